"""Float32 islands (jaxmp.ops) against float64 NumPy references; cases OP-1, OP-2, OP-3."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jaxmp import ops
from jaxmp.analysis import residuals

LOW = [jnp.float32, jnp.bfloat16, jnp.float16]
# Relative error of one rounding to each dtype (2**-mantissa bits), with a 2x margin.
RTOL = {jnp.dtype(jnp.float32): 2e-6, jnp.dtype(jnp.bfloat16): 2 ** -7, jnp.dtype(jnp.float16): 2 ** -10}


def f64(x):
    """The exact float64 value of a (possibly low-precision) array."""
    return np.asarray(jnp.asarray(x).astype(jnp.float32), dtype=np.float64)


def ref_log_softmax(x, axis=-1):
    x = x - x.max(axis=axis, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=axis, keepdims=True))


def eqns(jaxpr):
    """All equations of a jaxpr, including those of nested (jit, custom_jvp, ...) jaxprs."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from eqns(sub)


def assert_math_in_f32(fn, *args, required=("reduce_sum", "exp")):
    """Every exp/log/reduction/division in ``fn``'s jaxpr has only float32 operands.

    ``required`` primitives must occur, so that the check cannot pass vacuously.
    """
    checked = {"exp", "log", "reduce_sum", "reduce_max", "div", "rsqrt"}
    seen = []
    for eqn in eqns(jax.make_jaxpr(fn)(*args).jaxpr):
        if eqn.primitive.name in checked:
            seen.append(eqn.primitive.name)
            dtypes = {str(v.aval.dtype) for v in eqn.invars}
            assert dtypes == {"float32"}, f"{eqn.primitive.name} runs in {dtypes}: {eqn}"
    assert set(required) <= set(seen), seen


# ---------------------------------------------------------------- norms


def test_op1_layer_norm_fp16_large_values():
    x = jnp.array([300.0, -300.0], jnp.float16)
    with np.errstate(over="ignore"):
        naive_var = np.mean(np.square(np.array([300.0, -300.0], np.float16)))
    assert np.isinf(naive_var)  # why the island is needed
    y = ops.layer_norm(x)
    assert y.dtype == jnp.float16
    np.testing.assert_allclose(f64(y), 300.0 / np.sqrt(90000.0 + 1e-5) * np.array([1, -1]), rtol=1e-3)


def test_op1_rms_norm_fp16_large_values():
    y = ops.rms_norm(jnp.array([300.0, 300.0], jnp.float16))
    assert y.dtype == jnp.float16
    np.testing.assert_allclose(f64(y), 300.0 / np.sqrt(90000.0 + 1e-6), rtol=1e-3)


