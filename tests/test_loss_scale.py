"""Tests of jaxmp.precision.loss_scale: cases LS-1..LS-5 and LS-9, parity with jmp, a Megatron model."""
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxmp
from jaxmp import DynamicLossScale, NoOpLossScale, StaticLossScale

REPO = pathlib.Path(__file__).resolve().parents[1]
F32_MAX = float(np.finfo(np.float32).max)
HYP = settings(max_examples=30, deadline=None)
SEQ_LEN = 200  # verdict sequences are padded to this length: one compilation for all

# Jitted once and reused: every field is a leaf, so new values never retrace.
adjust = jax.jit(lambda ls, finite: ls.adjust(finite))
TRUE, FALSE = jnp.array(True), jnp.array(False)


def f32(v) -> float:
    """Rounds a Python float to the nearest float32 (inf on overflow), as a Python float."""
    with np.errstate(over="ignore"):
        return float(np.float32(v))


def fields(ls):
    return {f: np.asarray(getattr(ls, f)) for f in ls._fields}


def assert_same_state(a, b):
    assert type(a) is type(b)
    fa, fb = fields(a), fields(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        assert fa[k].dtype == fb[k].dtype, k
        np.testing.assert_array_equal(fa[k], fb[k], err_msg=k)


def assert_dtypes(ls):
    for f in ("loss_scale", "growth_factor", "backoff_factor", "min_loss_scale", "max_loss_scale"):
        assert getattr(ls, f).dtype == jnp.float32 and getattr(ls, f).shape == (), f
    for f in ("counter", "hysteresis_counter", "growth_interval", "hysteresis"):
        assert getattr(ls, f).dtype == jnp.int32 and getattr(ls, f).shape == (), f


# ------------------------------------------------------------------------ LS-1


def test_ls1_scale_state_stays_float32_with_float16_grads():
    ls = DynamicLossScale(loss_scale=32768.0, growth_interval=3)
    grads16 = {"w": jnp.array([0.5, -1.0], jnp.float16), "b": jnp.array([2.0], jnp.float16)}
    for _ in range(2):
        ls = adjust(ls, jaxmp.all_finite(grads16))
    assert float(ls.loss_scale) == 32768.0  # not yet a full interval
    ls = adjust(ls, jaxmp.all_finite(grads16))
    assert ls.loss_scale.dtype == jnp.float32
    assert float(ls.loss_scale) == 65536.0 and np.isfinite(float(ls.loss_scale))
    assert int(ls.counter) == 0
    assert_dtypes(ls)
    # 65536 itself is inf in float16; the product 0.5 * 65536 = 32768 is not.
    with np.errstate(over="ignore"):
        assert np.isinf(np.float16(65536.0))
    scaled = ls.scale(grads16)
    assert scaled["w"].dtype == jnp.float16 and scaled["b"].dtype == jnp.float16
    # -1 * 65536 overflows float16: the overflow signal the next adjust reacts to.
    np.testing.assert_array_equal(np.asarray(scaled["w"], np.float32), [32768.0, -np.inf])
    loss16 = jnp.float16(0.75)
    assert ls.scale(loss16).dtype == jnp.float16
    assert float(ls.scale(loss16)) == 0.75 * 65536.0  # 49152, exact in float16
    bf = jnp.array([3.0], jnp.bfloat16)
    assert ls.scale(bf).dtype == jnp.bfloat16 and float(ls.scale(bf)[0]) == 3.0 * 65536.0
    # Unscaling returns float32 by default, the leaf dtype with dtype=None.
    assert ls.unscale(scaled)["b"].dtype == jnp.float32
    assert ls.unscale(scaled, dtype=None)["b"].dtype == jnp.float16
    assert float(ls.unscale(loss16)) == 0.75 / 65536.0


def test_scale_keeps_dtypes_and_skips_non_floats():
    tree = {"f32": jnp.array([1.5], jnp.float32), "f16": jnp.array([1.5], jnp.float16),
            "bf16": jnp.array([1.5], jnp.bfloat16), "i": jnp.array([3], jnp.int32),
            "b": jnp.array([True])}
    for ls in (StaticLossScale(4.0), DynamicLossScale(loss_scale=4.0), NoOpLossScale()):
        out = jax.jit(lambda t, ls=ls: ls.scale(t))(tree)
        factor = 1.0 if isinstance(ls, NoOpLossScale) else 4.0
        for k in ("f32", "f16", "bf16"):
            assert out[k].dtype == tree[k].dtype
            assert float(out[k][0]) == 1.5 * factor
        assert out["i"].dtype == jnp.int32 and int(out["i"][0]) == 3
        assert out["b"].dtype == jnp.bool_
        back = ls.unscale(out)
        for k in ("f32", "f16", "bf16"):
            assert back[k].dtype == jnp.float32 and float(back[k][0]) == 1.5
        assert back["i"].dtype == jnp.int32


# ------------------------------------------------------------------------ LS-2


def _ls2_state():
    return DynamicLossScale(loss_scale=1.0, min_loss_scale=2.0**-5)


def test_ls2_every_field_survives_flatten_and_jit():
    ls = _ls2_state()
    paths, treedef = jax.tree_util.tree_flatten_with_path(ls)
    names = {p[0].name for p, _ in paths}
    assert names == {"loss_scale", "counter", "hysteresis_counter", "growth_interval",
                     "growth_factor", "backoff_factor", "hysteresis", "min_loss_scale",
                     "max_loss_scale"}
    back = jax.tree.unflatten(treedef, [v for _, v in paths])
    assert_same_state(back, ls)
    assert float(back.min_loss_scale) == 2.0**-5 and back.min_loss_scale.dtype == jnp.float32
    through_jit = jax.jit(lambda x: x)(ls)
    assert_same_state(through_jit, ls)
    out = adjust(through_jit, FALSE)
    assert float(out.loss_scale) == 0.5 and out.loss_scale.dtype == jnp.float32
    out = adjust(out, FALSE)
    assert float(out.loss_scale) == 0.25


def test_ls2_orbax_restore_into_default_template(tmp_path):
    ls = _ls2_state()
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "ls", ls)
    ckptr.wait_until_finished()
    template = DynamicLossScale(loss_scale=1.0)  # default min_loss_scale = 1
    assert float(template.min_loss_scale) == 1.0
    restored = ckptr.restore(tmp_path / "ls", template)
    assert isinstance(restored, DynamicLossScale)
    assert float(restored.min_loss_scale) == 2.0**-5 and restored.min_loss_scale.dtype == jnp.float32
    assert_same_state(restored, ls)
    out = adjust(restored, FALSE)
    assert float(out.loss_scale) == 0.5


