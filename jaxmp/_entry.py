"""What the command-line entry points (``train.py``, ``python -m jaxmp.report``,
``jaxmp.sample``, ``jaxmp.export``) do to the process: JAX's platforms before it starts
its backends, XLA's log lines, and orbax's tracebacks for a failed checkpoint write
(logger filters and ``sys.unraisablehook``).

Only entry points call this module: it changes process-wide settings, which library code
leaves as it found it.
"""
from __future__ import annotations

import glob
import importlib.util
import logging
import os
import pkgutil
import sys
from typing import Callable, Optional

__all__ = ["cpu_without_a_gpu", "quiet_xla_logs", "quiet_orbax_tracebacks"]


def _only_cuda_plugins() -> bool:
    """JAX's CUDA plugin (the ``gpu`` extra, ``jax[cuda12]``) is installed, and no other
    accelerator's (another ``jax_plugins`` module, or ``libtpu``)."""
    try:
        import jax_plugins
    except ImportError:
        return False
    names = [m.name for m in pkgutil.iter_modules(jax_plugins.__path__)]
    return (any(n.startswith("xla_cuda") for n in names)
            and all(n.startswith("xla_cuda") for n in names)
            and importlib.util.find_spec("libtpu") is None)


def cpu_without_a_gpu() -> Optional[str]:
    """Selects JAX's CPU platform where the CUDA plugin is installed but there is no
    NVIDIA GPU, unless ``JAX_PLATFORMS`` says otherwise.

    Without a GPU the plugin's ``cuInit`` fails (CUDA error 303) and JAX logs the
    failure with its traceback (``Jax plugin configuration error``, ``jax._src.xla_bridge``)
    from every command, before falling back to the CPU. On the CPU platform the plugin
    still registers for deviceless GPU compiles (``jax_plugins.xla_cuda12.initialize``
    skips its device check unless CUDA is asked for). A GPU is taken to be present when
    the NVIDIA driver's device nodes exist (``/dev/nvidiactl``, ``/dev/nvidia0`` ...).
    Call before anything starts JAX's backends.

    Returns:
      ``"cpu"`` when the platform was chosen here, else None (nothing changed).
    """
    if "JAX_PLATFORMS" in os.environ or not _only_cuda_plugins():
        return None
    if os.path.exists("/dev/nvidiactl") or glob.glob("/dev/nvidia[0-9]*"):
        return None
    import jax

    if jax.config.jax_platforms:  # chosen already (e.g. jax.config.update by the caller)
        return None
    jax.config.update("jax_platforms", "cpu")
    return "cpu"


def quiet_xla_logs() -> None:
    """Hides XLA's own C++ log lines (``W1204 ... hlo_rematerialization.cc``, ``E1204 ...
    gpu_hlo_schedule.cc``) unless ``TF_CPP_MIN_LOG_LEVEL`` is set: the report states what
    they are about (the memory per device and whether it fits) in its own lines. XLA reads
    the variable at its first log line, so calling this after JAX is imported works."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


class _DropOrbaxTracebacks(logging.Filter):
    """Drops the tracebacks orbax (and asyncio, for orbax's tasks) log for a failed
    write: :class:`~jaxmp.train.Checkpointer` raises each failure as a
    :class:`~jaxmp.train.CheckpointError` with the cause in one line; and orbax's warning
    that a reader opened a directory read-only, which is what the reader asked for."""

    def filter(self, record: logging.LogRecord) -> bool:
        if f"{os.sep}orbax{os.sep}" in record.pathname and str(record.msg).startswith(
                "Given directory is read only"):
            return False
        if record.name == "asyncio":  # e.g. "Future exception was never retrieved"
            return "orbax" not in record.getMessage() and not _raised_in_orbax(record.exc_info)
        return not (record.exc_info and f"{os.sep}orbax{os.sep}" in record.pathname)


def _raised_in_orbax(exc_info) -> bool:
    """Whether an exception's traceback runs through orbax's files."""
    tb = exc_info[2] if isinstance(exc_info, tuple) and len(exc_info) == 3 else None
    while tb is not None:
        if f"{os.sep}orbax{os.sep}" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


def _closed_loop_noise(unraisable) -> bool:
    """After a failed write, tensorstore's pending callbacks find orbax's event loop
    closed and report ``RuntimeError('Event loop is closed')`` as unraisable, dozens of
    times; the failure itself is raised as a :class:`CheckpointError`."""
    tb = unraisable.exc_traceback
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return (unraisable.exc_type is RuntimeError
            and str(unraisable.exc_value) == "Event loop is closed"
            and tb is not None
            and tb.tb_frame.f_code.co_filename.endswith(os.path.join("asyncio", "base_events.py")))


def quiet_orbax_tracebacks() -> Callable[[], None]:
    """Drops orbax's tracebacks for a failed checkpoint write, process-wide; for entry points.

    Adds a :class:`_DropOrbaxTracebacks` filter to the ``absl`` logger (orbax logs through
    absl.logging) and the ``asyncio`` logger, and wraps ``sys.unraisablehook`` to drop
    tensorstore's ``RuntimeError('Event loop is closed')`` after a failed write
    (:func:`_closed_loop_noise`). :class:`~jaxmp.train.Checkpointer` raises each failure
    as a :class:`~jaxmp.train.CheckpointError` with its cause in one line, so these are
    noise; but they are process-wide settings, so library code never makes them:
    ``train.py`` and the ``python -m jaxmp.export`` / ``jaxmp.sample`` commands call this
    once at start.

    Returns:
      A function that removes the two filters and puts back the ``sys.unraisablehook``
      found, if the hook is still the one installed here.
    """
    loggers = [logging.getLogger(name) for name in ("absl", "asyncio")]
    added = _DropOrbaxTracebacks()
    for logger in loggers:
        logger.addFilter(added)
    previous = sys.unraisablehook

    def hook(unraisable):
        if not _closed_loop_noise(unraisable):
            previous(unraisable)

    sys.unraisablehook = hook

    def restore() -> None:
        for logger in loggers:
            logger.removeFilter(added)
        if sys.unraisablehook is hook:
            sys.unraisablehook = previous

    return restore
