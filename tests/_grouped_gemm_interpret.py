"""Runs jaxmp's grouped GEMM (values, dx, dw) in Mosaic GPU interpret mode on the CPU.

A helper for tests/test_grouped_gemm.py, run in its own process because interpreting
needs ``XLA_FLAGS=--xla_cpu_use_fusion_emitters=false`` (see jaxmp.precision.grouped_gemm).

    python tests/_grouped_gemm_interpret.py IN.npz OUT.npz

IN holds x [M, K], w [G, K, N], dy [M, N] (float32, exactly representable in the dtype),
group_sizes [G] and dtype (a string); OUT gets y, dx, dw as float32 and the tiles chosen.
"""
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxmp.precision import grouped_gemm  # noqa: E402


def main(src: str, dst: str) -> None:
    data = np.load(src)
    dtype = jnp.dtype(str(data["dtype"]))
    x, w, dy = (jnp.asarray(data[k], dtype) for k in ("x", "w", "dy"))
    gs = jnp.asarray(data["group_sizes"], jnp.int32)
    with grouped_gemm.interpret_mode():
        y, vjp = jax.vjp(lambda a, b: grouped_gemm.grouped_matmul(a, b, gs, num_sms=4), x, w)
        dx, dw = vjp(dy)
        out = {k: np.asarray(v.astype(jnp.float32)) for k, v in (("y", y), ("dx", dx), ("dw", dw))}
    out["dtypes"] = np.array([str(y.dtype), str(dx.dtype), str(dw.dtype)])
    out["tiles"] = np.array(sorted(f"{k}: {v}" for k, v in grouped_gemm.tile_choices().items()))
    np.savez(dst, **out)


if __name__ == "__main__":
    main(*sys.argv[1:3])
