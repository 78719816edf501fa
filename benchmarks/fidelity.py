"""Does mixed precision train as well as float32? Final eval loss per precision mode.

Usage::

    python benchmarks/fidelity.py --json fidelity.json --plot fidelity.png
    python benchmarks/fidelity.py --steps 40 --d-model 32 --seq-len 32 --json small.json

Trains the model of ``--config`` (default ``configs/tiny_moe.py``, on the embedded
corpus: the Python standard library's source) with the same seed, data and number of
steps in each of these modes, through :func:`jaxmp.train.train_and_evaluate`:

======================== ================ ==============================================
run                      default policy   loss scale
======================== ================ ==============================================
``fp32``                 ``fp32``         none (the reference)
``mixed_bf16``           ``mixed_bf16``   none (bfloat16 has float32's range)
``mixed_fp16``           ``mixed_fp16``   dynamic (``--fp16-loss-scale``)
``mixed_fp16_noscale``   ``mixed_fp16``   none: what float16 does without a loss scale
``fp32_seed{s+1}``       ``fp32``         none; the next seed: run-to-run noise
======================== ================ ==============================================

Only the config policy's *default* is replaced; its per-module rules (``router: fp32;
norm: fp32`` in the shipped configs) are kept, so every mode has the same float32
islands. Each run gets its own directory under ``--workdir`` (a temporary directory,
deleted afterwards, by default) and its curves are read back from ``metrics.jsonl``.

The result is ``rel_diff[run] = (final_eval_loss[run] - final_eval_loss["fp32"]) /
final_eval_loss["fp32"]``. The target is ``|rel_diff| <= 0.25%`` for ``mixed_bf16``
and ``mixed_fp16``: the bar DeepSeek-V3 set for its FP8 training against BF16
(technical report, arXiv:2412.19437, section 3.3: "the relative loss error of our FP8
training model remains consistently below 0.25%"). ``fp32_seed{s+1}`` differs from the
reference only by its seed (initial weights, data order, step rng); its
``rel_diff`` is the run-to-run noise, the honest yardstick for the others: a precision
mode cannot be told apart from float32 by a difference smaller than the noise. Note
that it is an upper bound on the noise of a *paired* comparison (same seed), whose
trajectories still diverge, chaotically, from the first rounding difference on.

Underflow diagnostics (``"underflow"`` in the JSON) explain what the unscaled float16
run loses. They are computed on the **float32 run's true gradients**: its checkpoints
(step 0, the initial state rebuilt from the seed, and ``--underflow-checkpoints``
evenly spaced ones) are restored, the gradient of the training loss (cross-entropy +
MoE auxiliary loss, no loss scale) is taken in float32 on the first eval batch, and
:func:`jaxmp.diagnostics.underflow_report` counts, per parameter, the fraction of
non-zero elements that become 0 when cast to float16 at scale 1 (Micikevicius et al.
2018, section 3.2), aggregated by module. The float32 run is used rather than the
unscaled run's own state because its gradients are the true values (nothing has been
flushed yet), so the fractions are what a float16 cast *would* lose at that point of
a healthy run. They cover parameter gradients, which a float16 backward pass
materializes in float16 before the cast to the float32 master dtype; activation
gradients (not parameters, not reported) underflow too, and feed into them. Modules
listed with compute dtype float32 (router, norms) stay out of float16 in the
``mixed_fp16`` runs. The same totals at the dynamic run's final loss scale show what
scaling recovers.

The default ``--steps`` (:data:`DEFAULT_STEPS`) was measured: the default invocation (5
runs of configs/tiny_moe.py, one CPU device) took 10 min 40 s of wall time and 8 min 53 s
of CPU time on a 2-vCPU machine shared with other jobs (load average 4 to 6), and
15 min 48 s when the load average was near 10. The result is in benchmarks/README.md.
The runs are deterministic: both invocations gave the same losses.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import numbers
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

if __package__ in (None, ""):  # run as `python benchmarks/fidelity.py`: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from jaxmp import ops
from jaxmp.diagnostics import LeafReport, summarize, underflow_report
from jaxmp.precision.loss_scale import get_loss_scale
from jaxmp.precision.policy import get_policy_rules
from jaxmp.train import Checkpointer, Experiment, train_and_evaluate
from jaxmp.train.config import config_to_dict, load_config as _load_config, validate_config

__all__ = [
    "ROOT",
    "DEFAULT_CONFIG",
    "DEFAULT_STEPS",
    "DEFAULT_FP16_LOSS_SCALE",
    "DEFAULT_EVAL_BATCHES",
    "TARGET",
    "REFERENCE",
    "RunSpec",
    "load_config",
    "with_default_policy",
    "run_specs",
    "run_config",
    "Plan",
    "plan",
    "check_workdir",
    "train_run",
    "underflow_for",
    "compare",
    "read_metrics",
    "rel_diff",
    "by_module",
    "gradient_underflow",
    "run",
    "plot",
    "format_summary",
    "main",
]

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "configs" / "tiny_moe.py"
# About 10 minutes for the 5 default runs on 2 CPU cores (measured; module docstring).
DEFAULT_STEPS = 2000
# The trainer config's own suggestion for float16 (configs/tiny_moe.py docstring).
DEFAULT_FP16_LOSS_SCALE = "dynamic:init=2**15,growth_interval=200"
# Eval batches per evaluation. The shipped configs' 4 (4,096 tokens) make a noisy yardstick
# for differences of a fraction of a percent; 64 batches of tiny_moe are 65,536 tokens, the
# same fixed, unshuffled eval windows for every run.
DEFAULT_EVAL_BATCHES = 64
TARGET = 0.0025  # DeepSeek-V3 technical report, section 3.3
REFERENCE = "fp32"
TARGET_RUNS = ("mixed_bf16", "mixed_fp16")


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One training run of the comparison.

    Attributes:
      name: the key in the report (``fp32``, ``mixed_bf16``, ...).
      preset: the default policy (a :func:`jaxmp.get_policy` preset) replacing the
        config's default; the config's per-module rules are kept.
      loss_scale: a :func:`jaxmp.get_loss_scale` spec (``none``, ``dynamic:...``).
      seed_offset: added to the config's seed (0 for every run but the noise runs).
    """

    name: str
    preset: str
    loss_scale: str
    seed_offset: int = 0


