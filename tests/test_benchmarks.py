"""benchmarks/overhead.py and benchmarks/train_step.py end to end at tiny sizes, plus their parts.

The two scripts run once each, side by side in subprocesses (one module-scoped fixture),
on a 1-layer MoE model; the tests recompute every derived number of their JSON by hand.
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmarks/ is not an installed package
    sys.path.insert(0, str(ROOT))

import jax.numpy as jnp  # noqa: E402
import jmp  # noqa: E402

from benchmarks import overhead, train_step  # noqa: E402
from benchmarks._common import random_batches  # noqa: E402
from jaxmp.precision import loss_scale as jaxmp_ls  # noqa: E402
from _xla import cpu_flags

# One MoE layer (no dense layer), 2 sequences of 16 tokens: compiles in seconds.
TINY = ["--config.model.num_layers=1", "--config.model.first_dense_layers=0",
        "--config.train.batch_size=2", "--config.data.seq_len=16"]
REPEATS = 10
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_flags(),
       # Only the arithmetic of the reports is tested here: compile fast.
       "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}


def _popen(script, *args):
    return subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=ROOT,
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc, timeout=900):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return out


# Bad flags: each script must stop before any work and write no JSON.
BAD_FLAGS = {"overhead_bad": ("overhead.py", ["--repeats", "5"], "repeats"),
             "train_step_bad": ("train_step.py", ["--precisions", "fp32,fp64"], "--precisions")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Runs the scripts side by side (2 cores): two tiny benchmarks and two bad command lines.

    Returns ``({name: (report JSON, stdout)}, {bad name: (returncode, stderr, json written)})``.
    """
    tmp = tmp_path_factory.mktemp("bench")
    bad = {name: _popen(script, *args, "--json", str(tmp / f"{name}.json"))
           for name, (script, args, _) in BAD_FLAGS.items()}
    procs = {
        "overhead": _popen("overhead.py", "--steps", "2", "--repeats", str(REPEATS), "--warmup", "0",
                           "--ring", "2", *TINY, "--config.precision.policy=mixed_fp16",
                           "--config.precision.loss_scale=dynamic:init=2**10,growth_interval=3",
                           "--json", str(tmp / "overhead.json")),
        # Without the shared expert: one SwiGLU less to compile, three times.
        "train_step": _popen("train_step.py", "--steps", "2", "--repeats", str(REPEATS), "--warmup", "0",
                             "--ring", "2", "--peak_size", "128", *TINY,
                             "--config.model.num_shared_experts=0",
                             "--json", str(tmp / "train_step.json")),
    }
    try:
        bad_out = {}
        for name, proc in bad.items():
            _, err = proc.communicate(timeout=900)
            bad_out[name] = (proc.returncode, err, (tmp / f"{name}.json").exists())
        out = {name: _finish(proc) for name, proc in procs.items()}
    finally:  # a failure or timeout must not leave the other benchmark running
        for proc in [*bad.values(), *procs.values()]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return ({name: (json.loads((tmp / f"{name}.json").read_text()), out[name]) for name in procs},
            bad_out)


def _hand_param_counts(m):
    """(total, active) of the MoE Transformer from its config, by the parameter shapes."""
    d, v, e, k = m["d_model"], m["vocab_size"], m["num_experts"], m["top_k"]
    expert = 3 * d * m["d_expert"]  # SwiGLU gate, up, down
    per_layer_common = 2 * d + 4 * d * d  # two RMSNorm scales, q/k/v/o
    dense = [per_layer_common + 3 * d * m["d_ff"] for _ in range(m["first_dense_layers"])]
    moe_common = per_layer_common + d * e + m["num_shared_experts"] * expert  # router, shared
    n_moe = m["num_layers"] - m["first_dense_layers"]
    common = 2 * v * d + d + sum(dense) + n_moe * moe_common  # embed, head, final norm
    return common + n_moe * e * expert, common + n_moe * k * expert


