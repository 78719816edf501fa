"""Tokenizers of the trainer: bytes, a Hugging Face ``tokenizer.json``, a SentencePiece
``.model``, or a byte-level BPE trained on the training split (``data.tokenizer``).

Every tokenizer has ``name``, ``vocab_size``, ``eos_id`` (the end-of-document token the
packed stream puts after every document), ``encode(text, add_eos=True)``,
``encode_batch(texts)``, ``decode(ids)`` and ``token_bytes``: an int64 ``[vocab_size]``
array of the UTF-8 bytes each token stands for (0 for special tokens), or None when the
tokenizer cannot say exactly (then bits per byte is not reported).

:func:`load_tokenizer` reads ``data.tokenizer``:

* ``"bytes"`` (default): :class:`ByteTokenizer`, 256 bytes + end-of-document;
* a path ending in ``.json``: a Hugging Face ``tokenizers`` file (:class:`HFTokenizer`);
* a path ending in ``.model``: a SentencePiece model (:class:`SentencePieceTokenizer`);
* ``"bpe:VOCAB"``: a byte-level BPE of ``VOCAB`` tokens (``<|endoftext|>`` included)
  trained with ``tokenizers`` on the training documents (GPT-2's byte-level scheme,
  Radford et al. 2019), saved as ``WORKDIR/tokenizer.json`` and read back from there on
  resume, so a resumed run tokenizes as the first one did. It is trained on at most
  :data:`BPE_TRAIN_BYTES` (an even sample of a larger corpus), given in pieces of at most
  :data:`PIECE_BYTES` (:func:`text_pieces`): bounded in time and memory.

Text tokenizers (all but bytes) see each document decoded as UTF-8 with
``errors="replace"``: invalid UTF-8 becomes U+FFFD before tokenization.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
import sys
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np

__all__ = ["ByteTokenizer", "HFTokenizer", "SentencePieceTokenizer", "load_tokenizer",
           "train_bpe", "TOKENIZER_FILE", "EOS_CANDIDATES", "round_vocab", "text_pieces",
           "bpe_sample", "BPE_TRAIN_BYTES", "PIECE_BYTES"]

TOKENIZER_FILE = "tokenizer.json"
# The smallest byte-level BPE: the 256 byte values and <|endoftext|>.
BPE_MIN_VOCAB = 257
# End-of-document tokens looked for in a tokenizer.json, in this order.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "<|im_end|>")


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Writes ``data`` to ``path`` through a temporary file in the same directory, flushed
    and renamed over ``path`` (``os.replace`` is atomic on POSIX): a reader, or a rerun
    after a kill, finds the old file or the whole new one."""
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _check_file(path: str | os.PathLike) -> None:
    """Raises ValueError unless ``path`` is a regular file (not opened: a named pipe there
    would block the reader)."""
    if not os.path.exists(path):
        raise ValueError(f"data.tokenizer file {str(path)!r} does not exist")
    if not os.path.isfile(path):
        raise ValueError(f"data.tokenizer {str(path)!r} is not a regular file (a directory, a "
                         f"named pipe or a device)")


def _digest(content: bytes, eos_id: int) -> str:
    return hashlib.sha256(content + f"\neos={int(eos_id)}".encode()).hexdigest()


