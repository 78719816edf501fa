"""How a training run stops: SIGINT and SIGTERM caught for the duration of a call, the
:class:`Interrupted` they end in, and the step compiled in a background thread that a
signal may leave behind.

SIGINT (Ctrl-C) and SIGTERM (a preempted job) stop the loop after the current step
(:class:`SignalCatcher`); a second signal stops at once: ``KeyboardInterrupt`` in a
library call, or an exit with ``128 + signum`` where the command-line entry point asks for
it. The handlers are installed for the call and the previous ones put back after it.
"""
from __future__ import annotations

import os
import pathlib
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any, Dict, Optional

from jax.experimental import multihost_utils

if TYPE_CHECKING:  # the step it compiles is the experiment's
    from jaxmp.train.experiment import Experiment

__all__ = ["Interrupted", "SignalCatcher", "Compilation", "compile_in_progress"]

_COMPILE_THREAD = "jaxmp-compile"


def compile_in_progress() -> bool:
    """True while a train step of :func:`train_and_evaluate` still compiles in its
    background thread (left behind by a signal during start-up)."""
    return any(t.name == _COMPILE_THREAD and t.is_alive() for t in threading.enumerate())


class Interrupted(Exception):
    """Training stopped on SIGINT or SIGTERM.

    Attributes:
      signum: the signal.
      step: the step reached.
      saved: True when a checkpoint at ``step`` was written.
      directory: the checkpoint directory.
      startup: the signal came before training began (reading the data, compiling).
    """

    def __init__(self, signum: int, step: int, saved: bool, directory: pathlib.Path,
                 startup: bool = False):
        self.signum, self.step, self.saved, self.directory = signum, step, saved, directory
        self.startup = startup
        name = signal.Signals(signum).name
        if startup:
            resumable = directory.is_dir() and any(p.name.isdigit() for p in directory.iterdir())
            what = (f"{name} during start-up: stopped before training; nothing was trained or "
                    "saved in this run; rerun the same command to "
                    f"{'resume' if resumable else 'start'}")
        elif saved:
            what = (f"{name} at step {step}: checkpoint saved in {directory}; rerun the same "
                    "command to resume")
        else:
            what = (f"{name} before the first step finished: nothing was trained or saved in this "
                    f"run; rerun the same command to {'resume' if step else 'start'}")
        super().__init__(what)


class StartupSignal(BaseException):
    """Raised by :class:`SignalCatcher`'s handler in the main thread when a signal comes
    while ``reading`` is set (the trainer reading its data: nothing trained, nothing to
    save), so that the read stops at once; a ``BaseException``, as ``KeyboardInterrupt``,
    so that no ``except Exception`` of the code it interrupts takes it."""


