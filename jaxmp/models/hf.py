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

A checkpoint directory from outside is checked, not trusted; each fault is a one-line
``ValueError`` naming the file, field or tensor and what is allowed, raised before work
is lost:

* ``config.json``: each family's table of fields (:attr:`Family.specs`, one
  :class:`Field` each: type, range, default) requires the shape fields and those
  transformers has no default for, fills the others with transformers' default for that
  family (never jaxmp's), and refuses a null, an ill-typed value (an integer is not a
  bool, a real is finite) or one out of range; no number anywhere may be NaN or infinite.
  Two fields naming one value must agree (a top-level ``rope_theta`` and
  ``rope_parameters``' own, ``rope_scaling`` and ``rope_parameters``: transformers reads
  one of them), ``layer_types`` has one entry per layer, and MLA's
  ``num_key_value_heads`` is the head count.
* files: ``config.json``, the index and every weight file must be regular files
  (checked with ``os.stat`` before opening: a FIFO, a device or a directory is refused
  unread); the index's ``weight_map`` must name plain file names inside the directory;
  a damaged safetensors file (truncated, bad header, offsets past the end) is named.
* tensors: before the model is built, the weight map must hold every tensor the config
  needs (checked layer by layer, failing at the first missing layer) and no other (except
  RoPE ``inv_freq`` buffers and the multi-token-prediction layers that
  ``num_nextn_predict_layers`` announces, which are not read); every needed tensor's
  shape and dtype (F16, BF16, F32, F64) is checked from the headers, a tied head stored
  beside its embedding must equal it (transformers would use the stored one), and every
  slice is checked finite as it is read and again in the parameter dtype (a float64
  weight of 1e300 is infinite in float32).
* ``tokenizer_config.json``'s ``eos_token`` is null, a non-empty string or
  ``{"content": non-empty string}``, and a ``tokenizer.json`` that does not load is named.

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
import stat
from typing import Any, Callable, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmp._checks import BOOL, Choice, Int, Kind, Real, is_int
from jaxmp.models.layers import FP8State
from jaxmp.models.moe import RouterBias
from jaxmp.models.transformer import ModelConfig, MoETransformer
from jaxmp.precision import fp8 as fp8_lib

__all__ = ["from_pretrained", "save_pretrained", "config_from_hf", "config_to_hf", "FAMILIES",
           "IGNORED_FIELDS", "MAX_SHARD_BYTES", "RUNTIME_FIELDS", "load_weights", "read_config",
           "family_of", "tokenizer_eos", "check_weights", "check_directory"]

MAX_SHARD_BYTES = 5 * 10 ** 9  # transformers' default max_shard_size="5GB"

# Fields that do not change what the model computes in jaxmp (training or generation
# settings of transformers, metadata).
IGNORED_FIELDS = frozenset({
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version",
    "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "initializer_range",
    "output_router_logits", "router_aux_loss_coef", "aux_loss_alpha", "seq_aux",
    "_name_or_path", "tokenizer_class", "auto_map", "ep_size",
    "return_dict", "output_hidden_states", "output_attentions", "tie_encoder_decoder",
    "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
    "problem_type", "max_window_layers", "qk_head_dim", "head_dim_for_mla",
})

# ---- config.json fields: each family's table of what it reads, typed and ranged -----------

_NEEDED = type("_Needed", (), {"__repr__": lambda self: "NEEDED"})()
_ABSENT = type("_Absent", (), {"__repr__": lambda self: "ABSENT"})()
_REFUSED = type("_Refused", (), {"__repr__": lambda self: "REFUSED"})()


@dataclasses.dataclass(frozen=True)
class Field:
    """How one ``config.json`` field is read (an entry of :attr:`Family.specs`).

    Attributes:
      allowed: the values it may hold, a :mod:`jaxmp._checks` spec (``Int``, ``Real``,
        ``Choice``, ``Kind``, ``BOOL``): integers are never bools, reals are finite.
      default: its value when config.json leaves it out, transformers' default for the
        family (None: as if ``null``); ``NEEDED``: required (transformers has no default,
        or it is a shape field); ``ABSENT``: not read when left out (an alias).
      null: what a JSON ``null`` stands for (``REFUSED``: null is not allowed).
      exact: ``allowed`` lists the only values jaxmp computes exactly (a value outside it
        "cannot be represented exactly" rather than being ill-typed).
    """

    allowed: Any
    default: Any = _NEEDED
    null: Any = _REFUSED
    exact: bool = False


_MAX_INT = 2 ** 31 - 1  # every count and size is an int32 array dimension or position
_COUNT = Int(1, _MAX_INT)
_COUNT0 = Int(0, _MAX_INT)
_POSITIVE = Real(0.0, lo_open=True)
_OBJECT = Kind(lambda v: isinstance(v, dict), "a JSON object {...} or null")
_STRING = Kind(lambda v: isinstance(v, str), "a string")
_NAMES = Kind(lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v),
              "a list of strings or null")
_INDICES = Kind(lambda v: isinstance(v, list) and all(is_int(i) and 0 <= i <= _MAX_INT
                                                     for i in v),
                "a list of layer indices (integers >= 0) or null")


def _fixed(*values: Any, text: Optional[str] = None) -> Field:
    """A field with the only value(s) jaxmp computes; absent means the first."""
    return Field(Choice(values, text or " or ".join(map(repr, values))), values[0],
                 exact=True)


