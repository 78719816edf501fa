"""Cost model, the article's recomputed tables and the report CLI, against hand arithmetic."""
import json
import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

from jaxmp.analysis import article, cost, report

TINY = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "configs" / "tiny_moe.py")

# DeepSeek-V3: 6 x 37e9 x 14.8e12, and the causal-attention term 6 x 61 x 4096 x 7168 per token.
DSV3_6ND = 3.2856e24
DSV3_ATTN_PER_TOKEN = 10_745_806_848  # 6 * 61 = 366; 366 * 4096 = 1_499_136; * 7168.
DSV3_FLOPS = (222e9 + DSV3_ATTN_PER_TOKEN) * 14.8e12


# ---------------------------------------------------------------- FLOPs and estimate


def test_training_flops_6nd_by_hand():
    assert cost.training_flops(37e9, 14.8e12) == pytest.approx(DSV3_6ND, rel=1e-12)


def test_training_flops_attention_term_by_hand():
    got = cost.training_flops(37e9, 14.8e12, num_layers=61, seq_len=4096, d_model=7168)
    assert got == pytest.approx(DSV3_FLOPS, rel=1e-12)
    assert got == pytest.approx(3.4446379e24, rel=1e-7)


def test_estimate_round_numbers_by_hand():
    # 6 x 1.56e9 x 6e10 = 5.616e20 FLOPs; A100 bf16 312 TFLOP/s at MFU 0.5 = 1.56e14 FLOP/s
    # -> 3.6e6 GPU-seconds = 1000 GPU-hours; on 10 GPUs 100 h; at 400 W TDP, 400 kWh.
    e = cost.estimate(2e9, 1.56e9, 6e10, hardware="A100", dtype="bf16", mfu=0.5, num_gpus=10)
    assert e.flops == pytest.approx(5.616e20, rel=1e-12)
    assert e.gpu_hours == pytest.approx(1000.0, rel=1e-12)
    assert e.days == pytest.approx(100.0 / 24.0, rel=1e-12)
    assert e.energy_kwh == pytest.approx(400.0, rel=1e-12)
    assert e.energy_mwh == pytest.approx(0.4, rel=1e-12)
    assert e.tokens_per_s == pytest.approx(6e10 / 360_000.0, rel=1e-12)
    assert (e.total_params, e.active_params, e.tokens, e.hardware, e.dtype, e.mfu,
            e.num_gpus, e.watts_per_gpu, e.peak_tflops) == (
                2e9, 1.56e9, 6e10, "A100", "bf16", 0.5, 10, 400.0, 312.0)


def test_estimate_deepseek_v3_by_hand():
    # 3.2856e24 / (989.4e12 x 0.4) / 3600 GPU-hours; 300 W overrides the 700 W TDP.
    e = cost.estimate(671e9, 37e9, 14.8e12, mfu=0.4, watts_per_gpu=300.0)
    hours = 3.2856e24 / (989.4e12 * 0.4) / 3600
    assert e.gpu_hours == pytest.approx(hours, rel=1e-12)
    assert e.gpu_hours == pytest.approx(2.30612e6, rel=1e-5)
    assert e.days == pytest.approx(hours / 2048 / 24, rel=1e-12)
    assert e.energy_mwh == pytest.approx(hours * 300 / 1e6, rel=1e-12)


def test_implied_mfu_of_published_deepseek_v3_by_hand():
    # 3.2856e24 / (2.664e6 h x 3600 s x 989.4e12) = 3.2856 / 9.48874176.
    bf16 = cost.implied_mfu(DSV3_6ND, 2.664e6, hardware="H800", dtype="bf16")
    assert bf16 == pytest.approx(3.2856 / 9.48874176, rel=1e-12)
    assert cost.implied_mfu(DSV3_6ND, 2.664e6, dtype="fp8") == pytest.approx(bf16 / 2, rel=1e-3)


@settings(max_examples=25, deadline=None)
@given(mfu=st.floats(0.01, 1.0), active=st.floats(1e6, 1e12), tokens=st.floats(1e6, 1e14),
       gpus=st.integers(1, 100_000), hw_dt=st.sampled_from(
           [("H800", "fp8"), ("H100", "bf16"), ("H200", "tf32"), ("A100", "fp16"),
            ("A100", "fp32")]))
