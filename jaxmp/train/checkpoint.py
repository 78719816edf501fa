"""Checkpoints of the whole train state, the data iterator state and the config (orbax).

A checkpoint step directory holds three items, written by one
``orbax.checkpoint.CheckpointManager``:

* ``state``: the :class:`~jaxmp.train.state.TrainState` (params, optimizer state, loss
  scale with every field, router biases, counters, rng), restored onto the shardings
  of a template so it lands on the mesh it is used on;
* ``data``: the grain iterator state (JSON), so a resumed run sees exactly the batches
  an uninterrupted run would have seen;
* ``config``: the run's config (JSON), checked against the current one on resume.

Saves are asynchronous (orbax's default): :meth:`Checkpointer.save` returns once the
arrays are copied off the devices, and the files are written in a background thread
while training goes on; the next save, and :meth:`Checkpointer.close`, wait for it.
orbax writes each step into a temporary directory and renames it when complete, so a
process killed mid-write leaves the earlier checkpoints as they were; the unfinished
directory is removed when the next run opens the manager.

Restoring never adjusts the loss scale or runs a step (case LS-9): the restored state
is used as it is. A checkpoint that cannot be read, or one written for another model or
precision setup, raises :class:`CheckpointError`; it is never silently replaced by a
fresh start. A save that fails (a full disk, a read-only directory) raises
:class:`CheckpointError` naming the directory; orbax deletes old checkpoints only after
a new one is complete, so the earlier ones stay.
"""
from __future__ import annotations

import json
import logging
import os
import pathlib
import re
import sys
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


def _os_cause(error: BaseException) -> str:
    """The operating system's word for a failed write (``No space left on device``), else
    the first 300 characters of the error."""
    if getattr(error, "strerror", None):
        return error.strerror
    text = " ".join(str(error).split())
    code = re.search(r"os_error_code='?(\d+)", text)
    if code:
        return os.strerror(int(code.group(1)))
    return text[:300]


class _DropOrbaxTracebacks(logging.Filter):
    """Drops the tracebacks orbax (and asyncio, for orbax's tasks) log for a failed
    write: :class:`Checkpointer` raises each failure as a :class:`CheckpointError` with
    the cause in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "asyncio":
            return "orbax" not in record.getMessage()
        return not (record.exc_info and f"{os.sep}orbax{os.sep}" in record.pathname)


def _closed_loop_noise(unraisable) -> bool:
    """After a failed write, tensorstore's pending callbacks find orbax's event loop
    closed and report ``RuntimeError('Event loop is closed')`` as unraisable, dozens of
    times; the failure itself is raised as a :class:`CheckpointError`."""
    tb = unraisable.exc_traceback
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return (unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed"
            and tb is not None and tb.tb_frame.f_code.co_filename.endswith(os.path.join("asyncio", "base_events.py")))


def _quiet_orbax_tracebacks() -> None:
    for name in ("absl", "asyncio"):  # orbax logs through absl.logging
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropOrbaxTracebacks) for f in logger.filters):
            logger.addFilter(_DropOrbaxTracebacks())
    if not getattr(sys.unraisablehook, "_jaxmp", False):
        previous = sys.unraisablehook

        def hook(unraisable):
            if not _closed_loop_noise(unraisable):
                previous(unraisable)

        hook._jaxmp = True
        sys.unraisablehook = hook


class Checkpointer:
    """Saves and restores ``(state, data_state, config)`` under ``workdir/checkpoints``.

    Use as a context manager (or call :meth:`close`): leaving waits for the last save.

    Args:
      workdir: the run directory.
      keep: how many most recent checkpoints to keep (orbax ``max_to_keep``).

    Raises:
      ValueError: ``keep`` < 1.
      CheckpointError: the directory cannot be created (e.g. a read-only workdir).
    """

    def __init__(self, workdir: str | pathlib.Path, keep: int = 2):
        if keep < 1:
            raise ValueError(f"train.keep_checkpoints must be >= 1, got {keep}")
        self.directory = pathlib.Path(workdir).absolute() / "checkpoints"
        self.saved_config: Optional[dict] = None  # the config of the last restored checkpoint
        self._pending: Optional[int] = None  # the step being written in the background
        _quiet_orbax_tracebacks()
        try:
            self.manager = ocp.CheckpointManager(
                self.directory,
                options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                     cleanup_tmp_directories=True),
                item_names=("state", "data", "config"),
            )
        except OSError as e:
            raise CheckpointError(f"cannot create the checkpoint directory {self.directory}: "
                                  f"{e.strerror or e}; use a writable --workdir") from None

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close(raise_errors=exc[0] is None)

    def latest_step(self) -> Optional[int]:
        """The newest saved step, or None when there is none."""
        return self.manager.latest_step()

    def all_steps(self) -> list:
        """Every complete saved step, oldest first."""
        return sorted(self.manager.all_steps())

    def _failed(self, what: str, error: BaseException) -> CheckpointError:
        cause = _os_cause(error)
        kept = self.all_steps()
        return CheckpointError(
            f"{what} in {self.directory} failed: {type(error).__name__}: {cause}; the earlier "
            f"checkpoints ({', '.join(map(str, kept)) or 'none'}) are intact. Free disk space or "
            f"make the directory writable, then rerun to resume")

    def save(self, step: int, state: Any, data_state: dict, config: dict) -> None:
        """Starts an asynchronous save of a checkpoint at ``step``.

        Waits for the previous save first; returns once ``state`` is copied off the
        devices (so it may be donated to the next step right away).

        Raises:
          CheckpointError: this or the previous save failed; the message names the
            step, the directory and the checkpoints that remain.
        """
        self.wait()
        self._pending = step
        try:
            self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=ocp.args.JsonSave(data_state),
                config=ocp.args.JsonSave(config)), force=True)
        except Exception as e:  # orbax raises OSError, ValueError, XlaRuntimeError, ...
            self._pending = None
            raise self._failed(f"saving checkpoint step {step}", e) from None

    def wait(self) -> None:
        """Blocks until the pending save is on disk.

        Raises:
          CheckpointError: it failed.
        """
        step, self._pending = self._pending, None
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            raise self._failed(f"writing checkpoint step {step}", e) from None

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

    def close(self, raise_errors: bool = True) -> None:
        """Waits for the pending save and releases the manager (idempotent).

        Raises:
          CheckpointError: the pending save failed (unless ``raise_errors`` is False,
            as when an exception is already on its way out).
        """
        if self.manager is None:
            return
        try:
            self.wait()
        except CheckpointError:
            if raise_errors:
                raise
        finally:
            manager, self.manager = self.manager, None
            try:
                manager.close()
            except Exception:  # a failed save can make closing fail too; the error is raised above
                pass
