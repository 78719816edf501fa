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
      ``(status, out, err)``: the exit status and what train.py wrote to stdout and
      stderr, as a process of its own would leave them: ``sys.exit(message)`` (a bad
      flag or config key) is the interpreter's, the message on stderr and status 1.
    """
    import train  # train.py: its flags, _parse_flags and main

    argv = ["train.py", "--config", config, "--workdir", str(workdir),
            *(f"--config.{o}" for o in overrides)]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # as absl.app.run, without its one-time set-up
        train.main(train._parse_flags(argv))
    out, err = capsys.readouterr()
    code = e.value.code
    if code is None:
        return 0, out, err
    if not isinstance(code, int):
        return 1, out, err + f"{code}\n"
    return code, out, err