def round_vocab(n: int, multiple: int = 128) -> int:
    """``n`` rounded up to a multiple of 128 (tensor-core friendly embedding rows)."""
    return -(-int(n) // multiple) * multiple


def _as_text(text: str | bytes) -> str:
    if isinstance(text, str):
        return text
    if isinstance(text, (bytes, bytearray, memoryview)):
        return bytes(text).decode("utf-8", errors="replace")
    raise TypeError(f"encode expects str or bytes, got {type(text).__name__}")


def _check_ids(ids: Any, vocab_size: int) -> np.ndarray:
    ids = np.asarray(ids).reshape(-1)
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got dtype {ids.dtype}")
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        raise ValueError(f"token id {ids[bad][0]} is outside [0, {vocab_size})")
    return ids


class ByteTokenizer:
    """Tokenizer whose tokens are raw bytes plus one end-of-document token.

    Ids ``0..255`` are the bytes themselves, so any file, valid UTF-8 or not, is
    tokenized losslessly without decoding; id ``256`` (``eos_id``) marks the end
    of a document. Nothing is downloaded (the ByT5 / nanoGPT "byte-level" idea,
    without ByT5's special-token offset).

    Attributes:
      vocab_size: 257 (256 byte values + EOS).
      eos_id: 256.
    """

    vocab_size: int = 257
    eos_id: int = 256
    name: str = "bytes"

    def digest(self) -> str:
        """SHA-256 naming the byte tokenizer (it has no file)."""
        return _digest(b"bytes", self.eos_id)

    def encode(self, text: str | bytes, *, add_eos: bool = True) -> np.ndarray:
        """Returns the token ids of ``text`` as one document.

        Args:
          text: a ``str`` (encoded as UTF-8) or raw ``bytes`` (used as they are,
            so invalid UTF-8 survives unchanged).
          add_eos: append ``eos_id`` after the bytes, as the packed corpus does
            after every document; pass ``False`` for a prompt to be continued.

        Returns:
          int32 array ``[num_bytes (+1)]`` with values in ``[0, 257)``.

        Raises:
          TypeError: ``text`` is neither ``str`` nor bytes-like.
        """
        if isinstance(text, str):
            text = text.encode("utf-8")
        elif not isinstance(text, (bytes, bytearray, memoryview)):
            raise TypeError(f"encode expects str or bytes, got {type(text).__name__}")
        ids = np.frombuffer(bytes(text), dtype=np.uint8).astype(np.int32)
        if add_eos:
            ids = np.append(ids, np.int32(self.eos_id))
        return ids

    def encode_batch(self, texts: Sequence[str | bytes]) -> list:
        """:meth:`encode` (with EOS) of each text, as uint16 arrays."""
        return [np.append(np.frombuffer(bytes(t) if not isinstance(t, str) else t.encode("utf-8"),
                                        np.uint8).astype(np.uint16), np.uint16(self.eos_id))
                for t in texts]

    def decode(self, ids: Any) -> str:
        """Returns the text of token ids, dropping every EOS token.

        The remaining bytes are decoded as UTF-8 with ``errors="replace"``: each
        undecodable byte sequence becomes U+FFFD (the replacement character), so
        decoding never fails but is lossless only for valid UTF-8.

        Args:
          ids: integer array-like of any shape (flattened), values in ``[0, 257)``.

        Returns:
          The decoded string.

        Raises:
          ValueError: ``ids`` is not integer or holds a value outside ``[0, 257)``.
        """
        ids = _check_ids(ids, self.vocab_size)
        data = ids[ids != self.eos_id].astype(np.uint8).tobytes()
        return data.decode("utf-8", errors="replace")

    @functools.cached_property
    def token_bytes(self) -> np.ndarray:
        """1 byte per byte token, 0 for EOS."""
        out = np.ones(self.vocab_size, np.int64)
        out[self.eos_id] = 0
        return out

    def save(self, directory: str | os.PathLike) -> Optional[pathlib.Path]:
        """Nothing to save (the scheme is fixed); returns None."""
        return None

    def to_hf(self):
        """The same tokenizer as a Hugging Face ``tokenizers.Tokenizer`` (for
        ``tokenizer.json``, ``--format hf`` exports): GPT-2's byte-level alphabet
        (:func:`_byte_level_alphabet`) as a BPE without merges, so each byte is its own id
        ``0..255``, and ``<|endoftext|>`` a special token with id 256 (``eos_id``).

        Returns:
          ``tokenizers.Tokenizer`` whose ``encode(text).ids`` are :meth:`encode`'s without EOS.
        """
        import tokenizers
        from tokenizers import decoders, models, pre_tokenizers

        vocab = {ch: b for ch, b in _byte_level_alphabet().items()}
        tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([tokenizers.AddedToken("<|endoftext|>", special=True)])
        return tok


@functools.lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict:
    """GPT-2's ``bytes_to_unicode`` inverted: the character each byte is written as in a
    byte-level BPE vocabulary -> the byte (Radford et al. 2019, openai/gpt-2 encoder.py)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` (a ``tokenizer.json``).

    Args:
      tokenizer: a ``tokenizers.Tokenizer``.
      name: how it is shown (its path, or ``bpe:VOCAB``).
      eos_id: the end-of-document token; None finds the first of :data:`EOS_CANDIDATES`.

    Raises:
      ValueError: no end-of-document token (the message says to set ``data.eod_id``),
        or ``eos_id`` outside the vocabulary.
    """

    def __init__(self, tokenizer, name: str, eos_id: Optional[int] = None):
        self.tokenizer, self.name = tokenizer, name
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        if eos_id is None:
            found = [tokenizer.token_to_id(t) for t in EOS_CANDIDATES]
            found = [i for i in found if i is not None]
            if not found:
                raise ValueError(f"tokenizer {name!r} has none of the end-of-document tokens "
                                 f"{', '.join(EOS_CANDIDATES)}; set data.eod_id to its id")
            eos_id = found[0]
        if not 0 <= eos_id < self.vocab_size:
            raise ValueError(f"data.eod_id={eos_id} is outside tokenizer {name!r}'s vocabulary "
                             f"[0, {self.vocab_size})")
        self.eos_id = int(eos_id)

    @classmethod
    def from_file(cls, path: str | os.PathLike, eos_id: Optional[int] = None) -> "HFTokenizer":
        """Reads a ``tokenizer.json``.

        Raises:
          ValueError: the file does not exist or is not a tokenizer file.
        """
        import tokenizers
        _check_file(path)
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own Exception type
            raise ValueError(f"data.tokenizer {str(path)!r} is not a Hugging Face tokenizer.json "
                             f"({' '.join(str(e).split())[:160]})") from None
        return cls(tok, str(path), eos_id)

    def encode(self, text: str | bytes, *, add_eos: bool = True) -> np.ndarray:
        """Token ids (int32 ``[n (+1)]``) of one document, no special tokens added but EOS."""
        ids = self.tokenizer.encode(_as_text(text), add_special_tokens=False).ids
        return np.asarray(ids + ([self.eos_id] if add_eos else []), np.int32)

    def encode_batch(self, texts: Sequence[str | bytes]) -> list:
        """:meth:`encode` (with EOS) of each text, in parallel (the library's threads), as
        uint32 arrays."""
        encs = self.tokenizer.encode_batch([_as_text(t) for t in texts], add_special_tokens=False)
        return [np.asarray(e.ids + [self.eos_id], np.uint32) for e in encs]

    def decode(self, ids: Any) -> str:
        """The text of ``ids``, EOS and other special tokens dropped.

        Raises:
          ValueError: an id outside ``[0, vocab_size)``.
        """
        ids = _check_ids(ids, self.vocab_size)
        return self.tokenizer.decode([int(i) for i in ids if i != self.eos_id],
                                     skip_special_tokens=True)

    @functools.cached_property
    def token_bytes(self) -> Optional[np.ndarray]:
        """Exact for a byte-level tokenizer (its ``decoder`` is ``ByteLevel``): each
        token's characters are bytes in GPT-2's alphabet; special tokens count 0. None
        for any other kind (its pieces do not map one to one onto bytes)."""
        spec = json.loads(self.tokenizer.to_str())
        if (spec.get("decoder") or {}).get("type") != "ByteLevel":
            return None
        alphabet = _byte_level_alphabet()
        special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        out = np.zeros(self.vocab_size, np.int64)
        for token, i in self.tokenizer.get_vocab(with_added_tokens=True).items():
            if i in special:
                continue
            if not all(ch in alphabet for ch in token):
                return None
            out[i] = len(token)
        return out

    def save(self, directory: str | os.PathLike) -> pathlib.Path:
        """Writes ``directory/tokenizer.json`` atomically (a temporary file renamed over
        it: a kill while writing leaves the old file or none, never a torn one); returns
        its path."""
        path = pathlib.Path(directory) / TOKENIZER_FILE
        write_atomic(path, self.tokenizer.to_str(pretty=True).encode("utf-8"))
        return path

    def digest(self) -> str:
        """SHA-256 of the tokenizer (its JSON) and its end-of-document id."""
        return _digest(self.tokenizer.to_str().encode("utf-8"), self.eos_id)


class SentencePieceTokenizer:
    """A SentencePiece model (a ``.model`` file; Kudo and Richardson 2018).

    Args:
      path: the ``.model`` file.
      eos_id: the end-of-document token; None takes the model's ``eos_id()``.

    Raises:
      ValueError: the file does not exist or does not load, or there is no
        end-of-document token.
    """

    def __init__(self, path: str | os.PathLike, eos_id: Optional[int] = None):
        import sentencepiece as spm
        _check_file(path)
        self.path = pathlib.Path(path)
        self.name = str(path)
        self.model_proto = self.path.read_bytes()
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.LoadFromSerializedProto(self.model_proto)
        except Exception as e:
            raise ValueError(f"data.tokenizer {str(path)!r} is not a SentencePiece model "
                             f"({' '.join(str(e).split())[:160]})") from None
        self.vocab_size = int(self.sp.get_piece_size())
        eos_id = self.sp.eos_id() if eos_id is None else eos_id
        if eos_id is None or eos_id < 0:
            raise ValueError(f"SentencePiece model {str(path)!r} has no end-of-document (eos) "
                             f"piece; set data.eod_id to the id to use")
        if eos_id >= self.vocab_size:
            raise ValueError(f"data.eod_id={eos_id} is outside {str(path)!r}'s vocabulary "
                             f"[0, {self.vocab_size})")
        self.eos_id = int(eos_id)

    def encode(self, text: str | bytes, *, add_eos: bool = True) -> np.ndarray:
        """Token ids (int32 ``[n (+1)]``) of one document."""
        ids = self.sp.encode(_as_text(text))
        return np.asarray(ids + ([self.eos_id] if add_eos else []), np.int32)

    def encode_batch(self, texts: Sequence[str | bytes]) -> list:
        """:meth:`encode` (with EOS) of each text, as uint32 arrays."""
        return [np.asarray(ids + [self.eos_id], np.uint32)
                for ids in self.sp.encode([_as_text(t) for t in texts])]

    def decode(self, ids: Any) -> str:
        """The text of ``ids``, EOS dropped.

        Raises:
          ValueError: an id outside ``[0, vocab_size)``.
        """
        ids = _check_ids(ids, self.vocab_size)
        return self.sp.decode([int(i) for i in ids if i != self.eos_id])

    token_bytes = None  # the dummy-prefix space makes piece lengths inexact

    def to_hf(self):
        """The same tokenizer as a Hugging Face ``tokenizers.Tokenizer`` (for
        ``tokenizer.json``, ``--format hf`` exports), built from the model's protobuf
        (``sentencepiece_model.proto``) with no transformers import:

        - the model: a ``Unigram`` of the pieces and their scores, or a ``BPE`` of the
          pieces whose merges are every split of a normal piece into two pieces, ranked by
          the merged piece's id, then the parts' ids (SentencePiece's BPE merges the
          highest-scoring pair, and its BPE scores fall with the id); byte fallback and the
          unknown piece as the model has them;
        - the normalizer: the model's precompiled character map, then, where
          ``remove_extra_whitespaces`` is on, spaces removed at both ends and runs of
          spaces made one (SentencePiece's ``normalizer.cc``);
        - the pre-tokenizer: ``Metaspace`` (spaces become ``▁``; a ``▁`` in front where
          ``add_dummy_prefix``; split at each ``▁`` where ``split_by_whitespace``);
        - the decoder: ``▁`` back to spaces, byte pieces back to bytes, the dummy prefix
          dropped;
        - control and unknown pieces (``<s>``, ``</s>``, ``<unk>``) as special tokens and
          user-defined pieces as added tokens, as transformers' own conversion
          (``convert_slow_tokenizer.SpmConverter``) has them.

        What differs from SentencePiece: text that spells a control piece (``</s>``) is
        that token here, where SentencePiece splits it; a Unigram model's segmentations
        whose log-probabilities are within 1e-2 of each other may be broken the other way
        (SentencePiece's encoder is not always the Viterbi best: one case seen was 0.0012
        below it; a BPE model matched every token, ``tests/test_hf.py``); an unknown piece
        decodes to nothing here and to `` ⁇ `` in SentencePiece.

        Returns:
          ``tokenizers.Tokenizer`` whose ``encode(text, add_special_tokens=False).ids`` are
          :meth:`encode`'s without EOS, but as above.

        Raises:
          ValueError: a model that has no exact counterpart (a ``word`` or ``char`` model,
            ``treat_whitespace_as_suffix``, ``escape_whitespaces`` off), naming the field.
        """
        import tokenizers
        from sentencepiece import sentencepiece_model_pb2 as pb
        from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers

        proto = pb.ModelProto()
        proto.ParseFromString(self.model_proto)
        trainer, norm = proto.trainer_spec, proto.normalizer_spec
        kind = pb.TrainerSpec.ModelType.Name(trainer.model_type).lower()
        for bad, field in ((kind not in ("unigram", "bpe"), f"trainer_spec.model_type={kind}"),
                           (trainer.treat_whitespace_as_suffix,
                            "trainer_spec.treat_whitespace_as_suffix=true"),
                           (not norm.escape_whitespaces, "normalizer_spec.escape_whitespaces=false")):
            if bad:
                raise ValueError(f"SentencePiece model {self.name!r} has {field}, which no Hugging "
                                 f"Face tokenizer reproduces exactly (allowed: unigram or bpe "
                                 f"models with whitespace as a prefix, escaped)")
        piece_type = pb.ModelProto.SentencePiece
        pieces = [(p.piece, p.score, p.type) for p in proto.pieces]
        if kind == "unigram":
            model = models.Unigram([(p, s) for p, s, _ in pieces], trainer.unk_id,
                                   trainer.byte_fallback)
        else:
            ids = {p: i for i, (p, _, _) in enumerate(pieces)}
            merges = []
            for p, _, t in pieces:
                if t == piece_type.NORMAL:
                    splits = sorted((ids[p[:k]], ids[p[k:]]) for k in range(1, len(p))
                                    if p[:k] in ids and p[k:] in ids)
                    merges += [(pieces[a][0], pieces[b][0]) for a, b in splits]
            model = models.BPE(ids, merges, unk_token=pieces[trainer.unk_id][0], fuse_unk=True,
                               byte_fallback=trainer.byte_fallback)
        tok = tokenizers.Tokenizer(model)
        steps = [normalizers.Precompiled(norm.precompiled_charsmap)] if norm.precompiled_charsmap \
            else []
        if norm.remove_extra_whitespaces:
            steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""),
                      normalizers.Replace(Regex(" {2,}"), " ")]
        if steps:
            tok.normalizer = normalizers.Sequence(steps)
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="always" if norm.add_dummy_prefix else "never",
            split=trainer.split_by_whitespace)
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
            + ([decoders.Strip(" ", 1, 0)] if norm.add_dummy_prefix else []))
        tok.add_special_tokens([tokenizers.AddedToken(p, special=True, normalized=False)
                                for p, _, t in pieces
                                if t in (piece_type.CONTROL, piece_type.UNKNOWN)])
        tok.add_tokens([tokenizers.AddedToken(p, special=False, normalized=False)
                        for p, _, t in pieces if t == piece_type.USER_DEFINED])
        return tok

    def save(self, directory: str | os.PathLike) -> pathlib.Path:
        """Writes ``directory/tokenizer.model``; returns its path."""
        path = pathlib.Path(directory) / "tokenizer.model"
        write_atomic(path, self.model_proto)
        return path

    def digest(self) -> str:
        """SHA-256 of the model's protobuf and its end-of-document id."""
        return _digest(self.model_proto, self.eos_id)


