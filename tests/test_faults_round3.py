"""Nothing lost, round three (issue 28, the single-process items): readers never change a
workdir, the metrics history survives a kill during a resume, the final state is saved,
a directory is read as what it holds, the best checkpoint is kept, bad values and bad
workdirs are refused before any work, Ctrl-C is one line and status 130, a glob walks
each real directory once.

The library is called in-process wherever the process boundary is not the subject; the
two subprocess tests (Ctrl-C) are bounded by generous timeouts.
"""
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _configs import ROOT, small_config
from jaxmp.train import CheckpointError, Checkpointer, TrainingStalled, load, train_and_evaluate
from jaxmp.train.artifacts import export
from jaxmp.train.metrics import MetricsWriter, read_metrics

LIMIT_S = 600  # per subprocess: generous on a slow, shared machine


def _snapshot(root):
    """Every path under ``root`` with its kind, size and modification time."""
    out = {}
    for p in sorted(pathlib.Path(root).rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(root))] = (p.is_dir(), st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 4-step run on one device: checkpoints at steps 2 and 4, each evaluated."""
    workdir = tmp_path_factory.mktemp("r3") / "run"
    config = small_config(steps=4, checkpoint_every=2, eval_every=2)
    train_and_evaluate(config, str(workdir), num_devices=1)
    return workdir


@pytest.fixture
def run_copy(trained, tmp_path):
    """A copy of the trained run that a test may damage."""
    workdir = tmp_path / "run"
    shutil.copytree(trained, workdir, symlinks=True)
    return workdir


def _flip_newest_state(workdir, step):
    files = sorted((p for p in (workdir / "checkpoints" / str(step) / "state").rglob("*")
                    if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(files[-1].read_bytes())
    data[len(data) // 2] ^= 1 << 3
    files[-1].write_bytes(bytes(data))


# ------------------------------------------------------------ 1, 13: readers of a workdir


def test_load_and_export_change_nothing_in_a_workdir_a_trainer_writes(run_copy, tmp_path):
    """Item 1: a trainer's in-flight save (orbax's ``STEP.orbax-checkpoint-tmp-...``), the
    lock and every checkpoint are left exactly as they were by load and export."""
    in_flight = run_copy / "checkpoints" / "6.orbax-checkpoint-tmp-1764660000000000"
    (in_flight / "state").mkdir(parents=True)
    (in_flight / "state" / "half-written").write_bytes(b"\0" * 100)
    before = _snapshot(run_copy)
    load(run_copy)
    export(run_copy, tmp_path / "out")
    assert _snapshot(run_copy) == before


def test_sample_and_export_pass_over_a_corrupt_newest_checkpoint_and_label_the_step_read(
        run_copy, tmp_path):
    """Item 13 (and 1: the step label and the weights come from one checkpoint): step 4
    corrupt, step 2 intact. load warns and returns step 2's model, export writes step 2's
    weights labelled step 2, and nothing is moved."""
    _flip_newest_state(run_copy, 4)
    before = _snapshot(run_copy)
    with pytest.warns(RuntimeWarning, match=r"checkpoint step 4 .* is corrupt.*read step 2"):
        model, _, _ = load(run_copy)
    meta = export(run_copy, tmp_path / "out", notes=(notes := []))
    assert meta["step"] == 2 and json.loads((tmp_path / "out" / "config.json").read_text())[
        "step"] == 2
    assert len(notes) == 1 and "step 4" in notes[0]
    model2, _, _ = load(run_copy, 2)
    a = jax.tree.leaves(jax.tree.map(np.asarray, nnx_state(model)))
    b = jax.tree.leaves(jax.tree.map(np.asarray, nnx_state(model2)))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert _snapshot(run_copy) == before


def nnx_state(model):
    from flax import nnx
    return nnx.state(model, nnx.Param)


@pytest.mark.parametrize("step", ["2", 2.0, True])
def test_load_refuses_a_step_that_is_not_an_int_in_one_line(trained, step):
    with pytest.raises(ValueError, match=rf"step={step!r} \({type(step).__name__}\) is not "
                                         r"allowed; give a checkpoint step as an int"):
        load(trained, step)


def test_export_refuses_a_non_empty_directory_unless_forced(trained, tmp_path, capsys):
    from jaxmp import export as export_cli
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("the user's own")
    with pytest.raises(SystemExit) as e:
        export_cli.main(["--workdir", str(trained), "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err and "is not empty (config.json)" in err
    assert (out / "config.json").read_text() == "the user's own"
    assert export_cli.main(["--workdir", str(trained), "--out", str(out), "--force"]) == 0
    assert json.loads((out / "config.json").read_text())["step"] == 4
    with pytest.raises(ValueError, match="holds no checkpoints directory"):
        export(tmp_path / "no-run", tmp_path / "fresh")
    assert not (tmp_path / "fresh").exists()  # a failed export leaves no directory behind


def test_export_into_a_read_only_directory_is_one_line(trained, tmp_path, monkeypatch, capsys):
    from jaxmp import export as export_cli
    out = tmp_path / "ro"
    out.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(out)],
        capture_output=True).returncode == 0
    if not mounted:  # the kernel's error, from the first write
        def read_only(self, data):
            raise OSError(30, "Read-only file system")
        monkeypatch.setattr(pathlib.Path, "write_bytes", read_only)
    try:
        with pytest.raises(SystemExit) as e:
            export_cli.main(["--workdir", str(trained), "--out", str(out)])
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(out)], capture_output=True)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err
    assert f"--out {out} is not writable: Read-only file system" in err


# ------------------------------------------------------------------- 3: metrics history


def test_a_kill_while_a_resume_rewrites_metrics_leaves_the_whole_history(tmp_path, monkeypatch):
    """Item 3: the resume drops the records past its checkpoint. A kill in the middle of
    that write (simulated: the write fails after the file was opened) leaves every
    record, where an in-place rewrite left an empty file."""
    path = tmp_path / "metrics.jsonl"
    records = [{"step": s, "split": "train", "loss": 1.0 / s} for s in range(1, 11)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    original = path.read_bytes()
    real_open = pathlib.Path.open

    class Killed(BaseException):
        pass

    def dying_open(self, mode="r", *args, **kwargs):
        f = real_open(self, mode, *args, **kwargs)
        if "w" in mode and self.parent == tmp_path:
            f.close()
            raise Killed()  # the process dies right after the file was opened for writing
        return f

    monkeypatch.setattr(pathlib.Path, "open", dying_open)
    with pytest.raises(Killed):
        MetricsWriter(tmp_path, start_step=6)
    monkeypatch.undo()
    assert path.read_bytes() == original
    writer = MetricsWriter(tmp_path, start_step=6)  # the rerun
    writer.close()
    assert read_metrics(path) == records[:6] and not (tmp_path / "metrics.jsonl.tmp").exists()


def test_a_resume_with_nothing_to_drop_leaves_metrics_untouched(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "split": "train", "loss": 2.0}) + "\n")
    before = path.stat()
    MetricsWriter(tmp_path, start_step=1).close()
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


# ------------------------------------------------------------ 4: the final state is saved


def test_the_last_step_is_saved_even_when_it_was_skipped():
    """Item 4: a save falling due at the last step while it was skipped is made (marked
    unhealthy by the saver), not put off past the end of the run."""
    from jaxmp.train.hooks import SaveCheckpoint, Stopwatch
    saved = []
    hook = SaveCheckpoint(2, 4, save=lambda step, state, loss: saved.append(step),
                          stopwatch=Stopwatch())
    bad = {"consecutive_skips": jnp.int32(1), "divergent_steps": jnp.int32(0)}
    for step in (2, 3, 4):  # due at 2 (skipped: put off), 3 (still skipped), 4 (the last)
        hook(step, None, bad)
    assert saved == [4]


def test_a_run_whose_every_step_is_skipped_saves_its_state_and_fails(tmp_path, capsys):
    """Item 4: with a static loss scale of 1e30 under float16 compute every step overflows:
    the run fails (train.py exits 1), says so, and names the checkpoint it saved."""
    config = small_config(steps=3, checkpoint_every=1000, sample_tokens=0)
    config.precision.policy = "mixed_fp16"
    config.precision.loss_scale = "static:1e30"
    with pytest.raises(TrainingStalled, match=r"none of the 3 steps applied: every one was "
                       r"skipped.*checkpoint step 3 saved in .*, while the run was "
                       r"unhealthy.*last healthy checkpoint is none"):
        train_and_evaluate(config, str(tmp_path), num_devices=1)
    out = capsys.readouterr().out
    assert "the one resumed from" not in out
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.all_steps() == [3] and ckpt.healthy(3) is False


# ---------------------------------------------------------- 6: the best checkpoint is kept


def test_the_checkpoint_of_the_lowest_eval_loss_is_kept_besides_the_newest(tmp_path):
    """Item 6: a slow divergence (eval loss rising, every step healthy) keeps step 2, the
    lowest eval loss, besides the 2 newest; the stall/divergence text names it."""
    from jaxmp.train.hooks import last_checkpoint_text
    state = {"w": jnp.arange(4, dtype=jnp.float32)}
    losses = {1: 5.0, 2: 1.5, 3: 2.0, 4: 3.0, 5: None, 6: 7.0}
    with Checkpointer(tmp_path, keep=2) as ckpt:
        for step, loss in losses.items():
            ckpt.save(step, state, {}, {}, eval_loss=loss)
        ckpt.wait()
        assert ckpt.all_steps() == [2, 5, 6]
        assert ckpt.best_step() == 2
        assert "best checkpoint by eval loss is step 2 (1.5000 nats/token)" in \
            last_checkpoint_text(ckpt)
    with Checkpointer(tmp_path, read_only=True) as ckpt:  # read back from disk
        assert [ckpt.eval_loss(s) for s in ckpt.all_steps()] == [1.5, None, 7.0]


def test_the_trainer_saves_each_checkpoints_eval_loss(trained):
    evals = {r["step"]: r["loss"] for r in read_metrics(trained / "metrics.jsonl", "eval")}
    with Checkpointer(trained, read_only=True) as ckpt:
        assert {s: ckpt.eval_loss(s) for s in ckpt.all_steps()} == {2: evals[2], 4: evals[4]}


# ------------------------------------------------------ 5, 11, 14: data read as it is


def _data_config(path, **kw):
    import ml_collections
    cfg = dict(path=str(path), text_field="text", seq_len=15, eval_fraction=0.1,
               num_eval_batches=1, max_tokens=None, tokenizer="bytes", token_dtype="uint16",
               eod_id=-1)
    cfg.update(kw)
    return ml_collections.ConfigDict(cfg)


def test_a_directory_of_bin_shards_is_read_as_shards_and_a_mix_is_refused(tmp_path):
    """Item 5: a directory holding two .bin shards is those shards (every token counted,
    eval the end of the last one), not text; with a script beside them it is refused in
    one line naming a file of each kind."""
    from jaxmp.train.data import create_pipeline
    rng = np.random.default_rng(0)
    shards = [rng.integers(0, 257, n).astype(np.uint16) for n in (3000, 2000)]
    for i, s in enumerate(shards):
        s.tofile(tmp_path / f"shard{i}.bin")
    pipe = create_pipeline(_data_config(tmp_path), global_batch_size=4, seed=0)
    assert (pipe.train_tokens, pipe.eval_tokens) == (4500, 500)  # ceil(0.1 * 5000) held out
    np.testing.assert_array_equal(pipe.eval_batches[0]["inputs"][0], shards[1][1500:1515])
    (tmp_path / "prepare.py").write_text("print('a small script')\n")
    with pytest.raises(ValueError) as e:
        create_pipeline(_data_config(tmp_path), global_batch_size=4, seed=0)
    message = str(e.value)
    assert "\n" not in message and "holds pre-tokenized shards" in message
    assert str(tmp_path / "shard0.bin") in message and str(tmp_path / "prepare.py") in message


def test_a_garbage_npy_is_an_error_naming_the_file(tmp_path):
    """Item 14: a .npy that is not an array (here a pickle's bytes after the magic)."""
    from jaxmp.train.data import create_pipeline
    bad = tmp_path / "tokens.npy"
    bad.write_bytes(b"\x93NUMPY\x01\x00" + b"\x76\x00" + b"{'descr': '|O', 'fortran_order': "
                    b"False, 'shape': (3,), }".ljust(117) + b"\n" + b"garbage" * 10)
    with pytest.raises(ValueError, match=rf"{bad} is not a \.npy token shard"):
        create_pipeline(_data_config(bad), global_batch_size=4, seed=0)
    bad.write_bytes(b"not numpy at all")
    with pytest.raises(ValueError, match=rf"{bad} is not a \.npy token shard"):
        create_pipeline(_data_config(bad), global_batch_size=4, seed=0)


def test_a_glob_over_links_to_ancestors_walks_each_real_directory_once(tmp_path, monkeypatch):
    """Item 11: ``d/a/up -> ..`` and ``d/a/self -> ../a`` under ``d/**/*.txt``: each real
    directory is listed once (counted at os.scandir, bounded so that a walk that loops
    fails at once instead of hanging), each file found once, and a warning names a link."""
    from jaxmp.train.data import data_files, load_documents
    d = tmp_path / "d"
    (d / "a").mkdir(parents=True)
    (d / "top.txt").write_text("top")
    (d / "a" / "inner.txt").write_text("inner")
    os.symlink("..", d / "a" / "up")
    os.symlink("../a", d / "a" / "self")
    scans, real_scandir = [], os.scandir

    def counting_scandir(path="."):
        scans.append(os.path.realpath(path))
        if len(scans) > 50:
            raise RuntimeError(f"{len(scans)} directory listings: the walk loops")
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", counting_scandir)
    pattern = str(d / "**" / "*.txt")
    assert data_files(pattern) == [str(d / "a" / "inner.txt"), str(d / "top.txt")]
    assert sorted(scans) == sorted({str(d), str(d / "a")})
    warnings_ = []
    docs = load_documents(pattern, warnings=warnings_)
    assert sorted(text for _, text in docs) == [b"inner", b"top"]
    assert len(warnings_) == 1 and "each real directory is walked once" in warnings_[0]
    assert f"the link {str(d / 'a' / 'up')!r} points to its own ancestor" in warnings_[0]


# ------------------------------------------------- 9, 14, 15: refused before any work


def _untouched(config, workdir, error, match):
    """``train_and_evaluate`` raises ``error`` matching ``match``, in one line, and leaves
    no workdir behind."""
    with pytest.raises(error) as e:
        train_and_evaluate(config, str(workdir), num_devices=1)
    assert "\n" not in str(e.value)
    import re
    assert re.search(match, str(e.value)), str(e.value)
    assert not workdir.exists()


@pytest.mark.parametrize("key, value, match", [
    ("optim.weight_decay", 1e30, r"optim.weight_decay=1e\+30 with optim.learning_rate=.* is not "
                                 r"allowed: .*must be below 1 / learning_rate"),
    ("model.capacity_factor", 1e30, r"capacity_factor=1e\+30 gives .* slots per expert.*use at "
                                    r"most num_experts / top_k"),
    ("model.max_len", 1_000_000, r"model.max_len=1000000: the closing sample runs the model "
                                 r"over 1000000 tokens.*attention scores.*lower model.max_len"),
])
def test_a_value_that_cannot_work_is_refused_before_any_work(tmp_path, key, value, match):
    """Items 14 and 9: weights decayed past zero every step, a capacity no array can hold,
    a closing sample whose attention scores cannot fit: one line, no workdir."""
    config = small_config()
    section, name = key.split(".")
    config[section][name] = value
    _untouched(config, tmp_path / "run", ValueError, match)


@pytest.mark.parametrize("where", ["checkpoints", "checkpoints/corrupt"])
def test_checkpoints_as_a_file_is_refused_before_any_work(tmp_path, where, monkeypatch):
    """Items 9 and 14: ``checkpoints`` (or ``checkpoints/corrupt``) is a regular file."""
    from jaxmp.train import loop
    workdir = tmp_path / "run"
    (workdir / where).parent.mkdir(parents=True, exist_ok=True)
    (workdir / where).write_text("not a directory")
    compiles = []
    monkeypatch.setattr(loop, "Compilation", lambda exp: compiles.append(exp))
    with pytest.raises(ValueError, match=rf"{workdir / where} is a file, where the run keeps "
                                         r"its .*checkpoints; move it away"):
        train_and_evaluate(small_config(), str(workdir), num_devices=1)
    assert compiles == []  # refused before the step started compiling


def test_a_read_only_checkpoint_directory_is_refused_before_any_work(trained, tmp_path,
                                                                       monkeypatch):
    """Item 9: ``checkpoints/`` read-only (a real read-only mount where this machine
    allows one; else the kernel's error from the first write there)."""
    workdir = tmp_path / "run"
    shutil.copytree(trained, workdir, symlinks=True)
    ckpts = workdir / "checkpoints"
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "--bind", "-o", "ro", str(ckpts), str(ckpts)],
        capture_output=True).returncode == 0
    if mounted:
        mounted = subprocess.run(["mount", "-o", "remount,bind,ro", str(ckpts)],
                                 capture_output=True).returncode == 0 or mounted
    if not mounted:
        real = pathlib.Path.write_bytes

        def read_only(self, data):
            if self.parent == ckpts:
                raise OSError(30, "Read-only file system")
            return real(self, data)
        monkeypatch.setattr(pathlib.Path, "write_bytes", read_only)
    try:
        with pytest.raises(ValueError, match=rf"the checkpoint directory {ckpts} is not "
                                             r"writable: Read-only file system"):
            train_and_evaluate(small_config(steps=6, checkpoint_every=2, eval_every=2),
                               str(workdir), num_devices=1)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(ckpts)], capture_output=True)