def load_config(path: str | os.PathLike) -> ml_collections.ConfigDict:
    """Loads ``get_config()`` from a config file such as configs/tiny_moe.py
    (:func:`jaxmp.train.config.load_config`).

    Raises:
      ValueError: the file does not exist, has no ``get_config``, or an unknown key.
    """
    return _load_config(path)


def with_default_policy(policy: str, preset: str) -> str:
    """Replaces the default policy of a rules string, keeping its per-module rules.

    ``with_default_policy("mixed_bf16; router: fp32; norm: fp32", "mixed_fp16")`` is
    ``"mixed_fp16; router: fp32; norm: fp32"``. Grammar: :func:`jaxmp.get_policy_rules`.

    Raises:
      ValueError: ``policy`` or the result does not parse (e.g. an unknown preset).
    """
    get_policy_rules(policy)
    rules = [item.strip() for item in policy.split(";") if ":" in item]
    result = "; ".join([preset] + rules)
    get_policy_rules(result)
    return result


def run_specs(fp16_loss_scale: str = DEFAULT_FP16_LOSS_SCALE, noise_seeds: int = 1) -> List[RunSpec]:
    """The runs of the comparison: the four modes, then ``noise_seeds`` float32 reseeds.

    Raises:
      ValueError: ``noise_seeds`` not an integer >= 0, or ``fp16_loss_scale`` not a
        ``dynamic`` or ``static`` loss scale.
    """
    if isinstance(noise_seeds, bool) or not isinstance(noise_seeds, numbers.Integral) or noise_seeds < 0:
        raise ValueError(f"noise_seeds must be an integer >= 0, got {noise_seeds!r}")
    kind = str(fp16_loss_scale).split(":", 1)[0].strip().lower()
    if kind not in ("dynamic", "static"):
        raise ValueError(f"fp16_loss_scale must be a 'dynamic[:...]' or 'static:S' loss scale, "
                         f"got {fp16_loss_scale!r}")
    specs = [RunSpec(REFERENCE, "fp32", "none"), RunSpec("mixed_bf16", "mixed_bf16", "none"),
             RunSpec("mixed_fp16", "mixed_fp16", fp16_loss_scale),
             RunSpec("mixed_fp16_noscale", "mixed_fp16", "none")]
    specs += [RunSpec(f"fp32_seed{i}", "fp32", "none", seed_offset=i) for i in range(1, noise_seeds + 1)]
    return specs


