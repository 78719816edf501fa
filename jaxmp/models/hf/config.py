"""``config.json`` to :class:`~jaxmp.models.ModelConfig` and back, read and written through
each family's record (:data:`~jaxmp.models.hf.families.FAMILIES`).

What the model computes is checked field by field: a field the family does not know, or a
value jaxmp cannot represent exactly (a sliding window where the family has none, an
activation other than SiLU, FP8 weights, ...) is a one-line ``ValueError`` naming the
field; nothing is approximated.
Fields that only concern training or generation in transformers are ignored
(:data:`~jaxmp.models.hf.spec.IGNORED_FIELDS`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional, Tuple

from jaxmp._checks import BOOL, Choice, Kind, Real, is_int
from jaxmp.models.hf.families import FAMILIES
from jaxmp.models.hf.spec import (ABSENT, COUNT, FEATURES, IGNORED_FIELDS, MAX_LISTED_LAYERS,
                                  NAMES, NEEDED, POSITIVE, STRING,
                                  Field, field_name, fixed, inexact, missing, non_finite,
                                  not_allowed, read_field, short)
from jaxmp.models.config import LAYER_TYPES, ModelConfig

__all__ = ["config_from_hf", "config_to_hf", "family_of", "field_values", "text_config",
           "quantization",
           "RUNTIME_FIELDS"]

# rope_scaling / rope_parameters keys: their types, and the rope_type(s) that read them.
_ROPE_PARAMS: Dict[str, Field] = {
    "factor": Field(POSITIVE),
    "original_max_position_embeddings": Field(COUNT),
    "low_freq_factor": Field(POSITIVE), "high_freq_factor": Field(POSITIVE),
    "beta_fast": Field(POSITIVE, None, null=None),
    "beta_slow": Field(POSITIVE, None, null=None),
    "mscale": Field(Real(), None, null=None), "mscale_all_dim": Field(Real(), None, null=None),
    "truncate": Field(BOOL, None, null=None),
    "attention_factor": Field(Choice((), "unset (derived from factor and mscale)"), None,
                              null=None, exact=True),
}
_ROPE_TYPES = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor",
               "high_freq_factor"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate", "attention_factor"),
}

# The fields from_pretrained's overrides may set: how the model runs, not what it is.
RUNTIME_FIELDS = ("max_len", "attention", "moe_kernel", "scan_layers", "remat",
                  "capacity_factor", "aux_loss_weight", "bias_update_rate")


def field_values(model_type: str, hf: Dict[str, Any]) -> Dict[str, Any]:
    """``{field: checked value}`` for every field of the family's :attr:`Family.specs`
    (defaults filled in); a missing, null or ill-typed field is a one-line ValueError."""
    fam = FAMILIES[model_type]
    vals = {}
    for key, spec in fam.specs.items():
        target = fam.fields.get(key)
        present = key in hf
        if not present and spec.default is NEEDED and target is not None and any(
                k in hf for k, t in fam.fields.items() if t == target and k != key):
            continue  # an alias (num_local_experts for num_experts, ...) says it
        value = read_field(model_type, key, spec, present, hf.get(key))
        if value is not ABSENT:
            vals[key] = value
    return vals


def _rope_fields(model_type: str, hf: Dict[str, Any], vals: Dict[str, Any],
                 out: Dict[str, Any]) -> None:
    """The RoPE fields of ``out`` from the old (``rope_theta`` + ``rope_scaling``) or new
    (``rope_parameters``) transformers layout, each key checked (:data:`_ROPE_PARAMS`)."""
    specs = FAMILIES[model_type].specs
    if vals["rope_scaling"] and vals["rope_parameters"]:
        # transformers reads rope_scaling alone then (rope_scaling or rope_parameters): a
        # key only rope_parameters says would be jaxmp's and not transformers'
        for key, value in vals["rope_parameters"].items():
            if key not in vals["rope_scaling"] or vals["rope_scaling"][key] != value:
                raise inexact(model_type, f"rope_parameters.{field_name(key)}", value,
                              f"absent, or rope_scaling's value (transformers reads "
                              f"rope_scaling and ignores rope_parameters when both are given)")
    merged: Dict[str, Any] = {}
    where: Dict[str, str] = {}  # key -> the dict it came from, for the messages
    seen: Dict[str, Tuple[str, Any]] = {}  # key (type: rope_type) -> (source, value)
    for source in ("rope_scaling", "rope_parameters"):  # both name the same parameters
        for key, value in vals[source].items():
            name = f"{source}.{key}"
            if key in ("rope_type", "type"):
                value = read_field(model_type, name, Field(STRING), True, value)
            elif key in ("rope_theta", "partial_rotary_factor"):
                value = read_field(model_type, name, specs[key], True, value)
            elif key in _ROPE_PARAMS:
                value = read_field(model_type, name, _ROPE_PARAMS[key], True, value)
            same = "rope_type" if key == "type" else key
            if same in seen and seen[same][0] != source and seen[same][1] != value:
                # transformers reads one and jaxmp would read the other: neither is taken
                raise not_allowed(model_type, name, value, f"{seen[same][0]}.{key}'s "
                                  f"{seen[same][1]!r} (both are given)")
            seen[same] = (source, value)
            merged[key], where[key] = value, source
    prefix = "rope_parameters" if vals["rope_parameters"] and not vals["rope_scaling"] \
        else "rope_scaling"
    theta = merged.pop("rope_theta", vals["rope_theta"])
    if "rope_theta" in hf:  # the top-level field and rope_parameters' must agree
        if "rope_theta" in where and theta != vals["rope_theta"]:
            raise not_allowed(model_type, "rope_theta", vals["rope_theta"],
                              f"{where['rope_theta']}.rope_theta's {theta!r} (both are given, and "
                              f"transformers reads {where['rope_theta']})")
        theta = vals["rope_theta"]
    kind = merged.pop("rope_type", merged.pop("type", "default"))
    # transformers' Glm4MoeConfig sets 0.5 where config.json gives no factor (the default).
    partial = merged.pop("partial_rotary_factor", vals["partial_rotary_factor"])
    out["rope_theta"] = float(theta)
    if partial != 1.0:
        if out.get("kv_lora_rank"):
            raise inexact(model_type, "partial_rotary_factor", partial, "1.0 with MLA")
        if not FAMILIES[model_type].partial_rotary:
            raise inexact(model_type, "partial_rotary_factor", partial,
                          f"1.0 (transformers' {model_type} rotates the whole head)")
        out["rope_dim"] = int(out["head_dim"] * partial)
        if out["rope_dim"] != out["head_dim"] * partial:
            raise inexact(model_type, "partial_rotary_factor", partial,
                          "a factor giving a whole number of rotated dimensions")
    merged = {k: v for k, v in merged.items()  # a known key's null: as if absent
              if v is not None or k not in _ROPE_PARAMS}
    if kind not in _ROPE_TYPES:
        raise inexact(model_type, f"{where.get('rope_type', where.get('type', prefix))}.rope_type",
                      kind, ", ".join(_ROPE_TYPES))
    for key in sorted(merged):
        if key not in _ROPE_TYPES[kind]:
            raise inexact(model_type, f"{where[key]}.{key}", merged[key],
                          f"the {kind} parameters" if _ROPE_TYPES[kind] else
                          "no parameters for rope_type default")
    if kind == "default":
        return
    if kind == "yarn" and "original_max_position_embeddings" not in merged:
        # transformers' yarn takes max_position_embeddings then (_compute_yarn_parameters)
        merged["original_max_position_embeddings"] = vals["max_position_embeddings"]
    for key in _ROPE_TYPES[kind]:
        if key not in merged and _ROPE_PARAMS[key].default is NEEDED:
            raise missing(model_type, f"{prefix}.{key}", _ROPE_PARAMS[key].allowed.allowed,
                          f" (rope_type {kind} needs it)")
    out["rope_scaling"] = kind
    out["rope_factor"] = float(merged["factor"])
    if kind == "linear":
        return
    out["rope_original_max_len"] = int(merged["original_max_position_embeddings"])
    names = ({"low_freq_factor": "rope_low_freq_factor",
              "high_freq_factor": "rope_high_freq_factor"} if kind == "llama3" else
             {"beta_fast": "rope_beta_fast", "beta_slow": "rope_beta_slow",
              "mscale": "rope_mscale", "mscale_all_dim": "rope_mscale_all_dim"})
    for key, field in names.items():
        if key in merged:
            out[field] = float(merged[key])
    if kind == "yarn" and "truncate" in merged:
        out["rope_truncate"] = merged["truncate"]
    if kind == "llama3" and not merged["high_freq_factor"] > merged["low_freq_factor"]:
        raise not_allowed(model_type, f"{where['high_freq_factor']}.high_freq_factor",
                          merged["high_freq_factor"],
                          f"a number > low_freq_factor={merged['low_freq_factor']}")


# The quantization_config each method the loader dequantizes may have: {key: Field}
# (transformers' Mxfp4Config and FineGrainedFP8Config; modules_to_not_convert names what is
# stored unquantized, which the loader sees from the tensors' dtypes).
_BLOCK = Kind(lambda v: isinstance(v, list) and len(v) == 2 and all(is_int(b) and b >= 1
                                                                   for b in v),
              "[rows, cols], two integers >= 1")
_QUANTIZATIONS = {
    "mxfp4": {"modules_to_not_convert": Field(NAMES, None, null=None)},
    "fp8": {"modules_to_not_convert": Field(NAMES, None, null=None),
            "fmt": fixed("e4m3"), "activation_scheme": fixed("dynamic"),
            "weight_block_size": Field(_BLOCK, [128, 128])},  # FineGrainedFP8Config's
}


def quantization(model_type: str, hf: Dict[str, Any]) -> Optional[Tuple[str, Dict[str, Any]]]:
    """``(quant_method, {key: checked value})`` of ``hf``'s ``quantization_config`` when the
    family's loader dequantizes that method (:attr:`Family.quantization`: GPT-OSS's
    ``mxfp4`` experts, the blockwise ``fp8`` of DeepSeek-V3, Qwen3, GLM-4.5), None without
    one.

    Raises:
      ValueError: any other quantization, a key jaxmp does not read, or a value it cannot
        (one line, naming it).
    """
    q = hf.get("quantization_config")
    if q is None:
        return None
    methods = FAMILIES[model_type].quantization
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method not in methods:
        raise inexact(model_type, "quantization_config", q,
                      "absent (jaxmp reads unquantized float16, bfloat16 or float32 weights"
                      + (f", and {' or '.join(methods)} ones" if methods else "") + ")")
    specs = _QUANTIZATIONS[method]
    extra = sorted(set(q) - set(specs) - {"quant_method"})
    if extra:
        raise inexact(model_type, f"quantization_config.{extra[0]}", q[extra[0]],
                      f"the {method} keys {', '.join(['quant_method', *sorted(specs)])}")
    return method, {k: read_field(model_type, f"quantization_config.{k}", spec, k in q,
                                  q.get(k)) for k, spec in specs.items()}


def text_config(hf: Dict[str, Any]) -> Tuple[Dict[str, Any], Optional[str]]:
    """``(the text model's config.json, the wrapper's model_type)`` of a multimodal wrapper
    (:attr:`Family.text_of`: its ``text_config``, whose ``model_type`` is the text family's
    or absent), its own fields checked; ``(hf, None)`` for any other config.json.

    Raises:
      ValueError: a wrapper field unknown, missing, ill-typed or not representable (one line
        naming it), or a ``text_config`` of another family.
    """
    fam = FAMILIES.get(hf.get("model_type")) if isinstance(hf, dict) and isinstance(
        hf.get("model_type"), str) else None
    if fam is None or not fam.text_of:
        return hf, None
    wrapper = fam.model_type
    for key in hf:
        if key not in fam.specs and key not in IGNORED_FIELDS:
            raise inexact(wrapper, field_name(key), hf[key],
                          "the fields jaxmp.models.hf implements (unknown field)")
    vals = field_values(wrapper, hf)
    text = dict(vals["text_config"])
    if hf.get("quantization_config") is not None:  # transformers writes it on the wrapper
        if text.get("quantization_config") not in (None, hf["quantization_config"]):
            raise not_allowed(wrapper, "quantization_config", hf["quantization_config"],
                              "text_config.quantization_config's value (both are given)")
        text["quantization_config"] = hf["quantization_config"]
    kind = text.setdefault("model_type", fam.text_of)
    if kind != fam.text_of:
        raise not_allowed(wrapper, "text_config.model_type", kind, repr(fam.text_of))
    return text, wrapper




def _window_fields(model_type: str, hf: Dict[str, Any], vals: Dict[str, Any],
                   out: Dict[str, Any]) -> None:
    """``out``'s ``sliding_window`` and ``layer_types`` as transformers' model of the family
    computes them (:attr:`Family.window`), or a one-line refusal: a window the family has
    not, ``layer_types`` of the wrong length or names, or ones the family would not read.
    A window no layer uses is no window (``sliding_window`` 0)."""
    fam = FAMILIES[model_type]
    n, types = vals["num_hidden_layers"], list(vals["layer_types"])
    if (types or hf.get("layer_types") == []) and len(types) != n:
        raise not_allowed(model_type, "layer_types", hf["layer_types"],
                          f"one entry per layer ({n}, num_hidden_layers; transformers refuses "
                          f"another length)")
    kinds = [t for t in LAYER_TYPES if t != "linear_attention" or
             "linear_attention" in fam.features]
    if any(t not in kinds for t in types):
        raise inexact(model_type, "layer_types", hf["layer_types"],
                      f"{' or '.join(kinds)} per layer")
    window = vals["sliding_window"]
    switch = fam.specs["use_sliding_window"].default is not ABSENT  # the family reads it
    if switch and not vals["use_sliding_window"]:
        window = None  # transformers: sliding_window = sliding_window if use_sliding_window
    elif not switch and "use_sliding_window" in hf and fam.window:
        raise inexact(model_type, "use_sliding_window", hf["use_sliding_window"],
                      f"absent (transformers' {model_type} does not read it: sliding_window "
                      f"alone decides)")
    if not fam.window:
        if window is not None:
            raise inexact(model_type, "sliding_window", window,
                          "None" + ("" if "sliding_window" in hf else
                                    f" (absent: transformers' {model_type} default)"))
        if "sliding_attention" in types:
            raise inexact(model_type, "layer_types", hf["layer_types"], "only full_attention")
        return
    if window is None:
        if "sliding_attention" in types and fam.window == "layered" and switch:
            raise not_allowed(model_type, "layer_types", hf["layer_types"],
                              "full_attention only while use_sliding_window is false (a "
                              "sliding layer without a window: transformers fails on it)")
        return
    if fam.window == "uniform":
        if any(t != "sliding_attention" for t in types):
            raise inexact(model_type, "layer_types", hf["layer_types"],
                          f"absent, or sliding_attention for every layer (transformers' "
                          f"{model_type} does not read layer_types: sliding_window={window} "
                          f"applies to every layer)")
        out["sliding_window"] = int(window)
        return
    # layered: layer_types, or transformers' default (Gemma 3: every pattern-th layer is
    # global; Qwen: the layers from max_window_layers on slide), listed per layer
    first = vals.get("max_window_layers", 0)
    if not types and ("sliding_window_pattern" in vals or 0 < first < n) and \
            n > MAX_LISTED_LAYERS:
        raise not_allowed(model_type, "num_hidden_layers", n,
                          f"at most {MAX_LISTED_LAYERS:,} layers where sliding and global "
                          f"layers alternate (each is listed)")
    if not types and "sliding_window_pattern" in vals:
        every = vals["sliding_window_pattern"]
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    if not types and first >= n:
        return
    out["sliding_window"] = int(window)
    if types and "full_attention" in types:
        out["layer_types"] = tuple(types) if "sliding_attention" in types else ()
        if not out["layer_types"]:
            del out["sliding_window"]
    elif not types and first > 0:  # counted before enumerated: n may be huge
        out["layer_types"] = ("full_attention",) * first + ("sliding_attention",) * (n - first)


def _write_window(config: ModelConfig, fam, hf: Dict[str, Any]) -> None:
    """The sliding-window fields of ``config`` as the family writes them (the inverse of
    :func:`_window_fields`; a family without windows writes none, and a model with a
    window is then refused by the round trip of :func:`config_to_hf`)."""
    if not fam.window:
        return
    window = config.sliding_window or None
    hf["sliding_window"] = window
    if fam.specs["use_sliding_window"].default is not ABSENT:
        hf["use_sliding_window"] = window is not None
    if fam.window == "layered" and window is not None:
        hf["layer_types"] = [LAYER_TYPES[int(bool(config.attention_window(i)))]
                             for i in range(config.num_layers)]


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
        raise ValueError(f"config.json: {short(hf)} is not a JSON object of fields "
                         f"({type(hf).__name__}); allowed: an object {{...}}")
    bad = non_finite(hf)
    if bad is not None:
        raise ValueError(f"config.json: {bad[0]}={bad[1]!r} is not a finite number; "
                         f"allowed: finite numbers only")
    text, wrapper = text_config(hf)
    if wrapper is not None:  # a multimodal checkpoint: its text model is what jaxmp reads
        return config_from_hf(text)
    model_type = hf.get("model_type")
    if not isinstance(model_type, str) or model_type not in FAMILIES or \
            FAMILIES[model_type].text_of:
        raise ValueError(f"config.json: model_type={short(model_type)} is not supported; "
                         f"allowed: {', '.join(FAMILIES)}")
    fam = FAMILIES[model_type]
    for key in hf:
        if key not in fam.specs and key not in IGNORED_FIELDS:
            raise inexact(model_type, field_name(key), hf[key],
                          "the fields jaxmp.models.hf implements (unknown field)")
    vals = field_values(model_type, hf)
    out: Dict[str, Any] = {"num_experts": 0}
    _window_fields(model_type, hf, vals, out)
    said: Dict[str, str] = {}  # ModelConfig field -> the config.json field that set it
    for key, field in fam.fields.items():
        if key not in vals:
            continue
        if field in said and vals[said[field]] != vals[key]:
            raise not_allowed(model_type, key, vals[key], f"{said[field]}'s value "
                              f"{vals[said[field]]!r} (both name "
                              f"{field})")
        out[field], said[field] = vals[key], key
    out.update(fam.fixed)
    if fam.read is not None:
        fam.read(vals, hf, out)
    quantization(model_type, hf)
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
    _write_window(config, fam, hf)
    if fam.write is not None:  # after the shared writers: a family may say more
        fam.write(config, hf)
    hf["rope_theta"] = config.rope_theta
    partial = (config.rope_dim or config.head_dim) / config.head_dim
    if partial != 1.0 or fam.specs["partial_rotary_factor"].default != 1.0:
        hf["partial_rotary_factor"] = partial  # said whenever the family's default is not 1
    if config.rope_scaling == "linear":
        hf["rope_scaling"] = {"rope_type": "linear", "factor": config.rope_factor}
    elif config.rope_scaling != "none":
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
            if not config.rope_truncate:
                scaling["truncate"] = False
        hf["rope_scaling"] = scaling
    try:
        back = config_from_hf(hf)  # what the file says must be exactly this model
    except ValueError as e:  # said of a file the user never wrote: say it of the model
        raise ValueError(f"the model does not map to {family}: the config.json it would "
                         f"write is refused ({e})") from None
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
               "group_score", "mlp_only_layers", "moe_bias", "expert_activation",
               "swiglu_alpha", "swiglu_limit")
# The ModelConfig fields of the rope_scaling parameters, and those each scaling reads.
_SCALING_PARAMS = ("rope_factor", "rope_original_max_len", "rope_low_freq_factor",
                   "rope_high_freq_factor", "rope_beta_fast", "rope_beta_slow", "rope_mscale",
                   "rope_mscale_all_dim", "rope_truncate")
_PARAMS_OF = {
    "none": (), "linear": ("rope_factor",),
    "llama3": ("rope_factor", "rope_original_max_len", "rope_low_freq_factor",
               "rope_high_freq_factor"),
    "yarn": ("rope_factor", "rope_original_max_len", "rope_beta_fast", "rope_beta_slow",
             "rope_mscale", "rope_mscale_all_dim", "rope_truncate"),
}
_MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
               "v_head_dim")


def _relevant_fields(config: ModelConfig) -> List[str]:
    """The architecture fields that change what ``config``'s model computes."""
    skip = set(RUNTIME_FIELDS)
    if not config.num_experts:
        skip |= set(_MOE_FIELDS)
    if config.topk_group == config.n_group:  # routing not group-limited
        skip.add("group_score")
    if config.expert_activation == "silu":
        skip |= {"swiglu_alpha", "swiglu_limit"}
    if config.num_dense_layers == 0:
        skip.add("d_ff")
    if config.is_mla:
        skip |= {"head_dim", "num_kv_heads", "qk_norm", "qkv_bias", "o_bias", "rope_dim"}
    else:
        skip |= set(_MLA_FIELDS)
    skip |= set(_SCALING_PARAMS) - set(_PARAMS_OF[config.rope_scaling])
    return [f.name for f in dataclasses.fields(config) if f.name not in skip]


