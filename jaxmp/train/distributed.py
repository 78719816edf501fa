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

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python train.py \\
        --config configs/tiny_moe.py --workdir runs/two \\
        --coordinator_address=127.0.0.1:12355 --num_processes=2 --process_id=0 &
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python train.py \\
        --config configs/tiny_moe.py --workdir runs/two \\
        --coordinator_address=127.0.0.1:12355 --num_processes=2 --process_id=1

JAX's CPU collectives (gloo, ``jax_cpu_collectives_implementation``) carry the
cross-process reductions on CPU; on GPUs NCCL does.

A process that dies is noticed at once by the :class:`PeerWatchdog` (:func:`start_watchdog`):
each process holds a TCP connection to process 0's watchdog, and the kernel closes a
dead process's connections. The survivors print one line naming the lost process and the
checkpoint to resume from. Where the caller is the command-line entry point
(:func:`initialize` with ``exit_process=True``: ``train.py``), they then leave with status
:data:`PEER_LOST_EXIT` without running the interpreter's shutdown (``os._exit``: their
main thread may be blocked in a collective that can never finish). A library caller's
process is not ended by jaxmp: :class:`PeerLost` is raised in its main thread (where a
watchdog thread notices, as an asynchronous exception at the main thread's next Python
instruction; no signal, so no handler of the caller's mistakes it for a Ctrl-C), and a
main thread blocked in a collective stays blocked until JAX's own heartbeat check ends
the process.

Nothing of this module sits in JAX's coordination path: every process reaches process 0's
coordination service directly, and the watchdog is a connection of its own beside it. So
when process 0, which hosts the service, dies, JAX's client in the other processes may
terminate them from C++ (``client.h``: a logged fatal error, ``Fatal Python error:
Aborted``) before the watchdog's line is written; either way the survivors stop within
seconds, and the checkpoints written so far resume exactly. (JAX's binding's
``missed_heartbeat_callback``, which would replace that abort, cannot be used in jax
0.10.2: nanobind has no caster for its ``absl::Status`` argument, and its first call
terminates the process.) A process that sends the watchdog nothing for half the
heartbeat timeout (stopped, or on a machine that vanished without closing its
connections), or that dies between ``jax.distributed.initialize`` and its first word to
the watchdog, is named after that half, before JAX's heartbeat check can abort anyone.

Start-up is bounded and says what it waits for (:func:`initialize`): process 0 checks
that the coordinator's port is free before JAX binds it, each process says which
processes it waits for, and one that is still waiting after ``startup_timeout`` seconds
leaves with one line. :func:`check_same_config` then compares the processes' configs
through JAX's key-value store, before any collective. A peer lost during these exchanges
(the key-value store's host, process 0, died) is one line and :data:`PEER_LOST_EXIT`
(:class:`PeerLost` for a library caller), unless JAX's own abort comes first.

A preemption notice (SIGTERM) reaches JAX's own handler, which
``jax.distributed.initialize`` installs (its preemption sync manager): the training loop
asks :func:`jax.experimental.multihost_utils.reached_preemption_sync_point` at every step,
so that all processes stop, and save, at the same step (:func:`preemption_sync`).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import pathlib
import re
import socket
import sys
import threading
import time
from typing import Callable, Dict, Optional

import jax

from jaxmp._checks import check_int

__all__ = ["initialize", "CLUSTER_ENV_VARS", "PeerWatchdog", "start_watchdog", "last_checkpoint",
           "PEER_LOST_EXIT", "PeerLost", "check_same_config", "preemption_sync"]

PEER_LOST_EXIT = 1  # the status of a process whose peer was lost (as for any other error)
_SAY_WAITING_S = 30.0  # a start-up still connecting after this long says what it waits for
_KEY = "jaxmp/peer-watchdog"  # where process 0 publishes its watchdog port (JAX's key-value store)

# Variables by which a scheduler names a multi-process job that jax.distributed.initialize()
# can read by itself (its cluster detection: Slurm, Open MPI, Cloud TPU, Kubernetes).
CLUSTER_ENV_VARS = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES",
                    "CLOUD_TPU_TASK_ID", "JOBSET_NAME")

# This process's run, as initialize() set it up: what the line of a lost peer says.
# exit_process: the caller is the command-line entry point, which lets jaxmp end the process.
_RUN = {"process_id": 0, "num_processes": 1, "address": None, "describe": None,
        "heartbeat_timeout": 30, "exit_process": False}
_LEAVING = threading.Event()  # this process leaves deliberately: closed connections are expected
_LOST = threading.Event()  # a peer was lost: this process is exiting
_STOP_LOCK = threading.Lock()
_WATCHDOG: Optional["PeerWatchdog"] = None
_MAIN_WAITS = threading.Event()  # the main thread waits on _LOST itself (settle, start-up)


class PeerLost(RuntimeError):
    """Another process of a multi-process run was lost (a library caller's process; the
    command-line trainer exits with :data:`PEER_LOST_EXIT` instead). The message is the
    line written to stderr: the lost process and the checkpoint to resume from."""

    def __init__(self, message: Optional[str] = None):
        super().__init__(message or _RUN.get("lost") or "a peer of this multi-process run "
                                                         "was lost")


def _write(line: str) -> None:
    """``line`` to stderr as one write; a closed or broken stderr does not stop the exit
    that follows (the watchdog's thread must get to it)."""
    try:
        os.write(2, line.encode())
    except OSError:
        pass


def _leave(line: str) -> None:
    """What a process does once the line of a lost peer or a failed start-up is written:
    ends at once with :data:`PEER_LOST_EXIT` when the caller is the command-line entry point
    (``exit_process``); else raises :class:`PeerLost` in the main thread: here when called
    from it; from another thread, as an asynchronous exception the main thread raises at
    its next Python instruction (CPython's ``PyThreadState_SetAsyncExc``: no signal, so no
    handler of the caller's, a ``SignalCatcher`` included, takes it for a Ctrl-C), unless
    the main thread is waiting on the loss itself (:meth:`PeerWatchdog.settle`), which
    then raises it. A main thread blocked in a call into JAX's runtime (a collective, the
    coordination service) sees it only when that call returns."""
    if _RUN["exit_process"]:
        os._exit(PEER_LOST_EXIT)
    if threading.current_thread() is threading.main_thread():
        raise PeerLost(line.strip())
    if _RUN.get("to_main"):
        import ctypes
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(threading.main_thread().ident), ctypes.py_object(PeerLost))


