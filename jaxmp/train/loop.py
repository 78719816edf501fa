"""The training loop behind ``python train.py --config configs/NAME.py``.

Reads top to bottom: build the :class:`~jaxmp.train.experiment.Experiment` (the config is
validated there, once), open the workdir, restore the newest checkpoint or initialise,
compile the step, then run it with the periodic hooks (log, stall guard, evaluate,
checkpoint) until ``train.steps``, and finish with a generated sample. Every resource
(checkpoint manager, metrics writer, signal handlers, progress bar) is closed on every
exit, an exception included.

SIGINT (Ctrl-C) and SIGTERM (a preempted job) stop the loop after the current step: a
checkpoint is saved at that step and :class:`Interrupted` is raised, which ``train.py``
turns into a message and exit status 128 + the signal number (130 for SIGINT, 143 for
SIGTERM); rerunning the same command resumes. A signal during compilation exits
without saving (nothing was trained). A second signal exits at once, leaving the
checkpoints that are complete.
"""
from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import sys
import threading
from typing import Any, Dict, Optional

import jax
import ml_collections
import numpy as np
from tqdm import tqdm

from jaxmp.models import generate
from jaxmp.precision.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from jaxmp.train.checkpoint import CheckpointError, Checkpointer
from jaxmp.train.config import config_to_dict
from jaxmp.train.experiment import Experiment, unmatched_rules
from jaxmp.train.hooks import (Evaluate, ReportMetrics, SaveCheckpoint, StallGuard, Stopwatch,
                               TrainingStalled, steps_text)
from jaxmp.train.metrics import MetricsWriter

__all__ = ["train_and_evaluate", "Interrupted", "TrainingStalled", "describe_loss_scale",
           "banner"]

_F32_MAX = float(np.finfo(np.float32).max)


class Interrupted(Exception):
    """Training stopped on SIGINT or SIGTERM.

    Attributes:
      signum: the signal.
      step: the step reached.
      saved: True when a checkpoint at ``step`` was written.
      directory: the checkpoint directory.
    """

    def __init__(self, signum: int, step: int, saved: bool, directory: pathlib.Path):
        self.signum, self.step, self.saved, self.directory = signum, step, saved, directory
        name = signal.Signals(signum).name
        if saved:
            what = f"{name} at step {step}: checkpoint saved in {directory}; rerun the same command to resume"
        else:
            what = (f"{name} before the first step finished: nothing was trained or saved in this run; "
                    f"rerun the same command to {'resume' if step else 'start'}")
        super().__init__(what)


class _SignalCatcher:
    """Turns SIGINT/SIGTERM into a flag the loop polls; a second signal exits at once."""

    def __init__(self):
        self.signum: Optional[int] = None
        self._previous = {}

    def _handle(self, signum, frame):
        if self.signum is not None:  # the second one: leave now, as the user asked twice
            sys.stderr.write(f"\n{signal.Signals(signum).name} again: exiting at once\n")
            sys.stderr.flush()
            os._exit(128 + signum)
        self.signum = signum
        sys.stderr.write(f"\n{signal.Signals(signum).name}: stopping after this step and saving "
                         f"a checkpoint (send it again to exit at once)\n")
        sys.stderr.flush()

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _compile(exp: Experiment, state, catcher: _SignalCatcher):
    """Compiles the train step in a worker thread, so that a signal is seen at once.

    Returns the compiled step, or None when a signal arrived first (the compilation is
    abandoned with the process).
    """
    result: Dict[str, Any] = {}

    def work():
        try:
            result["step"] = exp.train_step.lower(state, exp.abstract_batch()).compile()
        except BaseException as e:  # re-raised in the main thread
            result["error"] = e

    worker = threading.Thread(target=work, name="jaxmp-compile", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.1)
        if catcher.signum is not None:
            return None
    if "error" in result:
        raise result["error"]
    return result["step"]


def describe_loss_scale(loss_scale) -> str:
    """A one-line description of a loss scale for people (float32 max written so)."""
    def num(x):
        v = float(jax.device_get(x))
        return "float32 max" if v == _F32_MAX else f"{v:g}"
    if isinstance(loss_scale, NoOpLossScale):
        return "none"
    if isinstance(loss_scale, StaticLossScale):
        return f"static {num(loss_scale.loss_scale)}"
    if isinstance(loss_scale, DynamicLossScale):
        ls = loss_scale
        return (f"dynamic, now {num(ls.loss_scale)}; x{num(ls.growth_factor)} after "
                f"{int(ls.growth_interval)} finite steps, x{num(ls.backoff_factor)} on overflow "
                f"(hysteresis {int(ls.hysteresis)}); min {num(ls.min_loss_scale)}, max {num(ls.max_loss_scale)}")
    return repr(loss_scale)


def _tree_bytes(tree) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype")))


