"""Where training metrics go: ``metrics.jsonl`` and TensorBoard event files.

``workdir/metrics.jsonl`` gets one strict-JSON object per logged step (``split`` is
``train`` or ``eval``): a value that is not finite (the loss of a skipped step, say) is
written as ``null``, which ``jq``, JavaScript and every JSON loader accept, where a bare
``NaN`` is not JSON. TensorBoard event files (tensorboardX) go to ``workdir/tensorboard``,
finite values only. On resume, both drop what was logged after the checkpoint: the
JSON lines past it are removed, and TensorBoard is opened with ``purge_step`` so that the
rewritten steps are not shown twice. ``metrics.jsonl`` is never rewritten in place: when
lines must go, the kept ones are written to a new file that then replaces it
(``os.replace``, atomic), so a process killed during a resume leaves the whole history.
A ``metrics.jsonl`` that is not a regular file (a named pipe, which would hang the
process that opens it; a directory; a device) is refused, in one line, before it is
opened.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import stat
from typing import Any, List, Mapping, Optional

import numpy as np

__all__ = ["MetricsWriter", "expert_load_stats", "read_metrics"]


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


def _plain(v: Any) -> Any:
    """A JSON-ready Python value: NumPy scalars unwrapped, non-finite floats as None."""
    if hasattr(v, "item") and np.ndim(v) == 0:
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _is_file(path: pathlib.Path) -> bool:
    """Whether ``path`` exists, found by ``os.stat`` without opening it.

    Raises:
      ValueError: it exists but is not a regular file (a named pipe, which would block
        the ``open`` until a writer comes; a directory; a socket or a device).
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return False
    if stat.S_ISREG(mode):
        return True
    kind = ("a named pipe (FIFO)" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a device or other special file")
    raise ValueError(f"{path} is {kind}, not a regular file of metrics; move it away")


def read_metrics(path: str | os.PathLike, split: Optional[str] = None) -> List[dict]:
    """The records of a ``metrics.jsonl`` (of one ``split`` when given), in file order.

    A last line without its newline (cut off by a kill) is dropped, as the trainer drops
    it on resume; any other line that is not JSON is an error.

    Raises:
      ValueError: a line that is not UTF-8 text, not a JSON object, or whose ``step`` is
        not an integer, naming the file and line number; ``path`` is not a regular file
        (a named pipe, say: it is not opened).
    """
    path = pathlib.Path(path)
    if not _is_file(path):
        return []
    lines = path.read_bytes().split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    elif lines:
        lines.pop()  # torn last line: no newline was written after it
    records = []
    for i, raw in enumerate(lines, start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}, line {i}: not UTF-8 text ({e.reason} at byte {e.start} "
                             f"of the line)") from None
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}, line {i}: not a JSON record ({e})") from None
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            raise ValueError(f"{path}, line {i}: not a metrics record (an object with an "
                             f"integer step): {line[:80]!r}")
        if split is None or record.get("split") == split:
            records.append(record)
    return records


def _summary_writer():
    """tensorboardX's ``SummaryWriter``, imported without torch.

    ``tensorboardX.writer`` imports torch when it is installed (the ``hf`` extra), only to
    name ``torch.Tensor`` in type hints; this writer logs Python floats. That import costs
    about 3.5 CPU-seconds and 300 MB per trainer process (measured on the 2-core CI
    machine), so while tensorboardX loads, ``import torch`` raises ImportError, which
    tensorboardX catches; ``sys.modules`` is left as it was. Where torch or tensorboardX is
    already loaded, this is a plain import.
    """
    import sys

    if "torch" in sys.modules or "tensorboardX" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None  # type: ignore[assignment]  # import torch -> ImportError
    try:
        from tensorboardX import SummaryWriter
    finally:
        if sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    return SummaryWriter


