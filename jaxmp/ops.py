"""Precision-safe numerics: float32 islands inside a low-precision model.

Mixed precision runs matmuls in bfloat16/float16 but keeps a few operations in
float32, because their intermediate values leave the low-precision range or need more
mantissa than 8 (bfloat16) or 11 (float16) bits:

* Reductions, softmax and normalization statistics: Micikevicius et al. 2018, "Mixed
  Precision Training", section 3.3 ("Arithmetic precision"): large reductions (sums
  across a vector, as in batch/layer norm and softmax) are computed in float32 and the
  result is written back in float16. A float16 sum of squares overflows as soon as an
  element exceeds 256 (``300**2 = 90000 > 65504``, case OP-1) and a float16 sum over a
  70000-word vocabulary overflows even for unit values (case OP-2).
* The MoE router: DeepSeek-V3 technical report (2024), section 3.3 ("FP8 training"),
  keeps the embedding, the output head, the MoE gating, normalization and attention
  operators in their original (higher) precision. A router decides by comparing
  logits, and bfloat16 cannot tell 2.000 from 2.004 (case OP-3).

Every function here takes low-precision inputs, upcasts them to float32, computes in
float32 and casts the result back (to the input dtype, or to ``dtype``). Because the
upcast is an ordinary ``astype``, JAX differentiates through it: the backward pass of
each island also runs in float32, and only the final cotangent is cast back to the
input dtype.
"""
from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = [
    "rms_norm",
    "layer_norm",
    "softmax",
    "log_softmax",
    "masked_softmax",
    "cross_entropy",
    "causal_mask",
    "router_logits",
]

_F32 = jnp.float32


def _check_float(name: str, x: Any) -> None:
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise ValueError(f"{name} must have a floating-point dtype, got {jnp.result_type(x)}")


def _out_dtype(x: Any, dtype: Any) -> jnp.dtype:
    """The result dtype: ``dtype`` if given (must be floating), else the dtype of ``x``."""
    if dtype is None:
        return jnp.result_type(x)
    out = jnp.dtype(dtype)
    if not jnp.issubdtype(out, jnp.floating):
        raise ValueError(f"dtype must be a floating-point dtype, got {out}")
    return out


def _check_feature_param(name: str, p: Any, x: Any) -> None:
    if p is None:
        return
    _check_float(name, p)
    if jnp.shape(p) != jnp.shape(x)[-1:]:
        raise ValueError(f"{name} must have shape {jnp.shape(x)[-1:]} (the last axis of x, "
                         f"shape {jnp.shape(x)}), got {jnp.shape(p)}")


