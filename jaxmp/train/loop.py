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
SIGTERM); rerunning the same command resumes. A signal during start-up (reading the
data, compiling, restoring) stops at once without saving (nothing was trained), with
one message. A second signal stops at once, leaving the checkpoints that are complete:
``KeyboardInterrupt`` in a library call (a notebook's kernel survives), an exit with
128 + the signal number where ``train.py`` asks for it (``exit_on_second_signal``).
In a multi-process run, SIGTERM is JAX's preemption notice (SIGINT is passed on to it):
every process stops, and saves, at the step JAX's preemption sync point names, and
exits 143 (130 where SIGINT came); a second SIGTERM then changes nothing.

The step compiles in a background thread while the data is read. Every way out of
:func:`train_and_evaluate` but a signal waits for that thread (a process that exits
while XLA compiles in another thread can abort: ``terminate called ...``, exit 134);
after a signal it is left to finish on its own, and :func:`compile_in_progress` tells
``train.py`` to leave without running the interpreter's shutdown (``os._exit``).
"""
from __future__ import annotations

import contextlib
import os
import pathlib
from typing import Any, Dict, Optional

import jax
import ml_collections
from tqdm import tqdm

from jaxmp.models import generate
from jaxmp.train.checkpoint import (CheckpointError, Checkpointer, check_same_settings,
                                    reshard_residual)
from jaxmp.train.config import config_to_dict, validate_config
from jaxmp.train.resume import SAVED_STACKS
from jaxmp.train.data import check_data_path
from jaxmp.train.distributed import preemption_sync
from jaxmp.train.experiment import BASE_DIGEST, Experiment
from jaxmp.train.hooks import (DivergenceGuard, Evaluate, ReportMetrics, SaveCheckpoint,
                               StallGuard, Stopwatch, TrainingDiverged, TrainingStalled, eval_text,
                               steps_text)
from jaxmp.train.metrics import MetricsWriter
from jaxmp.train.preflight import (banner, check_memory, check_parameter_memory,
                                   check_sample_memory, describe_loss_scale, precision_warnings)
from jaxmp.train.signals import (Compilation, Interrupted, SignalCatcher, StartupSignal,
                                 compile_in_progress)
from jaxmp.train.chat import keep_chat_template, prompt_ids as chat_prompt_ids
from jaxmp.train.tokenizer import keep_tokenizer
from jaxmp.train.workdir import WorkdirInUse, WorkdirLock, prepare_workdir

# Interrupted, WorkdirInUse and the training errors are what train_and_evaluate raises;
# compile_in_progress is what train.py asks after it.
__all__ = ["train_and_evaluate", "Interrupted", "TrainingStalled", "TrainingDiverged",
           "WorkdirInUse", "compile_in_progress"]

def _resume_warnings(saved: Optional[dict], config, start: int) -> list:
    """What changed on resume that the user may not expect."""
    lines = []
    saved_steps = (saved or {}).get("train", {}).get("steps")
    if (saved_steps is not None and saved_steps != config.train.steps
        and not config.optim.decay_steps):
        lines.append(f"train.steps changed from {saved_steps} to {config.train.steps} with "
                     f"optim.decay_steps=0: the learning-rate schedule now decays over "
                     f"{config.train.steps} steps (set optim.decay_steps to choose the horizon)")
    if start >= config.train.steps:
        lines.append(f"the checkpoint is at step {start}, at or past train.steps="
                     f"{config.train.steps}: nothing to train")
    return lines


def _healthy(state) -> bool:
    """The state's latest step was applied and did not look divergent."""
    skips, divergent = jax.device_get((state.consecutive_skips, state.divergent_steps))
    return int(skips) == 0 and int(divergent) == 0


def _restore_or_init(exp: Experiment, ckpt: Checkpointer, data, config_dict: dict):
    """``(start_step, state, notes)``: the newest good checkpoint's, with the data iterator
    moved to it, or step 0 and a freshly initialised state."""
    if ckpt.latest_step() is None:
        return 0, exp.init_state(), []
    start, state, data_state = ckpt.restore(exp.checkpoint_template, config_dict,
                                            adapt=exp.checkpoint_adapter(),
                                            check_data=data.check_state)
    state = exp.restored_state(state, ckpt.saved_meta)
    state, note = reshard_residual(state, ckpt.saved_meta.get("num_devices"), exp.num_devices,
                                   exp.state_shardings.comm_state)
    notes = [note] if note else []
    saved = (ckpt.saved_meta.get("strategy", "dp"), ckpt.saved_meta.get("expert", 1),
             ckpt.saved_meta.get("num_devices"))
    now = (exp.layout.strategy, exp.layout.expert, exp.num_devices)
    if saved[2] is not None and saved != now:
        notes.append(f"the checkpoint was saved with parallel.strategy={saved[0]}, "
                     f"parallel.expert={saved[1]} on {saved[2]} devices and is resharded onto "
                     f"parallel.strategy={now[0]}, parallel.expert={now[1]} on {now[2]} devices "
                     "(the same global arrays)")
    data.set_state(data_state)  # checked by restore (check_data)
    if ckpt.saved_meta.get("healthy") is False:
        healthy = ckpt.healthy_step()
        notes.append(f"checkpoint step {start} was saved while the run was unhealthy (its latest "
                     f"step skipped or divergent); the last healthy checkpoint is "
                     f"{'step ' + str(healthy) if healthy else 'none'}")
    return start, state, notes


def _announce(exp: Experiment, data, ckpt: Checkpointer, start: int, notes, lock) -> None:
    print(banner(exp, data))
    for line in precision_warnings(exp):
        print(f"warning: {line}")
    for line in data.warnings:
        print(f"warning: {line}")
    for line in data.notes + tuple(notes):
        print(f"note: {line}")
    if lock is not None and lock.taken_over:
        held = lock.taken_over
        print(f"note: took over the workdir lock of process {held.get('pid')} on "
              f"{held.get('host')}, which is no longer running")
    for line in ckpt.warnings:
        print(f"WARNING: {line}")
    if start:
        print(f"resumed from {ckpt.directory} at step {start}")
        for line in _resume_warnings(ckpt.saved_config, exp.config, start):
            print(f"warning: {line}")


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       num_devices: Optional[int] = None, *,
                       exit_on_second_signal: bool = False) -> Dict[str, Any]:
    """Trains the MoE Transformer described by ``config``, resuming from ``workdir``.

    Args:
      config: the run config (see :func:`jaxmp.train.config.default_config` for every key).
      workdir: where checkpoints, ``metrics.jsonl``, TensorBoard files and the sample go.
      num_devices: devices of the mesh (split into ``data`` x ``expert`` as
        ``parallel.expert`` says; the batch is split over all of them);
        ``train.num_devices`` or all devices when None.
      exit_on_second_signal: what a second SIGINT or SIGTERM does while the call runs
        (the first stops the loop after its step and saves a checkpoint): False, raise
        ``KeyboardInterrupt`` (a library call: the caller's process, e.g. a notebook's
        kernel, goes on); True, exit the process at once with ``128 + signum`` (train.py,
        the command-line entry point). The handlers are the caller's again when the call
        returns or raises.

    Returns:
      A summary: ``step``, ``train_losses`` (one per logged step of this call, float),
      ``eval_loss`` (the last, nats/token, float or None without eval batches), ``eval``
      (the last eval metrics: loss, perplexity, bits_per_byte where known; or None),
      ``skipped_steps``,
      ``sample`` (str).

    Raises:
      ValueError: bad config values or data (see :func:`~jaxmp.train.config.validate_config`),
        a ``model.init_from`` that is not a checkpoint directory or whose tensors do not
        match its config.json (:func:`jaxmp.models.hf.check_weights`, before the corpus
        is read),
        a workdir that cannot be written, or a step too large for the device memory
        (:func:`check_memory`).
      WorkdirInUse: another trainer holds ``workdir``.
      jaxmp.train.checkpoint.CheckpointError: a checkpoint in ``workdir`` is unreadable
        or was written for another setup, or a save failed.
      TrainingStalled: ``train.max_consecutive_skips`` steps in a row were skipped, or
        no step of the run ever applied (the final state is saved first).
      TrainingDiverged: ``train.max_divergent_steps`` applied steps in a row looked
        divergent (a subclass of TrainingStalled).
      Interrupted: SIGINT or SIGTERM (after saving a checkpoint when a step had run).
    """
    if config.model.get("init_from"):  # a config.json file plans a run, it does not start one
        from jaxmp.models import hf

        hf.check_directory(config.model.init_from)  # before any other check
    check_parameter_memory(validate_config(config, num_devices))  # before the model is built
    exp = Experiment.create(config, num_devices=num_devices)  # validates: nothing is written
    check_data_path(exp.config.data.path)  # before the step compiles
    exp.check_tokenizer()  # before the workdir is made and the corpus read
    if not _has_checkpoints(workdir):  # a resume takes no weight from model.init_from
        exp.check_init_from()  # the base's tensors, from their headers: before the corpus
    check_sample_memory(exp)
    try:  # what the workdir held (None: nothing, it did not exist)
        before = set(os.listdir(workdir)) if pathlib.Path(workdir).is_dir() else None
    except OSError:  # unreadable: prepare_workdir says so; nothing of it is ever removed
        before = False
    workdir = prepare_workdir(workdir)
    try:
        return _run(exp, workdir, exit_on_second_signal)
    except WorkdirInUse:  # what is there is the other trainer's, however new
        raise
    except BaseException:
        if before is not False:
            _remove_untrained(workdir, before)
        raise


