"""The GPU measurement in one command, sized for a short window on one H200.

Usage::

    python benchmarks/gpu_suite.py --out gpu_suite            # one H200: gpu_suite.json + gpu_suite.md
                                                              # (+ gpu_suite_autotune.textproto)
    python benchmarks/gpu_suite.py --toy --out /tmp/suite     # any machine (CPU): toy sizes, end to end

It runs, in this order, and writes one JSON (everything measured) and one markdown
table (one row per figure, with its target and verdict):

1. ``matmul``: square-matmul TFLOP/s of bfloat16, float16 and float32 at JAX's default
   precision (TF32 on Ampere and newer) with ``benchmarks/matmul.py`` (random non-zero
   inputs, a ring of input pairs, warm-up, ``block_until_ready``, median of 10), against
   the dense datasheet peak of :data:`jaxmp.analysis.cost.HARDWARE`; plus one row per
   FP8 recipe of ``jaxmp.fp8`` when that module exists on the commit (``jaxmp.fp8.dot``
   of a bfloat16 ``x`` and a float32 ``w``, against the FP8 peak).
2. ``fp8_kernels``: the blockwise FP8 GEMMs as Pallas Mosaic GPU kernels
   (``Recipe.blockwise("pallas")``), dense and grouped. Correctness first: the value and
   both gradients of ``jaxmp.fp8.dot`` and ``jaxmp.fp8.grouped_dot`` (one group empty)
   against the XLA reference (``Recipe.blockwise("xla")``), within float32 rounding; a
   kernel that fails is not timed. Then the GEMMs alone on quantized operands, kernel and
   reference: the dense one at 4096^3 against the FP8 dense peak (target: 60%), the
   grouped forward and weight gradient at ``configs/bench_h200.py``'s routed-expert sizes.
   Off a GPU the kernels run interpreted (checked, not timed).
3. ``attention``: forward + backward of the attention core
   (:func:`jaxmp.models.attention.attention_core`) at ``configs/bench_h200.py``'s sizes,
   each path that runs here (reference, xla, cudnn): ms, the largest difference from the
   reference's output and gradients, and the bytes each keeps for the backward pass.
4. ``moe_dispatch``: forward + backward of the routed experts
   (:class:`jaxmp.models.RoutedExperts`) at ``configs/bench_h200.py``'s sizes, dropless
   (sort + ``jax.lax.ragged_dot``) against the capacity-factor einsum dispatch (GShard) at
   capacity factors 1.0 and 1.25: ms, tokens/s, dropped fraction, and which is faster. The
   shipped default stays dropless (exact) until this has run on a GPU; the row says which
   ``model.capacity_factor`` the measurement favours.
5. ``train_step``: the trainer's own step (``Experiment.train_step`` on a 1-device mesh,
   via ``benchmarks/train_step.py``) on ``configs/dense_1b.py`` (0.96B dense) and
   ``configs/bench_h200.py`` (MoE), in mixed_bf16, mixed_fp16 with dynamic loss scaling,
   and each ``fp8_*`` policy of ``jaxmp.fp8`` if present: tokens/s, model TFLOP/s, MFU,
   compile seconds, peak device memory (``memory_stats()["peak_bytes_in_use"]``, the
   case's own high-water mark: see below) and XLA's planned program bytes.
6. ``overhead``: ``benchmarks/overhead.py``'s ratio of the trainer's step to a
   hand-written Flax NNX + optax + jmp step on ``configs/bench_h200.py``, mixed_bf16.

Time budget: ``--budget_s`` (default 480, the issue's 8 minutes, compile times
included). Parts and cases run in the order above (the train-step cases bf16 first, the
overhead after the bf16 cases); one that would start with less than ``--reserve_s`` left
is skipped and listed as skipped, and an isolated case is killed at the deadline, so the
suite ends inside the budget and says what it did not measure. ``--parts`` picks parts.

Without ``--toy``, every part and case runs in a child process of its own
(``--no-isolate`` keeps them in this one): the device's memory statistics and allocator
are then the case's own, and a crash or an out-of-memory error is a failed row, not a
failed suite. The orchestrating process starts JAX without preallocating and with the
platform allocator, so that it holds no device memory the children need.

``--toy`` shrinks every size (2-layer models of width 64, 64 x 64 matmuls) and runs the
FP8 policies on the MoE config only, so that the whole suite runs on a CPU in about a
minute: ``tests/test_gpu_suite.py`` runs it so it never rots. Toy figures say nothing
about a GPU; the targets are judged only on an H200 (``n/a`` elsewhere).
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import pathlib
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

if __package__ in (None, ""):  # run as `python benchmarks/gpu_suite.py`: make `benchmarks` importable
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import matmul, overhead, train_step
from benchmarks._common import ROOT, device_info, write_json
from benchmarks._timing import MIN_REPEATS, time_per_call
from jaxmp.analysis import cost, gpu as gpu_target
from jaxmp.analysis.residuals import saved_residuals
from jaxmp.analysis.report import output_problem
from jaxmp.models import RoutedExperts
from jaxmp.models.moe import resolve_moe_kernel
from jaxmp.models.attention import attention_core, resolve_attention, trace_cudnn_without_gpu
from jaxmp.precision.policy import get_policy_rules
from jaxmp.train.config import load_config

__all__ = ["CONFIGS", "TOY_OVERRIDES", "TARGETS", "PARTS", "fp8_recipes", "suite_policies",
           "run_matmul", "run_fp8_kernels", "run_attention", "run_moe_dispatch", "run_case",
           "run_overhead", "run_part",
           "run_suite", "markdown_table", "main"]

CONFIGS = {"dense_1b": ROOT / "configs" / "dense_1b.py", "moe_bench": ROOT / "configs" / "bench_h200.py"}
# Toy sizes: the same configs shrunk to 2 layers of width 64, 2 sequences of 32 tokens.
_TOY_COMMON = ["model.vocab_size=512", "model.num_layers=2", "model.d_model=64", "model.num_heads=4",
               "model.d_ff=128", "model.max_len=32", "data.seq_len=32", "train.batch_size=2"]
TOY_OVERRIDES = {"dense_1b": _TOY_COMMON,
                 "moe_bench": _TOY_COMMON + ["model.d_expert=64", "model.num_experts=4"]}
BASE_RULES = "router: fp32; norm: fp32"
FP8_RECIPES = ("tensorwise", "delayed", "rowwise", "blockwise")  # jaxmp.fp8.Recipe presets (issue 12)
# Targets of the issue, judged on an H200 only.
TARGETS = {"mfu_dense_bf16": 0.45, "mfu_moe_bf16": 0.35, "overhead_ratio": 1.02,
           "fp8_tensorwise_speedup": 1.3, "fp8_blockwise_gemm_peak_fraction": 0.60}
PARTS = ("matmul", "fp8_kernels", "attention", "moe_dispatch", "train_step", "overhead")
GPU_SIZES = dict(matmul_n=8192, fp8_n=4096, steps=3, repeats=MIN_REPEATS, warmup=1, ring=2,
                 peak_size=8192,
                 overhead_steps=3, overhead_repeats=MIN_REPEATS, reserve_s=30.0)
TOY_SIZES = dict(matmul_n=64, fp8_n=128, steps=1, repeats=MIN_REPEATS, warmup=0, ring=1,
                 peak_size=64,
                 overhead_steps=1, overhead_repeats=MIN_REPEATS, reserve_s=0.0)


# ----------------------------------------------------------------------------- FP8 and policies


def fp8_recipes() -> Tuple[Dict[str, Any], str]:
    """The FP8 recipes of ``jaxmp.fp8`` on this commit: ``({name: Recipe}, note)``.

    A recipe counts when ``jaxmp.fp8.Recipe.<name>()`` builds (``name`` in
    tensorwise, delayed, rowwise, blockwise); its train-step policy is ``fp8_<name>``.
    Without the module: ``({}, "jaxmp.fp8 does not exist on this commit")``.
    """
    fp8 = getattr(importlib.import_module("jaxmp"), "fp8", None)  # a re-export, not a module file
    if fp8 is None:
        return {}, "jaxmp.fp8 does not exist on this commit"
    out = {}
    for name in FP8_RECIPES:
        factory = getattr(getattr(fp8, "Recipe", None), name, None)
        if callable(factory):
            out[name] = factory()
    return out, f"jaxmp.fp8 recipes: {', '.join(out) or 'none'}"


def suite_policies(recipes: Sequence[str]) -> Dict[str, Tuple[str, str]]:
    """``{name: (policy, loss_scale)}`` of the train-step cases.

    mixed_bf16 and mixed_fp16 (dynamic scale, ``benchmarks/train_step.py``'s default)
    keep the router and norms in float32; ``fp8_<recipe>`` runs the attention
    projections, dense FFNs and experts in FP8 by that recipe on a mixed_bf16 base (the
    embedding, head, router, norms and attention core stay as DeepSeek-V3 keeps them),
    for each recipe whose policy preset parses.
    """
    out = {"mixed_bf16": (f"mixed_bf16; {BASE_RULES}", "none"),
           "mixed_fp16": (f"mixed_fp16; {BASE_RULES}", train_step.DEFAULT_FP16_LOSS_SCALE)}
    for name in recipes:
        policy = f"mixed_bf16; {BASE_RULES}; attn: fp8_{name}; mlp: fp8_{name}; experts: fp8_{name}"
        try:
            get_policy_rules(policy)
        except ValueError:
            continue  # the recipe exists but its policy preset does not (yet)
        out[f"fp8_{name}"] = (policy, "none")
    return out


def _config(name: str, toy: bool):
    return load_config(CONFIGS[name], TOY_OVERRIDES[name] if toy else ())


def _hardware(device, hardware: Optional[str]) -> Optional[str]:
    if hardware is not None:
        return hardware
    return train_step.detect_hardware(device.device_kind) if device.platform == "gpu" else None


# ----------------------------------------------------------------------------- 1. matmul


def run_matmul(n: int, repeats: int, hardware: Optional[str], peak_size: int, device=None) -> dict:
    """Matmul TFLOP/s per dtype against the datasheet (GPU) or a measured (CPU) peak.

    Returns:
      ``{"rows": [{"dtype", "mode", "n", "median_ms", "tflops", "peak_tflops",
      "peak_source", "fraction_of_peak"}], "skipped": [{"dtype", "reason"}]}``.
    """
    device = device or jax.devices()[0]
    rows, skipped = [], []
    for dtype in ("bfloat16", "float16", "float32"):
        median_s = float(np.median(matmul.time_matmul(dtype, n, "default", repeats=repeats, device=device)))
        peak = train_step.resolve_peak(device, dtype, hardware, peak_size)
        tflops = matmul.matmul_tflops(n, median_s * 1e3)
        rows.append({"dtype": dtype, "mode": peak["math_mode"], "n": n, "median_ms": median_s * 1e3,
                     "tflops": tflops, "peak_tflops": peak["peak_tflops"],
                     "peak_source": peak["peak_source"], "fraction_of_peak": tflops / peak["peak_tflops"]})
    recipes, note = fp8_recipes()
    if not recipes:
        skipped.append({"dtype": "fp8", "reason": note})
    if recipes:
        if hardware is not None:
            peak = {"peak_tflops": cost.peak_tflops(hardware, "fp8"),
                    "peak_source": f"{hardware} dense fp8 peak, jaxmp.analysis.cost.HARDWARE"}
        else:  # no FP8 datasheet figure off a known GPU: the float32 measured peak, as train_step
            peak = train_step.resolve_peak(device, "float32", None, peak_size)
        for name in recipes:
            # matmul.py's own row: jaxmp.fp8.dot(x bf16, w f32, recipe, state) over a ring of
            # inputs, the delayed recipe with its amax histories (a layer's forward pass).
            try:
                median_s = float(np.median(matmul.time_fp8_recipe(name, n, "fwd", repeats=repeats,
                                                                  device=device)))
            except Exception as e:  # a recipe this device cannot run
                skipped.append({"dtype": f"fp8_{name}", "reason": f"{type(e).__name__}: {e}"[:300]})
                continue
            tflops = matmul.matmul_tflops(n, median_s * 1e3)
            rows.append({"dtype": f"fp8_{name}", "mode": "fp8", "n": n, "median_ms": median_s * 1e3,
                         "tflops": tflops, "peak_tflops": peak["peak_tflops"],
                         "peak_source": peak["peak_source"],
                         "fraction_of_peak": tflops / peak["peak_tflops"]})
    return {"rows": rows, "skipped": skipped}


# ----------------------------------------------------------------------------- 2. FP8 kernels


def _leaf_check(names, reference, got, rtol: float) -> Optional[str]:
    """None when each leaf of ``got`` is within ``rtol`` of the largest magnitude of its
    ``reference`` leaf (and finite), else what differs."""
    worst = []
    for name, a, b in zip(names, reference, got):
        x, y = np.asarray(a, np.float64), np.asarray(b, np.float64)
        err = float(np.max(np.abs(x - y))) / max(float(np.max(np.abs(x))), 1e-30)
        if not np.isfinite(err) or err > rtol:
            worst.append(f"{name} off by {err:.3g} of its scale")
    return ("refused to time: " + "; ".join(worst)) if worst else None


def _fp8_vjp(fp8, kernel, grouped_sizes=None):
    """jit of ``(y, dx, dw)`` of fp8.dot (or grouped_dot) by ``Recipe.blockwise(kernel)``."""
    recipe = fp8.Recipe.blockwise(kernel)

    def f(x, w, g):
        if grouped_sizes is None:
            y, vjp = jax.vjp(lambda a, b: fp8.dot(a, b, recipe), x, w)
        else:
            y, vjp = jax.vjp(lambda a, b: fp8.grouped_dot(a, b, grouped_sizes, recipe), x, w)
        return (y,) + vjp(g)
    return jax.jit(f)


def run_fp8_kernels(config, n: int, repeats: int, hardware: Optional[str],
                    rtol: float = 1e-3) -> dict:
    """The blockwise FP8 kernels, dense and grouped: checked against the XLA reference,
    then timed (GPU only) with the reference beside them.

    Check: float32 ``x``, ``w`` and cotangent (random normal), so the value and both
    gradients come out in float32; each within ``rtol`` of its largest magnitude of the
    reference's (the same quantization and 128-slices, so only float32 rounding
    differs: about ``K * 2^-24``). Sizes: dense ``n^3``; grouped, ``config``'s routed
    rows (batch x seq_len x top_k), ``K = d_model``, ``N = d_expert``, G experts, the
    rows spread by a multinomial draw (for the check with expert 1 empty). Timing: the
    GEMM alone on quantized operands, bfloat16 output (dense, grouped forward) or float32
    (grouped weight gradient); TFLOP/s of ``2 M K N`` against the FP8 dense peak of
    ``hardware`` (:data:`jaxmp.analysis.cost.HARDWARE`).

    Returns:
      ``{"peak_tflops", "peak_source", "checks": {name: verdict}, "rows": [{"gemm",
      "kernel", "shape", "ms", "tflops", "fraction_of_peak"}], "skipped": [{"gemm",
      "reason"}]}``.
    """
    from jaxmp import fp8
    from jaxmp.precision._fp8 import grouped_kernel, kernel as dense_kernel
    from jaxmp.precision._fp8.gemm import _row_groups, _scaled_mm, _tiled_wgrad
    from jaxmp.precision._fp8.quant import _cols

    on_gpu = jax.devices()[0].platform == "gpu"
    peak = cost.peak_tflops(hardware, "fp8") if hardware is not None else None
    out = {"peak_tflops": peak, "peak_source": (f"{hardware} dense fp8 peak, "
                                                f"jaxmp.analysis.cost.HARDWARE" if peak else None),
           "checks": {}, "rows": [], "skipped": []}
    s = _bench_shapes(config)
    m_g, k_g, n_g, groups = s["batch"] * s["seq_len"] * s["top_k"], s["d_model"], s["d_expert"], \
        s["num_experts"]
    rng = np.random.default_rng(0)
    share = np.full(groups, 1.0 / groups)
    sizes_time = jnp.asarray(rng.multinomial(m_g, share), jnp.int32)
    share[1] = 0.0
    sizes_check = jnp.asarray(rng.multinomial(m_g, share / share.sum()), jnp.int32)
    names = ("y", "dx", "dw")

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    cases = {"dense": ((n, n, n), None), "grouped": ((m_g, k_g, n_g), sizes_check)}
    for gemm, ((m, k, nn), sizes) in cases.items():
        w = normal(k, nn) if sizes is None else normal(groups, k, nn)
        args = (normal(m, k), w, normal(m, nn))
        ref = _fp8_vjp(fp8, "xla", sizes)(*args)
        got = _fp8_vjp(fp8, "pallas", sizes)(*args)
        problem = _leaf_check(names, ref, got, rtol)
        out["checks"][gemm] = problem or "value, dx and dw match the XLA reference"
        if problem:
            out["skipped"].append({"gemm": gemm, "reason": problem})
    if not on_gpu:
        out["skipped"].append({"gemm": "all", "reason": "not timed off a GPU (the kernels ran "
                                                          "interpreted for the check)"})
        return out

    def time_gemm(gemm, kernel, shape, fn, *operands):
        median_s = float(np.median(time_per_call(jax.jit(fn), [operands], repeats=repeats,
                                                 warmup=1)))
        tflops = 2.0 * np.prod(shape) / median_s / 1e12
        out["rows"].append({"gemm": gemm, "kernel": kernel, "shape": list(shape),
                            "ms": median_s * 1e3, "tflops": tflops,
                            "fraction_of_peak": tflops / peak if peak else None})

    bf16 = jnp.bfloat16
    if out["checks"]["dense"].startswith("value"):
        qa, sa = fp8.quantize_blocks(normal(n, n), (1, 128))
        qb, sb = fp8.quantize_blocks(normal(n, n), (128, 128))
        sbc = _cols(sb, n)
        time_gemm("dense", "pallas", (n, n, n),
                  lambda qa, sat, bt, sbc: dense_kernel.scaled_mm(qa, sat, bt, sbc, bf16),
                  qa, sa.T, qb.T, sbc)
        time_gemm("dense", "xla", (n, n, n),
                  lambda qa, sa, qb, sbc: _scaled_mm(qa, sa, qb, sbc).astype(bf16),
                  qa, sa, qb, sbc)
    if out["checks"]["grouped"].startswith("value"):
        gs = sizes_time
        qa, sa = fp8.quantize_blocks(normal(m_g, k_g), (1, 128))
        qw, sw = jax.vmap(lambda v: fp8.quantize_blocks(v, (128, 128)))(normal(groups, k_g, n_g))
        sbc = _cols(sw, n_g)
        shape = (m_g, k_g, n_g)
        time_gemm("grouped forward", "pallas", shape,
                  lambda qa, sa, bt, sbc, gs: grouped_kernel.grouped_scaled_mm(
                      qa, sa, bt, sbc, gs, bf16), qa, sa, jnp.swapaxes(qw, 1, 2), sbc, gs)
        time_gemm("grouped forward", "xla", shape,
                  lambda qa, sa, qw, sbc, gs: _scaled_mm(qa, sa, qw, sbc, gs,
                                                         _row_groups(gs, m_g)).astype(bf16),
                  qa, sa, qw, sbc, gs)
        qxt, sxt = fp8.quantize_blocks(normal(k_g, m_g), (1, 128))
        qgt, sgt = fp8.quantize_blocks(normal(n_g, m_g), (1, 128))
        time_gemm("grouped dw", "pallas", shape, grouped_kernel.grouped_wgrad,
                  qxt, sxt, qgt, sgt, gs)
        time_gemm("grouped dw", "xla", shape, _tiled_wgrad, qxt, sxt, qgt, sgt, gs)
    return out


# ----------------------------------------------------------------------------- 3. attention


def _bench_shapes(config) -> Dict[str, int]:
    m = config.model
    return dict(batch=int(config.train.batch_size), seq_len=int(config.data.seq_len),
                heads=int(m.num_heads), head_dim=int(m.d_model // m.num_heads), d_model=int(m.d_model),
                num_experts=int(m.num_experts), top_k=int(m.top_k), d_expert=int(m.d_expert))


def run_attention(config, repeats: int, dtype=jnp.bfloat16) -> dict:
    """Forward + backward ms of each attention path that runs here, at ``config``'s sizes.

    Returns:
      ``{"shape": [B, T, H, h], "dtype", "rows": [{"implementation", "ms",
      "max_abs_diff_out", "max_abs_diff_grad", "saved_bytes", "traced_only"}],
      "skipped": [{"implementation", "reason"}]}``; differences are against the
      reference path, in units of the reference's largest magnitude.
    """
    s = _bench_shapes(config)
    shape = (s["batch"], s["seq_len"], s["heads"], s["head_dim"])
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, g = (jax.random.normal(key, shape, jnp.float32).astype(dtype) for key in keys)
    rows, skipped, ref = [], [], None
    for impl in ("reference", "xla", "cudnn"):
        try:
            resolve_attention(impl, dtype, s["head_dim"])
        except ValueError as e:
            skipped.append({"implementation": impl, "reason": str(e)})
            continue

        def loss(q, k, v, impl=impl):
            return jnp.sum(attention_core(q, k, v, impl).astype(jnp.float32) * g.astype(jnp.float32))

        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        out = jax.jit(lambda q, k, v, impl=impl: attention_core(q, k, v, impl))(q, k, v)
        grads = fn(q, k, v)[1]
        median_s = float(np.median(time_per_call(fn, [(q, k, v)], repeats=repeats, warmup=1)))
        abstract = jax.ShapeDtypeStruct(shape, dtype)
        res = saved_residuals(lambda q, k, v, impl=impl: attention_core(q, k, v, impl).astype(jnp.float32).sum(),
                              abstract, abstract, abstract, argnums=(0, 1, 2))
        if ref is None:
            ref = (np.asarray(out, np.float32), [np.asarray(x, np.float32) for x in grads])
        scale_out = float(np.abs(ref[0]).max()) or 1.0
        rows.append({"implementation": impl, "ms": median_s * 1e3,
                     "max_abs_diff_out": float(np.abs(np.asarray(out, np.float32) - ref[0]).max()) / scale_out,
                     "max_abs_diff_grad": max(float(np.abs(np.asarray(a, np.float32) - b).max())
                                              / (float(np.abs(b).max()) or 1.0)
                                              for a, b in zip(grads, ref[1])),
                     "saved_bytes": sum(r.nbytes for r in res if r.kind == "computed"),
                     "traced_only": False})
    if any(r["implementation"] == "cudnn" for r in skipped):  # what the fused kernel would keep
        abstract = jax.ShapeDtypeStruct(shape, dtype)
        with trace_cudnn_without_gpu():
            res = saved_residuals(lambda q, k, v: attention_core(q, k, v, "cudnn").astype(jnp.float32).sum(),
                                  abstract, abstract, abstract, argnums=(0, 1, 2))
        rows.append({"implementation": "cudnn", "ms": None, "max_abs_diff_out": None,
                     "max_abs_diff_grad": None, "traced_only": True,
                     "saved_bytes": sum(r.nbytes for r in res if r.kind == "computed")})
    return {"shape": list(shape), "dtype": jnp.dtype(dtype).name, "rows": rows, "skipped": skipped}


# ----------------------------------------------------------------------------- 4. MoE dispatch


def run_moe_dispatch(config, repeats: int, capacity_factors=(1.0, 1.25), dtype="bfloat16") -> dict:
    """Forward + backward ms of the routed experts, dropless vs capacity dispatch.

    Routing: top-k of random normal scores per token (about uniform load, as
    auxiliary-loss-free balancing aims for), gates their softmax; ``x`` random normal
    in the compute dtype; the loss ``sum(y * g)`` with a random ``g``.

    Returns:
      ``{"tokens", "d_model", "num_experts", "top_k", "d_expert", "rows": [{"dispatch",
      "capacity_factor", "moe_kernel", "ms", "tokens_per_s", "dropped_fraction"}],
      "kernel_checks": {kernel: verdict}, "faster", "recommendation"}``. Dropless runs on
      ``ragged_dot`` and, where it runs (a Hopper GPU), on the Mosaic GPU grouped GEMM,
      whose loss and gradients are first checked against ``ragged_dot``'s: a kernel that
      fails is not timed.
    """
    s = _bench_shapes(config)
    b, t, d, e, k, de = s["batch"], s["seq_len"], s["d_model"], s["num_experts"], s["top_k"], s["d_expert"]
    rules = get_policy_rules(f"params=float32,compute={dtype},output=float32")
    keys = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(keys[0], (b, t, d), jnp.float32).astype(dtype)
    scores = jax.random.normal(keys[1], (b, t, e), jnp.float32)
    top, ids = jax.lax.top_k(scores, k)
    gates = jax.nn.softmax(top, axis=-1)
    g = jax.random.normal(keys[2], (b, t, d), jnp.float32)
    rows, checks = [], {}
    try:  # the Mosaic GPU grouped GEMM where it runs (model.moe_kernel="pallas")
        resolve_moe_kernel("pallas", dtype, d, de)
        kernels = ["ragged_dot", "pallas"]
    except ValueError as why:  # (not `e`: the expert count)
        kernels, checks["pallas"] = ["ragged_dot"], f"not timed: {why}"
    cases = [(0.0, k) for k in kernels] + [(f, "ragged_dot") for f in capacity_factors]
    reference = None
    for factor, kernel in cases:
        experts = RoutedExperts(e, d, de, factor, path="blocks/1/moe/experts", rules=rules,
                                rngs=nnx.Rngs(0), moe_kernel=kernel)
        graphdef, params = nnx.split(experts, nnx.Param)

        def loss(params, x):
            y, dropped = nnx.merge(graphdef, params)(x, ids.astype(jnp.int32), gates)
            return jnp.sum(y.astype(jnp.float32) * g), dropped

        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
        (value, dropped), grads = fn(params, x)
        if factor == 0 and kernel == "ragged_dot":
            reference = (value, grads)
        elif factor == 0:  # correctness first: the kernel's loss and gradients vs ragged_dot
            problem = _grouped_check(reference, (value, grads))
            checks[kernel] = problem or "values and gradients match ragged_dot"
            if problem:
                continue
        median_s = float(np.median(time_per_call(fn, [(params, x)], repeats=repeats, warmup=1)))
        rows.append({"dispatch": ("capacity einsum" if factor else
                                  "dropless ragged_dot" if kernel == "ragged_dot" else
                                  "dropless grouped GEMM (Mosaic GPU)"),
                     "capacity_factor": factor, "moe_kernel": kernel, "ms": median_s * 1e3,
                     "tokens_per_s": b * t / median_s, "dropped_fraction": float(dropped)})
    best = min(rows, key=lambda r: r["ms"])
    dropless = min((r for r in rows if r["capacity_factor"] == 0), key=lambda r: r["ms"])
    if best is dropless or best["ms"] > 0.95 * dropless["ms"]:
        rec = (f"keep model.capacity_factor=0 (dropless, exact; fastest with moe_kernel="
               f"{dropless['moe_kernel']}): capacity dispatch is not 5% faster here")
    else:
        rec = (f"model.capacity_factor={best['capacity_factor']:g} is {dropless['ms'] / best['ms']:.2f}x "
               f"faster here, dropping {best['dropped_fraction']:.1%} of assignments")
    return {"tokens": b * t, "d_model": d, "num_experts": e, "top_k": k, "d_expert": de, "dtype": dtype,
            "rows": rows, "kernel_checks": checks, "faster": best["dispatch"] + ("" if best is dropless else
                                                        f" (capacity_factor {best['capacity_factor']:g})"),
            "recommendation": rec}


def _grouped_check(reference, got, rtol: float = 2e-2) -> Optional[str]:
    """None when the kernel's loss and gradients match ragged_dot's (16-bit compute: each
    leaf within ``rtol`` of its largest magnitude), else what differs (not timed)."""
    worst = []
    for name, a, b in zip(("loss", "dparams", "dx"), (reference[0],) + tuple(reference[1]),
                          (got[0],) + tuple(got[1])):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
            scale = max(float(np.max(np.abs(x))), 1e-30)
            err = float(np.max(np.abs(x - y))) / scale
            if not np.isfinite(err) or err > rtol:
                worst.append(f"{name} off by {err:.3g} of its scale")
    return ("refused to time: " + "; ".join(worst)) if worst else None


# ----------------------------------------------------------------------------- 5. train step


def run_case(spec: dict) -> dict:
    """One train-step case: ``benchmarks/train_step.run`` of one config in one policy.

    ``spec``: ``{"part": "train_step", "config": name of CONFIGS, "toy": bool, "policy_name", "policy",
    "loss_scale", "steps", "repeats", "warmup", "ring", "hardware", "peak_size"}``.

    Returns:
      The case's row: config, policy and the result of ``train_step.run`` (tokens/s,
      achieved TFLOP/s, MFU, compile seconds, memory, ...) plus the model's sizes.
    """
    config = _config(spec["config"], spec["toy"])
    name = spec["policy_name"]
    report = train_step.run(config, spec["steps"], spec["repeats"], [name], warmup=spec["warmup"],
                            ring=spec["ring"], hardware=spec["hardware"], peak_size=spec["peak_size"],
                            policies={name: (spec["policy"], spec["loss_scale"])}, log=lambda *_: None)
    (result,) = report["results"]
    keep = ("total_params", "active_params", "num_layers", "seq_len", "batch_size",
            "tokens_per_step", "model_flops_per_step")
    row = {"config": spec["config"], "policy_name": name, **{k: report[k] for k in keep},
           **{k: v for k, v in result.items() if k != "samples_ms"}, "samples_ms": result["samples_ms"]}
    if jax.devices()[0].platform == "gpu" and spec["hardware"] in gpu_target.TARGETS:
        row.update(_bound(config, spec, result))
    return row


def _bound(config, spec: dict, result: dict) -> dict:
    """The measured step beside its roofline bound (:func:`jaxmp.analysis.gpu.roofline`):
    the same config and policy compiled for the same GPU with XLA's compiler."""
    config = config.copy_and_resolve_references()
    config.precision.policy, config.precision.loss_scale = spec["policy"], spec["loss_scale"]
    try:
        bound = gpu_target.gpu_report(config, gpu_target.get_target(spec["hardware"]), 1, top=0)["roofline"]
    except Exception as e:  # noqa: BLE001 - a bound that cannot be built is reported, not fatal
        return {"bound_error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    measured_ms = result.get("step_ms")
    return {"bound_ms": bound["bound_s"] * 1e3, "mfu_bound": bound["mfu_bound"],
            "measured_over_bound": (measured_ms / (bound["bound_s"] * 1e3)) if measured_ms else None}


def run_part(spec: dict) -> dict:
    """One part (or train-step case) of the suite from its JSON ``spec``: what a child
    process runs. ``spec["part"]`` names it; ``train_step`` specs are :func:`run_case`'s."""
    part, toy = spec["part"], spec["toy"]
    if part == "matmul":
        return run_matmul(spec["n"], spec["repeats"], spec["hardware"], spec["peak_size"])
    if part == "fp8_kernels":
        return run_fp8_kernels(_config("moe_bench", toy), spec["n"], spec["repeats"],
                               spec["hardware"])
    if part == "attention":
        return run_attention(_config("moe_bench", toy), spec["repeats"])
    if part == "moe_dispatch":
        return run_moe_dispatch(_config("moe_bench", toy), spec["repeats"])
    if part == "overhead":
        return run_overhead(_config("moe_bench", toy), spec["steps"], spec["repeats"])
    if part == "train_step":
        return run_case(spec)
    raise ValueError(f"part {part!r}; allowed: {', '.join(PARTS)}")


# The variables a child gets back: the orchestrating parent holds no device memory.
_ALLOCATOR_ENV = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_ALLOCATOR")
_ORIGINAL_ENV = {k: os.environ.get(k) for k in _ALLOCATOR_ENV}


def _run_isolated(spec: dict, timeout_s: float) -> dict:
    """:func:`run_part` in a child process (its own memory high-water mark, its own
    allocator with the device to itself); killed at ``timeout_s``."""
    out = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu_suite_case_{os.getpid()}_{time.time_ns()}.json"
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--case", json.dumps(spec),
           "--case-out", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in _ALLOCATOR_ENV}
    env.update({k: v for k, v in _ORIGINAL_ENV.items() if v is not None})
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=max(timeout_s, 1.0))
    except subprocess.TimeoutExpired:
        return {"error": f"killed at the suite's deadline after {timeout_s:.0f} s"}
    if proc.returncode != 0 or not out.exists():
        return {"error": (proc.stderr.strip().splitlines() or ["exit status %d" % proc.returncode])[-1][:500]}
    try:
        return json.loads(out.read_text())
    finally:
        out.unlink()


