"""bench_h200's train step compiled for one H200 with no GPU (jaxmp.analysis.gpu): with
``model.moe_kernel=auto`` the routed experts run as the Mosaic GPU grouped GEMM, at the
FLOPs of the tokens they route, in no more temporaries than ``ragged_dot``; under
``fp8_blockwise`` they run as the grouped blockwise FP8 kernels.

Skipped with the reason where JAX's CUDA plugin (the ``gpu`` extra) is absent.
"""
import numpy as np
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


@pytest.fixture(scope="module")
def fp8_step():
    from jaxmp.analysis import hlo

    step = gpu.compile_step(load_config("bench_h200", ["--config.precision.policy=fp8_blockwise"]),
                            gpu.get_target("H200"), 1)
    return hlo.parse_module(step.hlo_text), step


def test_fp8_blockwise_routed_experts_are_the_grouped_fp8_kernels(fp8_step):
    """Under fp8_blockwise (moe_kernel auto) the routed experts' FP8 GEMMs are Mosaic GPU
    kernels (jaxmp.precision._fp8.grouped_kernel): w_gate, w_up, w_down x (forward, dx,
    dw), once per MoE layer, each computing every routed row once, in 128-row slots:
    2 x (ceil(M / 128) + G) x 128 x 1024 x 1024 FLOPs for M = 16 x 1024 x 2 routed rows
    and G = 8 experts. No FP8 GEMM of XLA's is left: the XLA reference (kernel "xla")
    lowers the ragged_dot of each 128-slice of K to ragged_dot's masked [M, G, 128] copy
    and one FP8 GEMM [M, G * 128] x [G * 128, N] (17 FP8 GEMMs for one grouped matmul at
    these sizes, compiled the same way), so that copy goes with them; and no array is the
    size of the reference's float32 [G, M/128, K, N] weight-gradient partials (its largest
    array at these sizes). The masked copy itself cannot be told apart by shape here: the
    1x128 tiles of x, [M, K/128, 128], have its shape, as K/128 = G. Their backward
    quantizes g and the saved activation by kernel.quantize_both, told by the float32
    [M/128, N] 128x1 scales they write: g of each grouped matmul (3), and the saved
    activation once per distinct input (2: w_gate and w_up read the same x, and the
    kernel, lowered once for both call sites, is one call that XLA's CSE keeps once;
    w_down's input)."""
    from jaxmp.analysis import hlo

    module, _ = fp8_step
    kernels = hlo.hlo_kernels(module)
    m, g, d = 16 * 1024 * 2, 8, 1024
    slots = m // 128 + g

    def grouped(k):  # an operand or the result is [G, ., .] FP8 / float32 (dw)
        ins = module.by_name[k.name]
        arrays = list(module.operand_arrays(ins)) + list(ins.results)
        return any(len(a.shape) == 3 and a.shape[0] == g and a.dtype != "f32" for a in arrays) \
            or any(tuple(a.shape) == (g, d, d) and a.dtype == "f32" for a in ins.results)

    moe = [k for k in kernels if k.kind == "mosaic_gpu" and grouped(k)]
    assert len(moe) == 9 and all(k.runs == 11 for k in moe), [(k.name, k.runs) for k in moe]
    assert [k.flops for k in moe] == [2.0 * slots * 128 * d * d] * 9
    assert not [k for k in kernels if k.kind == "fp8_gemm"]
    # Their backward's quantization: kernel.quantize_both of g and of the saved activation
    # (rows=False), each writing the 128x1 scales of the sorted rows, float32 [M/128, N].
    quant = [k for k in kernels if k.kind == "mosaic_gpu" and not grouped(k)
             and any(tuple(a.shape) == (m // 128, d) and a.dtype == "f32"
                     for a in module.by_name[k.name].results)]
    assert len(quant) == 3 + 2 and all(k.runs == 11 for k in quant), \
        [(k.name, k.runs) for k in quant]
    shapes = [(a.dtype, tuple(a.shape)) for ins in module.instructions for a in ins.results]
    partials = g * (m // 128) * d * d
    assert max(int(np.prod(s)) for _, s in shapes) < partials


def test_fp8_blockwise_temporaries_are_no_larger_than_bf16s(fp8_step, reports):
    """The grouped FP8 kernels keep no float32 partials: the fp8_blockwise step's
    temporaries are no larger than the mixed_bf16 step's with the bf16 grouped GEMM."""
    _, step = fp8_step
    temp = step.compiled.memory_analysis().temp_size_in_bytes
    assert temp <= reports["auto"]["memory"]["temp_bytes"], temp
