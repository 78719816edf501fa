"""Logical axis names -> mesh axes: the only place the project decides how arrays are laid out.

Models name the axes of their parameters with logical names (``out_sharding`` metadata,
see :mod:`jaxmp.models.transformer`) and annotate activations with ``"batch"``. A *rule
table* maps each logical name to a mesh axis name, a tuple of mesh axis names, or None
(replicated), in the format of Flax's ``LogicalRules`` (a tuple of pairs). A new
parallelism layout is a new table, not a model change:

* :data:`DATA_PARALLEL_RULES`: the batch is split over mesh axis ``"data"``, every
  parameter is replicated (the scanned layout's stacked ``layers`` axis included).
* :data:`FSDP_RULES`: as above, plus every parameter's ``embed`` axis split over
  ``"data"``.

The trainer runs on a 2-D mesh ``("data", "expert")`` (:func:`make_mesh` with
``expert=``) and takes its tables from :func:`layout` (``parallel.strategy`` and
``parallel.expert``): where the float32 master weights and optimizer state live at
rest, and where the parameters are as the forward pass reads them:

============ ================================ =====================================
strategy     state at rest (master, moments)  parameters in the forward pass
============ ================================ =====================================
``dp``       replicated                       replicated
``zero1``    ``embed`` split over ``data``    a compute-dtype copy, replicated
``fsdp``     ``embed`` split over ``data``    split; each layer gathers its own
============ ================================ =====================================

In every strategy the routed experts' ``expert`` axis is split over ``"expert"``
(expert parallelism) and the batch over both mesh axes. The router's output axis is
``expert_logit``, never split: every device routes to every expert. Inside the train
step (``shard_map``), :func:`in_step` tells the model which mesh axis carries expert
parallelism, how to gather an FSDP-split parameter and in which dtype the expert
dispatch travels (:func:`expert_axis`, :func:`param_gather`, :func:`dispatch_dtype`);
outside it the first two are None, the dtype is ``"compute"``, and the model runs on
whole arrays.

``parallel.dispatch_dtype`` (:data:`DISPATCH_DTYPES`): ``"compute"`` sends the tokens of
the expert-parallel all-to-all in the compute dtype; ``"e4m3"`` sends them as E4M3 with
one float32 scale per 1x128 tile alongside (DeepSeek-V3 report, section 3.3.4: dispatch
in FP8, combine in bfloat16), :func:`jaxmp.fp8.all_to_all`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Mapping, Optional, Sequence, Tuple, Union

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = [
    "LOGICAL_AXES",
    "DATA_PARALLEL_RULES",
    "FSDP_RULES",
    "DATA_AXIS",
    "EXPERT_AXIS",
    "STRATEGIES",
    "DISPATCH_DTYPES",
    "Layout",
    "layout",
    "make_mesh",
    "logical_to_sharding",
    "state_shardings",
    "batch_sharding",
    "check_batch_divisible",
    "use_rules",
    "constrain",
    "in_step",
    "fsdp_checkpoint_policy",
    "expert_axis",
    "param_gather",
    "dispatch_dtype",
]

# Every logical name the models use; a rule table must map each (None = replicated).
# "layers" is the leading axis of the scanned layout's stacked variables
# (jaxmp.models.transformer): replicated in every table here, one slice per scan step.
LOGICAL_AXES = ("batch", "vocab", "embed", "heads", "head_dim", "mlp", "expert", "expert_mlp",
                "layers", "expert_logit")

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
    ("expert_logit", None),
)

FSDP_RULES: Tuple[Tuple[str, Any], ...] = tuple(
    (name, "data" if name == "embed" else axis) for name, axis in DATA_PARALLEL_RULES)

Rules = Union[Sequence[Tuple[str, Any]], Mapping[str, Any]]


DATA_AXIS, EXPERT_AXIS = "data", "expert"
STRATEGIES = ("dp", "zero1", "fsdp")
DISPATCH_DTYPES = ("compute", "e4m3")


@dataclasses.dataclass(frozen=True)
class Layout:
    """A run's layout on the ``("data", "expert")`` mesh (module docstring's table).

    Attributes:
      strategy: one of :data:`STRATEGIES`.
      expert: devices along ``"expert"`` (expert parallelism; 1 = none).
      state_rules: the rule table of the master weights and optimizer state at rest.
      compute_rules: the rule table of the parameters as the forward pass reads them.
      batch_axes: the mesh axes the batch is split over (every device holds a share).
      dispatch_dtype: one of :data:`DISPATCH_DTYPES`, the dtype of the tokens the
        expert-parallel all-to-all sends (module docstring).
    """

    strategy: str
    expert: int
    state_rules: Tuple[Tuple[str, Any], ...]
    compute_rules: Tuple[Tuple[str, Any], ...]
    batch_axes: Tuple[str, ...] = (DATA_AXIS, EXPERT_AXIS)
    dispatch_dtype: str = "compute"

    @property
    def compute_copy(self) -> bool:
        """True when the state keeps a compute-dtype copy of the parameters (zero1)."""
        return self.strategy == "zero1"

    def on(self, mesh: Mesh) -> "Layout":
        """This layout with the mesh axes ``mesh`` lacks dropped from its tables (a 1-D
        ``("data",)`` mesh is the 2-D mesh with ``expert=1``).

        Raises:
          ValueError: expert parallelism on a mesh without an ``"expert"`` axis.
        """
        if self.expert > 1 and mesh.shape.get(EXPERT_AXIS) != self.expert:
            raise ValueError(f"parallel.expert={self.expert} needs a mesh with an {EXPERT_AXIS!r} axis of "
                             f"{self.expert} devices, got {dict(mesh.shape)}")

        def fit(rules):
            out = []
            for name, target in rules:
                axes = () if target is None else (target,) if isinstance(target, str) else tuple(target)
                kept = tuple(a for a in axes if a in mesh.axis_names)
                out.append((name, None if not kept else kept[0] if len(kept) == 1 else kept))
            return tuple(out)

        return dataclasses.replace(self, state_rules=fit(self.state_rules), compute_rules=fit(self.compute_rules),
                                   batch_axes=tuple(a for a in self.batch_axes if a in mesh.axis_names))


def layout(strategy: str = "dp", expert: int = 1, dispatch_dtype: str = "compute") -> Layout:
    """The :class:`Layout` of ``parallel.strategy``, ``parallel.expert`` and
    ``parallel.dispatch_dtype``.

    Raises:
      ValueError: an unknown strategy or dispatch dtype, or an expert count below 1.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"parallel.strategy={strategy!r} is not allowed; allowed: {', '.join(STRATEGIES)}")
    if isinstance(expert, bool) or not isinstance(expert, (int, np.integer)) or expert < 1:
        raise ValueError(f"parallel.expert={expert!r} must be an integer >= 1")
    if dispatch_dtype not in DISPATCH_DTYPES:
        raise ValueError(f"parallel.dispatch_dtype={dispatch_dtype!r} is not allowed; allowed: "
                         f"{', '.join(DISPATCH_DTYPES)}")
    base = dict(DATA_PARALLEL_RULES, batch=(DATA_AXIS, EXPERT_AXIS), expert=EXPERT_AXIS)
    split = dict(base, embed=DATA_AXIS)
    state = base if strategy == "dp" else split
    compute = split if strategy == "fsdp" else base
    return Layout(strategy, int(expert), tuple(state.items()), tuple(compute.items()),
                  dispatch_dtype=dispatch_dtype)


