"""benchmarks/fidelity.py: the paired multi-seed protocol end to end at a tiny size, and its
statistics by hand (t quantiles from a table, means, standard deviations, intervals)."""
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
from jaxmp.precision.diagnostics import LeafReport  # noqa: E402

SCRIPT = ROOT / "benchmarks" / "fidelity.py"
# One MoE block (no dense one): the smallest model with router, experts and norms.
TINY = ["--steps", "3", "--layers", "1", "--dense-layers", "0", "--d-model", "16", "--heads", "2",
        "--d-ff", "32", "--d-expert", "16", "--experts", "4", "--top-k", "2", "--seq-len", "16",
        "--batch-size", "16", "--max-tokens", "20000", "--eval-batches", "3", "--log-every", "1",
        "--evals", "2", "--quiet"]
# Student's t, 0.975 quantile (two-sided 95%), from a printed table.
T975 = {1: 12.7062, 2: 4.3027, 4: 2.7764, 9: 2.2622, 30: 2.0423, 120: 1.9799}


def test_script_runs_the_paired_protocol_and_writes_json_and_plot(tmp_path):
    out, png = tmp_path / "fidelity.json", tmp_path / "fidelity.png"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--modes", "mixed_bf16,fp8_blockwise",
                           "--seeds", "2", "--devices", "1", "--json", str(out), "--plot", str(png)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["seeds"] == [0, 1] and r["target"] == 0.0025
    assert set(r["modes"]) == {"mixed_bf16", "fp8_blockwise"}
    assert set(r["final_eval_loss"]) == {"fp32", "mixed_bf16", "fp8_blockwise"}  # the references too
    assert r["modes"]["mixed_bf16"]["reference"] == "fp32"
    assert r["modes"]["fp8_blockwise"]["reference"] == "mixed_bf16"
    for run, losses in r["final_eval_loss"].items():
        assert len(losses) == 2 and all(math.isfinite(v) and 0 < v < math.log(257) + 1 for v in losses)
        for seed, loss in zip(("0", "1"), losses):  # the last evaluation of each run
            c = r["curves"][run][seed]
            assert c["eval_step"] == [2, 3] and c["eval_loss"][-1] == loss and c["step"] == [1, 2, 3]
    assert r["runs"]["fp8_blockwise"]["policy"] == "fp8_blockwise; router: fp32; norm: fp32"
    # Paired statistics recomputed here in float64 from the reported losses.
    for name, m in r["modes"].items():
        mine, ref = np.array(r["final_eval_loss"][name]), np.array(r["final_eval_loss"][m["reference"]])
        d = (mine - ref) / ref
        assert m["rel_diff"] == pytest.approx(list(d), rel=1e-12, abs=1e-15)
        assert m["n"] == 2 and m["mean"] == pytest.approx(d.mean(), abs=1e-15)
        assert m["std"] == pytest.approx(abs(d[0] - d[1]) / math.sqrt(2), rel=1e-9, abs=1e-15)
        half = T975[1] * m["std"] / math.sqrt(2)
        assert m["half_width"] == pytest.approx(half, rel=1e-4, abs=1e-15)
        assert m["ci95"] == pytest.approx([m["mean"] - half, m["mean"] + half], rel=1e-4, abs=1e-15)
        assert m["goal"] == (abs(m["mean"]) <= 0.0025 and m["half_width"] <= 0.0025)
        assert m["eval_se"] is not None and m["eval_se"] >= 0
    assert r["underflow"] is None  # no float16 mode in this subset
    assert r["setup"]["eval_tokens"] == 3 * 16 * 16 and r["setup"]["steps"] == 3
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "fp8_blockwise" in proc.stdout and "goal for" in proc.stdout


@pytest.mark.parametrize("df", sorted(T975))
def test_t_quantile_matches_the_table(df):
    assert fidelity.t_quantile(0.975, df) == pytest.approx(T975[df], abs=1e-4)
    assert fidelity.t_quantile(0.025, df) == pytest.approx(-T975[df], abs=1e-4)