def test_a_failed_start_leaves_no_workdir_behind(tmp_path):
    """Item 15: a data error found after the workdir was made (the corpus is too short for
    one window) removes the workdir this run created; an existing one is kept."""
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("too short")
    config = small_config()
    config.data.path = str(corpus)
    with pytest.raises(ValueError):
        train_and_evaluate(config, str(tmp_path / "run"), num_devices=1)
    assert not (tmp_path / "run").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("the user's")
    with pytest.raises(ValueError):
        train_and_evaluate(config, str(tmp_path / "mine"), num_devices=1)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "the user's"


def test_a_padded_vocabulary_never_samples_an_id_the_tokenizer_lacks():
    """Item 9: model.vocab_size=384 over the 257 byte ids. At a high temperature an
    untrained model samples the 127 padding ids often; with ``vocab_limit`` never."""
    from flax import nnx
    from jaxmp.models import ModelConfig, MoETransformer, generate
    from jaxmp.train.tokenizer import ByteTokenizer
    cfg = ModelConfig(vocab_size=384, num_layers=1, d_model=16, num_heads=2, d_ff=32,
                      max_len=64, num_experts=0)
    model = MoETransformer(cfg, "float32", rngs=nnx.Rngs(0))
    prompt = np.asarray([1, 2, 3], np.int32)
    free = generate(model, prompt, 40, temperature=20.0, rng=0)
    assert (free[3:] >= 257).any()  # the padding rows are reachable without the limit
    tok = ByteTokenizer()
    ids = generate(model, prompt, 40, temperature=20.0, rng=0, vocab_limit=tok.vocab_size)
    assert ids.max() < 257
    tok.decode(ids)  # every id decodes


