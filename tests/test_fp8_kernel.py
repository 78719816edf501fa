"""The blockwise FP8 GEMM as a Pallas Mosaic GPU kernel (jaxmp.precision._fp8.kernel).

Correctness runs on the CPU in Mosaic GPU's interpret mode against NumPy float64 and against
the XLA reference (one FP8 dot per 128 of K); the compiled kernel is checked by compiling
for an H200 without a GPU (jaxmp.analysis.gpu; skipped where the CUDA plugin is absent).
Interpreted shapes stay at a few 128-tiles: the interpreter is slow.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import _compiled
from jaxmp.analysis import gpu, hlo
from jaxmp import fp8
from jaxmp import target as compile_target
from jaxmp.precision._fp8 import kernel as fp8_kernel
from jaxmp.precision._fp8.gemm import _scaled_mm
from jaxmp.precision._fp8.quant import _cols, _dequantize_tiles, _q_tiles

U32 = 2.0 ** -24  # float32 unit roundoff


def _operands(rng, m, k, n, integer=False):
    if integer:  # small integers and power-of-two scales: every sum is exact in float32
        qa = rng.integers(-4, 5, (m, k)).astype(np.float32)
        qb = rng.integers(-4, 5, (k, n)).astype(np.float32)
        kb = -(-k // 128)
        sa = 2.0 ** rng.integers(-3, 4, (m, kb)).astype(np.float32)
        sb = 2.0 ** rng.integers(-3, 4, (kb, -(-n // 128))).astype(np.float32)
        return (jnp.asarray(qa, fp8.E4M3), jnp.asarray(sa), jnp.asarray(qb, fp8.E4M3),
                jnp.asarray(sb))
    qa, sa = fp8.quantize_blocks(jnp.asarray(rng.standard_normal((m, k)), jnp.float32), (1, 128))
    qb, sb = fp8.quantize_blocks(jnp.asarray(rng.standard_normal((k, n)), jnp.float32),
                                 (128, 128))
    return qa, sa, qb, sb


def _exact(qa, sa, qb, sb_cols):
    """float64 ``sum_c (qa_c @ qb_c) * sa_c * sb_c`` and the float32 error bound of
    computing it in any order: ``(K + 3) * u * sum_c |qa_c| @ |qb_c| * |sa_c| * |sb_c|``."""
    qa, qb = np.asarray(qa, np.float64), np.asarray(qb, np.float64)
    sa, sb = np.asarray(sa, np.float64), np.asarray(sb_cols, np.float64)
    k = qa.shape[1]
    total = np.zeros((qa.shape[0], qb.shape[1]))
    mag = np.zeros_like(total)
    for c in range(-(-k // 128)):
        s = slice(c * 128, (c + 1) * 128)
        total += (qa[:, s] @ qb[s]) * sa[:, c:c + 1] * sb[c]
        mag += (np.abs(qa[:, s]) @ np.abs(qb[s])) * np.abs(sa[:, c:c + 1]) * np.abs(sb[c])
    return total, (k + 3) * U32 * mag


def _kernel(qa, sa, qb, sb_cols, out_dtype=jnp.float32):
    return fp8_kernel.scaled_mm(qa, sa.T, qb.T, sb_cols, out_dtype,
                                interpret=fp8_kernel._interpret_params())


def test_recipe_kernel_key():
    assert fp8.Recipe.blockwise().kernel == "auto"
    for text in ("blockwise/xla", "blockwise/pallas", "blockwise/2/xla"):
        assert str(fp8.Recipe.parse(text)) == text
    assert fp8.Recipe.parse("blockwise/auto") == fp8.Recipe.blockwise()
    with pytest.raises(ValueError, match="kernel='cuda'; allowed: auto, pallas, xla"):
        fp8.Recipe.blockwise("cuda")
    with pytest.raises(ValueError, match="only for the blockwise recipe"):
        fp8.Recipe("rowwise", kernel="pallas")
    with pytest.raises(ValueError, match="bad FP8 recipe"):
        fp8.Recipe.parse("rowwise/xla")


def test_kernel_bitwise_when_every_sum_is_exact():
    """Integer operands, power-of-two scales: no rounding anywhere, so the kernel, the XLA
    reference and NumPy's float64 agree bit for bit (2 x 2 output tiles, 2 K steps)."""
    qa, sa, qb, sb = _operands(np.random.default_rng(0), 256, 256, 256, integer=True)
    sbc = _cols(sb, 256)
    exact, _ = _exact(qa, sa, qb, sbc)
    out = np.asarray(_kernel(qa, sa, qb, sbc))
    ref = np.asarray(_scaled_mm(qa, sa, qb, sbc))
    np.testing.assert_array_equal(out, exact.astype(np.float32))
    np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("m,k,n", [(256, 256, 256), (130, 200, 100)])
