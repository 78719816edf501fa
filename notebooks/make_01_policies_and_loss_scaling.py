"""Writes notebooks/01_policies_and_loss_scaling.ipynb, executed, with its outputs.

    python notebooks/make_01_policies_and_loss_scaling.py

Edit the cells here, not in the .ipynb, and rerun; tests/test_notebooks.py checks that the
stored notebook is this file's, executed, and executes it again with JAXMP_NOTEBOOK_SMALL=1.
"""
from pathlib import Path

from _nbgen import write

CELLS = [
    ("md", """# Precision policies and loss scaling

Four small experiments, each a few seconds on a CPU:

1. **Policies**: which dtype parameters, computations and outputs use, and per-module overrides.
2. **float16 underflow, made visible**: why small gradients vanish in float16 and how a loss scale brings them back (Micikevicius et al. 2018, "Mixed Precision Training", section 3.2 and figure 3).
3. **Dynamic loss scaling**: how the scale finds its level by growing, backing off and tolerating the odd overflow.
4. **bfloat16 vs float16**, and why the master weights stay in float32 (case MW-1).

All data are synthetic and seeded. With `JAXMP_NOTEBOOK_SMALL=1` (set by the tests) the arrays are smaller."""),
    ("code", """import os

import matplotlib
if "MPLBACKEND" not in os.environ:  # Jupyter sets its inline backend itself; elsewhere draw off-screen
    matplotlib.use("Agg")
import matplotlib.pyplot as plt
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmp
from jaxmp.precision.diagnostics import (DtypeRange, format_report, suggest_loss_scale,
                                         summarize, underflow_report)

SMALL = os.environ.get("JAXMP_NOTEBOOK_SMALL") == "1"
N_GRAD = 20_000 if SMALL else 200_000  # gradient values per synthetic layer
N_STEPS = 400 if SMALL else 1_500      # steps of the loss-scale simulation
rng = np.random.default_rng(0)
print(f"jax {jax.__version__} on {jax.devices()[0].platform}; small={SMALL}")"""),
    ("md", """## 1. Policies

A `jaxmp.Policy` names three dtypes, as in DeepMind's jmp:

* `param_dtype`: the *master weights* the optimizer updates (float32 in mixed precision, so that small updates are not rounded away; section 4 shows why);
* `compute_dtype`: matmuls and activations (bfloat16 or float16: half the memory traffic, tensor-core speed);
* `output_dtype`: what a module hands back (float32 for the loss, so it is summed accurately).

The presets:"""),
    ("code", """for name in jaxmp.PRESETS:
    policy = jaxmp.get_policy(name)
    print(f"{name:>10}: {policy}   needs a loss scale: {policy.needs_loss_scale}")"""),
    ("md", """`get_policy` also reads jmp's grammar: `key=dtype` pairs with keys `params`/`p`, `compute`/`c`, `output`/`o`, or one bare dtype for all three. Keys left out follow jmp's defaults: params float32, compute follows params, **output follows compute**, so `"c=bf16"` returns bfloat16 outputs, which is rarely what you want for a loss."""),
    ("code", """for spec in ["params=float32,compute=bfloat16,output=float32", "p=f32,c=f16,o=f32", "c=bf16", "bf16",
             "half"]:
    print(f"{spec!r:>50} -> {jaxmp.get_policy(spec)}")

policy = jaxmp.get_policy("mixed_bf16")
assert jaxmp.get_policy(str(policy)) == policy  # the string form parses back to the same policy"""),
    ("md", """Casting a parameter tree touches only floating-point leaves; integer state such as a step counter passes through."""),
    ("code", """params = {
    "embed": jnp.ones((8, 4), jnp.float32),
    "block": {"w": jnp.ones((4, 4), jnp.float32), "b": jnp.zeros((4,), jnp.float32)},
    "step": jnp.array(0, jnp.int32),
}
policy = jaxmp.get_policy("mixed_fp16")
compute = policy.cast_to_compute(params)
for (path, before), after in zip(jax.tree_util.tree_leaves_with_path(params),
                                 jax.tree_util.tree_leaves(compute)):
    print(f"{jax.tree_util.keystr(path):>14}: {before.dtype} -> {after.dtype}")"""),
    ("md", """### Per-module rules

Some modules need more precision than the rest: a mixture-of-experts router's softmax decides which expert a token goes to, and normalisation layers sum squares over a whole feature vector (DeepSeek-V3 keeps such components in higher precision, technical report section 3.3). `get_policy_rules("DEFAULT; PATTERN: POLICY; ...")` builds a `PolicyRules`. A module's path is its attribute path joined by `/`; a rule applies when its regular expression is *found anywhere* in the path (`re.search`), and **the first matching rule wins**."""),
    ("code", r"""rules = jaxmp.get_policy_rules("mixed_fp16; router: fp32; norm: fp32")
print(rules, end="\n\n")
for path in ["blocks/0/attn/wq", "blocks/0/attn_norm", "blocks/0/moe/router",
             "blocks/0/moe/experts/w_in", "final_norm", "lm_head"]:
    print(f"{path:>26} -> {rules.resolve(path)}")"""),
    ("md", """Because the first match wins, order matters: put specific patterns before general ones. Below, the router rule is shadowed when the broader `moe` rule comes first. (Note also that `norm` matches `attn_norm` and `final_norm` because it is a substring search; anchor with `(^|/)norm$` when you want exact names.)"""),
    ("code", """specific_first = jaxmp.get_policy_rules("mixed_fp16; moe/router: fp32; moe: mixed_bf16")
general_first = jaxmp.get_policy_rules("mixed_fp16; moe: mixed_bf16; moe/router: fp32")
print(f"{'path':>26}  {'specific first':>14}  {'general first':>13}")
for path in ["blocks/0/moe/router", "blocks/0/moe/experts/w_in", "blocks/0/attn/wq"]:
    a = specific_first.resolve(path).compute_dtype.name
    b = general_first.resolve(path).compute_dtype.name
    print(f"{path:>26}  {a:>14}  {b:>13}")

assert specific_first.resolve("blocks/0/moe/router").compute_dtype == jnp.float32
assert general_first.resolve("blocks/0/moe/router").compute_dtype == jnp.bfloat16  # shadowed"""),
    ("md", """## 2. float16 underflow, made visible

float16 has 5 exponent bits and 10 mantissa bits: its largest value is 65504, its smallest *normal* value is 2^-14 ≈ 6.1e-5 and its smallest *subnormal* value is 2^-24 ≈ 6.0e-8. Gradients are far smaller than the weights they update. Micikevicius et al. (2018, figure 3) plot the activation gradients of an SSD detector trained in float32: a large share lies below 2^-24, while most of float16's representable range above them stays unused. Cast to float16, a value of magnitude up to 2^-25 becomes exactly 0, and values in the subnormal range keep fewer significant bits.

A synthetic stand-in: four layers whose gradient magnitudes are log-normal (log10 |g| normally distributed with standard deviation 1.5, truncated to [-10, -1], so values span 1e-10 to 1e-1), centred at different depths, with random signs."""),
    ("code", """centres = {"embed": -7.5, "attn/wq": -6.0, "mlp/w_in": -5.0, "lm_head": -3.5}  # log10 of a typical |g|


def lognormal_gradients(centre, size):
    log10 = rng.normal(centre, 1.5, 2 * size)
    log10 = log10[(log10 >= -10.0) & (log10 <= -1.0)][:size]  # truncate to [1e-10, 1e-1]
    assert log10.size == size
    return jnp.asarray(rng.choice([-1.0, 1.0], size) * 10.0**log10, jnp.float32)


grads = {name: lognormal_gradients(c, N_GRAD) for name, c in centres.items()}
all_g = np.concatenate([np.asarray(g) for g in grads.values()])
f16 = DtypeRange.of(jnp.float16)
print(f"{all_g.size} gradient values, |g| in [{np.abs(all_g).min():.1e}, {np.abs(all_g).max():.1e}]")
print(f"float16: max {f16.max}, min normal {f16.min_normal:.3g} (2^-14), "
      f"min subnormal {f16.min_subnormal:.3g} (2^-24)")"""),
    ("md", """`underflow_report(grads, dtype, loss_scale)` counts, per leaf, the fraction of non-zero gradients that become 0, subnormal or inf after `(g * S).astype(dtype)`; `summarize` totals them. `suggest_loss_scale` returns the largest power of two that keeps `max|g| * S` below 65504 / 8 (three binades of headroom for growth and spikes)."""),
    ("code", """suggested = suggest_loss_scale(grads, jnp.float16)
scales = {"1": 1.0, "2^8": 2.0**8, "2^15": 2.0**15,
          f"2^{int(np.log2(suggested))} (suggested)": suggested, "2^20 (too big)": 2.0**20}
print(f"{'loss scale S':>20}  {'underflow':>9}  {'subnormal':>9}  {'overflow':>9}")
for label, s in scales.items():
    total = summarize(underflow_report(grads, jnp.float16, s))
    print(f"{label:>20}  {total.underflow:9.2%}  {total.subnormal:9.2%}  {total.overflow:9.2%}")"""),
    ("md", """Per layer, without a loss scale: the deeper the typical gradient, the more of it is lost."""),
    ("code", """print(format_report(underflow_report(grads, jnp.float16, 1.0)))

# Cross-check against NumPy's own float16 cast (round to nearest even, as XLA does).
for s in (1.0, 2.0**15):
    numpy_zero = np.mean((all_g * np.float32(s)).astype(np.float16) == 0)
    jaxmp_zero = summarize(underflow_report(grads, jnp.float16, s)).underflow
    assert abs(numpy_zero - jaxmp_zero) < 1e-12, (s, numpy_zero, jaxmp_zero)"""),
    ("md", """The same data as a histogram of log2 |g|. Multiplying by S = 2^15 shifts the whole histogram 15 binades to the right: most of what fell below 2^-25 now lands in float16's normal range, and the largest values (0.1 · 2^15 ≈ 3277) still sit far below 65504. Multiplying by 2^20 would push the top past 65504."""),
    ("code", """log2_g = np.log2(np.abs(all_g))
bins = np.arange(-36.0, 20.5, 0.5)
fig, ax = plt.subplots(figsize=(11, 4))
ax.axvspan(bins[0], -25, color="red", alpha=0.08, label="becomes 0 in float16 (|x| <= 2^-25)")
ax.axvspan(-25, np.log2(f16.min_normal), color="orange", alpha=0.10, label="float16 subnormal")
ax.hist(log2_g, bins=bins, alpha=0.6, label="true gradients (S = 1)")
ax.hist(log2_g + 15, bins=bins, alpha=0.6, label="scaled by S = 2^15")
ax.axvline(np.log2(f16.min_subnormal), color="red", ls="--", lw=1)
ax.axvline(np.log2(f16.min_normal), color="orange", ls="--", lw=1)
ax.axvline(np.log2(f16.max), color="black", ls="--", lw=1, label="float16 max 65504")
ax.set_xlabel("log2 |g|")
ax.set_ylabel("count")
ax.set_title("Synthetic gradients against float16's range")
ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
fig.tight_layout()
plt.show()"""),
    ("md", """## 3. Dynamic loss scaling

Gradient magnitudes drift during training, so the scale is found online. `jaxmp.DynamicLossScale` follows PyTorch's `GradScaler`, with Megatron-LM's hysteresis:

* **Growth interval**: after this many finite steps in a row, the scale doubles (`growth_factor=2`). Growing probes whether more range is free; a short interval climbs fast but overflows (and skips steps) more often.
* **Backoff**: a step whose gradients contain inf or NaN is *skipped* (parameters and optimizer state stay as they were) and the scale is multiplied by `backoff_factor=0.5`, moving the top of the histogram one binade down.
* **Hysteresis**: the number of overflowing steps tolerated since the last growth before backing off. With `hysteresis=2` a single spiky batch costs one skipped step but not a halving of the scale; the next overflow does halve it (and so does each one after that until the scale grows again).

Simulation: the largest gradient max|g| follows a random walk in log2 space with rare 8x spikes; a step overflows when `max|g| * S > 65504`. The loop is a `jax.lax.scan`, so the loss scale is carried as the pytree a jitted train step would carry."""),
    ("code", """F16_MAX = 65504.0
walk = np.cumsum(rng.normal(0.0, 0.08, N_STEPS))          # slow drift of log2 max|g|
spikes = np.where(rng.random(N_STEPS) < 0.01, 3.0, 0.0)   # rare 8x spikes
max_g = jnp.asarray(2.0 ** (-2.0 + walk + spikes), jnp.float32)


def step(loss_scale, g):
    finite = g * loss_scale.loss_scale <= F16_MAX  # the verdict all_finite(grads) would give
    return loss_scale.adjust(finite), (loss_scale.loss_scale, finite)


scaler = jaxmp.DynamicLossScale(loss_scale=2.0**15, growth_interval=20, hysteresis=2)
final, (scale_hist, finite_hist) = jax.lax.scan(step, scaler, max_g)
scale_hist, finite_hist = np.asarray(scale_hist), np.asarray(finite_hist)
print(f"{np.sum(~finite_hist)} of {N_STEPS} steps overflowed and were skipped; "
      f"scale went 2^15 -> 2^{np.log2(float(final.loss_scale)):.0f}")

# The same rule in plain Python, as a check on what is plotted.
s, good, budget, ref = 2.0**15, 0, 2, []
for g in np.asarray(max_g, np.float64):
    ref.append(s)
    if g * s <= F16_MAX:
        good += 1
        if good == 20:
            s, good, budget = s * 2, 0, 2
    else:
        good, budget = 0, max(budget - 1, 0)
        if budget == 0:
            s = max(s / 2, 1.0)
np.testing.assert_array_equal(scale_hist, np.array(ref, np.float32))"""),
    ("code", """steps = np.arange(N_STEPS)
fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True,
                               gridspec_kw={"height_ratios": [3, 1]})
ax1.plot(steps, F16_MAX / np.asarray(max_g), color="gray", lw=0.8, label="ceiling 65504 / max|g|")
ax1.plot(steps, scale_hist, drawstyle="steps-post", label="loss scale S")
ax1.scatter(steps[~finite_hist], scale_hist[~finite_hist], color="red", marker="x", zorder=3,
            label="overflow: step skipped")
ax1.set_yscale("log", base=2)
ax1.set_ylabel("S")
ax1.legend(fontsize=8)
ax1.set_title("DynamicLossScale(init 2^15, growth_interval=20, hysteresis=2)")
ax2.plot(steps, np.log2(np.asarray(max_g)), lw=0.8)
ax2.set_ylabel("log2 max|g|")
ax2.set_xlabel("step")
plt.show()"""),
    ("md", """Reading the plot: the scale climbs in 20-step stairs until it crosses the ceiling; the first overflow only spends hysteresis (same scale, step skipped), the second halves the scale. The result is a sawtooth within about a binade under the ceiling, which follows the drift of the gradients. A spike overflows once and, thanks to hysteresis, usually leaves the scale alone. Each red cross is a lost step, which is why the growth interval is long (2000 steps in PyTorch) in real training."""),
    ("md", """## 4. bfloat16 vs float16, and master weights (MW-1)

Both formats have 16 bits, split differently. bfloat16 keeps float32's 8 exponent bits, so it covers float32's range (no loss scale needed) but has only 7 mantissa bits; float16 has 3 more mantissa bits and a much narrower range."""),
    ("code", """print(f"{'dtype':>9} {'exp bits':>8} {'mant bits':>9} {'max':>10} {'min normal':>11} "
      f"{'min subnormal':>13} {'eps':>10}")
for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
    fi = jnp.finfo(dtype)
    print(f"{fi.dtype.name:>9} {fi.nexp:>8} {fi.nmant:>9} {float(fi.max):>10.3g} "
          f"{float(fi.tiny):>11.3g} {float(fi.smallest_subnormal):>13.3g} {float(fi.eps):>10.3g}")"""),
    ("md", """The price of bfloat16's range is resolution. Below 1.0 the bfloat16 grid has a step of 2^-8 ≈ 0.0039, so `1 - u` rounds back to 1.0 for any update `u` smaller than half a step, 2^-9 ≈ 0.00195. Adam normalises its update to about `lr` per step, and a typical learning rate of 6e-4 is well under that: **a bfloat16 weight at 1.0 never moves** (case MW-1). float16's grid below 1.0 has a step of 2^-11 ≈ 0.00049, so a float16 weight moves, but by one grid step (4.9e-4) instead of 6e-4. Float32 master weights (Micikevicius et al. 2018, section 3.1) take the update exactly; the bfloat16 copy used for compute then follows in steps.

Below: `optax.adam(6e-4)` with a constant gradient of 1, so every update is `lr` to within float32 rounding, applied to a single weight stored in each dtype."""),
    ("code", """LR, STEPS = 6e-4, 200
optimizer = optax.adam(LR)


def train(w0):
    params = {"w": w0}

    def body(carry, _):
        params, opt_state = carry
        grads = jax.tree.map(jnp.ones_like, params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)  # the sum is rounded to the param dtype
        # Emit the stored value itself: inside one compiled function XLA may drop a
        # bf16 -> f32 round trip (its allow-excess-precision default) and show the unrounded sum.
        return (params, opt_state), params["w"]

    _, ws = jax.lax.scan(body, (params, optimizer.init(params)), length=STEPS)
    return np.asarray(ws.astype(jnp.float32))


w_bf16 = train(jnp.array(1.0, jnp.bfloat16))
w_fp16 = train(jnp.array(1.0, jnp.float16))
w_f32 = train(jnp.array(1.0, jnp.float32))
w_f32_compute = np.asarray(jnp.asarray(w_f32).astype(jnp.bfloat16).astype(jnp.float32))
expected = 1.0 - LR * np.arange(1, STEPS + 1)

print(f"after {STEPS} steps of lr {LR}: expected {expected[-1]:.5f}")
for name, w in [("float32 master", w_f32), ("its bfloat16 copy", w_f32_compute),
                ("float16 weight", w_fp16), ("bfloat16 weight", w_bf16)]:
    print(f"{name:>18}: {w[-1]:.5f}")

assert np.all(w_bf16 == 1.0)                                   # stuck: MW-1
np.testing.assert_allclose(w_f32, expected, atol=1e-5)         # moves as the math says
np.testing.assert_allclose(np.diff(w_fp16[:50]), -2.0**-11)    # one float16 grid step per update"""),
    ("code", """fig, ax = plt.subplots(figsize=(9, 4))
steps = np.arange(1, STEPS + 1)
ax.plot(steps, expected, color="black", lw=3, alpha=0.25, label="exact: 1 - lr * step")
ax.plot(steps, w_f32, label="float32 master weight")
ax.plot(steps, w_f32_compute, drawstyle="steps-post", label="bfloat16 copy of the master (compute)")
ax.plot(steps, w_fp16, ls="--", label="float16 weight")
ax.plot(steps, w_bf16, label="bfloat16 weight (stuck at 1.0)")
ax.set_xlabel("step")
ax.set_ylabel("w")
ax.set_title("Adam, lr 6e-4, constant gradient: where the update survives rounding")
ax.legend(fontsize=8)
plt.show()"""),
    ("md", """## Takeaways

* A policy is three dtypes; per-module rules override it by path, first match wins.
* float16 needs a loss scale: without one, gradients below 2^-25 become 0. A power of two keeps scaling and unscaling exact; `suggest_loss_scale` and `underflow_report` tell you how far to shift.
* A dynamic loss scale settles just under the overflow ceiling; hysteresis keeps one spiky batch from halving it.
* bfloat16 needs no loss scale but rounds away small updates: keep float32 master weights and cast to bfloat16 for compute."""),
]


if __name__ == "__main__":
    write(CELLS, Path(__file__).resolve().with_name("01_policies_and_loss_scaling.ipynb"))
