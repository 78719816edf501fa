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

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from jaxmp.models import FP8State, update_router_bias
from jaxmp.precision import comm, fp8, ops, optim
from jaxmp.precision._paths import path_name
from jaxmp.precision.loss_scale import all_finite, select_tree
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

    The bias leaves, sorted by their block index, are in the order of the rows of
    ``aux["expert_counts"]`` (block order).
    """
    paths = sorted((p for p, _ in jax.tree_util.tree_flatten_with_path(biases)[0]), key=_layer_order)
    if not paths:
        return biases
    layer_of = {path_name(p): i for i, p in enumerate(paths)}

    def update(path, bias):
        return update_router_bias(bias, expert_counts[layer_of[path_name(path)]], rate)

    return jax.tree_util.tree_map_with_path(update, biases)


def _micro_batches(batch, n):
    return jax.tree.map(lambda x: x.reshape((n, x.shape[0] // n) + x.shape[1:]), batch)


def _mean_aux(ces, auxes):
    """Combines per-micro-batch losses and MoE statistics of one step."""
    return ces.mean(), {"aux_loss": auxes["aux_loss"].mean(), "expert_counts": auxes["expert_counts"].sum(0),
                        "dropped_fraction": auxes["dropped_fraction"].mean()}


def _data_parallel_grads(grad_fn, graphdef, state, batch, grad_accum_steps, mesh, comm_kwargs):
    """Per-device gradients inside ``shard_map``, averaged by :func:`jaxmp.comm.exchange_gradients`.

    Returns ``(grads, finite, ce, aux, new_comm_state, new_amax)``: float32 unscaled mean
    gradients (replicated), the verdict of every device's *local* gradients (``pmin``,
    taken before compression), the cross-entropy and ``aux_loss`` averaged over devices
    (the balance loss of each device's own batch), expert counts summed over devices, and
    the updated FP8 amax histories (max over micro-batches and devices; empty without
    delayed scaling).
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
        leading = {jnp.shape(r)[0] for r in jax.tree.leaves(residual)}
        if leading != {n}:
            raise ValueError(f"the top-k residual has leading dimension(s) {sorted(leading)} but the "
                             f"mesh's {axis!r} axis has {n} devices; build it with num_devices={n}")

    def varying(tree):
        return jax.tree.map(lambda x: jax.lax.pcast(x, axis, to="varying"), tree)

    def per_device(params, biases, rest, loss_scale, residual, batch):
        # Differentiate a device-varying copy of the params (and FP8 histories): the
        # gradient of a replicated input would be psum-ed by shard_map's transpose, in
        # float32, behind our back.
        params = varying(params)
        amax, other = split_fp8(rest)
        amax = varying(amax)
        if grad_accum_steps == 1:
            (grads, new_amax), (ce, aux) = grad_fn(graphdef, params, biases, amax, other, loss_scale,
                                                   batch)
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
            local_finite = all_finite(grads)
        else:
            def body(carry, micro_batch):
                acc, amax_acc = carry
                (g, a), (ce_m, aux_m) = grad_fn(graphdef, params, biases, amax, other, loss_scale,
                                                micro_batch)
                # Still scaled: the loss scale stays on the wire (see comm.pmean_gradients).
                # Amax histories: the max over micro-batches, never the last one (FP8-1).
                return ((optim.accumulate(acc, g, loss_scale, grads_scaled=False),
                         fp8.merge_states(amax_acc, a)), (ce_m, aux_m))

            start = (varying(optim.accumulator_init(params)),
                     jax.tree.map(lambda a: jnp.full_like(a, -jnp.inf), amax))
            (acc, new_amax), (ces, auxes) = jax.lax.scan(body, start,
                                                         _micro_batches(batch, grad_accum_steps))
            grads, local_finite = optim.accumulated_mean(acc)
            local_finite = local_finite & all_finite(grads)
            ce, aux = _mean_aux(ces, auxes)
        new_amax = jax.tree.map(lambda a: jax.lax.pmax(a, axis), new_amax)
        local_state = None if residual is None else {"residual": jax.tree.map(lambda r: r[0], residual)}
        grads, new_state = comm.exchange_gradients(grads, loss_scale, local_state, axis_name=axis,
                                                   **comm_kwargs)
        new_residual = None if new_state is None else jax.tree.map(lambda r: r[None], new_state["residual"])
        finite = jax.lax.pmin(local_finite.astype(jnp.int32), axis).astype(jnp.bool_)
        aux = {"aux_loss": jax.lax.pmean(jnp.asarray(aux["aux_loss"], jnp.float32), axis),
               "expert_counts": jax.lax.psum(aux["expert_counts"], axis),
               "dropped_fraction": jax.lax.pmean(jnp.asarray(aux["dropped_fraction"], jnp.float32), axis)}
        return grads, finite, jax.lax.pmean(ce.astype(jnp.float32), axis), aux, new_residual, new_amax

    rep, split = PartitionSpec(), PartitionSpec(axis)
    grads, finite, ce, aux, new_residual, new_amax = jax.shard_map(
        per_device, mesh=mesh, in_specs=(rep, rep, rep, rep, split, split),
        out_specs=(rep, rep, rep, rep, split, rep))(
            state.params, state.biases, state.rest, state.loss_scale, residual, batch)
    new_comm_state = {"residual": new_residual} if topk else state.comm_state
    return grads, finite, ce, aux, new_comm_state, new_amax


def make_train_step(graphdef, optimizer: optax.GradientTransformation, *, mesh: Mesh,
                    lr_schedule: optax.Schedule, bias_update_rate: float = 0.0,
                    grad_accum_steps: int = 1, grad_reduce_dtype: Any = "float32",
                    grad_compression: str = "none", topk_ratio: float = 0.3) -> Callable:
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

    The batch is ``{"inputs": int32 [B, T], "targets": int32 [B, T]}``, B split over the
    mesh's data axis. Metrics (float32 scalars unless noted): ``loss`` (cross-entropy),
    ``aux_loss``, ``grad_norm`` (unscaled, float32), ``loss_scale`` (the scale used this
    step), ``grads_finite`` (bool), ``applied`` (bool: finite gradients and a finite new
    state), ``skipped_steps`` and ``consecutive_skips`` (int32, after this step), ``lr``
    (the rate of this step's update), ``expert_counts`` (float32 [num_moe_layers,
    num_experts]), ``dropped_fraction``.

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
    grad_fn = jax.grad(_fp8_loss, argnums=(1, 3), has_aux=True)

    def train_step(state: TrainState, batch: Mapping[str, jax.Array]):
        grads, finite, ce, aux, new_comm_state, new_amax = _data_parallel_grads(
            grad_fn, graphdef, state, batch, grad_accum_steps, mesh, comm_kwargs)
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
        new_state = state.replace(
            step=state.step + 1, params=update.params, biases=biases,
            rest=nnx.merge_state(amax, other),
            opt_state=update.opt_state, loss_scale=update.loss_scale, skipped_steps=skipped,
            consecutive_skips=consecutive, comm_state=new_comm_state)
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
        }
        return new_state, metrics

    return train_step