def test_fields_are_leaves_not_static():
    traces = []

    @jax.jit
    def step(ls, finite):
        traces.append(1)
        return ls.adjust(finite)

    a = step(DynamicLossScale(loss_scale=8.0, growth_interval=1, growth_factor=2.0), TRUE)
    b = step(DynamicLossScale(loss_scale=8.0, growth_interval=1, growth_factor=4.0,
                              max_loss_scale=1e4, hysteresis=3), TRUE)
    assert len(traces) == 1
    assert float(a.loss_scale) == 16.0 and float(b.loss_scale) == 32.0


# ------------------------------------------------------------------------ LS-3


def _ls3_grad(w, x16, ls, policy):
    """d/dw of sum_i x_i * w, the backward pass in float16 (true value 4 * 25000 = 1e5).

    ``x16`` is an argument, not a constant: XLA would fold a constant sum into one inf.
    """

    def loss_fn(w):
        y = policy.cast_to_compute(w) * x16              # float16 compute
        return ls.scale(jnp.sum(policy.cast_to_output(y)))  # float32 loss
    return jax.grad(loss_fn)(w)


@pytest.mark.parametrize("min_scale,expect_applied", [(2.0**-5, True), (1.0, False)])
def test_ls3_min_scale_below_one(min_scale, expect_applied):
    policy = jaxmp.get_policy("mixed_fp16")
    lr = np.float32(1e-5)
    x = jnp.full((4,), 25000.0, jnp.float16)

    @jax.jit
    def step(w, x, ls):
        scaled = _ls3_grad(w, x, ls, policy)
        grads = ls.unscale(scaled)
        finite = jaxmp.all_finite(grads)
        new_w = w - lr * grads
        return jaxmp.select_tree(finite, new_w, w), ls.adjust(finite), scaled, grads, finite

    # Independent reference: 25000 rounds to 24992 in float16; the float16 sum of four is 99968.
    x16 = float(np.float16(25000.0))
    true_grad = 4 * x16
    assert true_grad > float(np.finfo(np.float16).max) and abs(true_grad - 1e5) / 1e5 < 1e-3

    w0 = jnp.float32(1.0)
    ls = DynamicLossScale(loss_scale=1.0, min_loss_scale=min_scale)
    w, ls, scaled, _, finite = step(w0, x, ls)
    assert not bool(finite) and np.isinf(float(scaled))
    assert float(w) == 1.0
    if not expect_applied:
        # A hard floor of 1: the scale sticks at 1 and every step is skipped.
        for _ in range(3):
            w, ls, _, _, finite = step(w, x, ls)
            assert not bool(finite) and float(ls.loss_scale) == 1.0 and float(w) == 1.0
        return
    assert float(ls.loss_scale) == 0.5 and ls.loss_scale.dtype == jnp.float32
    w, ls, scaled, grads, finite = step(w, x, ls)
    assert bool(finite)
    assert scaled.dtype == jnp.float32  # master weight's gradient
    assert float(scaled) == 0.5 * true_grad  # 49984: the float16 gradient, finite
    assert float(grads) == true_grad and grads.dtype == jnp.float32
    np.testing.assert_allclose(float(grads), 1e5, rtol=1e-3)
    assert float(w) == float(np.float32(1.0) - lr * np.float32(true_grad))
    assert float(ls.loss_scale) == 0.5  # a finite step does not grow before the interval


