"""Causal multi-head self-attention with rotary position embeddings.

The softmax is a float32 island (:func:`jaxmp.ops.masked_softmax`); the projections run
in the module's compute dtype, or in FP8 under an FP8 policy (:func:`jaxmp.models.layers.matmul`);
the attention core (scores and the product with ``v``) never does (DeepSeek-V3 report,
section 3.3.1). Parameters carry the logical axes ``embed``, ``heads``,
``head_dim``.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmp.models.layers import add_fp8_states, apply_rope, make_param, matmul
from jaxmp.precision import ops
from jaxmp.precision.policy import Policy, PolicyRules

__all__ = ["Attention"]


class Attention(nnx.Module):
    """Causal multi-head self-attention with RoPE; softmax in a float32 island.

    Scores ``q k^T / sqrt(head_dim)`` are accumulated in float32 and normalized by
    ``ops.masked_softmax`` with ``ops.causal_mask``; the probabilities go back to the
    compute dtype for the product with ``v``.

    Args:
      d_model: model width.
      num_heads: heads H; must divide ``d_model``, and ``d_model / H`` must be even.
      rope_theta: the RoPE base.
      path: attribute path, e.g. ``blocks/0/attn``.
      rules: per-module precision rules.
      rngs: NNX rngs.
      init_std: normal init std of ``wq``, ``wk``, ``wv``.
      out_std: normal init std of ``wo`` (scaled down for a residual branch, GPT-2).

    Parameters: ``wq``, ``wk``, ``wv`` [d_model, H, head_dim] (``embed``, ``heads``,
    ``head_dim``), ``wo`` [H, head_dim, d_model] (``heads``, ``head_dim``, ``embed``).
    """

    def __init__(self, d_model: int, num_heads: int, rope_theta: float = 10000.0, *, path: str,
                 rules: PolicyRules, rngs: nnx.Rngs, init_std: float = 0.02, out_std: float = 0.02):
        self.path = path
        self.policy: Policy = rules.resolve(path)
        self.rope_theta = rope_theta
        d, h = d_model, num_heads
        k = d // h
        dt = self.policy.param_dtype
        for name in ("wq", "wk", "wv"):
            setattr(self, name, make_param(rngs, nnx.initializers.normal(init_std), (d, h, k), dt,
                                           ("embed", "heads", "head_dim")))
        self.wo = make_param(rngs, nnx.initializers.normal(out_std), (h, k, d), dt, ("heads", "head_dim", "embed"))
        add_fp8_states(self, ("wq", "wk", "wv", "wo"))

    def __call__(self, x: jax.Array) -> jax.Array:
        """[B, T, d_model] -> [B, T, d_model] in ``policy.output_dtype``."""
        p = self.policy
        x = p.cast_to_compute(x)
        t = x.shape[1]
        positions = jnp.arange(t)
        # Weights go to the compute dtype inside ops.cast_matmul (recast, not saved, for
        # backward), or to FP8 by the policy's recipe (layers.matmul).
        q = apply_rope(matmul(self, x, "wq", "btd,dhk->bthk"), positions, self.rope_theta)
        k = apply_rope(matmul(self, x, "wk", "btd,dhk->bthk"), positions, self.rope_theta)
        v = matmul(self, x, "wv", "btd,dhk->bthk")
        scores = jnp.einsum("bqhk,bshk->bhqs", q, k, preferred_element_type=jnp.float32)
        scores = scores / math.sqrt(q.shape[-1])
        probs = ops.masked_softmax(scores, ops.causal_mask(t), axis=-1, dtype=p.compute_dtype)
        out = jnp.einsum("bhqs,bshk->bqhk", probs, v)
        return p.cast_to_output(matmul(self, out, "wo", "bthk,hkd->btd"))


