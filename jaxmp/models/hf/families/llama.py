"""Llama 2 / 3 / 3.1: grouped-query attention, ``llama3`` RoPE scaling, tied or untied head,
optional q/k/v biases (``attention_bias``; transformers' bias on ``o_proj`` too, which
jaxmp has not: refused unless false).

transformers: ``models/llama/configuration_llama.py`` (the defaults below).
"""
from jaxmp.models.hf.spec import COMMON_FIELDS, Family, common_specs, fixed


def _write(config, hf):
    hf["attention_bias"] = bool(config.qkv_bias)


FAMILY = Family(
    "llama", "LlamaForCausalLM",
    "Llama 2/3/3.1 (GQA, ``llama3`` RoPE scaling, tied or untied head)",
    dict(COMMON_FIELDS, attention_bias="qkv_bias"), {},
    specs=common_specs(max_len=2048, attention_bias=fixed(
        False, text="false (jaxmp has no o_proj bias)")),
    write=_write,
    maps=lambda c: (not c.is_mla and not c.num_experts and not c.qk_norm and not c.qkv_bias
                    and not c.sliding_window))
