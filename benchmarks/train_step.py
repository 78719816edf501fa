"""Train-step throughput (tokens/s) and MFU of jaxmp's trainer in fp32, mixed bf16, mixed fp16.

Usage::

    python benchmarks/train_step.py --json train_step.json                 # tiny model, CPU
    python benchmarks/train_step.py --config configs/bench_h200.py --json train_step_h200.json

For each precision the trainer's own step (``Experiment.train_step`` of
:class:`jaxmp.train.Experiment` on a 1-device mesh: the function ``train.py`` runs, jitted
with the trainer's shardings and the state donated) is compiled, warmed up, then timed: ``--repeats`` samples of ``--steps`` consecutive steps, each sample
ending with ``jax.block_until_ready``, on one device, over a ring of random token
batches already on the device. The precisions set ``precision.policy`` to the preset
(routers and norms stay float32 islands, as always in :class:`~jaxmp.models.MoETransformer`)
and ``precision.loss_scale`` to ``none`` (fp32, mixed_bf16) or ``--fp16_loss_scale``.

MFU ("model FLOPs utilization", PaLM, Chowdhery et al. 2022, appendix B)::

    model FLOPs per step = jaxmp.analysis.cost.training_flops(active_params, batch * seq_len,
                               num_layers, seq_len, num_heads * head_dim)
                         = tokens * (6 * active_params + 6 * num_layers * seq_len * width)
    achieved TFLOP/s     = model FLOPs per step / median seconds per step / 1e12
    MFU                  = achieved TFLOP/s / peak TFLOP/s

``active_params`` is :func:`jaxmp.models.count_params`'s per-token count (embedding and
head included, as DeepSeek-V3 counts its 37B). Model FLOPs exclude recomputation, the
router, norms, softmax and the optimizer, so MFU is below the hardware utilization.

The peak: on NVIDIA GPUs, the dense datasheet peak from :data:`jaxmp.analysis.cost.HARDWARE` for
the math the matmuls really run (:func:`benchmarks.matmul.math_mode`: float32 matmuls run
as TF32 on Ampere and newer at JAX's default precision, so fp32 is measured against the
TF32 peak); the chip is read from ``device_kind`` (H100, H200, H800, A100) or given with
``--hardware``. Elsewhere (CPU) there is no datasheet peak: the peak is a measured float32
``[n, n] @ [n, n]`` matmul (:func:`benchmarks.matmul.measure_peak_tflops`, ``n =
--peak_size``), used for all three precisions. Each result says which peak it used.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

if __package__ in (None, ""):  # run as `python benchmarks/train_step.py`: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

from benchmarks import matmul
from benchmarks._common import (DEFAULT_CONFIG, check_json_flag, device_info, experiment, random_batches,
                                uncached_compiles, write_json)
from benchmarks._timing import MIN_REPEATS, check_repeats
from jaxmp.analysis import cost
from jaxmp.precision.loss_scale import get_loss_scale
from jaxmp.precision.policy import get_policy_rules
from jaxmp.train.config import config_to_dict

__all__ = ["PRECISIONS", "DEFAULT_FP16_LOSS_SCALE", "detect_hardware", "resolve_peak",
           "model_flops_per_step", "time_steps", "device_memory", "run"]

PRECISIONS = ("fp32", "mixed_bf16", "mixed_fp16")
# float16's largest finite value is 65504: start high and let backoff find the scale
# (Micikevicius et al. 2018, section 3.2; the scale PyTorch's GradScaler starts at).
DEFAULT_FP16_LOSS_SCALE = "dynamic:init=2**16"

# jaxmp.analysis.cost names its peaks by math mode; benchmarks.matmul.math_mode names them so too.
_MODE_TO_COST = {"fp32": "fp32", "tf32": "tf32", "bf16": "bf16", "fp16": "fp16"}


def detect_hardware(device_kind: str) -> Optional[str]:
    """The :data:`jaxmp.analysis.cost.HARDWARE` key named in a device kind, or None.

    ``"NVIDIA H200"`` -> ``"H200"``, ``"NVIDIA A100-SXM4-80GB"`` -> ``"A100"``. The table
    holds SXM figures; PCIe/NVL boards run lower clocks, so their MFU is understated.
    """
    kind = device_kind.upper()
    for name in cost.HARDWARE:
        if name.upper() in kind:
            return name
    return None


def resolve_peak(device: Any, compute_dtype: Any, hardware: Optional[str],
                 peak_size: int) -> Dict[str, Any]:
    """The peak TFLOP/s to divide by, with where it comes from.

    Args:
      device: the timed ``jax.Device``.
      compute_dtype: the policy's compute dtype (float32, bfloat16, float16).
      hardware: a :data:`jaxmp.analysis.cost.HARDWARE` key; None to detect it on GPUs.
      peak_size: matmul size of the measured peak (used off GPU without ``hardware``);
        measured anew on each call, so that on a shared machine the peak and the step
        it divides are timed under the same load.

    Returns:
      ``{"peak_tflops": float, "peak_kind": "datasheet" | "measured", "peak_source": str,
      "math_mode": str}``.

    Raises:
      ValueError: a GPU whose ``device_kind`` names no chip of the table and no
        ``hardware`` given.
    """
    mode = matmul.math_mode(compute_dtype, "default", device)
    if hardware is None and device.platform == "gpu":
        hardware = detect_hardware(device.device_kind)
        if hardware is None:
            raise ValueError(f"GPU {device.device_kind!r} is not in jaxmp.analysis.cost.HARDWARE; pass "
                             f"--hardware with one of {', '.join(cost.HARDWARE)}")
    if hardware is not None:
        key = _MODE_TO_COST[mode]
        board = device.device_kind.upper()
        note = " (SXM figure; this board is not SXM)" if "PCIE" in board or "NVL" in board else ""
        return {"peak_tflops": cost.peak_tflops(hardware, key), "peak_kind": "datasheet",
                "peak_source": f"{hardware} dense {key} peak, jaxmp.analysis.cost.HARDWARE{note}",
                "math_mode": mode}
    return {"peak_tflops": matmul.measure_peak_tflops("float32", peak_size, device=device),
            "peak_kind": "measured",
            "peak_source": f"measured float32 {peak_size}x{peak_size} matmul on "
                           f"{device.platform} (benchmarks/matmul.py, median of {MIN_REPEATS})",
            "math_mode": mode}


def model_flops_per_step(active_params: int, tokens: int, num_layers: int, seq_len: int,
                         width: int) -> float:
    """Model FLOPs of one train step: :func:`jaxmp.analysis.cost.training_flops` (6N + attention)."""
    return cost.training_flops(active_params, tokens, num_layers=num_layers, seq_len=seq_len,
                               d_model=width)


def time_steps(compiled, state, batches, steps: int, repeats: int, warmup: int):
    """Milliseconds per step: ``repeats`` samples of ``steps`` consecutive donated steps.

    Returns:
      ``(samples_ms list, final state, last metrics on the host)``.
    """
    cursor, samples, metrics = 0, [], None
    for r in range(warmup + repeats):
        start = time.perf_counter()
        for _ in range(steps):
            state, metrics = compiled(state, batches[cursor % len(batches)])
            cursor += 1
        jax.block_until_ready((state, metrics))
        if r >= warmup:
            samples.append((time.perf_counter() - start) / steps * 1e3)
    return samples, state, jax.device_get(metrics)


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def device_memory(device: Any, compiled: Any = None) -> Dict[str, Any]:
    """Device memory figures after a run: ``{"peak_bytes_in_use", "bytes_in_use",
    "program_bytes"}``.

    ``peak_bytes_in_use`` / ``bytes_in_use``: ``device.memory_stats()`` (the allocator's
    high-water mark since the process started, and now; None where the backend keeps no
    statistics, e.g. CPU). ``program_bytes``: what XLA planned for ``compiled``
    (``memory_analysis()``: arguments + outputs + temporaries - aliased donations;
    None without a program or an analysis).
    """
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    stats = stats or {}
    planned = None
    analysis = compiled.memory_analysis() if compiled is not None else None
    if analysis is not None:
        planned = int(analysis.argument_size_in_bytes + analysis.output_size_in_bytes
                      + analysis.temp_size_in_bytes - analysis.alias_size_in_bytes)
    return {"peak_bytes_in_use": stats.get("peak_bytes_in_use"),
            "bytes_in_use": stats.get("bytes_in_use"), "program_bytes": planned}


def run(config, steps: int, repeats: int, precisions: Sequence[str] = PRECISIONS, *,
        warmup: int = 1, ring: int = 4, fp16_loss_scale: str = DEFAULT_FP16_LOSS_SCALE,
        hardware: Optional[str] = None, peak_size: int = 1024,
        policies: Optional[Dict[str, Sequence[str]]] = None,
        log=print) -> Dict[str, Any]:
    """Times the trainer's step in each precision; returns the JSON report.

    Args:
      config: a trainer config (``configs/tiny_moe.py`` layout); its ``precision`` is
        replaced per run.
      steps: steps per timed sample, >= 1.
      repeats: timed samples per precision, >= 10 (median reported).
      precisions: names from :data:`PRECISIONS`.
      warmup: untimed samples after compiling, >= 0.
      ring: distinct random batches cycled, >= 1.
      fp16_loss_scale: the ``mixed_fp16`` loss scale (:func:`jaxmp.get_loss_scale` grammar).
      hardware: a :data:`jaxmp.analysis.cost.HARDWARE` key; None = detect on GPUs, measure elsewhere.
      peak_size: matrix size of the measured peak, >= 1.
      policies: instead of the presets, ``{name: (policy, loss_scale)}``: each
        ``precisions`` entry is a key of it, run with ``precision.policy = policy``
        (any policy string, e.g. an FP8 rule set) and ``precision.loss_scale =
        loss_scale``; the peak is that of the policy's default compute dtype.
      log: where progress lines go.

    Returns:
      ``{"device", "config", "total_params", "active_params", "num_layers", "seq_len",
      "attention_width", "batch_size", "tokens_per_step", "model_flops_per_step",
      "steps", "repeats", "warmup", "results": [...]}``; each result holds
      ``precision, policy, loss_scale, math_mode, step_ms`` (median ms per step),
      ``samples_ms, tokens_per_s, achieved_tflops, peak_tflops, peak_kind,
      peak_source, mfu, compile_s, final_loss, skipped_steps`` and the
      :func:`device_memory` figures (``peak_bytes_in_use`` is the process's high-water
      mark: run one precision per process to read it per precision).

    Raises:
      ValueError: bad counts, an unknown precision, hardware or loss scale, or an
        unknown GPU (all checked before any compilation), or bad config values.
    """
    repeats = check_repeats(repeats)
    steps, warmup = _check_int("steps", steps, 1), _check_int("warmup", warmup, 0)
    ring, peak_size = _check_int("ring", ring, 1), _check_int("peak_size", peak_size, 1)
    precisions = list(precisions)
    allowed = list(policies) if policies is not None else list(PRECISIONS)
    bad = [p for p in precisions if p not in allowed]
    if not precisions or bad:
        raise ValueError(f"precisions {precisions!r}: allowed {', '.join(allowed)} (at least one)")
    for name, (policy, loss_scale) in (policies or {}).items():
        get_policy_rules(policy)
        get_loss_scale(loss_scale)
    if hardware is not None:
        known = {name.lower(): name for name in cost.HARDWARE}
        if str(hardware).lower() not in known:
            raise ValueError(f"unknown hardware {hardware!r}; allowed: {', '.join(cost.HARDWARE)}")
        hardware = known[str(hardware).lower()]
    get_loss_scale(fp16_loss_scale)
    device = jax.devices()[0]
    if hardware is None and device.platform == "gpu" and detect_hardware(device.device_kind) is None:
        raise ValueError(f"GPU {device.device_kind!r} is not in jaxmp.analysis.cost.HARDWARE; pass "
                         f"--hardware with one of {', '.join(cost.HARDWARE)}")

    batch, seq_len = int(config.train.batch_size), int(config.data.seq_len)
    report: Dict[str, Any] = {"device": device_info(device), "results": []}
    batches = None
    for precision in precisions:
        cfg = config.copy_and_resolve_references()
        if policies is not None:
            cfg.precision.policy, cfg.precision.loss_scale = policies[precision]
        else:
            cfg.precision.policy = precision
            cfg.precision.loss_scale = fp16_loss_scale if precision == "mixed_fp16" else "none"
        exp = experiment(cfg)
        model_config, (total, active) = exp.model_config, exp.param_counts
        if batches is None:
            batches = random_batches(model_config.vocab_size, batch, seq_len, ring, seed=config.seed,
                                     device=exp.batch_sharding)
        state = exp.init_state()
        with uncached_compiles():
            start = time.perf_counter()
            compiled = exp.train_step.lower(state, batches[0]).compile()
            compile_s = time.perf_counter() - start
        samples, state, metrics = time_steps(compiled, state, batches, steps, repeats, warmup)
        memory = device_memory(device, compiled)
        del state, compiled  # free the device memory before the next precision

        width = model_config.num_heads * model_config.head_dim
        flops = model_flops_per_step(active, batch * seq_len, model_config.num_layers, seq_len, width)
        step_ms = float(np.median(samples))
        achieved = flops / (step_ms / 1e3) / 1e12
        peak = resolve_peak(device, get_policy_rules(cfg.precision.policy).default.compute_dtype,
                            hardware, peak_size)
        result = {
            "precision": precision, "policy": cfg.precision.policy,
            "loss_scale": cfg.precision.loss_scale, "step_ms": step_ms, "samples_ms": samples,
            "tokens_per_s": batch * seq_len / (step_ms / 1e3), "achieved_tflops": achieved,
            **peak, "mfu": achieved / peak["peak_tflops"], "compile_s": compile_s,
            "final_loss": float(metrics["loss"]), "skipped_steps": int(metrics["skipped_steps"]),
            **memory,
        }
        report["results"].append(result)
        report.update(total_params=int(total), active_params=int(active),
                      num_layers=model_config.num_layers, seq_len=seq_len, attention_width=width,
                      batch_size=batch, tokens_per_step=batch * seq_len,
                      model_flops_per_step=flops)
        log(f"  {precision:>10}: {step_ms:9.3f} ms/step  {result['tokens_per_s']:12,.0f} tokens/s  "
            f"{achieved:8.4f} TFLOP/s  MFU {result['mfu']:7.2%} of {peak['peak_tflops']:.4g} "
            f"({peak['peak_source']})  compile {compile_s:.1f} s  loss {result['final_loss']:.4f}  "
            f"skipped {result['skipped_steps']}")
    report.update(steps=steps, repeats=repeats, warmup=warmup, ring=ring, config=config_to_dict(config))
    return report


def _define_flags() -> None:
    # Defined only when run as a script, so tests can import this module next to overhead.py.
    config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "Trainer config file.")
    flags.DEFINE_integer("steps", 5, "Train steps per timed sample.", lower_bound=1)
    flags.DEFINE_integer("repeats", MIN_REPEATS, f"Timed samples per precision (>= {MIN_REPEATS}); "
                         "the median is reported.", lower_bound=MIN_REPEATS)
    flags.DEFINE_integer("warmup", 1, "Untimed samples after compiling.", lower_bound=0)
    flags.DEFINE_integer("ring", 4, "Distinct random batches cycled.", lower_bound=1)
    flags.DEFINE_list("precisions", list(PRECISIONS), "Precisions to time, comma-separated.")
    flags.DEFINE_string("fp16_loss_scale", DEFAULT_FP16_LOSS_SCALE,
                        "Loss scale of mixed_fp16 (jaxmp.get_loss_scale grammar).")
    flags.DEFINE_enum("hardware", None, list(cost.HARDWARE),
                      "Peak from this chip's datasheet (default: detected on GPUs, a measured "
                      "float32 matmul elsewhere).")
    flags.DEFINE_integer("peak_size", 1024, "Matrix size of the measured (non-GPU) peak.",
                         lower_bound=1)
    flags.DEFINE_string("json", None, "Write the report as JSON to this path.")
    flags.register_validator("json", check_json_flag)
    flags.register_validator("precisions", lambda v: bool(v) and set(v) <= set(PRECISIONS),
                             f"--precisions takes a comma-separated subset of {','.join(PRECISIONS)}")
    flags.register_validator("fp16_loss_scale", _valid_loss_scale,
                             "--fp16_loss_scale is not a loss scale (jaxmp.get_loss_scale grammar, "
                             "e.g. dynamic:init=2**16,growth_interval=2000)")


def _valid_loss_scale(spec: str) -> bool:
    try:
        get_loss_scale(spec)
    except ValueError:
        return False
    return True


def main(argv: Sequence[str]) -> None:
    """Command-line entry point (absl); flag errors exit with status 1 before any work."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # keep jax's backend-probing INFO lines out
    f = flags.FLAGS
    config = f.config
    device = jax.devices()[0]
    print(f"train-step benchmark on {device.platform} ({device.device_kind}): batch "
          f"{config.train.batch_size} x {config.data.seq_len} tokens, {f.repeats} samples of "
          f"{f.steps} steps per precision")
    report = run(config, f.steps, f.repeats, f.precisions, warmup=f.warmup, ring=f.ring,
                 fp16_loss_scale=f.fp16_loss_scale, hardware=f.hardware, peak_size=f.peak_size)
    print(f"  model: {report['total_params']:,} parameters, {report['active_params']:,} active per "
          f"token; {report['model_flops_per_step']:.4g} model FLOPs per step")
    if f.json:
        write_json(f.json, report)
        print(f"wrote {f.json}")


if __name__ == "__main__":
    _define_flags()
    app.run(main)