def _specs(*, max_len: int, kv_heads: Optional[int] = None, head_dim: Optional[int] = None,
           eps: float = 1e-6, theta: float = 10000.0, partial: float = 1.0,
           d_ff: Any = _COUNT, window: Optional[int] = None, window_switch: Any = _ABSENT,
           mtp: int = 0, **extra: Field) -> Dict[str, Field]:
    """A family's :attr:`Family.specs`: the fields every family reads, with the
    family's transformers defaults (``max_len``: ``max_position_embeddings``, ``eps``:
    ``rms_norm_eps``, ``window``: ``sliding_window``, ``window_switch``:
    ``use_sliding_window``, ``mtp``: ``num_nextn_predict_layers``), and ``extra``."""
    specs = {
        "vocab_size": Field(_COUNT), "hidden_size": Field(_COUNT),
        "num_hidden_layers": Field(_COUNT), "num_attention_heads": Field(_COUNT),
        "num_key_value_heads": Field(_COUNT, kv_heads, null=0),  # 0: num_attention_heads
        "head_dim": Field(_COUNT, head_dim, null=0),  # 0: hidden_size / num_attention_heads
        "intermediate_size": Field(d_ff),
        "max_position_embeddings": Field(_COUNT, max_len),
        "rms_norm_eps": Field(_POSITIVE, eps),
        "tie_word_embeddings": Field(BOOL, False),
        "rope_theta": Field(_POSITIVE, theta),
        "partial_rotary_factor": Field(Real(0.0, 1.0, lo_open=True), partial),
        "rope_scaling": Field(_OBJECT, None, null={}),
        "rope_parameters": Field(_OBJECT, None, null={}),
        "layer_types": Field(_NAMES, None, null=[]),
        # MTP layers (DeepSeek-V3, GLM-4.5) are not read; their tensors are skipped.
        "num_nextn_predict_layers": Field(_COUNT0, mtp, null=0),
        "hidden_act": _fixed("silu"), "attention_dropout": _fixed(0.0, 0),
        "mlp_bias": _fixed(False), "pretraining_tp": _fixed(1),
        "router_jitter_noise": _fixed(0.0, 0),
        "sliding_window": Field(_COUNT, window, null=None),
        "use_sliding_window": Field(Choice((False,), "False"), window_switch, exact=True),
    }
    specs.update(extra)
    return specs


@dataclasses.dataclass(frozen=True)
class Family:
    """One ``model_type``: its architectures name, the fields it reads, the layer table.

    Attributes:
      architecture: the ``architectures`` entry written (``LlamaForCausalLM``, ...).
      fields: ``{config.json field: ModelConfig field}`` read as they are.
      fixed: ModelConfig fields the family always has (``qk_norm=True`` for Qwen3).
      moe: the MoE key names ``{"experts": [...], "router": ..., "bias": ..., "shared": ...}``
        (None: a dense family).
      specs: ``{config.json field: Field}``, every field the family reads (``fields`` and
        those read by :func:`config_from_hf` itself): its type, range and default. A field
        neither here nor in :data:`IGNORED_FIELDS` is refused.
    """

    architecture: str
    fields: Dict[str, str]
    fixed: Dict[str, Any]
    moe: Optional[Dict[str, Any]] = None
    specs: Dict[str, Field] = dataclasses.field(default_factory=dict)


_COMMON = {"vocab_size": "vocab_size", "hidden_size": "d_model",
           "num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
           "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim",
           "intermediate_size": "d_ff", "max_position_embeddings": "max_len",
           "rms_norm_eps": "norm_eps", "tie_word_embeddings": "tie_embeddings"}

_QWEN_MOE = {"num_experts": "num_experts", "num_local_experts": "num_experts",
             "num_experts_per_tok": "top_k", "moe_intermediate_size": "d_expert",
             "norm_topk_prob": "norm_topk_prob", "mlp_only_layers": "mlp_only_layers"}

_EXPERTS_GUD = ("gate_proj", "up_proj", "down_proj")

# The defaults below are transformers' (its configuration_<family>.py) where it has one;
# the shape fields (sizes and counts of tensors) are required. Two keys naming one
# ModelConfig field (num_experts / num_local_experts) are aliases: either one suffices.
_NO_QKV_BIAS = _fixed(False)
_ROUTED = dict(num_experts_per_tok=Field(_COUNT), moe_intermediate_size=Field(_COUNT))
_DEEPSEEK = dict(  # DeepSeek-V2 and V3
    _ROUTED, n_routed_experts=Field(_COUNT), num_local_experts=Field(_COUNT),
    kv_lora_rank=Field(_COUNT), q_lora_rank=Field(_COUNT, null=0),  # null: plain q_proj
    qk_nope_head_dim=Field(_COUNT), qk_rope_head_dim=Field(_COUNT), v_head_dim=Field(_COUNT),
    moe_layer_freq=_fixed(1), attention_bias=_fixed(False))

FAMILIES: Dict[str, Family] = {
    "llama": Family("LlamaForCausalLM", dict(_COMMON, attention_bias="qkv_bias"), {},
                    specs=_specs(max_len=2048, attention_bias=_fixed(
                        False, text="false (jaxmp has no o_proj bias)"))),
    "mistral": Family("MistralForCausalLM", dict(_COMMON), {},
                      specs=_specs(max_len=131072, kv_heads=8, window=4096)),
    "qwen2": Family("Qwen2ForCausalLM", dict(_COMMON), {"qkv_bias": True},
                    specs=_specs(max_len=32768, kv_heads=32, window=4096,
                                 window_switch=False)),
    "qwen3": Family("Qwen3ForCausalLM", dict(_COMMON, attention_bias="qkv_bias"),
                    {"qk_norm": True},
                    specs=_specs(max_len=32768, kv_heads=32, head_dim=128, window=4096,
                                 window_switch=False, attention_bias=_NO_QKV_BIAS)),
    "qwen3_moe": Family("Qwen3MoeForCausalLM",
                        dict(_COMMON, attention_bias="qkv_bias", **_QWEN_MOE),
                        {"qk_norm": True, "score_fn": "softmax", "num_shared_experts": 0,
                         "first_dense_layers": 0},
                        {"block": "mlp", "experts": _EXPERTS_GUD, "router": "gate"},
                        _specs(max_len=32768, kv_heads=4, window=4096, window_switch=False,
                               d_ff=_COUNT0, attention_bias=_NO_QKV_BIAS, **_ROUTED,
                               num_experts=Field(_COUNT), num_local_experts=Field(_COUNT),
                               norm_topk_prob=Field(BOOL, False),
                               mlp_only_layers=Field(_INDICES, None, null=[]),
                               decoder_sparse_step=Field(_COUNT, 1))),
    "mixtral": Family("MixtralForCausalLM",
                      dict(_COMMON, num_local_experts="num_experts",
                           num_experts_per_tok="top_k", intermediate_size="d_expert"),
                      {"score_fn": "softmax", "num_shared_experts": 0,
                       "first_dense_layers": 0, "norm_topk_prob": True},
                      {"block": "block_sparse_moe", "experts": ("w1", "w3", "w2"),
                       "router": "gate"},
                      _specs(max_len=131072, kv_heads=8, eps=1e-5, theta=1e6,
                             num_local_experts=Field(_COUNT),
                             num_experts_per_tok=Field(_COUNT))),
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
                           "shared": "shared_experts"},
                          _specs(max_len=4096, kv_heads=128, d_ff=_COUNT0, mtp=1, **_DEEPSEEK,
                                 n_shared_experts=Field(_COUNT0, 1),
                                 first_k_dense_replace=Field(_COUNT0, 3),
                                 norm_topk_prob=Field(BOOL, True, null=False),
                                 routed_scaling_factor=Field(_POSITIVE, 2.5),
                                 n_group=Field(_COUNT, 8), topk_group=Field(_COUNT, 4),
                                 topk_method=_fixed("noaux_tc"), scoring_func=_fixed("sigmoid"),
                                 rope_interleave=Field(BOOL, True))),
}
FAMILIES["deepseek_v2"] = Family(
    "DeepseekV2ForCausalLM", dict(FAMILIES["deepseek_v3"].fields),
    {"score_fn": "softmax", "rope_layout": "interleaved", "group_score": "max"},
    {"block": "mlp", "experts": _EXPERTS_GUD, "router": "gate", "shared": "shared_experts"},
    _specs(max_len=2048, d_ff=_COUNT0, **_DEEPSEEK,
           n_shared_experts=Field(_COUNT0, 2), first_k_dense_replace=Field(_COUNT0, 0),
           norm_topk_prob=Field(Choice((False,), "false (transformers' DeepseekV2 never "
                                                 "normalizes)"), False, null=False, exact=True),
           routed_scaling_factor=Field(_POSITIVE, 1.0),
           n_group=Field(_COUNT, None, null=None), topk_group=Field(_COUNT, None, null=None),
           topk_method=_fixed("greedy", "group_limited_greedy"),
           scoring_func=_fixed("softmax")))
