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
    blocks/{i}/attn                    attention (q, k, v, o projections; MLA's too)
    blocks/{i}/attn/q_norm, k_norm     per-head q/k RMSNorm       (qk_norm, Qwen3)
    blocks/{i}/attn/q_a_norm, kv_a_norm  MLA's latent RMSNorms   (kv_lora_rank > 0)
    blocks/{i}/ffn_norm                RMSNorm before the FFN
    blocks/{i}/mlp                     dense SwiGLU FFN      (i < first_dense_layers or
                                       i in mlp_only_layers)
    blocks/{i}/moe                     MoE layer (sets only its output dtype)
    blocks/{i}/moe/router              router (float32 logits island always)
    blocks/{i}/moe/experts             routed experts
    blocks/{i}/moe/shared_experts      shared experts (when num_shared_experts > 0)
    final_norm                         final RMSNorm
    head                               output projection (with tie_embeddings, the
                                       policy of the product by embed's table)

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
``mlp`` (dense / shared-expert hidden), ``expert``, ``expert_mlp`` (routed-expert hidden),
and in the scanned layout ``layers`` first (the stacked-layer axis).
Activations ``[B, T, d_model]`` are annotated ``("batch", None, None)`` through
:func:`jaxmp.sharding.constrain` (a no-op outside :func:`jaxmp.sharding.use_rules`).

Scanned layers (``ModelConfig.scan_layers=True``): the blocks are grouped into *stacks*
(:func:`layer_stacks`): runs of consecutive layers of one kind (dense or MoE) whose
modules all resolve to the same policies. Stack ``s`` is one :class:`Block` at attribute
``stacks/{s}`` whose every variable has a leading axis of the stack's length, with the
logical axis name ``layers`` (mapped to None, replicated, in every rule table of
:mod:`jaxmp.sharding`), and the stack runs under ``jax.lax.scan``, so a deep model is
traced and compiled as one layer per stack. Policy rules keep matching the per-layer
paths ``blocks/{i}/...``: a rule that names one layer (``blocks/2/moe/router: fp32``)
ends a stack there and starts another, so every layer runs in exactly the policies it
would unscanned. Attribute paths become ``stacks/{s}/attn``, ``stacks/{s}/moe/router``,
...; each stacked module's ``path`` holds the first layer's path (``blocks/{first}/...``,
the one its policy was resolved from) and :meth:`MoETransformer.module_paths` lists the
path of every layer. The router bias of a MoE stack is float32 ``[layers, num_experts]``,
one row per layer. Initial weights equal the unscanned model's for the same seed (the
layers are created in the same order, then stacked), but the two layouts' states have
different trees: a checkpoint of one does not restore into the other (the saved config
differs in ``model.scan_layers``, which the trainer names).

Rematerialization (``ModelConfig.remat``, :data:`REMAT_POLICIES`), per block:

* ``"none"``: the backward pass keeps everything autodiff keeps (beyond the
  fine-grained recomputation of :mod:`jaxmp.ops` described above).
* ``"attention"``: only the attention core (scores, softmax, context) is recomputed;
  q, k, v and everything else are kept (selective activation recomputation,
  Korthikanti et al. 2022, section 4.2). Removes the ``[B, H, T, T]`` probabilities of
  the ``reference``/``xla`` paths from memory for about one attention-core forward of
  extra FLOPs.
* ``"dots_saveable"``: each block under ``jax.checkpoint`` with
  ``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``: the outputs of the weight
  matmuls (dots without batch dimensions, which :func:`jaxmp.ops.cast_matmul` and
  :func:`~jaxmp.models.layers.apply_rope` wrap in their own checkpoints, so what is kept
  is q and k after RoPE, v, the attention output projection, the dense and shared-expert
  SwiGLU gate and up products, and the router logits) are kept; everything else is
  recomputed: norms, the attention core (its dots have batch dimensions), SwiGLU's
  gating, and the routed experts (``ragged_dot`` is not a dot_general; the capacity
  path's dots have a batch dimension). (JAX's own ``dots_saveable`` would also keep the
  batched attention-score dots, i.e. the float32 ``[B, H, T, T]`` scores: not offered.)
* ``"full"``: each block under ``jax.checkpoint`` with ``nothing_saveable``: only the
  block's input ``[B, T, d_model]`` is kept; the backward pass recomputes the whole
  block's forward (about one more forward of the layers).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmp import target as compile_target
from jaxmp._checks import BOOL, Choice, Int, Kind, Real, check, check_choice, is_int, option

from jaxmp.models.attention import ATTENTION_IMPLEMENTATIONS, Attention, MLAttention
from jaxmp.models.layers import (ROPE_LAYOUTS, ROPE_SCALINGS, Embed, Head, ParamKeys, RMSNorm,
                                 Rope, SwiGLU)
from jaxmp.models.moe import GROUP_SCORES, MOE_KERNELS, SCORE_FNS, MoE, MoEStats, RoutedExperts
from jaxmp.precision import comm
from jaxmp.precision.policy import PolicyRules, get_policy_rules, with_float32_islands, without_fp8
from jaxmp.sharding import DISPATCH_DTYPES, constrain, fsdp_checkpoint_policy

__all__ = ["ModelConfig", "Block", "MoETransformer", "count_params", "FLOAT32_ISLANDS",
           "FP8_EXCLUDED", "REMAT_POLICIES", "layer_stacks", "param_compute_dtypes"]

# model.remat settings, in order of growing recomputation (module docstring).
REMAT_POLICIES = ("none", "attention", "dots_saveable", "full")

_BLOCK_CHECKPOINT_POLICIES = {
    "dots_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}

# Module-path patterns that compute in float32 unless a user rule matches them first.
FLOAT32_ISLANDS = ("router", "norm")
# Module-path patterns that an FP8 default policy leaves in its compute dtype (DeepSeek-V3 3.3.1).
FP8_EXCLUDED = ("embed", "head")

_POSITIVE = Real(0, lo_open=True)
_ACT_AXES = ("batch", None, None)  # only the batch: FSDP maps "embed" to the batch axis too


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and routing hyper-parameters of :class:`MoETransformer` (validated on creation).

    Each field is declared once, by :func:`jaxmp._checks.option`: its default, the values
    it allows and a one-line meaning. These are the run config's ``model.*`` keys: their
    defaults, their checks, ``train.py --help`` and docs/CONFIG.md are read from the fields
    (:mod:`jaxmp.train.keys`). ``ModelConfig()`` is a tiny dense model on bytes (257 tokens,
    2 blocks of width 64); every architecture feature and MoE is off by default.

    Attributes:
      vocab_size: tokens in the vocabulary (>= 1).
      num_layers: Transformer blocks (>= 1).
      d_model: residual width.
      num_heads: attention (query) heads; the rotated head width must be even.
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
      capacity_factor: 0 (or None) = dropless; > 0 = GShard capacity per sequence.
      moe_kernel: the dropless routed experts' kernel, one of
        :data:`~jaxmp.models.moe.MOE_KERNELS` (``"auto"``: the Mosaic GPU grouped GEMM on a
        Hopper-or-newer compile target, else ``ragged_dot``; see
        :func:`~jaxmp.models.moe.resolve_moe_kernel`).
      attention: the attention core's path, one of
        :data:`~jaxmp.models.attention.ATTENTION_IMPLEMENTATIONS` (``"auto"``: cuDNN's
        fused kernel where it runs, else jaxmp's float32-island ``"reference"``, never
        ``"xla"``; see :func:`~jaxmp.models.attention.resolve_attention`).
      scan_layers: stack the blocks and run them with ``jax.lax.scan`` (module
        docstring); False runs them in a Python loop.
      remat: per-block rematerialization, one of :data:`REMAT_POLICIES` (module
        docstring says what each keeps).

      num_kv_heads: key/value heads (grouped-query attention, Ainslie et al. 2023);
        must divide ``num_heads``; 0 = ``num_heads``, stored resolved.
      head_dim: per-head width; 0 = ``d_model / num_heads`` (``num_heads`` must then
        divide ``d_model``), stored resolved.
      qk_norm: per-head RMSNorm of q and k before RoPE (Qwen3): modules
        ``blocks/{i}/attn/q_norm``, ``.../k_norm``.
      qkv_bias: biases on the q, k, v projections (Qwen2).
      tie_embeddings: the output head is the embedding table transposed (no ``head``
        module; the ``head`` path's policy still governs the product).
      rope_dim: rotated dimensions per head (partial rotary); 0 = all of them.
      rope_layout: ``"half"`` (GPT-NeoX / LLaMA pairs ``i, i + d/2``) or
        ``"interleaved"`` (pairs ``2i, 2i + 1``, DeepSeek).
      rope_scaling: ``"none"``, ``"llama3"`` or ``"yarn"``; the ``rope_*`` fields below
        are its parameters (:class:`~jaxmp.models.layers.Rope`).
      rope_factor, rope_original_max_len, rope_low_freq_factor, rope_high_freq_factor,
        rope_beta_fast, rope_beta_slow, rope_mscale, rope_mscale_all_dim: as the
        transformers ``rope_scaling`` keys ``factor``, ``original_max_position_embeddings``,
        ``low_freq_factor``, ``high_freq_factor``, ``beta_fast``, ``beta_slow``,
        ``mscale``, ``mscale_all_dim``.
      norm_topk_prob: normalize the chosen experts' scores to sum to 1 (today's routing);
        False keeps the raw scores (Qwen3-MoE's option).
      routed_scaling_factor: multiplies the routed experts' gates (DeepSeek-V3: 2.5).
      n_group, topk_group: group-limited routing (DeepSeek-V3); ``topk_group ==
        n_group`` (1, 1) is off.
      group_score: a group's score in group-limited routing, ``"top2_sum"`` (DeepSeek-V3)
        or ``"max"`` (DeepSeek-V2's ``group_limited_greedy``); see
        :class:`~jaxmp.models.moe.Router`.
      mlp_only_layers: layer indices with a dense FFN though ``>= first_dense_layers``
        (Qwen-MoE's ``mlp_only_layers``).
      q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim:
        Multi-head Latent Attention (DeepSeek-V2/V3) when ``kv_lora_rank > 0``
        (:class:`~jaxmp.models.attention.MLAttention`; ``q_lora_rank`` 0 = a plain q
        projection); RoPE then rotates the ``qk_rope_head_dim`` part.

    MoE fields are ignored when ``num_experts == 0``. With every architecture feature at
    its default the model is the one before they existed (the same parameters, the same
    program).
    """

    vocab_size: int = option(257, "embedding rows; at least the tokenizer's vocabulary (257 = "
                                  "bytes + end-of-document), a multiple of 128 suits GPUs", Int(1))
    num_layers: int = option(2, "Transformer blocks", Int(1))
    d_model: int = option(64, "model width", Int(1))
    num_heads: int = option(4, "attention heads (divide d_model; head_dim even)", Int(1))
    d_ff: int = option(256, "hidden width of the dense SwiGLU layers (first_dense_layers)",
                       Int(0))
    max_len: int = option(128, "longest sequence (RoPE positions); data.seq_len <= max_len",
                          Int(1, 2**31 - 1, "an integer in [1, 2**31 - 1] (positions are int32)"))
    rope_theta: float = option(10000.0, "RoPE base frequency", _POSITIVE)
    norm_eps: float = option(1e-6, "RMSNorm epsilon", _POSITIVE)
    num_experts: int = option(0, "routed experts per MoE layer (0 = a dense model)", Int(0))
    num_shared_experts: int = option(0, "always-on experts per MoE layer (DeepSeekMoE)", Int(0))
    top_k: int = option(2, "routed experts per token", Int(1))
    d_expert: int = option(0, "hidden width of each expert", Int(0))
    first_dense_layers: int = option(0, "leading blocks with a dense SwiGLU instead of MoE",
                                     Int(0))
    score_fn: str = option("softmax", "router scores: softmax or sigmoid (DeepSeek-V3)",
                           Choice(SCORE_FNS))
    aux_loss_weight: float = option(0.01, "alpha of the load-balancing loss", Real(0))
    bias_update_rate: float = option(0.0, "gamma of auxiliary-loss-free balancing (DeepSeek-V3)",
                                     Real(0))
    capacity_factor: Optional[float] = option(
        0.0, "0 = dropless dispatch; > 0 = GShard slots per expert (expert parallelism needs it)",
        Kind(lambda v: v is None or Real(0).ok(v), "0 or None (dropless) or a finite number > 0"))
    moe_kernel: str = option("auto", "auto | ragged_dot | pallas (the Mosaic GPU grouped GEMM; "
                                     "auto: on Hopper and newer GPUs)", Choice(MOE_KERNELS))
    attention: str = option("auto", "reference | xla | cudnn | auto (cuDNN where it runs, else "
                                    "reference)", Choice(ATTENTION_IMPLEMENTATIONS))
    scan_layers: bool = option(False, "stack the blocks and run them with jax.lax.scan", BOOL)
    remat: str = option("none", "none | attention | dots_saveable | full (per block)",
                        Choice(REMAT_POLICIES))
    # Architecture features of open model families (jaxmp.models.hf); the defaults are off.
    num_kv_heads: int = option(0, "key/value heads (grouped-query attention; 0 = num_heads)",
                               Int(0))
    head_dim: int = option(0, "width of each head (0 = d_model / num_heads)", Int(0))
    qk_norm: bool = option(False, "per-head RMSNorm of q and k before RoPE (Qwen3)", BOOL)
    qkv_bias: bool = option(False, "biases on the q, k, v projections (Qwen2)", BOOL)
    tie_embeddings: bool = option(False, "the output head is the embedding table transposed",
                                  BOOL)
    rope_dim: int = option(0, "rotated dimensions per head (partial rotary; 0 = all)", Int(0))
    rope_layout: str = option("half", "half (pairs i, i+d/2: LLaMA) | interleaved (pairs 2i, "
                                      "2i+1: DeepSeek)", Choice(ROPE_LAYOUTS))
    rope_scaling: str = option("none", "none | llama3 | yarn (context extension of RoPE)",
                               Choice(ROPE_SCALINGS))
    rope_factor: float = option(1.0, "llama3/yarn: context extension factor", Real())
    rope_original_max_len: int = option(0, "llama3/yarn: the context before extension", Int(0))
    rope_low_freq_factor: float = option(1.0, "llama3: low-frequency band edge", Real())
    rope_high_freq_factor: float = option(4.0, "llama3: high-frequency band edge", Real())
    rope_beta_fast: float = option(32.0, "yarn: ramp edge in rotations (extrapolation)", Real())
    rope_beta_slow: float = option(1.0, "yarn: ramp edge in rotations (interpolation)", Real())
    rope_mscale: float = option(0.0, "yarn: mscale of the attention factor (0 = unset)", Real())
    rope_mscale_all_dim: float = option(0.0, "yarn: mscale_all_dim (0 = unset; MLA scales "
                                             "scores by its mscale squared)", Real())
    norm_topk_prob: bool = option(True, "normalize the chosen experts' gates to sum to 1", BOOL)
    routed_scaling_factor: float = option(1.0, "multiplies the routed experts' gates "
                                               "(DeepSeek-V3: 2.5)", _POSITIVE)
    n_group: int = option(1, "expert groups of group-limited routing (DeepSeek-V3)", Int(1))
    topk_group: int = option(1, "groups a token may route to (= n_group: routing not limited)",
                             Int(1))
    group_score: str = option("top2_sum", "a group's score: top2_sum (DeepSeek-V3) | max "
                                          "(DeepSeek-V2 group_limited_greedy)",
                              Choice(GROUP_SCORES))
    mlp_only_layers: Tuple[int, ...] = option(
        (), "layer indices with a dense FFN (Qwen-MoE), besides first_dense_layers",
        Kind(lambda v: isinstance(v, (tuple, list)) and all(is_int(i) and i >= 0 for i in v),
             "a tuple of layer indices"))
    q_lora_rank: int = option(0, "MLA: query latent width (0 = a plain q projection)", Int(0))
    kv_lora_rank: int = option(0, "MLA: key/value latent width (> 0 = Multi-head Latent "
                                  "Attention, DeepSeek-V2/V3)", Int(0))
    qk_nope_head_dim: int = option(0, "MLA: per-head q/k width without RoPE", Int(0))
    qk_rope_head_dim: int = option(0, "MLA: per-head q/k width with RoPE (one key shared)",
                                   Int(0))
    v_head_dim: int = option(0, "MLA: per-head value width", Int(0))

    def __post_init__(self):
        def need(ok, msg):
            if not ok:
                raise ValueError(msg)

        for f in dataclasses.fields(self):  # each field's own allowed values (its declaration)
            if f.metadata.get("allowed") is not None:
                check(f.name, getattr(self, f.name), f.metadata["allowed"])
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        head_dim_set = self.head_dim != 0
        if self.head_dim == 0:
            need(self.d_model % self.num_heads == 0,
                 f"num_heads={self.num_heads} must divide d_model={self.d_model} "
                 f"(or set head_dim)")
            object.__setattr__(self, "head_dim", self.d_model // self.num_heads)
        if self.num_kv_heads == 0:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        need(self.num_heads % self.num_kv_heads == 0,
             f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}")
        if self.is_mla:
            need(self.qk_rope_head_dim % 2 == 0,
                 f"qk_rope_head_dim={self.qk_rope_head_dim} must be even for RoPE")
        elif self.rope_dim:
            need(self.rope_dim % 2 == 0 and self.rope_dim <= self.head_dim,
                 f"rope_dim={self.rope_dim} must be even and at most head_dim={self.head_dim}")
        else:
            need(self.head_dim % 2 == 0,
                 f"head_dim = d_model / num_heads = {self.head_dim} must be even for RoPE "
                 f"(d_model={self.d_model}, num_heads={self.num_heads})" if not head_dim_set
                 else f"head_dim={self.head_dim} must be even for RoPE")
        if self.is_mla:
            for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                need(getattr(self, name) >= 1, f"{name}={getattr(self, name)} must be >= 1 "
                                               f"with kv_lora_rank > 0 (MLA)")
            need(not (self.qk_norm or self.qkv_bias),
                 "qk_norm and qkv_bias are not defined for MLA (kv_lora_rank > 0)")
        if self.rope_scaling != "none":
            need(self.rope_factor > 0 and self.rope_original_max_len >= 1,
                 f"rope_scaling={self.rope_scaling!r} needs rope_factor > 0 (got "
                 f"{self.rope_factor}) and rope_original_max_len >= 1 (got "
                 f"{self.rope_original_max_len})")
        if self.rope_scaling == "llama3":
            need(self.rope_high_freq_factor > self.rope_low_freq_factor > 0,
                 f"llama3 scaling needs rope_high_freq_factor={self.rope_high_freq_factor} > "
                 f"rope_low_freq_factor={self.rope_low_freq_factor} > 0")
        need(all(0 <= i < self.num_layers for i in self.mlp_only_layers),
             f"mlp_only_layers={list(self.mlp_only_layers)} must be layer indices in "
             f"[0, num_layers={self.num_layers})")
        need(0 <= self.first_dense_layers <= self.num_layers,
             f"first_dense_layers={self.first_dense_layers} must be in [0, "
             f"num_layers={self.num_layers}]")
        if self.num_dense_layers > 0:
            need(self.d_ff >= 1, f"d_ff={self.d_ff} must be >= 1 with "
                                 f"{self.num_dense_layers} dense layers")
        if self.num_experts > 0:
            need(1 <= self.top_k <= self.num_experts,
                 f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
            need(self.d_expert >= 1, f"d_expert={self.d_expert} must be >= 1 with num_experts > 0")
            cf = self.capacity_factor or 0.0
            need(cf * self.max_len * self.top_k / self.num_experts <= 2**31 - 1,
                 f"capacity_factor={self.capacity_factor} gives "
                 f"{cf * self.max_len * self.top_k / self.num_experts:.3g} slots per expert "
                 f"(capacity_factor * max_len * top_k / num_experts), more than an int32 array "
                 f"dimension holds (2**31 - 1); an expert never needs more than max_len slots: "
                 f"use at most num_experts / top_k = {self.num_experts / self.top_k:g}")
            need(self.num_experts % self.n_group == 0 and self.topk_group <= self.n_group,
                 f"n_group={self.n_group} must divide num_experts={self.num_experts} and "
                 f"topk_group={self.topk_group} be at most n_group")

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        """Builds a config from an ``ml_collections.ConfigDict`` (or any mapping).

        The run config's ``model.init_from`` (where the weights come from, not a shape
        field) is left out.

        Raises:
          ValueError: a key that is not a field (listed), or a value that fails
            validation.
        """
        data = dict(cfg.to_dict() if hasattr(cfg, "to_dict") else cfg)
        data.pop("init_from", None)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ValueError(f"unknown model config keys {unknown}; allowed: {sorted(fields)}")
        return cls(**data)

    @property
    def is_mla(self) -> bool:
        """Multi-head Latent Attention (``kv_lora_rank > 0``)."""
        return self.kv_lora_rank > 0

    @property
    def rope(self) -> Rope:
        """The :class:`~jaxmp.models.layers.Rope` these fields describe: each of its fields
        is the ``rope_<name>`` field here (MLA rotates its own ``qk_rope_head_dim``: dim 0)."""
        fields = {f.name: getattr(self, f"rope_{f.name}") for f in dataclasses.fields(Rope)}
        return Rope(**{**fields, "dim": 0 if self.is_mla else self.rope_dim})

    @property
    def num_dense_layers(self) -> int:
        if self.num_experts == 0:
            return self.num_layers
        # Counted, not enumerated: a config.json may announce a billion layers, and the
        # memory check that refuses it must answer at once.
        first = min(self.first_dense_layers, self.num_layers)
        return first + len({i for i in self.mlp_only_layers if first <= i < self.num_layers})

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    def is_moe_layer(self, i: int) -> bool:
        return (self.num_experts > 0 and i >= self.first_dense_layers
                and i not in self.mlp_only_layers)


def _std(config: ModelConfig):
    """GPT-2 init: normal(0.02), residual-branch output projections scaled by 1/sqrt(2L)."""
    return 0.02, 0.02 / math.sqrt(2 * config.num_layers)


def _block_module_suffixes(config: ModelConfig, i: int) -> Tuple[str, ...]:
    """The paths, relative to ``blocks/{i}``, of layer ``i``'s modules that have a policy."""
    common = ("attn_norm", "attn", "ffn_norm")
    if not config.is_moe_layer(i):
        return common + ("mlp",)
    shared = ("moe/shared_experts",) if config.num_shared_experts > 0 else ()
    return common + ("moe", "moe/router", "moe/experts") + shared


def layer_stacks(config: ModelConfig, rules: PolicyRules) -> Tuple[Tuple[int, ...], ...]:
    """The layer indices of each stack of the scanned layout, in layer order.

    A stack is a maximal run of consecutive layers of the same kind (dense FFN or MoE)
    whose modules (``blocks/{i}/attn_norm``, ``.../attn``, ``.../ffn_norm``, ``.../mlp``
    or ``.../moe``, ``.../moe/router``, ``.../moe/experts``, ``.../moe/shared_experts``)
    resolve to the same policies under ``rules`` (the model's rules, float32 islands
    included). Without per-layer rules there is one dense and one MoE stack.

    Returns:
      e.g. ``((0,), (1, 2, 3))`` for one dense layer then three MoE layers.
    """
    def signature(i):
        return (config.is_moe_layer(i),
                tuple(rules.resolve(f"blocks/{i}/{sub}")
                      for sub in _block_module_suffixes(config, i)))

    stacks, current = [], [0]
    for i in range(1, config.num_layers):
        if signature(i) == signature(current[-1]):
            current.append(i)
        else:
            stacks.append(tuple(current))
            current = [i]
    stacks.append(tuple(current))
    return tuple(stacks)


class Block(nnx.Module):
    """Pre-norm block: attention and a dense (``mlp``) or MoE (``moe``) FFN, each residual.

    ``__call__(h [B, T, d], *, expert_axis, dispatch_dtype, valid_length, operands) ->
    (h, MoEStats or None)`` (the keywords as :meth:`MoETransformer.__call__`'s); the
    residual keeps ``h``'s dtype. ``layers`` holds the indices of the layers this block
    is: ``(index,)``, or in the scanned layout the stack's layers (its variables then have
    a leading ``layers`` axis). ``target``: the compile target of the attention and routed experts'
    kernel choices (:class:`MoETransformer`).
    """

    def __init__(self, config: ModelConfig, index: int, *, rules: PolicyRules, rngs: nnx.Rngs,
                 target: Optional[compile_target.Target] = None):
        path = f"blocks/{index}"
        self.layers = (index,)
        std, out_std = _std(config)
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps, path=f"{path}/attn_norm",
                                 rules=rules, rngs=rngs)
        if config.is_mla:
            self.attn = MLAttention(config.d_model, config.num_heads,
                                    q_lora_rank=config.q_lora_rank,
                                    kv_lora_rank=config.kv_lora_rank,
                                    qk_nope_head_dim=config.qk_nope_head_dim,
                                    qk_rope_head_dim=config.qk_rope_head_dim,
                                    v_head_dim=config.v_head_dim, rope=config.rope,
                                    path=f"{path}/attn", rules=rules, rngs=rngs, init_std=std,
                                    out_std=out_std, implementation=config.attention,
                                    recompute_core=config.remat == "attention", target=target)
        else:
            self.attn = Attention(config.d_model, config.num_heads, config.rope_theta,
                                  path=f"{path}/attn",
                                  rules=rules, rngs=rngs, init_std=std, out_std=out_std,
                                  implementation=config.attention,
                                  recompute_core=config.remat == "attention",
                                  num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                                  qk_norm=config.qk_norm, qkv_bias=config.qkv_bias,
                                  norm_eps=config.norm_eps, rope=config.rope, target=target)
        self.ffn_norm = RMSNorm(config.d_model, config.norm_eps, path=f"{path}/ffn_norm",
                                rules=rules, rngs=rngs)
        if config.is_moe_layer(index):
            self.moe = MoE(config.d_model, config.num_experts, config.num_shared_experts,
                           config.top_k,
                           config.d_expert, config.score_fn, config.capacity_factor,
                           path=f"{path}/moe",
                           rules=rules, rngs=rngs, init_std=std, out_std=out_std,
                           moe_kernel=config.moe_kernel, norm_topk_prob=config.norm_topk_prob,
                           routed_scaling_factor=config.routed_scaling_factor,
                           n_group=config.n_group, topk_group=config.topk_group,
                           group_score=config.group_score, target=target)
        else:
            self.mlp = SwiGLU(config.d_model, config.d_ff, path=f"{path}/mlp", rules=rules,
                              rngs=rngs,
                              init_std=std, out_std=out_std)

    def __call__(self, h: jax.Array, *, expert_axis: Optional[str] = None,
                 dispatch_dtype: str = comm.DEFAULT_DISPATCH_DTYPE,
                 valid_length: Optional[jax.Array] = None,
                 operands: Optional[dict] = None):
        """One block; the keyword arguments are :meth:`MoETransformer.__call__`'s."""
        h = h + self.attn(self.attn_norm(h), operands=operands).astype(h.dtype)
        stats = None
        if hasattr(self, "moe"):
            y, stats = self.moe(self.ffn_norm(h), expert_axis=expert_axis,
                                dispatch_dtype=dispatch_dtype, valid_length=valid_length,
                                operands=operands)
        else:
            y = self.mlp(self.ffn_norm(h), operands=operands)
        return h + y.astype(h.dtype), stats


def _stack(blocks) -> Block:
    """One :class:`Block` holding ``blocks``' variables stacked on a new leading axis.

    The first block is reused as the template (its policies are every block's, by
    :func:`layer_stacks`); each variable gets the logical axis ``layers`` first.
    """
    template = blocks[0]
    nnx.update(template, jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(b) for b in blocks]))
    for _, var in nnx.iter_graph(template):
        if isinstance(var, nnx.Variable):
            axes = var.get_metadata().get("out_sharding") or (None,) * (var.get_value().ndim - 1)
            var.set_metadata(out_sharding=("layers",) + tuple(axes))
    template.layers = tuple(i for b in blocks for i in b.layers)
    return template


def _run_block(graphdef, remat: str, prevent_cse: bool, gather=None, dtypes=None,
               block_args: Optional[Mapping[str, Any]] = None):
    """``(block state, h) -> (h, stats)`` for one block called with ``block_args``
    (:meth:`Block.__call__`'s keywords), under ``jax.checkpoint`` when ``remat`` asks for
    a block-level policy. With ``gather`` (FSDP) the block's parameters are gathered
    inside, and the block always runs under :func:`jaxmp.sharding.fsdp_checkpoint_policy`
    of ``remat``'s policy: it keeps its split parameters and gathers them again for the
    backward pass, and saves no more than ``remat`` allows."""
    block_args = dict(block_args or {})

    def run(state, h):
        if gather is not None:
            state = _gathered(state, dtypes, gather)
        return nnx.merge(graphdef, state)(h, **block_args)

    policy = _BLOCK_CHECKPOINT_POLICIES.get(remat)
    if gather is not None:  # FSDP: the remat policy, and never a gathered weight
        policy = fsdp_checkpoint_policy(policy)
    elif policy is None:
        return run
    return jax.checkpoint(run, policy=policy, prevent_cse=prevent_cse)


def param_compute_dtypes(module: nnx.Module) -> dict:
    """``{path: compute dtype}`` of every parameter of ``module``, from the policy of the
    module that holds it: what a compute-dtype copy (ZeRO-1) or gather (FSDP) casts it
    to. Paths are those of ``nnx.to_flat_state(nnx.state(module, nnx.Param))``."""
    out = {}
    for path, m in nnx.iter_modules(module):
        policy = getattr(m, "policy", None)
        if policy is None:
            continue
        for name, value in vars(m).items():
            if isinstance(value, nnx.Param):
                out[tuple(path) + (name,)] = policy.compute_dtype
    return out


def _gathered(state, dtypes: dict, gather):
    """``state`` with each parameter gathered whole by ``gather`` (FSDP, inside the train
    step); other variables (router biases) pass through. A scanned layer's slice keeps
    its stacked variable's axis names: the leading ``layers`` is dropped to match."""
    flat = []
    for path, var in nnx.to_flat_state(state):
        if isinstance(var, nnx.Param) and path in dtypes:
            value = var.get_value()
            axes = tuple(var.get_metadata().get("out_sharding") or ())
            if len(axes) == value.ndim + 1 and axes[:1] == ("layers",):
                axes = axes[1:]
            var = var.replace(gather(value, axes, dtypes[path]))
        flat.append((path, var))
    return nnx.from_flat_state(flat)


def _call_gathered(module: nnx.Module, gather, *args, method: str = "__call__", **kwargs):
    """``module.method(*args, **kwargs)``, with its parameters gathered first by ``gather``
    (FSDP, not None) under :func:`jaxmp.sharding.fsdp_checkpoint_policy`: the backward
    pass gathers them again."""
    if gather is None:
        return getattr(module, method)(*args, **kwargs)
    graphdef, state = nnx.split(module)
    dtypes = param_compute_dtypes(module)

    def run(state, *args):
        module = nnx.merge(graphdef, _gathered(state, dtypes, gather))
        return getattr(module, method)(*args, **kwargs)

    return jax.checkpoint(run, policy=fsdp_checkpoint_policy())(state, *args)


class MoETransformer(nnx.Module):
    """Decoder-only MoE Transformer; see the module docstring for paths and precision.

    Args:
      config: the :class:`ModelConfig`.
      rules: per-module precision (a :class:`~jaxmp.precision.policy.PolicyRules` or anything
        :func:`~jaxmp.precision.policy.get_policy_rules` parses, e.g.
        ``"mixed_bf16; router: fp32"``).
      rngs: NNX rngs (stream ``params``).
      target: the compile target (:class:`jaxmp.target.Target`, the devices the program
        will run on, which for a deviceless compile are not this host's) that the
        hardware choices are made for, once, here: ``config.attention="auto"``
        (:func:`~jaxmp.models.attention.resolve_attention`) and ``config.moe_kernel="auto"``
        (:func:`~jaxmp.models.moe.resolve_moe_kernel`). None = :func:`jaxmp.target.current`
        (this host's first device outside :func:`jaxmp.target.compiling_for`);
        :meth:`jaxmp.train.Experiment.create` passes the mesh's.

    Attributes: ``embed``, ``final_norm``, ``head``, and ``blocks`` (a list of
    :class:`Block`, one per layer) or, with ``config.scan_layers``, ``stacks`` (one
    stacked :class:`Block` per entry of :func:`layer_stacks`).

    Raises:
      ValueError: an attention path that cannot run here (``"cudnn"`` off a GPU).
    """

    def __init__(self, config: ModelConfig, rules: PolicyRules, *, rngs: nnx.Rngs,
                 target: Optional[compile_target.Target] = None):
        # Routers and norms are float32 islands, and an FP8 default leaves the embedding and
        # head alone, unless one of the user's rules says otherwise.
        rules = without_fp8(with_float32_islands(get_policy_rules(rules), FLOAT32_ISLANDS),
                            FP8_EXCLUDED)
        self.rules = rules
        self.config = config
        rngs = ParamKeys(rngs)  # the same keys as rngs.params(), drawn in time linear in layers
        self.embed = Embed(config.vocab_size, config.d_model, path="embed", rules=rules, rngs=rngs,
                           head_path="head" if config.tie_embeddings else None)
        target = target or compile_target.current()
        blocks = [Block(config, i, rules=rules, rngs=rngs, target=target)
                  for i in range(config.num_layers)]
        if config.scan_layers:
            self.stacks = nnx.List([_stack([blocks[i] for i in layers])
                                    for layers in layer_stacks(config, rules)])
        else:
            self.blocks = nnx.List(blocks)
        self.final_norm = RMSNorm(config.d_model, config.norm_eps, path="final_norm", rules=rules,
                                  rngs=rngs)
        if not config.tie_embeddings:
            self.head = Head(config.d_model, config.vocab_size, path="head", rules=rules,
                             rngs=rngs)
        rngs.commit()  # the stream's count, as if each key had been drawn from it

    def layer_blocks(self):
        """The model's :class:`Block` s in layer order: one per layer, or one per stack."""
        return list(self.stacks if self.config.scan_layers else self.blocks)

    def routers(self):
        """``[(Router, num_layers)]`` of the MoE layers in layer order: one router per MoE
        layer, or per MoE stack with its ``[num_layers, E]`` bias (the rows of
        ``aux["expert_counts"]`` follow this order)."""
        return [(b.moe.router, len(b.layers)) for b in self.layer_blocks() if hasattr(b, "moe")]

    def module_paths(self):
        """The per-layer paths (``blocks/{i}/attn``, ...) of every module with a policy,
        which policy rules are matched against, in either layout."""
        out = []
        for path, module in nnx.iter_modules(self):
            if not path or not hasattr(module, "policy"):
                continue
            if self.config.scan_layers and path[0] == "stacks":
                rest = module.path.split("/", 2)[2]
                out.extend(f"blocks/{i}/{rest}" for i in self.stacks[int(path[1])].layers)
            else:
                out.append(module.path)
        return out

    def __call__(self, tokens: jax.Array, *, param_gather: Optional[Callable] = None,
                 expert_axis: Optional[str] = None,
                 dispatch_dtype: str = comm.DEFAULT_DISPATCH_DTYPE,
                 valid_length: Optional[jax.Array] = None, operands: Optional[dict] = None):
        """Forward pass.

        The keyword arguments matter only inside the train and eval steps' ``shard_map``
        (the first three: :func:`jaxmp.train.step.forward_args` of the run's
        :class:`~jaxmp.sharding.StepPlan`), for sampling from a fixed-shape buffer
        (``valid_length``) and for diagnostics (``operands``); their defaults run the
        model on whole arrays.

        Args:
          tokens: int [B, T] token ids, T <= max_len.
          param_gather: ``gather(value, logical_axes, dtype) -> value``, the FSDP all-gather
            of a parameter split over the data axis (``StepPlan.gather``,
            :func:`jaxmp.comm.gather_param`), or None (parameters are whole). Each module
            gathers its own parameters, under :func:`jaxmp.sharding.fsdp_checkpoint_policy`
            (the backward pass gathers them again).
          expert_axis: the mesh axis the routed experts are split over (expert
            parallelism), or None (:meth:`~jaxmp.models.moe.RoutedExperts.__call__`).
          dispatch_dtype: one of :data:`jaxmp.sharding.DISPATCH_DTYPES`: the dtype the
            expert-parallel all-to-all sends tokens in.
          valid_length: int32 scalar n (may be traced), ``1 <= n <= T``: only the first n
            tokens of each row are real (capacity dispatch then gives the padding no
            expert slot, :meth:`~jaxmp.models.moe.RoutedExperts.__call__`); None = all T.
          operands: a dict that every weight matmul records its operands in, keyed
            ``"<module path>/<weight>"`` (:func:`~jaxmp.models.layers.matmul`;
            :func:`jaxmp.diagnostics.fp8_report` reads it), or None. Run the model eagerly,
            unscanned and without block remat to get arrays rather than tracers.

        Returns:
          ``(logits, aux)``: logits [B, T, vocab_size] in the head's compute dtype
          (bfloat16 under ``mixed_bf16``; pass them to :func:`jaxmp.ops.cross_entropy`,
          which computes in float32, or upcast them); aux a dict of float32
          ``aux_loss`` (scalar, ``aux_loss_weight * sum`` of the MoE layers' balance
          losses), ``expert_counts`` ([num_moe_layers, num_experts], token-expert
          assignments per expert over the whole batch, rows in layer order; [0, 0]
          without MoE layers) and ``dropped_fraction`` (scalar, mean over MoE layers of
          the fraction of assignments dropped by capacity; 0 dropless).

        Raises:
          ValueError: tokens not an integer [B, T] array, T > max_len, or a
            ``dispatch_dtype`` not in :data:`jaxmp.sharding.DISPATCH_DTYPES`.
        """
        cfg = self.config
        if jnp.ndim(tokens) != 2 or not jnp.issubdtype(jnp.result_type(tokens), jnp.integer):
            raise ValueError("tokens must be an integer [B, T] array, got shape "
                             f"{jnp.shape(tokens)} dtype {jnp.result_type(tokens)}")
        if tokens.shape[1] > cfg.max_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_len={cfg.max_len}")
        check_choice("dispatch_dtype", dispatch_dtype, DISPATCH_DTYPES)
        block_args = dict(expert_axis=expert_axis, dispatch_dtype=dispatch_dtype,
                          valid_length=valid_length, operands=operands)
        # FSDP (param_gather): each module gathers its own weights.
        h = constrain(_call_gathered(self.embed, param_gather, tokens), _ACT_AXES)
        stats = []  # MoEStats with a leading layer axis, in layer order
        for block in self.layer_blocks():
            graphdef, state = nnx.split(block)
            # scan needs no CSE guard
            run = _run_block(graphdef, cfg.remat, prevent_cse=not cfg.scan_layers,
                             gather=param_gather, block_args=block_args,
                             dtypes=param_compute_dtypes(block) if param_gather else None)
            if cfg.scan_layers:
                def body(h, layer_state, run=run):
                    h, s = run(layer_state, h)
                    return constrain(h, _ACT_AXES), s

                h, s = jax.lax.scan(body, h, state)
            else:
                h, s = run(state, h)
                h = constrain(h, _ACT_AXES)
                s = None if s is None else jax.tree.map(lambda x: x[None], s)
            if s is not None:
                stats.append(s)
        h = _call_gathered(self.final_norm, param_gather, h)
        if cfg.tie_embeddings:
            logits = _call_gathered(self.embed, param_gather, h, method="attend")
        else:
            logits = _call_gathered(self.head, param_gather, h, operands=operands)
        if stats:
            stats = MoEStats(*(jnp.concatenate(parts) for parts in zip(*stats)))
            balance, counts = jnp.sum(stats.balance_loss), stats.expert_counts
            dropped = jnp.mean(stats.dropped_fraction)
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
    is only reached with its 2 x 0.93B embedding/head parameters included). The same in
    either layout (a stack's routed experts hold all its layers).

    Returns:
      ``(total, active_per_token)`` as Python ints.
    """
    total = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(nnx.state(model, nnx.Param)))
    inactive = 0
    cfg = model.config
    for _, module in nnx.iter_modules(model):
        if isinstance(module, RoutedExperts):
            routed = sum(int(np.prod(w.shape)) for w in (module.w_gate, module.w_up, module.w_down))
            inactive += routed // cfg.num_experts * (cfg.num_experts - cfg.top_k)
    return total, total - inactive
