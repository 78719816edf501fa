"""Decoder-only MoE Transformer (DeepSeekMoE style) in Flax NNX with per-module precision.

Architecture: token embedding -> ``num_layers`` pre-norm blocks -> final RMSNorm ->
untied output head; logits are returned in the head's compute dtype, for
:func:`jaxmp.ops.cross_entropy` (a float32 island) to upcast. Block ``i``::

    h = h + attn(attn_norm(h))      # causal multi-head attention with RoPE
    h = h + ffn(ffn_norm(h))        # SwiGLU for i < first_dense_layers, else MoE

Module paths (what :class:`~jaxmp.policy.PolicyRules` patterns are matched against; each
is the module's attribute path in the model, ``/``-joined, and every module resolves its
policy once, at construction)::

    embed                              token embedding
    blocks/{i}/attn_norm               RMSNorm before attention
    blocks/{i}/attn                    attention (q, k, v, o projections)
    blocks/{i}/ffn_norm                RMSNorm before the FFN
    blocks/{i}/mlp                     dense SwiGLU FFN      (i < first_dense_layers)
    blocks/{i}/moe                     MoE layer (sets only its output dtype)
    blocks/{i}/moe/router              router (float32 logits island always)
    blocks/{i}/moe/experts             routed experts
    blocks/{i}/moe/shared_experts      shared experts (when num_shared_experts > 0)
    final_norm                         final RMSNorm
    head                               output projection

Routers and norms compute in float32 by default (:data:`FLOAT32_ISLANDS`, appended after
the user's rules by :func:`jaxmp.policy.with_float32_islands`): ``"mixed_bf16"`` alone
already runs routers and all three kinds of norm in float32 with float32 parameters, and a
user rule that matches them first (``"mixed_bf16; router: p=f32,c=bf16,o=f32"``) overrides
that; and ``experts`` matches both routed and shared experts. Each module creates its
parameters in ``policy.param_dtype``, casts parameters and inputs to
``policy.compute_dtype`` and returns ``policy.output_dtype`` (the head excepted, see
:class:`Head`). The residual stream keeps the embedding's output dtype.

Activation memory: weights are cast to the compute dtype inside
:func:`jaxmp.ops.cast_matmul`, so the backward pass recasts the float32 masters instead
of keeping low-precision copies; norms and softmaxes save only their input / output
(:mod:`jaxmp.ops`); RoPE recomputes its tables in the backward pass.

Logical axis names of parameters (``out_sharding`` metadata; mapped to mesh axes only in
:mod:`jaxmp.sharding`): ``vocab``, ``embed`` (model width), ``heads``, ``head_dim``,
``mlp`` (dense / shared-expert hidden), ``expert``, ``expert_mlp`` (routed-expert hidden).
Activations ``[B, T, d_model]`` are annotated ``("batch", None, None)`` through
:func:`jaxmp.sharding.constrain` (a no-op outside :func:`jaxmp.sharding.use_rules`).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmp import ops
from jaxmp.models.moe import SCORE_FNS, MoE, SwiGLU, make_param
from jaxmp.policy import Policy, PolicyRules, get_policy_rules, with_float32_islands
from jaxmp.sharding import constrain

__all__ = ["ModelConfig", "RMSNorm", "Embed", "Attention", "Head", "Block", "MoETransformer",
           "apply_rope", "count_params", "generate"]

# Module-path patterns that compute in float32 unless a user rule matches them first.
FLOAT32_ISLANDS = ("router", "norm")

_ACT_AXES = ("batch", None, None)  # only the batch: FSDP maps "embed" to the batch axis too


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and routing hyper-parameters of :class:`MoETransformer` (validated on creation).

    Attributes:
      vocab_size: tokens in the vocabulary (>= 1).
      num_layers: Transformer blocks (>= 1).
      d_model: residual width; ``num_heads`` must divide it.
      num_heads: attention heads; ``d_model / num_heads`` must be even (RoPE rotates pairs).
      d_ff: hidden width of the dense SwiGLU FFN (needed when a dense layer exists).
      max_len: longest sequence, in tokens.
      rope_theta: RoPE base (Su et al. 2021; 10000).
      norm_eps: RMSNorm epsilon.
      num_experts: routed experts per MoE layer; 0 = every FFN dense.
      num_shared_experts: always-on experts per MoE layer (DeepSeekMoE).
      top_k: routed experts per token, in [1, num_experts].
      d_expert: hidden width of each expert (routed and shared).
      first_dense_layers: dense FFN layers before the MoE layers (DeepSeek-V3 uses 3).
      score_fn: ``"softmax"`` or ``"sigmoid"`` (DeepSeek-V3); gates are normalized over
        the chosen top-k either way.
      aux_loss_weight: alpha of the load-balance loss ``E * sum_e f_e P_e`` (Switch
        Transformer default 0.01); 0 disables it.
      bias_update_rate: gamma of auxiliary-loss-free balancing (DeepSeek-V3: 0.001); 0
        disables it (read by the trainer).
      capacity_factor: None or 0 = dropless; > 0 = GShard capacity per sequence.

    MoE fields are ignored when ``num_experts == 0``.
    """

    vocab_size: int
    num_layers: int
    d_model: int
    num_heads: int
    d_ff: int
    max_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    num_experts: int = 0
    num_shared_experts: int = 0
    top_k: int = 2
    d_expert: int = 0
    first_dense_layers: int = 0
    score_fn: str = "softmax"
    aux_loss_weight: float = 0.01
    bias_update_rate: float = 0.0
    capacity_factor: Optional[float] = None

    def __post_init__(self):
        def need(ok, msg):
            if not ok:
                raise ValueError(msg)

        for name in ("vocab_size", "num_layers", "d_model", "num_heads", "max_len"):
            v = getattr(self, name)
            need(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 1,
                 f"{name}={v!r} must be an integer >= 1")
        need(self.d_model % self.num_heads == 0,
             f"num_heads={self.num_heads} must divide d_model={self.d_model}")
        need(self.head_dim % 2 == 0,
             f"head_dim = d_model / num_heads = {self.head_dim} must be even for RoPE "
             f"(d_model={self.d_model}, num_heads={self.num_heads})")
        need(self.rope_theta > 0, f"rope_theta={self.rope_theta} must be > 0")
        need(self.norm_eps > 0, f"norm_eps={self.norm_eps} must be > 0")
        need(self.num_experts >= 0, f"num_experts={self.num_experts} must be >= 0 (0 = all dense)")
        need(0 <= self.first_dense_layers <= self.num_layers,
             f"first_dense_layers={self.first_dense_layers} must be in [0, num_layers={self.num_layers}]")
        need(self.aux_loss_weight >= 0, f"aux_loss_weight={self.aux_loss_weight} must be >= 0")
        need(self.bias_update_rate >= 0, f"bias_update_rate={self.bias_update_rate} must be >= 0")
        if self.num_dense_layers > 0:
            need(self.d_ff >= 1, f"d_ff={self.d_ff} must be >= 1 with {self.num_dense_layers} dense layers")
        if self.num_experts > 0:
            need(1 <= self.top_k <= self.num_experts,
                 f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
            need(self.d_expert >= 1, f"d_expert={self.d_expert} must be >= 1 with num_experts > 0")
            need(self.num_shared_experts >= 0, f"num_shared_experts={self.num_shared_experts} must be >= 0")
            need(self.score_fn in SCORE_FNS, f"score_fn={self.score_fn!r}; allowed: {', '.join(SCORE_FNS)}")
            need(self.capacity_factor is None or self.capacity_factor >= 0,
                 f"capacity_factor={self.capacity_factor} must be None, 0 (dropless) or > 0")

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        """Builds a config from an ``ml_collections.ConfigDict`` (or any mapping).

        Raises:
          ValueError: a key that is not a field (listed), a missing required field, or
            a value that fails validation.
        """
        data = dict(cfg.to_dict() if hasattr(cfg, "to_dict") else cfg)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ValueError(f"unknown model config keys {unknown}; allowed: {sorted(fields)}")
        missing = [n for n, f in fields.items()
                   if f.default is dataclasses.MISSING and n not in data]
        if missing:
            raise ValueError(f"model config is missing required keys {missing}")
        return cls(**data)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers if self.num_experts == 0 else self.first_dense_layers

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.num_dense_layers


def _std(config: ModelConfig):
    """GPT-2 init: normal(0.02), residual-branch output projections scaled by 1/sqrt(2L)."""
    return 0.02, 0.02 / math.sqrt(2 * config.num_layers)


class RMSNorm(nnx.Module):
    """RMSNorm (Zhang & Sennrich 2019) via ``ops.rms_norm`` (float32 statistics).

    The result is computed in ``policy.compute_dtype`` from ``x`` rounded to it, or
    from ``x`` itself when the compute dtype holds every value of ``x``'s dtype.
    Parameter ``scale`` [dim] (``embed``), ones, in ``policy.param_dtype``.
    """

    def __init__(self, dim: int, eps: float, *, path: str, rules: PolicyRules, rngs: nnx.Rngs):
        self.path = path
        self.policy: Policy = rules.resolve(path)
        self.eps = eps
        self.scale = make_param(rngs, nnx.initializers.ones, (dim,), self.policy.param_dtype, ("embed",))

    def __call__(self, x: jax.Array) -> jax.Array:
        """[..., dim] -> [..., dim] in ``policy.output_dtype``."""
        p = self.policy
        x = jnp.asarray(x)
        # ops.rms_norm computes in float32 whatever x's dtype, so a widening cast (a
        # bfloat16 stream into a float32 norm) would change no value, only keep a wider
        # copy of x for the backward pass. A narrowing one rounds x, as the policy says.
        if jnp.promote_types(x.dtype, p.compute_dtype) != p.compute_dtype:
            x = p.cast_to_compute(x)
        y = ops.rms_norm(x, p.cast_to_compute(self.scale[...]), self.eps, dtype=p.compute_dtype)
        return p.cast_to_output(y)


class Embed(nnx.Module):
    """Token embedding: table [vocab, d_model] (``vocab``, ``embed``).

    The table is normal(0.02) (GPT-2) in ``policy.param_dtype``; looked-up rows are cast
    to the compute, then the output dtype.
    """

    def __init__(self, vocab_size: int, d_model: int, *, path: str, rules: PolicyRules, rngs: nnx.Rngs):
        self.path = path
        self.policy: Policy = rules.resolve(path)
        self.table = make_param(rngs, nnx.initializers.normal(0.02), (vocab_size, d_model),
                                self.policy.param_dtype, ("vocab", "embed"))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """int [B, T] -> [B, T, d_model] in ``policy.output_dtype``."""
        return self.policy.cast_to_output(self.policy.cast_to_compute(jnp.take(self.table[...], tokens, axis=0)))


def apply_rope(x: jax.Array, positions: jax.Array, theta: float = 10000.0) -> jax.Array:
    """Rotary position embedding (Su et al. 2021, RoFormer, eq. 34), half-split layout.

    Dimension ``i < h/2`` is paired with ``i + h/2`` (GPT-NeoX / LLaMA layout) and the
    pair is rotated by ``position * theta ** (-2 i / h)`` radians. Angles and the
    rotation are computed in float32; the result has ``x``'s dtype. The backward pass
    (a rotation by the opposite angles) recomputes the float32 ``cos``/``sin`` tables
    from ``positions`` (``jax.checkpoint``) instead of keeping them between the passes.

    Args:
      x: [..., T, H, h] queries or keys, h even.
      positions: [T] integer positions.
      theta: the base.

    Returns:
      Rotated ``x``, same shape and dtype.
    """
    return jax.checkpoint(functools.partial(_rope, theta=theta),
                          policy=jax.checkpoint_policies.nothing_saveable)(x, positions)


def _rope(x, positions, theta):
    h = x.shape[-1]
    inv_freq = theta ** (-jnp.arange(0, h // 2, dtype=jnp.float32) * 2.0 / h)
    angle = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, h/2]
    cos, sin = jnp.cos(angle)[:, None, :], jnp.sin(angle)[:, None, :]   # broadcast over heads
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., : h // 2], x32[..., h // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    """Causal multi-head self-attention with RoPE; softmax in a float32 island.

    Scores ``q k^T / sqrt(head_dim)`` are accumulated in float32 and normalized by
    ``ops.masked_softmax`` with ``ops.causal_mask``; the probabilities go back to the
    compute dtype for the product with ``v``.

    Parameters: ``wq``, ``wk``, ``wv`` [d_model, H, head_dim] (``embed``, ``heads``,
    ``head_dim``), ``wo`` [H, head_dim, d_model] (``heads``, ``head_dim``, ``embed``).
    """

    def __init__(self, config: ModelConfig, *, path: str, rules: PolicyRules, rngs: nnx.Rngs):
        self.path = path
        self.policy: Policy = rules.resolve(path)
        self.rope_theta = config.rope_theta
        std, out_std = _std(config)
        d, h, k = config.d_model, config.num_heads, config.head_dim
        dt = self.policy.param_dtype
        for name in ("wq", "wk", "wv"):
            setattr(self, name, make_param(rngs, nnx.initializers.normal(std), (d, h, k), dt,
                                           ("embed", "heads", "head_dim")))
        self.wo = make_param(rngs, nnx.initializers.normal(out_std), (h, k, d), dt, ("heads", "head_dim", "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        """[B, T, d_model] -> [B, T, d_model] in ``policy.output_dtype``."""
        p = self.policy
        x = p.cast_to_compute(x)
        t = x.shape[1]
        positions = jnp.arange(t)
        # Weights go to the compute dtype inside ops.cast_matmul (recast, not saved, for backward).
        q = apply_rope(ops.cast_matmul(x, self.wq[...], "btd,dhk->bthk"), positions, self.rope_theta)
        k = apply_rope(ops.cast_matmul(x, self.wk[...], "btd,dhk->bthk"), positions, self.rope_theta)
        v = ops.cast_matmul(x, self.wv[...], "btd,dhk->bthk")
        scores = jnp.einsum("bqhk,bshk->bhqs", q, k, preferred_element_type=jnp.float32)
        scores = scores / math.sqrt(q.shape[-1])
        probs = ops.masked_softmax(scores, ops.causal_mask(t), axis=-1, dtype=p.compute_dtype)
        out = jnp.einsum("bhqs,bshk->bqhk", probs, v)
        return p.cast_to_output(ops.cast_matmul(out, self.wo[...], "bthk,hkd->btd"))


class Head(nnx.Module):
    """Untied output projection: kernel [d_model, vocab] (``embed``, ``vocab``).

    Returns the logits in ``policy.compute_dtype``; ``policy.output_dtype`` is not used
    (as for the router). The loss, :func:`jaxmp.ops.cross_entropy`, upcasts them to
    float32 inside its island, so the values and gradients are those of a float32 cast
    here, but the ``[B, T, vocab]`` array kept for the backward pass is not a float32
    copy.
    """

    def __init__(self, d_model: int, vocab_size: int, *, path: str, rules: PolicyRules, rngs: nnx.Rngs):
        self.path = path
        self.policy: Policy = rules.resolve(path)
        self.kernel = make_param(rngs, nnx.initializers.normal(0.02), (d_model, vocab_size),
                                 self.policy.param_dtype, ("embed", "vocab"))

    def __call__(self, x: jax.Array) -> jax.Array:
        """[..., d_model] -> [..., vocab] in ``policy.compute_dtype``."""
        p = self.policy
        return ops.cast_matmul(p.cast_to_compute(x), self.kernel[...])


class Block(nnx.Module):
    """Pre-norm block: attention and a dense (``mlp``) or MoE (``moe``) FFN, each residual.

    ``__call__(h [B, T, d]) -> (h, MoEStats or None)``; the residual keeps ``h``'s dtype.
    """

    def __init__(self, config: ModelConfig, index: int, *, rules: PolicyRules, rngs: nnx.Rngs):
        path = f"blocks/{index}"
        std, out_std = _std(config)
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps, path=f"{path}/attn_norm", rules=rules, rngs=rngs)
        self.attn = Attention(config, path=f"{path}/attn", rules=rules, rngs=rngs)
        self.ffn_norm = RMSNorm(config.d_model, config.norm_eps, path=f"{path}/ffn_norm", rules=rules, rngs=rngs)
        if config.is_moe_layer(index):
            self.moe = MoE(config.d_model, config.num_experts, config.num_shared_experts, config.top_k,
                           config.d_expert, config.score_fn, config.capacity_factor, path=f"{path}/moe",
                           rules=rules, rngs=rngs, init_std=std, out_std=out_std)
        else:
            self.mlp = SwiGLU(config.d_model, config.d_ff, path=f"{path}/mlp", rules=rules, rngs=rngs,
                              init_std=std, out_std=out_std)

    def __call__(self, h: jax.Array):
        h = h + self.attn(self.attn_norm(h)).astype(h.dtype)
        stats = None
        if hasattr(self, "moe"):
            y, stats = self.moe(self.ffn_norm(h))
        else:
            y = self.mlp(self.ffn_norm(h))
        return h + y.astype(h.dtype), stats


class MoETransformer(nnx.Module):
    """Decoder-only MoE Transformer; see the module docstring for paths and precision.

    Args:
      config: the :class:`ModelConfig`.
      rules: per-module precision (a :class:`~jaxmp.policy.PolicyRules` or anything
        :func:`~jaxmp.policy.get_policy_rules` parses, e.g. ``"mixed_bf16; router: fp32"``).
      rngs: NNX rngs (stream ``params``).
    """

    def __init__(self, config: ModelConfig, rules: PolicyRules, *, rngs: nnx.Rngs):
        # Routers and norms are float32 islands unless one of the user's rules says otherwise.
        rules = with_float32_islands(get_policy_rules(rules), FLOAT32_ISLANDS)
        self.rules = rules
        self.config = config
        self.embed = Embed(config.vocab_size, config.d_model, path="embed", rules=rules, rngs=rngs)
        self.blocks = nnx.List([Block(config, i, rules=rules, rngs=rngs) for i in range(config.num_layers)])
        self.final_norm = RMSNorm(config.d_model, config.norm_eps, path="final_norm", rules=rules, rngs=rngs)
        self.head = Head(config.d_model, config.vocab_size, path="head", rules=rules, rngs=rngs)

    def __call__(self, tokens: jax.Array):
        """Forward pass.

        Args:
          tokens: int [B, T] token ids, T <= max_len.

        Returns:
          ``(logits, aux)``: logits [B, T, vocab_size] in the head's compute dtype
          (bfloat16 under ``mixed_bf16``; pass them to :func:`jaxmp.ops.cross_entropy`,
          which computes in float32, or upcast them); aux a dict of float32
          ``aux_loss`` (scalar, ``aux_loss_weight * sum`` of the MoE layers' balance
          losses), ``expert_counts`` ([num_moe_layers, num_experts], token-expert
          assignments per expert over the whole batch, rows in block order; [0, 0]
          without MoE layers) and ``dropped_fraction`` (scalar, mean over MoE layers of
          the fraction of assignments dropped by capacity; 0 dropless).

        Raises:
          ValueError: tokens not an integer [B, T] array, or T > max_len.
        """
        cfg = self.config
        if jnp.ndim(tokens) != 2 or not jnp.issubdtype(jnp.result_type(tokens), jnp.integer):
            raise ValueError(f"tokens must be an integer [B, T] array, got shape {jnp.shape(tokens)} "
                             f"dtype {jnp.result_type(tokens)}")
        if tokens.shape[1] > cfg.max_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_len={cfg.max_len}")
        h = constrain(self.embed(tokens), _ACT_AXES)
        stats = []
        for block in self.blocks:
            h, s = block(h)
            h = constrain(h, _ACT_AXES)
            if s is not None:
                stats.append(s)
        logits = self.head(self.final_norm(h))
        if stats:
            balance = jnp.sum(jnp.stack([s.balance_loss for s in stats]))
            counts = jnp.stack([s.expert_counts for s in stats])
            dropped = jnp.mean(jnp.stack([s.dropped_fraction for s in stats]))
        else:
            balance = dropped = jnp.zeros((), jnp.float32)
            counts = jnp.zeros((0, 0), jnp.float32)
        aux = {"aux_loss": (cfg.aux_loss_weight * balance).astype(jnp.float32),
               "expert_counts": counts.astype(jnp.float32),
               "dropped_fraction": dropped.astype(jnp.float32)}
        return logits, aux


def count_params(model: MoETransformer) -> tuple[int, int]:
    """Total and per-token active parameter counts (``nnx.Param`` only, not router biases).

    Active = everything except the routed experts a token does not use: embeddings,
    attention, norms, head, dense FFNs, shared experts, routers, and ``top_k`` of the
    ``num_experts`` routed experts per MoE layer. Embedding table and output head are
    counted in both numbers, as in DeepSeek-V3's "671B total, 37B activated" (that 37B
    is only reached with its 2 x 0.93B embedding/head parameters included).

    Returns:
      ``(total, active_per_token)`` as Python ints.
    """
    total = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(nnx.state(model, nnx.Param)))
    inactive = 0
    cfg = model.config
    for block in model.blocks:
        if hasattr(block, "moe"):
            e = block.moe.experts
            routed = sum(int(np.prod(w.shape)) for w in (e.w_gate, e.w_up, e.w_down))
            inactive += routed // cfg.num_experts * (cfg.num_experts - cfg.top_k)
    return total, total - inactive


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
