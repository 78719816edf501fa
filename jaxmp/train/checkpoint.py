"""Checkpoints of the whole train state, the data iterator state and the config (orbax).

A checkpoint step directory holds four items, written by one
``orbax.checkpoint.CheckpointManager``:

* ``state``: the :class:`~jaxmp.train.state.TrainState` as
  :meth:`~jaxmp.train.Experiment.checkpoint_template` holds it: the master weights,
  the optimizer state, the loss scale with every field, the router biases, the rest of
  the model's state (FP8 amax histories), the counters (step, skipped and consecutive
  skips, divergent steps), the loss and gradient-norm running means, the rng and the
  top-k residual (``comm_state``); ZeRO-1's compute-dtype copy is left out and rebuilt.
  It is restored onto the shardings of a template so it lands on the mesh it is used on
  (a top-k residual saved for another number of devices is resharded,
  :func:`reshard_residual`);
* ``data``: the grain iterator state (JSON), so a resumed run sees exactly the batches
  an uninterrupted run would have seen;
* ``config``: the run's config (JSON), checked against the current one on resume;
* ``verify``: a 64-bit checksum of every array of the state, computed on the devices at
  save time (:func:`state_checksums`), a SHA-256 digest of each JSON item (``data``,
  ``config``) and of ``verify`` itself (:func:`json_digest`), whether the state was
  healthy (its latest step applied and not divergent), and what the state was saved for
  (the trainer's ``meta``: the number of devices, ``parallel.strategy`` and
  ``parallel.expert``), and the step it was saved at. Every item of a checkpoint is thus
  checked on restore.

A checkpoint knows its own step: a step directory whose ``verify`` names another step (a
copy of step 6 as ``checkpoints/8``, step 6 renamed to 12) is corrupt, as is, for one
written before ``verify`` named its step, one whose state's ``step`` counter differs from
its directory's name. A step directory must be a directory of its own holding only regular
files and directories: a symbolic link, or a named pipe (which would hang the reader that
opens it) or other non-regular file inside, makes it corrupt, found without opening any of
its files; such a directory is kept out of orbax's listing from the start
(:attr:`Checkpointer.refused`).

Rotation keeps the ``keep`` newest checkpoints and, outside that count, the newest healthy
one: checkpoints saved while a run stalls or diverges (a SIGTERM then) never push out the
last healthy state (:meth:`Checkpointer.healthy_step`). It also keeps the checkpoint of the
lowest eval loss (:meth:`Checkpointer.best_step`; the eval loss is saved with each
checkpoint evaluated at its step), so that a slow divergence, whose every step looks
healthy, never rotates out the best state: the equivalent of orbax's ``LatestN`` together
with ``BestN(n=1)`` preservation policies. Older ones are deleted once a newer save is
complete.

A reader (``Checkpointer(workdir, read_only=True)``: :func:`jaxmp.train.load`,
``python -m jaxmp.sample``, ``python -m jaxmp.export``) changes nothing in the workdir: orbax
is opened read-only (no directory created, no temporary directory of an in-flight save
removed), and a corrupt checkpoint is skipped, not moved. Beside a live trainer, whose
rotation may delete the checkpoint a reader is reading (``train.keep_checkpoints=1`` deletes
each one a save after it is complete), a checkpoint that fails to read because it was
deleted meanwhile is not corrupt: the steps are listed again and the newest is read, a
bounded number of times (:meth:`Checkpointer.restore`, :meth:`Checkpointer.read_config`).

Saves are asynchronous (orbax's default): :meth:`Checkpointer.save` returns once the
arrays are copied off the devices, and the files are written in a background thread
while training goes on; the next save, and :meth:`Checkpointer.close`, wait for it.
orbax writes each step into a temporary directory and renames it when complete, so a
process killed mid-write leaves the earlier checkpoints as they were; the unfinished
directory is removed when the next run opens the manager.

Restoring never adjusts the loss scale or runs a step (case LS-9): the restored state
is used as it is, after its checksums are recomputed and compared and its floating-point
leaves checked finite. A checkpoint written for another model or precision setup raises
:class:`CheckpointError` naming the differences. One that fails to read or to verify is
corrupt (so is a data-iterator state that the run's data cannot take): when resuming from the newest
checkpoint, it is moved to ``checkpoints/corrupt/STEP`` with a loud warning
(:attr:`Checkpointer.warnings`) and the next older one is tried; when none is good,
:class:`CheckpointError` names each, and nothing is moved. A run never continues from garbage, and
never silently starts afresh. A save that fails (a full disk, a read-only directory) raises
:class:`CheckpointError` naming the directory; orbax deletes old checkpoints only after a new one is
complete, so the earlier ones stay.
"""
from __future__ import annotations

