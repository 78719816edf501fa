"""Mistral: Llama's tensors and fields, and a sliding window over every layer
(``sliding_window``, 4096 when absent, as transformers' default; null for none).

transformers: ``models/mistral/configuration_mistral.py`` (its model applies
``sliding_window`` to every layer and does not read ``layer_types``). Chosen by
:func:`~jaxmp.models.hf.family_of` for a Llama-like model with a window on every layer
(without one, the model is Llama's).
"""
from jaxmp.models.hf.spec import COMMON_FIELDS, Family, common_specs

FAMILY = Family(
    "mistral", "MistralForCausalLM",
    "Mistral (the llama table, a sliding window on every layer)",
    dict(COMMON_FIELDS), {},
    specs=common_specs(max_len=131072, kv_heads=8, window=4096, windows=True),
    maps=lambda c: (not c.is_mla and not c.num_experts and not c.qk_norm and not c.qkv_bias
                    and c.sliding_window > 0 and not c.layer_types),
    window="uniform")
