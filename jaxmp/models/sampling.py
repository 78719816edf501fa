"""Sampling from a trained :class:`~jaxmp.models.transformer.MoETransformer`."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmp.models.transformer import MoETransformer

__all__ = ["generate"]


@nnx.jit
def _last_logits(model, tokens, last):
    logits, _ = model(tokens)
    return jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0].astype(jnp.float32)


def generate(model: MoETransformer, prompt_ids: np.ndarray, max_new_tokens: int,
             temperature: float = 1.0, rng: Any = 0) -> np.ndarray:
    """Samples continuations, recomputing the whole (truncated) context each step.

    The context is its last ``max_len`` tokens. With dropless MoE it is right-padded to
    ``max_len`` so one compiled forward serves every step (causal attention and
    per-token routing keep the padding invisible). With capacity dispatch later tokens
    can take earlier tokens' expert slots, so the context is run unpadded instead (one
    compilation per length).

    Args:
      prompt_ids: int [T0] or [B, T0] prompt tokens, T0 >= 1, ids in [0, vocab_size).
      max_new_tokens: tokens to add (>= 0).
      temperature: 0 = greedy (argmax); > 0 samples from softmax(logits / temperature).
      rng: a ``jax.random`` key or an int seed.

    Returns:
      int32 array shaped like ``prompt_ids`` with ``max_new_tokens`` more tokens on the
      last axis (the prompt followed by the samples).

    Raises:
      ValueError: empty prompt, out-of-range ids, negative ``max_new_tokens`` or
        ``temperature``.
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
    key = jax.random.key(rng) if isinstance(rng, (int, np.integer)) else rng
    ids = ids.astype(np.int32)
    pad = cfg.num_moe_layers == 0 or not cfg.capacity_factor
    for _ in range(max_new_tokens):
        ctx = ids[:, -cfg.max_len:]
        n = ctx.shape[1]
        padded = np.zeros((ids.shape[0], cfg.max_len if pad else n), np.int32)
        padded[:, :n] = ctx
        logits = _last_logits(model, jnp.asarray(padded), jnp.full((ids.shape[0],), n - 1, jnp.int32))
        if temperature == 0:
            nxt = jnp.argmax(logits, axis=-1)
        else:
            key, sub = jax.random.split(key)
            nxt = jax.random.categorical(sub, logits / temperature, axis=-1)
        ids = np.concatenate([ids, np.asarray(nxt, np.int32)[:, None]], axis=1)
    return ids[0] if squeeze else ids