# A byte-level BPE is trained on at most this many bytes of the training documents, an
# even sample of them when there are more (64 MiB: far more than a vocabulary of tens of
# thousands of merges needs; GPT-2's 50k merges came from 40 GB, but their counts settle
# long before), so that its time and memory are bounded whatever the corpus.
BPE_TRAIN_BYTES = 64 << 20
# Text is handed to the BPE trainer and to the tokenizers in pieces of at most this many
# bytes: the ``tokenizers`` trainer holds about 80 bytes per byte of one text it is given
# (a 200 MB single-line file took 7.4 GB), per piece it holds only the piece's.
PIECE_BYTES = 1 << 16
# A progress bar (stderr) appears once a phase has taken this long.
PROGRESS_DELAY_S = 2.0


def text_pieces(text: str | bytes, max_bytes: int = PIECE_BYTES) -> Iterable[str | bytes]:
    """``text`` cut into consecutive pieces of at most ``max_bytes`` (bytes, or characters
    of a ``str``), each cut just before the last space or line break of its window, so a
    pre-tokenizer that splits words there (GPT-2's byte-level one, SentencePiece's) sees
    the same words in the pieces as in the whole; a window without either is cut at its
    end (for bytes, moved back to a UTF-8 character boundary).

    Yields:
      Slices of ``text`` (its own type) whose concatenation is ``text``, one at a time.
    """
    if len(text) <= max_bytes:
        yield text
        return
    space, newline = (" ", "\n") if isinstance(text, str) else (b" ", b"\n")
    lo = 0
    while len(text) - lo > max_bytes:
        hi = lo + max_bytes
        cut = max(text.rfind(space, lo + 1, hi + 1), text.rfind(newline, lo + 1, hi + 1))
        if cut <= lo:
            cut = hi
            if not isinstance(text, str):
                while cut > lo + 1 and text[cut] & 0xC0 == 0x80:  # a UTF-8 continuation byte
                    cut -= 1
        yield text[lo:cut]
        lo = cut
    yield text[lo:]


