"""Hugging Face checkpoints in and out: ``from_pretrained`` and ``save_pretrained``.

Reads and writes the directory layout of transformers' ``save_pretrained``: a
``config.json`` (``model_type``, ``architectures`` and the family's fields) and the
weights as ``model.safetensors`` or as shards ``model-0000i-of-0000n.safetensors`` with a
``model.safetensors.index.json`` (``weight_map``: tensor name -> file). Only ``json``
and ``safetensors`` are used: no torch, no transformers.

Families (``model_type``), one name-mapping table each (:data:`FAMILIES`):

============  =====================================================================
llama         Llama 2/3/3.1 (GQA, ``llama3`` RoPE scaling, tied or untied head)
mistral       Mistral without a sliding window (the llama table)
qwen2         Qwen2 / Qwen2.5 dense (q/k/v biases; no sliding window)
qwen3         Qwen3 dense (per-head q/k RMSNorm, explicit ``head_dim``)
qwen3_moe     Qwen3-MoE (softmax router, ``norm_topk_prob``, ``mlp_only_layers``,
              ``decoder_sparse_step``)
mixtral       Mixtral (softmax top-k router, renormalized gates)
deepseek_v3   DeepSeek-V3 (MLA, sigmoid router with ``e_score_correction_bias``,
              group-limited top-k, ``routed_scaling_factor``, shared experts,
              ``first_k_dense_replace``, yarn RoPE with ``mscale``)
deepseek_v2   DeepSeek-V2 / V2-Lite (MLA, softmax router, ``topk_method`` ``greedy`` or
              ``group_limited_greedy``: a group's score is its best expert's)
glm4_moe      GLM-4.5 (GQA, partial rotary, optional q/k norm and q/k/v biases, the
              DeepSeek-V3 router and shared experts)
============  =====================================================================

What the model computes is checked field by field: a ``config.json`` field this module
does not know, or a value it cannot represent exactly (a sliding window, an activation
other than SiLU, biases on the output projection, FP8-quantized weights, ...) is a
one-line ``ValueError`` naming the field; nothing is approximated. Fields that only
concern training or generation in transformers (``initializer_range``,
``router_aux_loss_coef``, token ids, ``use_cache``, ...) are ignored
(:data:`IGNORED_FIELDS`).

Layouts: transformers' ``nn.Linear`` weight ``[out, in]`` is jaxmp's ``[in, out]``
transposed, with the head axis split out (``q_proj.weight [H * h, d]`` is ``wq [d, H, h]``);
routed experts are stacked (``experts.{e}.gate_proj.weight`` are ``w_gate[e]``). Loading
streams: every parameter is made with ``jax.make_array_from_callback`` on its sharding,
and each callback reads only the rows/columns of its device's slice from the
memory-mapped file (``safe_open(...).get_slice``); host memory holds one slice at a time.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any, Callable, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmp.models.layers import FP8State
from jaxmp.models.moe import RouterBias
from jaxmp.models.transformer import ModelConfig, MoETransformer
from jaxmp.precision import fp8 as fp8_lib

__all__ = ["from_pretrained", "save_pretrained", "config_from_hf", "config_to_hf", "FAMILIES",
           "IGNORED_FIELDS", "MAX_SHARD_BYTES", "RUNTIME_FIELDS", "load_weights", "read_config",
           "family_of", "tokenizer_eos"]

MAX_SHARD_BYTES = 5 * 10 ** 9  # transformers' default max_shard_size="5GB"

# Fields that do not change what the model computes in jaxmp (training or generation
# settings of transformers, metadata).
IGNORED_FIELDS = frozenset({
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version",
    "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "initializer_range",
    "output_router_logits", "router_aux_loss_coef", "aux_loss_alpha", "seq_aux",
    "_name_or_path", "tokenizer_class", "auto_map", "ep_size", "num_nextn_predict_layers",
    "return_dict", "output_hidden_states", "output_attentions", "tie_encoder_decoder",
    "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
    "problem_type", "max_window_layers", "qk_head_dim", "head_dim_for_mla",
})

# (field, value that jaxmp computes, meaning) the config must hold (absent = that value).
_REQUIRED = {
    "hidden_act": "silu", "attention_dropout": 0.0, "mlp_bias": False, "pretraining_tp": 1,
    "sliding_window": None, "use_sliding_window": False, "router_jitter_noise": 0.0,
}


@dataclasses.dataclass(frozen=True)
class Family:
    """One ``model_type``: its architectures name, the fields it reads, the layer table.

    Attributes:
      architecture: the ``architectures`` entry written (``LlamaForCausalLM``, ...).
      fields: ``{config.json field: ModelConfig field}`` read as they are.
      fixed: ModelConfig fields the family always has (``qk_norm=True`` for Qwen3).
      moe: the MoE key names ``{"experts": [...], "router": ..., "bias": ..., "shared": ...}``
        (None: a dense family).
    """

    architecture: str
    fields: Dict[str, str]
    fixed: Dict[str, Any]
    moe: Optional[Dict[str, Any]] = None


_COMMON = {"vocab_size": "vocab_size", "hidden_size": "d_model",
           "num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
           "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim",
           "intermediate_size": "d_ff", "max_position_embeddings": "max_len",
           "rms_norm_eps": "norm_eps", "tie_word_embeddings": "tie_embeddings"}

_QWEN_MOE = {"num_experts": "num_experts", "num_local_experts": "num_experts",
             "num_experts_per_tok": "top_k", "moe_intermediate_size": "d_expert",
             "norm_topk_prob": "norm_topk_prob", "mlp_only_layers": "mlp_only_layers"}

_EXPERTS_GUD = ("gate_proj", "up_proj", "down_proj")

FAMILIES: Dict[str, Family] = {
    "llama": Family("LlamaForCausalLM", dict(_COMMON, attention_bias="qkv_bias"), {}),
    "mistral": Family("MistralForCausalLM", dict(_COMMON), {}),
    "qwen2": Family("Qwen2ForCausalLM", dict(_COMMON), {"qkv_bias": True}),
    "qwen3": Family("Qwen3ForCausalLM", dict(_COMMON, attention_bias="qkv_bias"),
                    {"qk_norm": True}),
    "qwen3_moe": Family("Qwen3MoeForCausalLM",
                        dict(_COMMON, attention_bias="qkv_bias", **_QWEN_MOE),
                        {"qk_norm": True, "score_fn": "softmax", "num_shared_experts": 0,
                         "first_dense_layers": 0},
                        {"block": "mlp", "experts": _EXPERTS_GUD, "router": "gate"}),
    "mixtral": Family("MixtralForCausalLM",
                      dict(_COMMON, num_local_experts="num_experts",
                           num_experts_per_tok="top_k", intermediate_size="d_expert"),
                      {"score_fn": "softmax", "num_shared_experts": 0,
                       "first_dense_layers": 0, "norm_topk_prob": True},
                      {"block": "block_sparse_moe", "experts": ("w1", "w3", "w2"),
                       "router": "gate"}),
    "deepseek_v3": Family("DeepseekV3ForCausalLM",
                          dict(_COMMON, n_routed_experts="num_experts",
                               num_local_experts="num_experts",
                               n_shared_experts="num_shared_experts",
                               num_experts_per_tok="top_k", moe_intermediate_size="d_expert",
                               first_k_dense_replace="first_dense_layers",
                               norm_topk_prob="norm_topk_prob",
                               routed_scaling_factor="routed_scaling_factor",
                               n_group="n_group", topk_group="topk_group",
                               q_lora_rank="q_lora_rank", kv_lora_rank="kv_lora_rank",
                               qk_nope_head_dim="qk_nope_head_dim",
                               qk_rope_head_dim="qk_rope_head_dim", v_head_dim="v_head_dim"),
                          {"score_fn": "sigmoid"},
                          {"block": "mlp", "experts": _EXPERTS_GUD, "router": "gate",
                           "bias": "gate.e_score_correction_bias",
                           "shared": "shared_experts"}),
}
FAMILIES["deepseek_v2"] = Family(
    "DeepseekV2ForCausalLM", dict(FAMILIES["deepseek_v3"].fields),
    {"score_fn": "softmax", "rope_layout": "interleaved", "group_score": "max"},
    {"block": "mlp", "experts": _EXPERTS_GUD, "router": "gate", "shared": "shared_experts"})
FAMILIES["glm4_moe"] = Family(
    "Glm4MoeForCausalLM",
    dict(_COMMON, attention_bias="qkv_bias", use_qk_norm="qk_norm",
         **{k: v for k, v in FAMILIES["deepseek_v3"].fields.items()
            if k not in _COMMON and "lora" not in k and "head_dim" not in k}),
    {"score_fn": "sigmoid"}, FAMILIES["deepseek_v3"].moe)

# Fields a family reads besides FAMILIES[...].fields, checked in config_from_hf.
_FAMILY_CHECKS = {
    "qwen3_moe": {"decoder_sparse_step"},
    "deepseek_v3": {"topk_method", "scoring_func", "rope_interleave", "moe_layer_freq",
                    "attention_bias"},
    "deepseek_v2": {"topk_method", "scoring_func", "moe_layer_freq", "attention_bias"},
    "glm4_moe": set(),
}

_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor")

# The fields from_pretrained's overrides may set: how the model runs, not what it is.
RUNTIME_FIELDS = ("max_len", "attention", "moe_kernel", "scan_layers", "remat",
                  "capacity_factor", "aux_loss_weight", "bias_update_rate")


def _err(model_type: str, field: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"config.json ({model_type}): {field}={value!r} cannot be represented "
                      f"exactly; allowed: {allowed}")


def _rope_fields(model_type: str, hf: Dict[str, Any], out: Dict[str, Any]) -> None:
    """The RoPE fields of ``out`` from the old (``rope_theta`` + ``rope_scaling``) or new
    (``rope_parameters``) transformers layout."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = hf.get("rope_theta", params.pop("rope_theta", 10000.0))
    params.pop("rope_theta", None)
    merged = {**scaling, **params}
    kind = merged.pop("rope_type", merged.pop("type", "default"))
    # transformers' Glm4MoeConfig sets 0.5 where config.json gives no factor.
    partial = merged.pop("partial_rotary_factor", hf.get(
        "partial_rotary_factor", 0.5 if model_type == "glm4_moe" else 1.0))
    out["rope_theta"] = float(theta)
    if partial != 1.0:
        if out.get("kv_lora_rank"):
            raise _err(model_type, "partial_rotary_factor", partial, "1.0 with MLA")
        out["rope_dim"] = int(out["head_dim"] * partial)
        if out["rope_dim"] != out["head_dim"] * partial:
            raise _err(model_type, "partial_rotary_factor", partial,
                       "a factor giving a whole number of rotated dimensions")
    if kind == "default":
        if merged:
            raise _err(model_type, "rope_scaling", merged, "no parameters for rope_type default")
        return
    if kind not in ("llama3", "yarn"):
        raise _err(model_type, "rope_scaling.rope_type", kind, "default, llama3, yarn")
    out["rope_scaling"] = kind
    original = merged.pop("original_max_position_embeddings", None)
    if original is None:
        raise _err(model_type, "rope_scaling.original_max_position_embeddings", None,
                   "an integer")
    out["rope_original_max_len"] = int(original)
    factor = merged.pop("factor", None)
    if factor is None:
        if kind != "yarn":
            raise _err(model_type, "rope_scaling.factor", None, "a number")
        factor = hf["max_position_embeddings"] / original
    out["rope_factor"] = float(factor)
    names = ({"low_freq_factor": "rope_low_freq_factor",
              "high_freq_factor": "rope_high_freq_factor"} if kind == "llama3" else
             {"beta_fast": "rope_beta_fast", "beta_slow": "rope_beta_slow",
              "mscale": "rope_mscale", "mscale_all_dim": "rope_mscale_all_dim"})
    for key, field in names.items():
        if merged.get(key) is not None:
            out[field] = float(merged.pop(key))
        merged.pop(key, None)
    if kind == "yarn":
        if merged.pop("truncate", True) is not True:
            raise _err(model_type, "rope_scaling.truncate", False, "true")
        if merged.get("attention_factor") is not None:
            raise _err(model_type, "rope_scaling.attention_factor", merged["attention_factor"],
                       "unset (derived from factor and mscale)")
        merged.pop("attention_factor", None)
    if merged:
        key = sorted(merged)[0]
        raise _err(model_type, f"rope_scaling.{key}", merged[key], f"the {kind} parameters")


