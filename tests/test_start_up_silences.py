"""Issue 28, item 15 (silences): the start says what it does, with progress when it is
long; a BPE trained on one huge line is bounded in memory; the cheap checks come first;
a failed start leaves nothing behind.

Small inputs stand for the attack's (a 200 MB single-line file under ``bpe:512`` ran
480 s at 7.4 GB): a few-MB single line, the progress delay set to 0, memory bounded by a
generous multiple of the input, no wall-clock asserts.
"""
import os
import pathlib
import random
import signal
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from _configs import ROOT, small_config
from test_faults_round3 import _data_config as data_config
from jaxmp.train import Interrupted, train_and_evaluate
from jaxmp.train import data as data_module
from jaxmp.train import tokenizer as tokenizer_module
from jaxmp.train.tokenizer import ByteTokenizer, bpe_sample, text_pieces, train_bpe

LIMIT_S = 600  # per subprocess: generous on a slow, shared machine


def _one_line(n_bytes, seed=0):
    """``n_bytes`` of words separated by single spaces, with no line break (ASCII)."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
             for _ in range(3000)]
    out, size = [], 0
    while size < n_bytes:
        w = rng.choice(words)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


def _data_config(path, **kw):
    """test_faults_round3's data config, without eval."""
    return data_config(path, **{"eval_fraction": 0.0, "num_eval_batches": 0, **kw})


# ------------------------------------------------------------------ pieces and sample


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab é\n€")), max_size=300),
       st.integers(4, 40), st.booleans())
def test_text_pieces_cut_before_a_space_and_rebuild_the_text(text, size, as_bytes):
    """The pieces concatenate to the text, none is longer than ``size``, each but the last
    is followed by a space or line break where its window held one, and byte pieces are
    whole UTF-8 characters (each decodes strictly)."""
    whole = text.encode() if as_bytes else text
    pieces = list(text_pieces(whole, size))
    assert (b"" if as_bytes else "").join(pieces) == whole
    assert all(0 < len(p) <= size for p in pieces) or len(pieces) == 1
    sep = (b" ", b"\n") if as_bytes else (" ", "\n")
    lo = 0
    for piece in pieces[:-1]:
        lo += len(piece)
        window = whole[lo - len(piece) + 1:lo - len(piece) + size + 1]
        if any(s in window for s in sep):
            assert whole[lo:lo + 1] in sep
        if as_bytes:
            piece.decode("utf-8")  # strict: no character cut in two


def test_the_bpe_sample_is_even_and_bounded():
    """Over the cap, every ``total / cap``-th piece is kept (hand count: 100 pieces of 10
    bytes, cap 250 bytes: 25 pieces, one in four, spread over the whole corpus)."""
    texts = [("%09d " % i).encode() for i in range(100)]  # 10 bytes each, one piece each
    kept = list(bpe_sample(texts, max_bytes=250, piece_bytes=10))
    assert len(kept) == 25
    assert [int(k) for k in kept] == list(range(3, 100, 4))
    assert list(bpe_sample(texts, max_bytes=10_000, piece_bytes=10)) == texts


@pytest.mark.parametrize("spec", ["bytes", "bpe"])
def test_a_long_document_is_tokenized_in_pieces_to_the_whole_documents_ids(spec):
    """Cut before spaces and line breaks, a document's ids are the tokenizer's own ids of
    the whole document (byte-level BPE: GPT-2's pre-tokenizer splits words there)."""
    text = (_one_line(30_000, seed=1) + "\n  indented  line\n") * 3
    tok = (ByteTokenizer() if spec == "bytes" else
           train_bpe([_one_line(50_000, seed=2)], 400))
    docs = [("short", b"a short one"), ("long", text.encode())]
    got = data_module._tokenize(docs, tok, piece_bytes=1000)
    np.testing.assert_array_equal(got[1][1], tok.encode(text))  # EOS at the end only
    np.testing.assert_array_equal(got[0][1], tok.encode(b"a short one"))
    assert [n for n, _ in got] == ["short", "long"]


# ---------------------------------------------------- (b) a huge single line, bounded

_TRAIN_ONE_LINE = """
import importlib.util, pathlib, resource, sys
spec = importlib.util.spec_from_file_location(
    "tok", pathlib.Path(sys.argv[1]) / "jaxmp" / "train" / "tokenizer.py")
tok = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tok)
import tokenizers, tqdm  # imported before the baseline
tok.PROGRESS_DELAY_S = 0.0
text = pathlib.Path(sys.argv[2]).read_bytes()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
bpe = tok.train_bpe([text], 512, progress=True, max_bytes=int(sys.argv[3]))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(peak - base, bpe.vocab_size)
"""


