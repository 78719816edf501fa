"""Hugging Face checkpoints: jaxmp.models.from_pretrained / save_pretrained against transformers.

For each family a tiny random checkpoint is built by transformers itself (torch on the CPU),
with GQA or MLA as the family has, RoPE scaling on, perturbed norms and a nonzero router
bias where the family has one. The reference logits are transformers' own forward pass.
"""
import json
import os
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
transformers = pytest.importorskip("transformers",
                                   reason="the hf extra (transformers) is not installed")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxmp import sharding  # noqa: E402
from jaxmp.models import ModelConfig, MoETransformer, from_pretrained, save_pretrained  # noqa
from jaxmp.models import hf  # noqa: E402
from jaxmp.models.hf import load as hf_load  # noqa: E402

VOCAB = 96
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16)
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16)
FAMILIES = {
    "llama": dict(rope_scaling=LLAMA3, rope_theta=500000.0),
    # Sliding windows shorter than TOKENS' 24: on every layer (Mistral, Mixtral), on the
    # layers from max_window_layers on (Qwen2), on those layer_types names (Qwen3).
    "mistral": dict(sliding_window=8, rope_theta=1e6),
    "qwen2": dict(rope_scaling=YARN, use_sliding_window=True, sliding_window=6,
                  max_window_layers=1),
    "qwen3": dict(head_dim=16, tie_word_embeddings=True, rope_scaling=YARN,
                  use_sliding_window=True, sliding_window=5,
                  layer_types=["sliding_attention", "full_attention"]),
    "qwen3_moe": dict(head_dim=16, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16, norm_topk_prob=False, mlp_only_layers=[1],
                      rope_scaling=YARN),
    # Gemma 3: a local layer (window 5, its own RoPE base) then a global one (linear
    # RoPE scaling); scores by query_pre_attn_scalar, GeGLU, (1 + w) norms.
    "gemma3_text": dict(head_dim=16, query_pre_attn_scalar=12, sliding_window=5,
                        sliding_window_pattern=2, rope_local_base_freq=100.0,
                        rope_scaling=dict(rope_type="linear", factor=4.0)),
    # Gemma 3 multimodal: the text model above inside, a tiny vision tower beside it.
    "gemma3": dict(vision_config=dict(model_type="siglip_vision_model", hidden_size=16,
                                      intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, image_size=28, patch_size=14),
                   mm_tokens_per_image=4),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, rope_scaling=LLAMA3,
                    sliding_window=7),
    "deepseek_v3": dict(num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
                        num_experts_per_tok=2, moe_intermediate_size=16, kv_lora_rank=16,
                        q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                        first_k_dense_replace=1, n_group=4, topk_group=2,
                        routed_scaling_factor=2.5,
                        rope_scaling=dict(YARN, mscale=1.0, mscale_all_dim=0.8)),
    "deepseek_v2": dict(num_key_value_heads=4, n_routed_experts=4, n_shared_experts=2,
                        num_experts_per_tok=2, moe_intermediate_size=16, kv_lora_rank=16,
                        q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                        first_k_dense_replace=1, routed_scaling_factor=1.5,
                        rope_scaling=dict(YARN, mscale=0.707, mscale_all_dim=0.707)),
    # GPT-OSS: sinks, a local then a global layer, yarn with fractional ramp edges, biased
    # router and experts, a clamp small enough to cut (gate and up are ~0.1 here).
    "gpt_oss": dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
                    rope_parameters=dict(YARN, rope_theta=1000.0, beta_fast=32.0,
                                         beta_slow=1.0, truncate=False),
                    swiglu_alpha=1.3, swiglu_limit=0.1),
    # Qwen3-Next: Gated DeltaNet, gated attention (a full layer every second), a dense layer,
    # a shared expert twice the experts' width.
    "qwen3_next": dict(head_dim=16, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=16, shared_expert_intermediate_size=32,
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                       linear_value_head_dim=8, full_attention_interval=2, mlp_only_layers=[1]),
    # Qwen3.5-MoE: Qwen3-Next's stack with split DeltaNet projections and M-RoPE keys (plain
    # RoPE on text), every layer routed.
    "qwen3_5_moe_text": dict(head_dim=16, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=16, shared_expert_intermediate_size=16,
                             linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_key_head_dim=8, linear_value_head_dim=8,
                             # both, as the released configs give them: layer_types read
                             full_attention_interval=4,
                             layer_types=["linear_attention", "full_attention"],
                             rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                                  partial_rotary_factor=0.25,
                                                  mrope_section=[1, 1, 0],
                                                  mrope_interleaved=True)),
    # Qwen3.5-MoE multimodal: the text model above inside, a tiny vision tower beside it.
    "qwen3_5_moe": dict(vision_config=dict(depth=1, hidden_size=16, intermediate_size=32,
                                           num_heads=2, out_hidden_size=32, patch_size=14)),
    "glm4_moe": dict(head_dim=16, partial_rotary_factor=0.5, attention_bias=True,
                     use_qk_norm=True, n_routed_experts=8, n_shared_experts=1,
                     num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1,
                     n_group=2, topk_group=1, routed_scaling_factor=1.8),
}
TOKENS = np.random.RandomState(0).randint(0, VOCAB, (2, 24))


def _hf_logits(model, tokens=TOKENS):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


def _logits(model, tokens=TOKENS):
    """jaxmp's logits, jitted (eager dispatch of every small op is slower than a compile)."""
    return jax.jit(lambda t: model(t)[0])(jnp.asarray(tokens))


def _rel_err(a, ref):
    return float(np.abs(np.asarray(a, np.float64) - ref).max() / np.abs(ref).max())


def _hf_config(family, **fields):
    """transformers' config of a tiny ``family``: BASE and FAMILIES' fields with ``fields``
    over them, for a multimodal wrapper in its ``text_config``."""
    text_of = hf.FAMILIES[family].text_of
    if text_of:  # a wrapper: the text model's fields are its text_config
        text = dict(BASE, **FAMILIES[text_of], model_type=text_of, **fields)
        return transformers.AutoConfig.for_model(family, text_config=text, **FAMILIES[family])
    return transformers.AutoConfig.for_model(family, **{**BASE, **FAMILIES[family], **fields})


def _hf_fp8_model(path):
    """transformers' own load of a blockwise-FP8 directory: on a machine without a GPU it
    dequantizes the weights (its warnings that FP8 wants a GPU silenced), float32."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.float().eval()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory):
    """(family, directory, transformers' logits on TOKENS, jaxmp's model from the directory)."""
    family = request.param
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(family)).float().eval()
    with torch.no_grad():  # norms at 1 and a zero bias would hide a mapping error
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("bias", "sinks", "A_log")):
                p.add_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.1 * torch.randn_like(b))
    path = str(tmp_path_factory.mktemp(family))
    model.save_pretrained(path)
    with warnings.catch_warnings():  # gemma3's skipped vision tensors: their own test
        warnings.simplefilter("ignore", RuntimeWarning)
        ours = from_pretrained(path, "fp32", attention="reference")
    return family, path, _hf_logits(model), ours


def test_every_family_is_compared_with_transformers():
    """A family added to jaxmp.models.hf.FAMILIES gets its parameters here, so that its
    logits are compared with transformers' (the fixture above is parametrized by them)."""
    assert set(FAMILIES) == set(hf.FAMILIES)