def config_from_hf(hf: Dict[str, Any]) -> Dict[str, Any]:
    """ModelConfig fields for a transformers ``config.json``.

    Args:
      hf: the parsed ``config.json``.

    Returns:
      ``{ModelConfig field: value}`` (every architecture field; runtime fields such as
      ``attention`` are left to the caller).

    Raises:
      ValueError: an unknown ``model_type`` or a field that cannot be represented exactly
        (one line, naming the field and what is allowed).
    """
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"config.json: model_type={model_type!r} is not supported; "
                         f"allowed: {', '.join(FAMILIES)}")
    fam = FAMILIES[model_type]
    known = (set(fam.fields) | IGNORED_FIELDS | set(_REQUIRED) | set(_ROPE_KEYS)
             | _FAMILY_CHECKS.get(model_type, set()) | {"layer_types"})
    for key in hf:
        if key not in known:
            raise _err(model_type, key, hf[key], "the fields jaxmp.models.hf implements "
                                                 "(unknown field)")
    for key, want in _REQUIRED.items():
        if key not in hf or hf[key] == want:
            continue
        if key == "sliding_window" and hf.get("use_sliding_window") is False:
            continue  # Qwen2/3 keep the size with the window switched off
        raise _err(model_type, key, hf[key], repr(want))
    if any(t != "full_attention" for t in hf.get("layer_types") or ()):
        raise _err(model_type, "layer_types", hf["layer_types"], "only full_attention")
    out: Dict[str, Any] = {"num_experts": 0}
    for key, field in fam.fields.items():
        if key in hf and hf[key] is not None:
            out[field] = hf[key]
    out.update(fam.fixed)
    if model_type == "glm4_moe":
        out.setdefault("n_group", 1)
        out.setdefault("topk_group", out["n_group"])
    if model_type == "llama" and out.get("qkv_bias"):
        raise _err(model_type, "attention_bias", True, "false (jaxmp has no o_proj bias)")
    if model_type in ("qwen3", "qwen3_moe") and out.pop("qkv_bias", False):
        raise _err(model_type, "attention_bias", True, "false")
    if model_type == "qwen3_moe":
        step = int(hf.get("decoder_sparse_step", 1))
        dense = set(out.get("mlp_only_layers") or ())
        dense |= {i for i in range(out["num_layers"]) if (i + 1) % step}
        out["mlp_only_layers"] = tuple(sorted(dense))
        out["norm_topk_prob"] = bool(out.get("norm_topk_prob", False))
    if model_type in ("deepseek_v2", "deepseek_v3"):
        v3 = model_type == "deepseek_v3"
        checks = {"topk_method": ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy"),
                  "scoring_func": ("sigmoid" if v3 else "softmax",), "moe_layer_freq": (1,),
                  "attention_bias": (False,)}
        for key, want in checks.items():
            if key in hf and hf[key] not in want:
                raise _err(model_type, key, hf[key], " or ".join(map(repr, want)))
        if not v3 and hf.get("topk_method", "greedy") == "greedy":
            out["n_group"] = out["topk_group"] = 1  # transformers' greedy ignores the groups
        elif not v3 and out.get("num_experts"):  # group_limited_greedy
            per_group = out["num_experts"] // max(1, out.get("n_group") or 1)
            if out.get("top_k", 1) > (out.get("topk_group") or 1) * per_group:
                raise _err(model_type, "num_experts_per_tok", out.get("top_k"),
                           "at most topk_group x the experts of a group (transformers "
                           "would pick masked experts with gate 0)")
        if v3:
            out["rope_layout"] = "interleaved" if hf.get("rope_interleave", True) else "half"
        elif out.get("norm_topk_prob"):  # transformers' DeepseekV2 never normalizes
            raise _err(model_type, "norm_topk_prob", True, "false")
        out.pop("head_dim", None)
        out.pop("num_kv_heads", None)
        out.setdefault("n_group", 1)
        out.setdefault("topk_group", out["n_group"])
        out.setdefault("q_lora_rank", 0)
    if "quantization_config" in hf:
        raise _err(model_type, "quantization_config", hf["quantization_config"], "absent")
    out["tie_embeddings"] = bool(out.get("tie_embeddings", False))
    out.setdefault("head_dim", 0)
    if not out.get("kv_lora_rank"):
        out["head_dim"] = out["head_dim"] or out["d_model"] // out["num_heads"]
    _rope_fields(model_type, hf, out)
    if out["num_experts"]:
        out.setdefault("d_ff", 0)
        out["bias_update_rate"] = 0.0
        out["aux_loss_weight"] = 0.0
        out["capacity_factor"] = None
    return out


