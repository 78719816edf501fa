"""The family records (jaxmp/models/hf/families/): one module each, collected by
FAMILIES; exactly one family maps any architecture some family holds; the README's
family table lists them all."""
import pathlib
import re

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
            assert "\n" not in str(e) and re.match(r"(model\.\w+=|config\.json \()", str(e)), e
        else:
            assert back["num_layers"] == config.num_layers
            assert back["num_experts"] == config.num_experts
