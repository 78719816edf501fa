"""Library code leaves the process as it found it (issue 29, point 3).

Constructing and closing a :class:`~jaxmp.train.checkpoint.Checkpointer` changes no
logger and no ``sys.unraisablehook``; the entry points' :func:`quiet_orbax_tracebacks`
changes both and its returned function puts them back; leaving
:func:`jaxmp.precision.grouped_gemm.interpret_mode` restores the ``jax._src`` callback, the
CPU lowering table and the interpret flag it changed; leaving
``benchmarks.fidelity.compilation_cache`` leaves JAX's compilation cache where it was;
importing ``benchmarks._common`` leaves the cache on, and its ``uncached_compiles`` compiles
inside and turns the cache back on after. Importing every jaxmp module changes no logger;
``train_and_evaluate``'s signal handlers are the caller's again after it, and a second
signal raises ``KeyboardInterrupt`` there; each scoped patch of ``jax._src`` (the Mosaic
GPU interpreter's, ``jaxmp.target.compiling_for``'s and
``jaxmp.models.attention.trace_cudnn_without_gpu``'s cuDNN checks) is undone on leaving.
"""
import contextlib
import logging
import sys

import pytest


def _logging_state():
    return {name: list(logging.getLogger(name).filters) for name in ("absl", "asyncio")}


def test_a_checkpointer_changes_no_logger_and_no_unraisablehook(tmp_path):
    from jaxmp.train.checkpoint import Checkpointer
    filters, hook = _logging_state(), sys.unraisablehook
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.latest_step() is None
        assert _logging_state() == filters and sys.unraisablehook is hook
    assert _logging_state() == filters and sys.unraisablehook is hook


def test_quiet_orbax_tracebacks_is_undone_by_the_function_it_returns():
    from jaxmp._entry import _DropOrbaxTracebacks, quiet_orbax_tracebacks
    filters, hook = _logging_state(), sys.unraisablehook
    restore = quiet_orbax_tracebacks()
    try:
        for name in ("absl", "asyncio"):
            added = [f for f in logging.getLogger(name).filters if f not in filters[name]]
            assert len(added) == 1 and isinstance(added[0], _DropOrbaxTracebacks)
        assert sys.unraisablehook is not hook
    finally:
        restore()
    assert _logging_state() == filters and sys.unraisablehook is hook


def test_the_entry_points_quiet_orbax_and_the_library_does_not(tmp_path, monkeypatch):
    """Behaviour, not source text: importing every jaxmp module changes no logger and no
    ``sys.unraisablehook``; ``jaxmp.sample`` and ``jaxmp.export`` have orbax quiet while
    they read the run and put both back after; train.py's main has them quiet while it
    trains (an entry point: it leaves them so until the process ends)."""
    import importlib
    import pkgutil

    import jaxmp
    from jaxmp import export, sample
    from jaxmp.train import artifacts
    from jaxmp._entry import _DropOrbaxTracebacks

    filters, hook = _logging_state(), sys.unraisablehook
    for module in pkgutil.walk_packages(jaxmp.__path__, "jaxmp."):
        importlib.import_module(module.name)
    assert _logging_state() == filters and sys.unraisablehook is hook

    quiet = []

    def reads(*args, **kwargs):  # stands in for reading the run: is orbax quiet now?
        quiet.append(any(isinstance(f, _DropOrbaxTracebacks)
                         for f in logging.getLogger("absl").filters)
                     and sys.unraisablehook is not hook)
        raise ValueError("no run here")

    for name in ("read_run", "export", "export_hf"):
        monkeypatch.setattr(artifacts, name, reads)
    for main, argv in ((sample.main, ["--workdir", str(tmp_path)]),
                       (export.main, ["--workdir", str(tmp_path), "--out", str(tmp_path / "o")]),
                       (export.main, ["--workdir", str(tmp_path), "--out", str(tmp_path / "o"),
                                      "--format", "hf"])):
        with pytest.raises(SystemExit):
            main(argv)
        assert _logging_state() == filters and sys.unraisablehook is hook
    assert quiet == [True, True, True]

    import train
    from absl import flags

    monkeypatch.setattr(train, "train_and_evaluate", lambda config, workdir, **kw: reads())
    try:
        with pytest.raises(SystemExit):
            train.main(train._parse_flags(["train.py", "--workdir", str(tmp_path / "w")]))
        assert quiet == [True, True, True, True]
    finally:  # what the entry point left for its process's end
        for name, kept in filters.items():
            for f in list(logging.getLogger(name).filters):
                if f not in kept:
                    logging.getLogger(name).removeFilter(f)
        sys.unraisablehook = hook
        flags.FLAGS["workdir"].unparse()


