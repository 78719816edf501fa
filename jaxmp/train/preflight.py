"""What the trainer checks and says before its first step: that the parameters, the
compiled step and the closing sample fit a device's memory, the banner that says what the
run is, and the precision settings that are allowed but rarely meant.
"""
from __future__ import annotations

from typing import Optional, Tuple

import jax
from flax import nnx
import numpy as np

from jaxmp._checks import F32_MAX
from jaxmp.precision.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from jaxmp.precision.policy import get_policy_rules
from jaxmp.train.config import Settings
from jaxmp.train.experiment import Experiment, parameter_bytes, unmatched_rules
from jaxmp.train.keys import DEFAULTS

__all__ = ["device_memory", "check_parameter_memory", "check_memory", "check_sample_memory",
           "describe_loss_scale", "device_bytes", "banner", "precision_warnings"]


def device_memory(device) -> Tuple[Optional[int], str]:
    """``(bytes one device can hold, where that figure comes from)``; None when unknown.

    Accelerators report their limit (``memory_stats()["bytes_limit"]``). CPU devices
    share the host's memory: its available memory (``MemAvailable`` of /proc/meminfo)
    divided by the local CPU devices.
    """
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"{device.device_kind} memory limit"
    if device.platform == "cpu":
        try:
            with open("/proc/meminfo") as f:
                info = {line.split(":")[0]: line.split()[1] for line in f if ":" in line}
            available = int(info["MemAvailable"]) * 1024
        except (OSError, KeyError, ValueError):
            return None, "unknown"
        n = max(1, len([d for d in jax.local_devices() if d.platform == "cpu"]))
        return available // n, f"the host's available memory shared by {n} CPU device(s)"
    return None, "unknown"


def check_parameter_memory(settings: Settings) -> None:
    """Refuses a model whose parameters alone cannot fit on the devices, before it is built
    (building 100,000 layers, even abstractly, takes many minutes, and compiling them
    longer): their bytes (:func:`~jaxmp.train.experiment.parameter_bytes`) split over every
    device of the mesh, the most any ``parallel.strategy`` splits them, against a device's
    memory (:func:`device_memory`). The optimizer state, gradients and activations come on
    top: :func:`check_memory` checks the compiled step.

    Raises:
      ValueError: the parameters need more than a device holds; the line gives both.
    """
    device = jax.local_devices()[0]
    have, source = device_memory(device)
    if have is None:
        return
    need = parameter_bytes(settings.model, settings.rules,
                           None if settings.lora is None else settings.lora.base)
    n = settings.num_devices
    if need / n > have:
        m = settings.model
        raise ValueError(
            f"the model (model.num_layers={m.num_layers}, d_model {m.d_model}, "
            f"{m.num_experts} routed experts) has {need / 2**30:,.1f} GiB of parameters: at "
            f"least {need / n / 2**30:,.2f} GiB per device over the {n} devices however they are "
            f"split, before optimizer state and activations, but a device has "
            f"{have / 2**30:,.2f} GiB ({source}); use a smaller model or more devices")


def check_memory(compiled, exp: Experiment) -> None:
    """Refuses a step that cannot fit on a device, before it runs.

    The estimate is XLA's memory analysis of the compiled step, per device: arguments +
    outputs - aliased (donated) buffers + temporaries.

    Raises:
      ValueError: the estimate exceeds the device's memory; the message gives both and
        what to change.
    """
    analysis = compiled.memory_analysis()
    if analysis is None:
        return
    need = (analysis.argument_size_in_bytes + analysis.output_size_in_bytes
            - analysis.alias_size_in_bytes + analysis.temp_size_in_bytes)
    device = next(d for d in exp.mesh.devices.flat if d.process_index == jax.process_index())
    have, source = device_memory(device)
    if have is not None and need > have:
        t = exp.config.train
        raise ValueError(
            f"the train step needs about {need / 2**30:.2f} GiB per device (XLA's memory analysis "
            f"of the compiled step: arguments {analysis.argument_size_in_bytes / 2**30:.2f} GiB, "
            f"temporaries {analysis.temp_size_in_bytes / 2**30:.2f} GiB) but a device has "
            f"{have / 2**30:.2f} GiB ({source}); lower train.batch_size (now {t.batch_size}), "
            f"raise train.grad_accum_steps (now {t.grad_accum_steps}) or use more devices")


