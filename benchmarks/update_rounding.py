"""Do bfloat16 master weights learn? tiny_moe under pure_bf16 with each update rounding.

Usage::

    python benchmarks/update_rounding.py --json benchmarks/update_rounding.json \
        --plot benchmarks/update_rounding.png
    python benchmarks/update_rounding.py --seeds 1 --steps 50 --learning-rate 1e-4

Each run trains ``configs/tiny_moe.py`` (with a softmax router, as recorded) with the trainer's own
:class:`~jaxmp.train.experiment.Experiment` (the jitted ``train_step`` ``train.py``
runs, on one device) and its data pipeline, for ``--steps`` steps at a constant learning
rate after a 5-step warm-up, small enough that round-to-nearest bfloat16 weights lose
most Adam updates (an update below half an ulp of its weight, 2**-9 |w|, is lost). Both
Adam moments are bfloat16 in every mode, so the modes differ only in the master weights
and how updates reach them (:func:`jaxmp.optim.with_update_rounding`):

=================== =================================== =========================== =========
mode                policy                              optim.update_rounding       bytes/param
=================== =================================== =========================== =========
``mixed_bf16``      ``mixed_bf16; router: fp32; ...``   nearest (float32 masters)   8
``pure_nearest``    ``pure_bf16; router: fp32; ...``    nearest                     6
``pure_stochastic`` ``pure_bf16; router: fp32; ...``    stochastic                  6
``pure_kahan``      ``pure_bf16; router: fp32; ...``    kahan                       8
=================== =================================== =========================== =========

Per mode and seed it records the training loss of every step and the final eval loss
(the config's eval windows); the JSON holds them all, the table the mean over seeds of
the last 20 steps' training loss and of the eval loss, with the seed-to-seed spread.

``--gpu-target H100`` instead compiles ``configs/seed_moe.py``'s train step deviceless
for 8 x that GPU (:func:`jaxmp.analysis.gpu.gpu_report`, as ``python -m jaxmp.report
--target``; fsdp and ``model.remat=full``, as tests/test_gpu_target.py fits it on an
H100) under ``mixed_bf16``, ``pure_stochastic`` and ``pure_kahan`` (bf16 moments, no loss
scale), and reports XLA's memory analysis per device. A compile, not a timing.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxmp.train import Experiment  # noqa: E402
from jaxmp.train.config import load_config  # noqa: E402

RULES = "router: fp32; norm: fp32"
MODES = {
    "mixed_bf16": (f"mixed_bf16; {RULES}", "nearest"),
    "pure_nearest": (f"pure_bf16; {RULES}", "nearest"),
    "pure_stochastic": (f"pure_bf16; {RULES}", "stochastic"),
    "pure_kahan": (f"pure_bf16; {RULES}", "kahan"),
}


def run(mode: str, seed: int, steps: int, learning_rate: float, batch_size: int) -> dict:
    """One run of ``mode``: ``{"losses": [per step], "eval_loss": float, "seconds": float}``."""
    policy, rounding = MODES[mode]
    config = load_config(ROOT / "configs" / "tiny_moe.py", [
        f"seed={seed}", f"precision.policy={policy}", f"optim.update_rounding={rounding}",
        "optim.mu_dtype=bfloat16", "optim.nu_dtype=bfloat16", "optim.schedule=constant",
        f"optim.learning_rate={learning_rate}", f"train.steps={steps}",
        f"train.batch_size={batch_size}", "data.num_eval_batches=4",
        # The router of the recorded figures (tiny_moe's until it routed by sigmoid to map
        # to Hugging Face's glm4_moe, issue 27): the same runs as recorded.
        "model.score_fn=softmax"])
    t0 = time.perf_counter()
    exp = Experiment.create(config, num_devices=1)
    state, data, losses = exp.init_state(), exp.data, []
    for _ in range(steps):
        state, metrics = exp.train_step(state, exp.batch_to_device(next(data.train_iter)))
        losses.append(float(metrics["loss"]))
    return {"losses": losses, "eval_loss": float(exp.evaluate(state)),
            "skipped": int(state.skipped_steps), "seconds": time.perf_counter() - t0}


def summarize(results: dict, tail: int = 20) -> dict:
    """Per mode: mean and sample std over seeds of the last ``tail`` steps' mean training
    loss and of the eval loss."""
    out = {}
    for mode, runs in results.items():
        last = np.array([np.mean(r["losses"][-tail:]) for r in runs])
        ev = np.array([r["eval_loss"] for r in runs])
        out[mode] = {"train_loss_last": float(last.mean()),
                     "train_loss_last_std": float(last.std(ddof=1)) if len(runs) > 1 else 0.0,
                     "eval_loss": float(ev.mean()),
                     "eval_loss_std": float(ev.std(ddof=1)) if len(runs) > 1 else 0.0,
                     "seeds": len(runs)}
    return out


def table(summary: dict, start_loss: float) -> str:
    rows = ["| mode | train loss, last 20 steps | eval loss | seeds |",
            "| --- | --- | --- | --- |"]
    for mode, s in summary.items():
        rows.append(f"| `{mode}` | {s['train_loss_last']:.3f} +- {s['train_loss_last_std']:.3f} "
                    f"| {s['eval_loss']:.3f} +- {s['eval_loss_std']:.3f} | {s['seeds']} |")
    rows.append(f"\n(first step's loss, mean over runs: {start_loss:.3f})")
    return "\n".join(rows)


def plot(results: dict, path: str = None):
    """The training losses per mode (10-step running mean of the seeds' mean); saved to
    ``path`` when given. Returns the matplotlib figure."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, runs in results.items():
        losses = np.array([r["losses"] for r in runs])
        k = 10  # a 10-step running mean of the seeds' mean
        mean = np.convolve(losses.mean(0), np.ones(k) / k, mode="valid")
        ax.plot(np.arange(k, losses.shape[1] + 1), mean, label=mode)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/token), 10-step mean over seeds")
    ax.set_title("tiny_moe: bfloat16 master weights by update rounding")
    ax.legend()
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=100)
    return fig


