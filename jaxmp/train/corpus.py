"""The corpus: the documents ``data.path`` names and their train/eval split.

Finds and reads the documents (the Python standard library's ``.py`` files by default, a
directory's text files, a glob, ``.jsonl`` files: :func:`load_documents`), finds
pre-tokenized shard files (:func:`token_files`), and splits documents into train and eval
by a stable hash of their names (:func:`split_documents`). A part of the pipeline of
:mod:`jaxmp.train.data`, which re-exports these names.
"""
from __future__ import annotations

import fnmatch
import glob
import json
import os
import pathlib
import sys
import sysconfig
import zlib
from typing import Any, Optional, Sequence

from jaxmp.train import tokenizer as tokenizer_module


_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


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


def _jsonl_documents(file: str, text_field: str,
                     records: bool = False) -> list[tuple[str, Any]]:
    """``(file:line, text bytes)`` of each record; with ``records``, ``(file:line, the
    record)`` (a JSON object, read through :func:`jaxmp.train.packing.encode_examples`)."""
    docs = []
    with open(file, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{file}, line {lineno}: invalid JSON ({e})") from None
            except RecursionError:  # nested deeper than Python's recursion limit
                raise ValueError(f"{file}, line {lineno}: JSON nested too deeply to read (more "
                                 f"than about {sys.getrecursionlimit()} levels); a record is "
                                 f"an object with a string field {text_field!r}") from None
            docs.append((f"{file}:{lineno}", _document(record, text_field, records,
                                                       f"{file}, line {lineno}", line)))
    return docs


def _document(record: Any, text_field: str, records: bool, where: str,
              shown: Any = None) -> Any:
    """What :func:`load_documents` keeps of one record: with ``records`` the record itself
    (an object, every string in it text: :func:`_check_strings`), else its text
    (:func:`_record_text`).

    Raises:
      ValueError: as those, one line naming ``where``.
    """
    if not records:
        return _record_text(record, text_field, where, shown)
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {_shown(record, shown)}")
    _check_strings(record, where)
    return record


def _shown(record: Any, shown: Any = None) -> str:
    """A record in a message: ``shown`` (its line as read) or its JSON, cut to 80
    characters; rendered only for the message."""
    if shown is None:
        shown = json.dumps(record, ensure_ascii=False, default=str)
    return repr(shown[:80])


def _record_text(record: Any, text_field: str, where: str, shown: Any = None) -> bytes:
    """A text record's document: its ``text_field`` string, UTF-8 encoded.

    Raises:
      ValueError: not an object with a string ``text_field``, or one that is not text (an
        unpaired surrogate escape): one line naming ``where`` and the record (``shown``,
        else its JSON).
    """
    if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
        raise ValueError(f"{where}: expected a JSON object with a string field "
                         f"{text_field!r}, got {_shown(record, shown)}")
    try:
        return record[text_field].encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate escape such as "\ud800"
        raise ValueError(f"{where}: field {text_field!r} is not text ({e.reason} at character "
                         f"{e.start}: an unpaired \\u{ord(e.object[e.start]):04x} "
                         f"escape)") from None


# Files read as records (one document or example each), whatever their bytes look like.
RECORD_SUFFIXES = (".jsonl", ".parquet")


def _parquet_documents(file: str, text_field: str,
                       records: bool = False) -> list[tuple[str, Any]]:
    """:func:`_jsonl_documents` of a Parquet file: each row a record named ``file:ROW``
    (rows counted from 1), read with pyarrow (``RecordBatch.to_pylist``) a batch of rows at
    a time. Null fields are left out of a row's record and of the objects within it (the
    messages of a conversation), so that a file whose columns and structs carry every
    field on every row gives each record the fields it has, as JSON lines would.

    Raises:
      ValueError: pyarrow is not installed (the train extra's), the file is not Parquet,
        or a row is not a record of text (:func:`_record_text`): one line naming it.
    """
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{file}: reading Parquet needs pyarrow, the train extra's: "
                         f"pip install -e \".[train]\"") from None
    return [(f"{file}:{row}", _document(_without_nulls(record), text_field, records,
                                        f"{file}, row {row}"))
            for row, record in enumerate(_parquet_rows(pq, file), start=1)]


def _without_nulls(x: Any) -> Any:
    """``x`` with every null field of every object in it left out (lists kept whole)."""
    if isinstance(x, dict):
        return {k: _without_nulls(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [_without_nulls(v) for v in x]
    return x


def _parquet_rows(pq, file: str):
    """The rows of a Parquet file as dicts, a batch of rows read at a time; pyarrow's own
    errors (a file that is not Parquet, a damaged page) as one line naming the file."""
    try:
        batches = pq.ParquetFile(file).iter_batches(batch_size=1024)
        while True:
            try:
                rows = next(batches).to_pylist()
            except StopIteration:
                return
            yield from rows
    except Exception as e:  # noqa: BLE001 - pyarrow's errors: ArrowInvalid, OSError, ...
        raise ValueError(f"{file}: not a readable Parquet file "
                         f"({' '.join(str(e).split())[:200]})") from None


def _where(name: str) -> str:
    """A record's place in words: ``file, line N`` (JSON lines) or ``file, row N``."""
    file, _, number = name.rpartition(":")
    return f"{file}, {'row' if file.lower().endswith('.parquet') else 'line'} {number}"


def text_documents(records: Sequence[tuple[str, Any]], text_field: str) -> list[tuple[str, bytes]]:
    """The documents :func:`load_documents` gives of a corpus that it read with
    ``records=True`` (no second read of the files): each JSON-lines record's
    ``text_field`` encoded, other files' bytes as they are; empty ones left out.

    Raises:
      ValueError: a record without a string ``text_field``, named by file and line.
    """
    docs = []
    for name, record in records:
        if isinstance(record, dict):
            record = _record_text(record, text_field, _where(name))
        docs.append((name, record))
    return [d for d in docs if d[1]]


def _check_strings(record: Any, where: str) -> None:
    """Every string in a parsed record encodes as UTF-8 (JSON allows an unpaired surrogate
    escape such as ``\\ud800``, which no tokenizer can take): else one line naming it."""
    stack = [record]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"{where}: a string is not text ({e.reason} at character "
                                 f"{e.start}: an unpaired \\u{ord(x[e.start]):04x} "
                                 f"escape)") from None
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)


