"""The pure train and eval steps of the MoE Transformer trainer.

:func:`make_train_step` returns ``train_step(state, batch) -> (state, metrics)``, a pure
function over a :class:`~jaxmp.train.state.TrainState` that the
:class:`~jaxmp.train.experiment.Experiment` compiles with ``jax.jit`` over its mesh. There
is one gradient path, whatever the number of devices (one device is a 1-device mesh):

1. Per device, inside ``jax.shard_map`` over the mesh's batch axes (``"data"`` and
   ``"expert"``): forward and backward on that device's share of the batch, in the
   compute dtypes of the module policies, on the loss multiplied by the loss scale
   (micro-batches accumulate in the master dtype when ``grad_accum_steps > 1``). A
   device-varying copy of the parameters is differentiated, so ``shard_map`` inserts no
   reduction of its own.
2. Each device's finiteness verdict is combined with ``pmin``; the gradients are
   averaged explicitly, leaf by leaf as the run's :class:`~jaxmp.sharding.StepPlan` says
   (all-reduce, or ZeRO's reduce-scatter), by :func:`jaxmp.comm.reduce_gradients` in
   ``grad_reduce_dtype`` (float32, bfloat16 or float16), or under top-k compression by
   :func:`jaxmp.comm.exchange_gradients` as values and indices with an error-feedback
   residual kept in ``TrainState.comm_state``, and unscaled to float32.
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

import functools
from typing import Any, Callable, Dict, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec

from jaxmp.models import FP8State, update_router_bias
from jaxmp.precision import comm, fp8, ops, optim
from jaxmp.precision._paths import path_name
from jaxmp.precision.loss_scale import all_finite, select_tree
from jaxmp.sharding import StepPlan
from jaxmp.train.packing import LOSS_MASK, SEGMENT_KEYS
from jaxmp.train.state import TrainState, split_frozen

__all__ = ["loss_fn", "forward_args", "GradExchange", "DivergenceCheck", "make_train_step",
           "make_eval_step"]


def forward_args(plan: StepPlan) -> Dict[str, Any]:
    """The keyword arguments of ``MoETransformer.__call__`` inside the steps' ``shard_map``
    over ``plan``'s mesh, those the plan uses: ``param_gather`` (the FSDP gather,
    ``plan.gather``) under FSDP; ``expert_axis`` (``plan.expert_axis``) and
    ``dispatch_dtype`` (``plan.layout.dispatch_dtype``) under expert parallelism. So a
    model of its own (any NNX module called as ``model(tokens) -> (logits, aux)``) runs
    under a plan without either, and one that cannot take them fails by name."""
    args: Dict[str, Any] = {}
    if plan.gather is not None:
        args["param_gather"] = plan.gather
    if plan.expert_axis is not None:
        args.update(expert_axis=plan.expert_axis, dispatch_dtype=plan.layout.dispatch_dtype)
    return args


def loss_fn(graphdef, params, biases, rest, loss_scale, batch, amax=None, *,
            forward: Optional[Mapping[str, Any]] = None,
            denominator: Optional[jax.Array] = None):
    """The training loss, multiplied by the loss scale, and what the step logs.

    Args:
      graphdef: the model's NNX graph definition.
      params, biases, rest: the model's state (``split_model``'s three parts).
      loss_scale: a jaxmp loss scale.
      batch: ``{"inputs": int32 [B, T], "targets": int32 [B, T]}``, optionally with
        ``segment_ids`` and ``positions`` (int32 [B, T], packed documents: passed to the
        model) and ``loss_mask`` ([B, T], the tokens trained on).
      amax: the :class:`~jaxmp.models.FP8State` histories, when ``rest`` is given without
        them (``nnx.split_state(rest, FP8State, ...)``), so that they can be
        differentiated: their cotangent is their update (Flax's "overwrite with
        gradient").
      forward: keyword arguments of the model's call (:func:`forward_args` inside the
        steps' ``shard_map``); None = none.
      denominator: with a ``loss_mask``, what the masked sum is divided by
        (:func:`jaxmp.ops.cross_entropy`); None = this batch's own trained tokens.

    Returns:
      ``(loss_scale.scale(cross_entropy + aux_loss), (cross_entropy, aux))``: the
      cross-entropy is :func:`jaxmp.ops.cross_entropy` (a float32 island, mean over
      tokens), ``aux`` the model's dict (``aux_loss``, ``expert_counts``,
      ``dropped_fraction``).
    """
    if amax is not None:
        rest = nnx.merge_state(amax, rest)
    packing = {k: batch[k] for k in SEGMENT_KEYS if k in batch}
    logits, aux = nnx.merge(graphdef, params, biases, rest)(batch["inputs"], **packing,
                                                            **(forward or {}))
    ce = ops.cross_entropy(logits, batch["targets"], batch.get(LOSS_MASK),
                           denominator=denominator)
    return loss_scale.scale(ce + aux["aux_loss"]), (ce, aux)


def _layer_order(path) -> list:
    return [int(k.key) if isinstance(getattr(k, "key", None), int) else -1 for k in path]


def _update_biases(biases, expert_counts, rate):
    """Moves each MoE layer's router bias toward balance (DeepSeek-V3 section 2.1.2).

    The bias leaves, sorted by their block (or, scanned, stack) index, cover the rows of
    ``aux["expert_counts"]`` (layer order) in turn: a ``[num_experts]`` leaf one row, a
    stacked ``[layers, num_experts]`` leaf one row per layer, each layer moved by its own
    counts.
    """
    flat = sorted(jax.tree_util.tree_flatten_with_path(biases)[0],
                  key=lambda pl: _layer_order(pl[0]))
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
        counts = expert_counts[first:first + n].reshape(jnp.shape(bias))
        return update_router_bias(bias, counts, rate)

    return jax.tree_util.tree_map_with_path(update, biases)


def _micro_batches(batch, n):
    return jax.tree.map(lambda x: x.reshape((n, x.shape[0] // n) + x.shape[1:]), batch)


def _mean_aux(ces, auxes):
    """Combines per-micro-batch losses and MoE statistics of one step."""
    return ces.mean(), {"aux_loss": auxes["aux_loss"].mean(),
                        "expert_counts": auxes["expert_counts"].sum(0),
                        "dropped_fraction": auxes["dropped_fraction"].mean()}


class GradExchange(NamedTuple):
    """How the devices exchange gradients (the reduce dtype is the plan's).

    Attributes:
      compression: ``"none"`` (all-reduce / reduce-scatter, :func:`jaxmp.comm.reduce_gradients`)
        or ``"topk"`` (:func:`jaxmp.comm.topk_compress` with an error-feedback residual in
        ``TrainState.comm_state``; data parallelism only).
      topk_ratio: fraction of each leaf sent per step under top-k, in (0, 1].
    """

    compression: str = "none"
    topk_ratio: float = comm.TOPK_RATIO


class DivergenceCheck(NamedTuple):
    """When an applied step looks divergent (``_health``); a factor of 0 turns its test off.

    Attributes:
      loss_spike_factor: the loss exceeds this many times the running mean of the
        healthy steps' losses, and :data:`LOSS_SPIKE_FLOOR` (a run that has memorized its
        data, at 3e-7 nats, is not diverging at 3e-5).
      grad_norm_spike_factor: likewise for the unscaled gradient norm (the default 100 is
        loose because clipped training tolerates large spikes).
    """

    loss_spike_factor: float = 3.0
    grad_norm_spike_factor: float = 100.0


class _DeviceInputs(NamedTuple):
    """What each device's gradient computation reads (the arguments of ``shard_map``)."""

    params: Any       # as the forward pass reads them (ZeRO-1's compute copy, else masters)
    biases: Any       # router biases, replicated
    amax: Any         # FP8 delayed-scaling histories, replicated
    frozen: Any       # a LoRA model's frozen base, laid out as the forward reads params
    other: Any        # the rest of the model's state, replicated
    loss_scale: Any   # replicated
    residual: Any     # top-k error feedback [devices, ...] or None, split over the devices
    batch: Any        # split over the batch axes

    @classmethod
    def specs(cls, plan: StepPlan) -> "_DeviceInputs":
        """The ``shard_map`` in_spec of each field on ``plan``'s mesh."""
        rep, split = PartitionSpec(), plan.batch_spec
        return cls(params=plan.compute_specs, biases=rep, amax=rep, frozen=plan.frozen_specs,
                   other=rep, loss_scale=rep, residual=split, batch=split)