def test_a_bpe_on_one_huge_line_is_bounded_in_memory_and_shows_progress(tmp_path):
    """A 6 MiB single-line file under bpe:512: the trainer's peak memory stays within 16
    bytes per input byte (given whole, the ``tokenizers`` trainer held about 80: 7.4 GB for
    the attack's 200 MB), and a progress bar over the bytes counted, then the merges line,
    are on stderr."""
    size = 6 << 20
    corpus = tmp_path / "one_line.txt"
    corpus.write_text(_one_line(size))
    p = subprocess.run([sys.executable, "-c", _TRAIN_ONE_LINE, str(ROOT), str(corpus),
                        str(64 << 20)], capture_output=True, text=True, timeout=LIMIT_S)
    assert p.returncode == 0, p.stderr[-3000:]
    grew, vocab = map(int, p.stdout.split())
    assert vocab == 512
    assert grew < 16 * size, (grew, size)
    counted = corpus.stat().st_size  # the bar passes over the whole text, sampled or not
    bars = [s for s in p.stderr.replace("\r", "\n").splitlines() if "data: BPE: counting" in s]
    assert bars and "100%" in bars[-1], p.stderr[-2000:]
    assert f"{counted / 1e6:.2f}M/{counted / 1e6:.2f}M" in bars[-1], bars[-1]
    assert "data: BPE: computing up to 255 merges" in p.stderr.splitlines()


def test_the_start_says_it_trains_on_a_sample_and_shows_each_long_phase(tmp_path, capsys,
                                                                         monkeypatch):
    """(a) The lines of each phase (stdout) and a progress bar for reading the files,
    counting the BPE's words and tokenizing (stderr; the delay set to 0). A train split
    over BPE_TRAIN_BYTES is said to be sampled."""
    monkeypatch.setattr(tokenizer_module, "PROGRESS_DELAY_S", 0.0)
    monkeypatch.setattr(tokenizer_module, "BPE_TRAIN_BYTES", 100_000)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = [_one_line(150_000, seed=3), _one_line(100_000, seed=4)]
    for i, t in enumerate(texts):
        (corpus / f"{i}.txt").write_text(t)
    cfg = _data_config(corpus, tokenizer="bpe:300")
    data_module.create_pipeline(cfg, global_batch_size=2, seed=0, workdir=tmp_path / "w",
                                progress=True)
    captured = capsys.readouterr()
    size = sum(len(t) for t in texts) / 2**20
    assert captured.out.splitlines() == [
        f"data: reading data.path {str(corpus)!r}",
        f"data: training a byte-level BPE (bpe:300) on {100_000 / 2**20:,.1f} MiB of text, an "
        f"even sample of the {size:,.1f} MiB of the train split (at most BPE_TRAIN_BYTES)"]
    err = captured.err.replace("\r", "\n")
    for bar in ("data: reading files", "data: BPE: counting words",
                "data: tokenizing (bpe:300)"):
        assert any(bar in line and "100%" in line for line in err.splitlines()), (bar, err)


# ------------------------------------------------------- (c) cheap checks come first


def test_the_vocabulary_of_a_saved_bpe_is_checked_before_the_corpus_is_read(tmp_path,
                                                                             monkeypatch):
    """A tokenizer.json too large for model.vocab_size is refused before any document is
    read (the SentencePiece and bpe:N cases go through the same check: the spec's file
    is loaded, or N compared, before create_pipeline)."""
    from jaxmp.train import Experiment
    tok = train_bpe([_one_line(40_000)], 300)
    tok.save(tmp_path)
    config = small_config()
    config.data.tokenizer = str(tmp_path / "tokenizer.json")
    read = []
    monkeypatch.setattr(data_module, "load_documents", lambda *a, **k: read.append(a) or [])
    monkeypatch.setattr(data_module, "token_files", lambda *a, **k: read.append(a) or [])
    with pytest.raises(ValueError, match=r"model.vocab_size=257 is smaller"):
        Experiment.create(config, num_devices=1).data
    assert read == []
    config.data.tokenizer = "bpe:300"
    with pytest.raises(ValueError, match=r"model.vocab_size=257 is smaller than the "
                                         r"vocabulary of data.tokenizer='bpe:300'"):
        Experiment.create(config, num_devices=1).data
    assert read == []