def config_to_hf(config: ModelConfig, family: Optional[str] = None,
                 dtype: str = "float32") -> Dict[str, Any]:
    """The ``config.json`` of ``config`` as ``family`` (default: :func:`family_of`).

    Raises:
      ValueError: a field that ``family`` cannot express (named), or no family maps.
    """
    family = family or family_of(config)
    fam = FAMILIES[family]
    c = dataclasses.asdict(config)
    hf: Dict[str, Any] = {"architectures": [fam.architecture], "model_type": family,
                          "torch_dtype": dtype, "hidden_act": "silu"}
    written = set()
    for key, field in fam.fields.items():
        if field in written or (config.is_mla and key in ("head_dim", "num_key_value_heads")):
            continue
        written.add(field)
        value = c[field]
        hf[key] = list(value) if isinstance(value, tuple) else value
    if family in ("qwen3", "qwen3_moe", "llama", "glm4_moe"):
        hf["attention_bias"] = bool(config.qkv_bias)
    if family == "qwen3_moe":
        hf["decoder_sparse_step"] = 1
    if family == "deepseek_v3":
        hf.update(topk_method="noaux_tc", scoring_func="sigmoid", attention_bias=False,
                  rope_interleave=config.rope_layout == "interleaved",
                  q_lora_rank=config.q_lora_rank or None,
                  num_key_value_heads=config.num_heads)
    if family == "deepseek_v2":
        grouped = config.topk_group < config.n_group
        hf.update(topk_method="group_limited_greedy" if grouped else "greedy",
                  attention_bias=False,
                  q_lora_rank=config.q_lora_rank or None,
                  num_key_value_heads=config.num_heads)
    if family == "mixtral":
        hf["intermediate_size"] = config.d_expert
    hf["rope_theta"] = config.rope_theta
    if (config.rope_dim and config.rope_dim != config.head_dim) or family == "glm4_moe":
        hf["partial_rotary_factor"] = (config.rope_dim or config.head_dim) / config.head_dim
    if config.rope_scaling != "none":
        scaling = {"rope_type": config.rope_scaling, "factor": config.rope_factor,
                   "original_max_position_embeddings": config.rope_original_max_len}
        if config.rope_scaling == "llama3":
            scaling.update(low_freq_factor=config.rope_low_freq_factor,
                           high_freq_factor=config.rope_high_freq_factor)
        else:
            scaling.update(beta_fast=config.rope_beta_fast, beta_slow=config.rope_beta_slow)
            if config.rope_mscale:
                scaling["mscale"] = config.rope_mscale
            if config.rope_mscale_all_dim:
                scaling["mscale_all_dim"] = config.rope_mscale_all_dim
        hf["rope_scaling"] = scaling
    back = config_from_hf(hf)  # what the file says must be exactly this model
    rebuilt = ModelConfig(**{**{k: v for k, v in back.items() if k not in RUNTIME_FIELDS},
                             **{f: getattr(config, f) for f in RUNTIME_FIELDS}})
    for field in _relevant_fields(config):
        mine, theirs = getattr(config, field), getattr(rebuilt, field)
        if mine != theirs and not (isinstance(mine, float) and math.isclose(mine, theirs)):
            raise ValueError(f"model.{field}={mine!r} does not map to {family} (its "
                             f"config.json would say {theirs!r})")
    return hf