def test_from_pretrained_logits_match_transformers(checkpoint):
    family, _, ref, model = checkpoint
    logits, aux = jax.jit(lambda t: model(t))(jnp.asarray(TOKENS))
    assert logits.dtype == jnp.float32 and logits.shape == ref.shape
    assert _rel_err(logits, ref) < 2e-4, family
    assert set(aux) == {"aux_loss", "expert_counts", "dropped_fraction"}


def test_save_pretrained_loads_in_transformers(checkpoint, tmp_path):
    family, _, ref, model = checkpoint
    written = save_pretrained(model, str(tmp_path))
    # Mistral's windows are not Llama's; a multimodal Gemma 3 writes its text model
    assert written == (hf.FAMILIES[family].text_of or family)
    config = json.load(open(tmp_path / "config.json"))
    assert config["model_type"] == written and config["architectures"]
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).float().eval()
    assert _rel_err(_hf_logits(back), ref) < 2e-4


# A MoE with mlp_only_layers and an MLA MoE with a dense layer.
def test_llama_attention_bias_is_four_biases_both_ways(tmp_path):
    """Llama's attention_bias: biases on q, k, v and o (the o_proj bias was refused: jaxmp
    had none). Biases perturbed (transformers starts them at zero, which would hide a
    misplaced one); logits against transformers' both ways, and the model maps to llama."""
    torch.manual_seed(3)
    config = transformers.AutoConfig.for_model("llama", **{**BASE, **FAMILIES["llama"],
                                                          "attention_bias": True})
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.add_(0.5 * torch.randn_like(p))
    model.save_pretrained(str(tmp_path / "src"))
    ours = from_pretrained(str(tmp_path / "src"), "fp32", attention="reference")
    assert ours.config.qkv_bias and ours.config.o_bias
    ref = _hf_logits(model)
    assert _rel_err(_logits(ours), ref) < 2e-4
    assert save_pretrained(ours, str(tmp_path / "out")) == "llama"
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).float().eval()
    assert _rel_err(_hf_logits(back), ref) < 2e-4


@pytest.mark.parametrize("checkpoint", ["gemma3"], indirect=True)
def test_a_multimodal_gemma3_loads_its_text_model_under_either_naming(checkpoint, tmp_path):
    """The vision tower and projector are skipped with a warning naming them; the text
    model reads the same from transformers 5's names (model.language_model.*) and from the
    released files' (language_model.model.*, language_model.lm_head.weight)."""
    from safetensors.numpy import load_file, save_file

    _, path, ref, _ = checkpoint
    with pytest.warns(RuntimeWarning, match=r"tensor\(s\) of the gemma3 checkpoint are not "
                                            r"the text model's .*vision_tower"):
        assert _rel_err(_logits(from_pretrained(path, "fp32", attention="reference")),
                        ref) < 2e-4
    tensors = load_file(os.path.join(path, "model.safetensors"))
    renamed = {}
    for name, x in tensors.items():
        for new, old in (("model.language_model.", "language_model.model."),
                         ("model.vision_tower.", "vision_tower."),
                         ("model.multi_modal_projector.", "multi_modal_projector."),
                         ("lm_head.", "language_model.lm_head.")):
            if name.startswith(new):
                name = old + name[len(new):]
                break
        renamed[name] = x
    assert any(n.startswith("language_model.model.layers.") for n in renamed)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(open(os.path.join(path, "config.json")).read())
    with pytest.warns(RuntimeWarning):
        old = from_pretrained(str(tmp_path), "fp32", attention="reference")
    assert _rel_err(_logits(old), ref) < 2e-4
    # a head stored under the other naming is the head (transformers renames it and uses
    # it): one that differs from the tied embedding is refused, as is a head stored twice
    embed = renamed["language_model.model.embed_tokens.weight"]
    save_file({**renamed, "lm_head.weight": 2 * embed}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"tie_word_embeddings: true, but the checkpoint's "
                                         r"lm_head\.weight differs"):
        from_pretrained(str(tmp_path))
    save_file({**renamed, "lm_head.weight": embed, "language_model.lm_head.weight": embed},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"stores the text model's head twice"):
        from_pretrained(str(tmp_path))
    save_file(renamed, str(tmp_path / "model.safetensors"))
    bad = dict(json.load(open(tmp_path / "config.json")), vocab_size=96)
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"^config\.json \(gemma3\): vocab_size=96 cannot be "
                                         r"represented exactly"):
        from_pretrained(str(tmp_path))


# Qwen3 and Gemma 3: a sliding layer, then a full one (two stacks).
@pytest.mark.parametrize("checkpoint", ["qwen3_moe", "deepseek_v3", "qwen3", "gemma3_text"],
                         indirect=True)
def test_scanned_remat_layout_loads_the_same_logits(checkpoint):
    """The scanned layout (stacked layers, full remat) reads the same tensors."""
    family, path, ref, _ = checkpoint
    model = from_pretrained(path, "fp32", attention="reference", scan_layers=True,
                            remat="full")
    assert _rel_err(_logits(model), ref) < 2e-4, family


@pytest.mark.parametrize("checkpoint", ["qwen3_moe"], indirect=True)  # one family suffices
def test_sharded_checkpoint_both_ways(checkpoint, tmp_path):
    """transformers' own shards are read; ours (tiny max size) are read by transformers."""
    family, path, ref, _ = checkpoint
    model = transformers.AutoModelForCausalLM.from_pretrained(path).float().eval()
    theirs = tmp_path / "theirs"
    model.save_pretrained(str(theirs), max_shard_size="40KB")
    assert (theirs / "model.safetensors.index.json").exists()
    ours = from_pretrained(str(theirs), "fp32", attention="reference")
    assert _rel_err(_logits(ours), ref) < 2e-4
    mine = tmp_path / "mine"
    save_pretrained(ours, str(mine), max_shard_bytes=40_000)
    index = json.load(open(mine / "model.safetensors.index.json"))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files == sorted(
        f for f in os.listdir(mine) if f.endswith(".safetensors"))
    # every shard holds at most the limit unless a single tensor is larger
    from safetensors import safe_open
    for f in files:
        with safe_open(str(mine / f), "np") as s:
            sizes = [s.get_slice(k).get_shape() for k in s.keys()]
        nbytes = [4 * int(np.prod(x)) for x in sizes]
        assert sum(nbytes) <= 40_000 or len(nbytes) == 1
    back = transformers.AutoModelForCausalLM.from_pretrained(str(mine)).float().eval()
    assert _rel_err(_hf_logits(back), ref) < 2e-4


