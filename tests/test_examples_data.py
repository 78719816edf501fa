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
    return ml_collections.ConfigDict({**dict(path=str(path), seq_len=32, eval_fraction=0.0,
                                             num_eval_batches=0, max_tokens=0,
                                             tokenizer="bytes"), **data})


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


LLAMA3_GEN = (  # written for these tests in Llama 3's header format, with generation marks
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim + '<|eot_id|>' }}"
    "{% endgeneration %}{% else %}{{ m['content'] | trim + '<|eot_id|>' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
           "<|eot_id|>"]
WORDS = ["apple", "river", "stone", "cloud", "seven", "green", "quiet", "north"]


def _bpe(directory, special):
    """A byte-level BPE over WORDS with ``special`` tokens, saved as
    ``directory/tokenizer.json``; returned."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(WORDS * 10 + ["user assistant system"], trainers.BpeTrainer(
        vocab_size=300, special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(directory / "tokenizer.json"))
    return tok


def _base(tmp_path):
    """A released-model directory in miniature: a Llama (transformers' own, saved by it), a
    byte-level BPE tokenizer.json with Llama 3's special tokens, and a tokenizer_config.json
    naming bos and eos (the end of turn) and holding the chat template."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    src = tmp_path / "base"
    src.mkdir()
    tok = _bpe(src, SPECIAL)
    (src / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
         "eos_token": "<|eot_id|>", "chat_template": LLAMA3_GEN}))
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        "llama", vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        initializer_range=0.2)  # peaked logits: greedy choices far from ties
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(str(src))
    return src, transformers


def _conversations(n, seed=0):
    rng = np.random.default_rng(seed)
    return [[{"role": "user", "content": " ".join(rng.choice(WORDS, 4))},
             {"role": "assistant", "content": " ".join(rng.choice(WORDS, 6))}]
            for _ in range(n)]


