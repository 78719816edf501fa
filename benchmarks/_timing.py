"""Wall-clock timing of JAX calls that waits for the device, shared by the benchmarks.

JAX dispatch is asynchronous: a jitted call returns as soon as the work is queued, so
a clock read right after it measures the dispatch, not the computation. Every sample
here ends with ``jax.block_until_ready`` on all results of the sample.

One sample is one pass over a *ring* of argument tuples: ``fn`` is called once per
tuple, back to back, and the sample's time is divided by the ring's length. Distinct
inputs keep a cache from serving a repeated call's operands (the last call's inputs
may still sit in the GPU's L2), and queueing several calls before waiting hides the
per-call launch latency, as a training step's stream of kernels does.
"""
from __future__ import annotations

import numbers
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

__all__ = ["MIN_REPEATS", "check_repeats", "time_per_call"]

# The median of fewer samples moves with a single preempted sample.
MIN_REPEATS = 10


def check_repeats(repeats: Any) -> int:
    """Returns ``repeats`` as an int after checking it is an integer >= :data:`MIN_REPEATS`.

    Raises:
      ValueError: ``repeats`` is not an integer (bools refused) or is below 10.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, numbers.Integral):
        raise ValueError(f"repeats must be an integer >= {MIN_REPEATS}, got {repeats!r}")
    if repeats < MIN_REPEATS:
        raise ValueError(f"repeats={repeats} is too few: the median needs at least "
                         f"{MIN_REPEATS} timed samples")
    return int(repeats)


def time_per_call(fn: Callable[..., Any], ring: Sequence[tuple], *, repeats: int = MIN_REPEATS,
                  warmup: int = 1) -> np.ndarray:
    """Seconds per call of ``fn``, one sample per pass over ``ring``.

    Args:
      fn: the callable to time (typically jitted); its results are waited on with
        ``jax.block_until_ready``.
      ring: the argument tuples, at least one; each pass calls ``fn(*args)`` for every
        tuple in order.
      repeats: number of timed passes, >= :data:`MIN_REPEATS`.
      warmup: untimed passes first (>= 0); the first call of a jitted function
        compiles, which must not be timed.

    Returns:
      float64 array ``[repeats]``: each pass's wall time (``time.perf_counter``) divided
      by ``len(ring)``, in seconds.

    Raises:
      ValueError: an empty ring, too few repeats or a negative warmup.
    """
    repeats = check_repeats(repeats)
    if len(ring) == 0:
        raise ValueError("ring must hold at least one argument tuple")
    if isinstance(warmup, bool) or not isinstance(warmup, numbers.Integral) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")

    def one_pass():
        start = time.perf_counter()
        jax.block_until_ready([fn(*args) for args in ring])
        return (time.perf_counter() - start) / len(ring)

    for _ in range(warmup):
        one_pass()
    return np.array([one_pass() for _ in range(repeats)], dtype=np.float64)
