"""Memory and communication accounting (jaxmp.analysis.accounting, python -m jaxmp.report --config)
against hand arithmetic: a matmul + tanh whose saved arrays are known, a 1-layer dense
model with d_model 8 counted by formula, hand-written HLO, and the tiny_moe acceptance
ratios from the command line."""
import contextlib
import io
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from _configs import load_config
from jaxmp.analysis import accounting, hlo, remat, report, residuals

ROOT = pathlib.Path(__file__).resolve().parents[1]
MIXED_MODES = ("mixed_bf16", "mixed_fp16", "bf16_moments", "bf16_allreduce", "topk_allreduce",
               "fp8_tensorwise", "fp8_delayed", "fp8_rowwise", "fp8_blockwise")


# ----------------------------------------------------------------------------- residuals


@settings(max_examples=20, deadline=None)
@given(b=st.integers(1, 6), d=st.integers(1, 6), h=st.integers(1, 6))
def test_residuals_of_matmul_tanh_by_hand(b, d, h):
    """loss = sum(tanh(x @ w)), differentiated in w only.

    tanh's derivative is (1 + y)(1 - y), so JAX keeps y and 1 - y, both [b, h]; the
    weight gradient needs x, which is an argument and not counted.
    """
    w, x = jax.ShapeDtypeStruct((d, h), jnp.float32), jax.ShapeDtypeStruct((b, d), jnp.float32)
    res = residuals.saved_residuals(lambda w, x: jnp.tanh(x @ w).sum(), w, x, argnums=0)
    computed = [r for r in res if r.kind == "computed"]
    assert sorted(r.shape for r in computed) == [(b, h), (b, h)]
    assert sum(r.nbytes for r in computed) == 2 * b * h * 4
    assert [r.shape for r in res if r.kind == "argument"] == [(b, d)]


@settings(max_examples=20, deadline=None)
@given(b=st.integers(1, 6), d=st.integers(1, 6), h=st.integers(1, 6))
def test_residuals_of_bf16_matmul_tanh_by_hand(b, d, h):
    """Same in bfloat16: the cast of x (computed, [b, d]) is kept instead of x, and y and
    1 - y are bfloat16; the weight's cast is not needed by the weight gradient."""
    def loss(w, x):
        y = jnp.tanh(x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16))
        return y.astype(jnp.float32).sum()

    w, x = jax.ShapeDtypeStruct((d, h), jnp.float32), jax.ShapeDtypeStruct((b, d), jnp.float32)
    res = residuals.saved_residuals(loss, w, x)
    computed = [r for r in res if r.kind == "computed"]
    assert {r.dtype for r in computed} == {"bfloat16"}
    assert sum(r.nbytes for r in computed) == 2 * (b * d + 2 * b * h)


def test_residuals_differentiate_only_argnums():
    """x * w: d/dw needs x (an argument), d/dx needs w; exp(w) is kept only when w is
    differentiated."""
    f = lambda w, x: jnp.sum(jnp.exp(w) * x)  # noqa: E731
    w = x = jax.ShapeDtypeStruct((3, 5), jnp.float32)
    only_x = residuals.saved_residuals(f, w, x, argnums=1)
    both = residuals.saved_residuals(f, w, x, argnums=(0, 1))
    # d/dx = exp(w): one computed [3, 5] array either way; d/dw adds nothing new (exp(w)
    # times x, with x an argument).
    assert sum(r.nbytes for r in only_x if r.kind == "computed") == 15 * 4
    assert sum(r.nbytes for r in both if r.kind == "computed") == 15 * 4
    assert not [r for r in only_x if r.kind == "argument"]
    assert [r.shape for r in both if r.kind == "argument"] == [(3, 5)]


@pytest.mark.parametrize("argnums", [2, -1, (), (0, 0.5)])
def test_saved_residuals_rejects_bad_argnums(argnums):
    w = jax.ShapeDtypeStruct((2,), jnp.float32)
    with pytest.raises(ValueError, match="argnums"):
        residuals.saved_residuals(lambda a, b: (a * b).sum(), w, w, argnums=argnums)


