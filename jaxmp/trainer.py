"""The training loop behind ``python train.py --config configs/NAME.py``.

Reads top to bottom: check the config, build the mesh, data, model and train state,
resume from the newest checkpoint if the workdir has one, then run the jit-compiled
:func:`~jaxmp.train_step.make_train_step` over the mesh with logging, evaluation and
checkpoints, and finish with a generated sample.
"""
from __future__ import annotations

import json
import math
import pathlib
import re
import time
from typing import Any, Dict, Optional

import jax
import ml_collections
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxmp import comm, sharding
from jaxmp.checkpoint import CheckpointError, Checkpointer
from jaxmp.data import ByteTokenizer, create_pipeline
from jaxmp.loss_scale import NoOpLossScale, get_loss_scale
from jaxmp.metrics_log import MetricsWriter, expert_load_stats
from jaxmp.models import ModelConfig, MoETransformer, count_params, generate
from jaxmp.policy import canonical_dtype, get_policy_rules
from jaxmp.train_step import (create_train_state, make_eval_step, make_lr_schedule,
                              make_optimizer, make_train_step)

__all__ = ["train_and_evaluate", "validate_config", "build", "config_to_dict", "comm_settings",
           "train_state_shardings", "TrainingStalled", "module_paths", "unmatched_rules"]


class TrainingStalled(RuntimeError):
    """Every step for ``train.max_consecutive_skips`` steps in a row was skipped."""


def config_to_dict(config: ml_collections.ConfigDict) -> dict:
    """The config as plain JSON-compatible data (stored in checkpoints)."""
    return json.loads(config.to_json_best_effort(sort_keys=True))


def comm_settings(config: ml_collections.ConfigDict) -> dict:
    """The gradient-communication keys of ``config.precision`` as ``make_train_step``
    keyword arguments; configs without them get the defaults (float32, none, 0.3)."""
    p = config.precision
    return dict(grad_reduce_dtype=p.get("grad_reduce_dtype", "float32"),
                grad_compression=p.get("grad_compression", "none"),
                topk_ratio=p.get("topk_ratio", 0.3))


def train_state_shardings(state, mesh, rules):
    """:func:`jaxmp.sharding.state_shardings` of a train state, with the per-device
    top-k residual (``state.comm_state``) split over the data axis by
    :func:`jaxmp.comm.comm_state_shardings`."""
    shardings = sharding.state_shardings(state, mesh, rules)
    return shardings.replace(comm_state=comm.comm_state_shardings(state.comm_state, mesh, rules))


_F32_MAX = float(np.finfo(np.float32).max)