def run_config(base: ml_collections.ConfigDict, spec: RunSpec, *, steps: int, log_every: int,
               eval_every: int, checkpoint_every: int, keep_checkpoints: int) -> ml_collections.ConfigDict:
    """``base`` with ``spec``'s precision and seed and the given cadence (a copy).

    The sample at the end of training is switched off (``sample_tokens = 0``): it
    costs time and says nothing about the loss.
    """
    config = ml_collections.ConfigDict(base.to_dict())
    config.seed = int(base.seed) + spec.seed_offset
    config.precision.policy = with_default_policy(base.precision.policy, spec.preset)
    config.precision.loss_scale = spec.loss_scale
    config.train.update(dict(steps=steps, log_every=log_every, eval_every=eval_every,
                             checkpoint_every=checkpoint_every, keep_checkpoints=keep_checkpoints,
                             sample_tokens=0))
    return config


def read_metrics(workdir: str | os.PathLike) -> Dict[str, List[dict]]:
    """Reads ``workdir/metrics.jsonl`` into ``{"train": [records], "eval": [records]}``.

    Raises:
      ValueError: the file does not exist.
    """
    path = Path(workdir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"no metrics.jsonl in {str(workdir)!r}")
    out: Dict[str, List[dict]] = {"train": [], "eval": []}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            out.setdefault(record["split"], []).append(record)
    return out


def rel_diff(losses: Mapping[str, float], reference: str = REFERENCE) -> Dict[str, float]:
    """Relative loss differences ``(loss - loss[reference]) / loss[reference]``.

    Args:
      losses: final eval loss per run (nats per token).
      reference: the key of the reference run.

    Returns:
      One entry per run other than ``reference`` (a fraction: 0.0025 is 0.25%).

    Raises:
      ValueError: ``reference`` missing, or its loss zero or not finite.
    """
    if reference not in losses:
        raise ValueError(f"reference run {reference!r} not in {sorted(losses)}")
    ref = float(losses[reference])
    if not math.isfinite(ref) or ref == 0.0:
        raise ValueError(f"reference loss must be finite and non-zero, got {ref!r}")
    return {k: (float(v) - ref) / ref for k, v in losses.items() if k != reference}


def by_module(report: Mapping[str, LeafReport]) -> Dict[str, LeafReport]:
    """Aggregates an :func:`~jaxmp.diagnostics.underflow_report` by module.

    A leaf ``blocks/0/attn/wq`` belongs to module ``blocks/0/attn`` (its path without
    the parameter name). Fractions are weighted by non-zero counts
    (:func:`~jaxmp.diagnostics.summarize`).

    Returns:
      ``{module: LeafReport}`` in first-seen order.
    """
    groups: Dict[str, Dict[str, LeafReport]] = {}
    for path, leaf in report.items():
        groups.setdefault(path.rsplit("/", 1)[0] if "/" in path else path, {})[path] = leaf
    return {module: summarize(leaves) for module, leaves in groups.items()}


def _leaf_dict(r: LeafReport) -> dict:
    return {"nonzero": r.nonzero, "underflow": r.underflow, "subnormal": r.subnormal,
            "overflow": r.overflow}