class _DeviceGrads(NamedTuple):
    """The reduced gradients of one step and what the step logs, out of ``shard_map``.

    Attributes:
      grads: float32 unscaled gradients of the mean loss, laid out like the master
        weights (replicated, or split over ``data`` for zero1 / fsdp).
      finite: bool, the verdict of every device's *local* gradients (``pmin``, taken
        before compression).
      loss: float32, the cross-entropy averaged over devices.
      aux: the model's dict: ``aux_loss`` averaged over devices (the balance loss of each
        device's own batch), ``expert_counts`` summed over devices, ``dropped_fraction``
        averaged.
      residual: the new top-k error-feedback residual ``[devices, ...]``, or None.
      amax: the updated FP8 amax histories (max over micro-batches and over every batch
        axis of the mesh, replicated; empty without delayed scaling).
    """

    grads: Any
    finite: jax.Array
    loss: jax.Array
    aux: Dict[str, jax.Array]
    residual: Any
    amax: Any

    @classmethod
    def specs(cls, plan: StepPlan) -> "_DeviceGrads":
        """The ``shard_map`` out_spec of each field on ``plan``'s mesh."""
        rep = PartitionSpec()
        return cls(grads=plan.state_specs, finite=rep, loss=rep, aux=rep,
                   residual=plan.batch_spec, amax=rep)