def _voice() -> str:
    """Who speaks in the one-line messages: ``train.py`` (the command-line entry point,
    ``exit_process``), else ``jaxmp`` (a library caller)."""
    return "train.py" if _RUN["exit_process"] else "jaxmp"


def _stop(peer: int, how: str) -> None:
    """Writes the one line for a lost ``peer`` and leaves (:func:`_leave`); returns at once
    if this process is leaving by itself, or already stopping."""
    with _STOP_LOCK:
        if _LEAVING.is_set() or _LOST.is_set():
            return
        _LOST.set()
        # Who tells the main thread (a library caller's): this thread, unless it is the
        # main thread or the main thread waits on the loss itself (settle).
        _RUN["to_main"] = (threading.current_thread() is not threading.main_thread()
                           and not _MAIN_WAITS.is_set())
    n, describe = _RUN["num_processes"], _RUN["describe"]
    try:
        where = describe() if describe else "Where to resume from is unknown (no workdir given)"
    except Exception as e:  # noqa: BLE001  the exit must follow whatever the directory holds
        where = f"Where to resume from is unknown ({' '.join(str(e).split())[:120]})"
    line = (f"\n{_voice()}: error: process {peer} of {n} {how}; process {_RUN['process_id']} "
            f"stops too. {where}; rerun all {n} processes to resume\n")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    _RUN["lost"] = line.strip()
    _write(line)
    _leave(line)


def _lost_in_start_up(peer: int, what: str, error: BaseException) -> None:
    """A key-value exchange of the start-up failed (JAX's client raises once the
    coordination service, hosted by process 0, is gone, or a peer never wrote its key):
    gives the watchdog, where one runs, a moment to name the lost process, then writes
    one line naming ``peer`` and leaves (:func:`_stop`: :data:`PEER_LOST_EXIT`, or
    :class:`PeerLost` for a library caller); never a traceback from the entry point."""
    if _WATCHDOG is not None:
        _WATCHDOG.settle(PeerWatchdog.ECHO_S)
    detail = " ".join(str(error).split()[:6]).rstrip(":")
    _stop(peer, f"was lost {what} ({type(error).__name__}: {detail})")
    _wait_for_the_exit()


