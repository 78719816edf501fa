"""A MoE Transformer sized to fill one H200 for benchmarks/train_step.py.

    python benchmarks/train_step.py --config configs/bench_h200.py --json train_step_h200.json

12 layers, d_model 1024, 16 heads, the first layer dense (d_ff 4096), then 8 routed
experts (top-2) plus 1 shared expert of width 1024 per layer; vocabulary 32768 (the
benchmark feeds random tokens, so the byte tokenizer's 257 is not needed); batch 16 x
1024 tokens. 0.44B parameters, 0.23B active per token (count_params), so 2.4e13 model
FLOPs per step (6 N per token plus attention, jaxmp.analysis.cost.training_flops): about 60 ms per
step at 40% of the H200's dense BF16 peak, 120 ms at 40% of its TF32 peak. The layers are
scanned (one dense and one MoE stack compile instead of 12 layers) and attention "auto"
runs cuDNN's fused kernel on the GPU for the 16-bit precisions, so no [B, heads, T, T]
scores are kept; with fp32 (or the reference/xla paths) they are, ~0.5-2 GB per layer.
MoE dispatch is dropless (model.capacity_factor 0, exact); the GPU default awaits the
suite's dispatch timing. moe_kernel "auto" is the Mosaic GPU grouped GEMM on Hopper,
ragged_dot elsewhere. The memory (7 GB of train state, logits and activations) stays well
under the H200's 141 GB. benchmarks/gpu_suite.py also times this config's MoE dispatch (dropless
ragged_dot vs capacity einsum) at these sizes.

Not yet measured on a GPU; the estimate for the
command above (three precisions, 55 steps each after a compile each) is a few minutes,
inside a 10-minute limit.
"""
import pathlib

import ml_collections

from jaxmp.train.config import load_config


def get_config() -> ml_collections.ConfigDict:
    config = load_config(pathlib.Path(__file__).with_name("tiny_moe.py"))  # then what differs
    config.model.update(dict(
        vocab_size=32768, num_layers=12, d_model=1024, num_heads=16, d_ff=4096, max_len=1024,
        num_experts=8, d_expert=1024,
        score_fn="softmax",        # the router its deviceless figures were compiled with
        scan_layers=True,          # a dense and a MoE stack, each compiled once
    ))
    config.optim.update(dict(learning_rate=3e-4, warmup_steps=10))
    config.data.seq_len = 1024
    config.train.steps = 1000
    return config