def test_residual_breakdown_groups_and_sorts():
    rows = [residuals.Residual((4,), "float32", 16, "computed", "output of exp from a.py:1"),
            residuals.Residual((4,), "float32", 16, "computed", "output of exp from a.py:1"),
            residuals.Residual((8,), "bfloat16", 16, "computed", "output of mul from b.py:2"),
            residuals.Residual((100,), "float32", 400, "argument", "from the argument w")]
    got = residuals.residual_breakdown(rows)
    assert got == [{"source": "output of exp from a.py:1", "dtype": "float32", "count": 2, "bytes": 32},
                   {"source": "output of mul from b.py:2", "dtype": "bfloat16", "count": 1, "bytes": 16}]
    assert residuals.residual_breakdown(rows, top=1) == got[:1]


# ----------------------------------------------------------------------------- HLO parsing

HLO = """HloModule jit_step, entry_computation_layout={(f32[64,32]{1,0})->f32[]}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], bf16[16]{0})) -> (s32[], bf16[16]{0}) {
  %p = (s32[], bf16[16]{0}) parameter(0)
  %g = bf16[16]{0} get-tuple-element(%p), index=1
  %ar.loop = bf16[16]{0} all-reduce(%g), channel_id=5, replica_groups={{0,1}}, to_apply=%add
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], bf16[16]{0}) tuple(%i, %ar.loop)
}

%cond (p: (s32[], bf16[16]{0})) -> pred[] {
  %p = (s32[], bf16[16]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (w: f32[64,32], v: bf16[8]) -> f32[] {
  %w = f32[64,32]{1,0} parameter(0)
  %v = bf16[8]{0} parameter(1)
  %loss = f32[] constant(0)
  %all-reduce.3 = (f32[32,64]{1,0}, bf16[8]{0}, f32[]) all-reduce(%w, /*index=1*/%v, %loss), channel_id=1, replica_groups={{0,1}}, to_apply=%add, metadata={op_name="jit(step)/transpose(jvp())/dot_general"}
  %rs = f32[32,32]{1,0} reduce-scatter(%w), channel_id=2, replica_groups={{0,1}}, dimensions={0}, to_apply=%add
  %ag = s32[2,5]{1,0} all-gather(%idx), channel_id=3, replica_groups={{0,1}}, dimensions={0}
  %idx = s32[1,5]{1,0} parameter(2)
  %ars = f32[64,32]{1,0} all-reduce-start(%w), channel_id=4, to_apply=%add
  %ard = f32[64,32]{1,0} all-reduce-done(%ars)
  %init = (s32[], bf16[16]{0}) tuple(%zero, %g0)
  %loop = (s32[], bf16[16]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %r = f32[] constant(0)
}
"""


def test_hlo_collectives_by_hand():
    found = {c.name: c for c in hlo.hlo_collectives(HLO)}
    assert set(found) == {"all-reduce.3", "rs", "ag", "ars", "ar.loop"}
    ar = found["all-reduce.3"]
    assert ar.op == "all-reduce" and ar.count == 1
    assert [(a.dtype, a.shape) for a in ar.operands] == [("f32", (64, 32)), ("bf16", (8,)), ("f32", ())]
    assert [a.nbytes for a in ar.operands] == [64 * 32 * 4, 8 * 2, 4]
    assert ar.op_name == "jit(step)/transpose(jvp())/dot_general"
    assert found["rs"].op == "reduce-scatter" and found["rs"].results[0].shape == (32, 32)
    assert found["ag"].op == "all-gather" and found["ag"].results[0].nbytes == 2 * 5 * 4
    assert found["ars"].op == "all-reduce" and found["ars"].count == 1  # the -done is skipped
    assert found["ar.loop"].count == 4 and found["ar.loop"].operands[0].nbytes == 16 * 2


def test_gradient_collective_bytes_by_hand():
    colls = hlo.hlo_collectives(HLO)
    # Gradient leaves of 2048 (= 64 x 32, seen transposed as [32, 64]) and 16 elements;
    # the scalar and the bf16[8] operand are not gradients.
    dense = accounting.gradient_collective_bytes(colls, [2048, 16])
    # all-reduce.3: 8192; reduce-scatter of the whole 8192-byte buffer; the async
    # all-reduce: 8192; the loop all-reduce: 4 trips x 32 bytes.
    assert dense == 8192 + 8192 + 8192 + 4 * 32
    # A top-k of 5 values per leaf: the all-gather of 5 indices counts its 2 x 5 result.
    assert accounting.gradient_collective_bytes(colls, [], sparse_sizes=[5]) == 40
    assert accounting.gradient_collective_bytes(colls, [7]) == 0


