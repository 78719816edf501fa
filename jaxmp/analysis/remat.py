"""Per-device memory of a config's model under each attention path x remat setting.

``python -m jaxmp.report --config C --settings [--flops]``: the train step's loss traced
for every pair of ``model.attention`` (:data:`SETTING_ATTENTIONS`) and ``model.remat``
(:data:`~jaxmp.models.config.REMAT_POLICIES`), with the recomputation each remat
setting costs in FLOPs.
"""
from __future__ import annotations

import contextlib
from typing import Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from jaxmp.analysis.accounting import (MODES, data_mesh, lower_train_step, micro_batch,
                                       mode_config, state_bytes, step_residuals)
from jaxmp.analysis.residuals import saved_residuals
from jaxmp.models.attention import Attention, cudnn_support, trace_cudnn_without_gpu
from jaxmp.models.config import REMAT_POLICIES
from jaxmp.train.experiment import Experiment

__all__ = ["SETTING_ATTENTIONS", "activation_settings", "format_settings"]

SETTING_ATTENTIONS = ("reference", "xla", "cudnn")


def _attention_residual_bytes(exp: Experiment) -> int:
    """Bytes one attention sublayer (``blocks/0/attn``: projections, RoPE, core) keeps
    for its backward pass at the per-device micro-batch, differentiated in its weights
    and its input, outside any block-level checkpoint."""

    cfg, rules = exp.model_config, exp.rules
    module = nnx.eval_shape(lambda: Attention(
        cfg.d_model, cfg.num_heads, cfg.rope_theta, path="blocks/0/attn", rules=rules,
        rngs=nnx.Rngs(0), implementation=cfg.attention, recompute_core=cfg.remat == "attention"))
    graphdef, params = nnx.split(module, nnx.Param)
    micro = micro_batch(exp)
    # The residual stream's dtype: the embedding's output dtype.
    x = jax.ShapeDtypeStruct(micro.shape + (cfg.d_model,), rules.resolve("embed").output_dtype)
    res = saved_residuals(lambda p, x: nnx.merge(graphdef, p)(x).astype(jnp.float32).sum(),
                          params, x, argnums=(0, 1))
    return sum(r.nbytes for r in res if r.kind == "computed")


def _cost_flops(analysis) -> Optional[float]:
    if isinstance(analysis, (list, tuple)):  # older jax: one dict per computation
        analysis = analysis[0] if analysis else None
    return None if not analysis or "flops" not in analysis else float(analysis["flops"])


def _step_flops(config: ml_collections.ConfigDict) -> Tuple[Optional[float], Optional[float]]:
    """``(lowered, compiled)`` cost-analysis FLOPs of the train step on one device at the
    per-device micro-batch. ``lowered`` is the program JAX hands XLA (recomputation
    included); ``compiled`` is XLA's optimized program, None on CPU: XLA:CPU expands the
    optimization barriers that keep ``jax.checkpoint`` 's recomputation apart before it
    eliminates common subexpressions, so it merges the recomputation back into the
    forward pass (measured: a checkpointed attention core compiles to the un-checkpointed
    program), which XLA:GPU, whose barriers hold until scheduling, does not."""
    exp = Experiment.create(config, mesh=data_mesh(1))
    lowered = lower_train_step(exp, config.train.batch_size)
    if exp.mesh.devices.flat[0].platform == "cpu":
        return _cost_flops(lowered.cost_analysis()), None
    return _cost_flops(lowered.cost_analysis()), _cost_flops(lowered.compile().cost_analysis())


