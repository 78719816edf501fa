"""Decoder-only MoE Transformer (DeepSeekMoE style) in Flax NNX with per-module precision.

Architecture: token embedding -> ``num_layers`` pre-norm blocks -> final RMSNorm ->
untied output head; logits are returned in the head's compute dtype, for
:func:`jaxmp.ops.cross_entropy` (a float32 island) to upcast. Block ``i``::

    h = h + attn(attn_norm(h))      # causal multi-head attention with RoPE
    h = h + ffn(ffn_norm(h))        # SwiGLU for i < first_dense_layers, else MoE

Module paths (what :class:`~jaxmp.precision.policy.PolicyRules` patterns are matched against; each
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
the user's rules by :func:`jaxmp.precision.policy.with_float32_islands`): ``"mixed_bf16"`` alone
already runs routers and all three kinds of norm in float32 with float32 parameters, and a
user rule that matches them first (``"mixed_bf16; router: p=f32,c=bf16,o=f32"``) overrides
that; and ``experts`` matches both routed and shared experts.

FP8 (``fp8_*`` presets, :mod:`jaxmp.fp8`): a module whose policy has an FP8 recipe runs
its weight matmuls in FP8 (attention projections, dense FFN, routed and shared experts,
the head). As in DeepSeek-V3 (report, section 3.3.1) the embedding and the output head
(:data:`FP8_EXCLUDED`), the routers, the norms and the attention core stay in
bfloat16/float32 under an FP8 *default* policy, unless a user rule names them:
``"fp8_blockwise; router: fp32; norm: fp32"`` puts attention and every FFN in FP8, and
``"mixed_bf16; router: fp32; norm: fp32; experts: fp8_blockwise; mlp: fp8_blockwise"``
only the FFNs. Each module creates its
parameters in ``policy.param_dtype``, casts parameters and inputs to
``policy.compute_dtype`` and returns ``policy.output_dtype`` (the head excepted, see
:class:`~jaxmp.models.layers.Head`). The residual stream keeps the embedding's output dtype.

Activation memory: weights are cast to the compute dtype inside
:func:`jaxmp.ops.cast_matmul`, so the backward pass recasts the float32 masters instead
of keeping low-precision copies (an FP8 matmul keeps its FP8 input and scales and
quantizes the master weight again, :mod:`jaxmp.fp8`); norms and softmaxes save only their
input / output (:mod:`jaxmp.ops`); RoPE recomputes its tables in the backward pass.

Logical axis names of parameters (``out_sharding`` metadata; mapped to mesh axes only in
:mod:`jaxmp.sharding`): ``vocab``, ``embed`` (model width), ``heads``, ``head_dim``,
``mlp`` (dense / shared-expert hidden), ``expert``, ``expert_mlp`` (routed-expert hidden).
Activations ``[B, T, d_model]`` are annotated ``("batch", None, None)`` through
:func:`jaxmp.sharding.constrain` (a no-op outside :func:`jaxmp.sharding.use_rules`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmp.models.attention import Attention
from jaxmp.models.layers import Embed, Head, RMSNorm, SwiGLU
from jaxmp.models.moe import SCORE_FNS, MoE
from jaxmp.precision.policy import PolicyRules, get_policy_rules, with_float32_islands, without_fp8
from jaxmp.sharding import constrain

__all__ = ["ModelConfig", "Block", "MoETransformer", "count_params", "FLOAT32_ISLANDS",
           "FP8_EXCLUDED"]

# Module-path patterns that compute in float32 unless a user rule matches them first.
FLOAT32_ISLANDS = ("router", "norm")
# Module-path patterns that an FP8 default policy leaves in its compute dtype (DeepSeek-V3 3.3.1).
FP8_EXCLUDED = ("embed", "head")

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


class Block(nnx.Module):
    """Pre-norm block: attention and a dense (``mlp``) or MoE (``moe``) FFN, each residual.

    ``__call__(h [B, T, d]) -> (h, MoEStats or None)``; the residual keeps ``h``'s dtype.
    """

    def __init__(self, config: ModelConfig, index: int, *, rules: PolicyRules, rngs: nnx.Rngs):
        path = f"blocks/{index}"
        std, out_std = _std(config)
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps, path=f"{path}/attn_norm", rules=rules, rngs=rngs)
        self.attn = Attention(config.d_model, config.num_heads, config.rope_theta, path=f"{path}/attn",
                              rules=rules, rngs=rngs, init_std=std, out_std=out_std)
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
      rules: per-module precision (a :class:`~jaxmp.precision.policy.PolicyRules` or anything
        :func:`~jaxmp.precision.policy.get_policy_rules` parses, e.g. ``"mixed_bf16; router: fp32"``).
      rngs: NNX rngs (stream ``params``).
    """

    def __init__(self, config: ModelConfig, rules: PolicyRules, *, rngs: nnx.Rngs):
        # Routers and norms are float32 islands, and an FP8 default leaves the embedding and
        # head alone, unless one of the user's rules says otherwise.
        rules = without_fp8(with_float32_islands(get_policy_rules(rules), FLOAT32_ISLANDS), FP8_EXCLUDED)
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


