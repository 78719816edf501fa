"""Token streams cut into windows of ``seq_len + 1`` tokens, as grain random-access
sources: :class:`TokenStream` (one packed stream) and :class:`ShardStream` (several
memory-mapped token shards). A part of the pipeline of :mod:`jaxmp.train.data`, which
re-exports these names.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from jaxmp.train.tokenizer import ByteTokenizer


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