# ------------------------------------------------------------------ 10: Ctrl-C, one line


def _jax_loading(pid):
    """Whether process ``pid`` has mapped jaxlib (it is importing jax: train.py's slow
    imports have begun)."""
    try:
        return "jaxlib" in pathlib.Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.parametrize("after_s", [0.0, 0.5])
def test_ctrl_c_at_start_up_exits_130_with_one_line(tmp_path, after_s):
    """Item 10: SIGINT once train.py is importing jax, and half a second later (while it
    imports, parses and builds: the moments where it was a traceback with -2, or
    swallowed by a gc callback so that the run trained on)."""
    import time
    env = dict(os.environ, JAX_DISABLE_MOST_OPTIMIZATIONS="1")
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs" / "tiny_moe.py"),
         "--workdir", str(tmp_path / "run"), "--config.train.steps=2",
         "--config.data.max_tokens=20000", "--config.train.sample_tokens=0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    deadline = time.monotonic() + LIMIT_S
    while not _jax_loading(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(after_s)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=LIMIT_S)
    lines = [line for line in err.splitlines() if line.strip() and "\r" not in line]
    assert proc.returncode == 130, err[-3000:]
    assert len(lines) == 1 and "SIGINT" in lines[0] and "Traceback" not in err, err[-3000:]


