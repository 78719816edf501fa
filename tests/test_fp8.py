"""jaxmp.fp8 against NumPy float64 references: scales, quantization, blocks, the four recipes'
products and gradients, and the delayed-scaling state (history, max, accumulation, scan)."""
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jaxmp
from jaxmp import fp8
from jaxmp.precision.fp8 import E4M3, E5M2, Recipe

MAX = {E4M3: 448.0, E5M2: 57344.0}
ML = {E4M3: ml_dtypes.float8_e4m3fn, E5M2: ml_dtypes.float8_e5m2}
TINY = float(np.finfo(np.float32).tiny)
RECIPES = [Recipe.tensorwise(), Recipe.delayed(history_length=4), Recipe.rowwise(), Recipe.blockwise()]


def test_public_names_and_alias():
    assert jaxmp.fp8 is fp8 and fp8 is jaxmp.precision.fp8
    assert fp8.E4M3 == jnp.float8_e4m3fn and fp8.E5M2 == jnp.float8_e5m2
    for name in ("scale_from_amax", "quantize", "dequantize", "quantize_blocks", "dequantize_blocks",
                 "Recipe", "dot"):
        assert callable(getattr(fp8, name))
    assert Recipe.delayed() == Recipe("delayed", 1024, 0)
    assert [str(r) for r in (Recipe.tensorwise(), Recipe.delayed(), Recipe.delayed(16), Recipe.rowwise(),
                             Recipe.blockwise())] == ["tensorwise", "delayed", "delayed/16/0", "rowwise",
                                                      "blockwise"]
    for r in RECIPES + [Recipe.delayed(16, 2), Recipe("rowwise", margin=1)]:
        assert Recipe.parse(str(r)) == r and hash(Recipe.parse(str(r))) == hash(r)


def test_recipe_formats():
    assert (Recipe.tensorwise().bwd_dtype, Recipe.delayed().bwd_dtype) == (E5M2, E5M2)
    assert (Recipe.rowwise().bwd_dtype, Recipe.blockwise().bwd_dtype) == (E4M3, E4M3)
    assert all(r.fwd_dtype == E4M3 for r in RECIPES)


# ----------------------------------------------------------------------------- scales


@pytest.mark.parametrize("amax, dtype, margin, expected", [
    (448.0, E4M3, 0, 1.0), (8.0, E4M3, 0, np.float32(8.0) / np.float32(448.0)), (57344.0, E5M2, 0, 1.0),
    (448.0, E4M3, 2, 4.0), (-896.0, E4M3, 0, 2.0), (1.0, E5M2, 1, 2.0 / 57344.0),
])
def test_scale_from_amax_by_hand(amax, dtype, margin, expected):
    got = fp8.scale_from_amax(jnp.float32(amax), dtype, margin)
    assert got.dtype == jnp.float32
    assert float(got) == pytest.approx(float(expected), rel=1e-7)


