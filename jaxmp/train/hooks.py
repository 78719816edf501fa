"""The training loop's periodic actions: log, stall and divergence guards, evaluate, checkpoint.

Each hook is a periodic action in the style of ``clu.periodic_actions`` (clu itself is
not a dependency: its metric writers import TensorFlow): it is called after every train
step with ``(step, state, metrics)`` and acts every ``every_steps`` steps and at the last
step. Hooks run in the order given, so the loop reads: log, guard, evaluate, save.

:class:`Stopwatch` times the training between log points: evaluation and checkpoint
writes pause it, so tokens/s measures train steps only.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, Dict, List, Optional

import jax
import numpy as np

from jaxmp.precision.loss_scale import DynamicLossScale
from jaxmp.train.metrics import MetricsWriter, expert_load_stats
from jaxmp.train.step import LOSS_SPIKE_FLOOR

__all__ = ["TrainingStalled", "TrainingDiverged", "Stopwatch", "PeriodicAction", "ReportMetrics",
           "RunGuard", "StallGuard", "DivergenceGuard", "Evaluate", "SaveCheckpoint",
           "steps_text", "eval_text", "last_checkpoint_text"]


class TrainingStalled(RuntimeError):
    """Every step for ``train.max_consecutive_skips`` steps in a row was skipped."""


class TrainingDiverged(TrainingStalled):
    """``train.max_divergent_steps`` applied steps in a row looked divergent."""


def steps_text(n: int) -> str:
    """``"1 step"``, ``"2 steps"``."""
    return f"{n} step" if n == 1 else f"{n} steps"


class Stopwatch:
    """Wall time spent training, with pauses for work that is not training.

    ``lap()`` returns the seconds since the last lap (or reset), pauses excluded.
    """

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Starts timing afresh from now."""
        self._start, self._paused = time.perf_counter(), 0.0

    def lap(self) -> float:
        """Seconds since the last lap, without paused time; starts the next lap."""
        now = time.perf_counter()
        seconds = now - self._start - self._paused
        self._start, self._paused = now, 0.0
        return seconds

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside does not count as training."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._paused += time.perf_counter() - start


def _say(bar, text: str) -> None:
    """A line above the progress bar; nothing on a process whose bar is disabled (only
    process 0 reports; ``tqdm.write`` itself prints on every process)."""
    if not getattr(bar, "disable", False):
        bar.write(text)


@dataclasses.dataclass
class PeriodicAction:
    """Acts at steps ``every_steps``, ``2 * every_steps``, ... and at ``last_step``.

    Attributes:
      every_steps: the period; 0 = only at ``last_step``.
      last_step: the run's final step (``train.steps``).
    """

    every_steps: int
    last_step: int

    def should_trigger(self, step: int) -> bool:
        """True at a multiple of ``every_steps`` and at the last step."""
        return step == self.last_step or (self.every_steps > 0 and step % self.every_steps == 0)

    def __call__(self, step: int, state: Any, metrics: Dict[str, Any]) -> None:
        if self.should_trigger(step):
            self.apply(step, state, metrics)

    def apply(self, step: int, state: Any, metrics: Dict[str, Any]) -> None:
        raise NotImplementedError


@dataclasses.dataclass
class ReportMetrics(PeriodicAction):
    """Writes the train metrics of the step (``metrics.jsonl``, TensorBoard, progress bar).

    The record holds the step's scalar metrics, ``tokens_per_s`` over the steps since the
    last report (None when only the compiling first step ran) and the expert-load
    summary; a line is printed when steps were skipped since the last report. Where the
    batches carry a ``loss_mask`` (the metrics' ``trained_tokens``), also
    ``trained_tokens_per_s``: the trained tokens of every step since the last report
    (summed on the device as they come, read at the report) over the same seconds.
    """

    writer: MetricsWriter = None
    stopwatch: Stopwatch = None
    tokens_per_step: int = 0
    bar: Any = None
    losses: List[float] = dataclasses.field(default_factory=list)
    last_step_reported: int = 0
    last_skipped: int = 0
    timed_from: int = 0
    trained: Any = None  # trained tokens of the timed steps since the last report

    def __call__(self, step, state, metrics):
        if "trained_tokens" in metrics and step > self.timed_from:  # a step that is timed
            t = metrics["trained_tokens"]
            self.trained = t if self.trained is None else self.trained + t
        super().__call__(step, state, metrics)

    def apply(self, step, state, metrics):
        m = jax.device_get(metrics)
        seconds = self.stopwatch.lap()
        timed = step - self.timed_from
        tps = self.tokens_per_step * timed / seconds if timed > 0 and seconds > 0 else None
        if "trained_tokens" in m:
            m["trained_tokens_per_s"] = (float(jax.device_get(self.trained)) / seconds
                                         if self.trained is not None and seconds > 0
                                         and timed > 0 else float("nan"))
        self.trained = None
        self.timed_from = step
        flags, counts = ("grads_finite", "applied", "divergent"), (
            "skipped_steps", "consecutive_skips", "divergent_steps")
        record = {k: float(v) for k, v in m.items() if np.ndim(v) == 0 and k not in flags + counts}
        record.update({k: bool(m[k]) for k in flags}, **{k: int(m[k]) for k in counts},
                      tokens_per_s=tps, **expert_load_stats(m["expert_counts"]))
        if record["divergent_steps"]:
            _say(self.bar, f"step {step}: the last {steps_text(record['divergent_steps'])} applied "
                           f"looked divergent (loss {record['loss']:.4g} vs a running mean of "
                           f"{record['loss_ema']:.4g}, gradient norm {record['grad_norm']:.4g})")
        newly = record["skipped_steps"] - self.last_skipped
        if newly:
            _say(self.bar, f"step {step}: {newly} of the last "
                           f"{steps_text(step - self.last_step_reported)} skipped (non-finite "
                           "gradients or update); loss scale now "
                           f"{float(jax.device_get(state.loss_scale.loss_scale)):g}")
        self.last_skipped, self.last_step_reported = record["skipped_steps"], step
        self.writer.write(step, "train", record)
        self.losses.append(record["loss"])
        self.bar.set_postfix(loss=f"{record['loss']:.3f}", scale=f"{record['loss_scale']:g}",
                             tok_s="-" if tps is None else f"{tps:,.0f}",
                             skipped=record["skipped_steps"])


