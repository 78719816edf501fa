"""Trace-time context: the rule table activations are annotated by (:func:`use_rules`,
:func:`constrain`) and, inside the train step's ``shard_map``, the expert axis, the FSDP
gather and the dispatch dtype the model reads (:func:`in_step`)."""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Optional, Sequence

import jax
from jax.sharding import Mesh

from jaxmp._checks import check_choice
from jaxmp.sharding.rules import DISPATCH_DTYPES, LOGICAL_AXES, Rules, _as_dict, logical_to_sharding

__all__ = ["use_rules", "constrain", "in_step", "expert_axis", "param_gather", "dispatch_dtype"]


_CONTEXT = threading.local()


@contextlib.contextmanager
def use_rules(mesh: Mesh, rules: Rules):
    """Within this context, :func:`constrain` annotates activations by ``rules`` on ``mesh``.

    Annotations are made when a function is traced. The context also enters
    ``jax.set_mesh(mesh)``, which is part of ``jax.jit``'s trace-cache key, so a function
    traced before outside the context is traced again inside it. Switching only the rules
    on the same mesh does not retrace an already-traced function: jit a fresh one.
    """
    table = _as_dict(rules)
    unknown = sorted(set(LOGICAL_AXES) - set(table))
    if unknown:
        raise ValueError(f"rules do not map the logical axes {unknown}")
    previous = getattr(_CONTEXT, "value", None)
    _CONTEXT.value = (mesh, rules)
    try:
        with jax.set_mesh(mesh):
            yield
    finally:
        _CONTEXT.value = previous


def constrain(x: jax.Array, logical_axes: Sequence[Optional[str]]) -> jax.Array:
    """``jax.lax.with_sharding_constraint`` by logical names under :func:`use_rules`; else
    the identity."""
    ctx = getattr(_CONTEXT, "value", None)
    if ctx is None:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_sharding(logical_axes, *ctx))


_STEP = threading.local()


@contextlib.contextmanager
def in_step(expert_axis_name: Optional[str] = None, gather: Optional[Any] = None,
            dispatch: str = "compute"):
    """Within this context (entered by the train step, inside ``shard_map``, at trace time),
    :func:`expert_axis`, :func:`param_gather` and :func:`dispatch_dtype` return the given
    values.

    Args:
      expert_axis_name: the mesh axis the routed experts are split over, or None.
      gather: ``gather(value, logical_axes, dtype) -> value``, the FSDP all-gather of a
        parameter split over the data axis (:func:`jaxmp.comm.gather_param`), or None.
      dispatch: one of :data:`DISPATCH_DTYPES`.

    Raises:
      ValueError: ``dispatch`` not in :data:`DISPATCH_DTYPES`.
    """
    check_choice("dispatch", dispatch, DISPATCH_DTYPES)
    previous = getattr(_STEP, "value", None)
    _STEP.value = (expert_axis_name, gather, dispatch)
    try:
        yield
    finally:
        _STEP.value = previous


def expert_axis() -> Optional[str]:
    """The mesh axis of expert parallelism inside the train step; None elsewhere."""
    ctx = getattr(_STEP, "value", None)
    return None if ctx is None else ctx[0]


def param_gather() -> Optional[Any]:
    """The FSDP parameter gather inside the train step (see :func:`in_step`); None elsewhere."""
    ctx = getattr(_STEP, "value", None)
    return None if ctx is None else ctx[1]


def dispatch_dtype() -> str:
    """The dtype of the expert-parallel dispatch inside the train step (see :func:`in_step`):
    ``"compute"`` or ``"e4m3"``; ``"compute"`` elsewhere."""
    ctx = getattr(_STEP, "value", None)
    return "compute" if ctx is None else ctx[2]
