"""``python -m jaxmp.report --config configs/finetune.py --config.model.init_from=DIR --target
H100 --devices 8`` plans a released model from its config.json alone, no weights in DIR
(issue 27, point 3); configs/finetune.py without a DIR is a one-line error naming
model.init_from, and from_pretrained without safetensors (a core install) one naming the
``train`` extra."""
import json

import pytest

from _configs import ROOT
from jaxmp.analysis import gpu
from jaxmp.analysis.report import main
from jaxmp.train.config import load_config

# configs/hf/Qwen3-30B-A3B.json shrunk: GQA, q/k norms, 8 softmax experts, top-2.
V, D, L, H, KV, HD, E, K, DE = 256, 64, 2, 4, 2, 16, 8, 2, 32
SHRUNK = dict(vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=H,
              num_key_value_heads=KV, head_dim=HD, num_experts=E, num_experts_per_tok=K,
              moe_intermediate_size=DE, intermediate_size=128, max_position_embeddings=512)
# By hand: q and o (D x H*HD), k and v (D x KV*HD), q/k norms, 2 norms, router, experts.
LAYER_BUT_EXPERTS = 2 * D * H * HD + 2 * D * KV * HD + 2 * HD + 2 * D + D * E
PARAMS = L * (LAYER_BUT_EXPERTS + E * 3 * D * DE) + 2 * V * D + D
ACTIVE = L * (LAYER_BUT_EXPERTS + K * 3 * D * DE) + 2 * V * D + D


@pytest.fixture
def released_dir(tmp_path):
    config = json.loads((ROOT / "configs" / "hf" / "Qwen3-30B-A3B.json").read_text())
    config.update(SHRUNK)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.skipif(gpu.plugin_problem() is not None,
                    reason=f"deviceless GPU compile: {gpu.plugin_problem()}")
def test_report_plans_a_released_model_from_its_config_json(released_dir, tmp_path, capsys):
    assert [p.name for p in released_dir.iterdir()] == ["config.json"]  # no weights
    out = tmp_path / "plan.json"
    status = main(["--config", "configs/finetune.py", f"--config.model.init_from={released_dir}",
                   "--target", "H100", "--devices", "8", "--json", str(out)])
    assert status == 0
    plan = json.loads(out.read_text())
    assert (plan["setup"]["params"], plan["setup"]["active_params"]) == (PARAMS, ACTIVE)
    assert plan["setup"]["devices"] == 8 and plan["setup"]["remat"] == "full"
    # dp: every device holds the float32 master and both float32 Adam moments.
    assert plan["memory"]["argument_bytes"] >= 12 * PARAMS and plan["memory"]["fits"]
    assert "8 x H100" in capsys.readouterr().out


def test_finetune_without_init_from_names_it():
    with pytest.raises(ValueError, match=r"sets no model architecture .*--config\.model\."
                                         r"init_from=DIR") as info:
        load_config("configs/finetune.py", ["train.steps=3"])
    assert "\n" not in str(info.value)
    # The placeholder is finetune.py's alone: a config built from the defaults trains the
    # default model, and finetune.py's DIR given as an override is taken.
    assert load_config("configs/tiny_moe.py", ["train.steps=3"]).model.init_from == ""


def test_from_pretrained_without_safetensors_names_the_train_extra(released_dir, monkeypatch):
    """A core install (``pip install jaxmp``) has no safetensors: one line, before any work."""
    import sys

    from jaxmp.models import from_pretrained

    monkeypatch.setitem(sys.modules, "safetensors", None)  # import safetensors fails
    with pytest.raises(ImportError, match=r"need safetensors: pip install 'jaxmp\[train\]'") \
            as info:
        from_pretrained(str(released_dir))
    assert "\n" not in str(info.value)