def test_a_chat_fine_tune_from_a_released_model_resumes_exports_and_samples(tmp_path, capsys):
    """configs/finetune.py from model.init_from (a Llama and its tokenizer directory, chat
    template included) on a Parquet file of conversations, with data.format=auto: the step
    compiles again for the examples' keys, learns the assistant's tokens only, says so in
    the banner, and resumes to the same losses, bit for bit. The export renders as training
    did through transformers' apply_chat_template (BOS and the assistant mask included),
    and transformers' greedy generate on the export stops at the end of turn with the reply
    ``python -m jaxmp.sample --chat`` gives."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    torch = pytest.importorskip("torch")
    from jaxmp import export, sample
    from jaxmp.train import train_and_evaluate
    from jaxmp.train.chat import encode_conversation
    from jaxmp.train.config import load_config
    from jaxmp.train.metrics import read_metrics

    src, transformers = _base(tmp_path)
    convs = _conversations(40)
    rows = [{"messages": c} for c in convs] + [
        {"messages": [{"role": "user", "content": "no reply"}]}]  # skipped and counted
    data = tmp_path / "chats.parquet"
    pq.write_table(pa.Table.from_pylist(rows), str(data))

    def config(steps, *more):
        return load_config("configs/finetune.py", [*more,
            f"model.init_from={src}", f"data.path={data}", "precision.policy=fp32",
            "data.seq_len=64", "train.batch_size=8", "data.num_eval_batches=0",
            "data.eval_fraction=0", "model.remat=none", "model.scan_layers=False",
            f"train.steps={steps}", "train.checkpoint_every=2", "train.sample_tokens=0",
            "train.eval_every=0", "train.log_every=1", "optim.warmup_steps=0",
            "optim.decay_steps=4"])  # one schedule, whatever train.steps

    straight, resumed = tmp_path / "a", tmp_path / "b"
    summary = train_and_evaluate(config(4, "train.sample_tokens=6", "train.sample_temperature=0"),
                                 str(straight), num_devices=2)
    out = capsys.readouterr().out
    assert "examples    : chat, packing isolated, loss on assistant" in out, out
    assert "examples: 40 chat; 1 conversation(s) without an assistant turn skipped" in out, out
    train_and_evaluate(config(2), str(resumed), num_devices=2)
    train_and_evaluate(config(4), str(resumed), num_devices=2)
    a = [(r["step"], r["loss"], r["trained_tokens"]) for r in
         read_metrics(straight / "metrics.jsonl", "train")]
    b = [(r["step"], r["loss"], r["trained_tokens"]) for r in
         read_metrics(resumed / "metrics.jsonl", "train")]
    assert a == b and len(a) == 4
    assert all(0 < t < 8 * 64 for _, _, t in a)  # the assistant's tokens, not all
    rates = [r["trained_tokens_per_s"] for r in read_metrics(straight / "metrics.jsonl",
                                                              "train")]
    assert rates[0] is None and all(r > 0 for r in rates[1:])  # step 1 compiles: untimed

    # The export renders as training did: transformers' own tokenizer, template and mask.
    exported = tmp_path / "out"
    assert export.main(["--workdir", str(straight), "--out", str(exported),
                        "--format", "hf"]) == 0
    hf = transformers.AutoTokenizer.from_pretrained(str(exported))
    # the trainer's own sample answers the first conversation's user turn, as a chat
    first = hf.apply_chat_template(convs[0][:1], add_generation_prompt=True, tokenize=True,
                                   return_dict=True)["input_ids"]
    assert summary["sample"].startswith(hf.decode(first, skip_special_tokens=True))
    for conv in convs[:3]:
        ids, mask = encode_conversation(conv, str(src))
        theirs = hf.apply_chat_template(conv, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
        assert list(theirs["input_ids"]) == ids.tolist() and ids[0] == hf.bos_token_id
        assert list(theirs["assistant_masks"]) == mask.astype(int).tolist()

    # transformers' greedy generate on the export stops at the end of turn
    # (generation_config.json), with the reply jaxmp.sample --chat prints.
    model = transformers.AutoModelForCausalLM.from_pretrained(str(exported)).float().eval()
    eot = hf.convert_tokens_to_ids("<|eot_id|>")
    assert model.generation_config.eos_token_id in (eot, [eot])
    assert (model.config.bos_token_id, model.config.eos_token_id) == (hf.bos_token_id, eot)
    message = "apple river stone cloud"
    prompt = hf.apply_chat_template([{"role": "user", "content": message}],
                                    add_generation_prompt=True, tokenize=True,
                                    return_dict=True)["input_ids"]
    with torch.no_grad():
        full = model.generate(torch.tensor([list(prompt)]), max_new_tokens=12, do_sample=False,
                              pad_token_id=eot)[0].tolist()
    reply = full[len(prompt):]
    reply = reply[:reply.index(eot)] if eot in reply else reply
    assert reply  # a reply to compare, not an immediate end of turn
    capsys.readouterr()
    assert sample.main(["--workdir", str(straight), "--chat", "--prompt", message,
                        "--tokens", "12", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == hf.decode(reply, skip_special_tokens=True) + "\n"

    # a resume with another template (or other special tokens) is refused: their digest
    # is in the data state
    from jaxmp.train.data import create_pipeline as pipeline
    state = pipeline(config(4).data, global_batch_size=8, seed=0).get_state()
    settings = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**settings, "bos_token": "<|end_of_text|>"}))
    with pytest.raises(ValueError, match=r"^the chat template is not the one the checkpoint "
                                         r"was trained with"):
        pipeline(config(4).data, global_batch_size=8, seed=0).check_state(state)


def _chat_tokenizer(tmp_path, template):
    """A byte-level BPE with ChatML's tokens and ``template`` in its directory."""
    d = tmp_path / "tok"
    d.mkdir()
    _bpe(d, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return str(d / "tokenizer.json")


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_what_a_chat_corpus_cannot_train_is_one_line_naming_its_cause(tmp_path):
    """Truncation that cuts every assistant turn is refused before training (it trained on
    nothing and was taken for divergence); an eval split too small for a row says how to
    fix it; a template that does not compile is named by its file, not by a record."""
    convs = _conversations(12)
    tok = _chat_tokenizer(tmp_path, CHATML)
    data = _jsonl(tmp_path, [{"messages": c} for c in convs])
    base = dict(format="chat", tokenizer=tok)
    with pytest.raises(ValueError, match=r"^the train rows hold no token to learn \(data\.loss_on="
                                         r".*data\.truncate=truncate, data\.seq_len=6\)"):
        create_pipeline(_config(data, seq_len=6, truncate="truncate", **base),
                        global_batch_size=2, seed=0)
    with pytest.raises(ValueError, match=r"^no row of data\.seq_len=32 tokens: the eval split's "
                                         r"examples hold .* set data\.num_eval_batches=0"):
        create_pipeline(_config(data, packing="concat", eval_fraction=1e-9, num_eval_batches=1,
                                **base), global_batch_size=2, seed=0)
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match=rf"^{bad}: chat template does not compile"):
        create_pipeline(_config(data, chat_template=str(bad), **base), global_batch_size=2,
                        seed=0)


def test_a_mixed_file_says_what_each_format_learns(tmp_path, capsys):
    """Chat and prompt/completion records in one file: each learns its own tokens, and
    the banner's words say so per format; loss_on=completion on text names the one
    allowed value once."""
    tok = _chat_tokenizer(tmp_path, CHATML)
    records = [{"messages": c} for c in _conversations(8)] + RECORDS[:8]
    pipe = create_pipeline(_config(_jsonl(tmp_path, records), tokenizer=tok),
                           global_batch_size=2, seed=0)
    assert pipe.examples.startswith("chat and prompt_completion, packing isolated (chat: loss "
                                    "on assistant and prompt_completion: loss on completion)")
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "some words " * 20}) + "\n")
    with pytest.raises(ValueError, match=r"data\.loss_on='completion' does not apply to text "
                                         r"records .*; allowed: all$"):
        create_pipeline(_config(text, loss_on="completion"), global_batch_size=2, seed=0)


