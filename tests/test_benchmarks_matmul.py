"""benchmarks/matmul.py: the script end to end at tiny sizes, FLOP arithmetic, inputs, timing."""
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmarks/ is not an installed package
    sys.path.insert(0, str(ROOT))

from benchmarks import matmul  # noqa: E402
from benchmarks._timing import time_per_call  # noqa: E402

SCRIPT = ROOT / "benchmarks" / "matmul.py"
NON_FP8 = [("float32", "highest"), ("float32", "default"), ("bfloat16", "default"),
           ("float16", "default")]


def _run_script(*args, timeout=900):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_script_writes_json_for_every_dtype_and_size(tmp_path):
    out = tmp_path / "matmul.json"
    proc = _run_script("--sizes", "64,128", "--repeats", "10", "--fp8-recipes", "none", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert isinstance(report["device"], str) and report["device"].startswith("cpu")
    rows = report["results"]
    assert sorted((r["dtype"], r["precision"], r["n"]) for r in rows) == sorted(
        (d, p, n) for d, p in NON_FP8 for n in (64, 128))
    for r in rows:
        assert math.isfinite(r["median_ms"]) and r["median_ms"] > 0
        # TFLOP/s recomputed by hand from the reported median: 2 n^3 FLOPs per matmul.
        assert r["tflops"] == pytest.approx(2 * r["n"] ** 3 / (r["median_ms"] * 1e-3) / 1e12,
                                            rel=1e-12)
    # No FP8 tensor cores on CPU: skipped, with the reason printed and recorded.
    assert [s["dtype"] for s in report["skipped"]] == ["float8_e4m3fn"]
    assert "Hopper" in report["skipped"][0]["reason"]
    assert "skipping float8_e4m3fn" in proc.stdout and "Hopper" in proc.stdout
    assert proc.stdout.count("TFLOP/s") >= len(rows)
    assert report["fp8"] == []


def test_script_fp8_recipe_rows(tmp_path):
    """Two recipes, two sizes (one below, one above the 128 block), both passes: measured on
    CPU, TFLOP/s recomputed from the median (2 n^3 forward, 6 n^3 with both backward
    products), and the lowered programs' dots counted by hand: every product is FP8, one
    per pass and product for per-tensor scales, ceil(n / 128) for 1x128 / 128x128 blocks."""
    out = tmp_path / "fp8.json"
    proc = _run_script("--sizes", "64,200", "--repeats", "10", "--fp8-recipes", "tensorwise,blockwise",
                       "--json", str(out), timeout=900)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["fp8"]
    assert sorted((r["recipe"], r["pass"], r["n"]) for r in rows) == sorted(
        (rec, p, n) for rec in ("tensorwise", "blockwise") for p in ("fwd", "fwd+bwd") for n in (64, 200))
    for r in rows:
        flops = (2 if r["pass"] == "fwd" else 6) * r["n"] ** 3
        assert r["tflops"] == pytest.approx(flops / (r["median_ms"] * 1e-3) / 1e12, rel=1e-12)
        chunks = math.ceil(r["n"] / 128) if r["recipe"] == "blockwise" else 1
        assert r["lowered_fp8_dots"] == (1 if r["pass"] == "fwd" else 3) * chunks
        assert r["lowered_other_dots"] == 0
        assert r["fp8_gemm_calls"] is None and r["fp8_gemm"] == "not yet measured on a GPU"
    assert "blockwise" in proc.stdout and "not yet measured on a GPU" in proc.stdout


def test_script_refuses_fewer_than_10_repeats(tmp_path):
    out = tmp_path / "matmul.json"
    proc = _run_script("--sizes", "64", "--repeats", "9", "--json", str(out))
    assert proc.returncode == 2
    assert "repeats=9" in proc.stderr and "10" in proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("argv, message", [
    (["--repeats", "0"], "repeats=0"),
    (["--repeats", "ten"], "'ten'"),
    (["--sizes", "64,-1"], "'-1'"),
    (["--sizes", "64,x"], "'x'"),
    (["--sizes", "0"], "'0'"),
    (["--fp8-recipes", "perrow"], "perrow"),
])
def test_cli_rejects_bad_flags_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        matmul.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("n, median_ms, expected", [
    (128, 1.0, 0.004194304),      # 2 * 2097152 / 1e-3 / 1e12
    (1024, 2.0, 1.073741824),     # 2 * 1073741824 / 2e-3 / 1e12
    (4096, 10.0, 13.7438953472),  # 2 * 68719476736 / 1e-2 / 1e12
    (1, 1e-6, 2e-3),              # 2 FLOPs in 1 ns
])
def test_matmul_tflops_by_hand(n, median_ms, expected):
    assert matmul.matmul_tflops(n, median_ms) == pytest.approx(expected, rel=1e-12)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 1 << 15), ms=st.floats(1e-4, 1e4))
def test_matmul_tflops_scales_as_n_cubed_over_time(n, ms):
    base = matmul.matmul_tflops(n, ms)
    assert matmul.matmul_tflops(2 * n, ms) == pytest.approx(8 * base, rel=1e-12)
    assert matmul.matmul_tflops(n, 2 * ms) == pytest.approx(base / 2, rel=1e-12)


@pytest.mark.parametrize("n, ms", [(0, 1.0), (-4, 1.0), (True, 1.0), (64.0, 1.0), (64, 0.0),
                                   (64, -1.0), (64, float("nan")), (64, float("inf"))])
