"""Tests for jaxmp.train.data: byte tokenizer, corpus loading, packing, grain pipeline."""
import json
import os
import pathlib
import sysconfig
import zlib

import hypothesis
import hypothesis.strategies as st
import ml_collections
import numpy as np
import pytest

from jaxmp.train import data

EOS = 256


def _config(path, seq_len=4, eval_fraction=0.0, num_eval_batches=0, max_tokens=None,
            text_field="text"):
    return ml_collections.ConfigDict(dict(
        path=None if path is None else str(path), text_field=text_field, seq_len=seq_len,
        eval_fraction=eval_fraction, num_eval_batches=num_eval_batches,
        max_tokens=max_tokens))


def _pack(docs):
    """Reference packing: every document's bytes then EOS, as int64."""
    parts = [np.append(np.frombuffer(d, np.uint8).astype(np.int64), EOS) for d in docs]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _windows(tokens, seq_len):
    n = len(tokens) // (seq_len + 1)
    return tokens[: n * (seq_len + 1)].reshape(n, seq_len + 1)


def _take(it, n):
    return [next(it) for _ in range(n)]


@pytest.fixture
def corpus(tmp_path):
    """24 documents of distinct random bytes (incl. invalid UTF-8) in nested dirs; no NUL
    byte, which would make a file binary (skipped with a warning, load_documents)."""
    rng = np.random.default_rng(0)
    docs = []
    for i in range(24):
        f = tmp_path / f"d{i % 3}" / f"doc{i:02d}.txt"
        f.parent.mkdir(exist_ok=True)
        f.write_bytes(rng.integers(1, 256, size=int(rng.integers(5, 40)), dtype=np.uint8).tobytes())
        docs.append(f)
    return tmp_path, sorted(docs, key=str)


# --- tokenizer ---------------------------------------------------------------

def test_tokenizer_constants():
    tok = data.ByteTokenizer()
    assert (tok.vocab_size, tok.eos_id) == (257, 256)


def test_tokenizer_non_ascii_hand_checked():
    tok = data.ByteTokenizer()
    ids = tok.encode("hé€", add_eos=False)  # é = C3 A9, € = E2 82 AC in UTF-8
    assert ids.dtype == np.int32
    np.testing.assert_array_equal(ids, [0x68, 0xC3, 0xA9, 0xE2, 0x82, 0xAC])
    assert tok.decode(ids) == "hé€"
    np.testing.assert_array_equal(tok.encode(b"a"), [97, 256])  # a document ends in EOS


def test_tokenizer_invalid_utf8_and_eos():
    tok = data.ByteTokenizer()
    ids = tok.encode(b"ab\xff\xfec")
    np.testing.assert_array_equal(ids, [97, 98, 255, 254, 99, 256])
    assert tok.decode(ids) == "ab\ufffd\ufffdc"
    assert tok.decode([104, 256, 105, 256]) == "hi"
    assert tok.decode(np.array([[104], [105]])) == "hi"


@pytest.mark.parametrize("ids", [[-1], [257], [1.5]])
def test_tokenizer_decode_rejects_bad_ids(ids):
    with pytest.raises(ValueError):
        data.ByteTokenizer().decode(ids)


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(st.text())
def test_tokenizer_round_trip_text(text):
    tok = data.ByteTokenizer()
    ids = tok.encode(text)
    assert ids.tolist() == list(text.encode("utf-8")) + [256]
    assert tok.decode(ids) == text


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(st.binary())
def test_tokenizer_bytes_are_tokens(raw):
    tok = data.ByteTokenizer()
    ids = tok.encode(raw, add_eos=False)
    assert ids.tolist() == list(raw)
    assert tok.decode(ids) == raw.decode("utf-8", errors="replace")


# --- loading -----------------------------------------------------------------

