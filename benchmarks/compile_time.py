"""Compile time of the trainer's step against depth, scanned and unscanned layers.

Usage::

    python benchmarks/compile_time.py --json compile_time.json
    python benchmarks/compile_time.py --layers 4,24 --unscanned --json compile_time.json

For each depth of ``--layers`` (default 4 and 24) the ``--config`` (default
``configs/seed_moe.py``: d_model 2048, seq 4096) is built with ``model.num_layers`` set
and ``model.scan_layers=True`` (and, with ``--unscanned``, False as well), as the
trainer's :class:`~jaxmp.train.experiment.Experiment` on a 1-device mesh with the
per-device micro-batch of an 8-device run (``--batch``, default 8 sequences), and its
jitted train step is traced and lowered (``train_step.lower`` on abstract inputs:
nothing is allocated) and compiled with XLA's default options, as the trainer compiles
it. Each measurement is repeated ``--repeats`` times in alternation and the fastest
kept (a shared machine only ever slows a compile down). Reported per setting: seconds
to lower, seconds to compile, and their sum; per layout, the ratio of the deepest to
the shallowest total (the target for the scanned layout: <= 1.5).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

if __package__ in (None, ""):  # run as `python benchmarks/compile_time.py`: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax

from benchmarks._common import ROOT, device_info, experiment, uncached_compiles, write_json
from jaxmp.analysis.report import output_problem
from jaxmp.train.config import config_to_dict, load_config

__all__ = ["TARGET_RATIO", "measure", "run", "main"]

TARGET_RATIO = 1.5  # deepest / shallowest compile time with scanned layers (issue 13)


def measure(config, num_layers: int, scan_layers: bool) -> Dict[str, float]:
    """Seconds to lower and to compile the trainer's step of ``config`` at one depth.

    Returns:
      ``{"num_layers", "scan_layers", "lower_s", "compile_s", "total_s"}``.
    """
    cfg = config.copy_and_resolve_references()
    cfg.model.num_layers = num_layers
    cfg.model.first_dense_layers = min(cfg.model.first_dense_layers, num_layers)
    cfg.model.scan_layers = scan_layers
    exp = experiment(cfg)
    with uncached_compiles():
        start = time.perf_counter()
        lowered = exp.train_step.lower(exp.abstract_state, exp.abstract_batch())
        lowered_at = time.perf_counter()
        lowered.compile()
        done = time.perf_counter()
    return {"num_layers": num_layers, "scan_layers": scan_layers, "lower_s": lowered_at - start,
            "compile_s": done - lowered_at, "total_s": done - start}


def run(config, layers: Sequence[int], layouts: Sequence[bool], repeats: int = 2,
        log=print) -> Dict[str, Any]:
    """Measures every (layout, depth), ``repeats`` times in alternation; returns the report.

    Returns:
      ``{"results": [{"num_layers", "scan_layers", "lower_s", "compile_s", "total_s",
      "samples"}], "ratios": {"scanned"|"unscanned": deepest / shallowest total_s},
      "target_ratio", "device", "config"}``.

    Raises:
      ValueError: fewer than two depths, a depth < 1, or repeats < 1.
    """
    layers = sorted(set(int(n) for n in layers))
    if len(layers) < 2 or layers[0] < 1:
        raise ValueError(f"layers {layers!r}: give at least two depths >= 1")
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    samples: Dict[tuple, List[Dict[str, float]]] = {}
    for _ in range(repeats):
        for scan in layouts:
            for n in layers:
                m = measure(config, n, scan)
                samples.setdefault((scan, n), []).append(m)
                log(f"  {'scanned' if scan else 'unscanned':9s} {n:3d} layers: lower {m['lower_s']:6.2f} s, "
                    f"compile {m['compile_s']:6.2f} s")
    results = []
    for (scan, n), ms in samples.items():
        best = min(ms, key=lambda m: m["total_s"])
        results.append({**best, "samples": ms})
    ratios = {}
    for scan in layouts:
        by = {r["num_layers"]: r for r in results if r["scan_layers"] == scan}
        ratios["scanned" if scan else "unscanned"] = by[layers[-1]]["total_s"] / by[layers[0]]["total_s"]
    return {"results": results, "ratios": ratios, "target_ratio": TARGET_RATIO,
            "device": device_info(), "config": config_to_dict(config)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "seed_moe.py"))
    parser.add_argument("--layers", default="4,24", help="comma-separated depths (default 4,24)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--unscanned", action="store_true", help="also measure scan_layers=False")
    parser.add_argument("--repeats", type=int, default=2, help="alternating repetitions (default 2)")
    parser.add_argument("--json", default=None, help="write the report as JSON here")
    args = parser.parse_args(argv)
    if args.json and (problem := output_problem(args.json)):
        parser.error(f"--json: {problem}")
    try:
        layers = [int(x) for x in args.layers.split(",") if x.strip()]
        config = load_config(args.config, [f"train.batch_size={args.batch}"])
        print(f"compile time on {jax.devices()[0].platform}: {args.config}, batch {args.batch}")
        report = run(config, layers, [True, False] if args.unscanned else [True], args.repeats)
    except ValueError as e:
        parser.error(str(e))
    for name, ratio in report["ratios"].items():
        verdict = ("meets" if ratio <= TARGET_RATIO else "MISSES") if name == "scanned" else "for contrast"
        print(f"  {name}: {max(layers)} / {min(layers)} layers = {ratio:.2f}x ({verdict}"
              f"{' the target <= 1.5' if name == 'scanned' else ''})")
    if args.json:
        write_json(args.json, report)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