@pytest.mark.parametrize("dtype", LOW, ids=lambda d: jnp.dtype(d).name)
def test_norms_match_float64(dtype):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 3, 16)) * 3 + 1, dtype)
    scale = jnp.asarray(rng.normal(size=16), jnp.float32)
    bias = jnp.asarray(rng.normal(size=16), jnp.float32)
    xd, sd, bd = f64(x), f64(scale), f64(bias)

    rms_ref = xd / np.sqrt(np.mean(xd ** 2, -1, keepdims=True) + 1e-6) * sd
    mu = xd.mean(-1, keepdims=True)
    ln_ref = (xd - mu) / np.sqrt(((xd - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * sd + bd

    rms, ln = ops.rms_norm(x, scale), ops.layer_norm(x, scale, bias)
    assert rms.dtype == ln.dtype == jnp.dtype(dtype)
    # The only error left is the final rounding to `dtype` (absolute near zero).
    tol = RTOL[jnp.dtype(dtype)]
    np.testing.assert_allclose(f64(rms), rms_ref, rtol=tol, atol=tol * np.abs(rms_ref).max())
    np.testing.assert_allclose(f64(ln), ln_ref, rtol=tol, atol=tol * np.abs(ln_ref).max())


@pytest.mark.parametrize("value, eps", [(1e-4, 1e-8), (1e-3, 1e-6)])
def test_rms_norm_eps_not_lost_in_fp16(value, eps):
    # float16: (1e-4)**2 = 1e-8 flushes to 0 and eps=1e-8 rounds to 0 as well, so a float16
    # computation gives 1e-4 * rsqrt(0) = inf; 1e-6 is a float16 subnormal (1.3% error).
    x = jnp.array([value, -value], jnp.float16)
    assert float(np.float16(eps)) != eps
    xd = f64(x)
    ref = xd / np.sqrt(np.mean(xd ** 2) + eps)
    np.testing.assert_allclose(f64(ops.rms_norm(x, eps=eps)), ref, rtol=2e-3)
    np.testing.assert_allclose(f64(ops.layer_norm(x, eps=eps)), ref, rtol=2e-3)


def test_norm_statistics_are_float32_in_backward_too():
    x = jnp.linspace(-3, 3, 8, dtype=jnp.float16)
    scale = jnp.ones(8, jnp.float32)
    assert_math_in_f32(jax.grad(lambda x: jnp.sum(ops.layer_norm(x, scale).astype(jnp.float32) ** 3)), x,
                      required=("reduce_sum", "rsqrt"))


def test_zero_input_gives_zero_not_nan():
    z = jnp.zeros((2, 4), jnp.float16)
    np.testing.assert_array_equal(f64(ops.rms_norm(z)), 0.0)
    np.testing.assert_array_equal(f64(ops.layer_norm(z)), 0.0)


@pytest.mark.parametrize("call, match", [
    (lambda: ops.rms_norm(jnp.ones((2, 4)), jnp.ones(3)), r"\(4,\).*\(3,\)"),
    (lambda: ops.layer_norm(jnp.ones((2, 4)), bias=jnp.ones((4, 1))), r"bias"),
    (lambda: ops.rms_norm(jnp.ones(4), eps=-1.0), r"eps"),
    (lambda: ops.rms_norm(jnp.ones(4, jnp.int32)), r"floating"),
])
def test_norm_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------- softmax family


def test_op2_log_softmax_wide_vocab_fp16():
    v = 70000
    x = jnp.zeros(v, jnp.float16).at[0].set(2.0)
    xd = np.zeros(v)
    xd[0] = 2.0
    p = np.exp(xd - xd.max()) / np.exp(xd - xd.max()).sum()
    grad_ref = 1.0 - v * p  # d/dx sum_i log_softmax(x)_i = 1 - V * softmax(x)
    assert grad_ref[0] == pytest.approx(-6.388, abs=1e-3) and grad_ref[1] == pytest.approx(9.126e-5, rel=1e-3)

    loss = lambda x: jnp.sum(ops.log_softmax(x, dtype=jnp.float32))
    value, grad = jax.value_and_grad(loss)(x)
    assert grad.dtype == jnp.float16
    assert np.isfinite(float(value)) and np.all(np.isfinite(f64(grad)))
    np.testing.assert_allclose(float(value), ref_log_softmax(xd).sum(), rtol=1e-6)
    np.testing.assert_allclose(f64(grad), grad_ref, rtol=2e-3)

    # Default output dtype: float16 values, and a float16 cotangent of ones, still fine.
    y, vjp = jax.vjp(ops.log_softmax, x)
    assert y.dtype == jnp.float16
    np.testing.assert_allclose(f64(y), ref_log_softmax(xd), rtol=1e-3)
    np.testing.assert_allclose(f64(vjp(jnp.ones(v, jnp.float16))[0]), grad_ref, rtol=2e-3)

    # The same loss through a float16 log-softmax: sum(g) = 70000 overflows in the backward.
    naive = jax.grad(lambda x: jnp.sum(jax.nn.log_softmax(x).astype(jnp.float32)))(x)
    assert not np.all(np.isfinite(f64(naive)))


def test_op2_backward_runs_in_float32():
    x = jnp.zeros(16, jnp.float16)
    assert_math_in_f32(jax.grad(lambda x: jnp.sum(ops.log_softmax(x)).astype(jnp.float32)), x)
    assert_math_in_f32(jax.grad(lambda x: jnp.sum(ops.softmax(x) * x).astype(jnp.float32)), x)
    mask = jnp.arange(16) < 9
    assert_math_in_f32(
        jax.grad(lambda x: jnp.sum(ops.masked_softmax(x, mask) * x).astype(jnp.float32)), x)
    labels = jnp.zeros((2,), jnp.int32)
    assert_math_in_f32(jax.grad(lambda x: ops.cross_entropy(x, labels)), x.reshape(2, 8))


def test_op2_cross_entropy_grad_wide_vocab_fp16():
    v = 70000
    logits = jnp.zeros((1, v), jnp.float16).at[0, 0].set(2.0)
    labels = jnp.array([3])
    xd = f64(logits)[0]
    p = np.exp(xd) / np.exp(xd).sum()
    loss, grad = jax.value_and_grad(ops.cross_entropy)(logits, labels)
    np.testing.assert_allclose(float(loss), -np.log(p[3]), rtol=1e-6)
    grad_ref = p.copy()
    grad_ref[3] -= 1.0
    # Entries ~1.4e-5 are float16 subnormals (spacing 2**-24): absolute tolerance.
    np.testing.assert_allclose(f64(grad)[0], grad_ref, rtol=1e-3, atol=2 ** -24)


def softmax_rows():
    return st.sampled_from([jnp.float16, jnp.bfloat16]).flatmap(lambda dt: st.tuples(
        st.just(dt),
        hnp.arrays(np.float32, st.sampled_from([(3, 7), (2, 33)]),
                   elements=st.floats(-6e4, 6e4, width=32)),
    ))


@settings(max_examples=25, deadline=None)
@given(softmax_rows(), st.booleans())
def test_softmax_sums_to_one_and_matches_float64(case, log):
    dtype, values = case
    x = jnp.asarray(values, dtype)
    xd = f64(x)
    ref = ref_log_softmax(xd) if log else np.exp(ref_log_softmax(xd))
    fn = ops.log_softmax if log else ops.softmax
    y32, y = fn(x, dtype=jnp.float32), fn(x)
    assert y32.dtype == jnp.float32 and y.dtype == jnp.dtype(dtype)
    if log:
        np.testing.assert_allclose(f64(y32), ref, rtol=1e-6, atol=1e-3)  # atol: |x| up to 6e4
    else:
        np.testing.assert_allclose(f64(y32).sum(-1), 1.0, rtol=2e-6)
        np.testing.assert_allclose(f64(y32), ref, rtol=1e-5, atol=1e-7)
        tol = RTOL[jnp.dtype(dtype)]
        np.testing.assert_allclose(f64(y), ref, rtol=tol, atol=1e-7)
        np.testing.assert_allclose(f64(y).sum(-1), 1.0, rtol=values.shape[-1] * tol)


def test_softmax_where_matches_masked_reference():
    x = jnp.array([[1.0, 2.0, 3.0, 4.0]], jnp.bfloat16)
    where = jnp.array([True, False, True, False])
    e = np.exp(np.array([1.0, 3.0]))
    np.testing.assert_allclose(f64(ops.softmax(x, where=where, dtype=jnp.float32)),
                               [[e[0] / e.sum(), 0.0, e[1] / e.sum(), 0.0]], rtol=1e-6)


# ---------------------------------------------------------------- masked attention softmax


def test_masked_softmax_fp16_forward_backward():
    # Row 0: partly masked, masked slots hold garbage (+6e4, -inf) that must not leak.
    # Row 1: fully masked: zeros, zero gradient, no NaN.
    scores = jnp.array([[1.0, 60000.0, 3.0, -jnp.inf],
                        [5.0, -jnp.inf, 60000.0, 0.0]], jnp.float16)
    mask = jnp.array([[True, False, True, False],
                      [False, False, False, False]])
    w = jnp.array([[1.0, 2.0, -1.0, 4.0], [1.0, 1.0, 1.0, 1.0]], jnp.float16)
    p, vjp = jax.vjp(lambda s: ops.masked_softmax(s, mask), scores)
    (g,) = vjp(w)
    assert p.dtype == jnp.float16 and g.dtype == jnp.float16

    e = np.exp(np.array([1.0, 3.0]))
    q = e / e.sum()
    p_ref = np.array([[q[0], 0.0, q[1], 0.0], [0.0, 0.0, 0.0, 0.0]])
    np.testing.assert_allclose(f64(p), p_ref, rtol=1e-3)
    assert np.all(f64(p)[~np.asarray(mask)] == 0.0)
    # d/ds_i sum_j w_j p_j = p_i (w_i - sum_j w_j p_j) on attended slots, 0 elsewhere.
    wd = f64(w)[0]
    mean_w = q[0] * wd[0] + q[1] * wd[2]
    g_ref = np.array([[q[0] * (wd[0] - mean_w), 0.0, q[1] * (wd[2] - mean_w), 0.0], [0.0] * 4])
    assert np.all(np.isfinite(f64(g)))
    np.testing.assert_allclose(f64(g), g_ref, rtol=2e-3, atol=1e-6)


def test_masked_softmax_broadcast_causal():
    scores = jnp.zeros((2, 3, 3), jnp.bfloat16)  # [heads, q, k]
    p = ops.masked_softmax(scores, ops.causal_mask(3), dtype=jnp.float32)
    row = np.array([[1, 0, 0], [0.5, 0.5, 0], [1 / 3, 1 / 3, 1 / 3]])
    np.testing.assert_allclose(np.asarray(p), np.broadcast_to(row, (2, 3, 3)), rtol=1e-6)


@pytest.mark.parametrize("mask, match", [
    (jnp.ones((3,), jnp.float32), "boolean"),
    (jnp.ones((2,), bool), r"\(2,\).*\(4, 3\)"),
    (jnp.ones((2, 4, 3), bool), "enlarge"),
])
def test_masked_softmax_bad_mask(mask, match):
    with pytest.raises(ValueError, match=match):
        ops.masked_softmax(jnp.zeros((4, 3)), mask)


@pytest.mark.parametrize("q, kv, expected", [
    (3, None, [[1, 0, 0], [1, 1, 0], [1, 1, 1]]),
    (2, 4, [[1, 1, 1, 0], [1, 1, 1, 1]]),
    (1, 3, [[1, 1, 1]]),
])
def test_causal_mask(q, kv, expected):
    m = ops.causal_mask(q, kv)
    assert m.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(m), np.array(expected, bool))


@pytest.mark.parametrize("q, kv", [(0, 3), (2, -1), (2.0, 3), (True, 2)])
def test_causal_mask_bad_lengths(q, kv):
    with pytest.raises(ValueError, match="positive integer"):
        ops.causal_mask(q, kv)


# ---------------------------------------------------------------- cross-entropy


@pytest.mark.parametrize("dtype", LOW, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("mask_kind", ["none", "bool", "weights"])
def test_cross_entropy_matches_float64(dtype, mask_kind):
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(2, 3, 7)) * 4, dtype)
    labels = jnp.asarray(rng.integers(0, 7, size=(2, 3)), jnp.int32)
    nll = -np.take_along_axis(ref_log_softmax(f64(logits)), np.asarray(labels)[..., None], -1)[..., 0]
    if mask_kind == "none":
        mask, ref = None, nll.mean()
    elif mask_kind == "bool":
        mb = np.array([[True, False, True], [False, False, True]])
        mask, ref = jnp.asarray(mb), nll[mb].sum() / 3
    else:
        wt = np.array([[0.5, 0.0, 2.0], [1.0, 0.0, 0.25]])
        mask, ref = jnp.asarray(wt, jnp.float32), (wt * nll).sum() / wt.sum()
    out = ops.cross_entropy(logits, labels, mask)
    assert out.dtype == jnp.float32 and out.shape == ()
    np.testing.assert_allclose(float(out), ref, rtol=1e-5)


def test_cross_entropy_all_masked_is_zero_even_with_nonfinite_logits():
    logits = jnp.array([[jnp.nan, 1.0], [jnp.inf, 0.0]], jnp.float16)
    out, grad = jax.value_and_grad(ops.cross_entropy)(logits, jnp.array([0, 1]), jnp.zeros(2, bool))
    assert float(out) == 0.0
    assert np.all(f64(grad) == 0.0)


def test_cross_entropy_weights_below_one_divide_by_one():
    # max(sum(mask), 1): a total weight of 0.5 divides by 1.
    logits = jnp.zeros((1, 4))
    out = ops.cross_entropy(logits, jnp.array([2]), jnp.array([0.5]))
    np.testing.assert_allclose(float(out), 0.5 * np.log(4.0), rtol=1e-6)


@pytest.mark.parametrize("logits, labels, mask, match", [
    (jnp.zeros((2, 3, 5)), jnp.zeros((2, 4), jnp.int32), None, r"\(2, 4\).*\(2, 3, 5\).*\(2, 3\)"),
    (jnp.zeros((2, 5)), jnp.zeros((2,), jnp.int32), jnp.ones((3,), bool), r"mask shape \(3,\).*\(2,\)"),
    (jnp.zeros((2, 5)), jnp.zeros((2,), jnp.float32), None, "integer"),
    (jnp.zeros((2, 5), jnp.int32), jnp.zeros((2,), jnp.int32), None, "floating"),
])
def test_cross_entropy_bad_input(logits, labels, mask, match):
    with pytest.raises(ValueError, match=match):
        ops.cross_entropy(logits, labels, mask)


# ---------------------------------------------------------------- router


def test_op3_router_logits_float32_island():
    x = jnp.array([[1.0]], jnp.float32)
    w = jnp.array([[2.000, 2.004, 1.0, 0.0]], jnp.float32)
    logits = ops.router_logits(x, w)
    assert logits.dtype == jnp.float32 and logits.shape == (1, 4)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(w))
    assert int(jnp.argmax(logits[0])) == 1
    wd = f64(w)[0]
    gate_ref = np.exp(wd[1]) / np.exp(wd).sum()
    assert gate_ref == pytest.approx(0.400, abs=1e-3)
    np.testing.assert_allclose(float(ops.softmax(logits)[0, 1]), gate_ref, rtol=1e-6)

    # bfloat16 activations, float32 master weights: the island still picks expert 1.
    assert int(jnp.argmax(ops.router_logits(x.astype(jnp.bfloat16), w)[0])) == 1
    # A bfloat16 router: 2.004 rounds to 2.0 and the tie goes to expert 0.
    bf16 = x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)
    assert float(bf16[0, 1]) == 2.0 and int(jnp.argmax(bf16[0])) == 0


