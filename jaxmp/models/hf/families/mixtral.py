"""Mixtral: a softmax top-k router with renormalized gates; experts ``w1`` / ``w3`` / ``w2``
of size ``intermediate_size``; a sliding window on every layer where ``sliding_window``
is not null (transformers' default: null).

transformers: ``models/mixtral/configuration_mixtral.py``.
"""
from jaxmp.models.hf.spec import COMMON_FIELDS, COUNT, Family, Field, common_specs

FAMILY = Family(
    "mixtral", "MixtralForCausalLM",
    "Mixtral (softmax top-k router, renormalized gates)",
    dict(COMMON_FIELDS, num_local_experts="num_experts", num_experts_per_tok="top_k",
         intermediate_size="d_expert"),
    {"score_fn": "softmax", "num_shared_experts": 0, "first_dense_layers": 0,
     "norm_topk_prob": True},
    {"block": "block_sparse_moe", "experts": ("w1", "w3", "w2"), "router": "gate"},
    common_specs(max_len=131072, kv_heads=8, eps=1e-5, theta=1e6, windows=True,
                 num_local_experts=Field(COUNT), num_experts_per_tok=Field(COUNT)),
    maps=lambda c: (not c.is_mla and c.num_experts and c.score_fn != "sigmoid"
                    and not c.num_shared_experts and not c.qk_norm),
    window="uniform")