def activation_settings(config: ml_collections.ConfigDict, mode: str = "mixed_bf16",
                        num_devices: int = 8, *,
                        attentions: Sequence[str] = SETTING_ATTENTIONS,
                        remats: Sequence[str] = REMAT_POLICIES, flops: bool = False,
                        flops_attention: str = "reference") -> dict:
    """Per-device memory of ``config``'s model under each attention path x remat setting.

    For each pair, the experiment of ``mode_config(config, mode)`` with
    ``model.attention`` and ``model.remat`` set is built abstractly and the train
    step's loss is traced as in :func:`account_mode` (``activation_bytes``: every
    residual the forward keeps; ``total_bytes``: plus params, gradients, optimizer state
    and top-k residual); ``attention_bytes_per_layer`` is what one attention sublayer
    keeps (projections, RoPE and core, its block-level checkpoint aside). Where cuDNN
    is absent (CPU), the ``"cudnn"`` rows are traced with
    :func:`~jaxmp.models.attention.trace_cudnn_without_gpu`: the residuals of JAX's
    own cuDNN forward/backward rule, not run.

    With ``flops``, each remat setting's train step is also lowered (and, off CPU,
    compiled) on one device at the per-device micro-batch, with
    ``attention=flops_attention`` and ``scan_layers=False`` (XLA's cost analysis counts
    a loop body once and a custom call, such as the cuDNN kernel, as 0 FLOPs), and its
    cost-analysis FLOPs are reported with ``recompute_flops`` = FLOPs minus those of
    ``remat="none"``: what the setting recomputes, per device and step. The figure is
    the lowered program's (what JAX asks XLA to run); the compiled program's is added
    off CPU only (see :func:`_step_flops` for why XLA:CPU's is not the recompute).

    Args:
      config: a trainer config.
      mode: a key of :data:`MODES`.
      num_devices: data-parallel devices (the per-device micro-batch is
        ``batch_size / grad_accum_steps / num_devices``).
      attentions: paths among :data:`SETTING_ATTENTIONS`.
      remats: settings among :data:`~jaxmp.models.config.REMAT_POLICIES`.
      flops: also lower (off CPU: compile) for the FLOPs (slow for deep models: one
        unscanned lowering per remat setting).
      flops_attention: the path the FLOPs are compiled with (``"reference"`` or
        ``"xla"``: paths XLA counts).

    Returns:
      ``{"mode", "setup": {...}, "rows": [{"attention", "remat", "activation_bytes",
      "attention_bytes_per_layer", "total_bytes", "traced_only"}, ...], "flops": [{"remat",
      "attention", "step_flops", "recompute_flops", "compiled_step_flops"}, ...]}``
      (``flops`` empty unless asked; ``compiled_step_flops`` None on CPU), bytes per
      device.

    Raises:
      ValueError: an unknown mode, path or remat setting (before any work), or a config
        the trainer rejects.
    """
    if mode not in MODES:
        raise ValueError(f"unknown precision mode {mode!r}; allowed: {', '.join(MODES)}")
    for a in attentions:
        if a not in SETTING_ATTENTIONS:
            raise ValueError(f"attention path {a!r}; allowed: {', '.join(SETTING_ATTENTIONS)}")
    for r in remats:
        if r not in REMAT_POLICIES:
            raise ValueError(f"remat setting {r!r}; allowed: {', '.join(REMAT_POLICIES)}")
    if flops_attention not in ("reference", "xla"):
        raise ValueError(f"flops_attention={flops_attention!r}; allowed: reference, xla")
    mesh = data_mesh(num_devices)
    base = mode_config(config, mode)
    head_dim = base.model.d_model // base.model.num_heads
    rows, flop_rows = [], []
    for attention in attentions:
        for remat in remats:
            cfg = base.copy_and_resolve_references()
            cfg.model.attention, cfg.model.remat = attention, remat
            trace_only = attention == "cudnn" and not cudnn_support(jnp.bfloat16, head_dim)[0]
            with trace_cudnn_without_gpu() if trace_only else contextlib.nullcontext():
                exp = Experiment.create(cfg, mesh=mesh)
                activations = sum(r.nbytes for r in step_residuals(exp) if r.kind == "computed")
                attention_bytes = _attention_residual_bytes(exp)
            state = state_bytes(exp)
            rows.append({"attention": attention, "remat": remat, "activation_bytes": activations,
                         "attention_bytes_per_layer": attention_bytes,
                         "total_bytes": sum(state.values()) + activations,
                         "traced_only": trace_only})
    if flops:
        t = base.train
        none_flops = None
        for remat in ["none"] + [r for r in remats if r != "none"]:
            cfg = base.copy_and_resolve_references()
            cfg.model.update(dict(attention=flops_attention, remat=remat, scan_layers=False))
            cfg.train.batch_size = t.batch_size // num_devices
            value, compiled = _step_flops(cfg)
            none_flops = value if remat == "none" else none_flops
            flop_rows.append({"remat": remat, "attention": flops_attention, "step_flops": value,
                              "recompute_flops": value - none_flops,
                              "compiled_step_flops": compiled})
    t = base.train
    return {"mode": mode, "rows": rows, "flops": flop_rows,
            "setup": {"devices": num_devices, "micro_batch_per_device":
                      t.batch_size // t.grad_accum_steps // num_devices,
                      "seq_len": int(base.data.seq_len), "num_layers": int(base.model.num_layers),
                      "scan_layers": bool(base.model.scan_layers),
                      "state_bytes": sum(state_bytes(exp).values())}}


def format_settings(report: dict) -> str:
    """Formats :func:`activation_settings` for the terminal (GB = 1e9 bytes)."""
    s = report["setup"]
    lines = [f"Saved activations per attention path x remat setting, mode {report['mode']}: "
             f"{s['devices']} devices, micro-batch {s['micro_batch_per_device']} x {s['seq_len']} "
             f"tokens, {s['num_layers']} layers; state (params + grads + optimizer) "
             f"{s['state_bytes'] / 1e9:,.3f} GB per device",
             f"  {'attention':10s}{'remat':15s}{'activations GB':>16s}{'attention/layer GB':>20s}"
             f"{'total GB':>11s}"]
    for r in report["rows"]:
        note = "  (traced, not run: no cuDNN here)" if r["traced_only"] else ""
        lines.append(f"  {r['attention']:10s}{r['remat']:15s}{r['activation_bytes'] / 1e9:16,.3f}"
                     f"{r['attention_bytes_per_layer'] / 1e9:20,.4f}"
                     f"{r['total_bytes'] / 1e9:11,.3f}{note}")
    if report["flops"]:
        base = report["flops"][0]["step_flops"]
        lines += ["", "Train-step FLOPs per device of the lowered program, recomputation included "
                      f"(attention {report['flops'][0]['attention']}, layers unscanned, one device "
                      "at the micro-batch):"]
        for f in report["flops"]:
            share = f"{f['recompute_flops'] / base:+.1%}" if base else "-"
            compiled = (f"  compiled {f['compiled_step_flops']:.4g}" if f["compiled_step_flops"]
                        else "")
            lines.append(f"  {f['remat']:15s}{f['step_flops']:14.4g} FLOPs  recompute "
                         f"{f['recompute_flops']:12.4g} ({share}){compiled}")
    lines.append("activations: residuals the loss's forward keeps for the backward pass (as in the "
                 "mode tables); the working set of one block's recomputation is not included.")
    return "\n".join(lines)
