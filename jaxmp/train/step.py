"""The pure train and eval steps of the MoE Transformer trainer.

:func:`make_train_step` returns ``train_step(state, batch) -> (state, metrics)``, a pure
function over a :class:`~jaxmp.train.state.TrainState` that the
:class:`~jaxmp.train.experiment.Experiment` compiles with ``jax.jit`` over its mesh. There
is one gradient path, whatever the number of devices (one device is a 1-device mesh):

1. Per device, inside ``jax.shard_map`` over the mesh's ``"data"`` axis: forward and
   backward on that device's share of the batch, in the compute dtypes of the module
   policies, on the loss multiplied by the loss scale (micro-batches accumulate in the
   master dtype when ``grad_accum_steps > 1``). A device-varying copy of the parameters
   is differentiated, so ``shard_map`` inserts no reduction of its own.
2. Each device's finiteness verdict is combined with ``pmin``; the gradients are
   averaged explicitly by :func:`jaxmp.comm.exchange_gradients`, in
   ``grad_reduce_dtype`` (float32, bfloat16 or float16) or as top-k values and indices
   with an error-feedback residual kept in ``TrainState.comm_state``, and unscaled to
   float32.
3. The optimizer (clipping included) sees unscaled float32 gradients; on a non-finite
   step the parameters, every optimizer-state leaf, the router biases and the top-k
   residual are selected back bitwise and the loss scale backs off
   (:func:`jaxmp.optim.apply_gradients`), and so are the FP8 amax histories. Otherwise
   the router biases move by ``bias_update_rate`` toward balance.

FP8 delayed scaling (:mod:`jaxmp.fp8`): the model's :class:`~jaxmp.models.FP8State`
amax histories (in ``TrainState.rest``) are differentiated with the parameters; their
"gradient" is their updated value (Flax's "overwrite with gradient"). Micro-batches are
combined by :func:`jaxmp.fp8.merge_states` (elementwise max, so the newest entry is the
largest micro-batch amax, case FP8-1), devices by ``pmax``; the result replaces the
histories on an applied step and is selected away, bitwise, on a skipped one.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxmp import sharding

from jaxmp.models import FP8State, update_router_bias
from jaxmp.precision import comm, fp8, ops, optim
from jaxmp.precision._paths import path_name
from jaxmp.precision._vma import varying_axes
from jaxmp.precision.loss_scale import all_finite, select_tree
from jaxmp.sharding import DATA_AXIS, EXPERT_AXIS, Layout
from jaxmp.train.state import TrainState

__all__ = ["loss_fn", "make_train_step", "make_eval_step"]


def loss_fn(graphdef, params, biases, rest, loss_scale, batch):
    """The training loss, multiplied by the loss scale, and what the step logs.

    Args:
      graphdef: the model's NNX graph definition.
      params, biases, rest: the model's state (``split_model``'s three parts).
      loss_scale: a jaxmp loss scale.
      batch: ``{"inputs": int32 [B, T], "targets": int32 [B, T]}``.

    Returns:
      ``(loss_scale.scale(cross_entropy + aux_loss), (cross_entropy, aux))``: the
      cross-entropy is :func:`jaxmp.ops.cross_entropy` (a float32 island, mean over
      tokens), ``aux`` the model's dict (``aux_loss``, ``expert_counts``,
      ``dropped_fraction``).
    """
    model = nnx.merge(graphdef, params, biases, rest)
    logits, aux = model(batch["inputs"])
    ce = ops.cross_entropy(logits, batch["targets"])
    loss = ce + aux["aux_loss"]
    return loss_scale.scale(loss), (ce, aux)


def split_fp8(rest):
    """``(fp8_states, other)``: the :class:`~jaxmp.models.FP8State` leaves of a model's
    ``rest`` state and everything else (``nnx.merge_state`` puts them back together)."""
    return nnx.split_state(rest, FP8State, ...)


def _fp8_loss(graphdef, params, biases, amax, other, loss_scale, batch):
    """:func:`loss_fn` with ``rest`` given as its FP8 histories and the remainder, so that
    the histories can be differentiated (their cotangent is their update)."""
    return loss_fn(graphdef, params, biases, nnx.merge_state(amax, other), loss_scale, batch)


def _layer_order(path) -> list:
    return [int(k.key) if isinstance(getattr(k, "key", None), int) else -1 for k in path]


def _update_biases(biases, expert_counts, rate):
    """Moves each MoE layer's router bias toward balance (DeepSeek-V3 section 2.1.2).

    The bias leaves, sorted by their block (or, scanned, stack) index, cover the rows of
    ``aux["expert_counts"]`` (layer order) in turn: a ``[num_experts]`` leaf one row, a
    stacked ``[layers, num_experts]`` leaf one row per layer, each layer moved by its own
    counts.
    """
    flat = sorted(jax.tree_util.tree_flatten_with_path(biases)[0], key=lambda pl: _layer_order(pl[0]))
    if not flat:
        return biases
    rows, start = {}, 0
    for path, leaf in flat:
        n = 1 if jnp.ndim(leaf) == 1 else int(jnp.shape(leaf)[0])
        rows[path_name(path)] = (start, n)
        start += n
    if start != expert_counts.shape[0]:
        raise ValueError(f"router biases cover {start} MoE layers but expert_counts has "
                         f"{expert_counts.shape[0]} rows")

    def update(path, bias):
        first, n = rows[path_name(path)]
        return update_router_bias(bias, expert_counts[first:first + n].reshape(jnp.shape(bias)), rate)

    return jax.tree_util.tree_map_with_path(update, biases)


def _micro_batches(batch, n):
    return jax.tree.map(lambda x: x.reshape((n, x.shape[0] // n) + x.shape[1:]), batch)


def _mean_aux(ces, auxes):
    """Combines per-micro-batch losses and MoE statistics of one step."""
    return ces.mean(), {"aux_loss": auxes["aux_loss"].mean(), "expert_counts": auxes["expert_counts"].sum(0),
                        "dropped_fraction": auxes["dropped_fraction"].mean()}


class _Plan:
    """How one train or eval step lays its arrays out, derived at trace time from the
    state's logical axes and the run's :class:`~jaxmp.sharding.Layout`.

    Attributes:
      axes: the mesh axes the batch is split over (those of ``layout.batch_axes`` the
        mesh has).
      total: the devices (product of ``axes``): each holds a share of the batch.
      expert_axis: the mesh axis of expert parallelism, or None.
      dispatch_dtype: the dtype of the expert-parallel dispatch (``"compute"`` or ``"e4m3"``).
      compute_specs: ``PartitionSpec`` per parameter leaf as the forward reads it.
      state_specs: ``PartitionSpec`` per parameter leaf at rest (master, moments).
      layouts: :class:`jaxmp.comm.LeafReduce` per gradient leaf.
      gather: the FSDP gather for :func:`jaxmp.sharding.in_step`, or None.
    """

    def __init__(self, mesh: Mesh, layout: Layout, compute_params, master_params, reduce_dtype):
        layout = layout.on(mesh)
        self.mesh, self.layout = mesh, layout
        self.axes = tuple(a for a in layout.batch_axes if a in mesh.axis_names)
        self.total = int(np.prod([mesh.shape[a] for a in self.axes]))
        self.expert_axis = EXPERT_AXIS if mesh.shape.get(EXPERT_AXIS, 1) > 1 else None
        self.dispatch_dtype = layout.dispatch_dtype

        def specs(tree, rules):
            return jax.tree.map(lambda s: s.spec, sharding.state_shardings(tree, mesh, rules),
                                is_leaf=lambda x: isinstance(x, NamedSharding))

        self.compute_specs = specs(compute_params, layout.compute_rules)
        self.state_specs = specs(master_params, layout.state_rules)
        compute_rules = dict(layout.compute_rules)
        fsdp = layout.strategy == "fsdp"

        def leaf_reduce(compute_spec, state_spec):
            used_c = _spec_axes(compute_spec)
            scatter, dim = None, 0
            if not fsdp:
                for d, entry in enumerate(state_spec):
                    if DATA_AXIS in _entry_axes(entry) and DATA_AXIS not in used_c:
                        scatter, dim = DATA_AXIS, d
            sums = tuple(a for a in self.axes if a not in used_c and a != scatter)
            return comm.LeafReduce(sums, scatter, dim, divided=fsdp and DATA_AXIS in used_c)

        self.layouts = jax.tree.map(leaf_reduce, self.compute_specs, self.state_specs,
                                    is_leaf=lambda x: isinstance(x, PartitionSpec))
        self.gather = None
        if fsdp:
            data_names = {name for name, target in compute_rules.items() if DATA_AXIS in _entry_axes(target)}

            def gather(value, logical_axes, dtype):
                dims = [i for i, name in enumerate(logical_axes) if name in data_names]
                if not dims:
                    return value.astype(dtype)
                return comm.gather_param(value, DATA_AXIS, dims[0], dtype, reduce_dtype, self.total)

            self.gather = gather

    def varying(self, tree):
        """Every leaf made device-varying over all of :attr:`axes`: the gradient of a
        replicated input would otherwise be summed by ``shard_map``'s transpose, in the
        input's dtype, behind the explicit reduction's back."""
        def one(x):
            missing = tuple(a for a in self.axes if a not in varying_axes(x))
            return jax.lax.pcast(x, missing, to="varying") if missing else x
        return jax.tree.map(one, tree)


def _entry_axes(entry) -> tuple:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _spec_axes(spec) -> set:
    return {a for entry in spec for a in _entry_axes(entry)}


def _sharded_grads(grad_fn, graphdef, state, batch, grad_accum_steps, plan: _Plan, comm_kwargs):
    """Per-device gradients inside ``shard_map``, reduced by their layouts.

    Returns ``(grads, finite, ce, aux, new_comm_state, new_amax)``: float32 unscaled
    gradients of the mean loss laid out like the master weights (replicated, or split
    over ``data`` for zero1 / fsdp), the verdict of every device's *local* gradients
    (``pmin``, taken before compression), the cross-entropy and ``aux_loss`` averaged
    over devices (the balance loss of each device's own batch), expert counts summed over
    devices, and the updated FP8 amax histories (max over micro-batches and over every
    batch axis of the mesh, replicated; empty without delayed scaling).
    """
    n = plan.total
    rows = jax.tree.leaves(batch)[0].shape[0]
    if rows % (n * grad_accum_steps):
        raise ValueError(f"a batch of {rows} sequences does not split into {n} devices x "
                         f"{grad_accum_steps} micro-batches; use a multiple of {n * grad_accum_steps}")
    topk = comm_kwargs["grad_compression"] == "topk"
    residual = state.comm_state["residual"] if topk and state.comm_state is not None else None
    if topk:
        if residual is None:
            raise ValueError("grad_compression='topk' needs TrainState.comm_state from "
                             "jaxmp.comm.init_comm_state(params, num_devices, 'topk'); it is None")
        leading = {jnp.shape(r)[0] for r in jax.tree.leaves(residual)}
        if leading != {n}:
            raise ValueError(f"the top-k residual has leading dimension(s) {sorted(leading)} but the "
                             f"mesh has {n} devices; build it with num_devices={n}")
    params = state.compute_params if plan.layout.compute_copy else state.params
    reduce_dtype = comm.check_comm_config(**comm_kwargs)
    axes = plan.axes

    def per_device(params, biases, rest, loss_scale, residual, batch):
        # Differentiate device-varying copies of the params and FP8 histories (plan.varying).
        params = plan.varying(params)
        amax, other = split_fp8(rest)
        amax = plan.varying(amax)
        with sharding.in_step(plan.expert_axis, plan.gather, plan.dispatch_dtype):
            if grad_accum_steps == 1:
                (grads, new_amax), (ce, aux) = grad_fn(graphdef, params, biases, amax, other,
                                                       loss_scale, batch)
                local_finite = all_finite(grads)
            else:
                def body(carry, micro_batch):
                    acc, amax_acc = carry
                    (g, a), (ce_m, aux_m) = grad_fn(graphdef, params, biases, amax, other,
                                                    loss_scale, micro_batch)
                    # Still scaled: the loss scale stays on the wire (see comm.pmean_gradients).
                    # Amax histories: the max over micro-batches, never the last one (FP8-1).
                    return ((optim.accumulate(acc, g, loss_scale, grads_scaled=False),
                             fp8.merge_states(amax_acc, a)), (ce_m, aux_m))

                # The sum lives in float32 whatever dtype the parameters the forward reads
                # (a zero1 compute copy is bfloat16): the master dtype of mixed precision.
                init = plan.varying(optim.accumulator_init(
                    jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)))
                amax_init = plan.varying(jax.tree.map(lambda a: jnp.full(a.shape, -jnp.inf, a.dtype), amax))
                (acc, new_amax), (ces, auxes) = jax.lax.scan(body, (init, amax_init),
                                                             _micro_batches(batch, grad_accum_steps))
                grads, local_finite = optim.accumulated_mean(acc)
                local_finite = local_finite & all_finite(grads)
                ce, aux = _mean_aux(ces, auxes)
        # Every device saw its own activations, gradients and (expert parallelism) experts:
        # the histories' max over all batch axes is every device's, replicated.
        new_amax = jax.tree.map(lambda a: jax.lax.pmax(a, axes), new_amax)
        if topk:  # data parallelism only (validated): every leaf is summed over every axis
            local_state = {"residual": jax.tree.map(lambda r: r[0], residual)}
            grads, new_state = comm.exchange_gradients(grads, loss_scale, local_state,
                                                       axis_name=axes, **comm_kwargs)
            new_residual = jax.tree.map(lambda r: r[None], new_state["residual"])
        else:
            grads = loss_scale.unscale(comm.reduce_gradients(grads, plan.layouts, n, reduce_dtype))
            new_residual = None
        finite = jax.lax.pmin(local_finite.astype(jnp.int32), axes).astype(jnp.bool_)
        aux = {"aux_loss": jax.lax.pmean(jnp.asarray(aux["aux_loss"], jnp.float32), axes),
               "expert_counts": jax.lax.psum(aux["expert_counts"], axes),
               "dropped_fraction": jax.lax.pmean(jnp.asarray(aux["dropped_fraction"], jnp.float32), axes)}
        return grads, finite, jax.lax.pmean(ce.astype(jnp.float32), axes), aux, new_residual, new_amax

    rep, split = PartitionSpec(), PartitionSpec(axes)
    grads, finite, ce, aux, new_residual, new_amax = jax.shard_map(
        per_device, mesh=plan.mesh, in_specs=(plan.compute_specs, rep, rep, rep, split, split),
        out_specs=(plan.state_specs, rep, rep, rep, split, rep))(
            params, state.biases, state.rest, state.loss_scale, residual, batch)
    new_comm_state = {"residual": new_residual} if topk else state.comm_state
    return grads, finite, ce, aux, new_comm_state, new_amax


def compute_copy(params, dtypes, plan: _Plan):
    """ZeRO-1's compute-dtype copy of the parameters: each device casts its slice of the
    master weights and ``all_gather`` s it over ``data`` (DeepSpeed ZeRO with bf16;
    DeepSeek-V3 section 3.2.3), so the compute dtype crosses the wire, not float32.

    Args:
      params: the master weights, split like ``plan.state_specs``.
      dtypes: a tree like ``params`` of compute dtypes.
      plan: the step's layout.
    """
    def one(x, dtype, state_spec, compute_spec):
        x = x.astype(dtype)
        for d, entry in enumerate(state_spec):
            if DATA_AXIS in _entry_axes(entry) and DATA_AXIS not in _spec_axes(compute_spec):
                x = jax.lax.all_gather(x, DATA_AXIS, axis=d, tiled=True, to="invarying")
        return x

    def per_device(params):
        return jax.tree.map(one, params, dtypes, plan.state_specs, plan.compute_specs,
                            is_leaf=lambda x: isinstance(x, PartitionSpec))

    return jax.shard_map(per_device, mesh=plan.mesh, in_specs=(plan.state_specs,),
                         out_specs=plan.compute_specs)(params)


_EMA_DECAY = 0.9


def _health(state: TrainState, ce, grad_norm, applied, loss_spike_factor, grad_norm_spike_factor):
    """``(divergent, loss_ema, grad_norm_ema, divergent_steps)`` after this step.

    An applied step looks divergent when its loss is not finite, when its loss exceeds
    ``loss_spike_factor`` times the running mean of the healthy applied steps' losses,
    when its gradient norm exceeds ``grad_norm_spike_factor`` times theirs, or when its
    gradient norm is exactly 0 (no learning signal: a collapsed model). A factor of 0
    turns that test off. Only healthy applied steps move the running means.
    """
    ce, grad_norm = ce.astype(jnp.float32), grad_norm.astype(jnp.float32)
    seen = state.loss_ema > 0

    def above(x, ema, factor):
        return seen & (factor > 0) & (x > factor * ema)

    divergent = applied & (~jnp.isfinite(ce) | above(ce, state.loss_ema, loss_spike_factor)
                           | above(grad_norm, state.grad_norm_ema, grad_norm_spike_factor)
                           | (grad_norm == 0))
    healthy = applied & ~divergent

    def ema(old, x):
        return jnp.where(healthy, jnp.where(seen, _EMA_DECAY * old + (1 - _EMA_DECAY) * x, x), old)

    steps = jnp.where(divergent, state.divergent_steps + 1, jnp.where(applied, 0, state.divergent_steps))
    return divergent, ema(state.loss_ema, ce), ema(state.grad_norm_ema, grad_norm), steps.astype(jnp.int32)


def make_train_step(graphdef, optimizer: optax.GradientTransformation, *, mesh: Mesh,
                    lr_schedule: optax.Schedule, bias_update_rate: float = 0.0,
                    grad_accum_steps: int = 1, grad_reduce_dtype: Any = "float32",
                    grad_compression: str = "none", topk_ratio: float = 0.3,
                    loss_spike_factor: float = 3.0, grad_norm_spike_factor: float = 100.0,
                    layout: Optional[Layout] = None) -> Callable:
    """Returns the pure ``train_step(state, batch) -> (state, metrics)``.

    Args:
      graphdef: the model's NNX graph definition (static).
      optimizer: an optax transformation over the master params.
      mesh: the device mesh, with a ``"data"`` axis (one device: a 1-device mesh, e.g.
        :func:`jaxmp.sharding.make_mesh` ``(1)``).
      lr_schedule: the optimizer's learning-rate schedule, reported in the metrics at
        the optimizer's count of applied (non-skipped) updates.
      bias_update_rate: gamma of auxiliary-loss-free balancing; 0 leaves biases fixed.
      grad_accum_steps: micro-batches per step; each device's share of the batch must be
        divisible by it. Gradients accumulate in the master dtype under one loss scale.
      grad_reduce_dtype: ``"float32"`` (default), ``"bfloat16"`` or ``"float16"``: the
        dtype gradients are summed across devices in (:func:`jaxmp.comm.pmean_gradients`).
      grad_compression: ``"none"`` or ``"topk"`` (:func:`jaxmp.comm.topk_compress`;
        needs ``state.comm_state``).
      topk_ratio: fraction of each leaf sent per step under top-k, in (0, 1].
      loss_spike_factor: an applied step whose loss exceeds this many times the running
        mean of the healthy steps' losses looks divergent (0 = off).
      grad_norm_spike_factor: likewise for the unscaled gradient norm (0 = off; the
        default 100 is loose because clipped training tolerates large spikes).
      layout: where the state and the parameters live (:func:`jaxmp.sharding.layout`:
        dp, zero1 or fsdp, and expert parallelism); data parallelism when None.

    The batch is ``{"inputs": int32 [B, T], "targets": int32 [B, T]}``, B split over the
    mesh's data axis. Metrics (float32 scalars unless noted): ``loss`` (cross-entropy),
    ``aux_loss``, ``grad_norm`` (unscaled, float32), ``loss_scale`` (the scale used this
    step), ``grads_finite`` (bool), ``applied`` (bool: finite gradients and a finite new
    state), ``skipped_steps`` and ``consecutive_skips`` (int32, after this step), ``lr``
    (the rate of this step's update), ``expert_counts`` (float32 [num_moe_layers,
    num_experts]), ``dropped_fraction``, ``divergent`` (bool: an applied step that looks
    divergent, see ``_health``), ``divergent_steps`` (int32, in a row), ``loss_ema``.

    Raises:
      ValueError: ``grad_accum_steps`` < 1; bad communication settings (see
        :func:`jaxmp.comm.check_comm_config`); a mesh without a ``"data"`` axis. When
        tracing: top-k without (or with a mis-sized) ``state.comm_state``; a batch that
        the devices times ``grad_accum_steps`` do not divide.
    """
    if grad_accum_steps < 1:
        raise ValueError(f"grad_accum_steps must be >= 1, got {grad_accum_steps}")
    comm.check_comm_config(grad_reduce_dtype, grad_compression, topk_ratio)
    if not isinstance(mesh, Mesh) or comm.DATA_AXIS not in mesh.axis_names:
        raise ValueError(f"make_train_step needs mesh= a jax.sharding.Mesh with a {comm.DATA_AXIS!r} "
                         f"axis (jaxmp.sharding.make_mesh), got {mesh!r}")
    comm_kwargs = dict(grad_reduce_dtype=grad_reduce_dtype, grad_compression=grad_compression,
                       topk_ratio=topk_ratio)
    layout = layout or sharding.layout("dp", 1)
    if grad_compression == "topk" and (layout.strategy != "dp" or mesh.shape.get(EXPERT_AXIS, 1) > 1):
        raise ValueError("grad_compression='topk' runs with parallel.strategy='dp' and parallel.expert=1")
    # Under FSDP each module gathers its weights inside its own checkpoint
    # (jaxmp.sharding.fsdp_checkpoint_policy, composed with model.remat's policy).
    grad_fn = jax.grad(_fp8_loss, argnums=(1, 3), has_aux=True)

    def train_step(state: TrainState, batch: Mapping[str, jax.Array]):
        compute = state.compute_params if layout.compute_copy else state.params
        plan = _Plan(mesh, layout, compute, state.params, comm.check_comm_config(**comm_kwargs))
        grads, finite, ce, aux, new_comm_state, new_amax = _sharded_grads(
            grad_fn, graphdef, state, batch, grad_accum_steps, plan, comm_kwargs)
        new_biases = _update_biases(state.biases, aux["expert_counts"], bias_update_rate) \
            if bias_update_rate else state.biases
        amax, other = split_fp8(state.rest)
        update = optim.apply_gradients(
            optimizer, grads, state.opt_state, state.params, state.loss_scale,
            grads_scaled=False, grads_finite=finite, extra=(state.biases, amax),
            new_extra=(new_biases, new_amax))
        biases, amax = update.extra
        if grad_compression == "topk":  # a skipped step leaves the residual bitwise, as the params
            new_comm_state = select_tree(update.applied, new_comm_state, state.comm_state)
        not_applied = (~update.applied).astype(jnp.int32)
        skipped = state.skipped_steps + not_applied
        consecutive = (state.consecutive_skips + 1) * not_applied
        divergent, loss_ema, norm_ema, divergent_steps = _health(
            state, ce, update.grad_norm, update.applied, loss_spike_factor, grad_norm_spike_factor)
        new_compute = None
        if layout.compute_copy:  # the new master weights, gathered in the compute dtype
            # Cast from the master weights as stored: the barrier keeps XLA from fusing a
            # second evaluation of the update into the cast (rounded otherwise, e.g. with
            # another FMA contraction), so the copy is exactly what a restore rebuilds.
            stored = jax.lax.optimization_barrier(update.params)
            new_compute = compute_copy(stored, jax.tree.map(lambda x: x.dtype, compute), plan)
            new_compute = select_tree(update.applied, new_compute, state.compute_params)
        new_state = state.replace(
            step=state.step + 1, params=update.params, biases=biases,
            rest=nnx.merge_state(amax, other),
            opt_state=update.opt_state, loss_scale=update.loss_scale, skipped_steps=skipped,
            consecutive_skips=consecutive, loss_ema=loss_ema, grad_norm_ema=norm_ema,
            divergent_steps=divergent_steps, comm_state=new_comm_state, compute_params=new_compute)
        metrics = {
            "loss": ce.astype(jnp.float32),
            "aux_loss": jnp.asarray(aux["aux_loss"], jnp.float32),
            "grad_norm": update.grad_norm,
            "loss_scale": state.loss_scale.loss_scale,
            "grads_finite": update.grads_finite,
            "applied": update.applied,
            "skipped_steps": skipped,
            "consecutive_skips": consecutive,
            # The optimizer's count of applied updates before this step is what its
            # schedule reads: steps taken minus steps skipped.
            "lr": jnp.asarray(lr_schedule(state.step - state.skipped_steps), jnp.float32),
            "expert_counts": aux["expert_counts"],
            "dropped_fraction": jnp.asarray(aux["dropped_fraction"], jnp.float32),
            "divergent": divergent,
            "divergent_steps": divergent_steps,
            "loss_ema": loss_ema,
        }
        return new_state, metrics

    return train_step


def make_eval_step(graphdef, mesh: Mesh, layout: Optional[Layout] = None) -> Callable:
    """Returns ``eval_step(state, batch) -> {"loss": float32, "tokens": float32}``.

    Each device runs the forward pass on its share of the batch inside ``jax.shard_map``
    over the mesh, with the parameters laid out as the train step reads them (``layout``;
    data parallelism when None), and the sums are ``psum`` -med. ``loss`` is the summed
    token cross-entropy of the batch (float32) and ``tokens`` the token count, so a
    caller can average over batches of different sizes exactly.

    Raises:
      ValueError: a mesh without a ``"data"`` axis.
    """
    if not isinstance(mesh, Mesh) or comm.DATA_AXIS not in mesh.axis_names:
        raise ValueError(f"make_eval_step needs mesh= a jax.sharding.Mesh with a {comm.DATA_AXIS!r} "
                         f"axis, got {mesh!r}")
    layout = layout or sharding.layout("dp", 1)

    def eval_step(state: TrainState, batch):
        params = state.compute_params if layout.compute_copy else state.params
        plan = _Plan(mesh, layout, params, state.params, jnp.float32)

        def per_device(params, biases, rest, batch):
            with sharding.in_step(plan.expert_axis, plan.gather, plan.dispatch_dtype):
                logits, _ = nnx.merge(graphdef, params, biases, rest)(batch["inputs"])
            tokens = jnp.asarray(batch["targets"].size, jnp.float32)
            loss = ops.cross_entropy(logits, batch["targets"]) * tokens
            return {"loss": jax.lax.psum(loss, plan.axes), "tokens": jax.lax.psum(tokens, plan.axes)}

        rep = PartitionSpec()
        return jax.shard_map(per_device, mesh=mesh, in_specs=(plan.compute_specs, rep, rep, PartitionSpec(plan.axes)),
                             out_specs=rep)(params, state.biases, state.rest, batch)

    return eval_step
