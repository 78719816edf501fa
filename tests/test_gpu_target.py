"""Deviceless GPU compilation (jaxmp.analysis.gpu, python -m jaxmp.report --target): the
trainer's own step compiled by XLA's GPU compiler for H200/H100 targets on this CPU
machine. The FLOP counter is checked against hand counts first; the compiled programs
against the bounds of the issue (memory, kernels, collectives' dtypes, FLOP ratio).

Skips, with the reason, where JAX's CUDA plugin (the ``gpu`` extra) is absent.
"""
import collections
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import _compiled
from _configs import load_config
from jaxmp.analysis import gpu, hlo

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROBLEM = gpu.plugin_problem()
needs_plugin = pytest.mark.skipif(PROBLEM is not None, reason=f"deviceless GPU compile: {PROBLEM}")
GB = 1e9


XDIST_PER_TEST = True  # test by test over both workers, but the marked groups (tests/conftest.py)


def _compile_fn(fn, *shapes, devices=1, name="H200"):
    mesh = gpu.target_mesh(gpu.get_target(name), devices)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=rep) for s in shapes]
    return jax.jit(fn).lower(*args).compile().as_text()


def test_targets_carry_the_datasheet_figures_and_bad_names_are_one_line_errors(tmp_path):
    h200, h100, h800, a100 = (gpu.get_target(n) for n in ("H200", "h100", "H800", "A100"))
    assert h200.memory_bytes == 150_754_820_096 and h200.hbm_bytes_per_s == 4.8e12
    assert h100.hbm_bytes_per_s == 3.35232e12 and h100.memory_bytes < h200.memory_bytes
    assert h800.nvlink_bytes_per_s == 200e9 < h100.nvlink_bytes_per_s == 450e9
    assert a100.peak_flops("bf16") == pytest.approx(312e12)
    assert h200.peak_flops("f8e4m3fn") == pytest.approx(1978.9e12)
    assert h200.peak_flops("f32") == pytest.approx(494.7e12)  # TF32 tensor cores
    assert h200.peak_flops("f32", highest=True) == pytest.approx(66.9e12)
    with pytest.raises(ValueError, match=r"--target 'B300': allowed: H100, H200, H800, A100, or "):
        gpu.get_target("B300")
    with pytest.raises(ValueError, match=r"cannot read the target description"):
        gpu.get_target(str(tmp_path / "none.pbtxt"))
    no_runtime = tmp_path / "mine.pbtxt"
    no_runtime.write_text(h200.proto.split("runtime_version")[0])
    with pytest.raises(ValueError, match=r"no runtime_version, without which XLA rewrites no FP8"):
        gpu.get_target(str(no_runtime))
    own = tmp_path / "own.pbtxt"
    own.write_text(h200.proto)
    assert gpu.get_target(str(own)).memory_bytes == h200.memory_bytes


# One layer's weight sliced out of a scanned stack inside a fusion, through bitcasts (the
# shape of XLA's per-layer weight quantization in a scanned FP8 step).
_SLICED_HLO = """HloModule m

%fused_q (param_0: f32[16,64,32], param_1: s32[]) -> f8e4m3fn[64,32] {
  %param_0 = f32[16,64,32]{2,1,0} parameter(0)
  %bitcast.1 = f32[16,2048]{1,0} bitcast(%param_0)
  %param_1 = s32[] parameter(1)
  %c0 = s32[] constant(0)
  %dynamic-slice.1 = f32[1,2048]{1,0} dynamic-slice(%bitcast.1, %param_1, %c0), \
dynamic_slice_sizes={1,2048}
  %bitcast.2 = f32[64,32]{1,0} bitcast(%dynamic-slice.1)
  ROOT %convert.1 = f8e4m3fn[64,32]{1,0} convert(%bitcast.2)
}

ENTRY %main (p0: f32[16,64,32], p1: s32[]) -> f8e4m3fn[64,32] {
  %p0 = f32[16,64,32]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  ROOT %fusion = f8e4m3fn[64,32]{1,0} fusion(%p0, %p1), kind=kLoop, calls=%fused_q
}
"""


def test_fusion_bytes_count_a_slice_read_through_bitcasts_at_the_slice():
    """A fusion that reads one [1, 2048] float32 slice of a [16, 64, 32] operand (bitcast,
    dynamic-slice, bitcast) moves 2048 x 4 bytes of it, not the whole 16 x 2048 x 4; plus
    the int32 index (4) and the [64, 32] E4M3 result (2048)."""
    (k,) = hlo.hlo_kernels(_SLICED_HLO)
    assert (k.kind, k.bytes) == ("fusion", 2048 * 4 + 4 + 64 * 32)


