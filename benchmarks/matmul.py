"""Square-matmul throughput (TFLOP/s) per dtype: the peak a training step can hope for.

Usage::

    python benchmarks/matmul.py                          # small sizes on CPU, large on GPU
    python benchmarks/matmul.py --sizes 256,512,1024 --repeats 10 --json matmul.json

Measured, for each size ``n``, ``C = A @ B`` with ``A, B`` of shape ``[n, n]`` in:

* float32 at ``precision=HIGHEST`` (true float32 math; on NVIDIA GPUs the CUDA-core or
  multi-pass rate),
* float32 at the default precision, which on NVIDIA GPUs of compute capability >= 8.0
  (Ampere and newer) runs on the tensor cores as TF32 (10 mantissa bits), on TPU as
  one bfloat16 pass; on CPU it is plain float32,
* bfloat16 and float16 (result in the input dtype; accumulation is float32 on GPU),
* float8_e4m3fn (result in bfloat16), only on NVIDIA GPUs of compute capability >= 9.0
  (Hopper and newer), whose tensor cores multiply FP8; elsewhere XLA would upcast, so
  the row is skipped with a printed reason;
* each :mod:`jaxmp.fp8` recipe (tensorwise, delayed, rowwise, blockwise), the way a model
  layer runs it: ``jaxmp.fp8.dot(x, w, recipe)`` with ``x`` bfloat16 and ``w`` the float32
  master, quantization included, forward only (``2 n**3`` FLOPs) and forward plus both
  backward products (``6 n**3``). These rows run on every backend (on CPU the FP8
  products are emulated: XLA:CPU converts the FP8 operands to float32 for the dot). Each
  row also reads the programs: ``lowered_fp8_dots`` / ``lowered_other_dots``, the dots of
  the lowered StableHLO with two FP8 operands and the others (case FP8-2: no other dot
  may appear), and, on a GPU only, ``fp8_gemm_calls``, the cuBLASLt FP8 GEMM custom calls
  (``__cublas$lt$matmul$f8``) in the compiled HLO, i.e. which recipes reach XLA's FP8
  GEMM. Per-tensor and per-row scales factor out of the contraction (one product per
  pass); 1x128 / 128x128 block scales lie along it, so the blockwise recipe runs
  ``ceil(n / 128)`` products of depth 128 per pass, scaled and summed in float32.

Each matmul costs ``2 * n**3`` FLOPs (``n**3`` multiply-adds); TFLOP/s is
``2 * n**3 / median_seconds / 1e12``.

Why not time ``for _ in range(k): c = a @ b`` with ``time.time()`` around it, as the
seed article does? JAX dispatch is asynchronous: ``a @ b`` returns a future as soon as
the kernel is *queued*, so without synchronisation the clock stops while the device is
still computing. That loop measures the host's dispatch/launch rate (microseconds per
call, independent of ``n``), not the math, and reports impossible TFLOP/s that grow
with ``n**3``. Here every timed sample ends with ``jax.block_until_ready`` (see
``benchmarks/_timing.py``), the first (compiling) calls are untimed warm-up, and:

* inputs are random and non-zero (magnitudes in [0.5, 1.5), random signs): all-zero
  operands draw less power, so a GPU holds higher clocks than on real data;
* several distinct input pairs are cycled (a ring of at least 2, up to 8 pairs, sized
  to span about 256 MiB when the matrices are small), so a call does not find its
  operands left in a cache (H100/H200 L2: 50 MiB) by the call before;
* the reported time is the median of at least 10 samples, robust to a preempted one.

:func:`measure_peak_tflops` gives one measured number for MFU against the achievable,
rather than the datasheet, peak (e.g. on CPU, where no datasheet peak exists).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import numbers
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

if __package__ in (None, ""):  # run as `python benchmarks/matmul.py`: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._timing import MIN_REPEATS, check_repeats, time_per_call
from jaxmp import fp8
from jaxmp.analysis.hlo import FP8_GEMM_TARGET, count_fp8_dots
from jaxmp.analysis.report import output_problem

__all__ = [
    "CPU_SIZES",
    "GPU_SIZES",
    "DTYPES",
    "PRECISIONS",
    "Config",
    "CONFIGS",
    "matmul_tflops",
    "fp8_support",
    "math_mode",
    "matmul_fn",
    "ring_size",
    "make_ring",
    "time_matmul",
    "measure_peak_tflops",
    "FP8_RECIPES",
    "FP8_PASSES",
    "fp8_recipe_fn",
    "fp8_flops",
    "fp8_program_census",
    "time_fp8_recipe",
    "run",
    "format_table",
    "main",
]

CPU_SIZES = (256, 512, 1024)  # ~20 s for all dtypes on 2 CPU cores
GPU_SIZES = (4096, 8192, 16384)  # large enough to approach the tensor-core peak

DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn")
PRECISIONS = {"default": jax.lax.Precision.DEFAULT, "high": jax.lax.Precision.HIGH,
              "highest": jax.lax.Precision.HIGHEST}
FP8 = "float8_e4m3fn"

_RING_BYTES = 256 * 2**20  # several times the largest L2 (50 MiB) and typical CPU L3
_RING_MIN, _RING_MAX = 2, 8


class Config(NamedTuple):
    """One benchmarked combination: operand dtype name and ``lax.Precision`` name."""

    dtype: str
    precision: str


CONFIGS = (Config("float32", "highest"), Config("float32", "default"),
           Config("bfloat16", "default"), Config("float16", "default"),
           Config(FP8, "default"))

# The jaxmp.fp8 recipes benchmarked as a layer runs them (delayed: the preset's 1024 steps).
FP8_RECIPES = {"tensorwise": fp8.Recipe.tensorwise(), "delayed": fp8.Recipe.delayed(),
               "rowwise": fp8.Recipe.rowwise(), "blockwise": fp8.Recipe.blockwise()}
FP8_PASSES = ("fwd", "fwd+bwd")


def matmul_tflops(n: int, median_ms: float) -> float:
    """Throughput of one ``[n, n] @ [n, n]`` matmul taking ``median_ms`` milliseconds.

    Args:
      n: matrix size, an integer >= 1.
      median_ms: time per matmul in milliseconds, > 0.

    Returns:
      TFLOP/s: ``2 * n**3 / (median_ms / 1e3) / 1e12`` (``n**3`` multiply-adds of 2
      FLOPs each, the usual count, e.g. Kaplan et al. 2020, section 2.1).

    Raises:
      ValueError: ``n`` not a positive integer, or ``median_ms`` not finite and > 0.
    """
    _check_size(n)
    if not (isinstance(median_ms, numbers.Real) and math.isfinite(median_ms) and median_ms > 0):
        raise ValueError(f"median_ms must be a finite number > 0, got {median_ms!r}")
    return 2.0 * n**3 / (median_ms / 1e3) / 1e12


def _check_size(n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ValueError(f"matrix size must be an integer >= 1, got {n!r}")
    return int(n)


def _check_dtype(dtype: Any) -> str:
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = None
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not benchmarked; allowed: {', '.join(DTYPES)}")
    return name


def _check_precision(precision: Any) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not allowed; allowed: "
                         f"{', '.join(PRECISIONS)}")
    return precision


def _compute_capability(device: Any) -> Optional[Tuple[int, int]]:
    cc = getattr(device, "compute_capability", None)  # "9.0" on CUDA devices
    if device.platform != "gpu" or not cc:
        return None
    try:
        major, minor = (int(x) for x in str(cc).split(".")[:2])
    except ValueError:
        return None
    return major, minor


def fp8_support(device: Any) -> Tuple[bool, str]:
    """Whether ``device`` has FP8 tensor cores, with the reason.

    Args:
      device: a ``jax.Device``.

    Returns:
      ``(supported, reason)``: supported for an NVIDIA GPU of compute capability >= 9.0
      (Hopper; NVIDIA H100 datasheet: FP8 tensor cores), read from the device's
      ``compute_capability``.
    """
    cc = _compute_capability(device)
    if cc is None:
        return False, (f"float8 matmuls need an NVIDIA GPU of compute capability >= 9.0 "
                       f"(Hopper); this device is {device.platform} ({device.device_kind})")
    if cc < (9, 0):
        return False, (f"float8 matmuls need compute capability >= 9.0 (Hopper); "
                       f"{device.device_kind} has {cc[0]}.{cc[1]}")
    return True, f"{device.device_kind} has compute capability {cc[0]}.{cc[1]}"


def math_mode(dtype: Any, precision: str, device: Any) -> str:
    """The arithmetic a ``(dtype, precision)`` matmul actually runs on ``device``.

    Returns ``"tf32"`` for float32 at default precision on NVIDIA GPUs of compute
    capability >= 8.0 (XLA's default on Ampere and newer), ``"bf16_1pass"`` for it on
    TPU (one bfloat16 pass, the JAX default there), otherwise the dtype's short name
    (``fp32``, ``bf16``, ``fp16``, ``fp8``).
    """
    name = _check_dtype(dtype)
    _check_precision(precision)
    if name == "float32" and precision == "default":
        cc = _compute_capability(device)
        if cc is not None and cc >= (8, 0):
            return "tf32"
        if device.platform == "tpu":
            return "bf16_1pass"
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", FP8: "fp8"}[name]


def matmul_fn(dtype: Any, precision: str = "default") -> Callable[[jax.Array, jax.Array], jax.Array]:
    """The jitted ``(a, b) -> a @ b`` that is timed.

    Args:
      dtype: operand dtype, one of :data:`DTYPES`.
      precision: a key of :data:`PRECISIONS`.

    Returns:
      A jitted function of two ``[n, n]`` arrays of ``dtype``; the result has the
      operands' dtype, except bfloat16 for float8 operands (a float8 result would
      overflow; FP8 GEMMs write a wider type).

    Raises:
      ValueError: an unknown dtype or precision.
    """
    name = _check_dtype(dtype)
    prec = PRECISIONS[_check_precision(precision)]
    out = jnp.bfloat16 if name == FP8 else jnp.dtype(name)
    return jax.jit(lambda a, b: jnp.matmul(a, b, precision=prec, preferred_element_type=out))


def ring_size(n: int, dtype: Any) -> int:
    """How many distinct ``(A, B)`` pairs to cycle: enough to span 256 MiB, 2 to 8.

    Raises:
      ValueError: a bad ``n`` or dtype.
    """
    n = _check_size(n)
    pair_bytes = 2 * n * n * jnp.dtype(_check_dtype(dtype)).itemsize
    return int(min(max(math.ceil(_RING_BYTES / pair_bytes), _RING_MIN), _RING_MAX))


def make_ring(n: int, dtype: Any, count: int, seed: int = 0,
              device: Optional[Any] = None) -> List[Tuple[jax.Array, jax.Array]]:
    """``count`` distinct pairs of random non-zero ``[n, n]`` matrices of ``dtype``.

    Entries are ``sign * magnitude`` with magnitude uniform in [0.5, 1.5) and a random
    sign, drawn in float32 and cast; every value is non-zero in all of :data:`DTYPES`
    (float8_e4m3fn holds 0.5..1.5 with a 3-bit mantissa).

    Raises:
      ValueError: a bad ``n``, dtype or ``count`` < 1.
    """
    n = _check_size(n)
    name = _check_dtype(dtype)
    if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 1:
        raise ValueError(f"count must be an integer >= 1, got {count!r}")
    device = device or jax.devices()[0]
    keys = jax.random.split(jax.random.key(seed), count)
    with jax.default_device(device):
        pairs = [_draw_pair(key, n, name) for key in keys]
    return [(ab[0], ab[1]) for ab in pairs]


@functools.partial(jax.jit, static_argnums=(1, 2))
def _draw_pair(key, n, dtype):
    k_mag, k_sign = jax.random.split(key)
    mag = jax.random.uniform(k_mag, (2, n, n), jnp.float32, 0.5, 1.5)
    sign = jnp.where(jax.random.bernoulli(k_sign, 0.5, (2, n, n)), 1.0, -1.0)
    return (mag * sign).astype(dtype)


def time_matmul(dtype: Any, n: int, precision: str = "default", *, repeats: int = MIN_REPEATS,
                warmup: int = 1, device: Optional[Any] = None) -> np.ndarray:
    """Seconds per ``[n, n] @ [n, n]`` matmul, one sample per pass over a ring of inputs.

    Args:
      dtype: one of :data:`DTYPES`.
      n: matrix size >= 1.
      precision: a key of :data:`PRECISIONS`.
      repeats: timed samples, >= 10.
      warmup: untimed passes after compilation.
      device: the ``jax.Device`` to run on (default: the first device).

    Returns:
      float64 array ``[repeats]`` of seconds per matmul.

    Raises:
      ValueError: a bad dtype, size, precision or fewer than 10 repeats (checked before
        any array is built).
    """
    name, n, precision = _check_dtype(dtype), _check_size(n), _check_precision(precision)
    repeats = check_repeats(repeats)
    fn = matmul_fn(name, precision)
    ring = make_ring(n, name, ring_size(n, name), device=device)
    return time_per_call(fn, ring, repeats=repeats, warmup=warmup)


def measure_peak_tflops(dtype: Any, n: int, *, precision: str = "default",
                        repeats: int = MIN_REPEATS, device: Optional[Any] = None) -> float:
    """Measured matmul throughput, the achievable peak to compute MFU against.

    Args:
      dtype: operand dtype, one of :data:`DTYPES` (a dtype or its name).
      n: matrix size; pick one near the model's largest matmul (e.g. 512 on CPU).
      precision: a key of :data:`PRECISIONS`.
      repeats: timed samples (>= 10); the median is used.
      device: the ``jax.Device`` (default: the first device).

    Returns:
      TFLOP/s of the median sample, ``2 * n**3 / median_seconds / 1e12``.

    Raises:
      ValueError: bad arguments (see :func:`time_matmul`), or float8 on a device
        without FP8 tensor cores (see :func:`fp8_support`).
    """
    name = _check_dtype(dtype)
    device = device or jax.devices()[0]
    if name == FP8:
        ok, reason = fp8_support(device)
        if not ok:
            raise ValueError(reason)
    samples = time_matmul(name, n, precision, repeats=repeats, device=device)
    return matmul_tflops(n, float(np.median(samples)) * 1e3)


def _check_recipe(name: Any) -> str:
    if name not in FP8_RECIPES:
        raise ValueError(f"FP8 recipe {name!r} is not benchmarked; allowed: {', '.join(FP8_RECIPES)}")
    return name


def _check_pass(pass_: Any) -> str:
    if pass_ not in FP8_PASSES:
        raise ValueError(f"pass {pass_!r} is not allowed; allowed: {', '.join(FP8_PASSES)}")
    return pass_


def fp8_recipe_fn(recipe: str, pass_: str = "fwd") -> Callable:
    """The jitted function timed for an FP8 recipe row.

    Args:
      recipe: a key of :data:`FP8_RECIPES`.
      pass_: ``"fwd"``: ``(x, w, state, g) -> fp8.dot(x, w)``; ``"fwd+bwd"``: the product
        and both gradients for the output gradient ``g`` (``jax.vjp``), ``(y, dx, dw)``.

    Returns:
      A jitted function of ``x`` bfloat16 ``[n, n]``, ``w`` float32 ``[n, n]``, ``state``
      (the delayed recipe's amax histories, else None) and ``g`` bfloat16 ``[n, n]``.

    Raises:
      ValueError: an unknown recipe or pass.
    """
    r = FP8_RECIPES[_check_recipe(recipe)]
    if _check_pass(pass_) == "fwd":
        return jax.jit(lambda x, w, state, g: fp8.dot(x, w, r, state))

    def fwd_bwd(x, w, state, g):
        y, vjp = jax.vjp(lambda a, b: fp8.dot(a, b, r, state), x, w)
        return (y,) + vjp(g)

    return jax.jit(fwd_bwd)


def fp8_flops(n: int, pass_: str) -> float:
    """Matmul FLOPs of one call: ``2 n**3`` forward, ``6 n**3`` with both backward products
    (quantization and scaling not counted)."""
    return (2.0 if _check_pass(pass_) == "fwd" else 6.0) * _check_size(n) ** 3


def _fp8_args(n: int, recipe: str, count: int, device: Any) -> List[tuple]:
    """``count`` distinct ``(x, w, state, g)``: ``x``, ``g`` bfloat16 and ``w`` float32 from
    :func:`make_ring`; the delayed state's histories hold the inputs' largest magnitude."""
    r = FP8_RECIPES[recipe]
    state = None if not r.has_state else jnp.full((3, r.history_length), 1.5, jnp.float32)
    pairs = make_ring(n, "bfloat16", count, device=device)
    grads = make_ring(n, "bfloat16", count, seed=1, device=device)
    return [(a, b.astype(jnp.float32), state, g) for (a, b), (g, _) in zip(pairs, grads)]


def fp8_program_census(recipe: str, n: int, pass_: str, device: Optional[Any] = None) -> Dict[str, Any]:
    """The dots of an FP8 recipe row's programs (no timing).

    Returns:
      ``{"lowered_fp8_dots", "lowered_other_dots"}`` from the lowered StableHLO
      (:func:`jaxmp.analysis.hlo.count_fp8_dots`), and ``"fp8_gemm_calls"``: on a
      GPU the number of ``__cublas$lt$matmul$f8`` custom calls in the compiled HLO (how
      many products reach XLA's FP8 GEMM), None elsewhere.

    Raises:
      ValueError: a bad recipe, size or pass.
    """
    n = _check_size(n)
    device = device or jax.devices()[0]
    args = _fp8_args(n, _check_recipe(recipe), 1, device)[0]
    lowered = fp8_recipe_fn(recipe, pass_).lower(*args)
    f8, other = count_fp8_dots(lowered.as_text())
    calls = None
    if device.platform == "gpu":
        calls = lowered.compile().as_text().count(FP8_GEMM_TARGET)
    return {"lowered_fp8_dots": f8, "lowered_other_dots": other, "fp8_gemm_calls": calls}


def time_fp8_recipe(recipe: str, n: int, pass_: str = "fwd", *, repeats: int = MIN_REPEATS,
                    warmup: int = 1, device: Optional[Any] = None) -> np.ndarray:
    """Seconds per call of :func:`fp8_recipe_fn`, one sample per pass over a ring of inputs
    (the same ring sizes as :func:`time_matmul` for bfloat16).

    Raises:
      ValueError: a bad recipe, size, pass or fewer than 10 repeats (before any work).
    """
    _check_recipe(recipe)
    n, pass_ = _check_size(n), _check_pass(pass_)
    repeats = check_repeats(repeats)
    device = device or jax.devices()[0]
    ring = _fp8_args(n, recipe, ring_size(n, "bfloat16"), device)
    return time_per_call(fp8_recipe_fn(recipe, pass_), ring, repeats=repeats, warmup=warmup)


def run(sizes: Sequence[int], repeats: int = MIN_REPEATS, *, device: Optional[Any] = None,
        log: Callable[[str], None] = print, fp8_recipes: Sequence[str] = tuple(FP8_RECIPES)
        ) -> Dict[str, Any]:
    """Benchmarks every :data:`CONFIGS` entry and every FP8 recipe at every size.

    Args:
      sizes: matrix sizes, each >= 1.
      repeats: timed samples per measurement, >= 10.
      device: the ``jax.Device`` (default: the first device).
      log: where progress lines and skip reasons go.
      fp8_recipes: keys of :data:`FP8_RECIPES` to benchmark (default all; empty: none).

    Returns:
      ``{"device": str, "results": [{"dtype", "precision", "mode", "n", "median_ms",
      "tflops", "ring"}], "skipped": [{"dtype", "precision", "reason"}], "fp8": [{"recipe",
      "pass", "n", "median_ms", "tflops", "ring", "lowered_fp8_dots",
      "lowered_other_dots", "fp8_gemm_calls", "fp8_gemm"}]}``; ``mode`` is
      :func:`math_mode`, ``ring`` the number of input tuples cycled; an FP8 row's
      ``tflops`` counts its matmul FLOPs (:func:`fp8_flops`) and ``fp8_gemm`` says whether
      its products reached XLA's FP8 GEMM (read from the compiled HLO on a GPU; "not yet
      measured on a GPU" elsewhere).

    Raises:
      ValueError: an empty ``sizes``, a bad size, recipe or fewer than 10 repeats.
    """
    fp8_recipes = [_check_recipe(r) for r in fp8_recipes]
    sizes = [_check_size(n) for n in sizes]
    if not sizes:
        raise ValueError("sizes must name at least one matrix size")
    repeats = check_repeats(repeats)
    device = device or jax.devices()[0]
    report: Dict[str, Any] = {"device": f"{device.platform}: {device.device_kind}",
                              "results": [], "skipped": []}
    for cfg in CONFIGS:
        if cfg.dtype == FP8:
            ok, reason = fp8_support(device)
            if not ok:
                log(f"skipping {cfg.dtype}: {reason}")
                report["skipped"].append({**cfg._asdict(), "reason": reason})
                continue
        for n in sizes:
            median_s = float(np.median(time_matmul(cfg.dtype, n, cfg.precision,
                                                   repeats=repeats, device=device)))
            row = {**cfg._asdict(), "mode": math_mode(cfg.dtype, cfg.precision, device), "n": n,
                   "median_ms": median_s * 1e3, "tflops": matmul_tflops(n, median_s * 1e3),
                   "ring": ring_size(n, cfg.dtype)}
            report["results"].append(row)
            log(f"  {row['dtype']:>13} {row['precision']:>7} n={n:<6d} "
                f"{row['median_ms']:10.3f} ms {row['tflops']:10.3f} TFLOP/s")
    report["fp8"] = []
    for recipe in fp8_recipes:
        for pass_ in FP8_PASSES:
            for n in sizes:
                median_s = float(np.median(time_fp8_recipe(recipe, n, pass_, repeats=repeats,
                                                           device=device)))
                census = fp8_program_census(recipe, n, pass_, device)
                calls = census["fp8_gemm_calls"]
                row = {"recipe": recipe, "pass": pass_, "n": n, "median_ms": median_s * 1e3,
                       "tflops": fp8_flops(n, pass_) / median_s / 1e12,
                       "ring": ring_size(n, "bfloat16"), **census,
                       "fp8_gemm": ("not yet measured on a GPU" if calls is None else
                                    f"{calls} of {census['lowered_fp8_dots']} products")}
                report["fp8"].append(row)
                log(f"  fp8 {recipe:>10} {pass_:>7} n={n:<6d} {row['median_ms']:10.3f} ms "
                    f"{row['tflops']:10.3f} TFLOP/s  ({census['lowered_fp8_dots']} FP8 dots, "
                    f"{census['lowered_other_dots']} other)")
    return report


def format_table(report: Dict[str, Any]) -> str:
    """The results of :func:`run` as a plain-text table."""
    header = (f"{'dtype':<14} {'precision':<9} {'mode':<10} {'n':>6} {'median ms':>11} "
              f"{'TFLOP/s':>10}")
    lines = [f"device: {report['device']}", header, "-" * len(header)]
    for r in report["results"]:
        lines.append(f"{r['dtype']:<14} {r['precision']:<9} {r['mode']:<10} {r['n']:>6d} "
                     f"{r['median_ms']:>11.4f} {r['tflops']:>10.4f}")
    for s in report.get("skipped", []):
        lines.append(f"{s['dtype']:<14} {s['precision']:<9} skipped: {s['reason']}")
    if report.get("fp8"):
        head = (f"{'fp8 recipe':<12} {'pass':<8} {'n':>6} {'median ms':>11} {'TFLOP/s':>10} "
                f"{'FP8 dots':>9} {'other':>6}  FP8 GEMM")
        lines += ["", head, "-" * len(head)]
        for r in report["fp8"]:
            lines.append(f"{r['recipe']:<12} {r['pass']:<8} {r['n']:>6d} {r['median_ms']:>11.4f} "
                         f"{r['tflops']:>10.4f} {r['lowered_fp8_dots']:>9d} {r['lowered_other_dots']:>6d}  "
                         f"{r['fp8_gemm']}")
    return "\n".join(lines)


def _sizes_arg(text: str) -> List[int]:
    sizes = []
    for token in text.split(","):
        token = token.strip()
        if not token.isdigit() or int(token) < 1:
            raise argparse.ArgumentTypeError(
                f"bad size {token!r} in {text!r}: sizes are integers >= 1, comma-separated")
        sizes.append(int(token))
    return sizes


def _recipes_arg(text: str) -> List[str]:
    if text.strip() == "none":
        return []
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in FP8_RECIPES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"bad FP8 recipe(s) {bad or text!r}; allowed: "
                                         f"{', '.join(FP8_RECIPES)} or none")
    return names


def _repeats_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"repeats must be an integer >= {MIN_REPEATS}, got {text!r}") from None
    try:
        return check_repeats(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; returns the exit status (argparse exits 2 on bad flags)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=_sizes_arg, default=None,
                        help=f"comma-separated matrix sizes (default on CPU: "
                             f"{','.join(map(str, CPU_SIZES))}; on accelerators: --gpu-sizes)")
    parser.add_argument("--gpu-sizes", type=_sizes_arg, default=list(GPU_SIZES),
                        help="sizes used when --sizes is not given and the backend is not CPU "
                             f"(default {','.join(map(str, GPU_SIZES))})")
    parser.add_argument("--repeats", type=_repeats_arg, default=MIN_REPEATS,
                        help=f"timed samples per measurement, >= {MIN_REPEATS} (median reported)")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT",
                        help="also write the results as JSON to OUT")
    parser.add_argument("--fp8-recipes", type=_recipes_arg, default=list(FP8_RECIPES),
                        help="comma-separated jaxmp.fp8 recipes to benchmark, or 'none' "
                             f"(default {','.join(FP8_RECIPES)})")
    args = parser.parse_args(argv)
    if args.json is not None and (problem := output_problem(str(args.json))):
        parser.error(f"--json: {problem}")

    device = jax.devices()[0]
    sizes = args.sizes or (list(CPU_SIZES) if device.platform == "cpu" else args.gpu_sizes)
    print(f"matmul benchmark on {device.platform} ({device.device_kind}), sizes {sizes}, "
          f"{args.repeats} repeats")
    report = run(sizes, args.repeats, device=device, fp8_recipes=args.fp8_recipes)
    print(format_table(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
