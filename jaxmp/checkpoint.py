"""Checkpoints of the whole train state, the data iterator state and the config (orbax).

A checkpoint step directory holds three items, written by one
``orbax.checkpoint.CheckpointManager``:

* ``state``: the :class:`~jaxmp.train_step.TrainState` (params, optimizer state, loss
  scale with every field, router biases, counters, rng), restored onto the shardings
  of a template so it lands on the mesh it is used on;
* ``data``: the grain iterator state (JSON), so a resumed run sees exactly the batches
  an uninterrupted run would have seen;
* ``config``: the run's config (JSON), checked against the current one on resume.

Restoring never adjusts the loss scale or runs a step (case LS-9): the restored state
is used as it is. A checkpoint that cannot be read, or one written for another model or
precision setup, raises :class:`CheckpointError`; it is never silently replaced by a
fresh start.
"""
from __future__ import annotations

import json
import pathlib
from typing import Any, Optional, Tuple

import jax
import orbax.checkpoint as ocp

__all__ = ["CheckpointError", "Checkpointer", "INCOMPATIBLE_KEYS", "MAY_CHANGE_KEYS",
           "config_differences"]

# Config sections that must match between a checkpoint and the run resuming it; the
# rest (steps, logging cadence, ...) may change, e.g. to continue training longer.
INCOMPATIBLE_KEYS = ("model", "precision", "optim", "data.seq_len", "data.path",
                     "data.max_tokens", "train.batch_size", "train.grad_accum_steps", "seed")
# Keys inside those sections that may still change on resume: the decay horizon, so a
# run can be extended on a schedule the user chooses.
MAY_CHANGE_KEYS = ("optim.decay_steps",)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, or incompatible with the current run."""


def _lookup(config: dict, dotted: str):
    node = config
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _flatten(node, prefix: str) -> dict:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}.{key}"))
        return out
    return {prefix: node}


def config_differences(saved: dict, current: dict) -> list:
    """``[(key, saved_value, current_value)]`` for keys of :data:`INCOMPATIBLE_KEYS`
    (and below) that differ, ignoring :data:`MAY_CHANGE_KEYS`."""
    diffs = []
    for section in INCOMPATIBLE_KEYS:
        a, b = _flatten(_lookup(saved, section), section), _flatten(_lookup(current, section), section)
        for key in sorted(set(a) | set(b)):
            if key not in MAY_CHANGE_KEYS and json.dumps(a.get(key), default=str) != json.dumps(b.get(key), default=str):
                diffs.append((key, a.get(key), b.get(key)))
    return diffs


class Checkpointer:
    """Saves and restores ``(state, data_state, config)`` under ``workdir/checkpoints``.

    Args:
      workdir: the run directory.
      keep: how many most recent checkpoints to keep (orbax ``max_to_keep``).

    Raises:
      ValueError: ``keep`` < 1.
    """

    def __init__(self, workdir: str | pathlib.Path, keep: int = 2):
        if keep < 1:
            raise ValueError(f"train.keep_checkpoints must be >= 1, got {keep}")
        self.directory = pathlib.Path(workdir).absolute() / "checkpoints"
        self.saved_config: Optional[dict] = None  # the config of the last restored checkpoint
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
            item_names=("state", "data", "config"),
        )

    def latest_step(self) -> Optional[int]:
        """The newest saved step, or None when there is none."""
        return self.manager.latest_step()

    def save(self, step: int, state: Any, data_state: dict, config: dict) -> None:
        """Saves a checkpoint at ``step`` and waits until it is on disk."""
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data_state),
            config=ocp.args.JsonSave(config)), force=True)
        self.manager.wait_until_finished()

    def restore(self, template: Any, config: dict, step: Optional[int] = None) -> Tuple[int, Any, dict]:
        """Restores the newest (or the given) checkpoint onto ``template``'s shardings.

        Args:
          template: a state pytree of arrays (or ``jax.ShapeDtypeStruct`` with
            shardings) giving the structure, dtypes and shardings to restore to.
          config: the current run's config as a dict, checked against the saved one.
          step: the step to restore; the latest when None.

        Returns:
          ``(step, state, data_state)``.

        Raises:
          CheckpointError: no checkpoint, an unreadable one, or one whose saved config
            differs from ``config`` in any of :data:`INCOMPATIBLE_KEYS`.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        try:
            saved_config = self.manager.restore(step, args=ocp.args.Composite(
                config=ocp.args.JsonRestore()))["config"]
        except Exception as e:  # orbax raises many types for a damaged directory
            raise CheckpointError(self._damaged(step, "its config item is unreadable", e)) from None
        diffs = config_differences(saved_config, config)
        if diffs:
            listed = "; ".join(f"{k}: saved {a!r}, now {b!r}" for k, a, b in diffs[:8])
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} was written with different settings "
                f"({listed}{'; ...' if len(diffs) > 8 else ''}); resume with the same settings or "
                f"use a new --workdir")
        self.saved_config = saved_config
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
            template)
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))
        except Exception as e:
            raise CheckpointError(self._damaged(
                step, "it is corrupt or does not match this model's state", e)) from None
        return step, restored["state"], restored["data"]

    def _damaged(self, step: int, what: str, error: Exception) -> str:
        """The message for an unreadable checkpoint: the cause in one line, and a way out."""
        cause = " ".join(str(error).split())[:300]
        others = [s for s in self.manager.all_steps() if s != step]
        hint = (f"the other checkpoints here are at steps {others}: move {self.directory / str(step)} "
                f"away to resume from step {max(others)}, or use a new --workdir" if others
                else "use a new --workdir to start afresh")
        return (f"checkpoint step {step} in {self.directory} cannot be restored: {what} "
                f"({type(error).__name__}: {cause}); {hint}")

    def close(self) -> None:
        """Waits for pending writes and releases the manager."""
        self.manager.wait_until_finished()
        self.manager.close()
