"""Mistral without a sliding window: Llama's tensors and fields, Mistral's defaults
(``sliding_window`` 4096 when absent, so a config.json must say null).

transformers: ``models/mistral/configuration_mistral.py``. Never chosen by
:func:`~jaxmp.models.hf.family_of` (its files are Llama's); ``family="mistral"`` writes it.
"""
from jaxmp.models.hf.spec import COMMON_FIELDS, Family, common_specs

FAMILY = Family(
    "mistral", "MistralForCausalLM",
    "Mistral without a sliding window (the llama table)",
    dict(COMMON_FIELDS), {},
    specs=common_specs(max_len=131072, kv_heads=8, window=4096))
