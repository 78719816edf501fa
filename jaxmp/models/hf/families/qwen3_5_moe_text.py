"""Qwen3.5-MoE, text (``qwen3_5_moe_text``): Qwen3-Next's hybrid stack of Gated DeltaNet
and gated attention layers, every layer routed with a gated shared expert, the DeltaNet
input projections kept apart (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
``in_proj_a``: ``model.linear_projections='split'``) and M-RoPE parameters
(``mrope_section``, ``mrope_interleaved``), which on text alone (one position stream for
time, height and width) are plain RoPE. The multi-token-prediction layers (``mtp.*``) are
not read, as transformers does not read them.

transformers: ``models/qwen3_5_moe/configuration_qwen3_5_moe.py`` (``Qwen3_5MoeTextConfig``)
and ``modeling_qwen3_5_moe.py``.
"""
from jaxmp._checks import BOOL, Choice
from jaxmp.models.hf.families import qwen3_next
from jaxmp.models.hf.spec import (ABSENT, COMMON_FIELDS, COUNT, COUNT0, INDICES, Family, Field,
                                  common_specs, fixed, read_field)


def _read(vals, hf, out):
    out["o_bias"] = out["qkv_bias"]
    qwen3_next.hybrid_layers("qwen3_5_moe_text", vals, hf, out)
    qwen3_next.shared_expert("qwen3_5_moe_text", vals, out)
    params = dict(vals["rope_parameters"])  # M-RoPE's keys: checked, then plain RoPE's
    for key, spec in (("mrope_section", Field(INDICES)), ("mrope_interleaved", Field(BOOL))):
        if key in params:
            read_field("qwen3_5_moe_text", f"rope_parameters.{key}", spec, True,
                       params.pop(key))
    vals["rope_parameters"] = params


FAMILY = Family(
    "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM",
    "Qwen3.5-MoE text (Qwen3-Next's hybrid stack, split DeltaNet projections, M-RoPE read "
    "on text)",
    {**{k: v for k, v in COMMON_FIELDS.items() if k != "intermediate_size"},
     **qwen3_next.HYBRID_FIELDS},
    {**qwen3_next.HYBRID_FIXED, "norm_topk_prob": True, "linear_projections": "split"},
    qwen3_next.MOE,
    common_specs(max_len=32768, kv_heads=2, head_dim=256, partial=0.25,
                 attention_bias=Field(BOOL, False), **qwen3_next.HYBRID,
                 num_experts_per_tok=Field(COUNT, 8),
                 intermediate_size=Field(COUNT0, ABSENT),  # no dense layer reads it
                 attn_output_gate=fixed(True),
                 # vLLM's state dtype, which transformers does not read; jaxmp's is float32
                 mamba_ssm_dtype=Field(Choice(("float32",), "float32"), ABSENT, exact=True),
                 mtp_num_hidden_layers=Field(COUNT0, 0),
                 mtp_use_dedicated_embeddings=Field(BOOL, False)),
    read=_read, write=qwen3_next.write, partial_rotary=True,
    maps=qwen3_next.hybrid("split"),
    features=qwen3_next.HYBRID_FEATURES | {"linear_projections"},
    mtp_prefix="mtp.")
