"""FP8 matmuls with per-tensor, delayed, per-row and DeepSeek-V3 block scaling, in pure JAX.

``jaxmp.fp8`` (this module) quantizes the operands of a matmul to an 8-bit float format,
multiplies the 8-bit values with float32 accumulation, and applies the scales to the
float32 result. A scale is ``amax / finfo(dtype).max`` (:func:`scale_from_amax`), so the
largest magnitude of the group of elements it covers lands on the format's maximum
(448 for E4M3, 57344 for E5M2) and ``q = saturate(x / scale)`` (:func:`quantize`).

The formats (OCP 8-bit floating point specification; ``jnp.float8_e4m3fn`` and
``jnp.float8_e5m2``):

* :data:`E4M3`: 4 exponent, 3 mantissa bits, max 448, smallest normal ``2**-6``,
  smallest subnormal ``2**-9``, no inf (NaN only).
* :data:`E5M2`: 5 exponent, 2 mantissa bits, max 57344, smallest normal ``2**-14``,
  smallest subnormal ``2**-16``, with inf.

The recipes (:class:`Recipe`), by how many elements share one scale:

======================== ============================ ========== ========== ===================
recipe                   scales                       forward    backward   source
======================== ============================ ========== ========== ===================
``Recipe.tensorwise()``  one per tensor, from the     E4M3       E5M2       Transformer Engine's
                         tensor's own amax (current                         current scaling,
                         scaling)                                           HYBRID format
``Recipe.delayed()``     one per tensor, from the     E4M3       E5M2       Transformer Engine's
                         max of an amax history of                          ``DelayedScaling``;
                         earlier steps                                      Flax ``fp8_ops``
``Recipe.rowwise()``     one per row of the           E4M3       E4M3       torchao's float8
                         activation / gradient, one                         ``ROWWISE`` recipe
                         per output column of the                           (without its power
                         weight                                             of two rounding)
``Recipe.blockwise()``   one per 1x128 tile of the    E4M3       E4M3       DeepSeek-V3 report,
                         activation and gradient,                           section 3.3.2
                         one per 128x128 block of
                         the weight
======================== ============================ ========== ========== ===================

"Backward" is the format of the output gradient in the two backward matmuls
(``dx = g @ w.T``, ``dw = x.T @ g``); the weight and the activation keep the forward format
there. Every product accumulates in float32. Per-tensor and per-row scales lie outside
the contraction and multiply the float32 product once. 1x128 tiles and 128x128 blocks
lie *along* the contraction, so the blockwise product is a sum over 128-wide slices of
the contraction, each an FP8 product with float32 output that is scaled and added in
float32: the "promotion to CUDA cores every 128 elements" of DeepSeek-V3 (report, section
3.3.2), which on Hopper also avoids the tensor cores' limited (about 14-bit) accumulation
in long contractions.

The backward pass of :func:`dot` (a ``jax.custom_vjp``):

* saves the activation in FP8 with its scales (DeepSeek-V3, section 3.3.3, caches the
  activations of its linear layers in FP8), never a bfloat16 copy; the weight's FP8 copy
  is not saved but quantized again from the master weight, which the backward pass has
  anyway (as :func:`jaxmp.ops.cast_matmul` recasts it);
* quantizes each operand of the two backward products with scales outside *their*
  contraction where the recipe allows: per-row recipes scale the gradient by rows for
  ``dx`` and by columns for ``dw``, and the weight by rows for ``dx``; blockwise uses the
  transposed 128x128 weight blocks for ``dx`` and 128x1 tiles of the activation and the
  gradient for ``dw``. Where a saved FP8 activation is needed with another layout (per
  column for rowwise, 128x1 tiles for blockwise) it is dequantized and quantized again,
  as DeepSeek-V3 converts its cached 1x128 tiles to 128x1 tiles (section 3.3.3).

Delayed scaling and its state. ``Recipe.delayed`` scales each tensor by the largest amax
in a history of the previous steps (Transformer Engine, Flax). The history of one
:func:`dot` is a float32 ``[3, history_length]`` array (:func:`init_state`; rows: the
activation, the weight, the output gradient; newest entry first), a pure pytree leaf
that the caller keeps (the trainer: in ``TrainState.rest``, checkpointed with it). The
gradient's amax is only known in the backward pass, so the updated history comes back
the way Flax's Linen ``fp8_ops`` return it: as the *cotangent* of the state ("overwrite
with gradient"): ``jax.grad`` with respect to the state gives its new value, which
replaces the state instead of being applied by an optimizer. Three rules follow:

* each state belongs to exactly one :func:`dot` call per forward pass: JAX adds the
  cotangents of a value used twice, and a sum of histories is meaningless;
* micro-batches of one step each return the history rolled once with their own amax;
  combine them with :func:`merge_states` (elementwise max: the newest entry becomes the
  largest micro-batch amax, case FP8-1), and devices with ``jax.lax.pmax``;
* a skipped step keeps the old state (select it, as the parameters).

Flax's Linen version makes JAX combine cotangents by max through a custom extended dtype
(``fp8_meta_dtype``, a private JAX API); jaxmp keeps plain float32 arrays and lets the
train step combine them explicitly (:mod:`jaxmp.train.step`). Under ``jax.lax.scan`` over
layers a stacked ``[layers, 3, history_length]`` state gives each layer its own slice,
and the cotangent comes back stacked: each layer keeps its own history.

:func:`matmul` takes ``jnp.einsum``-style specs and grouped (ragged) matmuls, so a model
can swap :func:`jaxmp.ops.cast_matmul` for it module by module
(:mod:`jaxmp.models.layers`).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp.precision.ops import _check_float

__all__ = [
    "E4M3",
    "E5M2",
    "BLOCK",
    "RECIPES",
    "scale_from_amax",
    "quantize",
    "dequantize",
    "quantize_blocks",
    "dequantize_blocks",
    "Recipe",
    "init_state",
    "roll_history",
    "merge_states",
    "dot",
    "grouped_dot",
    "matmul",
    "all_to_all",
]

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E5M2 = jnp.dtype(jnp.float8_e5m2)
_FORMATS = {"e4m3": E4M3, "e5m2": E5M2}
# DeepSeek-V3 (report, section 3.3.2): 1x128 tiles, 128x128 blocks, promotion every 128.
BLOCK = 128
RECIPES = ("tensorwise", "delayed", "rowwise", "blockwise")

_F32 = jnp.float32
_F32_TINY = float(np.finfo(np.float32).tiny)  # 2**-126
_SCALE_MAX = 2.0 ** 126                           # 1 / _F32_TINY: a normal reciprocal


# ----------------------------------------------------------------------------- scales


def _fp8_dtype(dtype: Any) -> jnp.dtype:
    try:
        d = jnp.dtype(dtype)
    except TypeError:
        d = None
    if d not in (E4M3, E5M2):
        raise ValueError(f"FP8 dtype {dtype!r} is not supported; allowed: float8_e4m3fn (E4M3), "
                         f"float8_e5m2 (E5M2)")
    return d


def _check_margin(margin: Any) -> int:
    if isinstance(margin, bool) or not isinstance(margin, numbers.Integral) or margin < 0:
        raise ValueError(f"margin={margin!r} must be an integer >= 0 (binades of headroom)")
    return int(margin)


def scale_from_amax(amax: Any, dtype: Any = E4M3, margin: int = 0) -> jax.Array:
    """The float32 scale that maps ``amax`` onto the format's largest value.

    ``scale = amax / finfo(dtype).max * 2**margin`` (448 for E4M3, 57344 for E5M2, as
    DeepSeek-V3's released kernels divide by 448; ``margin`` binades of headroom below the
    maximum, as Transformer Engine's ``margin``), used as ``q = saturate(x / scale)``. The
    division is computed as ``amax * float32(1 / max)`` (one float32 rounding of the
    product): XLA turns a division by a constant or a broadcast into such a product on
    some backends and not on others, so writing it out gives every backend the same bits.

    Every input gives a finite, positive, usable scale:

    * an amax that is 0, subnormal (below float32's smallest normal ``2**-126``), +-inf or
      NaN gives scale **1.0**, Transformer Engine's and Flax's initial scale: the tensor
      is then quantized unscaled (an all-zero tensor stays zero; a non-finite one stays
      non-finite, which skips the step);
    * a normal amax gives the formula, clamped to ``[2**-126, 2**126]``: neither the
      scale nor its reciprocal (which :func:`quantize` multiplies by) is ever subnormal
      (XLA:CPU, and GPUs in flush-to-zero mode, treat subnormals as 0) or inf (a huge
      amax times ``2**margin``).

    Args:
      amax: float array of any shape, the largest magnitude of each scaled group (its
        absolute value is used).
      dtype: :data:`E4M3` or :data:`E5M2`.
      margin: integer >= 0.

    Returns:
      float32 array of ``amax``'s shape.

    Raises:
      ValueError: ``dtype`` is not an FP8 format, ``margin`` is negative or not an
        integer, or ``amax`` is not floating point.
    """
    dtype = _fp8_dtype(dtype)
    margin = _check_margin(margin)
    _check_float("amax", amax)
    a = jnp.abs(jnp.asarray(amax).astype(_F32))
    usable = jnp.isfinite(a) & (a >= _F32_TINY)  # a subnormal compares below tiny either way
    inv_max = np.float32(1.0 / float(jnp.finfo(dtype).max))
    scale = jnp.clip(a * inv_max * np.float32(2.0**margin), _F32_TINY, _SCALE_MAX)
    return jnp.where(usable, scale, jnp.ones_like(scale))


def quantize(x: Any, scale: Any, dtype: Any = E4M3) -> jax.Array:
    """``q = saturate(x / scale)`` in ``dtype``: finite inputs never become inf or NaN.

    The division is ``x * float32(1 / scale)``: the reciprocal of each scale is rounded to
    float32 once and multiplies ``x`` in float32 (what XLA makes of a division by a
    broadcast scale on some backends; written out, every backend gives the same bits, and
    DeepSeek-V3's kernels multiply by the reciprocal too). Results of finite inputs beyond
    the format's maximum (an overflow of the product included) are clipped to
    ``+-finfo(dtype).max`` (448 for E4M3, 57344 for E5M2) before the round-to-nearest-even
    cast, because a plain cast turns them into NaN (E4M3, which has no inf) or inf (E5M2). Non-finite inputs stay
    non-finite: +-inf becomes +-inf in E5M2 and NaN in E4M3, NaN stays NaN. So an
    overflow upstream (a float16 gradient under too large a loss scale) still reaches the
    train step's finiteness check instead of being clipped into a finite gradient.

    Args:
      x: float array.
      scale: float32 scale(s) broadcastable to ``x`` (e.g. from :func:`scale_from_amax`).
      dtype: :data:`E4M3` or :data:`E5M2`.

    Returns:
      Array of ``x``'s shape in ``dtype``.

    Raises:
      ValueError: a non-floating ``x`` or ``scale``, a scale that does not broadcast to
        ``x``, or an unsupported ``dtype``.
    """
    dtype = _fp8_dtype(dtype)
    _check_float("x", x)
    _check_float("scale", scale)
    try:
        np.broadcast_shapes(jnp.shape(scale), jnp.shape(x))
    except ValueError:
        raise ValueError(f"scale of shape {jnp.shape(scale)} does not broadcast to x of shape "
                         f"{jnp.shape(x)}") from None
    return _quantize(jnp.asarray(x), jnp.asarray(scale), dtype)


def _quantize(x, scale, dtype):
    fmax = float(jnp.finfo(dtype).max)
    x = x.astype(_F32)
    y = x * (1.0 / scale.astype(_F32))
    return jnp.where(jnp.isfinite(x), jnp.clip(y, -fmax, fmax), y).astype(dtype)


def dequantize(q: Any, scale: Any, dtype: Any = jnp.float32) -> jax.Array:
    """``q * scale`` in float32, cast to ``dtype``: the inverse of :func:`quantize`.

    Args:
      q: FP8 (or any float) array.
      scale: float32 scale(s) broadcastable to ``q``.
      dtype: the result's floating-point dtype.

    Returns:
      Array of ``q``'s shape in ``dtype``.

    Raises:
      ValueError: a non-floating ``q``, ``scale`` or ``dtype``.
    """
    _check_float("q", q)
    _check_float("scale", scale)
    if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype!r}")
    return (jnp.asarray(q).astype(_F32) * jnp.asarray(scale).astype(_F32)).astype(dtype)


# ----------------------------------------------------------------------------- blocks


def _check_block_shape(block_shape: Any) -> Tuple[int, int]:
    ok = (isinstance(block_shape, (tuple, list)) and len(block_shape) == 2
          and all(isinstance(b, numbers.Integral) and not isinstance(b, bool) and b >= 1
                  for b in block_shape))
    if not ok:
        raise ValueError(f"block_shape={block_shape!r} must be two integers >= 1, e.g. (1, 128) "
                         f"tiles or (128, 128) blocks")
    return int(block_shape[0]), int(block_shape[1])


def _check_2d(name: str, x: Any) -> None:
    if jnp.ndim(x) != 2:
        raise ValueError(f"{name} must be a 2-D [M, K] array, got shape {jnp.shape(x)}")


def quantize_blocks(x: Any, block_shape: Sequence[int], dtype: Any = E4M3) -> Tuple[jax.Array, jax.Array]:
    """Quantizes a 2-D array with one float32 scale per ``block_shape`` block.

    ``x [M, K]`` is cut into ``bm x bk`` blocks (DeepSeek-V3, section 3.3.2: ``(1, 128)``
    tiles for activations and gradients, ``(128, 128)`` blocks for weights); each block's
    scale is :func:`scale_from_amax` of its own amax and its elements are
    :func:`quantize` d with it. Ragged edges: the last block row / column covers the
    ``M % bm`` / ``K % bk`` remaining elements (as if zero-padded, which does not change an
    amax).

    Args:
      x: float ``[M, K]``.
      block_shape: ``(bm, bk)``, integers >= 1.
      dtype: :data:`E4M3` or :data:`E5M2`.

    Returns:
      ``(q, scales)``: ``q`` of ``x``'s shape in ``dtype``, ``scales`` float32
      ``[ceil(M / bm), ceil(K / bk)]``.

    Raises:
      ValueError: ``x`` is not a 2-D float array, a bad ``block_shape`` or ``dtype``.
    """
    dtype = _fp8_dtype(dtype)
    bm, bk = _check_block_shape(block_shape)
    _check_float("x", x)
    _check_2d("x", x)
    return _quantize_blocks(jnp.asarray(x), bm, bk, dtype)


def _blocked(x, bm, bk):
    """``x [M, K]`` zero-padded and reshaped to ``[Mb, bm, Kb, bk]``."""
    m, k = x.shape
    mb, kb = -(-m // bm), -(-k // bk)
    x = jnp.pad(x, ((0, mb * bm - m), (0, kb * bk - k)))
    return x.reshape(mb, bm, kb, bk)


def _quantize_blocks(x, bm, bk, dtype):
    m, k = x.shape
    if bm == 1 and bk >= k:  # one scale per row: no padding
        scales = scale_from_amax(jnp.max(jnp.abs(x.astype(_F32)), axis=1, keepdims=True), dtype)
        return _quantize(x, scales, dtype), scales
    xb = _blocked(x.astype(_F32), bm, bk)
    scales = scale_from_amax(jnp.max(jnp.abs(xb), axis=(1, 3)), dtype)
    q = _quantize(xb, scales[:, None, :, None], dtype)
    return q.reshape(xb.shape[0] * bm, xb.shape[2] * bk)[:m, :k], scales


def _expand(scales, bm, bk, shape):
    """Block scales ``[Mb, Kb]`` repeated to one per element, cropped to ``shape``."""
    full = jnp.repeat(jnp.repeat(scales, bm, axis=0), bk, axis=1)
    return full[:shape[0], :shape[1]]


def dequantize_blocks(q: Any, scales: Any, block_shape: Sequence[int],
                      dtype: Any = jnp.float32) -> jax.Array:
    """The inverse of :func:`quantize_blocks`: each element times its block's scale.

    Args:
      q: ``[M, K]`` FP8 (or any float) array.
      scales: float32 ``[ceil(M / bm), ceil(K / bk)]``.
      block_shape: ``(bm, bk)``, as given to :func:`quantize_blocks`.
      dtype: the result's floating-point dtype.

    Returns:
      ``[M, K]`` in ``dtype``.

    Raises:
      ValueError: a bad ``block_shape``, a ``q`` that is not 2-D, or ``scales`` of the
        wrong shape (the message gives the expected one).
    """
    bm, bk = _check_block_shape(block_shape)
    _check_float("q", q)
    _check_2d("q", q)
    m, k = jnp.shape(q)
    want = (-(-m // bm), -(-k // bk))
    if tuple(jnp.shape(scales)) != want:
        raise ValueError(f"scales of shape {jnp.shape(scales)} for q of shape {(m, k)} and blocks "
                         f"{(bm, bk)}; expected {want}")
    return dequantize(q, _expand(jnp.asarray(scales, _F32), bm, bk, (m, k)), dtype)


# ----------------------------------------------------------------------------- recipes


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How an FP8 matmul scales its operands (see the module docstring's table).

    Frozen and hashable: a static argument of ``jax.jit`` and a field of a
    :class:`~jaxmp.precision.policy.Policy`. Build it with a preset. ``str(recipe)`` is
    the name a policy string uses (``fp8=blockwise``, ``fp8=delayed/16/0`` for a delayed
    recipe other than the default) and :meth:`parse` reads it back.

    Attributes:
      name: ``"tensorwise"``, ``"delayed"``, ``"rowwise"`` or ``"blockwise"``.
      history_length: amax history length of ``delayed`` (>= 1); 0 for the others.
      margin: binades of headroom below the format's maximum (:func:`scale_from_amax`),
        an integer >= 0.

    Raises:
      ValueError: an unknown name, a history length that does not fit the name, or a bad
        margin.
    """

    name: str
    history_length: int = 0
    margin: int = 0

    def __post_init__(self):
        if self.name not in RECIPES:
            raise ValueError(f"unknown FP8 recipe {self.name!r}; allowed: {', '.join(RECIPES)}")
        h = self.history_length
        if isinstance(h, bool) or not isinstance(h, numbers.Integral):
            raise ValueError(f"history_length={h!r} must be an integer")
        if self.name == "delayed" and h < 1:
            raise ValueError(f"a delayed recipe needs history_length >= 1, got {h}")
        if self.name != "delayed" and h != 0:
            raise ValueError(f"history_length={h} is only for the delayed recipe, not {self.name!r}")
        object.__setattr__(self, "history_length", int(h))
        object.__setattr__(self, "margin", _check_margin(self.margin))

    @classmethod
    def tensorwise(cls) -> "Recipe":
        """Current per-tensor scaling: E4M3 forward, E5M2 gradients (TE's HYBRID format)."""
        return cls("tensorwise")

    @classmethod
    def delayed(cls, history_length: int = 1024, margin: int = 0) -> "Recipe":
        """Per-tensor scales from the max of an amax history of ``history_length`` steps.

        Transformer Engine's ``DelayedScaling`` (default ``amax_history_len=1024``,
        ``margin=0``, ``amax_compute_algo="max"``, HYBRID format: E4M3 forward, E5M2
        gradients) and Flax's Linen ``fp8_ops``.
        """
        return cls("delayed", history_length=history_length, margin=margin)

    @classmethod
    def rowwise(cls) -> "Recipe":
        """One scale per row of the activation / gradient and per output column of the
        weight, E4M3 throughout (torchao's ``Float8LinearRecipeName.ROWWISE``)."""
        return cls("rowwise")

    @classmethod
    def blockwise(cls) -> "Recipe":
        """DeepSeek-V3 (report, section 3.3.2): 1x128 activation and gradient tiles,
        128x128 weight blocks, E4M3 forward and backward, float32 promotion every 128
        elements of the contraction."""
        return cls("blockwise")

    @property
    def fwd_dtype(self) -> jnp.dtype:
        """Format of the activation and the weight: E4M3 in every recipe."""
        return E4M3

    @property
    def bwd_dtype(self) -> jnp.dtype:
        """Format of the output gradient: E5M2 for tensorwise/delayed, E4M3 otherwise."""
        return E5M2 if self.name in ("tensorwise", "delayed") else E4M3

    @property
    def has_state(self) -> bool:
        """True for ``delayed``: :func:`dot` needs an amax-history state."""
        return self.name == "delayed"

    def __str__(self) -> str:
        if self.name == "delayed" and (self.history_length, self.margin) != (1024, 0):
            return f"delayed/{self.history_length}/{self.margin}"
        if self.margin:
            return f"{self.name}/{self.margin}"
        return self.name

    @classmethod
    def parse(cls, text: str) -> "Recipe":
        """Reads ``str(recipe)``: ``tensorwise``, ``rowwise``, ``blockwise``, ``delayed``
        (history 1024, margin 0), ``delayed/H`` or ``delayed/H/M``; ``NAME/M`` sets a margin.

        Raises:
          ValueError: anything else (the message lists the forms).
        """
        parts = str(text).strip().lower().split("/")
        forms = "tensorwise, rowwise, blockwise, delayed, delayed/HISTORY, delayed/HISTORY/MARGIN"
        try:
            nums = [int(p) for p in parts[1:]]
        except ValueError:
            raise ValueError(f"bad FP8 recipe {text!r}; allowed: {forms}") from None
        name = parts[0]
        if name == "delayed" and len(nums) <= 2:
            return cls.delayed(*nums) if nums else cls.delayed()
        if name in RECIPES and name != "delayed" and len(nums) <= 1:
            return cls(name, 0, *nums)
        raise ValueError(f"bad FP8 recipe {text!r}; allowed: {forms}")


def _check_recipe(recipe: Any) -> Recipe:
    if not isinstance(recipe, Recipe):
        raise ValueError(f"recipe must be a jaxmp.fp8.Recipe (e.g. Recipe.blockwise()), got {recipe!r}")
    return recipe


# ----------------------------------------------------------------------------- state


def init_state(recipe: Recipe) -> Optional[jax.Array]:
    """The initial state of one :func:`dot` call under ``recipe``.

    Returns:
      For ``delayed``: float32 zeros ``[3, history_length]``, the amax histories of the
      activation, the weight and the output gradient (newest first); their first scale is
      therefore 1.0 (:func:`scale_from_amax` of 0). None for the other recipes.

    Raises:
      ValueError: ``recipe`` is not a :class:`Recipe`.
    """
    recipe = _check_recipe(recipe)
    if not recipe.has_state:
        return None
    return jnp.zeros((3, recipe.history_length), _F32)


def roll_history(history: jax.Array, amax: jax.Array) -> jax.Array:
    """``history`` shifted one place to the back, ``amax`` in front, the oldest dropped.

    Args:
      history: float32 ``[..., L]`` (newest first).
      amax: float ``[...]``, this step's amax.

    Returns:
      float32 ``[..., L]``: ``[amax, history[..., 0], ..., history[..., L - 2]]``.
    """
    history = jnp.asarray(history, _F32)
    amax = jnp.asarray(amax, _F32)[..., None]
    return jnp.concatenate([amax, history[..., :-1]], axis=-1)


def merge_states(a: Any, b: Any) -> Any:
    """Combines the updated states of two micro-batches (or devices) of one step.

    Each micro-batch's backward pass returns the old history rolled once with its own
    amax in front, so the elementwise max keeps the old entries and puts the largest
    amax in front (case FP8-1: 1, 8, 2, 1 over four micro-batches gives 8). Any pytree
    of states; ``-inf`` leaves are the identity (an accumulator's start).
    """
    return jax.tree.map(jnp.maximum, a, b)


def _check_state(recipe: Recipe, state: Any) -> Optional[jax.Array]:
    if not recipe.has_state:
        if state is not None:
            raise ValueError(f"the {recipe.name!r} recipe keeps no state; pass state=None")
        return None
    if state is None:
        raise ValueError("the delayed recipe needs its amax-history state: "
                         "state=jaxmp.fp8.init_state(recipe), kept between steps")
    want = (3, recipe.history_length)
    if tuple(jnp.shape(state)) != want or jnp.result_type(state) != _F32:
        raise ValueError(f"a delayed-scaling state must be float32 {want} (rows: activation, "
                         f"weight, gradient amax histories), got {jnp.result_type(state)} "
                         f"{jnp.shape(state)}")
    return jnp.asarray(state)


# ----------------------------------------------------------------------------- products


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


def _amax(x, axis=None, keepdims=False):
    return jnp.max(jnp.abs(x.astype(_F32)), axis=axis, keepdims=keepdims)


def _scale(amax, dtype, recipe):
    return scale_from_amax(amax, dtype, recipe.margin)


def _q_along(x, axis, dtype, recipe):
    """One scale per slice along ``axis`` reduced (keepdims): rows (axis=-1) or columns."""
    s = _scale(_amax(x, axis=axis, keepdims=True), dtype, recipe)
    return _quantize(x, s, dtype), s


def _q_tiles(x, dtype):
    """1x128 tiles along the last axis of a 2-D ``x``: ``(q, scales [M, ceil(K/128)])``."""
    return _quantize_blocks(x, 1, BLOCK, dtype)


def _cols(scales, n):
    """Scales of column blocks of 128 ``[..., Nb]`` repeated to one per column ``[..., n]``."""
    return jnp.repeat(scales, BLOCK, axis=-1)[..., :n]


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
    sg = _state_scales(recipe, state)[2] if recipe.has_state else _scale(amax_g, recipe.bwd_dtype, recipe)
    return _quantize(g, sg, recipe.bwd_dtype), sg, amax_g


def _new_state(state, amax_x, amax_w, amax_g):
    return roll_history(state, jnp.stack([amax_x, amax_w, amax_g]))


def _row_groups(group_sizes, m):
    """The group of each of ``m`` sorted rows (rows past the last group: the last group)."""
    ends = jnp.cumsum(group_sizes)
    return jnp.minimum(jnp.searchsorted(ends, jnp.arange(m), side="right"), group_sizes.shape[0] - 1)


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


# --- dense [M, K] @ [K, N]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _dense(recipe, layout, x, w, state):
    return _dense_fwd(recipe, layout, x, w, state)[0]


def _dense_fwd(recipe, layout, x, w_arg, state):
    f8 = recipe.fwd_dtype
    w = _as_matrix(w_arg, layout)
    n = w.shape[1]
    if recipe.name in ("tensorwise", "delayed"):
        qx, sx, qw, sw, amax_x, amax_w = _per_tensor(recipe, x, w, state)
        y = _mm(qx, qw, None) * (sx * sw)
        res = (qx, sx.reshape(1, 1), w_arg, sw, state, amax_x, amax_w)
    elif recipe.name == "rowwise":
        qx, sx = _q_along(x, -1, f8, recipe)             # [M, 1]
        qw, sw = _q_along(w, 0, f8, recipe)              # [1, N]
        y = _mm(qx, qw, None) * sx * sw
        res = (qx, sx, w_arg, None, state, None, None)
    else:  # blockwise
        qx, sx = _q_tiles(x, f8)                         # [M, Kb]
        qw, sw = _quantize_blocks(w, BLOCK, BLOCK, f8)   # [Kb, Nb]
        y = _scaled_mm(qx, sx, qw, _cols(sw, n))
        res = (qx, sx, w_arg, None, state, None, None)
    if not recipe.has_state:  # the amaxes only feed the delayed recipe's new history
        res = res[:5] + (None, None)
    return y.astype(x.dtype), (_stash(res[0]),) + res[1:]


def _dense_bwd(recipe, layout, res, g):
    qx, sx, w_arg, sw, state, amax_x, amax_w = res
    qx = _unstash(qx, recipe.fwd_dtype)
    w = _as_matrix(w_arg, layout)
    f8, b8 = recipe.fwd_dtype, recipe.bwd_dtype
    m, k = qx.shape
    n = w.shape[1]
    new_state = None
    if recipe.name in ("tensorwise", "delayed"):
        qg, sg, amax_g = _per_tensor_grad(recipe, g, state)
        qw = _quantize(w, sw, f8)
        dx = jax.lax.dot_general(qg, qw, (((1,), (1,)), ((), ())), preferred_element_type=_F32) * (sg * sw)
        dw = jax.lax.dot_general(qx, qg, (((0,), (0,)), ((), ())), preferred_element_type=_F32) * (sx[0, 0] * sg)
        if recipe.has_state:
            new_state = _new_state(state, amax_x, amax_w, amax_g)
    elif recipe.name == "rowwise":
        qg_r, sg_r = _q_along(g, -1, b8, recipe)          # [M, 1]: outside dx's contraction (N)
        qw_r, sw_r = _q_along(w, -1, f8, recipe)          # [K, 1]
        dx = jax.lax.dot_general(qg_r, qw_r, (((1,), (1,)), ((), ())), preferred_element_type=_F32)
        dx = dx * sg_r * sw_r.T
        xd = qx.astype(_F32) * sx                         # the saved FP8 activation, per column now
        qx_c, sx_c = _q_along(xd, 0, f8, recipe)          # [1, K]: outside dw's contraction (M)
        qg_c, sg_c = _q_along(g, 0, b8, recipe)           # [1, N]
        dw = jax.lax.dot_general(qx_c, qg_c, (((0,), (0,)), ((), ())), preferred_element_type=_F32)
        dw = dw * sx_c.T * sg_c
    else:  # blockwise
        qg, sg = _q_tiles(g, b8)                          # 1x128 tiles along N: [M, Nb]
        qw, sw_b = _quantize_blocks(w, BLOCK, BLOCK, f8)  # [Kb, Nb]; used transposed
        dx = _scaled_mm(qg, sg, qw.T, _cols(sw_b.T, k))
        xd = _dequantize_tiles(qx, sx)                    # 1x128 -> 128x1 tiles (DeepSeek-V3 3.3.3)
        qxt, sxt = _q_tiles(xd.T, f8)                     # x.T [K, M], tiles along M: [K, Mb]
        qgt, sgt = _q_tiles(g.T, b8)                      # g.T [N, M]: [N, Mb]
        dw = _scaled_mm(qxt, sxt, qgt.T, sgt.T)
    return dx.astype(g.dtype), _as_weight(dw, w_arg, layout), new_state


def _dequantize_tiles(q, s):
    return q.astype(_F32) * _cols(s, q.shape[1])


_dense.defvjp(_dense_fwd, _dense_bwd)


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
    return jnp.clip(jnp.minimum(ends[None], lo + BLOCK) - jnp.maximum(starts[None], lo), 0).astype(jnp.int32)


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _grouped(recipe, layout, x, w, group_sizes, state):
    return _grouped_fwd(recipe, layout, x, w, group_sizes, state)[0]


def _grouped_fwd(recipe, layout, x, w_arg, group_sizes, state):
    f8 = recipe.fwd_dtype
    w = _as_matrix(w_arg, layout)
    m = x.shape[0]
    n = w.shape[2]
    rows = _row_groups(group_sizes, m)
    if recipe.name in ("tensorwise", "delayed"):  # one scale for x and one for all of w
        qx, sx, qw, sw, amax_x, amax_w = _per_tensor(recipe, x, w, state)
        y = _mm(qx, qw, group_sizes) * (sx * sw)
        res = (qx, sx.reshape(1, 1), w_arg, sw, group_sizes, state, amax_x, amax_w)
    elif recipe.name == "rowwise":
        qx, sx = _q_along(x, -1, f8, recipe)              # [M, 1]
        qw, sw = _q_along(w, 1, f8, recipe)               # [G, 1, N]: per expert and column
        y = _scaled_mm(qx, sx, qw, sw, group_sizes, rows)
        res = (qx, sx, w_arg, None, group_sizes, state, None, None)
    else:
        qx, sx = _q_tiles(x, f8)
        qw, sw = jax.vmap(lambda v: _quantize_blocks(v, BLOCK, BLOCK, f8))(w)  # [G, Kb, Nb]
        y = _scaled_mm(qx, sx, qw, _cols(sw, n), group_sizes, rows)
        res = (qx, sx, w_arg, None, group_sizes, state, None, None)
    if not recipe.has_state:
        res = res[:6] + (None, None)
    res = (_stash(res[0]),) + res[1:]
    return y.astype(x.dtype), res


def _grouped_bwd(recipe, layout, res, g):
    qx, sx, w_arg, sw, group_sizes, state, amax_x, amax_w = res
    qx = _unstash(qx, recipe.fwd_dtype)
    w = _as_matrix(w_arg, layout)
    f8, b8 = recipe.fwd_dtype, recipe.bwd_dtype
    m, k = qx.shape
    g_count = w.shape[0]
    rows = _row_groups(group_sizes, m)
    new_state = None
    if recipe.name in ("tensorwise", "delayed"):
        qg, sg, amax_g = _per_tensor_grad(recipe, g, state)
        qw = _quantize(w, sw, f8)
        dx = _mm(qg, jnp.swapaxes(qw, 1, 2), group_sizes) * (sg * sw)
        dw = _wgrad(qx.T, qg, group_sizes) * (sx[0, 0] * sg)
        if recipe.has_state:
            new_state = _new_state(state, amax_x, amax_w, amax_g)
    elif recipe.name == "rowwise":
        qg_r, sg_r = _q_along(g, -1, b8, recipe)                       # [M, 1]
        qw_r, sw_r = _q_along(w, 2, f8, recipe)                        # [G, K, 1]
        dx = _scaled_mm(qg_r, sg_r, jnp.swapaxes(qw_r, 1, 2), jnp.swapaxes(sw_r, 1, 2),
                        group_sizes, rows)
        xd = qx.astype(_F32) * sx
        qx_c, sx_c = _group_q_cols(xd, rows, g_count, f8, recipe)      # [G, K]
        qg_c, sg_c = _group_q_cols(g, rows, g_count, b8, recipe)       # [G, N]
        dw = _wgrad(qx_c.T, qg_c, group_sizes) * sx_c[:, :, None] * sg_c[:, None, :]
    else:
        qg, sg = _q_tiles(g, b8)                                       # [M, Nb]
        qw, sw_b = jax.vmap(lambda v: _quantize_blocks(v, BLOCK, BLOCK, f8))(w)  # [G, Kb, Nb]
        dx = _scaled_mm(qg, sg, jnp.swapaxes(qw, 1, 2), _cols(jnp.swapaxes(sw_b, 1, 2), k),
                        group_sizes, rows)
        xd = _dequantize_tiles(qx, sx)
        qxt, sxt = _q_tiles(xd.T, f8)                                  # [K, Mb]
        qgt, sgt = _q_tiles(g.T, b8)                                   # [N, Mb]
        dw = _tiled_wgrad(qxt, sxt, qgt, sgt, group_sizes)
    return dx.astype(g.dtype), _as_weight(dw, w_arg, layout), None, new_state


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


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
    _check_float("x", x)
    _check_float("w", w)
    if jnp.ndim(w) != 2:
        raise ValueError(f"w must be a 2-D [K, N] weight, got shape {jnp.shape(w)}")
    if jnp.ndim(x) < 1 or jnp.shape(x)[-1] != jnp.shape(w)[0]:
        raise ValueError(f"x of shape {jnp.shape(x)} must end in K = {jnp.shape(w)[0]} "
                         f"(w of shape {jnp.shape(w)})")
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
    span two groups, and each (tile, group) pair is one FP8 product, so its float32
    temporaries are ``G * ceil(M / 128) * K * N``: a CPU-friendly layout, not a memory-lean
    one; DeepGEMM instead pads each group to a multiple of 128 rows).

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
    _check_float("x", x)
    _check_float("w", w)
    if jnp.ndim(w) != 3 or jnp.ndim(x) != 2 or jnp.shape(x)[1] != jnp.shape(w)[1]:
        raise ValueError(f"grouped_dot needs x [M, K] and w [G, K, N], got {jnp.shape(x)} and "
                         f"{jnp.shape(w)}")
    if (not jnp.issubdtype(jnp.result_type(group_sizes), jnp.integer)
            or jnp.shape(group_sizes) != (jnp.shape(w)[0],)):
        raise ValueError(f"group_sizes must be an integer [G] = [{jnp.shape(w)[0]}] array, got "
                         f"{jnp.result_type(group_sizes)} {jnp.shape(group_sizes)}")
    state = _check_state(recipe, state)
    return _grouped(recipe, None, jnp.asarray(x), jnp.asarray(w), jnp.asarray(group_sizes, jnp.int32),
                    state)


def _parse_spec(spec: str, x_ndim: int, w_ndim: int):
    """``"x,w->out"`` as (x letters, w letters, out letters, contracted, group letters)."""
    try:
        inputs, out = spec.replace(" ", "").split("->")
        xs, ws = inputs.split(",")
    except ValueError:
        raise ValueError(f"einsum spec {spec!r} must look like 'btd,dhk->bthk'") from None
    ok = (len(xs) == x_ndim and len(ws) == w_ndim and len(set(xs)) == len(xs)
          and len(set(ws)) == len(ws) and len(set(out)) == len(out) and set(out) <= set(xs) | set(ws))
    contracted = [c for c in xs if c in ws and c not in out]
    group = [c for c in xs if c in ws and c in out]
    if not ok or not contracted or len(group) > 1 or set(out) != (set(xs) | set(ws)) - set(contracted):
        raise ValueError(f"einsum spec {spec!r} (x rank {x_ndim}, w rank {w_ndim}) is not a matmul "
                         f"jaxmp.fp8.matmul takes: contract shared axes, keep every other axis, "
                         f"at most one axis in x, w and the output (the group)")
    return xs, ws, out, contracted, group


def matmul(x: Any, w: Any, recipe: Recipe, state: Optional[jax.Array] = None,
           spec: Optional[str] = None, *, group_sizes: Optional[Any] = None) -> jax.Array:
    """:func:`dot` / :func:`grouped_dot` behind :func:`jaxmp.ops.cast_matmul`'s signature.

    * ``spec=None, group_sizes=None``: ``x [..., K] @ w [K, N]`` (:func:`dot`);
    * ``group_sizes``: ``x [M, K]``, ``w [G, K, N]`` (:func:`grouped_dot`);
    * an ``einsum`` spec whose shared axes are contracted and whose other axes all reach
      the output, with at most one axis in ``x``, ``w`` and the output: the operands are
      transposed and reshaped to ``[M, K] @ [K, N]`` (``"btd,dhk->bthk"``: ``K = d``,
      ``N = h * k``) or, with such a group axis ``e``, to ``G = e`` equal groups of
      :func:`grouped_dot` (``"becd,edf->becf"``). Scales follow the reshaped 2-D layout:
      a row is one position of ``x``'s kept axes, ``K`` all contracted axes together.

    Args:
      x, w: the operands (``x`` in the compute dtype, ``w`` any float).
      recipe: a :class:`Recipe`.
      state: the delayed recipe's state (see :func:`dot`).
      spec: an ``einsum`` subscript string, or None.
      group_sizes: int ``[G]`` for a grouped matmul; excludes ``spec``.

    Returns:
      The product in ``x.dtype``.

    Raises:
      ValueError: both ``spec`` and ``group_sizes``, a spec that is not such a matmul, or
        anything :func:`dot` / :func:`grouped_dot` reject.
    """
    if spec is not None and group_sizes is not None:
        raise ValueError(f"give spec ({spec!r}) or group_sizes, not both")
    if group_sizes is not None:
        return grouped_dot(x, w, group_sizes, recipe, state)
    if spec is None:
        return dot(x, w, recipe, state)
    x, w = jnp.asarray(x), jnp.asarray(w)
    xs, ws, out, contracted, group = _parse_spec(spec, x.ndim, w.ndim)
    size = {**dict(zip(xs, x.shape)), **dict(zip(ws, w.shape))}
    for c in contracted + group:
        if x.shape[xs.index(c)] != w.shape[ws.index(c)]:
            raise ValueError(f"axis {c!r} of spec {spec!r} has size {x.shape[xs.index(c)]} in x "
                             f"(shape {x.shape}) but {w.shape[ws.index(c)]} in w (shape {w.shape})")
    x_keep = [c for c in xs if c not in ws]
    w_keep = [c for c in ws if c not in xs]
    k = math.prod(size[c] for c in contracted)
    m = math.prod(size[c] for c in x_keep)
    n = math.prod(size[c] for c in w_keep)
    _check_float("x", x)
    _check_float("w", w)
    state = _check_state(_check_recipe(recipe), state)
    x2 = jnp.transpose(x, [xs.index(c) for c in group + x_keep + contracted])
    perm = tuple(ws.index(c) for c in group + contracted + w_keep)
    if group:
        e = size[group[0]]
        y = _grouped(recipe, (perm, (e, k, n)), x2.reshape(e * m, k), w,
                     jnp.full((e,), m, jnp.int32), state)
    else:
        y = _dense(recipe, (perm, (k, n)), x2.reshape(m, k), w, state)
    order = group + x_keep + w_keep
    y = y.reshape(tuple(size[c] for c in order))
    return jnp.transpose(y, [order.index(c) for c in out])


# ----------------------------------------------------------------------------- dispatch


def all_to_all(x: Any, axis_name: Any, split_axis: int, concat_axis: int) -> jax.Array:
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
    _check_float("x", x)
    x = jnp.asarray(x)
    last = x.ndim - 1
    for name, ax in (("split_axis", split_axis), ("concat_axis", concat_axis)):
        if isinstance(ax, bool) or not isinstance(ax, numbers.Integral) or not 0 <= ax < last:
            raise ValueError(f"{name}={ax!r} must be an axis of x (shape {x.shape}) before its last, "
                             f"tiled axis: an integer in [0, {last})")
    return _fp8_all_to_all(x, axis_name, int(split_axis), int(concat_axis))


def _quantize_rows(x):
    """E4M3 values and 1x128 tile scales of ``x [..., D]``: ``(q [..., D], s [..., ceil(D/128)])``."""
    d = x.shape[-1]
    q, s = _quantize_blocks(x.reshape(-1, d), 1, BLOCK, E4M3)
    return q.reshape(x.shape), s.reshape(x.shape[:-1] + s.shape[-1:])


def _dequantize_rows(q, s, dtype):
    """The inverse of :func:`_quantize_rows`, in ``dtype``."""
    scales = s if s.shape[-1] == 1 else jnp.repeat(s, BLOCK, axis=-1)[..., :q.shape[-1]]
    return (q.astype(_F32) * scales).astype(dtype)


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