def _wait_for_the_exit() -> None:
    """After another thread stopped the process for a lost peer: waits for its exit (the
    entry point's), or raises :class:`PeerLost` (a library caller's): here, or, where that
    thread already sent it to this (main) thread, as that exception when it arrives."""
    if _RUN["exit_process"]:
        threading.Event().wait()  # the watchdog's thread is exiting the process
    if _RUN.get("to_main"):
        while True:  # the PeerLost sent to this thread is raised at one of these instructions
            time.sleep(0.01)
    raise PeerLost(_RUN.get("lost") or "a peer of this multi-process run was lost")


def initialize(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None, heartbeat_timeout: int = 30,
               workdir=None, startup_timeout: int = 300, *, exit_process: bool = False) -> str:
    """Starts JAX's multi-controller runtime when asked to, or when a cluster is detected.

    Must run before anything touches JAX's devices. With explicit arguments, process 0
    first checks that the coordinator's port is free on this host (a port in use is a
    one-line error, not JAX's crash), each process writes to stderr which processes it
    waits for once it has waited 30 s (or half of ``startup_timeout``), and a process still
    waiting after ``startup_timeout`` seconds says so in one line and, with
    ``exit_process``, leaves with :data:`PEER_LOST_EXIT` (JAX's own timeout aborts from
    C++). A library caller's main thread is then inside ``jax.distributed.initialize``,
    which jaxmp cannot interrupt: JAX's own timeout, 60 s later, aborts the process from
    C++ before the :class:`PeerLost` queued for it can be raised.

    Args:
      coordinator_address: ``host:port`` of process 0's coordination service.
      num_processes: how many processes take part (>= 1).
      process_id: this process, in ``[0, num_processes)``.
      heartbeat_timeout: seconds without a heartbeat after which a process counts as
        dead and the others fail (JAX's default is 100).
      workdir: the run's directory, whose last checkpoint the line of a lost peer names.
      startup_timeout: seconds to wait for every process to connect (>= 1; JAX's
        ``initialization_timeout`` defaults to 300).
      exit_process: the caller is the command-line entry point (``train.py``): a lost peer
        or a start-up past ``startup_timeout`` ends the process with
        :data:`PEER_LOST_EXIT` (``os._exit``). False (a library call): jaxmp never ends
        the process; :class:`PeerLost` is raised (module docstring).

    Returns:
      A line saying what was done (``"single process"``, or the process and count).

    Raises:
      ValueError: some but not all of the three given, a malformed address, a bad count
        or id, a heartbeat or start-up timeout below 1, or (process 0) a coordinator port
        already in use.
    """
    given = [v is not None for v in (coordinator_address, num_processes, process_id)]
    check_int("--heartbeat_timeout", heartbeat_timeout, 1,
              allowed="an integer number of seconds >= 1")
    check_int("--startup_timeout", startup_timeout, 1,
              allowed="an integer number of seconds >= 1")
    if any(given) and not all(given):
        raise ValueError("--coordinator_address, --num_processes and --process_id go together: "
                         "give all three (or none, to run one process or let a cluster's "
                         "environment say)")
    _RUN["heartbeat_timeout"] = heartbeat_timeout
    _RUN["exit_process"] = bool(exit_process)
    _RUN.update(describe=None, lost=None, to_main=False)  # nothing of an earlier run
    _LOST.clear()
    _LEAVING.clear()
    if workdir is not None:
        _RUN["describe"] = lambda: last_checkpoint(workdir)
    if all(given):
        if not re.fullmatch(r"[\w.\-\[\]:]+:\d{1,5}", coordinator_address):
            raise ValueError(f"--coordinator_address={coordinator_address!r} must be HOST:PORT, "
                             f"e.g. 127.0.0.1:12355")
        if num_processes < 1:
            raise ValueError(f"--num_processes={num_processes} must be >= 1")
        if not 0 <= process_id < num_processes:
            raise ValueError(f"--process_id={process_id} must be in [0, {num_processes})")
        if process_id == 0:
            _check_port_free(coordinator_address)
        _RUN.update(process_id=process_id, num_processes=num_processes, address=coordinator_address)
        _leave_quietly_at_exit()
        if num_processes > 1:
            others = [p for p in range(num_processes) if p != process_id]
            awaited = (f"process{'es' if len(others) > 1 else ''} "
                       f"{', '.join(map(str, others))} to connect to {coordinator_address}"
                       if process_id == 0 else
                       f"process 0's coordinator at {coordinator_address} and the other "
                       "processes")
        else:
            awaited = "nothing"
        timers = [threading.Timer(min(_SAY_WAITING_S, startup_timeout / 2), _say,
                                  (f"process {process_id} of {num_processes}: waiting up to "
                                   f"{startup_timeout} s for {awaited} (--startup_timeout)",)),
                  threading.Timer(startup_timeout, _startup_timed_out,
                                  (process_id, num_processes, coordinator_address,
                                   startup_timeout))]
        for timer in timers:
            timer.daemon = True
            timer.start()
        try:  # JAX's own limit later than ours: its timeout is an abort with a C++ stack
            jax.distributed.initialize(coordinator_address, num_processes, process_id,
                                       initialization_timeout=startup_timeout + 60,
                                       heartbeat_timeout_seconds=heartbeat_timeout)
        finally:
            for timer in timers:
                timer.cancel()
        return f"process {process_id} of {num_processes} (coordinator {coordinator_address})"
    if any(os.environ.get(v) for v in CLUSTER_ENV_VARS):
        try:
            jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat_timeout)
        except (ValueError, RuntimeError) as e:  # e.g. a one-task Slurm allocation
            return f"single process (cluster detection: {' '.join(str(e).split())[:120]})"
        from jax._src import distributed as _state  # (jax.process_index() starts the backend)
        pid, n = _state.global_state.process_id, _state.global_state.num_processes
        _RUN.update(process_id=pid, num_processes=n)
        _leave_quietly_at_exit()
        return f"process {pid} of {n} (from the cluster's environment)"
    return "single process"