# One family suffices (MLA: split and unsplit axes).
@pytest.mark.parametrize("checkpoint", ["deepseek_v3"], indirect=True)
def test_loads_onto_an_fsdp_mesh_each_device_its_slice(checkpoint):
    """On 8 devices under FSDP rules the embed axis is split and the logits are unchanged;
    each callback asks for its own slice only."""
    family, path, ref, _ = checkpoint
    mesh = sharding.make_mesh(8)
    asked = []
    original = hf_load.read_tensor

    def spy(files, name, kind, shape, index, raw=False):
        out = original(files, name, kind, shape, index, raw)
        asked.append((name, out.size))
        return out

    hf_load.read_tensor = spy
    try:
        model = from_pretrained(path, "fp32", attention="reference", mesh=mesh,
                                rules=sharding.FSDP_RULES)
    finally:
        hf_load.read_tensor = original
    table = model.embed.table[...]
    assert table.sharding.shard_shape(table.shape) == (VOCAB, 32 // 8)
    embed_reads = [n for name, n in asked if name == "model.embed_tokens.weight"]
    assert embed_reads and max(embed_reads) == VOCAB * 32 // 8
    with jax.set_mesh(mesh):
        logits = _logits(model)
    assert _rel_err(logits, ref) < 2e-4


@pytest.mark.parametrize("checkpoint", ["mixtral"], indirect=True)  # one family suffices
def test_mixed_bf16_keeps_float32_masters(checkpoint):
    family, path, ref, _ = checkpoint
    model = from_pretrained(path, "mixed_bf16", attention="reference")
    assert model.blocks[0].attn.wq[...].dtype == jnp.float32
    logits = _logits(model)
    assert logits.dtype == jnp.bfloat16
    assert _rel_err(logits.astype(jnp.float32), ref) < 5e-2  # bfloat16 compute


def _write_config(tmp_path, **fields):
    base = {**BASE, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    base.update(fields)
    (tmp_path / "config.json").write_text(json.dumps(base))
    return str(tmp_path)


@pytest.mark.parametrize("fields, message", [
    (dict(model_type="gemma"), "model_type='gemma' is not supported"),
    (dict(sliding_window=4096), r"\(llama\): sliding_window=4096 cannot be represented"),
    (dict(model_type="mistral", sliding_window=8, layer_types=["sliding_attention",
                                                               "full_attention"]),
     r"layer_types=.* allowed: absent, or sliding_attention for every layer"),
    (dict(model_type="mistral", use_sliding_window=False), r"use_sliding_window=False .*"
                                                           r"allowed: absent"),
    (dict(model_type="qwen2", layer_types=["sliding_attention"]), r"one entry per layer"),
    (dict(model_type="qwen2", layer_types=["chunked_attention"] * 2),
     r"layer_types=\['chunked_attention'"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(mlp_bias=True), "mlp_bias=True"),
    (dict(some_new_field=3), "some_new_field=3"),
    (dict(rope_scaling=dict(rope_type="dynamic", factor=2.0)), "rope_type='dynamic'"),
    (dict(rope_scaling=dict(LLAMA3, extra=1)), "rope_scaling.extra=1"),
])
def test_unrepresentable_config_is_a_one_line_error(tmp_path, fields, message):
    path = _write_config(tmp_path, **fields)
    with pytest.raises(ValueError, match=message) as info:
        from_pretrained(path)
    assert "\n" not in str(info.value)


def test_architecture_override_is_refused(tmp_path):
    path = _write_config(tmp_path)
    with pytest.raises(ValueError, match="num_heads=2.*allowed overrides"):
        from_pretrained(path, num_heads=2)


def test_unmappable_model_is_refused_before_writing(tmp_path):
    """Shared experts with a softmax router and standard attention map to no family
    (configs/tiny_moe.py routes by sigmoid: glm4_moe, tests/test_hf_shipped.py); a Mixtral
    model whose router bias moved cannot be written as Mixtral."""
    import flax.nnx as nnx

    cfg = ModelConfig(vocab_size=VOCAB, num_layers=1, d_model=32, num_heads=4, d_ff=64,
                      max_len=64, num_experts=4, num_shared_experts=1, d_expert=16)
    with pytest.raises(ValueError, match="num_shared_experts=1"):
        save_pretrained(nnx.eval_shape(lambda: MoETransformer(cfg, "fp32", rngs=nnx.Rngs(0))),
                        str(tmp_path / "a"))
    assert not (tmp_path / "a").exists()
    cfg = ModelConfig(vocab_size=VOCAB, num_layers=1, d_model=32, num_heads=4, d_ff=64,
                      max_len=64, num_experts=4, d_expert=16)
    model = nnx.eval_shape(lambda: MoETransformer(cfg, "fp32", rngs=nnx.Rngs(0)))
    model.blocks[0].moe.router.bias.set_value(jnp.full((4,), 0.5, jnp.float32))
    with pytest.raises(ValueError, match="nonzero router bias"):
        save_pretrained(model, str(tmp_path / "b"))
    assert not (tmp_path / "b").exists() or not os.listdir(tmp_path / "b")


def test_token_ids_other_than_the_id_fields_are_refused(tmp_path):
    """save_pretrained's token_ids take only the id fields (those written are read back by
    transformers in test_init_from_trains_and_exports and tests/test_examples_data.py)."""
    import flax.nnx as nnx

    model = nnx.eval_shape(lambda: MoETransformer(ModelConfig(vocab_size=VOCAB, num_layers=1,
                                                              d_model=32, num_heads=4, d_ff=64,
                                                              max_len=64), "fp32",
                                                  rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"^token_ids: \['bos_token'\] are not token id fields"):
        save_pretrained(model, str(tmp_path / "a"), token_ids={"bos_token": 1})
    assert not (tmp_path / "a").exists()


def test_family_mismatch_is_named(tmp_path):
    """A model with q/k norms written as llama would lose them: refused, the field named."""
    import flax.nnx as nnx

    cfg = ModelConfig(vocab_size=VOCAB, num_layers=1, d_model=32, num_heads=4, d_ff=64,
                      max_len=64, qk_norm=True)
    with pytest.raises(ValueError, match="model.qk_norm=True does not map to llama"):
        save_pretrained(nnx.eval_shape(lambda: MoETransformer(cfg, "fp32", rngs=nnx.Rngs(0))),
                        str(tmp_path / "a"), family="llama")
    assert not (tmp_path / "a").exists()


def _char_tokenizer(path):
    """A character-level tokenizer.json (printable ASCII, <unk>, </s>) and a
    tokenizer_config.json naming </s> the end of a document."""
    from tokenizers import Tokenizer, models

    vocab = {chr(i): i - 32 for i in range(32, 127)}
    vocab.update({"<unk>": len(vocab), "</s>": len(vocab) + 1})
    Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>")).save(
        str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return vocab["</s>"]


def test_init_from_trains_and_exports(tmp_path, monkeypatch):
    """configs/finetune.py with model.init_from=DIR (a Qwen3: GQA, q/k norms, tied head):
    the architecture and the tokenizer come from DIR, the weights load onto a 2-device
    mesh, two steps at a learning rate too small to move float32 weights, then
    ``python -m jaxmp.export --format hf``: transformers' logits are the original
    checkpoint's and AutoTokenizer reads the tokenizer with its eos token. A model.* key
    contradicting DIR is refused."""
    from jaxmp import export
    from jaxmp.train.config import load_config
    from jaxmp.train.loop import train_and_evaluate

    torch.manual_seed(2)
    config = transformers.AutoConfig.for_model("qwen3", **{**BASE, **FAMILIES["qwen3"],
                                                          "vocab_size": 128})
    original = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    src = tmp_path / "src"
    original.save_pretrained(str(src))
    eos = _char_tokenizer(src)
    tokens = np.random.RandomState(3).randint(0, 128, (2, 24))
    ref = _hf_logits(original, tokens)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"{i}.txt").write_text(f"def f{i}(x):\n    return x + {i}\n" * 100)
    overrides = [f"model.init_from={src}", "precision.policy=fp32", "data.seq_len=32",
                 "train.batch_size=8", "optim.learning_rate=1e-30", "optim.warmup_steps=0",
                 f"data.path={corpus}", "data.num_eval_batches=0", "data.eval_fraction=0",
                 "model.remat=none", "model.scan_layers=False", "train.steps=2",
                 "train.sample_tokens=0", "train.eval_every=0", "train.log_every=1"]
    cfg = load_config("configs/finetune.py", overrides)
    assert cfg.model.num_experts == 0 and cfg.model.qk_norm and cfg.model.tie_embeddings
    assert cfg.model.num_kv_heads == 2 and cfg.model.head_dim == 16 and cfg.model.vocab_size == 128
    assert cfg.data.tokenizer == str(src / "tokenizer.json") and cfg.data.eod_id == eos
    summary = train_and_evaluate(cfg, str(tmp_path / "run"), num_devices=2)
    assert summary["step"] == 2 and all(np.isfinite(summary["train_losses"]))
    # The run needs nothing of its base once trained: moved away, and read from another
    # directory, the run still loads (architecture from its config, weights from its
    # checkpoint, the tokenizer from its own copy), naming the base by absolute path.
    from jaxmp.train import load

    src.rename(tmp_path / "moved")
    with monkeypatch.context() as m:
        m.chdir(tmp_path / "corpus")
        model, tok, run_cfg = load(os.path.join("..", "run"))
    assert run_cfg.model.init_from == str(src) and (tmp_path / "run" / "tokenizer.json").is_file()
    assert list(tok.encode("ab")) == [ord("a") - 32, ord("b") - 32, eos]
    np.testing.assert_allclose(np.asarray(_logits(model, tokens)), ref, rtol=0, atol=2e-4 * np.abs(ref).max())
    out = tmp_path / "out"
    assert export.main(["--workdir", str(tmp_path / "run"), "--out", str(out),
                        "--format", "hf"]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out)).float().eval()
    assert _rel_err(_hf_logits(back, tokens), ref) < 2e-4
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok.eos_token == "</s>" and tok.convert_tokens_to_ids("</s>") == eos
    # config.json's ids are the tokenizer's, not LlamaConfig's defaults (bos 1, eos 2)
    exported = transformers.AutoConfig.from_pretrained(str(out))
    assert (exported.bos_token_id, exported.eos_token_id) == (None, eos)
    assert tok("ab")["input_ids"] == [ord("a") - 32, ord("b") - 32]
    (tmp_path / "moved").rename(src)
    with pytest.raises(ValueError, match=r"model.num_heads=8 contradicts .*\(4\)"):
        load_config("configs/finetune.py", overrides + ["model.num_heads=8"])


@pytest.mark.parametrize("family", ["gemma3_text", "gemma3", "mistral", "qwen2", "gpt_oss",
                                    "qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe"])
def test_a_new_family_trains_two_steps_from_init_from_and_exports(tmp_path, family):
    """train.py's path (configs/finetune.py, model.init_from=DIR) for the families whose
    windows, norms, sinks, linear attention and experts are new, and the multimodal
    wrappers' text models: two steps on a 2-device mesh with scanned layers (a stack per
    window and layer kind, interleaved where a pattern repeats) at a learning rate too
    small to move float32 weights, then ``export --format hf`` (a wrapper's text family):
    transformers' logits of the export are the original's."""
    from jaxmp import export
    from jaxmp.train.config import load_config
    from jaxmp.train.loop import train_and_evaluate

    torch.manual_seed(4)
    text_of = hf.FAMILIES[family].text_of
    config = _hf_config(family, vocab_size=128)
    original = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in original.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    src = tmp_path / "src"
    original.save_pretrained(str(src))
    _char_tokenizer(src)
    tokens = np.random.RandomState(5).randint(0, 128, (2, 24))
    ref = _hf_logits(original, tokens)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 300)
    cfg = load_config("configs/finetune.py", [
        f"model.init_from={src}", "precision.policy=fp32", "data.seq_len=32",
        "train.batch_size=4", "optim.learning_rate=1e-30", "optim.warmup_steps=0",
        f"data.path={corpus}", "data.num_eval_batches=0", "data.eval_fraction=0",
        "model.remat=none", "model.scan_layers=True", "train.steps=2",
        "train.sample_tokens=0", "train.eval_every=0"])
    assert cfg.model.sliding_window == FAMILIES[text_of or family].get("sliding_window", 0)
    summary = train_and_evaluate(cfg, str(tmp_path / "run"), num_devices=2)
    assert summary["step"] == 2 and all(np.isfinite(summary["train_losses"]))
    out = tmp_path / "out"
    assert export.main(["--workdir", str(tmp_path / "run"), "--out", str(out),
                        "--format", "hf"]) == 0
    assert json.load(open(out / "config.json"))["model_type"] == (text_of or family)
    # the weights as readable as config.json (safetensors alone writes them 0600)
    assert os.stat(out / "model.safetensors").st_mode == os.stat(out / "config.json").st_mode
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out)).float().eval()
    assert _rel_err(_hf_logits(back, tokens), ref) < 2e-4
    fp8_out = ["--workdir", str(tmp_path / "run"), "--out", str(tmp_path / "fp8"),
               "--format", "hf", "--quantize", "fp8"]
    if family == "gpt_oss":  # its released quantization is MXFP4: refused, nothing written
        for argv in (fp8_out, [a for a in fp8_out if a != "hf"][:-3] + ["--quantize", "fp8"]):
            with pytest.raises(SystemExit) as info:  # and a jaxmp export keeps the masters
                export.main(argv)
            assert info.value.code == 2 and not any((tmp_path / "fp8").glob("*.safetensors"))
    elif family == "qwen3_next":  # issue 42, point 3: --format hf --quantize fp8
        pytest.importorskip("accelerate", reason="transformers' FP8 load needs accelerate")
        assert export.main(fp8_out) == 0
        q = json.load(open(tmp_path / "fp8" / "config.json"))["quantization_config"]
        assert (q["quant_method"], q["weight_block_size"]) == ("fp8", [128, 128])
        theirs = _hf_logits(_hf_fp8_model(tmp_path / "fp8"), tokens)
        assert _rel_err(_logits(from_pretrained(str(tmp_path / "fp8"), "fp32",
                                                attention="reference"), tokens), theirs) < 2e-4
        assert _rel_err(theirs, ref) < 0.1  # E4M3's rounding of every projection


