"""``python -m jaxmp.export`` never destroys its own inputs or an old export, and
``python -m jaxmp.sample`` refuses a seed or a prompt it cannot use, each with a one-line
error (exit status 2):

1. an ``--out`` that is not empty needs ``--force`` (both formats); the run's workdir (or
   a folder in it) and its ``model.init_from`` base checkpoint (that folder, one inside
   it, or one holding it) are refused even with ``--force``, through symbolic links and
   ``..`` too;
2. a read-only ``--out`` and a write past the file-size limit (RLIMIT_FSIZE: EFBIG) are
   one line naming the file and the OS error, not a safetensors traceback;
3. ``--force`` writes the new export beside the old one and moves it into place only once
   it is whole: a failed write leaves the old export byte for byte; a good one replaces
   it and removes the old shards;
4. ``--seed`` outside [0, 2**64) and a prompt that is not UTF-8 are argparse errors.

One tiny run for the whole module: a 1-layer llama base checkpoint written by
``save_pretrained``, fine-tuned 2 steps from it (``model.init_from``), so that the run has
both inputs to protect. Everything runs in this process.
"""
import contextlib
import hashlib
import json
import os
import pathlib
import shutil
import signal
import tempfile
import types

import numpy as np
import pytest
from flax import nnx

from jaxmp import export as export_cli
from jaxmp import sample as sample_cli
from jaxmp.models import ModelConfig, MoETransformer, save_pretrained
from jaxmp.train import artifacts, train_and_evaluate
from jaxmp.train.config import load_config

from _configs import ROOT

FORMATS = ("jaxmp", "hf")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """``tmp/models/base`` (a Hugging Face llama, 1 layer, d_model 16), ``tmp/run`` (2 steps
    fine-tuned from it, bytes tokenizer) and the run as ``artifacts.read_run`` reads it."""
    tmp = tmp_path_factory.mktemp("safety")
    base = tmp / "models" / "base"
    cfg = ModelConfig(vocab_size=264, num_layers=1, d_model=16, num_heads=2, d_ff=32, max_len=16)
    save_pretrained(MoETransformer(cfg, "fp32", rngs=nnx.Rngs(0)), str(base))
    (base / "README.md").write_text("the base checkpoint\n")
    corpus = tmp / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("def f(x):\n    return x + 1\n" * 20)
    config = load_config(ROOT / "configs" / "finetune.py", [
        f"model.init_from={base}", "precision.policy=fp32", "data.seq_len=16",
        "train.batch_size=2", f"data.path={corpus}", "data.num_eval_batches=0",
        "data.eval_fraction=0", "model.remat=none", "model.scan_layers=False", "train.steps=2",
        "train.sample_tokens=0", "train.eval_every=0", "train.log_every=1",
        "optim.warmup_steps=0"])
    workdir = tmp / "run"
    train_and_evaluate(config, str(workdir), num_devices=1)
    loaded = artifacts.read_run(workdir)
    assert loaded[2].model.init_from == str(base)
    return types.SimpleNamespace(tmp=tmp, base=base, workdir=workdir, loaded=loaded)


@pytest.fixture
def loaded_once(run, monkeypatch):
    """``artifacts.read_run`` answers with the run read once (for tests that change the
    process's file-size limit or user, where reading the checkpoint is not the subject)."""
    monkeypatch.setattr(artifacts, "read_run",
                        lambda workdir, step=None, num_devices=None, base_dir=None: run.loaded)


def _tree(path: pathlib.Path) -> dict:
    """Everything under ``path`` by relative path: a file's SHA-256, a folder's None."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            if p.is_file() else None for p in sorted(path.rglob("*"))}


def _call(main, capsys, *argv):
    """``main(argv)`` in this process: ``(exit status, stdout, stderr)``."""
    capsys.readouterr()
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def _one_error_line(err: str, prog: str) -> str:
    """The error line of ``err``, asserting that there is exactly one and no traceback."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(lines) == 1 and lines[0].startswith(f"python -m jaxmp.{prog}: error: "), err
    return lines[0]


def _export(capsys, run, out, *flags):
    return _call(export_cli.main, capsys, "--workdir", run.workdir, "--out", out, *flags)


# 1. --out: not empty without --force; never the run's inputs


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_non_empty_out_is_refused_without_force(run, tmp_path, capsys, fmt):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    (out / "model.safetensors").write_bytes(b"someone else's weights")
    before = _tree(out)
    code, stdout, err = _export(capsys, run, out, "--format", fmt)
    line = _one_error_line(err, "export")
    assert code == 2 and str(out) in line and "is not empty" in line and "--force" in line
    assert _tree(out) == before and stdout == ""