def _validate_optim(o) -> None:
    """Checks the optimizer settings (numbers the optax pieces would take silently)."""
    checks = (
        ("learning_rate", lambda v: 0 < v <= _F32_MAX, "a number > 0 that float32 can hold"),
        ("warmup_steps", lambda v: v >= 0 and v == int(v), "an integer >= 0"),
        ("decay_steps", lambda v: v >= 0 and v == int(v), "an integer >= 0 (0 = train.steps)"),
        ("final_lr_fraction", lambda v: 0 <= v <= 1, "in [0, 1]"),
        ("weight_decay", lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0"),
        ("grad_clip", lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0 (0 = off)"),
        ("b1", lambda v: 0 <= v < 1, "in [0, 1)"),
        ("b2", lambda v: 0 <= v < 1, "in [0, 1)"),
        ("eps", lambda v: math.isfinite(v) and v > 0, "a finite number > 0"),
    )
    for key, ok, allowed in checks:
        value = o.get(key, 0)
        if not isinstance(value, (int, float)) or not ok(value):
            raise ValueError(f"optim.{key}={value!r} is not allowed; it must be {allowed}")
    for key in ("mu_dtype", "nu_dtype"):
        if o.get(key):
            try:
                canonical_dtype(o[key])
            except ValueError as e:
                raise ValueError(f"optim.{key}: {e}") from None


def module_paths(model: nnx.Module) -> list:
    """The ``/``-joined paths of a model's modules that have a policy: what policy rules
    match against."""
    return ["/".join(str(k) for k in path) for path, m in nnx.iter_modules(model)
            if path and hasattr(m, "policy")]


def unmatched_rules(rules, paths) -> list:
    """Warnings, one per rule pattern that matches no module path: a typo such as
    ``rooter: fp32`` would otherwise be ignored in silence. (Not an error: a shared rule
    string may name modules that one model lacks, e.g. ``router`` in a dense model.)"""
    kinds = {re.sub(r"\d+", "{i}", p): None for p in paths}  # one example per kind
    examples = ", ".join(list(kinds)[:10])
    return [f"precision.policy rule {pattern!r} matches no module of this model; module paths "
            f"look like: {examples}, ..." for pattern, _ in rules.rules
            if not any(re.search(pattern, p) for p in paths)]


def validate_config(config: ml_collections.ConfigDict, num_devices: int) -> None:
    """Checks the trainer's settings before any work is done.

    Raises:
      ValueError: a count that must be positive is not; an optimizer setting out of
        range; the global batch cannot be
        split into ``grad_accum_steps`` micro-batches that the data axis of the mesh
        divides; a bad model shape (e.g. heads not dividing the width, top-k above the
        number of experts), policy, loss scale, schedule or gradient communication
        (``precision.grad_reduce_dtype``, ``grad_compression``, ``topk_ratio``). The
        message names the values.
    """
    t = config.train
    for key in ("steps", "batch_size", "log_every", "eval_every", "checkpoint_every",
                "keep_checkpoints", "grad_accum_steps"):
        if int(t[key]) < 1:
            raise ValueError(f"train.{key} must be >= 1, got {t[key]}")
    if t.batch_size % t.grad_accum_steps:
        raise ValueError(f"train.batch_size={t.batch_size} is not divisible by "
                         f"train.grad_accum_steps={t.grad_accum_steps}")
    micro = t.batch_size // t.grad_accum_steps
    if micro % num_devices:
        raise ValueError(
            f"the micro-batch of {micro} sequences (train.batch_size={t.batch_size} / "
            f"train.grad_accum_steps={t.grad_accum_steps}) is not divisible by the "
            f"{num_devices} devices of the mesh's 'data' axis; use a multiple of {num_devices}")
    if config.data.seq_len > config.model.max_len:
        raise ValueError(f"data.seq_len={config.data.seq_len} exceeds model.max_len={config.model.max_len}")
    for key, ok, allowed in (
            ("sample_tokens", lambda v: v >= 0, ">= 0"),
            ("sample_temperature", lambda v: v >= 0, ">= 0 (0 = greedy)"),
            ("max_consecutive_skips", lambda v: v >= 1, ">= 1")):
        if not ok(t.get(key, 1)):
            raise ValueError(f"train.{key}={t[key]!r} is not allowed; it must be {allowed}")
    _validate_optim(config.optim)
    # Parse everything that can be wrong in the config now, before data is read.
    ModelConfig.from_config(config.model)
    get_policy_rules(config.precision.policy)
    get_loss_scale(config.precision.loss_scale)
    comm.check_comm_config(**comm_settings(config))
    make_lr_schedule(config.optim, t.steps)


def build(config: ml_collections.ConfigDict, num_devices: Optional[int] = None):
    """Builds ``(model_config, rules, graphdef, state, optimizer, lr_schedule, param_counts)``
    on the host; ``param_counts`` is ``(total, active_per_token)``.

    ``num_devices`` (of the data axis; default ``config.train.num_devices`` or all
    devices) sizes the per-device top-k residual in ``state.comm_state``.
    """
    model_config = ModelConfig.from_config(config.model)
    rules = get_policy_rules(config.precision.policy)
    model = MoETransformer(model_config, rules, rngs=nnx.Rngs(config.seed))
    optimizer = make_optimizer(config.optim, config.train.steps)
    lr_schedule = make_lr_schedule(config.optim, config.train.steps)
    num_devices = num_devices or config.train.get("num_devices") or jax.device_count()
    comm_state = comm.init_comm_state(nnx.state(model, nnx.Param), num_devices,
                                      comm_settings(config)["grad_compression"])
    graphdef, state = create_train_state(model, optimizer, get_loss_scale(config.precision.loss_scale),
                                         config.seed, comm_state=comm_state)
    # model.rules: the user's rules plus the model's float32 islands (router, norms).
    return model_config, model.rules, graphdef, state, optimizer, lr_schedule, count_params(model)


def _tree_bytes(tree) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype")))


def _banner(config, mesh, model_config, rules, state, data, param_counts) -> str:
    total, active = param_counts
    n = len(mesh.devices.flat)
    # The top-k residual is split over the devices: each holds one row of it.
    state_bytes = _tree_bytes(state.replace(comm_state=None)) + _tree_bytes(state.comm_state) // n
    grad_bytes = _tree_bytes(state.params)
    c = comm_settings(config)
    lines = [
        "jaxmp trainer",
        f"  devices     : {len(mesh.devices.flat)} x {jax.devices()[0].platform} "
        f"({jax.process_count()} process(es)); mesh {dict(mesh.shape)}",
        f"  model       : {model_config.num_layers} layers, d_model {model_config.d_model}, "
        f"{model_config.num_heads} heads, {model_config.num_experts} routed + "
        f"{model_config.num_shared_experts} shared experts, top-{model_config.top_k}",
        f"  parameters  : {total:,} total, {active:,} active per token",
        f"  policy      : {rules}",
        f"  loss scale  : {state.loss_scale!r}",
        f"  grad comm   : {c['grad_reduce_dtype']} reduce" + (
            f", top-k {c['topk_ratio']:g} with error feedback" if c["grad_compression"] == "topk" else ""),
        f"  memory/dev  : train state {state_bytes / 2**20:.1f} MiB + gradients "
        f"{grad_bytes / 2**20:.1f} MiB (activations not included; see python -m jaxmp.report)",
        f"  data        : {data.num_documents} documents, {data.train_tokens:,} train / "
        f"{data.eval_tokens:,} eval tokens, seq_len {config.data.seq_len}, "
        f"global batch {config.train.batch_size}",
    ]
    return "\n".join(lines)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       num_devices: Optional[int] = None) -> Dict[str, Any]:
    """Trains the MoE Transformer described by ``config``, resuming from ``workdir``.

    Args:
      config: the run config (see configs/tiny_moe.py for every key).
      workdir: where checkpoints, ``metrics.jsonl``, TensorBoard files and the sample go.
      num_devices: devices of the data-parallel mesh; ``config.train.num_devices`` or
        all devices when None.

    Returns:
      A summary: ``step``, ``train_losses`` (one per step run in this call, float),
      ``eval_loss`` (the last, float), ``skipped_steps``, ``sample`` (str).

    Raises:
      ValueError: bad config values or data (see :func:`validate_config`).
      jaxmp.checkpoint.CheckpointError: a checkpoint in ``workdir`` is unreadable or
        was written for another setup.
    """
    workdir = pathlib.Path(workdir)
    if workdir.exists() and not workdir.is_dir():
        raise ValueError(f"--workdir {workdir} exists and is not a directory")
    num_devices = num_devices or config.train.get("num_devices") or None
    mesh = sharding.make_mesh(num_devices)
    validate_config(config, mesh.devices.size)
    if config.model.vocab_size < ByteTokenizer.vocab_size:  # the trainer's tokenizer
        raise ValueError(f"model.vocab_size={config.model.vocab_size} is smaller than the byte "
                         f"tokenizer's {ByteTokenizer.vocab_size} (256 bytes + end-of-document)")
    t = config.train
    data = create_pipeline(config.data, global_batch_size=t.batch_size, seed=config.seed,
                           process_index=jax.process_index(), process_count=jax.process_count())
    model_config, rules, graphdef, state, optimizer, lr_schedule, param_counts = build(
        config, mesh.devices.size)

    logical_rules = sharding.DATA_PARALLEL_RULES
    state_sh = train_state_shardings(state, mesh, logical_rules)
    batch_sh = sharding.batch_sharding(mesh, logical_rules)
    state = jax.device_put(state, state_sh)

    writer = MetricsWriter(workdir, enabled=jax.process_index() == 0)
    ckpt = Checkpointer(workdir, keep=t.keep_checkpoints)
    config_dict = config_to_dict(config)
    start = 0
    if ckpt.latest_step() is not None:
        try:
            start, state, data_state = ckpt.restore(state, config_dict)
            data.set_state(data_state)
        except (CheckpointError, ValueError) as e:
            ckpt.close()  # stop orbax's threads before the error unwinds the program
            writer.close()
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"the data-iterator state in {ckpt.directory} does not fit this "
                                  f"run's data: {e}") from None
        print(f"resumed from {ckpt.directory} at step {start}")
        for line in _resume_warnings(ckpt.saved_config, config, start):
            print(f"warning: {line}")
    writer.truncate_after(start)  # a fresh run (start 0) drops an old run's records

    train_step = jax.jit(
        make_train_step(graphdef, optimizer, lr_schedule=lr_schedule,
                        bias_update_rate=model_config.bias_update_rate,
                        grad_accum_steps=t.grad_accum_steps, mesh=mesh, **comm_settings(config)),
        in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None), donate_argnums=0)
    eval_step = jax.jit(make_eval_step(graphdef), in_shardings=(state_sh, batch_sh))

    def to_device(batch):
        return {k: jax.make_array_from_process_local_data(batch_sh, np.asarray(v)) for k, v in batch.items()}

    def evaluate(state):
        loss = tokens = 0.0
        for batch in data.eval_batches:
            out = jax.device_get(eval_step(state, to_device(batch)))
            loss, tokens = loss + float(out["loss"]), tokens + float(out["tokens"])
        return loss / tokens

    if jax.process_index() == 0:
        print(_banner(config, mesh, model_config, rules, state, data, param_counts))
        user_rules = get_policy_rules(config.precision.policy)
        paths = module_paths(nnx.merge(graphdef, state.params, state.biases, state.rest))
        for line in _precision_warnings(rules, state.loss_scale) + unmatched_rules(user_rules, paths):
            print(f"warning: {line}")

    tokens_per_step = t.batch_size * config.data.seq_len
    summary = {"train_losses": [], "eval_loss": None}
    last_log_time, last_log_step = time.perf_counter(), start
    bar = tqdm(range(start, t.steps), initial=start, total=t.steps, desc="train",
               disable=jax.process_index() != 0, dynamic_ncols=True)
    max_skips = int(t.get("max_consecutive_skips", 100))
    consecutive_skips, last_skipped = 0, int(jax.device_get(state.skipped_steps))
    last_logged = start
    for step in bar:
        batch = to_device(next(data.train_iter))
        state, metrics = train_step(state, batch)
        done = step + 1
        if step == start:  # keep compilation out of tokens/s
            jax.block_until_ready(metrics)
            last_log_time, last_log_step = time.perf_counter(), done
        if done % t.log_every == 0 or done == t.steps:
            m = jax.device_get(metrics)
            now = time.perf_counter()
            # None when only the (compiling) first step ran since the timer was reset.
            tps = (tokens_per_step * (done - last_log_step) / (now - last_log_time)
                   if done > last_log_step else None)
            last_log_time, last_log_step = now, done
            record = {k: float(v) for k, v in m.items()
                      if np.ndim(v) == 0 and k not in ("grads_finite", "applied")}
            record.update(grads_finite=bool(m["grads_finite"]), applied=bool(m["applied"]),
                          skipped_steps=int(m["skipped_steps"]), tokens_per_s=tps,
                          **expert_load_stats(m["expert_counts"]))
            interval, last_logged = done - last_logged, done
            newly_skipped = record["skipped_steps"] - last_skipped
            last_skipped = record["skipped_steps"]
            if newly_skipped:
                bar.write(f"step {done}: {newly_skipped} of the last {interval} steps skipped "
                          f"(non-finite gradients or update); loss scale now "
                          f"{float(jax.device_get(state.loss_scale.loss_scale)):g}")
            # A lower bound on the current run of skipped steps, from what the logs saw.
            consecutive_skips = (0 if record["applied"] else
                                 consecutive_skips + interval if newly_skipped == interval else 1)
            writer.write(done, "train", record)
            summary["train_losses"].append(record["loss"])
            bar.set_postfix(loss=f"{record['loss']:.3f}", scale=f"{record['loss_scale']:g}",
                            tok_s="-" if tps is None else f"{tps:,.0f}", skipped=record["skipped_steps"])
            if consecutive_skips >= max_skips:
                bar.close()
                ckpt.close()
                writer.close()
                raise TrainingStalled(
                    f"the last {consecutive_skips} steps (to step {done}) were all skipped: "
                    f"gradients or updates were not finite and the parameters have not changed "
                    f"since; loss scale {float(jax.device_get(state.loss_scale.loss_scale)):g} "
                    f"({type(state.loss_scale).__name__}). Lower optim.learning_rate, use "
                    f"precision.loss_scale=dynamic for float16, or a wider compute dtype. The "
                    f"last checkpoint in {ckpt.directory} is from before the stall.")
        if done % t.eval_every == 0 or done == t.steps:
            summary["eval_loss"] = evaluate(state)
            writer.write(done, "eval", {"loss": summary["eval_loss"]})
            bar.write(f"step {done}: eval loss {summary['eval_loss']:.4f}")
        if done % t.checkpoint_every == 0 or done == t.steps:
            ckpt.save(done, state, data.get_state(), config_dict)
        if done % t.eval_every == 0 or done % t.checkpoint_every == 0:
            last_log_time, last_log_step = time.perf_counter(), done  # keep eval/saving out of tokens/s
    bar.close()
    ckpt.close()
    writer.close()

    if summary["eval_loss"] is None:  # nothing left to train: report the restored state
        summary["eval_loss"] = evaluate(state)
    model = nnx.merge(graphdef, *jax.device_get((state.params, state.biases, state.rest)))
    prompt = data.tokenizer.encode(t.sample_prompt, add_eos=False)
    ids = generate(model, prompt, max_new_tokens=t.sample_tokens, temperature=t.sample_temperature,
                   rng=jax.random.wrap_key_data(jax.device_get(state.rng)))
    sample = data.tokenizer.decode(ids)
    final_step, skipped = int(jax.device_get(state.step)), int(jax.device_get(state.skipped_steps))
    if jax.process_index() == 0:
        (workdir / "sample.txt").write_text(sample)
        print(f"done: step {final_step}, eval loss {summary['eval_loss']:.4f}, {skipped} of "
              f"{final_step} steps skipped")
        print(f"sample after {final_step} steps:\n{sample}")
    summary.update(step=final_step, skipped_steps=skipped, sample=sample)
    return summary


def _precision_warnings(rules, loss_scale) -> list:
    """Risky precision settings that are allowed but rarely meant."""
    policies = [rules.default] + [p for _, p in rules.rules]
    if any(p.needs_loss_scale for p in policies) and isinstance(loss_scale, NoOpLossScale):
        return ["float16 compute without a loss scale: gradients below 2**-24 flush to zero and "
                "large ones overflow (Micikevicius et al. 2018, section 3.2); set "
                "precision.loss_scale=dynamic"]
    return []


def _resume_warnings(saved: Optional[dict], config, start: int) -> list:
    """What changed on resume that the user may not expect."""
    lines = []
    saved_steps = (saved or {}).get("train", {}).get("steps")
    if saved_steps is not None and saved_steps != config.train.steps and not config.optim.get("decay_steps"):
        lines.append(f"train.steps changed from {saved_steps} to {config.train.steps} with "
                     f"optim.decay_steps=0: the learning-rate schedule now decays over "
                     f"{config.train.steps} steps (set optim.decay_steps to choose the horizon)")
    if start >= config.train.steps:
        lines.append(f"the checkpoint is at step {start}, at or past train.steps="
                     f"{config.train.steps}: nothing to train")
    return lines
