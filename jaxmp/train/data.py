"""Language-model data pipeline built on grain: text tokenized by bytes, a trained BPE
or a SentencePiece model (:mod:`jaxmp.train.tokenizer`), or pre-tokenized ``.bin`` /
``.npy`` token shards (:func:`create_pipeline`).

Documents (the Python standard library's own ``.py`` files by default, or the
user's text / ``.jsonl`` files) are split into train and eval by document, each
split is packed into one token stream with an end-of-document token after every
document, and the stream is cut into non-overlapping windows of ``seq_len + 1``
tokens. Training batches come from a ``grain.MapDataset`` (global shuffle,
reshuffled every epoch) whose iterator state is a small JSON-serialisable dict,
so a resumed run sees exactly the batches it would have seen.

The pipeline's parts are modules of their own, whose public names are importable from
here too: :mod:`jaxmp.train.corpus` (finding and reading the documents, the train/eval
split), :mod:`jaxmp.train.streams` (token streams as windows) and
:mod:`jaxmp.train.shards` (pre-tokenized token shards).

Example::

    cfg = ml_collections.ConfigDict(dict(path=None, text_field="text", seq_len=256,
                                         eval_fraction=0.02, num_eval_batches=8,
                                         max_tokens=None))
    pipe = create_pipeline(cfg, global_batch_size=32, seed=0)
    batch = next(pipe.train_iter)  # {"inputs", "targets"}: int32 [32, 256]
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import pathlib
import sys
from typing import Any, Optional, Sequence

import grain
import numpy as np

from jaxmp._checks import check, check_int, check_real
from jaxmp.train.corpus import (TOKEN_SUFFIXES, check_data_path, data_files,  # noqa: F401
                                default_corpus_files, eval_score, load_documents,
                                split_documents, text_documents, token_files,
                                RECORD_SUFFIXES)
from jaxmp.train.keys import DEFAULTS, SEED, TOKEN_DTYPES  # noqa: F401  (re-exported)
from jaxmp.train import packing as packing_module
from jaxmp.train.shards import shard_streams
from jaxmp.train.streams import ShardStream, TokenStream  # noqa: F401
from jaxmp.train import tokenizer as tokenizer_module
from jaxmp.train.tokenizer import ByteTokenizer, load_tokenizer, text_pieces  # noqa: F401

# Bumped when the meaning of a saved iterator state changes.
_STATE_VERSION = 1


class _EvalBatches(Sequence):
    """The fixed eval batches, gathered when read (so a huge batch size costs no memory
    until it is used): batch ``k`` holds windows ``k * B .. (k + 1) * B - 1`` modulo the
    number of eval windows, this process's rows ``[lo, hi)``."""

    def __init__(self, stream, count: int, batch: int, lo: int, hi: int):
        self._stream, self._count, self._batch, self._lo, self._hi = stream, count, batch, lo, hi

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        if not -self._count <= k < self._count:
            raise IndexError(f"eval batch {k} out of range for {self._count}")
        k %= self._count
        ids = (np.arange(k * self._batch + self._lo,
                         k * self._batch + self._hi)) % len(self._stream)
        return self._stream.batch(ids)


