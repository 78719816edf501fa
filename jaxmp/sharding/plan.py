"""The train and eval steps' per-device layout, worked out once per run.

:class:`StepPlan` derives, from a :class:`~jaxmp.sharding.Layout`, the mesh and the
parameters' logical axes, everything the steps' ``shard_map`` needs: the ``PartitionSpec``
of each parameter at rest and as the forward pass reads it, how each gradient leaf is
reduced (all-reduce, or ZeRO's reduce-scatter onto the master weights' slice), the FSDP
gather the model calls (:func:`jaxmp.comm.gather_param`), and ZeRO-1's compute-dtype
all-gather (:meth:`StepPlan.compute_copy`). :func:`fsdp_checkpoint_policy` keeps FSDP's
gathered weights out of what ``jax.checkpoint`` saves.
"""
from __future__ import annotations

from typing import Any, Optional

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxmp.precision import comm
from jaxmp.precision._vma import as_axes, varying_axes
from jaxmp.sharding.rules import DATA_AXIS, EXPERT_AXIS, Layout, state_shardings

__all__ = ["StepPlan", "fsdp_checkpoint_policy"]


def _spec_axes(spec) -> set:
    return {a for entry in spec for a in as_axes(entry)}


def _is_spec(x) -> bool:
    return isinstance(x, PartitionSpec)


