"""A checkpoint is checked, not trusted, in three ways that cost no training:

1. it knows its own step: a copy of (or a symbolic link to) step 6 as ``checkpoints/8``,
   or step 6 renamed to 12, is refused on restore and the previous good checkpoint is
   read, by the trainer (which sets it aside) and by a reader alike; a checkpoint written
   before ``verify`` recorded its step still restores, checked by its state's step counter;
2. a reader whose checkpoint a trainer's rotation deletes while it reads it reads the
   newest one instead, a bounded number of times, then fails in one line;
3. a named pipe in a step directory, or as ``metrics.jsonl``, is refused without being
   opened (which would hang the reader or the trainer).

Every state is a two-leaf pytree saved and restored with the Checkpointer directly; the
expected values are computed here with NumPy. Tests that meet a named pipe run under an
alarm, so that a regression fails instead of hanging.
"""
import contextlib
import json
import os
import pathlib
import shutil
import signal

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmp.train import checkpoint as ckpt_module
from jaxmp.train.checkpoint import CheckpointError, Checkpointer, json_digest
from jaxmp.train.metrics import MetricsWriter, read_metrics

XDIST_PER_TEST = True  # no costly fixture is shared: hand the tests out one by one

CONFIG = {"seed": 0, "model": {"d_model": 4}}
STEPS = (2, 4, 6, 8)


@flax.struct.dataclass
class Tiny:
    """A train state in miniature: a step counter (as ``TrainState.step``) and weights."""
    step: jax.Array
    w: jax.Array


def _expected(step: int):
    """The values saved at ``step``, in NumPy."""
    return np.int32(step), np.arange(4, dtype=np.float32) * step + 0.5


def _tiny(step: int) -> Tiny:
    counter, w = _expected(step)
    return Tiny(step=jnp.asarray(counter), w=jnp.asarray(w))


TEMPLATE = _tiny(0)


