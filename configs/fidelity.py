"""The fidelity protocol's model and run: tiny_moe trained smoothly on 2 CPU cores.

    python benchmarks/fidelity.py --json fidelity.json --plot benchmarks/fidelity.png

benchmarks/fidelity.py trains this config with several seeds in each precision mode
(only the policy's default and the loss scale change per mode) and compares the final
eval losses seed by seed. What differs from configs/tiny_moe.py, and why:

* a long warm-up and a cosine decay to 5% of the peak rate over the whole run: the loss
  flattens out towards the end instead of being cut off at full learning rate, so that a
  small change of trajectory (a rounding difference, another seed) moves the final loss
  less;
* a lower peak learning rate (2e-3) and clipping at 1.0: no loss spikes, which would
  make one seed's difference dominate the mean;
* 128 eval batches (131,072 tokens, fixed windows of the held-out documents, the same
  in every run) instead of 4: the eval set's own sampling error of a paired difference
  is then far below 0.25% (the benchmark reports it);
* ``max_tokens`` keeps the train split at 2.5 M tokens (800 steps read 0.8 M: no window
  is seen twice);
* 800 steps: the protocol's 8 runs x 5 seeds (40 runs) fit in about an hour on 2 shared
  CPU cores; the loss is still falling at the end (0.5% per 50 steps), it is not a
  plateau.
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.seed = 0
    config.model = ml_collections.ConfigDict(dict(
        vocab_size=257, num_layers=2, d_model=64, num_heads=4, d_ff=256, max_len=64,
        rope_theta=10000.0, norm_eps=1e-6, num_experts=4, num_shared_experts=1, top_k=2,
        d_expert=64, first_dense_layers=1, score_fn="softmax", aux_loss_weight=0.01,
        bias_update_rate=0.001, capacity_factor=0.0))
    config.precision = ml_collections.ConfigDict(dict(
        policy="mixed_bf16; router: fp32; norm: fp32", loss_scale="none",
        grad_reduce_dtype="float32", grad_compression="none", topk_ratio=0.3))
    config.optim = ml_collections.ConfigDict(dict(
        learning_rate=2e-3, warmup_steps=60, schedule="cosine", final_lr_fraction=0.05,
        decay_steps=0, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.01, grad_clip=1.0,
        mu_dtype="", nu_dtype=""))
    config.data = ml_collections.ConfigDict(dict(
        path="", text_field="text", seq_len=64, eval_fraction=0.02, num_eval_batches=128,
        max_tokens=2_500_000))
    config.train = ml_collections.ConfigDict(dict(
        steps=800, batch_size=16, grad_accum_steps=1, num_devices=1, log_every=10,
        eval_every=100, checkpoint_every=800, keep_checkpoints=1, max_consecutive_skips=100,
        sample_prompt="def ", sample_tokens=0, sample_temperature=0.8))
    return config
