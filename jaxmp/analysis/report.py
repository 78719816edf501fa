"""Accounting reports on the command line.

``python -m jaxmp.report --article``
    The memory (section 2.1) and gradient-communication (section 2.3) figures of the
    DeepSeek mixed-precision article this project started from, for its 67e9-parameter
    model, recomputed beside the printed values (:mod:`jaxmp.analysis.article`).
``python -m jaxmp.report --cost [--params ... --gpus ...]``
    DeepSeek-V3's published GPU-hours beside :func:`jaxmp.analysis.cost.estimate` for the same
    inputs, and the MFU the published hours imply (:mod:`jaxmp.analysis.cost`).

``python -m jaxmp.report --config configs/X.py [--config.KEY=VALUE ...] [--devices N]
[--modes a,b] [--breakdown [K]] [--settings [--flops]]``
    Per-device memory (params, gradients, optimizer state, compute copy, activations)
    and collective bytes (gradient reduction; every all-reduce, reduce-scatter,
    all-gather and all-to-all by dtype) of the config's model for each precision mode of
    :data:`jaxmp.analysis.accounting.MODES`, measured from the trainer's own step
    (:mod:`jaxmp.analysis.accounting`); ``--config.KEY=VALUE`` overrides a config key as
    in ``train.py``. ``--breakdown`` lists the K largest saved residuals per
    mode with the line that produced them. Lowering over N devices on CPU needs N host
    devices: the flag sets ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` unless
    ``XLA_FLAGS`` already sets it. The step is compiled once per mode: for
    ``configs/tiny_moe.py`` (ten modes, FP8 included) 43 s of wall time on an idle 2-core
    machine (a busier machine takes longer); about two minutes per mode for
    ``configs/seed_moe.py`` (24 layers; pick a few ``--modes``). The device count changes
    the per-device batch, not the compile time. ``--config.parallel.strategy`` and
    ``--config.parallel.expert`` choose the layout whose bytes and collectives are
    counted. ``--settings`` adds, for the first mode, the saved activation
    bytes and per-device total of every attention path x remat setting
    (:func:`jaxmp.analysis.remat.activation_settings`; the cuDNN path is traced, not
    run, where there is no GPU), and ``--flops`` the train step's FLOPs from the compiled
    program per remat setting, i.e. what each recomputes (one unscanned compile per
    setting: minutes for the seed config).

``python -m jaxmp.report --config configs/X.py --target H200 [--devices N]
[--config.KEY=VALUE ...]``
    The trainer's own step compiled by XLA's GPU compiler for N x that GPU without one
    (:mod:`jaxmp.analysis.gpu`; needs ``pip install -e ".[gpu]"``): memory per device
    and whether it fits, the largest buffers, kernels by kind, GEMM FLOPs against
    6 x active params x tokens, collectives, and a roofline bound on the step time and
    MFU. ``--target`` takes H100, H200, H800, A100 or the path of a
    ``GpuTargetConfigProto`` text file; ``--top K`` lists the K largest buffers (default
    10). The exit status is 1 when the step does not fit the GPU's memory.

``--json OUT`` also writes the printed tables to ``OUT`` as JSON: one top-level key per
mode (``"article"``, ``"cost"``), or for ``--config`` the accounting report itself
(``{"model": ..., "setup": ..., "modes": {NAME: {...}}, "details": ..., "skipped": {NAME:
reason}}``: a mode whose step XLA cannot compile here is left out, with its reason).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
from typing import List, Optional, Sequence

from jaxmp.analysis import article, cost

__all__ = ["article_report", "cost_report", "format_article", "format_cost", "build_parser",
           "output_problem", "main"]


def output_problem(path: str) -> Optional[str]:
    """Why a report could not be written to ``path``, or None when it can.

    Checked before any work, so that minutes of compiling or measuring are not lost to a
    bad output path: the file's folder is created if missing, and a temporary file is
    created and removed in it.

    Args:
      path: the output file.

    Returns:
      A one-line reason naming ``path``, or None.
    """
    out = pathlib.Path(path)
    if out.is_dir():
        return f"{path} is a folder; give a file path"
    for parent in out.absolute().parents:  # the first that exists must be a folder
        if parent.exists():
            if not parent.is_dir():
                return f"cannot write {path}: {parent} is a file, not a folder"
            break
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out.parent):
            pass
    except OSError as e:
        return f"cannot write {path}: {e.strerror or e}"
    return None


def article_report(num_devices: int = 8) -> dict:
    """The article's tables as a JSON-ready dict.

    Args:
      num_devices: data-parallel devices for the communication table.

    Returns:
      ``{"num_params", "num_devices", "gb", "memory": [row...], "communication": [row...],
      "strategy_devices", "strategies": [row...]}`` (the last: per-GPU state of the
      article's model under dp, zero1 and fsdp, :func:`jaxmp.analysis.article.strategy_table`)
      with rows as in :class:`jaxmp.analysis.article.Row`.
    """
    return {
        "num_params": article.ARTICLE_PARAMS,
        "num_devices": num_devices,
        "gb": 1e9,
        "memory": [r.as_dict() for r in article.memory_table()],
        "communication": [r.as_dict() for r in article.communication_table(num_devices)],
        "strategy_devices": article.STRATEGY_DEVICES,
        "strategies": [r.as_dict() for r in article.strategy_table()],
    }


def cost_report(total_params: float = cost.DEEPSEEK_V3.total_params,
                active_params: float = cost.DEEPSEEK_V3.active_params,
                tokens: float = cost.DEEPSEEK_V3.tokens, *,
                hardware: str = cost.DEEPSEEK_V3.hardware, dtype: str = "bf16",
                mfu: float = 0.4, num_gpus: int = cost.DEEPSEEK_V3.num_gpus,
                watts_per_gpu: Optional[float] = None,
                num_layers: int = cost.DEEPSEEK_V3.num_layers,
                seq_len: int = cost.DEEPSEEK_V3.seq_len,
                d_model: int = cost.DEEPSEEK_V3.d_model) -> dict:
    """DeepSeek-V3's published cost beside an estimate, as a JSON-ready dict.

    The estimate uses the arguments (DeepSeek-V3's own by default). The implied MFU is
    always that of the published run: DeepSeek-V3's FLOPs over its published
    pre-training GPU-hours, against the H800 dense BF16 and FP8 peaks.

    Args:
      See :func:`jaxmp.analysis.cost.estimate`.

    Returns:
      ``{"published": {...}, "estimate": {...}, "estimate_over_published": float,
      "implied_mfu": [{"flops_formula", "flops", "bf16", "fp8"}, ...]}``.

    Raises:
      ValueError: from :func:`jaxmp.analysis.cost.estimate`.
    """
    run = cost.DEEPSEEK_V3
    est = cost.estimate(total_params, active_params, tokens, hardware=hardware, dtype=dtype,
                        mfu=mfu, num_gpus=num_gpus, watts_per_gpu=watts_per_gpu,
                        num_layers=num_layers, seq_len=seq_len, d_model=d_model)
    pre = run.gpu_hours["pre-training"]
    tdp = cost.HARDWARE[run.hardware].tdp_watts
    implied = []
    for label, attn in (("6ND", {}), ("6ND + 6LTd", {"num_layers": run.num_layers,
                                                      "seq_len": run.seq_len,
                                                      "d_model": run.d_model})):
        flops = cost.training_flops(run.active_params, run.tokens, **attn)
        implied.append({"flops_formula": label, "flops": flops, **{
            dt: cost.implied_mfu(flops, pre, hardware=run.hardware, dtype=dt)
            for dt in ("bf16", "fp8")}})
    return {
        "published": {
            "name": run.name, "source": run.source, "total_params": run.total_params,
            "active_params": run.active_params, "tokens": run.tokens,
            "hardware": run.hardware, "num_gpus": run.num_gpus,
            "gpu_hours": dict(run.gpu_hours),
            "pretraining_days": pre / run.num_gpus / 24.0,
            "pretraining_energy_mwh_at_tdp": pre * tdp / 1e6,
        },
        "estimate": est.as_dict(),
        "estimate_over_published": est.gpu_hours / pre,
        "implied_mfu": implied,
    }


def _fmt_row(r: dict) -> List[str]:
    if r["bytes"] is not None:
        computed = (f"{r['bytes'] / 1e9:,.0f} "
                    f"GB" if r["bytes"] >= 10e9 else f"{r['bytes'] / 1e9:.2f} GB")
        if r["bytes_per_param"] is not None:
            computed += f" ({r['bytes_per_param']:.3g} B/param)"
    else:
        computed = f"{r['fraction']:.0%} of {r['baseline']}"
    if r["bytes"] is not None and r["fraction"] is not None and not (
            r["status"] == "REF" and r["fraction"] == 1.0):
        computed += f", {r['fraction']:.0%} of {r['baseline']}"
    return [f"  [{r['status']:5s}] {r['item']}",
            f"          formula:  {r['formula']}",
            f"          computed: {computed}",
            f"          article:  {r['article'] if r['article'] is not None else '-'}",
            f"          why:      {r['reason']}"]


def format_article(report: dict) -> str:
    """Formats :func:`article_report` for the terminal."""
    lines = [f"Article section 2.1: training memory, {report['num_params'] / 1e9:g}e9 parameters "
             f"(GB = 1e9 bytes)"]
    for r in report["memory"]:
        lines += _fmt_row(r)
    lines += ["", f"Article section 2.3: gradient bytes per device per step, "
                  f"{report['num_devices']} data-parallel devices"]
    for r in report["communication"]:
        lines += _fmt_row(r)
    lines += ["", f"Per-GPU training state by parallel strategy, {report['strategy_devices']} GPUs "
                  f"(bf16 compute, float32 master and moments; activations not included)"]
    for r in report["strategies"]:
        lines += _fmt_row(r)
    rows = report["memory"] + report["communication"]
    wrong = sum(r["status"] == "WRONG" for r in rows)
    checked = sum(r["status"] != "REF" for r in rows)
    lines += ["", f"{wrong} of the {checked} article's figures checked do not hold."]
    return "\n".join(lines)


def format_cost(report: dict) -> str:
    """Formats :func:`cost_report` for the terminal."""
    pub, est = report["published"], report["estimate"]
    hours = pub["gpu_hours"]
    lines = [
        f"{pub['name']}: published ({pub['source']})",
        f"  {pub['total_params']:.3g} total / {pub['active_params']:.3g} active parameters, "
        f"{pub['tokens']:.3g} tokens, {pub['num_gpus']} {pub['hardware']}",
        *(f"  {stage:18s} {h / 1e6:6.3f}M GPU-hours" for stage, h in hours.items()),
        f"  pre-training: {pub['pretraining_days']:.1f} days on {pub['num_gpus']} GPUs; "
        f"{pub['pretraining_energy_mwh_at_tdp']:,.0f} MWh of GPU energy at TDP (not published)",
        "",
        f"Estimate: {est['total_params']:.3g} total / {est['active_params']:.3g} active "
        f"parameters, {est['tokens']:.3g} tokens, {est['num_gpus']} {est['hardware']} at "
        f"{est['dtype']} peak {est['peak_tflops']} TFLOP/s, MFU {est['mfu']:.2f}, "
        f"{est['watts_per_gpu']:.0f} W/GPU",
        f"  attention term: L={est['num_layers']}, T={est['seq_len']}, d={est['d_model']}",
        f"  FLOPs        {est['flops']:.4g}",
        f"  GPU-hours    {est['gpu_hours'] / 1e6:.3f}M  "
        f"({report['estimate_over_published']:.2f}x published pre-training)",
        f"  days         {est['days']:.1f}",
        f"  tokens/s     {est['tokens_per_s']:,.0f} (cluster)",
        f"  energy       {est['energy_kwh']:,.0f} kWh = {est['energy_mwh']:,.0f} MWh (GPUs only)",
        "",
        f"MFU implied by the published {hours['pre-training'] / 1e6:.3f}M "
        f"{pub['hardware']} GPU-hours (dense peaks):",
    ]
    for r in report["implied_mfu"]:
        lines.append(f"  FLOPs = {r['flops_formula']:11s} {r['flops']:.4g}: "
                     f"{r['bf16']:.1%} of bf16 peak, {r['fp8']:.1%} of fp8 peak")
    lines.append("  (d = d_model; DeepSeek-V3's MLA attends with 128 heads x 192 QK / 128 V "
                 "dims, so the attention term here is a lower bound)")
    return "\n".join(lines)


# The most devices a report lowers over. The --config report simulates each one on this
# CPU (XLA:CPU host devices, whose buffers and threads take host memory: 100,000 of them
# aborted at 19 GB, 2026-12-04); 16,384 is eight times the 2,048 H800s DeepSeek-V3 was
# trained on (its technical report, section 3.1).
MAX_DEVICES = 16384


def _refuse(parser: argparse.ArgumentParser, error: ValueError) -> None:
    """Exits with status 2 (argparse's) and ``error`` as one line on stderr: a value or
    file the user gave is wrong, and the usage text above it would hide the line."""
    parser.exit(2, f"{parser.prog}: error: {error}\n")


def _progress(text: str) -> None:
    """A line on stderr while the report works (the tables go to stdout)."""
    print(text, file=sys.stderr, flush=True)


def _check_devices(parser: argparse.ArgumentParser, n: int) -> None:
    if not 1 <= n <= MAX_DEVICES:
        parser.error(f"--devices must be in [1, {MAX_DEVICES}], got {n} (each device is "
                     f"simulated on this machine)")


def _force_host_devices(n: int) -> None:
    """Asks XLA:CPU for ``n`` devices; effective only before JAX starts its backends."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser; one flag per report mode."""
    run = cost.DEEPSEEK_V3
    p = argparse.ArgumentParser(prog="python -m jaxmp.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--article", "--seed", dest="article", action="store_true",
                   help="recheck the DeepSeek mixed-precision article's memory and communication "
                        "figures (--seed is an old name)")
    p.add_argument("--cost", action="store_true",
                   help="DeepSeek-V3's published GPU-hours beside the cost model")
    p.add_argument("--config", metavar="PATH",
                   help="account memory and gradient traffic of this config's model per precision "
                        "mode; --config.KEY=VALUE overrides a key, as in train.py")
    p.add_argument("--json", metavar="OUT", help="also write the tables as JSON to OUT")
    p.add_argument("--devices", type=int, default=8,
                   help="devices of the --config mesh (parallel.expert of them along 'expert'), or "
                        "the data-parallel devices of --article's communication table (default 8)")
    g = p.add_argument_group("--config with --target: the step compiled for a GPU without one")
    g.add_argument("--target", metavar="GPU",
                   help="compile the trainer's step with XLA's GPU compiler for --devices x this "
                        "GPU (H100, H200, H800, A100, or a GpuTargetConfigProto .pbtxt) and report "
                        "memory, kernels, GEMM FLOPs, collectives and a roofline bound; needs "
                        "pip install -e \".[gpu]\"")
    g.add_argument("--autotune_results", metavar="FILE",
                   help="with --target: XLA autotune results from a real GPU of that kind "
                        "(benchmarks/gpu_suite.py writes them)")
    g.add_argument("--top", type=int, default=None,
                   help="with --target: largest buffers listed (default 10)")
    a = p.add_argument_group("--config options")
    a.add_argument("--modes", default=None,
                   help="comma-separated precision modes (default: all of "
                        "jaxmp.analysis.accounting.MODES, and of LORA_MODES (lora_master, "
                        "lora_bf16, lora_fp8) when the config has lora.rank > 0)")
    a.add_argument("--breakdown", type=int, nargs="?", const=15, default=0, metavar="K",
                   help="list the K (default 15) largest saved residuals per mode "
                        "with their source")
    a.add_argument("--settings", action="store_true",
                   help="also list saved activation bytes per attention path x remat setting "
                        "(first mode)")
    a.add_argument("--flops", action="store_true",
                   help="with --settings: the compiled step's FLOPs per remat setting (the "
                        "recompute cost; one compile each)")
    c = p.add_argument_group("--cost options (defaults: DeepSeek-V3 pre-training)")
    c.add_argument("--params", type=float, default=run.total_params, help="total parameters")
    c.add_argument("--active-params", type=float, default=run.active_params,
                   help="parameters active per token")
    c.add_argument("--tokens", type=float, default=run.tokens, help="training tokens")
    c.add_argument("--hardware", default=run.hardware, help=f"one of {', '.join(cost.HARDWARE)}")
    c.add_argument("--dtype", default="bf16", help=f"one of {', '.join(cost.DTYPES)}")
    c.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilization in (0, 1]")
    c.add_argument("--gpus", type=int, default=run.num_gpus, help="number of GPUs")
    c.add_argument("--watts", type=float, default=None, help="watts per GPU (default: TDP)")
    c.add_argument("--layers", type=int, default=run.num_layers,
                   help="layers for the attention term (0 with --seq-len 0 --d-model 0: none)")
    c.add_argument("--seq-len", type=int, default=run.seq_len, help="sequence length")
    c.add_argument("--d-model", type=int, default=run.d_model, help="attention width")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the report; returns the exit status (argparse exits 2 on bad input)."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    overrides = [a for a in rest if a.startswith("--config.")]
    unknown = [a for a in rest if not a.startswith("--config.")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if overrides and not args.config:
        parser.error(f"{overrides[0]} overrides a key of --config PATH, which is not given")
    args.overrides = overrides
    if args.config and (args.article or args.cost):
        parser.error("--config is a report of its own; run --article/--cost separately")
    if not (args.article or args.cost or args.config):
        parser.error("choose a report: --article and/or --cost, or --config PATH")
    problem = output_problem(args.json) if args.json else None
    if problem:
        parser.error(f"--json: {problem}")
    if (args.target or args.autotune_results) and not args.config:
        parser.error("--target compiles a config's step: give --config PATH")
    if args.autotune_results and not args.target:
        parser.error("--autotune_results goes with --target")
    if args.top is not None and args.top < 0:
        parser.error(f"--top must be an integer >= 0, got {args.top}")
    if args.top is not None and not args.target:
        parser.error("--top goes with --target (the largest buffers of the GPU compile)")
    if args.config and args.target:
        return _main_target(parser, args)
    if args.config:
        return _main_config(parser, args)
    out, text = {}, []
    try:
        if args.article:
            out["article"] = article_report(args.devices)
            text.append(format_article(out["article"]))
        if args.cost:
            out["cost"] = cost_report(
                args.params, args.active_params, args.tokens, hardware=args.hardware,
                dtype=args.dtype, mfu=args.mfu, num_gpus=args.gpus, watts_per_gpu=args.watts,
                num_layers=args.layers, seq_len=args.seq_len, d_model=args.d_model)
            text.append(format_cost(out["cost"]))
    except ValueError as e:  # a bad value or file: its line alone, not the usage before it
        _refuse(parser, e)
    print("\n\n".join(text))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


def runnable_modes(config, modes) -> tuple:
    """``(runnable, skipped)`` mode names: a mode with top-k gradient compression needs
    ``parallel.strategy='dp'`` and ``parallel.expert=1`` (as validate_config requires)."""
    from jaxmp import sharding

    layout_ok = (config.parallel.strategy in sharding.STRATEGY
                 and not sharding.STRATEGY[config.parallel.strategy].splits_state
                 and config.parallel.expert == 1)
    run, skipped = [], []
    for name, overrides in modes.items():
        topk = overrides.get("precision.grad_compression") == "topk"
        (skipped if topk and not layout_ok else run).append(name)
    return run, skipped


def _main_config(parser: argparse.ArgumentParser, args) -> int:
    _check_devices(parser, args.devices)
    if args.breakdown < 0:
        parser.error(f"--breakdown must be >= 0, got {args.breakdown}")
    _force_host_devices(args.devices)
    from jaxmp.analysis import accounting, remat  # JAX's backends' users: after XLA_FLAGS is set
    from jaxmp.train.config import load_config

    if args.flops and not args.settings:
        parser.error("--flops goes with --settings")
    modes = ([m.strip() for m in args.modes.split(",") if m.strip()] if args.modes is not None
             else None)
    if modes == []:
        parser.error(f"--modes {args.modes!r} names no precision mode; allowed: "
                     f"{', '.join(accounting.ALL_MODES)}")
    try:
        config = load_config(args.config, args.overrides)
        notes = []
        if modes is None:  # the default modes: those that run under the config's layout
            modes, skipped = runnable_modes(config, {m: accounting.ALL_MODES[m] for m in
                                                     accounting.default_modes(config)})
            if skipped:
                notes.append(f"note: skipped {', '.join(skipped)}: top-k compression runs only "
                             "with parallel.strategy='dp' and parallel.expert=1 (this config: "
                             f"{config.parallel.strategy!r}, {config.parallel.expert})")
        notes.append(f"note: {args.devices} devices (--devices, default 8; train.py uses every "
                     "local device unless train.num_devices is set)")
        notes.append("note: these are XLA:CPU's figures for the step compiled for this CPU, not "
                     "a GPU's: the GPU compiler fuses and schedules otherwise and may need much "
                     "more (Qwen3-30B-A3B fsdp: 58.6 GB here, 82.9 GB for an H100). For a GPU's "
                     "figure and whether it fits, install the gpu extra (pip install "
                     "'jaxmp[gpu]') and add --target H100 (or H200, H800, A100)")
        if "mixed_fp16" in modes:
            notes.append("note: mode mixed_fp16 starts its dynamic loss scale at 2**15; the "
                         "trainer's precision.loss_scale=dynamic starts at 256 (the seed "
                         "article's value), dynamic:init=2**15 there gives the mode's")
        print("\n".join(notes))
        out = accounting.accounting_report(config, modes, args.devices, breakdown=args.breakdown,
                                           skip_failed=True, progress=_progress)
        if not out["modes"]:  # not one mode could be compiled: say why, in one line each
            for mode, reason in out["skipped"].items():
                print(f"{parser.prog}: error: mode {mode}: {reason}", file=sys.stderr)
            return 1
        if args.settings:
            out["settings"] = remat.activation_settings(
                config, next(iter(out["modes"])), args.devices, flops=args.flops)
    except ValueError as e:  # a bad value or file: its line alone, not the usage before it
        _refuse(parser, e)
    print(accounting.format_accounting(out, args.config))
    if args.settings:
        print()
        print(remat.format_settings(out["settings"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


def _main_target(parser: argparse.ArgumentParser, args) -> int:
    _check_devices(parser, args.devices)
    if args.top is None:
        args.top = 10
    for flag in ("modes", "settings", "flops", "breakdown"):
        if getattr(args, flag):
            parser.error(f"--{flag} is a CPU accounting option; --target compiles the config as it "
                         f"is (set e.g. --config.precision.policy=... instead)")
    # The CUDA plugin registers only on the CPU platform when no GPU is attached (else its
    # cuInit fails with error 303); compiling for a target needs no GPU either way.
    import jax

    if "JAX_PLATFORMS" not in os.environ:  # read by JAX at import: set it in its config
        jax.config.update("jax_platforms", "cpu")
    from jaxmp.analysis import gpu
    from jaxmp.train.config import load_config

    try:
        target = gpu.get_target(args.target)
        problem = gpu.plugin_problem()
        if problem:
            raise ValueError(f"--target needs XLA's GPU compiler: {problem}")
        config = load_config(args.config, args.overrides)
        out = gpu.gpu_report(config, target, args.devices, top=args.top,
                             autotune_results=args.autotune_results)
    except ValueError as e:  # a bad value or file: its line alone, not the usage before it
        _refuse(parser, e)
    print(gpu.format_gpu_report(out, args.config))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    mem = out["memory"]
    if not mem["fits"]:  # a plan that cannot run is a failure, for scripts too
        print(f"{parser.prog}: the step needs {gpu.format_bytes(mem['total_bytes'])} per device"
              f" (as in the table above), more than {gpu.FIT_MARGIN:.0%} of "
              f"{out['target']['name']}'s {gpu.format_bytes(mem['device_bytes'])}: it does not "
              f"fit", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