def _check_eps(eps: float) -> None:
    if isinstance(eps, bool) or not (isinstance(eps, (int, float, np.number)) and np.isfinite(eps)
                                     and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")


def rms_norm(x: jax.Array, scale: Optional[jax.Array] = None, eps: float = 1e-6) -> jax.Array:
    """RMS normalization (Zhang & Sennrich 2019) with float32 statistics.

    ``y = x / sqrt(mean(x**2, -1) + eps) * scale``, every step in float32: the mean
    of squares (a reduction, Micikevicius et al. 2018 section 3.3), the addition of
    ``eps`` (float16 would round ``eps=1e-8`` to 0 and ``1e-6`` to a subnormal) and the
    multiplication by ``scale``. Case OP-1: float16 ``[300., 300.]`` gives ``[1., 1.]``
    where a float16 mean of squares is ``inf``.

    Args:
      x: ``[..., D]`` array of any floating dtype (the compute dtype).
      scale: ``[D]`` gain of any floating dtype (typically the float32 master
        parameter), or None for no gain.
      eps: non-negative constant added to the mean square, in float32.

    Returns:
      ``[..., D]`` array of ``x.dtype``.

    Raises:
      ValueError: ``x`` or ``scale`` is not floating point, ``scale`` is not ``[D]``,
        or ``eps`` is negative or not finite.
    """
    _check_float("x", x)
    _check_feature_param("scale", scale, x)
    _check_eps(eps)
    x32 = jnp.asarray(x).astype(_F32)
    mean_square = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    y = x32 * jax.lax.rsqrt(mean_square + jnp.asarray(eps, _F32))
    if scale is not None:
        y = y * jnp.asarray(scale).astype(_F32)
    return y.astype(jnp.result_type(x))


def layer_norm(x: jax.Array, scale: Optional[jax.Array] = None,
               bias: Optional[jax.Array] = None, eps: float = 1e-5) -> jax.Array:
    """Layer normalization (Ba et al. 2016) with float32 statistics.

    ``y = (x - mean) / sqrt(var + eps) * scale + bias`` over the last axis, computed in
    float32. The variance is the two-pass ``mean((x - mean)**2)`` (no cancellation
    of ``E[x**2] - E[x]**2``). Case OP-1: float16 ``[300., -300.]`` gives ``[1., -1.]``;
    a float16 variance is ``inf`` (``300**2`` overflows float16's 65504).

    Args:
      x: ``[..., D]`` array of any floating dtype.
      scale: ``[D]`` gain of any floating dtype, or None.
      bias: ``[D]`` offset of any floating dtype, or None.
      eps: non-negative constant added to the variance, in float32. The default 1e-5
        is ``torch.nn.LayerNorm``'s and ``flax.nnx.LayerNorm``'s.

    Returns:
      ``[..., D]`` array of ``x.dtype``.

    Raises:
      ValueError: a non-floating input, ``scale``/``bias`` not ``[D]``, or a bad ``eps``.
    """
    _check_float("x", x)
    _check_feature_param("scale", scale, x)
    _check_feature_param("bias", bias, x)
    _check_eps(eps)
    x32 = jnp.asarray(x).astype(_F32)
    centered = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(centered), axis=-1, keepdims=True)
    y = centered * jax.lax.rsqrt(var + jnp.asarray(eps, _F32))
    if scale is not None:
        y = y * jnp.asarray(scale).astype(_F32)
    if bias is not None:
        y = y + jnp.asarray(bias).astype(_F32)
    return y.astype(jnp.result_type(x))


def _masked_softmax_f32(s: jax.Array, mask: jax.Array, axis: Any) -> jax.Array:
    """Float32 softmax over ``axis`` restricted to ``mask``; masked entries are exactly 0.

    Masked scores never reach ``exp`` (they are replaced by ``-inf`` *before* it), so
    garbage or ``inf`` in masked slots cannot leak a NaN into the backward pass
    (``0 * inf``). A row with nothing to attend to has sum 0 and is divided by 1, so
    it is all zeros rather than NaN (0/0) or uniform.
    """
    row_max = jnp.max(jnp.where(mask, s, -jnp.inf), axis=axis, keepdims=True)
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    e = jnp.exp(jnp.where(mask, s - row_max, -jnp.inf))
    denom = jnp.sum(e, axis=axis, keepdims=True)
    return e / jnp.where(denom > 0, denom, 1.0)


def _broadcast_mask(mask: Any, shape: tuple, name: str) -> jax.Array:
    if jnp.result_type(mask) != jnp.bool_:
        raise ValueError(f"{name} must be boolean (True = attend), got dtype "
                         f"{jnp.result_type(mask)}; add additive biases to the scores instead")
    try:
        np.broadcast_shapes(jnp.shape(mask), shape)
    except ValueError:
        raise ValueError(f"{name} of shape {jnp.shape(mask)} does not broadcast to the "
                         f"scores' shape {shape}") from None
    if np.broadcast_shapes(jnp.shape(mask), shape) != tuple(shape):
        raise ValueError(f"{name} of shape {jnp.shape(mask)} would enlarge the scores' "
                         f"shape {shape}; it must broadcast to it")
    return jnp.broadcast_to(mask, shape)


