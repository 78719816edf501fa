"""Multi-process runs on JAX's own multi-controller runtime (``jax.distributed``).

Each process runs the same program on its own local devices; ``jax.distributed``
connects them (process 0 hosts the coordination service) and ``jax.devices()`` then lists
every process's devices, so the :class:`~jaxmp.train.experiment.Experiment`'s mesh spans
them all. The trainer needs nothing else: each process reads only its share of every
global batch (:func:`jaxmp.train.data.create_pipeline`'s ``process_index`` /
``process_count``), global arrays are assembled from process-local data
(``jax.make_array_from_process_local_data``), orbax saves and restores the sharded state
from all processes, and only process 0 writes metrics, TensorBoard, the progress bar, the
lock and the sample.

Two processes on one machine, four CPU devices each, over loopback only::

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python train.py --config configs/tiny_moe.py \\
        --workdir runs/two --coordinator_address=127.0.0.1:12355 --num_processes=2 --process_id=0 &
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python train.py --config configs/tiny_moe.py \\
        --workdir runs/two --coordinator_address=127.0.0.1:12355 --num_processes=2 --process_id=1

JAX's CPU collectives (gloo, ``jax_cpu_collectives_implementation``) carry the
cross-process reductions on CPU; on GPUs NCCL does.

A process that dies is noticed at once by the :class:`PeerWatchdog` (:func:`start_watchdog`):
each process holds a TCP connection to process 0's watchdog, and the kernel closes a
dead process's connections. The survivors print one line naming the lost process and the
checkpoint to resume from, and leave with status :data:`PEER_LOST_EXIT` without running
the interpreter's shutdown (``os._exit``: their main thread may be blocked in a collective
that can never finish). Otherwise JAX's coordination service would notice the missing
heartbeats after ``heartbeat_timeout`` seconds (or its lost connection to process 0) and
terminate the process from C++ with a check-failure stack trace; that remains the
fallback for a machine that stops without closing its connections.
"""
from __future__ import annotations

import os
import pathlib
import re
import socket
import sys
import threading
from typing import Callable, Dict, Optional

import jax

from jaxmp._checks import check_int

__all__ = ["initialize", "CLUSTER_ENV_VARS", "PeerWatchdog", "start_watchdog", "last_checkpoint",
           "PEER_LOST_EXIT"]

PEER_LOST_EXIT = 1  # the status of a process whose peer was lost (as for any other error)
_KEY = "jaxmp/peer-watchdog"  # where process 0 publishes its watchdog port (JAX's key-value store)

# Variables by which a scheduler names a multi-process job that jax.distributed.initialize()
# can read by itself (its cluster detection: Slurm, Open MPI, Cloud TPU, Kubernetes).
CLUSTER_ENV_VARS = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES",
                    "CLOUD_TPU_TASK_ID", "JOBSET_NAME")


def initialize(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None, heartbeat_timeout: int = 30) -> str:
    """Starts JAX's multi-controller runtime when asked to, or when a cluster is detected.

    Must run before anything touches JAX's devices.

    Args:
      coordinator_address: ``host:port`` of process 0's coordination service.
      num_processes: how many processes take part (>= 1).
      process_id: this process, in ``[0, num_processes)``.
      heartbeat_timeout: seconds without a heartbeat after which a process counts as
        dead and the others fail (JAX's default is 100).

    Returns:
      A line saying what was done (``"single process"``, or the process and count).

    Raises:
      ValueError: some but not all of the three given, a malformed address, a bad count
        or id, or a heartbeat timeout below 1.
    """
    given = [v is not None for v in (coordinator_address, num_processes, process_id)]
    check_int("--heartbeat_timeout", heartbeat_timeout, 1,
              allowed="an integer number of seconds >= 1")
    if any(given) and not all(given):
        raise ValueError("--coordinator_address, --num_processes and --process_id go together: give "
                         "all three (or none, to run one process or let a cluster's environment say)")
    if all(given):
        if not re.fullmatch(r"[\w.\-\[\]:]+:\d{1,5}", coordinator_address):
            raise ValueError(f"--coordinator_address={coordinator_address!r} must be HOST:PORT, e.g. "
                             f"127.0.0.1:12355")
        if num_processes < 1:
            raise ValueError(f"--num_processes={num_processes} must be >= 1")
        if not 0 <= process_id < num_processes:
            raise ValueError(f"--process_id={process_id} must be in [0, {num_processes})")
        jax.distributed.initialize(coordinator_address, num_processes, process_id,
                                   heartbeat_timeout_seconds=heartbeat_timeout)
        return f"process {process_id} of {num_processes} (coordinator {coordinator_address})"
    if any(os.environ.get(v) for v in CLUSTER_ENV_VARS):
        try:
            jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat_timeout)
        except (ValueError, RuntimeError) as e:  # e.g. a one-task Slurm allocation
            return f"single process (cluster detection: {' '.join(str(e).split())[:120]})"
        return f"process {jax.process_index()} of {jax.process_count()} (from the cluster's environment)"
    return "single process"


def last_checkpoint(workdir) -> str:
    """The newest complete checkpoint step under ``workdir/checkpoints``, in words (orbax
    names a finished step directory by its number, an unfinished one otherwise)."""
    directory = pathlib.Path(workdir).absolute() / "checkpoints"
    steps = sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.is_dir() else []
    if not steps:
        return f"There is no checkpoint in {directory} yet: a rerun starts afresh"
    return f"The last checkpoint to resume from is step {steps[-1]} in {directory}"