def check_sample_memory(exp: Experiment) -> None:
    """Refuses a ``model.max_len`` whose closing sample cannot fit, before any work.

    :func:`jaxmp.models.generate` runs the model over a context of ``model.max_len``
    tokens (dropless MoE pads it to that length; capacity dispatch runs
    ``len(prompt) + train.sample_tokens`` tokens at most). That needs at least the int32
    context (4 bytes a token) and its logits (``vocab_size`` values a token, 2 bytes
    each at the narrowest, bfloat16): ``tokens * (4 + 2 * vocab_size)`` bytes; and, where
    the attention materializes its scores (``reference`` and ``xla``; ``auto`` off GPU),
    one layer's float32 scores, ``num_heads * tokens**2 * 4`` bytes. A lower bound, held
    on one device.

    Raises:
      ValueError: the lower bound exceeds the memory of the device sampling runs on
        (:func:`device_memory`); the message gives both and what to change.
    """
    t, m = exp.config.train, exp.model_config
    if not t.sample_tokens:
        return
    pad = m.num_moe_layers == 0 or not m.capacity_factor
    tokens = (m.max_len if pad else min(m.max_len,
                                        len(t.sample_prompt.encode("utf-8")) + t.sample_tokens))
    need, what = tokens * (4 + 2 * m.vocab_size), "the int32 context and its logits"
    platform = jax.local_devices()[0].platform
    if m.attention in ("reference", "xla") or (m.attention == "auto" and platform != "gpu"):
        need += m.num_heads * tokens * tokens * 4  # one layer's float32 scores [H, T, T]
        what = "the int32 context, its logits and one layer's float32 attention scores"
    have, source = device_memory(jax.local_devices()[0])
    if have is not None and need > have:
        raise ValueError(
            f"model.max_len={m.max_len}: the closing sample runs the model over {tokens} tokens, "
            f"which needs at least {need / 2**30:.2f} GiB ({what}) but a device has "
            f"{have / 2**30:.2f} GiB ({source}); "
            f"lower model.max_len or set train.sample_tokens=0")


def describe_loss_scale(loss_scale) -> str:
    """A one-line description of a loss scale for people (float32 max written so)."""
    def num(x):
        v = float(jax.device_get(x))
        return "float32 max" if v == F32_MAX else f"{v:g}"
    if isinstance(loss_scale, NoOpLossScale):
        return "none"
    if isinstance(loss_scale, StaticLossScale):
        return f"static {num(loss_scale.loss_scale)}"
    if isinstance(loss_scale, DynamicLossScale):
        ls = loss_scale
        return (f"dynamic, now {num(ls.loss_scale)}; x{num(ls.growth_factor)} after "
                f"{int(ls.growth_interval)} finite steps, x{num(ls.backoff_factor)} on overflow "
                f"(hysteresis {int(ls.hysteresis)}); min {num(ls.min_loss_scale)}, max "
                f"{num(ls.max_loss_scale)}")
    return repr(loss_scale)


def device_bytes(tree) -> int:
    """Bytes one device holds of ``tree``'s arrays: each leaf's shard shape under its
    sharding (the whole leaf where it has none), as ``python -m jaxmp.report`` counts."""
    total = 0
    for x in jax.tree.leaves(tree):
        if not hasattr(x, "dtype"):
            continue
        s = getattr(x, "sharding", None)
        shape = s.shard_shape(tuple(x.shape)) if s is not None else x.shape
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total