def test_implied_mfu_inverts_estimate(mfu, active, tokens, gpus, hw_dt):
    hw, dt = hw_dt
    e = cost.estimate(active * 2, active, tokens, hardware=hw, dtype=dt, mfu=mfu, num_gpus=gpus)
    assert cost.implied_mfu(e.flops, e.gpu_hours, hardware=hw, dtype=dt) == pytest.approx(mfu, rel=1e-9)
    # Wall time x GPUs is GPU time; throughput x wall time is the token count.
    assert e.days * 24 * gpus == pytest.approx(e.gpu_hours, rel=1e-9)
    assert e.tokens_per_s * e.days * 86400 == pytest.approx(tokens, rel=1e-9)


# ---------------------------------------------------------------- hardware table


def test_hardware_table_sanity():
    assert set(cost.HARDWARE) == {"H800", "H100", "H200", "A100"}
    assert cost.HARDWARE["H100"].peak_tflops["bf16"] == pytest.approx(989.4, abs=0.5)
    assert cost.HARDWARE["A100"].peak_tflops["bf16"] == pytest.approx(312.0)
    assert cost.HARDWARE["A100"].peak_tflops["fp8"] is None
    for name, hw in cost.HARDWARE.items():
        assert hw.name == name and hw.source and hw.tdp_watts > 0 and hw.memory_gb > 0
        peaks = hw.peak_tflops
        assert set(peaks) == set(cost.DTYPES)
        assert peaks["fp16"] == peaks["bf16"]
        assert peaks["tf32"] == pytest.approx(peaks["bf16"] / 2, rel=1e-3)
        assert peaks["fp32"] < peaks["tf32"]  # CUDA-core FP32 is far below tensor cores.
    for name in ("H800", "H100", "H200"):
        peaks = cost.HARDWARE[name].peak_tflops
        assert peaks["fp8"] == pytest.approx(2 * peaks["bf16"], rel=1e-3)
    assert cost.HARDWARE["H200"].memory_gb > cost.HARDWARE["H100"].memory_gb
    with pytest.raises(TypeError):
        cost.HARDWARE["H100"].peak_tflops["bf16"] = 1.0


# ---------------------------------------------------------------- errors


GOOD = dict(total_params=671e9, active_params=37e9, tokens=14.8e12)


@pytest.mark.parametrize("kwargs, message", [
    ({"mfu": 0.0}, r"mfu=0.0 must be a finite number in \(0, 1\]"),
    ({"mfu": 1.5}, r"mfu=1.5 must be a finite number in \(0, 1\]"),
    ({"mfu": -0.2}, r"mfu=-0.2 must be a finite number in \(0, 1\]"),
    ({"hardware": "V100"}, r"unknown hardware 'V100'; allowed: H800, H100, H200, A100"),
    ({"dtype": "int8"}, r"unknown dtype 'int8'; allowed: fp32, tf32, bf16, fp16, fp8"),
    ({"hardware": "A100", "dtype": "fp8"}, r"A100 has no fp8 mode; supported on A100: fp32, tf32, bf16, fp16"),
    ({"total_params": 0}, r"total_params=0 must be a positive finite number"),
    ({"active_params": -1.0}, r"active_params=-1.0 must be a positive finite number"),
    ({"tokens": float("nan")}, r"tokens=nan must be a positive finite number"),
    ({"num_gpus": 0}, r"num_gpus=0 must be a positive finite number"),
    ({"num_gpus": 2.5}, r"num_gpus=2.5 must be a positive integer"),
    ({"watts_per_gpu": 0.0}, r"watts_per_gpu=0.0 must be a positive finite number"),
    ({"active_params": 700e9}, r"active_params=700000000000.0 exceeds total_params"),
    ({"num_layers": 61}, r"needs num_layers, seq_len and d_model together; got only num_layers"),
    ({"num_layers": 61, "seq_len": -1, "d_model": 7168}, r"seq_len=-1 must be an integer >= 0"),
])
def test_estimate_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        cost.estimate(**{**GOOD, **kwargs})


def test_implied_mfu_errors():
    with pytest.raises(ValueError, match="gpu_hours=0.0 must be a positive"):
        cost.implied_mfu(1e24, 0.0)
    with pytest.raises(ValueError, match="A100 has no fp8"):
        cost.implied_mfu(1e24, 1e6, hardware="A100", dtype="fp8")


# ---------------------------------------------------------------- the article's tables


def _by_item(rows):
    return {r.item: r for r in rows}


