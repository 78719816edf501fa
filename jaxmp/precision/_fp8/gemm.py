"""The FP8 products :func:`dot` and :func:`grouped_dot`, their custom VJPs, one scheme per recipe.

A scheme (:class:`_PerTensor`, :class:`_Rowwise`, :class:`_Blockwise`) says how one recipe
quantizes the operands of the three products of a matmul (forward, ``dx = g @ w.T``,
``dw = x.T @ g``), dense and grouped; :data:`_SCHEMES` maps each recipe name to its
scheme, the one dispatch point. The custom VJPs around them (:func:`_dense`,
:func:`_grouped`) own what every recipe shares: the einsum weight layout, the FP8
residual stashed as bits, the delayed recipe's state. Scales, formulas and sources:
:mod:`jaxmp.precision.fp8`.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._checks import check_float, check_matmul
from jaxmp.precision._fp8 import grouped_kernel as _grouped_kernel
from jaxmp.precision._fp8 import kernel as _kernel
from jaxmp.precision._fp8.quant import (
    _F32, BLOCK, _amax, _cols, _dequantize_tiles, _q_tiles, _quantize, _quantize_blocks,
    scale_from_amax)
from jaxmp.precision._fp8.recipe import Recipe, _check_recipe, _check_state, roll_history
from jaxmp.precision._vma import match_varying

def _mm(a, b, group_sizes):
    """FP8 ``a [M, K] @ b`` with float32 output: ``b [K, N]``, or ``b [G, K, N]`` grouped."""
    if group_sizes is None:
        return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=_F32)
    return jax.lax.ragged_dot(a, b, group_sizes, preferred_element_type=_F32)


def _scaled_mm(qa, sa, qb, sb, group_sizes=None, row_group=None):
    """``sum_c (qa[:, c] @ qb[.., c, :]) * sa[:, c] * sb[.., c, :]`` in float32.

    ``qa [M, K]`` with scales ``sa [M | 1, C]``; ``qb [K, N]`` with ``sb [C, N | 1]``, or
    grouped ``qb [G, K, N]`` (``group_sizes``) with ``sb [G | 1, C, N | 1]`` (a row's B
    scale is its group's, ``row_group [M]``). ``C == 1``: the scales factor out of one
    product over all of K. ``C > 1``: slice ``c`` is K's ``c``-th 128 elements, one FP8
    product each, scaled and accumulated in float32.
    """
    c_count = max(sa.shape[-1], sb.shape[-2])
    k = qa.shape[1]
    out = None
    for c in range(c_count):
        lo, hi = (0, k) if c_count == 1 else (c * BLOCK, min(k, (c + 1) * BLOCK))
        part = _mm(qa[:, lo:hi], qb[..., lo:hi, :], group_sizes)
        s_a = sa[:, c:c + 1] if sa.shape[-1] > 1 else sa
        s_b = sb[..., c, :] if sb.shape[-2] > 1 else sb[..., 0, :]
        if s_b.ndim == 2:  # grouped: [G | 1, N | 1]
            s_b = s_b[row_group] if s_b.shape[0] > 1 else s_b
        part = part * s_a * s_b
        out = part if out is None else out + part
    return out




def _scale(amax, dtype, recipe):
    return scale_from_amax(amax, dtype, recipe.margin)


def _q_along(x, axis, dtype, recipe):
    """One scale per slice along ``axis`` reduced (keepdims): rows (axis=-1) or columns."""
    s = _scale(_amax(x, axis=axis, keepdims=True), dtype, recipe)
    return _quantize(x, s, dtype), s


def _state_scales(recipe, state):
    """The delayed scales of the activation, weight and gradient from the histories."""
    amax = jnp.max(state, axis=-1)
    return (_scale(amax[0], recipe.fwd_dtype, recipe), _scale(amax[1], recipe.fwd_dtype, recipe),
            _scale(amax[2], recipe.bwd_dtype, recipe))


def _per_tensor(recipe, x, w, state):
    """One scale for ``x`` and one for ``w``: from their amaxes, or from the histories under
    delayed scaling. Returns ``(qx, sx, qw, sw, amax_x, amax_w)``."""
    f8 = recipe.fwd_dtype
    amax_x, amax_w = _amax(x), _amax(w)
    if recipe.has_state:
        sx, sw, _ = _state_scales(recipe, state)
    else:
        sx, sw = _scale(amax_x, f8, recipe), _scale(amax_w, f8, recipe)
    return _quantize(x, sx, f8), sx, _quantize(w, sw, f8), sw, amax_x, amax_w


def _per_tensor_grad(recipe, g, state):
    """The output gradient with one scale: ``(qg, sg, amax_g)``."""
    amax_g = _amax(g)
    sg = (_state_scales(recipe, state)[2] if recipe.has_state
          else _scale(amax_g, recipe.bwd_dtype, recipe))
    return _quantize(g, sg, recipe.bwd_dtype), sg, amax_g


def _new_state(state, amax_x, amax_w, amax_g):
    return roll_history(state, jnp.stack([amax_x, amax_w, amax_g]))


def _row_groups(group_sizes, m):
    """The group of each of ``m`` sorted rows (rows past the last group: the last group)."""
    ends = jnp.cumsum(group_sizes)
    return jnp.minimum(jnp.searchsorted(ends, jnp.arange(m), side="right"),
                       group_sizes.shape[0] - 1)


def _as_matrix(w, layout):
    """The weight as the product's matrix: ``w`` itself, or for ``layout = (perm, shape)``
    ``transpose(w, perm).reshape(shape)`` (an einsum weight such as ``[d, heads, head_dim]``).
    Done inside the custom VJP, so the residual is ``w`` itself (an argument, no copy)."""
    if layout is None:
        return w
    perm, shape = layout
    return jnp.transpose(w, perm).reshape(shape)


def _as_weight(dw, w, layout):
    """``dw`` of the matrix back in ``w``'s shape and dtype."""
    if layout is not None:
        perm, _ = layout
        dw = jnp.transpose(dw.reshape(tuple(w.shape[p] for p in perm)), tuple(np.argsort(perm)))
    return dw.astype(w.dtype)


def _stash(q):
    """The saved FP8 activation as its bits (uint8). ``jax.checkpoint`` passes each float
    residual it saves through ``reduce_precision`` with the dtype's exponent and mantissa
    widths (JAX PR 22244), which for E4M3FN (IEEE semantics, 4 exponent bits) turns every
    magnitude above 240 into inf: under remat (``model.remat``, the FSDP step's checkpoint)
    the saved activation, and the forward product that reads it, would become NaN. Bits
    are integers, which that pass leaves alone; :func:`_unstash` reads them back exactly."""
    return jax.lax.bitcast_convert_type(q, jnp.uint8)


def _unstash(bits, dtype):
    return jax.lax.bitcast_convert_type(bits, dtype)


# --- grouped: x [M, K] rows sorted by group, w [G, K, N]


def _ragged_wgrad_dims():
    return jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (0,)), ((), ())), lhs_ragged_dimensions=[1],
        rhs_group_dimensions=[])