FAMILIES["glm4_moe"] = Family(
    "Glm4MoeForCausalLM",
    dict(_COMMON, attention_bias="qkv_bias", use_qk_norm="qk_norm",
         **{k: v for k, v in FAMILIES["deepseek_v3"].fields.items()
            if k not in _COMMON and "lora" not in k and "head_dim" not in k}),
    {"score_fn": "sigmoid"}, FAMILIES["deepseek_v3"].moe,
    _specs(max_len=131072, kv_heads=8, eps=1e-5, partial=0.5, d_ff=_COUNT0, mtp=1, **_ROUTED,
           attention_bias=Field(BOOL, False), use_qk_norm=Field(BOOL, False),
           n_routed_experts=Field(_COUNT), num_local_experts=Field(_COUNT),
           n_shared_experts=Field(_COUNT0, 1), first_k_dense_replace=Field(_COUNT0, 1),
           norm_topk_prob=Field(BOOL, True), routed_scaling_factor=Field(_POSITIVE, 1.0),
           n_group=Field(_COUNT, 1), topk_group=Field(_COUNT, 1)))
for _fam in FAMILIES.values():  # every field a family maps is in its table
    assert set(_fam.fields) <= set(_fam.specs), set(_fam.fields) - set(_fam.specs)

# rope_scaling / rope_parameters keys: their types, and the rope_type(s) that read them.
_ROPE_PARAMS: Dict[str, Field] = {
    "factor": Field(_POSITIVE),
    "original_max_position_embeddings": Field(_COUNT),
    "low_freq_factor": Field(_POSITIVE), "high_freq_factor": Field(_POSITIVE),
    "beta_fast": Field(_POSITIVE, None, null=None),
    "beta_slow": Field(_POSITIVE, None, null=None),
    "mscale": Field(Real(), None, null=None), "mscale_all_dim": Field(Real(), None, null=None),
    "truncate": _fixed(True),
    "attention_factor": Field(Choice((), "unset (derived from factor and mscale)"), None,
                              null=None, exact=True),
}
_ROPE_TYPES = {
    "default": (),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor",
               "high_freq_factor"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate", "attention_factor"),
}

# The fields from_pretrained's overrides may set: how the model runs, not what it is.
RUNTIME_FIELDS = ("max_len", "attention", "moe_kernel", "scan_layers", "remat",
                  "capacity_factor", "aux_loss_weight", "bias_update_rate")


def _short(value: Any, limit: int = 80) -> str:
    """``repr(value)`` on one line, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _name(key: Any) -> str:
    """A field's name for a one-line message (``repr`` when it is not printable text)."""
    return key if isinstance(key, str) and key.isprintable() else repr(key)


def _err(model_type: str, field: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"config.json ({model_type}): {field}={_short(value)} cannot be "
                      f"represented exactly; allowed: {allowed}")


def _bad(model_type: str, field: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"config.json ({model_type}): {field}={_short(value)} is not allowed; "
                      f"allowed: {allowed}")


def _missing(model_type: str, field: str, allowed: str, why: str = "") -> ValueError:
    return ValueError(f"config.json ({model_type}): {field} is missing{why}; it is required "
                      f"(allowed: {allowed})")


def _non_finite(data: Any) -> Optional[Tuple[str, Any]]:
    """``(path, value)`` of the first non-finite number (NaN, Infinity) anywhere in parsed
    JSON ``data`` (``rope_scaling.factor``, ``mlp_only_layers[2]``), else None."""
    stack = [("", data)]
    while stack:
        path, x = stack.pop()
        if isinstance(x, float) and not math.isfinite(x):
            return path or "(the whole file)", x
        if isinstance(x, dict):
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in
                         reversed(list(x.items())))
        elif isinstance(x, list):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(x))))
    return None


def _read_field(model_type: str, name: str, spec: Field, present: bool, value: Any) -> Any:
    """The checked value of one field (``present``: config.json gives ``value``), its
    default when absent, what null stands for when null; ``_ABSENT`` when not read."""
    if not present:
        if spec.default is _NEEDED:
            raise _missing(model_type, name, spec.allowed.allowed)
        if spec.default is _ABSENT:
            return _ABSENT
        value = spec.default
    if value is None:
        if spec.null is _REFUSED:
            raise _bad(model_type, name, None, spec.allowed.allowed)
        return spec.null
    if not spec.allowed.ok(value):
        raise (_err if spec.exact else _bad)(model_type, name, value, spec.allowed.allowed)
    return value


