"""The train state: one pytree holding everything a train step reads and writes.

:class:`TrainState` holds the step counter, the master parameters, the optimizer state,
the loss scale, the MoE router biases (DeepSeek-V3 auxiliary-loss-free balancing), the
skip counters, an rng, the state of gradient compression and (in ``rest``) the FP8 amax
histories of delayed scaling. It is what a checkpoint
saves, what ``train_step(state, batch)`` returns, and what
:func:`train_state_shardings` lays out on a mesh.
"""
from __future__ import annotations

from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from jaxmp import sharding
from jaxmp.models import RouterBias
from jaxmp.models.lora import TRAINABLE, FrozenParam
from jaxmp.precision.loss_scale import LossScale, as_loss_scale

__all__ = ["TrainState", "split_model", "split_frozen", "create_train_state",
           "train_state_shardings"]


@flax.struct.dataclass
class TrainState:
    """Everything the train step reads and writes, as one pytree.

    Attributes:
      step: int32 scalar, train steps taken (skipped ones included: the data moves on).
      params: ``nnx.State`` of ``nnx.Param``, the master weights (float32 in mixed modes);
        with low-rank adapters (``lora.rank > 0``) the adapters alone.
      biases: ``nnx.State`` of ``RouterBias``, float32 [num_experts] per MoE layer.
      rest: any other NNX state of the model: the :class:`~jaxmp.models.FP8State` amax
        histories of delayed FP8 scaling (float32 ``[3, history_length]`` per FP8 matmul,
        replaced by the train step, :mod:`jaxmp.train.step`), and with adapters the
        frozen base (:class:`~jaxmp.models.FrozenParam`, laid out as the forward pass
        reads parameters, never written, not checkpointed: :func:`split_frozen`).
      opt_state: the optax optimizer state (moments in their configured dtypes; with
        ``optim.update_rounding`` stochastic or kahan, a
        :class:`jaxmp.optim.UpdateRoundingState` around it: the counter of the random
        bits, and Kahan's compensation sharded like the parameters).
      loss_scale: a ``jaxmp`` loss scale (float32 scale, int32 counters).
      skipped_steps: int32 scalar, steps not applied since the start of training: their
        gradients or the updated state were not finite, so the parameters, optimizer
        state, router biases and top-k residual were kept bitwise.
      consecutive_skips: int32 scalar, how many of the latest steps in a row were not
        applied (0 after an applied step); what the trainer's stall guard reads, exactly,
        at whatever interval it looks (as optax's ``apply_if_finite`` keeps
        ``notfinite_count``).
      loss_ema: float32 scalar, the running mean (exponential, decay 0.9) of the loss of
        the applied steps that did not look divergent; 0 before the first one.
      grad_norm_ema: float32 scalar, the same for the unscaled gradient norm.
      divergent_steps: int32 scalar, how many of the latest applied steps in a row looked
        divergent (:func:`jaxmp.train.step.make_train_step`); skipped steps leave it as it
        is, a healthy applied step resets it to 0.
      rng: uint32 [2] PRNG key data. The train step does not use it (the model has no
        stochastic layers); the trainer draws its closing sample with it.
      comm_state: None, or for top-k gradient compression ``{"residual": tree}`` of
        float32 ``[num_devices, *param.shape]`` error-feedback residuals, sharded over
        the data axis (:func:`jaxmp.comm.init_comm_state`).
      compute_params: None, or under ZeRO-1 (``parallel.strategy="zero1"``) the
        parameters cast to their modules' compute dtypes, whole on every device (the
        forward pass reads them; the float32 ``params`` are split), gathered anew from
        the master weights after every step.
    """

    step: jax.Array
    params: Any
    biases: Any
    rest: Any
    opt_state: Any
    loss_scale: LossScale
    skipped_steps: jax.Array
    consecutive_skips: jax.Array
    loss_ema: jax.Array
    grad_norm_ema: jax.Array
    divergent_steps: jax.Array
    rng: jax.Array
    comm_state: Any = None
    compute_params: Any = None


