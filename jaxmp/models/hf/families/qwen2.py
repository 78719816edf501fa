"""Qwen2 / Qwen2.5 dense: q/k/v biases always, no sliding window
(``use_sliding_window`` false).

transformers: ``models/qwen2/configuration_qwen2.py``.
"""
from jaxmp.models.hf.spec import COMMON_FIELDS, Family, common_specs

FAMILY = Family(
    "qwen2", "Qwen2ForCausalLM",
    "Qwen2 / Qwen2.5 dense (q/k/v biases; no sliding window)",
    dict(COMMON_FIELDS), {"qkv_bias": True},
    specs=common_specs(max_len=32768, kv_heads=32, window=4096, window_switch=False),
    maps=lambda c: not c.is_mla and not c.num_experts and not c.qk_norm and c.qkv_bias)
