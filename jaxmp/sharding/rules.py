"""Rule tables (logical axis name -> mesh axes), the run's :class:`Layout`, the mesh and
the shardings of whole arrays (see :mod:`jaxmp.sharding`)."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence, Tuple, Union

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxmp._checks import Int, check_choice, check_int
from jaxmp.precision._vma import as_axes
# The collectives' default axis (jaxmp.comm) is the data axis of every mesh here.
from jaxmp.precision.comm import DATA_AXIS, DEFAULT_DISPATCH_DTYPE, DISPATCH_DTYPES

__all__ = [
    "rule_table",
    "Strategy",
    "STRATEGY",
    "DP",
    "ZERO1",
    "FSDP",
    "LOGICAL_AXES",
    "DATA_PARALLEL_RULES",
    "FSDP_RULES",
    "DATA_AXIS",
    "EXPERT_AXIS",
    "STRATEGIES",
    "DISPATCH_DTYPES",
    "DEFAULT_DISPATCH_DTYPE",
    "Layout",
    "layout",
    "make_mesh",
    "logical_to_sharding",
    "state_shardings",
    "batch_sharding",
]

# Every logical name the models use; a rule table must map each (None = replicated).
# "layers" is the leading axis of the scanned layout's stacked variables
# (jaxmp.models.transformer): replicated in every table here, one slice per scan step.
# "frozen_expert" is the expert axis of a LoRA model's frozen routed experts
# (jaxmp.models.lora): split like "expert", and under FSDP also over "data" in place of
# their "embed" axis, so that the per-layer all-gather runs along the slice's leading
# (major) axis: gathered along "embed", XLA's GPU layout assignment transposed each whole
# stacked expert weight once, outside the scanned loop (a second copy of the frozen experts
# as temporaries: 82 GB a device for DeepSeek-V3's E4M3 experts under fsdp).
LOGICAL_AXES = ("batch", "vocab", "embed", "heads", "head_dim", "mlp", "expert", "expert_mlp",
                "layers", "expert_logit", "frozen_expert")

EXPERT_AXIS = "expert"

DATA_PARALLEL_RULES: Tuple[Tuple[str, Any], ...] = (
    ("batch", DATA_AXIS),
    ("vocab", None),
    ("embed", None),
    ("heads", None),
    ("head_dim", None),
    ("mlp", None),
    ("expert", None),
    ("expert_mlp", None),
    ("layers", None),
    ("expert_logit", None),
    ("frozen_expert", None),
)

FSDP_RULES: Tuple[Tuple[str, Any], ...] = tuple(
    (name, DATA_AXIS if name in ("embed", "frozen_expert") else axis)
    for name, axis in DATA_PARALLEL_RULES)

Rules = Union[Sequence[Tuple[str, Any]], Mapping[str, Any]]


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One ``parallel.strategy``: how the train state and the forward pass's parameters
    are split over the ``"data"`` axis (the module docstring's table). Every other module
    reads these fields, never the name, so a new strategy is one declaration here.

    Attributes:
      name: the ``parallel.strategy`` value.
      splits_state: the master weights and the optimizer state are split over ``"data"``
        at rest (ZeRO-1 and FSDP; Rajbhandari et al. 2020), each device holding 1/N.
      splits_compute: the parameters the forward pass reads are split too and gathered
        layer by layer (FSDP), so each gradient is reduce-scattered onto its split.
      compute_copy: the state also keeps a whole compute-dtype copy of the parameters,
        all-gathered after each update (ZeRO-1 as the DeepSeek article counts it).
      description: what it holds where, for the trainer's banner.
    """

    name: str
    splits_state: bool
    splits_compute: bool
    compute_copy: bool
    description: str


DP = Strategy("dp", False, False, False, "every device holds the whole state")
ZERO1 = Strategy("zero1", True, False, True,
                 "master weights and optimizer state split over 'data'")
FSDP = Strategy("fsdp", True, True, False,
                "parameters, gradients and optimizer state split over 'data'")