def banner(exp: Experiment, data) -> str:
    """What the run is: devices, model, precision, communication, memory, data."""
    cfg, m, state = exp.config, exp.model_config, exp.abstract_state
    total, active = exp.param_counts
    n = exp.mesh.devices.size
    # The top-k residual is split over the devices: each holds one row of it.
    state_bytes = _tree_bytes(state.replace(comm_state=None)) + _tree_bytes(state.comm_state) // n
    c = exp.settings.comm
    lines = [
        "jaxmp trainer",
        f"  devices     : {n} x {exp.mesh.devices.flat[0].platform} "
        f"({jax.process_count()} process{'es' if jax.process_count() > 1 else ''}); mesh {dict(exp.mesh.shape)}",
        f"  model       : {m.num_layers} layers, d_model {m.d_model}, {m.num_heads} heads, "
        f"{m.num_experts} routed + {m.num_shared_experts} shared experts, top-{m.top_k}",
        f"  parameters  : {total:,} total, {active:,} active per token",
        f"  policy      : {exp.rules}",
        f"  loss scale  : {describe_loss_scale(exp.settings.loss_scale)}",
        f"  grad comm   : {c['grad_reduce_dtype']} reduce" + (
            f", top-k {c['topk_ratio']:g} with error feedback" if c["grad_compression"] == "topk" else ""),
        f"  memory/dev  : train state {state_bytes / 2**20:.1f} MiB + gradients "
        f"{_tree_bytes(state.params) / 2**20:.1f} MiB (activations not included; see python -m jaxmp.report)",
        f"  data        : {data.num_documents} documents, {data.train_tokens:,} train / "
        f"{data.eval_tokens:,} eval tokens, seq_len {cfg.data.seq_len}, global batch {cfg.train.batch_size}",
    ]
    return "\n".join(lines)


def _precision_warnings(exp: Experiment) -> list:
    """Risky precision settings that are allowed but rarely meant."""
    rules = exp.rules
    policies = [rules.default] + [p for _, p in rules.rules]
    lines = []
    if any(p.needs_loss_scale for p in policies) and isinstance(exp.settings.loss_scale, NoOpLossScale):
        lines.append("float16 compute without a loss scale: gradients below 2**-24 flush to zero and "
                     "large ones overflow (Micikevicius et al. 2018, section 3.2); set "
                     "precision.loss_scale=dynamic")
    return lines + unmatched_rules(exp.settings.rules, exp.module_paths)


def _resume_warnings(saved: Optional[dict], config, start: int) -> list:
    """What changed on resume that the user may not expect."""
    lines = []
    saved_steps = (saved or {}).get("train", {}).get("steps")
    if saved_steps is not None and saved_steps != config.train.steps and not config.optim.decay_steps:
        lines.append(f"train.steps changed from {saved_steps} to {config.train.steps} with "
                     f"optim.decay_steps=0: the learning-rate schedule now decays over "
                     f"{config.train.steps} steps (set optim.decay_steps to choose the horizon)")
    if start >= config.train.steps:
        lines.append(f"the checkpoint is at step {start}, at or past train.steps="
                     f"{config.train.steps}: nothing to train")
    return lines


def _stall_message(exp: Experiment, directory: pathlib.Path):
    def describe(state, run: int) -> str:
        ls = state.loss_scale
        scale = float(jax.device_get(ls.loss_scale))
        step = int(jax.device_get(state.step))
        advice = ["lower optim.learning_rate"]
        if isinstance(ls, DynamicLossScale):
            advice.append("check the loss scale's min (it backs off no further)")
        elif any(p.needs_loss_scale for p in [exp.rules.default] + [p for _, p in exp.rules.rules]):
            advice.append("use precision.loss_scale=dynamic for float16")
        advice.append("or compute in a wider dtype")
        return (f"the last {steps_text(run)} (to step {step}) were all skipped: gradients or "
                f"updates were not finite, so the parameters have not changed since step "
                f"{step - run}; loss scale {scale:g} ({type(ls).__name__}). "
                f"{'; '.join(advice)}. Checkpoints are in {directory}")
    return describe


def _workdir(path) -> pathlib.Path:
    """The run directory, created, after checking that it can be written."""
    workdir = pathlib.Path(path)
    if workdir.exists() and not workdir.is_dir():
        raise ValueError(f"--workdir {workdir} exists and is not a directory")
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        probe = workdir / f".jaxmp-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"--workdir {workdir} is not writable: {e.strerror or e}; choose a "
                         f"writable directory") from None
    return workdir


def _restore_or_init(exp: Experiment, ckpt: Checkpointer, data, config_dict: dict):
    """``(start_step, state)``: the newest checkpoint's, with the data iterator moved to
    it, or step 0 and a freshly initialised state."""
    if ckpt.latest_step() is None:
        return 0, exp.init_state()
    start, state, data_state = ckpt.restore(exp.abstract_state, config_dict)
    try:
        data.set_state(data_state)
    except ValueError as e:
        raise CheckpointError(f"the data-iterator state in {ckpt.directory} does not fit "
                              f"this run's data: {e}") from None
    return start, state