# ------------------------------------------------------------------------ LS-4


def _deep_tree(last):
    return {"enc": [{"a": jnp.ones((2,)), "b": (jnp.zeros((1, 2)), jnp.arange(3))}],
            "z": {"y": {"x": [jnp.ones((3,), jnp.bfloat16), last]}}}


@pytest.mark.parametrize("tree", [
    {"a": jnp.array([1.0, 2.0]), "b": jnp.array([jnp.inf])},
    {"a": jnp.array([1.0, 2.0]), "b": jnp.array([jnp.nan])},
    {"a": jnp.array([1.0, 2.0]), "b": jnp.array([-jnp.inf])},
    {"a": jnp.array([1.0, 2.0]), "b": jnp.array([6e4], jnp.float16) * jnp.float16(2.0)},
    _deep_tree(jnp.array([1.0, 5.0, -jnp.inf], jnp.float16)),
    _deep_tree(jnp.array([jnp.nan], jnp.bfloat16)),
], ids=["inf", "nan", "-inf", "f16_overflow", "deep_-inf_last_leaf", "deep_nan_bf16"])
def test_ls4_non_finite_anywhere_skips(tree):
    leaves = jax.tree.leaves(tree)
    assert not np.all(np.isfinite(np.asarray(leaves[-1], np.float32)))  # the bad value is in the last leaf
    assert not bool(jaxmp.all_finite(tree))
    assert not bool(jax.jit(jaxmp.all_finite)(tree))
    params = jax.tree.map(lambda x: jnp.zeros_like(x) + 1, tree)

    @jax.jit
    def step(params, grads, ls):
        finite = jaxmp.all_finite(grads)
        new = jax.tree.map(lambda p, g: p - g, params, grads)
        return jaxmp.select_tree(finite, new, params), ls.adjust(finite)

    new_params, ls = step(params, tree, DynamicLossScale(loss_scale=8.0))
    for a, b in zip(jax.tree.leaves(new_params), jax.tree.leaves(params)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(ls.loss_scale) == 4.0


def test_all_finite_true_cases():
    assert bool(jaxmp.all_finite({"a": jnp.array([1.0, 2.0]), "b": jnp.array([3.0])}))
    assert bool(jaxmp.all_finite(_deep_tree(jnp.array([1.0], jnp.float16))))
    assert bool(jaxmp.all_finite({}))
    assert bool(jaxmp.all_finite({"i": jnp.array([2**31 - 1]), "flag": jnp.array([True])}))
    assert jaxmp.all_finite({"a": jnp.ones(2)}).dtype == jnp.bool_
    assert jaxmp.all_finite({"a": jnp.ones(2)}).shape == ()


@HYP
@given(st.lists(st.integers(1, 4), min_size=1, max_size=5),
       st.sampled_from([np.float32, np.float16]),
       st.data())
def test_all_finite_matches_numpy(sizes, dtype, data):
    leaves = [np.arange(n, dtype=dtype) for n in sizes]
    if data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(leaves) - 1))
        j = data.draw(st.integers(0, sizes[i] - 1))
        leaves[i][j] = data.draw(st.sampled_from([np.inf, -np.inf, np.nan]))
    tree = {"x": leaves[:2], "y": tuple(leaves[2:])}
    expected = all(np.isfinite(l).all() for l in leaves)
    assert bool(jaxmp.all_finite(jax.tree.map(jnp.asarray, tree))) == expected


# ------------------------------------------------------------------------ LS-5


@pytest.fixture(scope="module")
def mesh():
    devices = jax.devices()
    assert len(devices) == 8, "tests/conftest.py forces 8 host CPU devices"
    return Mesh(np.array(devices), ("data",))


def _ls5_grad(mesh):
    g = np.arange(16, dtype=np.float32) + 1  # shard k holds elements 2k, 2k+1
    g[:4] = [1.0, 2.0, np.nan, 3.0]          # shard 0 = [1, 2], shard 1 = [nan, 3]
    return jax.device_put(g, NamedSharding(mesh, P("data")))