def test_router_logits_uses_highest_precision():
    jaxpr = jax.make_jaxpr(ops.router_logits)(jnp.ones((3, 4), jnp.bfloat16), jnp.ones((4, 2)))
    dots = [e for e in eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
    assert len(dots) == 1
    assert {str(v.aval.dtype) for v in dots[0].invars} == {"float32"}
    assert jax.lax.Precision.HIGHEST in tuple(dots[0].params["precision"])


@pytest.mark.parametrize("x, w", [
    (jnp.ones((2, 3)), jnp.ones((4, 2))),
    (jnp.ones((2, 3)), jnp.ones((3,))),
])
def test_router_logits_bad_shapes(x, w):
    with pytest.raises(ValueError, match=r"shape"):
        ops.router_logits(x, w)


# ---------------------------------------------------------------- custom VJPs: gradients


def fd_grads(f, *args, h=1e-6):
    """Central-difference gradients of a scalar float64 NumPy function, one per argument."""
    args = [np.array(a, np.float64) for a in args]
    grads = []
    for i, a in enumerate(args):
        g = np.zeros_like(a)
        for idx in np.ndindex(a.shape):
            plus, minus = [x.copy() for x in args], [x.copy() for x in args]
            plus[i][idx] += h
            minus[i][idx] -= h
            g[idx] = (f(*plus) - f(*minus)) / (2 * h)
        grads.append(g)
    return grads


def np_rms_norm(x, s=None, eps=1e-6):
    y = x / np.sqrt(np.mean(x ** 2, -1, keepdims=True) + eps)
    return y if s is None else y * s


def np_layer_norm(x, s=None, b=None, eps=1e-5):
    c = x - x.mean(-1, keepdims=True)
    y = c / np.sqrt((c ** 2).mean(-1, keepdims=True) + eps)
    y = y if s is None else y * s
    return y if b is None else y + b


def np_masked_softmax(x, mask, axis=-1):
    z = np.where(mask, x, -np.inf)
    m = np.max(z, axis=axis, keepdims=True)
    e = np.where(mask, np.exp(z - np.where(np.isfinite(m), m, 0.0)), 0.0)
    d = e.sum(axis=axis, keepdims=True)
    return e / np.where(d > 0, d, 1.0)


def assert_close_to(got, ref, tol):
    """Elementwise within ``tol`` relative, or ``tol`` of the largest reference entry."""
    np.testing.assert_allclose(f64(got), ref, rtol=tol, atol=tol * np.abs(ref).max())


# Tolerance on gradients: a few roundings to the dtype (the cotangent is cast back to it).
GRAD_TOL = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 2 ** -6, jnp.dtype(jnp.float16): 2 ** -9}