class MetricsWriter:
    """Appends metrics to ``workdir/metrics.jsonl`` and TensorBoard.

    Args:
      workdir: the run directory (created if missing).
      start_step: the step training resumes from (0 for a fresh run): records past it
        are removed from ``metrics.jsonl`` (a torn last line with a warning) and
        TensorBoard purges the events after it.
      enabled: False on non-zero processes, so that one process writes.

    Raises:
      OSError: the directory cannot be written.
      ValueError: ``metrics.jsonl`` is not a regular file (a named pipe, say), or holds a
        line that is not a metrics record (:func:`read_metrics`).
    """

    def __init__(self, workdir: str | pathlib.Path, start_step: int = 0, enabled: bool = True):
        self.enabled = enabled
        self.path = pathlib.Path(workdir) / "metrics.jsonl"
        self._tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._truncate_after(int(start_step))
        SummaryWriter = _summary_writer()
        # purge_step: events at steps >= start_step + 1 written by an earlier, interrupted
        # run are hidden, so the steps this run rewrites appear once.
        # The suffix keeps two writers opened within one second from sharing a file name.
        self._tb = SummaryWriter(str(pathlib.Path(workdir) / "tensorboard"),
                                 purge_step=int(start_step) + 1 if start_step else None,
                                 filename_suffix=f".{os.getpid()}.{int(start_step)}")

    def write(self, step: int, split: str, metrics: Mapping[str, Any]) -> None:
        """Writes one record ``{"step": step, "split": split, **metrics}``.

        Raises:
          OSError: the files cannot be written (full disk, read-only); the message names
            the directory.
          ValueError: ``metrics.jsonl`` is no longer a regular file (a named pipe put in
            its place, say: it is not opened).
        """
        if not self.enabled:
            return
        record = {"step": int(step), "split": split}
        record.update({k: _plain(v) for k, v in metrics.items()})
        _is_file(self.path)  # before open(): appending to a named pipe blocks
        try:
            with self.path.open("a") as f:
                f.write(json.dumps(record, allow_nan=False) + "\n")
            for k, v in record.items():
                if (k not in ("step", "split") and isinstance(v, (int, float))
                    and not isinstance(v, bool)):
                    self._tb.add_scalar(f"{split}/{k}", v, step)
            self._tb.flush()
        except OSError as e:
            raise OSError(e.errno, f"writing the metrics of step {step} to {self.path.parent} "
                                   f"failed: {e.strerror or e}") from None

    def _truncate_after(self, step: int) -> None:
        """Drops records past ``step`` (a resumed run rewrites the steps after its
        checkpoint; a fresh run, step 0, starts an empty file). The file is left as it is
        when nothing is dropped; else the kept records go to ``metrics.jsonl.tmp``, which
        then replaces it atomically."""
        if not _is_file(self.path):
            return
        text = self.path.read_bytes().decode("utf-8", errors="replace")  # read_metrics checks
        torn = bool(text) and not text.endswith("\n")
        if torn:
            line = text.rsplit("\n", 1)[-1]
            print(f"warning: {self.path}: dropping its last line, cut off mid-write: {line[:60]!r}")
        records = read_metrics(self.path)
        kept = [r for r in records if r["step"] <= step]
        if not torn and len(kept) == len(records):
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w") as f:
            f.write("".join(json.dumps(r, allow_nan=False) + "\n" for r in kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def close(self, raise_errors: bool = True) -> None:
        """Flushes and closes the TensorBoard writer (idempotent).

        Args:
          raise_errors: False when an error is already on its way out (a failed write):
            a failure to close (the same full disk, say) must not replace it.

        Raises:
          OSError: closing failed (a final flush to a full disk), when ``raise_errors``.
        """
        tb, self._tb = self._tb, None
        if tb is None:
            return
        try:
            tb.close()
        except OSError as e:
            if raise_errors:
                raise OSError(e.errno, f"closing the TensorBoard files in {self.path.parent} "
                                       f"failed: {e.strerror or e}") from None
