"""A dense Transformer of about one billion parameters, for benchmarks/gpu_suite.py on one H200.

    python benchmarks/gpu_suite.py --out gpu_suite          # runs this config and bench_h200.py
    python benchmarks/train_step.py --config configs/dense_1b.py --precisions mixed_bf16

16 layers, d_model 2048, 16 heads of 128, SwiGLU width 5632 (8/3 x d_model rounded to a
multiple of 128, as LLaMA sizes it), no experts, vocabulary 32768 (the benchmarks feed
random tokens); batch 8 x 2048 tokens. 0.96B parameters (count_params), so
tokens x (6 N + 6 L T d) = 1.01e14 model FLOPs per step (jaxmp.analysis.cost.training_flops):
about 0.23 s per step at 45% of the H200's dense BF16 peak. The layers are scanned
(model.scan_layers) so that 16 layers compile as one; attention "auto" is cuDNN's fused
kernel on the GPU. Memory, from ``python -m jaxmp.report --config configs/dense_1b.py
--devices 1 --modes mixed_bf16 --settings``: 15.3 GB of train state (16 bytes per parameter)
and 29.7 GB of saved activations with the cuDNN path (traced on a CPU), 45.1 GB in all;
``remat="full"`` would take it to 18.7 GB; the default ``"none"`` fits an H200's 141 GB.
Not yet measured on a GPU.
"""
import ml_collections

from jaxmp.train.config import default_config


def get_config() -> ml_collections.ConfigDict:
    config = default_config()  # every key at its default (a dense model), then what differs
    config.model.update(dict(
        vocab_size=32768, num_layers=16, d_model=2048, num_heads=16, d_ff=5632, max_len=2048,
        scan_layers=True,          # one compiled layer instead of 16
    ))
    config.optim.update(dict(learning_rate=3e-4, warmup_steps=10))
    config.data.seq_len = 2048
    config.train.update(dict(batch_size=8, steps=1000))
    return config