import logging
import os
import pathlib
import re
from typing import Any, Callable, Optional, Tuple

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxmp._checks import check_int
from jaxmp.precision.loss_scale import all_finite
from jaxmp.train.integrity import (FORMAT, CheckpointError, Corrupt, check_digests, damage,
                                   json_digest, not_its_step, state_checksums, step_counter)
from jaxmp.train.orbax_items import (READER_ATTEMPTS, ROTATION_ATTEMPTS, StepNames,
                                     handler_registry)
from jaxmp.train.resume import (INCOMPATIBLE_KEYS, MAY_CHANGE_KEYS, check_same_settings,
                                config_differences, reshard_residual, residual_adapter)

# The checks of a checkpoint (jaxmp.train.integrity) and of a resume (jaxmp.train.resume)
# are named here too: they are what a Checkpointer's user meets.
__all__ = ["CheckpointError", "Checkpointer", "INCOMPATIBLE_KEYS", "MAY_CHANGE_KEYS",
           "state_checksums", "json_digest", "config_differences", "check_same_settings",
           "residual_adapter", "reshard_residual"]

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


class _ReadOnlyNotice(logging.Filter):
    """Drops orbax's warning that a manager was opened read-only (absl's logger)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Given directory is read only")


class _without_read_only_notice:  # noqa: N801  (a context manager)
    """While orbax's ``CheckpointManager`` is built, its warning that the directory is read
    only (what a reader asked for) is dropped from absl's logger; the filter is removed on
    leaving, so library calls (:func:`jaxmp.train.load`) leave the logger as they found it."""

    def __enter__(self):
        self._filter = _ReadOnlyNotice()
        logging.getLogger("absl").addFilter(self._filter)

    def __exit__(self, *exc):
        logging.getLogger("absl").removeFilter(self._filter)


def _one_line(error: BaseException) -> str:
    """An error's text on one line, at most 300 characters. Where the text holds a
    pybind11 object's repr instead of a message (orbax's "See full TensorStore details:
    <bound method ...>"), the message of the error that caused it is used: TensorStore's
    names the array and the file (``Error reading "params.w/0.0" in OCDBT database at
    local file ...``)."""
    text, cause = str(error), error.__cause__ or error.__context__
    while "<bound method" in text and cause is not None:
        text, cause = f"{type(cause).__name__}: {cause}", cause.__cause__ or cause.__context__
    return " ".join(text.split())[:300]


class Checkpointer:
    """Saves and restores ``(state, data_state, config)`` under ``workdir/checkpoints``.

    Use as a context manager (or call :meth:`close`): leaving waits for the last save.

    Args:
      workdir: the run directory.
      keep: how many most recent checkpoints to keep; the newest healthy one and the one
        of the lowest eval loss are kept besides them (see the module docstring).
      read_only: open for reading only (a reader beside a trainer): nothing is created,
        cleaned up, moved or deleted; :meth:`save` is refused.

    Raises:
      ValueError: ``keep`` < 1.
      CheckpointError: the directory cannot be created (e.g. a read-only workdir); with
        ``read_only``, it does not exist, or its steps cannot be listed (a live trainer's
        changes to them are listed again, up to ``READER_ATTEMPTS`` times).

    A step directory that is a symbolic link or holds anything but regular files and
    directories (a named pipe would hang the reader) is left out of orbax's listing from
    the start (:attr:`refused`); :meth:`restore` reports it, and sets it aside, as any
    other corrupt checkpoint.
    """

    def __init__(self, workdir: str | pathlib.Path, keep: int = 2, read_only: bool = False):
        check_int("train.keep_checkpoints", keep, 1)
        self.directory = pathlib.Path(workdir).absolute() / "checkpoints"
        self.read_only = bool(read_only)
        self.saved_config: Optional[dict] = None  # the config of the last restored checkpoint
        self.saved_meta: dict = {}  # what the last restored checkpoint was saved for
        self.warnings: list = []  # corrupt checkpoints set aside while restoring
        self._pending: Optional[int] = None  # the step being written in the background
        self.keep = int(keep)
        self._meta: dict = {}  # step -> {"healthy": bool or None, "eval_loss": float or None}
        if self.read_only and not self.directory.is_dir():
            raise CheckpointError(f"{self.directory} is not a directory of checkpoints")
        self._names = StepNames()  # orbax lists the steps through it, leaving out damaged ones
        # A trainer removes the temporary directories of saves a killed run left; a reader
        # must not: one of them may be the save a live trainer is writing.
        # save_interval_steps=0: what orbax sets for a reader anyway, given so that it
        # does not log a warning about it at every sample and export.
        options = (ocp.CheckpointManagerOptions(max_to_keep=None, create=False,
                                                cleanup_tmp_directories=False, read_only=True,
                                                save_interval_steps=0,
                                                step_name_format=self._names)
                   if self.read_only else
                   ocp.CheckpointManagerOptions(max_to_keep=None, create=True,
                                                cleanup_tmp_directories=True,
                                                step_name_format=self._names))
        for attempt in range(READER_ATTEMPTS):
            try:
                # max_to_keep=None: orbax keeps every step and _prune deletes, so that the
                # newest healthy checkpoint is kept outside the rotation.
                with _without_read_only_notice():
                    self.manager = ocp.CheckpointManager(
                        self.directory, options=options, handler_registry=handler_registry())
                break
            except FileNotFoundError as e:
                # A reader beside a live trainer: orbax lists the steps, then reads each
                # one's metadata, and the trainer may prune or finish a step in between.
                # The listing is read again; the directory itself must still be there.
                if (self.read_only and self.directory.is_dir()
                        and attempt + 1 < READER_ATTEMPTS):
                    continue
                raise CheckpointError(self._unreadable(e)) from None
            except OSError as e:
                raise CheckpointError(self._unreadable(e)) from None

    def _unreadable(self, e: OSError) -> str:
        if self.read_only:
            return f"cannot read the checkpoints in {self.directory}: {e.strerror or e}"
        return (f"cannot create the checkpoint directory {self.directory}: "
                f"{e.strerror or e}; use a writable --workdir")

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close(raise_errors=exc[0] is None)

    def latest_step(self) -> Optional[int]:
        """The newest step directory, or None when there is none. One refused as damaged
        (:attr:`refused`) counts, so that :meth:`restore` says what is wrong with it
        instead of a run starting afresh beside it."""
        listing = self._listing()
        return listing[0] if listing else None

    def all_steps(self) -> list:
        """Every complete saved step that is safe to read (not :attr:`refused`), oldest
        first."""
        return sorted(self.manager.all_steps())

    @property
    def refused(self) -> dict:
        """``{step: why}``: the step directories the last listing left out of orbax's sight
        (a symbolic link, a named pipe or other non-regular file inside)."""
        return dict(self._names.refused)

    def _listing(self) -> list:
        """Every step directory, refused ones included, newest first."""
        return sorted(set(self.manager.all_steps()) | set(self._names.refused), reverse=True)

    def _relist(self) -> None:
        """Lists the steps again (a live trainer completes and deletes them meanwhile).

        Raises:
          CheckpointError: they cannot be listed (``READER_ATTEMPTS`` tries).
        """
        for attempt in range(READER_ATTEMPTS):
            try:
                self.manager.reload()
                return
            except FileNotFoundError as e:  # a step deleted between orbax's listing and reading
                if self.directory.is_dir() and attempt + 1 < READER_ATTEMPTS:
                    continue
                raise CheckpointError(f"cannot list the checkpoints in {self.directory}: "
                                      f"{e.strerror or e}") from None

    def _read_json(self, step: int, what: str, *names: str) -> dict:
        """The JSON items ``names`` of checkpoint ``step``, read once :func:`~jaxmp.train.integrity.damage` finds
        its directory safe to read (nothing in it is opened before).

        Args:
          step: the checkpoint.
          what: the items in words, for the error (``"its config or checksums"``).
          *names: the items (``"config"``, ``"verify"``, ``"data"``).

        Raises:
          Corrupt: the directory is damaged, gone or unreadable (``unread`` but for damage).
        """
        try:
            why = damage(self.directory / str(step))
        except FileNotFoundError:
            raise Corrupt("its directory is gone", unread=True) from None
        except OSError as e:
            raise Corrupt(f"its directory cannot be listed ({e.strerror or e})",
                           unread=True) from None
        if why is not None:
            raise Corrupt(why)
        try:
            return self.manager.restore(step, args=ocp.args.Composite(
                **{name: ocp.args.JsonRestore() for name in names}))
        except Exception as e:  # orbax raises many types for a damaged directory
            raise Corrupt(f"{what} are unreadable ({type(e).__name__}: {_one_line(e)})",
                           unread=True) from None

    def _moved_on(self, step: int, listing: list) -> bool:
        """Whether checkpoint ``step``, of the steps ``listing`` (newest first), failed to
        read because it was deleted meanwhile: its directory is gone, or (a reader beside a
        trainer) the steps, listed again, lack it or hold a newer one (a trainer deletes a
        step, file by file, only once a newer one is complete). Lists the steps again when
        so."""
        if step not in listing:
            return False  # it was never there
        if not os.path.lexists(self.directory / str(step)):
            self._relist()
            return True
        if not self.read_only:  # the trainer itself: nothing else deletes its checkpoints
            return False
        self._relist()
        now = self._listing()
        return step not in now or (bool(now) and now[0] > listing[0])

    def read_config(self, step: Optional[int] = None) -> Tuple[int, dict]:
        """``(step, config)``: the config saved with checkpoint ``step``, or with the newest
        checkpoint whose config reads when ``step`` is None. Steps a trainer deletes while
        they are read (its rotation) are listed again and the newest is read, up to
        ``ROTATION_ATTEMPTS`` times. The checkpoint is not verified: :meth:`restore` does.

        Raises:
          CheckpointError: no checkpoint's config reads (each is named with its fault);
            ``step`` was deleted while it was read; the checkpoints were deleted while read
            ``ROTATION_ATTEMPTS`` times over.
        """
        for _ in range(ROTATION_ATTEMPTS):
            listing = self._listing()
            faults = []
            for s in ([step] if step is not None else listing):
                try:
                    return s, self._read_json(s, "its config", "config")["config"]
                except Corrupt as e:
                    if e.unread and self._moved_on(s, listing):
                        break
                    faults.append(f"step {s}: {e}")
            else:
                raise CheckpointError(f"no checkpoint in {self.directory} can be read "
                                      f"({'; '.join(faults) or 'there is none'})")
            if step is not None:
                raise self._deleted_while_read(step)
        raise self._rotated_out()

    def _deleted_while_read(self, step: int) -> CheckpointError:
        return CheckpointError(
            f"checkpoint step {step} in {self.directory} was deleted while it was read (a "
            f"trainer's rotation, train.keep_checkpoints); read the newest (no step), or "
            f"keep more checkpoints")

    def _rotated_out(self) -> CheckpointError:
        return CheckpointError(
            f"the checkpoints in {self.directory} were deleted while they were read "
            f"{ROTATION_ATTEMPTS} times over (a trainer saving and rotating them faster "
            f"than they read: train.checkpoint_every, train.keep_checkpoints); read again, or "
            f"keep more checkpoints")

    def _facts(self, step: int) -> dict:
        """``{"healthy": bool or None, "eval_loss": float or None}`` of checkpoint ``step``
        (from its ``verify`` item, read once; None where unknown, unreadable, or the item
        names another step)."""
        if step not in self._meta:
            try:
                meta = self._read_json(step, "its checksums", "verify")["verify"]
            except Corrupt:  # a damaged checkpoint: restore() says what is wrong with it
                meta = None
            meta = meta if isinstance(meta, dict) else {}
            if meta.get("step", step) != step:  # a copy of another step: nothing is known
                meta = {}
            flag, loss = meta.get("healthy"), meta.get("eval_loss")
            self._meta[step] = {
                "healthy": flag if isinstance(flag, bool) else None,
                "eval_loss": (float(loss) if isinstance(loss, (int, float))
                              and not isinstance(loss, bool) and np.isfinite(loss) else None)}
        return self._meta[step]

    def healthy(self, step: int) -> Optional[bool]:
        """Whether checkpoint ``step`` was saved healthy (its latest step applied and not
        divergent); None when unknown (written before format 2, or unreadable)."""
        return self._facts(step)["healthy"]

    def eval_loss(self, step: int) -> Optional[float]:
        """The eval loss (nats/token) saved with checkpoint ``step``; None when it was not
        evaluated at its step (or is unreadable)."""
        return self._facts(step)["eval_loss"]

    def healthy_step(self) -> Optional[int]:
        """The newest checkpoint saved healthy, or None when there is none."""
        return next((s for s in reversed(self.all_steps()) if self.healthy(s)), None)

    def best_step(self) -> Optional[int]:
        """The checkpoint of the lowest saved eval loss (the newest of equals), or None when
        no checkpoint was saved with one."""
        scored = [(self.eval_loss(s), -s) for s in self.all_steps()
                  if self.eval_loss(s) is not None]
        return -min(scored)[1] if scored else None

    def unhealthy_steps(self) -> list:
        """The checkpoints newer than :meth:`healthy_step` that were saved unhealthy."""
        last = self.healthy_step() or 0
        return [s for s in self.all_steps() if s > last and self.healthy(s) is False]

    def _prune(self) -> None:
        """Deletes the checkpoints that are neither among the ``keep`` newest, nor the
        newest healthy one, nor the one of the lowest eval loss (after a save is complete,
        as orbax's ``max_to_keep`` does)."""
        steps = self.all_steps()
        kept = set(steps[-self.keep:]) | {self.healthy_step(), self.best_step()}
        for step in steps:
            if step not in kept:
                self.manager.delete(step)
                self._meta.pop(step, None)

    def _failed(self, what: str, error: BaseException) -> CheckpointError:
        cause = _os_cause(error)
        kept = self.all_steps()
        return CheckpointError(
            f"{what} in {self.directory} failed: {type(error).__name__}: {cause}; the earlier "
            f"checkpoints ({', '.join(map(str, kept)) or 'none'}) are intact. Free disk space or "
            f"make the directory writable, then rerun to resume")

    def save(self, step: int, state: Any, data_state: dict, config: dict,
             meta: Optional[dict] = None,
             healthy: bool = True, eval_loss: Optional[float] = None) -> None:
        """Starts an asynchronous save of a checkpoint at ``step``.

        Waits for the previous save first (and then deletes the checkpoints the rotation
        no longer keeps); computes the state's checksums on the devices; returns once
        ``state`` is copied off the devices (so it may be donated to the next step right
        away).

        Args:
          step: the step number (the directory's name).
          state: the pytree of arrays to save.
          data_state: the data iterator's JSON state.
          config: the run's config as a dict.
          meta: JSON facts the state was saved for (e.g. ``{"num_devices": 8}``).
          healthy: False when the state's latest step was skipped or looked divergent:
            such a checkpoint never displaces the newest healthy one.
          eval_loss: the eval loss (nats/token) of ``state``, when it was evaluated at
            ``step``: the checkpoint of the lowest one is kept (:meth:`best_step`).

        Raises:
          CheckpointError: this or the previous save failed; the message names the
            step, the directory and the checkpoints that remain; a read-only Checkpointer.
        """
        if self.read_only:
            raise CheckpointError(f"{self.directory} was opened read-only; nothing is saved")
        self.wait()
        loss = (float(eval_loss) if eval_loss is not None and np.isfinite(float(eval_loss))
                else None)
        verify = {**(meta or {}), "format": FORMAT, "step": int(step),
                  "checksums": state_checksums(state),
                  "healthy": bool(healthy), "eval_loss": loss,
                  "items": {"data": json_digest(data_state), "config": json_digest(config)}}
        verify["digest"] = json_digest(verify)
        self._meta[step] = {"healthy": bool(healthy), "eval_loss": loss}
        self._pending = step
        try:
            self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=ocp.args.JsonSave(data_state),
                config=ocp.args.JsonSave(config),
                verify=ocp.args.JsonSave(verify)), force=True)
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
        if step is not None:
            self._prune()

    def restore(self, template: Any, config: dict, step: Optional[int] = None,
                adapt: Optional[Callable[[dict, Any], Any]] = None,
                check_data: Optional[Callable[[dict], None]] = None) -> Tuple[int, Any, dict]:
        """Restores and verifies a checkpoint onto ``template``'s shardings.

        With ``step=None`` the newest checkpoint is tried first; one that is corrupt
        (unreadable, checksum mismatch, non-finite values; a step directory that is a
        symbolic link or holds a named pipe or other non-regular file; one that is the
        checkpoint of another step, copied or renamed: its ``verify`` item names its step,
        or, written before it did, its state's ``step`` counter) is moved to
        ``checkpoints/corrupt/STEP`` (left in place when read-only), a warning is added to
        :attr:`warnings`, and the next older one is tried. Nothing is moved unless a good
        checkpoint is found. A checkpoint that fails to read because it was deleted
        meanwhile (a trainer's rotation, beside which a reader reads) is not corrupt: the
        steps are listed again and the newest is read, up to ``ROTATION_ATTEMPTS`` times.

        Args:
          template: a state pytree of arrays (or ``jax.ShapeDtypeStruct`` with
            shardings) giving the structure, dtypes and shardings to restore to.
          config: the current run's config as a dict, checked against the saved one.
          step: restore exactly this step (no fallback); the newest good one when None.
          adapt: ``adapt(saved_meta, template) -> template`` to restore a state saved
            for another setup (e.g. another device count) in its saved shape; the
            caller converts it afterwards.
          check_data: ``check_data(data_state)`` raises ValueError when the run's data
            cannot take the saved iterator state (e.g. a position out of range); such a
            checkpoint is treated as corrupt.

        Returns:
          ``(step, state, data_state)``; :attr:`saved_config` and :attr:`saved_meta`
          hold the checkpoint's config and meta.

        Raises:
          CheckpointError: no checkpoint; one whose saved config differs from ``config``
            in any of :data:`INCOMPATIBLE_KEYS`; no checkpoint that reads and verifies
            (each is named with its fault); ``step`` was deleted while it was read; the
            checkpoints were deleted while read ``ROTATION_ATTEMPTS`` times over.
        """
        for _ in range(ROTATION_ATTEMPTS):
            listing = self._listing()
            steps = [step] if step is not None else listing
            if not steps:
                raise CheckpointError(f"no checkpoint in {self.directory}")
            faults = []
            for s in steps:
                try:
                    out = self._restore_one(s, template, config, adapt, check_data)
                except Corrupt as e:
                    if e.unread and self._moved_on(s, listing):
                        break  # deleted while read: list again, read the newest
                    faults.append((s, str(e)))
                    continue
                for bad, why in faults:  # set the corrupt ones aside, now that a good one exists
                    self._set_aside(bad, why, s)
                return out
            else:
                listed = "; ".join(f"step {s}: {why}" for s, why in faults)
                raise CheckpointError(f"no checkpoint in {self.directory} can be restored "
                                      f"({listed}); use a new --workdir to start afresh")
            if step is not None:
                raise self._deleted_while_read(step)
        raise self._rotated_out()

    def _restore_one(self, step: int, template: Any, config: dict, adapt,
                     check_data) -> Tuple[int, Any, dict]:
        saved = self._read_json(step, "its config or checksums", "config", "verify")
        saved_config, meta = saved["config"], saved["verify"]
        if not isinstance(meta, dict) or not isinstance(meta.get("checksums"), dict):
            raise Corrupt("it holds no checksums")
        digests = check_digests(meta)
        if "step" in meta:  # the step it was saved at, covered by the digest of verify
            own = meta["step"]
            if not isinstance(own, int) or isinstance(own, bool):
                raise Corrupt(f"the step in its checksums item (verify) is not an integer "
                               f"({own!r})")
            if own != step:
                raise Corrupt(not_its_step(step, own, "its checksums item (verify) says so"))
        if digests and json_digest(saved_config) != digests["config"]:
            raise Corrupt("its config item does not match its checksum")
        check_same_settings(saved_config, config, step, self.directory)
        if adapt is not None:
            template = adapt(meta, template)
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
            template)
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))
        except Exception as e:
            raise Corrupt(f"it does not read as this model's state ({type(e).__name__}: "
                           f"{_one_line(e)})", unread=True) from None
        state, data_state = restored["state"], restored["data"]
        if digests and json_digest(data_state) != digests["data"]:
            raise Corrupt("its data-iterator state does not match its checksum")
        if check_data is not None:
            try:
                check_data(data_state)
            except ValueError as e:
                raise Corrupt(f"its data-iterator state does not fit this run's data "
                               f"({e})") from None
        sums = state_checksums(state)
        bad = [k.split(":", 1)[1] for k in sums if meta["checksums"].get(k) != sums[k]]
        if bad or set(sums) != set(meta["checksums"]):
            raise Corrupt(f"the checksums of {len(bad) or 'its'} arrays do not match what was "
                           f"saved ({', '.join(bad[:4])}{', ...' if len(bad) > 4 else ''})")
        counter = step_counter(state) if "step" not in meta else None
        if counter is not None and counter != step:  # saved before verify named its step
            raise Corrupt(not_its_step(step, counter, "its state's step counter says so"))
        # One jitted program: eager per-leaf reductions over a sharded state are dozens of
        # small collective programs in flight at once, which XLA:CPU can deadlock on.
        if not bool(jax.device_get(jax.jit(all_finite)(state))):
            raise Corrupt("it holds NaN or inf values")
        self.saved_config, self.saved_meta = saved_config, meta
        if not digests:
            self.warnings.append(f"checkpoint step {step} in {self.directory} predates checksums "
                                 "of its data-iterator state and config (format "
                                 f"{meta.get('format')}): only its arrays were verified")
        return step, state, data_state

    def _set_aside(self, step: int, why: str, good: int) -> None:
        """Moves a corrupt step directory out of orbax's sight and records a warning (a
        reader only records the warning)."""
        if self.read_only:
            self.warnings.append(f"checkpoint step {step} in {self.directory} is corrupt: {why}; "
                                 f"read step {good} instead (nothing was moved)")
            return
        corrupt = self.directory / "corrupt"
        if corrupt.exists() and not corrupt.is_dir():
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} is corrupt ({why}) and cannot be set "
                f"aside: {corrupt} is a file, not a directory; move it away and rerun")
        target = self.directory / "corrupt" / str(step)
        n = 1
        while os.path.lexists(target):  # a step set aside before keeps its copy: STEP.1, ...
            target, n = self.directory / "corrupt" / f"{step}.{n}", n + 1
        if jax.process_index() == 0:
            target.parent.mkdir(exist_ok=True)
            (self.directory / str(step)).rename(target)
        self.manager.reload()
        self.warnings.append(f"checkpoint step {step} in {self.directory} is corrupt: {why}. It "
                             f"was moved to {target}; resuming from step {good} instead")

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

