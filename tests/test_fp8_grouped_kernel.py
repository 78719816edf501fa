"""The grouped blockwise FP8 kernels (jaxmp.precision._fp8.grouped_kernel) on the CPU.

Mosaic GPU's interpreter runs them against NumPy float64 and against the XLA reference
(``Recipe.blockwise("xla")``). One shape throughout: M = 300 sorted rows (not a multiple
of the 128-row tile) in G = 3 groups of 130, 0 and 170 rows (an empty group; both
boundaries inside a tile), K = 256, N = 128. The compiled kernels: a deviceless H200
compile, in tests/test_grouped_gemm_deviceless.py.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmp import fp8
from jaxmp.precision._fp8 import grouped_kernel as gk
from jaxmp.precision._fp8.gemm import _row_groups, _scaled_mm, _tiled_wgrad
from jaxmp.precision._fp8.kernel import _interpret_params
from jaxmp.precision._fp8.quant import _cols

U32 = 2.0 ** -24  # float32 unit roundoff
M, K, N = 300, 256, 128
SIZES = np.array([130, 0, 170], np.int32)


def _groups(sizes):
    ends = np.cumsum(sizes)
    return [slice(int(e - s), int(e)) for s, e in zip(sizes, ends)]


@pytest.mark.parametrize("sizes,m", [([130, 0, 170], 300), ([0, 0, 5], 5), ([128, 128], 300),
                                     ([0, 127, 2, 0], 200)])
def test_slots_cover_each_row_once_in_its_group(sizes, m):
    """Every row of group e sits in exactly one slot of group e, at its offset in its
    128-row tile; slot rows of other groups are dropped; a group's slots are contiguous."""
    sizes = np.array(sizes, np.int32)
    src, keep, slot_group, first, count, row_pos = (
        np.asarray(v) for v in jax.jit(gk.slots, static_argnums=1)(jnp.asarray(sizes), m))
    p = gk.slot_count(m, len(sizes))
    assert src.shape == keep.shape == (p * 128,) and slot_group.shape == (p,)
    kept = np.flatnonzero(keep)
    total = int(sizes.sum())
    np.testing.assert_array_equal(np.sort(src[kept]), np.arange(total))  # each row once
    for e, rows in enumerate(_groups(sizes)):
        n_tiles = 0 if rows.stop == rows.start else (rows.stop - 1) // 128 - rows.start // 128 + 1
        assert count[e] == n_tiles
        mine = np.arange(first[e], first[e] + count[e])
        assert np.all(slot_group[mine] == e)
        for i in range(rows.start, rows.stop):
            pos = row_pos[i]
            assert keep[pos] and src[pos] == i and pos % 128 == i % 128
            assert slot_group[pos // 128] == e


def _int_operands(rng):
    """Small integers and power-of-two scales: every sum below is exact in float32."""
    kb, nb, mb = K // 128, N // 128, -(-M // 128)
    qa = jnp.asarray(rng.integers(-4, 5, (M, K)), fp8.E4M3)
    sa = jnp.asarray(2.0 ** rng.integers(-3, 4, (M, kb)), jnp.float32)
    qw = jnp.asarray(rng.integers(-4, 5, (3, K, N)), fp8.E4M3)
    sw = jnp.asarray(2.0 ** rng.integers(-3, 4, (3, kb, nb)), jnp.float32)
    qg = jnp.asarray(rng.integers(-4, 5, (N, M)), fp8.E4M3)
    sg = jnp.asarray(2.0 ** rng.integers(-3, 4, (N, mb)), jnp.float32)
    qx = jnp.asarray(rng.integers(-4, 5, (K, M)), fp8.E4M3)
    sx = jnp.asarray(2.0 ** rng.integers(-3, 4, (K, mb)), jnp.float32)
    return qa, sa, qw, sw, qx, sx, qg, sg


def test_kernels_bitwise_when_every_sum_is_exact():
    """With no rounding anywhere, the forward and weight-gradient kernels, the XLA
    reference and float64 NumPy agree bit for bit, rows past sum(sizes) and the empty
    group's weight gradient included (0)."""
    qa, sa, qw, sw, qx, sx, qg, sg = _int_operands(np.random.default_rng(0))
    sizes = np.array([130, 0, 150], np.int32)  # rows 280..299 belong to no group
    gs = jnp.asarray(sizes)
    sbc = _cols(sw, N)                                                    # [G, Kb, N]
    y = np.asarray(gk.grouped_scaled_mm(qa, sa, jnp.swapaxes(qw, 1, 2), sbc, gs, jnp.float32,
                                        interpret=_interpret_params()))
    dw = np.asarray(gk.grouped_wgrad(qx, sx, qg, sg, gs, interpret=_interpret_params()))
    y_ref = np.asarray(_scaled_mm(qa, sa, qw, sbc, gs, _row_groups(gs, M)))
    dw_ref = np.asarray(_tiled_wgrad(qx, sx, qg, sg, gs))
    a64 = np.asarray(qa, np.float64) * np.repeat(np.asarray(sa, np.float64), 128, 1)
    w64 = np.asarray(qw, np.float64) * np.repeat(np.repeat(np.asarray(sw, np.float64), 128, 1),
                                                 128, 2)
    x64 = (np.asarray(qx, np.float64) * np.repeat(np.asarray(sx, np.float64), 128, 1)[:, :M])
    g64 = (np.asarray(qg, np.float64) * np.repeat(np.asarray(sg, np.float64), 128, 1)[:, :M])
    y64, dw64 = np.zeros((M, N)), np.zeros((3, K, N))
    for e, rows in enumerate(_groups(sizes)):
        y64[rows] = a64[rows] @ w64[e]
        dw64[e] = x64[:, rows] @ g64[:, rows].T
    np.testing.assert_array_equal(y, y64.astype(np.float32))
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(dw, dw64.astype(np.float32))
    np.testing.assert_array_equal(dw, dw_ref)
    assert not y[280:].any() and not dw[1].any()


def _deq_tiles(x, axis_rows=False):
    """float64 of ``x`` through 1x128 tiles (fp8.quantize_blocks)."""
    q, s = fp8.quantize_blocks(jnp.asarray(x, jnp.float32), (1, 128))
    return np.asarray(q, np.float64) * np.repeat(np.asarray(s, np.float64), 128, 1)[:, :x.shape[1]]


def _float64_reference(x, w, g):
    """y, dx, dw of the blockwise recipe from the dequantized FP8 values in float64, and
    each one's float32 error bound ``(depth + 3) * u * sum |terms|``."""
    xq = _deq_tiles(x)
    wq = []
    for e in range(w.shape[0]):
        q, s = fp8.quantize_blocks(jnp.asarray(w[e]), (128, 128))
        wq.append(np.asarray(q, np.float64) * np.repeat(np.repeat(np.asarray(s, np.float64),
                                                                  128, 0), 128, 1))
    gq = _deq_tiles(g)
    xt = _deq_tiles(xq.T.astype(np.float32))        # 128x1 tiles of the FP8 activation
    gt = _deq_tiles(g.T)
    out = [np.zeros((M, N)), np.zeros((M, K)), np.zeros((3, K, N))]
    mag = [np.zeros((M, N)), np.zeros((M, K)), np.zeros((3, K, N))]
    for e, rows in enumerate(_groups(SIZES)):
        out[0][rows], mag[0][rows] = xq[rows] @ wq[e], np.abs(xq[rows]) @ np.abs(wq[e])
        out[1][rows], mag[1][rows] = gq[rows] @ wq[e].T, np.abs(gq[rows]) @ np.abs(wq[e].T)
        out[2][e] = xt[:, rows] @ gt[:, rows].T
        mag[2][e] = np.abs(xt[:, rows]) @ np.abs(gt[:, rows].T)
    return out, [(d + 3) * U32 * a for d, a in zip((K, N, M), mag)]


def test_grouped_dot_pallas_matches_xla_and_float64_values_and_gradients():
    """fp8.grouped_dot under blockwise("pallas") (interpreted: forward, dx and dw kernels)
    against blockwise("xla") and against float64 products of the dequantized FP8 values:
    y, dx and dw within float32 rounding (the same quantization and slices; only the order
    inside each 128-deep dot, and of the weight gradient's sum over tiles, differs)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((3, K, N)).astype(np.float32)
    g = rng.standard_normal((M, N)).astype(np.float32)
    gs = jnp.asarray(SIZES)

    def run(kernel):
        y, vjp = jax.vjp(lambda a, b: fp8.grouped_dot(a, b, gs, fp8.Recipe.blockwise(kernel)),
                         jnp.asarray(x), jnp.asarray(w))
        return [np.asarray(v) for v in (y,) + vjp(jnp.asarray(g))]

    got, ref = run("pallas"), run("xla")
    exact, bounds = _float64_reference(x, w, g)
    for name, a, b, want, bound in zip(("y", "dx", "dw"), got, ref, exact, bounds):
        assert a.shape == b.shape == want.shape, name
        assert np.all(np.abs(a - want) <= bound), name
        assert np.all(np.abs(b - want) <= bound), name
        assert np.all(np.abs(a - b) <= 2 * bound), name
    assert not got[2][1].any()  # the empty group's weight gradient


def _bits(a):
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


@pytest.mark.parametrize("kernel", ["pallas", "xla"])
def test_grouped_backward_quantizes_as_the_xla_tiles_bitwise(kernel, monkeypatch):
    """The grouped backward's FP8 operands with M, K, N multiples of 128 (M = 256 sorted
    rows in groups of 100, 0 and 156: the first 128x1 tile spans two groups): under
    "pallas" from kernel.quantize_both (interpreted; 2 calls: g, the saved activation),
    under "xla" from XLA; both the bits of quant._q_tiles of g (1x128, dx), of g.T and
    of the dequantized saved activation's transpose (128x1 along the sorted rows, dw)."""
    from jaxmp.precision._fp8 import gemm, kernel as fp8_kernel
    from jaxmp.precision._fp8.quant import _dequantize_tiles, _q_tiles

    m, k, n, sizes = 256, 256, 128, jnp.asarray([100, 0, 156], jnp.int32)
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((m, k)) * 2.0 ** rng.integers(-8, 9, (m, 1)),
                    jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, k, n)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((m, n)) * 2.0 ** rng.integers(-8, 9, (1, n)),
                    jnp.bfloat16)
    qx, sx = _q_tiles(x, fp8.E4M3)
    seen, calls = {}, []
    real = fp8_kernel.quantize_both
    monkeypatch.setattr(fp8_kernel, "quantize_both",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))

    def dx_operands(recipe, qa, sa, *rest):
        seen["dx"] = (qa, sa)
        return jnp.zeros((m, k), jnp.bfloat16)

    def dw_operands(*args, **kw):
        seen["dw"] = args[:4]
        return jnp.zeros((3, k, n), jnp.float32)

    monkeypatch.setattr(gemm, "_grouped_blockwise_mm", dx_operands)
    monkeypatch.setattr(gemm._grouped_kernel, "grouped_wgrad", dw_operands)
    monkeypatch.setattr(gemm, "_tiled_wgrad", dw_operands)
    recipe = fp8.Recipe.blockwise(kernel)
    gemm._Blockwise.grouped_bwd(recipe, qx, sx, None, w, g, sizes,
                                gemm._row_groups(sizes, m), None, None)
    assert len(calls) == (2 if kernel == "pallas" else 0)
    want = (*_q_tiles(g, recipe.bwd_dtype),
            *_q_tiles(_dequantize_tiles(qx, sx).T, recipe.fwd_dtype),
            *_q_tiles(g.T, recipe.bwd_dtype))
    for got, ref in zip((*seen["dx"], *seen["dw"]), want):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        np.testing.assert_array_equal(_bits(got), _bits(ref))


def test_bad_operands_are_named():
    a = jnp.zeros((8, 128), fp8.E4M3)
    with pytest.raises(ValueError, match=r"bt must be \[G, N, K=128\]"):
        gk.grouped_scaled_mm(a, jnp.ones((8, 1)), jnp.zeros((2, 64, 96), fp8.E4M3),
                             jnp.ones((2, 1, 64)), jnp.array([4, 4]), jnp.float32)
    with pytest.raises(ValueError, match="out_dtype=float16"):
        gk.grouped_scaled_mm(a, jnp.ones((8, 1)), jnp.zeros((2, 64, 128), fp8.E4M3),
                             jnp.ones((2, 1, 64)), jnp.array([4, 4]), jnp.float16)
    with pytest.raises(ValueError, match=r"scales must be \[128, 1\]"):
        gk.grouped_wgrad(jnp.zeros((128, 8), fp8.E4M3), jnp.ones((128, 2)),
                         jnp.zeros((64, 8), fp8.E4M3), jnp.ones((64, 1)), jnp.array([4, 4]))
