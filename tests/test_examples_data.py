"""Examples with loss masks as the trainer reads them (issue 41, points 1, 3 and 4):
prompt/completion and chat records from JSON lines, packed whole into rows with segment
ids (or one a row), each row checked against the records themselves; and a chat run of
the trainer that finds its format by itself (data.format=auto)."""
import json

import numpy as np
import pytest

from _configs import small_config
from jaxmp.train.data import create_pipeline
from jaxmp.train.packing import PackedRows, Example

RECORDS = [{"prompt": f"Q{i}: what is {i} + {i}?", "completion": f" {2 * i}."}
           for i in range(12)]


def _config(path, **data):
    import ml_collections
    return ml_collections.ConfigDict(dict(path=str(path), seq_len=32, eval_fraction=0.0,
                                          num_eval_batches=0, max_tokens=0, tokenizer="bytes",
                                          **data))


def _jsonl(tmp_path, records):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _segments(batch):
    """``[(row, tokens, learned targets)]`` of each example in the rows, from the batch
    alone: a segment's inputs then its last target are its tokens."""
    out = []
    for r in range(len(batch["inputs"])):
        seg = batch["segment_ids"][r]
        for s in sorted(set(seg.tolist()) - {0}):
            at = np.flatnonzero(seg == s)
            assert (batch["positions"][r][at] == np.arange(len(at))).all()
            tokens = np.append(batch["inputs"][r][at], batch["targets"][r][at[-1]])
            out.append((r, tokens, batch["loss_mask"][r][at]))
        assert not batch["loss_mask"][r][seg == 0].any()  # padding learns nothing
    return out


@pytest.mark.parametrize("packing", ["isolated", "padded"])
def test_prompt_completion_rows_hold_whole_examples_learning_the_completion(tmp_path, packing):
    pipe = create_pipeline(_config(_jsonl(tmp_path, RECORDS), packing=packing),
                           global_batch_size=4, seed=0)
    assert pipe.batch_keys == ("inputs", "targets", "loss_mask", "segment_ids", "positions")
    seen = {}
    for _ in range(6):
        for _, tokens, learned in _segments(next(pipe.train_iter)):
            seen[bytes(tokens[:-1].astype(np.uint8))] = (tokens, learned)
    assert len(seen) == len(RECORDS)  # every example, whole, in some row
    for rec in RECORDS:
        prompt, done = rec["prompt"].encode(), rec["completion"].encode()
        tokens, learned = seen[prompt + done]
        assert tokens[-1] == 256  # the end-of-document token after the completion
        # target j + 1 is learned exactly where it is a completion token or the EOS
        want = np.arange(1, len(tokens)) >= len(prompt)
        assert (learned == want).all()
    if packing == "padded":
        assert all(len(set(b.tolist()) - {0}) == 1 for b in next(pipe.train_iter)["segment_ids"])


def test_loss_on_all_and_a_wrong_one(tmp_path):
    pipe = create_pipeline(_config(_jsonl(tmp_path, RECORDS), loss_on="all"),
                           global_batch_size=4, seed=0)
    for _, tokens, learned in _segments(next(pipe.train_iter)):
        assert learned.all()
    with pytest.raises(ValueError, match=r"data.loss_on='assistant' does not apply to "
                                         r"prompt_completion records"):
        create_pipeline(_config(_jsonl(tmp_path, RECORDS), loss_on="assistant"),
                        global_batch_size=4, seed=0)


@pytest.mark.parametrize("truncate", ["split", "truncate"])
def test_an_example_longer_than_a_row_is_split_or_truncated_and_counted(truncate):
    ids = np.arange(1, 80, dtype=np.int32)
    short = Example("b", np.arange(5, dtype=np.int32), np.ones(5, bool))
    rows = PackedRows([Example("a", ids, np.ones(len(ids), bool)), short], 32, "isolated",
                      truncate)
    got = rows.batch(np.arange(len(rows)))
    if truncate == "split":
        assert rows.split == 1 and rows.truncated == 0
        assert np.concatenate([got["inputs"][r][got["segment_ids"][r] > 0]
                               for r in range(3)])[:78].tolist() == ids[:-1].tolist()
    else:
        assert rows.truncated == 1 and rows.split == 0
        assert got["inputs"][0].tolist() == ids[:32].tolist()
    assert rows.trained_tokens == (78 if truncate == "split" else 32) + 4