def test_ls5_one_verdict_across_the_mesh(mesh):
    grad = _ls5_grad(mesh)
    shards = sorted(grad.addressable_shards, key=lambda s: s.index[0].start)
    np.testing.assert_array_equal(shards[0].data, [1.0, 2.0])
    np.testing.assert_array_equal(shards[1].data, [np.nan, 3.0])
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(np.array([0.5, -1.5], np.float32), replicated)
    ls = jax.device_put(DynamicLossScale(loss_scale=8.0), replicated)

    @jax.jit
    def step(params, grad, ls):
        grads = ls.unscale(grad)
        finite = jaxmp.all_finite(grads)
        new = params - 0.1 * grads.reshape(8, 2).sum(0)
        return jaxmp.select_tree(finite, new, params), ls.adjust(finite), finite

    new_params, new_ls, finite = step(params, grad, ls)
    assert not bool(finite)
    assert len(new_ls.loss_scale.addressable_shards) == 8
    for s in new_ls.loss_scale.addressable_shards:
        assert float(s.data) == 4.0 and s.data.dtype == np.float32
    for s in new_ls.counter.addressable_shards:
        assert int(s.data) == 0
    for s in finite.addressable_shards:
        assert not bool(s.data)
    ref = np.array([0.5, -1.5], np.float32).tobytes()
    assert len(new_params.addressable_shards) == 8
    for s in new_params.addressable_shards:
        assert np.asarray(s.data).tobytes() == ref  # bit-identical on every replica


def test_ls5_axis_name_inside_shard_map(mesh):
    grad = _ls5_grad(mesh)
    ls = DynamicLossScale(loss_scale=8.0)

    def per_device(g, ls, reduce):
        finite = jaxmp.all_finite(g, axis_name="data" if reduce else None)
        return finite[None], ls.adjust(finite).loss_scale[None]

    def run(reduce):
        f = jax.shard_map(lambda g, ls: per_device(g, ls, reduce), mesh=mesh,
                          in_specs=(P("data"), P()), out_specs=(P("data"), P("data")))
        return jax.jit(f)(grad, ls)

    # Without axis_name each device judges only its own shard: the verdicts disagree.
    local, local_scales = run(False)
    np.testing.assert_array_equal(local, [True, False] + [True] * 6)
    np.testing.assert_array_equal(local_scales, [8.0, 4.0] + [8.0] * 6)
    # With axis_name: one verdict, the same new scale on every device.
    verdicts, scales = run(True)
    np.testing.assert_array_equal(verdicts, [False] * 8)
    np.testing.assert_array_equal(scales, [4.0] * 8)
    assert scales.dtype == jnp.float32


# ------------------------------------------------------------------------ LS-9


_RESTORE_SCRIPT = textwrap.dedent("""
    import json, sys
    import orbax.checkpoint as ocp
    import numpy as np
    import jaxmp

    def forbidden(*args, **kwargs):
        raise AssertionError("restore must not adjust the loss scale")
    jaxmp.DynamicLossScale.adjust = forbidden
    template = jaxmp.DynamicLossScale()  # defaults: scale 256, interval 2000
    restored = ocp.StandardCheckpointer().restore(sys.argv[1], template)
    out = {f: [np.asarray(getattr(restored, f)).item(), str(np.asarray(getattr(restored, f)).dtype)]
           for f in restored._fields}
    out["type"] = type(restored).__name__
    print("RESULT" + json.dumps(out))
""")


def test_ls9_restore_in_fresh_process(tmp_path):
    ls = DynamicLossScale(loss_scale=1024.0, growth_interval=2)
    ls = adjust(ls, TRUE)  # one finite step: counter 1, scale unchanged
    assert float(ls.loss_scale) == 1024.0 and int(ls.counter) == 1
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "scaler", ls)
    ckptr.wait_until_finished()

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _RESTORE_SCRIPT, str(tmp_path / "scaler")],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")][-1]
    got = json.loads(line[len("RESULT"):])
    assert got["type"] == "DynamicLossScale"
    assert got["loss_scale"] == [1024.0, "float32"]
    assert got["counter"] == [1, "int32"]
    # Nothing else moved either.
    assert got["growth_interval"] == [2, "int32"]
    assert got["hysteresis_counter"] == [1, "int32"]
    assert got["min_loss_scale"] == [1.0, "float32"]
    assert got["growth_factor"] == [2.0, "float32"]
    assert got["backoff_factor"] == [0.5, "float32"]
    assert got["max_loss_scale"] == [F32_MAX, "float32"]

    # Continuing from the restored state: the second finite step completes the interval.
    restored = ckptr.restore(tmp_path / "scaler", DynamicLossScale())
    assert_same_state(restored, ls)
    nxt = adjust(restored, TRUE)
    assert float(nxt.loss_scale) == 2048.0 and int(nxt.counter) == 0


# ------------------------------------------------------------------------ pytrees, types


@pytest.mark.parametrize("ls", [NoOpLossScale(), StaticLossScale(128.0),
                                DynamicLossScale(loss_scale=2.0**15, growth_interval=7, hysteresis=2,
                                                 min_loss_scale=0.25, max_loss_scale=2.0**20)],
                         ids=["noop", "static", "dynamic"])
