"""Writes notebooks/05_bf16_master_weights.ipynb (executed, with its outputs).

    python notebooks/make_05_bf16_master_weights.py

Edit the cells here, not in the .ipynb, and rerun; tests/test_notebooks.py executes the
notebook with JAXMP_NOTEBOOK_SMALL=1.
"""
from pathlib import Path

from _nbgen import write

CELLS = [
    ("md", """\
# bfloat16 master weights that still learn

Round to nearest loses every update smaller than half an ulp of the weight: 2^-9 to 2^-8 of |w| in bfloat16. `jaxmp.optim.with_update_rounding` adds the optimizer's updates to bfloat16 parameters by **stochastic rounding** (unbiased; Zamirai et al. 2020, Ozkara et al. AISTATS 2025; counter-based bits, so resumed and resharded runs draw the same ones) or by **Kahan-compensated summation** (a bfloat16 buffer per parameter in the optimizer state; optimi). The trainer takes `precision.policy="pure_bf16; router: fp32; norm: fp32"` and `optim.update_rounding=stochastic|kahan`.

First the toy where round to nearest stalls: w = 1 in bfloat16, a constant gradient of 1 and SGD with learning rate 1e-4, against the float64 trajectory."""),
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

ROOT = next(p for p in [Path.cwd(), *Path.cwd().parents] if (p / "benchmarks" / "update_rounding.py").is_file())
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax
import jax.numpy as jnp
import optax

from jaxmp import NoOpLossScale, optim

SMALL = os.environ.get("JAXMP_NOTEBOOK_SMALL") == "1"
N, STEPS, LR = (256, 100, 1e-4) if SMALL else (4096, 400, 1e-4)


def toy(rounding):
    tx = optim.with_update_rounding(optax.sgd(LR), rounding, seed=0)
    params = {"w": jnp.ones((N,), jnp.bfloat16)}

    def body(carry, _):
        p, s = carry
        out = optim.apply_gradients(tx, {"w": jnp.ones((N,), jnp.float32)}, s, p, NoOpLossScale(),
                                    grads_scaled=False)
        return (out.params, out.opt_state), out.params["w"].astype(jnp.float32)

    _, traj = jax.jit(lambda p, s: jax.lax.scan(body, (p, s), None, length=STEPS))(params, tx.init(params))
    return np.asarray(traj, np.float64)


ref = 1.0 - LR * np.arange(1, STEPS + 1)
fig, ax = plt.subplots(figsize=(7, 3.5))
ax.plot(ref, "k--", label="float64")
for rounding in optim.UPDATE_ROUNDINGS:
    w = toy(rounding)
    ax.plot(w.mean(1), label=f"{rounding} (mean of {N})")
    print(f"{rounding:10s} after {STEPS} steps: mean w = {w[-1].mean():.5f}, float64 {ref[-1]:.5f}, "
          f"largest |w - float64| {np.abs(w[-1] - ref[-1]).max():.5f}")
ax.set_xlabel("step")
ax.set_ylabel("w")
ax.legend()
fig.tight_layout()
plt.show()"""),
    ("md", """\
Round to nearest never moves. Stochastic rounding's *mean* follows float64 (each weight jumps by whole ulps, at the right rate); Kahan's compensation keeps every weight within one bfloat16 ulp of float64.

## tiny_moe, 3 seeds

`benchmarks/update_rounding.py` trains `configs/tiny_moe.py` (with a softmax router, as when it was recorded) with the trainer's own step under `mixed_bf16` (float32 masters) and `pure_bf16` with each rounding, bf16 Adam moments in every mode, at a learning rate of 1e-4 (constant after warm-up), where most Adam steps are below half an ulp of their weight. The recorded result (`benchmarks/update_rounding.json`):"""),
    ("code", """\
from benchmarks import update_rounding as bench

record = json.loads((ROOT / "benchmarks" / "update_rounding.json").read_text())
runs = record["runs"]
start = float(np.mean([r["losses"][0] for rs in runs.values() for r in rs]))
print(bench.table(bench.summarize(runs), start))
display(bench.plot(runs))
plt.close("all")"""),
]


if __name__ == "__main__":
    write(CELLS, Path(__file__).resolve().with_name("05_bf16_master_weights.ipynb"))
