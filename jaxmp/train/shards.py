"""Pre-tokenized ``.bin`` / ``.npy`` token shards: opened memory-mapped, checked against
the tokenizer and the end-of-document id, and cut into train and eval streams
(:func:`shard_streams`). A part of the pipeline of :mod:`jaxmp.train.data`; the dtypes
allowed, :data:`~jaxmp.train.keys.TOKEN_DTYPES`, are declared with the config's keys.
"""
from __future__ import annotations

import math
import os

import numpy as np

from jaxmp.train.keys import DEFAULTS, TOKEN_DTYPES
from jaxmp.train.streams import ShardStream, TokenStream


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


def shard_streams(files, data_config, tokenizer, eod: int, seq_len: int, eval_fraction: float,
                   max_tokens, need_eval: bool):
    """``(train, eval or None, notes, documents)`` of pre-tokenized shards: eval is the
    last ``max(seq_len + 1, eval_fraction * tokens)`` tokens of the last shard."""
    dtype = getattr(data_config, "token_dtype", None) or DEFAULTS["data.token_dtype"]
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
