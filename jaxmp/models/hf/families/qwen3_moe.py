"""Qwen3-MoE: Qwen3's attention, a softmax router with ``norm_topk_prob``, dense layers
where ``mlp_only_layers`` or ``decoder_sparse_step`` say; where ``use_sliding_window`` is
true, a sliding window on every layer (transformers' model reads no ``layer_types``).

transformers: ``models/qwen3_moe/configuration_qwen3_moe.py``.
"""
from jaxmp.models.hf.families import qwen3
from jaxmp.models.hf.spec import (BOOL, COMMON_FIELDS, COUNT, COUNT0, INDICES, Family, Field,
                                  common_specs, fixed)

# The routed-expert fields Qwen3-MoE (and GLM-4.5, DeepSeek) read.
ROUTED = dict(num_experts_per_tok=Field(COUNT), moe_intermediate_size=Field(COUNT))
# Routed experts' tensor names: experts.{e}.gate_proj / up_proj / down_proj.
EXPERTS = ("gate_proj", "up_proj", "down_proj")


def _read(vals, hf, out):
    qwen3.read(vals, hf, out)
    dense_layers(vals, out)


def dense_layers(vals, out):
    """``out``'s ``mlp_only_layers``: those config.json names and those
    ``decoder_sparse_step`` leaves dense (transformers: sparse where ``(i + 1) % step ==
    0``)."""
    step = vals["decoder_sparse_step"]
    dense = set(out["mlp_only_layers"])
    if step > 1:  # every layer is sparse at step 1: nothing to enumerate
        dense |= {i for i in range(out["num_layers"]) if (i + 1) % step}
    out["mlp_only_layers"] = tuple(sorted(dense))


def _write(config, hf):
    qwen3.write(config, hf)
    hf["decoder_sparse_step"] = 1


# num_experts and num_local_experts are aliases: either one suffices.
FAMILY = Family(
    "qwen3_moe", "Qwen3MoeForCausalLM",
    "Qwen3-MoE (softmax router, ``norm_topk_prob``, ``mlp_only_layers``, "
    "``decoder_sparse_step``)",
    dict(COMMON_FIELDS, attention_bias="qkv_bias", num_experts="num_experts",
         num_local_experts="num_experts", num_experts_per_tok="top_k",
         moe_intermediate_size="d_expert", norm_topk_prob="norm_topk_prob",
         mlp_only_layers="mlp_only_layers"),
    {"qk_norm": True, "score_fn": "softmax", "num_shared_experts": 0, "first_dense_layers": 0},
    {"block": "mlp", "experts": EXPERTS, "router": "gate"},
    common_specs(max_len=32768, kv_heads=4, window=4096, window_switch=False, windows=True,
                 d_ff=COUNT0,
                 attention_bias=fixed(False), **ROUTED,
                 num_experts=Field(COUNT), num_local_experts=Field(COUNT),
                 norm_topk_prob=Field(BOOL, False),
                 mlp_only_layers=Field(INDICES, None, null=[]),
                 decoder_sparse_step=Field(COUNT, 1)),
    read=_read, write=_write,
    maps=lambda c: (not c.is_mla and c.num_experts and c.score_fn != "sigmoid"
                    and not c.num_shared_experts and c.qk_norm),
    window="uniform")