class StepPlan:
    """How the train and eval steps lay their arrays out on ``mesh`` under ``layout``.

    Built once per run (:meth:`jaxmp.train.Experiment.create`) from the abstract state:
    only the parameters' logical axes (``out_sharding`` metadata) and tree structure are
    read, never their values.

    Args:
      mesh: the device mesh, with a ``"data"`` axis (and ``"expert"`` for expert
        parallelism).
      layout: the run's :class:`~jaxmp.sharding.Layout` (fitted to ``mesh`` here).
      compute_params: the parameters as the forward pass reads them (ZeRO-1's compute
        copy, else the master weights), arrays or ``jax.ShapeDtypeStruct`` s.
      master_params: the master weights.
      reduce_dtype: the dtype gradients cross the wire in (``grad_reduce_dtype``), also
        that of FSDP's reduce-scatter.
      frozen: a LoRA model's frozen base (:class:`~jaxmp.models.FrozenParam` s), or None
        (none): laid out by the compute rules, as the forward pass reads parameters.

    Attributes:
      mesh, layout, reduce_dtype: as given (``layout`` fitted to ``mesh``).
      axes: the mesh axes the batch is split over (those of ``layout.batch_axes`` the
        mesh has).
      total: the devices (product of ``axes``): each holds a share of the batch.
      expert_axis: the mesh axis of expert parallelism, or None.
      compute_specs: ``PartitionSpec`` per parameter leaf as the forward pass reads it.
      frozen_specs: ``PartitionSpec`` per frozen-base leaf (the compute rules), or one
        replicated ``PartitionSpec`` without a frozen base.
      state_specs: ``PartitionSpec`` per parameter leaf at rest (master, moments).
      reduces: :class:`jaxmp.comm.LeafReduce` per gradient leaf: summed over the batch
        axes it is not split over, and reduce-scattered over ``data`` where the master
        weights are split and the forward's copy is not (zero1); under FSDP the gather's
        transpose has reduce-scattered it already (``divided``).
      gather: ``gather(value, logical_axes, dtype)``, the FSDP all-gather of a parameter
        (:func:`jaxmp.comm.gather_param` along its first dimension split over ``data``);
        None unless the strategy splits the forward pass's parameters
        (``Strategy.splits_compute``: fsdp).
    """

    def __init__(self, mesh: Mesh, layout: Layout, compute_params: Any, master_params: Any,
                 reduce_dtype: Any = np.float32, frozen: Any = None):
        layout = layout.on(mesh)
        self.mesh, self.layout, self.reduce_dtype = mesh, layout, reduce_dtype
        self.axes = tuple(a for a in layout.batch_axes if a in mesh.axis_names)
        self.total = int(np.prod([mesh.shape[a] for a in self.axes]))
        self.expert_axis = EXPERT_AXIS if mesh.shape.get(EXPERT_AXIS, 1) > 1 else None

        def specs(tree, rules):
            return jax.tree.map(lambda s: s.spec, state_shardings(tree, mesh, rules),
                                is_leaf=lambda x: isinstance(x, NamedSharding))

        self.compute_specs = specs(compute_params, layout.compute_rules)
        self.state_specs = specs(master_params, layout.state_rules)
        self.frozen_specs = (PartitionSpec() if frozen is None
                             else specs(frozen, layout.compute_rules))
        fsdp = layout.declared.splits_compute

        def leaf_reduce(compute_spec, state_spec):
            used_c = _spec_axes(compute_spec)
            scatter, dim = None, 0
            if not fsdp:
                for d, entry in enumerate(state_spec):
                    if DATA_AXIS in as_axes(entry) and DATA_AXIS not in used_c:
                        scatter, dim = DATA_AXIS, d
            sums = tuple(a for a in self.axes if a not in used_c and a != scatter)
            return comm.LeafReduce(sums, scatter, dim, divided=fsdp and DATA_AXIS in used_c)

        self.reduces = jax.tree.map(leaf_reduce, self.compute_specs, self.state_specs,
                                    is_leaf=_is_spec)
        self.gather = None
        if fsdp:
            split = {name for name, target in layout.compute_rules
                     if DATA_AXIS in as_axes(target)}
            total = self.total

            def gather(value, logical_axes, dtype):
                dims = [i for i, name in enumerate(logical_axes) if name in split]
                if not dims:
                    return value.astype(dtype)
                return comm.gather_param(value, DATA_AXIS, dims[0], dtype, reduce_dtype, total)

            self.gather = gather

    @property
    def batch_spec(self) -> PartitionSpec:
        """The ``PartitionSpec`` of a ``[B, ...]`` batch: B over :attr:`axes`."""
        return PartitionSpec(self.axes)

    def varying(self, tree: Any) -> Any:
        """Every leaf made device-varying over all of :attr:`axes` (inside ``shard_map``):
        the gradient of a replicated input would otherwise be summed by ``shard_map``'s
        transpose, in the input's dtype, behind the explicit reduction's back."""
        def one(x):
            missing = tuple(a for a in self.axes if a not in varying_axes(x))
            return jax.lax.pcast(x, missing, to="varying") if missing else x
        return jax.tree.map(one, tree)

    def compute_copy(self, params: Any, dtypes: Any) -> Any:
        """ZeRO-1's compute-dtype copy of the parameters: each device casts its slice of
        the master weights and ``all_gather`` s it over ``data`` (DeepSpeed ZeRO with
        bf16; DeepSeek-V3 section 3.2.3), so the compute dtype crosses the wire, not
        float32.

        Args:
          params: the master weights, split like :attr:`state_specs`.
          dtypes: a tree like ``params`` of compute dtypes.

        Returns:
          The copy, laid out like :attr:`compute_specs`.
        """
        def one(x, dtype, state_spec, compute_spec):
            x = x.astype(dtype)
            for d, entry in enumerate(state_spec):
                if DATA_AXIS in as_axes(entry) and DATA_AXIS not in _spec_axes(compute_spec):
                    x = jax.lax.all_gather(x, DATA_AXIS, axis=d, tiled=True, to="invarying")
            return x

        def per_device(params):
            return jax.tree.map(one, params, dtypes, self.state_specs, self.compute_specs,
                                is_leaf=_is_spec)

        return jax.shard_map(per_device, mesh=self.mesh, in_specs=(self.state_specs,),
                             out_specs=self.compute_specs)(params)


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
    """True for a ``custom_jvp_call`` whose function all-gathers
    (:func:`jaxmp.comm.gather_param`)."""
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