# ----------------------------------------------------------------------------- 6. overhead


def run_overhead(config, steps: int, repeats: int) -> dict:
    """``benchmarks/overhead.run`` on ``config`` in mixed_bf16: the trainer's step against
    the hand-written baseline, interleaved."""
    cfg = config.copy_and_resolve_references()
    cfg.precision.policy, cfg.precision.loss_scale = f"mixed_bf16; {BASE_RULES}", "none"
    r = overhead.run(cfg, steps, repeats, warmup=1, ring=2)
    keep = ("ratio", "jaxmp_ms", "baseline_ms", "pair_ratio_median", "target_ratio", "meets_target",
            "compile_s", "cost_analysis", "steps", "repeats", "batch_size", "seq_len", "policy")
    return {k: r[k] for k in keep}


# ----------------------------------------------------------------------------- the suite


def _git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + (" (uncommitted changes)" if dirty else "")


def run_suite(toy: bool = False, budget_s: float = 480.0, parts: Sequence[str] = PARTS,
              hardware: Optional[str] = None, isolate: Optional[bool] = None,
              log: Callable[[str], None] = print) -> dict:
    """Runs the suite; returns the JSON report (``markdown_table`` formats it).

    Args:
      toy: toy sizes (any machine).
      budget_s: wall-clock budget in seconds, compile times included.
      parts: which of :data:`PARTS`, run in that order whatever the order given.
      hardware: a :data:`jaxmp.analysis.cost.HARDWARE` key; None = detect the GPU
        (CPU: measured peaks).
      isolate: run every part and train-step case in a process of its own (default:
        unless ``toy``); the caller should then keep this process off the device's
        memory (``main`` sets ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` and the platform
        allocator before JAX starts).
      log: where progress lines go.

    Returns:
      ``{"device", "commit", "toy", "budget_s", "elapsed_s", "fp8", "matmul",
      "fp8_kernels", "attention", "moe_dispatch", "train_step": [case rows], "overhead", "skipped":
      [{"part", "case", "reason"}], "rows": [markdown rows]}``.

    Raises:
      ValueError: an unknown part or hardware, or a budget <= 0 (before any work).
    """
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        raise ValueError(f"parts {list(parts)!r}: allowed {', '.join(PARTS)} (at least one)")
    if not (isinstance(budget_s, (int, float)) and math.isfinite(budget_s) and budget_s > 0):
        raise ValueError(f"budget_s={budget_s!r} must be a positive number of seconds")
    if hardware is not None and hardware not in cost.HARDWARE:
        raise ValueError(f"unknown hardware {hardware!r}; allowed: {', '.join(cost.HARDWARE)}")
    start = time.perf_counter()
    device = jax.devices()[0]
    hardware = _hardware(device, hardware)
    if device.platform == "gpu" and hardware is None:
        raise ValueError(f"GPU {device.device_kind!r} is not in jaxmp.analysis.cost.HARDWARE; pass "
                         f"--hardware with one of {', '.join(cost.HARDWARE)}")
    sizes = TOY_SIZES if toy else GPU_SIZES
    isolate = (not toy) if isolate is None else isolate
    recipes, fp8_note = fp8_recipes()
    policies = suite_policies(list(recipes))
    report: Dict[str, Any] = {"device": device_info(device), "hardware": hardware, "commit": _git_commit(),
                              "toy": toy, "budget_s": budget_s, "fp8": fp8_note,
                              "policies": {k: v[0] for k, v in policies.items()},
                              "train_step": [], "skipped": []}

    def left() -> float:
        return budget_s - (time.perf_counter() - start)

    def timed(part, case, fn):
        if left() < sizes["reserve_s"]:
            report["skipped"].append({"part": part, "case": case, "reason": f"time budget: {left():.0f} s left"})
            log(f"  skip {part} {case}: time budget")
            return None
        t0 = time.perf_counter()
        out = fn()
        log(f"  {part} {case}: {time.perf_counter() - t0:.1f} s")
        return out

    def execute(spec):
        return _run_isolated(spec, left()) if isolate else run_part(spec)

    common = {"toy": toy, "repeats": sizes["repeats"], "hardware": hardware}
    if "matmul" in parts:
        report["matmul"] = timed("matmul", "", lambda: execute(
            {"part": "matmul", **common, "n": sizes["matmul_n"], "peak_size": sizes["peak_size"]}))
    if "fp8_kernels" in parts:
        report["fp8_kernels"] = timed("fp8_kernels", "", lambda: execute(
            {"part": "fp8_kernels", **common, "n": sizes["fp8_n"]}))
    for part in ("attention", "moe_dispatch"):
        if part in parts:
            report[part] = timed(part, "", lambda part=part: execute({"part": part, **common}))
    # At toy size the FP8 policies run on the MoE config only: the dense config's FP8
    # layers are the same code, and the toy run exists so that every part keeps running.
    cases = [(c, p) for p in policies for c in CONFIGS
             if not (toy and p.startswith("fp8_") and c != "moe_bench")] if "train_step" in parts else []
    order = [x for x in cases if x[1] == "mixed_bf16"] + (["overhead"] if "overhead" in parts else []) \
        + [x for x in cases if x[1] != "mixed_bf16"]
    for item in order:
        if item == "overhead":
            report["overhead"] = timed("overhead", "moe_bench", lambda: execute(
                {"part": "overhead", **common, "steps": sizes["overhead_steps"],
                 "repeats": sizes["overhead_repeats"]}))
            continue
        config_name, policy_name = item
        spec = {"part": "train_step", "config": config_name, "toy": toy, "policy_name": policy_name,
                "policy": policies[policy_name][0], "loss_scale": policies[policy_name][1],
                "steps": sizes["steps"], "repeats": sizes["repeats"], "warmup": sizes["warmup"],
                "ring": sizes["ring"], "hardware": hardware, "peak_size": sizes["peak_size"]}
        row = timed("train_step", f"{config_name} {policy_name}", lambda: execute(spec))
        if row is not None:
            report["train_step"].append({"config": config_name, "policy_name": policy_name, **row})
    report["elapsed_s"] = time.perf_counter() - start
    report["rows"] = _rows(report)
    return report


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.3g} MB"