def _has_checkpoints(workdir) -> bool:
    """Whether ``workdir`` has a non-empty ``checkpoints`` directory (a run to resume;
    restore then decides which checkpoint is good)."""
    try:
        return any((pathlib.Path(workdir) / "checkpoints").iterdir())
    except OSError:  # none (or unreadable: prepare_workdir and restore say so)
        return False


def _remove_untrained(workdir: pathlib.Path, before: Optional[set] = None) -> None:
    """Removes what a failed start added to ``workdir`` when the run failed before it
    logged a step or saved a checkpoint (a lock file, an empty checkpoints directory, a
    tokenizer, TensorBoard's empty event files): the whole workdir when this run created
    it (``before`` None), else the entries not among the names ``before`` held. A failed
    start so leaves nothing behind; what a run that trained logged is kept. In a
    multi-process run process 0 (the lock's holder) removes it; another process only a
    workdir it created that is empty (it may have made it again after process 0 left)."""
    if jax.process_index() != 0:
        if before is None:
            try:
                os.rmdir(workdir)  # fails unless empty: nothing of process 0's is touched
            except OSError:
                pass
        return
    ckpts, metrics = workdir / "checkpoints", workdir / "metrics.jsonl"
    if (ckpts.is_dir() and any(ckpts.iterdir())) or (metrics.exists()
                                                     and metrics.stat().st_size):
        return
    import shutil
    if before is None:
        shutil.rmtree(workdir, ignore_errors=True)
        return
    for name in set(os.listdir(workdir)) - before:
        path = workdir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _run(exp: Experiment, workdir: pathlib.Path,
         exit_on_second_signal: bool = False) -> Dict[str, Any]:
    """:func:`train_and_evaluate` once the config, the data path and the workdir are
    checked."""
    exp.workdir = workdir  # where a bpe:VOCAB tokenizer is kept
    t, main_process = exp.config.train, jax.process_index() == 0
    exp.progress = main_process  # say what reading the data does, on process 0
    config_dict = config_to_dict(exp.config)

    with contextlib.ExitStack() as stack:
        catcher = stack.enter_context(SignalCatcher(sync=preemption_sync(),
                                                     exit_on_second=exit_on_second_signal))
        lock = stack.enter_context(WorkdirLock(workdir)) if main_process else None
        _check_resume_settings(workdir, config_dict)  # before the corpus is read
        compilation = Compilation(exp)  # in the background, while the data is read
        stack.callback(compilation.finish, catcher)  # every way out waits for it (but a signal)
        catcher.reading = True  # a signal stops the read at once (StartupSignal)
        try:
            try:
                if catcher.signum is not None:  # one came before: the read does not begin
                    raise StartupSignal(catcher.signum)
                data = exp.data  # reads the corpus: a bad data.path fails here, before anything is written
            finally:
                catcher.reading = False
        except StartupSignal:  # (also one that came as the read ended)
            raise Interrupted(catcher.signum, 0, False, (workdir / "checkpoints").absolute(),
                              startup=True) from None
        stack.callback(data.train_iter.close)  # grain's prefetch threads
        if main_process and compilation.worker.is_alive():  # what the wait is (minutes for a
            print("compiling the train step ...", flush=True)  # large model or FP8 kernels)
        step_fn = compilation.join(catcher)
        if step_fn is None:  # a signal during start-up: nothing to save
            raise Interrupted(catcher.signum, 0, False, (workdir / "checkpoints").absolute(),
                              startup=True)
        if tuple(data.batch_keys) != tuple(exp.abstract_batch()):  # format=auto found examples
            step_fn = exp.train_step.lower(exp.abstract_state, exp.abstract_batch(
                keys=data.batch_keys)).compile()
        check_memory(step_fn, exp)  # before the state takes device memory
        ckpt = stack.enter_context(Checkpointer(workdir, keep=t.keep_checkpoints))
        start, state, notes = _restore_or_init(exp, ckpt, data, config_dict)
        if main_process:  # the run's own copy of a tokenizer file: its readers need no other.
            # After restore: a resume refused for another tokenizer leaves the copy as it was.
            keep_tokenizer(data.tokenizer, exp.config.data.tokenizer, workdir)
            if data.chat_template:  # its export writes the template it trained with back
                keep_chat_template(data.chat_template, workdir, data.chat_tokens)
            _announce(exp, data, ckpt, start, notes, lock)
        writer = MetricsWriter(workdir, start_step=start, enabled=main_process)
        stack.push(lambda *exc: writer.close(raise_errors=exc[0] is None))  # the first error wins
        bar = stack.enter_context(tqdm(total=t.steps, initial=start, desc="train",
                                       dynamic_ncols=True, disable=not main_process))
        save = _saver(exp, ckpt, data, config_dict)
        stopwatch, hooks = _hooks(exp, ckpt, writer, bar, start, state, save)
        report, *_, evaluate, saver = hooks

        step = start
        catcher.training = catcher.signum is None
        stopping = catcher.signum is not None and not catcher.sync
        while step < t.steps and not stopping:
            batch = exp.batch_to_device(next(data.train_iter))
            state, metrics = step_fn(state, batch)
            step += 1
            bar.update(1)
            if step == start + 1:  # the first step's time (allocation, warm-up) is not counted
                jax.block_until_ready(metrics)
                stopwatch.reset()
            for hook in hooks:
                hook(step, state, metrics)
            stopping = catcher.stop(step)
        if stopping:
            if step > start and saver.last_saved != step:
                save(step, state)
            ckpt.close()
            raise Interrupted(catcher.signum, step, step > start, ckpt.directory)
        bar.close()
        saved = _saved_text(ckpt, saver.last_saved if saver.last_saved != start else None)
        ended = _ended_in_skips(state, start, hooks[1])  # while ckpt can name checkpoints
    return _finish(exp, data, state, start, report.losses, evaluate.last_metrics, workdir, saved,
                   ended_in_skips=ended)


