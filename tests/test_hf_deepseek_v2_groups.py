"""DeepSeek-V2's ``topk_method="group_limited_greedy"`` (a group's score is its best
expert's softmax score) against transformers' DeepseekV2 (torch on the CPU), both ways,
as tests/test_hf.py checks the other families."""
import dataclasses
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
transformers = pytest.importorskip("transformers",
                                   reason="the hf extra (transformers) is not installed")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxmp.models import from_pretrained, hf, save_pretrained  # noqa: E402

VOCAB = 96
CONFIG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
              n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3,
              moe_intermediate_size=16, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8,
              qk_rope_head_dim=8, v_head_dim=8, first_k_dense_replace=1,
              routed_scaling_factor=1.5, topk_method="group_limited_greedy", n_group=4,
              topk_group=2, rope_scaling=dict(rope_type="yarn", factor=4.0,
                                              original_max_position_embeddings=16,
                                              mscale=0.707, mscale_all_dim=0.707))
# top_k > topk_group: with a group's best score as its score, top_k <= topk_group would pick
# the same experts as no group limit (the best experts' groups are the best groups).
TOKENS = np.random.RandomState(0).randint(0, VOCAB, (2, 24))


def _hf_logits(model):
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.double().numpy()


def _logits(model):
    return np.asarray(jax.jit(lambda t: model(t)[0])(jnp.asarray(TOKENS)), np.float64)


def _rel_err(a, ref):
    return float(np.abs(a - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("deepseek_v2", **CONFIG)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("gate.weight"):  # routers spread enough to pick groups apart
                p.copy_(0.5 * torch.randn_like(p))
            if ".experts." in name:  # routed experts that weigh in the logits
                p.mul_(2.0)
    path = tmp_path_factory.mktemp("deepseek_v2_groups")
    model.save_pretrained(str(path))
    return path, _hf_logits(model)


def test_group_limited_greedy_matches_transformers_both_ways(checkpoint, tmp_path):
    path, ref = checkpoint
    model = from_pretrained(str(path), "fp32", attention="reference")
    cfg = model.config
    assert (cfg.n_group, cfg.topk_group, cfg.group_score) == (4, 2, "max")
    assert _rel_err(_logits(model), ref) < 2e-4
    assert save_pretrained(model, str(tmp_path)) == "deepseek_v2"
    written = json.loads((tmp_path / "config.json").read_text())
    assert (written["topk_method"], written["n_group"], written["topk_group"]) == (
        "group_limited_greedy", 4, 2)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).float().eval()
    assert _rel_err(_hf_logits(back), ref) < 2e-4


def test_the_group_score_is_what_differs(checkpoint):
    """The same weights with DeepSeek-V3's group score (its two best) or no group limit
    route otherwise, by more than the test above allows: it tells the rules apart."""
    path, ref = checkpoint
    base = from_pretrained(str(path), "fp32", attention="reference").config
    for change in (dict(group_score="top2_sum"), dict(n_group=1, topk_group=1)):
        other = hf.load_weights(str(path), dataclasses.replace(base, **change), "fp32")
        assert _rel_err(_logits(other), ref) > 5 * 2e-4, change


def test_group_limited_greedy_with_too_few_experts_left_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {**CONFIG, "model_type": "deepseek_v2", "num_experts_per_tok": 5}))
    with pytest.raises(ValueError, match="num_experts_per_tok=5 cannot be represented"):
        from_pretrained(str(tmp_path))