# A scan of length 3 as the partitioner's dump prints it: no known_trip_count yet; the
# counter starts at constant 1 here, so the loop runs 4 - 1 = 3 times; a loop of another
# shape (the condition a constant) is counted once.
HLO_SCAN = """HloModule jit_scan

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[16]{0})) -> (s32[], f32[16]{0}) {
  %p = (s32[], f32[16]{0}) parameter(0)
  %g = f32[16]{0} get-tuple-element(%p), index=1
  %rs.loop = f32[8]{0} reduce-scatter(%g), channel_id=5, replica_groups={{0,1}}, dimensions={0}, to_apply=%add
  %i = s32[] get-tuple-element(%p), index=0
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %pad = f32[16]{0} pad(%rs.loop)
  ROOT %t = (s32[], f32[16]{0}) tuple(%next, %pad)
}

%cond (p.1: (s32[], f32[16]{0})) -> pred[] {
  %p.1 = (s32[], f32[16]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

%body2 (q: (s32[], f32[16]{0})) -> (s32[], f32[16]{0}) {
  %q = (s32[], f32[16]{0}) parameter(0)
  %h = f32[16]{0} get-tuple-element(%q), index=1
  %ar.other = f32[16]{0} all-reduce(%h), channel_id=6, replica_groups={{0,1}}, to_apply=%add
  %j = s32[] get-tuple-element(%q), index=0
  ROOT %u = (s32[], f32[16]{0}) tuple(%j, %ar.other)
}

%cond2 (q.1: (s32[], f32[16]{0})) -> pred[] {
  %q.1 = (s32[], f32[16]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (w: f32[16]) -> f32[] {
  %w = f32[16]{0} parameter(0)
  %start = s32[] constant(1)
  %init = (s32[], f32[16]{0}) tuple(%start, %w)
  %scan = (s32[], f32[16]{0}) while(%init), condition=%cond, body=%body
  %other = (s32[], f32[16]{0}) while(%init), condition=%cond2, body=%body2
  ROOT %r = f32[] constant(0)
}
"""


def test_a_scans_counted_loop_is_counted_without_known_trip_count():
    found = {c.name: c for c in hlo.hlo_collectives(HLO_SCAN)}
    assert found["rs.loop"].count == 3 and found["ar.other"].count == 1
    assert accounting.gradient_collective_bytes(list(found.values()), [16]) == 3 * 16 * 4 + 16 * 4


def test_the_partitioners_hlo_is_read_under_a_persistent_compilation_cache():
    """The dump options are not in JAX's cache key: a second identical compile that hit
    the cache would write no partitioner dump (conftest sets the cache for the tests)."""
    assert os.environ.get("JAX_COMPILATION_CACHE_DIR")
    config = hand_config()
    first, second = (accounting.account_mode(config, "bf16_allreduce", 2) for _ in range(2))
    assert first["hlo_source"] == second["hlo_source"] == "HLO after SPMD partitioning"
    assert second["collective_bytes"] == first["collective_bytes"]
    assert second["collective_bytes"]["all-reduce"]["bf16"] > 0


HLO_DTYPES = {"pred": np.bool_, "s8": np.int8, "u8": np.uint8, "s16": np.int16, "f16": np.float16,
              "bf16": jnp.bfloat16, "s32": np.int32, "u32": np.uint32, "f32": np.float32,
              "s64": np.int64, "f64": np.float64, "c64": np.complex64}


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(sorted(HLO_DTYPES)),
                          st.lists(st.integers(0, 9), max_size=3)), min_size=1, max_size=4))
def test_tuple_all_reduce_bytes_match_numpy(arrays):
    """Any tuple of operands: bytes = sum of numpy nbytes of arrays of those shapes."""
    params = "\n".join(f"  %p{i} = {t}[{','.join(map(str, s))}] parameter({i})"
                       for i, (t, s) in enumerate(arrays))
    result = ", ".join(f"{t}[{','.join(map(str, s))}]" for t, s in arrays)
    ops = ", ".join(f"%p{i}" for i in range(len(arrays)))
    text = f"ENTRY %m () -> f32[] {{\n{params}\n  %x = ({result}) all-reduce({ops}), to_apply=%add\n}}\n"
    (c,) = hlo.hlo_collectives(text)
    want = sum(np.zeros(s, HLO_DTYPES[t]).nbytes for t, s in arrays)
    assert sum(a.nbytes for a in c.operands) == want == sum(a.nbytes for a in c.results)
    sizes = {int(np.prod(s)) for _, s in arrays}
    assert accounting.gradient_collective_bytes([c], sizes) == want


