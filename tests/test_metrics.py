"""metrics.jsonl and TensorBoard: strict JSON, torn last lines, resume without duplicates."""
import json
import math
import pathlib
import struct

import pytest

from jaxmp.train.metrics import MetricsWriter, read_metrics


def events(logdir):
    """Every Event proto in the tfevents files under ``logdir``, file by file (TFRecord
    framing: uint64 length, uint32 crc, data, uint32 crc)."""
    from tensorboardX.proto.event_pb2 import Event
    out = []
    for path in sorted(pathlib.Path(logdir).rglob("events.out.tfevents.*")):
        data, i, file_events = path.read_bytes(), 0, []
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            file_events.append(Event.FromString(data[i + 12:i + 12 + n]))
            i += 12 + n + 4
        out.append(file_events)
    return out


def test_non_finite_values_are_null_and_the_file_is_strict_json(tmp_path):
    w = MetricsWriter(tmp_path)
    w.write(1, "train", {"loss": math.nan, "grad_norm": math.inf, "lr": 0.5, "applied": False})
    w.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    record = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert record == {"step": 1, "split": "train", "loss": None, "grad_norm": None, "lr": 0.5,
                      "applied": False}
    # TensorBoard gets the finite number only (no 'NaN or Inf found' warning).
    tags = {v.tag for f in events(tmp_path / "tensorboard") for e in f for v in e.summary.value}
    assert tags == {"train/lr"}


def test_a_torn_last_line_is_dropped_with_a_warning_on_resume(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "split": "train", "loss": 2.0}\n{"step": 2, "split": "train", "lo')
    assert [r["step"] for r in read_metrics(path)] == [1]
    MetricsWriter(tmp_path, start_step=1).close()
    assert "dropping its last line, cut off mid-write" in capsys.readouterr().out
    assert path.read_text() == '{"step": 1, "split": "train", "loss": 2.0}\n'


def test_a_bad_line_elsewhere_is_an_error_naming_the_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "split": "train"}\nnot json\n{"step": 3, "split": "train"}\n')
    with pytest.raises(ValueError, match=rf"{path}, line 2: not a JSON record"):
        read_metrics(path)


def test_resume_truncates_the_jsonl_and_purges_tensorboard_after_the_checkpoint(tmp_path):
    w = MetricsWriter(tmp_path)
    for step in range(1, 6):
        w.write(step, "train", {"loss": float(step)})
    w.close()
    w = MetricsWriter(tmp_path, start_step=3)  # resumed from a checkpoint at step 3
    for step in (4, 5):
        w.write(step, "train", {"loss": 10.0 + step})
    w.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 14.0), (5, 15.0)]
    first, second = events(tmp_path / "tensorboard")
    # The resumed file opens with a START at step 4: TensorBoard hides the first file's
    # events from step 4 on, so steps 4 and 5 show once, with the new values.
    start = [e for e in second if e.HasField("session_log")]
    assert start and start[0].step == 4 and start[0].session_log.status == 1  # SessionLog.START
    assert [e.step for e in second if e.summary.value] == [4, 5]
    assert not any(e.HasField("session_log") for e in first)


def test_the_tensorboard_writer_loads_without_torch_and_leaves_it_importable(tmp_path):
    """A fresh interpreter: MetricsWriter opens tensorboardX without importing torch (the
    hf extra installs it; tensorboardX would import it for type hints only), writes its
    scalar, and torch, where installed, still imports afterwards."""
    import subprocess
    import sys

    code = (
        "import importlib.util, sys\n"
        "from jaxmp.train.metrics import MetricsWriter\n"
        f"w = MetricsWriter({str(tmp_path)!r})\n"
        "w.write(3, 'train', {'loss': 2.5}); w.close()\n"
        "print('torch' in sys.modules, 'torch' in sys.modules and sys.modules['torch'] is None)\n"
        "if importlib.util.find_spec('torch') is not None:\n"
        "    import torch; print(torch.tensor([1.0]).sum().item())\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, cwd=pathlib.Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.split()
    assert lines[:2] == ["False", "False"] and lines[2:] in ([], ["1.0"])
    scalars = [(e.step, v.tag, v.simple_value) for f in events(tmp_path / "tensorboard")
               for e in f for v in e.summary.value]
    assert (3, "train/loss", 2.5) in scalars
