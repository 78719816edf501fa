"""A tiny MoE Transformer that learns the embedded corpus on 2 CPU cores in minutes.

    python train.py --config configs/tiny_moe.py --workdir runs/tiny

Bytes of the Python standard library's source (the default corpus); mixed bfloat16
with the router and norms in float32 (bfloat16 has float32's range: no loss scale is
needed). Every key it does not set keeps its default (``python train.py --help``,
docs/CONFIG.md): the default model is a tiny dense one (vocabulary 257, 2 blocks of
width 64, 4 heads, SwiGLU width 256, 128 positions), and this file makes its second
block a DeepSeekMoE layer. Try float16 with dynamic loss scaling:

    python train.py --config configs/tiny_moe.py --workdir runs/tiny_fp16 \
        --config.precision.policy="mixed_fp16; router: fp32; norm: fp32" \
        --config.precision.loss_scale=dynamic:init=2**15,growth_interval=200
"""
import ml_collections

from jaxmp.train.config import default_config


def get_config() -> ml_collections.ConfigDict:
    config = default_config()
    config.model.update(dict(
        num_experts=4,             # routed experts
        num_shared_experts=1,      # always-on experts (DeepSeekMoE)
        d_expert=64,
        first_dense_layers=1,      # block 0 dense (d_ff), block 1 MoE
        score_fn="sigmoid",        # DeepSeek-V3's router; the model maps to HF glm4_moe
        bias_update_rate=0.001,    # gamma of auxiliary-loss-free balancing (DeepSeek-V3)
    ))
    return config
