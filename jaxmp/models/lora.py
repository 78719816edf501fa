"""Low-rank adapters over a frozen base (LoRA, Hu et al. 2021, "LoRA: Low-Rank Adaptation of
Large Language Models", eq. 3): ``y = x W + (alpha / r) (x A) B``.

:func:`apply_lora` turns a built :class:`~jaxmp.models.MoETransformer` (random, or loaded
by :func:`jaxmp.models.hf.load_weights`) into one whose every projection that
``Lora.targets`` names gets two trainable ``nnx.Param`` s, ``<weight>_lora_a`` ``[*in, r]``
and ``<weight>_lora_b`` ``[r, *out]``, and whose every other parameter becomes a
:class:`FrozenParam`: no gradient, no optimizer state, stored as ``Lora.base`` says.
:func:`jaxmp.models.layers.matmul` adds the adapter product wherever a weight has one.

What is as in PEFT's ``LoraLayer`` (peft 0.21, ``tuners/lora/layer.py``), so that
:mod:`jaxmp.models.hf.peft` writes adapters ``peft.PeftModel`` loads with the same
logits: ``A`` starts as ``kaiming_uniform_(a=sqrt(5))`` (uniform in
``+-1/sqrt(fan_in)``), ``B`` at zeros (the adapted model starts as the base), the scale
is ``alpha / r`` (not rsLoRA), no dropout, no bias. The adapter product runs in the
module's compute dtype whatever its policy's FP8 recipe (which quantizes the base
product only); the adapters are master weights in the module's ``param_dtype``. With
``Lora.base == "fp8"`` every projection's frozen weight is E4M3 with a float32 scale per
128 x 128 block of its ``[K, N]`` matrix (``<weight>_scale_inv``), which
:func:`jaxmp.fp8.matmul` reads as stored (``scales=``); a frozen routed expert's
``expert`` axis is named ``frozen_expert`` (:func:`frozen_metadata`), which FSDP splits
and gathers in place of its ``embed`` axis.

Which projections take adapters: those :func:`jaxmp.models.layers.matmul` multiplies by
(attention, linear attention, MLA, dense MLPs, shared experts, an untied head), matched
by ``re.search`` of a pattern of ``Lora.targets`` against the layer path
``blocks/{i}/<module>/<weight>`` (``blocks/3/attn/wq``; the paths policy rules match,
plus the weight's name). Routed experts take none (PEFT's ``target_parameters`` is not
supported): a pattern that names them is refused. Neither do the router, the tied
embedding, norms and convolutions.
"""
from __future__ import annotations

import dataclasses
import math
import re
import zlib
from typing import Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmp.precision import ops
from jaxmp.precision._fp8.einsum import _parse_spec

__all__ = ["Lora", "FrozenParam", "TRAINABLE", "LORA_BASES", "DEFAULT_TARGETS", "apply_lora",
           "adapted", "lora_product", "freeze_base", "fp8_base_weights", "fp8_matrix",
           "frozen_fp8", "dequantized", "frozen_metadata", "merged_weight", "merge_lora",
           "base_digest", "is_lora"]

# lora.base: what the frozen base weights are stored as. "master": the parameter dtype of
# each module's policy (float32 under the mixed presets); "bfloat16"; "fp8": every
# projection (fp8_base_weights) as E4M3 with a float32 scale per 128 x 128 block, read by
# the blockwise FP8 kernels, the rest bfloat16.
LORA_BASES = ("master", "bfloat16", "fp8")
# lora.targets' default: every projection of attention (Gated DeltaNet and MLA included),
# of the dense MLPs and of the shared experts; not the routed experts, router or head.
DEFAULT_TARGETS = "(attn|mlp|shared_experts)/w"


class FrozenParam(nnx.Param):
    """A base weight of a LoRA model: an ``nnx.Param`` (gathered under FSDP, counted,
    exported) that is not trained. :data:`TRAINABLE` leaves it out, so the trainer puts it
    in ``TrainState.rest``: no gradient, no optimizer state, not checkpointed (a
    checkpoint records its :func:`base_digest`)."""