RELEASED = {  # parameters (total, active per token) from the model cards, in billions
    "Llama-3.1-8B": (8.03, 8.03),
    "Mixtral-8x7B-v0.1": (46.7, 12.9),
    # OpenAI's card (and the gpt-oss paper's table 1): 20.9B total, 3.6B active; its active
    # count leaves out the input embedding (a lookup), which count_params counts
    "GPT-OSS-20B": (20.9, 3.61),
}
ACTIVE_WITHOUT_EMBEDDING = {"GPT-OSS-20B"}


def test_released_configs_map():
    """configs/hf/*.json (config.json of released models) are represented exactly."""
    import glob

    files = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "configs", "hf",
                                          "*.json")))
    assert len(files) == 9
    for f in files:
        ModelConfig(**hf.config_from_hf(json.load(open(f))))
    # Gemma-3-4B's text_config gives only what differs from transformers' defaults: its
    # model is transformers' reading of the file (8 heads, a 262,208-token vocabulary, a
    # global layer every sixth).
    g = json.load(open(os.path.join(os.path.dirname(files[0]), "Gemma-3-4B.json")))
    theirs = transformers.AutoConfig.for_model("gemma3", **{k: v for k, v in g.items()
                                                           if k != "model_type"}).text_config
    ours = ModelConfig(**hf.config_from_hf(g))
    assert (ours.num_heads, ours.num_kv_heads, ours.vocab_size, ours.head_dim,
            ours.sliding_window, list(ours.layer_types)) == (
        theirs.num_attention_heads, theirs.num_key_value_heads, theirs.vocab_size,
        theirs.head_dim, theirs.sliding_window, theirs.layer_types)


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_released_parameter_counts(name):
    """The model built abstractly from a released config.json has the model card's size."""
    import flax.nnx as nnx

    from jaxmp.models import count_params

    path = os.path.join(os.path.dirname(__file__), "..", "configs", "hf", f"{name}.json")
    cfg = ModelConfig(**hf.config_from_hf(json.load(open(path))), attention="reference",
                      moe_kernel="ragged_dot")
    total, active = count_params(nnx.eval_shape(lambda: MoETransformer(cfg, "mixed_bf16",
                                                                       rngs=nnx.Rngs(0))))
    if name in ACTIVE_WITHOUT_EMBEDDING:
        active -= cfg.vocab_size * cfg.d_model
    assert (round(total / 1e9, 2 if total < 1e10 else 1),
            round(active / 1e9, 2 if active < 1e10 else 1)) == RELEASED[name]