class PeerWatchdog:
    """Notices at once when another process of the run exits, and then stops this one.

    Process 0 listens on a TCP port of the coordinator's host (published in JAX's
    distributed key-value store); every other process connects to it and says who it
    is. A process that leaves deliberately says so first (:meth:`leave`); a connection
    that closes without that means the process died (SIGKILL, a crash). Process 0 tells
    the others which process was lost; each survivor writes one line to stderr and
    leaves with :data:`PEER_LOST_EXIT` through ``os._exit``.

    Args:
      process_id: this process.
      num_processes: processes in the run.
      host: the coordinator's host (process 0 binds there).
      describe: ``describe() -> str``, where to resume from (:func:`last_checkpoint`).
      exchange: ``(set, get)`` of the key-value store: ``set(key, value)`` and
        ``get(key, timeout_ms) -> str``.
    """

    GRACE_S = 10.0  # after a peer's own error: time for this process to stop by itself

    def __init__(self, process_id: int, num_processes: int, host: str, describe: Callable[[], str],
                 exchange):
        self.process_id, self.num_processes, self.describe = process_id, num_processes, describe
        self._leaving = threading.Event()
        self._lost = threading.Event()
        self._lock = threading.Lock()
        self._peers: Dict[int, socket.socket] = {}  # process 0: the others' connections
        self._said_bye: set = set()
        set_value, get_value = exchange
        if process_id == 0:
            self._server = socket.create_server((host, 0))
            set_value(_KEY, str(self._server.getsockname()[1]))
            threading.Thread(target=self._accept, name="jaxmp-watchdog", daemon=True).start()
        else:
            port = int(get_value(_KEY, 300_000))
            self._up = socket.create_connection((host, port), timeout=60)
            self._up.settimeout(None)
            self._up.sendall(f"hello {process_id}\n".encode())
            threading.Thread(target=self._read, args=(self._up, 0), name="jaxmp-watchdog",
                             daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._greet, args=(conn,), name="jaxmp-watchdog", daemon=True).start()

    def _greet(self, conn: socket.socket) -> None:
        reader = conn.makefile("r")
        first = reader.readline().split()
        if len(first) != 2 or first[0] != "hello" or not first[1].isdigit():
            conn.close()
            return
        peer = int(first[1])
        with self._lock:
            self._peers[peer] = conn
        self._read(conn, peer, reader)

    def _read(self, conn: socket.socket, peer: int, reader=None) -> None:
        reader = reader or conn.makefile("r")
        try:
            for line in reader:
                words = line.split()
                if words[:1] == ["bye"]:
                    self._said_bye.add(peer)
                    if words[1:] == ["error"]:  # it reports its error; this one may be stuck
                        timer = threading.Timer(self.GRACE_S, self._peer_lost,
                                                (peer, "stopped with an error (see its output)"))
                        timer.daemon = True
                        timer.start()
                elif words[:1] == ["lost"] and len(words) == 3:
                    self._peer_lost(int(words[1]), " ".join(words[2:]).replace("_", " "))
        except OSError:
            pass
        if peer not in self._said_bye:
            self._peer_lost(peer, "exited without a word (killed or crashed)")

    def _peer_lost(self, peer: int, how: str) -> None:
        if self._leaving.is_set():  # this process is on its way out by itself
            return
        with self._lock:
            if self._lost.is_set():
                return
            self._lost.set()
            for other, conn in self._peers.items():  # process 0 tells the others
                if other != peer:
                    try:
                        conn.sendall(f"lost {peer} {how.replace(' ', '_')}\n".encode())
                    except OSError:
                        pass
        line = (f"\ntrain.py: error: process {peer} of {self.num_processes} {how}; process "
                f"{self.process_id} stops too. {self.describe()}; rerun all "
                f"{self.num_processes} processes to resume\n")
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os.write(2, line.encode())
        os._exit(PEER_LOST_EXIT)

    def settle(self, seconds: float) -> None:
        """Gives the watchdog ``seconds`` to notice a lost peer (an error in this process
        may be the echo of one: a collective whose peer vanished); when it does, the
        process exits from the watchdog's thread and this never returns."""
        if self._lost.wait(seconds):
            threading.Event().wait()  # the watchdog is exiting the process

    def leave(self, ok: bool = True) -> None:
        """Says that this process leaves deliberately, so that its closed connection is
        not taken for a death; then stops watching. ``ok=False`` (it reports an error of
        its own): a peer that has not stopped by itself :attr:`GRACE_S` seconds later
        stops, naming this process."""
        self._leaving.set()
        with self._lock:
            conns = list(self._peers.values()) if self.process_id == 0 else [self._up]
        for conn in conns:
            try:
                conn.sendall(b"bye ok\n" if ok else b"bye error\n")
            except OSError:
                pass


def start_watchdog(workdir) -> Optional[PeerWatchdog]:
    """A :class:`PeerWatchdog` for a multi-process run (None for one process).

    Every process must call it, after :func:`initialize`.
    """
    if jax.process_count() <= 1:
        return None
    from jax._src import distributed as _state  # the key-value store of the running service
    client = _state.global_state.client
    host = _state.global_state.coordinator_address.rsplit(":", 1)[0].strip("[]")
    return PeerWatchdog(jax.process_index(), jax.process_count(), host, lambda: last_checkpoint(workdir),
                        (client.key_value_set, client.blocking_key_value_get))