def test_load_glob_recursive_sorted_skips_empty(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "deep").mkdir()
    (tmp_path / "a.txt").write_bytes(b"A")
    (tmp_path / "b" / "deep" / "c.txt").write_bytes(b"C\xff")
    (tmp_path / "b" / "empty.txt").write_bytes(b"")
    (tmp_path / "dir.txt").mkdir()  # a directory the glob also matches
    docs = data.load_documents(str(tmp_path / "**" / "*.txt"))
    assert docs == [(str(tmp_path / "a.txt"), b"A"),
                    (str(tmp_path / "b" / "deep" / "c.txt"), b"C\xff")]


def test_load_jsonl(tmp_path):
    f = tmp_path / "x.jsonl"
    f.write_text('{"body": "hi", "id": 1}\n\n{"body": "\u00e9"}\n{"body": ""}\n',
                 encoding="utf-8")
    docs = data.load_documents(str(f), text_field="body")
    assert docs == [(f"{f}:1", b"hi"), (f"{f}:3", b"\xc3\xa9")]


@pytest.mark.parametrize("bad_line", ['{"text": "a"', '["text"]', '{"other": "a"}',
                                      '{"text": 3}'])
def test_load_jsonl_bad_line_names_file_and_line(tmp_path, bad_line):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "ok"}\n' + bad_line + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 2"):
        data.load_documents(str(f))