GPU_MODES = ("mixed_bf16", "pure_stochastic", "pure_kahan")


def gpu_compiles(target: str, devices: int = 8) -> dict:
    """Per mode of :data:`GPU_MODES`: the seed config's step compiled for ``devices`` x
    ``target``; its memory analysis, parameter count and roofline bound."""
    from jaxmp.analysis import gpu
    out = {}
    for mode in GPU_MODES:
        policy, rounding = MODES[mode]
        config = load_config(ROOT / "configs" / "seed_moe.py", [
            "model.remat=full", "parallel.strategy=fsdp", f"precision.policy={policy}",
            "precision.loss_scale=none", f"optim.update_rounding={rounding}",
            "optim.mu_dtype=bfloat16", "optim.nu_dtype=bfloat16"])
        t0 = time.perf_counter()
        r = gpu.gpu_report(config, gpu.get_target(target), devices, top=0)
        out[mode] = {"memory": r["memory"], "params": r["setup"]["params"],
                     "bound_s": r["roofline"]["bound_s"], "compile_s": time.perf_counter() - t0}
        m = r["memory"]
        print(f"{mode}: arguments {m['argument_bytes'] / 1e9:.2f} GB "
              f"({m['argument_bytes'] / r['setup']['params']:.3f} B/param per device), temp "
              f"{m['temp_bytes'] / 1e9:.2f} GB, total {m['total_bytes'] / 1e9:.2f} GB, fits "
              f"{m['fits']}, roofline bound {r['roofline']['bound_s'] * 1e3:.1f} ms", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--gpu-target", default=None,
                   help="compile the seed config deviceless for 8 x this GPU instead (H100)")
    args = p.parse_args(argv)
    if args.gpu_target:
        out = gpu_compiles(args.gpu_target)
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        return 0
    modes = args.modes.split(",")
    for m in modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r}; allowed: {', '.join(MODES)}")
    results = {m: [] for m in modes}
    for seed in range(args.seeds):
        for m in modes:
            r = run(m, seed, args.steps, args.learning_rate, args.batch_size)
            results[m].append(r)
            print(f"{m} seed {seed}: last-20 loss {np.mean(r['losses'][-20:]):.4f}, eval "
                  f"{r['eval_loss']:.4f}, {r['seconds']:.0f} s", flush=True)
    summary = summarize(results)
    start = float(np.mean([r["losses"][0] for runs in results.values() for r in runs]))
    print(table(summary, start))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(
            {"args": vars(args), "summary": summary, "runs": results}, indent=1) + "\n")
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
