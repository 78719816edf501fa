"""Sampling from a trained :class:`~jaxmp.models.transformer.MoETransformer`."""
from __future__ import annotations

import functools
import sys
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmp.models.transformer import MoETransformer

__all__ = ["generate"]


@functools.partial(jax.jit, static_argnums=(0, 6))
def _next_token(graphdef, state, buffer, n, key, temperature, vocab_limit):
    """One sampling step on a fixed ``[B, max_len]`` buffer whose first ``n`` tokens are
    the context: the next token of each row (int32 [B]) and the next key. Ids at or above
    ``vocab_limit`` (padding rows of the embedding) get a logit of -inf."""
    model = nnx.merge(graphdef, state)
    logits, _ = model(buffer, valid_length=n)
    last = jax.lax.dynamic_index_in_dim(logits, n - 1, axis=1, keepdims=False).astype(jnp.float32)
    if vocab_limit < last.shape[-1]:
        last = jnp.where(jnp.arange(last.shape[-1]) < vocab_limit, last, -jnp.inf)
    key, sub = jax.random.split(key)
    greedy = jnp.argmax(last, axis=-1)
    sampled = jax.random.categorical(sub, last / jnp.where(temperature > 0, temperature, 1.0),
                                     axis=-1)
    return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32), key


def generate(model: MoETransformer, prompt_ids: np.ndarray, max_new_tokens: int,
             temperature: float = 1.0, rng: Any = 0, *, progress: bool = False,
             vocab_limit: Any = None, stop_ids: Sequence[int] = ()) -> np.ndarray:
    """Samples continuations, recomputing the whole (truncated) context each step.

    The context is its last ``max_len`` tokens, right-padded into a fixed ``[B, max_len]``
    buffer, so one compiled step serves every token of every call with the same batch
    size (the temperature is an argument of the step, not a constant of it). Causal
    attention keeps the padding invisible; under capacity dispatch
    (``capacity_factor > 0``) the padding takes no expert slot and the capacity is that of
    the real context (``MoETransformer.__call__(valid_length=)``), so each step's logits are
    those of the unpadded context.

    Args:
      prompt_ids: int [T0] or [B, T0] prompt tokens, T0 >= 1, ids in [0, vocab_size).
      max_new_tokens: tokens to add (>= 0).
      temperature: 0 = greedy (argmax); > 0 samples from softmax(logits / temperature).
      rng: a ``jax.random`` key or an int seed.
      progress: show a progress bar (tqdm, on stderr) over the new tokens; tqdm is
        the ``train`` extra's, imported only then.
      vocab_limit: sample only ids below it: the tokenizer's vocabulary size when the
        model's ``vocab_size`` is padded beyond it (e.g. to a multiple of 128), so that
        no id the tokenizer lacks is ever emitted; None = ``vocab_size``.
      stop_ids: ids that end a row's sample (a chat template's end of turn,
        :func:`jaxmp.train.chat.end_of_turn_ids`): once a row has sampled one, its later
        tokens are that id again, and sampling ends when every row has stopped.

    Returns:
      int32 array shaped like ``prompt_ids`` with up to ``max_new_tokens`` more tokens on
      the last axis (the prompt followed by the samples; fewer when every row stopped).

    Raises:
      ValueError: empty prompt, out-of-range ids, negative ``max_new_tokens`` or
        ``temperature``, a ``vocab_limit`` outside ``[1, vocab_size]``, a stop id outside
        ``[0, vocab_size)``.
    """
    cfg = model.config
    ids = np.asarray(prompt_ids)
    squeeze = ids.ndim == 1
    ids = ids[None] if squeeze else ids
    if ids.ndim != 2 or ids.shape[1] < 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"prompt_ids must be a non-empty integer [T] or [B, T] array, got shape "
                         f"{np.shape(prompt_ids)} dtype {ids.dtype}")
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ValueError(f"prompt ids must be in [0, vocab_size={cfg.vocab_size}), got "
                         f"[{ids.min()}, {ids.max()}]")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy)")
    limit = cfg.vocab_size if vocab_limit is None else vocab_limit
    if isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or not (
            1 <= limit <= cfg.vocab_size):
        raise ValueError(f"vocab_limit={vocab_limit!r} must be an int in [1, "
                         f"vocab_size={cfg.vocab_size}]")
    stops = np.asarray(list(stop_ids), np.int64)
    if stops.size and (stops.min() < 0 or stops.max() >= cfg.vocab_size):
        raise ValueError(f"stop_ids={list(stop_ids)} must be ids in [0, "
                         f"vocab_size={cfg.vocab_size})")
    key = jax.random.key(rng) if isinstance(rng, (int, np.integer)) else rng
    graphdef, state = nnx.split(model)
    temp = jnp.float32(temperature)
    ids = ids.astype(np.int32)
    buffer = np.zeros((ids.shape[0], cfg.max_len), np.int32)
    stopped = np.full(ids.shape[0], -1, np.int64)  # each row's stop id once it has sampled one
    steps = range(max_new_tokens)
    if progress:
        from tqdm import tqdm
        steps = tqdm(steps, desc="sample", unit="tok", file=sys.stderr, leave=False)
    for _ in steps:
        ctx = ids[:, -cfg.max_len:]
        n = ctx.shape[1]
        buffer[:, :n] = ctx
        buffer[:, n:] = 0
        nxt, key = _next_token(graphdef, state, jnp.asarray(buffer), jnp.int32(n), key, temp,
                               int(limit))
        nxt = np.asarray(nxt)
        if stops.size:
            nxt = np.where(stopped >= 0, stopped, nxt).astype(np.int32)
            stopped = np.where((stopped < 0) & np.isin(nxt, stops), nxt, stopped)
        ids = np.concatenate([ids, nxt[:, None]], axis=1)
        if stops.size and (stopped >= 0).all():
            break
    if progress:
        steps.close()
    return ids[0] if squeeze else ids
