"""Writes notebooks/03_mixed_precision_training.ipynb, executed, with its outputs.

    python notebooks/make_03_mixed_precision_training.py

Edit the cells here, not in the .ipynb, and rerun; tests/test_notebooks.py checks that the
stored notebook is this file's, executed, and executes it again with JAXMP_NOTEBOOK_SMALL=1.
"""
from pathlib import Path

from _nbgen import write

CELLS = [
    ("md", """\
# Mixed-precision training: float32, bfloat16 and float16 side by side

The tiny MoE Transformer of `configs/tiny_moe.py` learns the embedded corpus (the bytes of the
Python standard library's source) with the same seed, data and number of steps in four
precision modes, plus float32 once more with another seed:

| run | default policy | loss scale |
|---|---|---|
| `fp32` | float32 everywhere | none: the reference |
| `mixed_bf16` | float32 master weights, bfloat16 compute | none (bfloat16 has float32's range) |
| `mixed_fp16` | float32 master weights, float16 compute | dynamic |
| `mixed_fp16_noscale` | as `mixed_fp16` | none: what float16 loses without one |
| `fp32_seed1` | float32 everywhere, seed + 1 | none: run-to-run noise |

The per-module rules of the config (`router: fp32; norm: fp32`) stay in every run, so the MoE router and the norms are float32 islands throughout.

We compare the final eval loss against DeepSeek-V3's bar for its FP8 training (technical report, section 3.3: relative loss error below **0.25%**), follow the float16 loss scale and the skipped steps, and measure how many gradient elements float16 would flush to zero without a loss scale.

Everything here calls `benchmarks/fidelity.py`, the script behind `python benchmarks/fidelity.py --json ... --plot ...`; its recorded full-size result is in `benchmarks/README.md`. With `JAXMP_NOTEBOOK_SMALL=1` (set by the tests) the model is smaller and the runs are a few dozen steps: enough to see every mechanism, far too short to judge fidelity."""),
    ("code", """\
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import matplotlib
if "MPLBACKEND" not in os.environ:  # Jupyter sets its inline backend itself; elsewhere draw off-screen
    matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

# Jupyter and the tests start the kernel in notebooks/; benchmarks/ is not installed.
ROOT = next(p for p in [Path.cwd(), *Path.cwd().parents] if (p / "benchmarks" / "fidelity.py").is_file())
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax
from benchmarks import fidelity
from jaxmp.diagnostics import LeafReport, format_report

SMALL = os.environ.get("JAXMP_NOTEBOOK_SMALL") == "1"
config = fidelity.load_config(ROOT / "configs" / "tiny_moe.py")
if SMALL:
    # One MoE block, and XLA's optimization passes off: the tests run this notebook on two
    # CPU cores, where compiling five train steps is most of the time. (Not for real runs:
    # the programs are slower, and fusion decisions can round intermediates differently.)
    jax.config.update("jax_disable_most_optimizations", True)
    config.model.update(dict(num_layers=1, first_dense_layers=0, d_model=32, num_heads=2, d_expert=32,
                             max_len=32))
    config.data.update(dict(seq_len=32, max_tokens=200_000, num_eval_batches=4))
    STEPS, GROWTH_INTERVAL = 60, 10
else:
    config.data.num_eval_batches = 16
    STEPS, GROWTH_INTERVAL = 600, 50
FP16_LOSS_SCALE = f"dynamic:init=2**15,growth_interval={GROWTH_INTERVAL}"

# One device: the comparison does not depend on the device count, and on a CPU one is fastest.
plan = fidelity.plan(config, steps=STEPS, num_devices=1, fp16_loss_scale=FP16_LOSS_SCALE,
                     noise_seeds=1, log_every=1, num_evals=6 if SMALL else 10,
                     underflow_checkpoints=3)
WORKDIR = Path(tempfile.mkdtemp(prefix="jaxmp_nb03_"))
print(f"jax {jax.__version__} on {jax.devices()[0].platform}; small={SMALL}; {STEPS} steps of "
      f"{config.train.batch_size} x {config.data.seq_len} tokens; runs in {WORKDIR}")
for spec in plan.specs:
    cfg = plan.configs[spec.name]
    print(f"{spec.name:>19}: policy {cfg.precision.policy!r:40} loss scale {spec.loss_scale!r}, seed {cfg.seed}")"""),
    ("md", """\
## 1. The runs

`fidelity.train_run` trains one run with the project's trainer (`jaxmp.train.train_and_evaluate`) in its own directory, `WORKDIR/<run>`; the trainer's banner and progress bar go to `train.log` there. The growth interval of the dynamic scale is short here (10 steps at the small size) so that the scale visibly climbs and backs off within a short run; the benchmark's default is 200."""),
    ("code", """\
results = {}
for name in ("fp32", "mixed_bf16"):
    results[name] = fidelity.train_run(plan, name, WORKDIR, quiet=True)"""),
    ("code", """\
for name in ("mixed_fp16", "mixed_fp16_noscale"):
    results[name] = fidelity.train_run(plan, name, WORKDIR, quiet=True)"""),
    ("code", """\
results["fp32_seed1"] = fidelity.train_run(plan, "fp32_seed1", WORKDIR, quiet=True)"""),
    ("md", """\
## 2. Loss curves, read from `metrics.jsonl`

The trainer appends one JSON object per logged step to `WORKDIR/<run>/metrics.jsonl` (`split` is `train` or `eval`); `log_every=1` here, so every step is there. The training loss of one step is the loss of one batch and jumps around; the lines below are exponential moving averages. Eval losses are over the same fixed eval windows in every run."""),
    ("code", """\
metrics = {}
for name in results:
    records = [json.loads(line) for line in (WORKDIR / name / "metrics.jsonl").read_text().splitlines()]
    metrics[name] = {split: [r for r in records if r["split"] == split] for split in ("train", "eval")}
print("one train record of mixed_fp16:", json.dumps(metrics["mixed_fp16"]["train"][-1])[:400], "...")


def ema(x, decay=0.9):
    out, acc = [], None
    for v in x:
        acc = v if acc is None else decay * acc + (1 - decay) * v
        out.append(acc)
    return np.array(out)


fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
for i, (name, m) in enumerate(metrics.items()):
    ax1.plot([r["step"] for r in m["train"]], ema([r["loss"] for r in m["train"]]), color=f"C{i}", lw=1,
             label=name)
    ax1.plot([r["step"] for r in m["eval"]], [r["loss"] for r in m["eval"]], "o--", color=f"C{i}", ms=3, lw=0.6)
ax1.set_xlabel("step")
ax1.set_ylabel("loss (nats/token)")
ax1.set_title("train loss (EMA, lines) and eval loss (dots)")
ax1.legend(fontsize=8)
ref = np.array([r["loss"] for r in metrics["fp32"]["eval"]])
for i, (name, m) in enumerate(metrics.items()):
    if name != "fp32":
        ev = np.array([r["loss"] for r in m["eval"]])
        ax2.plot([r["step"] for r in m["eval"]], 100 * (ev - ref) / ref, "o-", color=f"C{i}", ms=3, label=name)
ax2.axhspan(-25e-2, 25e-2, color="green", alpha=0.12, label="target: within 0.25%")
ax2.axhline(0, color="black", lw=0.6)
ax2.set_xlabel("step")
ax2.set_ylabel("eval loss relative to fp32 (%)")
ax2.set_title("relative difference to float32")
ax2.legend(fontsize=8)
fig.tight_layout()
plt.show()"""),
    ("md", """\
## 3. Final eval loss against the 0.25% bar

`rel_diff = (loss - loss_fp32) / loss_fp32`. The float32 run with the next seed differs from the reference in nothing but its seed (initial weights, data order), so its `rel_diff` is the run-to-run noise: a precision mode whose difference is smaller than that cannot be told apart from float32 by this measurement, whatever side of 0.25% it falls on. (Same-seed runs start identical and drift apart from the first rounding difference, so the noise of the paired comparison is at most this large.)"""),
    ("code", """\
report = fidelity.compare(plan, list(results.values()))
losses, diffs = report["final_eval_loss"], report["rel_diff"]
ref_loss = losses["fp32"]
print(f"{'run':>19}  {'eval loss':>9}  {'vs fp32':>8}  {'skipped':>7}  {'final scale':>11}")
for name, loss in losses.items():
    diff = "" if name == "fp32" else f"{100 * diffs[name]:+.3f}%"
    print(f"{name:>19}  {loss:9.5f}  {diff:>8}  {results[name]['skipped_steps']:7d}  "
          f"{results[name]['final_loss_scale']:11g}")
    if name != "fp32":  # the report's number, recomputed from the two losses
        assert abs(diffs[name] - (loss - ref_loss) / ref_loss) < 1e-12
print()
for name, ok in report["meets_target"].items():
    print(f"{name}: |{100 * diffs[name]:.3f}%| {'<=' if ok else '>'} 0.25% -> target {'met' if ok else 'missed'}")
print(f"run-to-run noise (fp32, seed + 1): {100 * report['noise']:.3f}%")"""),
    ("md", """\
## 4. The float16 loss scale and skipped steps

`DynamicLossScale` doubles the scale after `growth_interval` finite steps in a row and halves it on a step whose gradients contain inf or NaN; that step is skipped (parameters and optimizer state kept bitwise). The trainer logs, per step, the scale the step used (`loss_scale`), whether its gradients were finite (`grads_finite`) and the running count of skipped steps (`skipped_steps`).

The unscaled float16 run skips a step only if its float16 gradients overflow at scale 1, which is rare; its loss is in the silent failure mode: gradients that are too small become zero, and nothing is reported. Section 5 measures how many.

Below, the logged scale is checked against a plain-Python replay of the rule from the logged `grads_finite` sequence (hysteresis 1, the default: every overflow halves)."""),
    ("code", """\
train = metrics["mixed_fp16"]["train"]
steps = np.array([r["step"] for r in train])
scale = np.array([r["loss_scale"] for r in train])
finite = np.array([r["grads_finite"] for r in train])
assert list(steps) == list(range(1, STEPS + 1))  # every step logged

# Replay: doubling after GROWTH_INTERVAL finite steps in a row, halving (not below 1) on overflow.
s, good, replay = 2.0**15, 0, []
for ok in finite:
    replay.append(s)
    if ok:
        good += 1
        if good == GROWTH_INTERVAL:
            s, good = 2 * s, 0
    else:
        s, good = max(s / 2, 1.0), 0
np.testing.assert_array_equal(scale, replay)
assert train[-1]["skipped_steps"] == int(np.sum(~finite)) == results["mixed_fp16"]["skipped_steps"]

fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
ax1.plot(steps, np.log2(scale), drawstyle="steps-post", label="mixed_fp16: loss scale used")
ax1.scatter(steps[~finite], np.log2(scale[~finite]), color="red", marker="x", zorder=3,
            label="overflow: step skipped, scale halved")
ax1.set_ylabel("log2 loss scale")
ax1.set_title(f"DynamicLossScale(init 2^15, growth_interval={GROWTH_INTERVAL})")
ax1.legend(fontsize=8)
for i, name in enumerate(("mixed_fp16", "mixed_fp16_noscale")):
    ax2.plot(steps, [r["skipped_steps"] for r in metrics[name]["train"]], drawstyle="steps-post",
             color=f"C{i + 2}", label=name)
ax2.set_ylabel("skipped steps (cumulative)")
ax2.set_xlabel("step")
ax2.legend(fontsize=8)
fig.tight_layout()
plt.show()
print(f"mixed_fp16: {int(np.sum(~finite))} of {STEPS} steps skipped; scale 2^15 -> 2^{np.log2(scale[-1]):.0f} "
      f"(final logged); mixed_fp16_noscale: {results['mixed_fp16_noscale']['skipped_steps']} skipped")"""),
    ("md", """\
## 5. What float16 flushes to zero without a loss scale

`fidelity.underflow_for` restores the float32 run's checkpoints (plus its initial state, step 0), takes the **true** gradient of the training loss (cross-entropy + MoE auxiliary loss, float32, no scale) on the first eval batch, and hands it to `jaxmp.diagnostics.underflow_report(grads, float16, loss_scale)`: per parameter, the fraction of non-zero elements that become exactly 0 (`underflow`) or lose precision as subnormals (`subnormal`) when cast to float16 (Micikevicius et al. 2018, section 3.2). The float32 run supplies the gradients because nothing has been flushed from them yet: they are what the unscaled float16 run *would* lose at that point of a healthy run.

These are parameter gradients, which the float16 backward pass materializes in float16 before the cast to the float32 master weights; the activation gradients flowing between layers (not shown) are flushed too. Modules whose compute dtype is float32 in the `mixed_fp16` runs (the router and the norms) never see a float16 gradient of their own."""),
    ("code", """\
scaled_at = results["mixed_fp16"]["final_loss_scale"]
underflow = fidelity.underflow_for(plan, WORKDIR, scaled_loss_scale=scaled_at)
checkpoints = underflow["checkpoints"]
modules = underflow["modules"]  # module -> compute dtype in the float16 runs

print(f"share of non-zero gradient elements that float16 flushes to zero at scale 1, by module and step")
print(f"{'module':>28} {'dtype':>8}" + "".join(f"{'step ' + str(c['step']):>11}" for c in checkpoints))
for m, dtype in modules.items():
    print(f"{m:>28} {dtype:>8}" + "".join(f"{100 * c['modules'][m]['underflow']:10.3f}%" for c in checkpoints))
print(f"{'all parameters':>28} {'':>8}" + "".join(f"{100 * c['total']['underflow']:10.3f}%" for c in checkpoints))
print(f"{'... at scale ' + format(scaled_at, 'g'):>28} {'':>8}"
      + "".join(f"{100 * c['total_scaled']['underflow']:10.3f}%" for c in checkpoints))

last = checkpoints[-1]
print(f"\\nstep {last['step']}, scale 1, by module (jaxmp.diagnostics.format_report):")
print(format_report({m: LeafReport(**r) for m, r in last["modules"].items()}, top=None))"""),
    ("code", """\
names = list(modules)
x = np.arange(len(names))
fig, ax = plt.subplots(figsize=(11, 4))
width = 0.8 / len(checkpoints)
for j, c in enumerate(checkpoints):
    ax.bar(x + j * width, [100 * c["modules"][m]["underflow"] for m in names], width,
           label=f"step {c['step']}: zero")
ax.scatter(x + 0.4 - width / 2, [100 * last["modules"][m]["subnormal"] for m in names], color="black",
           marker="_", s=200, zorder=3, label=f"step {last['step']}: subnormal")
ax.set_xticks(x + 0.4 - width / 2)
ax.set_xticklabels([f"{m}\\n({modules[m]})" for m in names], rotation=60, ha="right", fontsize=7)
ax.set_ylabel("% of non-zero gradient elements")
ax.set_yscale("symlog", linthresh=0.01)
ax.set_title("true gradients cast to float16 at scale 1")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()"""),
    ("md", """\
## 6. Everything in one figure, as the benchmark draws it

`fidelity.plot` makes the figure that `python benchmarks/fidelity.py --plot OUT.png` saves: train and eval losses, the eval loss relative to float32 with the 0.25% band, and the float16 loss scale."""),
    ("code", """\
report = fidelity.compare(plan, list(results.values()), underflow)
print(fidelity.format_summary(report))
fig = fidelity.plot(report)
display(fig)
shutil.rmtree(WORKDIR, ignore_errors=True)"""),
    ("md", """\
## Reading the results

* Judge a precision mode against the run-to-run noise as well as against 0.25%. In the benchmark's 2000-step runs of this model (`benchmarks/README.md`), changing only the seed moved the final eval loss by 2.3%, ten times the bar; no precision difference below that can be measured with one run per mode.
* bfloat16 needs no loss scale; float16 with a dynamic scale settles just below the overflow ceiling, paying one skipped step per overflow.
* Without a scale, float16 fails silently: the steps run, the gradients that fall below 2^-24 are zeroed. How much that costs depends on how small the gradients are: the underflow table shows where they are smallest, and the scaled row how much the dynamic scale gives back."""),
]


if __name__ == "__main__":
    write(CELLS, Path(__file__).resolve().with_name("03_mixed_precision_training.ipynb"))