def _wgrad(qxt, qg, group_sizes):
    """``dw[e] = qxt[:, rows of e] @ qg[rows of e]``: ``[K, M] x [M, N] -> [G, K, N]``, float32."""
    return jax.lax.ragged_dot_general(qxt, qg, group_sizes, _ragged_wgrad_dims(),
                                      preferred_element_type=_F32)


def _group_q_cols(x, row_group, g_count, dtype, recipe):
    """One scale per (group, column) of sorted rows ``x [M, C]``: ``(q, scales [G, C])``."""
    amax = jax.ops.segment_max(jnp.abs(x.astype(_F32)), row_group, num_segments=g_count)
    s = _scale(jnp.maximum(amax, 0.0), dtype, recipe)  # empty groups: -inf -> 0 -> scale 1
    return _quantize(x, s[row_group], dtype), s


def _tile_group_sizes(group_sizes, tiles):
    """``[tiles, G]``: how many rows of each 128-row tile of the sorted rows are in each group."""
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    lo = jnp.arange(tiles, dtype=ends.dtype)[:, None] * BLOCK
    return jnp.clip(jnp.minimum(ends[None], lo + BLOCK) - jnp.maximum(starts[None], lo),
                    0).astype(jnp.int32)


def _tiled_wgrad(qxt, sxt, qgt, sgt, group_sizes):
    """Blockwise ``dw [G, K, N]`` from 128x1 tiles of the sorted rows (tiles may span groups).

    ``qxt [K, M]`` / ``qgt [N, M]`` are ``x.T`` / ``g.T`` quantized in 1x128 tiles along M
    (scales ``[K, Mb]``, ``[N, Mb]``). Per tile, one FP8 product per group (a batched
    ``ragged_dot_general`` over the tiles, ragged along the tile's rows), scaled by the
    tile's scales and summed over tiles in float32: ``G * Mb * K * N`` float32 temporaries.
    """
    k, m = qxt.shape
    n = qgt.shape[0]
    tiles = -(-m // BLOCK)
    pad = ((0, 0), (0, tiles * BLOCK - m))
    a = jnp.pad(qxt, pad).reshape(k, tiles, BLOCK).transpose(1, 0, 2)   # [Mb, K, 128]
    b = jnp.pad(qgt, pad).reshape(n, tiles, BLOCK).transpose(1, 2, 0)   # [Mb, 128, N]
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((2,), (1,)), ((0,), (0,))), lhs_ragged_dimensions=[2],
        rhs_group_dimensions=[])
    part = jax.lax.ragged_dot_general(a, b, _tile_group_sizes(group_sizes, tiles), dims,
                                      preferred_element_type=_F32)     # [G, Mb, K, N]
    return jnp.sum(part * sxt.T[None, :, :, None] * sgt.T[None, :, None, :], axis=1)




