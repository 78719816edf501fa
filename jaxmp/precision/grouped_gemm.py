"""Grouped GEMM for the routed experts on Hopper: Mosaic GPU kernels with a custom VJP.

``grouped_matmul(x, w, group_sizes)`` is ``jax.lax.ragged_dot(x, w, group_sizes)``: rows of
``x [M, K]`` sorted by group, ``group_sizes[e]`` consecutive rows multiplied by ``w[e]``
(``w [G, K, N]``). XLA's GPU compiler (jax 0.10.2) lowers ``ragged_dot`` to a masked
``[M, G, K]`` copy of ``x`` and one dense ``[M, G*K] x [G*K, N]`` GEMM: every expert
computes every token, G times the FLOPs. Here each pass is one persistent Pallas kernel on
the Mosaic GPU backend that computes only the rows of each group:

* forward ``y = x w[e]`` and ``dx = dy w[e]^T``: JAX's
  ``jax.experimental.pallas.ops.gpu.ragged_dot_mgpu.ragged_dot`` (``transpose_rhs=True``
  for ``dx``), used as shipped;
* ``dw[e] = x_e^T dy_e`` (ragged along the contracted token axis): a copy of JAX's
  ``transposed_ragged_dot_mgpu.transposed_ragged_dot`` (:func:`_transposed_ragged_dot`)
  that differs in one point: the shipped kernel sizes its persistent grid by
  ``jax.devices()[0].core_count``, the *host's* device, which is a CPU (no ``core_count``,
  an ``AttributeError``) in a deviceless compile and in interpret mode. The copy takes
  the SM count of the compile target instead.

Operands: ``x`` and ``w`` float16 or bfloat16 (the same dtype: cast first; WGMMA
multiplies them and accumulates in float32), result in that dtype. ``group_sizes`` may
hold zeros and ``M`` need not be a multiple of any tile (a tile straddling two groups is
computed once per group and each group stores only its own rows; rows past the last
tile are read as zeros by TMA). ``K`` and ``N`` must be multiples of 64 (the kernels'
``block_k`` divides the contraction and their tiles the output columns; the shipped
forward rejects ``K % block_k``, the weight-gradient kernel ``K``/``N`` % tile).

Rows past ``sum(group_sizes)`` are set to 0 (as ``ragged_dot`` gives) by a select after
the kernel, which leaves them unwritten.

Tiles are chosen per shape by :func:`choose_tiles` and recorded in :func:`tile_choices`.

Off a GPU the kernels run in Mosaic GPU interpret mode (:func:`interpret_mode`), which
simulates shared memory, warpgroups, barriers and TMA on the CPU: slow, for small tests.
The interpreted weight-gradient kernel crashes XLA:CPU's compiler (SIGFPE in
``llvm::APInt::urem`` under ``FusionCompiler``, jax 0.10.2) unless the process runs with
``XLA_FLAGS=--xla_cpu_use_fusion_emitters=false`` (:data:`INTERPRET_XLA_FLAGS`); the tests
run interpreted kernels in a subprocess with it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp

from jaxmp.precision._vma import match_varying

__all__ = ["Tiles", "choose_tiles", "tile_choices", "grouped_matmul", "support",
           "interpret_mode", "INTERPRET_PINNED_JAX", "INTERPRET_XLA_FLAGS", "DEFAULT_NUM_SMS"]

# The jax version whose private interpret-mode spelling (jax._src...) interpret_mode uses.
INTERPRET_PINNED_JAX = "0.10.2"
# H100 SXM / H200 / H800: 132 SMs (NVIDIA H100 datasheet); the shipped forward kernel
# hard-codes this grid, and it is the weight-gradient kernel's default.
DEFAULT_NUM_SMS = 132
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# XLA:CPU flag an interpreting process needs (see the module docstring).
INTERPRET_XLA_FLAGS = "--xla_cpu_use_fusion_emitters=false"
ALIGN = 64  # K and N must be multiples of this (the smallest tile the choice below uses)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """One kernel launch's tiling (the arguments of JAX's ragged-dot kernels).

    Attributes:
      block_m, block_n, block_k: the output tile ``block_m x block_n`` and the contraction
        step ``block_k`` (for the weight gradient, ``block_k`` runs over the tokens).
      max_concurrent_steps: pipeline depth (TMA loads in flight per SM).
      grid_block_n: output column tiles walked together by the persistent grid's snake.
    """

    block_m: int
    block_n: int
    block_k: int
    max_concurrent_steps: int
    grid_block_n: int

    def kwargs(self) -> dict:
        return dataclasses.asdict(self)


_TILE_LOG: Dict[Tuple, Tiles] = {}


def _largest_divisor(n: int, options=(8, 4, 2, 1)) -> int:
    return next(o for o in options if n % o == 0)


def choose_tiles(op: str, m: int, k: int, n: int, groups: int) -> Tiles:
    """The tiling for one pass, by shape (float16 and bfloat16 alike: 2-byte operands).

    The rule, from the search spaces of JAX's own tuning scripts (``main`` in
    ``ragged_dot_mgpu.py``: block_m/n in 64..192, block_k 64, 2..6 steps;
    ``transposed_ragged_dot_mgpu.py``: block_m/n/k in 64/128, 1..6 steps):

    * output tile 128 wide where the dimension is a multiple of 128, else 64 (a WGMMA
      warpgroup's M is 64, so 64 is the smallest tile);
    * for ``"fwd"``/``"dx"``, ``block_m`` 128 when a group averages at least 128 rows,
      else 64: a group pays for at most one partial tile at each end;
    * ``block_k`` 64: 128 bytes of a 2-byte dtype, the widest TMA swizzle;
    * 4 pipeline stages: ``4 x (128 x 64 + 64 x 128) x 2`` bytes = 128 KiB of shared
      memory plus a 32 KiB output tile, inside Hopper's 227 KiB per SM;
    * ``grid_block_n`` the largest of 8, 4, 2, 1 dividing the column tiles.

    Not autotuned: benchmarks/gpu_suite.py times the choice on a GPU.

    Args:
      op: ``"fwd"`` (``[m, k] x [g, k, n]``), ``"dx"`` (``[m, k] x [g, n, k]^T``, output
        ``[m, n]``) or ``"dw"`` (``[k, m]^T x [k, n]`` ragged along the ``k`` tokens, output
        ``[g, m, n]``).
      m, k, n: the pass's dimensions as the kernel names them.
      groups: G.

    Raises:
      ValueError: an unknown ``op``, or a dimension the kernels cannot tile.
    """
    if op not in ("fwd", "dx", "dw"):
        raise ValueError(f"op={op!r}; allowed: fwd, dx, dw")

    def wide(d, what):
        if d % ALIGN:
            raise ValueError(f"grouped GEMM {op}: {what}={d} must be a multiple of {ALIGN}")
        return 128 if d % 128 == 0 else 64

    block_n = wide(n, "n")
    if op == "dw":
        block_m, block_k = wide(m, "m"), 64
    else:
        wide(k, "k")
        block_m, block_k = (128 if m >= 128 * max(groups, 1) else 64), 64
    return Tiles(block_m, block_n, block_k, 4, _largest_divisor(n // block_n))


def tile_choices() -> Dict[Tuple, Tiles]:
    """Every tiling used so far in this process: ``(op, m, k, n, groups, dtype) -> Tiles``."""
    return dict(_TILE_LOG)


def _record(op, m, k, n, g, dtype) -> Tiles:
    tiles = choose_tiles(op, m, k, n, g)
    _TILE_LOG[(op, m, k, n, g, jnp.dtype(dtype).name)] = tiles
    return tiles


def support(dtype, k: int, n: int) -> Tuple[bool, str]:
    """Whether :func:`grouped_matmul` takes ``x [M, k]`` in ``dtype`` times ``w [G, k, n]``.

    Returns:
      ``(supported, reason)``; the reason names the first condition that fails.
    """
    dtype = jnp.dtype(dtype)
    if dtype not in _DTYPES:
        return False, (f"the grouped GEMM kernel takes float16/bfloat16 operands; the experts "
                       f"compute in {dtype.name}")
    for name, d in (("d_in", k), ("d_out", n)):
        if d % ALIGN:
            return False, f"the grouped GEMM kernel needs {name}={d} to be a multiple of {ALIGN}"
    return True, "supported"


def _kernels():
    # Imported lazily: Pallas' Mosaic GPU modules are only needed when a kernel is traced.
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    return ragged_dot_mgpu


def _forward(x, w, group_sizes, transpose_rhs, op):
    m, k = x.shape
    n = w.shape[1] if transpose_rhs else w.shape[2]
    tiles = _record(op, m, k, n, w.shape[0], x.dtype)
    return _kernels().ragged_dot(x, w, group_sizes=group_sizes, transpose_rhs=transpose_rhs,
                                 **tiles.kwargs())


def _zero_past_end(y, group_sizes):
    rows = jax.lax.broadcasted_iota(jnp.int32, (y.shape[0], 1), 0)
    return jnp.where(rows < jnp.sum(group_sizes), y, jnp.zeros((), y.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped(x, w, group_sizes, num_sms):
    return _zero_past_end(match_varying(_forward(x, w, group_sizes, False, "fwd"), x, w,
                                        group_sizes),
                          group_sizes)


def _grouped_fwd(x, w, group_sizes, num_sms):
    return _grouped(x, w, group_sizes, num_sms), (x, w, group_sizes)


def _grouped_bwd(num_sms, res, dy):
    x, w, group_sizes = res
    dy = dy.astype(x.dtype)
    dx = _zero_past_end(match_varying(_forward(dy, w, group_sizes, True, "dx"), x), group_sizes)
    m, k = x.shape
    n = dy.shape[1]
    tiles = _record("dw", k, m, n, w.shape[0], x.dtype)
    dw = _transposed_ragged_dot(x, dy, group_sizes=group_sizes, num_sms=num_sms, **tiles.kwargs())
    dw = match_varying(dw.astype(w.dtype), w)
    return dx, dw, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                   num_sms: Optional[int] = None) -> jax.Array:
    """``jax.lax.ragged_dot(x, w, group_sizes)`` by the Mosaic GPU kernels, differentiable.

    Args:
      x: ``[M, K]`` float16/bfloat16, rows sorted by group.
      w: ``[G, K, N]`` in ``x``'s dtype.
      group_sizes: int ``[G]``, rows per group (zeros allowed), summing to at most ``M``.
      num_sms: the target GPU's SM count, the weight-gradient kernel's persistent grid
        (default :data:`DEFAULT_NUM_SMS`; the forward kernel's grid is fixed at 132 by JAX).

    Returns:
      ``[M, N]`` in ``x.dtype``, float32-accumulated; rows past ``sum(group_sizes)`` are 0.
      Gradients: ``dx`` ``[M, K]`` and ``dw`` ``[G, K, N]``, float32-accumulated in the
      kernel and returned in the operands' dtype (as ``ragged_dot``'s gradients are).

    Raises:
      ValueError: dtypes or shapes the kernels do not take (:func:`support`).
    """
    x, w = jnp.asarray(x), jnp.asarray(w)
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_matmul needs x [M, K] and w [G, K, N], got "
                         f"{x.shape} and {w.shape}")
    if x.dtype != w.dtype:
        raise ValueError(f"grouped_matmul needs x and w in one dtype, got {x.dtype} and {w.dtype}")
    ok, reason = support(x.dtype, w.shape[1], w.shape[2])
    if not ok:
        raise ValueError(reason)
    if jnp.shape(group_sizes) != (w.shape[0],):
        raise ValueError(f"group_sizes must be [G] = [{w.shape[0]}], got {jnp.shape(group_sizes)}")
    return _grouped(x, w, jnp.asarray(group_sizes, jnp.int32), int(num_sms or DEFAULT_NUM_SMS))


@contextlib.contextmanager
def interpret_mode():
    """A context in which Mosaic GPU kernels traced inside it run on the CPU (interpret mode).

    Uses ``jax._src.pallas.mosaic_gpu.interpret.params`` (``force_gpu_interpret_mode``,
    ``InterpretGPUParams``): jax 0.10.2 has no public spelling (checked against
    :data:`INTERPRET_PINNED_JAX` by tests/test_grouped_gemm.py). Out-of-bounds reads give
    zeros, as a TMA load past a tensor's end does on the GPU (the kernels rely on it for
    ``M`` not a multiple of the tile); every other simulated check stays on.

    jax 0.10.2's interpreter cannot run a WGMMA whose shared-memory operand is a
    ``plgpu.transpose_ref`` view (``AttributeError: 'TransposeTransform' object has no
    attribute 'indices'``), which both ``dx`` (``transpose_rhs``) and ``dw`` use. Inside
    the context its ``wgmma`` callback is replaced by :func:`_interpret_wgmma`, the same
    computation that also reads a trailing transpose of an operand's view; restored on exit.
    Nor can it run ``plgpu.layout_cast`` (a register-layout hint, the identity on values,
    which ``dw`` uses): it is given the identity as its CPU lowering inside the context
    (``mlir._platform_specific_lowerings``, jax 0.10.2's table of them). On exit the
    process is as it was: the ``wgmma`` callback and the CPU lowering table are put back
    (a lowering present before is restored, one added here removed), and the interpret
    flag is reset by JAX's own context manager.

    Raises:
      ImportError: this jax has no such module (a jax other than the pinned one).
    """
    from jax._src.interpreters import mlir
    from jax._src.pallas.mosaic_gpu import core as gpu_core
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, params

    cpu_lowerings = mlir._platform_specific_lowerings["cpu"]
    missing = object()
    lowering = cpu_lowerings.get(gpu_core.layout_cast_p, missing)
    original = gpu_callbacks.wgmma
    mlir.register_lowering(gpu_core.layout_cast_p, lambda ctx, x, **_: [x], platform="cpu")
    gpu_callbacks.wgmma = _interpret_wgmma
    try:
        with params.force_gpu_interpret_mode(params.InterpretGPUParams(
                out_of_bounds_reads="uninitialized", uninitialized_memory="zero")):
            yield
    finally:
        gpu_callbacks.wgmma = original
        if lowering is missing:
            cpu_lowerings.pop(gpu_core.layout_cast_p, None)
        else:
            cpu_lowerings[gpu_core.layout_cast_p] = lowering


def _interpret_wgmma(*, token, device_id, grid_point_coords, thread_id,
                     acc_allocation_key_as_array, acc_transforms, acc_dtype,
                     a_allocation_key_as_array, a_transforms, b_allocation_key_as_array,
                     b_transforms, source_info=None):
    """jax 0.10.2's ``gpu_callbacks.wgmma`` (interpret mode), plus transposed operands.

    ``acc += a @ b`` on the simulated shared memory; an operand whose transforms end in a
    ``TransposeTransform`` (``plgpu.transpose_ref``) is read through the transforms
    before it and then transposed. Any other placement of a transpose raises.
    """
    import numpy as np
    from jax._src.pallas.mosaic.interpret import utils as interpret_utils
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as cb
    from jax._src.state import types as state_types

    device_id, thread_id = int(device_id), int(thread_id)
    grid_point_coords = tuple(int(v) for v in grid_point_coords)
    shared_memory = cb._get_shared_memory()
    global_thread_id = shared_memory.get_global_thread_id(device_id, thread_id)
    info = interpret_utils.GPULoggingInfo(device_id=device_id, grid_point_coords=grid_point_coords,
                                          thread_id=thread_id, source_info=source_info)

    def read(key_array, transforms):
        transforms = cb._remove_noop_transforms(transforms)
        perm = None
        if transforms and isinstance(transforms[-1], state_types.TransposeTransform):
            perm, transforms = transforms[-1].permutation, transforms[:-1]
        if any(isinstance(t, state_types.TransposeTransform) for t in transforms):
            raise NotImplementedError(f"wgmma operand transforms {transforms}: a transpose "
                                      f"before an indexer is not interpreted")
        transforms = jax.tree.map(int, transforms)
        value, _, _ = shared_memory.get_buffer_content(
            cb.HostAllocationKey.from_array(key_array), interpret_utils.to_range(transforms),
            global_thread_id, logging_info=info)
        assert value is not None
        return value if perm is None else np.transpose(value, perm)

    a = read(a_allocation_key_as_array, a_transforms)
    b = read(b_allocation_key_as_array, b_transforms)
    acc_key = cb.HostAllocationKey.from_array(acc_allocation_key_as_array)
    acc_range = interpret_utils.to_range(
        jax.tree.map(int, cb._remove_noop_transforms(acc_transforms)))
    acc, _, _ = shared_memory.get_buffer_content(acc_key, acc_range, global_thread_id,
                                                 logging_info=info)
    shared_memory.store_buffer_content(acc_key, acc_range, acc + np.matmul(a, b, dtype=acc_dtype),
                                       global_thread_id, logging_info=info)
    return token


# --- Weight-gradient kernel --------------------------------------------------------------
# Copied from jax 0.10.2, jax/experimental/pallas/ops/gpu/transposed_ragged_dot_mgpu.py
# (Copyright 2025 The JAX Authors, Apache License 2.0), reformatted. One line differs: JAX's
# ``num_sms = jax.devices()[0].core_count`` (its line 192) is the keyword argument
# ``num_sms`` here. JAX's function takes no SM count, and that line reads the host's first
# device, a CPU without ``core_count`` in a deviceless compile and in interpret mode, while
# the grid must match the compile target's SMs. tests/test_grouped_gemm_copy.py compares the
# two syntax trees, so any other difference (or a change in a new jax) fails a test.

def _transposed_ragged_dot(lhs, rhs, *, group_sizes, block_m: int, block_n: int, block_k: int,
                           max_concurrent_steps: int, grid_block_n: int, num_sms: int):
    """``[K, M]^T x [K, N]`` ragged along K by ``group_sizes`` -> ``[G, M, N]`` (lhs dtype)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax import lax

    if lhs.dtype != rhs.dtype:
        raise NotImplementedError(
            f"lhs and rhs must have the same dtype, got {lhs.dtype} and {rhs.dtype}")
    k, m = lhs.shape
    k2, n = rhs.shape
    g = group_sizes.shape[0]
    if k != k2:
        raise ValueError(f"lhs.shape={k} must match rhs.shape={k2}")
    if m % block_m != 0:
        raise ValueError(f"m={m} must be a multiple of block_m={block_m}")
    if n % block_n != 0:
        raise ValueError(f"n={n} must be a multiple of block_n={block_n}")

    group_sizes = group_sizes.astype(int)
    group_starts = jnp.concatenate(
        [jnp.zeros(1, dtype=int), jnp.cumsum(group_sizes)[:-1]]).astype(int)
    group_ends = jnp.cumsum(group_sizes)
    group_block_starts = group_starts // block_k * block_k
    group_block_ends = -(group_ends // -block_k) * block_k
    group_num_blocks = (group_block_ends - group_block_starts) // block_k

    swizzle = plgpu.find_swizzle(block_k * jnp.dtype(lhs.dtype).itemsize * 8)
    swizzle_elems = swizzle // jnp.dtype(lhs.dtype).itemsize
    transforms = (plgpu.TilingTransform((8, swizzle_elems)), plgpu.SwizzleTransform(swizzle))

    def body(group_sizes_gmem, group_starts_gmem, group_ends_gmem, group_num_blocks_gmem,
             group_block_starts_gmem, lhs_gmem, rhs_gmem, o_gmem):
        grid_m = pl.cdiv(m, block_m)
        grid_n = pl.cdiv(n, block_n)

        @plgpu.nd_loop((g, grid_m * grid_n), collective_axes="sm")
        def mn_loop(loop_info: plgpu.NDLoopInfo):
            g_i = loop_info.index[0]
            m_i, n_i = plgpu.planar_snake(loop_info.index[1], (grid_m, grid_n), 1, grid_block_n)
            # Potentially out of bounds, but the pipeline never reads the part past K.
            group_block_start = pl.multiple_of(group_block_starts_gmem[g_i], block_k)
            gmem_slice = pl.ds(group_block_start, k)

            def acc_scope(acc_ref):
                def block_matmul(block_idx, lhs_smem, rhs_smem):
                    block_idx = block_idx[0]

                    @pl.when(block_idx == 0)
                    def _():
                        # The group's first block may start with the previous group's rows.
                        lhs_reg = lhs_smem[...]
                        start_index = lax.rem(group_starts_gmem[g_i], block_k)
                        indices = plgpu.layout_cast(
                            jax.lax.broadcasted_iota(jnp.int32, (block_k, block_m), 0),
                            plgpu.Layout.WGMMA)
                        lhs_mask = (indices >= start_index).astype(lhs_smem.dtype)
                        lhs_reg = lhs_reg * lhs_mask
                        lhs_smem[...] = lhs_reg
                        plgpu.commit_smem()

                    @pl.when(block_idx == group_num_blocks_gmem[g_i] - 1)
                    def _():
                        # The group's last block may end with the next group's rows.
                        lhs_reg = lhs_smem[...]
                        last_index = lax.rem(group_ends_gmem[g_i] - 1, block_k)
                        indices = plgpu.layout_cast(
                            jax.lax.broadcasted_iota(jnp.int32, (block_k, block_m), 0),
                            plgpu.Layout.WGMMA)
                        lhs_mask = (indices <= last_index).astype(lhs_smem.dtype)
                        lhs_reg = lhs_reg * lhs_mask
                        lhs_smem[...] = lhs_reg
                        plgpu.commit_smem()

                    plgpu.wgmma(acc_ref, plgpu.transpose_ref(lhs_smem, (1, 0)), rhs_smem)
                    if max_concurrent_steps == 1:
                        # Without delayed release only one smem block is in flight.
                        plgpu.wgmma_wait(0)

                @pl.when(group_sizes_gmem[g_i] > 0)  # an empty group keeps its zero tile
                def _():
                    plgpu.emit_pipeline(
                        block_matmul,
                        grid=(group_num_blocks_gmem[g_i],),
                        in_specs=[
                            plgpu.BlockSpec((block_k, block_m), lambda k_i: (k_i, m_i),
                                            delay_release=1 if max_concurrent_steps > 1 else 0,
                                            transforms=transforms),
                            plgpu.BlockSpec((block_k, block_n), lambda k_i: (k_i, n_i),
                                            delay_release=1 if max_concurrent_steps > 1 else 0,
                                            transforms=transforms),
                        ],
                        max_concurrent_steps=max_concurrent_steps,
                    )(lhs_gmem.at[gmem_slice, :], rhs_gmem.at[gmem_slice, :])

                return acc_ref[...]

            acc = pl.run_scoped(acc_scope, plgpu.ACC((block_m, block_n)))

            @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM(
                (block_m, block_n), dtype=o_gmem.dtype, transforms=transforms))
            def store_scope(o_smem):
                o_smem[...] = acc.astype(o_smem.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[
                    g_i, pl.ds(m_i * block_m, block_m), pl.ds(n_i * block_n, block_n)])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    # The one difference: jax 0.10.2 has ``num_sms = jax.devices()[0].core_count`` here.
    compiler_params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((g, m, n), lhs.dtype),
        grid=(num_sms,),
        grid_names=("sm",),
        compiler_params=compiler_params,
    )
    return kernel(group_sizes, group_starts, group_ends, group_num_blocks, group_block_starts,
                  lhs, rhs)
