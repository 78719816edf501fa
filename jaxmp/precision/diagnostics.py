"""Where do gradients fall out of a low-precision format? Per-leaf underflow report.

Micikevicius et al. 2018 ("Mixed Precision Training", section 3.2, figure 3) plot the
histogram of activation gradients of an SSD detector trained in float32: much of
float16's range goes unused while many values lie below 2**-24, float16's smallest
subnormal, so casting them to float16 flushes them to zero. A loss scale ``S`` shifts the whole
histogram up by ``log2(S)`` binades; too large an ``S`` pushes the largest gradients
past float16's maximum 65504 instead.

:func:`underflow_report` measures both tails for every parameter of a model: give it
the true (unscaled) float32 gradients, a target dtype and a loss scale, and it counts,
per leaf, how many non-zero gradients would become exactly 0, land in the subnormal
range (fewer mantissa bits), or overflow after ``(g * S).astype(dtype)``.
:func:`suggest_loss_scale` picks the largest power of two that does not overflow.

Counting runs in one jitted function on the device holding the gradients; only a
``[leaves, 4]`` int32 table comes back to the host. Zero and subnormal results are
classified from the bit pattern, so the answer does not depend on whether the
backend treats subnormal operands of comparisons as zero. Note that XLA:CPU (and TPU)
flush float32 subnormals to zero in arithmetic, so bfloat16 subnormals (which sit
below float32's normal range) do not occur there.
"""
from __future__ import annotations

import math
from typing import Any, Dict, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp.precision._paths import path_name
from jaxmp.precision.policy import canonical_dtype

__all__ = [
    "LeafReport",
    "DtypeRange",
    "underflow_report",
    "summarize",
    "format_report",
    "suggest_loss_scale",
]

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


class LeafReport(NamedTuple):
    """Underflow/overflow statistics of one gradient leaf (or of a whole tree).

    Attributes:
      nonzero: number of non-zero elements of the true float32 gradient.
      underflow: fraction of those that become exactly 0 in the target dtype.
      subnormal: fraction that become subnormal (non-zero, below ``finfo.tiny``):
        they survive but with fewer significant bits.
      overflow: fraction that become inf or NaN (beyond ``finfo.max`` after
        rounding). Non-finite true gradients count here too.
    """

    nonzero: int
    underflow: float
    subnormal: float
    overflow: float


class DtypeRange(NamedTuple):
    """The representable magnitudes of a floating dtype (from ``jnp.finfo``).

    Attributes:
      dtype: the dtype.
      max: largest finite value (float16: 65504).
      min_normal: smallest positive normal value, ``finfo.tiny`` (float16: 2**-14).
      min_subnormal: smallest positive value (float16: 2**-24); half of it or less
        rounds to 0.
    """

    dtype: jnp.dtype
    max: float
    min_normal: float
    min_subnormal: float

    @classmethod
    def of(cls, dtype: Any) -> "DtypeRange":
        """Returns the range of ``dtype`` (a dtype or a name :func:`canonical_dtype` accepts)."""
        dtype = canonical_dtype(dtype)
        fi = jnp.finfo(dtype)
        return cls(dtype, float(fi.max), float(fi.tiny), float(fi.smallest_subnormal))


def _check_dtype(dtype: Any) -> jnp.dtype:
    dtype = canonical_dtype(dtype)
    if dtype.itemsize not in _UINT:
        raise ValueError(f"dtype {dtype} is not supported; use a 8-, 16- or 32-bit float "
                         "(float16, bfloat16, float32, float8_*)")
    return dtype


def _resolve_scale(loss_scale: Any) -> Any:
    """Accepts a number, a scalar array or a jaxmp loss-scale object (its ``loss_scale``)."""
    scale = getattr(loss_scale, "loss_scale", loss_scale)
    if jnp.ndim(scale) != 0:
        raise ValueError(f"loss_scale must be a scalar, got shape {jnp.shape(scale)}")
    if not isinstance(scale, jax.core.Tracer):
        value = float(scale)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"loss_scale must be a finite number > 0, got {value!r}")
    return scale


