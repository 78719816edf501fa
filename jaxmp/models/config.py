"""The model's configuration: :class:`ModelConfig`, each field declared once with its
default, the values it allows and its meaning (the run config's ``model.*`` keys).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Tuple

from jaxmp._checks import BOOL, F32_MAX, Choice, Int, Kind, Real, check, is_int, option
from jaxmp.models.attention import ATTENTION_IMPLEMENTATIONS
from jaxmp.models.layers import MLP_ACTIVATIONS, ROPE_LAYOUTS, ROPE_SCALINGS, Rope
from jaxmp.models.linear_attention import LINEAR_PROJECTIONS
from jaxmp.models.moe import EXPERT_ACTIVATIONS, GROUP_SCORES, MOE_KERNELS, SCORE_FNS

__all__ = ["ModelConfig", "REMAT_POLICIES", "LAYER_TYPES"]

# What a layer's attention is (transformers' ``layer_types`` names): every earlier token,
# the last ``sliding_window`` tokens, or Gated DeltaNet's state (Qwen3-Next).
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")

# model.remat settings, in order of growing recomputation (jaxmp.models.transformer's
# docstring says what each recomputes).
REMAT_POLICIES = ("none", "attention", "dots_saveable", "full")

_POSITIVE = Real(0, lo_open=True)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and routing hyper-parameters of :class:`~jaxmp.models.transformer.MoETransformer` (validated on creation).

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
      scan_layers: stack the blocks and run them with ``jax.lax.scan``
        (:mod:`jaxmp.models.transformer`'s docstring); False runs them in a Python loop.
      remat: per-block rematerialization, one of :data:`REMAT_POLICIES`
        (:mod:`jaxmp.models.transformer`'s docstring says what each keeps).

      num_kv_heads: key/value heads (grouped-query attention, Ainslie et al. 2023);
        must divide ``num_heads``; 0 = ``num_heads``, stored resolved.
      head_dim: per-head width; 0 = ``d_model / num_heads`` (``num_heads`` must then
        divide ``d_model``), stored resolved.
      qk_norm: per-head RMSNorm of q and k before RoPE (Qwen3): modules
        ``blocks/{i}/attn/q_norm``, ``.../k_norm``.
      qkv_bias: biases on the q, k, v projections (Qwen2).
      o_bias: a bias on the attention output projection (``o_proj``; Llama's
        ``attention_bias`` sets it with ``qkv_bias``).
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
      rope_truncate: yarn's ``truncate``: the ramp's edges are rounded out to whole
        dimensions (``floor`` / ``ceil``; transformers' default), or kept fractional
        (GPT-OSS).
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
      sliding_window: sliding-window attention (Mistral, Qwen2; Beltagy et al. 2020): a
        query sees its own token and the ``sliding_window - 1`` tokens before it
        (transformers' ``kv_idx > q_idx - sliding_window``); 0 = none.
      layer_types: per layer, one of :data:`LAYER_TYPES` (transformers' ``layer_types``);
        ``()`` = every layer ``sliding_attention`` when ``sliding_window > 0``, else every
        layer ``full_attention`` (see :meth:`attention_window`).
      linear_num_key_heads, linear_num_value_heads, linear_key_head_dim,
        linear_value_head_dim, linear_conv_kernel: the ``linear_attention`` layers'
        Gated DeltaNet (:class:`~jaxmp.models.linear_attention.GatedDeltaNet`,
        transformers' ``linear_*`` fields of ``Qwen3NextConfig``); needed (>= 1) when
        ``layer_types`` names such a layer.
      linear_projections: how those layers' input projections are laid out, one of
        :data:`~jaxmp.models.linear_attention.LINEAR_PROJECTIONS`: ``grouped``
        (Qwen3-Next's ``in_proj_qkvz``, ``in_proj_ba``) or ``split`` (Qwen3.5's
        ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``).
      attention_output_gate: the q projection gives a gate too, and attention's output is
        multiplied by its sigmoid (Qwen3-Next's gated attention; ``wq`` is ``[d, H, 2
        head_dim]``).
      shared_expert_gate: the shared experts' output is multiplied by ``sigmoid(x w)``,
        ``w [d_model, 1]`` (Qwen3-Next's ``shared_expert_gate``; parameter
        ``.../moe/shared_gate``).
      rope_local_theta: the RoPE base of the sliding-window layers, which rotate by plain
        RoPE whatever ``rope_scaling`` says (Gemma 3's ``rope_local_base_freq``); 0 = every
        layer's RoPE is the one ``rope_*`` describes.
      norm_plus_one: every RMSNorm's gain is ``1 + scale`` (Gemma; weights stored around 0).
      post_norms: a norm after the attention and after the FFN too, before each residual
        add (Gemma 2/3's ``post_attention_layernorm``, ``post_feedforward_layernorm``):
        modules ``blocks/{i}/post_attn_norm``, ``.../post_ffn_norm``.
      embed_scale: the embedding rows' multiplier (Gemma: ``sqrt(d_model)``).
      query_pre_attn_scalar: the attention scores' scale is ``query_pre_attn_scalar ** -0.5``
        (Gemma); 0 = ``head_dim ** -0.5``.
      moe_bias: a learned bias of the router's logits and biases on each routed expert's
        projections (GPT-OSS's ``router.bias``, ``gate_up_proj_bias``,
        ``down_proj_bias``): parameters ``.../moe/router/logit_bias``,
        ``.../moe/experts/b_gate``, ``b_up``, ``b_down``.
      expert_activation: the routed experts' activation, one of
        :data:`~jaxmp.models.moe.EXPERT_ACTIVATIONS`: ``silu`` (SwiGLU) or
        ``clamped_swiglu`` (GPT-OSS: ``(clip(up, -limit, limit) + 1) * g * sigmoid(alpha
        g)``, ``g = min(gate, limit)``).
      swiglu_alpha, swiglu_limit: ``alpha`` and ``limit`` of ``clamped_swiglu``
        (transformers' ``GptOssConfig`` defaults, 1.702 and 7.0); unread otherwise.
      attention_sinks: a learned logit per query head in the attention softmax's
        denominator, with no value (GPT-OSS's ``sinks``; module parameter
        ``blocks/{i}/attn/sinks``): a query may attend to nothing.
      mlp_activation: the gated FFN's activation, a key of
        :data:`~jaxmp.models.layers.MLP_ACTIVATIONS`: ``silu`` (SwiGLU) or ``gelu_tanh``
        (GeGLU, Gemma).
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
    norm_eps: float = option(1e-6, "RMSNorm epsilon (added in float32)",
                             Real(0, F32_MAX, lo_open=True,
                                  text="a finite number > 0 that float32 holds"))
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
    o_bias: bool = option(False, "a bias on the attention output projection (Llama's "
                                 "attention_bias)", BOOL)
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
    rope_truncate: bool = option(True, "yarn: round the ramp's edges to whole dimensions "
                                       "(transformers' truncate)", BOOL)
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
    sliding_window: int = option(0, "sliding-window attention: a query sees itself and the "
                                    "sliding_window - 1 tokens before it (0 = none)",
                                 Int(0, 2**31 - 1))
    layer_types: Tuple[str, ...] = option(
        (), "per layer full_attention | sliding_attention | linear_attention (() = every "
            "layer sliding when sliding_window > 0)",
        Kind(lambda v: isinstance(v, (tuple, list)) and all(t in LAYER_TYPES for t in v),
             f"a tuple of {' | '.join(LAYER_TYPES)}, one per layer"))
    linear_num_key_heads: int = option(0, "linear_attention layers: q/k heads (Qwen3-Next)",
                                       Int(0))
    linear_num_value_heads: int = option(0, "linear_attention layers: value heads, a multiple "
                                            "of linear_num_key_heads", Int(0))
    linear_key_head_dim: int = option(0, "linear_attention layers: q/k head width", Int(0))
    linear_value_head_dim: int = option(0, "linear_attention layers: value head width", Int(0))
    linear_conv_kernel: int = option(4, "linear_attention layers: the causal convolution's "
                                        "width in tokens", Int(1))
    linear_projections: str = option("grouped", "linear_attention layers' input projections: "
                                                "grouped (Qwen3-Next) | split (Qwen3.5)",
                                     Choice(LINEAR_PROJECTIONS))
    attention_output_gate: bool = option(False, "attention's output times the sigmoid of a "
                                                "gate the q projection gives (Qwen3-Next)",
                                         BOOL)
    shared_expert_gate: bool = option(False, "the shared experts' output times a sigmoid gate "
                                             "of the token (Qwen3-Next)", BOOL)
    rope_local_theta: float = option(0.0, "RoPE base of the sliding-window layers, plain RoPE "
                                          "(Gemma 3; 0 = as every layer)", Real(0))
    norm_plus_one: bool = option(False, "RMSNorm gains are 1 + scale (Gemma)", BOOL)
    post_norms: bool = option(False, "a norm after attention and after the FFN too (Gemma)",
                              BOOL)
    embed_scale: float = option(1.0, "multiplier of the embedding rows (Gemma: sqrt(d_model))",
                                _POSITIVE)
    query_pre_attn_scalar: float = option(0.0, "attention scores scaled by its -1/2 power "
                                               "(Gemma; 0 = head_dim)", Real(0))
    moe_bias: bool = option(False, "a learned router logit bias and biases on each expert's "
                                   "projections (GPT-OSS)", BOOL)
    expert_activation: str = option("silu", "routed experts' activation: silu (SwiGLU) | "
                                            "clamped_swiglu (GPT-OSS)",
                                    Choice(EXPERT_ACTIVATIONS))
    swiglu_alpha: float = option(1.702, "clamped_swiglu: the sigmoid's gain alpha (GPT-OSS)",
                                 _POSITIVE)
    swiglu_limit: float = option(7.0, "clamped_swiglu: the clamp of gate (above) and up "
                                      "(both sides) (GPT-OSS)", _POSITIVE)
    attention_sinks: bool = option(False, "a learned per-head logit in the attention softmax's "
                                          "denominator (GPT-OSS)", BOOL)
    mlp_activation: str = option("silu", "gated FFN activation: silu (SwiGLU) | gelu_tanh "
                                         "(GeGLU, Gemma)", Choice(tuple(MLP_ACTIVATIONS)))
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
            need(not (self.qk_norm or self.qkv_bias or self.o_bias),
                 "qk_norm, qkv_bias and o_bias are not defined for MLA (kv_lora_rank > 0)")
        if self.rope_scaling == "linear":
            need(self.rope_factor > 0, f"rope_scaling='linear' needs rope_factor > 0 (got "
                                       f"{self.rope_factor})")
        elif self.rope_scaling != "none":
            need(self.rope_factor > 0 and self.rope_original_max_len >= 1,
                 f"rope_scaling={self.rope_scaling!r} needs rope_factor > 0 (got "
                 f"{self.rope_factor}) and rope_original_max_len >= 1 (got "
                 f"{self.rope_original_max_len})")
        if self.rope_scaling == "llama3":
            need(self.rope_high_freq_factor > self.rope_low_freq_factor > 0,
                 f"llama3 scaling needs rope_high_freq_factor={self.rope_high_freq_factor} > "
                 f"rope_low_freq_factor={self.rope_low_freq_factor} > 0")
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.layer_types:
            need(len(self.layer_types) == self.num_layers,
                 f"layer_types has {len(self.layer_types)} entries; it needs one per layer "
                 f"(num_layers={self.num_layers}) or none")
            need(self.sliding_window > 0 or "sliding_attention" not in self.layer_types,
                 "layer_types names sliding_attention layers but sliding_window=0; give the "
                 "window (tokens)")
        if "linear_attention" in self.layer_types:
            need(min(self.linear_num_key_heads, self.linear_num_value_heads,
                     self.linear_key_head_dim, self.linear_value_head_dim) >= 1,
                 "layer_types names linear_attention layers: linear_num_key_heads, "
                 "linear_num_value_heads, linear_key_head_dim and linear_value_head_dim must "
                 "be >= 1")
            need(self.linear_num_value_heads % self.linear_num_key_heads == 0,
                 f"linear_num_value_heads={self.linear_num_value_heads} must be a multiple of "
                 f"linear_num_key_heads={self.linear_num_key_heads}")
            need(not self.is_mla, "linear_attention layers are not defined with MLA "
                                  "(kv_lora_rank > 0)")
        need(not (self.shared_expert_gate and not self.num_shared_experts),
             "shared_expert_gate needs shared experts (num_shared_experts > 0)")
        need(not (self.is_mla and self.sliding_window),
             f"sliding_window={self.sliding_window} is not defined for MLA (kv_lora_rank > 0)")
        need(not (self.is_mla and self.attention_sinks),
             "attention_sinks are not defined for MLA (kv_lora_rank > 0)")
        need(not (self.is_mla and (self.norm_plus_one or self.query_pre_attn_scalar)),
             "norm_plus_one and query_pre_attn_scalar are not defined for MLA (kv_lora_rank > 0)")
        need(not (self.rope_local_theta and not self.sliding_window),
             f"rope_local_theta={self.rope_local_theta} is the base of sliding-window layers, "
             f"and sliding_window=0")
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

    def layer_rope(self, i: int) -> Rope:
        """Layer ``i``'s :class:`~jaxmp.models.layers.Rope`: :attr:`rope`, or for a
        sliding-window layer with ``rope_local_theta`` plain RoPE of that base."""
        if self.rope_local_theta and self.attention_window(i):
            return dataclasses.replace(self.rope, theta=self.rope_local_theta, scaling="none")
        return self.rope

    def layer_type(self, i: int) -> str:
        """Layer ``i``'s kind, one of :data:`LAYER_TYPES`."""
        if self.layer_types:
            return self.layer_types[i]
        return "sliding_attention" if self.sliding_window else "full_attention"

    def attention_window(self, i: int) -> int:
        """Layer ``i``'s sliding window in tokens, 0 for full (causal) attention and for a
        linear_attention layer."""
        if not self.sliding_window or self.layer_type(i) == "linear_attention":
            return 0
        slides = not self.layer_types or self.layer_types[i] == "sliding_attention"
        return self.sliding_window if slides else 0

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
