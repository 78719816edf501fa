"""Train jaxmp's mixed-precision MoE Transformer.

    python train.py --config configs/tiny_moe.py --workdir runs/tiny [--config.train.steps=100]

Rerunning the same command resumes from the newest checkpoint in --workdir.
"""
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from jaxmp.checkpoint import CheckpointError
from jaxmp.trainer import TrainingStalled, train_and_evaluate

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny_moe.py", "Path to a config file.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/tiny", "Directory for checkpoints and logs.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
    try:
        train_and_evaluate(_CONFIG.value, _WORKDIR.value)
    except (ValueError, CheckpointError, TrainingStalled) as e:
        # A user's mistake or a stalled run: the message says what and why; no traceback.
        sys.exit(f"train.py: error: {e}")


if __name__ == "__main__":
    app.run(main)