@pytest.mark.parametrize("dtype", LOW, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("params", [True, False], ids=["params", "no_params"])
def test_norm_gradients_match_float64_finite_differences(dtype, norm, params):
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(2, 3, 6)) * 2 + 0.5, dtype)
    w = rng.normal(size=(2, 3, 6))
    if norm == "rms":
        fn, ref_fn, num_params = ops.rms_norm, np_rms_norm, 1
    else:
        fn, ref_fn, num_params = ops.layer_norm, np_layer_norm, 2
    inputs = [x] + [jnp.asarray(rng.normal(size=6), jnp.float32) for _ in range(num_params if params else 0)]

    def loss(*a):
        return jnp.sum(jnp.asarray(w, jnp.float32) * fn(*a, dtype=jnp.float32))

    got = jax.grad(loss, argnums=tuple(range(len(inputs))))(*inputs)
    ref = fd_grads(lambda *a: np.sum(w * ref_fn(*a)), *map(f64, inputs))
    assert got[0].dtype == jnp.dtype(dtype)
    for g, r in zip(got, ref):
        assert_close_to(g, r, GRAD_TOL[jnp.dtype(dtype)])
    for g in got[1:]:  # parameter gradients in the parameter's dtype, summed over [2, 3]
        assert g.dtype == jnp.float32 and g.shape == (6,)