def _as_dict(rules: Rules) -> dict:
    return dict(rules.items() if isinstance(rules, Mapping) else rules)


def make_mesh(num_devices: Optional[int] = None, axis_name: str = "data", *,
              expert: Optional[int] = None, devices: Optional[Sequence[Any]] = None) -> Mesh:
    """A mesh over the first ``num_devices`` of ``devices`` (default ``jax.devices()``).

    Args:
      num_devices: devices in the mesh; None = all.
      axis_name: the axis name of a 1-D mesh.
      expert: when given, a 2-D mesh ``("data", "expert")`` of shape
        ``(num_devices / expert, expert)``: neighbouring devices share an expert group
        (they exchange tokens by all-to-all).
      devices: the devices to take them from (e.g. ``jax.devices("cpu")``).

    Returns:
      ``jax.sharding.Mesh``.

    Raises:
      ValueError: ``num_devices`` < 1 or more than are available, or ``expert`` not an
        integer >= 1 dividing it.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices) if num_devices is None else num_devices
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= len(devices):
        raise ValueError(f"num_devices={num_devices!r} must be an integer in [1, {len(devices)}] "
                         f"(the available {devices[0].platform} devices)")
    if expert is None:
        return Mesh(np.asarray(devices[:n]), (axis_name,))
    if isinstance(expert, bool) or not isinstance(expert, (int, np.integer)) or expert < 1 or n % expert:
        raise ValueError(f"parallel.expert={expert!r} must be an integer >= 1 that divides the {n} "
                         f"devices of the mesh")
    return Mesh(np.asarray(devices[:n]).reshape(n // expert, expert), (DATA_AXIS, EXPERT_AXIS))


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
    if dispatch not in DISPATCH_DTYPES:
        raise ValueError(f"dispatch={dispatch!r} is not allowed; allowed: {', '.join(DISPATCH_DTYPES)}")
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


# Primitives that only move, reshape or retype their input. Under FSDP their outputs are
# never saved for the backward pass: a gathered weight reaches its matmul through them
# (a transpose, a reshape into heads, a cast), and saving any of those would keep a
# whole copy of the weight alive between the passes. They are recomputed instead,
# from their saved inputs (activations) or from a fresh gather (weights).
_LAYOUT_PRIMITIVES = frozenset({
    "transpose", "reshape", "convert_element_type", "broadcast_in_dim", "squeeze",
    "expand_dims", "slice", "dynamic_slice", "concatenate", "copy", "copy_p", "all_gather",
    "rev", "pad", "select_n"})


def _gathers(params) -> bool:
    """True for a ``custom_jvp_call`` whose function all-gathers (:func:`jaxmp.comm.gather_param`)."""
    jaxpr = params.get("call_jaxpr")
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    return any(e.primitive.name == "all_gather" for e in getattr(jaxpr, "eqns", ()))


def fsdp_checkpoint_policy(base: Optional[Any] = None):
    """A ``jax.checkpoint`` policy for a module whose parameters FSDP gathers inside it.

    A value is saved for the backward pass when ``base`` saves it (every value when
    ``base`` is None) and it is neither a gathered parameter (the ``custom_jvp_call`` of
    :func:`jaxmp.comm.gather_param`) nor the output of a primitive that only moves,
    reshapes or casts its input. So the model's remat policy (``model.remat``) holds as
    it would without FSDP, and no whole weight stays alive between the passes: the
    backward pass gathers each again (ZeRO-3 / FSDP, Rajbhandari et al. 2020, 5.3).

    Args:
      base: a ``jax.checkpoint_policies`` policy, or None for "save everything".

    Returns:
      ``policy(prim, *args, **params) -> bool``.
    """
    def policy(prim, *args, **params) -> bool:
        if prim.name == "custom_jvp_call" and _gathers(params):
            return False
        if prim.name in _LAYOUT_PRIMITIVES:
            return False
        return True if base is None else bool(base(prim, *args, **params))

    return policy