def test_pytree_and_jit_round_trips(ls):
    leaves, treedef = jax.tree.flatten(ls)
    back = jax.tree.unflatten(treedef, leaves)
    assert_same_state(back, ls)
    assert_same_state(jax.jit(lambda x: x)(ls), ls)
    for verdict in (TRUE, FALSE):
        eager = ls.adjust(verdict)
        jitted = adjust(ls, verdict)
        assert type(eager) is type(ls) and type(jitted) is type(ls)
        assert_same_state(eager, jitted)
    assert ls.loss_scale.dtype == jnp.float32 and ls.loss_scale.shape == ()
    with pytest.raises(AttributeError):
        ls.loss_scale = 3.0


def test_static_and_noop_never_move():
    s = StaticLossScale(128.0)
    for v in (TRUE, FALSE, FALSE):
        s = adjust(s, v)
    assert float(s.loss_scale) == 128.0 and s.loss_scale.dtype == jnp.float32
    assert float(NoOpLossScale().adjust(FALSE).loss_scale) == 1.0


def test_dtypes_after_many_adjusts():
    rng = np.random.default_rng(0)
    ls = DynamicLossScale(loss_scale=2.0**10, growth_interval=2, hysteresis=2, min_loss_scale=2.0**-3)
    for v in rng.random(60) < 0.7:
        ls = adjust(ls, jnp.asarray(v))
        assert_dtypes(ls)
        assert isinstance(ls, DynamicLossScale)


def test_adjust_rejects_non_scalar_verdict():
    ls = DynamicLossScale()
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        ls.adjust(jnp.array([True, False]))


def test_growth_never_overflows():
    # Product past float32 max: the scale stays (jmp), never inf.
    ls = DynamicLossScale(loss_scale=2.0**127, growth_interval=1)
    for _ in range(3):
        ls = adjust(ls, TRUE)
        assert float(ls.loss_scale) == 2.0**127
    # Exactly reaching float32 max is allowed; one more growth keeps it.
    ls = DynamicLossScale(loss_scale=F32_MAX / 2, growth_interval=1)
    ls = adjust(ls, TRUE)
    assert float(ls.loss_scale) == F32_MAX
    ls = adjust(ls, TRUE)
    assert float(ls.loss_scale) == F32_MAX and np.isfinite(float(ls.loss_scale))
    # A huge growth factor overflows in one step.
    ls = adjust(DynamicLossScale(loss_scale=1e10, growth_interval=1, growth_factor=1e30), TRUE)
    assert float(ls.loss_scale) == f32(1e10)
    # max_loss_scale clamps.
    ls = DynamicLossScale(loss_scale=2.0**100, growth_interval=1, max_loss_scale=3 * 2.0**100)
    ls = adjust(ls, TRUE)
    assert float(ls.loss_scale) == 2.0**101
    ls = adjust(ls, TRUE)
    assert float(ls.loss_scale) == f32(3 * 2.0**100)
    ls = adjust(DynamicLossScale(loss_scale=6.0, growth_interval=1, max_loss_scale=10.0), TRUE)
    assert float(ls.loss_scale) == 10.0


def test_backoff_never_below_min():
    ls = DynamicLossScale(loss_scale=1.0, min_loss_scale=0.3)
    expected = [0.5, f32(0.3), f32(0.3)]
    for e in expected:
        ls = adjust(ls, FALSE)
        assert float(ls.loss_scale) == e
    ls = DynamicLossScale(loss_scale=2.0**-3, min_loss_scale=2.0**-5)
    for e in (2.0**-4, 2.0**-5, 2.0**-5):
        ls = adjust(ls, FALSE)
        assert float(ls.loss_scale) == e


def test_hysteresis_megatron_by_hand():
    ls = DynamicLossScale(loss_scale=64.0, growth_interval=2, hysteresis=2)
    # Two overflows to back off once; afterwards every overflow backs off until a growth.
    trace = [(FALSE, 64.0, 1), (FALSE, 32.0, 0), (FALSE, 16.0, 0), (TRUE, 16.0, 0),
             (TRUE, 32.0, 2), (FALSE, 32.0, 1), (TRUE, 32.0, 1), (FALSE, 16.0, 0)]
    for verdict, scale, hyst in trace:
        ls = adjust(ls, verdict)
        assert (float(ls.loss_scale), int(ls.hysteresis_counter)) == (scale, hyst)


@pytest.mark.parametrize("kwargs,token", [
    (dict(loss_scale=0.0), "loss_scale"),
    (dict(loss_scale=float("inf")), "loss_scale"),
    (dict(loss_scale=float("nan")), "loss_scale"),
    (dict(loss_scale=0.5), "min_loss_scale"),          # below the default min of 1
    (dict(loss_scale=2.0**20, max_loss_scale=2.0**16), "max_loss_scale"),
    (dict(min_loss_scale=0.0), "min_loss_scale"),
    (dict(max_loss_scale=1e39), "max_loss_scale"),
    (dict(growth_interval=0), "growth_interval"),
    (dict(growth_interval=2.5), "growth_interval"),
    (dict(growth_interval=float("inf")), "growth_interval"),
    (dict(growth_factor=0.5), "growth_factor"),
    (dict(growth_factor=1e39), "growth_factor"),
    (dict(backoff_factor=0.0), "backoff_factor"),
    (dict(backoff_factor=2.0), "backoff_factor"),
    (dict(hysteresis=0), "hysteresis"),
    (dict(counter=-1), "counter"),
    (dict(hysteresis=2, hysteresis_counter=3), "hysteresis_counter"),
])
def test_dynamic_validation(kwargs, token):
    with pytest.raises(ValueError) as e:
        DynamicLossScale(**kwargs)
    assert token in str(e.value)