_MOE_FIELDS = ("num_shared_experts", "top_k", "d_expert", "first_dense_layers", "score_fn",
               "norm_topk_prob", "routed_scaling_factor", "n_group", "topk_group",
               "group_score", "mlp_only_layers")
_MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
               "v_head_dim")


def _relevant_fields(config: ModelConfig) -> List[str]:
    """The architecture fields that change what ``config``'s model computes."""
    skip = set(RUNTIME_FIELDS)
    if not config.num_experts:
        skip |= set(_MOE_FIELDS)
    if config.topk_group == config.n_group:  # routing not group-limited
        skip.add("group_score")
    if config.num_dense_layers == 0:
        skip.add("d_ff")
    if config.is_mla:
        skip |= {"head_dim", "num_kv_heads", "qk_norm", "qkv_bias", "rope_dim"}
    else:
        skip |= set(_MLA_FIELDS)
    if config.rope_scaling == "none":
        skip |= {f.name for f in dataclasses.fields(config)
                 if f.name.startswith("rope_") and f.name not in ("rope_theta", "rope_dim",
                                                                  "rope_layout", "rope_scaling")}
    elif config.rope_scaling == "llama3":
        skip |= {"rope_beta_fast", "rope_beta_slow", "rope_mscale", "rope_mscale_all_dim"}
    else:
        skip |= {"rope_low_freq_factor", "rope_high_freq_factor"}
    return [f.name for f in dataclasses.fields(config) if f.name not in skip]