def _targets(run, tmp_path):
    """The --out of each refusal: (label, path as given, what the message says)."""
    step = sorted(p.name for p in (run.workdir / "checkpoints").iterdir() if p.name.isdigit())
    (tmp_path / "to_run").symlink_to(run.workdir, target_is_directory=True)
    (tmp_path / "to_base").symlink_to(run.base, target_is_directory=True)
    dotted = run.tmp / "corpus" / ".." / "run" / "export"  # as written, not under the run
    return [
        ("workdir", run.workdir, "is the run's workdir"),
        ("checkpoint", run.workdir / "checkpoints" / step[-1], "inside the run's workdir"),
        ("new folder in it", run.workdir / "checkpoints" / "999", "inside the run's workdir"),
        ("symlink to workdir", tmp_path / "to_run", "is the run's workdir"),
        ("dot-dot into workdir", dotted, "inside the run's workdir"),
        ("base", run.base, "is the run's base checkpoint"),
        ("in base", run.base / "export", "is inside the run's base checkpoint"),
        ("holds base", run.base.parent, "contains the run's base checkpoint"),
        ("symlink to base", tmp_path / "to_base", "is the run's base checkpoint"),
    ]


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_runs_own_inputs_are_refused_even_with_force(run, tmp_path, capsys, fmt):
    """The workdir, a checkpoint folder, a new folder inside the workdir, the base
    checkpoint, a folder in it and one holding it, directly, by symbolic link and by
    ``..``: each refused with --force, nothing of the run, its base or their folders
    changed (no file, no temporary folder)."""
    before = _tree(run.tmp)  # the run, its base, the corpus and the folders around them
    for label, out, says in _targets(run, tmp_path):
        code, stdout, err = _export(capsys, run, out, "--format", fmt, "--force")
        line = _one_error_line(err, "export")
        assert code == 2 and f"--out {out} " in line and says in line, (label, line)
        assert "even with --force" in line and stdout == "", label
        assert _tree(run.tmp) == before, label
    assert not (run.workdir / "checkpoints" / "999").exists()


# 2. and 3. a failed write: one line, the old export kept


@contextlib.contextmanager
def _modes(read_only: pathlib.Path, writable: pathlib.Path = None):
    """``read_only`` cannot be written by this process meanwhile (mode 0o555; for root,
    whom modes do not stop, the effective user id is nobody's, 65534), ``writable`` can
    (mode 0o777). Both are under a new folder of /tmp that everyone can enter (pytest's
    own is root's alone)."""
    read_only.chmod(0o555)
    if writable is not None:
        writable.chmod(0o777)
    switched = False
    try:
        if os.geteuid() == 0:
            try:
                os.seteuid(65534)
                switched = True
            except OSError:
                pytest.skip("root cannot switch its effective user id here")
        if os.access(read_only, os.W_OK, effective_ids=True):
            pytest.skip("cannot make a directory read-only to this process")
        yield
    finally:
        if switched:
            os.seteuid(0)
        read_only.chmod(0o755)


@pytest.fixture
def open_tmp():
    """A new folder of /tmp that everyone can enter, removed after the test."""
    top = pathlib.Path(tempfile.mkdtemp(prefix="jaxmp-export-safety-"))
    top.chmod(0o755)
    yield top
    shutil.rmtree(top)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_read_only_out_is_one_line(run, loaded_once, open_tmp, capsys, fmt):
    out = open_tmp / "out"
    out.mkdir()
    with _modes(read_only=out):
        code, stdout, err = _export(capsys, run, out, "--format", fmt)
    line = _one_error_line(err, "export")
    assert code == 2 and f"--out {out} is not writable" in line, line
    assert "is not writable: Permission denied [Errno 13]" in line and stdout == ""
    assert os.listdir(out) == [] and os.listdir(open_tmp) == ["out"]


def test_an_out_whose_folder_is_read_only_is_written_in_place(run, loaded_once, open_tmp,
                                                              capsys):
    """No temporary folder can be made beside --out: it is made inside --out, then its
    files are moved beside it and it is removed."""
    parent = open_tmp / "exports"
    out = parent / "out"
    out.mkdir(parents=True)
    (out / "notes.txt").write_text("mine\n")
    with _modes(read_only=parent, writable=out):
        code, stdout, err = _export(capsys, run, out, "--format", "hf", "--force")
    assert code == 0 and "exported step 2" in stdout, err
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "notes.txt",
                                       "tokenizer.json", "tokenizer_config.json"]
    assert os.listdir(parent) == ["out"]