# The filter of the trained parameters: every nnx.Param but the frozen base.
TRAINABLE = nnx.All(nnx.Param, nnx.Not(FrozenParam))


@dataclasses.dataclass(frozen=True)
class Lora:
    """The ``lora.*`` config section, parsed.

    Attributes:
      rank: ``r``, the adapters' inner width (0: no adapters, the whole model trains).
      alpha: the scale's numerator: the product is multiplied by ``alpha / rank``
        (Hu et al. 2021, section 4.1; PEFT's ``lora_alpha``).
      targets: regular expressions (``re.search``) over ``blocks/{i}/<module>/<weight>``.
      base: a key of :data:`LORA_BASES`.
    """

    rank: int = 0
    alpha: float = 16.0
    targets: Tuple[str, ...] = tuple(p.strip() for p in DEFAULT_TARGETS.split(";"))
    base: str = "master"

    @property
    def scale(self) -> float:
        """``alpha / rank``."""
        return self.alpha / self.rank

    @staticmethod
    def parse_targets(text: str) -> Tuple[str, ...]:
        """``"attn/w; mlp/w"`` -> ``("attn/w", "mlp/w")`` (``;``-separated, as policy rules).

        Raises:
          ValueError: an empty list or a pattern that is not a regular expression.
        """
        patterns = tuple(p.strip() for p in str(text).split(";") if p.strip())
        if not patterns:
            raise ValueError(f"lora.targets={text!r} names no pattern; allowed: ';'-separated "
                             f"regular expressions such as {DEFAULT_TARGETS!r}")
        for p in patterns:
            try:
                re.compile(p)
            except re.error as e:
                raise ValueError(f"lora.targets pattern {p!r} is not a regular expression ({e})")
        return patterns


def is_lora(model: nnx.Module) -> bool:
    """Whether ``model`` holds adapters (:func:`apply_lora` was applied)."""
    return any(name.endswith("_lora_a") for path, _ in nnx.to_flat_state(nnx.state(model))
               for name in [str(path[-1])])


def _in_dims(name: str, ndim: int) -> int:
    """How many leading dimensions of weight ``name`` (unstacked, ``ndim`` of them) the
    product contracts: all but the model width for an output projection ``wo``
    (``[H, h, d]``), the first for every other (``[d, H, h]``, ``[d, f]``); checked
    against the product's ``einsum`` spec by :func:`lora_product`."""
    return ndim - 1 if name == "wo" else 1


def _layer_paths(model, path, module) -> List[str]:
    """The per-layer paths of ``module`` (at state path ``path``): ``blocks/{i}/...`` for
    each layer of a scanned stack, its own path otherwise."""
    if path and str(path[0]) == "stacks":
        rest = module.path.split("/", 2)[2]
        return [f"blocks/{i}/{rest}" for i in model.stacks[int(path[1])].layers]
    return [module.path]


def _path_key(key: jax.Array, text: str) -> jax.Array:
    return jax.random.fold_in(key, zlib.crc32(text.encode()))


