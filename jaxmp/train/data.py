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

Example::

    cfg = ml_collections.ConfigDict(dict(path=None, text_field="text", seq_len=256,
                                         eval_fraction=0.02, num_eval_batches=8,
                                         max_tokens=None))
    pipe = create_pipeline(cfg, global_batch_size=32, seed=0)
    batch = next(pipe.train_iter)  # {"inputs", "targets"}: int32 [32, 256]
"""
from __future__ import annotations

import dataclasses
import fnmatch
import glob
import json
import math
import os
import pathlib
import sys
import sysconfig
import zlib
from typing import Any, Optional, Sequence

import grain
import numpy as np

from jaxmp._checks import Int, check, check_int, check_real
from jaxmp.train.tokenizer import ByteTokenizer, load_tokenizer

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
# Bumped when the meaning of a saved iterator state changes.
_STATE_VERSION = 1


def default_corpus_files() -> list[pathlib.Path]:
    """Returns the standard library's ``.py`` files, sorted by relative path.

    The root is ``sysconfig.get_paths()["stdlib"]``; subpackages are included,
    ``site-packages`` / ``dist-packages`` (third-party code) and ``__pycache__``
    are not, and directory symlinks are not followed.

    Returns:
      Absolute paths, sorted by their POSIX path relative to the stdlib root, so
      the order is the same on every machine with the same Python version.

    Raises:
      FileNotFoundError: the stdlib holds no ``.py`` file (e.g. a zipped stdlib).
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        files.extend(pathlib.Path(dirpath, f) for f in filenames if f.endswith(".py"))
    if not files:
        raise FileNotFoundError(f"no .py files under the stdlib directory {root}")
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _jsonl_documents(file: str, text_field: str) -> list[tuple[str, bytes]]:
    docs = []
    with open(file, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{file}, line {lineno}: invalid JSON ({e})") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise ValueError(
                    f"{file}, line {lineno}: expected a JSON object with a string "
                    f"field {text_field!r}, got {line[:80]!r}")
            try:
                text = record[text_field].encode("utf-8")
            except UnicodeEncodeError as e:  # a lone surrogate escape such as "\ud800"
                raise ValueError(f"{file}, line {lineno}: field {text_field!r} is not text "
                                 f"({e.reason} at character {e.start}: an unpaired "
                                 f"\\u{ord(e.object[e.start]):04x} escape)") from None
            docs.append((f"{file}:{lineno}", text))
    return docs


def _is_text_file(path: str) -> bool:
    """No NUL byte in the first 8 KiB: git's rule for telling text from binary files."""
    with open(path, "rb") as f:
        return b"\0" not in f.read(8192)