def _verdict(value: Optional[float], target: float, h200: bool, higher: bool = True) -> str:
    if value is None or not h200:
        return "n/a (not an H200)" if not h200 else "not measured"
    ok = value >= target if higher else value <= target
    return "met" if ok else "MISSED"


def _rows(report: dict) -> List[List[str]]:
    """``[part, case, result, target, verdict]`` rows of the markdown table."""
    h200 = report.get("hardware") == "H200" and not report["toy"]
    rows = []
    for part in ("matmul", "fp8_kernels", "attention", "moe_dispatch", "overhead"):
        if isinstance(report.get(part), dict) and "error" in report[part]:
            rows.append([part, "", f"failed: {report[part]['error']}", "", ""])
            report[part] = None  # nothing else to show for it
    for r in (report.get("matmul") or {}).get("rows", []):
        rows.append(["matmul", f"{r['dtype']} ({r['mode']}) n={r['n']}",
                     f"{r['tflops']:.4g} TFLOP/s = {r['fraction_of_peak']:.1%} of {r['peak_tflops']:.4g} "
                     f"({r['peak_source']})", "", ""])
    for s in (report.get("matmul") or {}).get("skipped", []):
        rows.append(["matmul", s["dtype"], f"skipped: {s['reason']}", "", ""])
    fk = report.get("fp8_kernels") or {}
    for gemm, verdict in fk.get("checks", {}).items():
        rows.append(["fp8_kernels", f"{gemm} blockwise kernel correctness", verdict, "", ""])
    for r in fk.get("rows", []):
        frac = r["fraction_of_peak"]
        result = f"{r['ms']:.4g} ms, {r['tflops']:.4g} TFLOP/s" + (
            f" = {frac:.1%} of {fk['peak_tflops']:.4g} ({fk['peak_source']})" if frac else "")
        target, verdict = "", ""
        if r["gemm"] == "dense" and r["kernel"] == "pallas":
            goal = TARGETS["fp8_blockwise_gemm_peak_fraction"]
            target, verdict = f">= {goal:.0%} of the FP8 peak", _verdict(frac, goal, h200)
        rows.append(["fp8_kernels", f"{r['gemm']} {r['kernel']} "
                     f"{'x'.join(str(d) for d in r['shape'])}", result, target, verdict])
    for sk in fk.get("skipped", []):
        rows.append(["fp8_kernels", sk["gemm"], f"skipped: {sk['reason']}", "", ""])
    att = report.get("attention") or {}
    for r in att.get("rows", []):
        if r["traced_only"]:
            result = f"not run here; keeps {r['saved_bytes']:,} bytes for the backward pass (traced)"
        else:
            result = (f"{r['ms']:.4g} ms fwd+bwd; vs reference: out {r['max_abs_diff_out']:.2g}, grads "
                      f"{r['max_abs_diff_grad']:.2g} (relative); keeps {r['saved_bytes']:,} bytes")
        rows.append(["attention", f"{r['implementation']} {att['dtype']} {att['shape']}", result, "", ""])
    for s in att.get("skipped", []):
        rows.append(["attention", s["implementation"], f"skipped: {s['reason']}", "", ""])
    moe = report.get("moe_dispatch") or {}
    for r in moe.get("rows", []):
        rows.append(["moe_dispatch", f"{r['dispatch']} cf={r['capacity_factor']:g}, {moe['tokens']} tokens",
                     f"{r['ms']:.4g} ms fwd+bwd, {r['tokens_per_s']:,.0f} tokens/s, dropped "
                     f"{r['dropped_fraction']:.1%}", "", ""])
    for kernel, verdict in moe.get("kernel_checks", {}).items():
        rows.append(["moe_dispatch", f"moe_kernel={kernel} correctness", verdict, "", ""])
    if moe:
        rows.append(["moe_dispatch", "choice", moe["recommendation"], "the faster one as the GPU default",
                     "measured" if report["device"]["platform"] == "gpu" and not report["toy"] else "n/a (no GPU)"])
    bf16 = {}
    for r in report["train_step"]:
        case = f"{r['config']} {r['policy_name']}"
        if "error" in r:
            rows.append(["train_step", case, f"failed: {r['error']}", "", ""])
            continue
        peak = r.get("peak_bytes_in_use")
        mem = f"peak {_size(peak)}" if peak is not None else "peak n/a (no memory_stats)"
        if r.get("program_bytes") is not None:
            mem += f", program {_size(r['program_bytes'])}"
        result = (f"{r['tokens_per_s']:,.0f} tokens/s, {r['achieved_tflops']:.4g} TFLOP/s, MFU {r['mfu']:.1%} "
                  f"of {r['peak_tflops']:.4g}; compile {r['compile_s']:.1f} s; {mem}")
        target, verdict = "", ""
        if r["policy_name"] == "mixed_bf16":
            bf16[r["config"]] = r
            key = "mfu_dense_bf16" if r["config"] == "dense_1b" else "mfu_moe_bf16"
            target, verdict = f"MFU >= {TARGETS[key]:.0%}", _verdict(r["mfu"], TARGETS[key], h200)
        if r["policy_name"] == "fp8_tensorwise" and r["config"] == "dense_1b":
            base = bf16.get("dense_1b")
            speedup = r["tokens_per_s"] / base["tokens_per_s"] if base and "error" not in base else None
            target = f"tokens/s >= {TARGETS['fp8_tensorwise_speedup']}x bf16"
            verdict = _verdict(speedup, TARGETS["fp8_tensorwise_speedup"], h200)
            if speedup is not None:
                result += f"; {speedup:.2f}x bf16"
        rows.append(["train_step", case, result, target, verdict])
    ov = report.get("overhead")
    if ov:
        rows.append(["overhead", f"moe_bench mixed_bf16, {ov['steps']} steps x {ov['repeats']}",
                     f"ratio {ov['ratio']:.4f} (jaxmp {ov['jaxmp_ms']:.4g} ms, baseline {ov['baseline_ms']:.4g} ms; "
                     f"pair median {ov['pair_ratio_median']:.4f})",
                     f"ratio <= {TARGETS['overhead_ratio']}", _verdict(ov["ratio"], TARGETS["overhead_ratio"],
                                                                       h200, higher=False)])
    for s in report["skipped"]:
        rows.append([s["part"], s["case"], f"skipped: {s['reason']}", "", ""])
    return rows


