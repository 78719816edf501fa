"""Writing a :class:`~jaxmp.models.MoETransformer` as a Hugging Face checkpoint that
transformers loads (:func:`save_pretrained`).
"""
from __future__ import annotations

import json
import os
import re
from typing import Dict, List, Optional

import jax
import numpy as np
from flax import nnx

from jaxmp.models.hf.config import config_to_hf, family_of
from jaxmp.models.hf.families import FAMILIES
from jaxmp.models.hf.files import safetensors_module
from jaxmp.models.hf.layout import INTERLEAVED, global_table, layer_table, param_sources
from jaxmp.models.layers import FP8State
from jaxmp.models.moe import RouterBias
from jaxmp.models.transformer import MoETransformer

__all__ = ["save_pretrained", "check_router_biases", "MAX_SHARD_BYTES"]

MAX_SHARD_BYTES = 5 * 10 ** 9  # transformers' default max_shard_size="5GB"


def _hf_tensors(model: MoETransformer, family: str):
    """Yields ``(hf name, numpy array)`` for every tensor of ``family``'s checkpoint; the
    two halves of an interleaved tensor (:data:`~jaxmp.models.hf.layout.INTERLEAVED`)
    once both are read."""
    halves: Dict[str, Dict[str, np.ndarray]] = {}
    for name, kind, w in _hf_parts(model, family):
        if kind not in INTERLEAVED:
            yield name, w
            continue
        halves.setdefault(name, {})[kind] = w
        if len(halves[name]) == len(INTERLEAVED):
            part = halves.pop(name)
            even, odd = (part[k] for k in INTERLEAVED)
            both = np.empty(even.shape[:-1] + (2 * even.shape[-1],), even.dtype)
            both[..., 0::2], both[..., 1::2] = even, odd
            yield name, both


def _hf_parts(model: MoETransformer, family: str):
    """Yields ``(hf name, layout kind, numpy array)`` for every jaxmp variable's part of
    ``family``'s checkpoint."""
    config = model.config
    sources = param_sources(model, family)
    for path, var in nnx.to_flat_state(nnx.state(model)):
        layers, key, stacked = sources[tuple(str(x) for x in path)]
        table = global_table(config) if layers is None else layer_table(config, family,
                                                                         layers[0])
        value = var.get_value()
        if key not in table:
            if isinstance(var, (RouterBias, FP8State)):  # zero biases: check_router_biases
                continue
            raise ValueError(f"jaxmp {'/'.join(map(str, path))} maps to no {family} tensor")
        rows = list(layers) if stacked else [layers[0] if layers else None]
        for j, layer in enumerate(rows):
            v = np.asarray(jax.device_get(value[j] if stacked else value))
            tab = table if layer is None else layer_table(config, family, layer)
            name, kind = tab[key]
            names = name if isinstance(name, tuple) else (name,)
            for e, n in enumerate(names):
                w = v[e] if isinstance(name, tuple) else v
                if kind == "in":
                    w = w.reshape(w.shape[0], -1).T
                elif kind == "out":
                    w = w.reshape(-1, w.shape[-1]).T
                elif kind == "vec":
                    w = w.reshape(-1)
                yield n, kind, np.ascontiguousarray(w)


def save_pretrained(model: MoETransformer, path: str, *, family: Optional[str] = None,
                    max_shard_bytes: int = MAX_SHARD_BYTES,
                    token_ids: Optional[Dict[str, Optional[int]]] = None) -> str:
    """Writes ``model`` as a Hugging Face checkpoint that transformers loads.

    ``config.json`` (with ``model_type`` and ``architectures``) and the weights in their
    stored dtype, as ``model.safetensors`` or, past ``max_shard_bytes``, as shards
    ``model-0000i-of-0000n.safetensors`` of at most that size (one tensor larger than it
    gets a shard of its own) with ``model.safetensors.index.json``. Host memory holds at
    most one shard (shards are written as they fill, then renamed ``-of-n``).

    Args:
      model: the model (any layout, any mesh: each tensor is gathered to the host).
      path: the directory (created).
      family: a key of :data:`FAMILIES`; default the one :func:`family_of` finds.
      max_shard_bytes: the shard size limit (transformers' default, 5 GB).
      token_ids: config.json fields of the tokenizer's special token ids
        (``bos_token_id``, ``eos_token_id``, ``pad_token_id``: an int or None), written as
        given; transformers' config classes default to their own ids where absent.

    Returns:
      The family written.

    Raises:
      ValueError: an architecture that maps to no family, a field or nonzero router bias
        the family cannot hold, or a ``token_ids`` key that is no token id field (one
        line, named), before anything is written.
      ImportError: safetensors is not installed (the ``train`` extra).
    """
    save_file = safetensors_module().numpy.save_file
    family = family or family_of(model.config)
    dtypes = {str(v.dtype) for v in jax.tree.leaves(nnx.state(model, nnx.Param))}
    dtype = "bfloat16" if dtypes == {"bfloat16"} else "float32"
    hf = config_to_hf(model.config, family, dtype)
    bad = sorted(set(token_ids or {}) - {"bos_token_id", "eos_token_id", "pad_token_id"})
    if bad:
        raise ValueError(f"token_ids: {bad} are not token id fields; allowed: bos_token_id, "
                         f"eos_token_id, pad_token_id")
    hf.update(token_ids or {})
    check_router_biases(model, family)  # before anything is written
    os.makedirs(path, exist_ok=True)
    for name in [n for n in os.listdir(path) if re.fullmatch(
            r"model(-\d+-of-\d+|-part-\d+)?\.safetensors(\.index\.json)?", n)]:
        os.remove(os.path.join(path, name))
    parts: List[List[str]] = []
    current: Dict[str, np.ndarray] = {}
    size = total = 0

    def flush():
        file = os.path.join(path, f"model-part-{len(parts):05d}.safetensors")
        save_file(current, file, metadata={"format": "pt"})
        parts.append(list(current))

    for name, w in _hf_tensors(model, family):
        if current and size + w.nbytes > max_shard_bytes:
            flush()
            current, size = {}, 0
        current[name] = w
        size += w.nbytes
        total += w.nbytes
    flush()
    n = len(parts)
    if n == 1:
        os.replace(os.path.join(path, "model-part-00000.safetensors"),
                   os.path.join(path, "model.safetensors"))
    else:
        weight_map = {}
        for i, names in enumerate(parts):
            file = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(path, f"model-part-{i:05d}.safetensors"),
                       os.path.join(path, file))
            weight_map.update({name: file for name in names})
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f,
                      indent=2, sort_keys=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)
    return family


def check_router_biases(model: MoETransformer, family: str) -> None:
    """Refuses a nonzero router bias where ``family`` stores none.

    Raises:
      ValueError: one line naming the bias's path.
    """
    if "bias" in (FAMILIES[family].moe or {}):
        return
    for path, var in nnx.to_flat_state(nnx.state(model, RouterBias)):
        if np.any(np.asarray(jax.device_get(var.get_value())) != 0):
            raise ValueError(f"{'/'.join(map(str, path))}: a nonzero router bias (auxiliary-"
                             f"loss-free balancing); {family} has no router bias")