def _field_values(model_type: str, hf: Dict[str, Any]) -> Dict[str, Any]:
    """``{field: checked value}`` for every field of the family's :attr:`Family.specs`
    (defaults filled in); a missing, null or ill-typed field is a one-line ValueError."""
    fam = FAMILIES[model_type]
    vals = {}
    for key, spec in fam.specs.items():
        target = fam.fields.get(key)
        present = key in hf
        if not present and spec.default is _NEEDED and target is not None and any(
                k in hf for k, t in fam.fields.items() if t == target and k != key):
            continue  # an alias (num_local_experts for num_experts, ...) says it
        value = _read_field(model_type, key, spec, present, hf.get(key))
        if value is not _ABSENT:
            vals[key] = value
    return vals


def _rope_fields(model_type: str, hf: Dict[str, Any], vals: Dict[str, Any],
                 out: Dict[str, Any]) -> None:
    """The RoPE fields of ``out`` from the old (``rope_theta`` + ``rope_scaling``) or new
    (``rope_parameters``) transformers layout, each key checked (:data:`_ROPE_PARAMS`)."""
    specs = FAMILIES[model_type].specs
    merged: Dict[str, Any] = {}
    where: Dict[str, str] = {}  # key -> the dict it came from, for the messages
    seen: Dict[str, Tuple[str, Any]] = {}  # key (type: rope_type) -> (source, value)
    for source in ("rope_scaling", "rope_parameters"):  # both name the same parameters
        for key, value in vals[source].items():
            name = f"{source}.{key}"
            if key in ("rope_type", "type"):
                value = _read_field(model_type, name, Field(_STRING), True, value)
            elif key in ("rope_theta", "partial_rotary_factor"):
                value = _read_field(model_type, name, specs[key], True, value)
            elif key in _ROPE_PARAMS:
                value = _read_field(model_type, name, _ROPE_PARAMS[key], True, value)
            same = "rope_type" if key == "type" else key
            if same in seen and seen[same][0] != source and seen[same][1] != value:
                # transformers reads one and jaxmp would read the other: neither is taken
                raise _bad(model_type, name, value, f"{seen[same][0]}.{key}'s "
                                                    f"{seen[same][1]!r} (both are given)")
            seen[same] = (source, value)
            merged[key], where[key] = value, source
    prefix = "rope_parameters" if vals["rope_parameters"] and not vals["rope_scaling"] \
        else "rope_scaling"
    theta = merged.pop("rope_theta", vals["rope_theta"])
    if "rope_theta" in hf:  # the top-level field and rope_parameters' must agree
        if "rope_theta" in where and theta != vals["rope_theta"]:
            raise _bad(model_type, "rope_theta", vals["rope_theta"],
                       f"{where['rope_theta']}.rope_theta's {theta!r} (both are given, and "
                       f"transformers reads {where['rope_theta']})")
        theta = vals["rope_theta"]
    kind = merged.pop("rope_type", merged.pop("type", "default"))
    # transformers' Glm4MoeConfig sets 0.5 where config.json gives no factor (the default).
    partial = merged.pop("partial_rotary_factor", vals["partial_rotary_factor"])
    out["rope_theta"] = float(theta)
    if partial != 1.0:
        if out.get("kv_lora_rank"):
            raise _err(model_type, "partial_rotary_factor", partial, "1.0 with MLA")
        out["rope_dim"] = int(out["head_dim"] * partial)
        if out["rope_dim"] != out["head_dim"] * partial:
            raise _err(model_type, "partial_rotary_factor", partial,
                       "a factor giving a whole number of rotated dimensions")
    merged = {k: v for k, v in merged.items()  # a known key's null: as if absent
              if v is not None or k not in _ROPE_PARAMS}
    if kind not in _ROPE_TYPES:
        raise _err(model_type, f"{where.get('rope_type', where.get('type', prefix))}.rope_type",
                   kind, ", ".join(_ROPE_TYPES))
    for key in sorted(merged):
        if key not in _ROPE_TYPES[kind]:
            raise _err(model_type, f"{where[key]}.{key}", merged[key],
                       f"the {kind} parameters" if _ROPE_TYPES[kind] else
                       "no parameters for rope_type default")
    if kind == "default":
        return
    for key in _ROPE_TYPES[kind]:
        if key not in merged and _ROPE_PARAMS[key].default is _NEEDED:
            raise _missing(model_type, f"{prefix}.{key}", _ROPE_PARAMS[key].allowed.allowed,
                           f" (rope_type {kind} needs it)")
    out["rope_scaling"] = kind
    out["rope_original_max_len"] = int(merged["original_max_position_embeddings"])
    out["rope_factor"] = float(merged["factor"])
    names = ({"low_freq_factor": "rope_low_freq_factor",
              "high_freq_factor": "rope_high_freq_factor"} if kind == "llama3" else
             {"beta_fast": "rope_beta_fast", "beta_slow": "rope_beta_slow",
              "mscale": "rope_mscale", "mscale_all_dim": "rope_mscale_all_dim"})
    for key, field in names.items():
        if key in merged:
            out[field] = float(merged[key])
    if kind == "llama3" and not merged["high_freq_factor"] > merged["low_freq_factor"]:
        raise _bad(model_type, f"{where['high_freq_factor']}.high_freq_factor",
                   merged["high_freq_factor"],
                   f"a number > low_freq_factor={merged['low_freq_factor']}")


