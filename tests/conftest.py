"""Test setup: 8 host CPU devices, so that meshes of 8 devices are real, and XLA:CPU
flags that compile fast (tests/_xla.py).

XLA reads XLA_FLAGS once, when the backend starts, so this must run before any
test module imports jax.
"""
import os

from _xla import CPU_COMPILE_FLAGS

for _flag in ("--xla_force_host_platform_device_count=8", CPU_COMPILE_FLAGS):
    if _flag not in os.environ.get("XLA_FLAGS", ""):  # pytest-xdist workers inherit them
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One persistent compilation cache per test session (JAX's own, keyed on the program, the
# compile options and the XLA flags), set by the pytest process that starts the session
# and inherited by both pytest-xdist workers and every train.py, benchmark and notebook
# subprocess: the tests compile the same tiny steps many times over, in many processes, a
# tiny_moe run's 7 programs taking about 6 of its 17 seconds. A size limit turns on JAX's
# file lock around every read and write of an entry (jax._src.lru_cache, which needs the
# filelock package), so that no process reads an entry another is still writing; where
# filelock is missing, each worker keeps a folder of its own instead. Benchmarks that time
# compilation turn the cache off themselves.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import importlib.util
    import shutil
    import tempfile

    _cache = tempfile.mkdtemp(prefix="jaxmp-tests-jit-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    if importlib.util.find_spec("filelock") is not None:
        os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(64 << 30)  # 64 GiB: never evicts
    else:
        _cache = os.path.join(_cache, os.environ.get("PYTEST_XDIST_WORKER", "main"))
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    # Only programs that took a quarter second to compile are written: JAX's size-limited
    # cache lists and stats every entry at each write (jax._src.lru_cache, to evict), so
    # writing each tiny eager op's program too made a full run quadratic in its entries
    # (66db6ff: test_ops.py 22 -> 345 test-seconds once the workers used the cache).
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.25"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

# Tests check numerics, not speed: compile fast, here and in every subprocess (train.py,
# the report, the notebooks), which reads the flag from the environment. The deviceless GPU
# compiles turn full optimizations back on themselves (jaxmp.analysis.gpu.full_optimizations).
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import gc  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

# Python's cyclic garbage collector, tuned for a process that traces and compiles JAX
# programs by the thousand: a young-generation collection every 100,000 net allocations
# instead of 700, and the imported modules frozen out of every collection once the tests
# are collected (pytest_collection_finish). Cycles are still freed, less often. Measured on
# tests/test_fp8_train.py alone (-n 0): 115 -> 105 CPU-seconds (turning the collector off
# gained nothing more). This is the test processes' own setting; their subprocesses
# (train.py, benchmarks, notebooks) keep Python's defaults.
gc.set_threshold(100_000, 50, 100)

jax.config.update("jax_disable_most_optimizations", True)


# Scheduling on the 2 pytest-xdist workers (`-n 2 --dist loadgroup --no-loadscope-reorder` in
# pyproject.toml). A test belongs to an xdist group: the one it is marked with
# (``@pytest.mark.xdist_group("NAME")``), else its module's file name, so that a module- or
# session-scoped fixture (and the persistent compilation cache's entries) serves its whole
# module on one worker. A module that sets ``XDIST_PER_TEST = True`` (it shares no costly
# fixture) is handed out test by test instead, except for its marked tests; marks are also
# how a long module is split across both workers. xdist hands out the groups in the order
# below, slowest first (test-seconds, tests/README.md): starting with the longest keeps one
# worker from running a long group alone at the end. A group or module missing here runs
# later, in collection order, and the tests handed out one by one last; no result changes.
SLOWEST_FIRST = (  # groups by their test-seconds in the run of 2026-12-03 07:00, longest first
    "two_processes", "test_notebooks.py", "faults_processes", "test_grouped_gemm_deviceless.py",
    "test_accounting.py", "test_faults.py", "gpu_seed", "test_parallel.py", "gpu_suite_toy",
    "test_scan_remat.py", "gpu_dense_1b", "test_install.py", "test_model.py", "test_fp8.py",
    "test_benchmarks.py", "test_fidelity.py", "test_update_rounding.py", "parallel_accounting",
    "test_faults_round3.py", "test_report_cli.py", "test_readers_beside_trainer.py", "test_hf.py",
    "test_artifacts.py", "test_comm.py", "test_benchmarks_matmul.py", "test_start_up_peers.py",
    "test_checkpoint.py", "test_start_up_silences.py", "test_distributed_startup.py",
    "test_fp8_kernel.py", "test_grouped_gemm.py", "test_multiprocess.py", "test_diagnostics.py")


def _group(item):
    mark = item.get_closest_marker("xdist_group")
    return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default")) if mark else None


def pytest_itemcollected(item):
    if _group(item) is None and not getattr(getattr(item, "module", None), "XDIST_PER_TEST", False):
        item.add_marker(pytest.mark.xdist_group(item.path.name))


@pytest.hookimpl(trylast=True)  # after xdist's own hook
def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}

    def order(item):  # the tests of XDIST_PER_TEST modules (no group) last: they fill gaps
        group = _group(item)
        return len(rank) + 1 if group is None else rank.get(group, len(rank))

    items.sort(key=order)  # stable: collection order within a group
    if not getattr(config.option, "loadgroup", False):  # set on xdist workers only
        return
    # xdist (3.8) groups tests by an "@GROUP" suffix of their node ids, which it sets on
    # ``item._nodeid``; pytest 9 keeps the id in ``item._id``, so the suffix is set here
    # (where xdist's own hook, which runs first, has not set it).
    for item in items:
        group = _group(item)
        if group is not None and not item.nodeid.endswith("@" + group):
            from _pytest.nodeid import coerce_node_id
            item._id = coerce_node_id(f"{item.nodeid}@{group}")


def pytest_collection_finish(session):
    gc.freeze()  # every module is imported now: keep their objects out of each collection
