"""The family records (jaxmp/models/hf/families/): one module each, collected by
FAMILIES; exactly one family maps any architecture some family holds; the README's
family table lists them all."""
import pathlib
import re

import pytest
from hypothesis import given, settings, strategies as st

from _configs import ROOT
from jaxmp.models import ModelConfig
from jaxmp.models.hf import FAMILIES, config_from_hf, config_to_hf, family_of

MODULES = sorted(p.stem for p in (ROOT / "jaxmp" / "models" / "hf" / "families").glob("*.py")
                 if p.stem != "__init__")


def test_every_family_module_is_collected_under_its_model_type():
    assert sorted(FAMILIES) == MODULES
    assert all(FAMILIES[name].model_type == name for name in MODULES)


def test_the_readme_family_table_lists_every_family():
    readme = pathlib.Path(ROOT / "README.md").read_text()
    table = readme[readme.index("| `model_type` | maps |"):]
    table = table[:table.index("\n\n")]
    listed = set(re.findall(r"`([a-z0-9_]+)`", "\n".join(row.split("|")[1]
                                                         for row in table.splitlines()[2:])))
    assert listed == set(FAMILIES)


# Every architecture switch a family's maps() reads, each value drawn.
_ARCH = dict(
    mla=st.booleans(), experts=st.booleans(), score_fn=st.sampled_from(["softmax", "sigmoid"]),
    shared=st.integers(0, 1), qk_norm=st.booleans(), qkv_bias=st.booleans())


def _config(mla, experts, score_fn, shared, qk_norm, qkv_bias):
    fields = dict(vocab_size=64, num_layers=2, d_model=32, num_heads=4, d_ff=64, max_len=32,
                  qk_norm=qk_norm, qkv_bias=qkv_bias and not mla)
    if mla:
        fields.update(kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                      qk_norm=False)
    if experts:
        fields.update(num_experts=4, top_k=2, d_expert=16, score_fn=score_fn,
                      num_shared_experts=shared)
    return ModelConfig(**fields)


@settings(max_examples=64, deadline=None)
@given(**_ARCH)
def test_at_most_one_family_maps_an_architecture(**arch):
    config = _config(**arch)
    found = [name for name, fam in FAMILIES.items() if fam.maps and fam.maps(config)]
    assert len(found) <= 1, found
    if found:
        assert family_of(config) == found[0]
        # the family writes it, or refuses in one line a field it cannot hold (q/k/v
        # biases in Mixtral, a dense MLA model, norm_topk_prob in DeepSeek-V2, ...)
        try:
            back = config_from_hf(config_to_hf(config, found[0]))
        except ValueError as e:
            assert "\n" not in str(e) and re.match(r"(model\.\w+=|the model does not map to )",
                                                    str(e)), e
        else:
            assert back["num_layers"] == config.num_layers
            assert back["num_experts"] == config.num_experts


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_partial_rotary_is_refused_where_transformers_rotates_the_whole_head(family):
    """transformers' Llama, Qwen2, Qwen3 and Mistral rotate every dimension whatever
    partial_rotary_factor says (an attack measured their logits 1.5e-3 to 0.17 apart from
    jaxmp's partial rotation): such a config.json cannot be represented, and a model with a
    partial rotation is not written as one. GLM-4.5 rotates a part (tests/test_hf.py)."""
    c = {"model_type": family, "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1,
         "num_attention_heads": 4, "intermediate_size": 64, "partial_rotary_factor": 0.5,
         "sliding_window": None}
    with pytest.raises(ValueError, match=rf"^config.json \({family}\): partial_rotary_factor=0.5 "
                                         rf"cannot be represented exactly; allowed: 1.0 "
                                         rf"\(transformers' {family} rotates the whole head\)$"):
        config_from_hf(c)
    model = ModelConfig(vocab_size=64, num_layers=1, d_model=32, num_heads=4, d_ff=64,
                        rope_dim=4)
    with pytest.raises(ValueError, match=r"^the model does not map to llama: the config.json "
                                         r"it would write is refused \(.*partial_rotary"):
        config_to_hf(model, "llama")


def test_an_epsilon_float32_cannot_hold_is_refused():
    c = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1,
         "num_attention_heads": 4, "intermediate_size": 64, "rms_norm_eps": 1e308}
    with pytest.raises(ValueError, match=r"rms_norm_eps=1e\+308 is not allowed; allowed: a "
                                         r"finite number > 0 that float32 holds"):
        config_from_hf(c)
    with pytest.raises(ValueError, match=r"norm_eps=1e\+308"):
        ModelConfig(norm_eps=1e308)


def test_mla_without_experts_maps_to_no_family_in_the_models_words():
    config = ModelConfig(vocab_size=64, num_layers=1, d_model=32, num_heads=4, d_ff=64,
                         kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    with pytest.raises(ValueError, match=r"^model.kv_lora_rank=8 \(MLA\) without routed experts "
                                         r"maps to no family"):
        family_of(config)