def _near_tie(sp, a, b):
    """SentencePiece's ids ``a`` and the export's ``b`` of one text differ only where
    Unigram segmentations of the same characters score within 1e-2 of each other (float64
    sums of the model's own piece scores)."""
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    j = 0
    while j < min(len(a), len(b)) - i and a[len(a) - 1 - j] == b[len(b) - 1 - j]:
        j += 1
    da, db = a[i:len(a) - j], b[i:len(b) - j]
    same_text = "".join(map(sp.id_to_piece, da)) == "".join(map(sp.id_to_piece, db))
    return same_text and abs(sum(map(sp.get_score, da)) - sum(map(sp.get_score, db))) < 1e-2


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_a_sentencepiece_tokenizer_exports_for_autotokenizer(tmp_path, monkeypatch, kind):
    """export --format hf of a run whose tokenizer is a SentencePiece model: AutoTokenizer
    loads the directory, and its ids are SentencePiece's own on 60 standard-library files
    (a BPE model every token; a Unigram model but near-ties, each checked from the piece
    scores); the end-of-document token is the model's. A model with no exact counterpart
    (a char model) is refused before anything is written."""
    import io
    import pathlib
    import sysconfig

    import flax.nnx as nnx
    spm = pytest.importorskip("sentencepiece")

    from jaxmp.train import artifacts
    from jaxmp.train.tokenizer import SentencePieceTokenizer

    files = sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:90]
    docs = [f.read_text(errors="replace") for f in files]
    docs += ["  two  spaces  ", "\ttab\nnew line ", "é ü 漢字 🙂 \u00a0nbsp", "", "   "]

    def export(kind, out):
        model = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(docs[:30]), model_writer=model,
            vocab_size=300 if kind == "unigram" else 600,
            model_type=kind, eos_id=2, minloglevel=2, hard_vocab_limit=False,
            byte_fallback=kind == "bpe", character_coverage=0.995)
        (tmp_path / f"{kind}.model").write_bytes(model.getvalue())
        tok = SentencePieceTokenizer(tmp_path / f"{kind}.model")
        net = MoETransformer(ModelConfig(vocab_size=320, num_layers=1, d_model=32, num_heads=4,
                                         d_ff=64, max_len=64), "fp32", rngs=nnx.Rngs(0))
        monkeypatch.setattr(artifacts, "read_run",
                            lambda workdir, step, base_dir=None: (net, tok, None, 7, []))
        return artifacts.export_hf(tmp_path / "run", out), tok

    meta, tok = export(kind, tmp_path / "out")
    assert meta == {"family": "llama", "step": 7, "tokenizer": "tokenizer.json"}
    assert (tmp_path / "out" / "tokenizer.model").read_bytes() == tok.model_proto
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert auto.eos_token == "</s>" and auto.eos_token_id == tok.eos_id == 2
    sp, ties = tok.sp, 0
    for doc in docs[30:]:
        a, b = sp.encode(doc), auto(doc, add_special_tokens=False)["input_ids"]
        if a != b:
            assert kind == "unigram" and _near_tie(sp, a, b), doc[:80]
            ties += 1
        if kind == "bpe":  # byte fallback: every text decodes back as SentencePiece has it
            assert auto.decode(b) == sp.decode(a)
    assert ties <= 5
    with pytest.raises(ValueError, match=r"has trainer_spec.model_type=char, which no Hugging "
                                         r"Face tokenizer reproduces exactly"):
        export("char", tmp_path / "out_char")
    assert not (tmp_path / "out_char").exists()


