"""Deviceless compilation for an H200 in tests: a stand-in until jaxmp.analysis.gpu lands.

XLA's GPU compiler runs without a GPU when JAX's CUDA plugin is installed (the ``gpu``
extra) and ``JAX_PLATFORMS=cpu`` (tests/conftest.py): ``get_topology_desc`` with a
``GpuTargetConfigProto`` gives GPU devices to build a mesh on (recipe:
/work/shared/gpu-targets/README.md). Tests that need it call :func:`h200_mesh`, which
skips with a one-line reason where the plugin or the target description is absent.
"""
from __future__ import annotations

import contextlib
import re
from pathlib import Path

import jax
import numpy as np
import pytest

_TARGETS = [Path(__file__).resolve().parents[1] / "jaxmp" / "targets" / "h200.pbtxt",
            Path("/work/shared/gpu-targets/h200.pbtxt")]


def h200_mesh(devices: int = 1, axis: str = "data") -> jax.sharding.Mesh:
    """A mesh of ``devices`` H200 topology devices, or ``pytest.skip`` with the reason."""
    path = next((p for p in _TARGETS if p.exists()), None)
    if path is None:
        pytest.skip("no H200 GpuTargetConfigProto (jaxmp/targets/h200.pbtxt) to compile for")
    try:
        from jax.experimental import topologies
        topo = topologies.get_topology_desc(platform="cuda", topology=f"1x1x{devices}",
                                            target_config=path.read_text())
    except Exception as e:  # the plugin is absent or refuses: not this test's failure
        pytest.skip(f"no deviceless CUDA compile here (install jaxmp[gpu]): "
                    f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
    return jax.sharding.Mesh(np.array(topo.devices[:devices]), (axis,))


@contextlib.contextmanager
def optimized():
    """XLA's normal optimizations (tests/conftest.py turns most off), so the GPU compiler
    rewrites FP8 dots into cuBLASLt FP8 GEMMs as it does in a real run."""
    old = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", old)


def kernel_calls(hlo: str) -> dict:
    """Custom calls of optimized GPU HLO text by target: ``{"__cublas$lt$matmul$f8": 3, ...}``."""
    out: dict = {}
    for target in re.findall(r'custom_call_target="([^"]+)"', hlo):
        out[target] = out.get(target, 0) + 1
    return out


FP8_GEMM = "__cublas$lt$matmul$f8"
MOSAIC = "mosaic_gpu"
_HEADER = re.compile(r"^\s*%?([\w.\-]+) \((.*)\) -> .* \{$")
_FUSION = re.compile(r" fusion\(.*kind=kCustom, calls=%?(gemm_fusion[\w.\-]+)")


def fp8_gemms(hlo: str) -> int:
    """FP8 GEMMs in optimized GPU HLO: cuBLASLt FP8 calls plus Triton GEMM fusions whose
    computation takes an f8 operand (XLA picks Triton for small shapes, without autotuning)."""
    f8_computations = {m.group(1) for m in map(_HEADER.match, hlo.splitlines())
                       if m and "f8e" in m.group(2)}
    triton = sum(1 for m in map(_FUSION.search, hlo.splitlines())
                 if m and m.group(1) in f8_computations)
    return kernel_calls(hlo).get(FP8_GEMM, 0) + triton


def mosaic_calls(calls: dict) -> int:
    return sum(v for k, v in calls.items() if MOSAIC in k)