def softmax(x: jax.Array, axis: Any = -1, where: Optional[jax.Array] = None,
            dtype: Any = None) -> jax.Array:
    """Softmax computed in float32, forward and backward.

    Same contract as ``jax.nn.softmax`` (which does the unmasked work), but the input
    is upcast to float32 first (Micikevicius et al. 2018 section 3.3): the exponent
    sum cannot overflow, and the backward pass (``y * (g - sum(y * g))``, a reduction)
    runs in float32 too.

    Args:
      x: array of any floating dtype.
      axis: axis or tuple of axes to normalize over.
      where: optional boolean array broadcastable to ``x``; False entries get exactly
        0 and do not count in the sum (see :func:`masked_softmax`).
      dtype: dtype of the result; default ``x.dtype``.

    Returns:
      Array of ``x``'s shape and ``dtype``.

    Raises:
      ValueError: ``x`` is not floating point, ``dtype`` is not a floating dtype, or
        ``where`` is not boolean / does not broadcast to ``x``.
    """
    _check_float("x", x)
    out = _out_dtype(x, dtype)
    x32 = jnp.asarray(x).astype(_F32)
    if where is None:
        return jax.nn.softmax(x32, axis=axis).astype(out)
    mask = _broadcast_mask(where, x32.shape, "where")
    return _masked_softmax_f32(x32, mask, axis).astype(out)


def log_softmax(x: jax.Array, axis: Any = -1, dtype: Any = None) -> jax.Array:
    """Log-softmax computed in float32, forward and backward.

    ``jax.nn.log_softmax`` on the float32 upcast of ``x``. Its backward pass is
    ``g - softmax(x) * sum(g)``: for a float16 vocabulary of 70000 entries ``sum(g)``
    alone overflows float16, so the island must include the backward pass (case OP-2).

    Args:
      x: array of any floating dtype.
      axis: axis or tuple of axes to normalize over.
      dtype: dtype of the result; default ``x.dtype``. Pass ``jnp.float32`` when the
        result feeds a further reduction (a loss).

    Returns:
      Array of ``x``'s shape and ``dtype``.

    Raises:
      ValueError: ``x`` is not floating point or ``dtype`` is not a floating dtype.
    """
    _check_float("x", x)
    out = _out_dtype(x, dtype)
    return jax.nn.log_softmax(jnp.asarray(x).astype(_F32), axis=axis).astype(out)


def masked_softmax(scores: jax.Array, mask: jax.Array, axis: Any = -1,
                   dtype: Any = None) -> jax.Array:
    """Attention softmax with a boolean mask, in float32, safe for fully masked rows.

    Masked positions get probability exactly 0, whatever their score (``-inf``,
    ``finfo.min`` or garbage). A fully masked row (padding queries, or a causal mask
    with ``kv_len < q_len``) gives all zeros, not NaN and not a uniform distribution,
    and its gradient is 0. Forward and backward are finite for float16 scores.

    Args:
      scores: ``[..., q, k]`` attention logits (any floating dtype, any layout).
      mask: boolean array broadcastable to ``scores``; True = attend.
      axis: axis or tuple of axes to normalize over (the key axis).
      dtype: dtype of the result; default ``scores.dtype``.

    Returns:
      Probabilities with ``scores``' shape, in ``dtype``.

    Raises:
      ValueError: ``scores`` is not floating point, ``mask`` is not boolean or does
        not broadcast to ``scores``, or ``dtype`` is not floating.
    """
    _check_float("scores", scores)
    out = _out_dtype(scores, dtype)
    s32 = jnp.asarray(scores).astype(_F32)
    m = _broadcast_mask(mask, s32.shape, "mask")
    return _masked_softmax_f32(s32, m, axis).astype(out)