def bpe_sample(texts: Sequence[str | bytes], max_bytes: int = BPE_TRAIN_BYTES,
               piece_bytes: int = PIECE_BYTES) -> Iterable[str | bytes]:
    """The pieces (:func:`text_pieces`) of ``texts`` a BPE is trained on: all of them when
    they hold at most ``max_bytes`` bytes, else an even, deterministic sample of them of
    about ``max_bytes`` (piece ``j`` of ``n`` is kept when ``floor((j + 1) * r)`` exceeds
    ``floor(j * r)``, ``r = max_bytes / total``), so every part of the corpus is seen."""
    return (piece for piece, kept in _sampled(texts, max_bytes, piece_bytes) if kept)


def _sampled(texts, max_bytes: int, piece_bytes: int):
    """``(piece, kept)`` of every piece of ``texts``, in order (:func:`bpe_sample`)."""
    total = sum(len(t) for t in texts)
    ratio = min(1.0, max_bytes / total) if total else 1.0
    j = 0
    for text in texts:
        for piece in text_pieces(text, piece_bytes):
            yield piece, ratio >= 1.0 or int((j + 1) * ratio) > int(j * ratio)
            j += 1


def train_bpe(texts: Iterable[str | bytes], vocab_size: int, *,
              max_bytes: int = BPE_TRAIN_BYTES, progress: bool = False) -> HFTokenizer:
    """Trains a byte-level BPE of ``vocab_size`` tokens (``<|endoftext|>`` is id 0).

    GPT-2's scheme with the ``tokenizers`` library: the 256 byte symbols are the initial
    alphabet, so any text encodes, and decoding is lossless for valid UTF-8. The trainer
    is given the texts in pieces of at most :data:`PIECE_BYTES` (:func:`text_pieces`), at
    most ``max_bytes`` of them (:func:`bpe_sample`), so its memory and time are bounded
    by those, not by the longest document or the corpus.

    Args:
      texts: the training documents.
      vocab_size: tokens of the vocabulary, ``<|endoftext|>`` included (>= 257).
      max_bytes: bytes trained on at most (:data:`BPE_TRAIN_BYTES`).
      progress: a progress bar over the texts' bytes (tqdm, on stderr; a sample's skipped
        pieces count as passed) once it has taken :data:`PROGRESS_DELAY_S`, and a line
        when the merges are computed.

    Raises:
      ValueError: ``vocab_size`` below 257 (the bytes and the end-of-document token).
    """
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from tqdm import tqdm
    if vocab_size < 257:
        raise ValueError(f"data.tokenizer='bpe:{vocab_size}': a byte-level BPE needs at least "
                         f"257 tokens (256 bytes + <|endoftext|>)")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    texts = list(texts)
    total = sum(len(t) for t in texts)

    def fed():
        with tqdm(total=total, desc="data: BPE: counting words", unit="B",
                  unit_scale=True, disable=not progress, file=sys.stderr, leave=True,
                  delay=PROGRESS_DELAY_S) as bar:  # over the whole text, sampled or not
            for piece, kept in _sampled(texts, max_bytes, PIECE_BYTES):
                if kept:
                    yield _as_text(piece)
                bar.update(len(piece))
        if progress:
            print(f"data: BPE: computing up to {vocab_size - 257} merges", file=sys.stderr,
                  flush=True)

    tok.train_from_iterator(fed(), trainer=trainer)
    return HFTokenizer(tok, f"bpe:{vocab_size}", eos_id=tok.token_to_id("<|endoftext|>"))


