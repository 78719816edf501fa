"""Qwen3-Next: Gated DeltaNet linear-attention layers (``linear_attn``) interleaved with
gated full-attention layers (``self_attn``: an output gate from ``q_proj``, zero-centred q/k
norms, partial rotary, 0.25 by default), ``(1 + w)`` norms, routed experts with a softmax
router and a shared expert scaled by ``sigmoid(shared_expert_gate x)``. Without
``layer_types``, every ``full_attention_interval``-th layer is full attention.

transformers: ``models/qwen3_next/configuration_qwen3_next.py`` and
``modeling_qwen3_next.py``.
"""
from jaxmp.models.hf.families import qwen3_moe
from jaxmp.models.hf.spec import (BOOL, COMMON_FIELDS, COUNT, COUNT0, INDICES,
                                  MAX_LISTED_LAYERS, Family, Field, common_specs, inexact,
                                  not_allowed)


def hybrid_layers(model_type, vals, hf, out):
    """``out``'s ``layer_types``: config.json's, or without them every
    ``full_attention_interval``-th layer full attention and the others linear
    (transformers' default)."""
    n = out["num_layers"]
    types = list(vals["layer_types"])
    if not types:
        if n > MAX_LISTED_LAYERS:
            raise not_allowed(model_type, "num_hidden_layers", n,
                              f"at most {MAX_LISTED_LAYERS:,} layers (each is listed)")
        every = vals["full_attention_interval"]
        types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    # with layer_types given, transformers reads them and not full_attention_interval (the
    # released Qwen3.5 configs give both)
    out["layer_types"] = tuple(types)


def shared_expert(model_type, vals, out):
    """``out``'s ``num_shared_experts``: the shared expert's width in experts' widths."""
    shared, width = vals["shared_expert_intermediate_size"], vals["moe_intermediate_size"]
    if shared % width:
        raise inexact(model_type, "shared_expert_intermediate_size", shared,
                      f"a multiple of moe_intermediate_size={width} (jaxmp's shared experts "
                      f"are experts of that width)")
    out["num_shared_experts"] = shared // width


def write(config, hf):
    """The fields Qwen3-Next and Qwen3.5 write beyond their maps."""
    hf["attention_bias"] = bool(config.qkv_bias)
    hf["layer_types"] = list(config.layer_types) or [config.layer_type(i)
                                                     for i in range(config.num_layers)]
    hf["shared_expert_intermediate_size"] = config.num_shared_experts * config.d_expert


def _read(vals, hf, out):
    """``o_bias`` with ``attention_bias``; the layers' kinds; dense layers where
    ``mlp_only_layers`` or ``decoder_sparse_step`` say; the shared expert's width."""
    out["o_bias"] = out["qkv_bias"]
    hybrid_layers("qwen3_next", vals, hf, out)
    qwen3_moe.dense_layers(vals, out)
    shared_expert("qwen3_next", vals, out)


def _write(config, hf):
    write(config, hf)
    hf["decoder_sparse_step"] = 1


# The MoE tensor names (Qwen3.5 keeps them).
MOE = {"block": "mlp", "experts": ("gate_proj", "up_proj", "down_proj"), "router": "gate",
       "shared": "shared_expert", "shared_gate": "shared_expert_gate"}
# The fields of the hybrid stack Qwen3.5 shares, with Qwen3-Next's defaults.
HYBRID = dict(full_attention_interval=Field(COUNT, 4),
              linear_num_key_heads=Field(COUNT, 16), linear_num_value_heads=Field(COUNT, 32),
              linear_key_head_dim=Field(COUNT, 128), linear_value_head_dim=Field(COUNT, 128),
              linear_conv_kernel_dim=Field(COUNT, 4), moe_intermediate_size=Field(COUNT, 512),
              shared_expert_intermediate_size=Field(COUNT, 512), num_experts=Field(COUNT))
HYBRID_FIELDS = dict(attention_bias="qkv_bias", num_experts="num_experts",
                     num_experts_per_tok="top_k", moe_intermediate_size="d_expert",
                     linear_num_key_heads="linear_num_key_heads",
                     linear_num_value_heads="linear_num_value_heads",
                     linear_key_head_dim="linear_key_head_dim",
                     linear_value_head_dim="linear_value_head_dim",
                     linear_conv_kernel_dim="linear_conv_kernel")
HYBRID_FIXED = {"qk_norm": True, "norm_plus_one": True, "attention_output_gate": True,
                "shared_expert_gate": True, "score_fn": "softmax", "first_dense_layers": 0}
HYBRID_FEATURES = frozenset({"norm_plus_one", "linear_attention", "attention_output_gate",
                             "shared_expert_gate", "o_bias"})


def hybrid(projections):
    """``maps`` of a hybrid family: its linear layers' projections, or (a stack of full
    attention alone, which either family can write) Qwen3-Next's gated attention."""
    def maps(c):
        if c.is_mla or not c.num_experts:
            return False
        if "linear_attention" in c.layer_types:
            return c.linear_projections == projections
        return projections == "grouped" and c.attention_output_gate
    return maps

FAMILY = Family(
    "qwen3_next", "Qwen3NextForCausalLM",
    "Qwen3-Next (Gated DeltaNet and gated attention layers, zero-centred norms, partial "
    "rotary, routed experts and a gated shared expert)",
    dict(COMMON_FIELDS, **HYBRID_FIELDS, norm_topk_prob="norm_topk_prob",
         mlp_only_layers="mlp_only_layers"),
    HYBRID_FIXED, MOE,
    common_specs(max_len=32768, kv_heads=2, head_dim=256, partial=0.25, d_ff=COUNT0,
                 attention_bias=Field(BOOL, False), **HYBRID,
                 num_experts_per_tok=Field(COUNT, 10), norm_topk_prob=Field(BOOL, True),
                 mlp_only_layers=Field(INDICES, None, null=[]),
                 decoder_sparse_step=Field(COUNT, 1)),
    read=_read, write=_write, partial_rotary=True,
    maps=hybrid("grouped"), features=HYBRID_FEATURES, mtp_prefix="mtp.")
