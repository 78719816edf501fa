"""The compile target: the kind of device a program is built for, which may not be this host's.

A program is compiled for the devices of its mesh. With JAX's CUDA plugin installed, those
can be the devices of a GPU topology description (``jax.experimental.topologies``) on a
machine that has no GPU: XLA's GPU compiler runs all the same (a *deviceless* compile,
:mod:`jaxmp.analysis.gpu`). Choices that depend on the hardware (``model.attention="auto"``,
kernels) read :func:`current`, which is the host's default device unless
:func:`compiling_for` names other devices; :class:`~jaxmp.train.experiment.Experiment`
enters it for its mesh's devices while it builds the model.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Iterator, Optional, Tuple

import jax

__all__ = ["CompileTarget", "of_device", "current", "compiling_for"]


@dataclasses.dataclass(frozen=True)
class CompileTarget:
    """What a program is compiled for.

    Attributes:
      platform: ``"cpu"``, ``"gpu"`` or ``"tpu"`` (``jax.Device.platform``).
      device_kind: e.g. ``"NVIDIA H200"``, ``"cpu"``.
      compute_capability: ``(major, minor)`` of an NVIDIA GPU, else None.
      deviceless: True when no device of this platform is attached to this process:
        the program can be compiled, never run.
    """

    platform: str
    device_kind: str
    compute_capability: Optional[Tuple[int, int]] = None
    deviceless: bool = False

    def is_nvidia(self, at_least: Tuple[int, int] = (0, 0)) -> bool:
        """An NVIDIA GPU of compute capability >= ``at_least`` (9.0 is Hopper)."""
        return (self.platform == "gpu" and self.compute_capability is not None
                and self.compute_capability >= tuple(at_least))


def _attached(platform: str) -> bool:
    try:
        return bool(jax.devices(platform))
    except RuntimeError:  # "Unknown backend" / no such platform in this process
        return False


def of_device(device: Any) -> CompileTarget:
    """The :class:`CompileTarget` of one ``jax.Device`` (attached or from a topology)."""
    cc = getattr(device, "compute_capability", None)
    capability = tuple(int(x) for x in str(cc).split(".")[:2]) if cc else None
    platform = str(device.platform)
    return CompileTarget(platform, str(device.device_kind), capability,
                         deviceless=platform != jax.default_backend() and not _attached(platform))


_STATE = threading.local()


def current() -> CompileTarget:
    """The target in force: the innermost :func:`compiling_for`, else ``jax.devices()[0]``."""
    target = getattr(_STATE, "value", None)
    return target if target is not None else of_device(jax.devices()[0])


@contextlib.contextmanager
def compiling_for(device: Any) -> Iterator[CompileTarget]:
    """Within this context :func:`current` is ``device``'s target (a ``jax.Device`` or a
    :class:`CompileTarget`).

    For a deviceless NVIDIA target, JAX's cuDNN attention checks, which read the host's
    backend (``jax._src.cudnn.fused_attention_stablehlo``: ``check_cudnn_version``,
    ``check_compute_capability``, ``is_cuda_compute_capability_equal``), answer for the
    target instead, so that tracing the ``"cudnn"`` path builds JAX's own cuDNN custom
    calls (cuDNN 9.8 is assumed, as in the target descriptions of
    :mod:`jaxmp.analysis.gpu`).
    """
    target = device if isinstance(device, CompileTarget) else of_device(device)
    previous = getattr(_STATE, "value", None)
    _STATE.value = target
    restore = []
    if target.deviceless and target.is_nvidia():
        from jax._src.cudnn import fused_attention_stablehlo as fused  # no public hook

        def at_least(capability: str) -> bool:
            return target.compute_capability >= tuple(int(x) for x in capability.split("."))

        def equal(capability: str) -> bool:
            return target.compute_capability == tuple(int(x) for x in capability.split("."))

        for name, fn in (("check_cudnn_version", lambda: 90800),
                         ("check_compute_capability", at_least),
                         ("is_cuda_compute_capability_equal", equal)):
            restore.append((name, getattr(fused, name)))
            setattr(fused, name, fn)
    try:
        yield target
    finally:
        _STATE.value = previous
        if restore:
            from jax._src.cudnn import fused_attention_stablehlo as fused
            for name, fn in restore:
                setattr(fused, name, fn)
