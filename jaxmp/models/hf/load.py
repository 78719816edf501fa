"""Loading a Hugging Face checkpoint into a :class:`~jaxmp.models.MoETransformer`:
:func:`from_pretrained`, :func:`load_weights` and the header-only :func:`check_weights`.

Before the model is built, the weight map must hold every tensor the config needs (checked
layer by layer, failing at the first missing layer) and no other (except RoPE ``inv_freq``
buffers and the multi-token-prediction layers that ``num_nextn_predict_layers`` announces,
which are not read); every needed tensor's shape and dtype (F16, BF16, F32, F64) is checked
from the headers, a tied head stored beside its embedding must equal it (transformers would
use the stored one), and every slice is checked finite as it is read and again in the
parameter dtype (a float64 weight of 1e300 is infinite in float32).

Loading streams: every parameter is made with ``jax.make_array_from_callback`` on its
sharding, and each callback reads only the rows/columns of its device's slice from the
memory-mapped file (``safe_open(...).get_slice``); host memory holds one slice at a time.
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmp.models.hf.config import (RUNTIME_FIELDS, config_from_hf, field_values,
                                    quantization, text_config)
from jaxmp.models.hf.families import FAMILIES
from jaxmp.models.hf.files import (FLOAT_DTYPES, SKIPPED, Files, all_finite, check_directory,
                                   first_names, read_config, safetensors_module)
from jaxmp.models.hf.layout import (global_table, layer_table, norm_index, param_sources,
                                    read_tensor)
from jaxmp.models.layers import FP8State
from jaxmp.models.lora import fp8_matrix
from jaxmp.models.moe import RouterBias
from jaxmp.models.config import ModelConfig
from jaxmp.models.transformer import MoETransformer
from jaxmp.precision import fp8 as fp8_lib

__all__ = ["from_pretrained", "load_weights", "check_weights", "check_fp8_base", "owner"]


def _cast(files: Files, name: Any, x: np.ndarray, dtype) -> np.ndarray:
    """``x`` (finite, as read) as the parameter dtype ``dtype``, refusing values it cannot
    hold: a finite float64 weight of 1e300 is infinite in float32, a float32 weight of 1e5
    infinite in float16."""
    with np.errstate(over="ignore"):  # an overflow is refused below, not warned about
        y = x.astype(dtype)
    if not all_finite(y):
        names = name if isinstance(name, tuple) else (name,)
        raise ValueError(f"{files.path}: tensor {', '.join(names)} holds values beyond "
                         f"{np.dtype(dtype).name}'s range (the parameter dtype; largest "
                         f"|value| {float(np.max(np.abs(x.astype(np.float64)))):.4g}); "
                         f"allowed: weights the parameter dtype holds")
    return y


def _load_array(files: Files, config, family, layers, key, stacked, shape, dtype, index):
    """The ``index`` slice of one jaxmp variable, as ``dtype`` (E4M3: an FP8 weight's
    stored values, a ``lora.base=fp8`` model's)."""
    idx = norm_index(index, shape)
    if stacked:
        rows = [layers[j] for j in idx[0]]
        inner = index[1:]
        parts = [_load_array(files, config, family, (l,), key, False, shape[1:], dtype, inner)
                 for l in rows]
        return np.stack(parts).astype(dtype)
    name, kind = _source(config, family, layers, key)
    raw = np.dtype(dtype) == np.dtype(jnp.float8_e4m3fn)
    if isinstance(name, tuple):  # stacked experts: leading axis = expert index
        experts = [name[e] for e in idx[0]]
        return _cast(files, tuple(experts), np.stack(
            [read_tensor(files, n, kind, shape[1:], tuple(index[1:]), raw) for n in experts]),
            dtype)
    return _cast(files, name, read_tensor(files, name, kind, shape, tuple(index), raw), dtype)


def _source(config, family, layers, key):
    """``(hf name(s), kind)`` of jaxmp variable ``key`` of ``layers`` (None: global)."""
    return layer_table(config, family, layers[0])[key] if layers else global_table(config)[key]


def _fp8_scales(files: Files, config, family, layers, key, stacked) -> np.ndarray:
    """The block scales of an FP8 weight as jaxmp's ``[(L,) (E,) Kb, Nb]``: the transpose
    of each checkpoint ``weight_scale_inv [ceil(out / 128), ceil(in / 128)]`` (jaxmp's
    matrix is ``[in, out]``), stacked over a scanned stack's layers and the experts."""
    if stacked:
        return np.stack([_fp8_scales(files, config, family, (l,), key, False) for l in layers])
    name, _ = _source(config, family, layers, key)
    if isinstance(name, tuple):
        return np.stack([files.fp8_scales(n).T for n in name])
    return files.fp8_scales(name).T


def _hf_names(config, family, layers, key) -> Tuple[str, ...]:
    """Every checkpoint tensor jaxmp variable ``key`` is read from: one per layer of a
    scanned stack (``layers``; None: global) and per routed expert."""
    out = []
    for layer in (layers or (None,)):
        name, _ = _source(config, family, None if layer is None else (layer,), key)
        out.extend(name if isinstance(name, tuple) else (name,))
    return tuple(out)


def _fp8_base_source(files: Files, path: str, names, module, key: str) -> bool:
    """Whether a ``fp8_base`` load keeps this weight in E4M3; refuses one whose checkpoint
    tensors (``names``: every layer's and expert's) are not all E4M3 with 128 x 128 blocks
    (what the blockwise kernels read)."""
    from jaxmp.models.lora import fp8_base_weights
    from jaxmp.precision.fp8 import BLOCK

    if key.rpartition("/")[2] not in fp8_base_weights(module):
        return False
    for n in names:
        if not files.is_fp8(n):
            raise ValueError(f"lora.base=fp8: {path} stores {n} unquantized; allowed: a "
                             f"blockwise-FP8 checkpoint (quantization_config quant_method fp8; "
                             f"python -m jaxmp.export --format hf --quantize fp8 writes one), "
                             f"or lora.base=bfloat16")
        if tuple(files.fp8_block(n)) != (BLOCK, BLOCK):
            raise ValueError(f"lora.base=fp8: {path} has weight_block_size "
                             f"{list(files.fp8_block(n))}; allowed: [{BLOCK}, {BLOCK}] (the "
                             f"blocks the blockwise FP8 kernels read), or lora.base=bfloat16")
    return True


def _check_names(files: Files, config: ModelConfig, family: str,
                 skipped: Tuple[str, ...]) -> None:
    """Before the model is built: every tensor ``config`` needs is in the checkpoint's
    weight map (a set lookup per name, layer by layer, failing at the first layer that
    lacks one: a config.json of a million layers over a 2-layer file fails at layer 2 at
    once), and every tensor of the checkpoint is one of them, except those skipped on
    purpose: RoPE's ``rotary_emb.inv_freq`` buffers, the multi-token-prediction layers
    ``model.layers.{n}..`` that ``num_nextn_predict_layers`` announces, or those under the
    family's :attr:`~jaxmp.models.hf.spec.Family.mtp_prefix` (``skipped``: the name
    prefixes; DeepSeek-V3 and GLM-4.5 keep them after the ``n`` layers, Qwen3.5 under
    ``mtp.``; jaxmp does not read them) and
    ``lm_head.weight`` with tied embeddings (which must equal the embedding:
    :func:`_check_tied_head`).

    Raises:
      ValueError: a missing tensor (named, with its layer), or unused tensors (their count
        and first names).
    """
    have = files.weight_map
    used = set()
    for key, (name, _) in global_table(config).items():
        if name not in have:
            raise ValueError(f"{files.path}: the checkpoint has no tensor {name!r} (jaxmp "
                             f"{key})")
        used.add(name)
    for i in range(config.num_layers):
        for key, (name, _) in layer_table(config, family, i).items():
            for n in (name if isinstance(name, tuple) else (name,)):
                if n not in have and f"{n}_blocks" in have:
                    raise ValueError(f"{files.path}: the checkpoint has tensor {n!r} as MXFP4 "
                                     f"({n}_blocks, _scales), and config.json has no "
                                     f"quantization_config saying so; allowed: "
                                     f"quantization_config {{quant_method: mxfp4}}")
                if n not in have:
                    raise ValueError(f"{files.path}: the checkpoint has no tensor {n!r}: "
                                     f"layer {i} is missing or incomplete, and config.json "
                                     f"says {config.num_layers} layers (jaxmp {key})")
                used.add(n)
    unused = sorted(n for n in have if n not in used and not SKIPPED.fullmatch(n)
                    and not n.startswith(skipped)
                    and not (config.tie_embeddings and n == "lm_head.weight"))
    if unused:
        raise ValueError(f"{files.path}: {len(unused)} tensor(s) of the checkpoint are not "
                         f"used by the {family} model its config.json describes "
                         f"({config.num_layers} layers): {first_names(unused)}")


def _check_shapes(files: Files, model: MoETransformer, family: str, sources) -> None:
    """Every tensor the model needs exists with the shape jaxmp expects and a floating
    dtype (before loading)."""
    config = model.config
    for path, var in nnx.to_flat_state(nnx.state(model)):
        layers, key, stacked = sources[tuple(str(x) for x in path)]
        table = global_table(config) if layers is None else layer_table(config, family,
                                                                         layers[0])
        if key not in table:
            continue
        shape = tuple(var.get_value().shape)[1:] if stacked else tuple(var.get_value().shape)
        for layer in (layers or (None,)):
            tab = table if layer is None else layer_table(config, family, layer)
            name, kind = tab[key]
            names = name if isinstance(name, tuple) else (name,)
            want = shape[1:] if isinstance(name, tuple) else shape
            expect = {"same": want, "vec": (int(np.prod(want)),),
                      "even": want[:-1] + (2 * want[-1],), "odd": want[:-1] + (2 * want[-1],),
                      "in": (int(np.prod(want[1:])), want[0]) if want else (),
                      "out": (want[-1], int(np.prod(want[:-1]))) if want else ()}[kind]
            for n in names:
                have, dtype = files.info(n)
                if dtype not in FLOAT_DTYPES + ("MXFP4", "FP8"):
                    raise ValueError(
                        f"{os.path.join(files.path, files.weight_map[n])}: tensor {n} has "
                        f"dtype {dtype}; allowed: {', '.join(FLOAT_DTYPES)}"
                        + (f" (an FP8 weight needs its {n}_scale_inv and config.json's "
                           f"quantization_config {{quant_method: fp8}})"
                           if dtype.startswith("F8") else ""))
                if have != tuple(expect):
                    raise ValueError(f"{files.path}: tensor {n} has shape {list(have)}; the "
                                     f"config.json says {list(expect)} (jaxmp {key})")


def _check_tied_head(files: Files, rows: int = 8192) -> None:
    """With ``tie_word_embeddings: true`` a stored ``lm_head.weight`` must equal the
    embedding (a copy some writers keep): transformers then uses the stored head, jaxmp
    the embedding, so a head that differs would load as another model. Compared
    ``rows`` rows at a time, no copy of either in memory.

    Raises:
      ValueError: the two differ in shape or in any value (one line naming both).
    """
    head, embed = "lm_head.weight", "model.embed_tokens.weight"
    shape = files.shape(head)
    same = shape == files.shape(embed)
    for start in range(0, shape[0] if same and shape else 0, rows):
        block = slice(start, min(start + rows, shape[0]))
        same = np.array_equal(files.read(head, block).astype(np.float32),
                              files.read(embed, block).astype(np.float32))
        if not same:
            break
    if not same:
        raise ValueError(f"{files.path}: config.json says tie_word_embeddings: true, but the "
                         f"checkpoint's {head} differs from {embed} (transformers would use the "
                         f"stored head, jaxmp the embedding); allowed: "
                         f"tie_word_embeddings false, or no {head}, or one equal to {embed}")


def from_pretrained(path: str, policy: Any = "fp32", *, mesh=None, rules=None,
                    **overrides) -> MoETransformer:
    """A :class:`~jaxmp.models.MoETransformer` holding a Hugging Face checkpoint.

    Args:
      path: a directory with ``config.json`` and ``model.safetensors`` or sharded
        ``model-*-of-*.safetensors`` with ``model.safetensors.index.json``.
      policy: the precision policy or rules (e.g. ``"fp32"``, ``"mixed_bf16"``); the
        parameters are created in each module's ``param_dtype`` (float32 masters under the
        presets) from the file's dtype.
      mesh: optional ``jax.sharding.Mesh``; with ``rules`` (a logical-axis rule table of
        :mod:`jaxmp.sharding`) each parameter is placed on its sharding, every device
        reading only its own slice. Without a mesh, on the default device.
      rules: the rule table for ``mesh`` (default :data:`jaxmp.sharding.DATA_PARALLEL_RULES`).
      overrides: ModelConfig fields of :data:`RUNTIME_FIELDS` (``max_len``, ``attention``,
        ``scan_layers``, ``remat``, ...).

    Returns:
      The model; ``model(tokens)`` returns ``(logits, aux)``.

    Raises:
      ValueError: one line, naming the file, field or tensor and what is allowed: a
        config.json or index that is not a regular file, not JSON or not an object; a
        config.json field missing, ill-typed, out of range, non-finite or not representable
        (:func:`config_from_hf`); an override outside :data:`RUNTIME_FIELDS`; a weight file
        named outside the directory, not a regular file or not a readable safetensors
        file; a missing tensor, an unused one, one of the wrong shape or of a non-float
        dtype (all before any weight is read); a weight holding a NaN or an infinity (as
        it is read).
      ImportError: safetensors is not installed (the ``train`` extra), before any work.
    """
    safetensors_module()
    hf = read_config(path)
    fields = config_from_hf(hf)
    for key in overrides:
        if key not in RUNTIME_FIELDS:
            raise ValueError(f"from_pretrained override {key}={overrides[key]!r}: the "
                             f"architecture comes from config.json; allowed overrides: "
                             f"{', '.join(RUNTIME_FIELDS)}")
    fields.update(overrides)
    return load_weights(path, ModelConfig(**fields), policy, mesh=mesh, rules=rules)



def _checked(path: str, config: ModelConfig, policy: Any, target):
    """``(files, family, abstract model, sources)`` once :func:`check_weights`' checks
    pass (no weight read)."""
    safetensors_module()
    check_directory(path)
    hf = read_config(path)
    config_from_hf(hf)
    text, wrapper = text_config(hf)
    family = text["model_type"]
    files = Files(path)
    if wrapper is not None:  # a multimodal checkpoint: the text model's tensors alone
        left = files.take_text_model(FAMILIES[wrapper].text_prefixes)
        if left:
            warnings.warn(f"{path}: {len(left)} tensor(s) of the {wrapper} checkpoint are not "
                          f"the text model's and are not read (the vision tower and "
                          f"projector: {first_names(left)})", RuntimeWarning, stacklevel=3)
    quantized = quantization(family, text)  # read dequantized into the run's masters
    if quantized and quantized[0] == "mxfp4":
        files.take_mxfp4()
    elif quantized:
        files.take_fp8(tuple(quantized[1]["weight_block_size"]))
    vals = field_values(family, text)
    layers = vals["num_hidden_layers"]
    fam = FAMILIES[family]
    mtp = vals.get("mtp_num_hidden_layers", 0) or vals["num_nextn_predict_layers"]
    skipped = (fam.mtp_prefix,) if fam.mtp_prefix else tuple(
        f"model.layers.{j}." for j in range(layers, layers + mtp))
    _check_names(files, config, family, skipped)
    abstract = nnx.eval_shape(lambda: MoETransformer(config, policy, rngs=nnx.Rngs(0),
                                                     target=target))
    sources = param_sources(abstract, family)
    _check_shapes(files, abstract, family, sources)
    if config.tie_embeddings and "lm_head.weight" in files.weight_map:
        _check_tied_head(files)
    return files, family, abstract, sources


def check_weights(path: str, config: ModelConfig, policy: Any = "fp32", *,
                  target=None) -> None:
    """Checks, from the safetensors headers alone, that checkpoint directory ``path`` holds
    the weights of ``config``: every tensor ``config`` needs and no other, each of the
    shape jaxmp expects and a floating dtype; with ``tie_word_embeddings`` a stored
    ``lm_head.weight`` equal to the embedding. No other weight is read (a few KiB per
    file), so the trainer calls it before it reads its corpus; :func:`load_weights` runs
    the same checks and then checks each slice finite as it reads it.

    Args:
      path: the checkpoint directory (``config.json``, ``model.safetensors`` or shards
        with ``model.safetensors.index.json``).
      config: the architecture to check against (that of ``path``'s config.json,
        :func:`config_from_hf`, plus :data:`RUNTIME_FIELDS`).
      policy: the precision policy or rules the model is built with.
      target: the compile target of the model's kernel choices.

    Raises:
      ValueError: as :func:`from_pretrained`, one line naming the file, field or tensor:
        ``path`` not a directory (e.g. a config.json file, which plans but does not
        load), a damaged index or weight file, a missing, unused, misshapen or non-float
        tensor, a tied ``lm_head.weight`` that differs from the embedding.
      ImportError: safetensors is not installed (the ``train`` extra).
    """
    _checked(path, config, policy, target)


def check_fp8_base(path: str, config: ModelConfig, policy: Any = "fp32", *,
                   target=None) -> None:
    """:func:`check_weights`, and that every projection a ``lora.base=fp8`` model keeps in
    E4M3 (:func:`jaxmp.models.lora.fp8_base_weights`) is stored so, every layer's and
    expert's, in 128 x 128 blocks: from the headers alone, before the trainer reads its
    corpus.

    Raises:
      ValueError: as :func:`check_weights`; a projection stored unquantized or in other
        blocks (one line, naming the tensor).
    """
    files, family, abstract, sources = _checked(path, config, policy, target)
    for path_, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        layers, key, _ = sources[tuple(str(x) for x in path_)]
        table = global_table(config) if layers is None else layer_table(config, family,
                                                                         layers[0])
        if key in table:
            _fp8_base_source(files, path, _hf_names(config, family, layers, key),
                             owner(abstract, path_), key)


def load_weights(path: str, config: ModelConfig, policy: Any = "fp32", *, mesh=None,
                 rules=None, target=None, fp8_base: bool = False) -> MoETransformer:
    """:func:`from_pretrained` with the :class:`ModelConfig` given: ``config``'s architecture
    must be the one ``path``'s config.json describes (the trainer's ``model.init_from``
    checks that first); the tensors' shapes are checked before anything is read.
    ``target``: the compile target of the model's kernel choices (``MoETransformer``'s).

    Before the model is built (even abstractly), the checkpoint's weight map must have
    every tensor ``config`` needs and no other (:func:`_check_names`); then every file's
    header is read and each tensor's shape and dtype checked (:func:`check_weights`'
    checks); each slice is checked finite as it is read.

    With ``fp8_base`` (``lora.base=fp8``) the projections
    (:func:`jaxmp.models.lora.fp8_base_weights`) keep the checkpoint's E4M3 values, each
    with a ``<name>_scale_inv`` variable of its block scales, as
    :func:`jaxmp.models.lora.apply_lora` freezes them; nothing is dequantized.

    Raises:
      ValueError: as :func:`from_pretrained` (one line naming the file, field or tensor);
        with ``fp8_base``, a projection the checkpoint stores unquantized or in blocks
        other than 128 x 128.
      ImportError: safetensors is not installed (the ``train`` extra).
    """
    files, family, abstract, sources = _checked(path, config, policy, target)
    scales = []
    from jaxmp import sharding as shd

    flat = []
    for path_, var in nnx.to_flat_state(nnx.state(abstract)):
        value = var.get_value()
        shape, dtype = tuple(value.shape), value.dtype
        if mesh is not None:
            axes = var.get_metadata().get("out_sharding") or (None,) * len(shape)
            sharding = shd.logical_to_sharding(axes, mesh, rules or shd.DATA_PARALLEL_RULES)
        else:
            sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        layers, key, stacked = sources[tuple(str(x) for x in path_)]
        table = global_table(config) if layers is None else layer_table(config, family,
                                                                         layers[0])
        if key in table and fp8_base and _fp8_base_source(
                files, path, _hf_names(config, family, layers, key), owner(abstract, path_),
                key):
            dtype = jnp.float8_e4m3fn
            axes = tuple(var.get_metadata().get("out_sharding") or (None,) * len(shape))
            lead = fp8_matrix(str(path_[-1]), shape, axes)[0]
            value = _fp8_scales(files, config, family, layers, key, stacked)
            scales.append((path_, value, axes[:lead] + (None, None)))
        if key in table:
            def callback(index, layers=layers, key=key, stacked=stacked, shape=shape,
                         dtype=dtype):
                return _load_array(files, config, family, layers, key, stacked, shape, dtype,
                                   index)

            array = jax.make_array_from_callback(shape, sharding, callback)
        elif isinstance(var, RouterBias):
            array = jax.device_put(jnp.zeros(shape, dtype), sharding)
        elif isinstance(var, FP8State):
            module = owner(abstract, path_)
            state = fp8_lib.init_state(module.policy.fp8)
            array = jax.device_put(jnp.broadcast_to(state, shape).astype(dtype), sharding)
        else:
            raise ValueError(f"{family}: no checkpoint tensor maps to jaxmp "
                             f"{'/'.join(map(str, path_))}")
        flat.append((path_, var.replace(array)))
    nnx.update(abstract, nnx.from_flat_state(flat))
    for path_, value, axes in scales:  # beside each E4M3 weight, its scales
        sharding = (shd.logical_to_sharding(axes, mesh, rules or shd.DATA_PARALLEL_RULES)
                    if mesh is not None else jax.sharding.SingleDeviceSharding(jax.devices()[0]))
        setattr(owner(abstract, path_), f"{path_[-1]}_scale_inv", nnx.Param(
            jax.device_put(value, sharding), eager_sharding=False, out_sharding=axes))
    return abstract


def owner(model, path):
    """The module of ``model`` that holds the variable at state path ``path``."""
    node = model
    for part in path[:-1]:
        node = node[int(part)] if isinstance(part, int) or str(part).isdigit() else getattr(
            node, str(part))
    return node
