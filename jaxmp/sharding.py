"""Logical axis names -> mesh axes: the only place the project decides how arrays are laid out.

Models name the axes of their parameters with logical names (``out_sharding`` metadata,
see :mod:`jaxmp.models.transformer`) and annotate activations with ``"batch"``. A *rule
table* maps each logical name to a mesh axis name, a tuple of mesh axis names, or None
(replicated), in the format of Flax's ``LogicalRules`` (a tuple of pairs). A new
parallelism layout is a new table, not a model change:

* :data:`DATA_PARALLEL_RULES`: the batch is split over mesh axis ``"data"``, every
  parameter is replicated (the scanned layout's stacked ``layers`` axis included).
* :data:`FSDP_RULES`: as above, plus every parameter's ``embed`` axis split over
  ``"data"`` (ZeRO-3 / FSDP style sharding of the weights; XLA inserts the gathers).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Mapping, Optional, Sequence, Tuple, Union

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = [
    "LOGICAL_AXES",
    "DATA_PARALLEL_RULES",
    "FSDP_RULES",
    "make_mesh",
    "logical_to_sharding",
    "state_shardings",
    "batch_sharding",
    "check_batch_divisible",
    "use_rules",
    "constrain",
]

# Every logical name the models use; a rule table must map each (None = replicated).
# "layers" is the leading axis of the scanned layout's stacked variables
# (jaxmp.models.transformer): replicated in every table here, one slice per scan step.
LOGICAL_AXES = ("batch", "vocab", "embed", "heads", "head_dim", "mlp", "expert", "expert_mlp",
                "layers")

DATA_PARALLEL_RULES: Tuple[Tuple[str, Any], ...] = (
    ("batch", "data"),
    ("vocab", None),
    ("embed", None),
    ("heads", None),
    ("head_dim", None),
    ("mlp", None),
    ("expert", None),
    ("expert_mlp", None),
    ("layers", None),
)

FSDP_RULES: Tuple[Tuple[str, Any], ...] = tuple(
    (name, "data" if name == "embed" else axis) for name, axis in DATA_PARALLEL_RULES)

Rules = Union[Sequence[Tuple[str, Any]], Mapping[str, Any]]


def _as_dict(rules: Rules) -> dict:
    return dict(rules.items() if isinstance(rules, Mapping) else rules)


def make_mesh(num_devices: Optional[int] = None, axis_name: str = "data") -> Mesh:
    """A 1-D mesh over the first ``num_devices`` of ``jax.devices()``.

    Args:
      num_devices: devices in the mesh; None = all.
      axis_name: the mesh axis name.

    Returns:
      ``jax.sharding.Mesh`` of shape ``(num_devices,)``.

    Raises:
      ValueError: ``num_devices`` < 1 or more than are available.
    """
    devices = jax.devices()
    n = len(devices) if num_devices is None else num_devices
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= len(devices):
        raise ValueError(f"num_devices={num_devices!r} must be an integer in [1, {len(devices)}] "
                         f"(the available {devices[0].platform} devices)")
    return Mesh(np.asarray(devices[:n]), (axis_name,))


def logical_to_sharding(logical_axes: Sequence[Optional[str]], mesh: Mesh, rules: Rules) -> NamedSharding:
    """Maps one array's logical axis names to a ``NamedSharding`` on ``mesh``.

    Args:
      logical_axes: one logical name (or None, replicated) per array dimension.
      mesh: the device mesh.
      rules: a rule table (pairs or a mapping), e.g. :data:`DATA_PARALLEL_RULES`.

    Returns:
      ``NamedSharding(mesh, PartitionSpec(...))``.

    Raises:
      ValueError: a logical name the rules do not map, a mesh axis not in ``mesh``, or
        one mesh axis used for two dimensions.
    """
    table = _as_dict(rules)
    spec, used = [], set()
    for name in logical_axes:
        if name is None:
            spec.append(None)
            continue
        if name not in table:
            raise ValueError(f"logical axis {name!r} has no rule; the rules map {sorted(table)}")
        target = table[name]
        axes = () if target is None else (target,) if isinstance(target, str) else tuple(target)
        for a in axes:
            if a not in mesh.axis_names:
                raise ValueError(f"rule {name!r} -> {target!r}: mesh axis {a!r} is not in the mesh "
                                 f"axes {mesh.axis_names}")
            if a in used:
                raise ValueError(f"mesh axis {a!r} would shard two dimensions of logical axes "
                                 f"{tuple(logical_axes)}")
            used.add(a)
        spec.append(target if target is None or isinstance(target, str) else tuple(target))
    return NamedSharding(mesh, PartitionSpec(*spec))


def _leaf_axes(x) -> Optional[tuple]:
    get = getattr(x, "get_metadata", None)
    axes = get().get("out_sharding") if get is not None else None
    return tuple(axes) if axes else None


def state_shardings(state: Any, mesh: Mesh, rules: Rules) -> Any:
    """Shardings for a pytree of ``nnx.Variable`` s (an ``nnx.State``) or arrays.

    Variables with ``out_sharding`` metadata get :func:`logical_to_sharding` of it; every
    other leaf is replicated. The result has ``state``'s structure (each variable holding
    a ``NamedSharding``, as ``flax.nnx.get_named_sharding`` builds it), so it can be given
    to ``jax.jit(in_shardings=...)`` or ``jax.device_put`` together with ``state``.

    Raises:
      ValueError: as :func:`logical_to_sharding`, or metadata whose length differs from
        the variable's rank.
    """
    from flax import nnx  # deferred: this module is imported by the models

    replicated = NamedSharding(mesh, PartitionSpec())

    def one(x):
        if isinstance(x, nnx.Variable):
            axes = _leaf_axes(x)
            if axes is None:
                return x.replace(replicated)
            shape = tuple(getattr(x.get_value(), "shape", ()))  # also abstract (eval_shape) values
            if len(axes) != len(shape):
                raise ValueError(f"logical axes {axes} do not match a variable of shape {shape}")
            return x.replace(logical_to_sharding(axes, mesh, rules))
        return replicated

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: Mesh, rules: Rules) -> NamedSharding:
    """Sharding of a [B, T] token batch: B over the ``batch`` rule's mesh axes, T whole."""
    return logical_to_sharding(("batch", None), mesh, rules)


def check_batch_divisible(global_batch: int, mesh: Mesh, rules: Rules = DATA_PARALLEL_RULES) -> None:
    """Checks that the global batch splits evenly over the mesh axes of ``batch``.

    Raises:
      ValueError: e.g. "global batch 12 is not divisible by the 8 devices of mesh axis
        'data'", or a global batch < 1.
    """
    if isinstance(global_batch, bool) or not isinstance(global_batch, (int, np.integer)) or global_batch < 1:
        raise ValueError(f"global batch {global_batch!r} must be a positive integer")
    target = _as_dict(rules).get("batch")
    axes = () if target is None else (target,) if isinstance(target, str) else tuple(target)
    n = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
    if global_batch % n:
        names = ", ".join(repr(a) for a in axes)
        raise ValueError(f"global batch {global_batch} is not divisible by the {n} devices of "
                         f"mesh axis {names}")


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
    """``jax.lax.with_sharding_constraint`` by logical names under :func:`use_rules`; else identity."""
    ctx = getattr(_CONTEXT, "value", None)
    if ctx is None:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_sharding(logical_axes, *ctx))
