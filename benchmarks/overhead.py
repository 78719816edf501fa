"""What jaxmp's train step costs over a minimal hand-written one, on the same model.

Usage::

    python benchmarks/overhead.py --json overhead.json
    python benchmarks/overhead.py --target H200     # both compiled for an H200, no GPU needed
    python benchmarks/overhead.py --config configs/tiny_moe.py --steps 5 --repeats 40 \
        --config.precision.policy=mixed_fp16 --config.precision.loss_scale=dynamic:init=2**16

Both sides train the same :class:`~jaxmp.models.MoETransformer` (same config, same
initial weights, same per-module precision rules, same batches in the same order) with
the same algorithm: loss = cross-entropy + MoE balance loss, multiplied by the loss
scale; gradients unscaled; one finiteness verdict; global-norm clipping then AdamW on a
warm-up + cosine schedule with weight decay on matrices only; parameters, optimizer
state and router biases selected back on a non-finite step; router biases moved toward
balance (DeepSeek-V3 section 2.1.2) when ``model.bias_update_rate > 0``.

* **jaxmp**: ``Experiment.train_step`` of :class:`jaxmp.train.Experiment` on a 1-device
  mesh, exactly what ``train.py`` runs (the per-device ``shard_map`` step with its
  explicit gradient all-reduce, and its metrics: grad norm, lr, expert counts, ...).
* **baseline**: :func:`make_baseline_step` below, written plainly with Flax NNX, optax
  and jmp: ``jmp.Policy`` for the master/output dtypes, ``optax.adamw``,
  ``jmp.DynamicLossScale`` (or ``NoOpLossScale``/``StaticLossScale``), ``jmp.all_finite``
  and ``jmp.select_tree``. The compute-dtype casts are the model's own (its modules cast
  per their policy), so they are the same on both sides: the baseline differs in the step
  machinery, not the model.

Both are ``jax.jit`` with the state donated, compiled before timing, warmed up, and
timed *interleaved*: each sample runs ``--steps`` steps of one side then of the other
(the order alternating between samples) and ends with ``jax.block_until_ready``, so slow
phases of a shared machine hit both sides alike. Reported: the median ms per step of
each side and ``ratio = jaxmp_ms / baseline_ms`` (target: <= 1.02); for context the
median of the back-to-back pair ratios, the fastest samples, the CPU time per step, and
XLA's cost analysis of both compiled steps (FLOPs, bytes accessed), which says whether a
difference is device work or host work. ``--profile DIR`` also writes a
``jax.profiler`` trace of a few steps of each side.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence

if __package__ in (None, ""):  # run as `python benchmarks/overhead.py`: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
from absl import app, flags, logging
from flax import nnx
from ml_collections import config_flags

from benchmarks._common import (DEFAULT_CONFIG, check_json_flag, device_info, experiment, random_batches,
                                uncached_compiles, write_json)
from benchmarks._timing import MIN_REPEATS, check_repeats
from jaxmp.models import ModelConfig, MoETransformer, RouterBias, update_router_bias
from jaxmp.precision import loss_scale as jaxmp_ls
from jaxmp.train.config import config_to_dict

__all__ = ["TARGET_RATIO", "jmp_loss_scale", "make_baseline_optimizer", "make_baseline_step",
           "build_sides", "compile_side", "time_interleaved", "run", "target_report"]

# The overhead the issue allows jaxmp's step over a hand-written one.
TARGET_RATIO = 1.02


def jmp_loss_scale(loss_scale: jaxmp_ls.LossScale):
    """The ``jmp`` loss scale with the same behaviour as a jaxmp one.

    ``DynamicLossScale`` maps to ``jmp.DynamicLossScale(loss_scale, period=growth_interval,
    factor=growth_factor, min_loss_scale)``; jmp backs off by ``1 / factor`` at once,
    which equals jaxmp's only for ``backoff_factor == 1 / growth_factor`` and
    ``hysteresis == 1`` (jaxmp's defaults).

    Raises:
      ValueError: a jaxmp dynamic scale whose backoff or hysteresis jmp cannot express.
    """
    # New arrays from Python floats: sharing a buffer with the jaxmp state would let one
    # side's donation delete the other side's loss scale.
    if isinstance(loss_scale, jaxmp_ls.NoOpLossScale):
        return jmp.NoOpLossScale()
    if isinstance(loss_scale, jaxmp_ls.StaticLossScale):
        return jmp.StaticLossScale(jnp.float32(float(loss_scale.loss_scale)))
    if isinstance(loss_scale, jaxmp_ls.DynamicLossScale):
        growth, backoff = float(loss_scale.growth_factor), float(loss_scale.backoff_factor)
        if abs(backoff * growth - 1.0) > 1e-6 or int(loss_scale.hysteresis) != 1:
            raise ValueError(
                f"jmp.DynamicLossScale backs off by 1/growth_factor at once; the config asks for "
                f"backoff_factor={backoff}, growth_factor={growth}, hysteresis="
                f"{int(loss_scale.hysteresis)} (allowed here: backoff = 1/growth, hysteresis=1)")
        return jmp.DynamicLossScale(
            jnp.float32(float(loss_scale.loss_scale)), period=int(loss_scale.growth_interval),
            factor=growth, min_loss_scale=jnp.float32(float(loss_scale.min_loss_scale)))
    raise ValueError(f"unknown loss scale {type(loss_scale).__name__}")


def make_baseline_optimizer(optim_config, total_steps: int) -> optax.GradientTransformation:
    """Clipping then ``optax.adamw`` on the config's warm-up + cosine (or constant) schedule.

    Raises:
      ValueError: ``optim.nu_dtype`` set (``optax.adamw`` keeps nu in the params' dtype),
        or an unknown ``optim.schedule`` (allowed: cosine, constant).
    """
    c = optim_config
    if c.nu_dtype:
        raise ValueError(f"optim.nu_dtype={c.nu_dtype!r}: optax.adamw has no nu_dtype; use ''")
    lr, warmup = float(c.learning_rate), int(c.warmup_steps)
    if c.schedule == "cosine":
        schedule = optax.warmup_cosine_decay_schedule(
            0.0, lr, warmup, max(int(c.decay_steps) or total_steps, warmup + 1),
            lr * float(c.final_lr_fraction))
    elif c.schedule == "constant":
        schedule = optax.join_schedules(
            [optax.linear_schedule(0.0, lr, warmup), optax.constant_schedule(lr)], [warmup]
        ) if warmup else lr
    else:
        raise ValueError(f"unknown optim.schedule {c.schedule!r}; allowed: 'cosine', 'constant'")
    adamw = optax.adamw(schedule, b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=c.weight_decay,
                        mu_dtype=c.mu_dtype or None,
                        mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params))
    if c.grad_clip and c.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(float(c.grad_clip)), adamw)
    return adamw


def make_baseline_step(graphdef, optimizer: optax.GradientTransformation, policy: jmp.Policy,
                       bias_update_rate: float) -> Callable:
    """The hand-written step: ``step((params, biases, rest, opt_state, loss_scale), batch)``.

    Returns ``(new_state, {"loss": float32 cross-entropy, "grads_finite": bool})``; the
    batch is ``{"inputs", "targets"}`` of int32 [B, T].
    """

    def loss_fn(params, biases, rest, loss_scale, batch):
        model = nnx.merge(graphdef, policy.cast_to_param(params), biases, rest)
        logits, aux = model(batch["inputs"])
        logits = policy.cast_to_output(logits)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
        return loss_scale.scale(ce + aux["aux_loss"]), (ce, aux["expert_counts"])

    def step(state, batch):
        params, biases, rest, opt_state, loss_scale = state
        grads, (ce, counts) = jax.grad(loss_fn, has_aux=True)(params, biases, rest, loss_scale, batch)
        grads = loss_scale.unscale(grads)
        finite = jmp.all_finite(grads)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        new_biases = biases
        if bias_update_rate:
            model = nnx.merge(graphdef, params, biases, rest)
            row = 0
            for router, num_layers in model.routers():  # layer order: the rows of counts
                bias = router.bias
                layer_counts = counts[row:row + num_layers].reshape(bias[...].shape)
                bias[...] = update_router_bias(bias[...], layer_counts, bias_update_rate)
                row += num_layers
            new_biases = nnx.state(model, RouterBias)
        params, opt_state, biases = jmp.select_tree(
            finite, (new_params, new_opt_state, new_biases), (params, opt_state, biases))
        state = (params, biases, rest, opt_state, loss_scale.adjust(finite))
        return state, {"loss": ce, "grads_finite": finite}

    return step


def build_sides(config) -> Dict[str, Dict[str, Any]]:
    """Both sides' ``{"step": function, "state": initial state}``, same model weights.

    Raises:
      ValueError: bad config values (as the trainer's, and see :func:`jmp_loss_scale`,
        :func:`make_baseline_optimizer`).
    """
    exp = experiment(config)
    cfg, model_config = exp.config, exp.model_config
    state = exp.init_state()

    model = MoETransformer(ModelConfig.from_config(cfg.model), cfg.precision.policy,
                           rngs=nnx.Rngs(cfg.seed))
    b_graphdef, _, biases, rest = nnx.split(model, nnx.Param, RouterBias, ...)
    # The trainer's initial weights, copied (each side's donation must not free the other's).
    params = jax.tree.map(jnp.copy, state.params)
    b_optimizer = make_baseline_optimizer(cfg.optim, cfg.train.steps)
    policy = jmp.get_policy(str(exp.rules.default))  # jaxmp prints policies in jmp's grammar
    b_state = (params, biases, rest, b_optimizer.init(params), jmp_loss_scale(state.loss_scale))
    b_step = make_baseline_step(b_graphdef, b_optimizer, policy, model_config.bias_update_rate)
    return {"jaxmp": {"step": exp.train_step, "state": state, "jitted": True,
                      "batch_sharding": exp.batch_sharding},
            "baseline": {"step": b_step, "state": b_state, "jitted": False}}


def compile_side(step: Callable, state: Any, batch: Any, jitted: bool = False):
    """Compiles a side's step ahead of time for ``(state, batch)``, the state donated.

    ``jitted=True`` (jaxmp): ``step`` is the trainer's own ``jax.jit`` (its shardings and
    donation), lowered and compiled as it is. Otherwise (the baseline) ``step`` is
    jitted here with the state donated, and the compiled function takes the state's
    leaves (a list) rather than the state: jax builds its ahead-of-time argument info
    by rebuilding each argument pytree around placeholder objects, and
    ``jmp.DynamicLossScale.__post_init__`` (jmp 0.0.4) calls ``jax.eval_shape`` on its
    fields, which fails on them. Both calls flatten the state once per step.

    Returns:
      ``(call, seconds_to_compile, {"flops", "bytes_accessed"})``: ``call(state, batch)
      -> (state, metrics)``; the costs from XLA's cost analysis of the compiled step
      (None where the backend gives none).
    """
    with uncached_compiles():  # a compile, not a cache read, however often it runs
        start = time.perf_counter()
        if jitted:
            compiled = step.lower(state, batch).compile()
        else:
            treedef = jax.tree.structure(state)

            def flat_step(leaves, batch):
                return step(jax.tree.unflatten(treedef, leaves), batch)

            compiled = jax.jit(flat_step, donate_argnums=0).lower(jax.tree.leaves(state), batch).compile()
        seconds = time.perf_counter() - start
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):  # older jax: one dict per computation
        analysis = analysis[0] if analysis else None
    analysis = analysis or {}
    cost = {key: (float(analysis[name]) if name in analysis else None)
            for key, name in (("flops", "flops"), ("bytes_accessed", "bytes accessed"))}

    if jitted:
        return compiled, seconds, cost

    def call(state, batch):
        return compiled(jax.tree.leaves(state), batch)

    return call, seconds, cost


def time_interleaved(sides: Dict[str, Dict[str, Any]], batches: Sequence[Any], steps: int,
                     repeats: int, warmup: int) -> Dict[str, Dict[str, List[float]]]:
    """Milliseconds per step of each side, ``repeats`` samples each, interleaved.

    Each sample runs ``steps`` consecutive steps of one side (batches cycled from
    ``batches``), waits for the state and metrics, and divides by ``steps`` both the wall
    time (``time.perf_counter``) and the CPU time this process used in all its threads
    (``time.process_time``). Sample ``r`` runs the sides in order A, B for even ``r`` and
    B, A for odd ``r``, so a drift in machine speed biases neither. ``warmup`` untimed
    samples per side run first. Each side's ``"state"`` is consumed (donated) and
    replaced; its ``"first_metrics"`` hold the metrics of its first step.

    The CPU time is for CPU backends on a shared machine: other processes stretch the
    wall time of a sample but hardly the CPU time it needs. On GPUs it counts host work
    and waiting, not device time.

    Returns:
      ``{name: {"wall": [ms per step, ...], "cpu": [ms per step, ...]}}``, ``repeats``
      entries each.
    """
    names = list(sides)
    samples = {name: {"wall": [], "cpu": []} for name in names}
    cursor = {name: 0 for name in names}

    def one_sample(name):
        side = sides[name]
        state = side["state"]
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            state, metrics = side["compiled"](state, batches[cursor[name] % len(batches)])
            if cursor[name] == 0:
                side["first_metrics"] = metrics
            cursor[name] += 1
        jax.block_until_ready((state, metrics))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        side["state"] = state
        return wall / steps * 1e3, cpu / steps * 1e3

    for r in range(warmup + repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            wall_ms, cpu_ms = one_sample(name)
            if r >= warmup:
                samples[name]["wall"].append(wall_ms)
                samples[name]["cpu"].append(cpu_ms)
    return samples


def run(config, steps: int, repeats: int, warmup: int = 2, ring: int = 4,
        profile_dir: str = "") -> Dict[str, Any]:
    """Builds, compiles and times both sides; returns the JSON report.

    Args:
      config: a trainer config (``configs/tiny_moe.py`` layout).
      steps: train steps per timed sample, >= 1.
      repeats: timed samples per side, >= 10 (the median is reported).
      warmup: untimed samples per side after compilation, >= 0.
      ring: distinct random batches cycled, >= 1.
      profile_dir: when set, a ``jax.profiler`` trace of ``steps`` steps of each side
        is written there after timing.

    Returns:
      ``{"ratio", "jaxmp_ms", "baseline_ms", "target_ratio", "meets_target",
      "jaxmp_samples_ms", "baseline_samples_ms", "pair_ratios", "pair_ratio_median",
      "jaxmp_min_ms", "baseline_min_ms", "jaxmp_cpu_ms", "baseline_cpu_ms", "cpu_ratio",
      "jaxmp_cpu_samples_ms", "baseline_cpu_samples_ms", "steps", "repeats", "warmup",
      "ring", "batch_size", "seq_len", "policy", "loss_scale", "first_loss", "compile_s",
      "cost_analysis", "state_leaves", "device", "config"}``. Times are ms per train
      step; ``jaxmp_ms``/``baseline_ms`` are medians of the wall-time samples and
      ``ratio = jaxmp_ms / baseline_ms``; ``pair_ratios`` the ratios of the two sides'
      samples taken back to back, in sample order (their median is the estimate least
      moved by a busy machine); ``*_cpu_ms`` medians of the process CPU time per step
      and ``cpu_ratio`` their ratio (see :func:`time_interleaved`).

    Raises:
      ValueError: bad counts (before any work) or config values.
    """
    repeats = check_repeats(repeats)
    for name, value, low in (("steps", steps, 1), ("warmup", warmup, 0), ("ring", ring, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if config.train.grad_accum_steps != 1:
        raise ValueError(f"train.grad_accum_steps={config.train.grad_accum_steps}: the baseline "
                         f"has no accumulation; use 1")
    device = jax.devices()[0]
    sides = build_sides(config)
    # Placed as the trainer places them: the batch sharding of its 1-device mesh.
    batches = random_batches(config.model.vocab_size, config.train.batch_size, config.data.seq_len,
                             ring, seed=config.seed, device=sides["jaxmp"]["batch_sharding"])
    report: Dict[str, Any] = {"compile_s": {}, "cost_analysis": {}, "state_leaves": {}}
    for name, side in sides.items():
        if not side["jitted"]:  # the trainer's state is created on its mesh already
            side["state"] = jax.device_put(side["state"], device)
        report["state_leaves"][name] = len(jax.tree.leaves(side["state"]))
        side["compiled"], report["compile_s"][name], report["cost_analysis"][name] = compile_side(
            side["step"], side["state"], batches[0], side["jitted"])
    samples = time_interleaved(sides, batches, steps, repeats, warmup)
    if profile_dir:
        for name, side in sides.items():
            with jax.profiler.trace(str(Path(profile_dir) / name)):
                for i in range(steps):
                    side["state"], metrics = side["compiled"](side["state"], batches[i % len(batches)])
                jax.block_until_ready((side["state"], metrics))

    med = {name: {kind: float(np.median(v)) for kind, v in s.items()} for name, s in samples.items()}
    ratio = med["jaxmp"]["wall"] / med["baseline"]["wall"]
    pair_ratios = [a / b for a, b in zip(samples["jaxmp"]["wall"], samples["baseline"]["wall"])]
    report.update({
        "ratio": ratio, "jaxmp_ms": med["jaxmp"]["wall"], "baseline_ms": med["baseline"]["wall"],
        "target_ratio": TARGET_RATIO, "meets_target": ratio <= TARGET_RATIO,
        "jaxmp_samples_ms": samples["jaxmp"]["wall"],
        "baseline_samples_ms": samples["baseline"]["wall"],
        "pair_ratios": pair_ratios, "pair_ratio_median": float(np.median(pair_ratios)),
        "jaxmp_min_ms": min(samples["jaxmp"]["wall"]),
        "baseline_min_ms": min(samples["baseline"]["wall"]),
        "jaxmp_cpu_ms": med["jaxmp"]["cpu"], "baseline_cpu_ms": med["baseline"]["cpu"],
        "cpu_ratio": med["jaxmp"]["cpu"] / med["baseline"]["cpu"],
        "jaxmp_cpu_samples_ms": samples["jaxmp"]["cpu"],
        "baseline_cpu_samples_ms": samples["baseline"]["cpu"],
        "steps": steps, "repeats": repeats, "warmup": warmup, "ring": ring,
        "batch_size": int(config.train.batch_size), "seq_len": int(config.data.seq_len),
        "policy": str(config.precision.policy), "loss_scale": str(config.precision.loss_scale),
        "first_loss": {name: float(jax.device_get(side["first_metrics"]["loss"]))
                       for name, side in sides.items()},
        "device": device_info(device), "config": config_to_dict(config),
    })
    return report


def _hbm_bytes(kernels) -> int:
    return sum(k.bytes * k.runs for k in kernels if k.kind != "collective")


def target_report(config, target_name: str) -> Dict[str, Any]:
    """Both sides compiled by XLA's GPU compiler for one ``target_name`` GPU, not run.

    The jaxmp side is the trainer's own step (:func:`jaxmp.analysis.gpu.compile_step`);
    the baseline is :func:`make_baseline_step` on the same model (built for the target,
    so ``attention="auto"`` is cuDNN's there too), lowered on abstract arrays placed on
    the target device. Reported per side: XLA's memory analysis, the HBM bytes every
    kernel reads and writes at least (:func:`jaxmp.analysis.hlo.hlo_kernels`) and the
    roofline bound (:func:`jaxmp.analysis.gpu.roofline`); then jaxmp over baseline for
    both. A deviceless compile has no autotuning: a bound, not a timing.

    Raises:
      ValueError: no CUDA plugin, an unknown target, or bad config values.
    """
    from jaxmp import target as compile_target
    from jaxmp.analysis import gpu, hlo

    tgt = gpu.get_target(target_name)
    ours = gpu.compile_step(config, tgt, 1)
    exp, cfg = ours.experiment, ours.experiment.config
    device = exp.mesh.devices.flat[0]
    rep = jax.sharding.SingleDeviceSharding(device)

    def abstract(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x), sharding=rep), tree)

    with compile_target.compiling_for(device):
        model = nnx.eval_shape(lambda: MoETransformer(ModelConfig.from_config(cfg.model),
                                                      cfg.precision.policy, rngs=nnx.Rngs(cfg.seed)))
        graphdef, params, biases, rest = nnx.split(model, nnx.Param, RouterBias, ...)
        optimizer = make_baseline_optimizer(cfg.optim, cfg.train.steps)
        policy = jmp.get_policy(str(exp.rules.default))
        state = (params, biases, rest, jax.eval_shape(optimizer.init, params),
                 jmp_loss_scale(exp.settings.loss_scale))
        step = make_baseline_step(graphdef, optimizer, policy, exp.model_config.bias_update_rate)
        treedef = jax.tree.structure(state)

        def flat_step(leaves, batch):
            return step(jax.tree.unflatten(treedef, leaves), batch)

        batch = abstract({k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in exp.abstract_batch().items()})
        compiled = jax.jit(flat_step, donate_argnums=0).lower(abstract(jax.tree.leaves(state)), batch).compile()
    out: Dict[str, Any] = {"target": tgt.name, "policy": str(cfg.precision.policy)}
    for name, program in (("jaxmp", ours.compiled), ("baseline", compiled)):
        module = hlo.parse_module(program.as_text())
        kernels = hlo.hlo_kernels(module)
        stats = program.memory_analysis()
        bound = gpu.roofline(kernels, hlo.hlo_collectives(module), tgt, 1)
        out[name] = {"hbm_bytes": _hbm_bytes(kernels), "bound_s": bound["bound_s"],
                     "memory_s": bound["memory_s"], "gemm_s": bound["gemm_s"],
                     "kernels": len(kernels), "temp_bytes": int(stats.temp_size_in_bytes),
                     "argument_bytes": int(stats.argument_size_in_bytes)}
    out["hbm_ratio"] = out["jaxmp"]["hbm_bytes"] / out["baseline"]["hbm_bytes"]
    out["bound_ratio"] = out["jaxmp"]["bound_s"] / out["baseline"]["bound_s"]
    return out


def _define_flags() -> None:
    # Defined only when run as a script, so tests can import this module next to train_step.py.
    config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "Trainer config file.")
    flags.DEFINE_integer("steps", 5, "Train steps per timed sample.", lower_bound=1)
    flags.DEFINE_integer("repeats", 40, f"Timed samples per side (>= {MIN_REPEATS}); the median "
                         "is reported.", lower_bound=MIN_REPEATS)
    flags.DEFINE_integer("warmup", 2, "Untimed samples per side after compiling.", lower_bound=0)
    flags.DEFINE_integer("ring", 4, "Distinct random batches cycled.", lower_bound=1)
    flags.DEFINE_string("json", None, "Write the report as JSON to this path.")
    flags.register_validator("json", check_json_flag)
    flags.DEFINE_string("profile", "", "Write jax.profiler traces of both sides here.")
    flags.DEFINE_string("target", None, "Compile both sides for this GPU (H100, H200, H800, A100 "
                        "or a .pbtxt) with XLA's GPU compiler instead of timing them here: HBM "
                        "bytes and roofline bounds side by side (needs the gpu extra).")


def main(argv: Sequence[str]) -> None:
    """Command-line entry point (absl); flag errors exit with status 1 before any work."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # keep jax's backend-probing INFO lines out
    f = flags.FLAGS
    config = f.config
    if f.target:
        report = target_report(config, f.target)
        for name in ("jaxmp", "baseline"):
            r = report[name]
            print(f"  {name:>8} on {report['target']} (deviceless): HBM {r['hbm_bytes'] / 1e9:.3f} GB, "
                  f"roofline bound {r['bound_s'] * 1e3:.3f} ms (other kernels {r['memory_s'] * 1e3:.3f} ms), "
                  f"{r['kernels']} kernels, temporaries {r['temp_bytes'] / 1e9:.3f} GB")
        print(f"  jaxmp/baseline: HBM bytes {report['hbm_ratio']:.4f}, bound {report['bound_ratio']:.4f} "
              f"(target <= {TARGET_RATIO}; a compile, not a timing)")
        if f.json:
            write_json(f.json, report)
        return
    print(f"overhead: jaxmp vs a hand-written NNX + optax + jmp step on "
          f"{jax.devices()[0].platform} ({jax.devices()[0].device_kind}); policy "
          f"{config.precision.policy!r}, loss scale {config.precision.loss_scale!r}, batch "
          f"{config.train.batch_size} x {config.data.seq_len} tokens; {f.repeats} samples "
          f"of {f.steps} steps per side, interleaved")
    report = run(config, f.steps, f.repeats, f.warmup, f.ring, f.profile)
    for name in ("jaxmp", "baseline"):
        cost = report["cost_analysis"][name]
        print(f"  {name:>8}: {report[name + '_ms']:9.3f} ms/step (median)  compile "
              f"{report['compile_s'][name]:6.1f} s  first loss {report['first_loss'][name]:.5f}  "
              f"XLA flops {cost['flops']}  bytes {cost['bytes_accessed']}  "
              f"state leaves {report['state_leaves'][name]}")
    verdict = "meets" if report["meets_target"] else "MISSES"
    print(f"  ratio jaxmp/baseline = {report['ratio']:.4f} ({verdict} the target "
          f"<= {TARGET_RATIO}); per-sample ratios: median {report['pair_ratio_median']:.4f}, "
          f"min {min(report['pair_ratios']):.4f}, max {max(report['pair_ratios']):.4f}; "
          f"fastest samples {report['jaxmp_min_ms']:.3f} / {report['baseline_min_ms']:.3f} ms; "
          f"CPU time per step {report['jaxmp_cpu_ms']:.3f} / {report['baseline_cpu_ms']:.3f} ms "
          f"(ratio {report['cpu_ratio']:.4f})")
    if f.json:
        write_json(f.json, report)
        print(f"wrote {f.json}")


if __name__ == "__main__":
    _define_flags()
    app.run(main)