def test_kernel_within_float32_rounding(m, k, n):
    """Random E4M3 tiles: kernel and reference both within the float32 bound of the exact
    sum (the order of the 128-deep dot differs, so bits may too); ragged shapes are
    zero-padded to 128-tiles and cropped."""
    qa, sa, qb, sb = _operands(np.random.default_rng(1), m, k, n)
    sbc = _cols(sb, n)
    exact, bound = _exact(qa, sa, qb, sbc)
    out = np.asarray(_kernel(qa, sa, qb, sbc))
    ref = np.asarray(_scaled_mm(qa, sa, qb, sbc))
    assert out.shape == (m, n)
    assert np.all(np.abs(out - exact) <= bound)
    assert np.all(np.abs(ref - exact) <= bound)
    bf = np.asarray(_kernel(qa, sa, qb, sbc, jnp.bfloat16))  # one rounding of the f32 total
    np.testing.assert_array_equal(bf, out.astype(jnp.bfloat16))


def _bits(a):
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _hard_tiles(rng, dtype):
    """256 x 256 in ``dtype``: normal values spanning 2**-20..2**20 per tile, one tile with
    a +inf, a -inf and a NaN, one all-zero tile with a -0.0, subnormals."""
    x = rng.standard_normal((256, 256)) * 2.0 ** rng.integers(-20, 21, (256, 1))
    x[:128, 128:] = 0.0
    x[5, 130] = -0.0
    x[130, 3], x[131, 7], x[200, 9] = np.inf, -np.inf, np.nan
    x[140, 140:150] = 1e-40  # float32 subnormals (bfloat16 keeps some too)
    x[141, 140:150] = -3e-39
    return jnp.asarray(x, dtype)


@pytest.mark.parametrize("dtype,fmt", [(jnp.bfloat16, fp8.E5M2), (jnp.float32, fp8.E4M3)])
def test_quantize_both_equals_the_xla_tiles_bitwise(dtype, fmt):
    """One read of x gives the 1x128 tiles (q, scales) and the transposed 128x1 tiles of
    quant._q_tiles(x) and quant._q_tiles(x.T), bit for bit (interpreted), with inf, NaN,
    signed zeros and subnormals in some tiles."""
    x = _hard_tiles(np.random.default_rng(3), dtype)
    q, s_t, qt, st = fp8_kernel.quantize_both(x, fmt, interpret=fp8_kernel._interpret_params())
    rq, rs = _q_tiles(x, fmt)
    tq, ts = _q_tiles(x.T, fmt)
    for got, want in ((q, rq), (s_t, rs.T), (qt, tq), (st, ts.T)):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(_bits(got), _bits(want))
    q1, s1_t, none_q, none_s = fp8_kernel.quantize_both(
        x, fmt, cols=False, interpret=fp8_kernel._interpret_params())  # 1x128 tiles alone
    assert none_q is None and none_s is None
    for got, want in ((q1, rq), (s1_t, rs.T)):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(_bits(got), _bits(want))


def test_quantize_both_dequantizes_the_saved_tiles_first():
    """With the saved activation's 1x128 scales, the kernel re-tiles it along M for dw:
    the bits of _q_tiles(_dequantize_tiles(qx, sx).T), and no 1x128 copy."""
    x = _hard_tiles(np.random.default_rng(4), jnp.bfloat16)
    qx, sx = _q_tiles(x, fp8.E4M3)
    q, s_t, qt, st = fp8_kernel.quantize_both(qx, fp8.E4M3, row_scales_t=sx.T, rows=False,
                                              interpret=fp8_kernel._interpret_params())
    tq, ts = _q_tiles(_dequantize_tiles(qx, sx).T, fp8.E4M3)
    assert q is None and s_t is None
    np.testing.assert_array_equal(_bits(qt), _bits(tq))
    np.testing.assert_array_equal(_bits(st), _bits(ts.T))
    with pytest.raises(ValueError, match="multiples of 128"):
        fp8_kernel.quantize_both(x[:130], fp8.E4M3)
    with pytest.raises(ValueError, match="rows=True or cols=True"):
        fp8_kernel.quantize_both(x, fp8.E4M3, rows=False, cols=False)