def _sharded_grads(graphdef, state, amax, frozen, other, batch, grad_accum_steps,
                   plan: StepPlan, exchange: GradExchange) -> _DeviceGrads:
    """Per-device gradients inside ``shard_map``, reduced as ``plan.reduces`` says (or
    exchanged as top-k), as a :class:`_DeviceGrads`."""
    n, axes, reduce_dtype = plan.total, plan.axes, plan.reduce_dtype
    topk = exchange.compression == "topk"
    residual = state.comm_state["residual"] if topk and state.comm_state is not None else None
    if topk:
        if residual is None:
            raise ValueError("grad_compression='topk' needs TrainState.comm_state from "
                             "jaxmp.comm.init_comm_state(params, num_devices, 'topk'); it is None")
        leading = {jnp.shape(r)[0] for r in jax.tree.leaves(residual)}
        if leading != {n}:
            raise ValueError(f"the top-k residual has leading dimension(s) {sorted(leading)} but "
                             f"the mesh has {n} devices; build it with num_devices={n}")
    params = state.compute_params if plan.layout.compute_copy else state.params
    # d(scaled loss)/d(params, amax): the histories' "gradient" is their update. The model
    # is called with the plan's FSDP gather, expert axis and dispatch dtype.
    grad_fn = jax.grad(functools.partial(loss_fn, forward=forward_args(plan)), argnums=(1, 6),
                       has_aux=True)

    def per_device(inputs: _DeviceInputs) -> _DeviceGrads:
        params, biases, amax, frozen, other, loss_scale, residual, batch = inputs
        # Device-varying copies (plan.varying): shard_map adds no reduction of its own.
        params, amax = plan.varying(params), plan.varying(amax)
        # The frozen base is read, never differentiated; device-varying too, as the custom
        # VJPs (the norms') give cotangents for every input, the base's included.
        other = nnx.merge_state(other, plan.varying(frozen))
        trained = None
        if LOSS_MASK in batch:  # the mean over the global batch's trained tokens: each
            # micro-batch's masked sum over a share of them, so that the means over
            # micro-batches and devices below add the shares up
            trained = jax.lax.psum(jnp.sum(batch[LOSS_MASK].astype(jnp.float32)), axes)
            denominator = jnp.maximum(trained, 1.0) / (grad_accum_steps * n)
            grad_fn_ = functools.partial(grad_fn, denominator=denominator)
        else:
            grad_fn_ = grad_fn
        if grad_accum_steps == 1:
            (grads, new_amax), (ce, aux) = grad_fn_(graphdef, params, biases, other,
                                                    loss_scale, batch, amax)
            local_finite = all_finite(grads)
        else:
            def body(carry, micro_batch):
                acc, amax_acc = carry
                (g, a), (ce_m, aux_m) = grad_fn_(graphdef, params, biases, other, loss_scale,
                                                 micro_batch, amax)
                # Still scaled: the loss scale stays on the wire (comm.reduce_gradients).
                # Amax histories: the max over micro-batches, never the last one (FP8-1).
                return ((optim.accumulate(acc, g, loss_scale, grads_scaled=False),
                         fp8.merge_states(amax_acc, a)), (ce_m, aux_m))

            # The sum lives in float32 whatever dtype the parameters the forward reads
            # (a zero1 compute copy is bfloat16): the master dtype of mixed precision.
            init = plan.varying(optim.accumulator_init(
                jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)))
            amax_init = plan.varying(
                jax.tree.map(lambda a: jnp.full(a.shape, -jnp.inf, a.dtype), amax))
            (acc, new_amax), (ces, auxes) = jax.lax.scan(
                body, (init, amax_init), _micro_batches(batch, grad_accum_steps))
            grads, local_finite = optim.accumulated_mean(acc)
            local_finite = local_finite & all_finite(grads)
            ce, aux = _mean_aux(ces, auxes)
        # Every device saw its own activations, gradients and (expert parallelism) experts:
        # the histories' max over all batch axes is every device's, replicated.
        new_amax = jax.tree.map(lambda a: jax.lax.pmax(a, axes), new_amax)
        if topk:  # data parallelism only (validated): every leaf is summed over every axis
            local_state = {"residual": jax.tree.map(lambda r: r[0], residual)}
            grads, new_state = comm.exchange_gradients(
                grads, loss_scale, local_state, axis_name=axes, grad_reduce_dtype=reduce_dtype,
                grad_compression=exchange.compression, topk_ratio=exchange.topk_ratio)
            new_residual = jax.tree.map(lambda r: r[None], new_state["residual"])
        else:
            grads = loss_scale.unscale(
                comm.reduce_gradients(grads, plan.reduces, n, reduce_dtype))
            new_residual = None
        finite = jax.lax.pmin(local_finite.astype(jnp.int32), axes).astype(jnp.bool_)

        def mean(x):
            return jax.lax.pmean(jnp.asarray(x, jnp.float32), axes)

        aux = {"aux_loss": mean(aux["aux_loss"]),
               "expert_counts": jax.lax.psum(aux["expert_counts"], axes),
               "dropped_fraction": mean(aux["dropped_fraction"])}
        if trained is not None:
            aux["trained_tokens"] = trained
        return _DeviceGrads(grads=grads, finite=finite, loss=mean(ce), aux=aux,
                           residual=new_residual, amax=new_amax)

    inputs = _DeviceInputs(params=params, biases=state.biases, amax=amax, frozen=frozen,
                           other=other, loss_scale=state.loss_scale, residual=residual,
                           batch=batch)
    return jax.shard_map(per_device, mesh=plan.mesh, in_specs=(_DeviceInputs.specs(plan),),
                         out_specs=_DeviceGrads.specs(plan))(inputs)


