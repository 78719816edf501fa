"""Does a precision mode train as well as its reference? A paired, multi-seed protocol.

Usage::

    python benchmarks/fidelity.py --json fidelity.json --plot benchmarks/fidelity.png
    python benchmarks/fidelity.py --modes mixed_bf16,fp8_blockwise --seeds 3 --steps 300

For each seed, every run trains :data:`DEFAULT_CONFIG` (``configs/fidelity.py``) with the
same initial weights, the same batches in the same order and the same number of steps;
only the precision changes (the config policy's *default* is replaced, its per-module
rules such as ``router: fp32; norm: fp32`` are kept). Each mode is compared with its
reference **seed by seed** (a paired comparison):

========================== ============================ ================ ==============
mode                       default policy               loss scale       reference
========================== ============================ ================ ==============
``mixed_bf16``             ``mixed_bf16``               none             ``fp32``
``mixed_fp16``             ``mixed_fp16``               dynamic          ``fp32``
``mixed_fp16_noscale``     ``mixed_fp16``               none (diagnostic) ``fp32``
``fp8_tensorwise``         ``fp8_tensorwise``           none             ``mixed_bf16``
``fp8_delayed``            ``fp8_delayed``              none             ``mixed_bf16``
``fp8_rowwise``            ``fp8_rowwise``              none             ``mixed_bf16``
``fp8_blockwise``          ``fp8_blockwise``            none             ``mixed_bf16``
========================== ============================ ================ ==============

The FP8 recipes are compared with mixed_bf16 as DeepSeek-V3 compares its FP8 training
with BF16 (technical report, arXiv:2412.19437, section 3.3, and its appendix B.1).

For seed ``s`` the relative difference is ``d_s = (L_mode,s - L_ref,s) / L_ref,s`` of the
final eval losses (mean token cross-entropy over the config's fixed eval windows). Over
the ``n`` seeds the report gives the mean, the sample standard deviation (``n - 1``) and
the 95% confidence interval of the mean, ``mean +- t(0.975, n - 1) * std / sqrt(n)``
(Student's t; :func:`t_quantile`). The goal for ``mixed_bf16``, ``mixed_fp16`` and
``fp8_blockwise`` (:data:`GOAL_MODES`) is ``|mean| <= 0.25%`` **and** a CI half-width
``<= 0.25%``: DeepSeek-V3's bar ("the relative loss error of our FP8 training model
remains consistently below 0.25%", section 3.3), with enough seeds to tell. The report
also gives, per mode, the eval set's own sampling error of the paired difference (the
standard error of the per-batch differences, ``eval_se``), and the seed-to-seed spread of
the references' losses.

Every run uses the trainer's own step: the
:class:`~jaxmp.train.experiment.Experiment`'s jitted ``train_step`` and ``eval_step``
(what ``train.py`` runs), in a loop here without checkpoints, so that the per-batch eval
losses of the final state are at hand. XLA's persistent compilation cache (a temporary
directory) lets the seeds of one mode share a compiled program.

Underflow diagnostics (``"underflow"``; 0 ``--underflow-points`` skips them): on the first
seed's float32 run, the true float32 gradient of the training loss (cross-entropy + MoE
auxiliary loss, no loss scale) on the first eval batch at evenly spaced steps, cast to
float16 by :func:`jaxmp.diagnostics.underflow_report` (Micikevicius et al. 2018, section
3.2): the share of non-zero elements flushed to zero per module, at scale 1 and at the
dynamic float16 run's final scale. They explain what the unscaled float16 run loses.
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
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

if __package__ in (None, ""):  # run as `python benchmarks/fidelity.py`: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from benchmarks._common import compilation_cache_settings
from jaxmp import ops
from jaxmp.precision.diagnostics import LeafReport, summarize, underflow_report
from jaxmp.precision.loss_scale import get_loss_scale
from jaxmp.precision.policy import get_policy_rules
from jaxmp.train import Experiment
from jaxmp.train.config import load_config as _load_config, validate_config

__all__ = [
    "ROOT",
    "DEFAULT_CONFIG",
    "DEFAULT_SEEDS",
    "DEFAULT_FP16_LOSS_SCALE",
    "TARGET",
    "GOAL_MODES",
    "Mode",
    "mode_table",
    "runs_for",
    "load_config",
    "with_default_policy",
    "run_config",
    "Plan",
    "plan",
    "t_quantile",
    "paired_stats",
    "compilation_cache",
    "train_run",
    "by_module",
    "gradient_underflow",
    "compare",
    "run",
    "plot",
    "format_summary",
    "main",
]

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "configs" / "fidelity.py"
DEFAULT_SEEDS = 5
# The trainer config's own suggestion for float16 (configs/tiny_moe.py docstring).
DEFAULT_FP16_LOSS_SCALE = "dynamic:init=2**15,growth_interval=200"
TARGET = 0.0025  # DeepSeek-V3 technical report, section 3.3
GOAL_MODES = ("mixed_bf16", "mixed_fp16", "fp8_blockwise")
REFERENCE = "fp32"


@dataclasses.dataclass(frozen=True)
class Mode:
    """One run kind of the protocol.

    Attributes:
      name: the key in the report (``fp32``, ``mixed_bf16``, ``fp8_blockwise``, ...).
      preset: the default policy (a :func:`jaxmp.get_policy` preset) replacing the
        config's default; the config's per-module rules are kept.
      loss_scale: a :func:`jaxmp.get_loss_scale` spec (``none``, ``dynamic:...``).
      reference: the run it is compared with, seed by seed; None for ``fp32``.
    """

    name: str
    preset: str
    loss_scale: str
    reference: Optional[str]


def mode_table(fp16_loss_scale: str = DEFAULT_FP16_LOSS_SCALE) -> Dict[str, Mode]:
    """Every run kind, references first (the module docstring's table).

    Raises:
      ValueError: ``fp16_loss_scale`` is not a ``dynamic`` or ``static`` loss scale.
    """
    kind = str(fp16_loss_scale).split(":", 1)[0].strip().lower()
    if kind not in ("dynamic", "static"):
        raise ValueError(f"fp16_loss_scale must be a 'dynamic[:...]' or 'static:S' loss scale, "
                         f"got {fp16_loss_scale!r}")
    get_loss_scale(fp16_loss_scale)
    table = [Mode("fp32", "fp32", "none", None),
             Mode("mixed_bf16", "mixed_bf16", "none", "fp32"),
             Mode("mixed_fp16", "mixed_fp16", fp16_loss_scale, "fp32"),
             Mode("mixed_fp16_noscale", "mixed_fp16", "none", "fp32")]
    table += [Mode(f"fp8_{r}", f"fp8_{r}", "none", "mixed_bf16")
              for r in ("tensorwise", "delayed", "rowwise", "blockwise")]
    return {m.name: m for m in table}


def runs_for(modes: Sequence[str], table: Mapping[str, Mode]) -> List[str]:
    """The runs that ``modes`` need (each mode and its reference), in table order.

    Raises:
      ValueError: an unknown or duplicated mode, or ``fp32`` (the reference, not a mode).
    """
    compared = [m for m in table if table[m].reference is not None]
    if not modes:
        raise ValueError(f"no modes given; allowed: {', '.join(compared)}")
    for m in modes:
        if m not in compared:
            raise ValueError(f"unknown fidelity mode {m!r}; allowed: {', '.join(compared)}")
    if len(set(modes)) != len(modes):
        raise ValueError(f"a mode is given twice in {list(modes)}")
    needed = set(modes) | {table[m].reference for m in modes}
    return [m for m in table if m in needed]


def load_config(path: str | os.PathLike) -> ml_collections.ConfigDict:
    """Loads ``get_config()`` from a config file (:func:`jaxmp.train.config.load_config`).

    Raises:
      ValueError: the file does not exist, has no ``get_config``, or an unknown key.
    """
    return _load_config(path)


def with_default_policy(policy: str, preset: str) -> str:
    """Replaces the default policy of a rules string, keeping its per-module rules.

    ``with_default_policy("mixed_bf16; router: fp32; norm: fp32", "fp8_blockwise")`` is
    ``"fp8_blockwise; router: fp32; norm: fp32"``. Grammar: :func:`jaxmp.get_policy_rules`.

    Raises:
      ValueError: ``policy`` or the result does not parse (e.g. an unknown preset).
    """
    get_policy_rules(policy)
    rules = [item.strip() for item in policy.split(";") if ":" in item]
    result = "; ".join([preset] + rules)
    get_policy_rules(result)
    return result


def run_config(base: ml_collections.ConfigDict, mode: Mode, seed: int, *, steps: int,
               log_every: int, eval_every: int) -> ml_collections.ConfigDict:
    """``base`` with ``mode``'s precision, ``seed`` and the cadence (a copy).

    No sample, no intermediate checkpoints: the protocol reads losses only.
    """
    config = ml_collections.ConfigDict(base.to_dict())
    config.seed = int(seed)
    config.precision.policy = with_default_policy(base.precision.policy, mode.preset)
    config.precision.loss_scale = mode.loss_scale
    config.train.update(dict(steps=steps, log_every=log_every, eval_every=eval_every,
                             checkpoint_every=steps, sample_tokens=0))
    return config


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The validated runs of one protocol (see :func:`plan`).

    Attributes:
      steps: train steps per run.
      num_devices: data-parallel devices of every run.
      seeds: the seeds, in order.
      modes: the compared modes, in table order.
      runs: the runs trained per seed (the modes and their references), in table order.
      table: every :class:`Mode` by name.
      configs: the trainer config of each ``(run, seed)``.
      eval_steps: the steps after which the eval loss is measured (the last is ``steps``).
      log_every: train steps between recorded train losses.
      underflow_steps: the first seed's fp32 steps analysed for float16 underflow.
      base: the base config.
    """

    steps: int
    num_devices: int
    seeds: Tuple[int, ...]
    modes: Tuple[str, ...]
    runs: Tuple[str, ...]
    table: Mapping[str, Mode]
    configs: Mapping[Tuple[str, int], ml_collections.ConfigDict]
    eval_steps: Tuple[int, ...]
    log_every: int
    underflow_steps: Tuple[int, ...]
    base: ml_collections.ConfigDict


def plan(config: ml_collections.ConfigDict, *, steps: Optional[int] = None,
         seeds: int = DEFAULT_SEEDS, first_seed: Optional[int] = None,
         modes: Optional[Sequence[str]] = None, num_devices: Optional[int] = None,
         fp16_loss_scale: str = DEFAULT_FP16_LOSS_SCALE, log_every: Optional[int] = None,
         num_evals: Optional[int] = None, underflow_points: int = 3) -> Plan:
    """Builds and checks the config of every run; nothing is trained.

    Args:
      config: the base config (e.g. :func:`load_config` of configs/fidelity.py).
      steps: train steps per run (>= 1); default ``config.train.steps``.
      seeds: how many seeds (>= 1; the confidence interval needs >= 2).
      first_seed: the first seed (default ``config.seed``); seeds are consecutive.
      modes: the compared modes (default all, :func:`mode_table`); their references
        are trained too.
      num_devices: data-parallel devices; the config's ``train.num_devices``, else all.
      fp16_loss_scale: the loss scale of ``mixed_fp16``.
      log_every: train steps between recorded train losses (default the config's).
      num_evals: evaluations per run, evenly spaced, the last at ``steps`` (>= 1); default
        ``steps // train.eval_every`` (at least 1; 1 when ``eval_every`` is 0).
      underflow_points: fp32 states analysed for float16 underflow (0 = none; else the
        initial state and ``underflow_points - 1`` evenly spaced later ones, the last at
        ``steps``); only when a float16 mode is run.

    Returns:
      A :class:`Plan`.

    Raises:
      ValueError: bad counts, modes or loss scale, more devices than exist, no eval
        batches, or a config the trainer rejects (:func:`validate_config`).
    """
    steps = _check_int("steps", int(config.train.steps) if steps is None else steps, 1)
    seeds = _check_int("seeds", seeds, 1)
    first = int(config.seed) if first_seed is None else _check_int("first_seed", first_seed, 0)
    log_every = _check_int("log_every", int(config.train.log_every) if log_every is None else log_every, 1)
    every = int(config.train.eval_every)
    num_evals = _check_int("num_evals", (max(1, steps // every) if every else 1) if num_evals is None
                           else num_evals, 1)
    underflow_points = _check_int("underflow_points", underflow_points, 0)
    table = mode_table(fp16_loss_scale)
    modes = tuple(m for m in table if m in (modes or [m for m in table if table[m].reference]))
    runs = tuple(runs_for(list(modes), table))
    devices = num_devices or int(config.train.get("num_devices") or 0) or jax.device_count()
    if devices > jax.device_count():
        raise ValueError(f"num_devices={devices} exceeds the {jax.device_count()} available devices")
    if int(config.data.num_eval_batches) < 1:
        raise ValueError("the protocol needs an eval loss: data.num_eval_batches must be >= 1")
    num_evals = min(num_evals, steps)
    eval_steps = tuple(sorted({max(1, round(steps * (i + 1) / num_evals)) for i in range(num_evals)}))
    underflow = ()
    if underflow_points and REFERENCE in runs and {"mixed_fp16", "mixed_fp16_noscale"} & set(runs):
        underflow = tuple(sorted({round(steps * i / max(1, underflow_points - 1))
                                  for i in range(underflow_points)}))
    configs = {}
    for run_name in runs:
        for seed in range(first, first + seeds):
            cfg = run_config(config, table[run_name], seed, steps=steps, log_every=min(log_every, steps),
                             eval_every=eval_steps[0])
            validate_config(cfg, devices)
            configs[(run_name, seed)] = cfg
    return Plan(steps, devices, tuple(range(first, first + seeds)), modes, runs, table, configs,
                eval_steps, min(log_every, steps), underflow, config)


# ----------------------------------------------------------------------------- statistics


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz; Numerical
    Recipes, 3rd ed., section 6.4)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)),
                   -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function ``I_x(a, b)`` (Numerical Recipes 6.4)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                     + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def _t_cdf(t: float, df: int) -> float:
    """Student's t distribution function: ``1 - I_{df/(df+t^2)}(df/2, 1/2) / 2`` for t >= 0."""
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t distribution with ``df`` degrees of freedom.

    Bisection on the distribution function (computed from the regularized incomplete
    beta function), to about 1e-12. ``t_quantile(0.975, 4)`` is 2.776 (the 95%
    two-sided value for 5 samples).

    Raises:
      ValueError: ``p`` outside (0, 1) or ``df`` not an integer >= 1.
    """
    if not (isinstance(p, numbers.Real) and 0.0 < p < 1.0):
        raise ValueError(f"p={p!r} must be in (0, 1)")
    df = _check_int("df", df, 1)
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while _t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if _t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


def paired_stats(diffs: Sequence[float]) -> Dict[str, Any]:
    """Mean, standard deviation and 95% t confidence interval of paired differences.

    Args:
      diffs: the per-seed relative differences (fractions).

    Returns:
      ``{"n", "mean", "std", "ci95": [low, high], "half_width"}``: ``std`` with ``n - 1``
      in the denominator, ``half_width = t(0.975, n - 1) * std / sqrt(n)``. With one
      value, ``std``, ``ci95`` and ``half_width`` are None.

    Raises:
      ValueError: no values, or a value that is not finite.
    """
    d = np.asarray(list(diffs), np.float64)
    if d.size == 0 or not np.all(np.isfinite(d)):
        raise ValueError(f"paired_stats needs finite values, got {list(diffs)!r}")
    mean = float(d.mean())
    if d.size == 1:
        return {"n": 1, "mean": mean, "std": None, "ci95": None, "half_width": None}
    std = float(d.std(ddof=1))
    half = t_quantile(0.975, d.size - 1) * std / math.sqrt(d.size)
    return {"n": int(d.size), "mean": mean, "std": std, "ci95": [mean - half, mean + half],
            "half_width": half}


# ----------------------------------------------------------------------------- training


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


def _true_grads(exp: Experiment, batch: Mapping[str, jax.Array]) -> Callable:
    """A jitted ``state -> grads`` of cross-entropy + auxiliary loss (no loss scale)."""
    graphdef = exp.graphdef

    def loss(params, biases, rest):
        logits, aux = nnx.merge(graphdef, params, biases, rest)(batch["inputs"])
        return ops.cross_entropy(logits, batch["targets"]) + aux["aux_loss"]

    grad = jax.jit(jax.grad(loss))
    return lambda state: jax.device_get(grad(state.params, state.biases, state.rest))


def gradient_underflow(points: Sequence[Tuple[int, Any]], fp16_rules, *,
                       scaled_loss_scale: Optional[float] = None,
                       dtype: Any = jnp.float16) -> Dict[str, Any]:
    """Float16 underflow of true float32 gradients, by module, at several steps.

    Args:
      points: ``(step, grads)`` pairs, the true gradients of a float32 run.
      fp16_rules: the float16 run's :class:`~jaxmp.PolicyRules` (model rules, islands
        included): which modules compute in float16 there.
      scaled_loss_scale: also report totals at this loss scale; None to skip.
      dtype: the dtype to test.

    Returns:
      ``{"source", "dtype", "loss_scale": 1.0, "scaled_loss_scale", "modules": {module:
      compute dtype name in the float16 run}, "checkpoints": [{"step", "total",
      "total_scaled", "modules": {module: {"nonzero", "underflow", "subnormal",
      "overflow"}}}]}``; fractions of non-zero gradient elements.
    """
    checkpoints, modules = [], {}
    for step, grads in points:
        report = underflow_report(grads, dtype, 1.0)
        per_module = by_module(report)
        modules = {m: fp16_rules.resolve(m).compute_dtype.name for m in per_module}
        entry = {"step": int(step), "total": _leaf_dict(summarize(report)),
                 "modules": {m: _leaf_dict(r) for m, r in per_module.items()}}
        if scaled_loss_scale is not None:
            entry["total_scaled"] = _leaf_dict(summarize(underflow_report(grads, dtype, scaled_loss_scale)))
        checkpoints.append(entry)
    return {"source": "true float32 gradients of the first seed's fp32 run, first eval batch",
            "dtype": jnp.dtype(dtype).name, "loss_scale": 1.0, "scaled_loss_scale": scaled_loss_scale,
            "modules": modules, "checkpoints": checkpoints}


def _eval_batch_losses(exp: Experiment, state, batches) -> List[float]:
    out = []
    for batch in batches:
        r = jax.device_get(exp.eval_step(state, batch))
        out.append(float(r["loss"]) / float(r["tokens"]))
    return out


def train_run(plan_: Plan, run_name: str, seed: int, *, log: Callable[[str], None] = print
              ) -> Dict[str, Any]:
    """Trains run ``run_name`` with ``seed`` and evaluates it at ``plan_.eval_steps``.

    Args:
      plan_: from :func:`plan`.
      run_name: one of ``plan_.runs``.
      seed: one of ``plan_.seeds``.
      log: where the start and end lines go.

    Returns:
      ``{"run", "seed", "policy", "loss_scale", "final_eval_loss" (nats/token),
      "eval_batch_losses" (the final state's mean loss per eval batch), "skipped_steps",
      "final_loss_scale", "wall_s", "curves": {"step", "loss", "loss_scale",
      "skipped_steps", "eval_step", "eval_loss"}}``, plus ``"underflow_grads"``
      (``[(step, grads)]``) for the first seed's fp32 run when the plan asks for them.

    Raises:
      ValueError: a run or seed the plan does not have.
    """
    if (run_name, seed) not in plan_.configs:
        raise ValueError(f"the plan has no run {run_name!r} with seed {seed}; runs: "
                         f"{', '.join(plan_.runs)}; seeds: {list(plan_.seeds)}")
    cfg = plan_.configs[(run_name, seed)]
    log(f"[{run_name} seed {seed}] policy {cfg.precision.policy!r}, loss scale "
        f"{cfg.precision.loss_scale!r}, {plan_.steps} steps")
    start = time.perf_counter()
    exp = Experiment.create(cfg, num_devices=plan_.num_devices)
    state = exp.init_state()
    data = exp.data
    evals = [exp.batch_to_device(b) for b in data.eval_batches]
    grads_at = None
    if run_name == REFERENCE and seed == plan_.seeds[0] and plan_.underflow_steps:
        grads_at = _true_grads(exp, {k: jnp.asarray(v) for k, v in data.eval_batches[0].items()})
    underflow = [(0, grads_at(state))] if grads_at and 0 in plan_.underflow_steps else []
    curves = {"step": [], "loss": [], "loss_scale": [], "skipped_steps": [], "eval_step": [],
              "eval_loss": []}
    batch_losses: List[float] = []
    eval_at = set(plan_.eval_steps)
    for step in range(1, plan_.steps + 1):
        state, metrics = exp.train_step(state, exp.batch_to_device(next(data.train_iter)))
        if step % plan_.log_every == 0 or step == plan_.steps:
            m = jax.device_get(metrics)
            curves["step"].append(step)
            curves["loss"].append(float(m["loss"]))
            curves["loss_scale"].append(float(m["loss_scale"]))
            curves["skipped_steps"].append(int(m["skipped_steps"]))
        if step in eval_at:
            batch_losses = _eval_batch_losses(exp, state, evals)
            curves["eval_step"].append(step)
            curves["eval_loss"].append(float(np.mean(batch_losses)))
        if grads_at and step in plan_.underflow_steps:
            underflow.append((step, grads_at(state)))
    skipped, scale = jax.device_get((state.skipped_steps, state.loss_scale.loss_scale))
    wall = time.perf_counter() - start
    result = {"run": run_name, "seed": int(seed), "policy": cfg.precision.policy,
              "loss_scale": cfg.precision.loss_scale, "final_eval_loss": curves["eval_loss"][-1],
              "eval_batch_losses": batch_losses, "skipped_steps": int(skipped),
              "final_loss_scale": float(scale), "wall_s": wall,
              "curves": curves}
    if grads_at:
        result["underflow_grads"] = underflow
    log(f"[{run_name} seed {seed}] eval loss {result['final_eval_loss']:.5f}, "
        f"{result['skipped_steps']} skipped steps, {wall:.0f} s")
    return result


def compare(plan_: Plan, results: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """Assembles the report from the runs' results (see :func:`run` for its keys).

    Raises:
      ValueError: a run of the plan is missing a seed.
    """
    by = {(r["run"], r["seed"]): r for r in results}
    missing = [k for k in plan_.configs if k not in by]
    if missing:
        raise ValueError(f"results are missing for {missing}")
    seeds = list(plan_.seeds)
    losses = {run: [by[(run, s)]["final_eval_loss"] for s in seeds] for run in plan_.runs}
    modes = {}
    for name in plan_.modes:
        mode = plan_.table[name]
        diffs, se = [], []
        for s in seeds:
            mine, ref = by[(name, s)], by[(mode.reference, s)]
            ref_loss = ref["final_eval_loss"]
            diffs.append((mine["final_eval_loss"] - ref_loss) / ref_loss)
            per_batch = (np.asarray(mine["eval_batch_losses"]) - np.asarray(ref["eval_batch_losses"])) / ref_loss
            se.append(float(per_batch.std(ddof=1) / math.sqrt(per_batch.size)) if per_batch.size > 1 else None)
        stats = paired_stats(diffs)
        goal = None
        if name in GOAL_MODES:
            goal = bool(abs(stats["mean"]) <= TARGET and stats["half_width"] is not None
                        and stats["half_width"] <= TARGET)
        modes[name] = {"reference": mode.reference, "preset": mode.preset, "loss_scale": mode.loss_scale,
                       "rel_diff": diffs, **stats,
                       "eval_se": None if None in se else float(np.mean(se)), "goal": goal,
                       "skipped_steps": [by[(name, s)]["skipped_steps"] for s in seeds],
                       "final_loss_scale": [by[(name, s)]["final_loss_scale"] for s in seeds]}
    spread = {run: (float(np.std(v, ddof=1) / np.mean(v)) if len(v) > 1 else None)
              for run, v in losses.items()}
    underflow = None
    first = by.get((REFERENCE, seeds[0]), {})
    if first.get("underflow_grads"):  # the plan asks for them only with a float16 run
        fp16 = next(plan_.configs[(m, seeds[0])] for m in ("mixed_fp16_noscale", "mixed_fp16")
                    if (m, seeds[0]) in plan_.configs)
        rules = Experiment.create(fp16, num_devices=plan_.num_devices).rules
        scaled = by[("mixed_fp16", seeds[0])]["final_loss_scale"] if ("mixed_fp16", seeds[0]) in by else None
        underflow = gradient_underflow(first["underflow_grads"], rules, scaled_loss_scale=scaled)
    base, device = plan_.base, jax.devices()[0]
    return {
        "target": TARGET, "goal_modes": list(GOAL_MODES), "seeds": seeds, "modes": modes,
        "final_eval_loss": losses, "reference_spread": spread,
        "runs": {run: {"policy": by[(run, seeds[0])]["policy"], "loss_scale": by[(run, seeds[0])]["loss_scale"],
                       "wall_s": [by[(run, s)]["wall_s"] for s in seeds]} for run in plan_.runs},
        "curves": {run: {str(s): by[(run, s)]["curves"] for s in seeds} for run in plan_.runs},
        "underflow": underflow,
        "setup": {"steps": plan_.steps, "num_devices": plan_.num_devices, "seeds": seeds,
                  "batch_size": int(base.train.batch_size), "seq_len": int(base.data.seq_len),
                  "eval_batches": int(base.data.num_eval_batches),
                  "eval_tokens": int(base.data.num_eval_batches) * int(base.train.batch_size)
                  * int(base.data.seq_len),
                  "eval_steps": list(plan_.eval_steps), "model": base.model.to_dict(),
                  "optim": base.optim.to_dict(), "base_policy": base.precision.policy,
                  "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, "
                             f"{device.platform} ({device.device_kind})",
                  "jax": jax.__version__},
    }


@contextlib.contextmanager
def compilation_cache(directory: Optional[str]):
    """XLA's persistent compilation cache in ``directory`` (a temporary one if None), so the
    seeds of one mode, whose programs are identical, compile once; the previous settings
    are restored afterwards.

    JAX opens its cache once, at the first compile after the directory is set, and keeps
    it open: the cache is reset (``compilation_cache.reset_cache``, public in
    ``jax.experimental``) on entering and on leaving, so that the programs compiled inside
    go to ``directory`` and those compiled after it to the previous directory again, not
    to a deleted temporary one (:func:`benchmarks._common.compilation_cache_settings`)."""
    temp = tempfile.mkdtemp(prefix="jaxmp_fidelity_xla_") if directory is None else None
    try:
        with compilation_cache_settings(jax_compilation_cache_dir=directory or temp,
                                        jax_persistent_cache_min_compile_time_secs=0,
                                        jax_persistent_cache_min_entry_size_bytes=0):
            yield
    finally:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)


def run(config: ml_collections.ConfigDict, *, quiet: bool = False, compile_cache: Optional[str] = None,
        log: Callable[[str], None] = print, **plan_kwargs) -> Dict[str, Any]:
    """Trains every run of :func:`plan` for every seed and compares them.

    Args:
      config: the base config.
      quiet: log only one line per run (no start lines).
      compile_cache: a directory for XLA's persistent compilation cache (default: a
        temporary one, deleted afterwards).
      log: where progress lines go.
      **plan_kwargs: as :func:`plan` (``steps``, ``seeds``, ``first_seed``, ``modes``,
        ``num_devices``, ``fp16_loss_scale``, ``log_every``, ``num_evals``,
        ``underflow_points``).

    Returns:
      ``{"target": 0.0025, "goal_modes", "seeds", "modes": {mode: {"reference",
      "preset", "loss_scale", "rel_diff": [per seed], "n", "mean", "std", "ci95": [low,
      high], "half_width", "eval_se", "goal": bool (None outside GOAL_MODES),
      "skipped_steps", "final_loss_scale"}}, "final_eval_loss": {run: [per seed]},
      "reference_spread": {run: std / mean of its final losses over seeds}, "runs",
      "curves": {run: {seed: {...}}}, "underflow", "setup"}``. Losses in nats per token;
      differences as fractions (0.0025 is 0.25%).

    Raises:
      ValueError: anything :func:`plan` rejects, before any run starts.
    """
    plan_ = plan(config, **plan_kwargs)
    results = []
    quiet_log = (lambda line: None) if quiet else log
    with compilation_cache(compile_cache):
        for run_name in plan_.runs:
            for seed in plan_.seeds:
                r = train_run(plan_, run_name, seed, log=quiet_log)
                if quiet:
                    log(f"[{run_name} seed {seed}] eval loss {r['final_eval_loss']:.5f}, "
                        f"{r['skipped_steps']} skipped, {r['wall_s']:.0f} s")
                results.append(r)
        return compare(plan_, results)


# ----------------------------------------------------------------------------- output


def plot(report: Mapping[str, Any]):
    """The protocol's figure: eval losses, paired differences over training, final verdicts.

    Args:
      report: the result of :func:`run` (or its JSON).

    Returns:
      A ``matplotlib.figure.Figure`` with an Agg canvas (no pyplot state is touched),
      three panels: the eval loss of every run (mean over seeds); each mode's paired
      relative difference to its reference at every evaluation (mean over seeds, with
      the 95% t interval shaded); the final differences, one dot per seed, the mean with
      its 95% interval, and the +-0.25% band.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    curves, modes = report["curves"], report["modes"]
    fig = Figure(figsize=(10, 12))
    FigureCanvasAgg(fig)
    ax1, ax2, ax3 = fig.subplots(3, 1, gridspec_kw={"height_ratios": [3, 3, 3]})
    colors = {run: f"C{i}" for i, run in enumerate(curves)}
    finals = []
    for run, per_seed in curves.items():
        steps = next(iter(per_seed.values()))["eval_step"]
        mean = np.mean([c["eval_loss"] for c in per_seed.values()], axis=0)
        finals.append(mean[-1])
        ax1.plot(steps, mean, marker="o", ms=3, color=colors[run], label=run)
    ax1.set_ylim(0.98 * min(finals), 1.25 * max(finals))
    ax1.set_ylabel("eval loss (nats/token)")
    ax1.set_xlabel("step")
    ax1.set_title(f"eval loss, mean over {len(report['seeds'])} seeds")
    ax1.legend(fontsize=8)
    for name, m in modes.items():
        ref = curves[m["reference"]]
        rel = np.array([(np.asarray(curves[name][s]["eval_loss"]) - np.asarray(ref[s]["eval_loss"]))
                        / np.asarray(ref[s]["eval_loss"]) for s in ref]) * 100
        steps = next(iter(ref.values()))["eval_step"]
        mean = rel.mean(axis=0)
        ax2.plot(steps, mean, marker="o", ms=3, color=colors[name], label=f"{name} vs {m['reference']}")
        if rel.shape[0] > 1:
            half = t_quantile(0.975, rel.shape[0] - 1) * rel.std(axis=0, ddof=1) / math.sqrt(rel.shape[0])
            ax2.fill_between(steps, mean - half, mean + half, color=colors[name], alpha=0.12)
    ax2.axhspan(-100 * TARGET, 100 * TARGET, color="green", alpha=0.12, label="+-0.25%")
    ax2.axhline(0, color="black", lw=0.6)
    ax2.set_ylabel("paired eval-loss difference (%)")
    ax2.set_xlabel("step")
    ax2.set_title("each mode vs its reference, seed by seed (shaded: 95% t interval)")
    ax2.legend(fontsize=7, ncol=2)
    names = list(modes)
    for i, name in enumerate(names):
        m = modes[name]
        d = 100 * np.asarray(m["rel_diff"])
        ax3.scatter(np.full(d.size, i) + np.linspace(-0.12, 0.12, d.size), d, s=12,
                    color=colors[name], alpha=0.7)
        if m["ci95"] is not None:
            ax3.errorbar([i + 0.25], [100 * m["mean"]], yerr=[[100 * m["half_width"]]] * 2, fmt="s",
                         color="black", capsize=4, ms=4)
    ax3.axhspan(-100 * TARGET, 100 * TARGET, color="green", alpha=0.12)
    ax3.axhline(0, color="black", lw=0.6)
    ax3.set_xticks(range(len(names)))
    ax3.set_xticklabels([f"{n}\nvs {modes[n]['reference']}" for n in names], fontsize=7)
    ax3.set_ylabel("final eval-loss difference (%)")
    ax3.set_title("final differences: dots = seeds, squares = mean with 95% t interval")
    fig.tight_layout()
    return fig


