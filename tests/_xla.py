"""XLA flags of every test process and of the subprocesses the tests start.

``CPU_COMPILE_FLAGS``: XLA:CPU's elemental IR emitters instead of its fusion emitters. The
tests check numerics, not CPU speed, and compile hundreds of small train steps: a tiny_moe
run of 40 steps takes about 30% less CPU time with them (2026-12-02, jax 0.10.2: 21 against
30 CPU-seconds, most of it compiling). They are also what Mosaic GPU's interpret mode needs
(``jaxmp.precision.grouped_gemm.INTERPRET_XLA_FLAGS``). No import here: tests/conftest.py
reads it before JAX starts.
"""
CPU_COMPILE_FLAGS = "--xla_cpu_use_fusion_emitters=false"


def cpu_flags(devices=None):
    """``XLA_FLAGS`` for a subprocess: :data:`CPU_COMPILE_FLAGS`, and ``devices`` simulated
    CPU devices where given (else XLA's default, one)."""
    count = f"--xla_force_host_platform_device_count={devices} " if devices else ""
    return count + CPU_COMPILE_FLAGS