_EMA_DECAY = 0.9
# A loss below this (nats per trained token; the model gives its targets about 0.9
# probability) is no loss spike, however many times its running mean it is: a run that has
# memorized its data rises from 3e-7 to 3e-5 nats without diverging.
LOSS_SPIKE_FLOOR = 0.1


class _Health(NamedTuple):
    """The divergence verdict of a step and the running means after it."""

    divergent: jax.Array        # bool
    loss_ema: jax.Array         # float32
    grad_norm_ema: jax.Array    # float32
    divergent_steps: jax.Array  # int32, in a row


def _health(state: TrainState, ce, grad_norm, applied, check: DivergenceCheck) -> _Health:
    """The :class:`_Health` after this step.

    An applied step looks divergent when its loss or its gradient norm is not finite (a
    norm past float32's range from finite gradients: its square sum overflows), when its loss exceeds
    ``check.loss_spike_factor`` times the running mean of the healthy applied steps'
    losses and :data:`LOSS_SPIKE_FLOOR`, when its gradient norm exceeds ``check.grad_norm_spike_factor`` times theirs,
    or when its gradient norm is exactly 0 (no learning signal: a collapsed model). A
    factor of 0 turns that test off. Only healthy applied steps move the running means.
    """
    ce, grad_norm = ce.astype(jnp.float32), grad_norm.astype(jnp.float32)
    seen = state.loss_ema > 0

    def above(x, ema, factor):
        return seen & (factor > 0) & (x > factor * ema)

    divergent = applied & (~jnp.isfinite(ce) | ~jnp.isfinite(grad_norm)
                           | (above(ce, state.loss_ema, check.loss_spike_factor)
                              & (ce > LOSS_SPIKE_FLOOR))
                           | above(grad_norm, state.grad_norm_ema, check.grad_norm_spike_factor)
                           | (grad_norm == 0))
    healthy = applied & ~divergent

    def ema(old, x):
        return jnp.where(healthy, jnp.where(seen, _EMA_DECAY * old + (1 - _EMA_DECAY) * x, x), old)

    steps = jnp.where(divergent, state.divergent_steps + 1,
                      jnp.where(applied, 0, state.divergent_steps)).astype(jnp.int32)
    return _Health(divergent, ema(state.loss_ema, ce), ema(state.grad_norm_ema, grad_norm), steps)