def test_overhead_report(runs):
    r, stdout = runs[0]["overhead"]
    for side in ("jaxmp", "baseline"):
        samples = r[f"{side}_samples_ms"]
        assert len(samples) == REPEATS and all(s > 0 and math.isfinite(s) for s in samples)
        assert r[f"{side}_ms"] == pytest.approx(float(np.median(samples)), rel=1e-12)
        assert r["compile_s"][side] > 0
    assert r["ratio"] == pytest.approx(r["jaxmp_ms"] / r["baseline_ms"], rel=1e-12)
    pairs = [a / b for a, b in zip(r["jaxmp_samples_ms"], r["baseline_samples_ms"])]
    assert r["pair_ratios"] == pytest.approx(pairs, rel=1e-12)
    assert r["pair_ratio_median"] == pytest.approx(float(np.median(pairs)), rel=1e-12)
    for side in ("jaxmp", "baseline"):
        assert r[f"{side}_min_ms"] == min(r[f"{side}_samples_ms"])
        cpu = r[f"{side}_cpu_samples_ms"]
        assert len(cpu) == REPEATS and min(cpu) >= 0
        assert r[f"{side}_cpu_ms"] == pytest.approx(float(np.median(cpu)), rel=1e-12)
    assert r["cpu_ratio"] == pytest.approx(r["jaxmp_cpu_ms"] / r["baseline_cpu_ms"], rel=1e-12)
    assert r["meets_target"] == (r["ratio"] <= 1.02) and r["target_ratio"] == 1.02
    assert (r["steps"], r["repeats"], r["batch_size"], r["seq_len"]) == (2, REPEATS, 2, 16)
    assert r["policy"] == "mixed_fp16" and r["loss_scale"].startswith("dynamic")
    assert r["device"]["platform"] == "cpu"
    # Same model, weights and batch: the first losses agree, near ln(vocab) at init
    # (logits of weights drawn with std 0.02 are close to 0).
    first = r["first_loss"]
    assert first["jaxmp"] == pytest.approx(first["baseline"], rel=1e-4)
    assert abs(first["jaxmp"] - math.log(r["config"]["model"]["vocab_size"])) < 0.2
    # Same work: XLA counts nearly the same FLOPs in both compiled steps.
    flops = r["cost_analysis"]
    assert flops["jaxmp"]["flops"] == pytest.approx(flops["baseline"]["flops"], rel=0.1)
    assert "ratio jaxmp/baseline" in stdout


def test_train_step_report(runs):
    r, stdout = runs[0]["train_step"]
    m = r["config"]["model"]
    total, active = _hand_param_counts(m)
    assert (r["total_params"], r["active_params"]) == (total, active)
    tokens = 2 * 16
    assert r["tokens_per_step"] == tokens and r["attention_width"] == m["d_model"]
    # Kaplan et al. 2020: 6 N per token, plus 6 L T d for causal attention.
    flops = tokens * (6 * active + 6 * m["num_layers"] * 16 * m["d_model"])
    assert r["model_flops_per_step"] == pytest.approx(flops, rel=1e-12)
    assert [x["precision"] for x in r["results"]] == ["fp32", "mixed_bf16", "mixed_fp16"]
    for x, mode in zip(r["results"], ["fp32", "bf16", "fp16"]):
        assert len(x["samples_ms"]) == REPEATS and min(x["samples_ms"]) > 0
        assert x["step_ms"] == pytest.approx(float(np.median(x["samples_ms"])), rel=1e-12)
        seconds = x["step_ms"] / 1e3
        assert x["tokens_per_s"] == pytest.approx(tokens / seconds, rel=1e-12)
        assert x["achieved_tflops"] == pytest.approx(flops / seconds / 1e12, rel=1e-12)
        assert x["mfu"] == pytest.approx(x["achieved_tflops"] / x["peak_tflops"], rel=1e-12)
        # No datasheet peak on CPU: a float32 matmul measured next to each precision's steps.
        assert x["peak_kind"] == "measured" and "128x128" in x["peak_source"]
        assert x["peak_tflops"] > 0
        assert x["math_mode"] == mode
        assert math.isfinite(x["final_loss"]) and x["final_loss"] < math.log(m["vocab_size"]) + 0.5
    assert r["results"][0]["loss_scale"] == "none" and r["results"][2]["loss_scale"].startswith("dynamic")
    assert stdout.count("MFU") == 3


@settings(max_examples=20, deadline=None)
@given(vocab=st.integers(1, 300), batch=st.integers(1, 4), seq=st.integers(1, 9),
       count=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_random_batches_are_next_token_pairs_in_the_vocabulary(vocab, batch, seq, count, seed):
    batches = random_batches(vocab, batch, seq, count, seed=seed)
    assert len(batches) == count
    for b in batches:
        inputs, targets = np.asarray(b["inputs"]), np.asarray(b["targets"])
        assert inputs.shape == targets.shape == (batch, seq)
        assert inputs.dtype == targets.dtype == np.int32
        assert inputs.min() >= 0 and max(inputs.max(), targets.max()) < vocab
        np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])  # targets: next tokens
    again = random_batches(vocab, batch, seq, count, seed=seed)
    np.testing.assert_array_equal(np.asarray(again[-1]["targets"]), np.asarray(batches[-1]["targets"]))


@pytest.mark.parametrize("vocab, batch, seq, count", [(0, 1, 1, 1), (2, 0, 1, 1), (2, 1, 0, 1),
                                                      (2, 1, 1, 0)])
def test_random_batches_rejects_sizes_below_one(vocab, batch, seq, count):
    with pytest.raises(ValueError, match="must be >= 1"):
        random_batches(vocab, batch, seq, count)


@pytest.mark.parametrize("kind, expected", [
    ("NVIDIA H200", "H200"), ("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H800", "H800"),
    ("NVIDIA A100-SXM4-80GB", "A100"), ("NVIDIA GeForce RTX 4090", None), ("cpu", None),
])
def test_detect_hardware(kind, expected):
    assert train_step.detect_hardware(kind) == expected