def gradient_underflow(config: ml_collections.ConfigDict, workdir: str | os.PathLike, *,
                       fp16_policy: str, num_devices: Optional[int] = None,
                       scaled_loss_scale: Optional[float] = None,
                       dtype: Any = jnp.float16) -> Dict[str, Any]:
    """Underflow of the true float32 gradients of a finished run, by module and checkpoint.

    Restores every checkpoint of the run in ``workdir`` (trained with ``config``) plus
    the initial state (step 0, rebuilt from ``config.seed``), takes the gradient of
    cross-entropy + auxiliary loss on the first eval batch in the run's own precision
    (use a float32 run: its gradients are the true values) and casts it to ``dtype``.

    Args:
      config: the run's config (as given to ``train_and_evaluate``).
      workdir: the run's directory.
      fp16_policy: the policy string of the low-precision run, used to report which
        modules compute in ``dtype`` there and which are float32 islands.
      num_devices: the devices the run trained on (the train state's per-device
        parts are sized by it); the trainer's default when None.
      scaled_loss_scale: also report totals at this loss scale (e.g. the dynamic
        run's final scale); None to skip.
      dtype: the dtype to test (float16).

    Returns:
      ``{"source", "dtype", "loss_scale": 1.0, "scaled_loss_scale", "modules":
      {module: compute dtype name in the fp16 run}, "checkpoints": [{"step", "total",
      "total_scaled", "modules": {module: {"nonzero", "underflow", "subnormal",
      "overflow"}}}]}``; fractions of non-zero gradient elements.

    Raises:
      ValueError: the config has no eval batches.
      jaxmp.train.CheckpointError: an unreadable checkpoint.
    """
    if int(config.data.num_eval_batches) < 1:
        raise ValueError("gradient_underflow needs data.num_eval_batches >= 1")
    exp = Experiment.create(config, num_devices=num_devices)
    batch = {k: jnp.asarray(v) for k, v in exp.data.eval_batches[0].items()}
    graphdef = exp.graphdef

    def loss_fn(params, biases, rest):
        logits, aux = nnx.merge(graphdef, params, biases, rest)(batch["inputs"])
        return ops.cross_entropy(logits, batch["targets"]) + aux["aux_loss"]

    grad_fn = jax.jit(jax.grad(loss_fn))
    states = [(0, exp.init_state())]
    with Checkpointer(workdir, keep=max(1, int(config.train.keep_checkpoints))) as ckpt:
        config_dict = config_to_dict(exp.config)
        for step in ckpt.all_steps():
            states.append(ckpt.restore(exp.abstract_state, config_dict, step=step)[:2])

    # The modules' compute dtypes in the float16 run: its rules plus the model's islands.
    fp16 = Experiment.create(_with_policy(config, fp16_policy), num_devices=num_devices)
    rules = fp16.rules
    checkpoints, modules = [], {}
    for step, state in states:
        grads = grad_fn(state.params, state.biases, state.rest)
        report = underflow_report(grads, dtype, 1.0)
        per_module = by_module(report)
        modules = {m: rules.resolve(m).compute_dtype.name for m in per_module}
        entry = {"step": int(step), "total": _leaf_dict(summarize(report)),
                 "modules": {m: _leaf_dict(r) for m, r in per_module.items()}}
        if scaled_loss_scale is not None:
            entry["total_scaled"] = _leaf_dict(summarize(underflow_report(grads, dtype, scaled_loss_scale)))
        checkpoints.append(entry)
    return {"source": "true float32 gradients of the fp32 run's checkpoints, first eval batch",
            "dtype": jnp.dtype(dtype).name, "loss_scale": 1.0, "scaled_loss_scale": scaled_loss_scale,
            "modules": modules, "checkpoints": checkpoints}


def _with_policy(config: ml_collections.ConfigDict, policy: str) -> ml_collections.ConfigDict:
    out = ml_collections.ConfigDict(config.to_dict())
    out.precision.policy = policy
    return out


