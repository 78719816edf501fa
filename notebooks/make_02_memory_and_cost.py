"""Writes notebooks/02_memory_and_cost.ipynb, executed, with its outputs.

    python notebooks/make_02_memory_and_cost.py

Edit the cells here, not in the .ipynb, and rerun; tests/test_notebooks.py checks that the
stored notebook is this file's, executed, and executes it again with JAXMP_NOTEBOOK_SMALL=1.
"""
from pathlib import Path

from _nbgen import write

CELLS = [
    ("md", """\
# Memory and cost: the article's tables, measured and corrected

The DeepSeek mixed-precision article this project started from (a blog post on DeepSeek-style FP32 master weights, FP16/BF16 compute and compressed gradients; "the article" below) prints, for a 67e9-parameter model, how much memory mixed precision saves (its section 2.1) and how much less gradient traffic 16-bit and top-k-sparsified gradients need (its section 2.3). Most of those figures do not hold. This notebook

1. recomputes the memory table from first principles (`jaxmp.analysis.article.memory_table`) and draws it beside the article's figures,
2. does the same for gradient communication (`jaxmp.analysis.article.communication_table`), including how top-k sparsification scales with the number of devices,
3. puts DeepSeek-V3's published GPU-hours beside the cost model (`jaxmp.analysis.cost`) and solves for the utilization they imply,
4. measures what each precision mode really costs for the tiny MoE model of `configs/tiny_moe.py`, from the program JAX builds for the train step (`jaxmp.analysis.accounting`).

GB means 1e9 bytes, as in the article. Sections 1 to 3 are arithmetic and take moments; section 4 traces and compiles the train step once per mode."""),
    ("code", """\
import os
import sys
from pathlib import Path

# Section 4 lays the train step out over 8 data-parallel devices; on a CPU, XLA makes that many
# host devices only if asked before JAX starts its backend (the tests ask already).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import matplotlib
if "MPLBACKEND" not in os.environ:  # Jupyter sets its inline backend itself; elsewhere draw off-screen
    matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from jaxmp.analysis import accounting, article, cost
from jaxmp.analysis.report import cost_report
from jaxmp.train.config import load_config

# Jupyter and the tests start the kernel in notebooks/; the configs live at the repo root.
ROOT = next(p for p in [Path.cwd(), *Path.cwd().parents] if (p / "configs" / "tiny_moe.py").is_file())
SMALL = os.environ.get("JAXMP_NOTEBOOK_SMALL") == "1"
GB = 1e9
P = article.ARTICLE_PARAMS
print(f"seed model: {P:.3g} parameters; small={SMALL}")"""),
    ("md", """\
## 1. Training memory of a 67e9-parameter model

Static training memory is bytes per parameter times the parameter count. With Adam, float32 training holds the weights, the gradients and two moments: 4 + 4 + 4 + 4 = 16 bytes per parameter. Mixed precision as Micikevicius et al. (2018, section 3.1) and ZeRO (Rajbhandari et al. 2020, section 3.1) describe it keeps float32 *master* weights and float32 moments, and adds 16-bit copies of the weights and gradients: 2 + 2 + 4 + 4 + 4 = 16 bytes, **no less**. DeepSeek-V3 (technical report, section 3.3.3) stores the Adam moments in bfloat16 and gets 4 + 4 + 2 + 2 = 12. What mixed precision does halve is the activations kept for the backward pass, which grow with batch, sequence length, width and depth, and which the article's table leaves out."""),
    ("code", """\
mem = article.memory_table()
print(f"{'':7}{'item':58} {'computed':>10}  {'seed':>18}")
for r in mem:
    computed = f"{r.bytes / GB:,.0f} GB" if r.bytes is not None else f"{r.fraction:.0%}"
    print(f"[{r.status:5}] {r.item:58} {computed:>10}  {r.article or '-':>18}")

# The same numbers by hand, in bytes per parameter.
by_hand = {"FP32 parameters": 4, "FP16 + FP32 parameter copies": 2 + 4, "FP32 training, Adam": 4 + 4 + 4 + 4,
           "mixed precision, Adam (Micikevicius 2018; ZeRO sec. 3.1)": 2 + 2 + 4 + 4 + 4,
           "DeepSeek-V3 (report sec. 3.3.3)": 4 + 4 + 2 + 2}
for r in mem:
    if r.item in by_hand:
        assert r.bytes == by_hand[r.item] * P, r.item"""),
    ("md", """\
The article's figures, read as numbers: "2.68 TB" for the float32 weights; "132+132 GB" for the 16- and 32-bit copies; "40-60% less memory" from mixed precision, i.e. 40% to 60% of float32 training's 1,072 GB. The transcription is checked against the strings `jaxmp.analysis.article` quotes."""),
    ("code", """\
fp32_states = by_hand["FP32 training, Adam"] * P
claims = {  # item -> (low, high) bytes the article's figure stands for
    "FP32 parameters": ("2.68 TB", 2.68e12, 2.68e12),
    "FP16 + FP32 parameter copies": ("132+132 GB", 264e9, 264e9),
    "mixed precision, Adam (Micikevicius 2018; ZeRO sec. 3.1)": ("40-60% less memory", 0.4 * fp32_states, 0.6 * fp32_states),
    "DeepSeek-V3 (report sec. 3.3.3)": ("40-60% less memory", 0.4 * fp32_states, 0.6 * fp32_states),
}
rows = [r for r in mem if r.bytes is not None]
for r in rows:
    if r.item in claims:
        assert r.article == claims[r.item][0], (r.item, r.article)

labels = [r.item.replace(" (", "\\n(") for r in rows]
y = np.arange(len(rows))
fig, ax = plt.subplots(figsize=(10, 4.8))
ax.barh(y + 0.2, [r.bytes / GB for r in rows], 0.4, label="computed", color="C0")
for i, r in enumerate(rows):
    if r.item in claims:
        _, lo, hi = claims[r.item]
        ax.barh(y[i] - 0.2, (hi - lo) / GB if hi > lo else lo / GB, 0.4, left=lo / GB if hi > lo else 0,
                color="C3", alpha=0.6, label="the article's figure (a range for '40-60% less')" if i == 0 else None)
        ax.text(max(hi, r.bytes) / GB + 30, y[i], r.status, va="center", fontsize=8,
                color="C3" if r.status == "WRONG" else "C2")
ax.set_yticks(y)
ax.set_yticklabels(labels, fontsize=8)
ax.invert_yaxis()
ax.set_xlabel("GB (1e9 bytes), whole model, unsharded")
ax.set_title("Training memory of a 67e9-parameter model: computed vs the article")
ax.legend(fontsize=8, loc="lower right")
fig.tight_layout()
plt.show()"""),
    ("md", """\
## 2. Gradient communication per step

In data parallelism every device sends and receives its gradients once per step. A ring all-reduce moves 2(N-1)/N times the buffer through each device (Patarasuk and Yuan 2009), so 16-bit gradients do halve the traffic, as the article says. Its top-k claim ("cuts it to 30%") forgets two things: each kept value needs an index (4 bytes as int32), and different devices keep different entries, so the sparse lists cannot be summed in place along a ring; they are all-gathered, and every device receives N-1 of them."""),
    ("code", """\
N = 8
comm_rows = article.communication_table(N)
print(f"{N} devices, bytes per parameter sent per device per step")
for r in comm_rows:
    print(f"[{r.status:5}] {r.item:68} {r.bytes_per_param:6.2f} B/param  "
          f"{r.fraction:5.0%} of {r.baseline:30} article: {r.article or '-'}")

ring = 2 * (N - 1) / N
by_hand = [ring * 4, ring * 2, ring * 0.3 * (2 + 4), ring * 0.3 * (4 + 4), (N - 1) * 0.3 * (2 + 4)]
np.testing.assert_allclose([r.bytes_per_param for r in comm_rows], by_hand, rtol=1e-12)

# What the article's claim would make of each row: half of FP32, or 30% of the dense baseline.
claimed = [None, 0.5 * by_hand[0], 0.3 * by_hand[1], 0.3 * by_hand[0], 0.3 * by_hand[1]]
fig, ax = plt.subplots(figsize=(10, 4))
y = np.arange(len(comm_rows))
ax.barh(y + 0.2, by_hand, 0.4, color="C0", label="computed")
ax.barh(y - 0.2, [c or 0 for c in claimed], 0.4, color="C3", alpha=0.6, label="what the article's claim implies")
ax.set_yticks(y)
ax.set_yticklabels([r.item.replace(", ", ",\\n", 1) for r in comm_rows], fontsize=8)
ax.invert_yaxis()
ax.set_xlabel(f"bytes per parameter per device per step (N = {N})")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()"""),
    ("md", """\
How the all-gathered top-k grows with the number of devices, against the dense rings (whose per-device traffic approaches 2x the buffer): it costs more than the dense **float32** ring as soon as (N-1) x 0.3 x 6 > 2(N-1)/N x 4, i.e. for N > 8 / 1.8 = 4.4 devices."""),
    ("code", """\
ns = np.array([2, 3, 4, 5, 8, 16, 32, 64, 128])
tables = {n: article.communication_table(int(n)) for n in ns}
series = {name: [tables[n][i].bytes_per_param for n in ns] for i, name in enumerate(
    ["FP32 ring", "16-bit ring", "top-k 30%, 16-bit + idx, same indices (ring)", "top-k 30%, FP32 + idx (ring)",
     "top-k 30%, 16-bit + idx, all-gather"])}
fig, ax = plt.subplots(figsize=(9, 4.5))
for name, values in series.items():
    ax.plot(ns, values, marker="o", ms=3, label=name)
ax.plot(ns, 0.3 * np.array(series["16-bit ring"]), ls="--", color="black", lw=1, label="the article's '30%' of the 16-bit ring")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("data-parallel devices N")
ax.set_ylabel("bytes per parameter per device per step")
ax.legend(fontsize=8)
plt.show()

crossing = ns[np.argmax(np.array(series["top-k 30%, 16-bit + idx, all-gather"]) > np.array(series["FP32 ring"]))]
assert crossing == 5 and 8 / 1.8 < 5  # the first N in the sweep above 4.44"""),
    ("md", """\
## 3. What does training cost? DeepSeek-V3's published GPU-hours against the cost model

`jaxmp.analysis.cost` uses the usual model: training FLOPs ≈ 6 x active parameters x tokens (Kaplan et al. 2020, section 2.1) plus 6 x layers x sequence length x width per token for causal attention, and time = FLOPs / (GPUs x dense peak x MFU), where MFU (model FLOPs utilization, PaLM appendix B) is the share of the peak the model's FLOPs achieve. DeepSeek-V3 publishes 2.664M H800 GPU-hours for pre-training on 14.8T tokens with 37e9 active of 671e9 parameters (technical report, Table 1); solving for the MFU says how efficiently those hours were used."""),
    ("code", """\
rep = cost_report()
pub, est = rep["published"], rep["estimate"]
pre = pub["gpu_hours"]["pre-training"]
print(f"published pre-training: {pre / 1e6:.3f}M GPU-hours on {pub['num_gpus']} {pub['hardware']} "
      f"= {pub['pretraining_days']:.1f} days")
print(f"estimate at MFU {est['mfu']:.0%} of the bf16 peak: {est['gpu_hours'] / 1e6:.3f}M GPU-hours "
      f"({rep['estimate_over_published']:.2f}x published), {est['days']:.1f} days")
for r in rep["implied_mfu"]:
    print(f"implied MFU with FLOPs = {r['flops_formula']:10}: {r['bf16']:.1%} of the bf16 peak, "
          f"{r['fp8']:.1%} of the fp8 peak")

# By hand: 6 N D / (GPU-seconds x peak), H800 dense bf16 peak 989.4 TFLOP/s.
flops_6nd = 6 * 37e9 * 14.8e12
assert abs(rep["implied_mfu"][0]["bf16"] - flops_6nd / (2664e3 * 3600 * 989.4e12)) < 1e-12"""),
    ("code", """\
mfus = np.linspace(0.1, 0.6, 51)
attn = dict(num_layers=cost.DEEPSEEK_V3.num_layers, seq_len=cost.DEEPSEEK_V3.seq_len,
            d_model=cost.DEEPSEEK_V3.d_model)
run = cost.DEEPSEEK_V3
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 2]})
for dtype, color in (("bf16", "C0"), ("fp8", "C1")):
    hours = [cost.estimate(run.total_params, run.active_params, run.tokens, dtype=dtype, mfu=float(m),
                           **attn).gpu_hours / 1e6 for m in mfus]
    ax1.plot(100 * mfus, hours, color=color, label=f"estimate, MFU of the dense {dtype} peak")
    implied = rep["implied_mfu"][1][dtype]
    ax1.scatter([100 * implied], [pre / 1e6], color=color, zorder=3)
    ax1.annotate(f"{implied:.1%}", (100 * implied, pre / 1e6), textcoords="offset points", xytext=(5, 8),
                 color=color)
ax1.axhline(pre / 1e6, color="black", ls="--", lw=1, label="published pre-training 2.664M")
ax1.set_xlabel("MFU (%)")
ax1.set_ylabel("GPU-hours (millions)")
ax1.set_yscale("log")
ax1.set_title("DeepSeek-V3 pre-training: estimate vs published (FLOPs = 6ND + 6LTd)")
ax1.legend(fontsize=8)
stages = {k: v for k, v in pub["gpu_hours"].items() if k != "total"}
ax2.bar(list(stages), [v / 1e6 for v in stages.values()], color="C2")
for i, v in enumerate(stages.values()):
    ax2.text(i, v / 1e6, f"{v / 1e6:.3f}M", ha="center", va="bottom", fontsize=8)
ax2.set_ylabel("GPU-hours (millions)")
ax2.set_title(f"published, total {pub['gpu_hours']['total'] / 1e6:.3f}M H800 GPU-hours")
fig.tight_layout()
plt.show()"""),
    ("md", """\
DeepSeek-V3 ran most of its matrix multiplications in FP8 but kept others in BF16 (report, section 3.3), so its true utilization lies between the two implied figures above; neither is a measurement of the hardware, both follow from the published hours and the FLOP count."""),
    ("md", """\
## 4. Measured: what each precision mode costs the tiny MoE model

Sections 1 and 2 are formulas. `jaxmp.analysis.accounting` reads the same quantities from the program JAX and XLA build for the trainer's own train step (`Experiment.train_step`, the function `train.py` runs), under abstract evaluation, so nothing is allocated. Per device, on an 8-device data-parallel mesh:

* **params, grads, optimizer state**: the train state as stored (float32 master weights in every mode; Adam moments in float32, or bfloat16 in `bf16_moments` as DeepSeek-V3 does);
* **top-k residual**: the error-feedback buffer that top-k sparsification keeps per device;
* **activations**: the arrays the forward pass of the loss saves for the backward pass, at the per-device micro-batch, listed from the traced `jax.vjp`;
* **grad reduction**: bytes of the gradient collectives per step (all-reduce; reduce-scatter under `zero1`/`fsdp`), read from the HLO after XLA's SPMD partitioner (traffic, not memory).

This is the table `python -m jaxmp.report --config configs/tiny_moe.py --json OUT` prints. At the small size (`JAXMP_NOTEBOOK_SMALL=1`) the model is shrunk to one MoE block of width 32 and sequences of 32 tokens, and five of the modes are accounted (fp32, mixed_bf16, bf16_moments, bf16_allreduce, pure_bf16_kahan: each mode is one compile of the train step; `tests/test_accounting.py` checks all of them)."""),
    ("code", """\
config = load_config(ROOT / "configs" / "tiny_moe.py")
if SMALL:
    config.model.update(dict(num_layers=1, first_dense_layers=0, d_model=32, num_heads=2, d_expert=32, max_len=32))
    config.data.seq_len = 32
SMALL_MODES = ["fp32", "mixed_bf16", "bf16_moments", "bf16_allreduce", "pure_bf16_kahan"]
acc = accounting.accounting_report(config, SMALL_MODES if SMALL else None, num_devices=8)
print(accounting.format_accounting(acc, "configs/tiny_moe.py" + (" (shrunk)" if SMALL else "")))

# By hand: float32 master weights are 4 bytes per parameter, replicated on every device (the
# pure_bf16 modes keep bfloat16 weights, 2 bytes, with float32 routers and norms); gradients are
# float32 under every mode; Adam's two moments are 8 bytes per parameter in float32 and 4 in
# bfloat16, plus a few step counters.
n_params = acc["model"]["params"]
modes = acc["modes"]
for mode, r in modes.items():
    assert r["grads_bytes"] == 4 * n_params, mode
    if mode.startswith("pure_bf16"):
        assert 2 * n_params < r["params_bytes"] < 4 * n_params, mode
    else:
        assert r["params_bytes"] == 4 * n_params, mode
counters = modes["fp32"]["opt_state_bytes"] - 8 * n_params
assert 0 <= counters < 64 and modes["bf16_moments"]["opt_state_bytes"] == 4 * n_params + counters
assert all(r["total_bytes"] == sum(r[k] for k in accounting.MEMORY_KEYS) for r in modes.values())"""),
    ("code", """\
parts = [("params_bytes", "params (master weights)"), ("grads_bytes", "grads"), ("opt_state_bytes", "Adam moments"),
         ("comm_state_bytes", "top-k residual"), ("activation_bytes", "activations")]
names = list(modes)
y = np.arange(len(names))
MiB = 2**20
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [3, 2]})
left = np.zeros(len(names))
for i, (key, label) in enumerate(parts):
    widths = np.array([modes[m][key] for m in names]) / MiB
    ax1.barh(y, widths, left=left, color=f"C{i}", label=label)
    left += widths
fp32_total = modes["fp32"]["total_bytes"] / MiB
ax1.axvspan(0.4 * fp32_total, 0.6 * fp32_total, color="red", alpha=0.12,
            label="the article's '40-60% less memory' than fp32")
ax1.set_yticks(y)
ax1.set_yticklabels(names)
ax1.invert_yaxis()
ax1.set_xlabel("MiB per device")
ax1.set_title("memory per device, measured from the train step")
ax1.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3)
traffic = np.array([modes[m]["grad_allreduce_bytes"] for m in names]) / MiB
ax2.barh(y, traffic, color="C5")
for i, m in enumerate(names):
    ax2.text(traffic[i], y[i], f" {traffic[i] / traffic[0]:.2f}x fp32", va="center", fontsize=8)
ax2.set_yticks(y)
ax2.set_yticklabels(names)
ax2.invert_yaxis()
ax2.set_xlabel("MiB per device per step")
ax2.set_title("gradient collectives (HLO after SPMD partitioning)")
ax2.set_xlim(0, 1.35 * traffic.max())
fig.tight_layout()
plt.show()

for m in names:
    r = modes[m]
    print(f"{m:>15}: total {r['total_bytes'] / modes['fp32']['total_bytes']:.0%} of fp32, "
          f"activations {r['activation_bytes'] / modes['fp32']['activation_bytes']:.0%} of fp32's")"""),
    ("md", """\
## Takeaways

* Mixed precision with Adam does not shrink the *static* training state: float32 master weights and moments stay, and 16-bit copies come on top (section 1). DeepSeek-V3's bfloat16 moments cut it by a quarter.
* The saving is in activations: jaxmp's float32 islands (routers, norms, softmax, the loss) compute in float32 but save only compute-dtype tensors plus per-row float32 statistics, and the backward pass re-casts weights from the float32 masters instead of keeping 16-bit copies; integer routing state does not shrink (section 4 measures the share).
* 16-bit gradients halve the bytes of a ring all-reduce; top-k sparsification with indices does not cut traffic to 30%, and gathered across devices it grows with their number (section 2). The measured collectives of the tiny model (section 4) are what XLA's partitioned program actually sends; see `jaxmp.analysis.accounting` for how they are counted.
* DeepSeek-V3's published hours imply a utilization in the tens of percent of the dense peak (section 3); the cost model with an assumed MFU lands in the same range."""),
]


if __name__ == "__main__":
    write(CELLS, Path(__file__).resolve().with_name("02_memory_and_cost.ipynb"))
