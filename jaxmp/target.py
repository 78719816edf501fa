"""The compile target: the devices a program is built for, which need not be this host's.

A model chooses some kernels by the hardware it will run on (``model.moe_kernel="auto"``
picks the Mosaic GPU grouped GEMM on Hopper and newer). That hardware is the one the
program is *compiled for*: the mesh's devices. For a deviceless compile (XLA's GPU
compiler run on a CPU host, ``jax.experimental.topologies.get_topology_desc``) those are
topology devices (platform ``"gpu"``, ``compute_capability`` ``"9.0"`` for an H200) while
``jax.devices()`` is still the CPU. :func:`compile_for` sets the target for the code that
builds a model (``Experiment.create`` does it with its mesh's first device); outside it,
:func:`current` is this host's first device.

Below :mod:`jaxmp.precision` and :mod:`jaxmp.models` in the layering: it imports only jax.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Optional, Tuple

import jax

__all__ = ["Target", "of_device", "current", "compile_for"]


@dataclasses.dataclass(frozen=True)
class Target:
    """What a kernel choice needs to know about the device a program is compiled for.

    Attributes:
      platform: ``"cpu"``, ``"gpu"``, ``"tpu"`` (``jax.Device.platform``).
      device_kind: e.g. ``"NVIDIA H200"``, ``"cpu"``.
      compute_capability: ``(major, minor)`` of an NVIDIA GPU, else None.
      core_count: streaming multiprocessors of a GPU (``jax.Device.core_count``), else None.
    """

    platform: str
    device_kind: str = ""
    compute_capability: Optional[Tuple[int, int]] = None
    core_count: Optional[int] = None

    def is_hopper_or_newer(self) -> bool:
        """An NVIDIA GPU of compute capability >= 9.0 (H100, H200, H800, B200...)."""
        return self.platform == "gpu" and (self.compute_capability or (0, 0)) >= (9, 0)

    def describe(self) -> str:
        """One line for error messages: ``"gpu NVIDIA H200 (sm 9.0)"``, ``"cpu"``."""
        cc = self.compute_capability
        sm = f" (sm {cc[0]}.{cc[1]})" if cc else ""
        kind = f" {self.device_kind}" if self.device_kind and self.device_kind != self.platform else ""
        return f"{self.platform}{kind}{sm}"


def of_device(device: Any) -> Target:
    """The :class:`Target` of one ``jax.Device`` (a real device or a topology device)."""
    cc = getattr(device, "compute_capability", None)
    parsed = None
    if cc:
        try:
            parsed = tuple(int(v) for v in str(cc).split(".")[:2])
        except ValueError:
            parsed = None
    cores = getattr(device, "core_count", None)
    return Target(platform=str(device.platform), device_kind=str(getattr(device, "device_kind", "")),
                  compute_capability=parsed, core_count=int(cores) if cores else None)


_CONTEXT = threading.local()


def current() -> Target:
    """The target set by the innermost :func:`compile_for`, else this host's first device."""
    stack = getattr(_CONTEXT, "stack", None)
    if stack:
        return stack[-1]
    return of_device(jax.devices()[0])


@contextlib.contextmanager
def compile_for(target: Any):
    """Within the context, :func:`current` is ``target``.

    Args:
      target: a :class:`Target`, a ``jax.Device``, or a ``jax.sharding.Mesh`` (its first
        device; a mesh is one kind of device).
    """
    if isinstance(target, jax.sharding.Mesh):
        target = target.devices.flat[0]
    if not isinstance(target, Target):
        target = of_device(target)
    stack = getattr(_CONTEXT, "stack", None)
    if stack is None:
        stack = _CONTEXT.stack = []
    stack.append(target)
    try:
        yield target
    finally:
        stack.pop()
