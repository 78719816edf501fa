"""GLM-4.5 (``glm4_moe``): grouped-query attention with partial rotary (0.5 by default),
optional q/k norm and q/k/v biases, DeepSeek-V3's sigmoid router and shared experts.

transformers: ``models/glm4_moe/configuration_glm4_moe.py``.
"""
from jaxmp.models.hf.families import deepseek_v3
from jaxmp.models.hf.families.qwen3_moe import ROUTED
from jaxmp.models.hf.spec import (BOOL, COMMON_FIELDS, COUNT, COUNT0, POSITIVE, Family, Field,
                                  common_specs)


def _write(config, hf):
    hf["attention_bias"] = bool(config.qkv_bias)


FAMILY = Family(
    "glm4_moe", "Glm4MoeForCausalLM",
    "GLM-4.5 (GQA, partial rotary, optional q/k norm and q/k/v biases, the DeepSeek-V3 "
    "router and shared experts)",
    dict(COMMON_FIELDS, attention_bias="qkv_bias", use_qk_norm="qk_norm",
         **{k: v for k, v in deepseek_v3.FIELDS.items()
            if k not in COMMON_FIELDS and "lora" not in k and "head_dim" not in k}),
    {"score_fn": "sigmoid"}, deepseek_v3.MOE,
    common_specs(max_len=131072, kv_heads=8, eps=1e-5, partial=0.5, d_ff=COUNT0, mtp=1,
                 **ROUTED, attention_bias=Field(BOOL, False), use_qk_norm=Field(BOOL, False),
                 n_routed_experts=Field(COUNT), num_local_experts=Field(COUNT),
                 n_shared_experts=Field(COUNT0, 1), first_k_dense_replace=Field(COUNT0, 1),
                 norm_topk_prob=Field(BOOL, True), routed_scaling_factor=Field(POSITIVE, 1.0),
                 n_group=Field(COUNT, 1), topk_group=Field(COUNT, 1)),
    write=_write, partial_rotary=True,
    maps=lambda c: not c.is_mla and c.num_experts and c.score_fn == "sigmoid")
