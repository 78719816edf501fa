"""train.py in this process: its flag parsing, its ``main`` and its exit status, without
an interpreter start and a JAX import per run (tests where the process boundary is not
the subject; tests/test_faults.py keeps real processes for SIGKILL, two trainers on one
workdir and a signal during compilation)."""
import pytest

from _configs import ROOT

CONFIG = str(ROOT / "configs" / "tiny_moe.py")


def run_train_py(capsys, workdir, *overrides, config=CONFIG):
    """Runs ``train.py --config CONFIG --workdir WORKDIR --config.KEY=VALUE ...`` in-process.

    Args:
      capsys: pytest's capsys fixture; what was captured before is dropped.
      workdir: the ``--workdir``.
      *overrides: ``KEY=VALUE`` items, passed as ``--config.KEY=VALUE``.
      config: the ``--config`` file.

    Returns:
      ``(status, out, err)``: the exit status train.py would leave with (0, 128 + a
      signal, or the one-line message of ``sys.exit(message)``, which an interpreter
      prints to stderr and exits 1 with) and what it wrote to stdout and stderr.
    """
    import train  # train.py: its flags, _parse_flags and main

    argv = ["train.py", "--config", config, "--workdir", str(workdir),
            *(f"--config.{o}" for o in overrides)]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # as absl.app.run, without its one-time set-up
        train.main(train._parse_flags(argv))
    out, err = capsys.readouterr()
    return e.value.code, out, err
