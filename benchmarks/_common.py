"""Pieces shared by the train-step benchmarks (overhead.py, train_step.py).

Both scripts take a trainer config file (``--config configs/NAME.py``, overridden as in
``train.py``: ``--config.model.num_layers=4``), build the trainer's own
:class:`~jaxmp.train.experiment.Experiment` on a 1-device mesh (:func:`experiment`), time
its jitted train step over a ring of random token batches placed on the device
beforehand, and write JSON.
"""
from __future__ import annotations

import contextlib
import json
import pathlib
from typing import Any, Dict, Iterator, List

import jax
import numpy as np

from jaxmp.analysis.report import output_problem
from jaxmp.train import Experiment

__all__ = ["ROOT", "DEFAULT_CONFIG", "experiment", "random_batches", "device_info", "write_json",
           "check_json_flag", "compilation_cache_settings", "uncached_compiles"]

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = str(ROOT / "configs" / "tiny_moe.py")


@contextlib.contextmanager
def compilation_cache_settings(**settings: Any) -> Iterator[None]:
    """JAX's persistent compilation cache with ``settings`` (``jax.config`` names and
    values) inside, as it was on leaving.

    JAX opens its cache once per process, at its first compile, and keeps it open: the
    cache is reset (``jax.experimental.compilation_cache.compilation_cache.reset_cache``) on
    entering and on leaving, so that the compiles inside see the new settings and those
    after the block the previous ones (not, say, a deleted temporary directory).
    """
    from jax.experimental.compilation_cache import compilation_cache as cc

    before = {k: getattr(jax.config, k) for k in settings}
    try:
        for k, v in settings.items():
            jax.config.update(k, v)
        cc.reset_cache()
        yield
    finally:
        for k, v in before.items():
            jax.config.update(k, v)
        cc.reset_cache()


def uncached_compiles():
    """JAX's persistent compilation cache off inside, on again (as it was) on leaving
    (:func:`compilation_cache_settings`).

    The compile seconds the benchmarks report must be compilations: with a cache
    (``JAX_COMPILATION_CACHE_DIR``, which the test suite sets for every process) a program
    compiled before would be a cache read. Setting the flag for the whole process on
    import instead turned the cache off in every process that imported this module, the
    test suite's workers included.
    """
    return compilation_cache_settings(jax_enable_compilation_cache=False)


def experiment(config) -> Experiment:
    """The trainer's :class:`~jaxmp.train.experiment.Experiment` of ``config`` on a 1-device
    mesh: the same object ``train.py`` builds, so the step timed is the step trained.

    Raises:
      ValueError: a bad config value (as the trainer's).
    """
    return Experiment.create(config, num_devices=1)


def random_batches(vocab_size: int, batch_size: int, seq_len: int, count: int, seed: int = 0,
                   device: Any = None) -> List[Dict[str, jax.Array]]:
    """``count`` batches ``{"inputs", "targets"}`` of int32 [batch_size, seq_len] on ``device``
    (a ``jax.Device`` or a ``Sharding``, e.g. an experiment's ``batch_sharding``).

    Tokens are uniform in ``[0, vocab_size)`` (NumPy, seeded); targets are the inputs
    shifted by one, as in language-model training. Random tokens cost the same FLOPs as
    text; only the routing (which experts get how many tokens) depends on the data.

    Raises:
      ValueError: a size or count below 1.
    """
    for name, value in (("vocab_size", vocab_size), ("batch_size", batch_size),
                        ("seq_len", seq_len), ("count", count)):
        if int(value) < 1:
            raise ValueError(f"{name} must be >= 1, got {value!r}")
    rng = np.random.default_rng(seed)
    device = device or jax.devices()[0]
    batches = []
    for _ in range(count):
        tokens = rng.integers(0, vocab_size, size=(batch_size, seq_len + 1), dtype=np.int32)
        batches.append(jax.device_put({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, device))
    return batches


def device_info(device: Any = None) -> Dict[str, Any]:
    """``{"platform", "device_kind", "devices_used", "devices_present"}`` of the timed device."""
    device = device or jax.devices()[0]
    return {"platform": device.platform, "device_kind": device.device_kind, "devices_used": 1,
            "devices_present": jax.device_count()}


def check_json_flag(value) -> bool:
    """absl validator of a ``--json`` flag: checked before any work, so that a long run is
    not lost to a path that cannot be written (:func:`jaxmp.analysis.report.output_problem`).

    Raises:
      absl.flags.ValidationError: naming the path and why it cannot be written.
    """
    from absl import flags  # the absl scripts' dependency only

    problem = value and output_problem(str(value))
    if problem:
        raise flags.ValidationError(problem)
    return True


def write_json(path: str, report: Dict[str, Any]) -> None:
    """Writes ``report`` as indented JSON to ``path``, creating parent folders."""
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
