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
* the softmax router, which tiny_moe had when the recorded
  figures were made (it routes by sigmoid since, to map to Hugging Face's glm4_moe);
* 800 steps: the protocol's 8 runs x 5 seeds (40 runs) fit in about an hour on 2 shared
  CPU cores; the loss is still falling at the end (0.5% per 50 steps), it is not a
  plateau.
"""
import pathlib

import ml_collections

from jaxmp.train.config import load_config


def get_config() -> ml_collections.ConfigDict:
    config = load_config(pathlib.Path(__file__).with_name("tiny_moe.py"))  # then what differs
    config.model.score_fn = "softmax"  # the router the recorded figures were made with
    config.model.max_len = 64
    config.optim.update(dict(learning_rate=2e-3, warmup_steps=60, final_lr_fraction=0.05))
    config.data.update(dict(num_eval_batches=128, max_tokens=2_500_000))
    config.train.update(dict(steps=800, num_devices=1, log_every=10, eval_every=100,
                             checkpoint_every=800, keep_checkpoints=1, sample_tokens=0))
    return config