def test_dot_pallas_matches_xla_values_and_gradients():
    """fp8.dot under blockwise(kernel="pallas") (interpreted: three kernel calls, forward,
    dx and dw) against blockwise(kernel="xla"): value, dx and dw within float32 rounding
    of each other (same quantization, same slices; only the 128-deep dot order differs)."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((128, 256)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((256, 128)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((128, 128)), jnp.float32)

    def run(kernel):
        y, vjp = jax.vjp(lambda a, b: fp8.dot(a, b, fp8.Recipe.blockwise(kernel)), x, w)
        return (y,) + vjp(g)

    for got, want in zip(run("pallas"), run("xla")):
        got, want = np.asarray(got), np.asarray(want)
        tol = 300 * U32 * np.max(np.abs(want))  # K <= 256 products, a few scalings
        assert np.max(np.abs(got - want)) <= tol


# ----------------------------------------------------------------------------- deviceless


PROBLEM = gpu.plugin_problem()
needs_plugin = pytest.mark.skipif(PROBLEM is not None, reason=f"deviceless GPU compile: {PROBLEM}")


def h200_mesh():
    return gpu.target_mesh(gpu.get_target("H200"), 1)


def _kinds(text):
    """``(Mosaic GPU GEMMs, FP8 GEMMs, Mosaic GPU quantization kernels)`` of optimized GPU
    HLO (jaxmp.analysis.hlo: a Mosaic kernel with GEMM FLOPs is a GEMM)."""
    kernels = hlo.hlo_kernels(text)
    mosaic = [k for k in kernels if k.kind == "mosaic_gpu"]
    return (sum(1 for k in mosaic if k.flops), sum(1 for k in kernels if k.kind == "fp8_gemm"),
            sum(1 for k in mosaic if not k.flops))


def _compile(mesh, f, *shapes):
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    args = [jax.ShapeDtypeStruct(s, d, sharding=sh) for s, d in shapes]
    with gpu.full_optimizations(), jax.set_mesh(mesh):
        return jax.jit(f).lower(*args).compile()


def test_hopper_is_sm_9_only_and_newer_is_not():
    """The WGMMA kernel's target test: sm 9.x is Hopper; sm 10.0 (B200) is newer but has
    no WGMMA; a CPU is neither."""
    h200 = compile_target.Target("gpu", "NVIDIA H200", (9, 0))
    b200 = compile_target.Target("gpu", "NVIDIA B200", (10, 0))
    cpu = compile_target.Target("cpu", "cpu")
    assert [t.is_hopper() for t in (h200, b200, cpu)] == [True, False, False]
    assert [t.is_hopper_or_newer() for t in (h200, b200, cpu)] == [True, True, False]


@needs_plugin
def test_select_reads_the_target_from_the_mesh_or_compiling_for():
    """Under ``jax.set_mesh`` of an H200 topology mesh (no ``compiling_for``), the compile
    target is that deviceless sm 9.0 GPU (its kind's name gives the capability that an
    abstract device lacks) and ``auto`` picks the compiled kernel; ``compiling_for`` a CPU
    device inside it wins, and ``auto`` is the XLA reference, ``pallas`` the interpreter."""
    def pick(kernel):
        return fp8_kernel.select(kernel, lambda i: ("pallas", i), lambda: "xla")

    with jax.set_mesh(h200_mesh()):
        t = compile_target.current()
        assert (t.platform, t.device_kind, t.compute_capability, t.deviceless) == (
            "gpu", "NVIDIA H200", (9, 0), True)
        assert pick("auto") == ("pallas", None) and pick("xla") == "xla"
        with compile_target.compiling_for(jax.devices("cpu")[0]):
            assert pick("auto") == "xla"
            kind, params = pick("pallas")
            assert kind == "pallas" and params is not None
    assert compile_target.current().platform == jax.devices()[0].platform


def _train_matmul(recipe):
    def f(x, w, g):  # the output and both gradients for a cotangent g given as input
        y, vjp = jax.vjp(lambda a, b: fp8.dot(a, b, recipe), x, w)
        return y, vjp(g)
    return f


@needs_plugin
def test_h200_blockwise_is_three_kernels_and_per_tensor_recipes_one_gemm_each():
    """Compiled for one H200: forward + dx + dw of a blockwise fp8.dot are 3 Mosaic GPU
    GEMMs and no cuBLASLt FP8 GEMM under kernel auto, and the backward's operands come
    from 2 Mosaic GPU quantization kernels (kernel.quantize_both of g and of the saved
    activation); the XLA reference is one FP8 GEMM
    per 128 of the contraction (K/128 + K/128 + M/128 here); tensorwise and rowwise stay
    one FP8 GEMM per product."""
    mesh = h200_mesh()
    m, k, n = 256, 512, 256
    shapes = [((m, k), jnp.bfloat16), ((k, n), jnp.float32), ((m, n), jnp.bfloat16)]
    text = _compile(mesh, _train_matmul(fp8.Recipe.blockwise()), *shapes).as_text()
    assert _kinds(text) == (3, 0, 2)  # + quantize_both of g and of the saved x
    text = _compile(mesh, _train_matmul(fp8.Recipe.blockwise("xla")), *shapes).as_text()
    assert _kinds(text) == (0, k // 128 + n // 128 + m // 128, 0)
    for recipe in (fp8.Recipe.tensorwise(), fp8.Recipe.rowwise()):
        text = _compile(mesh, _train_matmul(recipe), *shapes).as_text()
        assert _kinds(text) == (0, 3, 0), recipe


@needs_plugin
@pytest.mark.xdist_group("gpu_dense_1b")
def test_dense_1b_blockwise_step_on_h200_is_three_kernels_per_matmul():
    """configs/dense_1b.py's train step compiled for one H200: under fp8_blockwise each of
    the 7 FP8 matmuls of the (scanned) layer body (q, k, v, o projections; SwiGLU gate,
    up, down) is 3 Mosaic GPU GEMMs (forward, dx, dw) and a Mosaic GPU quantization
    kernel of g (both tilings); the saved activation is re-tiled for dw by one more, once
    per distinct input (4: q, k and v read the same x, gate and up the same x; o's
    and down's: the kernel is lowered once per shape and XLA's CSE keeps one call of
    it per operand), and no FP8 GEMM is
    left (the XLA reference had one per 128 of K: 820); temporaries are no larger than
    mixed_bf16's;
    no cuBLAS/Triton GEMM of the layer body is left outside FP8 (what
    tests/test_gpu_target.py checks for the other recipes); the roofline bound
    (jaxmp.analysis.gpu.roofline of each compiled program's kernels)
    is below mixed_bf16's (issue 20's done-when; its target, 0.75x, is a benchmark)."""
    h200 = gpu.get_target("H200")
    result = {}
    for policy in ("mixed_bf16", "fp8_blockwise"):
        # mixed_bf16's compile is shared with tests/test_gpu_target.py (tests/_compiled.py).
        step = _compiled.compiled_step("dense_1b", (f"--config.precision.policy={policy}",))
        module = hlo.parse_module(step.hlo_text)
        bound = gpu.roofline(hlo.hlo_kernels(module), hlo.hlo_collectives(module), h200, 1)
        result[policy] = ((step.compiled.memory_analysis().temp_size_in_bytes, bound["bound_s"])
                          + _kinds(module))
        if policy == "fp8_blockwise":  # no GEMM of the layer body left outside FP8
            body = [k for k in hlo.hlo_kernels(module)
                    if "/while/body/" in k.op_name and k.kind in ("gemm", "fp8_gemm")]
            assert body == [], body
    (temp_bf16, bound_bf16), (temp_fp8, bound_fp8) = (result[p][:2] for p in result)
    assert result["fp8_blockwise"][2:] == (3 * 7, 0, 7 + 4), result
    assert temp_fp8 <= temp_bf16, result
    assert bound_fp8 < bound_bf16, result