def family_of(config: ModelConfig) -> str:
    """The family whose architecture is ``config``'s.

    Raises:
      ValueError: none maps (one line, naming the first field in the way).
    """
    if config.is_mla:
        return "deepseek_v3" if config.score_fn == "sigmoid" else "deepseek_v2"
    if config.num_experts:
        if config.score_fn == "sigmoid":
            return "glm4_moe"
        if config.num_shared_experts:
            raise ValueError(f"model.num_shared_experts={config.num_shared_experts} with "
                             f"softmax routing and standard attention maps to no family "
                             f"(deepseek_v2 needs MLA: kv_lora_rank > 0; glm4_moe "
                             f"score_fn='sigmoid')")
        return "qwen3_moe" if config.qk_norm else "mixtral"
    if config.qk_norm:
        return "qwen3"
    return "qwen2" if config.qkv_bias else "llama"


# ---- weights -------------------------------------------------------------------------------


def _safetensors():
    """The ``safetensors`` package (in the ``train`` extra, not in jaxmp's core install).

    Raises:
      ImportError: it is not installed (one line naming the extra).
    """
    try:
        import safetensors
        import safetensors.numpy  # noqa: F401
    except ImportError:
        raise ImportError("Hugging Face checkpoints (jaxmp.models.from_pretrained, "
                          "save_pretrained) need safetensors: pip install 'jaxmp[train]' "
                          "(or pip install safetensors)") from None
    return safetensors


class _Files:
    """The checkpoint's tensors by name over its (possibly sharded) safetensors files."""

    def __init__(self, path: str):
        safe_open = _safetensors().safe_open

        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.exists(single):
            with safe_open(single, "np") as f:
                weight_map = {k: "model.safetensors" for k in f.keys()}
        else:
            raise ValueError(f"{path}: neither model.safetensors nor "
                             f"model.safetensors.index.json found")
        self.path, self.weight_map = path, weight_map
        self._safe_open, self._shapes = safe_open, {}

    def slice(self, name: str):
        """The tensor's lazy slice over a mapping of its file opened for this read only:
        when the slice is dropped the file is unmapped, so the pages read do not stay in
        the process's resident memory (a cached handle kept the whole checkpoint's pages
        resident: benchmarks/hf_load_memory.py)."""
        if name not in self.weight_map:
            raise ValueError(f"{self.path}: the checkpoint has no tensor {name!r}")
        with self._safe_open(os.path.join(self.path, self.weight_map[name]), "np") as f:
            return f.get_slice(name)

    def shape(self, name: str) -> Tuple[int, ...]:
        """The tensor's shape, from its file's header (each file's header is read once)."""
        if name not in self.weight_map:
            raise ValueError(f"{self.path}: the checkpoint has no tensor {name!r}")
        file = self.weight_map[name]
        if file not in self._shapes:
            with self._safe_open(os.path.join(self.path, file), "np") as f:
                self._shapes[file] = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        if name not in self._shapes[file]:
            raise ValueError(f"{self.path}: {file} has no tensor {name!r} (the index says "
                             f"it has)")
        return self._shapes[file][name]


def _norm_index(index, shape):
    return tuple(range(*s.indices(n)) if isinstance(s, slice) else [s]
                 for s, n in zip(index, shape))


# A mapping reads one parameter of jaxmp's shape for a device index from HF tensors.
# kinds: "same" (identical layout), "in" (ours = W[out, in].T, out split into ours[1:]),
# "out" (ours = W[out, in].T, in split into ours[:-1]), "vec" (a vector reshaped).


def _read(files: _Files, name: str, kind: str, shape: Tuple[int, ...], index) -> np.ndarray:
    sl = files.slice(name)
    if kind == "same":
        return np.asarray(sl[index])
    if kind == "vec":
        return np.asarray(sl[:]).reshape(shape)[index]
    if kind == "in":  # ours [in, *out]
        w = np.asarray(sl[:, index[0]])  # [out, in_local]
        return w.T.reshape((w.shape[1],) + tuple(shape[1:]))[(slice(None),) + tuple(index[1:])]
    w = np.asarray(sl[index[-1], :])  # "out": ours [*in, out]; w [out_local, in]
    return w.T.reshape(tuple(shape[:-1]) + (w.shape[0],))[tuple(index[:-1]) + (slice(None),)]