@pytest.mark.parametrize("dtype", LOW, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("out", [None, jnp.float32], ids=["out_in_dtype", "out_float32"])
def test_softmax_gradients_match_float64_finite_differences(dtype, out):
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(3, 2, 5)) * 3, dtype)
    w = rng.normal(size=(3, 2, 5))
    # A causal-like mask with one fully masked row ([0, 1]) and garbage under the mask.
    mask = np.tril(np.ones((2, 5), bool), k=2)[None].repeat(3, 0)
    mask[0, 1] = False
    garbage = jnp.where(jnp.asarray(mask), x, jnp.asarray(6e4, dtype))
    # Rounding p to the output dtype before the backward adds one rounding of p.
    tol = GRAD_TOL[jnp.dtype(out or dtype)] + GRAD_TOL[jnp.dtype(dtype)]
    cases = [
        (lambda x: ops.softmax(x, axis=-1, dtype=out), x,
         lambda x: np_masked_softmax(x, np.ones(x.shape, bool), -1)),
        (lambda x: ops.softmax(x, axis=(0, 2), dtype=out), x,
         lambda x: np_masked_softmax(x, np.ones(x.shape, bool), (0, 2))),
        (lambda x: ops.masked_softmax(x, jnp.asarray(mask), dtype=out), garbage,
         lambda x: np_masked_softmax(x, mask, -1)),
    ]
    for fn, arg, ref_fn in cases:
        g = jax.grad(lambda a: jnp.sum(jnp.asarray(w, jnp.float32) * fn(a).astype(jnp.float32)))(arg)
        (ref,) = fd_grads(lambda a: np.sum(w * ref_fn(a)), f64(arg))
        assert g.dtype == jnp.dtype(dtype) and np.all(np.isfinite(f64(g)))
        assert_close_to(g, ref, tol)
    masked_grad = jax.grad(lambda a: jnp.sum(ops.masked_softmax(a, jnp.asarray(mask), dtype=out)
                                             .astype(jnp.float32) * w))(garbage)
    assert np.all(f64(masked_grad)[~mask] == 0.0)  # exactly 0, garbage or not


