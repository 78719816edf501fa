"""Models: the DeepSeekMoE-style decoder-only Transformer with per-module precision."""
from jaxmp.models.moe import (
    MoE,
    MoEStats,
    RoutedExperts,
    Router,
    RouterBias,
    Routing,
    SwiGLU,
    expert_capacity,
    update_router_bias,
)
from jaxmp.models.transformer import (
    Attention,
    Block,
    Embed,
    Head,
    ModelConfig,
    MoETransformer,
    RMSNorm,
    apply_rope,
    count_params,
    generate,
)

__all__ = [
    "ModelConfig", "MoETransformer", "RouterBias", "update_router_bias", "count_params",
    "generate", "apply_rope", "MoE", "MoEStats", "Router", "Routing", "RoutedExperts",
    "SwiGLU", "expert_capacity", "RMSNorm", "Embed", "Attention", "Head", "Block",
]