def _layer_table(config: ModelConfig, family: str, i: int) -> Dict[str, Tuple]:
    """``{jaxmp path relative to a block: (hf name(s), kind)}`` for layer ``i``; a tuple of
    names is stacked on a new leading axis (routed experts)."""
    fam = FAMILIES[family]
    p = f"model.layers.{i}"
    t: Dict[str, Tuple] = {
        "attn_norm/scale": (f"{p}.input_layernorm.weight", "same"),
        "ffn_norm/scale": (f"{p}.post_attention_layernorm.weight", "same"),
    }
    a = f"{p}.self_attn"
    if config.is_mla:
        if config.q_lora_rank:
            t["attn/wq_a"] = (f"{a}.q_a_proj.weight", "in")
            t["attn/q_a_norm/scale"] = (f"{a}.q_a_layernorm.weight", "same")
            t["attn/wq_b"] = (f"{a}.q_b_proj.weight", "in")
        else:
            t["attn/wq"] = (f"{a}.q_proj.weight", "in")
        t["attn/wkv_a"] = (f"{a}.kv_a_proj_with_mqa.weight", "in")
        t["attn/kv_a_norm/scale"] = (f"{a}.kv_a_layernorm.weight", "same")
        t["attn/wkv_b"] = (f"{a}.kv_b_proj.weight", "in")
    else:
        for x in "qkv":
            t[f"attn/w{x}"] = (f"{a}.{x}_proj.weight", "in")
            if config.qkv_bias:
                t[f"attn/b{x}"] = (f"{a}.{x}_proj.bias", "vec")
        if config.qk_norm:
            t["attn/q_norm/scale"] = (f"{a}.q_norm.weight", "same")
            t["attn/k_norm/scale"] = (f"{a}.k_norm.weight", "same")
    t["attn/wo"] = (f"{a}.o_proj.weight", "out")
    if config.is_moe_layer(i):
        moe = fam.moe
        b = f"{p}.{moe['block']}"
        g, u, d = moe["experts"]
        experts = range(config.num_experts)
        t["moe/router/kernel"] = (f"{b}.{moe['router']}.weight", "in")
        if "bias" in moe:
            t["moe/router/bias"] = (f"{b}.{moe['bias']}", "same")
        for ours, theirs, kind in (("w_gate", g, "in"), ("w_up", u, "in"),
                                   ("w_down", d, "out")):
            t[f"moe/experts/{ours}"] = (tuple(f"{b}.experts.{e}.{theirs}.weight"
                                              for e in experts), kind)
        if config.num_shared_experts:
            s = f"{b}.{moe['shared']}"
            for ours, theirs, kind in (("w_gate", "gate_proj", "in"), ("w_up", "up_proj", "in"),
                                       ("w_down", "down_proj", "out")):
                t[f"moe/shared_experts/{ours}"] = (f"{s}.{theirs}.weight", kind)
    else:
        m = f"{p}.mlp"
        for ours, theirs, kind in (("w_gate", "gate_proj", "in"), ("w_up", "up_proj", "in"),
                                   ("w_down", "down_proj", "out")):
            t[f"mlp/{ours}"] = (f"{m}.{theirs}.weight", kind)
    return t


def _global_table(config: ModelConfig) -> Dict[str, Tuple]:
    t = {"embed/table": ("model.embed_tokens.weight", "same"),
         "final_norm/scale": ("model.norm.weight", "same")}
    if not config.tie_embeddings:
        t["head/kernel"] = ("lm_head.weight", "in")
    return t


def _param_sources(model: MoETransformer, family: str):
    """``{flat state path: (layers, relative key)}``: where each variable of ``model``
    comes from. ``layers`` is None for a global variable, else the tuple of layer indices
    (one per row of a scanned stack, or ``(i,)`` unscanned with no leading axis)."""
    out = {}
    for path, _ in nnx.to_flat_state(nnx.state(model)):
        path = tuple(str(x) for x in path)
        if path[0] == "blocks":
            out[path] = ((int(path[1]),), "/".join(path[2:]), False)
        elif path[0] == "stacks":
            layers = model.stacks[int(path[1])].layers
            out[path] = (layers, "/".join(path[2:]), True)
        else:
            out[path] = (None, "/".join(path), False)
    return out


def _load_array(files: _Files, config, family, layers, key, stacked, shape, dtype, index):
    """The ``index`` slice of one jaxmp variable, as ``dtype``."""
    idx = _norm_index(index, shape)
    if stacked:
        rows = [layers[j] for j in idx[0]]
        inner = index[1:]
        parts = [_load_array(files, config, family, (l,), key, False, shape[1:], dtype, inner)
                 for l in rows]
        return np.stack(parts).astype(dtype)
    name, kind = _layer_table(config, family, layers[0])[key] if layers else \
        _global_table(config)[key]
    if isinstance(name, tuple):  # stacked experts: leading axis = expert index
        experts = [name[e] for e in idx[0]]
        return np.stack([_read(files, n, kind, shape[1:], tuple(index[1:])) for n in experts]
                        ).astype(dtype)
    return _read(files, name, kind, shape, tuple(index)).astype(dtype)


def _check_shapes(files: _Files, model: MoETransformer, family: str, sources) -> None:
    """Every tensor the model needs exists with the shape jaxmp expects (before loading)."""
    config = model.config
    for path, var in nnx.to_flat_state(nnx.state(model)):
        layers, key, stacked = sources[tuple(str(x) for x in path)]
        table = _global_table(config) if layers is None else _layer_table(config, family,
                                                                         layers[0])
        if key not in table:
            continue
        shape = tuple(var.get_value().shape)[1:] if stacked else tuple(var.get_value().shape)
        for layer in (layers or (None,)):
            tab = table if layer is None else _layer_table(config, family, layer)
            name, kind = tab[key]
            names = name if isinstance(name, tuple) else (name,)
            want = shape[1:] if isinstance(name, tuple) else shape
            expect = {"same": want, "vec": (int(np.prod(want)),),
                      "in": (int(np.prod(want[1:])), want[0]) if want else (),
                      "out": (want[-1], int(np.prod(want[:-1]))) if want else ()}[kind]
            for n in names:
                have = files.shape(n)
                if have != tuple(expect):
                    raise ValueError(f"{files.path}: tensor {n} has shape {list(have)}; the "
                                     f"config.json says {list(expect)} (jaxmp {key})")