@pytest.mark.parametrize("dtype", LOW, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("mask_kind", ["none", "bool", "weights"])
def test_cross_entropy_gradients_match_float64_finite_differences(dtype, mask_kind):
    rng = np.random.default_rng(5)
    logits = jnp.asarray(rng.normal(size=(2, 3, 7)) * 3, dtype)
    labels = rng.integers(0, 7, size=(2, 3))
    weights = {"none": np.ones((2, 3)), "bool": np.array([[1, 0, 1], [0, 1, 1]], np.float64),
               "weights": np.array([[0.5, 0.0, 2.0], [1.0, 0.25, 0.0]])}[mask_kind]
    mask = {"none": None, "bool": jnp.asarray(weights, bool),
            "weights": jnp.asarray(weights, jnp.float32)}[mask_kind]

    def ref(z):
        nll = -np.take_along_axis(ref_log_softmax(z), labels[..., None], -1)[..., 0]
        return np.sum(weights * nll) / max(weights.sum(), 1.0)

    g = jax.grad(ops.cross_entropy)(logits, jnp.asarray(labels, jnp.int32), mask)
    (want,) = fd_grads(ref, f64(logits))
    assert g.dtype == jnp.dtype(dtype)
    assert_close_to(g, want, GRAD_TOL[jnp.dtype(dtype)])
    assert np.all(f64(g)[weights == 0] == 0.0)


def test_custom_vjps_pass_check_grads_in_float32():
    from jax.test_util import check_grads

    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.normal(size=(3, 5)), jnp.float32)
    s, b = jnp.asarray(rng.normal(size=5), jnp.float32), jnp.asarray(rng.normal(size=5), jnp.float32)
    labels = jnp.asarray([0, 4, 2])
    mask = ops.causal_mask(3, 5)
    kw = dict(order=1, modes=("rev",), atol=1e-2, rtol=1e-2)
    check_grads(lambda x, s: ops.rms_norm(x, s), (x, s), **kw)
    check_grads(lambda x, s, b: ops.layer_norm(x, s, b), (x, s, b), **kw)
    check_grads(lambda x: ops.softmax(x, axis=-1), (x,), **kw)
    check_grads(lambda x: ops.masked_softmax(x, mask), (x,), **kw)
    check_grads(lambda x: ops.cross_entropy(x, labels), (x,), **kw)


