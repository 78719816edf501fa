"""Train jaxmp's mixed-precision MoE Transformer.

    python train.py --config configs/tiny_moe.py --workdir runs/tiny [--config.train.steps=100]

Rerunning the same command resumes from the newest checkpoint in --workdir. Ctrl-C or
SIGTERM saves a checkpoint at the current step and exits with status 130 or 143.
Several processes: --coordinator_address=HOST:PORT --num_processes=N --process_id=I on
each (jaxmp.train.distributed), or a cluster's environment (Slurm, Open MPI, ...).
"""
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from jaxmp.train import CheckpointError, Interrupted, TrainingStalled, train_and_evaluate
from jaxmp.train import distributed
from jaxmp.train.workdir import WorkdirInUse
from jaxmp.train.config import check_override_keys, load_config

_DEFAULT_CONFIG = "configs/tiny_moe.py"
_CONFIG = config_flags.DEFINE_config_file("config", _DEFAULT_CONFIG, "Path to a config file.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/tiny", "Directory for checkpoints and logs.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0 for a "
                                   "multi-process run (jax.distributed); with --num_processes, --process_id.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in a multi-process run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process, in [0, num_processes).")
_HEARTBEAT = flags.DEFINE_integer("heartbeat_timeout", 30, "Seconds without a heartbeat after which "
                                  "a process counts as dead and the others exit with an error.")


def _parse_flags(argv):
    """absl's flag parsing, with config-key typos and bad files as one-line errors."""
    config_path = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if config_path is None and "--config" in argv[:-1]:
        config_path = argv[argv.index("--config") + 1]
    try:
        check_override_keys(load_config(config_path or _DEFAULT_CONFIG), argv[1:])
        return flags.FLAGS(argv)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        sys.exit(f"train.py: error: {e}")
    except flags.Error as e:
        sys.exit(f"train.py: error: {e}")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
    try:
        distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                               _HEARTBEAT.value)  # before anything touches the devices
        train_and_evaluate(_CONFIG.value, _WORKDIR.value)
    except (ValueError, CheckpointError, TrainingStalled, WorkdirInUse, OSError) as e:
        # A user's mistake, a stalled or diverging run, a busy workdir or a full disk: the
        # message says what and why.
        sys.exit(f"train.py: error: {e}")
    except Interrupted as e:
        print(f"train.py: {e}", file=sys.stderr)
        sys.exit(128 + e.signum)
    except KeyboardInterrupt:  # before the trainer's own handler is installed (start-up)
        print("train.py: interrupted during start-up; nothing was trained", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
