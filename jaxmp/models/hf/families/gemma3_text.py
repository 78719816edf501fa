"""Gemma 3 (text): (1 + w) RMSNorms before and after attention and the FFN, q/k norms,
the embedding scaled by ``sqrt(hidden_size)``, scores scaled by
``query_pre_attn_scalar ** -0.5``, GeGLU (``gelu_pytorch_tanh``), a tied head, and sliding
windows on every layer but each ``sliding_window_pattern``-th (or as ``layer_types``
says), whose RoPE is plain with base ``rope_local_base_freq`` while the global layers'
takes ``rope_theta`` and ``rope_scaling`` (linear in the released 4B-27B).

transformers: ``models/gemma3/configuration_gemma3.py`` (``Gemma3TextConfig``, both its
old ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling`` fields and its
``rope_parameters`` per layer type) and ``modeling_gemma3.py``. Logit soft-capping
(Gemma 2's) and bidirectional attention are refused.
"""
from jaxmp._checks import Choice
from jaxmp.models.hf.spec import (COMMON_FIELDS, COUNT, OBJECT, POSITIVE, STRING, Field, Family,
                                  common_specs, fixed, inexact, not_allowed, read_field)

_LAYER_KINDS = ("full_attention", "sliding_attention")


def _read(vals, hf, out):
    """The embedding scale, and the two RoPEs: ``rope_parameters`` keyed by layer type
    (transformers 5) is split here, the global layers' read by the shared reader. The
    local layers' base is kept only where a layer slides. transformers' Gemma 3 reads
    neither ``rope_scaling``'s legacy ``type`` key nor a ``rope_parameters`` not keyed by
    layer type (it ignores them): both are refused."""
    out["embed_scale"] = float(vals["hidden_size"]) ** 0.5
    if vals["hidden_size"] % vals["num_attention_heads"]:  # Gemma3TextConfig's own check
        raise not_allowed("gemma3_text", "hidden_size", vals["hidden_size"],
                          f"a multiple of num_attention_heads={vals['num_attention_heads']} "
                          f"(transformers' Gemma 3 refuses another)")
    if "type" in vals["rope_scaling"]:
        raise inexact("gemma3_text", "rope_scaling.type", vals["rope_scaling"]["type"],
                      "absent (transformers' Gemma 3 reads rope_type, and ignores type)")
    params = vals["rope_parameters"]
    if params and not set(params) & set(_LAYER_KINDS):
        raise inexact("gemma3_text", "rope_parameters", params,
                      "keyed by full_attention and sliding_attention (transformers' Gemma 3 "
                      "ignores other keys)")
    slides = bool(out.get("sliding_window"))  # _window_fields has read the layers
    if not params:
        if slides:
            out["rope_local_theta"] = float(vals["rope_local_base_freq"])
        return
    extra = sorted(set(params) - set(_LAYER_KINDS))
    if extra:
        raise inexact("gemma3_text", f"rope_parameters.{extra[0]}", params[extra[0]],
                      "full_attention and sliding_attention entries")
    local = params.get("sliding_attention") or {}
    if not isinstance(local, dict) or set(local) - {"rope_type", "rope_theta"} or \
            local.get("rope_type", "default") != "default":
        raise inexact("gemma3_text", "rope_parameters.sliding_attention", local,
                      "{rope_type: default, rope_theta} (plain RoPE on the local layers)")
    theta = read_field("gemma3_text", "rope_parameters.sliding_attention.rope_theta",
                       Field(POSITIVE), True, local.get("rope_theta",
                                                        vals["rope_local_base_freq"]))
    if slides:
        out["rope_local_theta"] = float(theta)
    full = params.get("full_attention") or {}
    if not isinstance(full, dict):
        raise not_allowed("gemma3_text", "rope_parameters.full_attention", full,
                          OBJECT.allowed)
    vals["rope_parameters"] = dict(full)  # the global layers' RoPE: the shared reader's


def _write(config, hf):
    hf["query_pre_attn_scalar"] = int(config.query_pre_attn_scalar)  # refused unless whole
    hf["hidden_activation"] = "gelu_pytorch_tanh"
    hf["rope_local_base_freq"] = config.rope_local_theta or config.rope_theta
    hf["attention_bias"] = False


FAMILY = Family(
    "gemma3_text", "Gemma3ForCausalLM",
    "Gemma 3 text ((1 + w) norms before and after each branch, GeGLU, scaled embedding, "
    "local and global layers)",
    dict(COMMON_FIELDS, query_pre_attn_scalar="query_pre_attn_scalar"),
    {"qk_norm": True, "norm_plus_one": True, "post_norms": True, "tie_embeddings": True,
     "mlp_activation": "gelu_tanh"},
    specs=common_specs(
        max_len=131072, kv_heads=4, head_dim=256, theta=1e6, window=4096, windows=True,
        # Shape fields default too, to transformers' Gemma3TextConfig values: the released
        # multimodal configs' text_config gives only those that differ (Gemma-3-4B's has no
        # vocab_size nor num_attention_heads).
        vocab_size=Field(COUNT, 262_208), hidden_size=Field(COUNT, 2304),
        intermediate_size=Field(COUNT, 9216), num_hidden_layers=Field(COUNT, 26),
        num_attention_heads=Field(COUNT, 8),
        hidden_activation=fixed("gelu_pytorch_tanh"),
        hidden_act=Field(STRING, None, null=None),  # not read by transformers' Gemma 3
        tie_word_embeddings=fixed(True),
        query_pre_attn_scalar=Field(COUNT, 256),  # an int in transformers' config class
        attention_bias=fixed(False),
        final_logit_softcapping=Field(Choice((), "null"), None, null=None, exact=True),
        attn_logit_softcapping=Field(Choice((), "null"), None, null=None, exact=True),
        use_bidirectional_attention=Field(Choice((False,), "false"), False, null=False,
                                          exact=True),
        rope_local_base_freq=Field(POSITIVE, 10000.0),
        sliding_window_pattern=Field(COUNT, 6),
        _sliding_window_pattern=Field(COUNT, None, null=None)),  # written, never read
    read=_read, write=_write,
    maps=lambda c: not c.is_mla and not c.num_experts and c.norm_plus_one and c.post_norms,
    window="layered",
    features=frozenset({"norm_plus_one", "post_norms", "embed_scale", "query_pre_attn_scalar",
                        "mlp_activation", "rope_local_theta"}))