def _is_text_file(path: str) -> bool:
    """No NUL byte in the first 8 KiB: git's rule for telling text from binary files."""
    with open(path, "rb") as f:
        return b"\0" not in f.read(8192)


def _is_data_file(path: str) -> bool:
    """A file the corpus reads: a Parquet file (binary, read by pyarrow), or a text file
    (:func:`_is_text_file`)."""
    return path.lower().endswith(".parquet") or _is_text_file(path)


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
    """Every text (or Parquet) file below ``root``, recursively, sorted; hidden files and directories
    (names starting with ``.``) and ``__pycache__`` are skipped, symlinked directories not
    followed.

    Raises:
      ValueError: no text file is found (the message counts what was skipped).
    """
    found, skipped = [], 0
    for file in _walk_directory(root):
        if _is_data_file(file):
            found.append(file)
        else:
            skipped += 1
    if not found:
        raise ValueError(f"data.path directory {root!r} holds no text file ({skipped} binary "
                         f"file(s) skipped); give a directory of text files, a glob such as "
                         f"'{root}/**/*.txt', or .jsonl / .parquet files")
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
    text = [f for f in kept if _is_data_file(f)]
    binary = [f for f in kept if f not in set(text)]
    if not text:
        raise ValueError(f"data.path {path!r} matches no text file ({len(binary)} binary file(s), "
                         f"e.g. {binary[0]!r}: a NUL byte in its first 8 KiB); give text files, a "
                         f"directory of them, or .jsonl / .parquet files")
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
                   warnings: list | None = None,
                   progress: bool = False, records: bool = False) -> list[tuple[str, Any]]:
    """Reads a corpus as ``(name, raw bytes)`` documents; empty documents are skipped.

    Args:
      path: ``None`` or ``""`` for the stdlib corpus (:func:`default_corpus_files`,
        names are POSIX paths relative to the stdlib root); a directory, meaning every
        text file below it, recursively (text: no NUL byte in its first 8 KiB; hidden
        files and directories skipped); or a glob (``**`` matches any number of
        directories) of files. Each text file is one document read as raw bytes; a
        ``.jsonl`` file holds one JSON object per non-blank line, whose ``text_field``
        string (UTF-8 encoded) is one document named ``"file:line"``, and a ``.parquet``
        file one per row, named ``"file:row"`` (:func:`_parquet_documents`). Files are
        taken in sorted path order; directories a glob matches are not expanded. Each real
        file is read once, however many paths (symbolic links) lead to it, and binary
        files (a NUL byte in the first 8 KiB; Parquet files excepted) are skipped, both
        with a warning.
      text_field: the ``.jsonl`` or Parquet field holding the text.
      warnings: a list that gets a sentence for each thing skipped (repeated files,
        links that loop, binary files).
      progress: a progress bar over the files read (tqdm, on stderr) once reading them
        has taken ``PROGRESS_DELAY_S`` (:mod:`jaxmp.train.tokenizer`).
      records: a ``.jsonl`` line or a Parquet row is returned as its record (a parsed JSON
        object; chat or prompt_completion examples, :mod:`jaxmp.train.packing`), every
        string in it checked to be text, and kept however few fields it has (its format is
        checked where it is read); other files as bytes.

    Returns:
      Documents in a deterministic order.

    Raises:
      ValueError: no file matches ``path`` (or no text file does); a Parquet file that
        does not read; a ``.jsonl`` line (Parquet row) is not valid
        JSON, lacks a string ``text_field`` or holds one that is not text (an unpaired
        surrogate escape); the message names the file and line number.
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
    from tqdm import tqdm
    for file in tqdm(files, desc="data: reading files", unit=" files", disable=not progress,
                     file=sys.stderr, leave=True, delay=tokenizer_module.PROGRESS_DELAY_S):
        if file.lower().endswith(".jsonl"):
            docs.extend(_jsonl_documents(file, text_field, records))
        elif file.lower().endswith(".parquet"):
            docs.extend(_parquet_documents(file, text_field, records))
        else:
            with open(file, "rb") as f:
                docs.append((file, f.read()))
    return [d for d in docs if not isinstance(d[1], bytes) or d[1]]  # a record is kept: checked


def eval_score(name: str) -> float:
    """Where document ``name`` falls in ``[0, 1)``: below ``eval_fraction``, it is an eval
    document (:func:`split_documents`)."""
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
        (evals if eval_score(doc[0]) < eval_fraction else train).append(doc)
    return train, evals


TOKEN_SUFFIXES = (".bin", ".npy")


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
