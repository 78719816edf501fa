"""One process of a multi-process run that trains nothing: jaxmp.train.distributed's
start-up (JAX's runtime, the watchdog) and then a cross-process all-reduce
in a loop, so that a test can kill a peer and read what the survivor says, in a few
seconds instead of a trainer's compile.

    python tests/_peer_probe.py ADDRESS NUM_PROCESSES PROCESS_ID WORKDIR [PAUSE_S]

Creates ``WORKDIR/ready.PROCESS_ID`` once the watchdog runs and the first all-reduce is
done, after writing ``WORKDIR/info.PROCESS_ID`` (JSON: the coordinator address JAX's client
was given, and this process's thread names); with PAUSE_S > 0, first
``WORKDIR/paused.PROCESS_ID`` and then a sleep of PAUSE_S seconds between ``initialize`` and
the watchdog (a death in that gap). Exits 0 once ``WORKDIR/stop`` exists.
"""
import importlib.util
import json
import os
import pathlib
import sys
import threading
import time

import jax
import numpy as np

# The module alone (it imports only jax), not the jaxmp.train package: half the start-up.
_path = pathlib.Path(__file__).resolve().parents[1] / "jaxmp" / "train" / "distributed.py"
_spec = importlib.util.spec_from_file_location("jaxmp_train_distributed", _path)
distributed = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(distributed)

# JAX's heartbeat timeout; the watchdog's silence limit is half of it (5 s), which is how
# long a test of a stopped peer waits. Long enough for a busy machine: the watchdog pings
# five times per silence limit.
HEARTBEAT_TIMEOUT_S = 10

address, n, pid, workdir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
pause = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
distributed.initialize(address, n, pid, heartbeat_timeout=HEARTBEAT_TIMEOUT_S, workdir=workdir,
                       exit_process=True)  # as train.py
if pause:
    (pathlib.Path(workdir) / f"paused.{pid}").touch()
    time.sleep(pause)
watchdog = distributed.start_watchdog(workdir)
mesh = jax.make_mesh((jax.device_count(),), ("d",))
sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
local = np.ones((jax.local_device_count(),), np.float32)
total = jax.jit(lambda x: x.sum(), out_shardings=jax.sharding.NamedSharding(
    mesh, jax.sharding.PartitionSpec()))
x = jax.make_array_from_process_local_data(sharding, local)
try:
    assert float(total(x)) == jax.device_count()
    from jax._src import distributed as _state
    (pathlib.Path(workdir) / f"info.{pid}").write_text(json.dumps(
        {"coordinator_address": _state.global_state.coordinator_address,
         "threads": [t.name for t in threading.enumerate()]}))
    (pathlib.Path(workdir) / f"ready.{pid}").touch()
    while not (pathlib.Path(workdir) / "stop").exists():
        float(total(x))  # a collective with the peer, as a training step would run
        time.sleep(0.01)
except Exception:  # a collective whose peer died: the watchdog says so (as train.py does)
    watchdog.settle(5.0)
    raise
watchdog.leave(True)
sys.stdout.flush()
os._exit(0)
