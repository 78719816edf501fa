"""The grouped (MoE) blockwise FP8 GEMMs as Pallas Mosaic GPU kernels for Hopper.

Rows of ``A [M, K]`` are sorted by group (``group_sizes [G]``, zeros allowed, summing to
at most ``M``; ``M`` any size), as ``jax.lax.ragged_dot`` and
:mod:`jaxmp.precision.grouped_gemm` take them. Three products, each one kernel with
float32 promotion every 128 of the contraction (DeepSeek-V3 report, section 3.3.2;
DeepGEMM), the body of :func:`jaxmp.precision._fp8.kernel.scaled_mm`:

* :func:`grouped_scaled_mm`, forward ``y = x w[e]`` and ``dx = g w[e]^T``: E4M3 ``A``
  with 1x128 tile scales times one ``B[e]`` per group with 128x128 block scales (for
  ``dx`` the blocks of ``w[e]^T`` are the transposed 128x128 blocks of ``w[e]``);
* :func:`grouped_wgrad`, ``dw[e] = x_e^T g_e``, ragged along the contracted token axis,
  with 128x1 tiles of ``x`` and ``g`` along the tokens (DeepSeek-V3, section 3.3.2).

Layout: 128-row *slots*. The sorted rows are cut into 128-row tiles (the tiles of the
1x128 / 128x1 quantization). A tile in which ``j`` groups have rows becomes ``j``
slots, one per (tile, group) pair, each a copy of the tile with the other groups' rows
set to 0, at the same offsets in the tile: at most ``ceil(M / 128) + G`` slots (a group
boundary splits at most one tile). A slot belongs to one group, so every output tile
of the forward and ``dx`` kernels multiplies by one ``B[e]``, picked from a per-slot
group index, and the weight-gradient kernel of group ``e`` runs over its own
contiguous range of slots. This is DeepGEMM's "contiguous" grouped layout (each group
padded to a multiple of the M tile, so an M tile belongs to one group; its
``m_grouped_fp8_gemm_nt_contiguous``) with ragged_dot_mgpu's treatment of a tile that
straddles a boundary (computed once per group; each group keeps its own rows), but
masked in memory before the kernel rather than in it. Chosen because:

* a 128x1 weight-gradient tile may span two groups (the tiles are cut from the sorted
  rows, as in the XLA reference ``jaxmp.precision._fp8.gemm._tiled_wgrad``); a slot keeps
  the tile's rows at their offsets and its scales as they are, so the kernel multiplies
  the same FP8 values by the same scales as the reference and agrees with it to float32
  rounding, where padding each group to 128 rows would re-tile (and re-quantize) it;
* the kernel body stays the dense one: WGMMA straight from the TMA'd shared-memory
  tiles, no masking of FP8 tiles in registers;
* the cost is one FP8 copy of ``A`` (``(M + 128 G) K`` bytes) and a gather of the output
  rows, against the G-fold FLOPs of ``ragged_dot`` and the float32 ``[G, Mb, K, N]``
  temporaries of the reference's weight gradient.

Empty slots (past the last used one) are computed on zeros and never read back. The
plain software-pipelined form, as the dense kernel; not timed on an H200 here.

Interpret mode (``InterpretGPUParams``) runs the same kernels on the CPU, with the tile
product as ``lax.dot_general`` on the shared-memory tiles (the interpreter's WGMMA takes
no transposed operand), as in the dense kernel.
"""
from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax

from jaxmp.precision._fp8.kernel import (_STEPS, _TILE, _check_out, _k_pipeline, _pad_to,
                                         _lowered_once, _promote, _store, _tiled,
                                         _zeros)
from jaxmp.precision._vma import match_varying

_F32 = jnp.float32


