"""Qwen3 dense: per-head RMSNorm of queries and keys, an explicit ``head_dim``, no q/k/v
biases; sliding windows as Qwen2's (``use_sliding_window``, ``layer_types``,
``max_window_layers``).

transformers: ``models/qwen3/configuration_qwen3.py``.
"""
from jaxmp.models.hf.spec import COMMON_FIELDS, COUNT0, Family, Field, common_specs, fixed


def read(vals, hf, out):
    """``attention_bias`` is always false here: ModelConfig's own default says it."""
    out.pop("qkv_bias", None)


def write(config, hf):
    hf["attention_bias"] = bool(config.qkv_bias)


FAMILY = Family(
    "qwen3", "Qwen3ForCausalLM",
    "Qwen3 dense (per-head q/k RMSNorm, explicit ``head_dim``)",
    dict(COMMON_FIELDS, attention_bias="qkv_bias"), {"qk_norm": True},
    specs=common_specs(max_len=32768, kv_heads=32, head_dim=128, window=4096,
                       window_switch=False, windows=True, attention_bias=fixed(False),
                       max_window_layers=Field(COUNT0, 28)),
    read=read, write=write,
    maps=lambda c: not c.is_mla and not c.num_experts and c.qk_norm,
    window="layered")