@dataclasses.dataclass
class RunGuard(PeriodicAction):
    """Stops the run once a count of bad steps in a row reaches ``limit``.

    The count is ``metrics[metric]``, kept exactly in the train state
    (``consecutive_skips``: steps not applied; ``divergent_steps``: applied steps that
    looked divergent), so it is right at any interval; the stop comes at the first check
    at or after the ``limit``-th bad step and raises ``error(self.message(state, count))``
    (``describe(state, count)`` when given).
    """

    metric: str = "consecutive_skips"
    limit: int = 100
    error: type = TrainingStalled
    describe: Optional[Callable[[Any, int], str]] = None

    def apply(self, step, state, metrics):
        run = int(jax.device_get(metrics[self.metric]))
        if run >= self.limit:
            raise self.error(self.describe(state, run) if self.describe else
                             self.message(state, run, step))

    def message(self, state, run: int, step: int) -> str:
        """The error's text after ``run`` bad steps in a row, at ``step``."""
        return f"{self.metric} reached {run} at step {step}"


def last_checkpoint_text(ckpt) -> str:
    """Where a rerun resumes and where the last healthy state is (they differ when a
    checkpoint was saved unhealthy, by a signal during a stall or a divergence).

    ``ckpt`` is a :class:`~jaxmp.train.checkpoint.Checkpointer` (``directory``,
    ``healthy_step()``, ``unhealthy_steps()``, ``best_step()``, ``eval_loss(step)``). The
    checkpoint of the lowest eval loss is named too (a slow divergence looks healthy at
    every step, so the last healthy checkpoint may be far worse than the best).
    """
    directory, healthy, unhealthy = ckpt.directory, ckpt.healthy_step(), ckpt.unhealthy_steps()
    best = ckpt.best_step()
    best_text = ("" if best is None else
                 f". The best checkpoint by eval loss is step {best} "
                 f"({ckpt.eval_loss(best):.4f} nats/token), kept in {directory}")
    if healthy is None:
        return f"No healthy checkpoint was written (checkpoints: {directory}){best_text}"
    text = f"The last healthy checkpoint, step {healthy} in {directory}, is from before it"
    if not unhealthy:
        return text + ": a rerun resumes from there" + best_text
    many = len(unhealthy) > 1
    return (text + f"; the newer checkpoint{'s' if many else ''} {', '.join(map(str, unhealthy))} "
            f"{'were' if many else 'was'} saved while the run was unhealthy, and a "
            f"rerun resumes from step {unhealthy[-1]}: move {'them' if many else 'it'} "
            f"out of {directory} to resume from step {healthy}{best_text}")


@dataclasses.dataclass
class StallGuard(RunGuard):
    """Raises :class:`TrainingStalled` after ``limit`` skipped steps in a row
    (``train.max_consecutive_skips``), with advice for the run's precision ``rules``
    (a :class:`~jaxmp.precision.policy.PolicyRules`) and where ``ckpt`` resumes."""

    metric: str = "consecutive_skips"
    error: type = TrainingStalled
    rules: Any = None
    ckpt: Any = None

    def message(self, state, run, step):
        ls = state.loss_scale
        scale, step = float(jax.device_get(ls.loss_scale)), int(jax.device_get(state.step))
        advice = ["lower optim.learning_rate"]
        policies = [self.rules.default] + [p for _, p in self.rules.rules]
        if isinstance(ls, DynamicLossScale):
            advice.append("check the loss scale's min (it backs off no further)")
        elif any(p.needs_loss_scale for p in policies):
            advice.append("use precision.loss_scale=dynamic for float16")
        advice.append("or compute in a wider dtype")
        return (f"the last {steps_text(run)} (to step {step}) were all skipped: gradients or "
                f"updates were not finite, so the parameters have not changed since step "
                f"{step - run}; loss scale {scale:g} ({type(ls).__name__}). "
                f"{'; '.join(advice)}. {last_checkpoint_text(self.ckpt)}")


