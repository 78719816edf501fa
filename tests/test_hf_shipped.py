"""The shipped configs map exactly to a Hugging Face family (issue 27, point 4).

configs/tiny_moe.py (shared experts, a sigmoid router with the auxiliary-loss-free bias,
a leading dense layer) is glm4_moe; configs/seed_moe.py (4 softmax experts, top-1) is
mixtral. tiny_moe is trained two steps in-process, exported with ``python -m
jaxmp.export --format hf`` and loaded by transformers' AutoModelForCausalLM and
AutoTokenizer; seed_moe is too large to train, so its config.json is built by transformers
and the model it describes instantiated on torch's meta device (shapes, no weights).
"""
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
transformers = pytest.importorskip("transformers",
                                   reason="the hf extra (transformers) is not installed")

import dataclasses  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jaxmp.models import ModelConfig, MoETransformer, count_params, hf  # noqa: E402
from jaxmp.models.moe import RouterBias  # noqa: E402
from jaxmp.train.config import load_config  # noqa: E402

FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}


def _model_config(name):
    cfg = load_config(f"configs/{name}.py")
    return ModelConfig(**{k: v for k, v in cfg.model.items() if k in FIELDS})


def _meta_model(config_json, tmp_path):
    """transformers' own config object and model (on the meta device) of ``config_json``."""
    (tmp_path / "config.json").write_text(json.dumps(config_json))
    theirs = transformers.AutoConfig.from_pretrained(str(tmp_path))
    with torch.device("meta"):
        return theirs, transformers.AutoModelForCausalLM.from_config(theirs)


@pytest.mark.parametrize("name, family", [("tiny_moe", "glm4_moe"), ("seed_moe", "mixtral")])
def test_shipped_config_maps_to_its_family(name, family, tmp_path):
    """family_of names the family; transformers' model of the config.json has jaxmp's
    parameter count and the fields that fix the architecture."""
    config = _model_config(name)
    assert hf.family_of(config) == family
    theirs, model = _meta_model(hf.config_to_hf(config), tmp_path)
    assert type(model).__name__ == hf.FAMILIES[family].architecture
    total, _ = count_params(nnx.eval_shape(lambda: MoETransformer(config, "fp32",
                                                                  rngs=nnx.Rngs(0))))
    assert sum(p.numel() for p in model.parameters()) == total
    assert (theirs.hidden_size, theirs.num_hidden_layers, theirs.num_attention_heads,
            theirs.vocab_size, theirs.num_experts_per_tok) == (
        config.d_model, config.num_layers, config.num_heads, config.vocab_size, config.top_k)
    assert theirs.rope_parameters["rope_type"] == "default"
    assert theirs.rope_parameters["rope_theta"] == config.rope_theta
    # Glm4MoeConfig defaults to half of each head rotated: the file must say all of it.
    assert theirs.rope_parameters.get("partial_rotary_factor", 1.0) == 1.0
    assert theirs.rms_norm_eps == config.norm_eps and not theirs.tie_word_embeddings
    if family == "glm4_moe":
        assert (theirs.n_shared_experts, theirs.first_k_dense_replace, theirs.n_routed_experts,
                theirs.norm_topk_prob, theirs.routed_scaling_factor, theirs.use_qk_norm,
                theirs.attention_bias) == (1, 1, 4, True, 1.0, False, False)
    else:
        assert (theirs.num_local_experts, theirs.sliding_window) == (4, None)


def test_glm4_moe_without_a_rotary_factor_rotates_half():
    """A GLM config.json that leaves partial_rotary_factor out means transformers' 0.5."""
    c = {"model_type": "glm4_moe", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
         "intermediate_size": 48, "max_position_embeddings": 64, "n_routed_experts": 4,
         "num_experts_per_tok": 2, "moe_intermediate_size": 8, "first_k_dense_replace": 1}
    assert hf.config_from_hf(c)["rope_dim"] == 8
    assert "rope_dim" not in hf.config_from_hf({**c, "partial_rotary_factor": 1.0})


def test_tiny_moe_trains_exports_and_loads_in_transformers(tmp_path):
    """configs/tiny_moe.py as shipped (its model, routing and byte tokenizer), two steps,
    then ``export --format hf``: transformers' logits equal jaxmp's of the trained
    checkpoint, the moved router bias included, and AutoTokenizer encodes as the byte
    tokenizer does."""
    from jaxmp import export
    from jaxmp.train import artifacts
    from jaxmp.train.loop import train_and_evaluate
    from jaxmp.train.tokenizer import ByteTokenizer

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"{i}.txt").write_text(f"def f{i}(x):\n    return x * {i} + 1\n" * 60)
    cfg = load_config("configs/tiny_moe.py", [
        "precision.policy=fp32", f"data.path={corpus}", "train.steps=2", "train.batch_size=4",
        "data.num_eval_batches=0", "data.eval_fraction=0", "train.sample_tokens=0",
        "train.eval_every=0", "train.log_every=1", "optim.warmup_steps=0"])
    run = tmp_path / "run"
    summary = train_and_evaluate(cfg, str(run), num_devices=1)
    assert summary["step"] == 2
    model, _, _ = artifacts.load(str(run))
    biases = [np.asarray(v.get_value()) for _, v in nnx.to_flat_state(nnx.state(model,
                                                                                RouterBias))]
    assert biases and any(np.any(b != 0) for b in biases)  # e_score_correction_bias moved
    out = tmp_path / "hf"
    assert export.main(["--workdir", str(run), "--out", str(out), "--format", "hf"]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "glm4_moe"

    tokens = np.random.RandomState(0).randint(0, 257, (2, 40))
    ours = np.asarray(jax.jit(lambda t: model(t)[0])(jnp.asarray(tokens)), np.float64)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out)).float().eval()
    with torch.no_grad():
        ref = back(torch.tensor(tokens)).logits.double().numpy()
    assert np.abs(ours - ref).max() / np.abs(ref).max() < 2e-4

    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "def f(x):\n\treturn 'héllo' # ü\n"
    assert tok(text)["input_ids"] == ByteTokenizer().encode(text, add_eos=False).tolist()
    assert (tok.eos_token_id, tok.decode(tok(text)["input_ids"])) == (256, text)