def test_matmul_tflops_rejects_bad_input(n, ms):
    with pytest.raises(ValueError):
        matmul.matmul_tflops(n, ms)


@pytest.mark.parametrize("kwargs, message", [
    (dict(dtype="float64", n=64), "float64"),
    (dict(dtype="int8", n=64), "int8"),
    (dict(dtype="float32", n=0), "0"),
    (dict(dtype="float32", n=64, repeats=9), "repeats=9"),
    (dict(dtype="float32", n=64, precision="fastest"), "fastest"),
    (dict(dtype="float8_e4m3fn", n=64), "Hopper"),  # CPU has no FP8 tensor cores
])
def test_measure_peak_tflops_rejects_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        matmul.measure_peak_tflops(**kwargs)


def test_measure_peak_tflops_returns_a_plausible_number():
    tflops = matmul.measure_peak_tflops("float32", 64)
    # Positive and far below one PFLOP/s, which no CPU reaches.
    assert isinstance(tflops, float) and 0 < tflops < 1e3


@pytest.mark.parametrize("dtype, precision, out_dtype, rtol", [
    ("float32", "highest", "float32", 1e-6),
    ("float32", "default", "float32", 1e-6),   # plain float32 on CPU (TF32 only on GPUs)
    ("bfloat16", "default", "bfloat16", 2.0**-7),
    ("float16", "default", "float16", 2.0**-10),
    ("float8_e4m3fn", "default", "bfloat16", 2.0**-7),
])
def test_matmul_fn_matches_float64_numpy(dtype, precision, out_dtype, rtol):
    a, b = matmul.make_ring(16, dtype, 1, seed=3)[0]
    c = matmul.matmul_fn(dtype, precision)(a, b)
    assert c.dtype == np.dtype(out_dtype) and c.shape == (16, 16)
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    ref = a64 @ b64
    # Rounding the result (and float32 accumulation) errs by at most ~rtol of sum |a||b|.
    bound = rtol * (np.abs(a64) @ np.abs(b64))
    assert np.all(np.abs(np.asarray(c, np.float64) - ref) <= bound)


@pytest.mark.parametrize("dtype", matmul.DTYPES)
def test_make_ring_gives_distinct_nonzero_pairs(dtype):
    ring = matmul.make_ring(32, dtype, 3, seed=1)
    assert len(ring) == 3
    mats = [np.asarray(m, np.float64) for pair in ring for m in pair]
    for m in mats:
        assert m.shape == (32, 32)
        assert np.all(np.abs(m) >= 0.5) and np.all(np.abs(m) <= 1.5)
        assert 0.3 < np.mean(m > 0) < 0.7  # both signs occur
    assert all(m.dtype == np.dtype(dtype) for pair in ring for m in pair)
    for i in range(len(mats)):
        for j in range(i + 1, len(mats)):
            assert not np.array_equal(mats[i], mats[j])


@pytest.mark.parametrize("n, dtype, expected", [
    (64, "float32", 8),        # pair 32 KiB: 256 MiB would need 8192 pairs; capped at 8
    (4096, "bfloat16", 4),     # pair 2 * 4096^2 * 2 B = 64 MiB -> 4 pairs span 256 MiB
    (4096, "float32", 2),      # pair 128 MiB -> 2
    (8192, "float32", 2),      # pair 512 MiB -> 1, raised to the minimum of 2
    (8192, "float8_e4m3fn", 2),  # pair 128 MiB -> 2
])
def test_ring_size_by_hand(n, dtype, expected):
    assert matmul.ring_size(n, dtype) == expected


@pytest.mark.parametrize("device, fp8, mode", [
    (SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3",
                     compute_capability="9.0"), True, "tf32"),
    (SimpleNamespace(platform="gpu", device_kind="NVIDIA A100-SXM4-80GB",
                     compute_capability="8.0"), False, "tf32"),
    (SimpleNamespace(platform="gpu", device_kind="Tesla V100-SXM2-16GB",
                     compute_capability="7.0"), False, "fp32"),
    (SimpleNamespace(platform="tpu", device_kind="TPU v5 lite"), False, "bf16_1pass"),
    (SimpleNamespace(platform="cpu", device_kind="cpu"), False, "fp32"),
])
def test_fp8_support_and_float32_default_mode(device, fp8, mode):
    ok, reason = matmul.fp8_support(device)
    assert ok is fp8
    assert device.device_kind in reason
    assert matmul.math_mode("float32", "default", device) == mode
    assert matmul.math_mode("float32", "highest", device) == "fp32"
    assert matmul.math_mode("bfloat16", "default", device) == "bf16"


def test_time_per_call_divides_each_pass_by_the_ring_length():
    calls = []

    def slow(x):
        calls.append(x)
        time.sleep(0.005)
        return x

    samples = time_per_call(slow, [(0,), (1,), (2,), (3,)], repeats=10, warmup=2)
    assert samples.shape == (10,)
    assert len(calls) == (2 + 10) * 4 and calls[:4] == [0, 1, 2, 3]
    # 5 ms per call; an undivided pass would take >= 20 ms.
    assert 0.005 <= np.median(samples) < 0.02


@pytest.mark.parametrize("kwargs", [dict(repeats=9), dict(repeats=10.0), dict(repeats=True),
                                    dict(warmup=-1)])
def test_time_per_call_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        time_per_call(lambda x: x, [(0,)], **kwargs)
    with pytest.raises(ValueError, match="at least one"):
        time_per_call(lambda x: x, [])
