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
cross-process reductions on CPU; on GPUs NCCL does. A process that dies stops sending
heartbeats: after ``heartbeat_timeout`` seconds the coordination service fails the others,
which exit with an error instead of waiting forever.
"""
from __future__ import annotations

import os
import re
from typing import Optional

import jax

__all__ = ["initialize", "CLUSTER_ENV_VARS"]

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
    if isinstance(heartbeat_timeout, bool) or not isinstance(heartbeat_timeout, int) or heartbeat_timeout < 1:
        raise ValueError(f"--heartbeat_timeout={heartbeat_timeout!r} must be an integer number of seconds >= 1")
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