class SignalCatcher:
    """Turns SIGINT/SIGTERM into a flag the loop polls; a second signal stops at once:
    ``KeyboardInterrupt`` in a library call (a notebook's kernel survives a double
    Ctrl-C), or with ``exit_on_second`` (train.py, the command-line entry point) the
    process exits with ``128 + signum``. The handlers are installed on entering and the
    previous ones put back on leaving.

    Once ``training`` is set (the loop runs), the first signal says that a checkpoint
    will be saved; before, it says nothing here: :class:`Interrupted` says what happened.
    While ``reading`` is set, the first signal also raises :class:`StartupSignal` where
    the main thread is, so that a long read of the data stops at once.

    With ``sync`` (a multi-process run with JAX's preemption sync manager,
    :func:`jaxmp.train.distributed.preemption_sync`), SIGTERM is left to JAX's own handler
    and SIGINT is passed on to it (as a SIGTERM to this process): :meth:`stop` is then
    :func:`jax.experimental.multihost_utils.reached_preemption_sync_point`, the step at
    which every process stops, so that all save the same step (a process stopping on its
    own would wait for the others in its checkpoint's collectives for ever).
    """

    def __init__(self, sync: bool = False, exit_on_second: bool = False):
        self.signum: Optional[int] = None
        self.training = False
        self.reading = False  # start-up work a signal cuts short (StartupSignal)
        self.sync = sync
        self.exit_on_second = exit_on_second
        self._stopped = False
        self._previous = {}
        self._leaving: list = []  # signals that came while the handlers were put back

    def stop(self, step: int) -> bool:
        """Whether the loop stops after ``step`` (every process agrees under ``sync``)."""
        if not self.sync:
            return self.signum is not None
        if not self._stopped and multihost_utils.reached_preemption_sync_point(step):
            self._stopped = True
            if self.signum is None:  # the notice came to another process (or to JAX's handler)
                self.signum = signal.SIGTERM
                sys.stderr.write(f"\nSIGTERM (a preemption notice) at step {step}: every process "
                                 "stops at this step and saves a checkpoint\n")
                sys.stderr.flush()
        return self._stopped

    def _handle(self, signum, frame):
        if self._leaving:  # __exit__ is putting the caller's handlers back: theirs, after
            self._leaving.append(signum)
            return
        if self.signum is not None:  # the second one: stop now, as the user asked twice
            name = signal.Signals(signum).name
            if self.exit_on_second:  # the command-line trainer: nothing of the caller's to keep
                sys.stderr.write(f"\n{name} again: exiting at once\n")
                sys.stderr.flush()
                os._exit(128 + signum)
            sys.stderr.write(f"\n{name} again: stopping at once (KeyboardInterrupt); the "
                             f"complete checkpoints are kept\n")
            sys.stderr.flush()
            raise KeyboardInterrupt
        self.signum = signum
        if self.sync:  # to JAX's preemption notifier: every process stops at one step
            os.kill(os.getpid(), signal.SIGTERM)
        if self.reading:  # reading the data (a slow chat template, a large corpus): stop now
            raise StartupSignal(signum)
        if self.training:
            sys.stderr.write(f"\n{signal.Signals(signum).name}: stopping after this step and "
                             "saving a checkpoint (send it again to exit at once)\n")
            sys.stderr.flush()

    def __enter__(self):
        if self._previous:
            raise RuntimeError("a SignalCatcher is entered once at a time")
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT,) if self.sync else (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        """Puts every previous handler back, whatever signal comes meanwhile: one that
        does is delivered again once they are back, to the caller's handler."""
        self._leaving.append(None)
        try:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
        finally:
            came = [s for s in self._leaving if s is not None]
            self._previous, self._leaving = {}, []
            for sig in came:
                signal.raise_signal(sig)


class Compilation:
    """Compiles the train step in a worker thread while the main thread reads the data,
    and so that a signal during the compilation is seen at once."""

    def __init__(self, exp: "Experiment"):
        self.result: Dict[str, Any] = {}

        def work():
            try:
                self.result["step"] = exp.train_step.lower(exp.abstract_state,
                                                           exp.abstract_batch()).compile()
            except BaseException as e:  # re-raised in the main thread
                self.result["error"] = e

        self.worker = threading.Thread(target=work, name=_COMPILE_THREAD, daemon=True)
        self.worker.start()

    def finish(self, catcher: "SignalCatcher") -> None:
        """Waits for the worker (its result is dropped), unless a signal came: then it
        is left to finish on its own (see :func:`compile_in_progress`)."""
        while self.worker.is_alive() and catcher.signum is None:
            self.worker.join(0.1)

    def join(self, catcher: "SignalCatcher"):
        """The compiled step, or None when a signal came first (the compilation is then
        left to finish on its own in its daemon thread: train.py leaves without waiting
        for it, :func:`compile_in_progress`; a library caller's process keeps it until
        it ends)."""
        while self.worker.is_alive() and catcher.signum is None:
            self.worker.join(0.1)
        if catcher.signum is not None:  # also one that came as the compilation finished
            return None
        if "error" in self.result:
            raise self.result["error"]
        return self.result["step"]
