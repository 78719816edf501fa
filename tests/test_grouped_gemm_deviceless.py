"""bench_h200's train step compiled for one H200 with no GPU (jaxmp.analysis.gpu): with
``model.moe_kernel=auto`` the routed experts run as the Mosaic GPU grouped GEMM, at the
FLOPs of the tokens they route, in no more temporaries than ``ragged_dot``.

Skipped with the reason where JAX's CUDA plugin (the ``gpu`` extra) is absent.
"""
import pytest

from _configs import load_config
from jaxmp.analysis import gpu

PROBLEM = gpu.plugin_problem()
pytestmark = pytest.mark.skipif(PROBLEM is not None, reason=f"deviceless GPU compile: {PROBLEM}")


@pytest.fixture(scope="module")
def reports():
    return {kernel: gpu.gpu_report(load_config("bench_h200", [f"--config.model.moe_kernel={kernel}"]),
                                   gpu.get_target("H200"), 1, top=0)
            for kernel in ("auto", "ragged_dot")}


def test_auto_compiles_the_routed_experts_to_the_kernel(reports):
    # One MoE stack (scanned): w_gate, w_up, w_down forward + dx + dw: 9 Mosaic kernels,
    # each launched once per MoE layer (11 of bench_h200's 12 layers).
    kernels = reports["auto"]["kernels"]["mosaic_gpu"]
    assert kernels["sites"] == 9 and kernels["launches"] == 9 * 11
    assert "mosaic_gpu" not in reports["ragged_dot"]["kernels"]


def test_kernel_flops_are_the_routed_tokens_and_temporaries_no_larger(reports):
    auto, plain = reports["auto"], reports["ragged_dot"]
    # ragged_dot on the GPU computes every expert for every token (a G-fold GEMM).
    assert plain["flops"]["gemm_ratio"] > 2.5
    assert auto["flops"]["gemm_ratio"] <= 1.15
    assert auto["memory"]["temp_bytes"] <= plain["memory"]["temp_bytes"]
    assert auto["roofline"]["gemm_s"] * 2 <= plain["roofline"]["gemm_s"]