def slot_count(m: int, groups: int) -> int:
    """Slots for ``m`` sorted rows in ``groups`` groups: ``ceil(m / 128) + groups``."""
    return -(-m // _TILE) + groups


def slots(group_sizes: jax.Array, m: int):
    """The slot layout of ``m`` rows sorted into ``len(group_sizes)`` groups.

    Returns:
      ``(src, keep, slot_group, first, count, row_pos)``: ``src`` int32 ``[P * 128]``, the
      row each slot row copies (clipped into ``[0, m)``); ``keep`` bool ``[P * 128]``,
      whether it is in the slot's group; ``slot_group`` int32 ``[P]``; ``first`` and
      ``count`` int32 ``[G]``, each group's first slot and number of slots (0 for an
      empty group); ``row_pos`` int32 ``[m]``, where row ``i`` sits in the slot layout.
      ``P`` = :func:`slot_count`.
    """
    t = _TILE
    g = group_sizes.shape[0]
    p = slot_count(m, g)
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    count = jnp.where(sizes > 0, (ends - 1) // t - starts // t + 1, 0)
    first = jnp.cumsum(count) - count
    pi = jnp.arange(p, dtype=jnp.int32)
    slot_group = jnp.minimum(jnp.searchsorted(jnp.cumsum(count), pi, side="right"), g - 1)
    slot_group = slot_group.astype(jnp.int32)
    used = pi < jnp.sum(count)
    tile = starts[slot_group] // t + pi - first[slot_group]
    rows = tile[:, None] * t + jnp.arange(t, dtype=jnp.int32)[None, :]     # [P, 128]
    keep = (used[:, None] & (rows >= starts[slot_group][:, None])
            & (rows < ends[slot_group][:, None]) & (rows < m))
    src = jnp.clip(rows, 0, m - 1).reshape(-1)
    i = jnp.arange(m, dtype=jnp.int32)
    row_group = jnp.minimum(jnp.searchsorted(ends, i, side="right"), g - 1)
    row_pos = (first[row_group] + i // t - starts[row_group] // t) * t + i % t
    return src, keep.reshape(-1), slot_group, first.astype(jnp.int32), count, row_pos


@_lowered_once("out_dtype", "interpret")
def grouped_scaled_mm(a: jax.Array, sa: jax.Array, bt: jax.Array, sb: jax.Array,
                      group_sizes: jax.Array, out_dtype: Any, *,
                      interpret: Optional[Any] = None) -> jax.Array:
    """Row ``i`` of group ``e``: ``sum_kb (a[i, kb] @ bt[e][:, kb].T) * sa[i, kb] * sb[e, kb]``.

    Args:
      a: E4M3 (or E5M2) ``[M, K]``, rows sorted by group.
      sa: float32 ``[M, ceil(K / 128)]``, the 1x128 tile scales of ``a``.
      bt: ``[G, N, K]`` in ``a``'s dtype: each group's B transposed (K-major, as FP8
        WGMMA needs). Forward: ``w[e].T``; ``dx``: ``w[e]`` itself.
      sb: float32 ``[G, ceil(K / 128), N]``: the scale of each column of ``B[e]`` in each
        128-slice of K (a 128x128 block scale repeated over its columns).
      group_sizes: int ``[G]``, rows per group (zeros allowed), summing to at most ``M``.
      out_dtype: bfloat16 or float32.
      interpret: None to compile for the GPU, or ``InterpretGPUParams()``.

    Returns:
      ``[M, N]`` in ``out_dtype``: float32 promotion every 128 of K, one rounding at the
      end; rows past ``sum(group_sizes)`` are 0 (as ``ragged_dot`` gives).

    Raises:
      ValueError: shapes or dtypes other than the above.
    """
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    m, k = a.shape
    if bt.ndim != 3 or bt.shape[2] != k or bt.dtype != a.dtype:
        raise ValueError(f"bt must be [G, N, K={k}] in {a.dtype}, got {bt.dtype} {bt.shape}")
    g, n = bt.shape[:2]
    kb = -(-k // _TILE)
    if sa.shape != (m, kb) or sb.shape != (g, kb, n) or group_sizes.shape != (g,):
        raise ValueError(f"sa, sb, group_sizes must be [{m}, {kb}], [{g}, {kb}, {n}], [{g}]; got "
                         f"{sa.shape}, {sb.shape}, {group_sizes.shape}")
    out_dtype = _check_out(out_dtype)
    t = _TILE
    src, keep, slot_group, _, _, row_pos = slots(group_sizes, m)
    p = slot_group.shape[0]
    a_s = jnp.where(keep[:, None], a[src], jnp.zeros((), a.dtype))             # [P*128, K]
    sa_t = jnp.where(keep[None, :], sa.astype(_F32)[src].T, 1.0)               # [Kb, P*128]
    a_s = _pad_to(a_s, 1, t, 0)
    bt = _pad_to(_pad_to(bt, 1, t, 0), 2, t, 0)
    sb = _pad_to(sb.astype(_F32), 2, t, 1)
    np_ = bt.shape[1]
    tiled, out_tiled = _tiled(a.dtype), _tiled(out_dtype)
    compiled = interpret is None
    body = _promote(compiled, t)

    def kernel(group_gmem, a_gmem, b_gmem, sa_gmem, sb_gmem, o_gmem, o_smem):
        si, ni = lax.axis_index("s"), lax.axis_index("n")
        e = group_gmem[si]
        total = _k_pipeline(body, kb, tiled, compiled)(
            a_gmem.at[pl.ds(si * t, t), :], b_gmem.at[e, pl.ds(ni * t, t), :],
            sa_gmem.at[:, pl.ds(si * t, t)], sb_gmem.at[e, :, pl.ds(ni * t, t)])
        _store(total, o_smem, o_gmem.at[pl.ds(si * t, t), pl.ds(ni * t, t)], out_dtype)

    extra = {} if compiled else {"interpret": interpret}
    out = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((p * t, np_), out_dtype),
        scratch_types=[plgpu.SMEM((t, t), out_dtype, transforms=out_tiled)],
        grid=(p, np_ // t), grid_names=("s", "n"), **extra)(slot_group, a_s, bt, sa_t, sb)
    live = jnp.arange(m) < jnp.sum(group_sizes)
    y = jnp.where(live[:, None], out[row_pos, :n], jnp.zeros((), out_dtype))
    return match_varying(y, a, bt, sa, sb)


@_lowered_once("interpret")
def grouped_wgrad(qxt: jax.Array, sxt: jax.Array, qgt: jax.Array, sgt: jax.Array,
                  group_sizes: jax.Array, *, interpret: Optional[Any] = None) -> jax.Array:
    """``dw[e] = sum over the 128-token tiles t of group e of (x_t^T g_t) * sx[:, t] * sg[:, t]``.

    The blockwise weight gradient, ragged along the contracted tokens: ``x`` and ``g``
    quantized in 128x1 tiles along the sorted tokens (a tile may span two groups; each
    group takes only its own tokens of it, with the tile's scales).

    Args:
      qxt: E4M3 ``[K, M]``: ``x.T`` quantized in 1x128 tiles along the tokens ``M``.
      sxt: float32 ``[K, ceil(M / 128)]``, its scales.
      qgt: ``[N, M]`` in ``qxt``'s dtype: ``g.T`` likewise.
      sgt: float32 ``[N, ceil(M / 128)]``.
      group_sizes: int ``[G]`` (zeros allowed), summing to at most ``M``.
      interpret: None to compile for the GPU, or ``InterpretGPUParams()``.

    Returns:
      float32 ``[G, K, N]``; an empty group's is 0.

    Raises:
      ValueError: shapes or dtypes other than the above.
    """
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    k, m = qxt.shape
    n = qgt.shape[0]
    mb = -(-m // _TILE)
    g = group_sizes.shape[0] if group_sizes.ndim == 1 else -1
    if qgt.shape != (n, m) or qgt.dtype != qxt.dtype or g < 1:
        raise ValueError(f"qgt must be [N, M={m}] in {qxt.dtype} and group_sizes [G], got "
                         f"{qgt.dtype} {qgt.shape} and {group_sizes.shape}")
    if sxt.shape != (k, mb) or sgt.shape != (n, mb):
        raise ValueError(f"scales must be [{k}, {mb}] and [{n}, {mb}], got {sxt.shape} and "
                         f"{sgt.shape}")
    t = _TILE
    src, keep, slot_group, first, count, _ = slots(group_sizes, m)
    p = slot_group.shape[0]
    tile_of = src.reshape(p, t)[:, 0] // t                   # each slot's tile (any row)
    zero = jnp.zeros((), qxt.dtype)
    a_s = _pad_to(jnp.where(keep[None, :], qxt[:, src], zero), 0, t, 0)    # [Kp, P*128]
    b_s = _pad_to(jnp.where(keep[None, :], qgt[:, src], zero), 0, t, 0)    # [Np, P*128]
    sa_s = _pad_to(sxt.astype(_F32)[:, tile_of].T, 1, t, 1)               # [P, Kp]
    sb_s = _pad_to(sgt.astype(_F32)[:, tile_of].T, 1, t, 1)               # [P, Np]
    kp, np_ = a_s.shape[0], b_s.shape[0]
    tiled, out_tiled = _tiled(qxt.dtype), _tiled(_F32)
    compiled = interpret is None
    body = _promote(compiled, t)

    def kernel(first_gmem, count_gmem, a_gmem, b_gmem, sa_gmem, sb_gmem, o_gmem, o_smem):
        ei, ki, ni = lax.axis_index("e"), lax.axis_index("k"), lax.axis_index("n")
        start, steps = first_gmem[ei], count_gmem[ei]
        o_tile = o_gmem.at[ei, pl.ds(ki * t, t), pl.ds(ni * t, t)]

        @pl.when(steps > 0)
        def _():
            total = _k_pipeline(body, steps, tiled, compiled, start, min(_STEPS, p))(
                a_gmem.at[pl.ds(ki * t, t), :], b_gmem.at[pl.ds(ni * t, t), :],
                sa_gmem.at[:, pl.ds(ki * t, t)], sb_gmem.at[:, pl.ds(ni * t, t)])
            _store(total, o_smem, o_tile, _F32)

        @pl.when(steps == 0)  # an empty group: its weight gradient is 0
        def _():
            _store(_zeros(compiled, t), o_smem, o_tile, _F32)

    extra = {} if compiled else {"interpret": interpret}
    out = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((g, kp, np_), _F32),
        scratch_types=[plgpu.SMEM((t, t), _F32, transforms=out_tiled)],
        grid=(g, kp // t, np_ // t), grid_names=("e", "k", "n"), **extra)(
            first, count, a_s, b_s, sa_s, sb_s)
    return match_varying(out[:, :k, :n], qxt, qgt, sxt, sgt)