def _check_plan(plan, who: str) -> None:
    if not isinstance(plan, StepPlan):
        raise ValueError(f"{who} needs plan= a jaxmp.sharding.StepPlan (built by "
                         f"jaxmp.train.Experiment.create), got {plan!r}")


def make_train_step(graphdef, optimizer: optax.GradientTransformation, *, plan: StepPlan,
                    lr_schedule: optax.Schedule, bias_update_rate: float = 0.0,
                    grad_accum_steps: int = 1, exchange: GradExchange = GradExchange(),
                    divergence: DivergenceCheck = DivergenceCheck()) -> Callable:
    """Returns the pure ``train_step(state, batch) -> (state, metrics)``.

    The settings are checked once, before any work, by
    :func:`jaxmp.train.config.validate_config` (the batch split over the devices and
    ``grad_accum_steps``, :func:`jaxmp.comm.check_comm_config`, top-k only under data
    parallelism); this function takes them as validated and does not check them again.

    Args:
      graphdef: the model's NNX graph definition (static).
      optimizer: an optax transformation over the master params.
      plan: the run's :class:`~jaxmp.sharding.StepPlan` (mesh, layout, and
        ``reduce_dtype``: the dtype gradients are summed across devices in, float32,
        bfloat16 or float16, :func:`jaxmp.comm.reduce_gradients`), built once by
        :meth:`jaxmp.train.Experiment.create`.
      lr_schedule: the optimizer's learning-rate schedule, reported in the metrics at
        the optimizer's count of applied (non-skipped) updates.
      bias_update_rate: gamma of auxiliary-loss-free balancing; 0 leaves biases fixed.
      grad_accum_steps: micro-batches per step; each device's share of the batch must be
        divisible by it. Gradients accumulate in the master dtype under one loss scale.
      exchange: a :class:`GradExchange`: all-reduce / reduce-scatter, or top-k
        compression (needs ``state.comm_state``) and its ratio.
      divergence: a :class:`DivergenceCheck`: when an applied step looks divergent.

    The batch is ``{"inputs": int32 [B, T], "targets": int32 [B, T]}``, B split over the
    mesh's data axis, optionally with ``segment_ids``, ``positions`` and ``loss_mask``
    [B, T] (:func:`loss_fn`). With a ``loss_mask`` the loss is the mean over the trained
    tokens of the whole global batch, whatever ``grad_accum_steps`` and the mesh: each
    micro-batch's masked sum is divided by its share of the global count, so uneven
    micro-batches weigh by their tokens (not the mean of per-micro-batch means), and the
    metrics gain ``trained_tokens``. Metrics (float32 scalars unless noted): ``loss``
    (cross-entropy),
    ``aux_loss``, ``grad_norm`` (unscaled, float32), ``loss_scale`` (the scale used this
    step), ``grads_finite`` (bool), ``applied`` (bool: finite gradients and a finite new
    state), ``skipped_steps`` and ``consecutive_skips`` (int32, after this step), ``lr``
    (the rate of this step's update), ``expert_counts`` (float32 [num_moe_layers,
    num_experts]), ``dropped_fraction``, ``divergent`` (bool: an applied step that looks
    divergent, see ``_health``), ``divergent_steps`` (int32, in a row), ``loss_ema``.

    Raises:
      ValueError: ``plan`` is not a :class:`~jaxmp.sharding.StepPlan`. When tracing:
        top-k without (or with a mis-sized) ``state.comm_state``.
    """
    _check_plan(plan, "make_train_step")
    layout = plan.layout
    topk = exchange.compression == "topk"

    def train_step(state: TrainState, batch: Mapping[str, jax.Array]):
        frozen, rest = split_frozen(state.rest)
        amax, other = nnx.split_state(rest, FP8State, ...)
        out = _sharded_grads(graphdef, state, amax, frozen, other, batch, grad_accum_steps,
                             plan, exchange)
        aux = out.aux
        new_biases = _update_biases(state.biases, aux["expert_counts"], bias_update_rate) \
            if bias_update_rate else state.biases
        update = optim.apply_gradients(
            optimizer, out.grads, state.opt_state, state.params, state.loss_scale,
            grads_scaled=False, grads_finite=out.finite, extra=(state.biases, amax),
            new_extra=(new_biases, out.amax))
        biases, amax = update.extra
        new_comm_state = state.comm_state
        if topk:  # a skipped step leaves the residual bitwise, as the params
            new_comm_state = select_tree(update.applied, {"residual": out.residual},
                                         state.comm_state)
        not_applied = (~update.applied).astype(jnp.int32)
        skipped = state.skipped_steps + not_applied
        consecutive = (state.consecutive_skips + 1) * not_applied
        health = _health(state, out.loss, update.grad_norm, update.applied, divergence)
        new_compute = None
        if layout.compute_copy:  # the new master weights, gathered in the compute dtype
            # Cast from the master weights as stored: the barrier keeps XLA from fusing a
            # second evaluation of the update into the cast (rounded otherwise, e.g. with
            # another FMA contraction), so the copy is exactly what a restore rebuilds.
            stored = jax.lax.optimization_barrier(update.params)
            dtypes = jax.tree.map(lambda x: x.dtype, state.compute_params)
            new_compute = select_tree(update.applied, plan.compute_copy(stored, dtypes),
                                      state.compute_params)
        new_state = state.replace(
            step=state.step + 1, params=update.params, biases=biases,
            rest=nnx.merge_state(nnx.merge_state(amax, other), frozen),
            opt_state=update.opt_state, loss_scale=update.loss_scale, skipped_steps=skipped,
            consecutive_skips=consecutive, loss_ema=health.loss_ema,
            grad_norm_ema=health.grad_norm_ema, divergent_steps=health.divergent_steps,
            comm_state=new_comm_state, compute_params=new_compute)
        metrics = {
            **({"trained_tokens": aux["trained_tokens"]} if "trained_tokens" in aux else {}),
            "loss": out.loss.astype(jnp.float32),
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
            "divergent": health.divergent,
            "divergent_steps": health.divergent_steps,
            "loss_ema": health.loss_ema,
        }
        return new_state, metrics

    return train_step