def _bpe_vocab(spec: str) -> int:
    text = spec.split(":", 1)[1]
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"data.tokenizer={spec!r}: bpe:VOCAB takes an integer vocabulary "
                         f"size, e.g. 'bpe:4096'") from None


def load_tokenizer(spec: str, *, workdir: Optional[str | os.PathLike] = None,
                   train_texts: Optional[Callable[[], Iterable[str | bytes]]] = None,
                   eod_id: int = -1, save: bool = True, progress: bool = False):
    """The tokenizer ``data.tokenizer`` names (see the module docstring).

    Args:
      spec: ``"bytes"``, a ``.json`` or ``.model`` path, or ``"bpe:VOCAB"``.
      workdir: where ``bpe:VOCAB`` keeps ``tokenizer.json`` (read back when it is there);
        None trains it afresh in memory.
      train_texts: for ``bpe:VOCAB``, a callable giving the training documents.
      eod_id: ``data.eod_id``: the end-of-document id, or -1 for the tokenizer's own.
      save: write a newly trained BPE into ``workdir`` (process 0 only, in a
        multi-process run).
      progress: show the progress of training a BPE (:func:`train_bpe`).

    Raises:
      ValueError: an unknown spec (what is allowed is listed), a missing or unreadable
        file, a saved ``tokenizer.json`` of another vocabulary size, or no
        end-of-document token.
    """
    eos = None if eod_id is None or eod_id < 0 else int(eod_id)
    if spec in ("", "bytes"):
        if eos not in (None, ByteTokenizer.eos_id):
            raise ValueError(f"data.eod_id={eod_id}: the bytes tokenizer's end-of-document id "
                             f"is {ByteTokenizer.eos_id} (or -1)")
        return ByteTokenizer()
    if spec.startswith("bpe:"):
        vocab = _bpe_vocab(spec)
        saved = pathlib.Path(workdir) / TOKENIZER_FILE if workdir is not None else None
        if saved is not None and saved.is_file():
            tok = HFTokenizer.from_file(saved, eos)
            if tok.vocab_size > vocab:  # a small corpus may give fewer merges than asked
                raise ValueError(f"{saved} holds a BPE of {tok.vocab_size} tokens, but "
                                 f"data.tokenizer={spec!r}; use a new --workdir or delete it")
            tok.name = spec
            return tok
        if train_texts is None:
            raise ValueError(f"data.tokenizer={spec!r} needs the training documents to train on")
        tok = train_bpe(train_texts(), vocab, progress=progress)
        if eos is not None:  # data.eod_id names another token than <|endoftext|>
            tok = HFTokenizer(tok.tokenizer, spec, eos)
        if saved is not None and save:
            saved.parent.mkdir(parents=True, exist_ok=True)
            tok.save(saved.parent)
        return tok
    lowered = spec.lower()
    path = os.path.expanduser(spec)
    if lowered.endswith(".json"):
        return HFTokenizer.from_file(path, eos)
    if lowered.endswith(".model"):
        return SentencePieceTokenizer(path, eos)
    raise ValueError(f"data.tokenizer={spec!r} is not allowed; it must be 'bytes', a path to a "
                     f"Hugging Face tokenizer.json, a SentencePiece .model, or 'bpe:VOCAB'")


