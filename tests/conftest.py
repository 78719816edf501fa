"""Test setup: 8 host CPU devices, so that meshes of 8 devices are real.

XLA reads XLA_FLAGS once, when the backend starts, so this must run before any
test module imports jax.
"""
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One persistent compilation cache per test session (JAX's own, keyed on the program, the
# compile options and the XLA flags), inherited by every train.py, benchmark and notebook
# subprocess: the tests compile the same tiny steps many times over, in many processes.
# Each pytest-xdist worker gets a folder of its own, so no process reads an entry that
# another worker is still writing. Benchmarks that time compilation turn it off themselves.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache = tempfile.mkdtemp(prefix="jaxmp-tests-jit-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(
        _cache, os.environ.get("PYTEST_XDIST_WORKER", "main"))
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

# Tests check numerics, not speed: compile fast, here and in every subprocess (train.py,
# the report, the notebooks), which reads the flag from the environment. The deviceless GPU
# compiles turn full optimizations back on themselves (jaxmp.analysis.gpu.full_optimizations).
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_disable_most_optimizations", True)


# Scheduling on the 2 pytest-xdist workers (`-n 2 --dist loadgroup --no-loadscope-reorder` in
# pyproject.toml). Every test belongs to an xdist group: its module's file name, unless it is
# marked ``@pytest.mark.xdist_group("NAME")`` itself, which is how a long module is split
# across both workers (the tests sharing a module- or session-scoped fixture stay in one
# group, so that the fixture is computed once). xdist hands out whole groups, in the order
# below, slowest first (test-seconds from tests/README.md): starting with the longest keeps
# one worker from running a long group alone at the end. A group missing here runs later,
# in collection order; no result changes.
SLOWEST_FIRST = ("test_gpu_target.py", "test_faults.py", "faults_processes", "test_train.py",
                 "test_fp8_train.py", "test_parallel.py", "test_artifacts.py",
                 "test_grouped_gemm_deviceless.py", "test_fp8_kernel.py", "test_grouped_gemm.py",
                 "test_gpu_suite.py", "test_scan_remat.py", "test_accounting.py",
                 "test_notebooks.py", "test_checkpoint.py", "test_fp8.py", "test_comm.py",
                 "test_model.py", "test_fidelity.py", "test_multiprocess.py",
                 "test_benchmarks.py", "test_benchmarks_matmul.py", "test_diagnostics.py")


def _group(item):
    mark = item.get_closest_marker("xdist_group")
    return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default")) if mark else None


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _group(item) is None:
            item.add_marker(pytest.mark.xdist_group(item.path.name))
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(_group(item), len(rank)))  # stable within a group
