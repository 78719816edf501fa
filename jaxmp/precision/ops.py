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
float32 and casts the result back (to the input dtype, or to ``dtype``); the backward
pass of each island runs in float32 too, and only the final cotangent is cast back to
the input dtype.

Activation memory. Differentiated naively, a float32 island keeps its float32
intermediates for the backward pass, so a bfloat16 model would save float32 copies of
its largest activations. The norms and the softmaxes here are ``jax.custom_vjp``
functions that save only what their backward pass needs, without widening it: a
norm's input and a softmax's output, the arrays Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models", section 4.1) count as their
activations; everything else is recomputed, as FlashAttention (Dao et al. 2022,
section 3.1) recomputes the softmax from saved statistics:

* :func:`rms_norm` / :func:`layer_norm`: the input ``x`` in its own dtype and the
  per-row float32 ``rsqrt`` (and mean); the normalized value is recomputed.
* :func:`softmax` / :func:`masked_softmax`: the output probabilities in the output
  dtype (``dx = p * (g - sum(g * p))`` needs nothing else; masked entries of ``p`` are
  exactly 0, so the mask is not kept either).

:func:`cast_matmul` does the same for weights: ``x @ w.astype(x.dtype)`` that recasts
the (float32 master) weight in the backward pass instead of keeping its low-precision
copy alive between the passes.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._checks import Int, check_float, check_int, check_matmul, check_real

__all__ = [
    "rms_norm",
    "layer_norm",
    "softmax",
    "log_softmax",
    "masked_softmax",
    "cross_entropy",
    "causal_mask",
    "router_logits",
    "cast_matmul",
]

_F32 = jnp.float32


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
    check_float(name, p)
    if jnp.shape(p) != jnp.shape(x)[-1:]:
        raise ValueError(f"{name} must have shape {jnp.shape(x)[-1:]} (the last axis of x, "
                         f"shape {jnp.shape(x)}), got {jnp.shape(p)}")


def _check_eps(eps: float) -> None:
    check_real("eps", eps, 0.0)


def rms_norm(x: jax.Array, scale: Optional[jax.Array] = None, eps: float = 1e-6,
             dtype: Any = None) -> jax.Array:
    """RMS normalization (Zhang & Sennrich 2019) with float32 statistics.

    ``y = x / sqrt(mean(x**2, -1) + eps) * scale``, every step in float32: the mean
    of squares (a reduction, Micikevicius et al. 2018 section 3.3), the addition of
    ``eps`` (float16 would round ``eps=1e-8`` to 0 and ``1e-6`` to a subnormal) and the
    multiplication by ``scale``. Case OP-1: float16 ``[300., 300.]`` gives ``[1., 1.]``
    where a float16 mean of squares is ``inf``.

    The backward pass (float32) keeps only ``x`` as given and the float32 per-row
    ``rsqrt``: pass a bfloat16 ``x`` with ``dtype=jnp.float32`` rather than upcasting
    it first, and no float32 copy of ``x`` is kept.

    Args:
      x: ``[..., D]`` array of any floating dtype.
      scale: ``[D]`` gain of any floating dtype (typically the float32 master
        parameter), or None for no gain.
      eps: non-negative constant added to the mean square, in float32.
      dtype: dtype of the result; default ``x.dtype``.

    Returns:
      ``[..., D]`` array of ``dtype``.

    Raises:
      ValueError: ``x`` or ``scale`` is not floating point, ``scale`` is not ``[D]``,
        ``eps`` is negative or not finite, or ``dtype`` is not floating.
    """
    check_float("x", x)
    _check_feature_param("scale", scale, x)
    _check_eps(eps)
    out = _out_dtype(x, dtype)
    return _rms_norm(jnp.asarray(x), None if scale is None else jnp.asarray(scale), float(eps), out)