class _EvalInputs(NamedTuple):
    """What each device's eval forward reads (the argument of ``shard_map``)."""

    params: Any  # as the forward pass reads them
    biases: Any  # replicated
    frozen: Any  # a LoRA model's frozen base, as the forward pass reads parameters
    rest: Any    # replicated
    batch: Any   # split over the batch axes

    @classmethod
    def specs(cls, plan: StepPlan) -> "_EvalInputs":
        """The ``shard_map`` in_spec of each field on ``plan``'s mesh."""
        rep = PartitionSpec()
        return cls(params=plan.compute_specs, biases=rep, frozen=plan.frozen_specs, rest=rep,
                   batch=plan.batch_spec)


def make_eval_step(graphdef, *, plan: StepPlan) -> Callable:
    """Returns ``eval_step(state, batch) -> {"loss": float32, "tokens": float32}``.

    Each device runs the forward pass on its share of the batch inside ``jax.shard_map``
    over the plan's mesh, with the parameters laid out as the train step reads them
    (``plan``, a :class:`~jaxmp.sharding.StepPlan`), and the sums are
    ``psum`` -med. ``loss`` is the summed token cross-entropy of the batch (float32) and
    ``tokens`` the token count (with a ``loss_mask``, of the trained tokens only), so a
    caller can average over batches of different sizes exactly. ``segment_ids`` and
    ``positions`` reach the model as in :func:`loss_fn`.

    Raises:
      ValueError: ``plan`` is not a :class:`~jaxmp.sharding.StepPlan`.
    """
    _check_plan(plan, "make_eval_step")
    layout, forward = plan.layout, forward_args(plan)

    def eval_step(state: TrainState, batch):
        params = state.compute_params if layout.compute_copy else state.params

        def per_device(inputs: _EvalInputs):
            model = nnx.merge(graphdef, inputs.params, inputs.biases, inputs.frozen,
                              inputs.rest)
            batch = inputs.batch
            logits, _ = model(batch["inputs"], **{k: batch[k] for k in SEGMENT_KEYS
                                                   if k in batch}, **forward)
            targets = batch["targets"]
            if LOSS_MASK in batch:  # the masked sum and the trained tokens
                mask = batch[LOSS_MASK].astype(jnp.float32)
                tokens = jnp.sum(mask)
                loss = ops.cross_entropy(logits, targets, mask, denominator=1.0)
            else:
                tokens = jnp.asarray(targets.size, jnp.float32)
                loss = ops.cross_entropy(logits, targets) * tokens
            return {"loss": jax.lax.psum(loss, plan.axes),
                    "tokens": jax.lax.psum(tokens, plan.axes)}

        frozen, rest = split_frozen(state.rest)
        inputs = _EvalInputs(params=params, biases=state.biases, frozen=frozen, rest=rest,
                             batch=batch)
        return jax.shard_map(per_device, mesh=plan.mesh, in_specs=(_EvalInputs.specs(plan),),
                             out_specs=PartitionSpec())(inputs)

    return eval_step