STRATEGY = {s.name: s for s in (DP, ZERO1, FSDP)}  # parallel.strategy -> its declaration
STRATEGIES = tuple(STRATEGY)


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
    dispatch_dtype: str = DEFAULT_DISPATCH_DTYPE

    @property
    def declared(self) -> Strategy:
        """The :class:`Strategy` named by :attr:`strategy`."""
        return STRATEGY[self.strategy]

    @property
    def compute_copy(self) -> bool:
        """True when the state keeps a compute-dtype copy of the parameters (zero1)."""
        return self.declared.compute_copy

    def on(self, mesh: Mesh) -> "Layout":
        """This layout with the mesh axes ``mesh`` lacks dropped from its tables (a 1-D
        ``("data",)`` mesh is the 2-D mesh with ``expert=1``).

        Raises:
          ValueError: expert parallelism on a mesh without an ``"expert"`` axis.
        """
        if self.expert > 1 and mesh.shape.get(EXPERT_AXIS) != self.expert:
            raise ValueError(f"parallel.expert={self.expert} needs a mesh with an {EXPERT_AXIS!r} "
                             f"axis of {self.expert} devices, got {dict(mesh.shape)}")

        def fit(rules):
            out = []
            for name, target in rules:
                kept = tuple(a for a in as_axes(target) if a in mesh.axis_names)
                out.append((name, None if not kept else kept[0] if len(kept) == 1 else kept))
            return tuple(out)

        return dataclasses.replace(self, state_rules=fit(self.state_rules),
                                   compute_rules=fit(self.compute_rules),
                                   batch_axes=tuple(a for a in self.batch_axes
                                                    if a in mesh.axis_names))


def layout(strategy: str = DP.name, expert: int = 1,
           dispatch_dtype: str = DEFAULT_DISPATCH_DTYPE) -> Layout:
    """The :class:`Layout` of ``parallel.strategy``, ``parallel.expert`` and
    ``parallel.dispatch_dtype``.

    Raises:
      ValueError: an unknown strategy or dispatch dtype, or an expert count below 1.
    """
    check_choice("parallel.strategy", strategy, STRATEGIES)
    check_int("parallel.expert", expert, 1)
    check_choice("parallel.dispatch_dtype", dispatch_dtype, DISPATCH_DTYPES)
    base = dict(DATA_PARALLEL_RULES, batch=(DATA_AXIS, EXPERT_AXIS), expert=EXPERT_AXIS,
                frozen_expert=EXPERT_AXIS)
    split = dict(base, embed=DATA_AXIS, frozen_expert=(EXPERT_AXIS, DATA_AXIS))
    state = split if STRATEGY[strategy].splits_state else base
    compute = split if STRATEGY[strategy].splits_compute else base
    return Layout(strategy, int(expert), tuple(state.items()), tuple(compute.items()),
                  dispatch_dtype=dispatch_dtype)


def rule_table(rules: Rules) -> dict:
    """``rules`` (a mapping, or ``(logical axis, mesh axis)`` pairs as the layouts hold
    them) as a dict ``{logical axis: mesh axis or None}``."""
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
    n = check_int("num_devices", n, 1, len(devices), f"an integer in [1, {len(devices)}] (the "
                  f"available {devices[0].platform} devices)")
    if expert is None:
        return Mesh(np.asarray(devices[:n]), (axis_name,))
    if not Int(1).ok(expert) or n % expert:
        raise ValueError(f"parallel.expert={expert!r} must be an integer >= 1 that divides the {n} "
                         f"devices of the mesh")
    return Mesh(np.asarray(devices[:n]).reshape(n // expert, expert), (DATA_AXIS, EXPERT_AXIS))


def logical_to_sharding(logical_axes: Sequence[Optional[str]], mesh: Mesh,
                        rules: Rules) -> NamedSharding:
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
    table = rule_table(rules)
    spec, used = [], set()
    for name in logical_axes:
        if name is None:
            spec.append(None)
            continue
        if name not in table:
            raise ValueError(f"logical axis {name!r} has no rule; the rules map {sorted(table)}")
        target = table[name]
        for a in as_axes(target):
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
    from flax import nnx  # deferred: the models import this module

    replicated = NamedSharding(mesh, PartitionSpec())

    def one(x):
        if isinstance(x, nnx.Variable):
            if not hasattr(x.get_value(), "shape"):  # no array (optax.MaskedNode): no leaf
                return x
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
