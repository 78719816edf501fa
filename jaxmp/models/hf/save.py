"""Writing a :class:`~jaxmp.models.MoETransformer` as a Hugging Face checkpoint that
transformers loads (:func:`save_pretrained`).
"""
from __future__ import annotations

import json
import os
import re
import warnings
from typing import Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmp.models.hf.config import config_to_hf, family_of
from jaxmp.models.hf.families import FAMILIES
from jaxmp.models.hf.files import safetensors_module, save_safetensors
from jaxmp.models.hf.layout import INTERLEAVED, global_table, layer_table, param_sources
from jaxmp.models.layers import FP8State
from jaxmp.models.moe import RouterBias
from jaxmp.models.transformer import MoETransformer
from jaxmp.precision import fp8

__all__ = ["save_pretrained", "check_router_biases", "MAX_SHARD_BYTES", "QUANTIZE_FORMATS"]

MAX_SHARD_BYTES = 5 * 10 ** 9  # transformers' default max_shard_size="5GB"
# save_pretrained's quantize: None (weights in their stored dtype) or "fp8", the blockwise
# E4M3 format of DeepSeek-V3's and Qwen3's FP8 releases (quant_method fp8).
QUANTIZE_FORMATS = ("fp8",)
# The FP8 export's block, DeepSeek-V3's 128 x 128 (section 3.3.2) and transformers'
# FineGrainedFP8Config's default weight_block_size.
FP8_BLOCK = (128, 128)


def _fp8_projection(key: str, kind: str) -> bool:
    """Whether a block's variable ``key`` (of layout ``kind``) is a projection an FP8
    export stores in E4M3: the ``nn.Linear`` weights of attention (linear attention's
    included), dense MLPs, routed and shared experts, as DeepSeek-V3's release; not the
    router or the shared expert's gate (a ``[1, d]`` projection), which the releases keep
    in bfloat16 and name in ``modules_to_not_convert``, nor norms, biases, convolutions,
    embeddings and the head."""
    return kind in ("in", "out") and not key.startswith("moe/router") and \
        key != "moe/shared_gate"


def _hf_tensors(model: MoETransformer, family: str):
    """Yields ``(hf name, numpy array, linear)`` for every tensor of ``family``'s
    checkpoint (``linear``: True for a projection an FP8 export quantizes,
    :func:`_fp8_projection`, False for another ``nn.Linear`` weight, None for the rest);
    the two halves of an interleaved
    tensor (:data:`~jaxmp.models.hf.layout.INTERLEAVED`) once both are read."""
    halves: Dict[str, Dict[str, np.ndarray]] = {}
    for name, kind, w, linear in _hf_parts(model, family):
        if kind not in INTERLEAVED:
            yield name, w, linear
            continue
        halves.setdefault(name, {})[kind] = w
        if len(halves[name]) == len(INTERLEAVED):
            part = halves.pop(name)
            even, odd = (part[k] for k in INTERLEAVED)
            both = np.empty(even.shape[:-1] + (2 * even.shape[-1],), even.dtype)
            both[..., 0::2], both[..., 1::2] = even, odd
            yield name, both, None


def _hf_parts(model: MoETransformer, family: str):
    """Yields ``(hf name, layout kind, numpy array, linear)`` for every jaxmp variable's
    part of ``family``'s checkpoint (``linear`` as :func:`_hf_tensors`')."""
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
                linear = (layer is not None and _fp8_projection(key, kind)) \
                    if kind in ("in", "out") else None
                yield n, kind, np.ascontiguousarray(w), linear


def _fp8_tensors(name: str, w: np.ndarray, block) -> Dict[str, np.ndarray]:
    """``{name: E4M3 weight, name + "_scale_inv": float32 scales}``: ``w [out, in]``
    quantized with one scale per ``block`` (:func:`jaxmp.fp8.quantize_blocks`, the FP8
    recipes' own code: scale = the block's amax / 448; the last block row and column
    partial), DeepSeek-V3's ``weight`` / ``weight_scale_inv`` pair (``weight_scale_inv``
    is what the E4M3 values are multiplied by). ``w`` is finite (:func:`save_pretrained`
    checks)."""
    import ml_dtypes

    q, s = fp8.quantize_blocks(jnp.asarray(w, jnp.float32), block, fp8.E4M3)
    return {name: np.asarray(q).view(ml_dtypes.float8_e4m3fn),
            f"{name}_scale_inv": np.asarray(s, np.float32)}