def from_pretrained(path: str, policy: Any = "fp32", *, mesh=None, rules=None,
                    **overrides) -> MoETransformer:
    """A :class:`~jaxmp.models.MoETransformer` holding a Hugging Face checkpoint.

    Args:
      path: a directory with ``config.json`` and ``model.safetensors`` or sharded
        ``model-*-of-*.safetensors`` with ``model.safetensors.index.json``.
      policy: the precision policy or rules (e.g. ``"fp32"``, ``"mixed_bf16"``); the
        parameters are created in each module's ``param_dtype`` (float32 masters under the
        presets) from the file's dtype.
      mesh: optional ``jax.sharding.Mesh``; with ``rules`` (a logical-axis rule table of
        :mod:`jaxmp.sharding`) each parameter is placed on its sharding, every device
        reading only its own slice. Without a mesh, on the default device.
      rules: the rule table for ``mesh`` (default :data:`jaxmp.sharding.DATA_PARALLEL_RULES`).
      overrides: ModelConfig fields of :data:`RUNTIME_FIELDS` (``max_len``, ``attention``,
        ``scan_layers``, ``remat``, ...).

    Returns:
      The model; ``model(tokens)`` returns ``(logits, aux)``.

    Raises:
      ValueError: a config.json field that cannot be represented (named), an override
        outside :data:`RUNTIME_FIELDS`, a missing tensor or a tensor of the wrong shape.
      ImportError: safetensors is not installed (the ``train`` extra), before any work.
    """
    _safetensors()
    hf = read_config(path)
    fields = config_from_hf(hf)
    for key in overrides:
        if key not in RUNTIME_FIELDS:
            raise ValueError(f"from_pretrained override {key}={overrides[key]!r}: the "
                             f"architecture comes from config.json; allowed overrides: "
                             f"{', '.join(RUNTIME_FIELDS)}")
    fields.update(overrides)
    return load_weights(path, ModelConfig(**fields), policy, mesh=mesh, rules=rules)


def read_config(path: str) -> Dict[str, Any]:
    """The parsed ``config.json`` of checkpoint directory ``path``.

    Raises:
      ValueError: no readable ``config.json`` there.
    """
    file = os.path.join(path, "config.json")
    try:
        with open(file) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{file}: cannot read the checkpoint's config.json ({e})") from None


def load_weights(path: str, config: ModelConfig, policy: Any = "fp32", *, mesh=None,
                 rules=None) -> MoETransformer:
    """:func:`from_pretrained` with the :class:`ModelConfig` given: ``config``'s architecture
    must be the one ``path``'s config.json describes (the trainer's ``model.init_from``
    checks that first); the tensors' shapes are checked before anything is read.

    Raises:
      ValueError: an unsupported family, a missing tensor or one of the wrong shape.
      ImportError: safetensors is not installed (the ``train`` extra).
    """
    _safetensors()
    hf = read_config(path)
    config_from_hf(hf)
    family = hf["model_type"]
    files = _Files(path)
    abstract = nnx.eval_shape(lambda: MoETransformer(config, policy, rngs=nnx.Rngs(0)))
    sources = _param_sources(abstract, family)
    _check_shapes(files, abstract, family, sources)
    from jaxmp import sharding as shd

    flat = []
    for path_, var in nnx.to_flat_state(nnx.state(abstract)):
        value = var.get_value()
        shape, dtype = tuple(value.shape), value.dtype
        if mesh is not None:
            axes = var.get_metadata().get("out_sharding") or (None,) * len(shape)
            sharding = shd.logical_to_sharding(axes, mesh, rules or shd.DATA_PARALLEL_RULES)
        else:
            sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        layers, key, stacked = sources[tuple(str(x) for x in path_)]
        table = _global_table(config) if layers is None else _layer_table(config, family,
                                                                         layers[0])
        if key in table:
            def callback(index, layers=layers, key=key, stacked=stacked, shape=shape,
                         dtype=dtype):
                return _load_array(files, config, family, layers, key, stacked, shape, dtype,
                                   index)

            array = jax.make_array_from_callback(shape, sharding, callback)
        elif isinstance(var, RouterBias):
            array = jax.device_put(jnp.zeros(shape, dtype), sharding)
        elif isinstance(var, FP8State):
            module = _owner(abstract, path_)
            state = fp8_lib.init_state(module.policy.fp8)
            array = jax.device_put(jnp.broadcast_to(state, shape).astype(dtype), sharding)
        else:
            raise ValueError(f"{family}: no checkpoint tensor maps to jaxmp "
                             f"{'/'.join(map(str, path_))}")
        flat.append((path_, var.replace(array)))
    nnx.update(abstract, nnx.from_flat_state(flat))
    return abstract


def _owner(model, path):
    node = model
    for part in path[:-1]:
        node = node[int(part)] if isinstance(part, int) or str(part).isdigit() else getattr(
            node, str(part))
    return node


