"""What a resumed run must share with its checkpoint (:func:`check_same_settings`), and
what is adapted when it may differ: a top-k residual saved for another number of devices
(:func:`residual_adapter`, :func:`reshard_residual`), and scanned stacks saved in another
layout (:func:`stacks_adapter`, :func:`relayout_stacks`).
"""
from __future__ import annotations

import json
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.traverse_util import flatten_dict
from jax.sharding import NamedSharding, PartitionSpec

from jaxmp.precision.policy import canonical_dtype
from jaxmp.train.integrity import CheckpointError
from jaxmp.train.keys import DEFAULTS

__all__ = ["INCOMPATIBLE_KEYS", "MAY_CHANGE_KEYS", "config_differences", "check_same_settings",
           "residual_adapter", "reshard_residual", "stacks_adapter", "relayout_stacks",
           "saved_stacks", "SAVED_STACKS"]

# The checkpoint meta key holding a scanned model's stacks (lists of layer indices); a
# checkpoint without it was written before jaxmp recorded them, in the layout of runs alone
# (jaxmp.models.layer_stacks(interleave=False)).
SAVED_STACKS = "stacks"

# Config sections that must match between a checkpoint and the run resuming it; the
# rest (steps, logging cadence, ...) may change, e.g. to continue training longer.
INCOMPATIBLE_KEYS = ("model", "precision", "optim", "lora", "data.seq_len", "data.path", "data.tokenizer",
                     "data.token_dtype", "data.eod_id", "data.format", "data.loss_on",
                     "data.packing", "data.truncate", "data.chat_template",
                     "data.max_tokens", "train.batch_size", "train.grad_accum_steps", "seed")
# Keys inside those sections that may still change on resume: the decay horizon, so a
# run can be extended on a schedule the user chooses; the base checkpoint's directory
# (model.init_from, read at step 0 only: a resumed run's weights are its checkpoint's, and
# its architecture is compared key by key), which a run stores absolute since 2026-12-04.
MAY_CHANGE_KEYS = ("optim.decay_steps", "model.init_from")


def _lookup(config: dict, dotted: str):
    node = config
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _dtype_name(value):
    """A dtype key's value as the dtype it names (``' BF16 '`` and ``bfloat16`` alike), or
    the value itself where it names none ('' = the master dtype)."""
    try:
        return canonical_dtype(value).name if value else value
    except (ValueError, TypeError):
        return value


# Keys that take several spellings of one value: compared by what they name, so that a
# resume with another spelling is not another setting.
_SAME_VALUE = {"precision.grad_reduce_dtype": _dtype_name, "optim.mu_dtype": _dtype_name,
               "optim.nu_dtype": _dtype_name}


def config_differences(saved: dict, current: dict) -> list:
    """``[(key, saved_value, current_value)]`` for keys of :data:`INCOMPATIBLE_KEYS`
    (and below) that differ, ignoring :data:`MAY_CHANGE_KEYS`; a dtype key compares the
    dtype it names (``bf16`` is ``bfloat16``). A key the saved config
    does not have (added to jaxmp after it was written, e.g. ``optim.update_rounding``)
    differs only when the current value is not that key's default."""
    diffs = []
    for section in INCOMPATIBLE_KEYS:
        a, b = (flatten_dict({section: _lookup(c, section)}, sep=".") for c in (saved, current))
        for key in sorted(set(a) | set(b)):
            if key not in a and key in DEFAULTS and b.get(key) == DEFAULTS[key]:
                continue  # a newer key at its default: the checkpoint ran with that behaviour
            same = _SAME_VALUE.get(key, lambda v: v)
            if (key not in MAY_CHANGE_KEYS
                and json.dumps(same(a.get(key)), default=str)
                != json.dumps(same(b.get(key)), default=str)):
                diffs.append((key, a.get(key), b.get(key)))
    return diffs


def check_same_settings(saved: dict, current: dict, step: int, directory) -> None:
    """Refuses to resume checkpoint ``step`` of ``directory`` (saved with config ``saved``)
    under ``current``.

    Raises:
      CheckpointError: a key of :data:`INCOMPATIBLE_KEYS` differs
        (:func:`config_differences`); the line names up to 8 with both values.
    """
    diffs = config_differences(saved, current)
    if diffs:
        listed = "; ".join(f"{k}: saved {a!r}, now {b!r}" for k, a, b in diffs[:8])
        raise CheckpointError(
            f"checkpoint step {step} in {directory} was written with different settings "
            f"({listed}{'; ...' if len(diffs) > 8 else ''}); resume with the same settings or "
            f"use a new --workdir")


def residual_adapter(num_devices: int, mesh) -> Callable[[dict, Any], Any]:
    """An ``adapt`` for :meth:`jaxmp.train.checkpoint.Checkpointer.restore`: a top-k residual (``comm_state``,
    one row per device, ``[saved_n, ...]``) saved for another device count is restored
    in its saved shape, replicated on ``mesh``, for :func:`reshard_residual`."""
    def adapt(meta: dict, template):
        saved_n = meta.get("num_devices")
        if template.comm_state is None or saved_n in (None, num_devices):
            return template
        replicated = NamedSharding(mesh, PartitionSpec())
        comm = jax.tree.map(lambda x: jax.ShapeDtypeStruct((int(saved_n),) + tuple(x.shape[1:]),
                                                           x.dtype, sharding=replicated),
                            template.comm_state)
        return template.replace(comm_state=comm)
    return adapt


