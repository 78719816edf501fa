"""Faults a long run meets: SIGTERM and Ctrl-C, SIGKILL in the middle of a checkpoint
write, a full disk and a read-only workdir. Every run resumes from the last complete
checkpoint, and its losses equal an uninterrupted run's, loss by loss.

The subprocesses are bounded by progress (rows in metrics.jsonl, checkpoints on disk)
with generous time limits, never by how fast the machine is.
"""
import hashlib
import json
import os
import re
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from _configs import ROOT, load_config
from _train_py import run_train_py
from jaxmp.train import CheckpointError, Checkpointer, Experiment, Interrupted, train_and_evaluate
from jaxmp.train.config import config_to_dict
from jaxmp.train.metrics import read_metrics
from _xla import cpu_flags

# One MoE layer on a small corpus; the schedule's horizon is fixed (decay_steps), so a
# run's first N losses do not depend on train.steps.
OVERRIDES = ["model.num_layers=1", "model.first_dense_layers=0", "data.max_tokens=50000",
             "data.num_eval_batches=1", "train.log_every=1", "train.eval_every=0",
             "train.sample_tokens=0", "optim.decay_steps=200"]
ENV = dict(os.environ, JAX_DISABLE_MOST_OPTIMIZATIONS="1")  # the 8-device XLA_FLAGS are inherited
LIMIT_S = 900  # per wait: generous on a slow, shared machine


def launch(workdir, *extra):
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/tiny_moe.py"),
           "--workdir", str(workdir), *(f"--config.{o}" for o in OVERRIDES + list(extra))]
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def wait_for(condition, proc, what):
    """Polls ``condition()`` until it holds; fails if the process exits first."""
    deadline = time.monotonic() + LIMIT_S
    while time.monotonic() < deadline:
        if condition():
            return
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the trainer exited ({proc.returncode}) before {what}:\n{err[-3000:]}")
        time.sleep(0.01)
    proc.kill()
    pytest.fail(f"no {what} within {LIMIT_S} s")


