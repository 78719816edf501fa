"""benchmarks/released_memory.py at toy size on 8 CPU devices: the bytes it reads from the
compiled trainer step against the parameter count by hand, the toy configs representable
exactly, and a case the trainer refuses written as a row with its reason."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmarks/ is not an installed package
    sys.path.insert(0, str(ROOT))

from benchmarks import released_memory as rm  # noqa: E402
from jaxmp.analysis import gpu  # noqa: E402
from jaxmp.models import hf  # noqa: E402

# Llama-3.1-8B at toy size (rm.TOY_FIELDS): vocabulary 256, width 64, 2 layers, 4 heads of
# 16 (d_model / heads: the file has no head_dim), 2 key/value heads, MLP 128, untied head.
V, D, L, H, KV, HD, FF = 256, 64, 2, 4, 2, 16, 128
LLAMA_PARAMS = (2 * V * D  # embedding and head
                + L * (D * H * HD + 2 * D * KV * HD + H * HD * D  # q, k, v, o
                       + 3 * D * FF + 2 * D)  # SwiGLU, two RMSNorms
                + D)  # final RMSNorm
BATCH_BYTES = 2 * 64 * 4  # one device's inputs and targets: 64 int32 tokens each


TOY = ["--toy", "--models", "Llama-3.1-8B", "--policies", "mixed_bf16"]


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    out = tmp_path_factory.mktemp("released") / "toy"
    assert rm.main([*TOY, "--strategies", "dp,fsdp", "--out", str(out)]) == 0
    return json.loads(Path(f"{out}.json").read_text()), Path(f"{out}.md").read_text()


def _case(report, strategy, target="H100"):
    (rec,) = [r for r in report["cases"] if r["strategy"] == strategy and r["target"] == target]
    return rec


def test_argument_bytes_are_the_state_by_hand(toy):
    """dp holds float32 master weights and both Adam moments whole on every device (12 bytes
    a parameter), fsdp an eighth of each (every parameter has a d_model axis)."""
    report, _ = toy
    dp, fsdp = _case(report, "dp"), _case(report, "fsdp")
    assert dp["params"] == LLAMA_PARAMS == 106_816
    state = 12 * LLAMA_PARAMS
    assert state <= dp["memory"]["argument_bytes"] <= state + BATCH_BYTES + 1024
    assert state // 8 <= fsdp["memory"]["argument_bytes"] <= state // 8 + BATCH_BYTES + 1024


def test_total_and_fit_per_target(toy):
    """total = arguments + outputs - aliased + temporaries; fits against each target's
    capacity at gpu.FIT_MARGIN; the table shows each figure, the setup in its header."""
    report, md = toy
    assert "1 x 64 tokens per device" in md.splitlines()[0]
    for rec in report["cases"]:
        m = rec["memory"]
        assert m["total_bytes"] == (m["argument_bytes"] + m["output_bytes"] - m["alias_bytes"]
                                    + m["temp_bytes"])
        assert m["device_bytes"] == gpu.get_target(rec["target"]).memory_bytes
        assert m["fits"] == (m["total_bytes"] <= gpu.FIT_MARGIN * m["device_bytes"])
        assert f"**{m['total_bytes'] / 1e6:.3f} MB** fits" in md
    assert len(report["cases"]) == 4  # dp, fsdp x H100, H200; a dense model: no expert row
    assert "expert" not in md


def test_resume_compiles_nothing_done_and_keeps_the_rest(toy, tmp_path):
    """A run in steps: --resume with a subset of the cases already there compiles none,
    and keeps the cases it was not asked for (the table is the same)."""
    report, md = toy
    out = tmp_path / "resumed"
    Path(f"{out}.json").write_text(json.dumps(report))
    assert rm.main([*TOY, "--strategies", "fsdp", "--resume", "--out", str(out)]) == 0
    again = json.loads(Path(f"{out}.json").read_text())
    assert sorted(map(json.dumps, again["cases"])) == sorted(map(json.dumps, report["cases"]))
    assert Path(f"{out}.md").read_text() == md
    with pytest.raises(SystemExit):  # another batch size is another experiment
        rm.main([*TOY, "--per_device_batch", "2", "--resume", "--out", str(out)])


def test_refused_case_is_a_row_with_its_reason(tmp_path):
    """Expert parallelism without slots (capacity factor 0) is refused by the trainer's
    config check: the row says so instead of the run stopping."""
    out = tmp_path / "refused"
    assert rm.main(["--toy", "--models", "Mixtral-8x7B-v0.1", "--policies", "mixed_bf16",
                    "--strategies", "expert", "--targets", "H200", "--capacity_factor", "0",
                    "--out", str(out)]) == 0
    (rec,) = json.loads(Path(f"{out}.json").read_text())["cases"]
    assert "memory" not in rec and "capacity_factor > 0" in rec["error"]
    md = Path(f"{out}.md").read_text()
    assert "| fsdp + expert 8 | does not compile: parallel.expert=8" in md


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "configs" / "hf").glob("*.json")))
def test_toy_configs_keep_the_family(name):
    """Each shrunk config.json is still represented exactly, with the released one's
    attention kind (GQA, MHA or MLA) and routing."""
    full = json.loads((ROOT / "configs" / "hf" / f"{name}.json").read_text())
    small, big = hf.config_from_hf(rm.toy_config_json(full)), hf.config_from_hf(full)
    assert small["d_model"] == 64 and small["num_layers"] == 2
    for key in ("kv_lora_rank", "q_lora_rank", "norm_topk_prob", "n_group"):
        assert bool(small.get(key)) == bool(big.get(key)), key
    assert (small.get("num_kv_heads") == small.get("num_heads")) == \
        (big.get("num_kv_heads") == big.get("num_heads"))
    assert bool(small.get("num_experts")) == bool(big.get("num_experts"))
    # the layer kinds: sliding and full (GPT-OSS), linear and full (Qwen3-Next)
    assert set(small.get("layer_types") or ()) == set(big.get("layer_types") or ())


def test_bad_model_name_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        rm.main(["--toy", "--models", "GPT-5", "--out", str(tmp_path / "x")])
    assert "'GPT-5': no configs/hf/GPT-5.json; allowed: DeepSeek-V2-Lite" in capsys.readouterr().err