@dataclasses.dataclass
class DataPipeline:
    """Training iterator, eval batches and corpus statistics for one process.

    Attributes:
      train_iter: infinite iterator of ``{"inputs", "targets"}`` int32
        ``[local_batch, seq_len]`` batches, ``local_batch = global_batch /
        process_count``.
      eval_batches: ``num_eval_batches`` batches of the same form, fixed order (a
        sequence: each batch is gathered when read).
      tokenizer: the tokenizer (:mod:`jaxmp.train.tokenizer`; ``data.tokenizer``).
      train_tokens: tokens in the (capped) packed train stream.
      eval_tokens: tokens in the (capped) packed eval stream.
      num_documents: non-empty documents in the corpus (both splits); for pre-tokenized
        shards, the end-of-document tokens in them.
      notes: what :func:`create_pipeline` changed in the split to give eval enough text,
        as sentences for the user (empty when the hash split sufficed).
      warnings: what :func:`load_documents` skipped (files reached twice through
        symbolic links, links that loop, binary files), as sentences.
      eval_bytes: per eval batch, the UTF-8 bytes its (global) targets stand for
        (``tokenizer.token_bytes``), for bits per byte; None when the tokenizer does not
        know them.
      sample_prompt: the start of the first eval document (of the train stream when
        there is no eval), up to 16 tokens and before its first line break: the default
        prompt of the trainer's sample.
      batch_keys: the keys of a batch: ``("inputs", "targets")``, or with loss masks and
        packed examples (:data:`jaxmp.train.packing.PACKED_KEYS`).
      examples: for packed examples, what they are in words (format, packing, loss_on,
        the trained fraction of the train rows, the chat template's source), for the
        banner; '' for a token stream.
      chat_template: the chat template the conversations were rendered with ('' without
        chat records); its SHA-256, with the special tokens', is part of the data state,
        so a resume refuses another.
      chat_tokens: the special tokens the template was rendered with (``bos_token``,
        ``eos_token``, ...: :func:`jaxmp.train.chat.special_tokens`), empty without chat.
      sample_stop_ids: where the trainer's sample stops: a chat run's end-of-turn tokens
        (:func:`jaxmp.train.chat.end_of_turn_ids`); its ``sample_prompt`` is then the
        first eval conversation (else train) up to its first assistant turn, rendered
        with the generation prompt. Empty otherwise.
    """

    train_iter: grain.DatasetIterator
    eval_batches: Sequence[dict]
    tokenizer: Any
    train_tokens: int
    eval_tokens: int
    num_documents: int
    notes: tuple = ()
    warnings: tuple = ()
    eval_bytes: Optional[tuple] = None
    sample_prompt: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))
    batch_keys: tuple = packing_module.BATCH_KEYS
    examples: str = ""
    chat_template: str = ""
    chat_tokens: dict = dataclasses.field(default_factory=dict)
    sample_stop_ids: tuple = ()
    # Identifies the training order; a saved state only resumes a matching one.
    _fingerprint: dict = dataclasses.field(default_factory=dict, repr=False)

    def get_state(self) -> dict:
        """Returns the train iterator's position as a JSON-serialisable dict.

        The position counts global batches, so a run may resume with a different
        ``process_count`` and still see the same global batches.
        """
        return {"version": _STATE_VERSION, "fingerprint": dict(self._fingerprint),
                "iterator": self.train_iter.get_state()}

    def check_state(self, state: Any) -> None:
        """Checks that :meth:`set_state` can take ``state``, without moving the iterator.

        Raises:
          ValueError: ``state`` is not a state of this version, was saved by a pipeline
            with a different corpus size, seq_len, global batch size or seed (its
            batches would differ), other examples (their tokens and masks' SHA-256) or
            another chat template, or its position (``next_index``, global batches
            taken) is not an integer >= 0.
        """
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION \
                or not isinstance(state.get("iterator"), dict):
            raise ValueError(f"not a DataPipeline state (version {_STATE_VERSION}): {state!r}")
        saved = state.get("fingerprint")
        if isinstance(saved, dict) and "tokenizer" in saved and \
                saved["tokenizer"] != self._fingerprint.get("tokenizer"):
            raise ValueError(f"the tokenizer ({self.tokenizer.name}) is not the one the "
                             f"checkpoint was trained with (another SHA-256); restore that "
                             f"tokenizer or start a new --workdir")
        if isinstance(saved, dict) and "examples" in self._fingerprint and \
                saved.get("examples") != self._fingerprint["examples"] and \
                saved.get("chat_template") == self._fingerprint.get("chat_template"):
            raise ValueError("the examples are not the ones the checkpoint was trained on "
                             "(another SHA-256 of their tokens and masks, with the same "
                             "template: other data, or a chat template that reads the time, "
                             "strftime_now); restore them or start a new --workdir")
        if isinstance(saved, dict) and saved.get("chat_template") != \
                self._fingerprint.get("chat_template"):
            raise ValueError("the chat template is not the one the checkpoint was trained with "
                             "(another SHA-256 of the template and its special tokens); "
                             "restore that template or start a new --workdir")
        mine = dict(self._fingerprint)
        if isinstance(saved, dict) and "tokenizer" not in saved:
            mine.pop("tokenizer", None)  # saved before runs recorded their tokenizer
        if saved != mine:
            raise ValueError(
                f"data state was saved for {state.get('fingerprint')}, but this "
                f"pipeline is {self._fingerprint}")
        check_int("the iterator position next_index", state["iterator"].get("next_index"), 0)

    def set_state(self, state: dict) -> None:
        """Moves the train iterator to a position saved by :meth:`get_state`.

        Raises:
          ValueError: as :meth:`check_state`.
        """
        self.check_state(state)
        self.train_iter.set_state(state["iterator"])