def _walk_directory(root: str) -> list[str]:
    """Every file below ``root``, recursively, sorted, none read; hidden files and
    directories (names starting with ``.``) and ``__pycache__`` are skipped, symlinked
    directories not followed."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
        files.extend(f for f in (os.path.join(dirpath, n) for n in filenames
                                 if not n.startswith(".")) if os.path.isfile(f))
    return sorted(files)


def _match_parts(pattern: Sequence[str], parts: Sequence[str]) -> bool:
    """Whether path components ``parts`` match glob components ``pattern`` as
    ``glob.glob(recursive=True)`` does: ``**`` is any number of directories, another
    component one name (``fnmatch``), and a name starting with ``.`` only matches a
    component that starts with ``.``."""
    if not pattern:
        return not parts
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_match_parts(rest, parts[i:]) for i in range(len(parts) + 1)
                   if not any(p.startswith(".") for p in parts[:i]))
    return (bool(parts) and (not parts[0].startswith(".") or head.startswith("."))
            and fnmatch.fnmatchcase(parts[0], head) and _match_parts(rest, parts[1:]))


def _glob_files(pattern: str, links: Optional[list] = None) -> list[str]:
    """The files a glob matches, sorted, like ``glob.glob(pattern, recursive=True)``, but
    a ``**`` walks each real directory once: a symlinked directory that leads to one
    already walked (an ancestor: a loop) is not entered again, where ``glob`` follows it
    round and round. Each such link is appended to ``links`` as ``(link, target)``."""
    if "**" not in pattern:
        return sorted(f for f in glob.glob(pattern) if os.path.isfile(f))
    parts = pattern.split(os.sep)
    i = 0
    while i < len(parts) - 1 and not glob.has_magic(parts[i]):
        i += 1
    prefix = os.sep.join(parts[:i]) if i else ""
    root = prefix or (os.sep if pattern.startswith(os.sep) else os.curdir)
    rest = parts[i:]
    if not os.path.isdir(root):
        return []
    found, st = [], os.stat(root)
    walked = {(st.st_dev, st.st_ino)}  # walked, or to be walked: each real directory once
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        keep = []
        for name in sorted(dirnames):
            if name.startswith(".") and not any(p.startswith(".") for p in rest):
                continue  # glob's ** enters no hidden directory
            sub = os.path.join(dirpath, name)
            try:
                st = os.stat(sub)
            except OSError:  # a dangling link
                continue
            if (st.st_dev, st.st_ino) in walked:
                if links is not None:
                    links.append((sub, os.path.realpath(sub)))
                continue
            walked.add((st.st_dev, st.st_ino))
            keep.append(name)
        dirnames[:] = keep
        rel = os.path.relpath(dirpath, root)
        rel_parts = [] if rel == os.curdir else rel.split(os.sep)
        for name in filenames:
            if _match_parts(rest, rel_parts + [name]):
                file = os.path.join(dirpath, name) if prefix else os.path.join(*rel_parts, name)
                if os.path.isfile(file):
                    found.append(file)
    return sorted(found)


def _walked_once_warning(path: str, links: Sequence[tuple]) -> list:
    """The warning for the symlinked directories a glob did not enter twice."""
    if not links:
        return []
    why = []
    for link, target in links[:3]:
        parent = os.path.realpath(os.path.dirname(link) or ".")
        loop = parent == target or parent.startswith(target.rstrip(os.sep) + os.sep)
        why.append(f"the link {link!r} points to its own ancestor {target!r}, a loop" if loop
                   else f"the link {link!r} leads to {target!r}")
    return [f"data.path {path!r}: {len(links)} linked director{'y' if len(links) == 1 else 'ies'} "
            f"lead to directories already walked ({'; '.join(why)}); each real directory is "
            f"walked once"]


def _directory_files(root: str) -> list[str]:
    """Every text file below ``root``, recursively, sorted; hidden files and directories
    (names starting with ``.``) and ``__pycache__`` are skipped, symlinked directories not
    followed.

    Raises:
      ValueError: no text file is found (the message counts what was skipped).
    """
    found, skipped = [], 0
    for file in _walk_directory(root):
        if _is_text_file(file):
            found.append(file)
        else:
            skipped += 1
    if not found:
        raise ValueError(f"data.path directory {root!r} holds no text file ({skipped} binary "
                         f"file(s) skipped); give a directory of text files, a glob such as "
                         f"'{root}/**/*.txt', or .jsonl files")
    return sorted(found)


def _looping_links(files: Sequence[str]) -> dict:
    """``{link: target}`` for each symlinked directory on the paths of ``files`` that
    points to one of its own ancestors (a glob's ``**`` follows it again and again)."""
    loops, seen = {}, set()
    for file in files:
        d = os.path.dirname(file)
        while d and d not in seen:
            seen.add(d)
            if os.path.islink(d):
                target = os.path.realpath(d)
                parent = os.path.realpath(os.path.dirname(d) or ".")
                if parent == target or parent.startswith(target.rstrip(os.sep) + os.sep):
                    loops[d] = target
            d = os.path.dirname(d)
    return loops


def _unique_text_files(path: str, files: Sequence[str], warnings: list) -> list[str]:
    """``files`` with each real file once (symlinks resolved: the first path in sorted
    order is kept) and binary files left out, with a warning for each kind of skip.

    Raises:
      ValueError: none of ``files`` is a text file.
    """
    first, duplicates = {}, []
    for file in files:
        real = os.path.realpath(file)
        if real in first:
            duplicates.append((file, first[real]))
        else:
            first[real] = file
    if duplicates:
        loops = _looping_links([f for f, _ in duplicates])
        why = "".join(f"; the link {link!r} points to its own ancestor {target!r}, a loop"
                      for link, target in sorted(loops.items())[:3])
        warnings.append(f"data.path {path!r}: {len(duplicates)} path(s) lead to files already read "
                        f"(e.g. {duplicates[0][0]!r} is {duplicates[0][1]!r}){why}; each file is "
                        f"read once")
    kept = list(first.values())
    text = [f for f in kept if _is_text_file(f)]
    binary = [f for f in kept if f not in set(text)]
    if not text:
        raise ValueError(f"data.path {path!r} matches no text file ({len(binary)} binary file(s), "
                         f"e.g. {binary[0]!r}: a NUL byte in its first 8 KiB); give text files, a "
                         f"directory of them, or .jsonl files")
    if binary:
        warnings.append(f"data.path {path!r}: skipped {len(binary)} binary file(s) (a NUL byte in "
                        f"the first 8 KiB), e.g. {binary[0]!r}")
    return text


def data_files(path: str, links: Optional[list] = None) -> list[str]:
    """The files ``data.path`` names (a directory's text files, recursively; or a glob's,
    each real directory walked once: :func:`_glob_files`), sorted: what
    :func:`load_documents` reads, found before it reads them.

    Raises:
      ValueError: ``path`` does not exist, is a directory of no text file (each file's
        first 8 KiB are read for a NUL byte), or is a glob that matches no file.
    """
    expanded = os.path.expanduser(path)
    if os.path.isdir(expanded):
        files = _directory_files(expanded)
    else:
        files = _glob_files(expanded, links)
    if not files:
        if not glob.has_magic(expanded):
            raise ValueError(f"data.path {path!r} does not exist (give a directory, a file, a glob "
                             "such as 'corpus/**/*.txt', or '' for the standard library's "
                             "sources)")
        raise ValueError(f"no file matches data.path glob {path!r} (a directory, a glob such as "
                         f"'corpus/**/*.txt', or '' for the standard library's sources)")
    return files


def check_data_path(path: str) -> None:
    """Fails fast for a ``data.path`` that names nothing, reading no file: a path that
    does not exist, or a glob that matches no file (as :func:`data_files` says it). A
    directory is walked, and its files tested for text, only when it is read.

    Raises:
      ValueError: as :func:`data_files`.
    """
    if path and not os.path.isdir(os.path.expanduser(path)):
        data_files(path)


def load_documents(path: str | None, text_field: str = "text",
                   warnings: list | None = None) -> list[tuple[str, bytes]]:
    """Reads a corpus as ``(name, raw bytes)`` documents; empty documents are skipped.

    Args:
      path: ``None`` or ``""`` for the stdlib corpus (:func:`default_corpus_files`,
        names are POSIX paths relative to the stdlib root); a directory, meaning every
        text file below it, recursively (text: no NUL byte in its first 8 KiB; hidden
        files and directories skipped); or a glob (``**`` matches any number of
        directories) of files. Each text file is one document read as raw bytes; a
        ``.jsonl`` file holds one JSON object per non-blank line, whose ``text_field``
        string (UTF-8 encoded) is one document named ``"file:line"``. Files are taken in
        sorted path order; directories a glob matches are not expanded. Each real file
        is read once, however many paths (symbolic links) lead to it, and binary files
        (a NUL byte in the first 8 KiB) are skipped, both with a warning.
      text_field: the ``.jsonl`` field holding the text.
      warnings: a list that gets a sentence for each thing skipped (repeated files,
        links that loop, binary files).

    Returns:
      Documents in a deterministic order.

    Raises:
      ValueError: no file matches ``path`` (or no text file does); a ``.jsonl`` line is not valid
        JSON or lacks a string ``text_field`` (names the file and line number).
    """
    if not path:
        root = pathlib.Path(sysconfig.get_paths()["stdlib"])
        docs = [(p.relative_to(root).as_posix(), p.read_bytes())
                for p in default_corpus_files()]
        return [d for d in docs if d[1]]
    warnings = warnings if warnings is not None else []
    links: list = []
    found = data_files(path, links)
    warnings.extend(_walked_once_warning(path, links))
    files = _unique_text_files(path, found, warnings)
    docs = []
    for file in files:
        if file.lower().endswith(".jsonl"):
            docs.extend(_jsonl_documents(file, text_field))
        else:
            with open(file, "rb") as f:
                docs.append((file, f.read()))
    return [d for d in docs if d[1]]


def _eval_score(name: str) -> float:
    # crc32 is stable across processes and machines, unlike hash() of a str.
    return zlib.crc32(name.encode("utf-8")) / 2**32


def split_documents(docs: Sequence[tuple[str, bytes]],
                    eval_fraction: float) -> tuple[list, list]:
    """Splits documents into train and eval by a stable hash of their names.

    A document goes to eval iff ``zlib.crc32(name.encode()) / 2**32 <
    eval_fraction``. The choice depends only on the name, so it is the same on
    every machine and run, and adding or removing documents never moves the
    others to the other split. Each split keeps the input order. The eval share
    is ``eval_fraction`` of the documents in expectation, not exactly.

    Args:
      docs: ``(name, bytes)`` documents.
      eval_fraction: in ``[0, 1)``; 0 puts every document in train.

    Returns:
      ``(train_docs, eval_docs)``, disjoint, together all of ``docs``.

    Raises:
      ValueError: ``eval_fraction`` is outside ``[0, 1)``.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    train, evals = [], []
    for doc in docs:
        (evals if _eval_score(doc[0]) < eval_fraction else train).append(doc)
    return train, evals


class TokenStream:
    """A packed token stream viewed as non-overlapping windows of ``seq_len + 1``.

    Window ``i`` is ``tokens[i * (seq_len + 1) : (i + 1) * (seq_len + 1)]``; its
    first ``seq_len`` tokens are model inputs and its last ``seq_len`` the
    next-token targets. The tail shorter than a window is dropped. Tokens are
    stored once, as uint16 (2 bytes/token; the stdlib is ~30 M byte tokens, ~60 MB) or
    uint32 where an id needs it; a uint16/uint32 array (a ``np.memmap`` of a
    pre-tokenized file included) is used as it is, not copied. Windows are sliced on
    demand, so the stream is a grain random-access source.

    Args:
      tokens: 1-D array of non-negative integer ids.
      seq_len: model sequence length (> 0).

    Raises:
      ValueError: ``seq_len <= 0``, ``tokens`` is not 1-D, or it holds fewer than
        ``seq_len + 1`` tokens (the message gives both counts).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int):
        if not isinstance(seq_len, (int, np.integer)) or seq_len <= 0:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
        if tokens.size < seq_len + 1:
            raise ValueError(
                f"corpus has {tokens.size} tokens, fewer than the seq_len + 1 = "
                f"{seq_len + 1} needed for one sequence")
        self.seq_len = int(seq_len)
        if tokens.dtype not in (np.uint16, np.uint32):
            wide = tokens.size and int(tokens.max()) >= 2**16
            tokens = tokens.astype(np.uint32 if wide else np.uint16)
        self.tokens = tokens
        n = tokens.size // (seq_len + 1)
        self._windows = self.tokens[: n * (seq_len + 1)].reshape(n, seq_len + 1)

    @classmethod
    def from_documents(cls, docs: Sequence[tuple[str, bytes]], seq_len: int, *,
                       max_tokens: int | None = None) -> "TokenStream":
        """Packs documents, each followed by EOS (256), into one stream.

        Args:
          docs: ``(name, bytes)`` documents in order; every byte is one token.
          seq_len: model sequence length.
          max_tokens: keep only the first ``max_tokens`` tokens of the packed
            stream (``None`` or 0: all); documents past the cap are never copied.

        Returns:
          The stream.

        Raises:
          ValueError: as for the constructor, or ``max_tokens < 0``.
        """
        if max_tokens is not None and max_tokens < 0:
            raise ValueError(f"max_tokens must be None or >= 0, got {max_tokens}")
        max_tokens = max_tokens or None
        kept, total = [], 0
        for _, data in docs:
            if max_tokens is not None and total >= max_tokens:
                break
            kept.append(data)
            total += len(data) + 1
        lengths = np.fromiter((len(d) for d in kept), dtype=np.int64, count=len(kept))
        eos_at = np.cumsum(lengths + 1) - 1
        tokens = np.empty(total, dtype=np.uint16)
        is_byte = np.ones(total, dtype=bool)
        is_byte[eos_at] = False
        tokens[is_byte] = np.frombuffer(b"".join(kept), dtype=np.uint8)
        tokens[eos_at] = ByteTokenizer.eos_id
        return cls(tokens[:max_tokens], seq_len)

    @classmethod
    def from_token_documents(cls, docs: Sequence[tuple[str, np.ndarray]], seq_len: int, *,
                             max_tokens: int | None = None) -> "TokenStream":
        """Packs tokenized documents (each already ending in its EOS) into one stream.

        Args:
          docs: ``(name, ids)`` documents in order, ``ids`` a 1-D integer array.
          seq_len: model sequence length.
          max_tokens: keep only the first ``max_tokens`` tokens (``None`` or 0: all).

        Raises:
          ValueError: as for the constructor.
        """
        kept, total = [], 0
        for _, ids in docs:
            if max_tokens and total >= max_tokens:
                break
            kept.append(ids)
            total += len(ids)
        dtype = np.uint32 if any(a.dtype.itemsize > 2 and a.size and a.max() >= 2**16
                                 for a in kept) else np.uint16
        tokens = np.concatenate(kept).astype(dtype) if kept else np.zeros(0, dtype)
        return cls(tokens[:max_tokens or None], seq_len)

    @property
    def num_tokens(self) -> int:
        """Tokens in the stream, including the dropped tail."""
        return int(self.tokens.size)

    def __len__(self) -> int:
        return self._windows.shape[0]

    def __getitem__(self, index: int) -> np.ndarray:
        """Returns window ``index`` as int32 ``[seq_len + 1]``."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        return self._windows[index].astype(np.int32)

    def batch(self, window_ids: Any) -> dict[str, np.ndarray]:
        """Gathers windows into a ``{"inputs", "targets"}`` batch.

        Args:
          window_ids: integer array ``[B]`` of window indices.

        Returns:
          ``inputs = w[:, :-1]`` and ``targets = w[:, 1:]`` of the gathered
          windows ``w``, both contiguous int32 ``[B, seq_len]``.
        """
        w = self._windows[np.asarray(window_ids)].astype(np.int32)
        return {"inputs": np.ascontiguousarray(w[:, :-1]),
                "targets": np.ascontiguousarray(w[:, 1:])}


class ShardStream:
    """Windows of several token arrays (pre-tokenized shards, memory-mapped), as one
    random-access source: each shard is a :class:`TokenStream` (windows never cross a
    shard boundary; each shard's tail shorter than a window is dropped) and window ids
    run through the shards in order.

    Raises:
      ValueError: no shard holds one window.
    """

    def __init__(self, arrays: Sequence[np.ndarray], seq_len: int):
        window = seq_len + 1
        self.seq_len = seq_len
        self.parts = [TokenStream(a, seq_len) for a in arrays if a.size >= window]
        if not self.parts:
            total = sum(int(a.size) for a in arrays)
            raise ValueError(f"the token shards hold {total} tokens and none holds the "
                             f"seq_len + 1 = {window} needed for one sequence")
        self._starts = np.cumsum([0] + [len(p) for p in self.parts])
        self._sizes = [int(a.size) for a in arrays]

    @property
    def num_tokens(self) -> int:
        """Tokens in the shards, including the dropped tails."""
        return int(sum(self._sizes))

    def __len__(self) -> int:
        return int(self._starts[-1])

    def batch(self, window_ids: Any) -> dict[str, np.ndarray]:
        """As :meth:`TokenStream.batch`."""
        ids = np.asarray(window_ids).reshape(-1) % len(self)
        part = np.searchsorted(self._starts, ids, side="right") - 1
        w = np.stack([self.parts[p]._windows[i - self._starts[p]] for p, i in zip(part, ids)])
        w = w.astype(np.int32).reshape(len(ids), self.seq_len + 1)
        return {"inputs": np.ascontiguousarray(w[:, :-1]),
                "targets": np.ascontiguousarray(w[:, 1:])}


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
            batches would differ), or its position (``next_index``, global batches
            taken) is not an integer >= 0.
        """
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION \
                or not isinstance(state.get("iterator"), dict):
            raise ValueError(f"not a DataPipeline state (version {_STATE_VERSION}): {state!r}")
        if state.get("fingerprint") != self._fingerprint:
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
        by_score = sorted(docs, key=lambda d: _eval_score(d[0]))
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


TOKEN_SUFFIXES = (".bin", ".npy")
TOKEN_DTYPES = ("uint16", "uint32")


def token_files(path: Optional[str]) -> list:
    """The pre-tokenized shard files ``data.path`` names (a ``.bin`` / ``.npy`` file, a
    glob matching only such files, or a directory holding only such files, recursively,
    hidden ones aside), sorted; ``[]`` when it names text. No file is read.

    Raises:
      ValueError: a glob or a directory holds both token files and other files.
    """
    if not path:
        return []
    expanded = os.path.expanduser(path)
    if os.path.isdir(expanded):
        files, what = _walk_directory(expanded), "directory holds"
    else:
        files, what = _glob_files(expanded), "matches"
    tokens = [f for f in files if f.lower().endswith(TOKEN_SUFFIXES)]
    if tokens and len(tokens) != len(files):
        other = next(f for f in files if not f.lower().endswith(TOKEN_SUFFIXES))
        raise ValueError(f"data.path {path!r} {what} pre-tokenized shards ({tokens[0]}) and "
                         f"other files ({other}); give one kind (e.g. a glob such as "
                         f"'DIR/**/*{os.path.splitext(tokens[0])[1]}')")
    return tokens


def _open_shard(file: str, dtype: str) -> np.ndarray:
    """A shard memory-mapped: a ``.npy`` in its own dtype, a ``.bin`` as flat ``dtype``."""
    if file.lower().endswith(".npy"):
        try:
            array = np.load(file, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise ValueError(f"{file} is not a .npy token shard: {' '.join(str(e).split())[:200]}"
                             ) from None
        if array.ndim != 1 or array.dtype.name not in TOKEN_DTYPES:
            raise ValueError(f"{file} holds a {array.dtype.name} array of shape {array.shape}; a "
                             f"token shard is 1-D {' or '.join(TOKEN_DTYPES)}")
        return array
    size = os.path.getsize(file)
    itemsize = np.dtype(dtype).itemsize
    if size % itemsize:
        raise ValueError(f"{file} has {size} bytes, not a whole number of {dtype} tokens; check "
                         f"data.token_dtype (allowed: {', '.join(TOKEN_DTYPES)})")
    if size == 0:
        return np.zeros(0, dtype)
    return np.memmap(file, dtype=dtype, mode="r")


def _scan_shard(array: np.ndarray, eod: int, chunk: int = 1 << 24) -> tuple:
    """``(max id, end-of-document count)`` of a shard, read in 16 M-token chunks."""
    top, docs = -1, 0
    for start in range(0, array.size, chunk):
        part = np.asarray(array[start:start + chunk])
        top = max(top, int(part.max()))
        docs += int(np.count_nonzero(part == eod))
    return top, docs


def _shard_streams(files, data_config, tokenizer, eod: int, seq_len: int, eval_fraction: float,
                   max_tokens, need_eval: bool):
    """``(train, eval or None, notes, documents)`` of pre-tokenized shards: eval is the
    last ``max(seq_len + 1, eval_fraction * tokens)`` tokens of the last shard."""
    dtype = getattr(data_config, "token_dtype", "uint16") or "uint16"
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"data.token_dtype={dtype!r} is not allowed; it must be one of "
                         f"{', '.join(TOKEN_DTYPES)}")
    arrays = [_open_shard(f, dtype) for f in files]
    documents = 0
    for file, array in zip(files, arrays):
        top, docs = _scan_shard(array, eod)
        documents += docs
        if top >= tokenizer.vocab_size:
            raise ValueError(f"{file} holds token id {top}, outside the vocabulary of "
                             f"data.tokenizer={tokenizer.name!r} ([0, {tokenizer.vocab_size})); "
                             f"set data.tokenizer to the tokenizer that wrote the shards")
    total = sum(int(a.size) for a in arrays)
    window = seq_len + 1
    notes, evals = [], None
    if need_eval:
        held = max(window, math.ceil(eval_fraction * total))
        last = arrays[-1]
        if last.size - held < 0 or total - held < window:
            raise ValueError(f"eval is the last {held} tokens of the last shard {files[-1]}, which "
                             f"holds {last.size} of the {total} tokens; train needs {window} more. "
                             "Add tokens, lower data.seq_len or data.eval_fraction, or set "
                             "data.num_eval_batches=0")
        arrays = arrays[:-1] + [last[:last.size - held]]
        eval_array = last[last.size - held:]
        if max_tokens:
            eval_array = eval_array[:max_tokens]
        evals = TokenStream(eval_array, seq_len)
        notes.append(f"data.path holds pre-tokenized shards: eval is the last {held} of their "
                     f"{total} tokens (the end of {files[-1]}), train the rest")
    if max_tokens:
        capped, left = [], max_tokens
        for a in arrays:
            if left <= 0:
                break
            capped.append(a[:left])
            left -= min(left, a.size)
        arrays = capped
    train = ShardStream(arrays, seq_len)
    return train, evals, notes, documents


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


# The run's seed (the run config's ``seed``): the model's initialisation, the data order
# and the sample all take it.
SEED = Int(0, 2**31 - 2, text="an integer in [0, 2**31 - 1)")


def _say(progress: bool, text: str) -> None:
    """A line on stdout (where the trainer's banner goes) saying what the data pipeline
    is doing (when ``progress``)."""
    if progress:
        print(f"data: {text}", flush=True)


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
      data_config: object with attributes ``path`` (a directory, a glob, token shards,
        ``None``/``""``: the stdlib; see :func:`load_documents`), ``text_field``
        (default ``"text"``), ``seq_len``, ``eval_fraction`` (see
        :func:`split_documents`), ``num_eval_batches`` (0 disables eval), ``max_tokens``
        (``None`` or 0: all; otherwise caps each split's packed stream, for tests and
        tiny runs), and optionally ``tokenizer`` (default ``"bytes"``), ``token_dtype``
        and ``eod_id``.
      global_batch_size: sequences per step over all processes.
      seed: shuffle seed in ``[0, 2**31 - 1)`` (:data:`SEED`, the run config's ``seed``).
      process_index: this process, in ``[0, process_count)``.
      process_count: number of processes sharing each global batch.
      workdir: the run directory, where ``bpe:VOCAB`` keeps its ``tokenizer.json``.
      progress: say on stdout what is being read and whether a BPE is being trained, and
        show a progress bar (stderr) while tokenizing takes longer than 2 s.

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
    num_eval = check_int("data.num_eval_batches", getattr(data_config, "num_eval_batches", 0), 0)
    max_tokens = getattr(data_config, "max_tokens", None)
    if max_tokens is not None:
        max_tokens = check_int("data.max_tokens", max_tokens, 0) or None
    eval_fraction = check_real("data.eval_fraction", getattr(data_config, "eval_fraction", 0.0),
                               0.0, 1.0, hi_open=True)
    spec = getattr(data_config, "tokenizer", "bytes") or "bytes"
    eod_id = getattr(data_config, "eod_id", -1)
    eod_id = -1 if eod_id is None else check_int("data.eod_id", eod_id, -1)

    path = getattr(data_config, "path", None)
    warnings: list = []
    shards = token_files(path)
    trains_bpe = spec.startswith("bpe:") and not (
        workdir is not None and (pathlib.Path(workdir) / "tokenizer.json").is_file())
    if shards:
        _say(progress, f"reading {_count(len(shards), 'pre-tokenized shard')} of data.path "
                       f"{path!r} ({sum(os.path.getsize(f) for f in shards) / 2**20:,.1f} MiB)")
        tokenizer = load_tokenizer(spec, workdir=workdir, eod_id=eod_id, save=index == 0,
                                   train_texts=(None if not spec.startswith("bpe:")
                                                else _no_text(path)))
        eod = tokenizer.eos_id
        train, evals, notes, num_documents = _shard_streams(
            shards, data_config, tokenizer, eod, seq_len, eval_fraction, max_tokens, num_eval > 0)
        starts_mid = True
    else:
        what = f"data.path {path!r}" if path else "the standard library's sources (data.path='')"
        _say(progress, f"reading {what}")
        docs = load_documents(path, getattr(data_config, "text_field", None) or "text", warnings)
        split = split_documents(docs, eval_fraction)
        if trains_bpe:
            size = sum(len(d) for _, d in split[0] or docs)
            _say(progress, f"training a byte-level BPE ({spec}) on {size / 2**20:,.1f} MiB of text")
        tokenizer = load_tokenizer(spec, workdir=workdir, eod_id=eod_id, save=index == 0,
                                   train_texts=lambda: (d for _, d in split[0] or docs))
        tokenized = _tokenize(docs, tokenizer, progress=progress)
        names = {name for name, _ in split[1]}
        tok_split = ([d for d in tokenized if d[0] not in names],
                     [d for d in tokenized if d[0] in names])
        train, evals, notes = _split_streams(tokenized, eval_fraction, seq_len, max_tokens,
                                             need_eval=num_eval > 0, split=tok_split)
        num_documents = len(docs)
        starts_mid = any("held out" in n for n in notes)
    lo, hi = index * batch // count, (index + 1) * batch // count

    eval_batches, eval_tokens, eval_bytes = _EvalBatches(None, 0, 0, 0, 0), 0, None
    if num_eval:
        eval_tokens = evals.num_tokens
        eval_batches = _EvalBatches(evals, num_eval, batch, lo, hi)
        table = getattr(tokenizer, "token_bytes", None)
        if table is not None:
            eval_bytes = tuple(
                int(table[evals.batch(
                    np.arange(k * batch, (k + 1) * batch) % len(evals))["targets"]].sum())
                for k in range(num_eval))
    prompt_source = evals if num_eval else train
    if hasattr(prompt_source, "parts"):
        prompt_source = prompt_source.parts[0]
    prompt_source.starts_mid_document = starts_mid
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
        _fingerprint={"train_windows": len(train), "seq_len": seq_len,
                      "global_batch_size": batch, "seed": seed})


def _no_text(path):
    def fail():
        raise ValueError(f"data.tokenizer='bpe:...' trains on text, but data.path {path!r} holds "
                         "pre-tokenized shards; set data.tokenizer to the tokenizer that wrote "
                         "them")
    return fail


def _tokenize(docs, tokenizer, chunk: int = 1024, progress: bool = False) -> list:
    """``(name, ids)`` of each document, each ending in the tokenizer's EOS; with
    ``progress``, a progress bar over the bytes (tqdm, on stderr) once it has taken 2 s."""
    from tqdm import tqdm
    out = []
    with tqdm(total=sum(len(d) for _, d in docs), desc=f"data: tokenizing ({tokenizer.name})",
              unit="B", unit_scale=True, disable=not progress, file=sys.stderr,
              leave=False, delay=2.0) as bar:
        for start in range(0, len(docs), chunk):
            part = docs[start:start + chunk]
            out.extend(zip((n for n, _ in part), tokenizer.encode_batch([d for _, d in part])))
            bar.update(sum(len(d) for _, d in part))
    return out