def config_from_hf(hf: Dict[str, Any]) -> Dict[str, Any]:
    """ModelConfig fields for a transformers ``config.json``.

    Every field is read through the family's table (:attr:`Family.specs`): the fields
    transformers has no default for, and the shape fields (``vocab_size``,
    ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
    ``intermediate_size``, the expert counts and sizes, the MLA ranks), are required; the
    others take transformers' default for the family when left out (``rms_norm_eps``,
    ``rope_theta``, ``max_position_embeddings``, ...). Integers must be integers (not
    bools) in range, reals finite and in range, bools bools; no number anywhere in the
    file may be NaN or infinite.

    Args:
      hf: the parsed ``config.json``.

    Returns:
      ``{ModelConfig field: value}`` (every architecture field; runtime fields such as
      ``attention`` are left to the caller).

    Raises:
      ValueError: one line naming the field and what is allowed: ``hf`` not a JSON object,
        an unknown ``model_type``, an unknown field, a required field missing, a field
        null, ill-typed or out of range, a non-finite number anywhere, or a value that
        cannot be represented exactly.
    """
    if not isinstance(hf, dict):
        raise ValueError(f"config.json: {_short(hf)} is not a JSON object of fields "
                         f"({type(hf).__name__}); allowed: an object {{...}}")
    bad = _non_finite(hf)
    if bad is not None:
        raise ValueError(f"config.json: {bad[0]}={bad[1]!r} is not a finite number; "
                         f"allowed: finite numbers only")
    model_type = hf.get("model_type")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise ValueError(f"config.json: model_type={_short(model_type)} is not supported; "
                         f"allowed: {', '.join(FAMILIES)}")
    fam = FAMILIES[model_type]
    for key in hf:
        if key not in fam.specs and key not in IGNORED_FIELDS:
            raise _err(model_type, _name(key), hf[key],
                       "the fields jaxmp.models.hf implements (unknown field)")
    vals = _field_values(model_type, hf)
    if vals["sliding_window"] is not None and vals.get("use_sliding_window") is not False:
        raise _err(model_type, "sliding_window", vals["sliding_window"],
                   "None" + ("" if "sliding_window" in hf else
                             f" (absent: transformers' {model_type} default)"))
    if any(t != "full_attention" for t in vals["layer_types"]):
        raise _err(model_type, "layer_types", hf["layer_types"], "only full_attention")
    if vals["layer_types"] and len(vals["layer_types"]) != vals["num_hidden_layers"]:
        raise _bad(model_type, "layer_types", hf["layer_types"],
                   f"one entry per layer ({vals['num_hidden_layers']}, num_hidden_layers; "
                   f"transformers refuses another length)")
    out: Dict[str, Any] = {"num_experts": 0}
    said: Dict[str, str] = {}  # ModelConfig field -> the config.json field that set it
    for key, field in fam.fields.items():
        if key not in vals:
            continue
        if field in said and vals[said[field]] != vals[key]:
            raise _bad(model_type, key, vals[key], f"{said[field]}'s value "
                                                   f"{vals[said[field]]!r} (both name {field})")
        out[field], said[field] = vals[key], key
    out.update(fam.fixed)
    if model_type in ("qwen3", "qwen3_moe"):
        out.pop("qkv_bias", None)
    if model_type == "qwen3_moe":
        step = vals["decoder_sparse_step"]
        dense = set(out["mlp_only_layers"])
        if step > 1:  # every layer is sparse at step 1: nothing to enumerate
            dense |= {i for i in range(out["num_layers"]) if (i + 1) % step}
        out["mlp_only_layers"] = tuple(sorted(dense))
    if model_type in ("deepseek_v2", "deepseek_v3"):
        v3 = model_type == "deepseek_v3"
        if not v3 and vals["topk_method"] == "greedy":
            out["n_group"] = out["topk_group"] = 1  # transformers' greedy ignores the groups
        elif not v3:  # group_limited_greedy
            for key in ("n_group", "topk_group"):
                if out[key] is None:
                    raise (_bad(model_type, key, None, "an integer >= 1 with topk_method "
                                                       "group_limited_greedy")
                           if key in hf else _missing(model_type, key, "an integer >= 1",
                                                      " with topk_method group_limited_greedy"))
            per_group = out["num_experts"] // out["n_group"]
            if out["top_k"] > out["topk_group"] * per_group:
                raise _err(model_type, "num_experts_per_tok", out["top_k"],
                           "at most topk_group x the experts of a group (transformers "
                           "would pick masked experts with gate 0)")
        if v3:
            out["rope_layout"] = "interleaved" if vals["rope_interleave"] else "half"
        kv = hf.get("num_key_value_heads")
        if kv is not None and kv != out["num_heads"]:  # MLA: one key and value per head
            raise _bad(model_type, "num_key_value_heads", kv,
                       f"num_attention_heads ({out['num_heads']}) or null: MLA has a key and "
                       f"value per head (transformers' {model_type} fails on another count)")
        out.pop("head_dim", None)
        out.pop("num_kv_heads", None)
    if "quantization_config" in hf:
        raise _err(model_type, "quantization_config", hf["quantization_config"], "absent")
    out.setdefault("head_dim", 0)
    if not out.get("kv_lora_rank"):
        out["head_dim"] = out["head_dim"] or out["d_model"] // out["num_heads"]
    _rope_fields(model_type, hf, vals, out)
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


_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
# The dtypes a weight may be stored in (safetensors' names): floating point, not FP8
# (FP8 checkpoints come with a quantization_config, which jaxmp does not read).
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
# Tensors a checkpoint may hold that jaxmp does not read, on purpose: RoPE's inverse
# frequencies, a buffer older transformers saved (jaxmp computes them from rope_theta).
_SKIPPED = re.compile(r"(.+\.)?rotary_emb\.inv_freq")


def _one_line(e: BaseException) -> str:
    """An exception's message on one line."""
    return " ".join(str(e).split()) or type(e).__name__


def _first(names: List[str], n: int = 4) -> str:
    return ", ".join(names[:n]) + (", ..." if len(names) > n else "")


def _regular(file: str, what: str, missing_ok: bool = False) -> bool:
    """Whether ``file`` is a regular file (after symbolic links), checked with ``os.stat``
    alone: a FIFO, a device or a directory is refused without being opened (opening a
    FIFO for reading blocks). False when nothing is there and ``missing_ok``.

    Raises:
      ValueError: ``file`` is not a regular file, is missing (unless ``missing_ok``) or a
        broken symbolic link (one line naming it and ``what`` it should be).
    """
    try:
        mode = os.stat(file).st_mode
    except FileNotFoundError:
        if os.path.islink(file):
            raise ValueError(f"{file}: a broken symbolic link; the checkpoint's {what} must "
                             f"be a regular file") from None
        if missing_ok:
            return False
        raise ValueError(f"{file}: no such file; the checkpoint's {what} must be a regular "
                         f"file") from None
    except OSError as e:
        raise ValueError(f"{file}: cannot read the checkpoint's {what} "
                         f"({_one_line(e)})") from None
    if not stat.S_ISREG(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a character device" if stat.S_ISCHR(mode) else "a block device"
                if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "special")
        raise ValueError(f"{file}: {kind}, not a regular file; the checkpoint's {what} must "
                         f"be a regular file (refused unread)")
    return True


def _json_kind(data: Any) -> str:
    return ("null" if data is None else "a JSON array" if isinstance(data, list) else
            "a string" if isinstance(data, str) else "a boolean" if isinstance(data, bool)
            else f"the number {data!r}" if isinstance(data, (int, float)) else
            type(data).__name__)