def _gpu(kind, cc):
    return SimpleNamespace(platform="gpu", device_kind=kind, compute_capability=cc)


@pytest.mark.parametrize("device, dtype, hardware, peak, mode", [
    # Dense datasheet figures (the H100/H200 sheets print 2x these, "with sparsity").
    (_gpu("NVIDIA H200", "9.0"), jnp.float32, None, 494.7, "tf32"),
    (_gpu("NVIDIA H200", "9.0"), jnp.bfloat16, None, 989.4, "bf16"),
    (_gpu("NVIDIA H100 80GB HBM3", "9.0"), jnp.float16, None, 989.4, "fp16"),
    (_gpu("NVIDIA A100-SXM4-80GB", "8.0"), jnp.float32, None, 156.0, "tf32"),
    (_gpu("Some new GPU", "9.0"), jnp.bfloat16, "H100", 989.4, "bf16"),
    (SimpleNamespace(platform="cpu", device_kind="cpu"), jnp.bfloat16, "A100", 312.0, "bf16"),
])
def test_resolve_peak_uses_the_datasheet_on_gpus(device, dtype, hardware, peak, mode):
    got = train_step.resolve_peak(device, dtype, hardware, 1024)
    assert (got["peak_tflops"], got["math_mode"], got["peak_kind"]) == (peak, mode, "datasheet")


def test_resolve_peak_refuses_an_unknown_gpu():
    with pytest.raises(ValueError, match="RTX 4090.*--hardware"):
        train_step.resolve_peak(_gpu("NVIDIA GeForce RTX 4090", "8.9"), jnp.float32, None, 1024)


def _tiny_config():
    import importlib.util
    spec = importlib.util.spec_from_file_location("tiny_moe", ROOT / "configs" / "tiny_moe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


@pytest.mark.parametrize("kwargs, message", [
    (dict(steps=0, repeats=10), "steps must be an integer >= 1, got 0"),
    (dict(steps=1, repeats=9), "repeats=9"),
    (dict(steps=1, repeats=10, precisions=["fp64"]), "fp64"),
    (dict(steps=1, repeats=10, precisions=[]), "at least one"),
    (dict(steps=1, repeats=10, hardware="V100"), "V100"),
    (dict(steps=1, repeats=10, peak_size=0), "peak_size"),
    (dict(steps=1, repeats=10, fp16_loss_scale="dynamic:foo=1"), "foo"),
])
def test_train_step_run_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        train_step.run(_tiny_config(), **kwargs)


@pytest.mark.parametrize("args, message", [
    (dict(steps=1, repeats=5), "repeats=5"),
    (dict(steps=0, repeats=10), "steps must be an integer >= 1, got 0"),
    (dict(steps=1, repeats=10, ring=0), "ring"),
])
def test_overhead_run_rejects_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        overhead.run(_tiny_config(), **args)


def test_overhead_refuses_gradient_accumulation():
    config = _tiny_config()
    config.train.grad_accum_steps = 2
    with pytest.raises(ValueError, match="grad_accum_steps=2"):
        overhead.run(config, steps=1, repeats=10)


def test_jmp_loss_scale_mirrors_jaxmp():
    dyn = overhead.jmp_loss_scale(jaxmp_ls.DynamicLossScale(
        loss_scale=1024.0, growth_interval=7, growth_factor=4.0, backoff_factor=0.25))
    assert isinstance(dyn, jmp.DynamicLossScale)
    assert (float(dyn.loss_scale), dyn.period, dyn.factor, int(dyn.counter)) == (1024.0, 7, 4.0, 0)
    static = overhead.jmp_loss_scale(jaxmp_ls.StaticLossScale(8.0))
    assert isinstance(static, jmp.StaticLossScale) and float(static.loss_scale) == 8.0
    assert isinstance(overhead.jmp_loss_scale(jaxmp_ls.NoOpLossScale()), jmp.NoOpLossScale)
    with pytest.raises(ValueError, match="hysteresis=2"):
        overhead.jmp_loss_scale(jaxmp_ls.DynamicLossScale(hysteresis=2))


@pytest.mark.parametrize("name", sorted(BAD_FLAGS))
def test_scripts_reject_bad_flags_before_any_work(runs, name):
    returncode, stderr, wrote_json = runs[1][name]
    assert returncode != 0 and BAD_FLAGS[name][2] in stderr
    assert not wrote_json


@pytest.mark.parametrize("script", ["matmul.py", "compile_time.py", "overhead.py", "train_step.py"])
def test_an_unwritable_json_path_is_refused_before_any_work(script):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--json=/proc/no/such.json"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode in (1, 2), proc.stderr[-2000:]  # absl flag errors exit 1, argparse 2
    assert "cannot write /proc/no/such.json" in proc.stderr and "Traceback" not in proc.stderr
    assert "median" not in proc.stdout and "ms/step" not in proc.stdout  # nothing was timed