def _split_streams(docs, eval_fraction: float, seq_len: int, max_tokens, *, need_eval: bool,
                   split=None):
    """``(train, eval or None, notes)``: the hash split, made to work for small corpora.

    ``docs`` are tokenized, ``(name, ids)`` with each ``ids`` ending in its EOS token;
    ``split`` is the hash split of their names (:func:`split_documents`) when already made.
    When eval is wanted and the hash split leaves either split shorter than one window
    (``seq_len + 1`` tokens), the split is repaired:

    1. by document: eval gets the documents with the lowest hash scores (those closest to
       being eval documents), as few as make one window, and train the rest, if that
       leaves train one window;
    2. otherwise (e.g. a single document) the last ``max(seq_len + 1, eval_fraction *
       tokens)`` tokens of the packed stream are held out as eval.

    Both repairs depend only on the corpus, so they are the same on every run.

    Raises:
      ValueError: train has fewer than ``seq_len + 1`` tokens, or the corpus cannot give
        both splits one window (the message says it is the eval split that is short).
    """
    window = seq_len + 1
    train_docs, eval_docs = split or split_documents(docs, eval_fraction)
    notes = []

    def tokens(ds):
        return sum(len(d) for _, d in ds)

    if need_eval and (tokens(eval_docs) < window or tokens(train_docs) < window):
        by_score = sorted(docs, key=lambda d: eval_score(d[0]))
        taken, count = set(), 0
        for name, d in by_score:
            if count >= window:
                break
            taken.add(name)
            count += len(d)
        left = [d for d in docs if d[0] not in taken]
        short = "eval" if tokens(eval_docs) < window else "train"
        moved = ("the document whose name hashes closest to eval" if len(taken) == 1 else
                 f"the {len(taken)} documents whose names hash closest to eval")
        if count >= window and tokens(left) >= window:
            notes.append(f"data.eval_fraction={eval_fraction} put "
                         f"{_count(len(eval_docs), 'document')} in eval and "
                         f"{_count(len(train_docs), 'document')} in train, leaving {short} shorter "
                         f"than one sequence of {window} tokens; so eval now holds {moved} and "
                         f"train the other {len(left)}")
            train_docs, eval_docs = left, [d for d in docs if d[0] in taken]
        else:
            stream = TokenStream.from_token_documents(docs, seq_len)
            total = stream.num_tokens
            held = max(window, math.ceil(eval_fraction * total))
            if total - held < window:
                raise ValueError(
                    f"the eval split needs at least one sequence of seq_len + 1 = {window} tokens, "
                    f"and train as many, but the corpus has {total} tokens in "
                    f"{_count(len(docs), 'document')}; add text, lower data.seq_len, or set "
                    f"data.num_eval_batches=0")
            notes.append(f"the corpus ({_count(len(docs), 'document')}) is too small to split by "
                         f"document, so its last {held} of {total} tokens are held out for eval "
                         f"and train gets the rest")
            cap = max_tokens or None
            return (TokenStream(stream.tokens[:total - held][:cap], seq_len),
                    TokenStream(stream.tokens[total - held:][:cap], seq_len), notes)
    train = TokenStream.from_token_documents(train_docs, seq_len, max_tokens=max_tokens)
    evals = (TokenStream.from_token_documents(eval_docs, seq_len, max_tokens=max_tokens)
             if need_eval else None)
    return train, evals, notes