def _leaf_counts(g: jax.Array, scale: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """int32 ``[4]``: non-zero, underflow, subnormal and overflow counts of one leaf."""
    fi = jnp.finfo(dtype)
    uint = _UINT[dtype.itemsize]
    g32 = g.astype(jnp.float32)
    nonzero = (jax.lax.bitcast_convert_type(g32, jnp.uint32) & 0x7FFFFFFF) != 0
    cast = (g32 * scale).astype(dtype)
    bits = jax.lax.bitcast_convert_type(cast, uint)
    mant = bits & uint((1 << fi.nmant) - 1)
    expo = (bits >> fi.nmant) & uint((1 << fi.nexp) - 1)
    finite = jnp.isfinite(cast.astype(jnp.float32))
    is_zero = (expo == 0) & (mant == 0) & finite  # finite: fnuz float8 spell NaN as -0
    is_subnormal = (expo == 0) & (mant != 0)

    def count(x):
        return jnp.sum(nonzero & x, dtype=jnp.int32)

    return jnp.stack([jnp.sum(nonzero, dtype=jnp.int32), count(is_zero),
                      count(is_subnormal), count(~finite)])


def _is_float_leaf(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def underflow_report(grads: Any, dtype: Any, loss_scale: Any = 1.0) -> Dict[str, LeafReport]:
    """Per-leaf fractions of gradients that underflow, go subnormal or overflow in ``dtype``.

    For each floating-point leaf ``g`` (true, unscaled gradient values; upcast to
    float32) the scaled cast ``(g * loss_scale).astype(dtype)`` is what a loss-scaled
    backward pass in ``dtype`` would store (Micikevicius et al. 2018, section 3.2).
    Fractions are of the leaf's non-zero elements (0.0 for a leaf with none).
    Non-floating leaves (step counters, masks) are skipped.

    Args:
      grads: any pytree of gradient arrays: nested dicts/lists, dataclasses, a Flax
        ``nnx.State``.
      dtype: the low-precision dtype to test (``jnp.float16``, ``"bf16"``, a float8
        dtype, ...).
      loss_scale: the loss scale ``S`` (> 0): a number, a scalar array or a jaxmp
        loss-scale object (its ``loss_scale`` is used).

    Returns:
      ``{path: LeafReport}`` where ``path`` is the leaf's key path joined by ``/``
      (``"blocks/0/attn/wq"``; an ``nnx.Variable``'s trailing ``value`` is dropped),
      in tree-flattening order.

    Raises:
      ValueError: an unsupported ``dtype``, or ``loss_scale`` not a finite positive
        scalar.
    """
    dtype = _check_dtype(dtype)
    scale = _resolve_scale(loss_scale)
    flat, _ = jax.tree_util.tree_flatten_with_path(grads)
    flat = [(path, leaf) for path, leaf in flat if _is_float_leaf(leaf)]
    if not flat:
        return {}
    counts = _count_all([leaf for _, leaf in flat], jnp.asarray(scale, jnp.float32), dtype)
    counts = np.asarray(jax.device_get(counts))
    report = {}
    for (path, _), (nonzero, under, sub, over) in zip(flat, counts):
        n = max(int(nonzero), 1)  # a leaf with no non-zero gradient reports 0.0
        report[path_name(path)] = LeafReport(int(nonzero), int(under) / n, int(sub) / n,
                                              int(over) / n)
    return report


@jax.jit(static_argnames=("dtype",))
def _count_all(leaves, scale, dtype):
    return jnp.stack([_leaf_counts(g, scale, dtype) for g in leaves])


def summarize(report: Dict[str, LeafReport]) -> LeafReport:
    """Totals over all leaves of an :func:`underflow_report`.

    Args:
      report: the ``{path: LeafReport}`` mapping.

    Returns:
      A :class:`LeafReport` whose ``nonzero`` is the total count and whose fractions
      are the leaves' fractions weighted by their non-zero counts (i.e. fractions of
      all non-zero gradients of the model). All zeros for an empty report.
    """
    total = sum(r.nonzero for r in report.values())
    if total == 0:
        return LeafReport(0, 0.0, 0.0, 0.0)

    def weighted(field):
        return sum(getattr(r, field) * r.nonzero for r in report.values()) / total

    return LeafReport(total, weighted("underflow"), weighted("subnormal"), weighted("overflow"))


def format_report(report: Dict[str, LeafReport], top: Optional[int] = 10) -> str:
    """A plain-text table of the leaves with the most underflow, plus a total line.

    Args:
      report: the ``{path: LeafReport}`` mapping of :func:`underflow_report`.
      top: how many leaves to list (>= 1), worst underflow fraction first (ties:
        larger overflow, then path); None lists all.

    Returns:
      The table, one line per leaf, percentages with two decimals.

    Raises:
      ValueError: ``top`` is not a positive integer or None.
    """
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 1):
        raise ValueError(f"top must be a positive integer or None, got {top!r}")
    rows = sorted(report.items(), key=lambda kv: (-kv[1].underflow, -kv[1].overflow, kv[0]))
    shown = rows if top is None else rows[:top]
    width = max([len("leaf"), len("TOTAL")] + [len(p) for p, _ in shown])
    header = f"{'leaf':<{width}}  {'nonzero':>10}  {'underflow':>9}  {'subnormal':>9}  {'overflow':>9}"

    def line(name, r):
        return (f"{name:<{width}}  {r.nonzero:>10d}  {100 * r.underflow:>8.2f}%  "
                f"{100 * r.subnormal:>8.2f}%  {100 * r.overflow:>8.2f}%")

    lines = [header, "-" * len(header)] + [line(p, r) for p, r in shown]
    if len(shown) < len(rows):
        lines.append(f"... {len(rows) - len(shown)} more leaves")
    lines += ["-" * len(header), line("TOTAL", summarize(report))]
    return "\n".join(lines)


def suggest_loss_scale(grads: Any, dtype: Any = jnp.float16, headroom: float = 8.0) -> float:
    """The largest power of two ``S`` with ``max|g| * S < finfo(dtype).max / headroom``.

    Loss scaling shifts gradients up by ``S`` (Micikevicius et al. 2018, section 3.2,
    who note there is no downside to a large ``S`` as long as nothing overflows); a
    power of two makes scaling and unscaling exact. ``S`` may be below 1 when the
    largest gradient already exceeds the limit (case LS-3).

    The default ``headroom=8`` (three binades) is a heuristic, not a published
    constant: it leaves room for one growth step of a dynamic loss scale
    (``growth_factor=2``) and a further 4x for the step-to-step variation of the
    largest gradient and for intermediate activation gradients, which the parameter
    gradients given here do not show. Use ``headroom=1`` for the raw limit.

    Args:
      grads: pytree of true (unscaled) gradients; non-floating leaves are skipped.
      dtype: the dtype the scaled gradients are stored in.
      headroom: factor (>= 1) kept free below ``finfo(dtype).max``.

    Returns:
      ``S`` as a Python float (a power of two).

    Raises:
      ValueError: ``headroom`` < 1 or not finite, an unknown ``dtype``, no floating
        leaves, any non-finite gradient, or all gradients zero.
    """
    if not (isinstance(headroom, (int, float)) and math.isfinite(headroom) and headroom >= 1):
        raise ValueError(f"headroom must be a finite number >= 1, got {headroom!r}")
    dtype = canonical_dtype(dtype)
    leaves = [x for x in jax.tree_util.tree_leaves(grads) if _is_float_leaf(x)]
    if not leaves:
        raise ValueError("grads has no floating-point leaves")
    max_abs = float(_max_abs(leaves))
    if not math.isfinite(max_abs):
        raise ValueError("grads contain inf or NaN; no loss scale makes them finite")
    if max_abs == 0.0:
        raise ValueError("grads are all zero; any loss scale works, none can be suggested")
    limit = float(jnp.finfo(dtype).max) / headroom
    # frexp: limit / max_abs = m * 2**e with 0.5 <= m < 1, so 2**(e-1) <= ratio < 2**e.
    _, e = math.frexp(limit / max_abs)
    scale = math.ldexp(1.0, e - 1)
    if max_abs * scale >= limit:  # ratio exactly a power of two: need strictly below
        scale /= 2
    return scale


@jax.jit
def _max_abs(leaves):
    # NaN propagates through max, so a NaN anywhere makes the result non-finite.
    return jnp.max(jnp.stack([jnp.max(jnp.abs(x.astype(jnp.float32))) for x in leaves]))
