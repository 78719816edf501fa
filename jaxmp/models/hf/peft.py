"""Writing a LoRA model's adapters as a PEFT adapter directory (:func:`save_adapters`):
``adapter_config.json`` and ``adapter_model.safetensors``, which
``peft.PeftModel.from_pretrained(base, directory)`` loads onto the base.

PEFT's names and shapes (peft 0.21, ``tuners/lora/layer.py``, ``utils/save_and_load.py``):
the module ``model.layers.{i}.self_attn.q_proj`` gets
``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` ``[r, in_features]``
and ``...lora_B.weight`` ``[out_features, r]``; ``in_features`` and ``out_features`` are the
``nn.Linear`` 's, whose weight ``[out, in]`` jaxmp stores as ``[in, *out]`` or ``[*in, out]``
(:mod:`jaxmp.models.hf.layout`, C order): so ``lora_A`` is jaxmp's ``A [*in, r]`` flattened
and transposed, ``lora_B`` its ``B [r, *out]`` likewise.
"""
from __future__ import annotations

import json
import os
from typing import Dict, Optional

import numpy as np
import jax
from flax import nnx

from jaxmp.models.hf.config import family_of
from jaxmp.models.hf.files import save_safetensors
from jaxmp.models.hf.layout import global_table, layer_table
from jaxmp.models.lora import adapted, is_lora

__all__ = ["save_adapters", "ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "PEFT_MOE_REMAPPED"]

# Families whose MLP projections peft (0.19 to 0.21 at least) re-targets when it loads an
# adapter onto transformers 5: their model types share transformers' "qwen2_moe" checkpoint
# conversion, and peft's transformers_weight_conversion._convert_peft_config_moe moves every
# target ending in .gate_proj, .up_proj or .down_proj (dense MLPs and shared experts too) to
# the routed experts' fused parameters, so such adapters would load onto the wrong modules.
PEFT_MOE_REMAPPED = {"deepseek_v2", "deepseek_v3", "glm4_moe", "qwen3_moe", "qwen3_next"}
_REMAPPED_NAMES = (".gate_proj", ".up_proj", ".down_proj")

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."  # PeftModelForCausalLM's prefix of the base model's names


def _adapter_tensors(model, family: str) -> Dict[str, np.ndarray]:
    """``{peft tensor name: float32 array}`` of every adapter of ``model``."""
    config, out = model.config, {}
    for path, module in nnx.iter_modules(model):
        for name in getattr(module, "matmul_weights", ()):
            adapter = adapted(module, name)
            if adapter is None:
                continue
            a, b = (np.asarray(jax.device_get(t), np.float32) for t in adapter[:2])
            stacked = bool(path) and str(path[0]) == "stacks"
            if path and str(path[0]) in ("stacks", "blocks"):
                rel = module.path.split("/", 2)[2] + "/" + name
                layers = model.stacks[int(path[1])].layers if stacked else (int(path[1]),)
                rows = [(layer_table(config, family, i)[rel], a[j] if stacked else a,
                         b[j] if stacked else b) for j, i in enumerate(layers)]
            else:
                rows = [(global_table(config)[f"{module.path}/{name}"], a, b)]
            for (hf_name, kind), a_i, b_i in rows:
                if kind not in ("in", "out") or not hf_name.endswith(".weight"):
                    raise ValueError(f"the adapter of jaxmp {module.path}/{name} has no PEFT form: "
                                     f"{family}'s {hf_name} is not an nn.Linear weight")
                module_name = _PREFIX + hf_name[:-len(".weight")]
                r = a_i.shape[-1]
                out[f"{module_name}.lora_A.weight"] = np.ascontiguousarray(a_i.reshape(-1, r).T)
                out[f"{module_name}.lora_B.weight"] = np.ascontiguousarray(b_i.reshape(r, -1).T)
    return out


def save_adapters(model, path: str, *, rank: int, alpha: float,
                  base_model: Optional[str] = None, family: Optional[str] = None) -> dict:
    """Writes ``model``'s adapters as a PEFT LoRA adapter directory.

    Args:
      model: a :class:`~jaxmp.models.MoETransformer` with adapters
        (:func:`jaxmp.models.lora.apply_lora`).
      path: the directory (created if missing).
      rank, alpha: the run's ``lora.rank`` and ``lora.alpha`` (PEFT's ``r`` and
        ``lora_alpha``; the scale is ``alpha / rank`` in both).
      base_model: ``base_model_name_or_path`` (the run's ``model.init_from``), or None.
      family: a key of :data:`jaxmp.models.hf.FAMILIES`; default :func:`family_of`'s.

    Returns:
      The adapter config written (``target_modules``: the exact module names adapted).

    Raises:
      ValueError: a model without adapters; an architecture that maps to no family; an
        adapter on a weight that is no ``nn.Linear`` of the family; for a family of
        :data:`PEFT_MOE_REMAPPED`, an adapter on an MLP projection (peft would load it
        onto the routed experts).
    """
    if not is_lora(model):
        raise ValueError("the model has no adapters (lora.rank=0): a PEFT export needs a run "
                         "trained with lora.rank > 0; export it with --format hf or jaxmp")
    family = family or family_of(model.config)
    tensors = _adapter_tensors(model, family)
    targets = sorted({n[len(_PREFIX):].rsplit(".lora_", 1)[0] for n in tensors})
    moved = [t for t in targets if t.endswith(_REMAPPED_NAMES)]
    if family in PEFT_MOE_REMAPPED and moved:
        raise ValueError(f"peft re-targets {family}'s MLP projections ({moved[0]}, ...) at the "
                         f"routed experts when it loads an adapter onto transformers 5, so these "
                         f"adapters would load onto the wrong modules; train with lora.targets "
                         f"that leave the MLPs out (e.g. 'attn/w') for a PEFT export, or export "
                         f"the merged model with --format hf")
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(rank),
        "lora_alpha": float(alpha), "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "inference_mode": True, "target_modules": targets,
        "modules_to_save": None, "base_model_name_or_path": base_model,
        "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None,
        "layers_pattern": None, "revision": None,
    }
    os.makedirs(path, exist_ok=True)
    save_safetensors(tensors, os.path.join(path, ADAPTER_WEIGHTS), {"format": "pt"})
    with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    return config