def test_dynamic_is_keyword_only():
    with pytest.raises(TypeError):
        DynamicLossScale(1024.0)


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan")])
def test_static_validation(value):
    with pytest.raises(ValueError, match="loss_scale"):
        StaticLossScale(value)


# ------------------------------------------------------------------------ select_tree


def test_select_tree_selects_bitwise():
    old = {"w": jnp.array([1.0, -0.0], jnp.float32), "n": jnp.array(3, jnp.int32)}
    new = {"w": jnp.array([jnp.nan, jnp.inf], jnp.float32), "n": jnp.array(4, jnp.int32)}
    kept = jax.jit(jaxmp.select_tree)(FALSE, new, old)
    assert np.asarray(kept["w"]).tobytes() == np.asarray(old["w"]).tobytes()  # -0.0 stays -0.0
    assert int(kept["n"]) == 3
    taken = jaxmp.select_tree(TRUE, new, old)
    assert np.isnan(float(taken["w"][0])) and int(taken["n"]) == 4


@pytest.mark.parametrize("pred,a,b,msg", [
    (jnp.array([True]), {"w": jnp.ones(2)}, {"w": jnp.ones(2)}, "scalar"),
    (TRUE, {"w": jnp.ones(2)}, {"v": jnp.ones(2)}, "structure"),
    (TRUE, {"w": jnp.ones(2)}, {"w": jnp.ones(3)}, "differ"),
    (TRUE, {"w": jnp.ones(2)}, {"w": jnp.ones(2, jnp.float16)}, "differ"),
])
def test_select_tree_errors(pred, a, b, msg):
    with pytest.raises(ValueError, match=msg):
        jaxmp.select_tree(pred, a, b)


# ------------------------------------------------------------------------ get_loss_scale


def test_get_loss_scale_grammar():
    assert isinstance(jaxmp.get_loss_scale("none"), NoOpLossScale)
    s = jaxmp.get_loss_scale("static:1024")
    assert isinstance(s, StaticLossScale) and float(s.loss_scale) == 1024.0
    assert float(jaxmp.get_loss_scale(" Static : 2**15 ").loss_scale) == 32768.0
    d = jaxmp.get_loss_scale("dynamic")
    assert_same_state(d, DynamicLossScale())
    d = jaxmp.get_loss_scale("dynamic:init=256,growth_interval=500")
    assert float(d.loss_scale) == 256.0 and int(d.growth_interval) == 500
    d = jaxmp.get_loss_scale("dynamic: init = 2**10, growth_factor=4, backoff_factor=0.25, "
                             "hysteresis=2, min=2**-5, max=2**24")
    assert_same_state(d, DynamicLossScale(loss_scale=1024.0, growth_factor=4.0, backoff_factor=0.25,
                                          hysteresis=2, min_loss_scale=1 / 32, max_loss_scale=2.0**24))
    d = jaxmp.get_loss_scale("dynamic:loss_scale=8,min_loss_scale=0.5,max_loss_scale=64")
    assert (float(d.loss_scale), float(d.min_loss_scale), float(d.max_loss_scale)) == (8.0, 0.5, 64.0)
    assert int(jaxmp.get_loss_scale("dynamic:growth_interval=1e3").growth_interval) == 1000
    same = DynamicLossScale(loss_scale=4.0)
    assert jaxmp.get_loss_scale(same) is same


@pytest.mark.parametrize("spec,tokens", [
    ("dymanic", ["'dymanic'", "static", "dynamic"]),
    ("dynamic:foo=1", ["'foo'", "growth_interval", "hysteresis"]),
    ("dynamic:init=abc", ["'abc'", "not a number"]),
    ("dynamic:init", ["'init'", "init=VALUE"]),
    ("dynamic:init=2,loss_scale=4", ["'loss_scale'", "twice"]),
    ("dynamic:growth_interval=2.5", ["growth_interval", "'2.5'", "integer"]),
    ("dynamic:hysteresis=inf", ["hysteresis", "integer"]),
    ("dynamic:min=2,init=1", ["loss_scale=1.0", "min_loss_scale=2.0"]),
    ("static:", ["static:1024"]),
    ("static:big", ["'big'"]),
    ("static:-4", ["loss_scale"]),
    ("none:3", ["'none:3'"]),
])
def test_get_loss_scale_errors(spec, tokens):
    with pytest.raises(ValueError) as e:
        jaxmp.get_loss_scale(spec)
    for t in tokens:
        assert t in str(e.value), (t, str(e.value))