# ----------------------------------------------------------------------------- schemes


def _dot_nt(a, b):
    """``a [M, C] @ b [N, C].T`` in float32 (FP8 operands)."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=_F32)


def _dot_tn(a, b):
    """``a [C, K].T @ b [C, N]`` in float32 (FP8 operands)."""
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=_F32)


class _PerTensor:
    """Tensorwise and delayed: one scale for ``x``, one for all of ``w``, one for ``g``.

    Forward residual scales: ``(sx, sw)``; amaxes feed the delayed recipe's new history.
    """

    @staticmethod
    def dense_fwd(recipe, x, w, state):
        qx, sx, qw, sw, amax_x, amax_w = _per_tensor(recipe, x, w, state)
        y = _mm(qx, qw, None) * (sx * sw)
        return y.astype(x.dtype), (qx, sx.reshape(1, 1), sw, amax_x, amax_w)

    @staticmethod
    def dense_bwd(recipe, qx, sx, sw, w, g, state, amaxes):
        qg, sg, amax_g = _per_tensor_grad(recipe, g, state)
        qw = _quantize(w, sw, recipe.fwd_dtype)
        dx = _dot_nt(qg, qw) * (sg * sw)
        dw = _dot_tn(qx, qg) * (sx[0, 0] * sg)
        new_state = _new_state(state, *amaxes, amax_g) if recipe.has_state else None
        return dx, dw, new_state

    @staticmethod
    def grouped_fwd(recipe, x, w, group_sizes, rows, state):
        qx, sx, qw, sw, amax_x, amax_w = _per_tensor(recipe, x, w, state)
        y = _mm(qx, qw, group_sizes) * (sx * sw)
        return y, (qx, sx.reshape(1, 1), sw, amax_x, amax_w)

    @staticmethod
    def grouped_bwd(recipe, qx, sx, sw, w, g, group_sizes, rows, state, amaxes):
        qg, sg, amax_g = _per_tensor_grad(recipe, g, state)
        qw = _quantize(w, sw, recipe.fwd_dtype)
        dx = _mm(qg, jnp.swapaxes(qw, 1, 2), group_sizes) * (sg * sw)
        dw = _wgrad(qx.T, qg, group_sizes) * (sx[0, 0] * sg)
        new_state = _new_state(state, *amaxes, amax_g) if recipe.has_state else None
        return dx, dw, new_state


class _Rowwise:
    """Per row of ``x`` / ``g``, per output column of ``w``; the backward products scale
    outside *their* contraction: ``g`` by rows and ``w`` by rows for ``dx``, ``x`` and
    ``g`` by columns for ``dw`` (the saved FP8 activation is dequantized and quantized
    again per column)."""

    @staticmethod
    def dense_fwd(recipe, x, w, state):
        f8 = recipe.fwd_dtype
        qx, sx = _q_along(x, -1, f8, recipe)             # [M, 1]
        qw, sw = _q_along(w, 0, f8, recipe)              # [1, N]
        return (_mm(qx, qw, None) * sx * sw).astype(x.dtype), (qx, sx, None, None, None)

    @staticmethod
    def dense_bwd(recipe, qx, sx, sw, w, g, state, amaxes):
        f8, b8 = recipe.fwd_dtype, recipe.bwd_dtype
        qg_r, sg_r = _q_along(g, -1, b8, recipe)          # [M, 1]: outside dx's contraction (N)
        qw_r, sw_r = _q_along(w, -1, f8, recipe)          # [K, 1]
        dx = _dot_nt(qg_r, qw_r) * sg_r * sw_r.T
        xd = qx.astype(_F32) * sx                         # the saved FP8 activation, per column now
        qx_c, sx_c = _q_along(xd, 0, f8, recipe)          # [1, K]: outside dw's contraction (M)
        qg_c, sg_c = _q_along(g, 0, b8, recipe)           # [1, N]
        dw = _dot_tn(qx_c, qg_c) * sx_c.T * sg_c
        return dx, dw, None

    @staticmethod
    def grouped_fwd(recipe, x, w, group_sizes, rows, state):
        f8 = recipe.fwd_dtype
        qx, sx = _q_along(x, -1, f8, recipe)              # [M, 1]
        qw, sw = _q_along(w, 1, f8, recipe)               # [G, 1, N]: per expert and column
        return _scaled_mm(qx, sx, qw, sw, group_sizes, rows), (qx, sx, None, None, None)

    @staticmethod
    def grouped_bwd(recipe, qx, sx, sw, w, g, group_sizes, rows, state, amaxes):
        f8, b8 = recipe.fwd_dtype, recipe.bwd_dtype
        g_count = w.shape[0]
        qg_r, sg_r = _q_along(g, -1, b8, recipe)                       # [M, 1]
        qw_r, sw_r = _q_along(w, 2, f8, recipe)                        # [G, K, 1]
        dx = _scaled_mm(qg_r, sg_r, jnp.swapaxes(qw_r, 1, 2), jnp.swapaxes(sw_r, 1, 2),
                        group_sizes, rows)
        xd = qx.astype(_F32) * sx
        qx_c, sx_c = _group_q_cols(xd, rows, g_count, f8, recipe)      # [G, K]
        qg_c, sg_c = _group_q_cols(g, rows, g_count, b8, recipe)       # [G, N]
        dw = _wgrad(qx_c.T, qg_c, group_sizes) * sx_c[:, :, None] * sg_c[:, None, :]
        return dx, dw, None


def _blockwise_mm(recipe, qa, sa, qb, sb_cols, out_dtype):
    """``sum_c (qa[:, c] @ qb[c]) * sa[:, c] * sb_cols[c]`` (``c``: 128-wide slices of K) in
    ``out_dtype``, by the GEMM ``recipe.kernel`` selects (:func:`_kernel.select`).

    ``qa [M, K]``, ``sa [M, Kb]``, ``qb [K, N]``, ``sb_cols [Kb, N]`` (block scales
    repeated per column). ``xla``: :func:`_scaled_mm`, one FP8 ``dot_general`` per slice,
    then a cast. ``pallas``: :func:`jaxmp.precision._fp8.kernel.scaled_mm`, one kernel
    (its B operand is ``qb.T``, K-major as FP8 WGMMA needs).
    """
    def xla():
        return _scaled_mm(qa, sa, qb, sb_cols).astype(out_dtype)

    def pallas(interpret):
        return _kernel.scaled_mm(qa, sa.T, qb.T, sb_cols, out_dtype, interpret=interpret)
    return _kernel.select(recipe.kernel, pallas, xla, qa, qb)


def _blockwise_bwd_tiles(recipe, qx, sx, g):
    """The backward operands of a blockwise matmul, dense or grouped: ``(qg, sg)`` the 1x128
    tiles of ``g [M, N]`` along N (``dx``); ``(qgt, sgt)`` and ``(qxt, sxt)`` the 128x1 tiles
    of ``g`` and of the saved activation (dequantized from its 1x128 tiles ``qx [M, K]``,
    ``sx``) along M, transposed: ``[N, M]``, ``[N, Mb]``, ``[K, M]``, ``[K, Mb]`` (``dw``;
    DeepSeek-V3 3.3.3). Grouped, M is the sorted rows and a 128x1 tile may span two groups
    (the weight-gradient GEMMs split it: :func:`_tiled_wgrad`, ``grouped_wgrad``).

    ``xla``: :func:`_q_tiles` of each layout (XLA fuses them into several passes over
    ``g``: benchmarks/README.md). ``pallas`` (:func:`_kernel.select`; M, N and K
    multiples of 128, else ``xla``): :func:`jaxmp.precision._fp8.kernel.quantize_both`,
    one read of ``g`` for both of its layouts and one of ``qx``; the same bits.
    """
    f8, b8 = recipe.fwd_dtype, recipe.bwd_dtype

    def xla():
        qg, sg = _q_tiles(g, b8)
        qxt, sxt = _q_tiles(_dequantize_tiles(qx, sx).T, f8)
        qgt, sgt = _q_tiles(g.T, b8)
        return qg, sg, qgt, sgt, qxt, sxt

    def pallas(interpret):
        qg, sg_t, qgt, sgt_t = _kernel.quantize_both(g, b8, interpret=interpret)
        _, _, qxt, sxt_t = _kernel.quantize_both(qx, f8, row_scales_t=sx.T, rows=False,
                                                 interpret=interpret)
        return qg, sg_t.T, qgt, sgt_t.T, qxt, sxt_t.T

    if any(d % BLOCK for d in (*g.shape, qx.shape[1])):
        return xla()
    return _kernel.select(recipe.kernel, pallas, xla)


def _grouped_blockwise_mm(recipe, qa, sa, qb, sb_cols, group_sizes, rows, out_dtype):
    """The grouped :func:`_blockwise_mm`: row ``i`` of group ``e`` times ``qb[e]``.

    ``qa [M, K]``, ``sa [M, Kb]``, ``qb [G, K, N]``, ``sb_cols [G, Kb, N]``. ``xla``:
    :func:`_scaled_mm` (one FP8 ``ragged_dot`` per 128 of K), then a cast. ``pallas``:
    :func:`jaxmp.precision._fp8.grouped_kernel.grouped_scaled_mm`, one kernel (its B operand
    is ``qb[e].T``, K-major).
    """
    def xla():
        return _scaled_mm(qa, sa, qb, sb_cols, group_sizes, rows).astype(out_dtype)

    def pallas(interpret):
        out = out_dtype if jnp.dtype(out_dtype) == jnp.dtype(jnp.bfloat16) else _F32
        return _grouped_kernel.grouped_scaled_mm(qa, sa, jnp.swapaxes(qb, 1, 2), sb_cols,
                                                 group_sizes, out, interpret=interpret)
    return _kernel.select(recipe.kernel, pallas, xla, qa, qb)


class _Blockwise:
    """DeepSeek-V3 (report, sections 3.3.2-3.3.3): 1x128 tiles of ``x`` and ``g``, 128x128
    blocks of ``w`` (transposed blocks for ``dx``), 128x1 tiles of ``x`` and ``g`` for
    ``dw`` (the saved 1x128-tiled FP8 activation is dequantized and tiled again along M)."""

    @staticmethod
    def dense_fwd(recipe, x, w, state):
        f8 = recipe.fwd_dtype
        qx, sx = _q_tiles(x, f8)                         # [M, Kb]
        qw, sw = _quantize_blocks(w, BLOCK, BLOCK, f8)   # [Kb, Nb]
        y = _blockwise_mm(recipe, qx, sx, qw, _cols(sw, w.shape[1]), x.dtype)
        return y, (qx, sx, None, None, None)

    @staticmethod
    def dense_bwd(recipe, qx, sx, sw, w, g, state, amaxes):
        f8 = recipe.fwd_dtype
        k = qx.shape[1]
        qg, sg, qgt, sgt, qxt, sxt = _blockwise_bwd_tiles(recipe, qx, sx, g)
        qw, sw_b = _quantize_blocks(w, BLOCK, BLOCK, f8)  # [Kb, Nb]; used transposed
        dx = _blockwise_mm(recipe, qg, sg, qw.T, _cols(sw_b.T, k), g.dtype)
        dw = _blockwise_mm(recipe, qxt, sxt, qgt.T, sgt.T, _F32)
        return dx, dw, None

    @staticmethod
    def grouped_fwd(recipe, x, w, group_sizes, rows, state):
        f8 = recipe.fwd_dtype
        qx, sx = _q_tiles(x, f8)
        qw, sw = jax.vmap(lambda v: _quantize_blocks(v, BLOCK, BLOCK, f8))(w)  # [G, Kb, Nb]
        y = _grouped_blockwise_mm(recipe, qx, sx, qw, _cols(sw, w.shape[2]), group_sizes, rows,
                                  x.dtype)
        return y, (qx, sx, None, None, None)

    @staticmethod
    def grouped_bwd(recipe, qx, sx, sw, w, g, group_sizes, rows, state, amaxes):
        f8 = recipe.fwd_dtype
        k = qx.shape[1]
        # 128x1 tiles along the sorted rows (a tile may span two groups): dense's tiles.
        qg, sg, qgt, sgt, qxt, sxt = _blockwise_bwd_tiles(recipe, qx, sx, g)
        qw, sw_b = jax.vmap(lambda v: _quantize_blocks(v, BLOCK, BLOCK, f8))(w)  # [G, Kb, Nb]
        dx = _grouped_blockwise_mm(recipe, qg, sg, jnp.swapaxes(qw, 1, 2),
                                   _cols(jnp.swapaxes(sw_b, 1, 2), k), group_sizes, rows, g.dtype)

        def pallas(interpret):
            return _grouped_kernel.grouped_wgrad(qxt, sxt, qgt, sgt, group_sizes,
                                                 interpret=interpret)
        dw = _kernel.select(recipe.kernel, pallas,
                            lambda: _tiled_wgrad(qxt, sxt, qgt, sgt, group_sizes), qxt, qgt)
        return dx, dw, None


# The one dispatch point from a recipe to how it scales its products.
_SCHEMES = {"tensorwise": _PerTensor, "delayed": _PerTensor, "rowwise": _Rowwise,
            "blockwise": _Blockwise}


# ----------------------------------------------------------------------------- custom VJPs


def _residuals(recipe, qx, sx, w_arg, sw, state, amax_x, amax_w):
    """What the backward pass keeps: the FP8 activation as bits, its scales, the weight
    argument itself, the weight's per-tensor scale, and (delayed only) state and amaxes."""
    amaxes = (amax_x, amax_w) if recipe.has_state else None
    return _stash(qx), sx, w_arg, sw, state, amaxes


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _dense(recipe, layout, x, w, state):
    return _dense_fwd(recipe, layout, x, w, state)[0]