@dataclasses.dataclass
class DivergenceGuard(RunGuard):
    """Raises :class:`TrainingDiverged` after ``limit`` divergent applied steps in a row
    (``train.max_divergent_steps``); the spike factors are ``train.loss_spike_factor`` and
    ``train.grad_norm_spike_factor``, as the train step tests them."""

    metric: str = "divergent_steps"
    error: type = TrainingDiverged
    loss_spike_factor: float = 0.0
    grad_norm_spike_factor: float = 0.0
    ckpt: Any = None

    def message(self, state, run, step):
        step = int(jax.device_get(state.step))
        return (f"the last {steps_text(run)} applied (to step {step}) looked divergent: a loss "
                f"above {self.loss_spike_factor:g}x its running mean and {LOSS_SPIKE_FLOOR:g} nats "
                f"({float(jax.device_get(state.loss_ema)):.4g}), a gradient norm above "
                f"{self.grad_norm_spike_factor:g}x its running mean, a non-finite loss, or a zero "
                f"gradient norm. Lower optim.learning_rate or raise optim.warmup_steps. "
                f"{last_checkpoint_text(self.ckpt)}")


@dataclasses.dataclass
class Evaluate(PeriodicAction):
    """Evaluates the state on the eval batches and writes the eval metrics.

    ``evaluate(state) -> dict, float or None``: a dict such as
    :meth:`~jaxmp.train.experiment.Experiment.evaluate_metrics` gives (``loss`` in
    nats/token, ``perplexity``, ``bits_per_byte``) is written as it is, a float as
    ``{"loss": value}``; None (no eval batches) writes nothing. :attr:`last_loss` is the
    last loss, :attr:`last_metrics` the last dict, :attr:`evaluated_at` their step.
    """

    evaluate: Callable[[Any], Optional[float]] = None
    writer: MetricsWriter = None
    stopwatch: Stopwatch = None
    bar: Any = None
    last_loss: Optional[float] = None
    last_metrics: Optional[dict] = None
    evaluated_at: Optional[int] = None

    def apply(self, step, state, metrics):
        with self.stopwatch.paused():
            out = self.evaluate(state)
        if out is None:
            return
        out = dict(out) if isinstance(out, dict) else {"loss": float(out)}
        self.last_loss, self.last_metrics, self.evaluated_at = out["loss"], out, step
        self.writer.write(step, "eval", {**out, "loss_unit": "nats/token"})
        _say(self.bar, f"step {step}: {eval_text(out)}")


def eval_text(metrics: dict) -> str:
    """``eval loss 2.3456 nats/token, perplexity 10.45, 1.234 bits/byte``."""
    text = f"eval loss {metrics['loss']:.4f} nats/token, perplexity {metrics['perplexity']:.4g}" \
        if "perplexity" in metrics else f"eval loss {metrics['loss']:.4f} nats/token"
    if "bits_per_byte" in metrics:
        text += f", {metrics['bits_per_byte']:.4f} bits/byte"
    return text


@dataclasses.dataclass
class SaveCheckpoint(PeriodicAction):
    """Saves the state (asynchronously) every ``every_steps`` and at the last step.

    ``save(step, state, eval_loss)`` starts the write (``eval_loss``: that of
    ``evaluate``, the :class:`Evaluate` hook, when it evaluated this step; else None); the
    :class:`~jaxmp.train.checkpoint.Checkpointer` waits for it before the next one and on
    close. A save that falls due while the latest step was skipped or looked divergent
    (``consecutive_skips`` or ``divergent_steps`` > 0) is put off to the next healthy step,
    so a stall or a divergence never crowds out the last healthy checkpoints; a line says
    so once per unhealthy stretch. The last step's state is saved however it is (marked
    unhealthy, so the rotation keeps the last healthy one besides it): a run never ends
    with its final steps unsaved.
    """

    save: Callable[..., None] = None
    stopwatch: Stopwatch = None
    bar: Any = None
    last_saved: Optional[int] = None
    pending: bool = False
    evaluate: Any = None

    def __call__(self, step, state, metrics):
        if not (self.should_trigger(step) or self.pending):
            return
        m = jax.device_get({k: metrics[k] for k in ("consecutive_skips", "divergent_steps")})
        if (int(m["consecutive_skips"]) or int(m["divergent_steps"])) and step != self.last_step:
            if not self.pending and self.bar is not None:
                last = f"step {self.last_saved}" if self.last_saved else "none yet"
                _say(self.bar, f"step {step}: checkpoint put off: the latest steps were skipped or "
                               f"looked divergent; the last checkpoint is {last}")
            self.pending = True
            return
        self.pending = False
        self.apply(step, state, metrics)

    def apply(self, step, state, metrics):
        ev = self.evaluate
        loss = ev.last_loss if ev is not None and ev.evaluated_at == step else None
        with self.stopwatch.paused():
            self.save(step, state, loss)
        self.last_saved = step
