"""Two real processes with 4 CPU devices each, over loopback, against one process with 8:
the same losses step by step, and a checkpoint written by both and resumed by both. A
process killed mid-run is tests/test_faults.py's (the survivor's one-line exit).

Every wait is bounded by progress (rows in metrics.jsonl) or by a generous limit.
"""
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from _configs import ROOT, load_config
from jaxmp.train import train_and_evaluate

OVERRIDES = ["precision.policy=float32", "model.num_layers=1", "model.first_dense_layers=0", "data.max_tokens=50000",
             "data.num_eval_batches=1", "train.log_every=1", "train.eval_every=0",
             "train.sample_tokens=0", "optim.decay_steps=200"]
LIMIT_S = 900
RTOL = 1e-5  # cross-process float32 sums add in another order than one process's


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_pair(workdir, *extra):
    port = free_port()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu", JAX_DISABLE_MOST_OPTIMIZATIONS="1")
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/tiny_moe.py"),
           "--workdir", str(workdir), f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
           "--heartbeat_timeout=20", *(f"--config.{o}" for o in OVERRIDES + list(extra))]
    return [subprocess.Popen(cmd + [f"--process_id={i}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for i in range(2)]


def finish(procs):
    out = []
    try:
        for p in procs:
            out.append(p.communicate(timeout=LIMIT_S))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return out


# One 8-device process's losses, computed once per pytest process for the longest run asked
# and shared by the two-process tests (this module's, tests/test_preemption.py's and
# tests/test_faults.py's killed peer: one xdist group, GROUP). A run's first steps do not
# depend on train.steps: OVERRIDES fix the schedule's decay_steps (the two-process runs of
# 100000 steps in tests/test_preemption.py match one process's shorter run for that reason).
GROUP = "two_processes"
REFERENCE_STEPS = 16  # the preemption test's last step is about 10
_REFERENCE = []


def reference_losses(steps):
    """The train losses of steps 1..``steps`` of one process with 8 CPU devices."""
    if len(_REFERENCE) < steps:
        workdir = tempfile.mkdtemp(prefix="jaxmp-reference-")
        try:
            train_and_evaluate(load_config("tiny_moe", OVERRIDES + [
                f"train.steps={max(steps, REFERENCE_STEPS)}", "train.checkpoint_every=100000"]),
                workdir)
            _REFERENCE[:] = [r["loss"] for r in rows(workdir)]
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    return _REFERENCE[:steps]


def rows(workdir):
    path = pathlib.Path(workdir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["split"] == "train"]


@pytest.mark.xdist_group(GROUP)  # the reference run is shared (reference_losses)
@pytest.mark.slow
def test_two_processes_match_one_and_resume_together(tmp_path):
    # One process, 8 devices: the reference, 8 steps.
    want = reference_losses(8)
    assert len(want) == 8

    # Two processes, 4 devices each: 4 steps, a checkpoint at step 4 written by both.
    two = tmp_path / "two"
    results = finish(launch_pair(two, "train.steps=4", "train.checkpoint_every=4"))
    for p, (out, err) in zip((0, 1), results):
        assert "Traceback" not in err, err[-3000:]
    assert "jaxmp trainer" in results[0][0] and "devices     : 8 x cpu (2 processes)" in results[0][0]
    # Only process 0 prints, logs and samples (gloo's own connection lines aside).
    assert "jaxmp trainer" not in results[1][0] and "done:" not in results[1][0]
    assert (two / "checkpoints" / "4").is_dir()
    np.testing.assert_allclose([r["loss"] for r in rows(two)], want[:4], rtol=RTOL)

    # Rerun both to step 8: from the step-4 checkpoint, the same losses as one process.
    results = finish(launch_pair(two, "train.steps=8", "train.checkpoint_every=100000"))
    assert "resumed from" in results[0][0] and "at step 4" in results[0][0], results[0][1][-3000:]
    got = rows(two)
    assert [r["step"] for r in got] == list(range(1, 9))
    np.testing.assert_allclose([r["loss"] for r in got], want, rtol=RTOL)