@settings(max_examples=30, deadline=None)
@given(st.floats(0.51, 0.999), st.integers(1, 60))
def test_t_quantile_inverts_the_distribution_function(p, df):
    assert fidelity._t_cdf(fidelity.t_quantile(p, df), df) == pytest.approx(p, abs=1e-9)


def test_t_quantile_rejects_bad_input():
    with pytest.raises(ValueError, match="p="):
        fidelity.t_quantile(1.0, 3)
    with pytest.raises(ValueError, match="df"):
        fidelity.t_quantile(0.9, 0)


def test_paired_stats_by_hand():
    d = [0.001, 0.003, -0.002, 0.004, 0.0]
    mean = 0.0012
    std = math.sqrt(sum((x - mean) ** 2 for x in d) / 4)
    s = fidelity.paired_stats(d)
    assert s["n"] == 5 and s["mean"] == pytest.approx(mean, abs=1e-15)
    assert s["std"] == pytest.approx(std, rel=1e-12)
    assert s["half_width"] == pytest.approx(T975[4] * std / math.sqrt(5), rel=1e-4)
    assert fidelity.paired_stats([0.01]) == {"n": 1, "mean": 0.01, "std": None, "ci95": None,
                                             "half_width": None}
    with pytest.raises(ValueError, match="finite"):
        fidelity.paired_stats([0.1, float("nan")])


def test_modes_and_their_references():
    table = fidelity.mode_table("dynamic:init=2**10")
    assert list(table) == ["fp32", "mixed_bf16", "mixed_fp16", "mixed_fp16_noscale", "fp8_tensorwise",
                           "fp8_delayed", "fp8_rowwise", "fp8_blockwise"]
    assert table["mixed_fp16"].loss_scale == "dynamic:init=2**10" and table["mixed_fp16_noscale"].loss_scale == "none"
    assert {table[m].reference for m in table if m.startswith("fp8_")} == {"mixed_bf16"}
    assert fidelity.runs_for(["fp8_rowwise"], table) == ["mixed_bf16", "fp8_rowwise"]
    assert fidelity.runs_for(["mixed_fp16", "fp8_blockwise"], table) == [
        "fp32", "mixed_bf16", "mixed_fp16", "fp8_blockwise"]
    with pytest.raises(ValueError, match="unknown fidelity mode 'fp8_perrow'"):
        fidelity.runs_for(["fp8_perrow"], table)
    with pytest.raises(ValueError, match="'fp32'"):
        fidelity.runs_for(["fp32"], table)


def _result(run, seed, loss, batch_losses):
    curves = {"step": [1], "loss": [loss], "loss_scale": [1.0], "skipped_steps": [0],
              "eval_step": [1], "eval_loss": [loss]}
    return {"run": run, "seed": seed, "policy": "p", "loss_scale": "none", "final_eval_loss": loss,
            "eval_batch_losses": batch_losses, "skipped_steps": 0, "final_loss_scale": 1.0,
            "wall_s": 1.0, "curves": curves}


def test_compare_by_hand():
    config = fidelity.load_config(fidelity.DEFAULT_CONFIG)
    plan = fidelity.plan(config, steps=10, seeds=2, modes=["mixed_bf16", "fp8_blockwise"], num_devices=1)
    assert plan.runs == ("fp32", "mixed_bf16", "fp8_blockwise") and plan.seeds == (0, 1)
    losses = {("fp32", 0): 2.0, ("fp32", 1): 2.1, ("mixed_bf16", 0): 2.002, ("mixed_bf16", 1): 2.1021,
              ("fp8_blockwise", 0): 2.012, ("fp8_blockwise", 1): 2.0811}
    results = [_result(run, s, v, [v - 0.1, v + 0.1]) for (run, s), v in losses.items()]
    r = fidelity.compare(plan, results)
    bf16 = r["modes"]["mixed_bf16"]
    assert bf16["rel_diff"] == pytest.approx([0.001, 0.001], abs=1e-12)
    assert bf16["mean"] == pytest.approx(0.001) and bf16["std"] == pytest.approx(0.0, abs=1e-12)
    assert bf16["goal"] is True
    f8 = r["modes"]["fp8_blockwise"]
    assert f8["rel_diff"] == pytest.approx([0.01 / 2.002, -0.021 / 2.1021], rel=1e-9)
    assert f8["goal"] is False  # |mean| small, but the interval is wide
    # Per-batch paired differences equal the final one here: their standard error is 0.
    assert f8["eval_se"] == pytest.approx(0.0, abs=1e-12)
    assert r["reference_spread"]["fp32"] == pytest.approx(np.std([2.0, 2.1], ddof=1) / 2.05, rel=1e-12)
    text = fidelity.format_summary(r)
    assert "mixed_bf16" in text and "met" in text and "not met" in text


