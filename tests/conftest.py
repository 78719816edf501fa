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

jax.config.update("jax_disable_most_optimizations", True)


# The slowest modules, slowest first (summed --durations=0, 2026-12-01). pytest-xdist
# (`-n 2 --dist loadfile --no-loadscope-reorder` in pyproject.toml) hands each module whole
# to one worker, in this order; starting with the longest keeps one worker from running a
# long module alone at the end (without --no-loadscope-reorder, xdist would order the
# modules by their number of tests). A module missing here runs later; no result changes.
SLOWEST_FIRST = ("test_faults.py", "test_train.py", "test_gpu_target.py", "test_fp8_train.py",
                 "test_parallel.py", "test_artifacts.py", "test_grouped_gemm_deviceless.py",
                 "test_fp8_kernel.py", "test_grouped_gemm.py", "test_gpu_suite.py", "test_scan_remat.py", "test_accounting.py",
                 "test_notebooks.py", "test_checkpoint.py", "test_fp8.py", "test_comm.py",
                 "test_model.py", "test_fidelity.py", "test_multiprocess.py",
                 "test_benchmarks.py", "test_benchmarks_matmul.py", "test_diagnostics.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable within a module
