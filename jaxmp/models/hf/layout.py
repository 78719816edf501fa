"""Where each jaxmp parameter comes from in a Hugging Face checkpoint, and how its layout
differs.

transformers' ``nn.Linear`` weight ``[out, in]`` is jaxmp's ``[in, out]`` transposed, with
the head axis split out (``q_proj.weight [H * h, d]`` is ``wq [d, H, h]``); routed experts
are stacked (``experts.{e}.gate_proj.weight`` are ``w_gate[e]``), or stored stacked
already (GPT-OSS's ``experts.gate_up_proj``, gate and up interleaved). The names of attention,
dense MLPs and norms are common to every family; a family's record names its MoE block,
experts, router and shared experts (:attr:`~jaxmp.models.hf.spec.Family.moe`).
"""
from __future__ import annotations

from typing import Dict, Tuple

import numpy as np
from flax import nnx

from jaxmp.models.hf.families import FAMILIES
from jaxmp.models.hf.files import Files
from jaxmp.models.config import ModelConfig
from jaxmp.models.transformer import MoETransformer

__all__ = ["INTERLEAVED", "read_tensor", "layer_table", "global_table", "param_sources", "norm_index"]


def norm_index(index, shape):
    """A device index (a tuple of slices and integers) as explicit ranges per axis."""
    return tuple(range(*s.indices(n)) if isinstance(s, slice) else [s]
                 for s, n in zip(index, shape))


# A mapping reads one parameter of jaxmp's shape for a device index from HF tensors.
# kinds: "same" (identical layout), "in" (ours = W[out, in].T, out split into ours[1:]),
# "out" (ours = W[out, in].T, in split into ours[:-1]), "vec" (a vector reshaped),
# "even" / "odd" (ours = W[..., 0::2] / W[..., 1::2]: GPT-OSS's interleaved gate and up).
INTERLEAVED = ("even", "odd")


def read_tensor(files: Files, name: str, kind: str, shape: Tuple[int, ...], index,
                raw: bool = False) -> np.ndarray:
    """jaxmp's ``shape`` slice ``index`` of HF tensor ``name`` laid out by ``kind``; with
    ``raw``, an FP8 weight's E4M3 values as stored (:meth:`Files.read_e4m3`, a
    ``lora.base=fp8`` model's), else every tensor as float (FP8 ones dequantized)."""
    read = files.read_e4m3 if raw else files.read
    if kind == "same":
        return read(name, index)
    if kind == "vec":
        return read(name, slice(None)).reshape(shape)[index]
    if kind in INTERLEAVED:  # the device's rows, every column; then its half's columns
        w = read(name, tuple(index[:-1]) + (slice(None),))
        return w[..., INTERLEAVED.index(kind)::2][..., index[-1]]
    if kind == "in":  # ours [in, *out]
        w = read(name, (slice(None), index[0]))  # [out, in_local]
        return w.T.reshape((w.shape[1],) + tuple(shape[1:]))[(slice(None),) + tuple(index[1:])]
    w = read(name, (index[-1], slice(None)))  # "out": ours [*in, out]; w [out_local, in]
    return w.T.reshape(tuple(shape[:-1]) + (w.shape[0],))[tuple(index[:-1]) + (slice(None),)]