def _hf_tensors(model: MoETransformer, family: str):
    """Yields ``(hf name, numpy array)`` for every tensor of ``family``'s checkpoint."""
    config = model.config
    sources = _param_sources(model, family)
    for path, var in nnx.to_flat_state(nnx.state(model)):
        layers, key, stacked = sources[tuple(str(x) for x in path)]
        table = _global_table(config) if layers is None else _layer_table(config, family,
                                                                         layers[0])
        value = var.get_value()
        if key not in table:
            if isinstance(var, (RouterBias, FP8State)):  # zero biases: _check_router_biases
                continue
            raise ValueError(f"jaxmp {'/'.join(map(str, path))} maps to no {family} tensor")
        rows = list(layers) if stacked else [layers[0] if layers else None]
        for j, layer in enumerate(rows):
            v = np.asarray(jax.device_get(value[j] if stacked else value))
            tab = table if layer is None else _layer_table(config, family, layer)
            name, kind = tab[key]
            names = name if isinstance(name, tuple) else (name,)
            for e, n in enumerate(names):
                w = v[e] if isinstance(name, tuple) else v
                if kind == "in":
                    w = w.reshape(w.shape[0], -1).T
                elif kind == "out":
                    w = w.reshape(-1, w.shape[-1]).T
                elif kind == "vec":
                    w = w.reshape(-1)
                yield n, np.ascontiguousarray(w)


def save_pretrained(model: MoETransformer, path: str, *, family: Optional[str] = None,
                    max_shard_bytes: int = MAX_SHARD_BYTES) -> str:
    """Writes ``model`` as a Hugging Face checkpoint that transformers loads.

    ``config.json`` (with ``model_type`` and ``architectures``) and the weights in their
    stored dtype, as ``model.safetensors`` or, past ``max_shard_bytes``, as shards
    ``model-0000i-of-0000n.safetensors`` of at most that size (one tensor larger than it
    gets a shard of its own) with ``model.safetensors.index.json``. Host memory holds at
    most one shard (shards are written as they fill, then renamed ``-of-n``).

    Args:
      model: the model (any layout, any mesh: each tensor is gathered to the host).
      path: the directory (created).
      family: a key of :data:`FAMILIES`; default the one :func:`family_of` finds.
      max_shard_bytes: the shard size limit (transformers' default, 5 GB).

    Returns:
      The family written.

    Raises:
      ValueError: an architecture that maps to no family, or a field or nonzero router
        bias the family cannot hold (one line, named), before anything is written.
      ImportError: safetensors is not installed (the ``train`` extra).
    """
    save_file = _safetensors().numpy.save_file
    family = family or family_of(model.config)
    dtypes = {str(v.dtype) for v in jax.tree.leaves(nnx.state(model, nnx.Param))}
    dtype = "bfloat16" if dtypes == {"bfloat16"} else "float32"
    hf = config_to_hf(model.config, family, dtype)
    _check_router_biases(model, family)  # before anything is written
    os.makedirs(path, exist_ok=True)
    for name in [n for n in os.listdir(path) if re.fullmatch(
            r"model(-\d+-of-\d+|-part-\d+)?\.safetensors(\.index\.json)?", n)]:
        os.remove(os.path.join(path, name))
    parts: List[List[str]] = []
    current: Dict[str, np.ndarray] = {}
    size = total = 0

    def flush():
        file = os.path.join(path, f"model-part-{len(parts):05d}.safetensors")
        save_file(current, file, metadata={"format": "pt"})
        parts.append(list(current))

    for name, w in _hf_tensors(model, family):
        if current and size + w.nbytes > max_shard_bytes:
            flush()
            current, size = {}, 0
        current[name] = w
        size += w.nbytes
        total += w.nbytes
    flush()
    n = len(parts)
    if n == 1:
        os.replace(os.path.join(path, "model-part-00000.safetensors"),
                   os.path.join(path, "model.safetensors"))
    else:
        weight_map = {}
        for i, names in enumerate(parts):
            file = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(path, f"model-part-{i:05d}.safetensors"),
                       os.path.join(path, file))
            weight_map.update({name: file for name in names})
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f,
                      indent=2, sort_keys=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)
    return family


def _check_router_biases(model: MoETransformer, family: str) -> None:
    if "bias" in (FAMILIES[family].moe or {}):
        return
    for path, var in nnx.to_flat_state(nnx.state(model, RouterBias)):
        if np.any(np.asarray(jax.device_get(var.get_value())) != 0):
            raise ValueError(f"{'/'.join(map(str, path))}: a nonzero router bias (auxiliary-"
                             f"loss-free balancing); {family} has no router bias")


def tokenizer_eos(path: str) -> Optional[Tuple[str, int]]:
    """``(tokenizer.json path, eos id)`` of a checkpoint directory, or None without a
    ``tokenizer.json``. The id is that of ``tokenizer_config.json``'s ``eos_token``, looked
    up in the tokenizer (None when there is no such file or token: the tokenizer's own
    choice, :data:`jaxmp.train.tokenizer.EOS_CANDIDATES`).

    Raises:
      ValueError: an ``eos_token`` that the tokenizer does not have.
    """
    file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(file):
        return None
    eos = None
    config = os.path.join(path, "tokenizer_config.json")
    if os.path.exists(config):
        with open(config) as f:
            eos = json.load(f).get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if not eos:
        return file, None
    from tokenizers import Tokenizer

    eos_id = Tokenizer.from_file(file).token_to_id(eos)
    if eos_id is None:
        raise ValueError(f"{config}: eos_token={eos!r} is not in {file}")
    return file, int(eos_id)
