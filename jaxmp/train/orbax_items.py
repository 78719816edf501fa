"""A checkpoint directory as orbax sees it: the handlers of a checkpoint's four items
(:func:`handler_registry`) and the step names that list only step directories safe to read
(:class:`StepNames`), with the bounded retries of a reader beside a live trainer.
"""
from __future__ import annotations

import pathlib

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxmp.train.integrity import damage

__all__ = ["StepNames", "StepGone", "StateHandler", "handler_registry", "READER_ATTEMPTS",
           "ROTATION_ATTEMPTS"]

class StepNames:
    """orbax's standard step names (``checkpoints/STEP``), listing only the step
    directories that are safe to read.

    orbax reads each listed step's ``_CHECKPOINT_METADATA`` as it lists them, so a named
    pipe there would hang every Checkpointer: :meth:`find_all` leaves out of orbax's sight
    each step directory that :func:`~jaxmp.train.integrity.damage` finds fault with, and keeps it in
    :attr:`refused` (``{step: why}``) for :meth:`Checkpointer.restore` to report and set
    aside. A step deleted while it is listed (a trainer's rotation) is left out, and the
    steps are listed again: the newer step that replaced it, still a temporary directory
    when the steps were first listed, is complete by then.
    """

    def __init__(self):
        self._standard = ocp.step.standard_name_format()
        self.refused: dict = {}

    def build_name(self, step: int) -> str:
        return self._standard.build_name(step)

    def find_all(self, base_path):
        for _ in range(READER_ATTEMPTS):
            found, refused, vanished = [], {}, False
            for metadata in self._standard.find_all(base_path):
                try:
                    why = damage(pathlib.Path(str(metadata.path)))
                except FileNotFoundError:  # being deleted
                    vanished = True
                    continue
                except OSError as e:
                    why = f"its directory cannot be listed ({e.strerror or e})"
                if why is None:
                    found.append(metadata)
                else:
                    refused[metadata.step] = why
            if not vanished:
                break
        self.refused = refused
        return iter(found)

    def find_step(self, base_path, step: int):
        """The step's directory; :class:`StepGone` when there is none. (orbax, without a
        name format of the caller's, only builds the path: a step deleted after it was
        listed then fails as a missing file, which the callers retry on.)"""
        path = ocp.step.build_step_path(base_path, self, step)
        if not path.exists():
            raise StepGone(f"checkpoint step {step} is not in {base_path}")
        return ocp.step.Metadata(step=step, path=path)


class StepGone(FileNotFoundError, ValueError):
    """No directory for a step: a missing file to the readers that list the steps again
    on one, a ValueError to orbax's deleter, as orbax's ``find_step`` raises."""


def handler_registry():
    """orbax's handlers for a checkpoint's four items: ``state`` (the arrays,
    :class:`StateHandler`) and three JSON items (``data``, ``config``, ``verify``)."""
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    state = StateHandler()
    registry.add("state", ocp.args.StandardSave, state)
    registry.add("state", ocp.args.StandardRestore, state)
    for name in ("data", "config", "verify"):
        handler = ocp.JsonCheckpointHandler()
        registry.add(name, ocp.args.JsonSave, handler)
        registry.add(name, ocp.args.JsonRestore, handler)
    return registry


class StateHandler(ocp.StandardCheckpointHandler):
    """orbax's ``StandardCheckpointHandler``; on the CPU backend its arrays are written
    without replica parallelism.

    orbax splits the write of a replicated array among its replicas
    (``ArrayHandler(use_replica_parallel=...)``), by default everywhere but where
    ``JAX_PLATFORMS`` names a GPU. On CPU devices, which share one host's memory and disk,
    that only adds a slicing program per array and shard: a dp save of tiny_moe on 8 CPU
    devices took 6.8 CPU-seconds the first time with it and 3.0 without (0.8 and 0.5 after).
    The files are the same format; only who writes which bytes differs. Elsewhere this is
    orbax's handler unchanged.
    """

    def __init__(self):
        super().__init__()
        if jax.default_backend() == "cpu" and hasattr(self, "_impl"):
            th = ocp.type_handlers
            scalar = th.ScalarHandler()
            arrays = th.ArrayHandler(use_replica_parallel=False, array_metadata_store=getattr(
                th.get_type_handler(jax.Array), "_array_metadata_store", None))
            self._impl = ocp.PyTreeCheckpointHandler(
                type_handler_registry=th.create_type_handler_registry(
                    (int, scalar), (float, scalar), (bytes, scalar), (np.number, scalar),
                    (np.ndarray, th.NumpyHandler()), (jax.Array, arrays),
                    (str, th.StringHandler())))


# Attempts of a read-only Checkpointer to list the steps while a live trainer changes them
# (each attempt lists them once; a trainer removes or completes one step per save).
READER_ATTEMPTS = 5
# Attempts to read the newest checkpoint while a trainer's rotation deletes the ones being
# read (train.checkpoint_every=1 with train.keep_checkpoints=1 deletes each step one save
# after it is complete): each attempt lists the steps again and reads the newest.
ROTATION_ATTEMPTS = 10