@pytest.mark.parametrize("amax", [0.0, -0.0, 1e-40, np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_scale_of_zero_subnormal_or_nonfinite_amax_is_one(amax, dtype):
    assert float(fp8.scale_from_amax(jnp.float32(amax), dtype)) == 1.0


def test_scale_and_its_reciprocal_stay_normal():
    # 1e-37 / 448 is subnormal in float32; 3e38 / 448 * 2**10 is above 2**126, whose
    # reciprocal would be subnormal.
    assert float(fp8.scale_from_amax(jnp.float32(1e-37))) == TINY
    assert float(fp8.scale_from_amax(jnp.float32(3e38), E4M3, margin=10)) == 2.0 ** 126


@settings(max_examples=60, deadline=None)
@given(st.floats(width=32, allow_nan=True, allow_infinity=True), st.sampled_from([E4M3, E5M2]),
       st.integers(0, 8))
def test_every_amax_gives_a_finite_positive_scale(amax, dtype, margin):
    s = float(fp8.scale_from_amax(jnp.float32(amax), dtype, margin))
    assert math.isfinite(s) and s >= TINY


@pytest.mark.parametrize("bad, match", [
    (dict(dtype=jnp.bfloat16), "FP8 dtype"), (dict(margin=-1), "margin"), (dict(margin=1.5), "margin"),
])
def test_scale_from_amax_rejects_bad_arguments(bad, match):
    with pytest.raises(ValueError, match=match):
        fp8.scale_from_amax(1.0, **bad)


# ----------------------------------------------------------------------------- quantize


def np_quantize(x, scale, dtype):
    """NumPy reference of the documented rule: x times float32(1 / scale) in float32,
    saturated at +-max for finite inputs, rounded to the format (ml_dtypes' cast)."""
    x32 = np.asarray(x, np.float64).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        y = (x32 * (np.float32(1.0) / np.asarray(scale, np.float32))).astype(np.float64)
    y = np.where(np.isfinite(x32), np.clip(y, -MAX[dtype], MAX[dtype]), y)
    return y.astype(ML[dtype])


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantize_saturates_at_the_format_maximum(dtype):
    m = MAX[dtype]
    x = jnp.asarray([m, -m, 2 * m, -10 * m, 3e38, -3e38, 1.0], jnp.float32)
    q = np.asarray(fp8.quantize(x, jnp.float32(1.0), dtype), np.float64)
    np.testing.assert_array_equal(q, [m, -m, m, -m, m, -m, 1.0])
    # A finite input whose quotient overflows float32 is saturated too.
    q = np.asarray(fp8.quantize(jnp.float32(1e30), jnp.float32(TINY), dtype), np.float64)
    assert q == m


def test_plain_cast_would_not_saturate():
    """Why quantize clips: a plain cast turns 500 into NaN in E4M3 and 1e5 into inf in E5M2."""
    assert np.isnan(np.float64(jnp.float32(500.0).astype(E4M3)))
    assert np.isinf(np.float64(jnp.float32(1e5).astype(E5M2)))


def test_nonfinite_inputs_stay_nonfinite():
    x = jnp.asarray([np.inf, -np.inf, np.nan], jnp.float32)
    e5 = np.asarray(fp8.quantize(x, jnp.float32(2.0), E5M2), np.float64)
    assert e5[0] == np.inf and e5[1] == -np.inf and np.isnan(e5[2])
    assert np.all(np.isnan(np.asarray(fp8.quantize(x, jnp.float32(2.0), E4M3), np.float64)))


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("seed", [0, 1])
def test_quantize_and_dequantize_match_numpy(dtype, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((64, 33)) * np.exp(rng.uniform(-6, 6, (64, 33)))).astype(np.float32)
    scale = np.float32(0.37)
    q = fp8.quantize(jnp.asarray(x), jnp.float32(scale), dtype)
    assert q.dtype == dtype
    ref = np_quantize(x, scale, dtype)
    np.testing.assert_array_equal(np.asarray(q, np.float64), ref.astype(np.float64))
    deq = fp8.dequantize(q, jnp.float32(scale), jnp.float32)
    np.testing.assert_array_equal(np.asarray(deq), (ref.astype(np.float64) * np.float64(scale)).astype(np.float32))
    assert fp8.dequantize(q, scale, jnp.bfloat16).dtype == jnp.bfloat16


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, width=32), min_size=1, max_size=40), st.sampled_from([E4M3, E5M2]))
def test_roundtrip_error_is_within_half_an_ulp(values, dtype):
    """With the amax scale, |dequantize(quantize(x)) - x| <= half a step of the format at |x|
    (relative 2**-4 for E4M3's 3 mantissa bits, 2**-3 for E5M2's 2), or half the smallest
    subnormal step below the normal range."""
    x = np.asarray(values, np.float32)
    s = fp8.scale_from_amax(jnp.max(jnp.abs(jnp.asarray(x))), dtype)
    y = np.asarray(fp8.dequantize(fp8.quantize(jnp.asarray(x), s, dtype), s), np.float64)
    fi = ml_dtypes.finfo(ML[dtype])
    rel = 2.0 ** -(fi.nmant + 1)
    bound = np.maximum(rel * np.abs(x), float(fi.smallest_subnormal) / 2 * float(s)) * (1 + 1e-6)
    assert np.all(np.abs(y - x) <= bound + 1e-30)


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match="FP8 dtype"):
        fp8.quantize(jnp.ones(3), 1.0, jnp.float16)
    with pytest.raises(ValueError, match="broadcast"):
        fp8.quantize(jnp.ones(3), jnp.ones(2), E4M3)
    with pytest.raises(ValueError, match="floating"):
        fp8.quantize(jnp.ones(3, jnp.int32), 1.0)


# ----------------------------------------------------------------------------- blocks