def _announce(exp: Experiment, data, ckpt: Checkpointer, start: int) -> None:
    print(banner(exp, data))
    for line in _precision_warnings(exp):
        print(f"warning: {line}")
    if start:
        print(f"resumed from {ckpt.directory} at step {start}")
        for line in _resume_warnings(ckpt.saved_config, exp.config, start):
            print(f"warning: {line}")


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       num_devices: Optional[int] = None) -> Dict[str, Any]:
    """Trains the MoE Transformer described by ``config``, resuming from ``workdir``.

    Args:
      config: the run config (see :func:`jaxmp.train.config.default_config` for every key).
      workdir: where checkpoints, ``metrics.jsonl``, TensorBoard files and the sample go.
      num_devices: devices of the data-parallel mesh; ``train.num_devices`` or all
        devices when None.

    Returns:
      A summary: ``step``, ``train_losses`` (one per logged step of this call, float),
      ``eval_loss`` (the last, float or None without eval batches), ``skipped_steps``,
      ``sample`` (str).

    Raises:
      ValueError: bad config values or data (see :func:`~jaxmp.train.config.validate_config`),
        or a workdir that cannot be written.
      jaxmp.train.checkpoint.CheckpointError: a checkpoint in ``workdir`` is unreadable
        or was written for another setup, or a save failed.
      TrainingStalled: ``train.max_consecutive_skips`` steps in a row were skipped.
      Interrupted: SIGINT or SIGTERM (after saving a checkpoint when a step had run).
    """
    workdir = _workdir(workdir)
    exp = Experiment.create(config, num_devices=num_devices)
    cfg, t = exp.config, exp.config.train
    main_process = jax.process_index() == 0
    config_dict = config_to_dict(cfg)

    with contextlib.ExitStack() as stack:
        catcher = stack.enter_context(_SignalCatcher())
        data = exp.data  # reads the corpus: a bad data.path fails here, before anything is written
        ckpt = stack.enter_context(Checkpointer(workdir, keep=t.keep_checkpoints))
        start, state = _restore_or_init(exp, ckpt, data, config_dict)
        if main_process:
            _announce(exp, data, ckpt, start)
        writer = MetricsWriter(workdir, start_step=start, enabled=main_process)
        stack.callback(writer.close)
        bar = stack.enter_context(tqdm(total=t.steps, initial=start, desc="train", dynamic_ncols=True,
                                       disable=not main_process))
        stopwatch = Stopwatch()
        report = ReportMetrics(t.log_every, t.steps, writer=writer, stopwatch=stopwatch,
                               tokens_per_step=t.batch_size * cfg.data.seq_len, bar=bar,
                               last_step_reported=start, last_skipped=int(jax.device_get(state.skipped_steps)),
                               timed_from=start + 1)
        evaluate = Evaluate(t.eval_every, t.steps, evaluate=exp.evaluate, writer=writer,
                            stopwatch=stopwatch, bar=bar)
        saver = SaveCheckpoint(t.checkpoint_every, t.steps, stopwatch=stopwatch,
                               save=lambda step, s: ckpt.save(step, s, data.get_state(), config_dict))
        hooks = [report,
                 StallGuard(t.log_every, t.steps, max_skips=t.max_consecutive_skips,
                            describe=_stall_message(exp, ckpt.directory)),
                 evaluate, saver]

        step = start
        step_fn = _compile(exp, state, catcher) if start < t.steps and catcher.signum is None else None
        while step < t.steps and catcher.signum is None:
            batch = exp.batch_to_device(next(data.train_iter))
            state, metrics = step_fn(state, batch)
            step += 1
            bar.update(1)
            if step == start + 1:  # the first step's time (allocation, warm-up) is not counted
                jax.block_until_ready(metrics)
                stopwatch.reset()
            for hook in hooks:
                hook(step, state, metrics)
        if catcher.signum is not None:
            saved = step > start
            if saved and saver.last_saved != step:
                ckpt.save(step, state, data.get_state(), config_dict)
            ckpt.close()
            raise Interrupted(catcher.signum, step, saved, ckpt.directory)
        bar.close()

    eval_loss = evaluate.last_loss
    if eval_loss is None and start >= t.steps:  # nothing left to train: report the restored state
        eval_loss = exp.evaluate(state)
    prompt = data.tokenizer.encode(t.sample_prompt, add_eos=False)
    ids = generate(exp.host_model(state), prompt, max_new_tokens=t.sample_tokens,
                   temperature=t.sample_temperature,
                   rng=jax.random.wrap_key_data(jax.device_get(state.rng)))
    sample = data.tokenizer.decode(ids)
    final_step, skipped = int(jax.device_get(state.step)), int(jax.device_get(state.skipped_steps))
    if main_process:
        (workdir / "sample.txt").write_text(sample)
        loss_text = "no eval batches" if eval_loss is None else f"eval loss {eval_loss:.4f}"
        print(f"done: step {final_step}, {loss_text}, {skipped} of {steps_text(final_step)} skipped")
        print(f"sample after {steps_text(final_step)}:\n{sample}")
    return {"step": final_step, "train_losses": report.losses, "eval_loss": eval_loss,
            "skipped_steps": skipped, "sample": sample}
