"""DeepSeek-V2 / V2-Lite: DeepSeek-V3's MLA and fields, a softmax router, ``topk_method``
``greedy`` or ``group_limited_greedy`` (a group's score is its best expert's), interleaved
RoPE, gates never renormalized.

transformers: ``models/deepseek_v2/configuration_deepseek_v2.py``.
"""
from jaxmp.models.hf.families.deepseek_v3 import FIELDS, SPECS, read_mla, write_mla
from jaxmp.models.hf.families.qwen3_moe import EXPERTS
from jaxmp.models.hf.spec import (COUNT, COUNT0, POSITIVE, Choice, Family, Field, common_specs,
                                  fixed, inexact, missing, not_allowed)


def _read(vals, hf, out):
    if vals["topk_method"] == "greedy":
        out["n_group"] = out["topk_group"] = 1  # transformers' greedy ignores the groups
    else:  # group_limited_greedy
        for key in ("n_group", "topk_group"):
            if out[key] is None:
                raise (not_allowed("deepseek_v2", key, None, "an integer >= 1 with "
                                                             "topk_method group_limited_greedy")
                       if key in hf else missing("deepseek_v2", key, "an integer >= 1",
                                                 " with topk_method group_limited_greedy"))
        per_group = out["num_experts"] // out["n_group"]
        if out["top_k"] > out["topk_group"] * per_group:
            raise inexact("deepseek_v2", "num_experts_per_tok", out["top_k"],
                          "at most topk_group x the experts of a group (transformers would "
                          "pick masked experts with gate 0)")
    read_mla("deepseek_v2", hf, out)


def _write(config, hf):
    write_mla(config, hf)
    hf["topk_method"] = ("group_limited_greedy" if config.topk_group < config.n_group
                         else "greedy")


FAMILY = Family(
    "deepseek_v2", "DeepseekV2ForCausalLM",
    "DeepSeek-V2 / V2-Lite (MLA, softmax router, ``topk_method`` ``greedy`` or "
    "``group_limited_greedy``: a group's score is its best expert's)",
    dict(FIELDS), {"score_fn": "softmax", "rope_layout": "interleaved", "group_score": "max"},
    {"block": "mlp", "experts": EXPERTS, "router": "gate", "shared": "shared_experts"},
    common_specs(max_len=2048, d_ff=COUNT0, **SPECS,
                 n_shared_experts=Field(COUNT0, 2), first_k_dense_replace=Field(COUNT0, 0),
                 norm_topk_prob=Field(Choice((False,), "false (transformers' DeepseekV2 never "
                                                       "normalizes)"), False, null=False,
                                      exact=True),
                 routed_scaling_factor=Field(POSITIVE, 1.0),
                 n_group=Field(COUNT, None, null=None), topk_group=Field(COUNT, None, null=None),
                 topk_method=fixed("greedy", "group_limited_greedy"),
                 scoring_func=fixed("softmax")),
    read=_read, write=_write,
    maps=lambda c: c.is_mla and c.num_experts and c.score_fn != "sigmoid")