# ----------------------------------------------------------------------------- modes


def test_mode_config_applies_every_override_and_copies():
    base = load_config("tiny_moe")
    cfg = accounting.mode_config(base, "bf16_moments")
    assert cfg.precision.policy == "mixed_bf16; router: fp32; norm: fp32"
    assert (cfg.optim.mu_dtype, cfg.optim.nu_dtype) == ("bfloat16", "bfloat16")
    assert cfg.precision.grad_reduce_dtype == "float32" and cfg.precision.grad_compression == "none"
    assert base.optim.mu_dtype == "" and base.to_dict() == load_config("tiny_moe").to_dict()
    # Every mode sets the same keys, so no row inherits a knob from the config.
    assert len({frozenset(m) for m in accounting.MODES.values()}) == 1


def test_unknown_mode_is_rejected():
    with pytest.raises(ValueError, match="unknown precision mode 'fp8'.*fp32"):
        accounting.mode_config(load_config("tiny_moe"), "fp8")
    with pytest.raises(ValueError, match="unknown precision mode"):
        accounting.accounting_report(load_config("tiny_moe"), ["fp32", "fp8"])


# ----------------------------------------------------------------------------- the hand model

V, D, F, T, B = 16, 8, 16, 8, 8  # vocab, d_model, d_ff, seq_len, global batch (1 per device)
# embed + head, 3 norms, q/k/v/o, SwiGLU (gate, up, down).
HAND_PARAMS = 2 * V * D + 3 * D + 4 * D * D + 3 * D * F
HAND_LEAVES = [V * D, D * F, D, D, D] + [D * D] * 4 + [D * F] * 3  # element counts
assert HAND_PARAMS == sum(HAND_LEAVES) == 920


def hand_config():
    cfg = load_config("tiny_moe")
    cfg.model.update(dict(vocab_size=V, num_layers=1, d_model=D, num_heads=2, d_ff=F, max_len=T,
                          num_experts=0))
    cfg.data.seq_len = T
    cfg.train.batch_size = B
    return cfg


@pytest.fixture(scope="module")
def hand_report():
    return accounting.accounting_report(
        hand_config(), ["fp32", "bf16_moments", "bf16_allreduce", "topk_allreduce", "fp8_tensorwise",
                        "fp8_blockwise"], 8, breakdown=100)


def test_hand_model_memory_by_formula(hand_report):
    r = hand_report
    assert r["model"] == {"params": HAND_PARAMS, "active_params": HAND_PARAMS}
    for mode, row in r["modes"].items():
        assert row["params_bytes"] == row["grads_bytes"] == 4 * HAND_PARAMS, mode
        # Adam mu + nu per parameter, plus two int32 counts (Adam's, the lr schedule's).
        moments = 2 if mode == "bf16_moments" else 4
        assert row["opt_state_bytes"] == 2 * moments * HAND_PARAMS + 2 * 4, mode
        assert row["comm_state_bytes"] == (4 * HAND_PARAMS if mode == "topk_allreduce" else 0)
        assert row["total_bytes"] == sum(row[k] for k in accounting.MEMORY_KEYS)
    assert r["setup"]["micro_batch_per_device"] == 1


def test_hand_model_allreduce_bytes_by_formula(hand_report):
    m = hand_report["modes"]
    assert m["fp32"]["grad_allreduce_bytes"] == 4 * HAND_PARAMS
    assert m["bf16_allreduce"]["grad_allreduce_bytes"] == 2 * HAND_PARAMS
    # Top 30% of each leaf (round half to even; at least 1), bf16 values + int32
    # indices, gathered from all 8 devices.
    kept = sum(max(1, round(0.3 * n)) for n in HAND_LEAVES)
    assert kept == 38 + 38 + 2 + 2 + 2 + 4 * 19 + 3 * 38
    assert m["topk_allreduce"]["grad_allreduce_bytes"] == 8 * kept * (2 + 4)