def apply_lora(model: nnx.Module, lora: Lora, seed: int) -> List[str]:
    """Gives ``model`` adapters and freezes its base, in place (also under ``nnx.eval_shape``).

    Args:
      model: a :class:`~jaxmp.models.MoETransformer`, scanned or not.
      lora: the settings (``rank > 0``).
      seed: the run's seed; each ``A`` is drawn from ``fold_in(key(seed), crc32(path))``,
        so a weight's adapter does not depend on which others are adapted.

    Returns:
      The adapted weights' paths (``blocks/0/attn/wq``, ... ; a scanned stack's first
      layer's path stands for the stack).

    Raises:
      ValueError: a pattern of ``lora.targets`` that matches no projection (naming what
        the paths look like), one that matches a routed expert, or one that picks some
        layers of a scanned stack and not others; ``lora.base`` not in
        :data:`LORA_BASES`.
    """
    if lora.base not in LORA_BASES:
        raise ValueError(f"lora.base={lora.base!r}; allowed: {', '.join(LORA_BASES)}")
    key = jax.random.key(seed)
    used = {p: False for p in lora.targets}
    seen: List[str] = []
    adapted_paths: List[str] = []
    for path, module in list(nnx.iter_modules(model)):
        names = getattr(module, "matmul_weights", ())
        if not names or not hasattr(module, "policy"):
            continue
        layers = _layer_paths(model, path, module)
        for name in names:
            full = [f"{p}/{name}" for p in layers]
            seen.append(full[0])
            hits = [[p for p in lora.targets if re.search(p, f)] for f in full]
            for h in hits:
                for p in h:
                    used[p] = True
            if not any(hits):
                continue
            if not all(hits):
                raise ValueError(f"lora.targets picks {full[[bool(h) for h in hits].index(True)]} "
                                 f"but not {full[[bool(h) for h in hits].index(False)]}, layers "
                                 f"of one scanned stack; allowed: patterns that take every layer "
                                 f"of a stack, or model.scan_layers=False")
            var = getattr(module, name)
            axes = tuple(var.get_metadata().get("out_sharding") or ())
            if "expert" in axes:
                raise ValueError(f"lora.targets pattern {hits[0][0]!r} matches the routed experts "
                                 f"{full[0]}, which take no adapters (PEFT's target_parameters "
                                 f"is not supported); allowed: patterns that leave them out, such "
                                 f"as {DEFAULT_TARGETS!r}")
            _add_adapter(module, name, var, axes, lora, _path_key(key, full[0]))
            adapted_paths.append(full[0])
    unused = [p for p, hit in used.items() if not hit]
    if unused:
        kinds = list(dict.fromkeys(re.sub(r"/\d+/", "/{i}/", s) for s in seen))
        raise ValueError(f"lora.targets pattern {unused[0]!r} matches no projection of this "
                         f"model; projections look like: {', '.join(kinds[:12])}")
    freeze_base(model, lora.base)
    return adapted_paths


def _add_adapter(module, name, var, axes, lora: Lora, key) -> None:
    value = var.get_value()
    stacked = len(axes) == value.ndim and axes[:1] == ("layers",)
    lead, lead_axes = (value.shape[:1], axes[:1]) if stacked else ((), ())
    shape = value.shape[len(lead):]
    inner_axes = axes[len(lead):] if axes else (None,) * len(shape)
    n_in = _in_dims(name, len(shape))
    fan_in = int(np.prod(shape[:n_in]))
    dtype = module.policy.param_dtype
    bound = 1.0 / math.sqrt(fan_in)
    a = jax.random.uniform(key, lead + shape[:n_in] + (lora.rank,), jnp.float32, -bound, bound)
    b = jnp.zeros(lead + (lora.rank,) + shape[n_in:], dtype)
    setattr(module, f"{name}_lora_a", nnx.Param(a.astype(dtype), eager_sharding=False,
                                                out_sharding=lead_axes + inner_axes[:n_in] + (None,)))
    setattr(module, f"{name}_lora_b", nnx.Param(b, eager_sharding=False, out_sharding=lead_axes + (None,) + inner_axes[n_in:]))
    module.lora_scale = float(lora.scale)


def freeze_base(model, base: str) -> None:
    """Every ``nnx.Param`` that is not an adapter becomes a :class:`FrozenParam`, in the
    dtype ``base`` says (``master``: as stored; ``bfloat16``; ``fp8``: the projections
    :func:`fp8_base_weights` names in E4M3 with their block scales, the rest bfloat16)."""
    for path, module in list(nnx.iter_modules(model)):
        fp8_names = fp8_base_weights(module) if base == "fp8" else ()
        for name, var in list(vars(module).items()):
            if not isinstance(var, nnx.Param) or isinstance(var, FrozenParam) or \
                    name.endswith(("_lora_a", "_lora_b")) or \
                    (name.endswith("_scale_inv") and name[:-len("_scale_inv")] in fp8_names):
                continue
            if name in fp8_names:
                _freeze_fp8(module, name, var)
                continue
            value = var.get_value()
            if base != "master" and jnp.issubdtype(value.dtype, jnp.floating):
                value = value.astype(jnp.bfloat16)
            setattr(module, name, FrozenParam(value, **frozen_metadata(var)))


