"""Trace-time context: the rule table activations are annotated by (:func:`use_rules`,
:func:`constrain`). What the model needs inside the train step's ``shard_map`` (the expert
axis, the FSDP gather, the dispatch dtype) it takes as arguments of its call
(:func:`jaxmp.train.step.forward_args` of a :class:`~jaxmp.sharding.StepPlan`)."""
from __future__ import annotations

import contextlib
import threading
from typing import Optional, Sequence

import jax
from jax.sharding import Mesh

from jaxmp.sharding.rules import LOGICAL_AXES, Rules, logical_to_sharding, rule_table

__all__ = ["use_rules", "constrain"]


_CONTEXT = threading.local()


@contextlib.contextmanager
def use_rules(mesh: Mesh, rules: Rules):
    """Within this context, :func:`constrain` annotates activations by ``rules`` on ``mesh``.

    Annotations are made when a function is traced. The context also enters
    ``jax.set_mesh(mesh)``, which is part of ``jax.jit``'s trace-cache key, so a function
    traced before outside the context is traced again inside it. Switching only the rules
    on the same mesh does not retrace an already-traced function: jit a fresh one.
    """
    table = rule_table(rules)
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