def test_norm_statistics_are_float32_in_rms_backward_too():
    x = jnp.linspace(-3, 3, 8, dtype=jnp.float16)
    scale = jnp.ones(8, jnp.float32)
    assert_math_in_f32(jax.grad(lambda x: jnp.sum(ops.rms_norm(x, scale).astype(jnp.float32) ** 3)), x,
                      required=("reduce_sum", "rsqrt"))


@pytest.mark.parametrize("call, match", [
    (lambda: ops.softmax(jnp.ones((2, 3)), axis=2), "axis=2"),
    (lambda: ops.masked_softmax(jnp.ones((2, 3)), jnp.ones((2, 3), bool), axis=()), "axis"),
    (lambda: ops.rms_norm(jnp.ones(4), dtype=jnp.int32), "dtype"),
    (lambda: ops.layer_norm(jnp.ones(4), dtype=jnp.int8), "dtype"),
])
def test_bad_axis_or_dtype(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------- custom VJPs: what is saved


def computed_residuals(fn, *args, argnums=0):
    """(shape, dtype) of the arrays ``fn``'s forward pass keeps for its backward pass,
    arguments excluded (jaxmp.analysis.accounting's definition of activation memory)."""
    res = residuals.saved_residuals(fn, *args, argnums=argnums)
    return sorted((r.shape, r.dtype) for r in res if r.kind == "computed")


def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def lin(y):
    """A loss linear in y (fixed NumPy weights: a constant), so it keeps nothing itself."""
    w = np.linspace(-1.0, 1.0, y.size, dtype=np.float32).reshape(y.shape)
    return jnp.sum(y.astype(jnp.float32) * w)


def test_norms_save_only_x_and_row_statistics():
    x, s, b = sds((4, 16), jnp.bfloat16), sds((16,), jnp.float32), sds((16,), jnp.float32)
    # x is an argument here: only the float32 per-row rsqrt (and mean) is computed and kept.
    assert computed_residuals(lambda x, s: lin(ops.rms_norm(x, s, dtype=jnp.float32)), x, s,
                              argnums=(0, 1)) == [((4, 1), "float32")]
    assert computed_residuals(lambda x, s, b: lin(ops.layer_norm(x, s, b)), x, s, b,
                              argnums=(0, 1, 2)) == [((4, 1), "float32")] * 2
    # A computed bfloat16 x is kept as it is: no float32 copy of it.
    upcast_first = computed_residuals(lambda a: lin(ops.rms_norm(a.astype(jnp.bfloat16) * 2, dtype=jnp.float32)),
                                      sds((4, 16), jnp.float32))
    assert upcast_first == [((4, 1), "float32"), ((4, 16), "bfloat16")]


@pytest.mark.parametrize("dtype, out", [(jnp.bfloat16, None), (jnp.float16, jnp.float32),
                                        (jnp.float32, jnp.bfloat16)])
def test_softmaxes_save_only_the_probabilities(dtype, out):
    x = sds((2, 3, 5), dtype)
    out_name = jnp.dtype(out or dtype).name
    assert computed_residuals(lambda x: lin(ops.softmax(x, dtype=out)), x) == [((2, 3, 5), out_name)]
    # No float32 exponentials, no broadcast boolean mask.
    assert computed_residuals(lambda x: lin(ops.masked_softmax(x, ops.causal_mask(3, 5), dtype=out)), x) \
        == [((2, 3, 5), out_name)]


def test_cross_entropy_saves_logits_as_given_and_logsumexp():
    a, w = sds((6, 4), jnp.float32), sds((4, 9), jnp.float32)
    labels = jnp.zeros((6,), jnp.int32)
    # bfloat16 logits computed in the function: kept in bfloat16 ([6, 9], the
    # cross-entropy's) next to the matmul's own bfloat16 operands and the float32 [6]
    # logsumexp; no float32 [6, 9] array.
    got = computed_residuals(lambda a, w: ops.cross_entropy(
        a.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16), labels), a, w, argnums=(0, 1))
    assert got == sorted([((6,), "float32"), ((6, 9), "bfloat16"), ((6, 4), "bfloat16"),
                          ((4, 9), "bfloat16")])