def _curves(metrics: Dict[str, List[dict]]) -> Dict[str, list]:
    train, evals = metrics["train"], metrics["eval"]
    return {"step": [r["step"] for r in train], "loss": [r["loss"] for r in train],
            "loss_scale": [r["loss_scale"] for r in train],
            "skipped_steps": [r["skipped_steps"] for r in train],
            "eval_step": [r["step"] for r in evals], "eval_loss": [r["loss"] for r in evals]}


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The validated runs of one comparison (see :func:`plan`).

    Attributes:
      steps: train steps per run.
      num_devices: data-parallel devices of every run.
      specs: the runs, in order.
      configs: the trainer config of each run, by name.
      base: the base config.
    """

    steps: int
    num_devices: int
    specs: Sequence[RunSpec]
    configs: Mapping[str, ml_collections.ConfigDict]
    base: ml_collections.ConfigDict


def plan(config: ml_collections.ConfigDict, *, steps: int = DEFAULT_STEPS,
         num_devices: Optional[int] = None, fp16_loss_scale: str = DEFAULT_FP16_LOSS_SCALE,
         noise_seeds: int = 1, log_every: int = 5, num_evals: int = 10,
         underflow_checkpoints: int = 3) -> Plan:
    """Builds and checks the config of every run; nothing is trained.

    Args:
      config: the base config (e.g. :func:`load_config` of configs/tiny_moe.py).
      steps: train steps per run (>= 1).
      num_devices: data-parallel devices; the config's ``train.num_devices``, else all.
      fp16_loss_scale: the loss scale of the ``mixed_fp16`` run.
      noise_seeds: float32 runs with seeds ``seed + 1 ..`` (run-to-run noise).
      log_every: train steps between logged records (loss, loss scale).
      num_evals: evaluations per run, evenly spaced (the last at ``steps``).
      underflow_checkpoints: checkpoints of the float32 run kept for
        :func:`gradient_underflow` (>= 1; the initial state comes on top).

    Returns:
      A :class:`Plan`.

    Raises:
      ValueError: bad counts or loss scale, more devices than exist, no eval batches,
        or a config the trainer rejects (:func:`jaxmp.train.config.validate_config`).
    """
    steps = _check_positive_int("steps", steps)
    log_every = _check_positive_int("log_every", log_every)
    num_evals = _check_positive_int("num_evals", num_evals)
    underflow_checkpoints = _check_positive_int("underflow_checkpoints", underflow_checkpoints)
    get_loss_scale(fp16_loss_scale)
    specs = run_specs(fp16_loss_scale, noise_seeds)
    devices = num_devices or int(config.train.get("num_devices") or 0) or jax.device_count()
    if devices > jax.device_count():
        raise ValueError(f"num_devices={devices} exceeds the {jax.device_count()} available devices")
    if int(config.data.num_eval_batches) < 1:
        raise ValueError("the comparison needs an eval loss: data.num_eval_batches must be >= 1")
    configs = {}
    for spec in specs:
        # Only the reference keeps intermediate checkpoints (for the underflow report).
        every = -(-steps // underflow_checkpoints) if spec.name == REFERENCE else steps
        configs[spec.name] = run_config(
            config, spec, steps=steps, log_every=min(log_every, steps),
            eval_every=max(1, steps // num_evals), checkpoint_every=every,
            keep_checkpoints=underflow_checkpoints + 1)
        validate_config(configs[spec.name], devices)
    return Plan(steps, devices, tuple(specs), configs, config)


def check_workdir(workdir: str | os.PathLike, names: Sequence[str]) -> None:
    """Refuses run directories that hold anything: the trainer would resume from them.

    Raises:
      ValueError: ``workdir/<name>`` exists and is not empty.
    """
    for name in names:
        d = Path(workdir) / name
        if d.exists() and any(d.iterdir()):
            raise ValueError(f"run directory {str(d)!r} is not empty (the trainer would resume "
                             "from it); use an empty --workdir")


def train_run(plan_: Plan, name: str, workdir: str | os.PathLike, *, quiet: bool = False,
              log: Callable[[str], None] = print) -> Dict[str, Any]:
    """Trains run ``name`` of ``plan_`` in ``workdir/<name>`` and reads its metrics back.

    Args:
      plan_: from :func:`plan`.
      name: one of ``plan_.configs``.
      workdir: the parent directory; ``workdir/<name>`` must be empty or missing.
      quiet: send the trainer's banner and progress bar to ``workdir/<name>/train.log``.
      log: where the start and end lines go.

    Returns:
      ``{"name", "final_eval_loss" (nats/token), "policy", "loss_scale", "seed",
      "skipped_steps", "final_loss_scale", "wall_s" (seconds), "curves": {"step",
      "loss", "loss_scale", "skipped_steps", "eval_step", "eval_loss"}}``, the curves
      from ``metrics.jsonl``.

    Raises:
      ValueError: an unknown ``name`` or a used run directory.
    """
    if name not in plan_.configs:
        raise ValueError(f"unknown run {name!r}; the plan has {', '.join(plan_.configs)}")
    check_workdir(workdir, [name])
    cfg, d = plan_.configs[name], Path(workdir) / name
    d.mkdir(parents=True, exist_ok=True)
    log(f"[{name}] policy {cfg.precision.policy!r}, loss scale {cfg.precision.loss_scale!r}, "
        f"seed {cfg.seed}, {plan_.steps} steps")
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if quiet:
            f = stack.enter_context(open(d / "train.log", "w"))
            stack.enter_context(contextlib.redirect_stdout(f))
            stack.enter_context(contextlib.redirect_stderr(f))
        summary = train_and_evaluate(cfg, str(d), num_devices=plan_.num_devices)
    wall = time.perf_counter() - start
    metrics = read_metrics(d)
    log(f"[{name}] eval loss {summary['eval_loss']:.5f}, {summary['skipped_steps']} skipped "
        f"steps, {wall:.0f} s")
    return {"name": name, "final_eval_loss": float(summary["eval_loss"]),
            "policy": cfg.precision.policy, "loss_scale": cfg.precision.loss_scale,
            "seed": int(cfg.seed), "skipped_steps": int(summary["skipped_steps"]),
            "final_loss_scale": metrics["train"][-1]["loss_scale"], "wall_s": wall,
            "curves": _curves(metrics)}


def underflow_for(plan_: Plan, workdir: str | os.PathLike,
                  scaled_loss_scale: Optional[float] = None) -> Dict[str, Any]:
    """:func:`gradient_underflow` of the plan's float32 run (trained in ``workdir/fp32``),
    with the module dtypes of its unscaled float16 run."""
    return gradient_underflow(plan_.configs[REFERENCE], Path(workdir) / REFERENCE,
                              fp16_policy=plan_.configs["mixed_fp16_noscale"].precision.policy,
                              num_devices=plan_.num_devices, scaled_loss_scale=scaled_loss_scale)


def compare(plan_: Plan, results: Sequence[Mapping[str, Any]],
            underflow: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """Assembles the report from the runs' results (see :func:`run` for its keys).

    Raises:
      ValueError: the float32 reference run is missing.
    """
    losses = {r["name"]: r["final_eval_loss"] for r in results}
    diffs = rel_diff(losses)
    noise = [abs(v) for k, v in diffs.items() if k.startswith(f"{REFERENCE}_seed")]
    base, device = plan_.base, jax.devices()[0]
    return {
        "final_eval_loss": losses, "rel_diff": diffs, "target": TARGET,
        "meets_target": {k: bool(abs(diffs[k]) <= TARGET) for k in TARGET_RUNS if k in diffs},
        "noise": max(noise) if noise else None,
        "runs": {r["name"]: {k: r[k] for k in ("policy", "loss_scale", "seed", "skipped_steps",
                                                "final_loss_scale", "wall_s")} for r in results},
        "curves": {r["name"]: r["curves"] for r in results},
        "underflow": underflow,
        "setup": {"steps": plan_.steps, "num_devices": plan_.num_devices, "seed": int(base.seed),
                  "batch_size": int(base.train.batch_size), "seq_len": int(base.data.seq_len),
                  "eval_tokens": int(base.data.num_eval_batches) * int(base.train.batch_size)
                  * int(base.data.seq_len),
                  "model": base.model.to_dict(), "base_policy": base.precision.policy,
                  "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, "
                             f"{device.platform} ({device.device_kind})",
                  "jax": jax.__version__},
    }


def run(config: ml_collections.ConfigDict, *, steps: int = DEFAULT_STEPS,
        workdir: Optional[str | os.PathLike] = None, num_devices: Optional[int] = None,
        fp16_loss_scale: str = DEFAULT_FP16_LOSS_SCALE, noise_seeds: int = 1,
        log_every: int = 5, num_evals: int = 10, underflow_checkpoints: int = 3,
        quiet: bool = False, log: Callable[[str], None] = print) -> Dict[str, Any]:
    """Trains every run of :func:`run_specs` and compares the final eval losses.

    Args:
      config, steps, num_devices, fp16_loss_scale, noise_seeds, log_every, num_evals,
      underflow_checkpoints: see :func:`plan`.
      workdir: parent of the run directories ``workdir/<run>``, which must not exist
        yet or be empty; a temporary directory (deleted afterwards) when None.
      quiet: send each run's banner and progress bar to ``workdir/<run>/train.log``.
      log: where progress lines go.

    Returns:
      ``{"final_eval_loss": {run: float}, "rel_diff": {run: float}, "target": 0.0025,
      "meets_target": {run: bool}, "noise": float or None (largest |rel_diff| of the
      float32 reseeds), "runs": {run: {"policy", "loss_scale", "seed",
      "skipped_steps", "final_loss_scale", "wall_s"}}, "curves": {run: {"step",
      "loss", "loss_scale", "skipped_steps", "eval_step", "eval_loss"}},
      "underflow": see :func:`gradient_underflow`, "setup": {...}}``. Losses are mean
      token cross-entropies in nats; ``wall_s`` in seconds; ``rel_diff`` a fraction.

    Raises:
      ValueError: anything :func:`plan` or :func:`check_workdir` rejects, before any
        run starts.
    """
    plan_ = plan(config, steps=steps, num_devices=num_devices, fp16_loss_scale=fp16_loss_scale,
                 noise_seeds=noise_seeds, log_every=log_every, num_evals=num_evals,
                 underflow_checkpoints=underflow_checkpoints)
    temp = None
    if workdir is None:
        workdir = temp = tempfile.mkdtemp(prefix="jaxmp_fidelity_")
    check_workdir(workdir, [s.name for s in plan_.specs])
    try:
        results = [train_run(plan_, s.name, workdir, quiet=quiet, log=log) for s in plan_.specs]
        start = time.perf_counter()
        scale = next(r["final_loss_scale"] for r in results if r["name"] == "mixed_fp16")
        underflow = underflow_for(plan_, workdir, scaled_loss_scale=scale)
        log(f"[underflow] {len(underflow['checkpoints'])} checkpoints, "
            f"{time.perf_counter() - start:.0f} s")
    finally:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)
    return compare(plan_, results, underflow)


def plot(report: Mapping[str, Any]):
    """Loss curves, eval-loss difference to float32 and the float16 loss scale.

    Args:
      report: the result of :func:`run` (or its JSON).

    Returns:
      A ``matplotlib.figure.Figure`` with an Agg canvas (no pyplot state is touched),
      three panels: train loss (exponential moving average over logged steps) and eval
      loss per run; eval loss relative to fp32 in percent with the 0.25% band; the
      ``mixed_fp16`` loss scale (log2) with its skipped steps.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    curves = report["curves"]
    fig = Figure(figsize=(9, 10))
    FigureCanvasAgg(fig)
    ax1, ax2, ax3 = fig.subplots(3, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2, 2]})
    for i, (name, c) in enumerate(curves.items()):
        color = f"C{i}"
        loss = np.asarray(c["loss"], np.float64)
        ema = np.empty_like(loss)
        for j, x in enumerate(loss):  # an EMA: train loss per logged step is one batch
            ema[j] = x if j == 0 else 0.9 * ema[j - 1] + 0.1 * x
        ax1.plot(c["step"], ema, color=color, lw=1, label=f"{name} (train, EMA)")
        ax1.plot(c["eval_step"], c["eval_loss"], color=color, marker="o", ms=3, ls="--", lw=0.8)
    finals = [c["eval_loss"][-1] for c in curves.values() if c["eval_loss"]]
    if finals:  # the first steps' loss would squash the part where the runs differ
        ax1.set_ylim(0.97 * min(finals), 1.5 * max(finals))
    ax1.set_ylabel("loss (nats/token)")
    ax1.set_title("train loss (lines), eval loss (dots)")
    ax1.legend(fontsize=8)
    ref = curves[REFERENCE]
    for i, (name, c) in enumerate(curves.items()):
        if name == REFERENCE or c["eval_step"] != ref["eval_step"]:
            continue
        rel = 100 * (np.asarray(c["eval_loss"]) - np.asarray(ref["eval_loss"])) / np.asarray(ref["eval_loss"])
        ax2.plot(c["eval_step"], rel, color=f"C{i}", marker="o", ms=3, label=name)
    ax2.axhspan(-100 * TARGET, 100 * TARGET, color="green", alpha=0.12, label="target +-0.25%")
    ax2.axhline(0, color="black", lw=0.6)
    ax2.set_ylabel("eval loss vs fp32 (%)")
    ax2.legend(fontsize=8)
    if "mixed_fp16" in curves:
        c = curves["mixed_fp16"]
        steps, scale = np.asarray(c["step"]), np.asarray(c["loss_scale"], np.float64)
        ax3.plot(steps, np.log2(scale), drawstyle="steps-post", color="C2", label="mixed_fp16 loss scale")
        skipped = np.asarray(c["skipped_steps"])
        new = np.flatnonzero(np.diff(np.concatenate([[0], skipped])) > 0)
        ax3.scatter(steps[new], np.log2(scale[new]), color="red", marker="x", zorder=3,
                    label=f"skipped steps logged ({int(skipped[-1]) if skipped.size else 0} in all)")
        ax3.legend(fontsize=8)
    ax3.set_ylabel("log2 loss scale")
    ax3.set_xlabel("step")
    fig.tight_layout()
    return fig