def finish(proc):
    try:
        return proc.communicate(timeout=LIMIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()


def assert_sigkilled_run_resumes_bitwise(workdir, *overrides):
    """train.py with ``overrides``, checkpointing every 4 steps, killed by SIGKILL once it
    logged 6 steps and completed a checkpoint; the rerun to the last logged step resumes
    from that checkpoint and logs the uninterrupted run's losses, bit for bit, each step
    past it a new loss (the weights moved)."""
    proc = launch(workdir, *overrides, "train.steps=100000", "train.checkpoint_every=4")
    wait_for(lambda: len(train_rows(workdir)) >= 6 and complete_steps(workdir), proc,
             "6 logged steps and a complete checkpoint")
    proc.kill()
    finish(proc)
    uninterrupted = {r["step"]: r["loss"] for r in train_rows(workdir)}
    last, logged = complete_steps(workdir)[-1], max(uninterrupted)
    assert logged > last  # steps past the checkpoint to compare with
    again = launch(workdir, *overrides, f"train.steps={logged}", "train.checkpoint_every=100000")
    out, err = finish(again)
    assert again.returncode == 0, err[-3000:]
    assert f"at step {last}" in out
    rows = train_rows(workdir)
    assert [r["step"] for r in rows] == list(range(1, logged + 1))
    assert [r["loss"] for r in rows] == [uninterrupted[s] for s in range(1, logged + 1)]
    assert len({r["loss"] for r in rows[last:]}) == logged - last


def train_rows(workdir):
    return read_metrics(pathlib.Path(workdir) / "metrics.jsonl", "train")


def complete_steps(workdir):
    d = pathlib.Path(workdir) / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Losses of an uninterrupted run, computed once, as long as a test asks for."""
    cache = {"losses": []}

    def losses(n):
        if len(cache["losses"]) < n:
            workdir = tmp_path_factory.mktemp("reference")
            config = load_config("tiny_moe", OVERRIDES + [f"train.steps={n}", "train.checkpoint_every=100000"])
            train_and_evaluate(config, str(workdir))
            cache["losses"] = [r["loss"] for r in train_rows(workdir)]
        return cache["losses"][:n]

    return losses


def assert_resumed_like_the_reference(workdir, reference, steps):
    rows = train_rows(workdir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # no duplicated, no missing row
    assert [r["loss"] for r in rows] == reference(steps)


def _signal_when(workdir, rows, sig):
    """Sends ``sig`` to this process once ``metrics.jsonl`` holds ``rows`` train rows (the
    trainer's own handler, installed while it trains, takes it)."""
    def watch():
        deadline = time.monotonic() + LIMIT_S
        while time.monotonic() < deadline:
            if len(train_rows(workdir)) >= rows:
                os.kill(os.getpid(), sig)
                return
            time.sleep(0.002)
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _train_py(capsys, workdir, *extra):
    """train.py with OVERRIDES, in this process: ``(status, out, err)`` (tests/_train_py.py)."""
    return run_train_py(capsys, workdir, *OVERRIDES, *extra)


@pytest.mark.slow
def test_sigterm_saves_at_the_step_reached_and_the_rerun_matches_an_uninterrupted_run(
        tmp_path, reference, capsys):
    """train.py's main in this process; SIGTERM once 3 steps are logged."""
    sender = _signal_when(tmp_path, 3, signal.SIGTERM)
    status, out, err = _train_py(capsys, tmp_path, "train.steps=100000", "train.checkpoint_every=100000")
    sender.join()
    assert status == 128 + signal.SIGTERM, err[-3000:]
    reached = train_rows(tmp_path)[-1]["step"]
    assert complete_steps(tmp_path) == [reached]  # saved at the step it reached, nothing else
    assert f"SIGTERM at step {reached}: checkpoint saved in" in err and "rerun the same command" in err
    assert "Traceback" not in err

    status, out, err = _train_py(capsys, tmp_path, f"train.steps={reached + 3}",
                                 "train.checkpoint_every=100000")
    assert status == 0, err[-3000:]
    assert f"resumed from {tmp_path / 'checkpoints'} at step {reached}" in out
    assert_resumed_like_the_reference(tmp_path, reference, reached + 3)


@pytest.mark.slow
@pytest.mark.xdist_group("faults_processes")
def test_sigkill_during_a_checkpoint_write_resumes_from_the_last_complete_one(tmp_path, reference,
                                                                              capsys):
    """A real train.py process, with a checkpoint at every step, so that writes are under
    way most of the time; the kill comes as soon as a temporary (unfinished) checkpoint
    directory is seen. The rerun is train.py's main in this process."""
    proc = launch(tmp_path, "train.steps=100000", "train.checkpoint_every=1")
    ckpts = tmp_path / "checkpoints"

    def writing():
        return (len(complete_steps(tmp_path)) >= 2
                and any("tmp" in p.name for p in ckpts.iterdir()))

    wait_for(writing, proc, "a checkpoint write in progress")
    proc.kill()
    finish(proc)
    steps = complete_steps(tmp_path)
    assert steps, "no complete checkpoint survived"
    last = steps[-1]
    logged = train_rows(tmp_path)[-1]["step"]
    assert logged >= last  # rows past the checkpoint are dropped on resume, then rewritten

    status, out, err = _train_py(capsys, tmp_path, f"train.steps={last + 3}", "train.checkpoint_every=100000")
    assert status == 0, err[-3000:]
    assert f"at step {last}" in out
    assert not any("tmp" in p.name for p in ckpts.iterdir())  # the unfinished write is cleaned up
    assert_resumed_like_the_reference(tmp_path, reference, last + 3)


def test_ctrl_c_saves_and_exits_130(tmp_path, capsys):
    """train.py's main in this process; SIGINT once a step is logged."""
    sender = _signal_when(tmp_path, 1, signal.SIGINT)
    status, out, err = _train_py(capsys, tmp_path, "train.steps=100000", "train.checkpoint_every=100000")
    sender.join()
    assert status == 128 + signal.SIGINT, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    reached = train_rows(tmp_path)[-1]["step"]
    assert complete_steps(tmp_path) == [reached]
    assert f"SIGINT at step {reached}: checkpoint saved" in err


def test_a_signal_during_compilation_exits_without_saving(tmp_path):
    """In process: SIGINT sent while the train step compiles (its worker thread is alive)."""
    config = load_config("tiny_moe", OVERRIDES + ["train.steps=5"])

    def interrupt_when_compiling():
        deadline = time.monotonic() + LIMIT_S
        while time.monotonic() < deadline:
            if any(t.name == "jaxmp-compile" for t in threading.enumerate()):
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.005)

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    sender = threading.Thread(target=interrupt_when_compiling, daemon=True)
    sender.start()
    with pytest.raises(Interrupted, match="SIGINT during start-up: stopped before training; nothing was "
                                          "trained or saved in this run; rerun the same command to start") as e:
        train_and_evaluate(config, str(tmp_path))
    sender.join()
    assert not e.value.saved and e.value.step == 0
    assert complete_steps(tmp_path) == [] and train_rows(tmp_path) == []
    # The handlers are restored to what they were, which is not Python's default where the
    # process started with SIGINT ignored (a background job of a non-interactive shell).
    assert {sig: signal.getsignal(sig) for sig in before} == before


def _tmpfs(path, size):
    """Mounts a tmpfs of ``size`` at ``path``; False where mounting is not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MiB tmpfs (None where this machine cannot mount one), unmounted afterwards."""
    disk = tmp_path / "disk"
    mounted = _tmpfs(disk, "64m")
    yield disk if mounted else None
    if mounted:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def _fill(disk, leave_bytes):
    """Fills the filesystem of ``disk`` until ``leave_bytes`` are free."""
    with open(disk / "filler", "wb") as f:
        block = b"\0" * (1 << 20)
        while os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize > leave_bytes + len(block):
            f.write(block)
            f.flush()
        rest = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize - leave_bytes
        if rest > 0:
            f.write(b"\0" * rest)


def _config(steps, **train):
    return load_config("tiny_moe", OVERRIDES + [f"train.steps={steps}"] +
                       [f"train.{k}={v}" for k, v in train.items()])


def _assert_restorable(workdir, config, step):
    exp = Experiment.create(config)
    with Checkpointer(workdir) as ckpt:
        assert ckpt.all_steps()[-1] == step
        restored_step, state, _ = ckpt.restore(exp.abstract_state, config_to_dict(exp.config))
    assert restored_step == step and int(np.asarray(state.step)) == step


def test_a_full_disk_is_a_clear_error_and_keeps_the_earlier_checkpoint(small_disk, tmp_path, monkeypatch):
    if small_disk is None:  # no tmpfs here: the same failure, raised where orbax writes
        import orbax.checkpoint as ocp
        workdir = tmp_path / "run"
        train_and_evaluate(_config(2, checkpoint_every=2), str(workdir))

        def no_space(self, *args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(ocp.CheckpointManager, "save", no_space)
    else:
        workdir = small_disk / "run"
        train_and_evaluate(_config(2, checkpoint_every=2), str(workdir))
        _fill(small_disk, leave_bytes=256 << 10)  # room for metrics, not for a checkpoint
    with pytest.raises(CheckpointError) as e:
        train_and_evaluate(_config(4, checkpoint_every=2), str(workdir))
    message = str(e.value)
    assert "checkpoint step 4" in message and str(workdir / "checkpoints") in message
    assert "No space left on device" in message and "earlier checkpoints (2) are intact" in message
    if small_disk is not None:
        (small_disk / "filler").unlink()
    monkeypatch.undo()
    _assert_restorable(workdir, _config(4), 2)


def test_a_read_only_workdir_is_a_clear_error_before_any_work(small_disk, tmp_path, monkeypatch):
    if small_disk is not None:  # a real read-only filesystem
        workdir = small_disk / "run"
        train_and_evaluate(_config(2, checkpoint_every=2), str(workdir))
        assert subprocess.run(["mount", "-o", "remount,ro", str(small_disk)]).returncode == 0
        undo = lambda: subprocess.run(["mount", "-o", "remount,rw", str(small_disk)])  # noqa: E731
    else:
        workdir = tmp_path / "run"
        train_and_evaluate(_config(2, checkpoint_every=2), str(workdir))
        if os.geteuid() != 0:  # permissions bind everyone but root
            os.chmod(workdir, 0o555)
            undo = lambda: os.chmod(workdir, 0o755)  # noqa: E731
        else:  # root without mount rights: the error the kernel would give, from the first write
            def read_only(self, data):
                raise OSError(30, "Read-only file system")

            monkeypatch.setattr(pathlib.Path, "write_bytes", read_only)
            undo = monkeypatch.undo
    try:
        with pytest.raises(ValueError, match=rf"--workdir {workdir} is not writable: .*(Read-only|Permission)"):
            train_and_evaluate(_config(4, checkpoint_every=2), str(workdir))
    finally:
        undo()
    _assert_restorable(workdir, _config(4), 2)


# ----------------------------------------------------------------------------- the workdir lock


@pytest.mark.xdist_group("faults_processes")
def test_a_second_trainer_on_a_busy_workdir_is_refused_and_a_dead_ones_lock_is_taken_over(tmp_path, capsys):
    from jaxmp.train import WorkdirInUse
    proc = launch(tmp_path, "train.steps=100000", "train.checkpoint_every=2")
    try:
        wait_for(lambda: complete_steps(tmp_path), proc, "a checkpoint")
        with pytest.raises(WorkdirInUse, match=rf"--workdir {tmp_path} is in use by process {proc.pid} on "
                                               rf"{os.uname().nodename} \(running since .*\); wait for it"):
            train_and_evaluate(_config(100), str(tmp_path))
        rows_before = len(train_rows(tmp_path))
        assert rows_before >= 1  # the refused run wrote nothing: the other one kept going
    finally:
        proc.kill()  # a dead holder: its lock file stays, its flock goes with it
        finish(proc)
    last = complete_steps(tmp_path)[-1]
    capsys.readouterr()
    train_and_evaluate(_config(last + 1), str(tmp_path))
    out = capsys.readouterr().out
    assert f"took over the workdir lock of process {proc.pid} on {os.uname().nodename}" in out
    assert f"at step {last}" in out and train_rows(tmp_path)[-1]["step"] == last + 1


# ----------------------------------------------------------------------------- damaged files


def _flip_one_bit(directory):
    """Flips bit 3 of the middle byte of the largest file under ``directory``."""
    files = sorted((p for p in pathlib.Path(directory).rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(files[-1].read_bytes())
    data[len(data) // 2] ^= 1 << 3
    files[-1].write_bytes(bytes(data))
    return files[-1]


def _copy(four_steps, tmp_path):
    """A copy of the four_steps workdir (checkpoints at steps 2 and 4) to damage."""
    workdir = tmp_path / "run"
    shutil.copytree(four_steps, workdir)
    return workdir


def test_a_flipped_bit_in_the_newest_checkpoint_falls_back_to_the_previous_one(
        four_steps, tmp_path, reference, capsys):
    """Checkpoints at steps 2 and 4; one bit of step 4's largest state file flipped. The
    rerun sets step 4 aside with a warning, resumes from step 2 and then trains exactly
    as an uninterrupted run does."""
    workdir = _copy(four_steps, tmp_path)
    _flip_one_bit(workdir / "checkpoints" / "4" / "state")
    capsys.readouterr()
    train_and_evaluate(_config(6, checkpoint_every=2), str(workdir))
    out = capsys.readouterr().out
    assert f"WARNING: checkpoint step 4 in {workdir / 'checkpoints'} is corrupt" in out
    assert "resuming from step 2 instead" in out and "at step 2" in out
    assert (workdir / "checkpoints" / "corrupt" / "4").is_dir() and complete_steps(workdir) == [4, 6]
    assert_resumed_like_the_reference(workdir, reference, 6)


def test_a_truncated_array_file_is_named_in_the_corrupt_checkpoint_warning(four_steps, tmp_path, capsys):
    """The largest array file of step 4 cut to half its size: the warning names the array
    and the file TensorStore failed on, not a pybind11 repr, and step 2 resumes."""
    workdir = _copy(four_steps, tmp_path)
    files = sorted((p for p in (workdir / "checkpoints" / "4" / "state").rglob("*") if p.is_file()),
                   key=lambda p: p.stat().st_size)
    os.truncate(files[-1], files[-1].stat().st_size // 2)
    capsys.readouterr()
    train_and_evaluate(_config(6, checkpoint_every=2), str(workdir))
    out = capsys.readouterr().out
    warning = next(line for line in out.splitlines() if "is corrupt" in line)
    assert "<bound method" not in warning and "Error reading" in warning, warning
    assert str(workdir / "checkpoints") in warning and "resuming from step 2 instead" in out


def test_random_bytes_over_a_checkpoint_never_reach_the_run(four_steps, tmp_path, capsys):
    """64 random bytes over the start of every state file of the newest checkpoint."""
    workdir = _copy(four_steps, tmp_path)
    rng = np.random.default_rng(0)
    for f in (workdir / "checkpoints" / "4" / "state").rglob("*"):
        if f.is_file() and f.stat().st_size >= 64:
            data = bytearray(f.read_bytes())
            data[:64] = rng.integers(0, 256, 64, dtype=np.uint8).tobytes()
            f.write_bytes(bytes(data))
    capsys.readouterr()
    summary = train_and_evaluate(_config(4, checkpoint_every=2, eval_every=4), str(workdir))
    out = capsys.readouterr().out
    assert "checkpoint step 4" in out and "is corrupt" in out and "at step 2" in out
    assert summary["step"] == 4 and np.isfinite(summary["eval_loss"])


def test_a_torn_metrics_line_is_dropped_with_a_warning_and_the_run_resumes(tmp_path, capsys):
    train_and_evaluate(_config(2, checkpoint_every=2), str(tmp_path))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "split": "train", "lo')  # a kill mid-write
    capsys.readouterr()
    train_and_evaluate(_config(3, checkpoint_every=2), str(tmp_path))
    assert "dropping its last line, cut off mid-write" in capsys.readouterr().out
    assert [r["step"] for r in train_rows(tmp_path)] == [1, 2, 3]


# ----------------------------------------------------------------------------- runs that cannot work


def test_a_batch_that_cannot_fit_is_refused_before_training(tmp_path, monkeypatch):
    """A device of 64 MiB (patched in): the bfloat16 logits alone of 2**16 sequences of 16
    tokens on 8 devices are 2**17 x 257 x 2 B = 64.25 MiB, so the step cannot fit; the
    configured batch of 16 fits."""
    from jaxmp.train import loop
    from jaxmp.train import preflight
    monkeypatch.setattr(preflight, "device_memory", lambda device: (64 << 20, "a 64 MiB test device"))
    big = _config(2, batch_size=2**16)
    big.data.seq_len = 16
    with pytest.raises(ValueError, match=r"the train step needs about [\d.]+ GiB per device .* but a device "
                                         r"has 0.06 GiB \(a 64 MiB test device\); lower train.batch_size \(now 65536\)"):
        train_and_evaluate(big, str(tmp_path))
    assert not (tmp_path / "checkpoints").exists() and train_rows(tmp_path) == []
    train_and_evaluate(_config(1), str(tmp_path))  # the same device takes the small batch


def test_a_diverging_run_stops_and_keeps_its_last_healthy_checkpoint(tmp_path):
    """Learning rate 1e3 without clipping: step 1 applies a ruinous update; from step 2
    the loss is 1e7, then log(257) with a zero gradient norm (a collapsed model). Which
    later steps of the collapsed model are skipped (a non-finite gradient) depends on the
    processor's rounding (one machine applied steps 2-4, another skipped step 4): a
    skipped step neither counts nor resets the divergent steps, so the run stops at the
    third applied divergent step, whichever that is. Checkpoints every step: only step 1
    is written."""
    from jaxmp.train import TrainingDiverged
    config = _config(20, checkpoint_every=1, max_divergent_steps=3)
    config.optim.update(dict(learning_rate=1e3, warmup_steps=0, grad_clip=0.0))
    config.precision.policy = "mixed_bf16"
    with pytest.raises(TrainingDiverged, match=r"the last 3 steps applied \(to step (\d+)\) looked divergent.*"
                                               r"The last healthy checkpoint, step 1 in .*, is from before it: "
                                               r"a rerun resumes from there") as info:
        train_and_evaluate(config, str(tmp_path))
    rows = train_rows(tmp_path)
    applied = [r for r in rows if r["applied"]]
    assert [r["divergent_steps"] for r in applied] == [0, 1, 2, 3]
    assert applied[-1] is rows[-1]  # stopped at the third divergent step it applied
    assert str(rows[-1]["step"]) == re.search(r"to step (\d+)", str(info.value)).group(1)
    assert rows[1]["loss"] > 3 * rows[0]["loss"]
    assert complete_steps(tmp_path) == [1]


def test_no_eval_batches_train_to_the_end(tmp_path, capsys):
    config = _config(3)
    config.data.num_eval_batches = 0
    summary = train_and_evaluate(config, str(tmp_path))
    assert summary["step"] == 3 and summary["eval_loss"] is None
    assert "done: step 3, not evaluated" in capsys.readouterr().out
    assert read_metrics(tmp_path / "metrics.jsonl", "eval") == []



# ----------------------------------------------------------------------------- every item checked


def _canonical_digest(item):
    """SHA-256 of the JSON item with sorted keys and no spaces (computed here, by hand)."""
    return hashlib.sha256(json.dumps(item, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _edit_json_item(step_dir, item, edit, forge):
    """Applies ``edit`` to the JSON item ``item`` of a checkpoint step; with ``forge``
    the checkpoint's digests are recomputed to match, as a careful attacker would."""
    path = step_dir / item / "metadata"
    value = json.loads(path.read_text())
    edit(value)
    path.write_text(json.dumps(value))
    if forge:
        verify_path = step_dir / "verify" / "metadata"
        verify = json.loads(verify_path.read_text())
        verify["items"][item] = _canonical_digest(value)
        verify.pop("digest")
        verify["digest"] = _canonical_digest(verify)
        verify_path.write_text(json.dumps(verify))


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
    """A workdir with checkpoints at steps 2 and 4 (copied by each test that damages it)."""
    workdir = tmp_path_factory.mktemp("four_steps")
    train_and_evaluate(_config(4, checkpoint_every=2), str(workdir))
    return workdir


def _next_index(delta=None, value=None):
    def edit(data):
        it = data["iterator"]
        it["next_index"] = value if value is not None else it["next_index"] + delta
    return edit


@pytest.mark.parametrize("item, edit, forge, why", [
    ("data", _next_index(delta=1), False, "its data-iterator state does not match its checksum"),
    ("data", _next_index(value=-7), True, r"its data-iterator state does not fit this run's data "
                                          r"\(the iterator position next_index=-7 must be an integer >= 0\)"),
    ("config", lambda c: c["train"].update(log_every=7), False, "its config item does not match its checksum"),
    ("verify", lambda v: v.update(num_devices=4), False, r"its checksums item \(verify\) was altered"),
])
def test_an_edited_json_item_is_corrupt_and_the_previous_checkpoint_resumes_like_the_reference(
        four_steps, tmp_path, reference, capsys, item, edit, forge, why):
    """The data iterator's position moved by one (30 to 31 in the attack), an out-of-range
    position with forged digests, a config value, the saved-for facts: each makes step 4
    corrupt; the run resumes from step 2 and its losses equal an uninterrupted run's."""
    workdir = tmp_path / "run"
    shutil.copytree(four_steps, workdir)
    _edit_json_item(workdir / "checkpoints" / "4", item, edit, forge and item != "verify")
    capsys.readouterr()
    train_and_evaluate(_config(6, checkpoint_every=2), str(workdir))
    out = capsys.readouterr().out
    assert f"WARNING: checkpoint step 4 in {workdir / 'checkpoints'} is corrupt" in out
    assert __import__("re").search(why, out), out
    assert "resuming from step 2 instead" in out and "at step 2" in out
    assert_resumed_like_the_reference(workdir, reference, 6)


# ----------------------------------------------------------------------------- a diverged run


def _diverging(steps, max_divergent_steps):
    """Learning rate 1e3 without warm-up or clipping: step 1 is applied healthy, and every
    later step looks divergent (test_a_diverging_run_stops_and_keeps_its_last_healthy_checkpoint)."""
    config = _config(steps, checkpoint_every=1, keep_checkpoints=2, max_divergent_steps=max_divergent_steps)
    config.optim.update(dict(learning_rate=1e3, warmup_steps=0, grad_clip=0.0))
    config.precision.policy = "mixed_bf16"
    return config


def test_sigterms_during_a_divergence_never_push_out_the_last_healthy_checkpoint(tmp_path):
    """keep_checkpoints=2. Two SIGTERMs during the divergence save two unhealthy
    checkpoints; the healthy step 1 stays beside them, each is marked in its metadata, and
    the divergence guard of the third run names step 1 as the last healthy checkpoint.
    The losses equal an uninterrupted run's, step by step."""
    from jaxmp.train import TrainingDiverged
    workdir = tmp_path / "run"
    stops = []
    for rows in (4, 7):  # the first SIGTERM after step 4 or later, the second after step 7
        sender = _signal_when(workdir, rows, signal.SIGTERM)
        with pytest.raises(Interrupted) as e:
            train_and_evaluate(_diverging(1000, 1000), str(workdir))
        sender.join()
        assert e.value.saved
        stops.append(e.value.step)
    steps = complete_steps(workdir)
    assert steps == [1] + stops, steps  # without the fix: the two newest only
    for step in steps:
        verify = json.loads((workdir / "checkpoints" / str(step) / "verify" / "metadata").read_text())
        rows = {r["step"]: r for r in train_rows(workdir)}
        healthy = rows[step]["divergent_steps"] == 0 and rows[step]["consecutive_skips"] == 0
        assert verify["healthy"] is healthy is (step == 1)
    final = stops[-1] + 1
    with pytest.raises(TrainingDiverged) as e:
        train_and_evaluate(_diverging(1000, 3), str(workdir))
    text = str(e.value)
    assert (f"The last healthy checkpoint, step 1 in {workdir / 'checkpoints'}, is from before it; the "
            f"newer checkpoints {stops[0]}, {stops[1]} were saved while the run was unhealthy, and a rerun "
            f"resumes from step {stops[1]}: move them out of") in text, text
    assert complete_steps(workdir) == [1] + stops
    reference = tmp_path / "reference"
    train_and_evaluate(_diverging(final, 1000), str(reference))
    assert [r["step"] for r in train_rows(workdir)] == list(range(1, final + 1))
    assert [r["loss"] for r in train_rows(workdir)] == [r["loss"] for r in train_rows(reference)]


# ----------------------------------------------------------------------------- exits while compiling


@pytest.mark.xdist_group("faults_processes")
def test_every_start_up_exit_is_clean_however_often_it_is_repeated(tmp_path):
    """A data error while the step compiles in its thread (a missing path, an empty
    directory, binaries, a .jsonl without its text field) and SIGINT during the
    compilation, each repeated in forked children of one interpreter
    (tests/_exit_repeats.py): every exit is its one line and status, never an abort
    (``terminate called``, ``Fatal Python error``, exit 134) and never a traceback."""
    repeats = {"sigint": 8, "missing": 3, "empty": 3, "binary": 3, "jsonl": 3}
    want = {"sigint": (130, "train.py: SIGINT during start-up: stopped before training; nothing was "
                            "trained or saved in this run; rerun the same command to start"),
            "missing": (1, "train.py: error: data.path "),
            "empty": (1, "train.py: error: data.path directory"),
            "binary": (1, "train.py: error: data.path directory"),
            "jsonl": (1, "train.py: error: ")}
    results = []
    # One interpreter per repeat count (its kinds one after another), not one per kind.
    for n in sorted(set(repeats.values())):
        kinds = [kind for kind, k in repeats.items() if k == n]
        proc = subprocess.run([sys.executable, str(ROOT / "tests" / "_exit_repeats.py"), str(n),
                               str(tmp_path), *kinds], capture_output=True, text=True, env=ENV,
                              cwd=ROOT, timeout=LIMIT_S)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results += [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == sum(repeats.values())
    for r in results:
        status, first = want[r["kind"]]
        # stdout too: the progress lines ("data: ...", bars, "compiling the train step ...")
        # aside, one error line
        lines = [line for line in r["stderr"].splitlines()
                 if line.strip() and not line.lstrip("\r").startswith("data: ")
                 and line.strip() != "compiling the train step ..."]
        assert r["status"] == status and len(lines) == 1 and lines[0].startswith(first), r
    assert all("expected a JSON object with a string field 'text'" in r["stderr"]
               for r in results if r["kind"] == "jsonl")
    assert all("does not exist" in r["stderr"] for r in results if r["kind"] == "missing")


# ----------------------------------------------------------------------------- a peer that dies


def test_a_failed_metrics_write_is_the_error_reported_not_the_writers_close(tmp_path, monkeypatch):
    """The disk fills while step 1's metrics are written: that error is raised, not the
    OSError of the TensorBoard writer's close() on the way out (the same full disk)."""
    import tensorboardX
    real_open = pathlib.Path.open

    def full_disk_open(self, mode="r", *args, **kwargs):
        if self.name == "metrics.jsonl" and "a" in mode:
            raise OSError(28, "No space left on device")
        return real_open(self, mode, *args, **kwargs)

    def failing_close(self):
        raise OSError(28, "No space left on device (closing)")

    monkeypatch.setattr(pathlib.Path, "open", full_disk_open)
    monkeypatch.setattr(tensorboardX.SummaryWriter, "close", failing_close)
    with pytest.raises(OSError, match=rf"^\[Errno 28\] writing the metrics of step 1 to {tmp_path} failed: "
                                      rf"No space left on device$"):
        train_and_evaluate(_config(3), str(tmp_path))


def test_orbaxs_never_retrieved_future_traceback_is_dropped():
    """asyncio's ``Future exception was never retrieved`` for an orbax write names no
    orbax file in its message, only in its traceback."""
    import logging
    from jaxmp._entry import _DropOrbaxTracebacks
    try:
        exec(compile("raise OSError(28, 'No space left on device')",
                     os.path.join(os.sep, "site-packages", "orbax", "checkpoint", "write.py"), "exec"))
    except OSError:
        exc_info = sys.exc_info()
    record = logging.LogRecord("asyncio", logging.ERROR, "base_events.py", 1,
                               "Future exception was never retrieved\nfuture: <Future finished>", (), exc_info)
    assert not _DropOrbaxTracebacks().filter(record)
    record.exc_info = (ValueError, ValueError("x"), None)
    assert _DropOrbaxTracebacks().filter(record)  # asyncio's other messages stay


def _probe_pair(workdir, pauses=(0.0, 0.0)):
    """Two tests/_peer_probe.py processes (4 CPU devices each, over loopback); their
    stdout goes to ``workdir/out.I`` (gloo's lines), their stderr to ``workdir/err.I``."""
    from test_multiprocess import free_port
    env = dict(os.environ, XLA_FLAGS=cpu_flags(4),
               JAX_PLATFORMS="cpu")
    address = f"127.0.0.1:{free_port()}"
    return [subprocess.Popen([sys.executable, str(ROOT / "tests" / "_peer_probe.py"), address, "2",
                              str(i), str(workdir), str(pause)], cwd=ROOT, env=env,
                             stdin=subprocess.DEVNULL, stdout=open(workdir / f"out.{i}", "w"),
                             stderr=open(workdir / f"err.{i}", "w"))
            for i, pause in enumerate(pauses)]


@pytest.mark.xdist_group("faults_processes")
@pytest.mark.slow
@pytest.mark.parametrize("victim, when", [(1, "starting"), (0, "stopped"), (1, "stopped")],
                         ids=["peer-before-the-watchdog", "coordinator-stopped", "peer-stopped"])
def test_a_lost_peer_is_the_survivors_one_line_however_the_race_goes(tmp_path, victim, when):
    """kill -9 of process 1 before it reaches the watchdog; SIGSTOP of either (a machine
    gone silent, its connections open). (A killed process 0, which hosts JAX's
    coordination service, may end process 1 by JAX's own abort, nothing of ours being in
    its path: tests/test_distributed_startup.py bounds that exit.) The survivor exits 1
    with the one line naming the victim and the last checkpoint (a step directory made
    here), never with JAX's abort (``client.h``, ``Fatal Python error``) or a traceback.
    The probes' heartbeat timeout is 10 s, so the watchdog's silence limit is 5 s."""
    (tmp_path / "checkpoints" / "12").mkdir(parents=True)
    (tmp_path / "checkpoints" / "12.orbax-checkpoint-tmp-3").mkdir()  # unfinished: not named
    procs = _probe_pair(tmp_path, (0.0, 60.0) if when == "starting" else (0.0, 0.0))
    survivor = 1 - victim
    try:
        # Starting: process 1 sleeps between initialize and the watchdog (process 0, its
        # watchdog started, waits in the first all-reduce).
        marks = ["paused.1"] if when == "starting" else ["ready.0", "ready.1"]
        wait_for(lambda: all((tmp_path / m).exists() for m in marks), procs[survivor],
                 " and ".join(marks))
        procs[victim].send_signal(signal.SIGSTOP if when == "stopped" else signal.SIGKILL)
        procs[survivor].wait(timeout=LIMIT_S)
        err = (tmp_path / f"err.{survivor}").read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # a stopped process too
    how = {"running": "exited without a word (killed or crashed)",
           "starting": "exited without a word (killed or crashed)" if victim == 0 else
                       "died during start-up (it never reached process 0's watchdog)",
           "stopped": "sent nothing for 5 s (stopped, hung, or its machine vanished)"}[when]
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [f"train.py: error: process {victim} of 2 {how}; process {survivor} stops "
                     f"too. The last checkpoint to resume from is step 12 in "
                     f"{tmp_path / 'checkpoints'}; rerun all 2 processes to resume"], err[-3000:]
    assert procs[survivor].returncode == 1, err[-3000:]
    for bad in ("Traceback", "Fatal Python error", "client.h", "Terminating process",
                "terminate called"):
        assert bad not in err, err[-3000:]


@pytest.mark.parametrize("ema, loss, divergent", [
    (3e-7, 3e-5, False),  # a run that has memorized its data: 100x, yet no spike
    (0.03, 0.095, False),  # over 3x, under the floor
    (0.05, 0.2, True),    # over 3x and over the floor
    (0.2, 0.59, False),   # under 3x
])
def test_a_loss_spike_is_three_times_the_running_mean_and_above_the_floor(ema, loss, divergent):
    """DivergenceCheck's loss test by hand: loss > 3 x running mean and loss >
    LOSS_SPIKE_FLOOR (0.1 nats per trained token)."""
    from types import SimpleNamespace
    import jax.numpy as jnp
    from jaxmp.train import step

    state = SimpleNamespace(loss_ema=jnp.float32(ema), grad_norm_ema=jnp.float32(1.0),
                            divergent_steps=jnp.int32(0))
    health = step._health(state, jnp.float32(loss), jnp.float32(1.0), jnp.bool_(True),
                          step.DivergenceCheck())
    assert bool(health.divergent) is divergent
    assert step.LOSS_SPIKE_FLOOR == 0.1
