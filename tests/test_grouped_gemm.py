"""The grouped GEMM kernels (jaxmp.precision.grouped_gemm) against float64 NumPy.

The kernels run in Mosaic GPU interpret mode on the CPU, in a subprocess
(tests/_grouped_gemm_interpret.py) with the XLA flag interpreting needs. Kept small:
each case takes 15-30 s on 2 cores.
"""
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmp.precision import grouped_gemm

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_interpret_spelling_is_pinned_to_this_jax():
    # interpret_mode reaches into jax._src; a new jax must be re-checked, not trusted.
    assert jax.__version__ == grouped_gemm.INTERPRET_PINNED_JAX
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, params

    assert callable(params.force_gpu_interpret_mode) and callable(gpu_callbacks.wgmma)
    params.InterpretGPUParams(out_of_bounds_reads="uninitialized", uninitialized_memory="zero")


@pytest.mark.parametrize("op,m,k,n,g,want", [
    # bench_h200: 32768 routed rows, d_model = d_expert = 1024, 8 experts.
    ("fwd", 32768, 1024, 1024, 8, (128, 128, 64, 4, 8)),
    ("dx", 32768, 1024, 1024, 8, (128, 128, 64, 4, 8)),
    ("dw", 1024, 32768, 1024, 8, (128, 128, 64, 4, 8)),
    # fewer than 128 rows per group: 64-row tiles; N = 192: 64 wide, 3 column tiles.
    ("fwd", 200, 64, 192, 3, (64, 64, 64, 4, 1)),
    ("dw", 64, 200, 128, 3, (64, 128, 64, 4, 1)),
])
def test_choose_tiles(op, m, k, n, g, want):
    assert tuple(grouped_gemm.choose_tiles(op, m, k, n, g).kwargs().values()) == want


def test_unsupported_inputs_are_named():
    with pytest.raises(ValueError, match="float32"):
        grouped_gemm.grouped_matmul(jnp.zeros((8, 64)), jnp.zeros((2, 64, 64)), jnp.array([4, 4]))
    with pytest.raises(ValueError, match="d_out=96 to be a multiple of 64"):
        grouped_gemm.grouped_matmul(jnp.zeros((8, 64), jnp.bfloat16),
                                    jnp.zeros((2, 64, 96), jnp.bfloat16), jnp.array([4, 4]))
    with pytest.raises(ValueError, match="one dtype"):
        grouped_gemm.grouped_matmul(jnp.zeros((8, 64), jnp.bfloat16),
                                    jnp.zeros((2, 64, 64), jnp.float16), jnp.array([4, 4]))
    with pytest.raises(ValueError, match="op='bwd'"):
        grouped_gemm.choose_tiles("bwd", 1, 64, 64, 1)


def _reference(x, w, dy, group_sizes):
    """float64 per-group products: y = x_e w_e, dx = dy_e w_e^T, dw_e = x_e^T dy_e."""
    x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
    y, dx, dw = np.zeros((x.shape[0], w.shape[2])), np.zeros_like(x), np.zeros(w.shape)
    start = 0
    for e, size in enumerate(group_sizes):
        rows = slice(start, start + size)
        y[rows], dx[rows], dw[e] = x[rows] @ w[e], dy[rows] @ w[e].T, x[rows].T @ dy[rows]
        start += size
    return y, dx, dw


# M = 200 is no multiple of the 64-row tile; group 1 is empty, group 0 ends mid-tile.
@pytest.mark.parametrize("dtype,rel", [("bfloat16", 2.0 ** -7), ("float16", 2.0 ** -10)])
def test_kernel_matches_float64(tmp_path, dtype, rel):
    rng = np.random.default_rng(0)
    m, k, n, group_sizes = 200, 64, 128, np.array([70, 0, 130], np.int32)
    # Operands rounded to the dtype first, so the reference sees what the kernel sees.
    x, w, dy = (np.asarray(jnp.asarray(rng.standard_normal(s), dtype).astype(jnp.float32))
                for s in ((m, k), (3, k, n), (m, n)))
    np.savez(tmp_path / "in.npz", x=x, w=w, dy=dy, group_sizes=group_sizes, dtype=dtype)
    env = dict(os.environ, PYTHONPATH=str(ROOT),
               XLA_FLAGS=grouped_gemm.INTERPRET_XLA_FLAGS, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "_grouped_gemm_interpret.py"),
                           str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = np.load(tmp_path / "out.npz")
    assert list(out["dtypes"]) == [dtype] * 3
    for name, want in zip(("y", "dx", "dw"), _reference(x, w, dy, group_sizes)):
        got = out[name]
        # float32 accumulation, one rounding to the dtype at the end: within half an ulp
        # of the largest value (rel = 2^-8 bf16, 2^-11 fp16, doubled for the sum's error).
        assert np.max(np.abs(got - want)) <= rel * np.max(np.abs(want)), name
    assert not out["dw"][1].any()  # the empty group's weight gradient is exactly 0
    assert any(t.startswith("('dw', 64, 200, 128, 3") for t in out["tiles"])


H200 = __import__("jaxmp.target", fromlist=["Target"]).Target("gpu", "NVIDIA H200", (9, 0), 132)
A100 = __import__("jaxmp.target", fromlist=["Target"]).Target("gpu", "NVIDIA A100", (8, 0), 108)


@pytest.mark.parametrize("name,dtype,d,recipe,tgt,want", [
    ("auto", jnp.bfloat16, 1024, None, H200, "pallas"),
    ("auto", jnp.float16, 64, None, H200, "pallas"),
    ("auto", jnp.float32, 1024, None, H200, "ragged_dot"),
    ("auto", jnp.bfloat16, 96, None, H200, "ragged_dot"),
    ("auto", jnp.bfloat16, 1024, "fp8_blockwise", H200, "ragged_dot"),
    ("auto", jnp.bfloat16, 1024, None, A100, "ragged_dot"),
    ("auto", jnp.bfloat16, 1024, None, None, "ragged_dot"),  # this CPU host
    ("ragged_dot", jnp.bfloat16, 1024, None, H200, "ragged_dot"),
])
def test_resolve_moe_kernel(name, dtype, d, recipe, tgt, want):
    from jaxmp.models.moe import resolve_moe_kernel

    assert resolve_moe_kernel(name, dtype, d, d, recipe, tgt) == want


@pytest.mark.parametrize("dtype,d,tgt,match", [
    (jnp.bfloat16, 1024, None, "compile target cpu is not an NVIDIA GPU of sm >= 9.0"),
    (jnp.float32, 1024, H200, "float32"),
    (jnp.bfloat16, 96, H200, "d_in=96"),
])
def test_forced_pallas_where_it_cannot_run_is_one_line(dtype, d, tgt, match):
    from jaxmp.models.moe import resolve_moe_kernel

    with pytest.raises(ValueError, match=match) as err:
        resolve_moe_kernel("pallas", dtype, d, d, None, tgt)
    assert "\n" not in str(err.value) and "'auto' or 'ragged_dot'" in str(err.value)


def test_unknown_moe_kernel_is_rejected_by_the_config():
    from jaxmp.train.config import load_config, validate_config

    with pytest.raises(ValueError, match="moe_kernel"):
        validate_config(load_config("configs/tiny_moe.py", ["--config.model.moe_kernel=triton"]), 1)