def test_leaving_interpret_mode_restores_what_it_changed():
    from jaxmp.precision import grouped_gemm
    try:
        from jax._src import config
        from jax._src.interpreters import mlir
        from jax._src.pallas.mosaic_gpu import core as gpu_core
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    except ImportError as e:  # a jax other than INTERPRET_PINNED_JAX
        pytest.skip(f"no Mosaic GPU interpreter in this jax: {e}")
    cpu = mlir._platform_specific_lowerings["cpu"]
    before = (dict(cpu), gpu_callbacks.wgmma,
              config.pallas_tpu_interpret_mode_context_manager.value)
    assert gpu_core.layout_cast_p not in cpu  # so that the removal below is tested
    with grouped_gemm.interpret_mode():
        assert gpu_core.layout_cast_p in cpu
        assert gpu_callbacks.wgmma is grouped_gemm._interpret_wgmma
        assert config.pallas_tpu_interpret_mode_context_manager.value is not None
    after = (dict(cpu), gpu_callbacks.wgmma,
             config.pallas_tpu_interpret_mode_context_manager.value)
    assert after == before


def test_leaving_interpret_mode_puts_back_a_lowering_that_was_there():
    from jaxmp.precision import grouped_gemm
    try:
        from jax._src.interpreters import mlir
        from jax._src.pallas.mosaic_gpu import core as gpu_core
    except ImportError as e:
        pytest.skip(f"no Mosaic GPU interpreter in this jax: {e}")
    cpu = mlir._platform_specific_lowerings["cpu"]
    mine = mlir.LoweringRuleEntry(lambda ctx, x, **_: [x], True)
    cpu[gpu_core.layout_cast_p] = mine
    try:
        with pytest.raises(RuntimeError, match="inside"):
            with grouped_gemm.interpret_mode():
                assert cpu[gpu_core.layout_cast_p] is not mine
                raise RuntimeError("inside")  # an error inside the context restores too
        assert cpu[gpu_core.layout_cast_p] is mine
    finally:
        cpu.pop(gpu_core.layout_cast_p, None)


_CACHE_KEYS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
               "jax_persistent_cache_min_entry_size_bytes", "jax_enable_compilation_cache")