def np_scale(amax, dtype, margin=0):
    """amax / max as the docstring defines it: float32 amax times float32(1 / max), 2**margin."""
    amax = np.abs(np.asarray(amax, np.float64)).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        s = amax * np.float32(1.0 / MAX[dtype]) * np.float32(2.0 ** margin)
    s = np.clip(s, TINY, np.float32(2.0 ** 126))
    return np.where(np.isfinite(amax) & (amax >= TINY), s, np.float32(1.0)).astype(np.float32)


def np_blocks(x, bm, bk, dtype):
    """Per-block float64 reference: (dequantized values, scales), ragged edges included."""
    x = np.asarray(x, np.float64)
    m, k = x.shape
    scales = np.zeros((-(-m // bm), -(-k // bk)), np.float32)
    deq = np.zeros_like(x)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            blk = x[i * bm:(i + 1) * bm, j * bk:(j + 1) * bk]
            s = np_scale(np.max(np.abs(blk)), dtype)
            scales[i, j] = s
            deq[i * bm:(i + 1) * bm, j * bk:(j + 1) * bk] = np_quantize(blk, s, dtype).astype(np.float64) * np.float64(s)
    return deq, scales


def test_block_scales_by_hand():
    x = np.array([[1., -2., 3., 0.5, 7.],
                  [4., 0., -8., 1., 2.],
                  [-0.25, 896., 0., 0., 0.]], np.float32)
    q, s = fp8.quantize_blocks(jnp.asarray(x), (2, 2))
    assert s.shape == (2, 3) and s.dtype == jnp.float32
    # Block amaxes by hand: [[4, 8, 7], [896, 0, 0]]; the all-zero blocks get scale 1.
    want = np.array([[4 / 448, 8 / 448, 7 / 448], [2.0, 1.0, 1.0]], np.float32)
    np.testing.assert_allclose(np.asarray(s), want, rtol=1e-7)
    deq = np.asarray(fp8.dequantize_blocks(q, s, (2, 2)), np.float64)
    np.testing.assert_allclose(deq[:2, :2], [[1., -2.], [4., 0.]], rtol=2 ** -4)
    assert deq[2, 1] == 896.0 and deq[2, 2:].tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("shape, block", [((4, 300), (1, 128)), ((200, 130), (128, 128)), ((7, 5), (3, 2)),
                                           ((1, 1), (128, 128)), ((129, 257), (128, 128))])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantize_blocks_matches_numpy_on_ragged_shapes(shape, block, dtype):
    rng = np.random.default_rng(sum(shape))
    x = (rng.standard_normal(shape) * np.exp(rng.uniform(-4, 4, shape))).astype(np.float32)
    q, s = fp8.quantize_blocks(jnp.asarray(x), block, dtype)
    ref_deq, ref_s = np_blocks(x, *block, dtype)
    assert s.shape == (-(-shape[0] // block[0]), -(-shape[1] // block[1])) and q.shape == shape
    np.testing.assert_array_equal(np.asarray(s), ref_s)
    np.testing.assert_allclose(np.asarray(fp8.dequantize_blocks(q, s, block), np.float64), ref_deq,
                               rtol=1e-6, atol=0)


def test_blocks_reject_bad_shapes():
    with pytest.raises(ValueError, match="2-D"):
        fp8.quantize_blocks(jnp.ones((2, 3, 4)), (1, 128))
    with pytest.raises(ValueError, match="block_shape"):
        fp8.quantize_blocks(jnp.ones((2, 3)), (0, 128))
    with pytest.raises(ValueError, match=r"expected \(1, 1\)"):
        fp8.dequantize_blocks(jnp.ones((2, 3), E4M3), jnp.ones((2, 2)), (2, 3))


# ----------------------------------------------------------------------------- dot vs NumPy


def f32(x):
    """A dequantized operand as jaxmp.fp8.dequantize returns it: float32 (one rounding)."""
    return np.asarray(x, np.float64).astype(np.float32).astype(np.float64)


def q_tensor(x, dtype, scale=None):
    if x.size == 0:
        return np.zeros_like(x)
    s = np_scale(np.max(np.abs(x)), dtype) if scale is None else np.float32(scale)
    return np_quantize(x, s, dtype).astype(np.float64) * np.float64(s)


def q_rows(x, dtype):
    """One scale per row of a 2-D float64 array."""
    return np.stack([q_tensor(r, dtype) for r in x])


def q_cols(x, dtype):
    return q_rows(x.T, dtype).T


def q_tiles(x, dtype):
    """1x128 tiles along the rows."""
    return np_blocks(x, 1, 128, dtype)[0]


def np_delayed_scales(state, recipe):
    amax = np.max(np.asarray(state, np.float64), axis=1)
    return (np_scale(amax[0], E4M3), np_scale(amax[1], E4M3), np_scale(amax[2], E5M2))


def reference_operands(recipe, x, w, g, state=None):
    """The dequantized FP8 operands of y = x @ w, dx = g @ w.T and dw = x.T @ g (float64)."""
    if recipe.name == "tensorwise":
        xq, wq, gq = q_tensor(x, E4M3), q_tensor(w, E4M3), q_tensor(g, E5M2)
        return (xq, wq), (gq, wq), (xq, gq)
    if recipe.name == "delayed":
        sx, sw, sg = np_delayed_scales(state, recipe)
        xq, wq, gq = q_tensor(x, E4M3, sx), q_tensor(w, E4M3, sw), q_tensor(g, E5M2, sg)
        return (xq, wq), (gq, wq), (xq, gq)
    if recipe.name == "rowwise":
        xq = q_rows(x, E4M3)
        fwd = (xq, q_cols(w, E4M3))
        dgrad = (q_rows(g, E4M3), q_rows(w, E4M3))         # w per row k: outside dx's contraction
        wgrad = (q_cols(f32(xq), E4M3), q_cols(g, E4M3))   # the saved FP8 x, per column now
        return fwd, dgrad, wgrad
    xq = q_tiles(x, E4M3)
    wq = np_blocks(w, 128, 128, E4M3)[0]
    dgrad = (q_tiles(g, E4M3), wq)                         # g tiles along N, w blocks transposed
    wgrad = (q_tiles(f32(xq).T, E4M3).T, q_tiles(g.T, E4M3).T)  # 128x1 tiles of x (requantized), g
    return (xq, wq), dgrad, wgrad


def assert_product(got, a, b, out_dtype):
    """got ~ a @ b: the output dtype's rounding plus float32 accumulation of |a| @ |b|."""
    ref = a @ b
    absum = np.abs(a) @ np.abs(b)
    rtol = 2.0 ** -8 if out_dtype == jnp.bfloat16 else 2.0 ** -20
    err = np.abs(np.asarray(got, np.float64) - ref)
    assert np.all(err <= rtol * np.abs(ref) + 1e-5 * absum + 1e-30), float(np.max(err - rtol * np.abs(ref)))


def data(m, k, n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k))
    x[rng.integers(0, m, 4), rng.integers(0, k, 4)] *= 300.0  # outliers: recipes differ
    x = x.astype(ml_dtypes.bfloat16).astype(np.float64)
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32).astype(np.float64)
    g = (rng.standard_normal((m, n)) * 1e-3).astype(ml_dtypes.bfloat16).astype(np.float64)
    return x, w, g


def delayed_state(recipe, x, w, g):
    # Histories whose max differs from the current amax: x's below it (x saturates),
    # w's above, g's a little above.
    state = np.zeros((3, recipe.history_length), np.float32)
    state[0, 1] = np.max(np.abs(x)) / 4
    state[1, 2] = np.max(np.abs(w)) * 2
    state[2, 0] = np.max(np.abs(g)) * 1.5
    return state


@pytest.mark.parametrize("recipe", RECIPES, ids=str)
def test_dot_forward_and_both_gradients_match_numpy(recipe):
    x, w, g = data(140, 300, 200)   # M, K, N: 2 row tiles, ragged 128-blocks in K and N
    state = delayed_state(recipe, x, w, g) if recipe.has_state else None
    xj = jnp.asarray(x.reshape(2, 70, 300), jnp.bfloat16)  # batch dims are flattened into rows
    y, vjp = jax.vjp(lambda a, b, s: fp8.dot(a, b, recipe, s), xj, jnp.asarray(w, jnp.float32),
                     None if state is None else jnp.asarray(state))
    dx, dw, dstate = vjp(jnp.asarray(g.reshape(2, 70, 200), jnp.bfloat16))
    assert (y.dtype, dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.bfloat16, jnp.float32)
    assert y.shape == (2, 70, 200) and dx.shape == (2, 70, 300) and dw.shape == (300, 200)
    fwd, dgrad, wgrad = reference_operands(recipe, x, w, g, state)
    assert_product(np.asarray(y, np.float64).reshape(140, 200), fwd[0], fwd[1], jnp.bfloat16)
    assert_product(np.asarray(dx, np.float64).reshape(140, 300), dgrad[0], dgrad[1].T, jnp.bfloat16)
    assert_product(np.asarray(dw, np.float64), wgrad[0].T, wgrad[1], jnp.float32)
    if recipe.has_state:  # the new history: this step's amaxes in front, the rest shifted
        amax = [np.max(np.abs(v)) for v in (x, w, g)]
        np.testing.assert_array_equal(np.asarray(dstate)[:, 0], np.float32(amax))
        np.testing.assert_array_equal(np.asarray(dstate)[:, 1:], state[:, :-1])
    else:
        assert dstate is None


def test_recipes_differ_on_outliers():
    """The same inputs, four different products: the test above would catch a mixed-up recipe."""
    x, w, _ = data(140, 300, 200)
    outs = [np.asarray(fp8.dot(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.float32), r,
                               fp8.init_state(r)), np.float64) for r in RECIPES]
    exact = x @ w
    errs = [np.linalg.norm(o - exact) / np.linalg.norm(exact) for o in outs]
    assert len(set(np.round(errs, 6))) == 4
    assert errs[3] < errs[0] and errs[2] < errs[0]  # finer scales, smaller error


def np_grouped_reference(recipe, x, w, g, sizes, state=None):
    """y, dx, dw of the grouped product (rows sorted by group) on the dequantized operands."""
    rows = np.repeat(np.arange(len(sizes)), sizes)
    groups = range(len(sizes))
    if recipe.name in ("tensorwise", "delayed"):
        if recipe.has_state:
            sx, sw, sg = np_delayed_scales(state, recipe)
        else:
            sx, sw, sg = (np_scale(np.max(np.abs(v)), d) for v, d in ((x, E4M3), (w, E4M3), (g, E5M2)))
        xq, wq, gq = q_tensor(x, E4M3, sx), q_tensor(w, E4M3, sw), q_tensor(g, E5M2, sg)
        w_fwd = w_bwd = wq          # one scale for all groups' weights
        g_d, x_w, g_w = gq, xq, gq
    elif recipe.name == "rowwise":
        xq = q_rows(x, E4M3)
        w_fwd = np.stack([q_cols(w[e], E4M3) for e in groups])
        w_bwd = np.stack([q_rows(w[e], E4M3) for e in groups])
        g_d = q_rows(g, E4M3)
        x_w, g_w = np.zeros_like(xq), np.zeros_like(g)
        for e in groups:  # per (group, column)
            x_w[rows == e] = q_cols(f32(xq[rows == e]), E4M3)
            g_w[rows == e] = q_cols(g[rows == e], E4M3)
    else:
        xq = q_tiles(x, E4M3)
        w_fwd = w_bwd = np.stack([np_blocks(w[e], 128, 128, E4M3)[0] for e in groups])
        g_d = q_tiles(g, E4M3)
        x_w, g_w = q_tiles(f32(xq).T, E4M3).T, q_tiles(g.T, E4M3).T  # 128-row tiles, sorted rows
    y = [(xq[rows == e], w_fwd[e]) for e in groups]
    dx = [(g_d[rows == e], w_bwd[e].T) for e in groups]
    dw = [(x_w[rows == e].T, g_w[rows == e]) for e in groups]
    return rows, y, dx, dw


@pytest.mark.parametrize("recipe", RECIPES, ids=str)
def test_grouped_dot_matches_numpy(recipe):
    sizes = [100, 0, 150, 50]           # 300 sorted rows: 128-row tiles span groups; one empty
    x, _, g = data(300, 200, 136, seed=1)
    w = np.random.default_rng(2).standard_normal((4, 200, 136)).astype(np.float32).astype(np.float64) * 0.05
    state = delayed_state(recipe, x, w, g) if recipe.has_state else None
    gs = jnp.asarray(sizes, jnp.int32)
    y, vjp = jax.vjp(lambda a, b, s: fp8.grouped_dot(a, b, gs, recipe, s), jnp.asarray(x, jnp.bfloat16),
                     jnp.asarray(w, jnp.float32), None if state is None else jnp.asarray(state))
    dx, dw, _ = vjp(jnp.asarray(g, jnp.bfloat16))
    rows, ys, dxs, dws = np_grouped_reference(recipe, x, w, g, sizes, state)
    y, dx, dw = (np.asarray(v, np.float64) for v in (y, dx, dw))
    for e in range(4):
        if sizes[e]:
            assert_product(y[rows == e], *ys[e], jnp.bfloat16)
            assert_product(dx[rows == e], *dxs[e], jnp.bfloat16)
            assert_product(dw[e], *dws[e], jnp.float32)
        else:
            assert np.all(dw[e] == 0)


@pytest.mark.parametrize("spec, xs, ws", [("btd,dhk->bthk", (2, 3, 8), (8, 2, 4)),
                                          ("bthk,hkd->btd", (2, 3, 2, 4), (2, 4, 8)),
                                          ("becd,edf->becf", (2, 3, 4, 8), (3, 8, 5))])
def test_matmul_specs_match_einsum_layouts(spec, xs, ws):
    """matmul's reshapes put every element where jnp.einsum does. Entries +-1, 1/2, 1/4:
    each dequantizes to within 1e-7 of itself and the sums of 8 products are multiples of
    1/16 below 8, which bfloat16 holds, so the result is the float64 einsum."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(2.0 ** rng.integers(-2, 1, xs) * rng.choice([-1, 1], xs), jnp.bfloat16)
    w = jnp.asarray(2.0 ** rng.integers(-2, 1, ws) * rng.choice([-1, 1], ws), jnp.float32)
    got = fp8.matmul(x, w, Recipe.tensorwise(), spec=spec)
    ref = np.einsum(spec, np.asarray(x, np.float64), np.asarray(w, np.float64))
    np.testing.assert_array_equal(np.asarray(got, np.float64), ref)


@pytest.mark.parametrize("call, match", [
    (lambda: fp8.dot(jnp.ones((2, 3)), jnp.ones((4, 5)), Recipe.tensorwise()), "must end in K = 4"),
    (lambda: fp8.dot(jnp.ones((2, 3)), jnp.ones((3, 5, 1)), Recipe.tensorwise()), "2-D"),
    (lambda: fp8.dot(jnp.ones((2, 3)), jnp.ones((3, 5)), "blockwise"), "Recipe"),
    (lambda: fp8.dot(jnp.ones((2, 3)), jnp.ones((3, 5)), Recipe.delayed(4)), "needs its amax-history"),
    (lambda: fp8.dot(jnp.ones((2, 3)), jnp.ones((3, 5)), Recipe.delayed(4), jnp.zeros((3, 5))), r"\(3, 4\)"),
    (lambda: fp8.dot(jnp.ones((2, 3)), jnp.ones((3, 5)), Recipe.rowwise(), jnp.zeros((3, 4))), "no state"),
    (lambda: fp8.matmul(jnp.ones((2, 3)), jnp.ones((3, 5)), Recipe.rowwise(), spec="ab,bc->ac",
                        group_sizes=jnp.ones(3, jnp.int32)), "not both"),
    (lambda: fp8.matmul(jnp.ones((2, 3)), jnp.ones((3, 5)), Recipe.rowwise(), spec="ab,bc->abc"), "matmul"),
    (lambda: fp8.grouped_dot(jnp.ones((4, 3)), jnp.ones((2, 3, 5)), jnp.ones(3, jnp.int32), Recipe.rowwise()),
     "group_sizes"),
    (lambda: Recipe("delayed"), "history_length >= 1"), (lambda: Recipe("rowwise", 4), "only for the delayed"),
    (lambda: Recipe("perchannel"), "unknown FP8 recipe"), (lambda: Recipe.parse("delayed/x"), "bad FP8 recipe"),
])
def test_bad_input_is_a_clear_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ----------------------------------------------------------------------------- delayed scaling


def _step(recipe, state, x, w):
    """One forward + backward of sum(dot) with respect to the state: its new value."""
    return jax.grad(lambda s: jnp.sum(fp8.dot(x, w, recipe, s).astype(jnp.float32)))(state)


def test_history_rolls_and_the_scale_uses_its_max():
    recipe = Recipe.delayed(history_length=3)
    w = jnp.full((4, 2), 0.5, jnp.float32)
    state = fp8.init_state(recipe)
    np.testing.assert_array_equal(np.asarray(state), np.zeros((3, 3)))
    for amax in (1.0, 8.0, 2.0, 4.0):
        state = _step(recipe, state, jnp.full((2, 4), amax, jnp.bfloat16), w)
    # Newest first; the oldest (1.0) fell off the length-3 window.
    np.testing.assert_array_equal(np.asarray(state)[0], [4.0, 2.0, 8.0])
    np.testing.assert_array_equal(np.asarray(state)[1], [0.5, 0.5, 0.5])
    # The next forward scales x by max(history) / 448 = 8 / 448: 100 saturates to 448 * 8/448;
    # and w by 0.5 / 448.
    x = jnp.asarray([[100.0, 1.0, 1.0, 1.0]], jnp.bfloat16)
    y = fp8.dot(x, 0.5 * jnp.eye(4, dtype=jnp.float32), recipe, state)
    np.testing.assert_allclose(np.asarray(y, np.float64), [[4.0, 0.5, 0.5, 0.5]], rtol=2 ** -8)


def test_max_over_micro_batches_not_the_last_one():
    """Case FP8-1: four micro-batches with activation amax 1, 8, 2, 1, combined as the train
    step combines them (fp8.merge_states from a -inf start): the newest entry is 8 and the
    next step's activation scale 8 / 448."""
    recipe = Recipe.delayed(history_length=16)
    state = fp8.init_state(recipe).at[0, 0].set(3.0)  # an earlier step saw amax 3
    w = jnp.ones((4, 3), jnp.float32)
    micro = jnp.stack([jnp.full((2, 4), a, jnp.bfloat16) for a in (1.0, 8.0, 2.0, 1.0)])

    def body(acc, x):
        return fp8.merge_states(acc, _step(recipe, state, x, w)), None

    new, _ = jax.lax.scan(body, jnp.full_like(state, -jnp.inf), micro)
    assert float(new[0, 0]) == 8.0 and float(new[0, 1]) == 3.0
    last_only = _step(recipe, state, micro[-1], w)
    assert float(last_only[0, 0]) == 1.0  # what keeping the last micro-batch would store
    scale = fp8.scale_from_amax(jnp.max(new[0]), recipe.fwd_dtype)
    assert float(scale) == pytest.approx(8.0 / 448.0, rel=1e-7)


def test_each_layer_keeps_its_own_history_under_scan():
    """Case FP8-1 inside lax.scan over 3 layers with stacked weights and stacked states: the
    cotangent of the stacked state is stacked, one history per layer."""
    recipe = Recipe.delayed(history_length=8)
    layers, d = 3, 4
    ws = jnp.stack([jnp.eye(d, dtype=jnp.float32) * c for c in (1.0, 4.0, 0.5)])
    states = jnp.stack([fp8.init_state(recipe)] * layers)

    def net(ws, states, x):
        def layer(h, inputs):
            w, s = inputs
            return fp8.dot(h, w, recipe, s), None
        h, _ = jax.lax.scan(layer, x, (ws, states))
        return jnp.sum(h.astype(jnp.float32))

    x = jnp.full((2, d), 2.0, jnp.bfloat16)
    new = jax.jit(jax.grad(net, argnums=1))(ws, states, x)
    # Layer inputs: 2, then 2 * 1, then 2 * 1 * 4 (the scales of an empty history are 1: exact).
    np.testing.assert_array_equal(np.asarray(new[:, 0, 0]), [2.0, 2.0, 8.0])
    np.testing.assert_array_equal(np.asarray(new[:, 1, 0]), [1.0, 4.0, 0.5])
    assert np.all(np.asarray(new[:, :, 1:]) == 0)


@pytest.mark.parametrize("recipe", [fp8.Recipe.tensorwise(), fp8.Recipe.rowwise(), fp8.Recipe.blockwise()],
                         ids=str)
def test_remat_keeps_the_saved_fp8_activation_exact(recipe):
    """Under ``jax.checkpoint`` (model.remat, the FSDP step) JAX passes saved float residuals
    through ``reduce_precision`` with their dtype's widths, which in IEEE semantics turns
    E4M3FN magnitudes above 240 into inf; the saved activation travels as its bits, so
    values and gradients are bitwise those without the checkpoint (and finite)."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(16, 256)), jnp.bfloat16)  # current scaling: |q| reaches 448
    w = jnp.asarray(rng.normal(size=(256, 32)) * 0.05, jnp.float32)

    def loss(x, w):
        return jnp.sum(fp8.dot(x, w, recipe).astype(jnp.float32) ** 2)

    want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)
    saved = jax.checkpoint(loss, policy=jax.checkpoint_policies.everything_saveable)
    got = jax.jit(jax.value_and_grad(saved, argnums=(0, 1)))(x, w)
    assert np.isfinite(float(got[0]))
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