def test_hand_model_mixed_activations_are_smaller(hand_report):
    m = hand_report["modes"]  # the last three share the mixed_bf16 policy
    assert 0 < m["bf16_moments"]["activation_bytes"] < m["fp32"]["activation_bytes"]
    assert (m["bf16_moments"]["activation_bytes"] == m["bf16_allreduce"]["activation_bytes"]
            == m["topk_allreduce"]["activation_bytes"])


def test_hand_model_fp8_matmuls_save_fp8_activations(hand_report):
    """Under an FP8 policy every weight matmul of attention and the FFN keeps its input as
    FP8 (1 byte per element) for the backward pass. Per device (micro-batch 1 x T): the q,
    k, v, gate and up projections read [T, D], the output projection [T, D] (heads x
    head_dim = D), the down projection [T, F]: 5 * 64 + 64 + 128 = 512 bytes in 7 arrays."""
    for mode in ("fp8_tensorwise", "fp8_blockwise"):
        rows = [b for b in hand_report["details"][mode]["breakdown"] if b["dtype"] == "float8_e4m3fn"]
        assert sum(b["count"] for b in rows) == 7 and sum(b["bytes"] for b in rows) == 6 * T * D + T * F == 512
        assert hand_report["modes"][mode]["params_bytes"] == 4 * HAND_PARAMS  # float32 masters
    assert not any(b["dtype"].startswith("float8") for b in hand_report["details"]["bf16_moments"]["breakdown"])


def test_bad_device_counts_are_rejected():
    with pytest.raises(ValueError, match="not divisible by the 3 devices"):
        accounting.account_mode(hand_config(), "fp32", 3)
    with pytest.raises(ValueError, match="num_devices"):
        accounting.data_mesh(0)
    with pytest.raises(ValueError, match="num_devices=4096"):
        accounting.data_mesh(4096)


# ----------------------------------------------------------------------------- the command line


@pytest.fixture(scope="module")
def tiny_cli(tmp_path_factory):
    """``python -m jaxmp.report --config configs/tiny_moe.py`` (its ``main``, in this
    process: the 8 CPU devices are the CLI's default; the bad-input tests below run it
    the same way): the JSON it writes and what it prints."""
    out = tmp_path_factory.mktemp("acct") / "tiny.json"
    # The reference attention (what model.attention=auto runs on CPU) keeps its
    # probabilities in the compute dtype, so the activation ratio below measures the
    # policy; XLA's jax.nn.dot_product_attention keeps float32 scores in every policy,
    # which no precision setting can halve (see test_attention.py for its saved bytes).
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = report.main(["--config", str(ROOT / "configs" / "tiny_moe.py"),
                          "--config.model.attention=reference", "--json", str(out)])
    assert rc == 0, stderr.getvalue()[-3000:]
    return json.loads(out.read_text()), stdout.getvalue()


# tiny_moe by formula: embed + head, final norm, 2 blocks of (2 norms + attention), a
# dense SwiGLU (d_ff 256), and a MoE layer (router, 4 routed + 1 shared expert of 64).
TINY_PARAMS = 2 * 257 * 64 + 64 + 2 * (2 * 64 + 4 * 64 * 64) + 3 * 64 * 256 + (64 * 4 + 5 * 3 * 64 * 64)


def test_cli_json_layout_and_params(tiny_cli):
    r, stdout = tiny_cli
    assert r["model"]["params"] == TINY_PARAMS == 176_832
    assert list(r["modes"]) == list(accounting.MODES)
    keys = {"policy", "params_bytes", "grads_bytes", "opt_state_bytes", "activation_bytes",
            "grad_allreduce_bytes", "total_bytes"}
    for row in r["modes"].values():
        assert keys <= set(row)
        assert all(isinstance(row[k], int) for k in keys - {"policy"})
    for mode in accounting.MODES:
        assert f"mode {mode}:" in stdout


def test_cli_acceptance_params_and_moments(tiny_cli):
    m = tiny_cli[0]["modes"]
    for mode in MIXED_MODES:  # float32 master weights only, no half-precision copies kept
        assert m[mode]["params_bytes"] == 4 * TINY_PARAMS, mode
    assert m["bf16_moments"]["opt_state_bytes"] / TINY_PARAMS <= 4.05
    assert m["bf16_moments"]["opt_state_bytes"] == 4 * TINY_PARAMS + 8