def markdown_table(report: dict) -> str:
    """The report as one markdown table, headed by the device, commit and budget."""
    d = report["device"]
    head = (f"GPU suite on {d['platform']} ({d['device_kind']}), commit {report['commit']}, "
            f"{'toy sizes' if report['toy'] else 'full sizes'}, {report['elapsed_s']:.0f} s of a "
            f"{report['budget_s']:.0f} s budget; {report['fp8']}.")
    lines = [head, "", "| part | case | result | target | verdict |", "| --- | --- | --- | --- | --- |"]
    for row in report["rows"]:
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in row) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; returns the exit status (argparse exits 2 on bad flags)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_suite", help="write OUT.json and OUT.md (default gpu_suite)")
    parser.add_argument("--toy", action="store_true", help="toy sizes (FP8 policies on the MoE config only): runs anywhere in a minute or two")
    parser.add_argument("--budget_s", type=float, default=480.0, help="wall-clock budget (default 480)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--hardware", default=None, choices=list(cost.HARDWARE),
                        help="the chip's datasheet peaks (default: detected on GPUs)")
    parser.add_argument("--isolate", dest="isolate", action="store_true", default=None,
                        help="run each part and train-step case in its own process (default "
                             "without --toy)")
    parser.add_argument("--no-isolate", dest="isolate", action="store_false")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: one isolated case (JSON spec)
    parser.add_argument("--case-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case is not None or args.case_out is not None:
        if args.case is None or args.case_out is None:
            parser.error("--case and --case-out go together (the suite's own child processes)")
        try:
            spec = json.loads(args.case)
        except json.JSONDecodeError as e:
            parser.error(f"--case is not JSON: {e}")
        if not isinstance(spec, dict) or "part" not in spec or "toy" not in spec:
            parser.error(f"--case {args.case!r} needs an object with 'part' and 'toy'")
        if problem := output_problem(args.case_out):
            parser.error(f"--case-out: {problem}")
        write_json(args.case_out, run_part(spec))
        return 0
    for path in (f"{args.out}.json", f"{args.out}.md"):
        if problem := output_problem(path):
            parser.error(f"--out: {problem}")
    if not args.toy:
        # XLA's autotuning results on the real GPU (children inherit the flag): what a
        # deviceless compile lacks; python -m jaxmp.report --target ... --autotune_results
        # loads them.
        dump = os.path.abspath(f"{args.out}_autotune.textproto")
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_gpu_dump_autotune_results_to={dump}").strip()
    if (not args.toy) if args.isolate is None else args.isolate:
        # Before JAX starts its backend: this process only orchestrates; the children
        # (which get the original settings back) must find the device's memory free.
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        os.environ["XLA_PYTHON_CLIENT_ALLOCATOR"] = "platform"
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    try:
        report = run_suite(args.toy, args.budget_s, parts, args.hardware, args.isolate)
    except ValueError as e:
        parser.error(str(e))
    write_json(f"{args.out}.json", report)
    table = markdown_table(report)
    pathlib.Path(f"{args.out}.md").write_text(table)
    print(table)
    print(f"wrote {args.out}.json and {args.out}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
