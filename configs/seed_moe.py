"""The MoE example of the DeepSeek mixed-precision article this project started from.

24 layers, d_model 2048, 32 heads, max_length 4096, batch 64, AdamW lr 1e-4 with weight
decay 0.01, 4 experts computed in float16 with the gate (router) in float32, and a
dynamic loss scale starting at 256 with growth interval 500. Far too large for a CPU:
tests build it under ``jax.eval_shape`` only; ``python -m jaxmp.report`` accounts it.
Attention "auto" is cuDNN's fused kernel on a GPU (see benchmarks/README.md); remat
"none" (the default): "full" fits a GPU (``python -m jaxmp.report ... --settings``).
"""
import pathlib

import ml_collections

from jaxmp.train.config import load_config


def get_config() -> ml_collections.ConfigDict:
    config = load_config(pathlib.Path(__file__).with_name("tiny_moe.py"))  # then what differs
    config.model.update(dict(
        vocab_size=50304, num_layers=24, d_model=2048, num_heads=32, d_ff=8192, max_len=4096,
        num_shared_experts=0, top_k=1, d_expert=8192, first_dense_layers=0,
        score_fn="softmax",        # the article's gate; the model maps to HF mixtral
        bias_update_rate=0.0,
        scan_layers=True,          # 24 layers compile as one (benchmarks/compile_time.py)
    ))
    config.precision.policy = "mixed_fp16; router: fp32; norm: fp32; experts: p=f32,c=f16,o=f32"
    config.precision.loss_scale = "dynamic:init=256,growth_interval=500"
    config.optim.update(dict(learning_rate=1e-4, warmup_steps=2000))
    config.data.seq_len = 4096
    config.train.update(dict(batch_size=64, steps=100000, checkpoint_every=1000,
                             eval_every=1000, log_every=10))
    return config