def test_gradient_underflow_by_module_and_dtype():
    from jaxmp.precision.policy import get_policy_rules

    grads = {"blocks": {"0": {"attn": {"wq": np.array([1e-8, 1.0], np.float32)},
                              "attn_norm": {"scale": np.array([1.0, 2.0], np.float32)}}}}
    rules = get_policy_rules("mixed_fp16; norm: fp32")
    u = fidelity.gradient_underflow([(0, grads), (5, grads)], rules, scaled_loss_scale=2.0 ** 10)
    assert u["modules"] == {"blocks/0/attn": "float16", "blocks/0/attn_norm": "float32"}
    assert [c["step"] for c in u["checkpoints"]] == [0, 5]
    c = u["checkpoints"][0]
    assert c["modules"]["blocks/0/attn"]["underflow"] == 0.5  # 1e-8 < 2**-25 in float16
    assert c["total"]["underflow"] == 0.25 and c["total_scaled"]["underflow"] == 0.0


@pytest.mark.parametrize("policy, preset, expected", [
    ("mixed_bf16; router: fp32; norm: fp32", "fp32", "fp32; router: fp32; norm: fp32"),
    ("mixed_bf16; router: fp32; norm: fp32", "fp8_blockwise", "fp8_blockwise; router: fp32; norm: fp32"),
    ("router: fp32; mixed_bf16", "mixed_fp16", "mixed_fp16; router: fp32"),  # default anywhere
    ("mixed_bf16", "fp32", "fp32"),
])
def test_with_default_policy_keeps_rules(policy, preset, expected):
    assert fidelity.with_default_policy(policy, preset) == expected


@pytest.mark.parametrize("policy, preset", [("mixed_bf16", "float17"), ("mixed_bf16; bf16", "fp32")])
def test_with_default_policy_rejects_bad_policies(policy, preset):
    with pytest.raises(ValueError):
        fidelity.with_default_policy(policy, preset)


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


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "'0'"),
    (["--seeds", "0"], "'0'"),
    (["--modes", "mixed_bf16,fp8_perrow"], "fp8_perrow"),
    (["--fp16-loss-scale", "none"], "'none'"),
    (["--fp16-loss-scale", "dynamic:init=abc"], "'abc'"),
    (["--heads", "3"], "num_heads"),  # 64 wide: 3 heads do not divide it
    (["--batch-size", "12", "--devices", "8"], "12"),  # not divisible by 8 devices
    (["--config", "configs/nope.py"], "nope.py"),
])
def test_cli_rejects_bad_input_before_training(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        fidelity.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_plan_checks_every_run_and_the_eval_cadence():
    config = fidelity.load_config(fidelity.DEFAULT_CONFIG)
    p = fidelity.plan(config, steps=800, num_devices=1)
    assert p.seeds == (0, 1, 2, 3, 4) and len(p.configs) == 8 * 5
    assert p.eval_steps == tuple(range(100, 801, 100))  # train.eval_every = 100
    assert p.underflow_steps == (0, 400, 800)
    assert p.configs[("fp8_delayed", 3)].precision.policy == "fp8_delayed; router: fp32; norm: fp32"
    assert p.configs[("fp8_delayed", 3)].seed == 3
    assert fidelity.plan(config, steps=10, modes=["fp8_rowwise"], num_devices=1).underflow_steps == ()