def test_load_parquet_rows_as_jsonl_lines(tmp_path):
    """A Parquet file (written by pyarrow) reads as the same records in JSON lines would:
    a row per document, named file:row; an empty text skipped, a null field absent; rows
    read a batch at a time, past the first batch."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts = [f"doc {i}" for i in range(1500)] + ["", "\u00e9"]
    f = tmp_path / "x.parquet"
    pq.write_table(pa.Table.from_pylist([{"body": t, "id": i} for i, t in enumerate(texts)]),
                   str(f), row_group_size=700)
    docs = data.load_documents(str(tmp_path), text_field="body")  # a directory: Parquet is data
    assert docs == [(f"{f}:{i + 1}", t.encode()) for i, t in enumerate(texts) if t]
    g = tmp_path / "mixed.parquet"
    pq.write_table(pa.Table.from_pylist([{"messages": [{"role": "user", "content": "hi",
                                                        "tool_calls": None}], "text": None},
                                         {"messages": None, "text": "plain"}]), str(g))
    assert data.load_documents(str(g), records=True) == [
        (f"{g}:1", {"messages": [{"role": "user", "content": "hi"}]}),
        (f"{g}:2", {"text": "plain"})]


@pytest.mark.parametrize("rows, match", [
    ([{"text": 1}, {"text": 3}], r"bad\.parquet, row 1: expected a JSON object with a string "
                                 r"field 'text'"),
    ([{"text": "ok", "other": None}, {"text": None, "other": "a"}],
     r"bad\.parquet, row 2: expected"),
    (None, r"bad\.parquet: not a readable Parquet file \("),
])
def test_a_bad_parquet_row_or_file_names_file_and_row(tmp_path, rows, match):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    f = tmp_path / "bad.parquet"
    if rows is None:
        f.write_bytes(b"PAR1 this is no parquet file PAR1")
    else:
        pq.write_table(pa.Table.from_pylist(rows), str(f))
    with pytest.raises(ValueError, match=match) as info:
        data.load_documents(str(f))
    assert "\n" not in str(info.value)


def test_auto_reads_a_text_jsonl_corpus_once_as_text_does(tmp_path, monkeypatch):
    """data.format=auto on JSON lines of text records reads the files once, and gives the
    batches data.format=text gives; an empty object is refused as text refuses it."""
    f = tmp_path / "x.jsonl"
    f.write_text("".join(json.dumps({"text": f"line {i} " * 5}) + "\n" for i in range(40)))
    calls = []
    real = data.load_documents
    monkeypatch.setattr(data, "load_documents",
                        lambda *a, **k: calls.append(k.get("records")) or real(*a, **k))
    auto = data.create_pipeline(ml_collections.ConfigDict(dict(_config(f), format="auto")),
                                global_batch_size=2, seed=0)
    assert calls == [True]
    text = data.create_pipeline(ml_collections.ConfigDict(dict(_config(f), format="text")),
                                global_batch_size=2, seed=0)
    for _ in range(3):
        a, b = next(auto.train_iter), next(text.train_iter)
        assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    f.write_text('{"text": "ok"}\n{}\n')
    with pytest.raises(ValueError, match=r"x\.jsonl, line 2: expected a JSON object with a "
                                         r"string field 'text'"):
        data.create_pipeline(ml_collections.ConfigDict(dict(_config(f), format="auto")),
                             global_batch_size=2, seed=0)


def test_no_match_names_glob(tmp_path):
    pattern = str(tmp_path / "nothing" / "*.txt")
    with pytest.raises(ValueError, match="nothing"):
        data.load_documents(pattern)
    with pytest.raises(ValueError, match="no file matches"):
        data.create_pipeline(_config(pattern), global_batch_size=2, seed=0)


# --- split -------------------------------------------------------------------

def test_split_documents_stable_hash():
    docs = [(f"dir/file{i}.py", b"x") for i in range(2000)]
    train, evals = data.split_documents(docs, 0.1)
    expected_eval = [d for d in docs if zlib.crc32(d[0].encode()) < 0.1 * 2**32]
    assert evals == expected_eval
    assert train == [d for d in docs if d not in expected_eval]
    assert 0.08 < len(evals) / len(docs) < 0.12
    # A document's split depends on its name only, not on the other documents.
    assert data.split_documents(docs[::-1], 0.1) == (train[::-1], evals[::-1])
    assert data.split_documents(docs, 0.0) == (docs, [])


@pytest.mark.parametrize("fraction", [-0.1, 1.0])
def test_split_documents_bad_fraction(fraction):
    with pytest.raises(ValueError, match="eval_fraction"):
        data.split_documents([("a", b"x")], fraction)


# --- packing -----------------------------------------------------------------

def test_packing_hand_checked(tmp_path):
    for name, text in [("a.txt", b"abc"), ("b.txt", b"de"), ("c.txt", b"fgh"),
                       ("d.txt", b"")]:
        (tmp_path / name).write_bytes(text)
    # a b c EOS d e EOS f g h EOS -> windows of 3, tail [h, EOS] dropped.
    stream = data.TokenStream.from_documents(data.load_documents(str(tmp_path / "*.txt")), 2)
    np.testing.assert_array_equal(
        stream.tokens, [97, 98, 99, 256, 100, 101, 256, 102, 103, 104, 256])
    hand = np.array([[97, 98, 99], [256, 100, 101], [256, 102, 103]])
    assert len(stream) == 3 and stream.num_tokens == 11
    for i in range(3):
        assert stream[i].dtype == np.int32
        np.testing.assert_array_equal(stream[i], hand[i])
    with pytest.raises(IndexError):
        stream[3]

    pipe = data.create_pipeline(_config(tmp_path / "*.txt", seq_len=2),
                                global_batch_size=3, seed=0)
    assert (pipe.train_tokens, pipe.eval_tokens, pipe.num_documents) == (11, 0, 3)
    batch = next(pipe.train_iter)
    assert set(batch) == {"inputs", "targets"}
    assert batch["inputs"].dtype == batch["targets"].dtype == np.int32
    assert batch["inputs"].shape == batch["targets"].shape == (3, 2)
    # One epoch is one batch here: its rows are the three windows, shuffled.
    order = [next(j for j in range(3) if (hand[j, :2] == row).all()) for row in batch["inputs"]]
    assert sorted(order) == [0, 1, 2]
    np.testing.assert_array_equal(batch["inputs"], hand[order, :2])
    np.testing.assert_array_equal(batch["targets"], hand[order, 1:])


def test_max_tokens_caps_stream(corpus):
    root, files = corpus
    docs = [f.read_bytes() for f in files]
    stream = data.TokenStream.from_documents([(str(f), d) for f, d in zip(files, docs)],
                                             seq_len=4, max_tokens=50)
    np.testing.assert_array_equal(stream.tokens, _pack(docs)[:50])
    named = [(str(f), d) for f, d in zip(files, docs)]
    for no_cap in (None, 0):  # the trainer's config uses 0 for "no cap"
        np.testing.assert_array_equal(
            data.TokenStream.from_documents(named, 4, max_tokens=no_cap).tokens, _pack(docs))


def test_epochs_cover_windows_and_reshuffle(corpus):
    root, files = corpus
    seq_len, batch_size = 3, 4
    ref = _windows(_pack([f.read_bytes() for f in files]), seq_len)
    pipe = data.create_pipeline(_config(root / "**" / "*.txt", seq_len=seq_len),
                                global_batch_size=batch_size, seed=1)
    num_batches = -(-2 * len(ref) // batch_size)
    rows = np.concatenate([np.concatenate([b["inputs"], b["targets"][:, -1:]], axis=1)
                           for b in _take(pipe.train_iter, num_batches)])
    # The windows are distinct random bytes, so each row identifies one window.
    ids = [int(np.flatnonzero((ref == r).all(axis=1))[0]) for r in rows]
    first, second = ids[: len(ref)], ids[len(ref): 2 * len(ref)]
    assert sorted(first) == sorted(second) == list(range(len(ref)))
    assert first != second  # each epoch is shuffled differently


def test_too_short_corpus(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"abc")  # 3 bytes + EOS = 4 tokens
    with pytest.raises(ValueError, match=r"4 tokens.*seq_len \+ 1 = 5"):
        data.create_pipeline(_config(tmp_path / "a.txt", seq_len=4), global_batch_size=1,
                             seed=0)
    (tmp_path / "b.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="0 tokens"):
        data.create_pipeline(_config(tmp_path / "b.txt"), global_batch_size=1, seed=0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(global_batch_size=0), "global_batch_size"),
    (dict(global_batch_size=-2), "global_batch_size"),
    (dict(seq_len=0), "seq_len"),
    (dict(global_batch_size=3, process_count=2), "divisible"),
    (dict(process_index=2, process_count=2), "process_index"),
    (dict(seed=-1), "seed"),
    (dict(max_tokens=-1), "max_tokens"),
    (dict(eval_fraction=1.5), "eval_fraction"),
    (dict(num_eval_batches=-1), "num_eval_batches"),
])
def test_bad_arguments(corpus, kwargs, match):
    root, _ = corpus
    cfg_keys = {"seq_len", "max_tokens", "eval_fraction", "num_eval_batches"}
    cfg = _config(root / "**" / "*.txt", **{k: v for k, v in kwargs.items() if k in cfg_keys})
    call = dict(global_batch_size=2, seed=0)
    call.update({k: v for k, v in kwargs.items() if k not in cfg_keys})
    with pytest.raises(ValueError, match=match):
        data.create_pipeline(cfg, **call)


def _eval_windows(pipe, batch_size):
    """The distinct eval windows of a pipeline, in order (rows repeat past the last one)."""
    rows = np.concatenate([np.concatenate([b["inputs"], b["targets"][:, -1:]], axis=1)
                           for b in pipe.eval_batches])
    return rows


def test_a_tiny_eval_split_gets_the_documents_closest_to_it(corpus):
    """eval_fraction=1e-9: the hash puts no document in eval, so documents move there in
    order of their crc32 score until eval holds one window (5 tokens)."""
    root, files = corpus
    assert all(zlib.crc32(str(f).encode()) >= 1e-9 * 2**32 for f in files)
    docs = data.load_documents(str(root / "**" / "*.txt"))
    by_score = sorted(docs, key=lambda d: zlib.crc32(d[0].encode()))
    moved, tokens = [], 0
    for name, d in by_score:  # the expected repair, computed here
        if tokens >= 5:
            break
        moved.append(name)
        tokens += len(d) + 1
    order = [name for name, _ in docs]
    eval_docs = [d for name, d in docs if name in moved]
    train_docs = [d for name, d in docs if name not in moved]
    cfg = _config(root / "**" / "*.txt", eval_fraction=1e-9, num_eval_batches=1)
    pipe = data.create_pipeline(cfg, global_batch_size=2, seed=0)
    assert pipe.eval_tokens == len(_pack(eval_docs)) and pipe.train_tokens == len(_pack(train_docs))
    ref = _windows(_pack(eval_docs), 4)
    np.testing.assert_array_equal(_eval_windows(pipe, 2), ref[np.arange(2) % len(ref)])
    assert len(moved) == 1 and len(pipe.notes) == 1
    assert "so eval now holds the document whose name hashes closest to eval" in pipe.notes[0]
    assert "document(s)" not in pipe.notes[0] and "0 documents in eval" in pipe.notes[0]
    assert order == sorted(order)


def test_a_single_document_holds_out_its_last_tokens_for_eval(tmp_path):
    text = bytes(range(1, 41))  # 41 tokens with EOS (no NUL byte: a text file)
    (tmp_path / "only.txt").write_bytes(text)
    cfg = _config(tmp_path, seq_len=4, eval_fraction=0.25, num_eval_batches=1)
    pipe = data.create_pipeline(cfg, global_batch_size=1, seed=0)
    tokens = _pack([text])
    held = max(5, int(np.ceil(0.25 * len(tokens))))  # 11
    assert (pipe.train_tokens, pipe.eval_tokens) == (len(tokens) - held, held)
    np.testing.assert_array_equal(_eval_windows(pipe, 1)[0], tokens[-held:][:5])
    first_train = np.concatenate([next(pipe.train_iter)["inputs"] for _ in range(6)])
    assert set(first_train.reshape(-1)) <= set(tokens[:len(tokens) - held])  # no eval token
    assert "last 11 of 41 tokens are held out for eval" in pipe.notes[0]


def test_a_corpus_too_short_for_both_splits_says_it_is_the_eval_split(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"123456")  # 7 tokens: one window of 5, not two
    with pytest.raises(ValueError, match=r"the eval split needs at least one sequence of seq_len \+ 1 = 5 "
                                         r"tokens, and train as many, but the corpus has 7 tokens"):
        data.create_pipeline(_config(tmp_path, eval_fraction=0.02, num_eval_batches=1),
                             global_batch_size=1, seed=0)
    # Without eval, the same corpus trains.
    assert data.create_pipeline(_config(tmp_path), global_batch_size=1, seed=0).train_tokens == 7


def test_thirty_short_files_train_and_evaluate_with_the_default_fraction(tmp_path):
    """What a new user tried: 30 short files, eval_fraction 0.02, seq_len 64."""
    for i in range(30):
        (tmp_path / f"note{i:02d}.txt").write_text(f"note {i}: " + "some words here " * 20)
    cfg = _config(tmp_path, seq_len=64, eval_fraction=0.02, num_eval_batches=2)
    pipe = data.create_pipeline(cfg, global_batch_size=4, seed=0)
    assert pipe.eval_tokens >= 65 and pipe.train_tokens >= 65 and len(pipe.eval_batches) == 2
    assert pipe.num_documents == 30


def test_a_directory_means_its_text_files_recursively(tmp_path):
    (tmp_path / "sub" / "deeper").mkdir(parents=True)
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "a.md").write_bytes(b"alpha")
    (tmp_path / "sub" / "b.py").write_bytes(b"beta \xff")  # invalid UTF-8 is still text
    (tmp_path / "sub" / "deeper" / "c").write_bytes(b"gamma")
    (tmp_path / "sub" / "image.bin").write_bytes(b"\x89PNG\0\0\x01")  # a NUL byte: binary
    (tmp_path / ".hidden" / "d.txt").write_bytes(b"delta")
    (tmp_path / ".dotfile").write_bytes(b"epsilon")
    docs = data.load_documents(str(tmp_path))
    assert docs == [(str(tmp_path / "a.md"), b"alpha"),
                    (str(tmp_path / "sub" / "b.py"), b"beta \xff"),
                    (str(tmp_path / "sub" / "deeper" / "c"), b"gamma")]
    (tmp_path / "sub" / "image.bin").unlink()
    for f in ("a.md", "sub/b.py", "sub/deeper/c"):
        (tmp_path / f).write_bytes(b"\0binary")
    with pytest.raises(ValueError, match=r"holds no text file \(3 binary file\(s\) skipped\)"):
        data.load_documents(str(tmp_path))


def test_eval_batches_unshuffled_and_repeated(corpus):
    root, files = corpus
    seq_len, batch_size = 4, 4
    pattern = str(root / "**" / "*.txt")
    _, eval_docs = data.split_documents(data.load_documents(pattern), 0.5)
    ref = _windows(_pack([d for _, d in eval_docs]), seq_len)
    assert len(ref) > 0
    num_eval = len(ref) // batch_size + 2  # more rows than windows: they repeat
    cfg = _config(pattern, seq_len=seq_len, eval_fraction=0.5, num_eval_batches=num_eval)
    pipe = data.create_pipeline(cfg, global_batch_size=batch_size, seed=0)
    assert pipe.eval_tokens == len(_pack([d for _, d in eval_docs]))
    assert len(pipe.eval_batches) == num_eval
    for k, b in enumerate(pipe.eval_batches):
        w = ref[(k * batch_size + np.arange(batch_size)) % len(ref)]
        np.testing.assert_array_equal(b["inputs"], w[:, :-1])
        np.testing.assert_array_equal(b["targets"], w[:, 1:])
        assert b["inputs"].dtype == np.int32


# --- determinism, resume, processes ------------------------------------------

def test_determinism(corpus):
    root, _ = corpus
    cfg = _config(root / "**" / "*.txt")

    def batches(seed):
        return _take(data.create_pipeline(cfg, global_batch_size=4, seed=seed).train_iter, 6)

    a, b, c = batches(7), batches(7), batches(8)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x["inputs"], y["inputs"])
        np.testing.assert_array_equal(x["targets"], y["targets"])
    assert any((x["inputs"] != z["inputs"]).any() for x, z in zip(a, c))


def test_resume_exact(corpus):
    root, files = corpus
    cfg = _config(root / "**" / "*.txt", seq_len=16)
    batches_per_epoch = len(_windows(_pack([f.read_bytes() for f in files]), 16)) / 4
    assert 5 < batches_per_epoch < 10  # so the resumed batches cross an epoch boundary
    pipe = data.create_pipeline(cfg, global_batch_size=4, seed=3)
    _take(pipe.train_iter, 5)
    saved = json.dumps(pipe.get_state())
    expected = _take(pipe.train_iter, 5)

    resumed = data.create_pipeline(cfg, global_batch_size=4, seed=3)
    resumed.set_state(json.loads(saved))
    for x, y in zip(expected, _take(resumed.train_iter, 5)):
        np.testing.assert_array_equal(x["inputs"], y["inputs"])
        np.testing.assert_array_equal(x["targets"], y["targets"])

    other_seed = data.create_pipeline(cfg, global_batch_size=4, seed=4)
    with pytest.raises(ValueError, match="seed"):
        other_seed.set_state(json.loads(saved))


@pytest.mark.parametrize("process_count", [2, 4])
def test_process_split_union_is_global_batch(corpus, process_count):
    root, _ = corpus
    cfg = _config(root / "**" / "*.txt", eval_fraction=0.5, num_eval_batches=2)
    whole = data.create_pipeline(cfg, global_batch_size=8, seed=5)
    parts = [data.create_pipeline(cfg, global_batch_size=8, seed=5, process_index=i,
                                  process_count=process_count) for i in range(process_count)]
    local = [_take(p.train_iter, 3) for p in parts]
    for step, full in enumerate(_take(whole.train_iter, 3)):
        for key in ("inputs", "targets"):
            assert local[0][step][key].shape == (8 // process_count, 4)
            np.testing.assert_array_equal(
                np.concatenate([local[i][step][key] for i in range(process_count)]), full[key])
    for k, full in enumerate(whole.eval_batches):
        np.testing.assert_array_equal(
            np.concatenate([p.eval_batches[k]["inputs"] for p in parts]), full["inputs"])
    # A state saved on 1 process resumes the same global batches on P processes.
    parts[0].set_state(whole.get_state())
    nxt = next(whole.train_iter)
    np.testing.assert_array_equal(next(parts[0].train_iter)["inputs"],
                                  nxt["inputs"][: 8 // process_count])


# --- default corpus ----------------------------------------------------------

def test_default_corpus_files():
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = data.default_corpus_files()
    rel = [f.relative_to(root).as_posix() for f in files]
    assert len(files) > 500
    assert rel == sorted(rel)
    assert all(f.is_file() and f.suffix == ".py" for f in files)
    assert not any(part in ("site-packages", "dist-packages") for r in rel for part in r.split("/"))
    assert {"os.py", "json/decoder.py"} <= set(rel)  # a module and a subpackage module


def test_default_corpus_pipeline():
    docs = data.load_documents(None)
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    assert docs[0] == (data.default_corpus_files()[0].relative_to(root).as_posix(),
                       data.default_corpus_files()[0].read_bytes())
    train, evals = data.split_documents(docs, 0.02)
    assert (train, evals) == data.split_documents(data.load_documents(""), 0.02)
    assert evals and not {n for n, _ in train} & {n for n, _ in evals}
    assert len(train) + len(evals) == len(docs)

    seq_len, cap = 16, 1000
    pipe = data.create_pipeline(_config(None, seq_len=seq_len, eval_fraction=0.02,
                                        num_eval_batches=1, max_tokens=cap),
                                global_batch_size=2, seed=0)
    assert pipe.num_documents == len(docs)
    assert pipe.train_tokens == cap
    ref = _windows(_pack([d for _, d in evals])[:cap], seq_len)
    np.testing.assert_array_equal(pipe.eval_batches[0]["inputs"], ref[:2, :-1])
    windows = _windows(_pack([d for _, d in train])[:cap], seq_len)
    row = next(pipe.train_iter)["inputs"][0]
    assert any((row == w[:-1]).all() for w in windows)


def test_a_link_loop_reads_each_file_once_with_a_warning(tmp_path):
    """``DIR/**`` where DIR/sub/up links back to DIR: glob reaches a.txt through
    up/, up/sub/up/, ... (41 times in the attack); it is read once, with a warning."""
    from jaxmp.train.data import load_documents
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("beta")
    os.symlink(tmp_path, tmp_path / "sub" / "up")
    warnings = []
    docs = load_documents(str(tmp_path / "**"), warnings=warnings)
    assert sorted(d for _, d in docs) == [b"alpha", b"beta"]
    assert len(warnings) == 1 and "lead to directories already walked" in warnings[0]
    assert f"the link {str(tmp_path / 'sub' / 'up')!r} points to its own ancestor" in warnings[0]


def test_a_single_binary_file_is_refused_and_a_binary_among_text_files_is_skipped(tmp_path):
    from jaxmp.train.data import load_documents
    elf = tmp_path / "ls.txt"
    elf.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 4)
    with pytest.raises(ValueError, match=rf"data.path {str(elf)!r} matches no text file \(1 binary file"):
        load_documents(str(elf))
    (tmp_path / "t.txt").write_text("text")
    warnings = []
    docs = load_documents(str(tmp_path / "*.txt"), warnings=warnings)
    assert [d for _, d in docs] == [b"text"]
    assert warnings == [f"data.path {str(tmp_path / '*.txt')!r}: skipped 1 binary file(s) (a NUL byte in "
                        f"the first 8 KiB), e.g. {str(elf)!r}"]