@pytest.mark.parametrize("record, match", [
    ({"question": "x"}, r"data.jsonl:1: a record of no known format \(fields \['question'\]\)"),
    ({"prompt": "", "completion": "x"}, r"data.jsonl:1: field 'prompt' must be non-empty text"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, r"data.jsonl:1: message 0 has role "),
])
def test_bad_records_are_one_line_naming_file_and_line(tmp_path, record, match):
    with pytest.raises(ValueError, match=match):
        create_pipeline(_config(_jsonl(tmp_path, [record] + RECORDS), format="auto",
                                packing="isolated"), global_batch_size=4, seed=0)


CHATML_GEN = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\\n' }}{% else %}{{ m['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_a_chat_run_finds_its_format_trains_on_the_assistant_and_resumes(tmp_path, capsys):
    """The trainer with data.format=auto on conversations: it compiles its step again for
    the examples' batch keys, trains on assistant tokens only (trained_tokens below the
    rows' tokens), says so in the banner, and resumes to the same losses."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from jaxmp.train import train_and_evaluate
    from jaxmp.train.metrics import read_metrics

    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    rng = np.random.default_rng(0)
    words = ["apple", "river", "stone", "cloud", "seven", "green", "quiet", "north"]
    convs = [[{"role": "user", "content": " ".join(rng.choice(words, 4))},
              {"role": "assistant", "content": " ".join(rng.choice(words, 6))}]
             for _ in range(40)]
    convs.append([{"role": "user", "content": "no reply"}])  # skipped and counted
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(words * 10 + ["user assistant"], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "chat_template": CHATML_GEN}))
    data = _jsonl(tmp_path, [{"messages": c} for c in convs])

    def config(steps):
        c = small_config({"vocab_size": 320}, steps=steps, checkpoint_every=2, sample_tokens=0)
        c.data.update(dict(path=str(data), tokenizer=str(tok_dir / "tokenizer.json"),
                           seq_len=32, eval_fraction=0.0, num_eval_batches=0, max_tokens=0))
        c.train.batch_size = 8
        return c

    straight, resumed = tmp_path / "a", tmp_path / "b"
    train_and_evaluate(config(4), str(straight), num_devices=2)
    out = capsys.readouterr().out
    assert "examples    : chat, packing isolated, loss on assistant" in out, out
    assert "1 conversation(s) without an assistant turn skipped" in out, out
    train_and_evaluate(config(2), str(resumed), num_devices=2)
    train_and_evaluate(config(4), str(resumed), num_devices=2)
    a = [(r["step"], r["loss"], r["trained_tokens"]) for r in
         read_metrics(straight / "metrics.jsonl", "train")]
    b = [(r["step"], r["loss"], r["trained_tokens"]) for r in
         read_metrics(resumed / "metrics.jsonl", "train")]
    assert a == b and len(a) == 4
    assert all(0 < t < 8 * 32 for _, _, t in a)  # the assistant's tokens, not all
    rates = [r["trained_tokens_per_s"] for r in read_metrics(straight / "metrics.jsonl",
                                                              "train")]
    assert rates[0] is None and all(r > 0 for r in rates[1:])  # step 1 compiles: untimed
    # The export writes the template it trained with back: transformers renders as it did.
    transformers = pytest.importorskip("transformers")
    from jaxmp.train.artifacts import export_hf
    from jaxmp.train.chat import encode_conversation

    export_hf(straight, tmp_path / "out")
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    ids, _ = encode_conversation(convs[0], str(tok_dir))
    assert list(theirs.apply_chat_template(convs[0], tokenize=True, return_dict=True)[
        "input_ids"]) == ids.tolist()
    # a resume with another template is refused: its digest is in the data state
    state = create_pipeline(config(4).data, global_batch_size=8, seed=0).get_state()
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "chat_template": CHATML_GEN.replace("\\n", " ")}))
    with pytest.raises(ValueError, match=r"^the chat template is not the one the checkpoint "
                                         r"was trained with"):
        create_pipeline(config(4).data, global_batch_size=8, seed=0).check_state(state)