# ---------------------------------------------------------------- cast_matmul

CAST_CASES = {
    "matmul": (None, (5, 8), (8, 3), None),
    "einsum": ("btd,dhk->bthk", (2, 5, 8), (8, 2, 3), None),
    "ragged": (None, (6, 8), (2, 8, 3), (2, 4)),
}


@pytest.mark.parametrize("case", list(CAST_CASES))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_cast_matmul_equals_plain_cast_and_saves_no_weight_copy(case, dtype):
    spec, x_shape, w_shape, groups = CAST_CASES[case]
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.normal(size=x_shape), jnp.float32)
    w = jnp.asarray(rng.normal(size=w_shape), jnp.float32)
    gs = None if groups is None else jnp.asarray(groups, jnp.int32)

    def plain(w, x):
        xc, wc = x.astype(dtype), w.astype(dtype)
        if gs is not None:
            return jax.lax.ragged_dot(xc, wc, gs)
        return jnp.einsum(spec, xc, wc) if spec else xc @ wc

    def ours(w, x):
        return ops.cast_matmul(x.astype(dtype), w, spec, group_sizes=gs)

    def loss(f):
        return lambda w, x: jnp.sum(jnp.tanh(f(w, x).astype(jnp.float32)))

    y, y_ref = ours(w, x), plain(w, x)
    assert y.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(f64(y), f64(y_ref))
    for g, g_ref in zip(jax.grad(loss(ours), (0, 1))(w, x), jax.grad(loss(plain), (0, 1))(w, x)):
        assert g.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(g), np.asarray(g_ref))
    name = jnp.dtype(dtype).name
    kept = computed_residuals(loss(ours), w, x, argnums=(0, 1))
    kept_plain = computed_residuals(loss(plain), w, x, argnums=(0, 1))
    assert (tuple(w_shape), name) in kept_plain  # the copy the plain expression keeps ...
    assert (tuple(w_shape), name) not in kept   # ... and cast_matmul does not
    assert (tuple(x_shape), name) in kept       # x in the compute dtype, for dw


def test_cast_matmul_same_dtype_is_a_plain_matmul():
    x, w = jnp.ones((3, 4)), jnp.ones((4, 2))
    prims = {e.primitive.name for e in eqns(jax.make_jaxpr(ops.cast_matmul)(x, w).jaxpr)}
    assert "dot_general" in prims and not prims & {"checkpoint", "remat", "remat2", "convert_element_type"}


@pytest.mark.parametrize("call, match", [
    (lambda: ops.cast_matmul(jnp.ones((2, 3), jnp.int32), jnp.ones((3, 2))), "floating"),
    (lambda: ops.cast_matmul(jnp.ones((2, 3)), jnp.ones((1, 3, 2)), "ab,gbc->ac",
                             group_sizes=jnp.array([2])), "not both"),
])
def test_cast_matmul_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()