@contextlib.contextmanager
def _file_size_limit(nbytes: int):
    """RLIMIT_FSIZE's soft limit at ``nbytes`` meanwhile; SIGXFSZ ignored (as CPython
    starts), so that a write past it fails with EFBIG instead of killing the process."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_file_size_limit_is_one_line_and_keeps_the_old_export(run, tmp_path, capsys,
                                                                monkeypatch, fmt):
    """--force over a good export, the weights past RLIMIT_FSIZE (EFBIG): one line naming
    the weights file and the OS error; the old export byte for byte, no temporary folder."""
    out = tmp_path / "export"
    code, _, err = _export(capsys, run, out, "--format", fmt)
    assert code == 0, err
    (out / "notes.txt").write_text("mine\n")
    before, around = _tree(out), sorted(os.listdir(tmp_path))
    assert os.path.getsize(out / "model.safetensors") > 8192
    with monkeypatch.context() as m:  # the run read once, before the limit
        m.setattr(artifacts, "read_run",
                  lambda workdir, step=None, num_devices=None, base_dir=None: run.loaded)
        with _file_size_limit(8192):
            code, stdout, err = _export(capsys, run, out, "--format", fmt, "--force")
    line = _one_error_line(err, "export")
    assert code == 2 and stdout == "" and str(out) in line, line
    assert "model.safetensors" in line and "[Errno 27] File too large" in line, line
    assert f"{out} is left as it was" in line
    assert _tree(out) == before and sorted(os.listdir(tmp_path)) == around


def test_force_replaces_an_hf_export_and_removes_its_old_shards(run, tmp_path, capsys):
    """--force over a sharded export: the new single model.safetensors, config.json and
    tokenizer in place, the old shards and their index gone, other files kept."""
    import safetensors.numpy

    out = tmp_path / "export"
    out.mkdir()
    old = {"model-00001-of-00002.safetensors": b"old shard 1",
           "model-00002-of-00002.safetensors": b"old shard 2",
           "model.safetensors.index.json": b'{"weight_map": {}}', "config.json": b"{}",
           "README.md": b"my notes\n"}
    for name, data in old.items():
        (out / name).write_bytes(data)
    code, stdout, err = _export(capsys, run, out, "--format", "hf", "--force")
    assert code == 0, err
    assert sorted(os.listdir(out)) == ["README.md", "config.json", "model.safetensors",
                                       "tokenizer.json", "tokenizer_config.json"]
    assert (out / "README.md").read_bytes() == b"my notes\n"
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    tensors = safetensors.numpy.load_file(str(out / "model.safetensors"))
    model = run.loaded[0]
    np.testing.assert_array_equal(tensors["model.embed_tokens.weight"],
                                  np.asarray(model.embed.table[...]))
    assert sorted(os.listdir(tmp_path)) == ["export"]  # no temporary folder left


# 4. python -m jaxmp.sample: --seed and --prompt


@pytest.mark.parametrize("seed", [str(2 ** 64), str(2 ** 200), "-1", "9" * 5000])
def test_a_seed_outside_64_bits_is_one_line(run, capsys, seed):
    code, stdout, err = _call(sample_cli.main, capsys, "--workdir", run.workdir, "--seed", seed)
    line = _one_error_line(err, "sample")
    assert code == 2 and "argument --seed" in line and "[0, 2**64)" in line and stdout == ""
    assert len(line) < 200


@pytest.mark.parametrize("temperature", ["inf", "-inf", "nan", "-1"])
def test_a_temperature_that_is_not_a_finite_number_at_least_0_is_one_line(tmp_path, capsys,
                                                                          temperature):
    """--temperature inf made every logit equal, the probabilities NaN and the sampled id
    one past the tokenizer: a ValueError traceback from decode. Refused before any
    checkpoint is read (the workdir need not exist)."""
    code, stdout, err = _call(sample_cli.main, capsys, "--workdir", tmp_path / "none",
                              f"--temperature={temperature}")
    line = _one_error_line(err, "sample")
    assert code == 2 and stdout == ""
    assert f"--temperature must be a finite number >= 0, got {float(temperature)}" in line


def test_every_64_bit_seed_is_its_own_key():
    """Seeds below 2**32 keep jax.random.key's key; the high 32 bits count (jax.random.key
    alone keeps only the low 32 bits without 64-bit mode: 2**32 would sample as 0)."""
    import jax

    def data(seed):
        return tuple(np.asarray(jax.random.key_data(sample_cli.seed_key(seed))).tolist())

    assert data(5) == tuple(np.asarray(jax.random.key_data(jax.random.key(5))).tolist())
    keys = {data(s) for s in (0, 1, 2 ** 32, 2 ** 32 + 1, 2 ** 63, 2 ** 64 - 1)}
    assert len(keys) == 6
    with pytest.raises(ValueError, match=r"\[0, 2\*\*64\)"):
        sample_cli.seed_key(2 ** 64)


def test_a_prompt_that_is_not_utf8_is_one_line(run, capsys):
    prompt = os.fsdecode(b"def \xff")  # as Python keeps the argument byte: a lone surrogate
    assert prompt == "def \udcff"
    code, stdout, err = _call(sample_cli.main, capsys, "--workdir", run.workdir,
                              "--prompt", prompt)
    line = _one_error_line(err, "sample")
    assert code == 2 and "--prompt" in line and "byte 0xff" in line and stdout == ""


def test_a_64_bit_seed_samples(run, capsys):
    code, stdout, err = _call(sample_cli.main, capsys, "--workdir", run.workdir, "--prompt",
                              "def ", "--tokens", "2", "--seed", str(2 ** 64 - 1))
    assert code == 0 and stdout.startswith("def "), err