def test_cli_fp8_modes_move_gradients_as_mixed_bf16_does(tiny_cli):
    """No FP8 collective: FP8 weights and dispatch stay on their device (case FP8-4 is not
    applicable yet); the gradient all-reduce is mixed_bf16's float32 one."""
    m = tiny_cli[0]["modes"]
    for mode in ("fp8_tensorwise", "fp8_delayed", "fp8_rowwise", "fp8_blockwise"):
        assert m[mode]["grad_allreduce_bytes"] == m["mixed_bf16"]["grad_allreduce_bytes"] == 4 * TINY_PARAMS
        assert 0 < m[mode]["activation_bytes"] < m["fp32"]["activation_bytes"]


def test_cli_acceptance_activation_ratio(tiny_cli):
    m = tiny_cli[0]["modes"]
    assert m["mixed_bf16"]["activation_bytes"] / m["fp32"]["activation_bytes"] <= 0.55


def test_cli_acceptance_bf16_allreduce_is_half_of_fp32(tiny_cli):
    m = tiny_cli[0]["modes"]
    assert 2 * m["bf16_allreduce"]["grad_allreduce_bytes"] == m["fp32"]["grad_allreduce_bytes"]
    assert m["fp32"]["grad_allreduce_bytes"] == 4 * TINY_PARAMS  # every gradient, once, in float32


def test_cli_bf16_allreduce_is_two_bytes_per_param(tiny_cli):
    assert tiny_cli[0]["modes"]["bf16_allreduce"]["grad_allreduce_bytes"] == 2 * TINY_PARAMS