def split_model(model: nnx.Module):
    """Splits an NNX model into ``(graphdef, params, biases, rest)``: the trained
    parameters (:data:`jaxmp.models.lora.TRAINABLE`, every ``nnx.Param`` but a frozen
    base), the router biases, everything else."""
    return nnx.split(model, TRAINABLE, RouterBias, ...)


def split_frozen(rest: Any):
    """``(frozen base, the rest without it)`` of ``TrainState.rest`` (two ``nnx.State`` s;
    the first empty without adapters)."""
    return nnx.split_state(rest, FrozenParam, ...)


def create_train_state(model: nnx.Module, optimizer: optax.GradientTransformation,
                       loss_scale: LossScale, seed: int, comm_state: Any = None):
    """Builds the initial :class:`TrainState` and returns ``(graphdef, state)``.

    Args:
      model: the NNX model, whose parameters are the initial master weights.
      optimizer: the optax transformation (its ``init`` gives ``opt_state``).
      loss_scale: a jaxmp or jmp loss scale (converted by :func:`jaxmp.as_loss_scale`).
      seed: the run's seed; ``rng`` is ``key(seed + 1)`` (``seed`` initialises the model).
      comm_state: see :func:`jaxmp.comm.init_comm_state` (None without compression).

    Raises:
      ValueError: ``loss_scale`` is not a loss scale.
    """
    graphdef, params, biases, rest = split_model(model)
    zero, zero_f = jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32)
    state = TrainState(
        step=zero, params=params, biases=biases, rest=rest,
        opt_state=optimizer.init(params), loss_scale=as_loss_scale(loss_scale),
        skipped_steps=zero, consecutive_skips=zero, loss_ema=zero_f, grad_norm_ema=zero_f,
        divergent_steps=zero,
        rng=jax.random.key_data(jax.random.key(seed + 1)), comm_state=comm_state)
    return graphdef, state


def train_state_shardings(state: TrainState, mesh: Mesh, rules) -> TrainState:
    """Shardings of a train state on ``mesh``.

    Args:
      state: a :class:`TrainState` of arrays or ``jax.ShapeDtypeStruct``.
      mesh: the device mesh.
      rules: a rule table of :mod:`jaxmp.sharding` (every part laid out by it), or a
        :class:`jaxmp.sharding.Layout`: the parameters, router biases and optimizer
        state by its ``state_rules``, the compute copy by its ``compute_rules``.

    Every ``nnx.Variable`` leaf with logical axes (the parameters, and the optimizer
    moments, which keep the parameters' wrappers) follows them
    (:func:`jaxmp.sharding.state_shardings`), a frozen base by the compute rules (as the
    forward pass reads parameters: whole under ZeRO-1, split under FSDP); the per-device top-k residual
    (``comm_state``) has its leading device axis split like the batch, so each device
    holds its own row; everything else is replicated.

    Returns:
      A :class:`TrainState` of ``NamedSharding`` (variables keep their wrappers).

    Raises:
      ValueError: as :func:`jaxmp.sharding.logical_to_sharding`.
    """
    state_rules = getattr(rules, "state_rules", rules)
    compute_rules = getattr(rules, "compute_rules", rules)
    shardings = sharding.state_shardings(state.replace(comm_state=None, compute_params=None), mesh,
                                         state_rules)
    comm = state.comm_state
    if comm is not None:
        comm = jax.tree.map(
            lambda x: sharding.logical_to_sharding(("batch",) + (None,) * (jnp.ndim(x) - 1), mesh,
                                                   state_rules),
            comm)
    compute = None
    if state.compute_params is not None:
        compute = sharding.state_shardings(state.compute_params, mesh, compute_rules)
    frozen, _ = split_frozen(state.rest)
    rest = shardings.rest
    if len(frozen):
        rest = nnx.merge_state(split_frozen(rest)[1],
                               sharding.state_shardings(frozen, mesh, compute_rules))
    return shardings.replace(comm_state=comm, compute_params=compute, rest=rest)