def format_summary(report: Mapping[str, Any]) -> str:
    """The final losses, differences, target verdicts and underflow totals as text."""
    s = report["setup"]
    lines = [f"{s['steps']} steps, batch {s['batch_size']} x {s['seq_len']} tokens, "
             f"{s['num_devices']} device(s); {s['machine']}",
             f"{'run':<20} {'eval loss':>10} {'vs fp32':>9} {'skipped':>8} {'final scale':>12}"]
    for name, loss in report["final_eval_loss"].items():
        r = report["runs"][name]
        diff = "-" if name == REFERENCE else f"{100 * report['rel_diff'][name]:+.3f}%"
        lines.append(f"{name:<20} {loss:>10.5f} {diff:>9} {r['skipped_steps']:>8d} "
                     f"{r['final_loss_scale']:>12g}")
    for name, ok in report["meets_target"].items():
        lines.append(f"{name}: |{100 * report['rel_diff'][name]:.3f}%| "
                     f"{'<=' if ok else '>'} {100 * report['target']:.2f}%: target "
                     f"{'met' if ok else 'MISSED'}")
    if report.get("noise") is not None:
        lines.append(f"run-to-run noise (fp32, another seed): {100 * report['noise']:.3f}%")
    u = report.get("underflow")
    if u:
        lines.append(f"float16 underflow of the true gradients (fp32 run), S = 1 vs "
                     f"S = {u['scaled_loss_scale']:g}:")
        for c in u["checkpoints"]:
            scaled = c.get("total_scaled", {}).get("underflow")
            lines.append(f"  step {c['step']:>6}: {100 * c['total']['underflow']:6.2f}% zero, "
                         f"{100 * c['total']['subnormal']:6.2f}% subnormal"
                         + ("" if scaled is None else f"; scaled: {100 * scaled:.2f}% zero"))
    return "\n".join(lines)