def banner(exp: Experiment, data) -> str:
    """What the run is: devices, layout, model, precision, communication, memory, data.

    The memory line is per device under the run's ``parallel.strategy``: each array of
    the train state counted by its shard shape (:func:`device_bytes`), gradients laid out
    like the master weights (split under zero1 and fsdp after the reduce-scatter).
    """
    cfg, m, state = exp.config, exp.model_config, exp.abstract_state
    total, active = exp.param_counts
    lora = exp.settings.lora
    trained = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    n = exp.mesh.devices.size
    state_bytes = device_bytes(state)
    c = exp.settings.comm
    layout = f"{exp.layout.strategy} ({exp.layout.declared.description})"
    if exp.layout.expert > 1:
        layout += f"; routed experts split over {exp.layout.expert} devices along 'expert'"
    docs = data.num_documents
    lines = [
        "jaxmp trainer",
        f"  devices     : {n} x {exp.mesh.devices.flat[0].platform} ({jax.process_count()} "
        f"process{'es' if jax.process_count() > 1 else ''}); mesh {dict(exp.mesh.shape)}",
        f"  parallel    : {layout}",
        f"  model       : {m.num_layers} layers, d_model {m.d_model}, {m.num_heads} heads, " + (
            f"{m.num_experts} routed + {m.num_shared_experts} shared experts, top-{m.top_k}"
            if m.num_experts else f"dense (feed-forward width {m.d_ff})"),
        f"  parameters  : {total:,} total, {active:,} active per token" + (
            f"; LoRA: {trained:,} trained in adapters of rank {lora.rank} (alpha {lora.alpha:g}), "
            f"the base frozen as {lora.base}" if lora is not None else ""),
        *([f"  weights     : from model.init_from={cfg.model.init_from} (at step 0; a resumed "
           f"run's are its checkpoint's)"] if cfg.model.get("init_from") else []),
        f"  policy      : {exp.rules}",
        f"  loss scale  : {describe_loss_scale(exp.settings.loss_scale)}",
        f"  grad comm   : {c['grad_reduce_dtype']} reduce" + (
            f", top-k {c['topk_ratio']:g} with error feedback"
            if c["grad_compression"] == "topk" else ""),
        f"  memory/dev  : train state {state_bytes / 2**20:.2f} MiB + gradients "
        f"{device_bytes(state.params) / 2**20:.2f} MiB under {exp.layout.strategy} "
        f"(activations not included; see python -m jaxmp.report)",
        f"  data        : {docs} document{'' if docs == 1 else 's'}, {data.train_tokens:,} train / "
        f"{data.eval_tokens:,} eval tokens (tokenizer {data.tokenizer.name}), seq_len "
        f"{cfg.data.seq_len}, global batch {cfg.train.batch_size}",
        *([f"  examples    : {data.examples}"] if getattr(data, "examples", "") else []),
    ]
    return "\n".join(lines)


def precision_warnings(exp: Experiment) -> list:
    """Risky precision settings that are allowed but rarely meant."""
    rules = exp.rules
    policies = [rules.default] + [p for _, p in rules.rules]
    lines = []
    if (any(p.needs_loss_scale for p in policies)
        and isinstance(exp.settings.loss_scale, NoOpLossScale)):
        lines.append("float16 compute without a loss scale: gradients below 2**-24 flush to zero "
                     "and large ones overflow (Micikevicius et al. 2018, section 3.2); set "
                     "precision.loss_scale=dynamic")
    # The default policy's own float32 islands (router, norm) are not the user's words: a
    # dense model has no router, and no warning is due for it.
    default = {pattern for pattern, _ in get_policy_rules(DEFAULTS["precision.policy"]).rules}
    return lines + unmatched_rules(exp.settings.rules, exp.module_paths, quiet=default) + \
        _peft_warnings(exp)


def _peft_warnings(exp: Experiment) -> list:
    """A LoRA run with MLP adapters whose family peft re-targets at the routed experts
    (:data:`jaxmp.models.hf.peft.PEFT_MOE_REMAPPED`): its PEFT export will be refused,
    said before it trains."""
    from jaxmp.models import hf
    from jaxmp.models.hf.peft import PEFT_MOE_REMAPPED

    if exp.settings.lora is None:
        return []
    try:
        family = hf.family_of(exp.model_config)
    except ValueError:
        return []
    mlp = [p for p, _ in nnx.to_flat_state(exp.abstract_state.params)
           if str(p[-1]).endswith("_lora_a") and any(str(k) in ("mlp", "shared_experts")
                                                      for k in p)]
    if family not in PEFT_MOE_REMAPPED or not mlp:
        return []
    return [f"lora.targets={exp.config.lora.targets!r} adapts MLP projections of a {family} "
            f"model, which peft re-targets at the routed experts: this run exports merged "
            f"(--format hf) but not as a PEFT adapter; lora.targets=attn/w trains adapters "
            f"that --format peft writes"]