def _read_json(file: str, what: str, finite: bool = True) -> Dict[str, Any]:
    """The JSON object in regular file ``file`` (the checkpoint's ``what``).

    Raises:
      ValueError: not a regular file, not JSON, not an object, or (``finite``) a
        non-finite number anywhere (one line naming the file and, for a number, the key).
    """
    _regular(file, what)
    try:
        with open(file, "rb") as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError) as e:  # ValueError: JSON, UTF-8
        raise ValueError(f"{file}: cannot read the checkpoint's {what} "
                         f"({_one_line(e)})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: the checkpoint's {what} is {_json_kind(data)}; allowed: a "
                         f"JSON object {{...}}")
    bad = _non_finite(data) if finite else None
    if bad is not None:
        raise ValueError(f"{file}: {bad[0]}={bad[1]!r} is not a finite number; allowed: "
                         f"finite numbers only")
    return data


def _plain_name(directory: str, name: Any) -> bool:
    """``name`` is a plain file name inside ``directory``: no path separator, not ``..``,
    not absolute, lexically inside the directory once joined."""
    if not isinstance(name, str) or name in ("", ".", "..") or "\x00" in name:
        return False
    if any(sep and sep in name for sep in ("/", "\\", os.sep, os.altsep)):
        return False
    if os.path.isabs(name):
        return False
    joined = os.path.abspath(os.path.join(directory, name))
    return os.path.dirname(joined) == os.path.abspath(directory)


class _Files:
    """The checkpoint's tensors by name over its (possibly sharded) safetensors files.

    Nothing is taken on trust: the index must map tensor names to plain file names inside
    the directory, every file must be a regular file (checked before it is opened) and a
    readable safetensors file, a shard must hold only the tensors the index maps to it,
    and every slice read must be finite. Each fault is a one-line ``ValueError`` naming
    the file (and the tensor).
    """

    def __init__(self, path: str):
        self.path, self._safe_open = path, _safetensors().safe_open
        self._headers: Dict[str, Dict[str, Tuple[Tuple[int, ...], str]]] = {}
        index = os.path.join(path, _INDEX)
        if _regular(index, _INDEX, missing_ok=True):
            weight_map = _read_json(index, _INDEX).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index}: weight_map={_short(weight_map)} is not allowed; "
                                 f"allowed: a JSON object {{tensor name: file name}}")
            for name, file in weight_map.items():
                if not _plain_name(path, file):
                    raise ValueError(f"{index}: weight_map[{name!r}]={_short(file)} is not a "
                                     f"file inside the checkpoint directory; allowed: a plain "
                                     f"file name (no path separator, not '..')")
            self.indexed, self.weight_map = True, weight_map
        elif _regular(os.path.join(path, _SINGLE), _SINGLE, missing_ok=True):
            self.indexed, self.weight_map = False, {}
            self.weight_map = dict.fromkeys(self._header(_SINGLE), _SINGLE)
        else:
            raise ValueError(f"{path}: neither model.safetensors nor "
                             f"model.safetensors.index.json found")

    def _header(self, file: str) -> Dict[str, Tuple[Tuple[int, ...], str]]:
        """``{tensor: (shape, dtype)}`` of weight file ``file`` (its header, read once)."""
        if file not in self._headers:
            full = os.path.join(self.path, file)
            _regular(full, "weight file")
            try:
                header = {}
                with self._safe_open(full, "np") as f:
                    for k in f.keys():
                        sl = f.get_slice(k)
                        header[k] = (tuple(sl.get_shape()), sl.get_dtype())
            except Exception as e:  # noqa: BLE001  SafetensorError, OSError: damaged
                raise ValueError(f"{full}: not a readable safetensors file "
                                 f"({_one_line(e)})") from None
            if self.indexed:
                extra = sorted(k for k in header if self.weight_map.get(k) != file)
                if extra:
                    raise ValueError(f"{full}: holds {len(extra)} tensor(s) that {_INDEX} "
                                     f"does not map to it: {_first(extra)}")
            self._headers[file] = header
        return self._headers[file]

    def info(self, name: str) -> Tuple[Tuple[int, ...], str]:
        """The tensor's ``(shape, dtype)``, from its file's header."""
        if name not in self.weight_map:
            raise ValueError(f"{self.path}: the checkpoint has no tensor {name!r}")
        file = self.weight_map[name]
        header = self._header(file)
        if name not in header:
            raise ValueError(f"{self.path}: {file} has no tensor {name!r} (the index says "
                             f"it has)")
        return header[name]

    def shape(self, name: str) -> Tuple[int, ...]:
        """The tensor's shape, from its file's header (each file's header is read once)."""
        return self.info(name)[0]

    def read(self, name: str, index) -> np.ndarray:
        """``tensor[index]`` read from a mapping of its file opened for this read only
        (when it closes the file is unmapped, so the pages read do not stay in the
        process's resident memory: a cached handle kept the whole checkpoint's pages
        resident, benchmarks/hf_load_memory.py).

        Raises:
          ValueError: the read fails, or the slice holds a NaN or an infinity (naming the
            tensor and its file).
        """
        if name not in self.weight_map:
            raise ValueError(f"{self.path}: the checkpoint has no tensor {name!r}")
        file = os.path.join(self.path, self.weight_map[name])
        try:
            with self._safe_open(file, "np") as f:
                x = np.asarray(f.get_slice(name)[index])
        except Exception as e:  # noqa: BLE001  SafetensorError, OSError
            raise ValueError(f"{file}: cannot read tensor {name} ({_one_line(e)})") from None
        if not _all_finite(x):
            raise ValueError(f"{file}: tensor {name} holds non-finite values (NaN or "
                             f"infinity); allowed: finite weights")
        return x


def _all_finite(x: np.ndarray) -> bool:
    """No NaN or infinity in ``x``, without an array of its size in memory: the float64
    sum of finite float16/bfloat16/float32 values is finite; only a non-finite sum (or a
    float64 sum that overflows) is looked at element by element."""
    with np.errstate(over="ignore", invalid="ignore"):
        if x.size == 0 or math.isfinite(float(x.sum(dtype=np.float64))):
            return True
    return bool(np.isfinite(x).all())


def _norm_index(index, shape):
    return tuple(range(*s.indices(n)) if isinstance(s, slice) else [s]
                 for s, n in zip(index, shape))


# A mapping reads one parameter of jaxmp's shape for a device index from HF tensors.
# kinds: "same" (identical layout), "in" (ours = W[out, in].T, out split into ours[1:]),
# "out" (ours = W[out, in].T, in split into ours[:-1]), "vec" (a vector reshaped).