def frozen_metadata(var) -> dict:
    """``var``'s metadata for its frozen copy: a routed expert's logical axes with
    ``expert`` as ``frozen_expert`` and its ``embed`` unsplit (:mod:`jaxmp.sharding.rules`:
    under FSDP the experts are split and gathered along their leading axis instead)."""
    meta = dict(var.get_metadata())
    axes = tuple(meta.get("out_sharding") or ())
    if "expert" in axes:
        meta["out_sharding"] = tuple("frozen_expert" if a == "expert" else
                                     None if a == "embed" else a for a in axes)
    return meta


def fp8_base_weights(module) -> Tuple[str, ...]:
    """The weights of ``module`` a ``lora.base=fp8`` model holds in E4M3: the projections
    it multiplies by :func:`jaxmp.models.layers.matmul` (attention, MLPs, routed and shared
    experts), as DeepSeek-V3's and Qwen3's FP8 releases store them; not the head, nor the
    shared expert's ``[d, 1]`` gate (which those releases keep in bfloat16)."""
    if getattr(module, "path", "") == "head":
        return ()
    return tuple(n for n in getattr(module, "matmul_weights", ()) if n != "shared_gate")


def fp8_matrix(name: str, shape, axes) -> Tuple[int, int, int]:
    """``(lead, K, N)`` of a weight stored as ``[*lead, *in, *out]``: how many leading axes
    are a scanned stack's ``layers`` or routed experts' ``expert`` / ``frozen_expert``
    (each its own matrix),
    and the contracted and kept sizes of its ``[K, N]`` matrix."""
    lead = 0
    while lead < len(axes) and axes[lead] in ("layers", "expert", "frozen_expert"):
        lead += 1
    inner = tuple(shape[lead:])
    n_in = _in_dims(name, len(inner))
    return lead, int(np.prod(inner[:n_in])), int(np.prod(inner[n_in:]))


def _freeze_fp8(module, name: str, var) -> None:
    """Weight ``name`` frozen in E4M3 with its block scales: as loaded when it already is
    (:func:`jaxmp.models.hf.load_weights` with ``fp8_base``: the checkpoint's own bytes and
    ``weight_scale_inv``), else quantized by :func:`jaxmp.fp8.quantize_blocks`."""
    from jaxmp.precision import fp8

    value = var.get_value()
    meta = frozen_metadata(var)
    stored = getattr(module, f"{name}_scale_inv", None)
    if stored is not None and jnp.dtype(value.dtype) == jnp.dtype(fp8.E4M3):
        setattr(module, name, FrozenParam(value, **meta))
        setattr(module, f"{name}_scale_inv", FrozenParam(stored.get_value(),
                                                         **frozen_metadata(stored)))
        return
    axes = tuple(meta.get("out_sharding") or (None,) * value.ndim)
    lead, k, n = fp8_matrix(name, value.shape, axes)
    quantize = lambda m: fp8.quantize_blocks(m, (fp8.BLOCK, fp8.BLOCK), fp8.E4M3)  # noqa: E731
    for _ in range(lead):
        quantize = jax.vmap(quantize)
    q, s = quantize(value.reshape(value.shape[:lead] + (k, n)))
    setattr(module, name, FrozenParam(q.reshape(value.shape), **meta))
    setattr(module, f"{name}_scale_inv", FrozenParam(
        s, eager_sharding=False, out_sharding=axes[:lead] + (None, None)))