def _pct(x: Optional[float], sign: bool = True) -> str:
    return "-" if x is None else (f"{100 * x:+.3f}%" if sign else f"{100 * x:.3f}%")


def format_summary(report: Mapping[str, Any]) -> str:
    """The table of paired differences, the goal verdicts and the references' spread."""
    s = report["setup"]
    lines = [f"{s['steps']} steps, batch {s['batch_size']} x {s['seq_len']} tokens, {s['num_devices']} "
             f"device(s), seeds {report['seeds']}, eval {s['eval_tokens']:,} tokens; {s['machine']}",
             f"{'mode':<20} {'vs':<11} {'n':>2} {'mean':>9} {'std':>8} {'95% CI':>21} {'eval se':>8}  goal"]
    for name, m in report["modes"].items():
        ci = "-" if m["ci95"] is None else f"[{_pct(m['ci95'][0])}, {_pct(m['ci95'][1])}]"
        goal = {None: "", True: "met", False: "not met"}[m["goal"]]
        lines.append(f"{name:<20} {m['reference']:<11} {m['n']:>2} {_pct(m['mean']):>9} "
                     f"{_pct(m['std'], False):>8} {ci:>21} {_pct(m['eval_se'], False):>8}  {goal}")
    lines.append(f"goal for {', '.join(report['goal_modes'])}: |mean| <= {100 * report['target']:.2f}% "
                 f"and 95% CI half-width <= {100 * report['target']:.2f}%")
    spread = ", ".join(f"{k} {_pct(v, False)}" for k, v in report["reference_spread"].items() if v is not None)
    if spread:
        lines.append(f"seed-to-seed spread of the final eval loss (std / mean): {spread}")
    u = report.get("underflow")
    if u:
        lines.append(f"float16 underflow of the true gradients (fp32, seed {report['seeds'][0]}), S = 1"
                     + (f" vs S = {u['scaled_loss_scale']:g}:" if u["scaled_loss_scale"] else ":"))
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
    "eval_batches": ("data", "num_eval_batches"),
}
_ZERO_OK = ("dense_layers", "max_tokens")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; returns the exit status (2 on bad flags or config)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                        help="config file with get_config() (default configs/fidelity.py)")
    parser.add_argument("--steps", type=_positive_int, default=None,
                        help="train steps per run (default: the config's train.steps)")
    parser.add_argument("--seeds", type=_positive_int, default=DEFAULT_SEEDS,
                        help=f"paired seeds per mode (default {DEFAULT_SEEDS})")
    parser.add_argument("--first-seed", type=_non_negative_int, default=None,
                        help="the first seed (default: the config's seed)")
    parser.add_argument("--modes", default=None,
                        help="comma-separated modes (default all: "
                             + ",".join(m for m, v in mode_table().items() if v.reference) + ")")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the report to OUT")
    parser.add_argument("--plot", type=Path, default=None, metavar="OUT.png", help="save the figure as a PNG")
    parser.add_argument("--devices", type=_positive_int, default=None,
                        help="data-parallel devices (default: the config's, else all)")
    parser.add_argument("--fp16-loss-scale", default=DEFAULT_FP16_LOSS_SCALE,
                        help=f"loss scale of mixed_fp16 (default {DEFAULT_FP16_LOSS_SCALE})")
    parser.add_argument("--log-every", type=_positive_int, default=None,
                        help="steps between recorded train losses (default: the config's)")
    parser.add_argument("--evals", type=_positive_int, default=None,
                        help="evaluations per run (default: steps / the config's train.eval_every)")
    parser.add_argument("--underflow-points", type=_non_negative_int, default=3,
                        help="fp32 states analysed for float16 underflow (0 = none; default 3)")
    parser.add_argument("--quiet", action="store_true", help="one line per run")
    size = parser.add_argument_group("size overrides (default: the config's)")
    for flag, (section, key) in _SIZE_FLAGS.items():
        size.add_argument(f"--{flag.replace('_', '-')}",
                          type=_non_negative_int if flag in _ZERO_OK else _positive_int,
                          default=None, help=f"{section}.{key}")
    args = parser.parse_args(argv)

    try:  # every check before the first run starts
        config = load_config(args.config)
        for flag, (section, key) in _SIZE_FLAGS.items():
            value = getattr(args, flag)
            if value is not None:
                config[section][key] = value
        config.model.max_len = max(int(config.model.max_len), int(config.data.seq_len))
        modes = None
        if args.modes is not None:
            modes = [m.strip() for m in args.modes.split(",") if m.strip()]
            runs_for(modes, mode_table(args.fp16_loss_scale))
        options = dict(steps=args.steps, seeds=args.seeds, first_seed=args.first_seed, modes=modes,
                       num_devices=args.devices, fp16_loss_scale=args.fp16_loss_scale,
                       log_every=args.log_every, num_evals=args.evals,
                       underflow_points=args.underflow_points)
        plan(config, **options)
    except ValueError as e:
        parser.error(str(e))
    for out in (args.json, args.plot):
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)

    start = time.perf_counter()
    report = run(config, quiet=args.quiet, **options)
    report["setup"]["wall_s"] = time.perf_counter() - start
    report["setup"]["config"] = str(args.config)
    report["setup"]["command"] = " ".join(["python benchmarks/fidelity.py"] + list(
        sys.argv[1:] if argv is None else argv))
    print(format_summary(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.plot is not None:
        plot(report).savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