def family_of(config: ModelConfig) -> str:
    """The family whose architecture is ``config``'s: the one whose :attr:`Family.maps`
    holds (at most one does).

    Raises:
      ValueError: none maps (one line, naming the first field in the way), or two
        families' ``maps`` both hold (a family module's fault: a family that writes the
        files of another with nothing of its own, declares ``maps=None``).
    """
    used = {name for name, test in FEATURES.items() if test(config)}
    found = [name for name, fam in FAMILIES.items()
             if fam.maps is not None and used <= fam.features and fam.maps(config)]
    if len(found) > 1:
        raise ValueError(f"families {', '.join(found)} all map this architecture; each "
                         f"architecture belongs to one family (give the other maps=None)")
    if found:
        return found[0]
    if config.is_mla and not config.num_experts:
        raise ValueError(f"model.kv_lora_rank={config.kv_lora_rank} (MLA) without routed experts "
                         f"maps to no family (deepseek_v2 and deepseek_v3, the MLA families, "
                         f"route to experts: model.num_experts > 0)")
    if config.num_experts and config.num_shared_experts and not config.is_mla:
        raise ValueError(f"model.num_shared_experts={config.num_shared_experts} with "
                         f"softmax routing and standard attention maps to no family "
                         f"(deepseek_v2 needs MLA: kv_lora_rank > 0; glm4_moe "
                         f"score_fn='sigmoid')")
    raise ValueError(f"model: this architecture maps to no family of "
                     f"{', '.join(FAMILIES)}")
