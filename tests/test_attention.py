"""The attention paths (jaxmp.models.attention): values and gradients against the reference
and a float64 NumPy attention, per dtype, causal and padded; the float32 softmax; the
fully-masked-row guarantee; which path "auto" picks; and the fused path's saved bytes."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmp.analysis.residuals import saved_residuals
from jaxmp.models import attention as attn
from jaxmp.models.attention import attention_core, cudnn_support, resolve_attention

B, T, H, HD = 2, 16, 2, 8
LENGTHS = np.array([16, 5], np.int32)  # sequence 1 is right-padded after 5 tokens

# Per-dtype tolerance of a path against the reference. Both paths accumulate the scores
# and the softmax in float32 and round the probabilities to the compute dtype, so they
# differ only by the order of float32 sums and the last rounding: float32 to ~1e-6;
# 16-bit results by a few units in the last place of the result (bfloat16: 2**-8
# relative, float16: 2**-11), i.e. atol = 4 ulp of the largest magnitude.
TOLERANCE = {"float32": dict(rtol=1e-5, atol=1e-6),
             "bfloat16": dict(rtol=2 ** -6, ulps=4 * 2 ** -8),
             "float16": dict(rtol=2 ** -9, ulps=4 * 2 ** -11)}


def runnable(implementation, dtype):
    """Whether the path runs here (cudnn only on a GPU; xla not for float16 on CPU)."""
    try:
        resolve_attention(implementation, dtype, HD)
    except ValueError:
        return False
    return True


def inputs(dtype, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.normal(size=(B, T, H, HD)) * scale, dtype) for _ in range(4)]


def np_attention(q, k, v, lengths=None):
    """float64 causal attention with right padding; padded query rows are 0."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = np.einsum("bqhd,bshd->bhqs", q, k) / np.sqrt(q.shape[-1])
    mask = np.tril(np.ones((T, T), bool))[None, None]
    if lengths is not None:
        valid = np.arange(T)[None, :] < lengths[:, None]
        mask = mask & valid[:, None, None, :] & valid[:, None, :, None]
    s = np.where(mask, s, -np.inf)
    m = np.max(s, -1, keepdims=True)
    e = np.where(mask, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
    d = e.sum(-1, keepdims=True)
    p = e / np.where(d > 0, d, 1.0)
    return np.einsum("bhqs,bshd->bqhd", p, v)


def value_and_grads(implementation, q, k, v, g, lengths):
    def loss(q, k, v):
        out = attention_core(q, k, v, implementation, lengths)
        return jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32))

    out = jax.jit(lambda q, k, v: attention_core(q, k, v, implementation, lengths))(q, k, v)
    return out, jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)


def assert_close(a, b, dtype):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    tol = TOLERANCE[dtype]
    atol = tol.get("atol", tol.get("ulps", 0) * float(np.abs(b).max()))
    np.testing.assert_allclose(a, b, rtol=tol["rtol"], atol=atol)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("padded", [False, True])
def test_reference_matches_float64_numpy(dtype, padded):
    q, k, v, _ = inputs(dtype)
    lengths = LENGTHS if padded else None
    out = attention_core(q, k, v, "reference", None if lengths is None else jnp.asarray(lengths))
    want = np_attention(q, k, v, lengths)
    # The probabilities are rounded to the compute dtype before the product with v.
    eps = {"float32": 1e-5, "bfloat16": 2 ** -6, "float16": 2 ** -9}[dtype]
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=eps, atol=eps * np.abs(want).max())