# Where a run keeps its own copy of a tokenizer given by path (``data.tokenizer=PATH``),
# by the file's suffix; a trained ``bpe:VOCAB`` is kept as ``tokenizer.json`` too.
KEPT_FILES = {".json": TOKENIZER_FILE, ".model": "tokenizer.model"}


def kept_tokenizer_path(workdir: str | os.PathLike, spec: str) -> Optional[pathlib.Path]:
    """Where the run keeps its own copy of the tokenizer file ``spec`` names (see
    :func:`keep_tokenizer`), whether or not it is there; None for ``bytes`` and
    ``bpe:VOCAB``, which are not copies."""
    suffix = os.path.splitext(spec.lower())[1]
    if spec.startswith("bpe:") or suffix not in KEPT_FILES:
        return None
    return pathlib.Path(workdir) / KEPT_FILES[suffix]


def kept_tokenizer(workdir: str | os.PathLike, spec: str) -> Optional[pathlib.Path]:
    """The run's own copy of the tokenizer file ``spec`` names (see :func:`keep_tokenizer`),
    or None: ``spec`` is ``bytes`` or ``bpe:VOCAB``, or the run kept no copy (one trained
    before copies were kept, or the copy was deleted).

    Raises:
      ValueError: something that is not a regular file (a FIFO, a directory) stands where
        the copy belongs (refused unopened, naming it).
    """
    path = kept_tokenizer_path(workdir, spec)
    if path is None or not os.path.lexists(path):
        return None
    if not path.is_file():
        raise ValueError(f"{path}: not a regular file; the run's copy of its tokenizer must "
                         f"be one (refused unread)")
    return path


def keep_tokenizer(tokenizer, spec: str, workdir: str | os.PathLike) -> Optional[pathlib.Path]:
    """Copies a tokenizer given by path into the run directory (atomically), so that the
    run's readers (``jaxmp.sample``, ``jaxmp.export``, :func:`jaxmp.train.load`) need
    nothing outside it, e.g. after a ``model.init_from`` base has moved. A copy with the
    same digest is left as it is. Returns the copy's path, or None for ``bytes`` and
    ``bpe:VOCAB`` (kept by :func:`load_tokenizer` itself)."""
    path = kept_tokenizer_path(workdir, spec)
    if path is None or not hasattr(tokenizer, "save"):
        return None
    if path.is_file():
        try:
            same = load_tokenizer(str(path), eod_id=tokenizer.eos_id).digest() == \
                tokenizer.digest()
        except ValueError:  # a torn or foreign file: replaced below
            same = False
        if same:
            return path
    return tokenizer.save(path.parent)