def dequantized(name: str, q, scales, axes) -> np.ndarray:
    """A frozen E4M3 weight ``q`` (jaxmp's layout) times its block ``scales``, float32
    NumPy: what the blockwise products multiply by (:func:`jaxmp.fp8.dequantize_blocks`
    per ``[K, N]`` matrix)."""
    from jaxmp.precision import fp8

    q = np.asarray(jax.device_get(q)).astype(np.float32)
    s = np.asarray(jax.device_get(scales), np.float32)
    lead, k, n = fp8_matrix(name, q.shape, axes or (None,) * q.ndim)
    mats = q.reshape((-1, k, n))
    out = np.stack([np.asarray(fp8.dequantize_blocks(m, sc, (fp8.BLOCK, fp8.BLOCK)))
                    for m, sc in zip(mats, s.reshape((-1,) + s.shape[-2:]))])
    return out.reshape(q.shape)


def frozen_fp8(module, name: str):
    """The float32 block scales of weight ``name`` when a ``lora.base=fp8`` model holds it
    in E4M3 (:func:`fp8_base_weights`), else None."""
    scales = getattr(module, f"{name}_scale_inv", None)
    return None if scales is None else scales[...]


def adapted(module, name: str) -> Optional[Tuple[jax.Array, jax.Array, float]]:
    """``(A, B, scale)`` of weight ``name`` of ``module`` (as stored, a scanned layer's
    slice inside the scan), or None when it has no adapter."""
    a = getattr(module, f"{name}_lora_a", None)
    if a is None:
        return None
    return a[...], getattr(module, f"{name}_lora_b")[...], module.lora_scale


def _rank_letter(spec: str) -> str:
    return next(c for c in "rstuvwxyzabcdefghijklmnopq" if c not in spec)


def lora_product(x: jax.Array, a: jax.Array, b: jax.Array, scale: float,
                 spec: Optional[str]) -> jax.Array:
    """``scale * (x A) B`` in ``x``'s dtype (the compute dtype), for the product
    ``einsum(spec, x, W)`` of the weight the adapter belongs to; each product is
    :func:`jaxmp.ops.cast_matmul` (the adapters cast to ``x``'s dtype).

    Args:
      x: the activation, as the weight's product reads it.
      a: ``[*in, r]``; b: ``[r, *out]`` (the weight's contracted and kept dimensions).
      scale: ``alpha / r``.
      spec: the weight's ``einsum`` spec, or None for ``x @ W``.

    Raises:
      ValueError: a spec :func:`jaxmp.fp8.matmul` would not take, or ``a`` does not
        contract what ``spec`` contracts.
    """
    if spec is None:
        y = ops.cast_matmul(ops.cast_matmul(x, a), b)
    else:
        xs, ws, out, contracted, group = _parse_spec(spec, x.ndim, a.ndim + b.ndim - 2)
        n_in = a.ndim - 1
        if group or sorted(contracted) != sorted(ws[:n_in]):
            raise ValueError(f"an adapter A of shape {a.shape} does not contract what "
                             f"{spec!r} contracts")
        r = _rank_letter(spec)
        mid = "".join(c for c in xs if c not in contracted) + r
        xa = ops.cast_matmul(x, a, f"{xs},{ws[:n_in]}{r}->{mid}")
        y = ops.cast_matmul(xa, b, f"{mid},{r}{ws[n_in:]}->{out}")
    return (y * jnp.asarray(scale, y.dtype)).astype(x.dtype)