def _say(line: str) -> None:
    """Writes ``train.py: line`` to stderr at once (:func:`_voice`, as :func:`_stop`)."""
    try:
        sys.stderr.flush()
    except Exception:  # noqa: BLE001  a closed stderr
        pass
    _write(f"{_voice()}: {line}\n")


def _check_port_free(address: str) -> None:
    """Raises ValueError when the port of ``address`` is already bound on this host (JAX's
    coordination service binds every interface of it: ``[::]:PORT``)."""
    port = int(address.rsplit(":", 1)[1])
    families = [(socket.AF_INET, "0.0.0.0")]
    if socket.has_ipv6:
        families.append((socket.AF_INET6, "::"))
    for family, host in families:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no owner
                s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ValueError(f"--coordinator_address={address}: port {port} is already in "
                                 f"use on this host (another run, or another program); choose "
                                 f"a free port for every process") from None
            if family == socket.AF_INET6:  # no IPv6 here: the IPv4 check stands
                continue
            raise ValueError(f"--coordinator_address={address}: port {port} cannot be bound on "
                             f"this host ({e.strerror or e})") from None


def _startup_timed_out(process_id: int, num_processes: int, address: str, seconds: int) -> None:
    """The one line of a start-up that waited ``seconds`` for its peers, then the exit."""
    what = ("not every process connected" if process_id == 0 else
            "process 0's coordinator or another process did not answer")
    line = (f"\n{_voice()}: error: process {process_id} of {num_processes}: {what} to {address} "
            f"within {seconds} s (--startup_timeout); start all {num_processes} processes with "
            f"the same --coordinator_address and --num_processes\n")
    _RUN["lost"] = line.strip()
    _write(line)
    _leave(line)