# ------------------------------------------------------------------------ sequences


def _pad(seq):
    return jnp.asarray(list(seq) + [True] * (SEQ_LEN - len(seq)), jnp.bool_)


@jax.jit
def _run_ours(ls, verdicts):
    def body(ls, v):
        ls = ls.adjust(v)
        return ls, (ls.loss_scale, ls.counter, ls.hysteresis_counter)
    return jax.lax.scan(body, ls, verdicts)[1]


@jax.jit
def _run_jmp(ls, verdicts):
    def body(ls, v):
        ls = ls.adjust(v)
        return ls, (ls.loss_scale, ls.counter)
    return jax.lax.scan(body, ls, verdicts)[1]


@st.composite
def verdict_sequences(draw):
    # Mostly-finite runs are needed for growth to happen at all.
    p_finite = draw(st.sampled_from([2, 5, 9, 10]))
    return draw(st.lists(st.integers(0, 9).map(lambda i: i < p_finite), max_size=SEQ_LEN))


@HYP
@given(verdict_sequences(),
       st.sampled_from([1.0, 3.0, 1000.0, 2.0**15, 2.0**100, 2.0**126]),
       st.sampled_from([1, 2, 3, 7]),
       st.sampled_from([2, 4]))
def test_parity_with_jmp(seq, init, period, factor):
    ours = DynamicLossScale(loss_scale=init, growth_interval=period, growth_factor=float(factor),
                            backoff_factor=1.0 / factor, hysteresis=1, min_loss_scale=1.0)
    ref = jmp.DynamicLossScale(loss_scale=jnp.float32(init), period=period, factor=factor)
    v = _pad(seq)
    scales, counters, _ = _run_ours(ours, v)
    ref_scales, ref_counters = _run_jmp(ref, v)
    n = len(seq)
    np.testing.assert_array_equal(np.asarray(scales)[:n], np.asarray(ref_scales, np.float32)[:n])
    np.testing.assert_array_equal(np.asarray(counters)[:n], np.asarray(ref_counters)[:n])


@HYP
@given(verdict_sequences(),
       st.sampled_from([1.0, 3.0, 2.0**15, 2.0**126]),
       st.integers(0, 6),
       st.sampled_from([1, 2, 7]),
       st.sampled_from([2, 4]),
       st.sampled_from([1.0, 2.0**-5]))
def test_a_converted_jmp_scale_behaves_as_jmp_itself(seq, init, counter, period, factor, lo):
    """as_loss_scale(jmp.DynamicLossScale) keeps every field (counter, period, factor and
    min included) and then adjusts exactly as jmp does, verdict by verdict."""
    counter = counter % period
    ref = jmp.DynamicLossScale(loss_scale=jnp.float32(init), counter=jnp.int32(counter),
                               period=period, factor=factor, min_loss_scale=jnp.float32(lo))
    ours = jaxmp.as_loss_scale(ref)  # outside jit: jmp's own pytree would drop min_loss_scale
    assert isinstance(ours, DynamicLossScale)
    assert (float(ours.loss_scale), int(ours.counter), int(ours.growth_interval)) == (init, counter, period)
    assert (float(ours.growth_factor), float(ours.backoff_factor), float(ours.min_loss_scale)) == (
        factor, 1.0 / factor, lo)
    assert int(ours.hysteresis) == 1 and ours.loss_scale.dtype == jnp.float32
    v = _pad(seq)
    scales, counters, _ = _run_ours(ours, v)
    ref_scales, ref_counters = [], []
    for verdict in v[:len(seq)]:  # jmp's adjust, eagerly: its min_loss_scale stays
        ref = ref.adjust(verdict)
        ref_scales.append(float(ref.loss_scale))
        ref_counters.append(int(ref.counter))
    n = len(seq)
    np.testing.assert_array_equal(np.asarray(scales)[:n], np.asarray(ref_scales, np.float32))
    np.testing.assert_array_equal(np.asarray(counters)[:n], np.asarray(ref_counters))