def reshard_residual(state, saved_n: Optional[int], num_devices: int, shardings):
    """``(state, note)``: the top-k residual of ``saved_n`` devices given to ``num_devices``
    devices, laid out by ``shardings`` (the train state's ``comm_state`` shardings); the
    state unchanged and None when the counts agree or there is no residual.

    Each device's residual is what it has not yet delivered of its own gradients; the
    exchange sends the mean over devices, so the undelivered part of the mean gradient is
    ``mean_i residual_i``. Giving every new device that mean keeps it exactly:
    ``mean_j new_j = mean_i old_i``.
    """
    if state.comm_state is None or saved_n in (None, num_devices):
        return state, None
    n = num_devices

    def spread(r, sharding):  # the mean in float64, rounded once to float32
        mean = np.asarray(jax.device_get(r), np.float64).mean(0, keepdims=True).astype(np.float32)
        return jax.device_put(np.broadcast_to(mean, (n,) + r.shape[1:]), sharding)

    comm = jax.tree.map(spread, state.comm_state, shardings)
    note = (f"the top-k residual was saved for {saved_n} devices and this mesh has {n}: each "
            f"device now holds the mean of the saved rows, which keeps the gradient not yet "
            f"delivered")
    return state.replace(comm_state=comm), note


def _relayout(tree, src, dst, axis: int):
    """``tree`` with every ``nnx.State`` that holds ``stacks`` (parameters, their optimizer
    moments, router biases, FP8 histories) re-stacked from the stacks ``src`` to ``dst``
    (each a tuple of layer-index tuples): stack ``t`` of the result holds, along ``axis``,
    the rows of its layers taken from wherever ``src`` keeps them. ``jax.ShapeDtypeStruct``
    leaves get the new length and keep their sharding (the ``layers`` axis is never split)."""
    where = {layer: (s, j) for s, layers in enumerate(src) for j, layer in enumerate(layers)}

    def combine(xs, picks, involved, n):
        if isinstance(xs[0], jax.ShapeDtypeStruct):
            shape = list(xs[0].shape)
            shape[axis] = n
            return jax.ShapeDtypeStruct(tuple(shape), xs[0].dtype, sharding=xs[0].sharding)
        return jnp.stack([jnp.take(xs[involved.index(s)], j, axis=axis) for s, j in picks],
                         axis=axis)

    def restack(node):
        if not (isinstance(node, nnx.State) and "stacks" in node):
            return node
        flat = list(nnx.to_flat_state(node))
        out = [(p, v) for p, v in flat if p[0] != "stacks"]
        old = {}  # stack -> {path inside it: leaf}
        for p, v in flat:
            if p[0] == "stacks":
                old.setdefault(int(p[1]), {})[tuple(p[2:])] = v
        for t, layers in enumerate(dst):
            picks = [where[layer] for layer in layers]
            involved = sorted({s for s, _ in picks})
            for rest, first in old[involved[0]].items():
                leaves = [old[s][rest] for s in involved]
                if isinstance(first, nnx.Variable):
                    value = combine([v.get_value() for v in leaves], picks, involved, len(layers))
                    out.append((("stacks", t) + rest, first.replace(value)))
                else:
                    out.append((("stacks", t) + rest, combine(leaves, picks, involved,
                                                              len(layers))))
        return nnx.from_flat_state(out)

    return jax.tree.map(restack, tree,
                        is_leaf=lambda x: isinstance(x, nnx.State) and "stacks" in x)


def relayout_stacks(state, src, dst):
    """A :class:`~jaxmp.train.TrainState` (of arrays or ``jax.ShapeDtypeStruct``) with its
    scanned stacks moved from layout ``src`` to ``dst`` (tuples of layer-index tuples,
    :func:`jaxmp.models.layer_stacks`): the master weights, router biases, FP8 histories
    and optimizer state one layer row at a time (the stacks hold the same per-layer
    arrays, only grouped otherwise), and the top-k residual ``[devices, layers, ...]``
    along its second axis. ``state`` itself where the layouts agree. Arrays come back
    wherever ``jnp.stack`` leaves them: put them on the run's shardings afterwards."""
    src, dst = (tuple(tuple(int(i) for i in s) for s in x) for x in (src, dst))
    if src == dst:
        return state
    if sorted(i for s in src for i in s) != sorted(i for s in dst for i in s):
        raise CheckpointError(f"the saved scanned stacks {src} do not hold this model's layers "
                              f"{dst}")
    rows = {k: _relayout(getattr(state, k), src, dst, 0)
            for k in ("params", "biases", "rest", "opt_state")}
    comm = None if state.comm_state is None else _relayout(state.comm_state, src, dst, 1)
    return state.replace(**rows, comm_state=comm)


def saved_stacks(meta: dict, legacy):
    """The scanned stacks a checkpoint was saved with: its meta's :data:`SAVED_STACKS`, or
    ``legacy`` (the runs-alone layout, :func:`jaxmp.models.layer_stacks` with
    ``interleave=False``) for one saved before they were recorded."""
    return meta.get(SAVED_STACKS, legacy)


def stacks_adapter(stacks, legacy, adapt: Optional[Callable[[dict, Any], Any]] = None):
    """An ``adapt`` for :meth:`jaxmp.train.checkpoint.Checkpointer.restore` (after
    ``adapt``, e.g. :func:`residual_adapter`): a checkpoint whose scanned stacks (its meta's
    :data:`SAVED_STACKS`; ``legacy``, the runs-alone layout, where it has none) are not
    ``stacks`` (this run's, None unscanned) is restored in its saved layout; convert it
    with :func:`relayout_stacks` (saved, ``stacks``) afterwards. A scanned run's
    checkpoints from before 460f087 (2026-12-06), where a repeating pattern of layers
    (GPT-OSS, Qwen3-Next, Gemma 3 past 34 layers) was one stack per run, resume this
    way."""
    def adapted(meta: dict, template):
        if adapt is not None:
            template = adapt(meta, template)
        if stacks is None:
            return template
        return relayout_stacks(template, stacks, saved_stacks(meta, legacy))
    return adapted
