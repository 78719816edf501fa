"""Qwen2 / Qwen2.5 dense: q/k/v biases always; a sliding window where
``use_sliding_window`` is true, on the layers ``layer_types`` names (by default those from
``max_window_layers`` on).

transformers: ``models/qwen2/configuration_qwen2.py``.
"""
from jaxmp.models.hf.spec import COMMON_FIELDS, COUNT0, Family, Field, common_specs

FAMILY = Family(
    "qwen2", "Qwen2ForCausalLM",
    "Qwen2 / Qwen2.5 dense (q/k/v biases; sliding windows per layer)",
    dict(COMMON_FIELDS), {"qkv_bias": True},
    specs=common_specs(max_len=32768, kv_heads=32, window=4096, window_switch=False,
                       windows=True, max_window_layers=Field(COUNT0, 28)),
    maps=lambda c: not c.is_mla and not c.num_experts and not c.qk_norm and c.qkv_bias,
    window="layered")
