"""The architecture features of open model families (GQA, q/k norms, biases, tied head, RoPE
layouts and scalings, MLA, router options), without transformers: equivalences that hold
by construction, every precision policy, and the one-line config errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmp.models import ModelConfig, MoETransformer

BASE = dict(vocab_size=64, num_layers=2, d_model=32, num_heads=4, d_ff=64, max_len=32,
            attention="reference", moe_kernel="ragged_dot")
TOKENS = jax.random.randint(jax.random.key(0), (2, 16), 0, 64)


def _logits(model):
    return np.asarray(jax.jit(lambda t: model(t)[0])(TOKENS), np.float64)


def test_gqa_equals_mha_with_repeated_key_value_heads():
    """K key/value heads are H heads whose k/v projections repeat each of the K
    (query head n reads head n // (H / K)): Ainslie et al. 2023."""
    gqa = MoETransformer(ModelConfig(**BASE, num_kv_heads=2), "fp32", rngs=nnx.Rngs(0))
    mha = MoETransformer(ModelConfig(**BASE), "fp32", rngs=nnx.Rngs(1))
    for g, m in zip(gqa.blocks, mha.blocks):
        for name in ("wq", "wo"):
            getattr(m.attn, name)[...] = getattr(g.attn, name)[...]
        for name in ("wk", "wv"):
            getattr(m.attn, name)[...] = jnp.repeat(getattr(g.attn, name)[...], 2, axis=1)
        for part in ("attn_norm", "ffn_norm", "mlp"):
            nnx.update(getattr(m, part), nnx.state(getattr(g, part)))
    for part in ("embed", "final_norm", "head"):
        nnx.update(getattr(mha, part), nnx.state(getattr(gqa, part)))
    np.testing.assert_allclose(_logits(gqa), _logits(mha), rtol=1e-6, atol=1e-6)


def test_interleaved_rope_is_half_split_with_permuted_projections():
    """Rotating pairs (2i, 2i+1) is rotating (i, i + h/2) after the same permutation of the
    q and k output dimensions; q.k is unchanged by it."""
    h = 8
    perm = np.concatenate([np.arange(0, h, 2), np.arange(1, h, 2)])
    inter = MoETransformer(ModelConfig(**BASE, rope_layout="interleaved"), "fp32",
                           rngs=nnx.Rngs(0))
    half = MoETransformer(ModelConfig(**BASE), "fp32", rngs=nnx.Rngs(0))
    for b_i, b_h in zip(inter.blocks, half.blocks):
        for name in ("wq", "wk"):
            getattr(b_h.attn, name)[...] = getattr(b_i.attn, name)[...][..., perm]
    assert not np.allclose(_logits(MoETransformer(ModelConfig(**BASE), "fp32",
                                                  rngs=nnx.Rngs(0))), _logits(inter))
    np.testing.assert_allclose(_logits(half), _logits(inter), rtol=1e-5, atol=1e-5)


def test_tied_head_is_the_embedding_table():
    model = MoETransformer(ModelConfig(**BASE, tie_embeddings=True), "fp32", rngs=nnx.Rngs(0))
    assert not hasattr(model, "head")
    h = jnp.ones((1, 1, 32), jnp.float32)
    np.testing.assert_allclose(np.asarray(model.embed.attend(h))[0, 0],
                               np.asarray(model.embed.table[...], np.float64).sum(-1),
                               rtol=1e-5)


FEATURES = {
    "gqa_qknorm_bias_tied_moe": dict(
        d_model=128, num_heads=2, num_kv_heads=1, head_dim=128, qk_norm=True, qkv_bias=True,
        o_bias=True, tie_embeddings=True, num_experts=4, top_k=2, d_expert=128, norm_topk_prob=False,
        mlp_only_layers=(1,), rope_scaling="yarn", rope_factor=4.0, rope_original_max_len=16,
        rope_dim=64),
    "mla_grouped_router": dict(
        d_model=128, num_heads=2, kv_lora_rank=128, q_lora_rank=128, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, num_experts=4, num_shared_experts=1,
        d_expert=128, first_dense_layers=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, score_fn="sigmoid", rope_layout="interleaved",
        rope_scaling="llama3", rope_factor=8.0, rope_original_max_len=16),
    # Gemma 3's: (1 + w) norms before and after each branch, GeGLU, a scaled embedding,
    # query_pre_attn_scalar, local and global layers with their own RoPE.
    "gemma3_local_global": dict(
        d_model=128, num_heads=2, num_kv_heads=1, head_dim=128, qk_norm=True,
        tie_embeddings=True, norm_plus_one=True, post_norms=True, embed_scale=128 ** 0.5,
        query_pre_attn_scalar=96.0, mlp_activation="gelu_tanh", sliding_window=5,
        layer_types=("sliding_attention", "full_attention"), rope_local_theta=100.0,
        rope_scaling="linear", rope_factor=4.0),
    # GPT-OSS's: sinks, q/k/v/o biases, alternating windows, yarn with fractional ramp
    # edges, router and expert biases, the clamped SwiGLU.
    "gpt_oss_sinks_biased_experts": dict(
        d_model=128, num_heads=2, num_kv_heads=1, head_dim=128, qkv_bias=True, o_bias=True,
        attention_sinks=True, sliding_window=5,
        layer_types=("sliding_attention", "full_attention"), num_experts=4, top_k=2,
        d_expert=128, moe_bias=True, expert_activation="clamped_swiglu", swiglu_limit=0.5,
        rope_scaling="yarn", rope_factor=4.0, rope_original_max_len=16, rope_truncate=False),
    # Qwen3-Next's: Gated DeltaNet and gated attention layers, zero-centred norms, partial
    # rotary, a gated shared expert.
    "qwen3_next_linear_gated": dict(
        d_model=128, num_heads=2, num_kv_heads=1, head_dim=128, qk_norm=True,
        norm_plus_one=True, attention_output_gate=True, rope_dim=32,
        layer_types=("linear_attention", "full_attention"), linear_num_key_heads=1,
        linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128,
        num_experts=4, top_k=2, d_expert=128, num_shared_experts=1, shared_expert_gate=True),
}


def _loss_and_grads(cfg, policy):
    model = MoETransformer(cfg, policy, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def loss(state):
        logits, aux = nnx.merge(graphdef, state)(TOKENS)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        return -jnp.mean(jnp.take_along_axis(logp, TOKENS[..., None], -1)) + aux["aux_loss"]

    return jax.jit(jax.value_and_grad(loss))(state)


@pytest.fixture(scope="module", params=sorted(FEATURES))
def fp32_loss(request):
    cfg = ModelConfig(**{**BASE, **FEATURES[request.param]})
    return cfg, float(_loss_and_grads(cfg, "fp32")[0])


@pytest.mark.parametrize("policy", ["mixed_bf16; router: fp32; norm: fp32",
                                    "fp8_blockwise; router: fp32; norm: fp32"])
def test_features_run_under_mixed_and_fp8_policies(fp32_loss, policy):
    """Every feature under bfloat16 and blockwise FP8 (the q/k and latent norms are float32
    islands by the ``norm`` pattern): the loss is the float32 loss to a low-precision
    tolerance, every gradient finite."""
    cfg, ref = fp32_loss
    loss, grads = _loss_and_grads(cfg, policy)
    assert abs(float(loss) - ref) < 2e-2 * abs(ref)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("fields, message", [
    (dict(num_kv_heads=3), "num_kv_heads=3 must divide num_heads=4"),
    (dict(head_dim=7), "head_dim=7 must be even"),
    (dict(rope_dim=10), "rope_dim=10 must be even and at most head_dim=8"),
    (dict(rope_scaling="dynamic"), "rope_scaling='dynamic' must be one of none, linear, "
                                   "llama3, yarn"),
    (dict(rope_scaling="linear", rope_factor=0.0), "rope_scaling='linear' needs rope_factor > 0"),
    (dict(mlp_activation="relu"), "mlp_activation='relu' must be one of silu, gelu_tanh"),
    (dict(expert_activation="gelu"), "expert_activation='gelu' must be one of silu, "
                                     "clamped_swiglu"),
    (dict(swiglu_limit=0.0), "swiglu_limit=0.0"),
    (dict(rope_local_theta=10.0), "rope_local_theta=10.0 is the base of sliding-window layers, "
                                  "and sliding_window=0"),
    (dict(rope_scaling="yarn", rope_factor=4.0), "rope_original_max_len >= 1"),
    (dict(num_experts=4, d_expert=8, n_group=3), "n_group=3 must divide num_experts=4"),
    (dict(mlp_only_layers=(5,)), r"mlp_only_layers=\[5\] must be layer indices"),
    (dict(kv_lora_rank=8, qk_rope_head_dim=4, v_head_dim=4),
     "qk_nope_head_dim=0 must be >= 1 with kv_lora_rank > 0"),
])
def test_bad_feature_values_are_named(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**BASE, **fields})


def test_head_dim_frees_d_model_from_num_heads():
    cfg = ModelConfig(**{**BASE, "d_model": 30, "num_heads": 4, "head_dim": 8})
    model = MoETransformer(cfg, "fp32", rngs=nnx.Rngs(0))
    assert model.blocks[0].attn.wq[...].shape == (30, 4, 8)
    assert model.blocks[0].attn.wo[...].shape == (4, 8, 30)