def _dense_fwd(recipe, layout, x, w_arg, state):
    y, (qx, sx, sw, amax_x, amax_w) = _SCHEMES[recipe.name].dense_fwd(
        recipe, x, _as_matrix(w_arg, layout), state)
    return y.astype(x.dtype), _residuals(recipe, qx, sx, w_arg, sw, state, amax_x, amax_w)


def _dense_bwd(recipe, layout, res, g):
    bits, sx, w_arg, sw, state, amaxes = res
    dx, dw, new_state = _SCHEMES[recipe.name].dense_bwd(
        recipe, _unstash(bits, recipe.fwd_dtype), sx, sw, _as_matrix(w_arg, layout), g, state,
        amaxes)
    return (match_varying(dx.astype(g.dtype), g, bits),
            match_varying(_as_weight(dw, w_arg, layout), w_arg), new_state)


_dense.defvjp(_dense_fwd, _dense_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _grouped(recipe, layout, x, w, group_sizes, state):
    return _grouped_fwd(recipe, layout, x, w, group_sizes, state)[0]


def _grouped_fwd(recipe, layout, x, w_arg, group_sizes, state):
    rows = _row_groups(group_sizes, x.shape[0])
    y, (qx, sx, sw, amax_x, amax_w) = _SCHEMES[recipe.name].grouped_fwd(
        recipe, x, _as_matrix(w_arg, layout), group_sizes, rows, state)
    res = _residuals(recipe, qx, sx, w_arg, sw, state, amax_x, amax_w)
    return y.astype(x.dtype), res + (group_sizes,)


def _grouped_bwd(recipe, layout, res, g):
    bits, sx, w_arg, sw, state, amaxes, group_sizes = res
    qx = _unstash(bits, recipe.fwd_dtype)
    rows = _row_groups(group_sizes, qx.shape[0])
    dx, dw, new_state = _SCHEMES[recipe.name].grouped_bwd(
        recipe, qx, sx, sw, _as_matrix(w_arg, layout), g, group_sizes, rows, state, amaxes)
    return dx.astype(g.dtype), _as_weight(dw, w_arg, layout), None, new_state


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


# ------------------------------------------------------------- frozen FP8 weights (LoRA bases)
# A frozen weight stored in E4M3 with one float32 scale per 128 x 128 block of its [K, N]
# matrix (DeepSeek-V3's and Qwen3's FP8 releases, read as they are): the products read
# the stored bits and scales, never quantize the weight, and give no weight gradient.


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _frozen_dense(recipe, layout, x, qw, sw):
    return _frozen_dense_fwd(recipe, layout, x, qw, sw)[0]


def _frozen_dense_fwd(recipe, layout, x, qw, sw):
    q = _as_matrix(qw, layout)                              # [K, N] E4M3
    qx, sx = _q_tiles(x, recipe.fwd_dtype)                  # 1x128 tiles
    y = _blockwise_mm(recipe, qx, sx, q, _cols(sw, q.shape[1]), x.dtype)
    return y, (qw, sw)


def _frozen_dense_bwd(recipe, layout, res, g):
    qw, sw = res
    q = _as_matrix(qw, layout)
    qg, sg = _q_tiles(g, recipe.bwd_dtype)                  # 1x128 tiles along N
    dx = _blockwise_mm(recipe, qg, sg, q.T, _cols(sw.T, q.shape[0]), g.dtype)
    return match_varying(dx, g), None, None


_frozen_dense.defvjp(_frozen_dense_fwd, _frozen_dense_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _frozen_grouped(recipe, layout, x, qw, sw, group_sizes):
    return _frozen_grouped_fwd(recipe, layout, x, qw, sw, group_sizes)[0]


def _frozen_grouped_fwd(recipe, layout, x, qw, sw, group_sizes):
    rows = _row_groups(group_sizes, x.shape[0])
    q = _as_matrix(qw, layout)                              # [G, K, N] E4M3
    qx, sx = _q_tiles(x, recipe.fwd_dtype)
    y = _grouped_blockwise_mm(recipe, qx, sx, q, _cols(sw, q.shape[2]), group_sizes, rows,
                              x.dtype)
    return y, (qw, sw, group_sizes)


def _frozen_grouped_bwd(recipe, layout, res, g):
    qw, sw, group_sizes = res
    q = _as_matrix(qw, layout)
    rows = _row_groups(group_sizes, g.shape[0])
    qg, sg = _q_tiles(g, recipe.bwd_dtype)
    dx = _grouped_blockwise_mm(recipe, qg, sg, jnp.swapaxes(q, 1, 2),
                               _cols(jnp.swapaxes(sw, 1, 2), q.shape[1]), group_sizes, rows,
                               g.dtype)
    return match_varying(dx, g), None, None, None


_frozen_grouped.defvjp(_frozen_grouped_fwd, _frozen_grouped_bwd)


def check_frozen(w: Any, scales: Any, recipe: Recipe) -> None:
    """Refuses a frozen FP8 weight the blockwise products cannot read: a recipe that is not
    blockwise, a weight that is not E4M3, or scales that are not one float32 per 128 x 128
    block of its matrix (``[..., ceil(K / 128), ceil(N / 128)]``; ``K``, ``N`` its last two
    axes once reshaped, checked by the caller)."""
    if recipe.name != "blockwise":
        raise ValueError(f"a frozen FP8 weight needs the blockwise recipe, got {recipe.name}")
    if jnp.dtype(w.dtype) != jnp.dtype(recipe.fwd_dtype):
        raise ValueError(f"a frozen FP8 weight must be {jnp.dtype(recipe.fwd_dtype).name}, got "
                         f"{jnp.dtype(w.dtype).name}")
    if jnp.dtype(scales.dtype) != jnp.dtype(jnp.float32):
        raise ValueError(f"a frozen FP8 weight's scales must be float32, got {scales.dtype}")


# ----------------------------------------------------------------------------- public products


def dot(x: Any, w: Any, recipe: Recipe, state: Optional[jax.Array] = None) -> jax.Array:
    """``x @ w`` with both operands in FP8, scaled by ``recipe``; a custom VJP in FP8 too.

    Forward: the activation and the weight are quantized (module docstring: scales per
    recipe), multiplied with float32 accumulation and rescaled in float32. Backward
    (``jax.custom_vjp``): ``dx = g @ w.T`` and ``dw = x.T @ g`` as FP8 products by the
    same recipe; the FP8 activation and its scales are the only activations saved, the
    weight is quantized again from ``w``.

    Args:
      x: ``[..., K]`` activations in the compute dtype (e.g. bfloat16).
      w: ``[K, N]`` weight in any float dtype (the float32 master weight).
      recipe: a :class:`Recipe`.
      state: the delayed recipe's float32 ``[3, history_length]`` amax histories
        (:func:`init_state`); None for the other recipes. Its cotangent under
        ``jax.grad`` / ``jax.vjp`` is the updated state (module docstring).

    Returns:
      ``[..., N]`` in ``x.dtype``. Gradients: ``dx`` in ``x.dtype``, ``dw`` in ``w.dtype``.

    Raises:
      ValueError: non-floating operands, ``w`` not 2-D, ``x``'s last axis not ``K``, not a
        :class:`Recipe`, or a state that the recipe does not take or that has the wrong
        shape or dtype.
    """
    recipe = _check_recipe(recipe)
    check_matmul(x, w)
    state = _check_state(recipe, state)
    x, w = jnp.asarray(x), jnp.asarray(w)
    lead = x.shape[:-1]
    y = _dense(recipe, None, x.reshape(-1, x.shape[-1]), w, state)
    return y.reshape(lead + (w.shape[1],))


def grouped_dot(x: Any, w: Any, group_sizes: Any, recipe: Recipe,
                state: Optional[jax.Array] = None) -> jax.Array:
    """The grouped (ragged) form of :func:`dot`: ``x`` rows sorted by group, one weight each.

    Row ``i`` of group ``e`` (groups in order, ``group_sizes[e]`` rows each) gives
    ``x[i] @ w[e]``, as ``jax.lax.ragged_dot``; the MoE experts' layout. Scales: one for
    ``x`` and one for all of ``w`` (tensorwise, delayed); per row of ``x`` and per (group,
    output column) of ``w`` (rowwise; the weight gradient uses per (group, column) scales
    of ``x`` and ``g``); 1x128 tiles of ``x`` and 128x128 blocks of each ``w[e]``
    (blockwise; the weight gradient's 128x1 tiles run over the sorted rows, a tile may
    span two groups, and each (tile, group) pair is one FP8 product). Blockwise runs the
    GEMM ``recipe.kernel`` selects: on a Hopper target (``auto``) or ``pallas``, three
    Mosaic GPU kernels (:mod:`jaxmp.precision._fp8.grouped_kernel`: each row multiplied
    by its own group's weight only, no float32 partials in memory); ``xla``, the
    reference: one FP8 ``ragged_dot`` per 128 of K (which XLA's GPU compiler runs for
    every group on every row) and a weight gradient with float32
    ``[G, ceil(M / 128), K, N]`` temporaries.

    Args:
      x: ``[M, K]`` in the compute dtype.
      w: ``[G, K, N]`` in any float dtype.
      group_sizes: int ``[G]``, rows per group; they should sum to ``M`` (rows past the
        sum give 0, as in ``ragged_dot``).
      recipe: a :class:`Recipe`.
      state: as in :func:`dot`.

    Returns:
      ``[M, N]`` in ``x.dtype``.

    Raises:
      ValueError: as :func:`dot`, or shapes that do not fit (``w`` not 3-D, ``K``,
        ``group_sizes`` not an integer ``[G]``).
    """
    recipe = _check_recipe(recipe)
    check_float("x", x)
    check_float("w", w)
    if jnp.ndim(w) != 3 or jnp.ndim(x) != 2 or jnp.shape(x)[1] != jnp.shape(w)[1]:
        raise ValueError(f"grouped_dot needs x [M, K] and w [G, K, N], got {jnp.shape(x)} and "
                         f"{jnp.shape(w)}")
    if (not jnp.issubdtype(jnp.result_type(group_sizes), jnp.integer)
            or jnp.shape(group_sizes) != (jnp.shape(w)[0],)):
        raise ValueError(f"group_sizes must be an integer [G] = [{jnp.shape(w)[0]}] array, got "
                         f"{jnp.result_type(group_sizes)} {jnp.shape(group_sizes)}")
    state = _check_state(recipe, state)
    return _grouped(recipe, None, jnp.asarray(x), jnp.asarray(w),
                    jnp.asarray(group_sizes, jnp.int32),
                    state)
