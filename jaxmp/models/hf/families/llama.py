"""Llama 2 / 3 / 3.1: grouped-query attention, ``llama3`` RoPE scaling, tied or untied head,
optional biases (``attention_bias``: on the q, k, v and o projections alike, as
transformers' ``LlamaAttention`` has them).

transformers: ``models/llama/configuration_llama.py`` (the defaults below).
"""
from jaxmp._checks import BOOL
from jaxmp.models.hf.spec import COMMON_FIELDS, Family, Field, common_specs


def _read(vals, hf, out):
    out["o_bias"] = out["qkv_bias"]  # attention_bias: every projection of attention


def _write(config, hf):
    hf["attention_bias"] = bool(config.qkv_bias)


FAMILY = Family(
    "llama", "LlamaForCausalLM",
    "Llama 2/3/3.1 (GQA, ``llama3`` RoPE scaling, tied or untied head, ``attention_bias``)",
    dict(COMMON_FIELDS, attention_bias="qkv_bias"), {},
    specs=common_specs(max_len=2048, attention_bias=Field(BOOL, False)),
    read=_read, write=_write,
    maps=lambda c: (not c.is_mla and not c.num_experts and not c.qk_norm
                    and c.qkv_bias == c.o_bias and not c.sliding_window),
    features=frozenset({"o_bias"}))