@needs_plugin
def test_flop_counter_against_hand_counts_for_two_matmuls_and_a_scan():
    m, k, n, p = 256, 512, 128, 64

    def two(a, b, c):
        return (a @ b) @ c

    kernels = hlo.hlo_kernels(_compile_fn(two, (m, k), (k, n), (n, p)))
    flops = sum(x.flops * x.runs for x in kernels if x.kind == "gemm")
    assert flops == 2 * m * k * n + 2 * m * n * p

    layers = 5

    def scanned(x, w):
        def body(h, _):
            return jnp.tanh(h @ w), None
        return jax.lax.scan(body, x, None, length=layers)[0]

    kernels = hlo.hlo_kernels(_compile_fn(scanned, (m, k), (k, k)))
    gemms = [x for x in kernels if x.kind == "gemm"]
    assert sum(x.flops * x.runs for x in gemms) == layers * 2 * m * k * k
    assert all(x.runs == layers for x in gemms)  # inside the loop: its trip count


@pytest.fixture(scope="module")
def seed_dp():
    if PROBLEM:
        pytest.skip(f"deviceless GPU compile: {PROBLEM}")
    config = load_config("seed_moe", ["--config.model.remat=full"])
    return gpu.gpu_report(config, gpu.get_target("H200"), 8)


@needs_plugin
@pytest.mark.xdist_group("gpu_seed")
def test_seed_config_fits_an_h200_with_cudnn_attention_forward_and_backward(seed_dp):
    mem = seed_dp["memory"]
    assert seed_dp["setup"]["attention_path"] == "cudnn"
    assert mem["total_bytes"] <= 120 * GB and mem["fits"]
    assert mem["total_bytes"] == (mem["argument_bytes"] + mem["output_bytes"] - mem["alias_bytes"]
                                  + mem["temp_bytes"])
    assert seed_dp["kernels"]["cudnn_attention_fwd"]["launches"] >= 24  # 24 layers
    assert seed_dp["kernels"]["cudnn_attention_bwd"]["launches"] == 24
    # The state is replicated under dp: the float32 master weights, gradients' buffers and
    # two Adam moments of every parameter are arguments (12 B/param plus the bf16 copy-free
    # step's small leaves).
    assert mem["argument_bytes"] >= 12 * seed_dp["setup"]["params"]
    assert len(seed_dp["largest_buffers"]) == 10
    sizes = [b["bytes"] for b in seed_dp["largest_buffers"]]
    assert sizes == sorted(sizes, reverse=True)


@needs_plugin
@pytest.mark.xdist_group("gpu_seed")
@pytest.mark.parametrize("name", ["H100"])  # one compile: the H200's memory is the larger
def test_fsdp_honours_remat_and_fits_an_h100(seed_dp, name):
    config = load_config("seed_moe", ["--config.model.remat=full",
                                         "--config.parallel.strategy=fsdp"])
    report = gpu.gpu_report(config, gpu.get_target(name), 8, top=0)
    total = report["memory"]["total_bytes"]
    assert total <= 0.6 * seed_dp["memory"]["total_bytes"]
    assert report["memory"]["fits"] and total <= 0.9 * gpu.get_target("H100").memory_bytes
    # The master weights and moments are split 8 ways: 12 B/param / 8 plus the router biases.
    assert report["memory"]["argument_bytes"] < 2 * report["setup"]["params"]
    # The routed experts (float16) run as the Mosaic grouped GEMM under FSDP, scanned layers
    # and remat=full (moe_kernel=auto on Hopper): forward, dx, dw of 3 weights, and the
    # forward again where the backward recomputes the block.
    assert report["kernels"]["mosaic_gpu"]["sites"] >= 9


@pytest.fixture(scope="module")
def dense_bf16():
    """dense_1b under mixed_bf16 on one H200: the compile tests/test_fp8_kernel.py's
    dense_1b step test compares fp8_blockwise with (tests/_compiled.py shares it)."""
    if PROBLEM:
        pytest.skip(f"deviceless GPU compile: {PROBLEM}")
    return _compiled.gpu_report("dense_1b", ("--config.precision.policy=mixed_bf16",))


