"""The compile target: the devices a program is built for, which need not be this host's.

A model chooses some paths and kernels by the hardware it will run on
(``model.attention="auto"`` picks cuDNN's fused attention on an NVIDIA GPU,
``model.moe_kernel="auto"`` the Mosaic GPU grouped GEMM on Hopper and newer). That
hardware is the one the program is *compiled for*: the mesh's devices. For a deviceless
compile (XLA's GPU compiler run on a CPU host through JAX's CUDA plugin,
``jax.experimental.topologies.get_topology_desc``; :mod:`jaxmp.analysis.gpu`) those are
topology devices (platform ``"gpu"``, ``compute_capability`` ``"9.0"`` for an H200) while
``jax.devices()`` is still the CPU. :func:`compiling_for` sets the target for the code
that builds and traces a model (``Experiment.create`` enters it with its mesh); outside
it, :func:`current` is this host's first device.

Below :mod:`jaxmp.precision` and :mod:`jaxmp.models` in the layering: it imports only jax.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
import threading
from typing import Any, Iterator, Optional, Tuple

import jax

__all__ = ["Target", "of_device", "current", "compiling_for"]


@dataclasses.dataclass(frozen=True)
class Target:
    """What a path or kernel choice needs to know about the device compiled for.

    Attributes:
      platform: ``"cpu"``, ``"gpu"``, ``"tpu"`` (``jax.Device.platform``).
      device_kind: e.g. ``"NVIDIA H200"``, ``"cpu"``.
      compute_capability: ``(major, minor)`` of an NVIDIA GPU, else None.
      core_count: streaming multiprocessors of a GPU (``jax.Device.core_count``), else None.
      deviceless: True when no device of this platform is attached to this process: the
        program can be compiled, never run.
    """

    platform: str
    device_kind: str = ""
    compute_capability: Optional[Tuple[int, int]] = None
    core_count: Optional[int] = None
    deviceless: bool = False

    def is_nvidia(self, at_least: Tuple[int, int] = (0, 0)) -> bool:
        """An NVIDIA GPU of compute capability >= ``at_least``."""
        return self.platform == "gpu" and (self.compute_capability or (-1, 0)) >= tuple(at_least)

    def is_hopper_or_newer(self) -> bool:
        """An NVIDIA GPU of compute capability >= 9.0 (H100, H200, H800, B200...)."""
        return self.is_nvidia((9, 0))

    def is_hopper(self) -> bool:
        """An NVIDIA GPU of compute capability 9.x (H100, H200, H800, H20, GH200): the
        only one with WGMMA (sm_90a; Blackwell's sm_100 has tcgen05 instead)."""
        return self.is_nvidia((9, 0)) and self.compute_capability[0] == 9

    def describe(self) -> str:
        """One line for error messages: ``"gpu NVIDIA H200 (sm 9.0)"``, ``"cpu"``."""
        cc = self.compute_capability
        sm = f" (sm {cc[0]}.{cc[1]})" if cc else ""
        kind = (f" {self.device_kind}" if self.device_kind
                and self.device_kind != self.platform else "")
        return f"{self.platform}{kind}{sm}"


def _attached(platform: str) -> bool:
    try:
        return bool(jax.devices(platform))
    except RuntimeError:  # "Unknown backend": no such platform in this process
        return False


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
    platform = str(device.platform)
    return Target(platform=platform, device_kind=str(getattr(device, "device_kind", "")),
                  compute_capability=parsed, core_count=int(cores) if cores else None,
                  deviceless=platform != jax.default_backend() and not _attached(platform))


# NVIDIA device kinds of compute capability 9.0, for an abstract device (which carries none).
_HOPPER_KINDS = re.compile(r"\bG?H(100|200|800|20)\b")


def _of_abstract(device: Any) -> Target:
    """The :class:`Target` of the abstract device of a mesh (``jax.set_mesh``).

    An abstract device has a platform, a device kind and a core count but no compute
    capability: that comes from an attached device of the same kind where there is one,
    else, for an NVIDIA GPU, from the device kind's name (H100, H200, H800, H20, GH200:
    9.0; other names: unknown).
    """
    platform, kind = str(device.platform), str(getattr(device, "device_kind", ""))
    try:
        local = [d for d in jax.devices(platform) if d.device_kind == kind]
    except RuntimeError:  # no such platform in this process
        local = []
    if local:
        return of_device(local[0])
    cc = (9, 0) if platform == "gpu" and _HOPPER_KINDS.search(kind) else None
    cores = getattr(device, "num_cores", None)
    return Target(platform=platform, device_kind=kind, compute_capability=cc,
                  core_count=int(cores) if cores else None, deviceless=True)


_CONTEXT = threading.local()


def current() -> Target:
    """The target set by the innermost :func:`compiling_for`; else the abstract device of
    the mesh set by ``jax.set_mesh`` (a program traced under it is built for that mesh's
    devices); else this host's first device."""
    stack = getattr(_CONTEXT, "stack", None)
    if stack:
        return stack[-1]
    device = jax.sharding.get_abstract_mesh().abstract_device
    if device is not None:
        return _of_abstract(device)
    return of_device(jax.devices()[0])


@contextlib.contextmanager
def compiling_for(target: Any) -> Iterator[Target]:
    """Within the context, :func:`current` is ``target``.

    For a deviceless NVIDIA target, JAX's cuDNN attention checks, which read the host's
    backend (``jax._src.cudnn.fused_attention_stablehlo``: ``check_cudnn_version``,
    ``check_compute_capability``, ``is_cuda_compute_capability_equal``; there is no public
    hook), answer for the target instead, so that tracing the ``"cudnn"`` path builds
    JAX's own cuDNN custom calls (cuDNN 9.8 is assumed, as in the target descriptions of
    :mod:`jaxmp.analysis.gpu`).

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
    restore = []
    if target.deviceless and target.is_nvidia():
        from jax._src.cudnn import fused_attention_stablehlo as fused

        def at_least(capability: str) -> bool:
            return target.compute_capability >= tuple(int(x) for x in capability.split("."))

        def equal(capability: str) -> bool:
            return target.compute_capability == tuple(int(x) for x in capability.split("."))

        for name, fn in (("check_cudnn_version", lambda: 90800),
                         ("check_compute_capability", at_least),
                         ("is_cuda_compute_capability_equal", equal)):
            restore.append((fused, name, getattr(fused, name)))
            setattr(fused, name, fn)
    try:
        yield target
    finally:
        stack.pop()
        for module, name, fn in restore:
            setattr(module, name, fn)