def save_pretrained(model: MoETransformer, path: str, *, family: Optional[str] = None,
                    max_shard_bytes: int = MAX_SHARD_BYTES,
                    token_ids: Optional[Dict[str, Optional[int]]] = None,
                    quantize: Optional[str] = None,
                    fp8_block: Tuple[int, int] = FP8_BLOCK,
                    notes: Optional[List[str]] = None) -> str:
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
      quantize: None (every tensor in its stored dtype) or ``"fp8"``
        (:data:`QUANTIZE_FORMATS`): the blockwise FP8 format of DeepSeek-V3's and Qwen3's
        FP8 releases, which transformers' ``FineGrainedFP8Config`` and jaxmp's
        :func:`from_pretrained` read. The projections of attention, MLPs and experts
        (``nn.Linear`` weights ``[out, in]``) are stored as E4M3 ``weight`` with a float32
        ``weight_scale_inv`` per ``fp8_block`` (:func:`jaxmp.fp8.quantize_blocks`, the
        recipes' own code: a block's scale is its amax / 448 and the weight is
        ``E4M3 * weight_scale_inv``); embeddings, norms, biases, the router, the shared
        expert's gate and the head keep the stored dtype, the ``nn.Linear`` ones among
        them named in ``quantization_config.modules_to_not_convert``. config.json gets
        ``quantization_config: {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic,
        weight_block_size: fp8_block, modules_to_not_convert}``. A dimension that spans
        more than one block and is not a multiple of it ends in a partial block, as
        DeepSeek-V3's release does (``kv_a_proj_with_mqa``: 576 rows): DeepSeek's
        ``weight_dequant`` and jaxmp read it, transformers' CPU loader (which takes the
        block from the scale grid, :meth:`~jaxmp.models.hf.files.Files.take_fp8`) reads
        other blocks or fails; each such projection is named in a note.
      fp8_block: ``(rows, cols)`` of a weight block, default DeepSeek-V3's (128, 128).
      notes: a list the note above is appended to; None: it is a ``UserWarning``.

    Returns:
      The family written.

    Raises:
      ValueError: an architecture that maps to no family, a field or nonzero router bias
        the family cannot hold, a ``token_ids`` key that is no token id field, a
        ``quantize`` not in :data:`QUANTIZE_FORMATS` or not a format of the family
        (:attr:`~jaxmp.models.hf.spec.Family.quantization`: GPT-OSS's is MXFP4), or a bad
        ``fp8_block``, or with ``quantize`` a parameter that is not finite (one line,
        named), before anything is written.
      ImportError: safetensors is not installed (the ``train`` extra).
    """
    safetensors_module()  # before anything is written
    family = family or family_of(model.config)
    dtypes = {str(v.dtype) for v in jax.tree.leaves(nnx.state(model, nnx.Param))}
    dtype = "bfloat16" if dtypes == {"bfloat16"} else "float32"
    hf = config_to_hf(model.config, family, dtype)
    bad = sorted(set(token_ids or {}) - {"bos_token_id", "eos_token_id", "pad_token_id"})
    if bad:
        raise ValueError(f"token_ids: {bad} are not token id fields; allowed: bos_token_id, "
                         f"eos_token_id, pad_token_id")
    hf.update(token_ids or {})
    if quantize is not None:
        if quantize not in QUANTIZE_FORMATS:
            raise ValueError(f"quantize={quantize!r} is not allowed; allowed: None or "
                             f"{', '.join(map(repr, QUANTIZE_FORMATS))}")
        if quantize not in FAMILIES[family].quantization:
            raise ValueError(f"quantize={quantize!r}: transformers' {family} reads no {quantize} "
                             f"checkpoint; {family}'s quantization: "
                             f"{', '.join(FAMILIES[family].quantization) or 'none'}")
        if not (isinstance(fp8_block, (tuple, list)) and len(fp8_block) == 2 and all(
                isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in fp8_block)):
            raise ValueError(f"fp8_block={fp8_block!r} is not allowed; allowed: two integers "
                             f">= 1, e.g. (128, 128)")
        for p, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            if not bool(jax.device_get(jnp.all(jnp.isfinite(var.get_value())))):
                raise ValueError(f"{'/'.join(map(str, p))} holds non-finite values, which FP8 "
                                 f"cannot quantize")
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
        save_safetensors(current, file, {"format": "pt"})
        parts.append(list(current))

    kept = []  # the nn.Linear modules an FP8 export keeps in the stored dtype
    partial = []  # the FP8 projections with a partial block past a whole one
    for name, w, linear in _hf_tensors(model, family):
        tensors = {name: w}
        if quantize == "fp8" and linear:
            tensors = _fp8_tensors(name, w, tuple(fp8_block))
            if any(n > b and n % b for n, b in zip(w.shape, fp8_block)):
                partial.append(f"{name} {list(w.shape)}")
        elif quantize == "fp8" and linear is False:
            kept.append(name.removesuffix(".weight"))
        nbytes = sum(t.nbytes for t in tensors.values())
        if current and size + nbytes > max_shard_bytes:
            flush()
            current, size = {}, 0
        current.update(tensors)
        size += nbytes
        total += nbytes
    flush()
    if quantize == "fp8":
        hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": list(fp8_block),
                                     "modules_to_not_convert": sorted(kept)}
        if partial:
            note = (f"{len(partial)} FP8 projections have a dimension of more than one "
                    f"{list(fp8_block)} block that is not a multiple of it "
                    f"({', '.join(partial[:3])}{', ...' if len(partial) > 3 else ''}): their "
                    f"last block is partial, as in DeepSeek-V3's release, which DeepSeek's "
                    f"weight_dequant and jaxmp read; transformers' CPU loader takes the block "
                    f"from the scale grid and reads them wrong or not at all")
            if notes is None:
                warnings.warn(note, UserWarning, stacklevel=2)
            else:
                notes.append(note)
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
