"""Data-parallel gradient collectives in a chosen dtype, optionally top-k compressed.

Collectives only: every function here runs *inside* ``jax.shard_map`` over the mesh's
data axis and calls ``psum`` / ``all_gather`` on ``axis_name``. The trainer's step
(:func:`jaxmp.train.step.make_train_step`) runs the forward and backward pass per device
in ``shard_map`` and hands each device's gradients to :func:`exchange_gradients`, so the
compiled program exchanges exactly what was asked for, float32 included:

* **dense** (``grad_reduce_dtype`` float32, bfloat16 or float16): each device divides its
  gradient by the number of devices N, casts it, and ``psum`` s it; the mean is cast
  back to float32 before the optimizer. A 16-bit dtype sends two bytes per element
  instead of four (a DeepSeek mixed-precision write-up, section 2.3: "FP16 gradients
  halve communication"; see :func:`jaxmp.analysis.article.communication_table`).
* **top-k with error feedback** (``grad_compression="topk"``): each device adds its
  residual to its gradient, keeps the ``topk_ratio`` largest magnitudes per leaf, sends
  them as values (in ``grad_reduce_dtype``) plus int32 indices by ``all_gather``, and
  keeps what it did not send as the next step's residual. Every device scatter-adds all
  devices' values into a dense float32 gradient and divides by N. Deep Gradient
  Compression (Lin et al. 2018, section 2) and "Sparsified SGD with memory" (Stich et
  al. 2018, Algorithm 1) for the residual ("memory"): without it the dropped 70% of
  every step would be lost for good.

And the expert-parallel dispatch in FP8 (:func:`fp8_all_to_all`, ``jaxmp.fp8.all_to_all``):
E4M3 values plus 1x128-tile scales on the wire.

Byte counting note: XLA's CPU backend widens 16-bit collectives to float32 while
compiling (``all-reduce-promotion`` for bfloat16/float16 all-reduces, bf16 float
normalization for bfloat16 all-gathers; float16 all-gathers stay float16), so on CPU
read the exchanged dtypes from the HLO *before* backend optimization
(``jax.jit(f).lower(...).compiler_ir("hlo").as_hlo_text()``), or compile for GPU,
where NCCL reduces and gathers bfloat16/float16 natively.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmp._checks import Choice, Kind, Real, check, check_choice, check_float, check_int
from jaxmp.precision._fp8.quant import BLOCK, E4M3, quantize_blocks
from jaxmp.precision._paths import leaf_names
from jaxmp.precision._vma import as_axes
from jaxmp.precision.loss_scale import LossScale
from jaxmp.precision.policy import canonical_dtype

__all__ = [
    "TOPK_RATIO",
    "DISPATCH_DTYPES",
    "DEFAULT_DISPATCH_DTYPE",
    "DATA_AXIS",
    "REDUCE_DTYPES",
    "COMPRESSIONS",
    "check_comm_config",
    "topk_count",
    "init_comm_state",
    "LeafReduce",
    "reduce_gradients",
    "gather_param",
    "topk_compress",
    "topk_allgather_mean",
    "exchange_gradients",
    "fp8_all_to_all",
]

# The mesh axis gradients are averaged over (jaxmp.sharding.make_mesh's default).
DATA_AXIS = "data"
REDUCE_DTYPES = ("float32", "bfloat16", "float16")
COMPRESSIONS = ("none", "topk")



# The fraction of each gradient leaf top-k compression sends per step: the DeepSeek
# mixed-precision article's (section 2.3), declared once here (precision.topk_ratio's
# default, jaxmp.train.step.GradExchange's, the accounting report's topk mode).
TOPK_RATIO = 0.3

# The dtype of the tokens the expert-parallel all-to-all sends (parallel.dispatch_dtype):
# the compute dtype as it is (the default), or E4M3 with 1x128 tile scales
# (:func:`fp8_all_to_all`). Declared here, with the collective; the models and the
# layouts read it.
DISPATCH_DTYPES = ("compute", "e4m3")
DEFAULT_DISPATCH_DTYPE = DISPATCH_DTYPES[0]


def _is_reduce_dtype(value: Any) -> bool:
    dtype = canonical_dtype(value)
    return dtype is not None and dtype.name in REDUCE_DTYPES


# The specs of the settings (jaxmp._checks), declared once with their tables: the checks
# below, jaxmp.sharding.layout and the run-config table (jaxmp.train.keys) read them.
REDUCE_DTYPE = Kind(_is_reduce_dtype, f"{', '.join(REDUCE_DTYPES)} (or a short form such as "
                                      f"bf16)")
COMPRESSION = Choice(COMPRESSIONS, " or ".join(COMPRESSIONS))
TOPK_RATIO_RANGE = Real(0.0, 1.0, lo_open=True)
DISPATCH_DTYPE = Choice(DISPATCH_DTYPES, " or ".join(DISPATCH_DTYPES))


def _reduce_dtype(value: Any) -> jnp.dtype:
    if not REDUCE_DTYPE.ok(value):
        raise ValueError(f"unknown grad_reduce_dtype {value!r}; allowed: {REDUCE_DTYPE.allowed}")
    return canonical_dtype(value)


def check_comm_config(grad_reduce_dtype: Any = "float32", grad_compression: str = "none",
                      topk_ratio: float = TOPK_RATIO) -> jnp.dtype:
    """Validates the communication settings before any work is done.

    Args:
      grad_reduce_dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` (short forms such
        as ``"bf16"`` and dtype objects are accepted).
      grad_compression: ``"none"`` or ``"topk"``.
      topk_ratio: fraction of each leaf's elements sent per step, in (0, 1] (the DeepSeek
        mixed-precision article uses 0.3).

    Returns:
      The reduction dtype as a ``jnp.dtype``.

    Raises:
      ValueError: an unknown dtype or compression, or ``topk_ratio`` outside (0, 1];
        the message names the bad value and what is allowed.
    """
    dtype = _reduce_dtype(grad_reduce_dtype)
    if not COMPRESSION.ok(grad_compression):
        raise ValueError(f"unknown grad_compression {grad_compression!r}; allowed: "
                         f"{COMPRESSION.allowed}")
    check("topk_ratio", topk_ratio, TOPK_RATIO_RANGE)
    return dtype


def topk_count(size: int, ratio: float) -> int:
    """Elements kept out of ``size``: ``round(ratio * size)``, at least 1, at most ``size``.

    Rounded to nearest rather than up: ``0.3 * 10`` is ``3.0000000000000004`` in binary
    floating point, and a ceiling would keep 4.
    """
    return int(min(size, max(1, round(ratio * size))))


def init_comm_state(params: Any, num_devices: int, compression: str = "none") -> Optional[dict]:
    """The communication part of the train state.

    Args:
      params: the master parameters (an ``nnx.State`` or any pytree of arrays).
      num_devices: devices N of the data axis.
      compression: ``"none"`` or ``"topk"``.

    Returns:
      None for ``"none"``. For ``"topk"``: ``{"residual": tree}``, the error-feedback
      memory as a plain nested dict with ``params``' keys (``nnx.to_pure_dict`` layout),
      each leaf float32 zeros of shape ``[N, *param.shape]`` (NumPy's; jax's where
      ``params`` are traced, under ``jit`` or ``eval_shape``): row i belongs to device i
      (the trainer shards it over the data axis: :func:`jaxmp.train.state.train_state_shardings`).
      The residual is in unscaled gradient units, so a changing loss scale does not corrupt it.

    Raises:
      ValueError: unknown ``compression`` or ``num_devices`` < 1.
    """
    check_choice("grad_compression", compression, COMPRESSIONS)
    num_devices = check_int("num_devices", num_devices, 1)
    if compression == "none":
        return None
    tree = nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params
    # NumPy: host zeros to be device_put onto their shardings, no compile per shape. Traced
    # (under jit or eval_shape): jax zeros, abstract or laid out by the caller's shardings;
    # host zeros would be allocated whole (48 GiB for configs/seed_moe.py on 8 devices).
    def zeros(p):
        shape = (int(num_devices),) + tuple(p.shape)
        return (jnp.zeros(shape, jnp.float32) if isinstance(p, jax.core.Tracer)
                else np.zeros(shape, np.float32))
    return {"residual": jax.tree.map(zeros, tree)}


class LeafReduce(NamedTuple):
    """How one gradient leaf is reduced across devices, inside ``shard_map``.

    Attributes:
      sum_axes: mesh axes the leaf is summed over whole (all-reduce).
      scatter_axis: a mesh axis the leaf is reduce-scattered over (ZeRO), or None.
      scatter_dim: the leaf's dimension split by the reduce-scatter (tiled: each device
        keeps its ``1/size`` slice of it).
      divided: True when the leaf was already divided by the device count (and partly
        reduced) on its way here, by :func:`gather_param`'s backward pass.
    """

    sum_axes: Tuple[str, ...] = ()
    scatter_axis: Optional[str] = None
    scatter_dim: int = 0
    divided: bool = False


def reduce_gradients(grads: Any, layouts: Any, total_devices: int, dtype: Any = jnp.float32) -> Any:
    """The mean over all devices of each leaf, summed in ``dtype`` by its layout; inside
    ``shard_map``.

    Each device computes ``cast(g / total_devices, dtype)``; the leaf is reduce-scattered
    over ``scatter_axis`` (``jax.lax.psum_scatter``, tiled) and all-reduced over
    ``sum_axes`` (``jax.lax.psum``), in ``dtype``, then cast to float32. Dividing *before*
    the sum keeps float16 finite: N values each below 65504 (float16's largest) can sum
    past it, N values each below 65504/N cannot, and their sum is the mean itself. For a
    power-of-two N the division is exact in every dtype (barring subnormals); leave the
    loss scale on the gradients when reducing in float16, so that small values stay above
    float16's subnormal range, and unscale the float32 result. A leaf with an empty
    layout is only divided: it was already summed (e.g. by the transpose of an
    all-gather).

    Args:
      grads: a pytree of per-device floating arrays (the gradient of each device's own
        mean loss).
      layouts: a pytree of :class:`LeafReduce` with ``grads``' structure.
      total_devices: the devices whose losses are averaged (every device of the mesh).
      dtype: the dtype of the exchanged values and of the sums.

    Returns:
      The tree of float32 reduced leaves (scattered ones keep their slice).
    """
    dtype = jnp.dtype(dtype)

    def one(g, layout):
        x = (g.astype(jnp.float32) / (1 if layout.divided else total_devices)).astype(dtype)
        if layout.scatter_axis is not None:
            x = jax.lax.psum_scatter(x, layout.scatter_axis, scatter_dimension=layout.scatter_dim,
                                     tiled=True)
        if layout.sum_axes:
            x = jax.lax.psum(x, tuple(layout.sum_axes))
        return x.astype(jnp.float32)

    return jax.tree.map(one, grads, layouts, is_leaf=lambda x: isinstance(x, LeafReduce))


def gather_param(x: jax.Array, axis_name: str, dim: int, dtype: Any,
                 reduce_dtype: Any = jnp.float32,
                 total_devices: int = 1) -> jax.Array:
    """FSDP: the whole parameter from this device's slice, in ``dtype``; inside ``shard_map``.

    Forward: ``all_gather`` of ``x.astype(dtype)`` over ``axis_name`` along ``dim``
    (tiled), so the compute dtype crosses the wire, not float32. Backward (ZeRO-3's
    reduce-scatter): the cotangent is divided by ``total_devices``, cast to
    ``reduce_dtype``, reduce-scattered over ``axis_name`` back to the slice, and cast to
    ``x.dtype``: the slice's share of the gradient of the mean loss, summed over the axis
    (mark it ``LeafReduce(divided=True)`` for :func:`reduce_gradients`).

    Args:
      x: this device's slice of the (float32 master) parameter.
      axis_name: the mesh axis the parameter is split over.
      dim: the split dimension.
      dtype: the compute dtype to gather in.
      reduce_dtype: the dtype of the reduce-scatter.
      total_devices: the devices whose mean loss is differentiated.
    """
    return _gather_param(x, axis_name, int(dim), jnp.dtype(dtype), jnp.dtype(reduce_dtype),
                         int(total_devices))


# A custom JVP: the tangent rule is linear and its transpose is the backward pass: cast
# to float32, divide by ``total``, cast to ``reduce_dtype``, reduce-scatter (the
# transpose of a tiled all-gather), cast back. Under ``jax.checkpoint`` the call is one
# ``custom_jvp_call`` whose output a policy may save or recompute; the FSDP step's
# policy (``jaxmp.sharding.fsdp_checkpoint_policy``) never saves it, so the backward pass
# gathers the weight again instead of keeping it whole from the forward pass.
@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3, 4, 5))
def _gather_param(x, axis_name, dim, dtype, reduce_dtype, total):
    return jax.lax.all_gather(x.astype(dtype), axis_name, axis=dim, tiled=True)


@_gather_param.defjvp
def _gather_param_jvp(axis_name, dim, dtype, reduce_dtype, total, primals, tangents):
    (x,), (t,) = primals, tangents
    out = _gather_param(x, axis_name, dim, dtype, reduce_dtype, total)
    t = jax.lax.all_gather(t.astype(reduce_dtype), axis_name, axis=dim, tiled=True)
    return out, (t.astype(jnp.float32) / total).astype(dtype)


def _topk_leaf(x: jax.Array, ratio: float, dtype) -> Tuple[jax.Array, jax.Array, jax.Array]:
    flat = x.reshape(-1).astype(jnp.float32)
    k = topk_count(flat.size, ratio)
    # NaN's place in lax.top_k's order is backend-defined; rank non-finite entries last
    # so the choice is well-defined. The finiteness flag, not top-k, handles them.
    key = jnp.where(jnp.isfinite(flat), jnp.abs(flat), -1.0)
    _, idx = jax.lax.top_k(key, k)
    values = flat[idx].astype(dtype)
    # Feed back the rounding of the cast too: the residual is what was not delivered.
    sent = jnp.zeros_like(flat).at[idx].set(values.astype(jnp.float32))
    return values, idx.astype(jnp.int32), (flat - sent).reshape(x.shape)


def topk_compress(grads: Any, residual: Any, ratio: float, dtype: Any = jnp.float32):
    """Top-k by magnitude per leaf with error feedback (Stich et al. 2018, Algorithm 1).

    Per leaf, on one device: ``acc = residual + grad`` (float32), ``idx`` = the
    ``k = topk_count(acc.size, ratio)`` positions of the largest ``|acc|`` in the
    flattened leaf (non-finite entries rank last), ``values = cast(acc[idx], dtype)``,
    ``new_residual = acc - scatter(values)``: zero at the sent positions (up to the
    rounding of the cast, which is fed back too, so a value that float16 flushes to
    zero is kept, not lost), ``acc`` elsewhere. The sum over devices is float32, so
    top-k needs no pre-division.

    Args:
      grads: a pytree of float arrays (unscaled gradients).
      residual: float32 pytree with ``grads``' leaf paths and shapes (e.g. the plain
        dict ``nnx.to_pure_dict`` makes of an ``nnx.State`` of gradients); its own
        structure is kept.
      ratio: fraction kept, in (0, 1].
      dtype: the dtype of the values sent.

    Returns:
      ``(values, indices, new_residual)``: lists over the leaves of ``[k]`` arrays in
      ``dtype`` and ``[k]`` int32 flat indices, and the residual tree.

    Raises:
      ValueError: ``ratio`` outside (0, 1] or an unknown ``dtype`` (as
        :func:`check_comm_config`); the leaf paths (``.value`` of nnx variables aside)
        or shapes of ``grads`` and ``residual`` differ.
    """
    dtype = check_comm_config(dtype, "topk", ratio)
    g_leaves = jax.tree.leaves(grads)
    r_leaves, r_def = jax.tree.flatten(residual)
    g_paths, r_paths = leaf_names(grads), leaf_names(residual)
    if g_paths != r_paths:
        raise ValueError(f"the residual does not match the gradients leaf by leaf: gradient paths "
                         f"{g_paths[:3]}... vs residual paths {r_paths[:3]}...")
    out_v, out_i, out_r = [], [], []
    for g, r in zip(g_leaves, r_leaves):
        if jnp.shape(g) != jnp.shape(r):
            raise ValueError(f"gradient of shape {jnp.shape(g)} for a residual of shape "
                             f"{jnp.shape(r)}")
        v, i, nr = _topk_leaf(r.astype(jnp.float32) + g.astype(jnp.float32), ratio, dtype)
        out_v.append(v)
        out_i.append(i)
        out_r.append(nr)
    return out_v, out_i, jax.tree.unflatten(r_def, out_r)


def topk_allgather_mean(values: list, indices: list, like: Any, axis_name: str = DATA_AXIS) -> Any:
    """All devices' sparse values -> the dense float32 mean gradient; inside ``shard_map``.

    ``all_gather`` of each leaf's values (their dtype kept on the wire) and int32 indices
    over ``axis_name``, a float32 scatter-add of the N lists into zeros, then ``/ N``.

    Args:
      values, indices: as returned by :func:`topk_compress`.
      like: a pytree whose leaves give the dense shapes (e.g. the gradients).
      axis_name: the mesh axis.

    Returns:
      A tree like ``like`` of float32 arrays, identical on every device.
    """
    leaves, treedef = jax.tree.flatten(like)
    n = jax.lax.axis_size(axis_name)
    all_v = jax.lax.all_gather(values, axis_name, to="invarying")
    all_i = jax.lax.all_gather(indices, axis_name, to="invarying")
    dense = [jnp.zeros(jnp.size(x), jnp.float32)
             .at[i.reshape(-1)].add(v.reshape(-1).astype(jnp.float32))
             .reshape(jnp.shape(x)) / n for x, v, i in zip(leaves, all_v, all_i)]
    return jax.tree.unflatten(treedef, dense)


def exchange_gradients(grads: Any, loss_scale: LossScale, comm_state: Optional[dict], *,
                       axis_name: str = DATA_AXIS, grad_reduce_dtype: Any = "float32",
                       grad_compression: str = "none", topk_ratio: float = TOPK_RATIO):
    """Per-device scaled gradients -> the float32 unscaled mean over ``axis_name``.

    Inside ``shard_map``. Dense: :func:`reduce_gradients` (every leaf all-reduced over
    ``axis_name``) of the *scaled* gradients in ``grad_reduce_dtype`` (the loss scale
    protects float16's small values on the wire too), then unscaled in float32. Top-k:
    unscale in float32, :func:`topk_compress` with this device's residual,
    :func:`topk_allgather_mean`. A value that overflows the reduction dtype arrives as
    inf and fails the caller's finiteness check.

    Args:
      grads: this device's gradients of the loss times ``loss_scale``.
      loss_scale: the :class:`jaxmp.LossScale` used.
      comm_state: this device's slice of :func:`init_comm_state` (residual leaves with
        the gradients' shapes); None without compression.
      axis_name, grad_reduce_dtype, grad_compression, topk_ratio: see
        :func:`check_comm_config`.

    Returns:
      ``(mean_grads, new_comm_state)``: float32 tree like ``grads``; the updated
      residual (or None). The caller keeps the old residual on a skipped step.

    Raises:
      ValueError: bad settings (see :func:`check_comm_config`), or top-k without a
        residual.
    """
    dtype = check_comm_config(grad_reduce_dtype, grad_compression, topk_ratio)
    if grad_compression == "none":
        axes = as_axes(axis_name)
        whole = jax.tree.map(lambda _: LeafReduce(axes), grads)
        mean = reduce_gradients(grads, whole, jax.lax.axis_size(axes), dtype)
        return loss_scale.unscale(mean), comm_state
    if comm_state is None:
        raise ValueError("grad_compression='topk' needs the residual of init_comm_state(...) in "
                         "the train state (comm_state is None)")
    values, indices, residual = topk_compress(loss_scale.unscale(grads), comm_state["residual"],
                                              topk_ratio, dtype)
    return topk_allgather_mean(values, indices, grads, axis_name), {"residual": residual}


# ----------------------------------------------------------------------------- FP8 dispatch


def fp8_all_to_all(x: Any, axis_name: Any, split_axis: int, concat_axis: int) -> jax.Array:
    """``jax.lax.all_to_all`` of ``x`` sent as E4M3 with one float32 scale per 1x128 tile.

    The expert-parallel dispatch of DeepSeek-V3 (report, section 3.3.4: tokens are
    dispatched in FP8, combined in bfloat16). Each device quantizes ``x`` in 1x128 tiles
    along its last axis (:func:`quantize_blocks` with ``(1, 128)``: a scale is the tile's
    amax / 448), sends the E4M3 values and, alongside them, the scales
    (``[..., ceil(D / 128)]`` float32) by two all-to-alls, and the receiver multiplies
    them back (:func:`dequantize_blocks`) into ``x``'s dtype. Per element of a 128-wide
    row that is 1 byte plus 4/128 instead of 2 (bfloat16). The backward pass sends the
    cotangent back by the transposed all-to-all in its own dtype (the combine direction
    stays in the compute dtype) and treats the quantization as the identity
    (straight-through), as a cast would be.

    Must run where ``axis_name`` is bound (inside ``jax.shard_map``).

    Args:
      x: float array; its last axis (the model width) is tiled and must not be
        ``split_axis`` or ``concat_axis``.
      axis_name: the mesh axis (or axes) to exchange over.
      split_axis: the axis of ``x`` cut into one piece per device, sent out.
      concat_axis: the axis the received pieces are stacked along.

    Returns:
      The exchanged array, ``x``'s dtype, shaped as ``jax.lax.all_to_all`` shapes it.

    Raises:
      ValueError: a non-floating ``x``, or ``split_axis`` / ``concat_axis`` out of range
        or on the last axis.
    """
    check_float("x", x)
    x = jnp.asarray(x)
    last = x.ndim - 1
    for name, ax in (("split_axis", split_axis), ("concat_axis", concat_axis)):
        check_int(name, ax, 0, last - 1, f"an axis of x (shape {x.shape}) before its last, "
                                         f"tiled axis: an integer in [0, {last})")
    return _fp8_all_to_all(x, axis_name, int(split_axis), int(concat_axis))


def _quantize_rows(x):
    """E4M3 values and 1x128 tile scales of ``x [..., D]``:
    ``(q [..., D], s [..., ceil(D/128)])``."""
    d = x.shape[-1]
    q, s = quantize_blocks(x.reshape(-1, d), (1, BLOCK), E4M3)
    return q.reshape(x.shape), s.reshape(x.shape[:-1] + s.shape[-1:])


def _dequantize_rows(q, s, dtype):
    """The inverse of :func:`_quantize_rows`, in ``dtype``."""
    scales = s if s.shape[-1] == 1 else jnp.repeat(s, BLOCK, axis=-1)[..., :q.shape[-1]]
    return (q.astype(jnp.float32) * scales).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _fp8_all_to_all(x, axis_name, split_axis, concat_axis):
    q, s = _quantize_rows(x)
    q = jax.lax.all_to_all(q, axis_name, split_axis, concat_axis)
    s = jax.lax.all_to_all(s, axis_name, split_axis, concat_axis)
    return _dequantize_rows(q, s, x.dtype)


def _fp8_all_to_all_fwd(x, axis_name, split_axis, concat_axis):
    return _fp8_all_to_all(x, axis_name, split_axis, concat_axis), None


def _fp8_all_to_all_bwd(axis_name, split_axis, concat_axis, _, g):
    return (jax.lax.all_to_all(g, axis_name, concat_axis, split_axis),)


_fp8_all_to_all.defvjp(_fp8_all_to_all_fwd, _fp8_all_to_all_bwd)
