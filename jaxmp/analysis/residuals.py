"""The arrays a function's forward pass keeps for its backward pass (residuals), traced.

:func:`saved_residuals` lists them from ``jax.vjp`` under abstract evaluation (nothing is
allocated); :func:`residual_breakdown` groups them by the source line that made them.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import jax
import numpy as np
from jax.extend import core as jex_core, source_info_util

__all__ = ["Residual", "saved_residuals", "residual_breakdown"]


@dataclasses.dataclass(frozen=True)
class Residual:
    """One array the forward pass keeps for the backward pass.

    Attributes:
      shape: the array's shape.
      dtype: its dtype name (``"bfloat16"``, ``"int32"``, ...); the E4M3 activation that
        :mod:`jaxmp.fp8` saves as uint8 bits is named ``"float8_e4m3fn"``.
      nbytes: ``prod(shape) * itemsize``.
      kind: ``"computed"`` (counted as activation memory), ``"argument"``, ``"literal"``
        or ``"constant"``.
      source: where it comes from, as JAX describes it, e.g. ``"output of exp from
        jaxmp/ops.py:157:8 (_masked_softmax_f32)"``.
    """

    shape: Tuple[int, ...]
    dtype: str
    nbytes: int
    kind: str
    source: str


def _kind(source: str) -> str:
    if source.startswith("from the argument"):
        return "argument"
    if source == "from a literal":
        return "literal"
    if source == "from a constant":
        return "constant"
    return "computed"


def _checkpoint_name(eqn) -> Optional[str]:
    """The ``jax.ad_checkpoint.checkpoint_name`` an equation gives its output, if any."""
    if eqn.primitive.name == "name":
        return eqn.params.get("name")
    prim = eqn.params.get("_prim")  # newer JAX: a call_hi primitive holding a CheckpointName
    return prim.name if type(prim).__name__ == "CheckpointName" else None


def _attributed(jaxpr, residuals, arg_names: Sequence[str]) -> List[Tuple[Any, str]]:
    """``[(aval, source)]`` for the residual variables ``residuals`` of ``jaxpr``: literals,
    then constants, arguments and equation outputs in the jaxpr's order.

    The wording is ``jax.ad_checkpoint.print_saved_residuals``' (``output of exp from
    FILE:LINE:COL (FUNCTION)``), from the public jaxpr types (``jax.extend.core``) and
    ``jax.extend.source_info_util.summarize``. A ``reduce_precision`` is looked through to
    the equation that produced its operand, as JAX does.
    """
    through = {e.outvars[0]: e.invars[0] for e in jaxpr.eqns
               if e.primitive.name == "reduce_precision"}
    wanted = {through.get(v, v) for v in residuals if not isinstance(v, jex_core.Literal)}
    out = [(v.aval, "from a literal") for v in residuals if isinstance(v, jex_core.Literal)]
    out += [(v.aval, "from a constant") for v in jaxpr.constvars if v in wanted]
    out += [(v.aval, f"from the argument {arg_names[i]}" if arg_names[i] else
             f"from the argument at flattened index {i}")
            for i, v in enumerate(jaxpr.invars) if v in wanted]
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            if v not in wanted:
                continue
            src = source_info_util.summarize(eqn.source_info)
            if (name := _checkpoint_name(eqn)) is not None:
                out.append((v.aval, f"named '{name}' from {src}"))
            elif eqn.primitive.name in ("jit", "pjit"):
                out.append((v.aval, f"output of jitted function '{eqn.params['name']}' from {src}"))
            else:
                out.append((v.aval, f"output of {eqn.primitive.name} from {src}"))
    return out


def saved_residuals(fn: Callable, *args, argnums: Any = 0) -> List[Residual]:
    """The residuals ``jax.vjp`` of ``fn`` with respect to ``args[argnums]`` saves.

    Like ``jax.ad_checkpoint.print_saved_residuals`` (the same list, read from the jaxpr of
    ``jax.vjp`` with public APIs only), but only the ``argnums`` arguments
    are differentiated (as ``jax.grad(fn, argnums)`` does): the others are traced as
    plain inputs, so a residual that *is* one of them is reported as an argument, and
    computations on them that need no derivative save nothing. Works on abstract
    arguments (``jax.ShapeDtypeStruct`` leaves); nothing is allocated.

    Args:
      fn: a function of ``args`` returning a pytree of float arrays (e.g. a loss).
      *args: pytrees of arrays or ``jax.ShapeDtypeStruct``.
      argnums: int or sequence of ints, the arguments to differentiate.

    Returns:
      One :class:`Residual` per saved array, in the order JAX lists them.

    Raises:
      ValueError: an ``argnums`` entry outside ``[0, len(args))``.
    """
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not nums or any(not isinstance(i, int) or not 0 <= i < len(args) for i in nums):
        raise ValueError(f"argnums={argnums!r} must name arguments in [0, {len(args)})")
    flat, tree = jax.tree_util.tree_flatten_with_path(args)
    leaves = [x for _, x in flat]
    names = [jax.tree_util.keystr(p) for p, _ in flat]

    def forward(*leaves_in):
        full = list(jax.tree.unflatten(tree, leaves_in))

        def of_diff(*diff):
            call = list(full)
            for i, d in zip(nums, diff):
                call[i] = d
            return fn(*call)

        return jax.vjp(of_diff, *(full[i] for i in nums))

    closed, shapes = jax.make_jaxpr(forward, return_shape=True)(*leaves)
    num_res = len(jax.tree.leaves(shapes[1]))
    jaxpr = closed.jaxpr
    out = []
    for aval, source in _attributed(jaxpr, jaxpr.outvars[len(jaxpr.outvars) - num_res:], names):
        shape = tuple(int(d) for d in aval.shape)
        dtype = np.dtype(aval.dtype)
        name = dtype.name
        if name == "uint8" and "(_stash)" in source:
            # jaxmp.fp8 saves its E4M3 activation as uint8 bits (safe under jax.checkpoint):
            # report what the bits are.
            name = "float8_e4m3fn"
        out.append(Residual(shape, name, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize,
                            _kind(source), source))
    return out


def residual_breakdown(residuals: Sequence[Residual], top: Optional[int] = None) -> List[dict]:
    """Counted (``kind == "computed"``) residual bytes grouped by source and dtype.

    Returns:
      ``[{"source": str, "dtype": str, "count": int, "bytes": int}, ...]``, largest
      ``bytes`` first, at most ``top`` rows (all when None). A source names the
      primitive and the line that produced the array.
    """
    groups: Dict[Tuple[str, str], List[int]] = collections.defaultdict(lambda: [0, 0])
    for r in residuals:
        if r.kind == "computed":
            g = groups[(r.source, r.dtype)]
            g[0] += 1
            g[1] += r.nbytes
    rows = [{"source": s, "dtype": d, "count": c, "bytes": b} for (s, d), (c, b) in groups.items()]
    rows.sort(key=lambda r: (-r["bytes"], r["source"]))
    return rows if top is None else rows[:top]