def make_eval_step(graphdef, mesh: Mesh) -> Callable:
    """Returns ``eval_step(state, batch) -> {"loss": float32, "tokens": float32}``.

    Each device runs the forward pass on its share of the batch inside ``jax.shard_map``
    over the mesh's ``"data"`` axis (as the train step does, so the dropless MoE never
    gathers the batch) and the sums are ``psum`` -med. ``loss`` is the summed token
    cross-entropy of the batch (float32) and ``tokens`` the token count, so a caller can
    average over batches of different sizes exactly.

    Raises:
      ValueError: a mesh without a ``"data"`` axis.
    """
    if not isinstance(mesh, Mesh) or comm.DATA_AXIS not in mesh.axis_names:
        raise ValueError(f"make_eval_step needs mesh= a jax.sharding.Mesh with a {comm.DATA_AXIS!r} "
                         f"axis, got {mesh!r}")
    axis = comm.DATA_AXIS

    def per_device(params, biases, rest, batch):
        model = nnx.merge(graphdef, params, biases, rest)
        logits, _ = model(batch["inputs"])
        tokens = jnp.asarray(batch["targets"].size, jnp.float32)
        loss = ops.cross_entropy(logits, batch["targets"]) * tokens
        return {"loss": jax.lax.psum(loss, axis), "tokens": jax.lax.psum(tokens, axis)}

    def eval_step(state: TrainState, batch):
        rep = PartitionSpec()
        return jax.shard_map(per_device, mesh=mesh, in_specs=(rep, rep, rep, PartitionSpec(axis)),
                             out_specs=rep)(state.params, state.biases, state.rest, batch)

    return eval_step