def test_article_memory_rows_by_hand():
    rows = article.memory_table()
    m = _by_item(rows)
    fp32 = m["FP32 parameters"]
    assert fp32.bytes == 268e9 and fp32.article == "2.68 TB" and fp32.status == "WRONG"
    both = m["FP16 + FP32 parameter copies"]
    assert both.bytes == pytest.approx(134e9 + 268e9) and both.status == "WRONG"
    assert both.fraction == pytest.approx(1.5)
    full = m["FP32 training, Adam"]
    assert full.bytes == pytest.approx(1.072e12) and full.status == "REF"
    mixed = next(r for r in rows if r.item.startswith("mixed precision, Adam"))
    assert mixed.bytes_per_param == 16 and mixed.bytes == pytest.approx(1.072e12)
    assert mixed.fraction == pytest.approx(1.0) and mixed.status == "WRONG"
    dsv3 = next(r for r in rows if r.item.startswith("DeepSeek-V3"))
    assert dsv3.bytes == pytest.approx(804e9) and dsv3.fraction == pytest.approx(0.75)
    assert dsv3.status == "WRONG"
    assert [r.status for r in rows] == ["WRONG", "WRONG", "REF", "WRONG", "WRONG", "REF"]
    # Only the figures the article prints are quoted.
    assert {r.article for r in rows} == {"2.68 TB", "132+132 GB", "40-60% less memory", None}


def test_article_communication_rows_by_hand():
    rows = article.communication_table(8)
    ring = 2 * 7 / 8
    assert [r.bytes for r in rows[:4]] == pytest.approx(
        [ring * 4 * 67e9, ring * 2 * 67e9, ring * 1.8 * 67e9, ring * 2.4 * 67e9])
    assert rows[4].bytes == pytest.approx(7 * 1.8 * 67e9)
    assert [r.fraction for r in rows] == pytest.approx([1.0, 0.5, 0.9, 0.6, 12.6 / 3.5])
    assert [r.status for r in rows] == ["REF", "OK", "WRONG", "WRONG", "WRONG"]
    assert {r.article for r in rows} == {None, "halves communication", "cuts it to 30%"}


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 100_000))
def test_ring_allreduce_factor(n):
    f = article.ring_allreduce_factor(n)
    assert f == pytest.approx(2.0 * (n - 1) / n, rel=1e-15)
    assert 0.0 <= f < 2.0


@settings(max_examples=20, deadline=None)
@given(n=st.integers(2, 4096))
def test_sparse_allgather_beats_dense_fp32_only_below_five_devices(n):
    rows = article.communication_table(n)
    dense32, gather = rows[0].bytes, rows[-1].bytes
    # (N-1) x 1.8 < 2 (N-1)/N x 4  <=>  N < 8 / 1.8 = 4.44.
    assert (gather < dense32) == (n <= 4)


@pytest.mark.parametrize("bad", [0, 1, -3, 2.0, True])
def test_communication_table_rejects_bad_device_count(bad):
    with pytest.raises(ValueError, match=r"num_devices=.* must be an integer >= 2"):
        article.communication_table(bad)


# ---------------------------------------------------------------- CLI


def _run(*args):
    return subprocess.run([sys.executable, "-m", "jaxmp.report", *args],
                          capture_output=True, text=True, timeout=900)