def layer_table(config: ModelConfig, family: str, i: int) -> Dict[str, Tuple]:
    """``{jaxmp path relative to a block: (hf name(s), kind)}`` for layer ``i``; a tuple of
    names is stacked on a new leading axis (routed experts)."""
    fam = FAMILIES[family]
    p = f"model.layers.{i}"
    t: Dict[str, Tuple] = {
        "attn_norm/scale": (f"{p}.input_layernorm.weight", "same"),
        "ffn_norm/scale": (f"{p}.post_attention_layernorm.weight", "same"),
    }
    if config.post_norms:  # Gemma 2/3: the norm after attention is transformers' "post"
        t.update({"post_attn_norm/scale": (f"{p}.post_attention_layernorm.weight", "same"),
                  "ffn_norm/scale": (f"{p}.pre_feedforward_layernorm.weight", "same"),
                  "post_ffn_norm/scale": (f"{p}.post_feedforward_layernorm.weight", "same")})
    a = f"{p}.self_attn"
    if config.layer_type(i) == "linear_attention":  # Qwen3-Next's Gated DeltaNet
        la = f"{p}.linear_attn"
        if config.linear_projections == "grouped":
            t.update({"attn/wqkvz": (f"{la}.in_proj_qkvz.weight", "in"),
                      "attn/wba": (f"{la}.in_proj_ba.weight", "in")})
        else:  # Qwen3.5
            t.update({f"attn/w{x}": (f"{la}.in_proj_{x}.weight", "in")
                      for x in ("qkv", "z", "b", "a")})
        t.update({"attn/conv": (f"{la}.conv1d.weight", "same"),
                  "attn/dt_bias": (f"{la}.dt_bias", "same"),
                  "attn/A_log": (f"{la}.A_log", "same"),
                  "attn/norm_scale": (f"{la}.norm.weight", "same"),
                  "attn/wo": (f"{la}.out_proj.weight", "out")})
    elif config.is_mla:
        if config.q_lora_rank:
            t["attn/wq_a"] = (f"{a}.q_a_proj.weight", "in")
            t["attn/q_a_norm/scale"] = (f"{a}.q_a_layernorm.weight", "same")
            t["attn/wq_b"] = (f"{a}.q_b_proj.weight", "in")
        else:
            t["attn/wq"] = (f"{a}.q_proj.weight", "in")
        t["attn/wkv_a"] = (f"{a}.kv_a_proj_with_mqa.weight", "in")
        t["attn/kv_a_norm/scale"] = (f"{a}.kv_a_layernorm.weight", "same")
        t["attn/wkv_b"] = (f"{a}.kv_b_proj.weight", "in")
    else:
        for x in "qkv":
            t[f"attn/w{x}"] = (f"{a}.{x}_proj.weight", "in")
            if config.qkv_bias:
                t[f"attn/b{x}"] = (f"{a}.{x}_proj.bias", "vec")
        if config.qk_norm:
            t["attn/q_norm/scale"] = (f"{a}.q_norm.weight", "same")
            t["attn/k_norm/scale"] = (f"{a}.k_norm.weight", "same")
        if config.attention_sinks:
            t["attn/sinks"] = (f"{a}.sinks", "same")
    if "attn/wo" not in t:  # attention's (standard or MLA) output projection
        t["attn/wo"] = (f"{a}.o_proj.weight", "out")
        if config.o_bias:
            t["attn/bo"] = (f"{a}.o_proj.bias", "same")
    if config.is_moe_layer(i):
        moe = fam.moe
        b = f"{p}.{moe['block']}"
        experts = range(config.num_experts)
        t["moe/router/kernel"] = (f"{b}.{moe['router']}.weight", "in")
        if "bias" in moe:
            t["moe/router/bias"] = (f"{b}.{moe['bias']}", "same")
        if config.moe_bias:
            t["moe/router/logit_bias"] = (f"{b}.{moe['router']}.bias", "same")
        if moe.get("fused"):  # stacked experts, gate and up interleaved (GPT-OSS)
            x = f"{b}.experts"
            for ours, theirs, kind in (("gate", "gate_up_proj", "even"),
                                       ("up", "gate_up_proj", "odd"),
                                       ("down", "down_proj", "same")):
                t[f"moe/experts/w_{ours}"] = (f"{x}.{theirs}", kind)
                if config.moe_bias:
                    t[f"moe/experts/b_{ours}"] = (f"{x}.{theirs}_bias", kind)
        else:
            g, u, d = moe["experts"]
            for ours, theirs, kind in (("w_gate", g, "in"), ("w_up", u, "in"),
                                       ("w_down", d, "out")):
                t[f"moe/experts/{ours}"] = (tuple(f"{b}.experts.{e}.{theirs}.weight"
                                                  for e in experts), kind)
        if config.num_shared_experts:
            s = f"{b}.{moe['shared']}"
            for ours, theirs, kind in (("w_gate", "gate_proj", "in"), ("w_up", "up_proj", "in"),
                                       ("w_down", "down_proj", "out")):
                t[f"moe/shared_experts/{ours}"] = (f"{s}.{theirs}.weight", kind)
            if config.shared_expert_gate:
                t["moe/shared_gate"] = (f"{b}.{moe['shared_gate']}.weight", "in")
    else:
        m = f"{p}.mlp"
        for ours, theirs, kind in (("w_gate", "gate_proj", "in"), ("w_up", "up_proj", "in"),
                                   ("w_down", "down_proj", "out")):
            t[f"mlp/{ours}"] = (f"{m}.{theirs}.weight", kind)
    return t


def global_table(config: ModelConfig) -> Dict[str, Tuple]:
    """``{jaxmp path: (hf name, kind)}`` of the variables outside the blocks."""
    t = {"embed/table": ("model.embed_tokens.weight", "same"),
         "final_norm/scale": ("model.norm.weight", "same")}
    if not config.tie_embeddings:
        t["head/kernel"] = ("lm_head.weight", "in")
    return t


def param_sources(model: MoETransformer, family: str):
    """``{flat state path: (layers, relative key, stacked)}``: where each variable of
    ``model`` comes from. ``layers`` is None for a global variable, else the tuple of layer
    indices (one per row of a scanned stack, or ``(i,)`` unscanned with no leading axis);
    ``stacked``: the variable has the stack's leading axis. (``family`` is not read: the
    paths are the model's own.)"""
    out = {}
    for path, _ in nnx.to_flat_state(nnx.state(model)):
        path = tuple(str(x) for x in path)
        if path[0] == "blocks":
            out[path] = ((int(path[1]),), "/".join(path[2:]), False)
        elif path[0] == "stacks":
            layers = model.stacks[int(path[1])].layers
            out[path] = (layers, "/".join(path[2:]), True)
        else:
            out[path] = (None, "/".join(path), False)
    return out
