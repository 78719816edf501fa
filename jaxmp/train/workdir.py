"""The run directory: checked writable, and locked so that one trainer uses it at a time.

Two trainers writing one workdir interleave their metrics and overwrite each other's
checkpoints. :class:`WorkdirLock` takes an exclusive ``fcntl.flock`` on
``workdir/.jaxmp.lock`` and writes the holder (process id, host, start time, command)
into it. The kernel releases the lock when the holder exits, however it exits (a
SIGKILL included), so a lock left by a dead process never blocks a resume: its file
is found unlocked, and the new trainer takes it over and says whose it was.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import pathlib
import socket
import sys
import time
from typing import Optional

__all__ = ["WorkdirInUse", "WorkdirLock", "prepare_workdir", "LOCK_NAME"]

LOCK_NAME = ".jaxmp.lock"


class WorkdirInUse(RuntimeError):
    """Another live trainer holds the workdir's lock."""


def prepare_workdir(path) -> pathlib.Path:
    """The run directory, created if missing, after checking that it can be written, and
    so can its ``checkpoints`` directory (and ``checkpoints/corrupt``, where a corrupt
    checkpoint is set aside) where they exist: each fault found before any work, not at
    the first save.

    Raises:
      ValueError: the path is empty (``--workdir=``: not the current directory), the
        path, ``checkpoints`` or ``checkpoints/corrupt`` is a file, or a
        directory cannot be created or written (read-only filesystem, permissions); the
        message names it.
    """
    if not str(path).strip():  # pathlib.Path("") is the current directory
        raise ValueError("--workdir is empty; give the directory of the run (e.g. "
                         "--workdir runs/mine)")
    workdir = pathlib.Path(path)
    if workdir.exists() and not workdir.is_dir():
        raise ValueError(f"--workdir {workdir} exists and is not a directory")
    ckpts = workdir / "checkpoints"
    for d in (ckpts, ckpts / "corrupt"):
        if d.exists() and not d.is_dir():
            raise ValueError(f"{d} is a file, where the run keeps its "
                             f"{'corrupt checkpoints' if d.name == 'corrupt' else 'checkpoints'}"
                             f"; move it away or choose another --workdir")
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--workdir {workdir} is not writable: {e.strerror or e}; choose a "
                         f"writable directory") from None
    for d in (workdir, ckpts, ckpts / "corrupt"):
        if d != workdir and not d.is_dir():
            continue
        try:
            probe = d / f".jaxmp-write-test-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            what = "--workdir" if d == workdir else "the checkpoint directory"
            raise ValueError(f"{what} {d} is not writable: {e.strerror or e}; make it writable "
                             f"or choose a writable --workdir") from None
    return workdir


class WorkdirLock:
    """An exclusive lock on a workdir, held from ``__enter__`` to ``__exit__``.

    Args:
      workdir: the run directory (must exist).

    Attributes:
      taken_over: the holder record of a dead process whose lock file was found (its
        ``pid``, ``host``, ``started``), or None.

    Raises (on enter):
      WorkdirInUse: a live process holds the lock; the message names its process id,
        host and start time.
      ValueError: the lock file is a symbolic link or a directory (it is never followed:
        taking a lock over truncates the file).
    """

    def __init__(self, workdir):
        self.path = pathlib.Path(workdir) / LOCK_NAME
        self.taken_over: Optional[dict] = None
        self._fd: Optional[int] = None

    def _holder(self, fd: int) -> Optional[dict]:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 1 << 16).decode("utf-8", errors="replace").strip()
        try:
            record = json.loads(text) if text else None
        except ValueError:
            return None
        return record if isinstance(record, dict) else None

    def __enter__(self) -> "WorkdirLock":
        try:  # O_NOFOLLOW: taking a lock over truncates it, never a link's target
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.EISDIR):
                raise
            kind = "a symbolic link" if self.path.is_symlink() else "a directory"
            raise ValueError(f"{self.path} is {kind}, where the workdir's lock file belongs; "
                             f"remove it (nothing of the run is kept in it) and rerun") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = self._holder(fd) or {}
            os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            raise WorkdirInUse(
                f"--workdir {self.path.parent} is in use by process {holder.get('pid', '?')} on "
                f"{holder.get('host', '?')} (running since {holder.get('started', '?')}); wait for "
                "it to finish or stop it, or use another --workdir") from None
        self.taken_over = self._holder(fd)
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "argv": sys.argv}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, (json.dumps(record) + "\n").encode())
        os.fsync(fd)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)  # released cleanly: nobody to take over from
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            os.close(self._fd)
            self._fd = None