def test_jmp_static_and_noop_scales_convert_and_are_taken_wherever_a_scale_is():
    static = jaxmp.as_loss_scale(jmp.StaticLossScale(jnp.float16(1024.0)))
    assert isinstance(static, StaticLossScale) and static.loss_scale.dtype == jnp.float32
    assert float(static.loss_scale) == 1024.0
    assert isinstance(jaxmp.as_loss_scale(jmp.NoOpLossScale()), NoOpLossScale)
    assert isinstance(jaxmp.get_loss_scale(jmp.DynamicLossScale(jnp.float32(8.0))), DynamicLossScale)
    # The optimizer step takes jmp's scale and hands back the jaxmp equivalent, adjusted.
    import optax
    params = {"w": jnp.ones((2,), jnp.float32)}
    opt = optax.sgd(0.5)
    out = jaxmp.optim.apply_gradients(opt, {"w": jnp.array([8.0, jnp.inf])}, opt.init(params), params,
                                      jmp.DynamicLossScale(jnp.float32(8.0), period=3, factor=2))
    assert isinstance(out.loss_scale, DynamicLossScale) and float(out.loss_scale.loss_scale) == 4.0
    np.testing.assert_array_equal(out.params["w"], [1.0, 1.0])  # skipped: the inf gradient
    with pytest.raises(ValueError, match="must be a loss scale: jaxmp's NoOpLossScale.*got builtins.float"):
        jaxmp.as_loss_scale(2.0)
    with pytest.raises(ValueError, match="loss_scale=0.0 is not allowed"):  # jmp allows 0; jaxmp refuses
        jaxmp.as_loss_scale(jmp.DynamicLossScale(jnp.float32(0.0)))


def _megatron_reference(seq, scale, counter, hyst_left, interval, growth, backoff, hysteresis, lo, hi):
    """Megatron-LM DynamicGradScaler.update in plain floats, plus min/max bounds.

    Products of two float32 values are exact in float64, so rounding them once with f32()
    gives the float32 product; an overflowing growth keeps the scale (as jmp does).
    """
    out = []
    for finite in seq:
        if finite:
            counter += 1
            if counter == interval:
                counter, hyst_left = 0, hysteresis
                grown = f32(scale * growth)
                if grown != float("inf"):
                    scale = min(grown, hi)
        else:
            counter = 0
            hyst_left -= 1
            if hyst_left <= 0:
                scale = max(f32(scale * backoff), lo)
        out.append((scale, counter, max(hyst_left, 0)))
    return out


@st.composite
def megatron_configs(draw):
    lo = f32(draw(st.sampled_from([2.0**-5, 0.3, 1.0, 7.0])))
    hi = f32(draw(st.sampled_from([8.0, 1000.0, 2.0**20, F32_MAX])))
    hi = max(hi, lo)
    scale = f32(draw(st.sampled_from([lo, hi, 1.0, 3.0, 1024.0, 2.0**15])))
    scale = min(max(scale, lo), hi)
    interval = draw(st.integers(1, 6))
    hysteresis = draw(st.integers(1, 3))
    return dict(scale=scale, lo=lo, hi=hi, interval=interval, hysteresis=hysteresis,
                counter=draw(st.integers(0, interval - 1)),
                hyst_left=draw(st.integers(0, hysteresis)),
                growth=f32(draw(st.sampled_from([1.0, 2.0, 3.0, 4.0]))),
                backoff=f32(draw(st.sampled_from([0.5, 0.25, 1 / 3, 1.0]))))


@HYP
@given(verdict_sequences(), megatron_configs())
def test_matches_megatron_reference(seq, cfg):
    ours = DynamicLossScale(loss_scale=cfg["scale"], growth_interval=cfg["interval"],
                            growth_factor=cfg["growth"], backoff_factor=cfg["backoff"],
                            hysteresis=cfg["hysteresis"], min_loss_scale=cfg["lo"],
                            max_loss_scale=cfg["hi"], counter=cfg["counter"],
                            hysteresis_counter=cfg["hyst_left"])
    scales, counters, hysts = (np.asarray(a) for a in _run_ours(ours, _pad(seq)))
    ref = _megatron_reference(seq, cfg["scale"], cfg["counter"], cfg["hyst_left"], cfg["interval"],
                              cfg["growth"], cfg["backoff"], cfg["hysteresis"], cfg["lo"], cfg["hi"])
    for i, (s, c, h) in enumerate(ref):
        assert (float(scales[i]), int(counters[i]), int(hysts[i])) == (s, c, h), (i, seq[:i + 1])
        assert cfg["lo"] <= float(scales[i]) <= cfg["hi"]


@pytest.mark.parametrize("spec", ["dynamic:init=2**2000", "dynamic:init=2**-2000", "static:1e39"])
def test_loss_scale_values_outside_float32_are_rejected_by_name(spec):
    token = spec.split("=")[-1] if "=" in spec else spec.split(":")[1]
    with pytest.raises(ValueError, match=re.escape(token)):
        jaxmp.get_loss_scale(spec)


def test_static_loss_scale_must_be_a_scalar():
    with pytest.raises(ValueError, match=r"scalar.*\(2,\)"):
        StaticLossScale(np.array([1.0, 2.0]))


def test_all_finite_sees_python_float_leaves():
    assert not bool(jaxmp.all_finite({"a": float("nan"), "b": jnp.ones(2)}))
    assert bool(jaxmp.all_finite({"a": 1.5, "b": jnp.ones(2)}))
