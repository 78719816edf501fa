"""GPT-OSS: attention sinks, biases on q, k, v and o (``attention_bias``), local
(``sliding_window``) and global layers alternating (``layer_types``; transformers' default:
the even layers slide), yarn RoPE with fractional ramp edges (``truncate: false``), and
routed experts with router and expert biases, a softmax over the chosen top-k logits (the
renormalized softmax) and the clamped SwiGLU (``swiglu_alpha``, ``swiglu_limit``). The
experts are stored stacked, gate and up interleaved in one ``gate_up_proj`` tensor
(:attr:`Family.moe` ``"fused"``).

transformers: ``models/gpt_oss/configuration_gpt_oss.py`` and ``modeling_gpt_oss.py``.
The released checkpoints' MXFP4 experts (``quantization_config: {quant_method: mxfp4}``,
tensors ``*_blocks`` and ``*_scales``) are dequantized as they are read
(:meth:`~jaxmp.models.hf.files.Files.take_mxfp4`) into the run's masters.
"""
from jaxmp._checks import BOOL
from jaxmp.models.hf.spec import (ABSENT, COMMON_FIELDS, COUNT, MAX_LISTED_LAYERS, OBJECT, POSITIVE,
                                  Family, Field, common_specs, not_allowed)

# transformers' GptOssConfig default when config.json gives no RoPE parameters.
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}


def _read(vals, hf, out):
    """``o_bias`` with ``attention_bias``; transformers' defaults of the RoPE parameters
    (yarn) and of ``layer_types`` (the even layers slide)."""
    out["o_bias"] = out["qkv_bias"]
    # transformers: rope_parameters = rope_scaling or rope_parameters, and None takes
    # GptOssConfig's yarn (an empty {} does not: plain RoPE)
    if not hf.get("rope_scaling") and hf.get("rope_parameters") is None:
        vals["rope_parameters"] = dict(DEFAULT_ROPE)
    n = out["num_layers"]
    if out.get("sliding_window") and not vals["layer_types"] and n > 1:
        if n > MAX_LISTED_LAYERS:
            raise not_allowed("gpt_oss", "num_hidden_layers", n,
                              f"at most {MAX_LISTED_LAYERS:,} layers where sliding and global "
                              f"layers alternate (each is listed)")
        out["layer_types"] = tuple("sliding_attention" if (i + 1) % 2 else "full_attention"
                                   for i in range(n))


def _write(config, hf):
    hf["attention_bias"] = bool(config.qkv_bias)
    if not config.sliding_window:  # transformers' GPT-OSS always builds its sliding mask
        hf["sliding_window"] = 128
        hf["layer_types"] = ["full_attention"] * config.num_layers
    if config.rope_scaling == "none":  # else transformers' default would be yarn
        hf["rope_parameters"] = {"rope_type": "default", "rope_theta": config.rope_theta}


FAMILY = Family(
    "gpt_oss", "GptOssForCausalLM",
    "GPT-OSS (attention sinks, q/k/v/o biases, alternating sliding and global layers, "
    "router and expert biases, clamped SwiGLU)",
    dict(COMMON_FIELDS, intermediate_size="d_expert", attention_bias="qkv_bias",
         num_local_experts="num_experts", num_experts="num_experts",  # an alias
         num_experts_per_tok="top_k",
         swiglu_alpha="swiglu_alpha", swiglu_limit="swiglu_limit"),
    {"attention_sinks": True, "moe_bias": True, "expert_activation": "clamped_swiglu",
     "score_fn": "softmax", "norm_topk_prob": True, "num_shared_experts": 0,
     "first_dense_layers": 0},
    {"block": "mlp", "router": "router", "fused": True},
    common_specs(max_len=131072, kv_heads=8, head_dim=64, eps=1e-5, theta=150000.0,
                 window=128, windows=True,
                 attention_bias=Field(BOOL, True),
                 # an integer: transformers' GPT-OSS builds a sliding mask whatever the layers
                 sliding_window=Field(COUNT, 128),
                 num_local_experts=Field(COUNT), num_experts=Field(COUNT),
                 num_experts_per_tok=Field(COUNT),
                 swiglu_alpha=Field(POSITIVE, 1.702), swiglu_limit=Field(POSITIVE, 7.0),
                 rope_parameters=Field(OBJECT, None, null={}),
                 # Written by OpenAI's release beside transformers' own fields, and read by
                 # neither transformers nor jaxmp (num_experts_per_tok and
                 # rope_scaling.original_max_position_embeddings are).
                 experts_per_token=Field(COUNT, ABSENT), initial_context_length=Field(COUNT, ABSENT)),
    read=_read, write=_write,
    maps=lambda c: not c.is_mla and bool(c.num_experts) and c.attention_sinks,
    window="layered",
    features=frozenset({"o_bias", "attention_sinks", "moe_bias", "expert_activation"}),
    quantization=("mxfp4",))
