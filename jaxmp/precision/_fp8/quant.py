"""FP8 formats, scales and quantization: per tensor, per slice and per block (2-D tiles).

Formulas and sources: :mod:`jaxmp.precision.fp8` (the module docstring) and each function.
"""
from __future__ import annotations

from typing import Any, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._checks import Int, check_float, check_int

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E5M2 = jnp.dtype(jnp.float8_e5m2)
# DeepSeek-V3 (report, section 3.3.2): 1x128 tiles, 128x128 blocks, promotion every 128.
BLOCK = 128

_F32 = jnp.float32
_F32_TINY = float(np.finfo(np.float32).tiny)  # 2**-126
_SCALE_MAX = 2.0 ** 126                           # 1 / _F32_TINY: a normal reciprocal


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
    return check_int("margin", margin, 0, allowed="an integer >= 0 (binades of headroom)")


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
    check_float("amax", amax)
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
    cast, because a plain cast turns them into NaN (E4M3, which has no inf) or inf (E5M2).
    Non-finite inputs stay non-finite: +-inf becomes +-inf in E5M2 and NaN in E4M3, NaN stays NaN.
    So an overflow upstream (a float16 gradient under too large a loss scale) still reaches the
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
    check_float("x", x)
    check_float("scale", scale)
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
    check_float("q", q)
    check_float("scale", scale)
    if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype!r}")
    return (jnp.asarray(q).astype(_F32) * jnp.asarray(scale).astype(_F32)).astype(dtype)


# ----------------------------------------------------------------------------- blocks


def _check_block_shape(block_shape: Any) -> Tuple[int, int]:
    ok = (isinstance(block_shape, (tuple, list)) and len(block_shape) == 2
          and all(Int(1).ok(b) for b in block_shape))
    if not ok:
        raise ValueError(f"block_shape={block_shape!r} must be two integers >= 1, e.g. (1, 128) "
                         f"tiles or (128, 128) blocks")
    return int(block_shape[0]), int(block_shape[1])


def _check_2d(name: str, x: Any) -> None:
    if jnp.ndim(x) != 2:
        raise ValueError(f"{name} must be a 2-D [M, K] array, got shape {jnp.shape(x)}")


def quantize_blocks(x: Any, block_shape: Sequence[int],
                    dtype: Any = E4M3) -> Tuple[jax.Array, jax.Array]:
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
    check_float("x", x)
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
    check_float("q", q)
    _check_2d("q", q)
    m, k = jnp.shape(q)
    want = (-(-m // bm), -(-k // bk))
    if tuple(jnp.shape(scales)) != want:
        raise ValueError(f"scales of shape {jnp.shape(scales)} for q of shape {(m, k)} and blocks "
                         f"{(bm, bk)}; expected {want}")
    return dequantize(q, _expand(jnp.asarray(scales, _F32), bm, bk, (m, k)), dtype)



# ----------------------------------------------------------------------------- GEMM helpers


def _amax(x, axis=None, keepdims=False):
    return jnp.max(jnp.abs(x.astype(_F32)), axis=axis, keepdims=keepdims)


def _q_tiles(x, dtype):
    """1x128 tiles along the last axis of a 2-D ``x``: ``(q, scales [M, ceil(K/128)])``."""
    return _quantize_blocks(x, 1, BLOCK, dtype)


def _cols(scales, n):
    """Scales of column blocks of 128 ``[..., Nb]`` repeated to one per column ``[..., n]``."""
    return jnp.repeat(scales, BLOCK, axis=-1)[..., :n]


def _dequantize_tiles(q, s):
    return q.astype(_F32) * _cols(s, q.shape[1])
