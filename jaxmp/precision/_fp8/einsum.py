""":func:`matmul`: :func:`jaxmp.ops.cast_matmul`'s signature (einsum specs, grouped
matmuls) onto the FP8 products of :mod:`jaxmp.precision._fp8.gemm`."""
from __future__ import annotations

import math
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxmp._checks import check_float
from jaxmp.precision._fp8.gemm import (_dense, _frozen_dense, _frozen_grouped, _grouped,
                                       check_frozen, dot, grouped_dot)
from jaxmp.precision._fp8.quant import BLOCK
from jaxmp.precision._fp8.recipe import Recipe, _check_recipe, _check_state


def _parse_spec(spec: str, x_ndim: int, w_ndim: int):
    """``"x,w->out"`` as (x letters, w letters, out letters, contracted, group letters)."""
    try:
        inputs, out = spec.replace(" ", "").split("->")
        xs, ws = inputs.split(",")
    except ValueError:
        raise ValueError(f"einsum spec {spec!r} must look like 'btd,dhk->bthk'") from None
    ok = (len(xs) == x_ndim and len(ws) == w_ndim and len(set(xs)) == len(xs)
          and len(set(ws)) == len(ws) and len(set(out)) == len(out)
          and set(out) <= set(xs) | set(ws))
    contracted = [c for c in xs if c in ws and c not in out]
    group = [c for c in xs if c in ws and c in out]
    if (not ok or not contracted or len(group) > 1
        or set(out) != (set(xs) | set(ws)) - set(contracted)):
        raise ValueError(f"einsum spec {spec!r} (x rank {x_ndim}, w rank {w_ndim}) is not a matmul "
                         f"jaxmp.fp8.matmul takes: contract shared axes, keep every other axis, "
                         f"at most one axis in x, w and the output (the group)")
    return xs, ws, out, contracted, group


def matmul(x: Any, w: Any, recipe: Recipe, state: Optional[jax.Array] = None,
           spec: Optional[str] = None, *, group_sizes: Optional[Any] = None,
           scales: Optional[Any] = None) -> jax.Array:
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
      scales: a frozen FP8 weight (a LoRA base, :mod:`jaxmp.models.lora`): ``w`` is then
        stored E4M3 and ``scales`` its float32 ``[(G,) ceil(K / 128), ceil(N / 128)]``, one
        per 128 x 128 block of its ``[K, N]`` matrix (the layout above); the blockwise
        recipe reads them as they are (the weight is never quantized in the product) and
        the product gives no weight gradient (``dx`` only: ``g`` in 1x128 tiles times the
        stored blocks transposed).

    Returns:
      The product in ``x.dtype``.

    Raises:
      ValueError: both ``spec`` and ``group_sizes``, a spec that is not such a matmul, or
        anything :func:`dot` / :func:`grouped_dot` reject.
    """
    if spec is not None and group_sizes is not None:
        raise ValueError(f"give spec ({spec!r}) or group_sizes, not both")
    if scales is not None:
        recipe = _check_recipe(recipe)
        check_frozen(w, scales, recipe)
    if group_sizes is not None:
        if scales is not None:
            return _frozen_grouped(recipe, None, jnp.asarray(x), jnp.asarray(w), scales,
                                   jnp.asarray(group_sizes, jnp.int32))
        return grouped_dot(x, w, group_sizes, recipe, state)
    if spec is None:
        if scales is not None:
            x = jnp.asarray(x)
            y = _frozen_dense(recipe, None, x.reshape(-1, x.shape[-1]), w, scales)
            return y.reshape(x.shape[:-1] + (w.shape[1],))
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
    check_float("x", x)
    check_float("w", w)
    state = _check_state(_check_recipe(recipe), state)
    x2 = jnp.transpose(x, [xs.index(c) for c in group + x_keep + contracted])
    perm = tuple(ws.index(c) for c in group + contracted + w_keep)
    if scales is not None and tuple(scales.shape[-2:]) != (-(-k // BLOCK), -(-n // BLOCK)):
        raise ValueError(f"frozen FP8 scales of shape {tuple(scales.shape)} for a [{k}, {n}] "
                         f"weight matrix; allowed: one per {BLOCK} x {BLOCK} block")
    if group:
        e = size[group[0]]
        if scales is not None:
            y = _frozen_grouped(recipe, (perm, (e, k, n)), x2.reshape(e * m, k), w, scales,
                                jnp.full((e,), m, jnp.int32))
        else:
            y = _grouped(recipe, (perm, (e, k, n)), x2.reshape(e * m, k), w,
                         jnp.full((e,), m, jnp.int32), state)
    elif scales is not None:
        y = _frozen_dense(recipe, (perm, (k, n)), x2.reshape(m, k), w, scales)
    else:
        y = _dense(recipe, (perm, (k, n)), x2.reshape(m, k), w, state)
    order = group + x_keep + w_keep
    y = y.reshape(tuple(size[c] for c in order))
    return jnp.transpose(y, [order.index(c) for c in out])