def _int_at_least(low: int):
    """An argparse type: an integer >= ``low``, or a message naming the bad text."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        return value
    return parse


_positive_int, _non_negative_int = _int_at_least(1), _int_at_least(0)


# Size flags: flag -> (config section, key).
_SIZE_FLAGS = {
    "layers": ("model", "num_layers"), "dense_layers": ("model", "first_dense_layers"),
    "d_model": ("model", "d_model"),
    "heads": ("model", "num_heads"), "d_ff": ("model", "d_ff"), "experts": ("model", "num_experts"),
    "top_k": ("model", "top_k"), "d_expert": ("model", "d_expert"), "seq_len": ("data", "seq_len"),
    "batch_size": ("train", "batch_size"), "max_tokens": ("data", "max_tokens"),
    "eval_batches": ("data", "num_eval_batches"), "seed": (None, "seed"),
}

_ZERO_OK = ("dense_layers", "max_tokens", "seed")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; returns the exit status (2 on bad flags or config)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                        help="config file with get_config() (default configs/tiny_moe.py)")
    parser.add_argument("--steps", type=_positive_int, default=DEFAULT_STEPS,
                        help=f"train steps per run (default {DEFAULT_STEPS})")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the report to OUT")
    parser.add_argument("--plot", type=Path, default=None, metavar="OUT.png",
                        help="save the loss curves and loss scale as a PNG")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep the runs under this (empty) directory instead of a temporary one")
    parser.add_argument("--devices", type=_positive_int, default=None,
                        help="data-parallel devices (default: the config's, else all)")
    parser.add_argument("--fp16-loss-scale", default=DEFAULT_FP16_LOSS_SCALE,
                        help=f"loss scale of the mixed_fp16 run (default {DEFAULT_FP16_LOSS_SCALE})")
    parser.add_argument("--noise-seeds", type=_non_negative_int, default=1,
                        help="extra fp32 runs with the next seeds, for run-to-run noise (default 1)")
    parser.add_argument("--log-every", type=_positive_int, default=5, help="steps between logged records")
    parser.add_argument("--evals", type=_positive_int, default=10, help="evaluations per run")
    parser.add_argument("--underflow-checkpoints", type=_positive_int, default=3,
                        help="checkpoints of the fp32 run analysed for float16 underflow")
    parser.add_argument("--quiet", action="store_true", help="send the trainer's output to train.log files")
    size = parser.add_argument_group(
        f"size overrides (default: the config's; --eval-batches {DEFAULT_EVAL_BATCHES})")
    for flag, (section, key) in _SIZE_FLAGS.items():
        size.add_argument(f"--{flag.replace('_', '-')}",
                          type=_non_negative_int if flag in _ZERO_OK else _positive_int,
                          default=DEFAULT_EVAL_BATCHES if flag == "eval_batches" else None,
                          help=f"{section or 'config'}.{key}")
    args = parser.parse_args(argv)

    options = dict(steps=args.steps, num_devices=args.devices, fp16_loss_scale=args.fp16_loss_scale,
                   noise_seeds=args.noise_seeds, log_every=args.log_every, num_evals=args.evals,
                   underflow_checkpoints=args.underflow_checkpoints)
    try:  # every check before the first run starts
        config = load_config(args.config)
        for flag, (section, key) in _SIZE_FLAGS.items():
            value = getattr(args, flag)
            if value is not None:
                (config if section is None else config[section])[key] = value
        config.model.max_len = max(int(config.model.max_len), int(config.data.seq_len))
        names = [s.name for s in plan(config, **options).specs]
        if args.workdir is not None:
            check_workdir(args.workdir, names)
    except ValueError as e:
        parser.error(str(e))
    for out in (args.json, args.plot):
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)

    report = run(config, workdir=args.workdir, quiet=args.quiet, **options)
    report["setup"]["config"] = str(args.config)
    report["setup"]["command"] = " ".join(["python benchmarks/fidelity.py"] + list(
        sys.argv[1:] if argv is None else argv))
    print(format_summary(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot is not None:
        plot(report).savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