def check_same_config(config_dict: dict, timeout_s: int = 300,
                      workdir: Optional[str] = None) -> None:
    """Refuses to go on unless every process was given the same config and workdir.

    Each process publishes its config (JSON) in JAX's distributed key-value store and
    compares the SHA-256 digest of every other process's with its own, before any
    collective (processes with different configs would otherwise meet in mismatched
    collectives: gloo's ``collective mismatch`` abort). A no-op for one process.

    Args:
      config_dict: the run's config as plain values (``config_to_dict``).
      timeout_s: seconds to wait for another process's config.
      workdir: the run's ``--workdir``, compared as an absolute path (key ``--workdir``):
        processes writing checkpoints into different directories would each wait for
        the other's part of a save.

    A process lost during the exchange (JAX's client raises: process 0, which hosts the
    key-value store, died; or a process wrote nothing within ``timeout_s``) is one line
    naming it, not a traceback, and then :data:`PEER_LOST_EXIT` (``exit_process``) or
    :class:`PeerLost`.

    Raises:
      ValueError: a process's config differs; the line names the first differing keys.
      PeerLost: a process was lost during the exchange (a library caller's process).
    """
    from jax._src import distributed as _state  # the running service: its key-value store
    state = _state.global_state
    if state.client is None or state.num_processes <= 1:
        return
    if workdir is not None:
        config_dict = {**config_dict, "--workdir": os.path.abspath(os.path.expanduser(workdir))}
    text = json.dumps(config_dict, sort_keys=True, default=str)
    digest = hashlib.sha256(text.encode()).hexdigest()
    me = state.process_id
    try:
        state.client.key_value_set(f"jaxmp/config/{me}", text)
    except (RuntimeError, OSError) as e:  # process 0's coordination service is gone
        _lost_in_start_up(0, "before the processes compared their configs", e)
    for other in range(state.num_processes):
        if other == me:
            continue
        try:
            theirs = state.client.blocking_key_value_get(f"jaxmp/config/{other}",
                                                         timeout_s * 1000)
        except (RuntimeError, OSError) as e:  # the service is gone, or `other` never wrote
            gone = "DEADLINE_EXCEEDED" not in str(e)
            _lost_in_start_up(0 if gone else other,
                              "before the processes compared their configs", e)
        if hashlib.sha256(theirs.encode()).hexdigest() == digest:
            continue
        mine, their = _flatten(config_dict), _flatten(json.loads(theirs))
        keys = sorted(k for k in set(mine) | set(their) if mine.get(k) != their.get(k))
        shown = "; ".join(f"{k}: {mine.get(k, '(none)')!r} here, {their.get(k, '(none)')!r} "
                          f"there" for k in keys[:3])
        more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
        raise ValueError(f"process {me} and process {other} were given different configs "
                         f"({shown}{more}); give every process the same --workdir, --config "
                         f"and --config.KEY=VALUE flags")


def _flatten(tree, prefix: str = "") -> dict:
    """``{"a.b": value}`` of a nested dict (JSON's values, round-tripped)."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.loads(json.dumps(v, default=str))
    return out


def preemption_sync() -> bool:
    """True in a multi-process run whose processes agree on the step at which to stop
    through JAX's preemption sync manager (``jax_enable_preemption_service``, on by
    default): SIGTERM is then JAX's to catch, and the loop asks
    :func:`jax.experimental.multihost_utils.reached_preemption_sync_point` every step."""
    from jax._src import distributed as _state
    state = _state.global_state
    return (state.client is not None and state.num_processes > 1
            and state.preemption_sync_manager is not None)


def _leave_quietly_at_exit() -> None:
    """At the interpreter's exit (registered after JAX's own clean-up, so run before it:
    ``atexit`` runs last-in first-out), closed connections are this process's own doing."""
    import atexit
    atexit.register(_LEAVING.set)


def _serve(server: socket.socket, handle: Callable[[socket.socket], None], name: str,
           thread_each: bool = False) -> None:
    """Accepts connections on ``server`` in a daemon thread until it is closed, passing each
    to ``handle`` (in a daemon thread of its own when ``thread_each``)."""
    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            if thread_each:
                threading.Thread(target=handle, args=(conn,), name=name, daemon=True).start()
            else:
                handle(conn)
    threading.Thread(target=accept, name=name, daemon=True).start()