def merged_weight(w: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> np.ndarray:
    """``W + scale * A B`` in float32 (NumPy), shaped like ``W`` (a scanned stack's
    leading axis included): the merged export's weight (PEFT's ``merge_and_unload``)."""
    w, a, b = (np.asarray(jax.device_get(t), np.float32) for t in (w, a, b))
    if a.ndim + b.ndim - 2 == w.ndim + 1:  # a scanned stack: [L, *in, r] x [L, r, *out]
        delta = np.einsum("lir,lro->lio", a.reshape(a.shape[0], -1, a.shape[-1]),
                          b.reshape(b.shape[0], b.shape[1], -1)).reshape(w.shape)
    else:
        delta = (a.reshape(-1, a.shape[-1]) @ b.reshape(b.shape[0], -1)).reshape(w.shape)
    return w + np.float32(scale) * delta


# Odd multipliers of the digest's two 32-bit lanes (golden-ratio and murmur3 constants).
_LANES = ((0x9E3779B1, 0x85EBCA6B), (0xC2B2AE35, 0x27D4EB2F))


def _leaf_lanes(x: jax.Array) -> jax.Array:
    """uint32 [2]: ``sum_i bits(x_i) * h_k(i) mod 2**32`` for two position hashes ``h_k``;
    integer sums, so the same on any layout and device count."""
    bits = jax.lax.bitcast_convert_type(
        x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]).astype(jnp.uint32)
    index = jnp.zeros(x.shape, jnp.uint32)
    for d, n in enumerate(x.shape):  # a mixed index: no flat index past 2**32 elements
        index = index * jnp.uint32(n % 2**32 or 1) + jax.lax.broadcasted_iota(jnp.uint32, x.shape, d)
    out = []
    for mul, add in _LANES:
        h = index * jnp.uint32(mul) + jnp.uint32(add)
        h = (h ^ (h >> 15)) * jnp.uint32(0x2C1B3C6D) | jnp.uint32(1)
        out.append(jnp.sum(bits * h, dtype=jnp.uint32))
    return jnp.stack(out)


def base_digest(frozen) -> str:
    """A hex digest of a frozen base (an ``nnx.State`` of :class:`FrozenParam`): every
    weight's bytes, shape, dtype and path. Computed on the devices where the base lives
    (two position-weighted 32-bit sums per weight, exact and independent of the layout),
    combined on the host with ``zlib.crc32``/SHA-256 of the paths."""
    import hashlib
    flat = sorted(((".".join(map(str, p)), v.get_value()) for p, v in nnx.to_flat_state(frozen)),
                  key=lambda t: t[0])
    lanes = jax.device_get(jax.jit(lambda xs: [_leaf_lanes(x) for x in xs])([x for _, x in flat]))
    h = hashlib.sha256()
    for (name, x), lane in zip(flat, lanes):
        h.update(f"{name}:{tuple(x.shape)}:{x.dtype}:{int(lane[0])}:{int(lane[1])};".encode())
    return h.hexdigest()


def _module_at(model, path):
    node = model
    for part in path[:-1]:
        node = node[int(part)] if str(part).isdigit() else getattr(node, str(part))
    return node


def merge_lora(model: nnx.Module) -> nnx.Module:
    """The model without adapters: each adapted weight ``W + (alpha / r) A B``
    (:func:`merged_weight`, in float32, then the parameter dtype), every other weight the
    frozen base's, all ``nnx.Param`` s in their modules' ``param_dtype`` (PEFT's
    ``merge_and_unload``). What ``export --format hf`` and ``--format jaxmp`` write.

    Args:
      model: a :class:`~jaxmp.models.MoETransformer` that :func:`apply_lora` adapted (a
        model without adapters is returned as it is).

    Returns:
      A new :class:`~jaxmp.models.MoETransformer` on the host.
    """
    if not is_lora(model):
        return model
    from jaxmp.models.transformer import MoETransformer

    plain = nnx.eval_shape(lambda: MoETransformer(model.config, model.rules, rngs=nnx.Rngs(0)))
    source = dict(nnx.to_flat_state(nnx.state(model)))
    flat = []
    for path, var in nnx.to_flat_state(nnx.state(plain)):
        value = source[path].get_value()
        module = _module_at(model, path)
        scales = frozen_fp8(module, str(path[-1]))
        if scales is not None:  # a frozen E4M3 weight: each block times its scale
            value = dequantized(str(path[-1]), value, scales,
                                tuple(source[path].get_metadata().get("out_sharding") or ()))
        adapter = adapted(module, str(path[-1]))
        if adapter is not None:
            value = merged_weight(value, *adapter)
        want = var.get_value().dtype
        flat.append((path, var.replace(np.asarray(jax.device_get(value)).astype(want))))
    nnx.update(plain, nnx.from_flat_state(flat))
    return plain