def test_json_records_in_a_json_file_are_refused_under_auto(tmp_path):
    """A .json file of JSON lines or a JSON array of records (what datasets' to_json
    writes) was trained as raw text under data.format=auto; text in a .json file that is
    no record still reads as text, and format=text keeps reading it."""
    lines = tmp_path / "lines.json"
    lines.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    array = tmp_path / "array.json"
    array.write_text(json.dumps(RECORDS))
    for f in (lines, array):
        with pytest.raises(ValueError, match=rf"^{f}: a \.json file of JSON records, which "
                                             rf"data\.format=auto would train on as text"):
            create_pipeline(_config(f), global_batch_size=2, seed=0)
        create_pipeline(_config(f, format="text"), global_batch_size=2, seed=0)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"name": "a package", "version": "1.0"}) * 40)
    create_pipeline(_config(other), global_batch_size=2, seed=0)


def test_a_template_that_reads_the_time_cannot_resume_into_other_examples(tmp_path):
    """Same template text, other renderings (strftime_now): the examples' digest refuses
    the resume in one line, where the batches would have differed silently."""
    clock = ("{{ strftime_now('%f') }}{% for m in messages %}{{ '<|im_start|>' + m['role'] + "
             "'\\n' }}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + "
             "'<|im_end|>' }}{% endgeneration %}{% else %}{{ m['content'] + '<|im_end|>' }}"
             "{% endif %}{% endfor %}")
    tok = _chat_tokenizer(tmp_path, clock)
    data = _jsonl(tmp_path, [{"messages": c} for c in _conversations(8)])
    config = _config(data, tokenizer=tok)
    state = create_pipeline(config, global_batch_size=2, seed=0).get_state()
    with pytest.raises(ValueError, match=r"^the examples are not the ones the checkpoint was "
                                         r"trained on .*strftime_now"):
        create_pipeline(config, global_batch_size=2, seed=0).check_state(state)
    (tmp_path / "b").mkdir()
    steady = _config(data, tokenizer=_chat_tokenizer(tmp_path / "b", CHATML))
    state = create_pipeline(steady, global_batch_size=2, seed=0).get_state()
    create_pipeline(steady, global_batch_size=2, seed=0).check_state(state)  # same: resumes


def test_a_signal_stops_a_chat_template_that_never_ends(tmp_path):
    """A template is code from the internet: one that loops for ever (10**10 iterations)
    is stopped by SIGTERM while the data is read (the trainer's start-up), at once: it
    was ignored until the read ended. A second signal 300 s on turns a regression into a
    KeyboardInterrupt here rather than a hang."""
    import os
    import signal
    import threading
    import time

    from jaxmp.train import train_and_evaluate
    from jaxmp.train.signals import Interrupted, compile_in_progress

    endless = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
               "{% endfor %}" + CHATML)
    tok = _chat_tokenizer(tmp_path, endless)
    config = small_config({"vocab_size": 320}, steps=2, sample_tokens=0)
    config.data.update(dict(path=str(_jsonl(tmp_path, [{"messages": c}
                                                       for c in _conversations(4)])),
                            tokenizer=tok, seq_len=32, eval_fraction=0.0, num_eval_batches=0,
                            max_tokens=0))
    original = signal.getsignal(signal.SIGTERM)
    done = threading.Event()

    def send():  # once the trainer's handler is in place, and again much later
        while signal.getsignal(signal.SIGTERM) is original and not done.wait(0.05):
            pass
        if not done.wait(0.5):
            os.kill(os.getpid(), signal.SIGTERM)
        if not done.wait(300):
            os.kill(os.getpid(), signal.SIGINT)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        with pytest.raises(Interrupted) as info:
            train_and_evaluate(config, str(tmp_path / "run"), num_devices=1)
    finally:
        done.set()
        sender.join()
        while compile_in_progress():  # the step's background compile, left to finish
            time.sleep(0.1)          # (a process leaving under it aborts)
    assert info.value.startup and "SIGTERM during start-up" in str(info.value)
    assert signal.getsignal(signal.SIGTERM) is original  # the handler is put back


def test_a_chat_template_given_for_data_without_chat_is_refused(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text(CHATML)
    with pytest.raises(ValueError, match=r"data\.chat_template=.*t\.jinja', but data\.path holds "
                                         r"no chat record"):
        create_pipeline(_config(_jsonl(tmp_path, RECORDS), chat_template=str(template)),
                        global_batch_size=2, seed=0)
