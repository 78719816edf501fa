"""Multi-process start-up and JAX's coordination path, with real processes over loopback.

- Nothing of jaxmp sits between a process and JAX's coordination service: JAX's client
  in process 1 is given the coordinator's own address, and when process 0 (which hosts
  the service) dies, process 1 stops within a bounded time, by the watchdog's line or by
  JAX's own abort (tests/_peer_probe.py, a few seconds a process).
- Start-up faults, each one line and exit 1 within a bounded time: the coordinator's port
  already in use, only process 0 started, processes given different configs (train.py).
"""
import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from _configs import ROOT
from test_multiprocess import LIMIT_S, OVERRIDES, free_port
from _xla import cpu_flags

ENV = dict(os.environ, XLA_FLAGS=cpu_flags(4), JAX_PLATFORMS="cpu")


def wait_files(paths, procs):
    import time
    deadline = time.monotonic() + LIMIT_S
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"none of {paths} within {LIMIT_S} s"
        assert all(p.poll() is None for p in procs), "a probe exited before it was ready"
        time.sleep(0.05)


@pytest.mark.slow
def test_jaxs_client_reaches_the_coordinator_directly_and_a_dead_coordinator_ends_process_1(
        tmp_path):
    address = f"127.0.0.1:{free_port()}"
    (tmp_path / "checkpoints" / "7").mkdir(parents=True)
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "_peer_probe.py"), address,
                               "2", str(i), str(tmp_path)], cwd=ROOT, env=ENV,
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=open(tmp_path / f"err.{i}", "w")) for i in range(2)]
    try:
        wait_files([tmp_path / "ready.0", tmp_path / "ready.1"], procs)
        for i in range(2):
            info = json.loads((tmp_path / f"info.{i}").read_text())
            assert info["coordinator_address"] == address, info  # no relay's own address
            assert not [t for t in info["threads"] if "relay" in t], info
        procs[0].send_signal(signal.SIGKILL)
        procs[1].wait(timeout=LIMIT_S)  # bounded: the watchdog's line or JAX's own abort
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    err = (tmp_path / "err.1").read_text()
    assert procs[1].returncode != 0, err[-3000:]
    ours = ("train.py: error: process 0 of 2 exited without a word (killed or crashed); process 1 "
            f"stops too. The last checkpoint to resume from is step 7 in "
            f"{tmp_path / 'checkpoints'}; rerun all 2 processes to resume")
    assert ours in err.splitlines() or "Fatal Python error" in err or procs[1].returncode < 0, \
        err[-3000:]


def _train(workdir, port, pid, *extra, n=2):
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/tiny_moe.py"),
           "--workdir", str(workdir), f"--coordinator_address=127.0.0.1:{port}",
           f"--num_processes={n}", f"--process_id={pid}", "--heartbeat_timeout=20",
           *(e if e.startswith("--") else f"--config.{e}"
             for e in OVERRIDES + ["train.steps=2"] + list(extra))]
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _lines(err):
    return [line for line in err.splitlines() if line.startswith("train.py")]


@pytest.mark.slow
def test_start_up_faults_are_one_line_each_within_a_bounded_time(tmp_path):
    """All at once: a busy port (process 0 refuses it before JAX binds it; process 1, its
    coordinator never answering, gives up after --startup_timeout), process 0 alone (says
    which process it awaits, then gives up), and a pair whose configs differ (both refuse,
    naming the key, before any collective)."""
    busy = socket.create_server(("127.0.0.1", 0))  # another program holds the port
    port, alone, pair = busy.getsockname()[1], free_port(), free_port()
    timeout = "--startup_timeout=4"  # the two that wait give up after it
    runs = {"busy0": _train(tmp_path / "busy", port, 0, timeout),
            "busy1": _train(tmp_path / "busy", port, 1, timeout),
            "alone": _train(tmp_path / "alone", alone, 0, timeout),
            "diff0": _train(tmp_path / "diff", pair, 0, "train.batch_size=8"),
            "diff1": _train(tmp_path / "diff", pair, 1, "train.batch_size=16")}
    out = {}
    try:
        for name, p in runs.items():
            out[name] = p.communicate(timeout=LIMIT_S)[1]
    finally:
        busy.close()
        for p in runs.values():
            if p.poll() is None:
                p.kill()
    for name, p in runs.items():
        assert p.returncode == 1, (name, out[name][-3000:])
        assert "Traceback" not in out[name] and "Fatal Python error" not in out[name], \
            (name, out[name][-3000:])
    assert _lines(out["busy0"]) == [
        f"train.py: error: --coordinator_address=127.0.0.1:{port}: port {port} is already in use "
        "on this host (another run, or another program); choose a free port for every process"]
    assert _lines(out["busy1"]) == [
        f"train.py: process 1 of 2: waiting up to 4 s for process 0's coordinator at "
        f"127.0.0.1:{port} and the other processes (--startup_timeout)",
        f"train.py: error: process 1 of 2: process 0's coordinator or another process did not "
        f"answer to 127.0.0.1:{port} within 4 s (--startup_timeout); start all 2 processes with "
        "the same --coordinator_address and --num_processes"], out["busy1"][-3000:]
    assert _lines(out["alone"]) == [
        f"train.py: process 0 of 2: waiting up to 4 s for process 1 to connect to "
        f"127.0.0.1:{alone} (--startup_timeout)",
        f"train.py: error: process 0 of 2: not every process connected to 127.0.0.1:{alone} "
        "within 4 s (--startup_timeout); start all 2 processes with the same "
        "--coordinator_address and --num_processes"], out["alone"][-3000:]
    for me, other, mine, theirs in ((0, 1, 8, 16), (1, 0, 16, 8)):
        assert _lines(out[f"diff{me}"]) == [
            f"train.py: error: process {me} and process {other} were given different configs "
            f"(train.batch_size: {mine} here, {theirs} there); give every process the same "
            "--workdir, --config and --config.KEY=VALUE flags"], out[f"diff{me}"][-3000:]
    assert not (tmp_path / "diff" / "checkpoints").exists()  # refused before any work