def _read(files: _Files, name: str, kind: str, shape: Tuple[int, ...], index) -> np.ndarray:
    if kind == "same":
        return files.read(name, index)
    if kind == "vec":
        return files.read(name, slice(None)).reshape(shape)[index]
    if kind == "in":  # ours [in, *out]
        w = files.read(name, (slice(None), index[0]))  # [out, in_local]
        return w.T.reshape((w.shape[1],) + tuple(shape[1:]))[(slice(None),) + tuple(index[1:])]
    w = files.read(name, (index[-1], slice(None)))  # "out": ours [*in, out]; w [out_local, in]
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


def _cast(files: _Files, name: Any, x: np.ndarray, dtype) -> np.ndarray:
    """``x`` (finite, as read) as the parameter dtype ``dtype``, refusing values it cannot
    hold: a finite float64 weight of 1e300 is infinite in float32, a float32 weight of 1e5
    infinite in float16."""
    with np.errstate(over="ignore"):  # an overflow is refused below, not warned about
        y = x.astype(dtype)
    if not _all_finite(y):
        names = name if isinstance(name, tuple) else (name,)
        raise ValueError(f"{files.path}: tensor {', '.join(names)} holds values beyond "
                         f"{np.dtype(dtype).name}'s range (the parameter dtype; largest "
                         f"|value| {float(np.max(np.abs(x.astype(np.float64)))):.4g}); "
                         f"allowed: weights the parameter dtype holds")
    return y


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
        return _cast(files, tuple(experts), np.stack(
            [_read(files, n, kind, shape[1:], tuple(index[1:])) for n in experts]), dtype)
    return _cast(files, name, _read(files, name, kind, shape, tuple(index)), dtype)


def _check_names(files: _Files, config: ModelConfig, family: str, mtp_layers: range) -> None:
    """Before the model is built: every tensor ``config`` needs is in the checkpoint's
    weight map (a set lookup per name, layer by layer, failing at the first layer that
    lacks one: a config.json of a million layers over a 2-layer file fails at layer 2 at
    once), and every tensor of the checkpoint is one of them, except those skipped on
    purpose: RoPE's ``rotary_emb.inv_freq`` buffers, the multi-token-prediction layers
    ``model.layers.{n}..`` that ``num_nextn_predict_layers`` announces (``mtp_layers``:
    DeepSeek-V3 and GLM-4.5 keep them after the ``n`` layers, jaxmp does not read them) and
    ``lm_head.weight`` with tied embeddings (which must equal the embedding:
    :func:`_check_tied_head`).

    Raises:
      ValueError: a missing tensor (named, with its layer), or unused tensors (their count
        and first names).
    """
    have = files.weight_map
    used = set()
    for key, (name, _) in _global_table(config).items():
        if name not in have:
            raise ValueError(f"{files.path}: the checkpoint has no tensor {name!r} (jaxmp "
                             f"{key})")
        used.add(name)
    for i in range(config.num_layers):
        for key, (name, _) in _layer_table(config, family, i).items():
            for n in (name if isinstance(name, tuple) else (name,)):
                if n not in have:
                    raise ValueError(f"{files.path}: the checkpoint has no tensor {n!r}: "
                                     f"layer {i} is missing or incomplete, and config.json "
                                     f"says {config.num_layers} layers (jaxmp {key})")
                used.add(n)
    mtp = tuple(f"model.layers.{j}." for j in mtp_layers)
    unused = sorted(n for n in have if n not in used and not _SKIPPED.fullmatch(n)
                    and not n.startswith(mtp)
                    and not (config.tie_embeddings and n == "lm_head.weight"))
    if unused:
        raise ValueError(f"{files.path}: {len(unused)} tensor(s) of the checkpoint are not "
                         f"used by the {family} model its config.json describes "
                         f"({config.num_layers} layers): {_first(unused)}")


def _check_shapes(files: _Files, model: MoETransformer, family: str, sources) -> None:
    """Every tensor the model needs exists with the shape jaxmp expects and a floating
    dtype (before loading)."""
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
                have, dtype = files.info(n)
                if dtype not in _FLOAT_DTYPES:
                    raise ValueError(
                        f"{os.path.join(files.path, files.weight_map[n])}: tensor {n} has "
                        f"dtype {dtype}; allowed: {', '.join(_FLOAT_DTYPES)}"
                        + (" (FP8 weights need a quantization_config, which jaxmp does not "
                           "read)" if dtype.startswith("F8") else ""))
                if have != tuple(expect):
                    raise ValueError(f"{files.path}: tensor {n} has shape {list(have)}; the "
                                     f"config.json says {list(expect)} (jaxmp {key})")


def _check_tied_head(files: _Files, rows: int = 8192) -> None:
    """With ``tie_word_embeddings: true`` a stored ``lm_head.weight`` must equal the
    embedding (a copy some writers keep): transformers then uses the stored head, jaxmp
    the embedding, so a head that differs would load as another model. Compared
    ``rows`` rows at a time, no copy of either in memory.

    Raises:
      ValueError: the two differ in shape or in any value (one line naming both).
    """
    head, embed = "lm_head.weight", "model.embed_tokens.weight"
    shape = files.shape(head)
    same = shape == files.shape(embed)
    for start in range(0, shape[0] if same and shape else 0, rows):
        block = slice(start, min(start + rows, shape[0]))
        same = np.array_equal(files.read(head, block).astype(np.float32),
                              files.read(embed, block).astype(np.float32))
        if not same:
            break
    if not same:
        raise ValueError(f"{files.path}: config.json says tie_word_embeddings: true, but the "
                         f"checkpoint's {head} differs from {embed} (transformers would use the "
                         f"stored head, jaxmp the embedding); allowed: "
                         f"tie_word_embeddings false, or no {head}, or one equal to {embed}")


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
      ValueError: one line, naming the file, field or tensor and what is allowed: a
        config.json or index that is not a regular file, not JSON or not an object; a
        config.json field missing, ill-typed, out of range, non-finite or not representable
        (:func:`config_from_hf`); an override outside :data:`RUNTIME_FIELDS`; a weight file
        named outside the directory, not a regular file or not a readable safetensors
        file; a missing tensor, an unused one, one of the wrong shape or of a non-float
        dtype (all before any weight is read); a weight holding a NaN or an infinity (as
        it is read).
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
    """The parsed ``config.json`` of checkpoint directory ``path`` (its fields are
    checked by :func:`config_from_hf`). ``path`` may also name the ``.json`` file itself
    (a released model's config.json alone, as in ``configs/hf/``): enough to plan a run
    (``python -m jaxmp.report``), not to load weights (:func:`check_weights` refuses it).

    Raises:
      ValueError: one line naming the file: no ``config.json`` there, or not a regular
        file (a FIFO, a device or a directory: refused without being opened), not JSON,
        not a JSON object, or holding a non-finite number (NaN, Infinity; the key named).
    """
    file = path if _config_file(path) else os.path.join(path, "config.json")
    return _read_json(file, "config.json")


