"""Train jaxmp's mixed-precision MoE Transformer.

    python train.py --config configs/tiny_moe.py --workdir runs/tiny [--config.train.steps=100]

Rerunning the same command resumes from the newest checkpoint in --workdir (default:
runs/NAME for --config configs/NAME.py). Ctrl-C or
SIGTERM saves a checkpoint at the current step and exits with status 130 or 143.
Several processes: --coordinator_address=HOST:PORT --num_processes=N --process_id=I on
each (jaxmp.train.distributed), or a cluster's environment (Slurm, Open MPI, ...).
"""
import os
import signal
import sys


def _interrupted_outside_training(signum, frame):
    """SIGINT while nothing is being trained (importing, checking, compiling before the
    trainer's own handler, the closing sample): exit at once with status 130 and one
    line. Raising KeyboardInterrupt instead can land in a callback that swallows it
    (``Exception ignored in: _xla_gc_callback``) and the run goes on."""
    sys.stderr.write("\ntrain.py: SIGINT outside training: exited at once; the complete "
                     "checkpoints are kept; rerun the same command to resume or start\n")
    sys.stderr.flush()
    os._exit(128 + signum)


# Before the slow imports. Also where SIGINT came ignored (a job started in the background
# by a shell script inherits SIG_IGN): the trainer honours SIGINT while it trains, so it
# honours it before and after too (before, a SIGINT during the imports or the closing
# sample of such a job did nothing and the run went on to exit 0).
if __name__ == "__main__" and signal.getsignal(signal.SIGINT) in (
        signal.default_int_handler, signal.SIG_IGN, signal.SIG_DFL):
    signal.signal(signal.SIGINT, _interrupted_outside_training)

import pathlib  # noqa: E402

from absl import app, flags, logging  # noqa: E402

from jaxmp.train import CheckpointError, Interrupted, TrainingStalled, train_and_evaluate
from jaxmp._entry import cpu_without_a_gpu, quiet_orbax_tracebacks
from jaxmp.train import distributed
from jaxmp.train.loop import compile_in_progress
from jaxmp.train.workdir import WorkdirInUse
from jaxmp.train.config import config_to_dict, load_config

# Relative config paths that do not exist from the current directory are looked up next
# to this file (load_config), so the shipped configs work from any directory.
_DEFAULT_CONFIG = str(pathlib.Path(__file__).resolve().parent / "configs" / "tiny_moe.py")
# --config PATH names the file; --config.KEY=VALUE items override its keys. Both are read
# by jaxmp.train.config.load_config (not ml_collections.config_flags), which completes the
# file's config with every default first, so a key the file leaves out can be overridden.
flags.DEFINE_string("config", _DEFAULT_CONFIG,
                    "Path to a config file; --config.KEY=VALUE overrides a key.")
_LOADED = {}
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and logs (default: "
                                "runs/NAME for --config configs/NAME.py, so that another "
                                "config never resumes this one's run).")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0 for a "
                                   "multi-process run (jax.distributed); with --num_processes, "
                                   "--process_id.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in a multi-process run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process, in [0, num_processes).")
_HEARTBEAT = flags.DEFINE_integer("heartbeat_timeout", 30, "Seconds without a heartbeat after "
                                  "which JAX counts a process as dead; the others name a silent "
                                  "process after half of it, and exit with an error.")
_STARTUP = flags.DEFINE_integer("startup_timeout", 300, "Seconds a multi-process run waits for "
                                "every process to connect before it exits with an error.")


def _parse_flags(argv):
    """absl's flag parsing; the config file and its ``--config.KEY=VALUE`` overrides are
    loaded here, so a typo, a bad value or a bad file is one line, not a traceback."""
    if any(a in ("-h", "--help", "--helpshort", "--helpfull", "-?") for a in argv[1:]):
        from jaxmp.train.keys import help_text
        print(__doc__.strip())
        print("\nflags:\n" + flags.FLAGS.main_module_help().split("\n", 1)[-1])
        print("\nconfig keys (--config.KEY=VALUE; the value shown is the default of "
              "jaxmp.train.config.default_config, which a config file may change):")
        print(help_text())
        sys.exit(0)
    rest, overrides, path = [argv[0]], [], _DEFAULT_CONFIG
    args = iter(argv[1:])
    for a in args:
        if a.startswith("--config."):
            overrides.append(a if "=" in a else f"{a}={next(args, '')}")
        elif a.startswith("--config="):
            path = a.split("=", 1)[1]
        elif a == "--config":
            path = next(args, "")
        else:
            rest.append(a)
    try:
        _LOADED["config"] = load_config(path, overrides, where="on the command line")
        _LOADED["workdir"] = str(pathlib.Path("runs") / pathlib.Path(path).stem)
        return flags.FLAGS(rest)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        sys.exit(f"train.py: error: {e}")
    except flags.Error as e:
        sys.exit(f"train.py: error: {e}")


def _leave(code, message=None, watchdog=None, ok=False):
    """Exits with ``code`` after ``message`` (stderr), telling the other processes first.

    While the train step still compiles in its background thread (a signal during
    start-up), the interpreter's shutdown could abort the process (``terminate called
    ...``, exit 134) when that thread comes back to Python: the process then leaves at
    once with ``os._exit``, nothing being left to save or close.
    """
    if watchdog is not None:
        watchdog.leave(ok)
    if message:
        print(message, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    if compile_in_progress():
        os._exit(code)
    sys.exit(code)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
    cpu_without_a_gpu()  # no CUDA plugin traceback on a machine without a GPU
    quiet_orbax_tracebacks()  # this process is the trainer's: a failed write is one line
    watchdog = None
    workdir = _WORKDIR.value if _WORKDIR.value is not None else _LOADED["workdir"]
    try:
        # Before anything touches the devices; the workdir, for the line of a lost peer.
        distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                               _HEARTBEAT.value, workdir, _STARTUP.value,
                               exit_process=True)  # the entry point: a lost peer ends it
        watchdog = distributed.start_watchdog(workdir)  # a peer that dies stops this one
        # Before any collective: processes with different configs would meet in mismatched ones.
        distributed.check_same_config(config_to_dict(_LOADED["config"]), _STARTUP.value,
                                      workdir=workdir)
        train_and_evaluate(_LOADED["config"], workdir, exit_on_second_signal=True)
    except (ValueError, CheckpointError, TrainingStalled, WorkdirInUse, OSError) as e:
        # A user's mistake, a stalled or diverging run, a busy workdir or a full disk: the
        # message says what and why.
        _leave(1, f"train.py: error: {e}", watchdog)
    except Interrupted as e:  # after the loop, every process of a run stops at the same step
        _leave(128 + e.signum, f"train.py: {e}", watchdog, ok=not e.startup)
    except KeyboardInterrupt:  # before the trainer's own handler is installed (start-up)
        _leave(130, "train.py: interrupted during start-up; nothing was trained", watchdog)
    except Exception:
        if watchdog is not None:  # a collective that failed because a peer died: say that
            watchdog.settle(5.0)
        raise
    _leave(0, None, watchdog, ok=True)


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