@needs_plugin
@pytest.mark.xdist_group("gpu_dense_1b")
def test_dense_gemm_flops_are_six_n_d(dense_bf16):
    setup, flops = dense_bf16["setup"], dense_bf16["flops"]
    tokens = setup["tokens_per_device"]
    assert flops["model_6nd"] == 6 * setup["active_params"] * tokens
    assert 0.85 <= flops["gemm_ratio"] <= 1.1
    r = dense_bf16["roofline"]
    assert r["bound_s"] == pytest.approx(r["gemm_s"] + r["attention_s"] + r["memory_s"] + r["collective_s"])
    # A lower bound: no faster than every GEMM FLOP at the dense bf16 peak.
    assert r["bound_s"] >= flops["gemm"] / 989.4e12
    assert 0 < r["mfu_bound"] <= 1


@needs_plugin
# fp8_blockwise: tests/test_fp8_kernel.py compiles the whole dense_1b step and checks the same.
@pytest.mark.parametrize("policy", ["fp8_tensorwise", "fp8_delayed", "fp8_rowwise"])
def test_every_layer_body_matmul_is_an_fp8_gemm(policy):
    # dense_1b's widths, 2 layers and one sequence: the same layer body, a faster compile.
    config = load_config("dense_1b", [f"--config.precision.policy={policy}",
                                         "--config.model.num_layers=2", "--config.train.batch_size=1"])
    step = gpu.compile_step(config, gpu.get_target("H200"), 1)
    kinds = collections.Counter(
        "fp8" if k.kind == "fp8_gemm" or (k.kind == "mosaic_gpu" and k.gemm_dtype.startswith("f8"))
        else k.kind for k in hlo.hlo_kernels(step.hlo_text)
        if "/while/body/" in k.op_name and k.kind in ("gemm", "fp8_gemm", "mosaic_gpu")
        and (k.kind != "mosaic_gpu" or k.flops))
    # q, k, v, o, gate, up, down at least forward (XLA may merge a few dx/dw GEMMs of one
    # input into one), and no GEMM of the layer body outside FP8: cuBLASLt/Triton FP8
    # GEMMs, or (blockwise on Hopper) the Mosaic GPU kernel with E4M3 operands (the
    # blockwise backward's Mosaic quantization kernels do no GEMM FLOPs: not counted).
    assert kinds["fp8"] >= 7 and kinds["gemm"] == 0 and kinds["mosaic_gpu"] == 0, kinds


def _tiny(overrides, devices=8):
    config = load_config("tiny_moe", ["--config.precision.policy=mixed_bf16",
                                         "--config.precision.grad_reduce_dtype=bfloat16"] + overrides)
    return gpu.gpu_report(config, gpu.get_target("H200"), devices, top=0)["collectives"]


@needs_plugin
@pytest.mark.parametrize("strategy, expert", [("zero1", 2), ("fsdp", 1)], ids=["zero1", "fsdp"])
def test_sharded_strategies_reduce_scatter_and_all_gather_in_bf16(strategy, expert):
    """Gradients reduce-scattered and weights all-gathered in bfloat16 (the policy's
    grad_reduce_dtype). The ZeRO-1 compile is also expert-parallel (2-way, capacity
    dispatch): its tokens travel by all-to-all in the dispatch dtype, bfloat16, and by
    nothing wider (one compile for both; before 2026-12-04 a dp compile of its own)."""
    overrides = [f"--config.parallel.strategy={strategy}"]
    if expert > 1:
        overrides += [f"--config.parallel.expert={expert}", "--config.model.capacity_factor=1.25"]
    colls = _tiny(overrides)
    assert colls["reduce-scatter"].get("bf16", 0) > 0 and set(colls["reduce-scatter"]) == {"bf16"}
    assert colls["all-gather"].get("bf16", 0) > 0
    if expert > 1:
        assert set(colls["all-to-all"]) == {"bf16"}
    else:
        assert "all-to-all" not in colls


@needs_plugin
def test_report_cli_target_json(tmp_path):
    out = tmp_path / "r.json"
    env = dict(os.environ)
    env.pop("JAX_PLATFORMS", None)  # the report itself chooses the CPU platform for --target
    proc = subprocess.run([sys.executable, "-m", "jaxmp.report", "--config", "configs/tiny_moe.py",
                           "--target", "H100", "--devices", "2", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1800, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["target"]["name"] == "H100" and report["setup"]["devices"] == 2
    assert "roofline bound" in proc.stdout and "fits" in proc.stdout
    assert "cuInit" not in proc.stderr  # the plugin is not asked for a GPU
