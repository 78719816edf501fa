"""data.tokenizer (bytes, tokenizer.json, SentencePiece .model, bpe:VOCAB), pre-tokenized
shards, and the data messages a new user meets (issue 21, points 4, 5 and 11)."""
import io
import json
import pathlib
import sysconfig

import ml_collections
import numpy as np
import pytest

from jaxmp.train import data
from jaxmp.train.config import load_config
from jaxmp.train.experiment import Experiment
from jaxmp.train.tokenizer import ByteTokenizer, load_tokenizer

STDLIB = pathlib.Path(sysconfig.get_paths()["stdlib"])
CORPUS = str(STDLIB / "json" / "*.py")  # a slice of the embedded corpus: BPE trains in a second
TEXT = "def parse(s):\n    return json.loads(s)  # héllo, wörld\n"


def _config(path, seq_len=16, eval_fraction=0.2, num_eval_batches=2, **extra):
    base = dict(path=str(path), text_field="text", seq_len=seq_len, eval_fraction=eval_fraction,
                num_eval_batches=num_eval_batches, max_tokens=0, tokenizer="bytes",
                token_dtype="uint16", eod_id=-1)
    return ml_collections.ConfigDict({**base, **extra})


def test_bpe_trains_on_train_split_round_trips_and_is_reused(tmp_path):
    cfg = _config(CORPUS, tokenizer="bpe:512")
    pipe = data.create_pipeline(cfg, global_batch_size=4, seed=0, workdir=tmp_path)
    tok = pipe.tokenizer
    assert tok.vocab_size == 512 and (tmp_path / "tokenizer.json").is_file()
    assert tok.decode(tok.encode(TEXT, add_eos=False)) == TEXT
    ids = tok.encode(TEXT, add_eos=False)
    assert len(ids) < len(TEXT.encode()) / 1.5  # BPE merges: fewer tokens than bytes
    assert tok.token_bytes[ids].sum() == len(TEXT.encode("utf-8"))  # exact byte counts
    assert tok.encode(TEXT)[-1] == tok.eos_id and tok.token_bytes[tok.eos_id] == 0
    # Only the train split was trained on: a document's tokens decode back to its text.
    train_docs, eval_docs = data.split_documents(data.load_documents(CORPUS), 0.2)
    assert eval_docs
    doc = eval_docs[0][1].decode()
    assert tok.decode(tok.encode(doc)) == doc
    # Resume: the saved file is read back, not retrained (the same ids, file untouched).
    mtime = (tmp_path / "tokenizer.json").stat().st_mtime_ns
    again = data.create_pipeline(cfg, global_batch_size=4, seed=0, workdir=tmp_path)
    assert (tmp_path / "tokenizer.json").stat().st_mtime_ns == mtime
    np.testing.assert_array_equal(again.tokenizer.encode(doc), tok.encode(doc))
    np.testing.assert_array_equal(next(again.train_iter)["inputs"], next(pipe.train_iter)["inputs"])
    # The eval byte counts, computed here token by token from the decoded text (the
    # corpus is ASCII, so each token decodes to its own bytes).
    ref = sum(sum(len(tok.decode([t]).encode()) for t in row if t != tok.eos_id)
              for b in range(2) for row in pipe.eval_batches[b]["targets"])
    assert sum(pipe.eval_bytes) == ref
    # A tokenizer.json given by path is the same tokenizer.
    by_path = load_tokenizer(str(tmp_path / "tokenizer.json"))
    np.testing.assert_array_equal(by_path.encode(doc), tok.encode(doc))