@pytest.fixture
def cache_dir(tmp_path):
    """JAX's persistent compilation cache on, in ``tmp_path / "cache"``, every program
    written, whatever another test of this worker left; the worker's settings are put back
    (and the cache reset) after the test. Yields the directory."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    old = {k: getattr(jax.config, k) for k in _CACHE_KEYS}
    try:
        for k, v in zip(_CACHE_KEYS, (str(tmp_path / "cache"), 0, 0, True)):
            jax.config.update(k, v)
        cc.reset_cache()
        yield tmp_path / "cache"
    finally:
        for k, v in old.items():
            jax.config.update(k, v)
        cc.reset_cache()


def test_fidelitys_compilation_cache_leaves_jax_writing_to_the_previous_directory(cache_dir):
    """Programs compiled after ``benchmarks.fidelity.compilation_cache(None)`` go to the
    cache directory set before it, not to its deleted temporary one (JAX opens its cache
    once, so leaving must reset it)."""
    import warnings

    import jax
    import jax.numpy as jnp

    from benchmarks import fidelity

    with fidelity.compilation_cache(None):
        jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.25)(jnp.ones(7)).block_until_ready()
    assert jax.config.jax_compilation_cache_dir == str(cache_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Error writing persistent compilation cache entry"
        jax.jit(lambda x: jnp.cos(x) * 5.0 - 0.75)(jnp.ones(11)).block_until_ready()
    assert any(cache_dir.iterdir())  # written where the process had asked


def test_the_benchmarks_time_compiles_and_leave_the_cache_on(cache_dir):
    """Importing ``benchmarks._common`` (as tests/test_train.py does) keeps JAX's persistent
    compilation cache on; a program compiled under ``uncached_compiles`` is compiled even
    when the cache holds it, and the same program compiled after the block is read from the
    cache again. Before, the import turned the cache off for the whole process: in the test
    suite, for both pytest-xdist workers."""
    import importlib
    from collections import Counter

    import jax
    import jax.numpy as jnp

    seen = Counter()

    def on_event(event, **_):
        seen[event] += 1

    def f(x):
        return jnp.tanh(x) * 1.625 - 0.375

    def compile_once():  # a new jit object: JAX's in-memory caches do not hold it
        before = Counter(seen)
        jax.jit(lambda x: f(x)).lower(jax.ShapeDtypeStruct((13,), jnp.float32)).compile()
        return tuple(seen[f"/jax/compilation_cache/{k}"] - before[f"/jax/compilation_cache/{k}"]
                     for k in ("compile_requests_use_cache", "cache_hits", "cache_misses"))

    jax.monitoring.register_event_listener(on_event)
    try:
        common = importlib.reload(importlib.import_module("benchmarks._common"))
        assert jax.config.jax_enable_compilation_cache is True
        # JAX's events per compile: (asked the cache, a hit, a miss)
        miss, hit, uncached = (1, 0, 1), (1, 1, 0), (0, 0, 0)
        assert compile_once() == miss  # and written to the cache
        assert compile_once() == hit
        with common.uncached_compiles():
            assert jax.config.jax_enable_compilation_cache is False
            assert compile_once() == uncached
        assert jax.config.jax_enable_compilation_cache is True
        assert compile_once() == hit
    finally:
        jax.monitoring.unregister_event_listener(on_event)


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
def test_a_second_signal_in_a_library_call_raises_and_the_handlers_come_back(signum):
    """train_and_evaluate's signal catcher: the first signal is a flag the loop polls; a
    second raises KeyboardInterrupt (before, os._exit: a double Ctrl-C killed a notebook's
    kernel); leaving puts the caller's handlers back. (train.py asks to exit at once:
    exit_on_second_signal=True, tested with real processes in test_faults.py.)"""
    import os
    import signal
    import threading
    import time

    from jaxmp.train.signals import SignalCatcher

    assert threading.current_thread() is threading.main_thread()  # signals reach this thread
    sig = getattr(signal, signum)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def delivered(catcher, want):
        deadline = time.monotonic() + 30  # a bound on a regression, not a timing
        while catcher.signum != want and time.monotonic() < deadline:
            time.sleep(0.01)
        return catcher.signum == want

    with pytest.raises(KeyboardInterrupt):
        with SignalCatcher() as catcher:
            os.kill(os.getpid(), sig)
            assert delivered(catcher, sig)
            os.kill(os.getpid(), sig)
            time.sleep(30)  # interrupted by the handler's KeyboardInterrupt
    assert {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} == before


def test_a_signal_while_the_catcher_leaves_reaches_the_callers_handler(monkeypatch):
    """A signal that comes while SignalCatcher puts the caller's handlers back is delivered
    again once both are back, to the caller's handler; nothing of the catcher's is left
    installed (the race a helper found: a second SIGINT raised out of __exit__ half-way)."""
    import os
    import signal

    from jaxmp.train.signals import SignalCatcher

    got = []

    def mine(signum, frame):
        got.append(signum)

    previous = {s: signal.signal(s, mine) for s in (signal.SIGINT, signal.SIGTERM)}
    real = signal.signal
    try:
        def racing(sig, handler):  # a SIGINT lands just before the first handler is put back
            if handler is mine and not got and not racing.fired:
                racing.fired = True
                os.kill(os.getpid(), signal.SIGINT)
            return real(sig, handler)

        racing.fired = False
        with SignalCatcher() as catcher:
            catcher.signum = signal.SIGINT  # a first signal already taken: the next is a second
            monkeypatch.setattr(signal, "signal", racing)
        monkeypatch.undo()
        assert got == [signal.SIGINT]  # delivered to the caller's handler, once
        assert all(signal.getsignal(s) is mine for s in (signal.SIGINT, signal.SIGTERM))
        with pytest.raises(RuntimeError, match="entered once at a time"):
            with catcher:
                with catcher:
                    pass
    finally:
        for s, h in previous.items():
            real(s, h)


_CUDNN_CHECKS = ("check_cudnn_version", "check_compute_capability",
                 "is_cuda_compute_capability_equal")


@pytest.mark.parametrize("leave", ["return", "raise"])
def test_compiling_for_a_deviceless_gpu_puts_back_jaxs_cudnn_checks(leave):
    """jaxmp.target.compiling_for patches three jax._src cuDNN checks for a deviceless
    NVIDIA target: inside they answer for the target, after (however the block ends) they
    are JAX's own again."""
    from jax._src.cudnn import fused_attention_stablehlo as fused

    from jaxmp import target

    before = {name: getattr(fused, name) for name in _CUDNN_CHECKS}
    h200 = target.Target(platform="gpu", device_kind="NVIDIA H200", compute_capability=(9, 0),
                         deviceless=True)
    with pytest.raises(RuntimeError) if leave == "raise" else contextlib.nullcontext():
        with target.compiling_for(h200):
            assert fused.check_cudnn_version() == 90800
            assert fused.check_compute_capability("9.0") and not fused.check_compute_capability(
                "10.0")
            assert all(getattr(fused, name) is not before[name] for name in _CUDNN_CHECKS)
            if leave == "raise":
                raise RuntimeError("a failed trace")
    assert {name: getattr(fused, name) for name in _CUDNN_CHECKS} == before


@pytest.mark.parametrize("leave", ["return", "raise"])
def test_tracing_cudnn_without_a_gpu_puts_back_jaxs_version_check(leave):
    """jaxmp.models.attention.trace_cudnn_without_gpu patches jax._src's cuDNN version
    check (and sets its own trace-only flag) where there is no cuDNN; both are as they
    were after the block, however it ends."""
    from jax._src.cudnn import fused_attention_stablehlo as fused

    from jaxmp.models import attention

    before, flag = fused.check_cudnn_version, list(attention._TRACE_ONLY_CUDNN)
    with pytest.raises(RuntimeError) if leave == "raise" else contextlib.nullcontext():
        with attention.trace_cudnn_without_gpu():
            assert attention._TRACE_ONLY_CUDNN[0] is True
            if attention._cudnn_version() is None:  # no cuDNN here: the version is faked
                assert fused.check_cudnn_version() == 90800
            if leave == "raise":
                raise RuntimeError("a failed trace")
    assert fused.check_cudnn_version is before and list(attention._TRACE_ONLY_CUDNN) == flag
