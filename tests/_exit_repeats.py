"""Runs train.py's ``main`` in forked children, each exiting by one path while the train
step still compiles in its background thread; prints one JSON line per child:
``{"kind", "status", "stderr"}``.

    python tests/_exit_repeats.py REPEATS WORKROOT KIND [KIND ...]

KIND is ``missing`` (a data.path that does not exist), ``empty`` (an empty directory),
``binary`` (a directory of binaries), ``jsonl`` (a .jsonl without its text field) or
``sigint`` (SIGINT as soon as the compile thread runs; the compilation waits until the
trainer's handler has taken the signal, so that the signal lands during the compilation
however fast a cache hit makes it and however late the busy machine runs the sending
thread). jax and the trainer are
imported once, before forking, so that a repeat costs a backend start and a compile
(a hit in the tests' persistent compilation cache), not an interpreter start; nothing
touches a device before the fork.
"""
import json
import os
import pathlib
import signal
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
from absl import app  # noqa: E402

import train  # noqa: E402  (train.py: its flags, _parse_flags and main)
from jaxmp.train import loop, signals  # noqa: E402

OVERRIDES = ["model.num_layers=1", "model.first_dense_layers=0", "model.d_model=32", "model.d_ff=64",
             "model.d_expert=32", "model.num_heads=2", "data.seq_len=16", "data.max_tokens=20000",
             "data.num_eval_batches=1", "train.steps=2", "train.batch_size=8", "train.sample_tokens=0"]


def _data_path(kind: str, root: pathlib.Path) -> str:
    root.mkdir(parents=True, exist_ok=True)
    if kind == "missing":
        return str(root / "no-such-corpus")
    if kind == "empty":
        (root / "empty").mkdir(exist_ok=True)
        return str(root / "empty")
    if kind == "binary":
        (root / "bins").mkdir(exist_ok=True)
        for i in range(3):
            (root / "bins" / f"b{i}.txt").write_bytes(b"\x7fELF\x00\x01" * 100)
        return str(root / "bins")
    if kind == "jsonl":
        (root / "c.jsonl").write_text('{"body": "no text field"}\n')
        return str(root / "c.jsonl")
    return ""  # sigint: the stdlib corpus


def _child(kind: str, workdir: pathlib.Path) -> None:
    argv = ["train.py", "--config", str(ROOT / "configs/tiny_moe.py"), "--workdir", str(workdir),
            *(f"--config.{o}" for o in OVERRIDES), f"--config.data.path={_data_path(kind, workdir / 'data')}"]
    if kind == "sigint":
        handled = threading.Event()
        handle, compile_ = signals.SignalCatcher._handle, jax.stages.Lowered.compile

        def handle_and_tell(self, signum, frame):
            handle(self, signum, frame)
            handled.set()

        def compile_once_signalled(self, *args, **kwargs):
            if threading.current_thread().name == signals._COMPILE_THREAD:
                handled.wait(300)  # the trainer's handler has run: the signal came mid-compile
            return compile_(self, *args, **kwargs)

        signals.SignalCatcher._handle = handle_and_tell
        jax.stages.Lowered.compile = compile_once_signalled

        def interrupt():
            while not any(t.name == "jaxmp-compile" for t in threading.enumerate()):
                time.sleep(0.001)
            os.kill(os.getpid(), signal.SIGINT)
        threading.Thread(target=interrupt, daemon=True).start()
    app.run(train.main, argv=argv, flags_parser=train._parse_flags)


def main() -> None:
    repeats, root, kinds = int(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3:]
    for kind in kinds:
        for i in range(repeats):
            workdir = root / f"{kind}-{i}"
            workdir.mkdir(parents=True)
            err = workdir / "stderr"
            pid = os.fork()
            if pid == 0:
                fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(fd, 2)
                os.dup2(fd, 1)
                _child(kind, workdir)  # exits through SystemExit: the interpreter's own shutdown
                os._exit(99)  # app.run always exits; 99 would mean it returned
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
            print(json.dumps({"kind": kind, "status": code, "stderr": err.read_text()}), flush=True)


if __name__ == "__main__":
    main()