def test_sentencepiece_model(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    docs = [d.decode() for _, d in data.load_documents(CORPUS)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(docs), model_writer=model, vocab_size=400,
                                   model_type="bpe", character_coverage=0.99, eos_id=2,
                                   minloglevel=2, hard_vocab_limit=False)
    path = tmp_path / "sp.model"
    path.write_bytes(model.getvalue())
    pipe = data.create_pipeline(_config(CORPUS, tokenizer=str(path)), global_batch_size=4, seed=0)
    tok = pipe.tokenizer
    assert tok.vocab_size == 400 and tok.eos_id == 2
    assert tok.decode(tok.encode("def loads(s):", add_eos=False)) == "def loads(s):"
    assert pipe.eval_bytes is None  # SentencePiece pieces do not map 1:1 onto bytes
    batch = next(pipe.train_iter)["inputs"]
    assert batch.shape == (4, 16) and batch.max() < 400


def test_vocab_size_is_checked_against_the_tokenizer(tmp_path):
    cfg = load_config("configs/tiny_moe.py", [f"data.path={CORPUS}", "data.tokenizer=bpe:1000"])
    with pytest.raises(ValueError, match=r"model.vocab_size=257 is smaller than the vocabulary "
                                         r"of data.tokenizer='bpe:1000'.*set model.vocab_size=1024"):
        Experiment.create(cfg, num_devices=1).data
    with pytest.raises(ValueError, match="data.tokenizer='wordpiece' is not allowed"):
        load_tokenizer("wordpiece")
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nope.model"))


def _shard(tmp_path, name, tokens, dtype):
    path = tmp_path / name
    if name.endswith(".npy"):
        np.save(path, tokens.astype(dtype))
    else:
        tokens.astype(dtype).tofile(path)
    return path


@pytest.mark.parametrize("name, dtype", [("a.bin", "uint16"), ("a.bin", "uint32"), ("a.npy", "uint32")])
def test_pretokenized_shards_memory_mapped_split_and_resume(tmp_path, name, dtype):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, 4000)
    tokens[::97] = 256  # end-of-document tokens
    path = _shard(tmp_path, name, tokens, dtype)
    cfg = _config(path, seq_len=15, eval_fraction=0.1, token_dtype=dtype)
    pipe = data.create_pipeline(cfg, global_batch_size=4, seed=3)
    held = 400  # ceil(0.1 * 4000) >= 16: eval is the last 400 tokens
    assert (pipe.train_tokens, pipe.eval_tokens) == (3600, 400)
    assert pipe.num_documents == int((tokens == 256).sum())
    np.testing.assert_array_equal(pipe.eval_batches[0]["inputs"][1], tokens[3600 + 16: 3600 + 31])
    # Every train window is a slice of the first 3600 tokens at a multiple of 16.
    batch = next(pipe.train_iter)
    windows = tokens[:3600 - 3600 % 16].reshape(-1, 16)
    for row_in, row_t in zip(batch["inputs"], batch["targets"]):
        match = np.flatnonzero((windows[:, :-1] == row_in).all(1))
        assert match.size == 1 and (windows[match[0], 1:] == row_t).all()
    # Exact resume from the saved position.
    state = json.dumps(pipe.get_state())
    expected = [next(pipe.train_iter)["inputs"] for _ in range(3)]
    resumed = data.create_pipeline(cfg, global_batch_size=4, seed=3)
    resumed.set_state(json.loads(state))
    for e in expected:
        np.testing.assert_array_equal(next(resumed.train_iter)["inputs"], e)
    assert held == 400


def test_pretokenized_shard_errors(tmp_path):
    tokens = np.arange(1000) % 300  # ids up to 299: not bytes
    path = _shard(tmp_path, "big.bin", tokens, "uint16")
    with pytest.raises(ValueError, match=r"holds token id 299, outside the vocabulary of "
                                         r"data.tokenizer='bytes' \(\[0, 257\)\)"):
        data.create_pipeline(_config(path), global_batch_size=4, seed=0)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\0" * 1001)
    with pytest.raises(ValueError, match="1001 bytes, not a whole number of uint16 tokens"):
        data.create_pipeline(_config(odd), global_batch_size=4, seed=0)
    bad = tmp_path / "wide.npy"
    np.save(bad, np.arange(100, dtype=np.int64))
    with pytest.raises(ValueError, match="holds a int64 array"):
        data.create_pipeline(_config(bad), global_batch_size=4, seed=0)
    with pytest.raises(ValueError, match="data.eod_id=500 is outside"):
        data.create_pipeline(_config(CORPUS, tokenizer="bpe:400", eod_id=500), global_batch_size=4,
                             seed=0)


def test_own_data_messages(tmp_path):
    with pytest.raises(ValueError, match=r"data.path '/tmp/x-does-not-exist' does not exist"):
        data.load_documents("/tmp/x-does-not-exist")
    with pytest.raises(ValueError, match="no file matches data.path glob"):
        data.load_documents(str(tmp_path / "*.txt"))
    (tmp_path / "one.txt").write_text("x" * 200)
    pipe = data.create_pipeline(_config(tmp_path / "one.txt", eval_fraction=0.1),
                                global_batch_size=2, seed=0)
    assert pipe.notes == ("the corpus (1 document) is too small to split by document, so its "
                          "last 21 of 201 tokens are held out for eval and train gets the rest",)
    assert ByteTokenizer().decode(pipe.sample_prompt) == "x" * 16  # the start of the eval text
