"""Tests of jaxmp.optim: Adam with per-moment dtypes, skip-safe steps, accumulation.

Cases LS-6, LS-7, LS-8 and MW-1 of shared/cases/mixed-precision-faults.md. Every
expected value comes from a NumPy reference (float64 Adam, float32 SGD loop) or hand
arithmetic, never from the code under test.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxmp
from jaxmp import optim
from jaxmp.precision.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from jaxmp.precision.policy import canonical_dtype

F32 = jnp.float32
BF16 = jnp.bfloat16


# ----------------------------------------------------------------------------- helpers

def bits(x):
    """The raw bits of an array, for bitwise comparisons (NaN-safe, -0 != +0)."""
    a = np.asarray(x)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def assert_bitwise_equal(tree_a, tree_b):
    la, lb = jax.tree.leaves(tree_a), jax.tree.leaves(tree_b)
    assert jax.tree.structure(tree_a) == jax.tree.structure(tree_b)
    for a, b in zip(la, lb):
        assert np.asarray(a).dtype == np.asarray(b).dtype
        assert np.array_equal(bits(a), bits(b))


def adam_directions(grads, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0):
    """NumPy float64 Adam (Kingma & Ba 2015, Algorithm 1): direction and moments per step."""
    m = v = np.zeros_like(np.asarray(grads[0], np.float64))
    out = []
    for t, g in enumerate(grads, start=1):
        g = np.asarray(g, np.float64)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        out.append((m / (1 - b1 ** t) / (np.sqrt(v / (1 - b2 ** t) + eps_root) + eps), m, v))
    return out


def adamw_reference(w, grads, lr, weight_decay, **kw):
    """NumPy float64 AdamW with decoupled decay; ``lr`` is a number or ``step -> lr``."""
    lr_fn = lr if callable(lr) else (lambda _: lr)
    w = np.asarray(w, np.float64)
    for step, (d, _, _) in enumerate(adam_directions(grads, **kw)):
        w = w - lr_fn(step) * (d + weight_decay * w)
    return w


def jit_step(optimizer):
    return jax.jit(functools.partial(optim.apply_gradients, optimizer))


def adam_state(opt_state):
    """The ScaleByAdamState inside an adamw chain state."""
    (state,) = [s for s in opt_state if isinstance(s, optim.ScaleByAdamState)]
    return state


# ----------------------------------------------------------------------------- scale_by_adam

@pytest.mark.parametrize("mu_dtype,nu_dtype,rtol", [
    (None, None, 1e-5),
    ("bf16", "bf16", 3e-2),   # DeepSeek-V3 section 3.3.3: both moments in bfloat16
    ("bfloat16", None, 3e-2),
    (None, "bf16", 3e-2),
])
def test_scale_by_adam_matches_float64_reference(mu_dtype, nu_dtype, rtol):
    rng = np.random.default_rng(0)
    params = {"a": jnp.zeros((3, 4), F32), "b": jnp.zeros((5,), F32)}
    grads = [jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params)
             for _ in range(4)]
    opt = optim.scale_by_adam(mu_dtype=mu_dtype, nu_dtype=nu_dtype)
    state = opt.init(params)
    update = jax.jit(opt.update)
    for step, g in enumerate(grads):
        u, state = update(jax.tree.map(jnp.asarray, g), state)
        assert int(state.count) == step + 1 and state.count.dtype == jnp.int32
    for key in params:
        d, m, v = adam_directions([g[key] for g in grads])[-1]
        np.testing.assert_allclose(np.asarray(u[key]), d, rtol=rtol, atol=1e-6)
        np.testing.assert_allclose(np.asarray(state.mu[key], np.float64), m, rtol=rtol, atol=1e-7)
        np.testing.assert_allclose(np.asarray(state.nu[key], np.float64), v, rtol=rtol, atol=1e-9)
        assert state.mu[key].dtype == canonical_dtype(mu_dtype or "f32")
        assert state.nu[key].dtype == canonical_dtype(nu_dtype or "f32")
        assert u[key].dtype == F32


@pytest.mark.parametrize("eps_root", [0.0, 1e-8])
def test_scale_by_adam_matches_optax_in_float32(eps_root):
    rng = np.random.default_rng(1)
    params = {"a": jnp.zeros((3, 4), F32), "b": jnp.zeros((2,), F32)}
    ours, theirs = optim.scale_by_adam(eps_root=eps_root), optax.scale_by_adam(eps_root=eps_root)
    s1, s2 = ours.init(params), theirs.init(params)
    for _ in range(3):
        g = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape) * 10.0 ** rng.integers(-3, 3), F32),
                         params)
        # Both jitted, as in a train step; eagerly, float32 pow rounds differently per op.
        u1, s1 = jax.jit(ours.update)(g, s1)
        u2, s2 = jax.jit(theirs.update)(g, s2)
        for a, b in zip(jax.tree.leaves((u1, s1.mu, s1.nu)), jax.tree.leaves((u2, s2.mu, s2.nu))):
            ulps = np.abs(bits(a).astype(np.int64) - bits(b).astype(np.int64))
            assert ulps.max() <= 1
        assert int(s1.count) == int(s2.count)


def test_scale_by_adam_moment_dtype_defaults_to_param_dtype():
    params = {"w": jnp.ones((2,), BF16), "v": jnp.ones((2,), F32)}
    state = optim.scale_by_adam().init(params)
    assert state.mu["w"].dtype == BF16 and state.nu["w"].dtype == BF16
    assert state.mu["v"].dtype == F32 and state.nu["v"].dtype == F32
    mixed = optim.scale_by_adam(mu_dtype="bf16", nu_dtype="f32").init(params)
    assert mixed.mu["v"].dtype == BF16 and mixed.nu["w"].dtype == F32


@pytest.mark.parametrize("make,match", [
    (lambda: optim.scale_by_adam(b1=1.0), "b1"),
    (lambda: optim.scale_by_adam(b2=-0.1), "b2"),
    (lambda: optim.scale_by_adam(eps=-1e-8), "eps"),
    (lambda: optim.scale_by_adam(mu_dtype="int32"), "int32"),
    (lambda: optim.scale_by_adam(nu_dtype="float8"), "float8"),
    (lambda: optim.adamw(-0.1), "learning_rate"),
    (lambda: optim.adamw(0.1, weight_decay=-1.0), "weight_decay"),
])
def test_bad_hyperparameters_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ----------------------------------------------------------------------------- LS-6

@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_ls6_skipped_step_leaves_adamw_state_bitwise_unchanged(bad):
    opt = optim.adamw(0.1, weight_decay=0.1)
    params = {"w": jnp.ones((1,), F32)}
    scale = DynamicLossScale(loss_scale=2.0 ** 10)
    step = jit_step(opt)
    first = step({"w": jnp.full((1,), 2.0 ** 10, F32)}, opt.init(params), params, scale)
    # Hand arithmetic: mu_hat = nu_hat = g = 1, direction 1/(1+1e-8), decay 0.1 * w. The
    # float32 bias correction 1 - 0.999 is off by ~5e-5 relative, hence the tolerance.
    np.testing.assert_allclose(np.asarray(first.params["w"]), 1 - 0.1 * (1 / (1 + 1e-8) + 0.1), atol=3e-6)

    second = step({"w": jnp.full((1,), bad, F32)}, first.opt_state, first.params, first.loss_scale)
    assert not bool(second.grads_finite)
    assert_bitwise_equal(second.params, first.params)
    old, new = adam_state(first.opt_state), adam_state(second.opt_state)
    assert_bitwise_equal((new.mu, new.nu, new.count), (old.mu, old.nu, old.count))
    assert_bitwise_equal(second.opt_state, first.opt_state)
    assert int(new.count) == 1
    assert not any(np.isnan(np.asarray(x)).any() for x in jax.tree.leaves((second.params, second.opt_state)))
    assert float(second.loss_scale.loss_scale) == 2.0 ** 9


def test_ls6_schedule_does_not_advance_on_a_skipped_step():
    schedule = optax.exponential_decay(0.1, transition_steps=1, decay_rate=0.5)  # 0.1, 0.05, ...
    opt = optim.adamw(schedule, weight_decay=0.1)
    params = {"w": jnp.ones((1,), F32)}
    step = jit_step(opt)
    scale = StaticLossScale(4.0)
    good, bad = {"w": jnp.full((1,), 4.0, F32)}, {"w": jnp.full((1,), np.inf, F32)}

    a = step(good, opt.init(params), params, scale)
    skipped = step(bad, a.opt_state, a.params, a.loss_scale)
    with_skip = step(good, skipped.opt_state, skipped.params, skipped.loss_scale)
    without_skip = step(good, a.opt_state, a.params, a.loss_scale)

    assert_bitwise_equal((with_skip.params, with_skip.opt_state), (without_skip.params, without_skip.opt_state))
    expected = adamw_reference(1.0, [1.0, 1.0], lambda t: 0.1 * 0.5 ** t, 0.1)   # lr 0.1 then 0.05
    advanced = adamw_reference(1.0, [1.0, 1.0], lambda t: 0.1 * 0.5 ** (2 * t), 0.1)  # 0.1 then 0.025
    np.testing.assert_allclose(np.asarray(with_skip.params["w"]), expected, atol=5e-6)
    assert abs(float(with_skip.params["w"][0]) - advanced) > 1e-2


@pytest.mark.parametrize("finite", [True, False])
def test_extra_state_is_kept_only_on_an_applied_step(finite):
    opt = optim.adamw(0.1, weight_decay=0.1)
    params = {"w": jnp.ones((3,), F32)}
    router_bias = {"bias": jnp.array([0.0, -1.0, 2.0], F32)}
    new_bias = {"bias": jnp.array([0.5, -0.5, 2.5], F32)}
    g = jnp.array([1.0, np.nan if not finite else 2.0, 3.0], F32)
    out = jax.jit(lambda g, s, p, l, e, ne: optim.apply_gradients(
        opt, g, s, p, l, extra=e, new_extra=ne))({"w": g}, opt.init(params), params,
                                                  NoOpLossScale(), router_bias, new_bias)
    assert bool(out.grads_finite) == finite
    assert_bitwise_equal(out.extra, new_bias if finite else router_bias)


# ----------------------------------------------------------------------------- LS-7

@pytest.mark.parametrize("grads,loss_scale,true_norm", [
    # Scale 65536, true grads [3, 4]: the scaled grads exceed float16, so they are float32.
    (np.array([3.0, 4.0], np.float32) * 65536, DynamicLossScale(loss_scale=65536.0), 5.0),
    # float16 grads whose norm 5000 overflows float16 (3000**2 = 9e6 > 65504).
    (np.array([3000.0, 4000.0], np.float16), NoOpLossScale(), 5000.0),
])
def test_ls7_clip_sees_unscaled_float32_grads(grads, loss_scale, true_norm):
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
    params = jnp.zeros((2,), F32)
    out = jit_step(opt)(jnp.asarray(grads), opt.init(params), params, loss_scale)
    assert bool(out.grads_finite)
    assert out.grad_norm.dtype == F32 and float(out.grad_norm) == true_norm
    np.testing.assert_allclose(-np.asarray(out.params), [0.6, 0.8], rtol=1e-6)
    if grads.dtype == np.float16:  # the premise: a float16 norm would be inf
        assert not np.isfinite(float(jnp.sqrt(jnp.sum(jnp.asarray(grads) ** 2))))


# ----------------------------------------------------------------------------- LS-8

def _micro_batches(rng, bad):
    x = rng.normal(size=(2, 5, 18)).astype(np.float32).astype(jnp.bfloat16)
    if bad:
        x[1, 2, 7] = np.inf
    return x


@pytest.mark.parametrize("bad", [False, True])
def test_ls8_scan_accumulation_in_master_dtype(bad):
    policy = jaxmp.get_policy("mixed_bf16")
    rng = np.random.default_rng(8)
    params = policy.cast_to_param(jnp.asarray(rng.normal(size=(5, 18)), F32))
    x = _micro_batches(rng, bad)
    opt = optim.adamw(1e-2, weight_decay=1e-4)
    scale = DynamicLossScale(loss_scale=2.0 ** 8)

    @jax.jit
    def train_step(params, opt_state, loss_scale, xs):
        def micro(acc, x):
            # A tiny linear model computed in bfloat16: d(S * sum(w * x))/dw = S * x, bf16.
            grads = jax.grad(lambda w: loss_scale.scale(jnp.sum(w * x)))(policy.cast_to_compute(params))
            return optim.accumulate(acc, grads, loss_scale), None
        acc, _ = jax.lax.scan(micro, optim.accumulator_init(params), xs)
        mean, finite = optim.accumulated_mean(acc)
        out = optim.apply_gradients(opt, mean, opt_state, params, loss_scale,
                                    grads_scaled=False, grads_finite=finite)
        return out, acc

    state = opt.init(params)
    out, acc = train_step(params, state, scale, jnp.asarray(x))
    assert acc.grad_sum.dtype == F32 and int(acc.count) == 2 and out.params.dtype == F32
    x64 = np.asarray(x, np.float64)
    if not bad:
        assert bool(acc.finite) and bool(out.grads_finite)
        expected = adamw_reference(np.asarray(params), [(x64[0] + x64[1]) / 2], 1e-2, 1e-4)
        np.testing.assert_allclose(np.asarray(out.params), expected, rtol=0, atol=1e-6)
        assert float(out.loss_scale.loss_scale) == 2.0 ** 8
    else:
        assert not bool(acc.finite) and not bool(out.grads_finite)
        np.testing.assert_array_equal(np.asarray(acc.grad_sum), x64[0].astype(np.float32))
        assert_bitwise_equal((out.params, out.opt_state), (params, state))
        assert float(out.loss_scale.loss_scale) == 2.0 ** 7  # backed off once per effective batch


def test_ls8_optax_multisteps_with_unscaled_float32_grads():
    rng = np.random.default_rng(9)
    params = jnp.asarray(rng.normal(size=(5, 18)), F32)
    x = _micro_batches(rng, bad=False)
    opt = optax.MultiSteps(optim.adamw(1e-2, weight_decay=1e-4), every_k_schedule=2)
    step = jit_step(opt)
    scale = DynamicLossScale(loss_scale=2.0 ** 8)
    to_grad = lambda xi: jnp.asarray(xi) * jnp.asarray(2.0 ** 8, BF16)  # bf16 scaled grads, exact
    poison = jnp.full((5, 18), np.nan, BF16)

    state = opt.init(params)
    s1 = step(to_grad(x[0]), state, params, scale)
    assert_bitwise_equal(s1.params, params)  # first micro-step: no update yet
    s_bad = step(poison, s1.opt_state, s1.params, s1.loss_scale)  # dropped, not accumulated
    assert not bool(s_bad.grads_finite) and float(s_bad.loss_scale.loss_scale) == 2.0 ** 7
    assert_bitwise_equal(s_bad.opt_state, s1.opt_state)
    assert s_bad.opt_state.acc_grads.dtype == F32
    # Same loss scale as the first micro-step, so the accumulated grads share one scale.
    s2 = step(to_grad(x[1]), s_bad.opt_state, s_bad.params, scale)
    x64 = np.asarray(x, np.float64)
    expected = adamw_reference(np.asarray(params), [(x64[0] + x64[1]) / 2], 1e-2, 1e-4)
    np.testing.assert_allclose(np.asarray(s2.params), expected, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- MW-1

@pytest.mark.parametrize("policy_name", ["bf16", "mixed_bf16"])
def test_mw1_master_weights_keep_small_updates(policy_name):
    policy = jaxmp.get_policy(policy_name)
    params = policy.cast_to_param({"w": jnp.ones((), F32)})
    opt = optax.sgd(6e-4)

    @jax.jit
    def run(params):
        def body(_, carry):
            params, opt_state = carry
            grads = policy.cast_to_compute({"w": jnp.ones((), F32)})  # bf16 compute grads
            out = optim.apply_gradients(opt, grads, opt_state, params, NoOpLossScale())
            return out.params, out.opt_state
        return jax.lax.fori_loop(0, 100, body, (params, opt.init(params)))[0]

    w = run(params)["w"]
    assert w.dtype == policy.param_dtype
    if policy_name == "bf16":
        assert float(w) == 1.0  # 1 - 6e-4 rounds back to 1 in bfloat16
    else:
        ref = np.float32(1.0)
        for _ in range(100):
            ref = np.float32(ref - np.float32(6e-4))
        assert np.asarray(w) == ref and abs(float(ref) - 0.94) < 1e-4


# ----------------------------------------------------------------------------- property

_STRUCTURES = [
    {"w": (3, 4)},
    {"w": (3, 4), "b": (4,)},
    {"a": (2,), "b": (3, 4), "c": ()},
]
_PROP_OPT = optim.adamw(1e-2, weight_decay=0.1)
_PROP_STEP = jit_step(_PROP_OPT)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_nonfinite_grads_skip_and_back_off_exactly(data):
    shapes = _STRUCTURES[data.draw(st.integers(0, len(_STRUCTURES) - 1), label="structure")]
    hysteresis = data.draw(st.sampled_from([1, 2]), label="hysteresis")
    init = 2.0 ** data.draw(st.sampled_from([0, 1, 10, 15]), label="log2 scale")
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1), label="seed"))
    names = sorted(shapes)
    n_bad = data.draw(st.integers(0, 3), label="n_bad")
    bad = [(data.draw(st.sampled_from(names)), data.draw(st.integers(0, 11)),
            data.draw(st.sampled_from([np.nan, np.inf, -np.inf]))) for _ in range(n_bad)]

    def tree(scale=1.0):
        return {k: np.asarray(rng.normal(size=s) * scale, np.float32) for k, s in shapes.items()}

    params = jax.tree.map(jnp.asarray, tree())
    g0, g1 = tree(), tree()
    scaled1 = {k: np.asarray(v * np.float32(init), np.float32) for k, v in g1.items()}
    for name, pos, value in bad:
        scaled1[name].flat[pos % scaled1[name].size] = value
    loss_scale = DynamicLossScale(loss_scale=init, hysteresis=hysteresis)

    first = _PROP_STEP({k: jnp.asarray(v * np.float32(init)) for k, v in g0.items()},
                       _PROP_OPT.init(params), params, loss_scale)
    second = _PROP_STEP(jax.tree.map(jnp.asarray, scaled1), first.opt_state, first.params, first.loss_scale)
    if not bad:
        assert bool(second.grads_finite)
        for k in names:
            expected = adamw_reference(np.asarray(params[k]), [g0[k], g1[k]], 1e-2, 0.1)
            np.testing.assert_allclose(np.asarray(second.params[k]), expected, rtol=1e-5, atol=1e-6)
        assert float(second.loss_scale.loss_scale) == init and int(second.loss_scale.counter) == 2
        return
    backed_off = max(init * 0.5, 1.0)
    assert not bool(second.grads_finite)
    assert_bitwise_equal((second.params, second.opt_state), (first.params, first.opt_state))
    if hysteresis == 1:
        assert float(second.loss_scale.loss_scale) == backed_off
    else:
        assert float(second.loss_scale.loss_scale) == init
        third = _PROP_STEP(jax.tree.map(jnp.asarray, scaled1), second.opt_state, second.params,
                           second.loss_scale)
        assert float(third.loss_scale.loss_scale) == backed_off
        assert_bitwise_equal((third.params, third.opt_state), (first.params, first.opt_state))


# ----------------------------------------------------------------------------- 8 devices

@pytest.mark.parametrize("poisoned", [True, False])
def test_one_bad_shard_skips_every_replica(poisoned):
    devices = jax.devices()
    assert len(devices) == 8, "tests/conftest.py forces 8 host CPU devices"
    mesh = Mesh(np.array(devices), ("data",))
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    opt = optim.adamw(0.1, weight_decay=0.1)
    w0 = np.linspace(-1.0, 1.0, 16).astype(np.float32)
    params = jax.device_put({"w": jnp.asarray(w0)}, replicated)
    state = jax.device_put(opt.init(params), replicated)
    true_grads = np.arange(1, 17, dtype=np.float32)
    scaled = true_grads * 8
    if poisoned:
        scaled[5] = np.nan  # lives on device 2 only
    grads = jax.device_put({"w": jnp.asarray(scaled)}, sharded)
    assert len({s.device for s in grads["w"].addressable_shards if np.isnan(np.asarray(s.data)).any()}) \
        == int(poisoned)

    def step(g, s, p, ls):
        out = optim.apply_gradients(opt, g, s, p, ls)
        return out.params, out.loss_scale, out.grads_finite

    new_params, new_scale, finite = jax.jit(step, out_shardings=replicated)(
        grads, state, params, DynamicLossScale(loss_scale=8.0))
    shards = new_params["w"].addressable_shards
    assert len({s.device for s in shards}) == 8
    for shard in shards:
        assert_bitwise_equal(shard.data, shards[0].data)
    for shard in new_scale.loss_scale.addressable_shards:
        assert float(shard.data) == (4.0 if poisoned else 8.0)
    assert bool(finite) == (not poisoned)
    if poisoned:
        assert_bitwise_equal(shards[0].data, w0)
    else:
        expected = adamw_reference(w0, [true_grads], 0.1, 0.1)
        np.testing.assert_allclose(np.asarray(shards[0].data), expected, atol=5e-6)


# ----------------------------------------------------------------------------- bad input

def test_apply_gradients_rejects_bad_input():
    opt = optim.adamw(0.1)
    params = {"w": jnp.ones((2,), F32)}
    state = opt.init(params)
    g = {"w": jnp.ones((2,), F32)}
    with pytest.raises(ValueError, match="LossScale"):
        optim.apply_gradients(opt, g, state, params, 2.0)
    with pytest.raises(ValueError, match="tree structure"):
        optim.apply_gradients(opt, {"v": g["w"]}, state, params, NoOpLossScale())
    with pytest.raises(ValueError, match="shape"):
        optim.apply_gradients(opt, {"w": jnp.ones((3,), F32)}, state, params, NoOpLossScale())
    with pytest.raises(ValueError, match="grads_finite"):
        optim.apply_gradients(opt, g, state, params, NoOpLossScale(), grads_finite=jnp.ones((2,), bool))
    with pytest.raises(ValueError, match="new_extra"):
        optim.apply_gradients(opt, g, state, params, NoOpLossScale(), extra={"b": jnp.ones(())})
    with pytest.raises(ValueError, match="empty accumulator"):
        optim.accumulated_mean(optim.accumulator_init(params))
    with pytest.raises(ValueError, match="accumulator"):
        optim.accumulate(optim.accumulator_init(params), {"w": jnp.ones((4,), F32)}, NoOpLossScale())


def test_an_update_that_overflows_on_finite_gradients_is_skipped_too():
    """A finite gradient can still produce a non-finite state (here float16 second moments:
    (1 - b2) * 1e4**2 = 1e5 > 65504). The step is skipped bitwise; the loss scale does not back off, since
    the gradients did not overflow."""
    params = {"w": jnp.ones((3,), jnp.float32)}
    opt = optim.adamw(1e-3, mu_dtype=jnp.float16, nu_dtype=jnp.float16)
    state = opt.init(params)
    scale = jaxmp.DynamicLossScale(loss_scale=4.0, growth_interval=100)
    grads = {"w": jnp.full((3,), 1e4 * 4.0, jnp.float32)}  # scaled by 4
    out = optim.apply_gradients(opt, grads, state, params, scale)
    assert bool(out.grads_finite) and not bool(out.applied)
    np.testing.assert_array_equal(np.asarray(out.params["w"]), np.ones(3, np.float32))
    for a, b in zip(jax.tree.leaves(out.opt_state), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(out.loss_scale.loss_scale) == 4.0 and int(out.loss_scale.counter) == 1
