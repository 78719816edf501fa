"""Writes notebooks/04_fp8_training.ipynb (without outputs).

    python notebooks/make_04_fp8_training.py

Edit the cells here, not in the .ipynb, and rerun; tests/test_notebooks.py executes the
notebook with JAXMP_NOTEBOOK_SMALL=1.
"""
from pathlib import Path

from _nbgen import write

CELLS = [
    ("md", """\
# FP8 training: DeepSeek-V3's fine-grained recipe in pure JAX

`jaxmp.fp8` multiplies FP8 operands with float32 accumulation and applies the scales to the float32 result. Four recipes differ in how many elements share one scale:

| recipe | scales | forward | gradients | source |
|---|---|---|---|---|
| `Recipe.tensorwise()` | one per tensor, from its own amax | E4M3 | E5M2 | Transformer Engine current scaling |
| `Recipe.delayed()` | one per tensor, from the max of an amax history | E4M3 | E5M2 | Transformer Engine `DelayedScaling`, Flax `fp8_ops` |
| `Recipe.rowwise()` | per row of activation / gradient, per output column of the weight | E4M3 | E4M3 | torchao `ROWWISE` |
| `Recipe.blockwise()` | per 1x128 tile of activation / gradient, per 128x128 block of the weight | E4M3 | E4M3 | DeepSeek-V3 report, section 3.3.2 |

The policies `fp8_tensorwise`, `fp8_delayed`, `fp8_rowwise` and `fp8_blockwise` are `mixed_bf16` plus a recipe for the module's matmuls; the embedding, the head, the routers, the norms and the attention core stay in bfloat16/float32 unless a rule names them.

This notebook shows the scales and their edge cases, why block scales survive outliers, the delayed-scaling state, the FP8 dots in the trainer's lowered program, the activation memory, and the recorded result of the fidelity protocol (`benchmarks/fidelity.py`). With `JAXMP_NOTEBOOK_SMALL=1` (set by the tests) the model sizes are smaller."""),
    ("code", """\
import json
import os
import sys
from pathlib import Path

import matplotlib
if "MPLBACKEND" not in os.environ:  # Jupyter sets its inline backend itself; elsewhere draw off-screen
    matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

ROOT = next(p for p in [Path.cwd(), *Path.cwd().parents] if (p / "benchmarks" / "fidelity.py").is_file())
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmp import diagnostics, fp8
from jaxmp.precision.fp8 import E4M3, E5M2, Recipe

SMALL = os.environ.get("JAXMP_NOTEBOOK_SMALL") == "1"
if SMALL:
    jax.config.update("jax_disable_most_optimizations", True)  # compile fast on 2 CPU cores
RECIPES = [Recipe.tensorwise(), Recipe.delayed(history_length=16), Recipe.rowwise(), Recipe.blockwise()]
print(f"jax {jax.__version__} on {jax.devices()[0].platform}; small={SMALL}")
for name, dt in (("E4M3", E4M3), ("E5M2", E5M2)):
    fi = jnp.finfo(dt)
    print(f"{name}: max {float(fi.max):g}, smallest normal {float(fi.tiny):g}, smallest subnormal "
          f"{float(fi.smallest_subnormal):g}, {fi.nmant} mantissa bits")"""),
    ("md", """\
## 1. Scales, saturation and the edge cases

`scale = amax / finfo.max` (448 for E4M3): the largest magnitude lands on the format's maximum, and `q = saturate(x / scale)`. A plain cast would turn 500 into NaN in E4M3 (it has no inf); `quantize` clips finite values to +-448 instead, while inf and NaN stay non-finite so that an overflow upstream still skips the step. An amax of 0, a subnormal, inf or NaN gives scale 1."""),
    ("code", """\
for amax in (8.0, 448.0, 0.0, 1e-40, float("inf"), float("nan")):
    print(f"scale_from_amax({amax!r:>8}) = {float(fp8.scale_from_amax(jnp.float32(amax))):.6g}")
x = jnp.array([500.0, -1e6, 3.0, jnp.inf, jnp.nan])
print("plain cast to E4M3:     ", np.asarray(x.astype(E4M3), np.float32))
print("quantize(x, 1.0, E4M3): ", np.asarray(fp8.quantize(x, jnp.float32(1.0)), np.float32))
print("quantize(x, 1.0, E5M2): ", np.asarray(fp8.quantize(x, jnp.float32(1.0), E5M2), np.float32))
q, s = fp8.quantize_blocks(jnp.arange(12.0).reshape(3, 4) - 5, (2, 2))
print("2x2 block scales of a 3x4 array (ragged last block row):", s.shape, "\\n", np.asarray(s) * 448)"""),
    ("md", """\
## 2. Why block scaling beats per-tensor scaling on a tensor with outliers

One scale per tensor lets a single outlier set it for every element: under the scale `2**19 / 448`, the value 1.0 becomes `0.44 * 2**-9`, below half of E4M3's smallest subnormal, and is flushed to zero. Per-row scales confine the damage to the outlier's row, 1x128 tiles to its tile. `jaxmp.diagnostics.fp8_quantization` counts it; the second example is a realistic activation: Gaussian values with a few channels 100x larger (the outlier features of large Transformers)."""),
    ("code", """\
one = jnp.ones((256, 256)).at[0, 0].set(2.0 ** 19)
key = jax.random.key(0)
act = jax.random.normal(key, (512, 1024))
act = act.at[:, jnp.array([7, 300, 901])].multiply(100.0)  # three outlier channels
rows = []
for label, t in (("ones + one outlier", one), ("gaussian + 3 outlier channels", act)):
    for r in RECIPES:
        rep = diagnostics.fp8_quantization(t, r)
        rows.append((label, str(r), rep))
        print(f"{label:>30} {str(r):>14}: zero {100 * rep.underflow:7.3f}%  subnormal {100 * rep.subnormal:6.2f}%  "
              f"saturated {100 * rep.saturated:.3f}%  rel. error {100 * rep.rel_error:.3f}%")
fig, ax = plt.subplots(figsize=(8, 3.5))
labels = [str(r) for r in RECIPES]
for i, label in enumerate(("ones + one outlier", "gaussian + 3 outlier channels")):
    ax.bar(np.arange(len(labels)) + 0.4 * i, [100 * rep.underflow + 1e-4 for l, _, rep in rows if l == label],
           0.4, label=label)
ax.set_xticks(np.arange(len(labels)) + 0.2)
ax.set_xticklabels(labels)
ax.set_yscale("log")
ax.set_ylabel("% of non-zero elements flushed to zero")
ax.set_title("E4M3 activation quantization (delayed at its best: the current amax)")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()"""),
    ("md", """\
## 3. An FP8 matmul and its gradients

`fp8.dot(x, w, recipe)` takes bfloat16 activations and the float32 master weight and returns bfloat16; its custom VJP computes `dx = g @ w.T` and `dw = x.T @ g` as FP8 products too (`dw` in float32). On the outlier activation, the relative error of each product against float64 shows the same order as above."""),
    ("code", """\
m, k, n = (128, 512, 256) if SMALL else (512, 1024, 1024)
xb = act[:m, :k].astype(jnp.bfloat16)
w = jax.random.normal(jax.random.key(1), (k, n)) * 0.02
g = (jax.random.normal(jax.random.key(2), (m, n)) * 1e-3).astype(jnp.bfloat16)
x64, w64, g64 = (np.asarray(v, np.float64) for v in (xb, w, g))
exact = (x64 @ w64, g64 @ w64.T, x64.T @ g64)
for r in RECIPES:
    state = fp8.init_state(r)
    if state is not None:  # a history as after a step on these inputs
        state = state.at[:, 0].set(jnp.array([jnp.max(jnp.abs(xb.astype(jnp.float32))), jnp.max(jnp.abs(w)),
                                              jnp.max(jnp.abs(g.astype(jnp.float32)))]))
    y, vjp = jax.vjp(lambda a, b: fp8.dot(a, b, r, state), xb, w)
    dx, dw = vjp(g)
    errs = [np.linalg.norm(np.asarray(v, np.float64) - e) / np.linalg.norm(e) for v, e in zip((y, dx, dw), exact)]
    print(f"{str(r):>14}: relative error  y {100 * errs[0]:.3f}%  dx {100 * errs[1]:.3f}%  dw {100 * errs[2]:.3f}%  "
          f"(dtypes {y.dtype}, {dx.dtype}, {dw.dtype})")"""),
    ("md", """\
## 4. Delayed scaling: the amax history as a pure state

Under `Recipe.delayed(history_length)` each `fp8.dot` has a float32 `[3, history_length]` state (activation, weight and gradient amax, newest first). The gradient's amax is only known in the backward pass, so the updated history comes back as the *cotangent* of the state (Flax's "overwrite with gradient"): `jax.grad` with respect to the state gives its new value. Micro-batches of one step are combined by `fp8.merge_states` (elementwise max): with activation amaxes 1, 8, 2, 1 the newest entry is 8, not the last 1 (case FP8-1), and the next step's scale is 8/448."""),
    ("code", """\
recipe = Recipe.delayed(history_length=4)
w4 = jnp.ones((4, 3), jnp.float32)
state = fp8.init_state(recipe)

def new_state(state, x):
    return jax.grad(lambda s: jnp.sum(fp8.dot(x, w4, recipe, s).astype(jnp.float32)))(state)

acc = jnp.full_like(state, -jnp.inf)
for a in (1.0, 8.0, 2.0, 1.0):  # four micro-batches of one step
    acc = fp8.merge_states(acc, new_state(state, jnp.full((2, 4), a, jnp.bfloat16)))
print("activation history after the step:", np.asarray(acc[0]))
print("next scale:", float(fp8.scale_from_amax(jnp.max(acc[0]))), "= 8/448 =", 8 / 448)
for a in (3.0, 0.5, 0.5, 0.5, 0.5):  # five more steps: the 8 falls out of the 4-step window
    acc = new_state(acc, jnp.full((2, 4), a, jnp.bfloat16))
    print(f"step with amax {a}: history {np.asarray(acc[0])}, scale {float(fp8.scale_from_amax(jnp.max(acc[0]))):.5f}")"""),
    ("md", """\
## 5. The model under FP8 policies: which matmuls are FP8, and are they FP8 in the program?

A forward pass given `operands={}` records every weight matmul's operands in it; `diagnostics.fp8_report` compares the recipes per module. Then the trainer's own step is lowered and its `dot_general` ops are counted (case FP8-2): under `fp8_blockwise` every weight matmul of attention and the FFNs becomes three dots with two FP8 operands (forward, `dx`, `dw`), and only the head, the router, the attention core and the gate-weighted sums keep bfloat16/float32 dots."""),
    ("code", """\
from jaxmp.analysis.hlo import count_fp8_dots, stablehlo_dots
from jaxmp.train import Experiment
from jaxmp.train.config import load_config

SIZE = ["model.d_model=32", "model.num_heads=2", "model.d_ff=64", "model.d_expert=32", "model.max_len=32",
        "data.seq_len=32", "data.max_tokens=60000", "data.num_eval_batches=1"] if SMALL else []


def tiny_moe(policy="mixed_bf16"):
    return load_config(ROOT / "configs" / "tiny_moe.py",
                       SIZE + [f"precision.policy={policy}; router: fp32; norm: fp32"])


config = tiny_moe()
exp = Experiment.create(config, num_devices=1)
batch = exp.data.eval_batches[0]
model = exp.host_model(jax.device_get(exp.init_state()))
operands = {}
model(jnp.asarray(batch["inputs"][:4]), operands=operands)
report = diagnostics.fp8_report(operands, RECIPES[:1] + RECIPES[2:])
print(diagnostics.format_fp8_report({k: v for k, v in report.items() if k.startswith("blocks/1")}))

policies = ["mixed_bf16", "fp8_blockwise"] + ([] if SMALL else ["mixed_bf16; experts: fp8_blockwise; mlp: fp8_blockwise"])
for policy in policies:
    e = Experiment.create(tiny_moe(policy), num_devices=1)
    text = e.train_step.lower(e.abstract_state, e.abstract_batch()).as_text()
    f8, other = count_fp8_dots(text)
    kinds = sorted({(d.lhs, d.rhs) for d in stablehlo_dots(text) if not d.fp8})
    print(f"{policy!r:>58}: {f8:3d} FP8 dots, {other:3d} others {kinds}")"""),
    ("md", """\
## 6. Activation memory

`python -m jaxmp.report` counts the residuals the loss's forward pass keeps for the backward pass. An FP8 matmul keeps its FP8 activation and float32 scales (1 byte per element plus a scale per row or tile) instead of a bfloat16 copy; the weight's FP8 copy is not kept but quantized again from the float32 master in the backward pass. The SwiGLU nonlinearity, the softmax and the residual stream keep their bfloat16/float32 activations, so the total moves much less than the matmul inputs."""),
    ("code", """\
from jaxmp.analysis import accounting

modes = ["mixed_bf16", "fp8_blockwise"] if SMALL else ["mixed_bf16", "fp8_tensorwise", "fp8_rowwise", "fp8_blockwise"]
acct = accounting.accounting_report(config, modes, 1, breakdown=40)
for mode in modes:
    row = acct["modes"][mode]
    f8 = sum(b["bytes"] for b in acct["details"][mode]["breakdown"] if b["dtype"].startswith("float8"))
    print(f"{mode:>15}: activations {row['activation_bytes']:>10,} B, of which FP8 {f8:>9,} B")"""),
    ("md", """\
## 7. The fidelity protocol's recorded result

`benchmarks/fidelity.py` trains `configs/fidelity.py` with 5 seeds in every mode and compares each mode with its reference seed by seed: mixed_bf16 and both float16 runs against fp32, each FP8 recipe against mixed_bf16 (as DeepSeek-V3 compares FP8 with BF16). The goal for mixed_bf16, mixed_fp16 and fp8_blockwise is a mean relative difference of the final eval loss within 0.25% **and** a 95% t-interval no wider than +-0.25%. The full run is recorded in `benchmarks/fidelity.json` (command, commit and machine in `benchmarks/README.md`); its table and figure:"""),
    ("code", """\
from benchmarks import fidelity

recorded = json.loads((ROOT / "benchmarks" / "fidelity.json").read_text())
command = recorded["setup"]["command"].split()
for flag in ("--json", "--plot"):  # output files: their names, not the recording machine's paths
    if flag in command:
        command[command.index(flag) + 1] = Path(command[command.index(flag) + 1]).name
print(" ".join(command))
print(fidelity.format_summary(recorded))
fig = fidelity.plot(recorded)
display(fig)"""),
]


if __name__ == "__main__":
    write(CELLS, Path(__file__).resolve().with_name("04_fp8_training.ipynb"))
