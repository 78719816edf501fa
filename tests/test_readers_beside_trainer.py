"""Issue 28, item 1, across real processes: ``python -m jaxmp.sample`` and
``python -m jaxmp.export`` read a workdir while ``train.py`` writes checkpoints into it
(every 2 steps). Before, the first reader's orbax cleaned up the trainer's in-flight
``STEP.orbax-checkpoint-tmp`` and the trainer died at its next save. Now both readers
finish, the trainer trains and saves on while they run, stops on SIGTERM with its
checkpoint saved, and every checkpoint it left loads and verifies.

(tests/test_faults_round3.py checks the same in-process: a reader changes nothing in a
workdir.) Every wait is bounded by progress or a generous limit.
"""
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from _configs import ROOT
from jaxmp.train import load
from _xla import cpu_flags

LIMIT_S = 600
OVERRIDES = ["precision.policy=float32", "model.num_layers=1", "model.first_dense_layers=0",
             "data.max_tokens=50000", "data.num_eval_batches=1", "train.log_every=1",
             "train.eval_every=0", "train.sample_tokens=0", "train.steps=100000",
             "train.checkpoint_every=2", "train.keep_checkpoints=3"]
ENV = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_flags(2),
           PYTHONPATH=str(ROOT))


def _steps(workdir):
    d = pathlib.Path(workdir) / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []


def _logged(workdir):
    path = pathlib.Path(workdir) / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines()
               if line.endswith("}") and json.loads(line)["split"] == "train")


def _wait(condition, procs, what):
    deadline = time.monotonic() + LIMIT_S
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {LIMIT_S} s"
        assert all(p.poll() is None for p in procs), f"a process exited before {what}"
        time.sleep(0.05)


@pytest.mark.slow
def test_sample_and_export_beside_a_training_run_leave_it_training_and_intact(tmp_path):
    workdir, out = tmp_path / "run", tmp_path / "export"
    trainer = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/tiny_moe.py"),
         "--workdir", str(workdir), *(f"--config.{o}" for o in OVERRIDES)],
        cwd=ROOT, env=ENV, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    readers = []
    try:
        _wait(lambda: _steps(workdir), [trainer], "first checkpoint")
        readers = [subprocess.Popen([sys.executable, "-m", "jaxmp.sample", "--workdir",
                                     str(workdir), "--tokens", "4"], cwd=ROOT, env=ENV,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True),
                   subprocess.Popen([sys.executable, "-m", "jaxmp.export", "--workdir",
                                     str(workdir), "--out", str(out)], cwd=ROOT, env=ENV,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)]
        logged = _logged(workdir)
        read = [r.communicate(timeout=LIMIT_S) for r in readers]
        for r, (r_out, r_err) in zip(readers, read):
            assert r.returncode == 0, r_err[-3000:]
        assert trainer.poll() is None, trainer.communicate()[1][-3000:]  # it trains on
        # ... and saves on: two more checkpoints after the readers ended.
        now = max(_steps(workdir))
        _wait(lambda: max(_steps(workdir)) >= now + 4, [trainer], "two more checkpoints")
        assert _logged(workdir) > logged
        trainer.send_signal(signal.SIGTERM)
        t_out, t_err = trainer.communicate(timeout=LIMIT_S)
    finally:
        for p in [trainer] + readers:
            if p.poll() is None:
                p.kill()
    assert trainer.returncode == 143, t_err[-3000:]
    lines = [line for line in t_err.splitlines() if line.startswith("train.py:")]
    assert len(lines) == 1 and "checkpoint saved in" in lines[0], t_err[-3000:]
    assert "Traceback" not in t_err and "FileNotFoundError" not in t_err, t_err[-3000:]
    ckpts = workdir / "checkpoints"
    assert not (ckpts / "corrupt").exists() or not any((ckpts / "corrupt").iterdir())
    assert [p.name for p in ckpts.iterdir() if "tmp" in p.name] == []
    steps = _steps(workdir)
    assert len(steps) >= 3 and lines[0].startswith(f"train.py: SIGTERM at step {steps[-1]}:")
    for step in steps:  # each verifies its checksums and finiteness as it restores
        model, tokenizer, config = load(workdir, step)
        assert config.train.checkpoint_every == 2
    assert (out / "config.json").exists() and read[0][0].strip()