def _ended_in_skips(state, start: int, stall: StallGuard) -> Optional[str]:
    """Why a run that ends in skipped steps failed, or None. At least 2 and at least half
    of the steps this call ran, all skipped at the end, mean it ended without recovering:
    a dynamic loss scale backs off (halves) at each skip and is found again within a few
    steps, while such a run (a learning rate that ruined the weights, e.g.
    ``optim.learning_rate=1e10``: 39 of 40 steps skipped) would otherwise exit 0 with its
    checkpoint as if it had trained. The text is ``stall``'s (the loss scale, advice and
    the last healthy checkpoint)."""
    step = int(jax.device_get(state.step))
    trailing, ran = int(jax.device_get(state.consecutive_skips)), step - start
    if ran > 0 and trailing >= max(2, (ran + 1) // 2):
        return f"the run ended in skipped steps: {stall.message(state, trailing, step)}"
    return None


def _check_resume_settings(workdir: pathlib.Path, config_dict: dict) -> None:
    """A resume under other settings fails here, in a second, not after the corpus is read
    and the step compiled: the newest checkpoint whose config reads against this run's
    (restore checks each checkpoint again). A workdir without checkpoints, or whose
    configs do not read, is left to restore, which sets damaged ones aside.

    Raises:
      CheckpointError: :func:`~jaxmp.train.checkpoint.check_same_settings`.
    """
    if not (workdir / "checkpoints").is_dir():
        return
    with Checkpointer(workdir, read_only=True) as peek:
        if not peek.all_steps():
            return
        try:
            step, saved = peek.read_config()
        except CheckpointError:
            return
        directory = peek.directory
    check_same_settings(saved, config_dict, step, directory)


def _saved_text(ckpt: Checkpointer, step: Optional[int]) -> str:
    """What this run saved, in one sentence: the checkpoint ``step`` (None: nothing) and,
    when it was saved unhealthy, where the last healthy one is."""
    if step is None:
        return f"no checkpoint was written in this run (checkpoints: {ckpt.directory})"
    text = f"checkpoint step {step} saved in {ckpt.directory}"
    if ckpt.healthy(step):
        return text
    healthy = next((s for s in reversed(ckpt.all_steps()) if s < step and ckpt.healthy(s)), None)
    return (text + ", while the run was unhealthy (its latest step was skipped or looked "
            "divergent); the last healthy checkpoint is "
            + (f"step {healthy}" if healthy is not None else "none"))


def _no_step_applied(state, step: int) -> str:
    """The reason a run whose every step was skipped fails."""
    scale = describe_loss_scale(state.loss_scale)
    return (f"none of the {steps_text(step)} applied: every one was skipped (non-finite "
            f"gradients or update), so the parameters are still the initial ones; loss scale "
            f"{scale}. Use precision.loss_scale=dynamic, a smaller static loss scale, a lower "
            f"optim.learning_rate or a wider compute dtype")


def _saver(exp: Experiment, ckpt: Checkpointer, data, config_dict: dict):
    """``save(step, state, eval_loss=None)``: starts the checkpoint of ``state`` at ``step``
    with the data iterator's state, the config, the layout it was saved for, its health
    and its eval loss (when evaluated at ``step``)."""
    meta = {"num_devices": exp.num_devices, "strategy": exp.layout.strategy,
            "expert": exp.layout.expert}
    stacks = exp.stacks()
    if stacks is not None:  # the scanned layout, for a jaxmp that lays it out otherwise
        meta[SAVED_STACKS] = [list(s) for s in stacks]

    def save(step, s, eval_loss=None):
        digest = exp.base_digest(s)  # a LoRA run's frozen base, which is not saved
        return ckpt.save(step, exp.checkpoint_state(s), data.get_state(), config_dict,
                         {**meta, BASE_DIGEST: digest} if digest else meta,
                         healthy=_healthy(s), eval_loss=eval_loss)

    return save


def _hooks(exp: Experiment, ckpt: Checkpointer, writer, bar, start: int, state, save):
    """``(stopwatch, hooks)``: the loop's periodic actions in order (report, stall guard,
    divergence guard, evaluate, save) for a run resumed at ``start`` with ``state``."""
    t, stopwatch = exp.config.train, Stopwatch()
    report = ReportMetrics(t.log_every, t.steps, writer=writer, stopwatch=stopwatch,
                           tokens_per_step=t.batch_size * exp.config.data.seq_len, bar=bar,
                           last_step_reported=start,
                           last_skipped=int(jax.device_get(state.skipped_steps)),
                           timed_from=start + 1)
    # eval_every=0: never evaluate (last_step=-1 never comes).
    evaluate = Evaluate(t.eval_every, t.steps if t.eval_every else -1,
                        evaluate=exp.evaluate_metrics, writer=writer, stopwatch=stopwatch, bar=bar)
    saver = SaveCheckpoint(t.checkpoint_every, t.steps, stopwatch=stopwatch, bar=bar,
                           last_saved=start or None, save=save, evaluate=evaluate)
    stall = StallGuard(t.log_every, t.steps, limit=t.max_consecutive_skips, rules=exp.rules,
                       ckpt=ckpt)
    diverge = DivergenceGuard(t.log_every, t.steps, limit=t.max_divergent_steps, ckpt=ckpt,
                              loss_spike_factor=t.loss_spike_factor,
                              grad_norm_spike_factor=t.grad_norm_spike_factor)
    return stopwatch, [report, stall, diverge, evaluate, saver]


def _finish(exp: Experiment, data, state, start: int, losses: list, eval_metrics, workdir,
            saved: str = "", ended_in_skips: Optional[str] = None):
    """The summary of :func:`train_and_evaluate`, after the closing evaluation (when the
    loop trained nothing) and the generated sample (``workdir/sample.txt``); ``saved``
    says what was saved.

    Raises:
      TrainingStalled: no step of the run ever applied (every one skipped), or the run
        ended in skipped steps (``ended_in_skips``, from :func:`_ended_in_skips`).
    """
    t, main_process = exp.config.train, jax.process_index() == 0
    final_step, skipped = int(jax.device_get(state.step)), int(jax.device_get(state.skipped_steps))
    if final_step and skipped == final_step:
        raise TrainingStalled(f"{_no_step_applied(state, final_step)}; {saved}")
    if ended_in_skips:
        raise TrainingStalled(ended_in_skips)
    if eval_metrics is None and start >= t.steps and t.eval_every:  # nothing left to train
        eval_metrics = exp.evaluate_metrics(state)  # the restored state
    eval_loss = None if eval_metrics is None else eval_metrics["loss"]
    if t.sample_prompt and data.chat_template:  # a chat run: the prompt is a user message
        prompt = chat_prompt_ids([{"role": "user", "content": t.sample_prompt}],
                                 data.chat_template, data.tokenizer.tokenizer, **data.chat_tokens)
    elif t.sample_prompt:
        prompt = data.tokenizer.encode(t.sample_prompt, add_eos=False)
    else:
        prompt = data.sample_prompt
    ids = generate(exp.host_model(state), prompt, max_new_tokens=t.sample_tokens,
                   temperature=t.sample_temperature,
                   rng=jax.random.wrap_key_data(jax.device_get(state.rng)), progress=main_process,
                   vocab_limit=data.tokenizer.vocab_size, stop_ids=data.sample_stop_ids)
    sample = data.tokenizer.decode(ids)
    if main_process:
        (workdir / "sample.txt").write_text(sample)
        loss_text = "not evaluated" if eval_metrics is None else eval_text(eval_metrics)
        print(f"done: step {final_step}, {loss_text}, {skipped} of {steps_text(final_step)} "
              f"skipped{'; ' + saved if saved else ''}")
        print(f"sample after {steps_text(final_step)}:\n{sample}")
    return {"step": final_step, "train_losses": losses, "eval_loss": eval_loss,
            "eval": eval_metrics, "skipped_steps": skipped, "sample": sample}
