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

FP8 (:mod:`jaxmp.fp8`): :func:`fp8_quantization` counts, for one matmul operand under one
recipe, the elements that FP8 flushes to zero, leaves subnormal or saturates, and its
relative error; :func:`fp8_report` does it per module and recipe for the operands a
forward pass records (``MoETransformer.__call__(tokens, operands={})``, filled by
:func:`jaxmp.models.matmul`). One scale per tensor lets a single
outlier set it for every element; block scales confine it to its tile::

    x = jnp.ones((256, 256)).at[0, 0].set(2.0**19)   # one outlier
    fp8_quantization(x, Recipe.tensorwise()).underflow  # 65535/65536: every 1.0 -> 0
    fp8_quantization(x, Recipe.rowwise()).underflow     # 255/65536: its row only
    fp8_quantization(x, Recipe.blockwise()).underflow   # 127/65536: its 1x128 tile only

(with the outlier's scale ``2**19 / 448``, 1.0 becomes ``0.44 * 2**-9``, below half of
E4M3's smallest subnormal ``2**-9``).

Counting runs in one jitted function on the device holding the gradients; only a
``[leaves, 4]`` int32 table comes back to the host. Zero and subnormal results are
classified from the bit pattern, so the answer does not depend on whether the
backend treats subnormal operands of comparisons as zero. Note that XLA:CPU (and TPU)
flush float32 subnormals to zero in arithmetic, so bfloat16 subnormals (which sit
below float32's normal range) do not occur there.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Dict, Mapping, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._checks import Int, check

from jaxmp.precision import fp8 as _fp8
from jaxmp.precision._paths import path_name
from jaxmp.precision.policy import canonical_dtype

__all__ = [
    "LeafReport",
    "DtypeRange",
    "underflow_report",
    "summarize",
    "format_report",
    "suggest_loss_scale",
    "FP8Report",
    "FP8_ROLES",
    "fp8_quantization",
    "fp8_report",
    "format_fp8_report",
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
    check("top", top, Int(1, text="a positive integer or None", none_ok=True))
    rows = sorted(report.items(), key=lambda kv: (-kv[1].underflow, -kv[1].overflow, kv[0]))
    shown = rows if top is None else rows[:top]
    width = max([len("leaf"), len("TOTAL")] + [len(p) for p, _ in shown])
    header = (f"{'leaf':<{width}}  {'nonzero':>10}  {'underflow':>9}  {'subnormal':>9}  "
              f"{'overflow':>9}")

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


# ----------------------------------------------------------------------------- FP8


class FP8Report(NamedTuple):
    """What one FP8 quantization does to a tensor.

    Attributes:
      nonzero: number of non-zero elements.
      underflow: fraction of them that become exactly 0 (flushed to zero).
      subnormal: fraction that become subnormal in the format (below its smallest
        normal: ``2**-6`` for E4M3, ``2**-14`` for E5M2): kept, with fewer mantissa bits.
      saturated: fraction whose scaled magnitude rounds above the format's maximum, so
        that :func:`jaxmp.fp8.quantize` clips it to +-max (448 for E4M3, 57344 for E5M2).
        Scales from the tensor's own amax never saturate; a delayed scale from a smaller
        history amax does.
      rel_error: ``||dequantize(quantize(x)) - x|| / ||x||`` (0.0 for an all-zero tensor).
    """

    nonzero: int
    underflow: float
    subnormal: float
    saturated: float
    rel_error: float


# The operands of a matmul: its activation "x", its weight "w", its output gradient "g".
FP8_ROLES = {"x": "activation", "w": "weight", "g": "gradient"}


def _fp8_scales(x: jax.Array, recipe: "_fp8.Recipe", role: str, amax: Optional[Any]) -> tuple:
    """``(x2d, per-element float32 scales, dtype)`` of an operand under ``recipe``."""
    dtype = recipe.bwd_dtype if role == "g" else recipe.fwd_dtype
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32) if x.ndim != 2 else x.astype(jnp.float32)
    if recipe.name in ("tensorwise", "delayed"):
        a = jnp.max(jnp.abs(x2)) if amax is None else jnp.asarray(amax, jnp.float32)
        return x2, jnp.broadcast_to(_fp8.scale_from_amax(a, dtype, recipe.margin), x2.shape), dtype
    if recipe.name == "rowwise":  # activations and gradients by row, weights by output column
        axis = 0 if role == "w" else 1
        s = _fp8.scale_from_amax(jnp.max(jnp.abs(x2), axis=axis, keepdims=True), dtype,
                                 recipe.margin)
        return x2, jnp.broadcast_to(s, x2.shape), dtype
    block = (_fp8.BLOCK, _fp8.BLOCK) if role == "w" else (1, _fp8.BLOCK)
    _, s = _fp8.quantize_blocks(x2, block, dtype)
    full = jnp.repeat(jnp.repeat(s, block[0], axis=0), block[1], axis=1)[:x2.shape[0], :x2.shape[1]]
    return x2, full, dtype


@functools.partial(jax.jit, static_argnames=("recipe", "role"))
def _fp8_counts(x, recipe, role, amax):
    """The raw counts of :func:`fp8_quantization`, as one compiled program per operand
    shape, recipe and role (op-by-op dispatch of the scales cost more than the counts)."""
    x2, scales, dtype = _fp8_scales(x, recipe, role, amax)
    fi = jnp.finfo(dtype)
    q = _fp8.quantize(x2, scales, dtype)
    nonzero = x2 != 0
    qf = q.astype(jnp.float32)
    y = jnp.abs(x2 * (1.0 / scales))
    # Rounds above max: beyond max plus half the format's step there (2**(maxexp-1-nmant)).
    limit = float(fi.max) + 0.5 * 2.0 ** (int(np.log2(float(fi.max))) - fi.nmant)
    err = qf * scales - x2
    return (jnp.sum(nonzero, dtype=jnp.int32), jnp.sum(nonzero & (qf == 0), dtype=jnp.int32),
            jnp.sum(nonzero & (qf != 0) & (jnp.abs(qf) < float(fi.tiny)), dtype=jnp.int32),
            jnp.sum(nonzero & jnp.isfinite(x2) & (y >= limit), dtype=jnp.int32),
            jnp.sum(err.astype(jnp.float32) ** 2), jnp.sum(x2 ** 2))


def fp8_quantization(x: Any, recipe: "_fp8.Recipe", role: str = "x",
                     amax: Optional[Any] = None) -> FP8Report:
    """Counts what ``recipe`` does to one matmul operand ``x``.

    The operand is viewed as a matrix (leading axes flattened, the last axis kept: the
    contraction of an activation, the output columns of a weight ``[K, N]``) and scaled as
    the recipe scales it in the forward pass (:mod:`jaxmp.fp8`): one scale per tensor
    (tensorwise, delayed), per row (rowwise activation or gradient), per output column
    (rowwise weight), per 1x128 tile (blockwise activation or gradient) or per 128x128
    block (blockwise weight). Activations and weights use the forward format (E4M3),
    gradients the backward one (E5M2 for tensorwise and delayed).

    Args:
      x: the operand, a float array of rank >= 1 (rank 2 for a weight).
      recipe: a :class:`jaxmp.fp8.Recipe`.
      role: ``"x"`` (activation), ``"w"`` (weight) or ``"g"`` (output gradient).
      amax: for tensorwise / delayed, the amax the scale comes from (a delayed
        history's max); default the tensor's own amax (current scaling, the best a
        delayed scale can do).

    Returns:
      An :class:`FP8Report`.

    Raises:
      ValueError: not a Recipe, an unknown role, or a non-floating / rank-0 ``x``.
    """
    if not isinstance(recipe, _fp8.Recipe):
        raise ValueError(f"recipe must be a jaxmp.fp8.Recipe, got {recipe!r}")
    if role not in FP8_ROLES:
        raise ValueError(f"role={role!r}; allowed: "
                         f"{', '.join(f'{k} ({v})' for k, v in FP8_ROLES.items())}")
    if not _is_float_leaf(x) or jnp.ndim(x) < 1:
        raise ValueError("x must be a floating-point array of rank >= 1, got "
                         f"{getattr(x, 'dtype', type(x))} {jnp.shape(x)}")
    amax = None if amax is None else jnp.asarray(amax, jnp.float32)
    nz, under, sub, sat, err2, sq = (np.asarray(v) for v in jax.device_get(
        _fp8_counts(jnp.asarray(x), recipe, role, amax)))
    n = max(int(nz), 1)
    return FP8Report(int(nz), int(under) / n, int(sub) / n, int(sat) / n,
                     float(np.sqrt(err2 / sq)) if sq > 0 else 0.0)


def fp8_report(operands: Mapping[str, Mapping[str, Any]],
               recipes: Sequence["_fp8.Recipe"] = (_fp8.Recipe.tensorwise(), _fp8.Recipe.rowwise(),
                                                   _fp8.Recipe.blockwise())
               ) -> Dict[str, Dict[str, Dict[str, FP8Report]]]:
    """:func:`fp8_quantization` of every operand of every matmul, under each recipe.

    Args:
      operands: ``{name: {"x": activation, "w": weight, ...}}``, e.g. the dict a forward
        pass ``MoETransformer.__call__(tokens, operands=found)`` filled
        (``"blocks/0/mlp/w_gate"``); keys other than ``x``, ``w``, ``g`` are ignored.
      recipes: the recipes to compare (delayed is counted at its best case, the current
        amax; pass ``amax`` to :func:`fp8_quantization` for a stale one).

    Returns:
      ``{name: {str(recipe): {role: FP8Report}}}`` in the order given.
    """
    out: Dict[str, Dict[str, Dict[str, FP8Report]]] = {}
    for name, tensors in operands.items():
        roles = {r: tensors[r] for r in FP8_ROLES if r in tensors and tensors[r] is not None}
        out[name] = {str(r): {role: fp8_quantization(t, r, role) for role, t in roles.items()}
                     for r in recipes}
    return out


def format_fp8_report(report: Mapping[str, Mapping[str, Mapping[str, FP8Report]]]) -> str:
    """:func:`fp8_report` as a plain-text table: one line per matmul, operand and recipe."""
    header = (f"{'matmul':<32} {'op':<2} {'recipe':<12} {'nonzero':>9} {'zero':>8} {'subnorm':>8} "
              f"{'saturated':>9} {'rel err':>8}")
    lines = [header, "-" * len(header)]
    for name, by_recipe in report.items():
        for recipe, by_role in by_recipe.items():
            for role, r in by_role.items():
                lines.append(f"{name:<32} {role:<2} {recipe:<12} {r.nonzero:>9d} "
                             f"{100 * r.underflow:>7.3f}% {100 * r.subnormal:>7.2f}% "
                             f"{100 * r.saturated:>8.3f}% {100 * r.rel_error:>7.3f}%")
    return "\n".join(lines)
