"""DeepSeek-V3: multi-head latent attention (MLA), a sigmoid router with
``e_score_correction_bias``, group-limited top-k, ``routed_scaling_factor``, shared experts,
``first_k_dense_replace`` dense layers, yarn RoPE with ``mscale``; its multi-token-prediction
layers (``num_nextn_predict_layers``) are not read.

transformers: ``models/deepseek_v3/configuration_deepseek_v3.py``.
"""
from jaxmp.models.hf.families.qwen3_moe import EXPERTS, ROUTED
from jaxmp.models.hf.spec import (BOOL, COMMON_FIELDS, COUNT, COUNT0, POSITIVE, Family, Field,
                                  common_specs, fixed, not_allowed)

# The fields of DeepSeek-V2 and V3 (deepseek_v2 reads them too).
FIELDS = dict(COMMON_FIELDS, n_routed_experts="num_experts", num_local_experts="num_experts",
              n_shared_experts="num_shared_experts", num_experts_per_tok="top_k",
              moe_intermediate_size="d_expert", first_k_dense_replace="first_dense_layers",
              norm_topk_prob="norm_topk_prob", routed_scaling_factor="routed_scaling_factor",
              n_group="n_group", topk_group="topk_group", q_lora_rank="q_lora_rank",
              kv_lora_rank="kv_lora_rank", qk_nope_head_dim="qk_nope_head_dim",
              qk_rope_head_dim="qk_rope_head_dim", v_head_dim="v_head_dim")
SPECS = dict(
    ROUTED, n_routed_experts=Field(COUNT), num_local_experts=Field(COUNT),
    kv_lora_rank=Field(COUNT), q_lora_rank=Field(COUNT, null=0),  # null: a plain q_proj
    qk_nope_head_dim=Field(COUNT), qk_rope_head_dim=Field(COUNT), v_head_dim=Field(COUNT),
    moe_layer_freq=fixed(1), attention_bias=fixed(False))


def read_mla(model_type, hf, out):
    """MLA has one key and value per head: ``num_key_value_heads`` is the head count or
    null, and neither it nor ``head_dim`` is a ModelConfig field of an MLA model."""
    kv = hf.get("num_key_value_heads")
    if kv is not None and kv != out["num_heads"]:
        raise not_allowed(model_type, "num_key_value_heads", kv,
                          f"num_attention_heads ({out['num_heads']}) or null: MLA has a key "
                          f"and value per head (transformers' {model_type} fails on another "
                          f"count)")
    out.pop("head_dim", None)
    out.pop("num_kv_heads", None)


def write_mla(config, hf):
    hf.update(attention_bias=False, q_lora_rank=config.q_lora_rank or None,
              num_key_value_heads=config.num_heads)


def _read(vals, hf, out):
    out["rope_layout"] = "interleaved" if vals["rope_interleave"] else "half"
    read_mla("deepseek_v3", hf, out)


def _write(config, hf):
    write_mla(config, hf)
    hf.update(topk_method="noaux_tc", scoring_func="sigmoid",
              rope_interleave=config.rope_layout == "interleaved")


MOE = {"block": "mlp", "experts": EXPERTS, "router": "gate",
       "bias": "gate.e_score_correction_bias", "shared": "shared_experts"}

FAMILY = Family(
    "deepseek_v3", "DeepseekV3ForCausalLM",
    "DeepSeek-V3 (MLA, sigmoid router with ``e_score_correction_bias``, group-limited "
    "top-k, ``routed_scaling_factor``, shared experts, ``first_k_dense_replace``, yarn RoPE "
    "with ``mscale``)",
    FIELDS, {"score_fn": "sigmoid"}, MOE,
    common_specs(max_len=4096, kv_heads=128, d_ff=COUNT0, mtp=1, **SPECS,
                 n_shared_experts=Field(COUNT0, 1), first_k_dense_replace=Field(COUNT0, 3),
                 norm_topk_prob=Field(BOOL, True, null=False),
                 routed_scaling_factor=Field(POSITIVE, 2.5),
                 n_group=Field(COUNT, 8), topk_group=Field(COUNT, 4),
                 topk_method=fixed("noaux_tc"), scoring_func=fixed("sigmoid"),
                 rope_interleave=Field(BOOL, True)),
    read=_read, write=_write,
    maps=lambda c: c.is_mla and c.num_experts and c.score_fn == "sigmoid")