def _mxfp4(w, rng):
    """GPT-OSS's MXFP4 storage of expert tensor ``w`` [E, in, out]: random E2M1 codes
    and E8M0 exponents near ``w``'s scale, as ``(blocks [E, out, in/32, 16] uint8,
    scales [E, out, in/32] uint8)``; the weights they stand for are what transformers'
    own dequantizer makes of them."""
    e, n_in, n_out = w.shape
    blocks = rng.randint(0, 256, (e, n_out, n_in // 32, 16)).astype(np.uint8)
    scales = rng.randint(120, 125, (e, n_out, n_in // 32)).astype(np.uint8)
    return blocks, scales


def test_gpt_oss_mxfp4_experts_load_as_transformers_dequantizes_them(tmp_path):
    """A GPT-OSS checkpoint as OpenAI releases it: experts in MXFP4 (``*_blocks``,
    ``*_scales``, ``quantization_config: {quant_method: mxfp4}``). jaxmp's loader
    dequantizes them into float32 masters; the reference is a transformers model whose
    experts are transformers' ``convert_moe_packed_tensors`` of the same blocks, so the
    layout (nibble order, the transpose, gate/up interleave) is transformers'."""
    from safetensors.numpy import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(6)
    config = transformers.AutoConfig.for_model("gpt_oss", **{**BASE, **FAMILIES["gpt_oss"],
                                                             "hidden_size": 64,
                                                             "intermediate_size": 32})
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    rng = np.random.RandomState(7)
    quantized = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                blocks, scales = _mxfp4(p.numpy(), rng)
                p.copy_(convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales),
                                                   dtype=torch.float32))
                quantized[name] = (blocks, scales)
            elif "norm" in name or name.endswith(("bias", "sinks")):
                p.add_(0.1 * torch.randn_like(p))
    ref = _hf_logits(model)
    tensors = {n: p.detach().numpy() for n, p in model.state_dict().items()
               if n not in quantized}
    for name, (blocks, scales) in quantized.items():
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    config_json = {**json.loads(config.to_json_string()), "quantization_config": {
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                            "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"]}}
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(config_json))
    ours = from_pretrained(str(tmp_path), "fp32", attention="reference")
    assert _rel_err(_logits(ours), ref) < 2e-4
    # the export is unquantized, and transformers reads it as the same model
    save_pretrained(ours, str(tmp_path / "out"))
    assert "quantization_config" not in json.load(open(tmp_path / "out" / "config.json"))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).float()
    assert _rel_err(_hf_logits(back.eval()), ref) < 2e-4
    # one-line refusals: an exponent past float32 (E8M0 255), blocks of the wrong dtype,
    # and MXFP4 tensors without the quantization_config that says what they are
    name = next(iter(quantized))
    for bad, message in (
            ({f"{name}_scales": np.full_like(quantized[name][1], 255)},
             r"MXFP4 tensor .*gate_up_proj has scales beyond float32's range"),
            ({f"{name}_blocks": quantized[name][0].astype(np.int8)},
             r"MXFP4 tensor .*gate_up_proj: .* I8 .*allowed: uint8")):
        save_file({**tensors, **bad}, str(tmp_path / "model.safetensors"),
                  metadata={"format": "pt"})
        with pytest.raises(ValueError, match=message) as info:
            from_pretrained(str(tmp_path), "fp32", attention="reference")
        assert "\n" not in str(info.value)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    del config_json["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config_json))
    with pytest.raises(ValueError, match=r"gate_up_proj' as MXFP4 .*no quantization_config"):
        from_pretrained(str(tmp_path), "fp32", attention="reference")


def _fp8_checkpoint(model, path, block, rng, quantize=None):
    """``model`` written as DeepSeek's FP8 releases are: every projection's weight E4M3
    with a float32 ``weight_scale_inv`` per ``block`` (random scales near the weights'
    own), the rest as it is; ``config.json`` with its ``quantization_config``. Returns
    the names quantized. ``quantize(name)``: which 2-D weights are projections (default
    the names ending ``proj.weight``)."""
    from safetensors.torch import load_file, save_file

    model.save_pretrained(path)  # the checkpoint's own names (per-expert tensors)
    tensors, quantized = {}, []
    for name, p in load_file(os.path.join(path, "model.safetensors")).items():
        if (quantize(name) if quantize else name.endswith("proj.weight")) and p.dim() == 2 \
                and "norm" not in name:
            rows, cols = (-(-n // b) for n, b in zip(p.shape, block))
            scale = torch.tensor(rng.uniform(0.5, 2.0, (rows, cols)), dtype=torch.float32) \
                * p.abs().max() / 448
            full = scale.repeat_interleave(block[0], 0)[:p.shape[0]].repeat_interleave(
                block[1], 1)[:, :p.shape[1]]
            tensors[name] = (p / full).to(torch.float8_e4m3fn)
            tensors[f"{name}_scale_inv"] = scale
            quantized.append(name)
        else:
            tensors[name] = p.contiguous()
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return quantized


def _dequantized(stored, name, block):
    """NumPy float32 ``weight * scale`` of the block each element is in (DeepSeek's
    ``weight_dequant``: blocks of ``block``, the last ones partial)."""
    w = stored[name].float().numpy()
    s = stored[f"{name}_scale_inv"].numpy()
    return w * np.repeat(np.repeat(s, block[0], 0), block[1], 1)[:w.shape[0], :w.shape[1]]


# Blocks that divide every projection of the tiny models (transformers' loader derives the
# block from the scale grid, which only holds then), and DeepSeek-V3 with partial blocks
# (its released kv_a_proj_with_mqa has 576 rows: 4.5 blocks of 128).
@pytest.mark.parametrize("family, block, partial", [("deepseek_v3", (8, 8), False),
                                                    ("qwen3_moe", (8, 16), False),
                                                    ("deepseek_v3", (16, 32), True)])
def test_blockwise_fp8_checkpoints_load_as_transformers_loads_them(family, block, partial,
                                                                   tmp_path):
    """Issue 42, point 1: a blockwise-FP8 checkpoint (E4M3 weights, one float32
    ``weight_scale_inv`` per block, ``quantization_config: {quant_method: fp8}``) loads
    into float32 masters, each exactly ``weight * scale`` of its block; its logits are
    those of transformers' own load of the same files (which dequantizes on a machine
    without a GPU) or, with partial blocks, of transformers' model holding NumPy's
    dequantization; bfloat16 masters under mixed_bf16 to bfloat16's rounding."""
    from safetensors.torch import load_file

    pytest.importorskip("accelerate", reason="transformers' FP8 load needs accelerate")
    torch.manual_seed(8)
    config = _hf_config(family)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    quantized = _fp8_checkpoint(model, str(tmp_path), block, np.random.RandomState(9))
    stored = load_file(str(tmp_path / "model.safetensors"))
    if partial:  # the reference: transformers' model of the NumPy dequantization
        ref_dir = tmp_path / "ref"
        model.save_pretrained(str(ref_dir))
        plain = load_file(str(ref_dir / "model.safetensors"))
        plain.update({n: torch.tensor(_dequantized(stored, n, block)) for n in quantized})
        from safetensors.torch import save_file
        save_file(plain, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(ref_dir))
    else:
        theirs = _hf_fp8_model(tmp_path)
    ref = _hf_logits(theirs.float().eval())
    ours = from_pretrained(str(tmp_path), "fp32", attention="reference")
    assert _rel_err(_logits(ours), ref) < 2e-4
    name = next(n for n in quantized if n.endswith("layers.0.self_attn.o_proj.weight"))
    mine = np.asarray(ours.blocks[0].attn.wo[...])  # [H, h, d]: o_proj.weight [d, H * h]
    np.testing.assert_array_equal(mine.reshape(-1, mine.shape[-1]).T,
                                  _dequantized(stored, name, block).astype(np.float32))
    bf16 = from_pretrained(str(tmp_path), "mixed_bf16", attention="reference")
    assert _rel_err(_logits(bf16), ref) < 3e-2


def test_bad_fp8_checkpoints_are_one_line_errors(tmp_path):
    """Issue 42, point 5: a missing ``weight_scale_inv``, NaN or zero scales, scales of
    the wrong grid, and a ``weight_block_size`` that is not two positive integers are each
    one line naming the tensor or field, before any weight is used."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(10)
    config = transformers.AutoConfig.for_model("llama", **BASE)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    quantized = _fp8_checkpoint(model, str(tmp_path), (8, 8), np.random.RandomState(11))
    good = load_file(str(tmp_path / "model.safetensors"))
    config_json = json.load(open(tmp_path / "config.json"))
    name = quantized[0]
    scale = f"{name}_scale_inv"
    cases = [
        ({scale: None}, {}, rf"tensor {name} has dtype F8_E4M3; .*needs its "
                            rf"{name}_scale_inv and config\.json's quantization_config"),
        ({scale: good[scale] * float("nan")}, {}, rf"tensor {scale} holds non-finite"),
        ({scale: good[scale] * 0}, {}, rf"tensor {scale} holds a scale <= 0"),
        ({scale: good[scale][:1]}, {}, rf"FP8 weight {name} .* allowed: an F8_E4M3 \[out, in\] "
                                       rf"weight and a float scale \[ceil\(out / 8\)"),
        ({}, {"weight_block_size": [128]}, r"quantization_config\.weight_block_size=\[128\] is "
                                           r"not allowed; allowed: \[rows, cols\]"),
        ({}, {"fmt": "e5m2"}, r"quantization_config\.fmt='e5m2' cannot be represented"),
        ({}, {"activation_scheme": "static"}, r"quantization_config\.activation_scheme='static'"),
    ]
    for tensors, quantization, message in cases:
        bad = {k: v for k, v in {**good, **tensors}.items() if v is not None}
        save_file(bad, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
        q = {**config_json["quantization_config"], **quantization}
        (tmp_path / "config.json").write_text(json.dumps({**config_json,
                                                          "quantization_config": q}))
        with pytest.raises(ValueError, match=message) as info:
            from_pretrained(str(tmp_path), "fp32", attention="reference")
        assert "\n" not in str(info.value), message


def _e4m3_reference(w, block):
    """Torch's own E4M3 rounding of ``w [out, in]`` (float32) per ``block``: the scale is
    the block's amax times float32(1 / 448) (DeepSeek-V3's, section 3.3.2; the product
    rounded once, as jaxmp documents), the values ``w * float32(1 / scale)`` cast by
    torch's round-to-nearest-even. Returns ``(E4M3 tensor, float32 scales)``."""
    w = w.float()
    rows, cols = (-(-n // b) for n, b in zip(w.shape, block))
    padded = torch.zeros(rows * block[0], cols * block[1])
    padded[:w.shape[0], :w.shape[1]] = w
    amax = padded.abs().reshape(rows, block[0], cols, block[1]).amax(dim=(1, 3))
    scale = (amax.numpy().astype(np.float32) * np.float32(1 / 448)).astype(np.float32)
    inv = (np.float32(1) / scale).astype(np.float32)
    full = np.repeat(np.repeat(inv, block[0], 0), block[1], 1)[:w.shape[0], :w.shape[1]]
    q = torch.tensor((w.numpy() * full).astype(np.float32)).to(torch.float8_e4m3fn)
    return q, torch.tensor(scale)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "deepseek_v3", "qwen3_next"])
def test_an_fp8_export_is_the_blockwise_checkpoint_transformers_loads(family, tmp_path):
    """Issue 42, point 3: ``save_pretrained(quantize="fp8")`` writes every projection of
    attention (MLA's and Gated DeltaNet's included), MLPs and experts as an E4M3 weight
    and a float32 ``weight_scale_inv`` per block, equal to torch's own rounding of the
    same weights; the router, shared-expert gate, embeddings, norms and head as they were
    (those that are ``nn.Linear`` named in ``modules_to_not_convert``). transformers'
    FP8 load of it and jaxmp's give the same logits."""
    from safetensors.torch import load_file

    pytest.importorskip("accelerate", reason="transformers' FP8 load needs accelerate")
    torch.manual_seed(12)
    config = _hf_config(family)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    model.save_pretrained(str(tmp_path / "src"))
    original = load_file(str(tmp_path / "src" / "model.safetensors"))
    ours = from_pretrained(str(tmp_path / "src"), "fp32", attention="reference")
    block = (8, 8)  # divides every dimension: transformers' CPU loader reads it right
    save_pretrained(ours, str(tmp_path / "fp8"), quantize="fp8", fp8_block=block)
    stored = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    quantized = sorted(n for n, t in stored.items() if t.dtype == torch.float8_e4m3fn)
    # every projection, and nothing else (DeepSeek-V3's release: nn.Linear but the gate)
    router = {"llama": None, "qwen3_moe": "mlp.gate", "deepseek_v3": "mlp.gate",
              "qwen3_next": "mlp.gate"}[family]
    projections = sorted(n for n, t in original.items() if t.dim() == 2 and (
        n.endswith("proj.weight") or n.endswith("proj_with_mqa.weight")
        or ".linear_attn.in_proj" in n) and "shared_expert_gate" not in n)
    assert quantized == projections and quantized
    for name in quantized:
        q, scale = _e4m3_reference(original[name], block)
        assert torch.equal(stored[name].view(torch.uint8), q.view(torch.uint8)), name
        assert torch.equal(stored[f"{name}_scale_inv"], scale), name
    for name, t in original.items():
        if name not in quantized:
            assert torch.equal(stored[name], t), name
    q = json.load(open(tmp_path / "fp8" / "config.json"))["quantization_config"]
    kept = sorted(n.removesuffix(".weight") for n in original if n == "lm_head.weight" or (
        router and (n.endswith(f"{router}.weight") or "shared_expert_gate" in n)))
    assert q == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                 "weight_block_size": list(block), "modules_to_not_convert": kept}
    ref = _hf_logits(_hf_fp8_model(tmp_path / "fp8"))
    back = from_pretrained(str(tmp_path / "fp8"), "fp32", attention="reference")
    assert _rel_err(_logits(back), ref) < 2e-4
    assert _rel_err(ref, _hf_logits(model)) < 0.1  # E4M3's rounding of the projections


def test_an_fp8_export_refuses_what_it_cannot_write(tmp_path):
    torch.manual_seed(13)
    config = transformers.AutoConfig.for_model("llama", **BASE)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path / "src"))
    model = from_pretrained(str(tmp_path / "src"), "fp32", attention="reference")
    for kwargs, message in (
            (dict(quantize="int8"), r"quantize='int8' is not allowed; allowed: None or 'fp8'"),
            (dict(quantize="fp8", fp8_block=(128,)), r"fp8_block=\(128,\) is not allowed")):
        with pytest.raises(ValueError, match=message) as info:
            save_pretrained(model, str(tmp_path / "out"), **kwargs)
        assert "\n" not in str(info.value)
        assert not (tmp_path / "out").exists()  # refused before anything is written
    # a block that a dimension spans more than once without dividing it: a note naming them
    notes = []
    save_pretrained(model, str(tmp_path / "partial"), quantize="fp8", fp8_block=(24, 24),
                    notes=notes)
    assert len(notes) == 1 and "model.layers.0.self_attn.q_proj.weight [32, 32]" in notes[0]
    assert "transformers' CPU loader" in notes[0] and "\n" not in notes[0]
    save_pretrained(model, str(tmp_path / "whole"), quantize="fp8", fp8_block=(16, 16),
                    notes=notes)
    assert len(notes) == 1  # every dimension a multiple of its block, or within one
    wq = model.blocks[0].attn.wq
    wq[...] = wq[...].at[0, 0, 0].set(jnp.nan)
    with pytest.raises(ValueError, match=r"blocks/0/attn/wq holds non-finite values, which "
                                         r"FP8 cannot quantize"):
        save_pretrained(model, str(tmp_path / "nan"), quantize="fp8")
    assert not (tmp_path / "nan").exists()