@pytest.mark.parametrize("argv, message", [
    (["--config", "configs/nope.py"], "does not exist"),
    (["--config", "configs/tiny_moe.py", "--modes", "fp32,fp8"], "unknown precision mode"),
    (["--config", "configs/tiny_moe.py", "--article"], "report of its own"),
    (["--config", "configs/tiny_moe.py", "--config.train.stesp=3"], "did you mean 'train.steps'"),
    (["--article", "--config.train.steps=3"], "--config PATH, which is not given"),
    (["--config", "configs/tiny_moe.py", "--devices", "0"], "--devices"),
])
def test_cli_bad_input(argv, message, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as e:
        report.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


# ----------------------------------------------------------------------------- attention x remat


def settings_config():
    cfg = hand_config()
    cfg.model.num_heads = 1  # head dimension 8: cuDNN's fused kernel needs a multiple of 8
    return cfg


@pytest.fixture(scope="module")
def hand_settings():
    return remat.activation_settings(settings_config(), "mixed_bf16", 8,
                                          attentions=("reference", "cudnn"),
                                          remats=("none", "attention", "full"), flops=True)


def test_settings_by_hand(hand_settings):
    rows = {(r["attention"], r["remat"]): r for r in hand_settings["rows"]}
    b, h, t, d = 1, 1, T, D  # one sequence per device, one head
    # State: float32 params and grads, two float32 Adam moments, two int32 counts.
    for r in rows.values():
        assert r["total_bytes"] - r["activation_bytes"] == 4 * HAND_PARAMS * 2 + 8 * HAND_PARAMS + 8
        assert r["traced_only"] == (r["attention"] == "cudnn")  # no cuDNN on this machine
    # One attention sublayer: the fused kernel keeps a float32 statistic per query and head
    # where the reference keeps the bf16 [B, H, T, T] probabilities; all else is the same.
    ref, fused = rows[("reference", "none")], rows[("cudnn", "none")]
    assert ref["attention_bytes_per_layer"] - fused["attention_bytes_per_layer"] == \
        b * h * t * t * 2 - b * h * t * 4
    assert ref["activation_bytes"] - fused["activation_bytes"] == b * h * t * t * 2 - b * h * t * 4
    # Full remat keeps the block's float32 input and what lies outside the block: token
    # indices (int32 [1, T, 1]), the final norm's float32 input and rsqrt, the head's bf16
    # input, the bf16 logits and the float32 logsumexp.
    outside = b * t * 4 + (b * t * d * 4 + b * t * 4) + b * t * d * 2 + b * t * V * 2 + b * t * 4
    for attention in ("reference", "cudnn"):
        assert rows[(attention, "full")]["activation_bytes"] == b * t * d * 4 + outside
        assert rows[(attention, "attention")]["activation_bytes"] < rows[(attention, "none")]["activation_bytes"]


def test_settings_recompute_flops(hand_settings):
    flops = {f["remat"]: f for f in hand_settings["flops"]}
    assert flops["none"]["recompute_flops"] == 0
    # Recomputing the reference core redoes at least its q k^T product: 2 B H T T h FLOPs.
    assert flops["attention"]["recompute_flops"] >= 2 * 1 * 1 * T * T * D
    assert flops["full"]["recompute_flops"] > flops["attention"]["recompute_flops"]
    for f in flops.values():
        assert f["recompute_flops"] == f["step_flops"] - flops["none"]["step_flops"]


def test_settings_reject_bad_names_before_work():
    with pytest.raises(ValueError, match="attention path 'flash'"):
        remat.activation_settings(hand_config(), attentions=("flash",))
    with pytest.raises(ValueError, match="remat setting 'some'"):
        remat.activation_settings(hand_config(), remats=("some",))


def test_stablehlo_dots_by_hand():
    text = """
    %0 = stablehlo.dot_general %arg0, %arg1, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<4x8xf8E4M3FN>, tensor<8x3xf8E4M3FN>) -> tensor<4x3xf32>
    %1 = stablehlo.dot_general %a, %b, batching_dims = [0] x [0], contracting_dims = [2] x [1] : (tensor<2x4x8xbf16>, tensor<2x8x3xbf16>) -> tensor<2x4x3xbf16>
    %2 = stablehlo.dot_general %c, %d, contracting_dims = [1] x [1] : (tensor<4x3xf8E5M2>, tensor<8x3xf8E4M3FN>) -> tensor<4x8xf32>
    %3 = stablehlo.dot_general %e, %f, contracting_dims = [1] x [0] : (tensor<4x8xf8E4M3FN>, tensor<8x3xbf16>) -> tensor<4x3xf32>
    """
    dots = hlo.stablehlo_dots(text)
    assert [(d.lhs, d.rhs, d.out) for d in dots] == [
        ("f8E4M3FN", "f8E4M3FN", "f32"), ("bf16", "bf16", "bf16"), ("f8E5M2", "f8E4M3FN", "f32"),
        ("f8E4M3FN", "bf16", "f32")]
    assert [d.fp8 for d in dots] == [True, False, True, False]
    assert hlo.count_fp8_dots(text) == (2, 2)


@pytest.mark.parametrize("remat_setting", ["none", "full"])
def test_fsdp_activations_are_counted_from_the_step_and_hold_no_gathered_weight(remat_setting):
    """Under fsdp the loss is traced as the step runs it (each module gathering its weights
    under the FSDP checkpoint policy): no residual is a whole compute-dtype weight, and
    remat=full keeps no more than remat=none."""
    from jaxmp.train.experiment import Experiment

    def residuals_of(remat_value):
        # Widths chosen so that no activation has a weight's shape (tokens per device 64,
        # dispatched rows 128; weights 48 x 80, 48 x 112, ...).
        config = load_config("tiny_moe", ["--config.parallel.strategy=fsdp",
                                          f"--config.model.remat={remat_value}",
                                          "--config.model.d_model=48", "--config.model.d_ff=80",
                                          "--config.model.d_expert=112", "--config.data.seq_len=32"])
        exp = Experiment.create(config, mesh=accounting.data_mesh(8))
        return exp, accounting.step_residuals(exp)

    exp, res = residuals_of(remat_setting)
    weights = {tuple(p.shape) for p in jax.tree.leaves(exp.abstract_state.params) if p.ndim >= 2}
    kept = [r for r in res if r.kind == "computed" and r.dtype == "bfloat16" and r.shape in weights]
    assert kept == [], kept
    if remat_setting == "full":
        none = sum(r.nbytes for r in residuals_of("none")[1] if r.kind == "computed")
        assert sum(r.nbytes for r in res if r.kind == "computed") < none


def test_cli_says_which_defaults_are_in_force(tiny_cli):
    """The report's device count and mixed_fp16's initial loss scale differ from the
    trainer's defaults: it says so, with the trainer's value (DynamicLossScale's 256)."""
    from jaxmp import DynamicLossScale

    out = tiny_cli[1]
    assert "note: 8 devices (--devices, default 8; train.py uses every local device" in out
    trainer_init = int(DynamicLossScale().loss_scale)
    assert trainer_init == 256
    assert (f"mixed_fp16 starts its dynamic loss scale at 2**15; the trainer's "
            f"precision.loss_scale=dynamic starts at {trainer_init}") in out