@pytest.mark.parametrize("spec", ["json", "bpe:300"])
def test_a_vocabulary_too_large_is_refused_before_the_workdir_and_the_compile(
        tmp_path, monkeypatch, spec):
    """train_and_evaluate refuses a tokenizer.json (or bpe:N) larger than model.vocab_size
    before it makes the workdir and starts compiling the step (it was found after both)."""
    from jaxmp.train import loop
    if spec == "json":
        train_bpe([_one_line(40_000)], 300).save(tmp_path)
        spec = str(tmp_path / "tokenizer.json")
    config = small_config()
    config.data.tokenizer = spec
    compiles = []
    monkeypatch.setattr(loop, "Compilation", lambda exp: compiles.append(exp))
    with pytest.raises(ValueError, match=r"model.vocab_size=257 is smaller"):
        train_and_evaluate(config, str(tmp_path / "run"), num_devices=1)
    assert compiles == [] and not (tmp_path / "run").exists()


# ------------------------------------------------- (d) a failed start leaves nothing


def _fail_in_data(monkeypatch, how):
    """Makes reading the data fail ``how``, after the workdir and its lock exist."""
    real = data_module.load_documents

    def load(*args, **kwargs):
        assert (pathlib.Path(load.workdir) / ".jaxmp.lock").exists()  # the lock is taken
        if how == "error":
            raise ValueError("a data error found while reading")
        if how == "oserror":
            raise OSError(5, "Input/output error")
        os.kill(os.getpid(), signal.SIGINT if how == "sigint" else signal.SIGTERM)
        return real(*args, **kwargs)
    return load


@pytest.mark.parametrize("how, error", [("error", ValueError), ("oserror", OSError),
                                        ("sigint", Interrupted), ("sigterm", Interrupted),
                                        ("vocab", ValueError)])
def test_a_failed_start_of_each_kind_leaves_no_workdir_and_no_lock(tmp_path, monkeypatch, how,
                                                                  error):
    """Each way a start can fail after the workdir was made and locked (a data error, an
    I/O error, Ctrl-C or SIGTERM while the data is read, a vocabulary found too small only
    once a saved BPE is read back): the exception, and no workdir left (no lone lock file,
    no tokenizer.json). A workdir that existed before is kept with what it held."""
    workdir = tmp_path / "run"
    config = small_config()
    config.data.max_tokens = 20_000
    if how == "vocab":  # a BPE of 300 tokens trained into the workdir, model.vocab_size=257
        corpus = tmp_path / "c.txt"
        corpus.write_text(_one_line(60_000))
        config.data.path, config.data.tokenizer = str(corpus), "bpe:257"
        real_load = tokenizer_module.load_tokenizer

        def bigger(spec, **kw):
            return real_load("bpe:300", **kw)
        monkeypatch.setattr(data_module, "load_tokenizer", bigger)
    else:
        load = _fail_in_data(monkeypatch, how)
        load.workdir = workdir
        monkeypatch.setattr(data_module, "load_documents", load)
    with pytest.raises(error):
        train_and_evaluate(config, str(workdir), num_devices=1)
    assert not workdir.exists(), sorted(p.name for p in workdir.rglob("*"))
    if how in ("error", "sigint"):
        workdir.mkdir()
        (workdir / "notes.txt").write_text("the user's")
        if how != "vocab":
            load.workdir = workdir
        with pytest.raises(error):
            train_and_evaluate(config, str(workdir), num_devices=1)
        assert sorted(p.name for p in workdir.iterdir()) == ["notes.txt"]



def test_a_start_refused_for_a_busy_workdir_removes_nothing_of_the_other_trainers(
        tmp_path, monkeypatch):
    """Two starts racing for a new workdir: the one refused (WorkdirInUse) removes neither
    the workdir nor the lock file of the one that holds it, though both are newer than
    the refused start's look at the workdir (it removed the whole workdir before)."""
    from jaxmp.train import WorkdirInUse, loop
    from jaxmp.train.workdir import WorkdirLock, prepare_workdir
    workdir, other = tmp_path / "run", []

    def prepare(path):  # the other trainer creates and locks the workdir meanwhile
        out = prepare_workdir(path)
        other.append(WorkdirLock(out).__enter__())
        return out
    monkeypatch.setattr(loop, "prepare_workdir", prepare)
    try:
        with pytest.raises(WorkdirInUse):
            train_and_evaluate(small_config(), str(workdir), num_devices=1)
        assert (workdir / ".jaxmp.lock").exists()
    finally:
        other[0].__exit__(None, None, None)
