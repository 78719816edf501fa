"""benchmarks/fidelity.py: the script end to end at a tiny size, and its pieces by hand."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmarks/ is not an installed package
    sys.path.insert(0, str(ROOT))

from benchmarks import fidelity  # noqa: E402
from jaxmp.diagnostics import LeafReport  # noqa: E402

SCRIPT = ROOT / "benchmarks" / "fidelity.py"
MODES = {"fp32", "mixed_bf16", "mixed_fp16", "mixed_fp16_noscale"}
# One MoE block (no dense one): the smallest model with router, experts and norms.
TINY = ["--steps", "3", "--layers", "1", "--dense-layers", "0", "--d-model", "16", "--heads", "2",
        "--d-ff", "32", "--d-expert", "16", "--experts", "4", "--top-k", "2", "--seq-len", "16",
        "--batch-size", "16", "--max-tokens", "20000", "--eval-batches", "1", "--log-every", "1",
        "--evals", "1", "--underflow-checkpoints", "1", "--noise-seeds", "0", "--quiet"]


def _metrics(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_script_writes_report_and_plot(tmp_path):
    out, png, runs = tmp_path / "fidelity.json", tmp_path / "fidelity.png", tmp_path / "runs"
    # The 8 host devices of tests/conftest.py reach the script through XLA_FLAGS.
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--json", str(out), "--plot", str(png),
                           "--workdir", str(runs)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())

    losses = report["final_eval_loss"]
    assert set(losses) == MODES
    assert all(math.isfinite(v) and 0 < v < math.log(257) + 1 for v in losses.values())
    # Each final eval loss is the last eval record its own run wrote to metrics.jsonl.
    for name, loss in losses.items():
        records = _metrics(runs / name / "metrics.jsonl")
        evals = [r for r in records if r["split"] == "eval"]
        assert evals[-1]["step"] == 3 and evals[-1]["loss"] == loss
        assert [r["step"] for r in records if r["split"] == "train"] == [1, 2, 3]
    # rel_diff recomputed in float64 from the reported losses.
    ref = losses["fp32"]
    assert set(report["rel_diff"]) == set(losses) - {"fp32"}
    for name, diff in report["rel_diff"].items():
        assert diff == pytest.approx((losses[name] - ref) / ref, rel=1e-12, abs=1e-15)
    assert report["meets_target"] == {k: abs(report["rel_diff"][k]) <= 0.0025
                                      for k in ("mixed_bf16", "mixed_fp16")}
    assert report["noise"] is None  # --noise-seeds 0
    assert report["target"] == 0.0025

    runs_info = report["runs"]
    assert runs_info["mixed_fp16"]["loss_scale"].startswith("dynamic")
    assert runs_info["mixed_fp16_noscale"]["loss_scale"] == "none"
    assert runs_info["fp32"]["policy"] == "fp32; router: fp32; norm: fp32"
    assert runs_info["mixed_fp16_noscale"]["policy"] == "mixed_fp16; router: fp32; norm: fp32"
    assert runs_info["fp32"]["final_loss_scale"] == 1.0
    assert report["setup"]["num_devices"] == 8

    u = report["underflow"]
    assert u["dtype"] == "float16" and u["loss_scale"] == 1.0
    assert [c["step"] for c in u["checkpoints"]] == [0, 3]  # initial state + the final checkpoint
    assert u["modules"]["blocks/0/moe/router"] == "float32"
    assert u["modules"]["blocks/0/attn_norm"] == "float32"
    assert u["modules"]["blocks/0/moe/experts"] == "float16"
    assert u["modules"]["head"] == "float16"
    for c in u["checkpoints"]:
        assert set(c["modules"]) == set(u["modules"])
        # The total is the count-weighted mean of the modules' fractions.
        counts = np.array([m["nonzero"] for m in c["modules"].values()], np.float64)
        fracs = np.array([m["underflow"] for m in c["modules"].values()], np.float64)
        assert c["total"]["nonzero"] == counts.sum() > 0
        assert c["total"]["underflow"] == pytest.approx((counts * fracs).sum() / counts.sum(), abs=1e-12)
        # A larger loss scale never flushes more gradients to zero (no overflow here).
        assert c["total_scaled"]["underflow"] <= c["total"]["underflow"]

    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "mixed_fp16" in proc.stdout and "target" in proc.stdout


@pytest.mark.parametrize("policy, preset, expected", [
    ("mixed_bf16; router: fp32; norm: fp32", "fp32", "fp32; router: fp32; norm: fp32"),
    ("mixed_bf16; router: fp32; norm: fp32", "mixed_fp16", "mixed_fp16; router: fp32; norm: fp32"),
    ("router: fp32; mixed_bf16", "mixed_fp16", "mixed_fp16; router: fp32"),  # default anywhere
    ("mixed_bf16", "fp32", "fp32"),
    ("mixed_bf16; (?:attn|mlp)/w: p=f32,c=f16,o=f32", "fp32", "fp32; (?:attn|mlp)/w: p=f32,c=f16,o=f32"),
])
def test_with_default_policy_keeps_rules(policy, preset, expected):
    assert fidelity.with_default_policy(policy, preset) == expected


@pytest.mark.parametrize("policy, preset", [("mixed_bf16", "float17"), ("mixed_bf16; bf16", "fp32")])
def test_with_default_policy_rejects_bad_policies(policy, preset):
    with pytest.raises(ValueError):
        fidelity.with_default_policy(policy, preset)


def test_rel_diff_by_hand():
    diffs = fidelity.rel_diff({"fp32": 2.0, "a": 2.005, "b": 1.99, "c": 2.0})
    assert diffs == pytest.approx({"a": 0.0025, "b": -0.005, "c": 0.0}, abs=1e-15)


@pytest.mark.parametrize("losses, message", [
    ({"a": 1.0}, "'fp32'"), ({"fp32": 0.0, "a": 1.0}, "0.0"), ({"fp32": float("nan")}, "nan"),
])
def test_rel_diff_rejects_bad_reference(losses, message):
    with pytest.raises(ValueError, match=message):
        fidelity.rel_diff(losses)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["embed", "blocks/0/attn", "blocks/1/moe/experts"]),
                          st.integers(0, 1000), st.integers(0, 1000)), min_size=1, max_size=8))
def test_by_module_weights_leaves_by_their_counts(leaves):
    report = {}
    for i, (module, nonzero, zeros) in enumerate(leaves):
        zeros = min(zeros, nonzero)
        report[f"{module}/w{i}"] = LeafReport(nonzero, zeros / max(nonzero, 1), 0.0, 0.0)
    got = fidelity.by_module(report)
    assert list(got) == list(dict.fromkeys(m for m, _, _ in leaves))
    for module in got:
        mine = [(n, min(z, n)) for m, n, z in leaves if m == module]
        total = sum(n for n, _ in mine)
        assert got[module].nonzero == total
        assert got[module].underflow == pytest.approx(sum(z for _, z in mine) / total if total else 0.0,
                                                      abs=1e-12)


def test_run_specs_names_modes_and_noise_seeds():
    specs = fidelity.run_specs("dynamic:init=2**10", noise_seeds=2)
    assert [s.name for s in specs] == ["fp32", "mixed_bf16", "mixed_fp16", "mixed_fp16_noscale",
                                       "fp32_seed1", "fp32_seed2"]
    assert [s.seed_offset for s in specs] == [0, 0, 0, 0, 1, 2]
    assert specs[2].loss_scale == "dynamic:init=2**10" and specs[3].loss_scale == "none"


def _result(name, loss, seed=0):
    curves = {"step": [1], "loss": [loss], "loss_scale": [1.0], "skipped_steps": [0],
              "eval_step": [1], "eval_loss": [loss]}
    return {"name": name, "final_eval_loss": loss, "policy": "p", "loss_scale": "none", "seed": seed,
            "skipped_steps": 0, "final_loss_scale": 1.0, "wall_s": 1.0, "curves": curves}


def test_compare_reports_noise_and_verdicts_by_hand():
    config = fidelity.load_config(fidelity.DEFAULT_CONFIG)
    plan = fidelity.plan(config, steps=10, num_devices=1, noise_seeds=2)
    results = [_result("fp32", 2.0), _result("mixed_bf16", 2.004), _result("mixed_fp16", 1.99),
               _result("mixed_fp16_noscale", 2.1), _result("fp32_seed1", 2.03, 1),
               _result("fp32_seed2", 1.98, 2)]
    report = fidelity.compare(plan, results)
    assert report["rel_diff"] == pytest.approx({"mixed_bf16": 0.002, "mixed_fp16": -0.005,
                                                "mixed_fp16_noscale": 0.05, "fp32_seed1": 0.015,
                                                "fp32_seed2": -0.01}, abs=1e-15)
    assert report["meets_target"] == {"mixed_bf16": True, "mixed_fp16": False}
    assert report["noise"] == pytest.approx(0.015, abs=1e-15)  # the larger |diff| of the reseeds
    assert report["setup"]["steps"] == 10 and report["setup"]["eval_tokens"] == 4 * 16 * 64
    text = fidelity.format_summary(report)
    assert "mixed_fp16: |-0.500%| > 0.25%: target MISSED" in text
    assert "run-to-run noise (fp32, another seed): 1.500%" in text


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "'0'"),
    (["--noise-seeds", "-1"], "'-1'"),
    (["--fp16-loss-scale", "none"], "'none'"),
    (["--fp16-loss-scale", "dynamic:init=abc"], "'abc'"),
    (["--heads", "3"], "num_heads"),  # 64 wide: 3 heads do not divide it
    (["--batch-size", "12", "--devices", "8"], "12"),  # not divisible by 8 devices
    (["--config", "configs/nope.py"], "nope.py"),
])
def test_cli_rejects_bad_input_before_training(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        fidelity.main(argv + ["--workdir", str(tmp_path / "runs")])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_run_refuses_a_used_workdir(tmp_path):
    (tmp_path / "fp32").mkdir()
    (tmp_path / "fp32" / "metrics.jsonl").write_text("{}\n")
    config = fidelity.load_config(fidelity.DEFAULT_CONFIG)
    with pytest.raises(ValueError, match="not empty"):
        fidelity.run(config, steps=2, workdir=tmp_path)


def test_read_metrics_needs_the_file(tmp_path):
    with pytest.raises(ValueError, match="metrics.jsonl"):
        fidelity.read_metrics(tmp_path)
