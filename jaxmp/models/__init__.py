"""Models: the DeepSeekMoE-style decoder-only Transformer with per-module precision.

* :mod:`~jaxmp.models.layers`: parameters with logical axes, RMSNorm, embedding, head,
  SwiGLU, RoPE, the policy-aware :func:`matmul` (FP8 or ``cast_matmul``) and the
  :class:`FP8State` of delayed scaling;
* :mod:`~jaxmp.models.attention`: causal self-attention on the reference, XLA or cuDNN path;
* :mod:`~jaxmp.models.moe`: router, routed and shared experts, auxiliary-loss-free biases;
* :mod:`~jaxmp.models.config`: :class:`ModelConfig`, each field declared once (the run
  config's ``model.*`` keys);
* :mod:`~jaxmp.models.transformer`: :class:`MoETransformer` (scanned layers, per-block
  rematerialization);
* :mod:`~jaxmp.models.sampling`: :func:`generate`;
* :mod:`~jaxmp.models.hf`: :func:`from_pretrained` / :func:`save_pretrained`, Hugging Face
  checkpoints of the families in :data:`jaxmp.models.hf.FAMILIES` (one module each in
  ``jaxmp/models/hf/families/``).
"""
from jaxmp.models.attention import ATTENTION_IMPLEMENTATIONS, Attention, attention_core
from jaxmp.models.layers import (
    Embed,
    FP8State,
    Head,
    RMSNorm,
    SwiGLU,
    add_fp8_states,
    apply_rope,
    make_param,
    matmul,
)
from jaxmp.models.moe import (
    MoE,
    MoEStats,
    RoutedExperts,
    Router,
    RouterBias,
    Routing,
    expert_capacity,
    update_router_bias,
)
from jaxmp.models.lora import FrozenParam, Lora, apply_lora
from jaxmp.models.hf import from_pretrained, save_pretrained
from jaxmp.models.sampling import generate
from jaxmp.models.config import REMAT_POLICIES, ModelConfig
from jaxmp.models.transformer import (
    FLOAT32_ISLANDS,
    FP8_EXCLUDED,
    Block,
    MoETransformer,
    count_params,
    layer_stacks,
)

__all__ = [
    "ModelConfig", "MoETransformer", "RouterBias", "update_router_bias", "count_params",
    "generate", "apply_rope", "make_param", "MoE", "MoEStats", "Router", "Routing",
    "RoutedExperts", "SwiGLU", "expert_capacity", "RMSNorm", "Embed", "Attention", "Head",
    "Block", "FLOAT32_ISLANDS", "ATTENTION_IMPLEMENTATIONS", "attention_core", "REMAT_POLICIES",
    "layer_stacks", "FP8_EXCLUDED", "FP8State", "add_fp8_states", "matmul",
    "from_pretrained", "save_pretrained", "Lora", "FrozenParam", "apply_lora",
]
