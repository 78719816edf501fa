"""The train state and the pure train / eval steps of the MoE Transformer trainer.

One pytree, :class:`TrainState`, holds everything a step reads and writes: the step
counter, the float32 master parameters, the optimizer state, the loss scale, the MoE
router biases (DeepSeek-V3 auxiliary-loss-free balancing), the count of skipped steps
and an rng. :func:`make_train_step` returns ``train_step(state, batch) -> (state,
metrics)``, a pure function compiled by the caller with ``jax.jit`` over a mesh.

One step, top to bottom:

1. Forward and backward in the compute dtypes of the module policies, on a loss
   multiplied by the loss scale (micro-batches accumulate in the master dtype when
   ``grad_accum_steps > 1``).
2. Gradients are unscaled to float32 before anything else; one global finiteness
   verdict (every leaf, every device) decides the step.
3. The optimizer (clipping included) sees unscaled float32 gradients; on a non-finite
   step the parameters, every optimizer-state leaf and the router biases are selected
   back bitwise, and the loss scale backs off. Otherwise the router biases move by
   ``bias_update_rate`` toward balance.

With ``grad_reduce_dtype`` other than float32 or ``grad_compression="topk"``, step 1
runs per device inside ``jax.shard_map`` over the mesh's ``"data"`` axis and the
gradients are averaged explicitly by :mod:`jaxmp.comm` (16-bit all-reduce, or top-k
all-gather with an error-feedback residual kept in ``TrainState.comm_state``); each
device's finiteness is combined with ``pmin`` before compression could hide it.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from jaxmp import comm, ops, optim
from jaxmp.loss_scale import LossScale, all_finite, select_tree
from jaxmp.models import RouterBias, update_router_bias

__all__ = ["TrainState", "split_model", "make_optimizer", "make_lr_schedule",
           "create_train_state", "make_train_step", "make_eval_step"]


@flax.struct.dataclass
class TrainState:
    """Everything the train step reads and writes, as one pytree.

    Attributes:
      step: int32 scalar, train steps taken (skipped ones included: data moves on).
      params: ``nnx.State`` of ``nnx.Param``, the master weights (float32 in mixed modes).
      biases: ``nnx.State`` of ``RouterBias``, float32 [num_experts] per MoE layer.
      rest: any other NNX state of the model (empty for the default model).
      opt_state: the optax optimizer state (moments in their configured dtypes).
      loss_scale: a ``jaxmp`` loss scale (float32 scale, int32 counters).
      skipped_steps: int32 scalar, steps whose gradients were not finite.
      rng: uint32 [2] PRNG key data, split once per step for stochastic layers and
        sampling.
      comm_state: None, or for top-k gradient compression ``{"residual": tree}`` of
        float32 ``[num_devices, *param.shape]`` error-feedback residuals, sharded over
        the data axis (:func:`jaxmp.comm.init_comm_state`).
    """

    step: jax.Array
    params: Any
    biases: Any
    rest: Any
    opt_state: Any
    loss_scale: LossScale
    skipped_steps: jax.Array
    rng: jax.Array
    comm_state: Any = None


def split_model(model: nnx.Module):
    """Splits an NNX model into ``(graphdef, params, biases, rest)``."""
    return nnx.split(model, nnx.Param, RouterBias, ...)


def make_lr_schedule(optim_config, total_steps: int) -> optax.Schedule:
    """Linear warm-up then cosine decay to ``lr * final_lr_fraction`` (optax schedules).

    The cosine decays over ``optim.decay_steps`` steps, or over ``total_steps`` when that
    is 0. Fix ``decay_steps`` when a run may be stopped and continued to more steps, so
    that the schedule does not depend on ``train.steps``.

    Raises:
      ValueError: unknown ``optim.schedule`` (allowed: ``cosine``, ``constant``).
    """
    lr = float(optim_config.learning_rate)
    warmup = int(optim_config.warmup_steps)
    kind = optim_config.schedule
    if kind == "constant":
        if warmup == 0:
            return optax.constant_schedule(lr)
        return optax.join_schedules(
            [optax.linear_schedule(0.0, lr, warmup), optax.constant_schedule(lr)], [warmup])
    if kind == "cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=lr, warmup_steps=warmup,
            decay_steps=max(int(optim_config.get("decay_steps", 0)) or total_steps, warmup + 1),
            end_value=lr * float(optim_config.final_lr_fraction))
    raise ValueError(f"unknown optim.schedule {kind!r}; allowed: 'cosine', 'constant'")


def make_optimizer(optim_config, total_steps: int) -> optax.GradientTransformation:
    """Global-norm clipping (on unscaled float32 gradients) then AdamW with configurable
    moment dtypes (``mu_dtype``/``nu_dtype``; DeepSeek-V3 section 3.3.3 keeps both in bf16).

    Weight decay skips vectors (norm scales, router biases are not params anyway),
    following common practice (e.g. nanoGPT, Megatron-LM).
    """
    def decay_mask(params):
        return jax.tree.map(lambda p: p.ndim >= 2, params)

    def dtype_or_none(name):
        return None if not name else jnp.dtype(name)

    parts = []
    if optim_config.grad_clip and optim_config.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(float(optim_config.grad_clip)))
    parts.append(optim.adamw(
        make_lr_schedule(optim_config, total_steps), b1=optim_config.b1, b2=optim_config.b2,
        eps=optim_config.eps, weight_decay=optim_config.weight_decay,
        mu_dtype=dtype_or_none(optim_config.mu_dtype), nu_dtype=dtype_or_none(optim_config.nu_dtype),
        mask=decay_mask))
    return optax.chain(*parts)


def create_train_state(model: nnx.Module, optimizer: optax.GradientTransformation,
                       loss_scale: LossScale, seed: int, comm_state: Any = None):
    """Builds the initial :class:`TrainState` and returns ``(graphdef, state)``.

    ``comm_state``: see :func:`jaxmp.comm.init_comm_state` (None without compression).
    """
    graphdef, params, biases, rest = split_model(model)
    state = TrainState(
        step=jnp.zeros((), jnp.int32), params=params, biases=biases, rest=rest,
        opt_state=optimizer.init(params), loss_scale=loss_scale,
        skipped_steps=jnp.zeros((), jnp.int32),
        rng=jax.random.key_data(jax.random.key(seed + 1)), comm_state=comm_state)
    return graphdef, state


def _loss_fn(graphdef, params, biases, rest, loss_scale, batch):
    model = nnx.merge(graphdef, params, biases, rest)
    logits, aux = model(batch["inputs"])
    ce = ops.cross_entropy(logits, batch["targets"])
    loss = ce + aux["aux_loss"]
    return loss_scale.scale(loss), (ce, aux)


def _moe_bias_paths(biases) -> list:
    """Router-bias leaf paths in layer order (the order of ``aux['expert_counts']``)."""
    def layer_index(path):
        return [int(k.key) if isinstance(getattr(k, "key", None), int) else -1 for k in path]
    flat = jax.tree_util.tree_flatten_with_path(biases)[0]
    return sorted((p for p, _ in flat), key=layer_index)


def _update_biases(biases, expert_counts, rate):
    """Moves each MoE layer's router bias toward balance (DeepSeek-V3 section 2.1.2)."""
    paths = _moe_bias_paths(biases)
    if not paths:
        return biases
    layer_of = {jax.tree_util.keystr(p): i for i, p in enumerate(paths)}

    def update(path, bias):
        return update_router_bias(bias, expert_counts[layer_of[jax.tree_util.keystr(path)]], rate)

    return jax.tree_util.tree_map_with_path(update, biases)