GPT_OSS_FILE = dict(model_type="gpt_oss", vocab_size=VOCAB, hidden_size=32, intermediate_size=24,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                    max_position_embeddings=64, sliding_window=5)


@pytest.mark.parametrize("change", [
    {},  # no RoPE keys: GptOssConfig's yarn (factor 32, truncate false)
    {"rope_parameters": {}},  # {} is not None: plain RoPE of the default base
    {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},  # original max: max_position
    {"num_experts": 4, "num_local_experts": None},  # transformers' alias
    {"layer_types": ["full_attention", "sliding_attention"]},
], ids=["no_rope", "empty_rope_parameters", "yarn_without_original_max", "num_experts",
        "layer_types"])
def test_gpt_oss_config_files_read_as_transformers_reads_them(change, tmp_path):
    """config.json files as written by hand, each read as transformers' GptOssConfig reads
    it: the logits of jaxmp's load are those of transformers' load of the same file."""
    cfg = {k: v for k, v in {**GPT_OSS_FILE, **change}.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(str(tmp_path)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("bias", "sinks")):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(cfg))  # the file as written above
    ref = _hf_logits(transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval())
    ours = from_pretrained(str(tmp_path), "fp32", attention="reference")
    assert _rel_err(_logits(ours), ref) < 2e-4