def _count(n: int, noun: str) -> str:
    """``"1 document"``, ``"2 documents"``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _prompt_from(stream, tokenizer, max_tokens: int = 16) -> np.ndarray:
    """The start of the stream's first document (after the first EOS when the stream may
    begin mid-document), at most ``max_tokens`` tokens, cut before its first line break."""
    first = stream.batch(np.zeros(1, np.int64))["inputs"][0]
    eos = np.flatnonzero(first == tokenizer.eos_id)
    if getattr(stream, "starts_mid_document", False) and eos.size and eos[0] + 1 < first.size:
        first = first[eos[0] + 1:]
        eos = np.flatnonzero(first == tokenizer.eos_id)
    ids = first[: eos[0]] if eos.size else first
    ids = ids[:max_tokens]
    if ids.size == 0:
        return first[:1].astype(np.int32)
    text = tokenizer.decode(ids)
    line = text.lstrip("\n").split("\n")[0]
    encoded = tokenizer.encode(line, add_eos=False) if line else np.zeros(0, np.int32)
    return encoded if encoded.size else ids.astype(np.int32)




def _say(progress: bool, text: str) -> None:
    """A line on stdout (where the trainer's banner goes) saying what the data pipeline
    is doing (when ``progress``), written whole in one call: a signal that stops the read
    (:class:`jaxmp.train.signals.StartupSignal`) never leaves half a line."""
    if progress:
        sys.stdout.write(f"data: {text}\n")
        sys.stdout.flush()


def create_pipeline(data_config: Any, *, global_batch_size: int, seed: int,
                    process_index: int = 0, process_count: int = 1,
                    workdir: Optional[str | os.PathLike] = None,
                    progress: bool = False) -> DataPipeline:
    """Builds this process's train iterator and eval batches.

    Train: window ids ``0..n-1`` are globally shuffled with ``seed`` by grain,
    repeated forever with a fresh shuffle every epoch, and grouped into global
    batches of ``global_batch_size`` (batches may span an epoch boundary). Each
    process then gathers only rows ``[i * B / P, (i + 1) * B / P)`` of each global
    batch, so the processes' rows together are the one-process global batch.
    Shuffling ids rather than windows is what lets a process read only its rows.

    Eval: global batch ``k`` holds eval windows ``k * B .. (k + 1) * B - 1``
    modulo the number of eval windows (a small eval split is repeated), unshuffled.
    A corpus whose hash split leaves eval shorter than one window gets its split
    repaired (see ``DataPipeline.notes``): documents move to eval, or the stream's last
    tokens are held out.

    Text is tokenized by ``data.tokenizer`` (:func:`jaxmp.train.tokenizer.load_tokenizer`;
    ``bpe:VOCAB`` is trained on the hash split's train documents and kept in
    ``workdir``). Pre-tokenized shards (``data.path`` naming ``.bin`` files of
    ``data.token_dtype`` or ``.npy`` files, or a directory holding only such files, as
    nanoGPT's ``prepare.py`` and Megatron-style pipelines write flat token files) are
    memory-mapped, never copied: their ids are
    checked against the tokenizer's vocabulary, ``data.eod_id`` (-1: the tokenizer's
    end-of-document id) counts their documents, and eval is the end of the last shard.

    Args:
      data_config: object with attribute ``seq_len`` and the other ``data.*`` keys
        (:mod:`jaxmp.train.keys`; one it lacks takes that key's declared default, the
        run config's): ``path`` (a directory, a glob, token shards, ``None``/``""``: the
        stdlib; see :func:`load_documents`), ``text_field``, ``eval_fraction`` (see
        :func:`split_documents`), ``num_eval_batches`` (0 disables eval), ``max_tokens``
        (``None`` or 0: all; otherwise caps each split's packed stream, for tests and
        tiny runs), ``tokenizer``, ``token_dtype`` and ``eod_id``.
      global_batch_size: sequences per step over all processes.
      seed: shuffle seed in ``[0, 2**31 - 1)`` (:data:`SEED`, the run config's ``seed``).
      process_index: this process, in ``[0, process_count)``.
      process_count: number of processes sharing each global batch.
      workdir: the run directory, where ``bpe:VOCAB`` keeps its ``tokenizer.json``.
      progress: say on stdout what is being read and whether a BPE is being trained (on
        how much text: a sample when the train split exceeds ``BPE_TRAIN_BYTES``), and
        show a progress bar (stderr) for reading the files, counting the BPE's words and
        tokenizing, each once it has taken ``PROGRESS_DELAY_S`` (2 s;
        :mod:`jaxmp.train.tokenizer`).

    Returns:
      The pipeline.

    Raises:
      ValueError: a non-positive batch size, seq_len or process count; a batch
        not divisible by ``process_count``; a bad ``process_index``, ``seed``,
        ``eval_fraction``, ``num_eval_batches`` or ``max_tokens``; no file
        matches ``path``; a bad ``.jsonl`` line; a train split shorter than one
        window; a corpus too short to give eval one window too while eval is enabled;
        a bad tokenizer, token dtype, end-of-document id or shard.
    """
    seq_len = check_int("data.seq_len", data_config.seq_len, 1)
    batch = check_int("global_batch_size", global_batch_size, 1)
    count = check_int("process_count", process_count, 1)
    index = check_int("process_index", process_index, 0, count - 1)
    if batch % count:
        raise ValueError(f"global_batch_size={batch} is not divisible by "
                         f"process_count={count}")
    seed = int(check("seed", seed, SEED))
    def given(name):  # an attribute the caller's object lacks takes the key's declared default
        return getattr(data_config, name, DEFAULTS[f"data.{name}"])

    num_eval = check_int("data.num_eval_batches", given("num_eval_batches"), 0)
    max_tokens = given("max_tokens")
    if max_tokens is not None:
        max_tokens = check_int("data.max_tokens", max_tokens, 0) or None
    eval_fraction = check_real("data.eval_fraction", given("eval_fraction"), 0.0, 1.0,
                               hi_open=True)
    spec = given("tokenizer") or DEFAULTS["data.tokenizer"]
    eod_id = given("eod_id")
    eod_id = -1 if eod_id is None else check_int("data.eod_id", eod_id, -1)

    path = given("path")
    warnings: list = []
    shards = token_files(path)
    records, extra = None, {}
    trains_bpe = spec.startswith("bpe:") and not (
        workdir is not None and (pathlib.Path(workdir) / "tokenizer.json").is_file())
    if shards:
        _say(progress, f"reading {_count(len(shards), 'pre-tokenized shard')} of data.path "
                       f"{path!r} ({sum(os.path.getsize(f) for f in shards) / 2**20:,.1f} MiB)")
        tokenizer = load_tokenizer(spec, workdir=workdir, eod_id=eod_id, save=index == 0,
                                   train_texts=(None if not spec.startswith("bpe:")
                                                else _no_text(path)))
        eod = tokenizer.eos_id
        train, evals, notes, num_documents = shard_streams(
            shards, data_config, tokenizer, eod, seq_len, eval_fraction, max_tokens, num_eval > 0)
        starts_mid = True
    else:
        what = f"data.path {path!r}" if path else "the standard library's sources (data.path='')"
        _say(progress, f"reading {what}")
        text_field = given("text_field") or DEFAULTS["data.text_field"]
        records, docs = _examples_wanted(given, path, text_field, warnings, progress)
    if records is not None:  # examples with loss masks, packed (jaxmp.train.packing)
        if spec.startswith("bpe:"):
            raise ValueError(f"data.tokenizer={spec!r} trains on text documents; chat examples "
                             f"need the model's tokenizer (PATH/tokenizer.json), "
                             f"prompt_completion examples that or 'bytes'")
        tokenizer = load_tokenizer(spec, workdir=workdir, eod_id=eod_id, save=index == 0)
        train, evals, notes, num_documents, extra = _packed_examples(
            records, given, tokenizer, text_field, seq_len, eval_fraction, max_tokens,
            num_eval > 0)
        starts_mid = False
    elif not shards:
        if docs is None:
            docs = load_documents(path, text_field, warnings, progress=progress)
        split = split_documents(docs, eval_fraction)
        if trains_bpe:
            size, cap = sum(len(d) for _, d in split[0] or docs), tokenizer_module.BPE_TRAIN_BYTES
            _say(progress, f"training a byte-level BPE ({spec}) on {min(size, cap) / 2**20:,.1f} "
                           f"MiB of text" + (f", an even sample of the {size / 2**20:,.1f} MiB of "
                                             f"the train split (at most BPE_TRAIN_BYTES)"
                                             if size > cap else ""))
        tokenizer = load_tokenizer(spec, workdir=workdir, eod_id=eod_id, save=index == 0,
                                   train_texts=lambda: (d for _, d in split[0] or docs),
                                   progress=progress)
        tokenized = _tokenize(docs, tokenizer, progress=progress)
        names = {name for name, _ in split[1]}
        tok_split = ([d for d in tokenized if d[0] not in names],
                     [d for d in tokenized if d[0] in names])
        train, evals, notes = _split_streams(tokenized, eval_fraction, seq_len, max_tokens,
                                             need_eval=num_eval > 0, split=tok_split)
        num_documents = len(docs)
        starts_mid = any("held out" in n for n in notes)
    if given("chat_template") and not extra.get("chat_template"):  # the user's: used or refused
        raise ValueError(f"data.chat_template={given('chat_template')!r}, but data.path holds no "
                         f"chat record to render with it (give chat records, or leave "
                         f"data.chat_template '')")
    lo, hi = index * batch // count, (index + 1) * batch // count

    eval_batches, eval_tokens, eval_bytes = _EvalBatches(None, 0, 0, 0, 0), 0, None
    if num_eval:
        eval_tokens = evals.num_tokens
        eval_batches = _EvalBatches(evals, num_eval, batch, lo, hi)
        table = getattr(tokenizer, "token_bytes", None)
        if table is not None:
            def trained_bytes(b):  # the bytes of the targets the loss counts
                got = table[b["targets"]]
                return int(got[b["loss_mask"]].sum() if "loss_mask" in b else got.sum())

            eval_bytes = tuple(
                trained_bytes(evals.batch(np.arange(k * batch, (k + 1) * batch) % len(evals)))
                for k in range(num_eval))
    prompt_source = evals if num_eval else train
    if hasattr(prompt_source, "parts"):
        prompt_source = prompt_source.parts[0]
    prompt_source.starts_mid_document = starts_mid
    sample_prompt = extra.get("sample_prompt")
    if sample_prompt is None:
        sample_prompt = _prompt_from(prompt_source, tokenizer)

    ds = (grain.MapDataset.range(len(train)).shuffle(seed=seed).repeat()
          .batch(batch, drop_remainder=True)
          .map(lambda ids: train.batch(ids[lo:hi])))
    # One reader thread and a 2-batch buffer: gathering is a NumPy copy, and
    # grain's default (16 threads, 500 batches) would hold hundreds of MB.
    train_iter = iter(ds.to_iter_dataset(
        grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)))
    return DataPipeline(
        train_iter=train_iter, eval_batches=eval_batches, tokenizer=tokenizer,
        train_tokens=train.num_tokens, eval_tokens=eval_tokens,
        num_documents=num_documents, notes=tuple(notes), warnings=tuple(warnings),
        eval_bytes=eval_bytes, sample_prompt=sample_prompt,
        batch_keys=extra.get("batch_keys", packing_module.BATCH_KEYS),
        examples=extra.get("examples", ""), chat_template=extra.get("chat_template", ""),
        chat_tokens=extra.get("chat_tokens", {}),
        sample_stop_ids=tuple(extra.get("sample_stop_ids", ())),
        _fingerprint={"train_windows": len(train), "seq_len": seq_len,
                      "global_batch_size": batch, "seed": seed,
                      "tokenizer": tokenizer.digest(), **extra.get("fingerprint", {})})


def _examples_wanted(given, path, text_field: str, warnings: list, progress: bool):
    """``(records, None)`` when ``data.path`` is read as examples with loss masks
    (:mod:`jaxmp.train.packing`): ``data.format`` chat or prompt_completion, ``data.loss_on``
    or ``data.packing`` asking for them, or ``data.format=auto`` finding a chat or
    prompt_completion record (:func:`load_documents` with ``records``); else ``(None,
    documents)``: the text documents of a token stream, read once (None where they are
    still to be read: no JSON-lines file, or ``data.format=text``)."""
    fmt = given("format")
    wanted = packing_module.asks_for_examples(fmt, given("loss_on"), given("packing"))
    if path and fmt == "auto":
        for file in data_files(path):
            if file.lower().endswith(".json") and _json_records(file, text_field):
                raise ValueError(f"{file}: a .json file of JSON records, which data.format=auto "
                                 f"would train on as text; name JSON lines .jsonl (convert a "
                                 f"JSON array to JSON lines), or set data.format=text to train "
                                 f"on the file as text")
    if fmt == "text" and not wanted:
        return None, None
    if not wanted and not (path and any(f.lower().endswith(RECORD_SUFFIXES)
                                for f in data_files(path))):
        return None, None
    records = load_documents(path, text_field, warnings, progress=progress, records=True)
    if wanted or any(packing_module.example_kind(r) for _, r in records):
        return records, None
    return None, text_documents(records, text_field)


def _json_records(file: str, text_field: str, head: int = 1 << 16) -> bool:
    """Whether a ``.json`` file holds JSON records (JSON lines, or an array of objects):
    its first object (on its first line, or the array's first) has ``messages``,
    ``prompt`` or ``text_field``. Reads at most ``head`` bytes."""
    with open(file, "rb") as f:
        start = f.read(head).decode("utf-8", "replace").lstrip()
    try:
        if start.startswith("["):  # an array: its first object, as far as the head holds it
            first, _ = json.JSONDecoder().raw_decode(start[1:].lstrip())
        else:
            first = json.loads(start.split("\n", 1)[0])
    except ValueError:  # an array cut by the head still starts with an object
        return start.startswith("[") and start[1:].lstrip().startswith("{")
    return isinstance(first, dict) and bool({"messages", "prompt", text_field} & set(first))


def _packed_examples(records, given, tokenizer, text_field: str, seq_len: int,
                     eval_fraction: float, max_tokens, need_eval: bool):
    """``(train rows, eval rows or None, notes, examples, extra)`` of the records
    (:class:`jaxmp.train.packing.PackedRows`), split by name as documents are
    (:func:`split_documents`); an eval split that gives no row takes the examples whose
    names hash closest to eval until it gives one."""
    fmt = given("format")
    examples, counts, source, template, tokens = packing_module.encode_examples(
        records, fmt, text_field=text_field, tokenizer=tokenizer, loss_on=given("loss_on"),
        chat_template=given("chat_template"))
    main = next((k for k in ("chat", "prompt_completion", "text") if counts.get(k)), "text")
    loss_on, packing = packing_module.resolve(main, given("loss_on"), given("packing"))
    truncate = given("truncate")
    if max_tokens:
        kept, total = [], 0
        for e in examples:
            if total >= max_tokens:
                break
            kept.append(e)
            total += len(e.ids)
        examples = kept
    if not examples:
        raise ValueError(f"data.path holds no example to train on ({counts})")
    named = [(e.name, e) for e in examples]
    train_ex, eval_ex = split_documents(named, eval_fraction)

    def rows(named_examples, part):
        return packing_module.PackedRows([e for _, e in named_examples], seq_len, packing,
                                         truncate, part)

    notes = []
    evals = None
    if need_eval:
        if not eval_ex:
            by_score = sorted(named, key=lambda d: eval_score(d[0]))
            eval_ex, train_ex = by_score[:1], by_score[1:]
            notes.append(f"data.eval_fraction={eval_fraction} put no example in eval; it now "
                         f"holds the one whose name hashes closest to eval")
        if not train_ex:
            raise ValueError(f"{len(examples)} example(s): too few for a train and an eval "
                             f"split; add data or set data.num_eval_batches=0")
        evals = rows(eval_ex, "eval")
    train = rows(train_ex, "train")
    if not train.trained_tokens:  # e.g. truncation cut every assistant turn
        raise ValueError(f"the train rows hold no token to learn (data.loss_on="
                         f"{given('loss_on') or 'the format default'}, data.truncate={truncate}, "
                         f"data.seq_len={seq_len}): every {loss_on} token was cut or there is "
                         f"none; raise data.seq_len or set data.truncate=split")
    skipped = counts.get("no assistant turn", 0)
    kinds = ", ".join(f"{counts[k]} {k}" for k in ("chat", "prompt_completion", "text")
                      if counts.get(k))
    notes.append(f"examples: {kinds}" + (f"; {skipped} conversation(s) without an assistant "
                                         f"turn skipped" if skipped else ""))
    for part, cut in (("train", train), ("eval", evals)):
        if cut is not None and (cut.split or cut.truncated):
            notes.append(f"{cut.split + cut.truncated} {part} example(s) longer than a row "
                         f"(data.seq_len={seq_len} tokens) were "
                         f"{'split into rows' if truncate == 'split' else 'truncated'} "
                         f"(data.truncate={truncate})")
    fraction = train.trained_tokens / (len(train) * seq_len)
    kinds_read = [k for k in ("chat", "prompt_completion", "text") if counts.get(k)]
    learned = " and ".join(f"{k}: loss on {packing_module.resolve(k, given('loss_on'), '')[0]}"
                           for k in kinds_read)
    words = ((f"{main}, packing {packing}, loss on {loss_on}" if len(kinds_read) == 1 else
              f"{' and '.join(kinds_read)}, packing {packing} ({learned})")
             + f" ({fraction:.1%} of the train rows' tokens trained)"
             + (f", chat template {source}" if source else ""))
    rendered = (template + "\n" + json.dumps(tokens, sort_keys=True)).encode()
    digest = hashlib.sha256()  # what the examples are, token by token: a template that
    for e in examples:          # reads the time (strftime_now) renders others on resume
        digest.update(np.asarray(e.ids, np.int32).tobytes())
        digest.update(np.packbits(e.learned).tobytes())
    extra = {"batch_keys": packing_module.PACKED_KEYS, "examples": words,
             **_chat_sample(records, [n for n, _ in eval_ex] if evals is not None else [],
                            template, tokens, tokenizer),
             "chat_template": template, "chat_tokens": dict(tokens),
             "fingerprint": {"format": main, "packing": packing, "loss_on": loss_on,
                             "truncate": truncate, "examples": digest.hexdigest(),
                             **({"chat_template": hashlib.sha256(rendered).hexdigest()}
                                if template else {})}}
    return train, evals, notes, len(examples), extra


def _chat_sample(records, eval_names, template: str, tokens: dict, tokenizer) -> dict:
    """``{"sample_prompt", "sample_stop_ids"}`` of a chat run (empty without a template):
    the first conversation of the eval split (else of all) with a turn before an assistant
    turn, up to that assistant turn, rendered with the generation prompt; and the
    template's end-of-turn ids."""
    from jaxmp.train import chat

    if not template:
        return {}
    first = set(eval_names)
    ordered = ([r for n, r in records if n in first] + [r for _, r in records])
    for record in ordered:
        messages = record.get("messages") if isinstance(record, dict) else None
        if not isinstance(messages, list):
            continue
        turn = next((i for i, m in enumerate(messages)
                     if isinstance(m, dict) and m.get("role") == "assistant"), 0)
        if turn:
            return {"sample_prompt": chat.prompt_ids(messages[:turn], template,
                                                     tokenizer.tokenizer, **tokens),
                    "sample_stop_ids": chat.end_of_turn_ids(template, tokenizer.tokenizer,
                                                            tokens)}
    return {}


def _no_text(path):
    def fail():
        raise ValueError(f"data.tokenizer='bpe:...' trains on text, but data.path {path!r} holds "
                         "pre-tokenized shards; set data.tokenizer to the tokenizer that wrote "
                         "them")
    return fail


def _tokenize(docs, tokenizer, chunk: int = 1024, progress: bool = False,
              piece_bytes: Optional[int] = None) -> list:
    """``(name, ids)`` of each document, each ending in the tokenizer's EOS; with
    ``progress``, a progress bar over the bytes (tqdm, on stderr) once it has taken
    ``PROGRESS_DELAY_S``.

    Documents are encoded ``chunk`` at a time (``encode_batch``), and one longer than
    ``piece_bytes`` (default 16 x ``PIECE_BYTES``, 1 MiB) in pieces cut before a space or
    line break (:func:`~jaxmp.train.tokenizer.text_pieces`; its ids are the pieces' ids
    concatenated, so a tokenizer's memory holds one piece's encoding at a time, and the
    progress bar moves within it). A byte-level BPE's pre-tokenizer splits words at those
    cuts, SentencePiece's too, so the ids are the whole document's; a cut inside a run
    of ``piece_bytes`` without a space may differ from it there.
    """
    from tqdm import tqdm
    piece_bytes = piece_bytes or 16 * tokenizer_module.PIECE_BYTES
    out = []
    with tqdm(total=sum(len(d) for _, d in docs), desc=f"data: tokenizing ({tokenizer.name})",
              unit="B", unit_scale=True, disable=not progress, file=sys.stderr,
              leave=True, delay=tokenizer_module.PROGRESS_DELAY_S) as bar:
        for start in range(0, len(docs), chunk):
            part = docs[start:start + chunk]
            small = [i for i, (_, d) in enumerate(part) if len(d) <= piece_bytes]
            encoded = dict(zip(small, tokenizer.encode_batch([part[i][1] for i in small])))
            bar.update(sum(len(part[i][1]) for i in small))
            for i, (name, doc) in enumerate(part):
                ids = encoded[i] if i in encoded else _encode_in_pieces(doc, tokenizer,
                                                                        piece_bytes, bar)
                out.append((name, ids))
    return out


def _encode_in_pieces(doc, tokenizer, piece_bytes: int, bar, group: int = 8) -> np.ndarray:
    """The ids of one long document, encoded ``group`` pieces at a time (see
    :func:`_tokenize`); EOS only at its end."""
    parts, pieces = [], text_pieces(doc, piece_bytes)
    while True:
        batch = [p for _, p in zip(range(group), pieces)]
        if not batch:
            break
        parts.extend(ids[:-1] for ids in tokenizer.encode_batch(batch))  # each piece's EOS off
        bar.update(sum(len(p) for p in batch))
    return np.concatenate(parts + [np.asarray([tokenizer.eos_id], parts[0].dtype)])