def _save(checkpointer: Checkpointer, step: int) -> None:
    checkpointer.save(step, _tiny(step), {"position": step}, CONFIG)
    checkpointer.wait()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A workdir with checkpoints at steps 2, 4, 6 and 8 (kept: all), to copy."""
    workdir = tmp_path_factory.mktemp("saved")
    with Checkpointer(workdir, keep=len(STEPS)) as ckpt:
        for step in STEPS:
            _save(ckpt, step)
    return workdir


@pytest.fixture
def workdir(saved, tmp_path):
    shutil.copytree(saved, tmp_path / "run", symlinks=True)
    return tmp_path / "run"


def _assert_restored(out, step: int) -> None:
    """``out`` of ``Checkpointer.restore`` holds what was saved at ``step``."""
    got, state, data = out
    counter, w = _expected(step)
    assert got == step and data == {"position": step}
    assert int(state.step) == counter
    np.testing.assert_array_equal(np.asarray(state.w), w)


def _tree(directory: pathlib.Path) -> dict:
    """Every path under ``directory`` with what it is (a link's target, a file's bytes)."""
    out = {}
    for p in sorted(directory.rglob("*")):
        rel = str(p.relative_to(directory))
        out[rel] = (("link", os.readlink(p)) if p.is_symlink() else ("fifo",) if p.is_fifo()
                    else ("dir",) if p.is_dir() else ("file", p.read_bytes()))
    return out


def _rewrite_verify(step_dir: pathlib.Path, change) -> None:
    """Edits the ``verify`` item of a step as a writer would have written it: ``change``
    alters the dict, and the digest is computed anew over the result."""
    path = step_dir / "verify" / "metadata"
    meta = json.loads(path.read_text())
    meta.pop("digest")
    change(meta)
    meta["digest"] = json_digest(meta)
    path.write_text(json.dumps(meta))


def _open_pipes(root: pathlib.Path) -> None:
    """Opens (and closes) each named pipe under ``root`` once, O_RDWR, which never blocks:
    a thread blocked opening one for reading is freed and reads an end of file."""
    for p in pathlib.Path(root).rglob("*"):
        if p.is_fifo():
            os.close(os.open(p, os.O_RDWR | os.O_NONBLOCK))


@contextlib.contextmanager
def _no_hang(root: pathlib.Path, seconds: int = 20):
    """Fails the block with TimeoutError after ``seconds`` instead of hanging the suite.

    The timer frees the threads blocked on a named pipe under ``root`` (:func:`_open_pipes`)
    before it raises, and again each second after, so that the error can unwind through
    code that joins them (orbax's thread pools)."""
    fired = []

    def expired(signum, frame):
        _open_pipes(root)
        if not fired:
            fired.append(True)
            raise TimeoutError(f"still blocked after {seconds} s: a named pipe was opened")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        _open_pipes(root)


# ------------------------------------------------------------- 1: a checkpoint knows its step


def _copy_6_as_8(ckpts):
    shutil.rmtree(ckpts / "8")
    shutil.copytree(ckpts / "6", ckpts / "8")


def _link_8_to_6(ckpts):
    shutil.rmtree(ckpts / "8")
    os.symlink("6", ckpts / "8")


def _rename_6_to_12(ckpts):
    os.rename(ckpts / "6", ckpts / "12")


@pytest.mark.parametrize("read_only", [False, True], ids=["trainer", "reader"])
@pytest.mark.parametrize("damage, bad, good, why", [
    (_copy_6_as_8, 8, 6, "it is the checkpoint of step 6"),
    (_link_8_to_6, 8, 6, "its directory is a symbolic link (to 6)"),
    (_rename_6_to_12, 12, 8, "it is the checkpoint of step 6"),
], ids=["copy", "symlink", "rename"])
def test_a_step_directory_holding_another_steps_checkpoint_is_refused(workdir, damage, bad,
                                                                      good, why, read_only):
    """Step 8 replaced by a copy of, or a link to, step 6; or step 6 renamed to 12: the
    impostor is refused, with a warning naming it and why, and the previous good
    checkpoint is read with its own values. The trainer moves the impostor (a link moves as
    the link: step 6 stays); a reader moves nothing."""
    ckpts = workdir / "checkpoints"
    damage(ckpts)
    before = _tree(ckpts)
    with Checkpointer(workdir, read_only=read_only) as ckpt:
        assert ckpt.healthy(bad) is None  # rotation trusts nothing of an impostor
        _assert_restored(ckpt.restore(TEMPLATE, CONFIG), good)
        [warning] = ckpt.warnings
    assert warning.startswith(f"checkpoint step {bad} in {ckpts} is corrupt: {why}")
    assert "\n" not in warning
    if read_only:
        assert "read step" in warning and "nothing was moved" in warning
        assert _tree(ckpts) == before
    else:
        assert f"moved to {ckpts / 'corrupt' / str(bad)}; resuming from step {good}" in warning
        assert os.path.lexists(ckpts / "corrupt" / str(bad))
        assert not os.path.lexists(ckpts / str(bad))
        assert (ckpts / "corrupt" / str(bad)).is_symlink() == (damage is _link_8_to_6)
        with Checkpointer(workdir, read_only=True) as again:  # the good one is left intact
            _assert_restored(again.restore(TEMPLATE, CONFIG, step=good), good)
            assert again.warnings == []


def test_a_checkpoint_asked_for_by_step_is_refused_when_it_is_another_steps(workdir):
    """``restore(step=8)`` of a copy of step 6: an error naming both steps, in one line."""
    _copy_6_as_8(workdir / "checkpoints")
    with Checkpointer(workdir, read_only=True) as ckpt:
        with pytest.raises(CheckpointError, match=r"step 8: it is the checkpoint of step 6") as e:
            ckpt.restore(TEMPLATE, CONFIG, step=8)
    assert "\n" not in str(e.value)


def test_a_checkpoint_saved_before_its_step_was_recorded_restores_checked_by_its_counter(workdir):
    """Checkpoints as written before ``verify`` named its step (the same item without it,
    its digest computed without it) restore as before, with no warning; a copy of one of
    them under a newer name is refused by its state's step counter."""
    ckpts = workdir / "checkpoints"
    for step in STEPS:
        _rewrite_verify(ckpts / str(step), lambda meta: meta.pop("step"))
        assert "step" not in json.loads((ckpts / str(step) / "verify" / "metadata").read_text())
    with Checkpointer(workdir, read_only=True) as ckpt:
        _assert_restored(ckpt.restore(TEMPLATE, CONFIG), 8)
        _assert_restored(ckpt.restore(TEMPLATE, CONFIG, step=4), 4)
        assert ckpt.warnings == []
    _copy_6_as_8(ckpts)
    with Checkpointer(workdir, read_only=True) as ckpt:
        _assert_restored(ckpt.restore(TEMPLATE, CONFIG), 6)
        [warning] = ckpt.warnings
    assert warning.startswith(f"checkpoint step 8 in {ckpts} is corrupt: it is the checkpoint "
                              f"of step 6 (its state's step counter says so)")


def test_an_ill_typed_step_in_verify_is_refused_naming_it(workdir):
    """A ``verify`` item whose step is the string "8" (its digest recomputed, so only the
    type is wrong) is corrupt: the warning names the field and its value."""
    _rewrite_verify(workdir / "checkpoints" / "8", lambda meta: meta.update(step="8"))
    with Checkpointer(workdir, read_only=True) as ckpt:
        _assert_restored(ckpt.restore(TEMPLATE, CONFIG), 6)
        [warning] = ckpt.warnings
    assert warning.startswith(f"checkpoint step 8 in {workdir / 'checkpoints'} is corrupt: the "
                              f"step in its checksums item (verify) is not an integer ('8')")


# ------------------------------------------------------- 2: readers beside a trainer's rotation


class _Rotation:
    """A trainer with ``train.keep_checkpoints=1`` beside a reader: on each of the reader's
    orbax reads numbered in ``on``, the trainer saves the next step, which deletes the
    step before it (``partial``: the next step is saved but only the old step's items are
    deleted, its directory left, as orbax's deleter leaves it midway)."""

    def __init__(self, workdir, on, partial=False):
        self.writer = Checkpointer(workdir, keep=1)
        _save(self.writer, 1)
        self.newest, self.calls, self.on, self.partial = 1, 0, set(on), partial

    def patch(self, reader: Checkpointer) -> Checkpointer:
        real = reader.manager.restore

        def restore(step, *args, **kwargs):
            self.calls += 1
            if self.calls in self.on or "all" in self.on:
                old, self.newest = self.newest, self.newest + 1
                if self.partial:
                    self.writer.keep = 2
                    _save(self.writer, self.newest)
                    for item in ("state", "data", "config", "verify"):
                        shutil.rmtree(self.writer.directory / str(old) / item)
                else:
                    _save(self.writer, self.newest)  # the rotation deletes step `old`
                    assert not (self.writer.directory / str(old)).exists()
            return real(step, *args, **kwargs)

        reader.manager.restore = restore
        return reader


@pytest.mark.parametrize("on, partial", [({1}, False), ({2}, False), ({2}, True)],
                         ids=["deleted-before-config", "deleted-before-state", "half-deleted"])
def test_a_reader_reads_the_newest_checkpoint_when_rotation_deletes_the_one_it_reads(
        tmp_path, on, partial):
    """The step the reader opened is deleted (wholly or half) before its config or its
    state is read: the reader lists the steps again and reads the newest, with its own
    values and no warning."""
    rotation = _Rotation(tmp_path, on, partial)
    with rotation.writer, rotation.patch(Checkpointer(tmp_path, read_only=True)) as reader:
        assert reader.all_steps() == [1]
        _assert_restored(reader.restore(TEMPLATE, CONFIG), 2)
        assert reader.warnings == [] and rotation.newest == 2


def test_read_config_reads_the_newest_when_rotation_deletes_the_one_it_reads(tmp_path):
    """What jaxmp.train.load, sample and export read first: the config."""
    rotation = _Rotation(tmp_path, {1})
    with rotation.writer, rotation.patch(Checkpointer(tmp_path, read_only=True)) as reader:
        assert reader.read_config() == (2, CONFIG)
        assert rotation.calls == 2


def test_a_reader_that_rotation_outruns_fails_in_one_line(tmp_path, monkeypatch):
    """Every step read is deleted under the reader: after ``ROTATION_ATTEMPTS`` reads, one
    line; a step asked for by number that is deleted is one line at once."""
    monkeypatch.setattr(ckpt_module, "ROTATION_ATTEMPTS", 3)
    rotation = _Rotation(tmp_path, {"all"})
    with rotation.writer, rotation.patch(Checkpointer(tmp_path, read_only=True)) as reader:
        with pytest.raises(CheckpointError, match="deleted while they were read 3 times over") as e:
            reader.restore(TEMPLATE, CONFIG)
        assert rotation.calls == 3 and "\n" not in str(e.value)
        newest = rotation.newest
        with pytest.raises(CheckpointError, match=f"checkpoint step {newest} in .* was deleted "
                                                  f"while it was read") as e:
            reader.restore(TEMPLATE, CONFIG, step=newest)
        assert rotation.calls == 4 and "\n" not in str(e.value)


# ------------------------------------------------------------------- 3: named pipes


@pytest.mark.parametrize("read_only", [False, True], ids=["trainer", "reader"])
@pytest.mark.parametrize("name", ["_CHECKPOINT_METADATA", "verify/metadata"])
def test_a_named_pipe_in_a_step_is_refused_without_opening_it(workdir, name, read_only):
    """A named pipe as ``8/_CHECKPOINT_METADATA`` (which orbax reads as it lists the steps)
    or as ``8/verify/metadata`` (jaxmp's checksums item): step 8 is corrupt, named with the
    file, and step 6 is read; the trainer sets step 8 aside, the pipe moving with it."""
    ckpts = workdir / "checkpoints"
    (ckpts / "8" / name).unlink()
    os.mkfifo(ckpts / "8" / name)
    before = _tree(ckpts)
    with _no_hang(workdir), Checkpointer(workdir, read_only=read_only) as ckpt:
        assert ckpt.all_steps() == [2, 4, 6] and ckpt.latest_step() == 8
        assert ckpt.healthy(8) is None
        _assert_restored(ckpt.restore(TEMPLATE, CONFIG), 6)
        [warning] = ckpt.warnings
    assert warning.startswith(f"checkpoint step 8 in {ckpts} is corrupt: its file {name} is a "
                              f"named pipe (FIFO), not a regular file")
    if read_only:
        assert _tree(ckpts) == before
    else:
        assert (ckpts / "corrupt" / "8" / name).is_fifo() and not (ckpts / "8").exists()


def test_a_lone_step_holding_a_named_pipe_is_an_error_not_a_fresh_start(tmp_path):
    """The only checkpoint holds a named pipe: the trainer still sees a step to resume
    (latest_step), and restoring it is one line naming the pipe; nothing is moved."""
    with Checkpointer(tmp_path) as ckpt:
        _save(ckpt, 3)
    os.mkfifo(tmp_path / "checkpoints" / "3" / "state" / "pipe")
    with _no_hang(tmp_path), Checkpointer(tmp_path) as ckpt:
        assert ckpt.latest_step() == 3 and ckpt.refused == {
            3: "its file state/pipe is a named pipe (FIFO), not a regular file"}
        with pytest.raises(CheckpointError, match=r"step 3: its file state/pipe is a named pipe"
                           ) as e:
            ckpt.restore(TEMPLATE, CONFIG)
    assert "\n" not in str(e.value)
    assert (tmp_path / "checkpoints" / "3" / "state" / "pipe").is_fifo()  # nothing moved


def test_a_named_pipe_as_metrics_jsonl_is_refused_without_opening_it(tmp_path):
    """``metrics.jsonl`` a named pipe: reading it, a resuming trainer's writer and an
    append after it was put in place each fail in one line naming it, at once."""
    path = tmp_path / "metrics.jsonl"
    message = rf"{path} is a named pipe \(FIFO\), not a regular file of metrics"
    writer = MetricsWriter(tmp_path)
    try:
        writer.write(1, "train", {"loss": 2.0})
        assert read_metrics(path) == [{"step": 1, "split": "train", "loss": 2.0}]
        path.unlink()
        os.mkfifo(path)
        with _no_hang(tmp_path):
            with pytest.raises(ValueError, match=message):
                writer.write(2, "train", {"loss": 1.5})
            with pytest.raises(ValueError, match=message):
                read_metrics(path)
            with pytest.raises(ValueError, match=message):
                MetricsWriter(tmp_path, start_step=1)
    finally:
        writer.close()
    assert path.is_fifo()