def test_a_gpt_oss_without_windows_saves_what_transformers_runs(tmp_path):
    """transformers' GPT-OSS builds its sliding mask whatever the layers: a model without
    windows is written with an integer sliding_window and every layer full_attention,
    and transformers' logits of it are jaxmp's."""
    from flax import nnx

    cfg = ModelConfig(vocab_size=VOCAB, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2,
                      head_dim=16, max_len=64, num_experts=4, top_k=2, d_expert=24, d_ff=0,
                      norm_eps=1e-5, qkv_bias=True, o_bias=True, attention_sinks=True,
                      moe_bias=True, expert_activation="clamped_swiglu", capacity_factor=None,
                      attention="reference", moe_kernel="ragged_dot")
    model = MoETransformer(cfg, "fp32", rngs=nnx.Rngs(0))
    assert save_pretrained(model, str(tmp_path)) == "gpt_oss"
    written = json.load(open(tmp_path / "config.json"))
    assert written["layer_types"] == ["full_attention"] * 2 and written["sliding_window"] >= 1
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).float().eval()
    assert _rel_err(_hf_logits(back), np.asarray(_logits(model), np.float64)) < 2e-4


def test_qwen3_5_mtp_layers_are_skipped(tmp_path):
    """Qwen3.5's and Qwen3-Next's multi-token-prediction layers (``mtp.*``) are not read,
    as transformers does not read them: the checkpoint loads as without them."""
    from safetensors.numpy import load_file, save_file

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        "qwen3_5_moe_text", **{**BASE, **FAMILIES["qwen3_5_moe_text"]})
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    model.save_pretrained(str(tmp_path))
    ref = _hf_logits(model)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["mtp.fc.weight"] = np.ones((32, 64), np.float32)
    tensors["mtp.layers.0.input_layernorm.weight"] = np.ones(32, np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    assert _rel_err(_logits(from_pretrained(str(tmp_path), "fp32", attention="reference")),
                    ref) < 2e-4
    assert _rel_err(_hf_logits(transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path)).float().eval()), ref) < 2e-4


@pytest.mark.parametrize("change", [dict(attention_bias=True),
                                    dict(full_attention_interval=1)],
                         ids=["attention_bias", "no_linear_layer"])
def test_an_odd_qwen3_next_saves_what_transformers_reads(change, tmp_path):
    """A Qwen3-Next with q/k/v/o biases, or with full attention only, loads and saves as
    the qwen3_next it is: transformers' reload gives transformers' logits."""
    torch.manual_seed(1)
    config = transformers.AutoConfig.for_model(
        "qwen3_next", **{**BASE, **FAMILIES["qwen3_next"], **change})
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(tmp_path / "src"))
    ref = _hf_logits(model)
    ours = from_pretrained(str(tmp_path / "src"), "fp32", attention="reference")
    assert _rel_err(_logits(ours), ref) < 2e-4
    assert save_pretrained(ours, str(tmp_path / "out")) == "qwen3_next"
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).float()
    assert _rel_err(_hf_logits(back.eval()), ref) < 2e-4


def test_a_multimodal_qwen3_5_loads_its_text_model(tmp_path):
    """Qwen3_5MoeForConditionalGeneration as transformers saves it (``model.language_model.``,
    a vision tower under ``model.visual.``): jaxmp loads the text model alone, its logits
    the multimodal model's on text, and writes it back as the text family."""
    torch.manual_seed(2)
    text = dict(BASE, **FAMILIES["qwen3_5_moe_text"], model_type="qwen3_5_moe_text")
    config = transformers.AutoConfig.for_model("qwen3_5_moe", text_config=text,
                                               **FAMILIES["qwen3_5_moe"])
    model = transformers.Qwen3_5MoeForConditionalGeneration(config).float().eval()
    model.save_pretrained(str(tmp_path / "src"))
    from safetensors import safe_open
    with safe_open(str(tmp_path / "src" / "model.safetensors"), "np") as f:
        assert any(k.startswith("model.visual.") for k in f.keys())
    ref = _hf_logits(model)
    with pytest.warns(RuntimeWarning, match="not the text model's"):
        ours = from_pretrained(str(tmp_path / "src"), "fp32", attention="reference")
    assert _rel_err(_logits(ours), ref) < 2e-4
    assert save_pretrained(ours, str(tmp_path / "out")) == "qwen3_5_moe_text"