def _leading_sum(a: jax.Array) -> jax.Array:
    """Sum over every axis but the last: the gradient of a per-feature ``[D]`` parameter."""
    return jnp.sum(a, axis=tuple(range(a.ndim - 1)))


def _param_grad(a: Optional[jax.Array], like: Optional[jax.Array]) -> Optional[jax.Array]:
    return None if like is None else _leading_sum(a).astype(like.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _rms_norm(x, scale, eps, out):
    return _rms_norm_fwd(x, scale, eps, out)[0]


def _rms_norm_fwd(x, scale, eps, out):
    x32 = x.astype(_F32)
    inv = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + jnp.asarray(eps, _F32))
    y = x32 * inv
    if scale is not None:
        y = y * scale.astype(_F32)
    # x in its own dtype and one float32 scalar per row: x32, x32**2 and y are recomputed.
    return y.astype(out), (x, scale, inv)


def _rms_norm_bwd(eps, out, res, g):
    # y = xhat * s with xhat = x * r, r = (mean(x**2) + eps)**-1/2, dr/dx = -r**3 x / D:
    # dx = r * (u - xhat * mean(u * xhat)) with u = g * s; ds = sum(g * xhat). All float32.
    x, scale, inv = res
    g32 = g.astype(_F32)
    xhat = x.astype(_F32) * inv
    u = g32 if scale is None else g32 * scale.astype(_F32)
    dx = inv * (u - xhat * jnp.mean(u * xhat, axis=-1, keepdims=True))
    return dx.astype(x.dtype), _param_grad(g32 * xhat, scale)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def layer_norm(x: jax.Array, scale: Optional[jax.Array] = None,
               bias: Optional[jax.Array] = None, eps: float = 1e-5,
               dtype: Any = None) -> jax.Array:
    """Layer normalization (Ba et al. 2016) with float32 statistics.

    ``y = (x - mean) / sqrt(var + eps) * scale + bias`` over the last axis, computed in
    float32. The variance is the two-pass ``mean((x - mean)**2)`` (no cancellation
    of ``E[x**2] - E[x]**2``). Case OP-1: float16 ``[300., -300.]`` gives ``[1., -1.]``;
    a float16 variance is ``inf`` (``300**2`` overflows float16's 65504).

    The backward pass (float32) keeps only ``x`` as given and the float32 per-row mean
    and ``rsqrt``.

    Args:
      x: ``[..., D]`` array of any floating dtype.
      scale: ``[D]`` gain of any floating dtype, or None.
      bias: ``[D]`` offset of any floating dtype, or None.
      eps: non-negative constant added to the variance, in float32. The default 1e-5
        is ``torch.nn.LayerNorm``'s and ``flax.nnx.LayerNorm``'s.
      dtype: dtype of the result; default ``x.dtype``.

    Returns:
      ``[..., D]`` array of ``dtype``.

    Raises:
      ValueError: a non-floating input, ``scale``/``bias`` not ``[D]``, a bad ``eps``,
        or a non-floating ``dtype``.
    """
    check_float("x", x)
    _check_feature_param("scale", scale, x)
    _check_feature_param("bias", bias, x)
    _check_eps(eps)
    out = _out_dtype(x, dtype)
    as_array = lambda p: None if p is None else jnp.asarray(p)  # noqa: E731
    return _layer_norm(jnp.asarray(x), as_array(scale), as_array(bias), float(eps), out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _layer_norm(x, scale, bias, eps, out):
    return _layer_norm_fwd(x, scale, bias, eps, out)[0]


def _layer_norm_fwd(x, scale, bias, eps, out):
    x32 = x.astype(_F32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    centered = x32 - mean
    inv = jax.lax.rsqrt(jnp.mean(jnp.square(centered), axis=-1, keepdims=True)
                        + jnp.asarray(eps, _F32))
    y = centered * inv
    if scale is not None:
        y = y * scale.astype(_F32)
    if bias is not None:
        y = y + bias.astype(_F32)
    # bias ([D]) only tells the backward pass its dtype; its value is not used.
    return y.astype(out), (x, scale, bias, mean, inv)


def _layer_norm_bwd(eps, out, res, g):
    # Standard layer-norm backward (Ba et al. 2016), float32:
    # dx = r * (u - mean(u) - xhat * mean(u * xhat)), u = g * s; ds = sum(g * xhat); db = sum(g).
    x, scale, bias, mean, inv = res
    g32 = g.astype(_F32)
    xhat = (x.astype(_F32) - mean) * inv
    u = g32 if scale is None else g32 * scale.astype(_F32)
    dx = inv * (u - jnp.mean(u, axis=-1, keepdims=True)
                - xhat * jnp.mean(u * xhat, axis=-1, keepdims=True))
    return dx.astype(x.dtype), _param_grad(g32 * xhat, scale), _param_grad(g32, bias)


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


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
    check_float("x", x)
    out = _out_dtype(x, dtype)
    x = jnp.asarray(x)
    mask = None if where is None else _broadcast_mask(where, x.shape, "where")
    return _softmax(x, mask, _axes(axis, x.ndim), out, x.dtype)


def _axes(axis: Any, ndim: int) -> tuple:
    """``axis`` as a sorted tuple of non-negative ints (hashable, for ``nondiff_argnums``)."""
    axes = tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
    ok = axes and all(Int(-ndim, ndim - 1).ok(a) for a in axes)
    if not ok:
        raise ValueError(f"axis={axis!r} must be an int or a non-empty tuple of ints in "
                         f"[-{ndim}, {ndim}) for an array of rank {ndim}")
    return tuple(sorted({int(a) % ndim for a in axes}))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _softmax(x, mask, axis, out, in_dtype):
    return _softmax_fwd(x, mask, axis, out, in_dtype)[0]


def _softmax_fwd(x, mask, axis, out, in_dtype):
    x32 = x.astype(_F32)
    p32 = jax.nn.softmax(x32, axis=axis) if mask is None else _masked_softmax_f32(x32, mask, axis)
    p = p32.astype(out)
    # Only p, in the output dtype: the float32 exponentials, the row sums and the mask
    # are not kept for the backward pass.
    return p, p


def _softmax_bwd(axis, out, in_dtype, p, g):
    # d softmax: dx = p * (g - sum(g * p)) over `axis`, a reduction: float32. Masked
    # entries have p == 0 and get exactly 0; a fully masked row gets all zeros.
    p32, g32 = p.astype(_F32), g.astype(_F32)
    dx = p32 * (g32 - jnp.sum(g32 * p32, axis=axis, keepdims=True))
    return dx.astype(in_dtype), None


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


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
    check_float("x", x)
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
    check_float("scores", scores)
    out = _out_dtype(scores, dtype)
    scores = jnp.asarray(scores)
    m = _broadcast_mask(mask, scores.shape, "mask")
    return _softmax(scores, m, _axes(axis, scores.ndim), out, scores.dtype)


def cross_entropy(logits: jax.Array, labels: jax.Array,
                  mask: Optional[jax.Array] = None, *,
                  denominator: Optional[jax.Array] = None) -> jax.Array:
    """Mean token cross-entropy with the log-softmax in float32, forward and backward.

    ``sum(mask * nll) / max(sum(mask), 1)`` with ``nll = logsumexp(logits) -
    logits[label]`` computed on the float32 upcast of ``logits``; with ``denominator``,
    ``sum(mask * nll) / denominator``. Tokens with weight 0
    contribute exactly 0 to the loss and to the gradient, even if their logits are
    non-finite (padding cannot make a loss-scaled step skip); an all-masked batch
    gives 0.

    The gradient ``dlogits = g * (softmax(logits) - onehot(label))`` is computed in
    float32 (a vocabulary-wide reduction feeds it, case OP-2) and cast to ``logits``'
    dtype. For it the forward pass keeps only ``logits`` as given (bfloat16 logits stay
    bfloat16) and the float32 per-token logsumexp; the float32 upcast and its
    exponentials are recomputed (Dao et al. 2022, FlashAttention, section 3.1, does the
    same for attention: keep the logsumexp, recompute the probabilities).

    Args:
      logits: ``[..., V]`` array of any floating dtype.
      labels: ``[...]`` integer class ids in ``[0, V)`` (not checked: values are
        traced).
      mask: ``[...]`` boolean (True = count the token) or float weights; None counts
        every token.
      denominator: float32 scalar (may be traced) dividing the masked sum in place of
        this batch's own count, e.g. a share of the trained tokens of a whole global
        batch, when ``logits`` are one micro-batch of it on one device (the mean over
        the whole batch, not a mean of per-micro-batch means: transformers' gradient
        accumulation fault of October 2024). Needs ``mask``.

    Returns:
      float32 scalar, the mean negative log-likelihood in nats per token.

    Raises:
      ValueError: ``logits`` is not floating or has no class axis, ``labels`` is not
        integer, or the shapes of ``logits``, ``labels`` and ``mask`` disagree (the
        message names them).
    """
    check_float("logits", logits)
    if jnp.ndim(logits) < 1:
        raise ValueError(f"logits must have a class axis [..., V], got shape {jnp.shape(logits)}")
    if not jnp.issubdtype(jnp.result_type(labels), jnp.integer):
        raise ValueError(f"labels must be integer class ids, got dtype {jnp.result_type(labels)}")
    if jnp.shape(labels) != jnp.shape(logits)[:-1]:
        raise ValueError(f"labels shape {jnp.shape(labels)} must equal logits shape "
                         f"{jnp.shape(logits)} without its last (class) axis, "
                         f"{jnp.shape(logits)[:-1]}")
    if denominator is not None and mask is None:
        raise ValueError("cross_entropy's denominator divides a masked sum: give a mask")
    if mask is not None and jnp.shape(mask) != jnp.shape(labels):
        raise ValueError(f"mask shape {jnp.shape(mask)} must equal labels shape "
                         f"{jnp.shape(labels)}")
    logits, labels = jnp.asarray(logits), jnp.asarray(labels)
    if mask is None:
        return jnp.mean(_token_nll(logits, labels, None))
    w = jnp.asarray(mask).astype(_F32)
    keep = w != 0
    nll = _token_nll(logits, labels, keep)
    # Select, never multiply: 0 * inf = NaN.
    total = jnp.sum(jnp.where(keep, w * nll, 0.0))
    if denominator is not None:
        return total / jnp.asarray(denominator, _F32)
    return total / jnp.maximum(jnp.sum(w), 1.0)


def _masked_logits32(logits, keep):
    """float32 logits; rows of dropped tokens zeroed *before* any exp, so that a NaN or
    inf there never reaches the loss or the gradient."""
    z = logits.astype(_F32)
    return z if keep is None else jnp.where(keep[..., None], z, 0.0)


@jax.custom_vjp
def _token_nll(logits, labels, keep):
    return _token_nll_fwd(logits, labels, keep)[0]


def _token_nll_fwd(logits, labels, keep):
    z = _masked_logits32(logits, keep)
    lse = jax.nn.logsumexp(z, axis=-1)
    nll = lse - jnp.take_along_axis(z, labels[..., None], axis=-1)[..., 0]
    nll = nll if keep is None else jnp.where(keep, nll, 0.0)
    return nll, (logits, labels, keep, lse)


def _token_nll_bwd(res, g):
    logits, labels, keep, lse = res
    p = jnp.exp(_masked_logits32(logits, keep) - lse[..., None])  # softmax, float32
    onehot = labels[..., None] == jnp.arange(logits.shape[-1], dtype=labels.dtype)
    d = g.astype(_F32)[..., None] * (p - onehot.astype(_F32))
    if keep is not None:
        d = jnp.where(keep[..., None], d, 0.0)
    return d.astype(logits.dtype), None, None


_token_nll.defvjp(_token_nll_fwd, _token_nll_bwd)


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
        check_int(name, n, 1, allowed="a positive integer")
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
    check_matmul(x, w, "D", "E")
    return jnp.matmul(jnp.asarray(x).astype(_F32), jnp.asarray(w).astype(_F32),
                      precision=jax.lax.Precision.HIGHEST)


def _product(x, w, spec, group_sizes, grouped=None):
    if group_sizes is not None:
        if grouped is not None:
            return grouped(x, w, group_sizes)
        return jax.lax.ragged_dot(x, w, group_sizes)
    if spec is not None:
        return jnp.einsum(spec, x, w)
    return jnp.matmul(x, w)


def cast_matmul(x: jax.Array, w: jax.Array, spec: Optional[str] = None, *,
                group_sizes: Optional[jax.Array] = None, grouped: Any = None) -> jax.Array:
    """``x @ w.astype(x.dtype)`` whose backward pass recasts ``w`` instead of saving the cast.

    A mixed-precision layer multiplies its compute-dtype input by a low-precision copy
    of its float32 master weight. Differentiated naively, that copy is an activation:
    the backward pass needs it for ``dx = g @ w_c.T``, so it stays alive from the
    forward to the backward pass: one more parameter-sized array per weight (the
    "fp16 parameters" of Rajbhandari et al. 2020, ZeRO, section 3.1, held as
    activations). Here the cast and the product run
    under ``jax.checkpoint`` with the ``nothing_saveable`` policy: the backward pass
    keeps only the inputs (``x``, already in the compute dtype, which ``dw`` needs
    anyway, and the master ``w``, which exists regardless) and redoes the cheap cast;
    the product itself is not recomputed (each cotangent is one product, as without
    the checkpoint). Values and gradients are bitwise those of the plain expression.
    When ``w`` already has ``x``'s dtype (a float32 policy) there is no cast and no
    checkpoint.

    Also used the other way round, to upcast a low-precision operand into a float32
    product (``x`` float32 gates, ``w`` bfloat16 expert outputs): the float32 copy is
    recomputed, the bfloat16 original saved.

    Args:
      x: the activation, ``[..., K]`` (any floating dtype; its dtype is the compute
        dtype).
      w: the weight, any floating dtype (typically the float32 master), ``[K, N]`` for
        ``x @ w``, shaped for ``spec``, or ``[G, K, N]`` with ``group_sizes``.
      spec: an ``einsum`` subscript string ``"x_axes,w_axes->out"``; default a matmul.
      group_sizes: int ``[G]`` rows of ``x`` per group: a grouped matmul
        (``jax.lax.ragged_dot``, the sorted-token MoE layout); excludes ``spec``.
      grouped: with ``group_sizes``, a function ``(x, w_cast, group_sizes) -> [M, N]``
        that replaces ``ragged_dot`` (e.g.
        :func:`jaxmp.precision.grouped_gemm.grouped_matmul`); ``w_cast`` is in ``x.dtype``.

    Returns:
      The product in ``x.dtype``.

    Raises:
      ValueError: a non-floating ``x`` or ``w``, or both ``spec`` and ``group_sizes``.
    """
    check_float("x", x)
    check_float("w", w)
    if spec is not None and group_sizes is not None:
        raise ValueError(f"give spec ({spec!r}) or group_sizes, not both")
    x, w = jnp.asarray(x), jnp.asarray(w)
    if w.dtype == x.dtype:
        return _product(x, w, spec, group_sizes, grouped)

    def cast_then_multiply(x, w, group_sizes):
        return _product(x, w.astype(x.dtype), spec, group_sizes, grouped)

    return jax.checkpoint(cast_then_multiply, policy=jax.checkpoint_policies.nothing_saveable)(
        x, w, group_sizes)