def last_checkpoint(workdir) -> str:
    """The newest complete checkpoint step under ``workdir/checkpoints``, in words (orbax
    names a finished step directory by its number, an unfinished one otherwise)."""
    directory = pathlib.Path(workdir).absolute() / "checkpoints"
    steps = (sorted(int(p.name) for p in directory.iterdir()
                    if p.name.isascii() and p.name.isdigit())
             if directory.is_dir() else [])
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
    leaves with :data:`PEER_LOST_EXIT` through ``os._exit`` where :func:`initialize` was
    given ``exit_process=True`` (the entry point), else :class:`PeerLost` is raised in its
    main thread (module docstring). Each end sends ``ping``
    five times per ``silence_s``; a process that sends nothing for ``silence_s``
    seconds (stopped, hung, or on a machine that vanished without closing its
    connections) is lost too, and so is one that has not connected ``silence_s``
    seconds after process 0's watchdog started (it died between
    ``jax.distributed.initialize`` and its first word). A process other than 0 that
    cannot read process 0's watchdog port or connect to it (process 0 died first) leaves
    with one line and :data:`PEER_LOST_EXIT` too (:class:`PeerLost` for a library caller).

    Args:
      process_id: this process.
      num_processes: processes in the run.
      host: the coordinator's host (process 0 binds there).
      describe: ``describe() -> str``, where to resume from (:func:`last_checkpoint`).
      exchange: ``(set, get)`` of the key-value store: ``set(key, value)`` and
        ``get(key, timeout_ms) -> str``.
      silence_s: see above. Below JAX's heartbeat timeout, after which JAX notices
        such a process and aborts the others; far above any time the watchdog's
        threads may wait for the interpreter's lock.
    """

    GRACE_S = 10.0  # after a peer's own error: time for this process to stop by itself
    # A peer's death closes its connections at once; their end here is read within
    # milliseconds, unless this machine is very busy.
    ECHO_S = 2.0

    def __init__(self, process_id: int, num_processes: int, host: str, describe: Callable[[], str],
                 exchange, silence_s: float = 15.0):
        global _WATCHDOG
        self.process_id, self.num_processes, self.describe = process_id, num_processes, describe
        self.silence_s = silence_s
        self._send_lock = threading.Lock()
        _RUN.update(process_id=process_id, num_processes=num_processes, describe=describe)
        self._lock = threading.Lock()
        self._peers: Dict[int, socket.socket] = {}  # process 0: the others' connections
        self.said_bye: Dict[int, str] = {}  # peer -> "ok" or "error", as it left
        set_value, get_value = exchange
        _WATCHDOG = self
        if process_id == 0:
            self._server = socket.create_server((host, 0))
            set_value(_KEY, str(self._server.getsockname()[1]))
            _serve(self._server, self._greet, "jaxmp-watchdog", thread_each=True)
            self._hello_deadline = time.monotonic() + silence_s
            timer = threading.Timer(silence_s, self._check_hellos)
            timer.daemon = True
            timer.start()
        else:
            try:  # process 0 may die before (or while) its watchdog port is read
                port = int(get_value(_KEY, 300_000))
                self._up = socket.create_connection((host, port), timeout=60)
            except (RuntimeError, OSError) as e:
                _lost_in_start_up(0, "before its watchdog was reached", e)
            self._up.settimeout(silence_s)
            self._send(self._up, f"hello {process_id}\n")
            threading.Thread(target=self._read, args=(self._up, 0), name="jaxmp-watchdog",
                             daemon=True).start()
        threading.Thread(target=self._ping, name="jaxmp-watchdog", daemon=True).start()

    def _send(self, conn: socket.socket, line: str) -> None:
        with self._send_lock:
            try:
                conn.sendall(line.encode())
            except OSError:  # closed, or full for silence_s: the reading side decides
                pass

    def _ping(self) -> None:
        while not _LEAVING.wait(self.silence_s / 5):
            with self._lock:
                conns = list(self._peers.values()) if self.process_id == 0 else [self._up]
            for conn in conns:
                self._send(conn, "ping\n")

    def _check_hellos(self) -> None:
        with self._lock:
            missing = [p for p in range(1, self.num_processes) if p not in self._peers]
        if missing:
            self._peer_lost(missing[0],
                            "died during start-up (it never reached process 0's watchdog)")

    def _greet(self, conn: socket.socket) -> None:
        conn.settimeout(self.silence_s)
        reader = conn.makefile("r")
        try:
            first = reader.readline().split()
        except OSError:
            first = []
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
                    self.said_bye[peer] = "error" if words[1:] == ["error"] else "ok"
                    if words[1:] == ["error"]:  # it reports its error; this one may be stuck
                        timer = threading.Timer(self.GRACE_S, self._peer_lost,
                                                (peer, "stopped with an error (see its output)"))
                        timer.daemon = True
                        timer.start()
                elif words[:1] == ["lost"] and len(words) == 3:
                    self._peer_lost(int(words[1]), " ".join(words[2:]).replace("_", " "))
        except TimeoutError:  # nothing, not even a ping, for silence_s
            if peer not in self.said_bye:
                self._peer_lost(peer, f"sent nothing for {self.silence_s:g} s (stopped, hung, "
                                      f"or its machine vanished)")
            return
        except OSError:
            pass
        if peer not in self.said_bye:
            self._peer_lost(peer, "exited without a word (killed or crashed)")

    def _peer_lost(self, peer: int, how: str) -> None:
        if _LEAVING.is_set() or _LOST.is_set():  # on its way out already
            return
        with self._lock:
            others = [conn for other, conn in self._peers.items() if other != peer]
        for conn in others:  # process 0 tells the others
            self._send(conn, f"lost {peer} {how.replace(' ', '_')}\n")
        _stop(peer, how)

    def settle(self, seconds: float) -> None:
        """Gives the watchdog ``seconds`` to notice a lost peer (an error in this process
        may be the echo of one: a collective whose peer vanished), and on process 0, while
        a peer has not connected yet, until a second after the hello deadline; when it
        does, the process exits from the watchdog's thread and this never returns (the
        entry point's), or :class:`PeerLost` is raised (a library caller's)."""
        with self._lock:
            waiting = self.process_id == 0 and len(self._peers) < self.num_processes - 1
        if waiting:  # a peer not yet connected is lost only at the hello deadline
            seconds = max(seconds, self._hello_deadline + 1.0 - time.monotonic())
        with _STOP_LOCK:  # a loss meanwhile is raised here, not sent to this thread
            _MAIN_WAITS.set()
        try:
            lost = _LOST.wait(seconds)
        finally:
            with _STOP_LOCK:
                _MAIN_WAITS.clear()
        if lost:
            _wait_for_the_exit()

    def leave(self, ok: bool = True) -> None:
        """Says that this process leaves deliberately, so that its closed connection is
        not taken for a death; then stops watching. ``ok=False`` (it reports an error of
        its own): first :meth:`settle` for :attr:`ECHO_S` seconds (the error may be the
        echo of a peer's death: a collective or a checkpoint write that failed with it);
        a peer that has not stopped by itself :attr:`GRACE_S` seconds later stops,
        naming this process."""
        if not ok:
            self.settle(self.ECHO_S)
        _LEAVING.set()
        with self._lock:
            conns = list(self._peers.values()) if self.process_id == 0 else [self._up]
        for conn in conns:
            self._send(conn, "bye ok\n" if ok else "bye error\n")


def start_watchdog(workdir, silence_s: Optional[float] = None) -> Optional[PeerWatchdog]:
    """A :class:`PeerWatchdog` for a multi-process run (None for one process).

    Every process must call it, after :func:`initialize` and before anything starts
    JAX's backend (which waits for every process: one that died first would leave the
    others waiting there, not watched). ``silence_s`` (see :class:`PeerWatchdog`)
    defaults to half of :func:`initialize`'s ``heartbeat_timeout``, so that a process that
    died during start-up, or went silent, is named before JAX's heartbeat check aborts
    the others.
    """
    from jax._src import distributed as _state  # the running service: its key-value store
    state = _state.global_state  # (not jax.process_count(): that would start the backend)
    if state.client is None or state.num_processes <= 1:
        return None
    address = _RUN["address"] or state.coordinator_address
    host = address.rsplit(":", 1)[0].strip("[]")
    if silence_s is None:
        silence_s = _RUN["heartbeat_timeout"] / 2
    return PeerWatchdog(state.process_id, state.num_processes, host,
                        lambda: last_checkpoint(workdir),
                        (state.client.key_value_set, state.client.blocking_key_value_get),
                        silence_s)
