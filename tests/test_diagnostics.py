"""Underflow/overflow report (jaxmp.diagnostics) on gradients whose fate is known by arithmetic.

float16: largest finite 65504, smallest normal 2**-14 ~ 6.1e-5, smallest subnormal
2**-24 ~ 6.0e-8; a magnitude of 2**-25 or less rounds to 0 (ties to even), and 65520
or more rounds to inf.
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmp
from jaxmp import diagnostics as dg


def test_fp16_flush_to_zero_fixed_by_loss_scale():
    grads = {"w": jnp.array([1e-8, -1e-8, 1.0, 0.0], jnp.float32)}
    # Scale 1: 1e-8 < 2**-25 rounds to 0; 2 of the 3 non-zero values are lost.
    r = dg.underflow_report(grads, jnp.float16, 1.0)["w"]
    assert r == dg.LeafReport(nonzero=3, underflow=2 / 3, subnormal=0.0, overflow=0.0)
    # Scale 1024: 1.024e-5 lies between 2**-24 and 2**-14: kept, but subnormal.
    r = dg.underflow_report(grads, jnp.float16, 1024.0)["w"]
    assert r == dg.LeafReport(3, 0.0, 2 / 3, 0.0)
    # Scale 2**13: 8.2e-5 is a normal float16 (and 1.0 * 8192 fits).
    assert dg.underflow_report(grads, jnp.float16, 2.0 ** 13)["w"] == dg.LeafReport(3, 0.0, 0.0, 0.0)
    # Scale 2**16: the small ones are fine, but 1.0 * 65536 overflows.
    assert dg.underflow_report(grads, jnp.float16, 2.0 ** 16)["w"] == dg.LeafReport(3, 0.0, 0.0, 1 / 3)
    # bfloat16 has float32's exponent range: nothing lost at scale 1.
    assert dg.underflow_report(grads, "bf16")["w"] == dg.LeafReport(3, 0.0, 0.0, 0.0)


def test_fp16_overflow_and_rounding_boundaries():
    g = {"big": jnp.array([1e5, 3e4, 65519.0, 65520.0, -65520.0], jnp.float32)}
    # Scale 1: 1e5 and +-65520 round to inf; 65519 rounds down to 65504.
    assert dg.underflow_report(g, jnp.float16)["big"] == dg.LeafReport(5, 0.0, 0.0, 3 / 5)
    # Scale 2: 3e4 -> 6e4 is still finite, 65519 -> 131038 is not.
    assert dg.underflow_report(g, jnp.float16, 2.0)["big"] == dg.LeafReport(5, 0.0, 0.0, 4 / 5)
    # Scale 1/2 (LS-3: scales below 1): every value fits.
    assert dg.underflow_report(g, jnp.float16, 0.5)["big"] == dg.LeafReport(5, 0.0, 0.0, 0.0)

    tiny = {"t": jnp.array([2.0 ** -25, 2.0 ** -25 * (1 + 2 ** -10), 2.0 ** -24, 2.0 ** -14])}
    # 2**-25 ties to even (0); just above it rounds up to 2**-24; 2**-14 is normal.
    assert dg.underflow_report(tiny, jnp.float16)["t"] == dg.LeafReport(4, 1 / 4, 2 / 4, 0.0)


def test_nonfinite_true_gradients_count_as_overflow_and_ints_are_skipped():
    g = {"a": jnp.array([jnp.nan, jnp.inf, 1.0, 1e38]), "step": jnp.array(3, jnp.int32)}
    report = dg.underflow_report(g, jnp.bfloat16, 1024.0)  # 1e38 * 1024 overflows float32
    assert list(report) == ["a"]
    assert report["a"] == dg.LeafReport(4, 0.0, 0.0, 3 / 4)


def test_float8_target():
    # float8_e4m3fn: max 448, smallest subnormal 2**-9; no inf, overflow becomes NaN.
    g = {"x": jnp.array([500.0, 2.0 ** -11, 2.0 ** -8, 1.0])}
    assert dg.underflow_report(g, jnp.float8_e4m3fn)["x"] == dg.LeafReport(4, 1 / 4, 1 / 4, 1 / 4)


class Pair(NamedTuple):
    w: jax.Array
    b: jax.Array


def test_paths_of_nested_containers():
    grads = {
        "blocks": [{"attn": {"wq": jnp.full((2, 2), 1e-8)}}, {"attn": {"wq": jnp.ones(3)}}],
        "head": Pair(w=jnp.array([1e5, 1.0]), b=jnp.zeros(2)),
    }
    report = dg.underflow_report(grads, jnp.float16)
    assert list(report) == ["blocks/0/attn/wq", "blocks/1/attn/wq", "head/w", "head/b"]
    assert report["blocks/0/attn/wq"] == dg.LeafReport(4, 1.0, 0.0, 0.0)
    assert report["head/w"] == dg.LeafReport(2, 0.0, 0.0, 0.5)
    assert report["head/b"] == dg.LeafReport(0, 0.0, 0.0, 0.0)  # no non-zero: fractions 0


class Attn(nnx.Module):
    def __init__(self):
        self.wq = nnx.Param(jnp.ones((2, 3)))
        self.wo = nnx.Param(jnp.ones((3,)))


class Tiny(nnx.Module):
    def __init__(self):
        self.attn = Attn()
        self.norm_scale = nnx.Param(jnp.ones((3,)))


def test_nnx_state_gradients():
    model = Tiny()
    cq = jnp.array([[1e-8, 1e-8, 1e-8], [1.0, 1.0, 2.0 ** -20]])
    co = jnp.array([1e5, 0.0, 1.0])

    def loss(m):  # linear in the parameters: the gradient is the coefficient array
        return jnp.sum(m.attn.wq * cq) + jnp.sum(m.attn.wo * co) + jnp.sum(m.norm_scale)

    grads = nnx.grad(loss)(model)
    assert isinstance(grads, nnx.State)
    report = dg.underflow_report(grads, jnp.float16)
    assert set(report) == {"attn/wq", "attn/wo", "norm_scale"}
    assert report["attn/wq"] == dg.LeafReport(6, 3 / 6, 1 / 6, 0.0)  # 2**-20 is subnormal
    assert report["attn/wo"] == dg.LeafReport(2, 0.0, 0.0, 1 / 2)
    assert report["norm_scale"] == dg.LeafReport(3, 0.0, 0.0, 0.0)

    # A jaxmp loss-scale object is accepted for its scale.
    scaled = dg.underflow_report(grads, jnp.float16, jaxmp.StaticLossScale(2.0 ** 10))
    assert scaled["attn/wq"] == dg.LeafReport(6, 0.0, 3 / 6, 0.0)  # 1.02e-5: subnormal
    assert scaled["attn/wo"] == dg.LeafReport(2, 0.0, 0.0, 1 / 2)


def test_summarize_weights_by_nonzero_counts():
    report = {
        "a": dg.LeafReport(3, 2 / 3, 0.0, 0.0),
        "b": dg.LeafReport(1, 0.0, 1.0, 0.0),
        "c": dg.LeafReport(4, 0.25, 0.0, 0.5),
        "d": dg.LeafReport(0, 0.0, 0.0, 0.0),
    }
    # underflow (2 + 0 + 1) / 8, subnormal 1 / 8, overflow 2 / 8.
    total = dg.summarize(report)
    assert total.nonzero == 8
    assert total[1:] == pytest.approx((3 / 8, 1 / 8, 2 / 8), rel=1e-12)
    assert dg.summarize({}) == dg.LeafReport(0, 0.0, 0.0, 0.0)


def test_format_report_sorted_and_truncated():
    report = {
        "low": dg.LeafReport(10, 0.1, 0.0, 0.0),
        "high": dg.LeafReport(10, 0.9, 0.05, 0.0),
        "mid": dg.LeafReport(20, 0.5, 0.0, 0.25),
    }
    lines = dg.format_report(report).splitlines()
    leaf_lines = [l for l in lines if l.split()[0] in report]
    assert [l.split()[0] for l in leaf_lines] == ["high", "mid", "low"]
    assert leaf_lines[0].split()[1:] == ["10", "90.00%", "5.00%", "0.00%"]
    total = [l for l in lines if l.startswith("TOTAL")][0].split()
    # (9 + 10 + 1) / 40 underflow, 0.5 / 40 subnormal, 5 / 40 overflow.
    assert total[1:] == ["40", "50.00%", "1.25%", "12.50%"]

    short = dg.format_report(report, top=1).splitlines()
    assert [l.split()[0] for l in short if l.split()[0] in report] == ["high"]
    assert "... 2 more leaves" in short
    with pytest.raises(ValueError, match="top"):
        dg.format_report(report, top=0)


def test_format_report_of_a_real_report():
    grads = {"layer": {"bias": jnp.array([1e5, 1.0]), "kernel": jnp.array([1e-8, 1.0])}}
    lines = dg.format_report(dg.underflow_report(grads, jnp.float16)).splitlines()
    assert lines[2].split() == ["layer/kernel", "2", "50.00%", "0.00%", "0.00%"]
    assert lines[3].split() == ["layer/bias", "2", "0.00%", "0.00%", "50.00%"]
    assert lines[-1].split() == ["TOTAL", "4", "25.00%", "0.00%", "25.00%"]


@pytest.mark.parametrize("max_abs, headroom, expected", [
    (3.0, 8.0, 2048.0),        # 65504 / 8 / 3 = 2729.3 -> 2**11
    (3.0, 1.0, 16384.0),       # 65504 / 3 = 21834.7 -> 2**14
    (65504 / 8 / 1024, 8.0, 512.0),  # ratio exactly 1024: strictly below needs 2**9
    (1e5, 8.0, 0.0625),        # 8188 / 1e5 = 0.082 -> 2**-4 (a scale below 1)
    (1e-8, 1.0, 2.0 ** 42),    # 65504 / 1e-8 = 6.55e12 -> 2**42
])
def test_suggest_loss_scale_by_hand(max_abs, headroom, expected):
    grads = {"a": jnp.array([0.5 * max_abs, -max_abs], jnp.float32), "b": [jnp.zeros(2)]}
    s = dg.suggest_loss_scale(grads, jnp.float16, headroom=headroom)
    assert isinstance(s, float) and s == expected
    limit = 65504.0 / headroom
    assert float(np.float32(max_abs)) * s < limit <= float(np.float32(max_abs)) * 2 * s


def test_suggested_scale_does_not_overflow_but_double_does():
    grads = {"a": jnp.array([3.0, 1e-3]), "b": jnp.array([-1.5])}
    s = dg.suggest_loss_scale(grads, jnp.float16, headroom=1.0)
    assert s == 16384.0  # 3 * 16384 = 49152 < 65504; at 32768 only 3 overflows (1.5 * 32768 = 49152)
    assert dg.summarize(dg.underflow_report(grads, jnp.float16, s)).overflow == 0.0
    assert dg.summarize(dg.underflow_report(grads, jnp.float16, 2 * s)).overflow == 1 / 3
    assert dg.suggest_loss_scale(grads, jnp.bfloat16, headroom=1.0) == 2.0 ** 126


@pytest.mark.parametrize("grads, kwargs, match", [
    ({"a": jnp.zeros(3)}, {}, "all zero"),
    ({"a": jnp.array([1.0, jnp.nan])}, {}, "inf or NaN"),
    ({"a": jnp.array([1.0]), "b": jnp.array([-jnp.inf])}, {}, "inf or NaN"),
    ({"a": jnp.array([1.0])}, {"headroom": 0.5}, "headroom"),
    ({"a": jnp.array([1.0])}, {"dtype": "int8"}, "int8"),
    ({"n": jnp.arange(3)}, {}, "no floating"),
])
def test_suggest_loss_scale_errors(grads, kwargs, match):
    with pytest.raises(ValueError, match=match):
        dg.suggest_loss_scale(grads, **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"dtype": jnp.float16, "loss_scale": 0.0}, "loss_scale"),
    ({"dtype": jnp.float16, "loss_scale": float("inf")}, "loss_scale"),
    ({"dtype": jnp.float16, "loss_scale": jnp.ones(2)}, "scalar"),
    ({"dtype": "float64"}, "float64"),
    ({"dtype": "fp17"}, "fp17"),
])
def test_underflow_report_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dg.underflow_report({"a": jnp.ones(2)}, **kwargs)


def test_dtype_range():
    r = dg.DtypeRange.of("fp16")
    assert (r.max, r.min_normal, r.min_subnormal) == (65504.0, 2.0 ** -14, 2.0 ** -24)
    assert dg.DtypeRange.of(jnp.bfloat16).min_normal == float(np.finfo(np.float32).tiny)


# ----------------------------------------------------------------------------- FP8

from jaxmp.precision.fp8 import Recipe  # noqa: E402

N = 256 * 256


def _one_outlier():
    # 1.0 everywhere but x[0, 0] = 2**19. Under the outlier's scale 2**19 / 448, 1.0 becomes
    # 448 * 2**-19 = 0.875 * 2**-10, below half of E4M3's smallest subnormal 2**-9: zero.
    return jnp.ones((256, 256), jnp.float32).at[0, 0].set(2.0 ** 19)


@pytest.mark.parametrize("recipe, role, zeros", [
    (Recipe.tensorwise(), "x", N - 1),          # one scale: every 1.0 flushed
    (Recipe.rowwise(), "x", 255),               # the outlier's row
    (Recipe.blockwise(), "x", 127),             # its 1x128 tile
    (Recipe.rowwise(), "w", 255),               # a weight: its output column
    (Recipe.blockwise(), "w", 128 * 128 - 1),   # its 128x128 block
])
def test_block_scales_confine_an_outlier(recipe, role, zeros):
    r = dg.fp8_quantization(_one_outlier(), recipe, role)
    assert r.nonzero == N and r.underflow == zeros / N and r.saturated == 0.0 and r.subnormal == 0.0


def test_fp8_subnormal_and_saturation_counts_by_hand():
    # amax 448 -> scale 1: 2**-7 is an E4M3 subnormal (below 2**-6), 2**-11 rounds to 0.
    x = jnp.array([448.0, 2.0 ** -7, 2.0 ** -11, 1.0, 0.0], jnp.float32)
    assert dg.fp8_quantization(x, Recipe.tensorwise()) == dg.FP8Report(4, 1 / 4, 1 / 4, 0.0, pytest.approx(
        float(np.sqrt(2.0 ** -22 / (448.0 ** 2 + 2.0 ** -14 + 2.0 ** -22 + 1))), rel=1e-5))
    # A stale delayed amax of 100: 448 * 4.48 = 2007 rounds above 448 + 16 and is clipped.
    r = dg.fp8_quantization(x, Recipe.delayed(4), amax=100.0)
    assert r.saturated == 1 / 4
    # As gradients under tensorwise (E5M2, max 57344, smallest normal 2**-14).
    g = jnp.array([57344.0, 2.0 ** -15, 1.0], jnp.float32)
    r = dg.fp8_quantization(g, Recipe.tensorwise(), "g")
    assert (r.underflow, r.subnormal, r.saturated) == (0.0, 1 / 3, 0.0)


def test_fp8_report_per_module_from_a_forward_pass():
    from jaxmp.models import MoETransformer, ModelConfig

    config = ModelConfig(vocab_size=64, num_layers=1, d_model=32, num_heads=2, d_ff=64, max_len=8)
    model = MoETransformer(config, "mixed_bf16", rngs=nnx.Rngs(0))
    ops_seen = {}
    model(jnp.arange(16, dtype=jnp.int32).reshape(2, 8) % 64, operands=ops_seen)
    report = dg.fp8_report(ops_seen)
    assert set(report) == {f"blocks/0/attn/{w}" for w in ("wq", "wk", "wv", "wo")} | {
        f"blocks/0/mlp/{w}" for w in ("w_gate", "w_up", "w_down")} | {"head/kernel"}
    for name, by_recipe in report.items():
        assert list(by_recipe) == ["tensorwise", "rowwise", "blockwise"]
        for by_role in by_recipe.values():
            assert set(by_role) == {"x", "w"}
            assert by_role["x"].nonzero == int(np.count_nonzero(np.asarray(ops_seen[name]["x"], np.float32)))
    text = dg.format_fp8_report(report)
    assert "blocks/0/mlp/w_down" in text and "blockwise" in text


def test_fp8_quantization_rejects_bad_input():
    with pytest.raises(ValueError, match="role"):
        dg.fp8_quantization(jnp.ones(3), Recipe.rowwise(), "y")
    with pytest.raises(ValueError, match="Recipe"):
        dg.fp8_quantization(jnp.ones(3), "rowwise")