@pytest.mark.parametrize("implementation", ["xla", "cudnn"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("padded", [False, True])
def test_paths_agree_with_the_reference_in_values_and_gradients(implementation, dtype, padded):
    if not runnable(implementation, dtype):
        # What the user gets instead of a crash deep in XLA: one clear line.
        with pytest.raises(ValueError, match=f"model.attention='{implementation}' cannot run here"):
            resolve_attention(implementation, dtype, HD)
        pytest.skip(f"{implementation} does not run for {dtype} on {jax.default_backend()}")
    q, k, v, g = inputs(dtype, seed=1)
    lengths = jnp.asarray(LENGTHS) if padded else None
    ref_out, ref_grads = value_and_grads("reference", q, k, v, g, lengths)
    out, grads = value_and_grads(implementation, q, k, v, g, lengths)
    assert out.dtype == q.dtype and all(x.dtype == q.dtype for x in grads)
    assert_close(out, ref_out, dtype)
    for a, b in zip(grads, ref_grads):
        assert_close(a, b, dtype)


@pytest.mark.parametrize("implementation", ["reference", "xla", "cudnn"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_padded_rows_are_exactly_zero_with_zero_gradient(implementation, dtype):
    if not runnable(implementation, dtype):
        pytest.skip(f"{implementation} does not run for {dtype} on {jax.default_backend()}")
    # Keys at padded positions hold garbage: they must not leak into any valid row.
    q, k, v, g = inputs(dtype, seed=2)
    k = k.at[1, 5:].set(jnp.asarray(1e4 if dtype != "float16" else 6e4, dtype))
    lengths = jnp.asarray(LENGTHS)
    out, (dq, dk, dv) = value_and_grads(implementation, q, k, v, g, lengths)
    for x in (out, dq, dk, dv):
        assert np.isfinite(np.asarray(x, np.float32)).all()
        np.testing.assert_array_equal(np.asarray(x[1, 5:], np.float32), 0.0)
    # A sequence of length 0: every row is fully masked.
    out0, grads0 = value_and_grads(implementation, q, k, v, g, jnp.asarray([16, 0], jnp.int32))
    for x in (out0, *grads0):
        np.testing.assert_array_equal(np.asarray(x[1], np.float32), 0.0)
    want = np_attention(q, k, v, LENGTHS)
    eps = {"float32": 1e-5, "bfloat16": 2 ** -6, "float16": 2 ** -9}[dtype]
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=eps, atol=eps * np.abs(want).max())


@pytest.mark.parametrize("implementation", ["reference", "xla", "cudnn"])
def test_float16_scores_beyond_its_range_are_handled_in_float32(implementation):
    """q.k / sqrt(8) reaches ~2.5e5 > 65504 (float16's max): a float16 softmax would see
    inf and return NaN; the float32 island gives the float64 answer."""
    if not runnable(implementation, "float16"):
        pytest.skip(f"{implementation} does not run for float16 on {jax.default_backend()}")
    q, k, v, _ = inputs("float16", seed=3)
    q = (jnp.abs(q.astype(jnp.float32)) * 200).astype(jnp.float16)
    k = (jnp.abs(k.astype(jnp.float32)) * 200).astype(jnp.float16)
    scores = np.einsum("bqhd,bshd->bhqs", np.asarray(q, np.float64), np.asarray(k, np.float64)) / np.sqrt(HD)
    assert scores.max() > 65504
    out = attention_core(q, k, v, implementation)
    want = np_attention(q, k, v)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=2 ** -9, atol=2 ** -9 * np.abs(want).max())


def test_auto_resolves_to_what_runs_here():
    if jax.default_backend() == "cpu":  # no cuDNN: the lean reference path (2 B/score)
        assert resolve_attention("auto", jnp.bfloat16, HD) == "reference"
        assert resolve_attention("auto", jnp.float32, HD) == "reference"
        assert resolve_attention("auto", jnp.float16, HD) == "reference"
        ok, reason = cudnn_support(jnp.bfloat16, HD)
        assert not ok and "cpu" in reason
        with pytest.raises(ValueError, match=r"model.attention='cudnn' cannot run here: the compile "
                                             r"target is 'cpu'.*use 'auto'"):
            resolve_attention("cudnn", jnp.bfloat16, HD)
    else:  # on a GPU with cuDNN: the fused kernel for 16-bit compute, the reference for float32
        want = "cudnn" if cudnn_support(jnp.bfloat16, HD)[0] else "reference"
        assert resolve_attention("auto", jnp.bfloat16, HD) == want
        assert resolve_attention("auto", jnp.float32, HD) == "reference"
    with pytest.raises(ValueError, match="model.attention='flash'; allowed: reference, xla, cudnn, auto"):
        resolve_attention("flash", jnp.bfloat16, HD)
    with pytest.raises(ValueError, match="allowed: reference, xla, cudnn"):
        attention_core(*inputs("float32")[:3], "auto")


def test_fused_path_saves_q_k_v_output_and_float32_statistics_only():
    """Traced (not run) off a GPU: what the cuDNN kernel's backward pass keeps, by hand:
    its output [B, T, H, h] in bf16 and one float32 softmax statistic per query and head;
    q, k, v are the arguments. The reference keeps the [B, H, T, T] bf16 probabilities."""
    shape = jax.ShapeDtypeStruct((B, T, H, HD), jnp.bfloat16)

    def counted(implementation):
        ctx = attn.trace_cudnn_without_gpu() if implementation == "cudnn" and \
            jax.default_backend() != "gpu" else contextlib.nullcontext()
        with ctx:
            res = saved_residuals(lambda q, k, v: attention_core(q, k, v, implementation)
                                  .astype(jnp.float32).sum(), shape, shape, shape, argnums=(0, 1, 2))
        return sum(r.nbytes for r in res if r.kind == "computed")

    assert counted("cudnn") == B * T * H * HD * 2 + B * H * T * 4
    assert counted("reference") == B * H * T * T * 2
    # The xla path keeps more than the reference: mask, float32 scores and exponentials.
    assert counted("xla") > counted("reference")