def cross_entropy(logits: jax.Array, labels: jax.Array,
                  mask: Optional[jax.Array] = None) -> jax.Array:
    """Mean token cross-entropy with the log-softmax in float32.

    ``sum(mask * nll) / max(sum(mask), 1)`` with ``nll = logsumexp(logits) -
    logits[label]`` from ``optax.softmax_cross_entropy_with_integer_labels`` on the
    float32 upcast of ``logits``. Tokens with weight 0 contribute exactly 0 to the
    loss and to the gradient, even if their logits are non-finite (padding cannot make
    a loss-scaled step skip); an all-masked batch gives 0.

    Args:
      logits: ``[..., V]`` array of any floating dtype.
      labels: ``[...]`` integer class ids in ``[0, V)`` (not checked: values are
        traced).
      mask: ``[...]`` boolean (True = count the token) or float weights; None counts
        every token.

    Returns:
      float32 scalar, the mean negative log-likelihood in nats per token.

    Raises:
      ValueError: ``logits`` is not floating or has no class axis, ``labels`` is not
        integer, or the shapes of ``logits``, ``labels`` and ``mask`` disagree (the
        message names them).
    """
    _check_float("logits", logits)
    if jnp.ndim(logits) < 1:
        raise ValueError(f"logits must have a class axis [..., V], got shape {jnp.shape(logits)}")
    if not jnp.issubdtype(jnp.result_type(labels), jnp.integer):
        raise ValueError(f"labels must be integer class ids, got dtype {jnp.result_type(labels)}")
    if jnp.shape(labels) != jnp.shape(logits)[:-1]:
        raise ValueError(f"labels shape {jnp.shape(labels)} must equal logits shape "
                         f"{jnp.shape(logits)} without its last (class) axis, "
                         f"{jnp.shape(logits)[:-1]}")
    if mask is not None and jnp.shape(mask) != jnp.shape(labels):
        raise ValueError(f"mask shape {jnp.shape(mask)} must equal labels shape {jnp.shape(labels)}")
    logits32 = jnp.asarray(logits).astype(_F32)
    labels = jnp.asarray(labels)
    if mask is None:
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits32, labels))
    w = jnp.asarray(mask).astype(_F32)
    keep = w != 0
    # Select, never multiply: 0 * inf = NaN. Masked logits are replaced *before* the
    # log-softmax too, or a NaN there would still reach the gradient (0 * NaN).
    logits32 = jnp.where(keep[..., None], logits32, 0.0)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits32, labels)
    return jnp.sum(jnp.where(keep, w * nll, 0.0)) / jnp.maximum(jnp.sum(w), 1.0)


def causal_mask(q_len: int, kv_len: Optional[int] = None) -> jax.Array:
    """Lower-triangular attention mask, right-aligned when keys outnumber queries.

    Query ``i`` may attend to keys ``j <= i + (kv_len - q_len)``: with a KV cache the
    ``q_len`` new queries are the last ``q_len`` positions of the ``kv_len`` keys.

    Args:
      q_len: number of queries (>= 1).
      kv_len: number of keys (>= 1); default ``q_len``.

    Returns:
      bool ``[q_len, kv_len]``, True = attend.

    Raises:
      ValueError: a length that is not a positive integer.
    """
    kv_len = q_len if kv_len is None else kv_len
    for name, n in (("q_len", q_len), ("kv_len", kv_len)):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"{name} must be a positive integer, got {n!r}")
    return jnp.tril(jnp.ones((q_len, kv_len), dtype=jnp.bool_), k=kv_len - q_len)


def router_logits(x: jax.Array, w: jax.Array) -> jax.Array:
    """MoE router logits as a float32 island: ``x @ w`` in float32 at HIGHEST precision.

    Both operands are cast to float32 and multiplied with
    ``precision=jax.lax.Precision.HIGHEST`` (no bfloat16 passes on TPU, no TF32 on
    GPU), following the DeepSeek-V3 report (section 3.3) that keeps MoE gating in
    higher precision. Case OP-3: expert logits 2.000 and 2.004 both round to 2.0 in
    bfloat16, and the top-1 pick flips from expert 1 to expert 0.

    Args:
      x: ``[..., D]`` token activations, any floating dtype.
      w: ``[D, E]`` router weights, any floating dtype (float32 master weights).

    Returns:
      float32 ``[..., E]`` logits.

    Raises:
      ValueError: non-floating inputs, ``w`` not 2-D, or ``x``'s last axis != ``D``.
    """
    _check_float("x", x)
    _check_float("w", w)
    if jnp.ndim(w) != 2:
        raise ValueError(f"w must be [D, E], got shape {jnp.shape(w)}")
    if jnp.ndim(x) < 1 or jnp.shape(x)[-1] != jnp.shape(w)[0]:
        raise ValueError(f"x shape {jnp.shape(x)} must end in D = {jnp.shape(w)[0]} "
                         f"(w shape {jnp.shape(w)})")
    return jnp.matmul(jnp.asarray(x).astype(_F32), jnp.asarray(w).astype(_F32),
                      precision=jax.lax.Precision.HIGHEST)
