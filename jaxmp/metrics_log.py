"""Where training metrics go: ``metrics.jsonl``, TensorBoard event files, and a banner.

``workdir/metrics.jsonl`` gets one JSON object per logged step (``split`` is ``train``
or ``eval``); TensorBoard event files (tensorboardX) sit beside it under
``workdir/tensorboard``. Values are written as plain Python numbers.
"""
from __future__ import annotations

import json
import pathlib
from typing import Any, Mapping

import numpy as np

__all__ = ["MetricsWriter", "expert_load_stats"]


def expert_load_stats(expert_counts: np.ndarray) -> dict:
    """Summarizes per-expert token counts of the MoE layers.

    Args:
      expert_counts: float [num_moe_layers, num_experts], tokens routed to each expert.

    Returns:
      ``expert_load_max`` and ``expert_load_min``: the largest / smallest expert load
      over all layers relative to a perfectly balanced load (1.0 = balanced), and
      ``expert_load_cv``: the mean over layers of the coefficient of variation of the
      loads. Empty dict when the model has no MoE layers.
    """
    counts = np.asarray(expert_counts, np.float64)
    if counts.size == 0:
        return {}
    mean = counts.mean(axis=1, keepdims=True)
    rel = counts / np.maximum(mean, 1e-12)
    return {"expert_load_max": float(rel.max()), "expert_load_min": float(rel.min()),
            "expert_load_cv": float((counts.std(axis=1) / np.maximum(mean[:, 0], 1e-12)).mean())}


class MetricsWriter:
    """Appends metrics to ``workdir/metrics.jsonl`` and TensorBoard.

    Args:
      workdir: the run directory (created if missing).
      enabled: False on non-zero processes, so that one process writes.
    """

    def __init__(self, workdir: str | pathlib.Path, enabled: bool = True):
        self.enabled = enabled
        self.path = pathlib.Path(workdir) / "metrics.jsonl"
        self._tb = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            from tensorboardX import SummaryWriter  # imported here: slow import, one process
            self._tb = SummaryWriter(str(pathlib.Path(workdir) / "tensorboard"))

    def write(self, step: int, split: str, metrics: Mapping[str, Any]) -> None:
        """Writes one record ``{"step": step, "split": split, **metrics}``."""
        if not self.enabled:
            return
        record = {"step": int(step), "split": split}
        for k, v in metrics.items():
            record[k] = v.item() if hasattr(v, "item") else v
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        for k, v in record.items():
            if k not in ("step", "split") and isinstance(v, (int, float)):
                self._tb.add_scalar(f"{split}/{k}", v, step)
        self._tb.flush()

    def truncate_after(self, step: int) -> None:
        """Drops records past ``step``: a resumed run rewrites the steps after its checkpoint."""
        if not self.enabled or not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
