"""Examples with a loss mask, packed into rows: what ``data.format``, ``data.loss_on``,
``data.packing`` and ``data.truncate`` mean.

An example is one JSON-lines record (or a whole text file):

* ``text``: the record's ``data.text_field`` (every token learned);
* ``chat``: ``{"messages": [{role, content}, ...]}``, rendered by the chat template
  (:func:`jaxmp.train.chat.encode_messages`, as :func:`~jaxmp.train.chat.encode_conversation`;
  the assistant's tokens learned);
* ``prompt_completion``: ``{"prompt": str, "completion": str}``, tokenized each on its
  own and joined, the end-of-document token after the completion (the completion and
  that token learned), as TRL's ``completion_only_loss``.

``data.format=auto`` (the default) takes each record's format from its fields, in that
order of precedence: ``messages``, then ``prompt`` with ``completion``, then the text
field. ``data.loss_on`` is ``all``, ``assistant`` (chat's default) or ``completion``
(prompt_completion's default); ``""`` is the format's default.

An example of ``n`` tokens is ``n - 1`` training pairs (input token ``j``, target
``j + 1``, learned where the target is). ``data.packing``:

* ``concat`` (text's default): the examples one after another in one stream cut into
  rows; a row's tokens attend to the examples before them in the row (no segment ids);
* ``isolated`` (chat's and prompt_completion's default): whole examples packed into rows
  in order, each with its own segment id (1, 2, ... within the row, 0 for padding) and
  RoPE positions from 0: attention never crosses an example;
* ``padded``: one example per row, the rest padding.

An example longer than a row (``data.seq_len`` pairs) is cut into rows of its own
(``data.truncate=split``, each piece its own segment) or keeps its first row
(``truncate``); either way the run reports how many were.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, List, NamedTuple, Sequence, Tuple

import numpy as np

__all__ = ["FORMATS", "LOSS_ON", "PACKINGS", "TRUNCATIONS", "BATCH_KEYS", "LOSS_MASK",
           "SEGMENT_KEYS", "PACKED_KEYS", "batch_keys", "asks_for_examples", "example_kind",
           "record_format", "resolve", "encode_examples", "Encoded", "PackedRows", "Example"]

FORMATS = ("auto", "text", "chat", "prompt_completion")
LOSS_ON = ("", "all", "assistant", "completion")
PACKINGS = ("", "concat", "isolated", "padded")
TRUNCATIONS = ("split", "truncate")
# The keys of a token batch, and of one with loss masks and packed examples: the mask the
# loss reads (jaxmp.train.step) and the keys MoETransformer takes for packed rows.
BATCH_KEYS = ("inputs", "targets")
LOSS_MASK = "loss_mask"
SEGMENT_KEYS = ("segment_ids", "positions")
PACKED_KEYS = BATCH_KEYS + (LOSS_MASK,) + SEGMENT_KEYS
_DEFAULT_LOSS_ON = {"text": "all", "chat": "assistant", "prompt_completion": "completion"}


@dataclasses.dataclass(frozen=True)
class Example:
    """One tokenized example: ``ids`` int32 ``[n]`` and ``learned`` bool ``[n]`` (token
    ``j`` is a target the loss counts)."""

    name: str
    ids: np.ndarray
    learned: np.ndarray


class Encoded(NamedTuple):
    """What :func:`encode_examples` gives.

    Attributes:
      examples: the :class:`Example` s, in order.
      counts: the examples by format, and the conversations skipped (``"no assistant
        turn"``, not among the chat count).
      source: where the chat template came from, in words ('' without chat).
      template: the chat template's text ('' without chat).
      tokens: the special tokens the template was rendered with
        (:func:`jaxmp.train.chat.special_tokens`; empty without chat).
    """

    examples: List[Example]
    counts: Dict[str, int]
    source: str
    template: str
    tokens: Dict[str, str]


def batch_keys(data_config: Any) -> Tuple[str, ...]:
    """The keys of the batches the data config describes, as far as the config says
    (before the data is read): :data:`PACKED_KEYS` where it asks for examples with masks
    (``format`` chat or prompt_completion, ``loss_on`` assistant or completion,
    ``packing`` isolated or padded), else :data:`BATCH_KEYS` (``format=auto`` may still
    find chat records: the trainer then compiles its step again for their keys)."""
    return PACKED_KEYS if asks_for_examples(data_config.get("format"), data_config.get(
        "loss_on"), data_config.get("packing")) else BATCH_KEYS


def asks_for_examples(fmt: str, loss_on: str, packing: str) -> bool:
    """Whether ``data.format``, ``data.loss_on`` and ``data.packing`` ask for examples with
    loss masks whatever the records are (``auto`` may still find them,
    :func:`example_kind`)."""
    return (fmt in ("chat", "prompt_completion") or loss_on in ("assistant", "completion")
            or packing in ("isolated", "padded"))


def example_kind(record: Any) -> Any:
    """``"chat"`` or ``"prompt_completion"`` for a record of one (by its fields, in that
    order of precedence), else None."""
    if isinstance(record, dict):
        if "messages" in record:
            return "chat"
        if "prompt" in record and "completion" in record:
            return "prompt_completion"
    return None


def record_format(record: Any, text_field: str, where: str) -> str:
    """The format of one JSON-lines record (``data.format=auto``).

    Raises:
      ValueError: a record of no known format (one line naming ``where``: file and line).
    """
    kind = example_kind(record)
    if kind is not None:
        return kind
    if isinstance(record, dict) and text_field in record:
        return "text"
    keys = sorted(record)[:6] if isinstance(record, dict) else type(record).__name__
    raise ValueError(f"{where}: a record of no known format (fields {keys}); allowed: "
                     f"'messages' (chat), 'prompt' and 'completion', or {text_field!r} "
                     f"(data.text_field)")


def resolve(fmt: str, loss_on: str, packing: str) -> Tuple[str, str]:
    """``(loss_on, packing)`` with ``""`` replaced by ``fmt``'s default (``fmt`` a resolved
    format, not ``auto``)."""
    return (loss_on or _DEFAULT_LOSS_ON[fmt],
            packing or ("concat" if fmt == "text" else "isolated"))


def _text(value: Any, where: str, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: field {field!r} must be non-empty text, got "
                         f"{str(value)[:40]!r}")
    return value


def encode_examples(records: Sequence[Tuple[str, Any]], fmt: str, *, text_field: str,
                    tokenizer, loss_on: str, chat_template: str = "") -> Encoded:
    """Tokenizes records into :class:`Example` s.

    Args:
      records: ``(name, record)``: a JSON object, or ``bytes`` (a text file).
      fmt: ``data.format`` (``auto`` decides per record, :func:`record_format`).
      text_field: the text's field (``data.text_field``).
      tokenizer: the run's tokenizer (:mod:`jaxmp.train.tokenizer`); chat needs a
        Hugging Face ``tokenizer.json`` (its directory holds the template unless
        ``chat_template`` names a file).
      loss_on: ``data.loss_on`` (``""``: each format's default).
      chat_template: ``data.chat_template`` (a file), or ``""``.

    Returns:
      The :class:`Encoded` examples, with their counts and the chat template's text,
      source and special tokens.

    Raises:
      ValueError: one line naming the file and line: a record of no known or of the wrong
        format, empty text, a conversation's fault (:func:`jaxmp.train.chat.check_messages`),
        a template that fails, chat without a ``tokenizer.json`` or with one that lacks the
        template's special tokens (:func:`jaxmp.train.chat.check_special_tokens`),
        ``loss_on`` that the format cannot have (``assistant`` for prompt_completion, ...).
    """
    from jaxmp.train import chat

    counts: Dict[str, int] = {}
    examples: List[Example] = []
    template = source = None
    special: Dict[str, str] = {}
    for name, record in records:
        kind = ("text" if isinstance(record, (bytes, str)) else
                record_format(record, text_field, name) if fmt == "auto" else fmt)
        if isinstance(record, (bytes, str)) and fmt not in ("auto", "text"):
            raise ValueError(f"{name}: data.format={fmt!r} reads JSON-lines records, and this "
                             f"is a text file")
        if fmt != "auto" and not isinstance(record, (bytes, str)):
            found = record_format(record, text_field, name)
            if found != fmt:
                raise ValueError(f"{name}: a {found} record, but data.format={fmt!r}")
        learn = loss_on or _DEFAULT_LOSS_ON[kind]
        if learn not in ("all", _DEFAULT_LOSS_ON[kind]):
            allowed = " or ".join(dict.fromkeys(("all", _DEFAULT_LOSS_ON[kind])))
            raise ValueError(f"data.loss_on={loss_on!r} does not apply to {kind} records "
                             f"({name}); allowed: {allowed}")
        if kind == "text":
            text = record if isinstance(record, (bytes, str)) else _text(
                record.get(text_field), name, text_field)
            ids = tokenizer.encode(text, add_eos=True).astype(np.int32)
            learned = np.ones(len(ids), bool)
        elif kind == "prompt_completion":
            prompt = tokenizer.encode(_text(record["prompt"], name, "prompt"), add_eos=False)
            done = tokenizer.encode(_text(record["completion"], name, "completion"),
                                    add_eos=True)
            ids = np.concatenate([prompt, done]).astype(np.int32)
            learned = np.concatenate([np.full(len(prompt), learn == "all"),
                                      np.ones(len(done), bool)])
        else:
            messages = chat.check_messages(record["messages"], name)
            if not any(m["role"] == "assistant" for m in messages):
                counts["no assistant turn"] = counts.get("no assistant turn", 0) + 1
                continue
            if template is None:  # loaded once, with the special tokens it reads
                directory = _tokenizer_dir(tokenizer)
                template, source = chat.load_chat_template(chat_template or directory)
                try:  # the template's own fault is its file's, not this record's
                    chat.compile_template(template)
                except ValueError as e:
                    raise ValueError(f"{source}: {e}") from None
                special = chat.special_tokens(directory)
                chat.check_special_tokens(template, tokenizer.tokenizer, special, tokenizer.name)
            try:  # the data tokenizer is the directory's tokenizer.json (_tokenizer_dir)
                ids, learned = chat.encode_messages(messages, template, tokenizer.tokenizer,
                                                    **special)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
            if learn == "all":
                learned = np.ones(len(ids), bool)
        counts[kind] = counts.get(kind, 0) + 1  # a skipped conversation is counted apart
        examples.append(Example(name, ids, learned))
    return Encoded(examples, counts, source or "", template or "", special)


def _tokenizer_dir(tokenizer) -> str:
    path = str(getattr(tokenizer, "name", ""))
    if not path.endswith(".json") or not os.path.isfile(path):
        raise ValueError(f"chat records need a Hugging Face tokenizer: data.tokenizer="
                         f"PATH/tokenizer.json (the model's), not {path!r}")
    return os.path.dirname(os.path.abspath(path))


class PackedRows:
    """Examples packed into rows of ``seq_len`` training pairs (module docstring).

    Args:
      examples: the :class:`Example` s, in order.
      seq_len: pairs per row.
      packing: ``concat``, ``isolated`` or ``padded``.
      truncate: ``split`` or ``truncate``.
      part: ``"train"`` or ``"eval"``, for the message of a split that gives no row.

    Attributes:
      num_tokens: tokens of the examples (all of them, whatever rows hold them).
      trained_tokens: targets the loss counts, over the rows.
      split, truncated: how many examples were longer than a row, and cut into rows or
        truncated.

    Raises:
      ValueError: no row (no example long enough to give a pair, or too few tokens for
        one ``concat`` row).
    """

    def __init__(self, examples: Sequence[Example], seq_len: int, packing: str,
                 truncate: str = "split", part: str = ""):
        self.seq_len, self.packing = int(seq_len), packing
        self.num_tokens = int(sum(len(e.ids) for e in examples))
        self.split = self.truncated = 0
        t = self.seq_len
        if packing == "concat":
            ids = np.concatenate([e.ids for e in examples]) if examples else np.zeros(0, np.int32)
            learned = (np.concatenate([e.learned for e in examples]) if examples
                       else np.zeros(0, bool))
            n = len(ids) // (t + 1)
            w = ids[: n * (t + 1)].reshape(n, t + 1)
            m = learned[: n * (t + 1)].reshape(n, t + 1)
            self._inputs, self._targets, self._mask = w[:, :-1], w[:, 1:], m[:, 1:]
            self._segments = np.ones((n, t), np.int32)
            self._positions = np.broadcast_to(np.arange(t, dtype=np.int32), (n, t))
        else:
            pieces = []  # (inputs, targets, learned) of at most t pairs each
            for e in examples:
                x, y, m = e.ids[:-1], e.ids[1:], e.learned[1:]
                if len(x) == 0:
                    continue
                if len(x) > t:
                    if truncate == "split":
                        self.split += 1
                        pieces += [(x[i:i + t], y[i:i + t], m[i:i + t])
                                   for i in range(0, len(x), t)]
                        continue
                    self.truncated += 1
                    x, y, m = x[:t], y[:t], m[:t]
                pieces.append((x, y, m))
            rows: List[List[Tuple]] = []
            used = t + 1
            for p in pieces:
                if packing == "padded" or used + len(p[0]) > t:
                    rows.append([])
                    used = 0
                rows[-1].append(p)
                used += len(p[0])
            n = len(rows)
            self._inputs = np.zeros((n, t), np.int32)
            self._targets = np.zeros((n, t), np.int32)
            self._mask = np.zeros((n, t), bool)
            self._segments = np.zeros((n, t), np.int32)
            self._positions = np.zeros((n, t), np.int32)
            for r, row in enumerate(rows):
                at = 0
                for s, (x, y, m) in enumerate(row, start=1):
                    k = len(x)
                    self._inputs[r, at:at + k], self._targets[r, at:at + k] = x, y
                    self._mask[r, at:at + k], self._segments[r, at:at + k] = m, s
                    self._positions[r, at:at + k] = np.arange(k)
                    at += k
        if len(self._inputs) == 0:
            where = f"the {part} split's examples" if part else "the examples"
            fix = ("; or set data.num_eval_batches=0, or raise data.eval_fraction"
                   if part == "eval" else "")
            raise ValueError(f"no row of data.seq_len={t} tokens: {where} hold "
                             f"{self.num_tokens} tokens in all; add data or lower "
                             f"data.seq_len{fix}")
        self.trained_tokens = int(self._mask.sum())

    def __len__(self) -> int:
        return len(self._inputs)

    def batch(self, row_ids: Any) -> Dict[str, np.ndarray]:
        """Rows ``row_ids`` as ``{"inputs", "targets", "loss_mask", "segment_ids",
        "positions"}``, each ``[B, seq_len]`` (int32, the mask bool); ``concat`` rows are one
        segment each."""
        i = np.asarray(row_ids)
        return {"inputs": self._inputs[i].astype(np.int32),
                "targets": self._targets[i].astype(np.int32),
                "loss_mask": self._mask[i].copy(),
                "segment_ids": self._segments[i].astype(np.int32),
                "positions": self._positions[i].astype(np.int32)}
