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


def saved_residuals(fn: Callable, *args, argnums: Any = 0) -> List[Residual]:
    """The residuals ``jax.vjp`` of ``fn`` with respect to ``args[argnums]`` saves.

    Like ``jax.ad_checkpoint.print_saved_residuals``, but only the ``argnums`` arguments
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
    # Private but documented by its public printer; no public call returns the list.
    from jax._src.ad_checkpoint import _saved_residuals

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
    info = jaxpr.debug_info
    jaxpr = jaxpr.replace(outvars=jaxpr.outvars[len(jaxpr.outvars) - num_res:],
                          debug_info=info._replace(result_paths=None) if info is not None else None)
    out = []
    for aval, source in _saved_residuals(jaxpr, names):
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
