"""What the command-line entry points (``train.py``, ``python -m jaxmp.report``,
``jaxmp.sample``, ``jaxmp.export``) do to the process before JAX starts its backends.

Only entry points call this module: it changes the process's JAX configuration, which
library code leaves as it found it.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import pkgutil
from typing import Optional

__all__ = ["cpu_without_a_gpu", "quiet_xla_logs"]


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