def _micro_batches(batch, n):
    return jax.tree.map(lambda x: x.reshape((n, x.shape[0] // n) + x.shape[1:]), batch)


def _mean_aux(ces, auxes):
    """Combines per-micro-batch losses and MoE statistics of one step."""
    return ces.mean(), {"aux_loss": auxes["aux_loss"].mean(), "expert_counts": auxes["expert_counts"].sum(0),
                        "dropped_fraction": auxes["dropped_fraction"].mean()}


def _automatic_grads(grad_fn, graphdef, state, batch, grad_accum_steps):
    """Unscaled float32 gradients of the global batch; XLA's partitioner inserts the
    cross-device reduction. Returns ``(grads, finite, ce, aux)``."""
    if grad_accum_steps == 1:
        grads, (ce, aux) = grad_fn(graphdef, state.params, state.biases, state.rest,
                                   state.loss_scale, batch)
        grads = state.loss_scale.unscale(grads)
        return grads, all_finite(grads), ce, aux

    def body(acc, micro_batch):
        g, (ce_m, aux_m) = grad_fn(graphdef, state.params, state.biases, state.rest,
                                   state.loss_scale, micro_batch)
        return optim.accumulate(acc, g, state.loss_scale), (ce_m, aux_m)

    acc, (ces, auxes) = jax.lax.scan(body, optim.accumulator_init(state.params),
                                     _micro_batches(batch, grad_accum_steps))
    grads, finite = optim.accumulated_mean(acc)
    return (grads, finite) + _mean_aux(ces, auxes)


def _explicit_grads(grad_fn, graphdef, state, batch, grad_accum_steps, mesh, comm_kwargs):
    """Per-device gradients inside ``shard_map``, averaged by :func:`jaxmp.comm.exchange_gradients`.

    Returns ``(grads, finite, ce, aux, new_comm_state)``: float32 unscaled mean
    gradients (replicated), the verdict of every device's *local* gradients (``pmin``,
    taken before compression), the cross-entropy and ``aux_loss`` averaged over devices
    (the balance loss of each device's own batch), expert counts summed over devices.
    """
    axis = comm.DATA_AXIS
    n = mesh.shape[axis]
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
        rows = {jnp.shape(r)[0] for r in jax.tree.leaves(residual)}
        if rows != {n}:
            raise ValueError(f"the top-k residual has leading dimension(s) {sorted(rows)} but the mesh's "
                             f"{axis!r} axis has {n} devices; build it with num_devices={n}")

    def varying(tree):
        return jax.tree.map(lambda x: jax.lax.pcast(x, axis, to="varying"), tree)

    def per_device(params, biases, rest, loss_scale, residual, batch):
        # Differentiate a device-varying copy of the params: the gradient of a replicated
        # input would be psum-ed by shard_map's transpose, in float32, behind our back.
        params = varying(params)
        if grad_accum_steps == 1:
            grads, (ce, aux) = grad_fn(graphdef, params, biases, rest, loss_scale, batch)
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
            local_finite = all_finite(grads)
        else:
            def body(acc, micro_batch):
                g, (ce_m, aux_m) = grad_fn(graphdef, params, biases, rest, loss_scale, micro_batch)
                # Still scaled: the loss scale stays on the wire (see comm.pmean_gradients).
                return optim.accumulate(acc, g, loss_scale, grads_scaled=False), (ce_m, aux_m)

            acc, (ces, auxes) = jax.lax.scan(body, varying(optim.accumulator_init(params)),
                                             _micro_batches(batch, grad_accum_steps))
            grads, local_finite = optim.accumulated_mean(acc)
            local_finite = local_finite & all_finite(grads)
            ce, aux = _mean_aux(ces, auxes)
        local_state = None if residual is None else {"residual": jax.tree.map(lambda r: r[0], residual)}
        grads, new_state = comm.exchange_gradients(grads, loss_scale, local_state, axis_name=axis,
                                                   **comm_kwargs)
        new_residual = None if new_state is None else jax.tree.map(lambda r: r[None], new_state["residual"])
        finite = jax.lax.pmin(local_finite.astype(jnp.int32), axis).astype(jnp.bool_)
        aux = {"aux_loss": jax.lax.pmean(jnp.asarray(aux["aux_loss"], jnp.float32), axis),
               "expert_counts": jax.lax.psum(aux["expert_counts"], axis),
               "dropped_fraction": jax.lax.pmean(jnp.asarray(aux["dropped_fraction"], jnp.float32), axis)}
        return grads, finite, jax.lax.pmean(ce.astype(jnp.float32), axis), aux, new_residual

    rep, split = PartitionSpec(), PartitionSpec(axis)
    grads, finite, ce, aux, new_residual = jax.shard_map(
        per_device, mesh=mesh, in_specs=(rep, rep, rep, rep, split, split),
        out_specs=(rep, rep, rep, rep, split))(
            state.params, state.biases, state.rest, state.loss_scale, residual, batch)
    new_comm_state = {"residual": new_residual} if topk else state.comm_state
    return grads, finite, ce, aux, new_comm_state


def make_train_step(graphdef, optimizer: optax.GradientTransformation, *, lr_schedule: optax.Schedule,
                    bias_update_rate: float = 0.0, grad_accum_steps: int = 1,
                    mesh: Optional[Mesh] = None, grad_reduce_dtype: Any = "float32",
                    grad_compression: str = "none", topk_ratio: float = 0.3) -> Callable:
    """Returns the pure ``train_step(state, batch) -> (state, metrics)``.

    Args:
      graphdef: the model's NNX graph definition (static).
      optimizer: an optax transformation over the master params.
      lr_schedule: the learning-rate schedule, reported in the metrics at the count of
        applied (non-skipped) updates, which is what the optimizer's own count holds.
      bias_update_rate: gamma of auxiliary-loss-free balancing; 0 leaves biases fixed.
      grad_accum_steps: micro-batches per step; the batch's leading dimension (each
        device's share of it, on the explicit path) must be divisible by it. Gradients
        accumulate in the master dtype under one loss scale.
      mesh: the device mesh with a ``"data"`` axis: selects the explicit per-device path;
        required when ``grad_reduce_dtype`` is not float32 or compression is on.
      grad_reduce_dtype: ``"float32"`` (default), ``"bfloat16"`` or ``"float16"``: the
        dtype gradients are summed across devices in (:func:`jaxmp.comm.pmean_gradients`).
      grad_compression: ``"none"`` or ``"topk"`` (:func:`jaxmp.comm.topk_compress`;
        needs ``state.comm_state``).
      topk_ratio: fraction of each leaf sent per step under top-k, in (0, 1].

    With a ``mesh`` (what the trainer does) the forward/backward pass runs per device in
    ``jax.shard_map`` on that device's share of the batch, and
    :func:`jaxmp.comm.exchange_gradients` all-reduces the gradients in
    ``grad_reduce_dtype`` (or exchanges top-k values and indices); on a skipped step the
    top-k residual, like the params, stays bitwise. Without a mesh (float32, no
    compression only) the step is left to XLA's automatic SPMD partitioning, which is
    right on one device but, for the dropless MoE, gathers all tokens onto every device
    of a multi-device mesh.

    The batch is ``{"inputs": int32 [B, T], "targets": int32 [B, T]}``. Metrics (float32
    scalars unless noted): ``loss`` (cross-entropy), ``aux_loss``, ``grad_norm``
    (unscaled, float32), ``loss_scale`` (the scale used this step), ``grads_finite``
    (bool), ``applied`` (bool: finite gradients and a finite new state), ``skipped_steps`` (int32, cumulative), ``lr``, ``expert_counts`` (float32
    [num_moe_layers, num_experts]), ``dropped_fraction``.

    Raises:
      ValueError: ``grad_accum_steps`` < 1; bad communication settings (see
        :func:`jaxmp.comm.check_comm_config`); the explicit path without a mesh with a
        ``"data"`` axis. When tracing, on the explicit path: top-k without (or with a
        mis-sized) ``state.comm_state``; a batch that the devices times
        ``grad_accum_steps`` do not divide.
    """
    if grad_accum_steps < 1:
        raise ValueError(f"grad_accum_steps must be >= 1, got {grad_accum_steps}")
    comm.check_comm_config(grad_reduce_dtype, grad_compression, topk_ratio)
    # With a mesh, each device runs forward/backward on its own shard and gradients are
    # reduced explicitly: XLA's automatic partitioning of the dropless MoE would gather
    # every token onto every device, and would pick its own reduction dtype.
    explicit = mesh is not None or comm.uses_explicit_reduce(grad_reduce_dtype, grad_compression)
    if explicit and (mesh is None or comm.DATA_AXIS not in mesh.axis_names):
        raise ValueError(f"grad_reduce_dtype={grad_reduce_dtype!r} / grad_compression={grad_compression!r} "
                         f"reduce gradients explicitly and need mesh= a Mesh with a {comm.DATA_AXIS!r} "
                         f"axis, got {mesh!r}")
    comm_kwargs = dict(grad_reduce_dtype=grad_reduce_dtype, grad_compression=grad_compression,
                       topk_ratio=topk_ratio)
    grad_fn = jax.grad(_loss_fn, argnums=1, has_aux=True)

    def train_step(state: TrainState, batch: Mapping[str, jax.Array]):
        rng, _ = jax.random.split(jax.random.wrap_key_data(state.rng))
        if explicit:
            grads, finite, ce, aux, new_comm_state = _explicit_grads(
                grad_fn, graphdef, state, batch, grad_accum_steps, mesh, comm_kwargs)
        else:
            grads, finite, ce, aux = _automatic_grads(grad_fn, graphdef, state, batch, grad_accum_steps)
            new_comm_state = state.comm_state

        new_biases = _update_biases(state.biases, aux["expert_counts"], bias_update_rate) \
            if bias_update_rate else state.biases
        update = optim.apply_gradients(
            optimizer, grads, state.opt_state, state.params, state.loss_scale,
            grads_scaled=False, grads_finite=finite, extra=state.biases, new_extra=new_biases)
        if grad_compression == "topk":  # a skipped step leaves the residual bitwise, as the params
            new_comm_state = select_tree(update.applied, new_comm_state, state.comm_state)
        skipped = state.skipped_steps + (~update.applied).astype(jnp.int32)
        new_state = state.replace(
            step=state.step + 1, params=update.params, biases=update.extra,
            opt_state=update.opt_state, loss_scale=update.loss_scale, skipped_steps=skipped,
            rng=jax.random.key_data(rng), comm_state=new_comm_state)
        metrics = {
            "loss": ce.astype(jnp.float32),
            "aux_loss": jnp.asarray(aux["aux_loss"], jnp.float32),
            "grad_norm": update.grad_norm,
            "loss_scale": state.loss_scale.loss_scale,
            "grads_finite": update.grads_finite,
            "applied": update.applied,
            "skipped_steps": skipped,
            # The lr the optimizer applied this step: its count excludes skipped steps.
            "lr": jnp.asarray(lr_schedule(state.step - state.skipped_steps), jnp.float32),
            "expert_counts": aux["expert_counts"],
            "dropped_fraction": jnp.asarray(aux["dropped_fraction"], jnp.float32),
        }
        return new_state, metrics

    return train_step


def make_eval_step(graphdef) -> Callable:
    """Returns ``eval_step(state, batch) -> {"loss": float32, "tokens": float32}``.

    ``loss`` is the summed token cross-entropy of the batch (float32) and ``tokens`` the
    token count, so a caller can average over batches of different sizes exactly.
    """
    def eval_step(state: TrainState, batch):
        model = nnx.merge(graphdef, state.params, state.biases, state.rest)
        logits, _ = model(batch["inputs"])
        tokens = jnp.asarray(batch["targets"].size, jnp.float32)
        return {"loss": ops.cross_entropy(logits, batch["targets"]) * tokens, "tokens": tokens}

    return eval_step
