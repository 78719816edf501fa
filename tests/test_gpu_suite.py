"""benchmarks/gpu_suite.py end to end at toy size on CPU, every derived figure recomputed by
hand from the raw ones; and one train-step case in its own process, as a GPU run runs
each."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _xla import cpu_flags

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_flags(), "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}


SCRIPT = str(ROOT / "benchmarks" / "gpu_suite.py")
# One train-step case as the suite runs each on a GPU: in a process of its own.
CASE = {"part": "train_step", "config": "dense_1b", "toy": True, "policy_name": "mixed_bf16",
        "policy": "mixed_bf16; router: fp32; norm: fp32", "loss_scale": "none", "steps": 1,
        "repeats": 10, "warmup": 0, "ring": 1, "hardware": None, "peak_size": 64}


def _suite(tmp, *args, timeout=900):
    return subprocess.run([sys.executable, SCRIPT, "--toy", "--out", str(tmp / "suite"), *args],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


XDIST_PER_TEST = True  # test by test, but the tests of the suite fixture (tests/conftest.py)


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    """The toy suite and one isolated case, side by side (2 cores)."""
    tmp = tmp_path_factory.mktemp("suite")
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for cmd in (
        # A budget no slow machine reaches: every part runs (the budget's own test is below).
        [sys.executable, SCRIPT, "--toy", "--budget_s", "3600", "--out", str(tmp / "suite")],
        [sys.executable, SCRIPT, "--case", json.dumps(CASE), "--case-out", str(tmp / "case.json")])]
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=600)
            assert proc.returncode == 0, err[-3000:]
    finally:  # a failure or timeout must not leave the other one running
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return (json.loads((tmp / "suite.json").read_text()), (tmp / "suite.md").read_text(),
            json.loads((tmp / "case.json").read_text()))


@pytest.mark.xdist_group("gpu_suite_toy")  # one suite fixture
def test_matmul_rows_by_hand(suite):
    r = suite[0]
    rows = {row["dtype"]: row for row in r["matmul"]["rows"]}
    assert {"bfloat16", "float16", "float32"} <= set(rows)
    for row in rows.values():
        n = row["n"]
        assert row["tflops"] == pytest.approx(2 * n ** 3 / (row["median_ms"] / 1e3) / 1e12, rel=1e-12)
        assert row["fraction_of_peak"] == pytest.approx(row["tflops"] / row["peak_tflops"], rel=1e-12)
    # Every jaxmp.fp8 recipe is measured (the delayed one with its amax histories); the CPU
    # runs the same jaxmp.fp8.dot as a GPU, in emulation.
    assert {row["dtype"] for row in r["matmul"]["rows"] if row["dtype"].startswith("fp8")} == {
        "fp8_tensorwise", "fp8_delayed", "fp8_rowwise", "fp8_blockwise"}, r["matmul"]["skipped"]
    assert r["fp8"].startswith("jaxmp.fp8")


@pytest.mark.xdist_group("gpu_suite_toy")  # one suite fixture
def test_attention_rows(suite):
    r = suite[0]
    a = r["attention"]
    b, t, h, d = a["shape"]
    rows = {row["implementation"]: row for row in a["rows"]}
    assert rows["reference"]["max_abs_diff_out"] == 0.0
    # The reference keeps the bf16 [B, H, T, T] probabilities; the fused kernel (traced on
    # CPU) its bf16 output and a float32 statistic per query and head.
    assert rows["reference"]["saved_bytes"] == b * h * t * t * 2
    assert rows["cudnn"]["saved_bytes"] == b * t * h * d * 2 + b * h * t * 4
    assert rows["xla"]["max_abs_diff_out"] <= 2 ** -7 and rows["xla"]["max_abs_diff_grad"] <= 2 ** -5
    assert rows["cudnn"]["traced_only"] and rows["cudnn"]["ms"] is None


@pytest.mark.xdist_group("gpu_suite_toy")  # one suite fixture
def test_fp8_kernels_are_checked_and_not_timed_off_a_gpu(suite):
    """The blockwise FP8 kernels (dense and grouped) ran interpreted at toy size and matched
    the XLA reference (value, dx, dw); nothing is timed on a CPU."""
    fk = suite[0]["fp8_kernels"]
    match = "value, dx and dw match the XLA reference"
    assert fk["checks"] == {"dense": match, "grouped": match}
    assert fk["rows"] == [] and fk["peak_tflops"] is None
    assert [s["reason"] for s in fk["skipped"]] == [
        "not timed off a GPU (the kernels ran interpreted for the check)"]


def test_an_fp8_kernel_that_does_not_match_the_reference_is_refused():
    from benchmarks.gpu_suite import _leaf_check

    ref = (np.array([1.0, -4.0]), np.array([[2.0]]), np.array([0.5, 0.5]))
    assert _leaf_check(("y", "dx", "dw"), ref, (ref[0] * (1 + 5e-4), ref[1], ref[2]), 1e-3) is None
    off = (ref[0], ref[1] * 1.01, np.array([0.5, np.inf]))
    assert _leaf_check(("y", "dx", "dw"), ref, off, 1e-3) == (
        "refused to time: dx off by 0.01 of its scale; dw off by inf of its scale")


@pytest.mark.xdist_group("gpu_suite_toy")  # one suite fixture
def test_moe_dispatch_rows(suite):
    r = suite[0]
    m = r["moe_dispatch"]
    dropless, *capacity = m["rows"]
    assert dropless["capacity_factor"] == 0 and dropless["dropped_fraction"] == 0.0
    assert [c["capacity_factor"] for c in capacity] == [1.0, 1.25]
    for row in m["rows"]:
        assert row["tokens_per_s"] == pytest.approx(m["tokens"] / (row["ms"] / 1e3), rel=1e-9)
        assert 0.0 <= row["dropped_fraction"] < 1.0
    fastest = min(m["rows"], key=lambda row: row["ms"])
    assert m["faster"].startswith(fastest["dispatch"])


def _hand_flops(case):
    # tokens x (6 N_active + 6 L T d) (Kaplan et al. 2020; jaxmp.analysis.cost.training_flops)
    width = {"dense_1b": 64, "moe_bench": 64}[case["config"]]
    return case["tokens_per_step"] * (6 * case["active_params"]
                                      + 6 * case["num_layers"] * case["seq_len"] * width)


@pytest.mark.xdist_group("gpu_suite_toy")  # one suite fixture
def test_train_step_cases_by_hand(suite):
    r = suite[0]
    cases = {(c["config"], c["policy_name"]): c for c in r["train_step"]}
    assert {("dense_1b", "mixed_bf16"), ("moe_bench", "mixed_bf16"), ("dense_1b", "mixed_fp16"),
            ("moe_bench", "mixed_fp16")} <= set(cases)
    for case in cases.values():
        assert "error" not in case, case
        assert case["tokens_per_step"] == 2 * 32 and case["num_layers"] == 2
        assert case["step_ms"] == pytest.approx(float(np.median(case["samples_ms"])), rel=1e-12)
        assert case["tokens_per_s"] == pytest.approx(64 / (case["step_ms"] / 1e3), rel=1e-12)
        assert case["model_flops_per_step"] == pytest.approx(_hand_flops(case), rel=1e-12)
        achieved = case["model_flops_per_step"] / (case["step_ms"] / 1e3) / 1e12
        assert case["achieved_tflops"] == pytest.approx(achieved, rel=1e-12)
        assert case["mfu"] == pytest.approx(achieved / case["peak_tflops"], rel=1e-12)
        assert case["compile_s"] > 0 and case["program_bytes"] > 0
        assert np.isfinite(case["final_loss"])
    assert cases[("dense_1b", "mixed_bf16")]["total_params"] == cases[("dense_1b", "mixed_bf16")]["active_params"]
    moe = cases[("moe_bench", "mixed_bf16")]
    assert moe["active_params"] < moe["total_params"]  # top-2 of 4 experts
    assert cases[("moe_bench", "mixed_fp16")]["loss_scale"].startswith("dynamic")


@pytest.mark.xdist_group("gpu_suite_toy")  # one suite fixture
def test_overhead_and_the_markdown_table(suite):
    r, md, _ = suite
    ov = r["overhead"]
    assert ov["ratio"] == pytest.approx(ov["jaxmp_ms"] / ov["baseline_ms"], rel=1e-12)
    lines = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    assert lines[0] == "| part | case | result | target | verdict |"
    assert len(lines) - 1 == len(r["rows"])  # one markdown row per figure, below the header
    # Targets are judged only on an H200, and never claimed from a CPU run.
    assert all(row[4] in ("", "n/a (not an H200)", "n/a (no GPU)") for row in r["rows"])
    assert "toy sizes" in md and r["toy"]


@pytest.mark.xdist_group("gpu_suite_toy")  # one suite fixture
def test_an_isolated_case_reports_as_the_in_process_one(suite):
    r, _, isolated = suite
    (case,) = [c for c in r["train_step"] if (c["config"], c["policy_name"]) == ("dense_1b", "mixed_bf16")]
    assert r["policies"]["mixed_bf16"] == CASE["policy"]
    for key in ("total_params", "tokens_per_step", "model_flops_per_step", "policy", "loss_scale"):
        assert isolated[key] == case[key], key
    # Same seed, same batches, same program: the same first steps.
    assert isolated["final_loss"] == pytest.approx(case["final_loss"], rel=1e-6)


def test_a_spent_budget_skips_and_says_so(tmp_path):
    proc = _suite(tmp_path, "--budget_s", "0.001", "--parts", "matmul,train_step")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "suite.json").read_text())
    assert r["train_step"] == [] and "matmul" in r and r["matmul"] is None
    skipped = {(s["part"], s["case"]) for s in r["skipped"]}
    assert ("matmul", "") in skipped and ("train_step", "dense_1b mixed_bf16") in skipped
    assert all(s["reason"].startswith("time budget") for s in r["skipped"])


def test_bad_parts_are_rejected(tmp_path):
    proc = _suite(tmp_path, "--parts", "matmul,gemm")
    assert proc.returncode == 2 and "gemm" in proc.stderr and not (tmp_path / "suite.json").exists()


def test_compile_time_benchmark_at_toy_size():
    sys.path.insert(0, str(ROOT))
    from benchmarks import compile_time
    from _configs import small_config

    lines = []
    r = compile_time.run(small_config(), [1, 2], [True], repeats=1, log=lines.append)
    by = {row["num_layers"]: row for row in r["results"]}
    assert set(by) == {1, 2} and len(lines) == 2
    for row in by.values():
        assert row["total_s"] == pytest.approx(row["lower_s"] + row["compile_s"], rel=1e-9)
        assert row["scan_layers"] is True and row["samples"] == [{k: row[k] for k in row if k != "samples"}]
    assert r["ratios"]["scanned"] == pytest.approx(by[2]["total_s"] / by[1]["total_s"], rel=1e-12)
    with pytest.raises(ValueError, match="at least two depths"):
        compile_time.run(small_config(), [3], [True])


@pytest.mark.parametrize("args, message", [
    (["--toy", "--parts", "attention", "--out", "/proc/no/such/suite"], "--out: cannot write /proc/no/such/suite.json"),
    (["--toy", "--case", "{bad"], "--case and --case-out go together"),
    (["--toy", "--case", "{bad", "--case-out", "/tmp/case.json"], "--case is not JSON"),
    (["--toy", "--case", "{}", "--case-out", "/tmp/case.json"], "needs an object with 'part' and 'toy'"),
])
def test_bad_output_or_case_is_a_one_line_error_before_any_measurement(args, message):
    proc = subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert "matmul" not in proc.stdout and "attention" not in proc.stdout  # nothing ran


def test_a_kernel_that_does_not_match_ragged_dot_is_refused_before_timing():
    """gpu_suite's correctness gate for the grouped GEMM: loss and gradients within 2% of
    each leaf's scale pass; a gradient off by 10% (or non-finite) is refused, by name."""
    import numpy as np

    from benchmarks.gpu_suite import _grouped_check

    ref = (np.float32(3.0), ({"w": np.array([1.0, -2.0, 4.0])}, np.array([[0.5, 0.25]])))
    close = (np.float32(3.01), ({"w": np.array([1.01, -2.0, 4.02])}, np.array([[0.5, 0.251]])))
    assert _grouped_check(ref, close) is None
    off = (np.float32(3.0), ({"w": np.array([1.0, -2.0, 4.4])}, np.array([[0.5, 0.25]])))
    assert _grouped_check(ref, off) == "refused to time: dparams off by 0.1 of its scale"
    nan = (np.float32(np.nan), ref[1])
    assert _grouped_check(ref, nan).startswith("refused to time: loss off by nan")