def _config_file(path: str) -> bool:
    """``path`` names a config.json file rather than a checkpoint directory: it is not a
    directory and its name ends in ``.json``."""
    return str(path).endswith(".json") and not os.path.isdir(path)


def check_directory(path: str) -> None:
    """Refuses a ``path`` that is not a directory, e.g. a config.json file, which
    :func:`read_config` reads to plan a run but which holds no weights.

    Raises:
      ValueError: one line naming ``path``.
    """
    if _config_file(path) or not os.path.isdir(path):
        raise ValueError(f"{path}: not a checkpoint directory; a config.json alone plans a run "
                         f"(python -m jaxmp.report) but loading needs the directory with its "
                         f"config.json and safetensors weights")


def _checked(path: str, config: ModelConfig, policy: Any, target):
    """``(files, family, abstract model, sources)`` once :func:`check_weights`' checks
    pass (no weight read)."""
    _safetensors()
    check_directory(path)
    hf = read_config(path)
    config_from_hf(hf)
    family = hf["model_type"]
    files = _Files(path)
    layers = hf["num_hidden_layers"]
    _check_names(files, config, family,
                 range(layers, layers + _field_values(family, hf)["num_nextn_predict_layers"]))
    abstract = nnx.eval_shape(lambda: MoETransformer(config, policy, rngs=nnx.Rngs(0),
                                                     target=target))
    sources = _param_sources(abstract, family)
    _check_shapes(files, abstract, family, sources)
    if config.tie_embeddings and "lm_head.weight" in files.weight_map:
        _check_tied_head(files)
    return files, family, abstract, sources


def check_weights(path: str, config: ModelConfig, policy: Any = "fp32", *,
                  target=None) -> None:
    """Checks, from the safetensors headers alone, that checkpoint directory ``path`` holds
    the weights of ``config``: every tensor ``config`` needs and no other, each of the
    shape jaxmp expects and a floating dtype; with ``tie_word_embeddings`` a stored
    ``lm_head.weight`` equal to the embedding. No other weight is read (a few KiB per
    file), so the trainer calls it before it reads its corpus; :func:`load_weights` runs
    the same checks and then checks each slice finite as it reads it.

    Args:
      path: the checkpoint directory (``config.json``, ``model.safetensors`` or shards
        with ``model.safetensors.index.json``).
      config: the architecture to check against (that of ``path``'s config.json,
        :func:`config_from_hf`, plus :data:`RUNTIME_FIELDS`).
      policy: the precision policy or rules the model is built with.
      target: the compile target of the model's kernel choices.

    Raises:
      ValueError: as :func:`from_pretrained`, one line naming the file, field or tensor:
        ``path`` not a directory (e.g. a config.json file, which plans but does not
        load), a damaged index or weight file, a missing, unused, misshapen or non-float
        tensor, a tied ``lm_head.weight`` that differs from the embedding.
      ImportError: safetensors is not installed (the ``train`` extra).
    """
    _checked(path, config, policy, target)


def load_weights(path: str, config: ModelConfig, policy: Any = "fp32", *, mesh=None,
                 rules=None, target=None) -> MoETransformer:
    """:func:`from_pretrained` with the :class:`ModelConfig` given: ``config``'s architecture
    must be the one ``path``'s config.json describes (the trainer's ``model.init_from``
    checks that first); the tensors' shapes are checked before anything is read.
    ``target``: the compile target of the model's kernel choices (``MoETransformer``'s).

    Before the model is built (even abstractly), the checkpoint's weight map must have
    every tensor ``config`` needs and no other (:func:`_check_names`); then every file's
    header is read and each tensor's shape and dtype checked (:func:`check_weights`'
    checks); each slice is checked finite as it is read.

    Raises:
      ValueError: as :func:`from_pretrained` (one line naming the file, field or tensor).
      ImportError: safetensors is not installed (the ``train`` extra).
    """
    files, family, abstract, sources = _checked(path, config, policy, target)
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
    ``tokenizer.json`` (or when ``path`` is a config.json file, :func:`read_config`). The
    id is that of ``tokenizer_config.json``'s ``eos_token``, looked up in the tokenizer
    (None when there is no such file or token: the tokenizer's own
    choice, :data:`jaxmp.train.tokenizer.EOS_CANDIDATES`).

    Raises:
      ValueError: an ``eos_token`` that the tokenizer does not have, or either file not a
        regular file (refused unopened), a ``tokenizer.json`` that does not load, or a
        ``tokenizer_config.json`` that is not a JSON object or whose ``eos_token`` is
        neither null, a non-empty string nor ``{"content": non-empty string}`` (one line
        naming the file).
    """
    if not os.path.isdir(path):  # a config.json file alone (read_config): no tokenizer
        return None
    file = os.path.join(path, "tokenizer.json")
    if not _regular(file, "tokenizer.json", missing_ok=True):
        return None
    eos = None
    config = os.path.join(path, "tokenizer_config.json")
    if _regular(config, "tokenizer_config.json", missing_ok=True):
        eos = _read_json(config, "tokenizer_config.json", finite=False).get("eos_token")
    if eos is None:  # absent or null: the tokenizer's own choice
        return file, None
    text = eos.get("content") if isinstance(eos, dict) else eos
    if not isinstance(text, str) or not text:
        raise ValueError(f"{config}: eos_token={_short(eos)} is not allowed; allowed: a "
                         f"non-empty string or {{\"content\": non-empty string}}, or null")
    eos = text
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(file)
    except Exception as e:  # noqa: BLE001  tokenizers raises a bare Exception
        raise ValueError(f"{file}: not a Hugging Face tokenizer.json ({_one_line(e)})") from None
    eos_id = tokenizer.token_to_id(eos)
    if eos_id is None:
        raise ValueError(f"{config}: eos_token={eos!r} is not in {file}")
    return file, int(eos_id)