def test_cli_article_json(tmp_path):
    out = tmp_path / "article.json"
    proc = _run("--article", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "2.68 TB" in proc.stdout and "WRONG" in proc.stdout
    data = json.loads(out.read_text())
    assert set(data) == {"article"}
    s = data["article"]
    assert s["num_params"] == 67e9 and s["num_devices"] == 8
    assert s["memory"][0]["bytes"] == 67e9 * 4
    assert s["memory"][0]["status"] == "WRONG"
    assert s["communication"][1]["status"] == "OK"
    assert s["communication"][0]["bytes"] == pytest.approx(1.75 * 4 * 67e9)
    assert set(s["memory"][0]) == {"item", "formula", "bytes_per_param", "bytes", "fraction",
                                   "baseline", "article", "status", "reason"}


def test_cli_cost_json(tmp_path):
    out = tmp_path / "cost.json"
    proc = _run("--cost", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "2.664M" in proc.stdout
    c = json.loads(out.read_text())["cost"]
    assert c["published"]["gpu_hours"] == {"pre-training": 2664e3, "context extension": 119e3,
                                           "post-training": 5e3, "total": 2788e3}
    assert c["published"]["pretraining_days"] == pytest.approx(2664e3 / 2048 / 24)
    est = c["estimate"]
    assert est["flops"] == pytest.approx(DSV3_FLOPS, rel=1e-12)
    assert est["gpu_hours"] == pytest.approx(DSV3_FLOPS / (989.4e12 * 0.4) / 3600, rel=1e-12)
    assert c["estimate_over_published"] == pytest.approx(est["gpu_hours"] / 2664e3)
    mfu = {r["flops_formula"]: r for r in c["implied_mfu"]}
    assert mfu["6ND"]["bf16"] == pytest.approx(3.2856 / 9.48874176, rel=1e-12)
    assert mfu["6ND + 6LTd"]["fp8"] == pytest.approx(
        DSV3_FLOPS / (2664e3 * 3600 * 1978.9e12), rel=1e-12)


def test_cli_cost_overrides_in_process(tmp_path, capsys):
    out = tmp_path / "cost.json"
    rc = report.main(["--cost", "--params", "2e9", "--active-params", "1.56e9", "--tokens", "6e10",
                      "--hardware", "A100", "--dtype", "bf16", "--mfu", "0.5", "--gpus", "10",
                      "--layers", "0", "--seq-len", "0", "--d-model", "0", "--json", str(out)])
    assert rc == 0
    est = json.loads(out.read_text())["cost"]["estimate"]
    assert est["gpu_hours"] == pytest.approx(1000.0, rel=1e-12)  # as in the round-number test.
    assert est["hardware"] == "A100" and est["num_gpus"] == 10
    assert "A100" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--cost", "--hardware", "A100", "--dtype", "fp8"], "A100 has no fp8 mode"),
    (["--cost", "--mfu", "2"], "mfu=2.0 must be a finite number in (0, 1]"),
    (["--article", "--devices", "1"], "num_devices=1 must be an integer >= 2"),
    ([], "choose a report: --article and/or --cost"),
    # Before any work: an output path that cannot be written, an empty list of modes.
    (["--article", "--json", "/proc/no/such/out.json"], "--json: cannot write /proc/no/such/out.json"),
    (["--config", TINY, "--modes", "fp32", "--json", "/proc/no/such/out.json"], "--json: cannot write"),
    (["--config", TINY, "--modes", ","], "--modes ',' names no precision mode; allowed: fp32,"),
])
def test_cli_bad_input_exits_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        report.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_article_strategy_rows_by_hand():
    """67e9 parameters on 2048 GPUs: dp 16 B/param, zero1 2 + 12/2048, fsdp 12/2048."""
    rows = {r.item.split(", ")[1]: r for r in article.strategy_table(2048)}
    p = 67e9
    assert rows["dp"].bytes == 16 * p == 1.072e12
    assert rows["zero1"].bytes == pytest.approx(2 * p + 12 * p / 2048, rel=1e-12)  # 134.39 GB
    assert rows["fsdp"].bytes == pytest.approx(12 * p / 2048, rel=1e-12)           # 0.393 GB
    assert all(r.status == "REF" and r.article is None for r in rows.values())
    assert article.strategy_table(1)[2].bytes_per_param == 12.0
    with pytest.raises(ValueError, match="num_devices=0 must be an integer >= 1"):
        article.strategy_table(0)


def test_training_flops_of_sliding_window_layers_by_hand():
    """A layer with a window W < T attends on average to W - W**2 / 2T keys per token (the
    keys min(i + 1, W) summed over i, continuous), where a full causal layer counts T/2:
    T = 4096, W = 1024, d = 2560, one of each layer: 12 d (1024 - 128 + 2048) per token."""
    full = cost.training_flops(1e9, 1e6, num_layers=2, seq_len=4096, d_model=2560)
    assert full == pytest.approx(1e6 * (6e9 + 6 * 2 * 4096 * 2560), rel=1e-12)
    mixed = cost.training_flops(1e9, 1e6, num_layers=2, seq_len=4096, d_model=2560,
                                windows=[1024, 0])
    assert mixed == pytest.approx(1e6 * (6e9 + 12 * 2560 * (1024 - 128 + 2048)), rel=1e-12)
    # a window as long as the row (or longer) is full attention
    assert cost.training_flops(1e9, 1e6, num_layers=2, seq_len=4096, d_model=2560,
                               windows=[4096, 9000]) == pytest.approx(full, rel=1e-12)
    # a linear-attention layer (None) has no attention term: one full layer's is left
    assert cost.training_flops(1e9, 1e6, num_layers=2, seq_len=4096, d_model=2560,
                               windows=[None, 0]) == pytest.approx(
        1e6 * (6e9 + 6 * 4096 * 2560), rel=1e-12)
    with pytest.raises(ValueError, match=r"windows must give one int >= 0 \(or None\) per "
                                         r"layer \(2\)"):
        cost.training_flops(1e9, 1e6, num_layers=2, seq_len=4096, d_model=2560, windows=[1])