# ------------------------------------------------------------- 15: what the start does


def test_a_tokenizer_json_too_large_for_the_model_is_refused_before_tokenizing(tmp_path,
                                                                                 monkeypatch):
    """Item 15: the vocabulary check of a tokenizer.json comes before the corpus is
    read and tokenized (it came after tokenizing: 58 s in the attack)."""
    from jaxmp.train import Experiment
    from jaxmp.train import data as data_module
    from jaxmp.train.tokenizer import train_bpe
    tok = train_bpe(["some text to learn a few merges from " * 50], 300)
    tok.save(tmp_path)
    config = small_config()
    config.data.tokenizer = str(tmp_path / "tokenizer.json")
    work = []
    monkeypatch.setattr(data_module, "load_documents", lambda *a, **k: work.append(a) or [])
    with pytest.raises(ValueError, match=rf"model.vocab_size=257 is smaller than the vocabulary "
                                         rf"of data.tokenizer=.*\({tok.vocab_size} tokens\)"):
        Experiment.create(config, num_devices=1).data
    assert work == []


def test_the_start_says_what_it_reads_and_trains(tmp_path, capsys):
    """Item 15: reading the data is announced (what, and that a BPE is trained on how many
    bytes) before the banner."""
    from jaxmp.train.data import create_pipeline
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = [("def f%d(x):\n    return x * %d\n" % (i, i)) * 40 for i in range(6)]
    for i, t in enumerate(texts):
        (corpus / f"{i}.py").write_text(t)
    cfg = _data_config(corpus, tokenizer="bpe:300", eval_fraction=0.0, num_eval_batches=0)
    pipe = create_pipeline(cfg, global_batch_size=2, seed=0, workdir=tmp_path / "w",
                           progress=True)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"data: reading data.path {str(corpus)!r}"
    size = sum(len(t.encode()) for t in texts) / 2**20
    assert out[1] == f"data: training a byte-level BPE (bpe:300) on {size:,.1f} MiB of text"
    assert pipe.tokenizer.vocab_size <= 300
    create_pipeline(cfg, global_batch_size=2, seed=0, workdir=tmp_path / "w", progress=True)
    assert capsys.readouterr().out.splitlines() == [out[0]]  # the saved BPE is read back
