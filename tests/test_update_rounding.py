"""bfloat16 master weights that still learn (jaxmp.optim.with_update_rounding): a toy
where round-to-nearest stalls, unbiased stochastic rounding checked against float64
(hypothesis, over exponents from subnormal to the bfloat16 maximum), the bitwise skip,
one device against zero1 and fsdp bitwise, and the config's checks."""
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _bitwise import assert_bitwise_equal, bits
from _configs import small_config
from jaxmp import NoOpLossScale, StaticLossScale
from jaxmp.precision import optim
from jaxmp import sharding
from jaxmp.train import Experiment
from jaxmp.train.config import validate_config
from jaxmp.train.optimizer import make_lr_schedule, make_optimizer

BF16_MAX = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)


def ulp(x, dtype):
    """Spacing of ``dtype`` at |x| (float64, by frexp): 2**(e - mantissa bits), with the
    exponent clamped at the smallest normal's (subnormals are evenly spaced)."""
    info = ml_dtypes.finfo(dtype) if dtype == ml_dtypes.bfloat16 else np.finfo(dtype)
    _, e = np.frexp(np.abs(np.float64(x)))  # |x| = m * 2**e, m in [0.5, 1)
    return 2.0 ** (max(int(e) - 1, int(info.minexp)) - int(info.nmant))


# --- A toy where round to nearest stalls ------------------------------------------------

N, STEPS, LR = 4096, 300, 1e-4  # w = 1, gradient 1: each update is 1e-4 < half an ulp (2**-9)


def toy(rounding):
    """SGD on a constant gradient of 1 from w = 1: bfloat16 ``w`` [N], float32 ``b`` [4].
    Returns the trajectory of w [STEPS, N] (float32) and the final b."""
    tx = optim.with_update_rounding(optax.sgd(LR), rounding, seed=7)
    params = {"w": jnp.ones((N,), jnp.bfloat16), "b": jnp.ones((4,), jnp.float32)}

    def body(carry, _):
        p, s = carry
        g = jax.tree.map(lambda x: jnp.ones(x.shape, jnp.float32), p)
        out = optim.apply_gradients(tx, g, s, p, NoOpLossScale(), grads_scaled=False)
        return (out.params, out.opt_state), out.params["w"].astype(jnp.float32)

    (p, _), traj = jax.jit(lambda p, s: jax.lax.scan(body, (p, s), None, length=STEPS))(
        params, tx.init(params))
    return np.asarray(traj, np.float64), np.asarray(p["b"])


REF = 1.0 - LR * np.arange(1, STEPS + 1, dtype=np.float64)  # float64 reference


@pytest.fixture(scope="module")
def b_float32():
    b = np.ones(4, np.float32)
    for _ in range(STEPS):  # optax.sgd's update is -lr * g, added in float32
        b = b + np.float32(-LR) * np.float32(1.0)
    return b


def test_nearest_stalls_where_stochastic_and_kahan_learn(b_float32):
    w, b = toy("nearest")
    assert np.all(w == 1.0)  # case MW-1: every update lost
    np.testing.assert_array_equal(b, b_float32)

    w, b = toy("stochastic")
    mean, moved = w.mean(axis=1), 1.0 - REF
    # Each weight's rounding noise has std <= ulp / 2 = 2**-9; the mean of N has 2**-9 / 64.
    se = 2.0 ** -9 / np.sqrt(N)
    assert np.all(np.abs(mean - REF) <= 0.03 * moved + 4 * se)
    assert abs(mean[-1] - REF[-1]) <= 0.01 * moved[-1]  # 3e-2 travelled, within 1%
    np.testing.assert_array_equal(b, b_float32)  # float32 leaves: exactly as without rounding

    w, b = toy("kahan")
    res = np.array([ulp(r, ml_dtypes.bfloat16) for r in REF])
    assert np.all(np.abs(w - REF[:, None]) <= res[:, None])  # within one bf16 ulp, all steps
    np.testing.assert_array_equal(b, b_float32)


# --- Unbiasedness -------------------------------------------------------------------------

DRAWS = 8192


def round_many(x, dtype, seed):
    """DRAWS stochastic roundings of the float32 value ``x`` (each element its own bits)."""
    xs = jnp.full((DRAWS,), np.float32(x), jnp.float32)
    out = optim.stochastic_round(xs, dtype, jax.random.key(seed))
    return np.asarray(out.astype(jnp.float32), np.float64)


def float32_values(max_value):
    """float32 values, either sign, over every exponent from subnormal to ``max_value``."""
    mags = st.builds(lambda m, e: np.float32(m) * np.float32(2.0) ** np.float32(e),
                     st.floats(1.0, 2.0, exclude_max=True), st.integers(-149, 127))
    near_max = st.floats(float(np.float32(0.99 * max_value)), max_value, width=32)
    sub = st.integers(1, 2 ** 23 - 1).map(lambda i: np.uint32(i).view(np.float32))
    values = st.one_of(mags, near_max, sub).filter(lambda v: 0 < abs(v) <= max_value)
    return st.tuples(values, st.booleans()).map(lambda t: np.float32(-t[0] if t[1] else t[0]))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_stochastic_rounding_is_unbiased(dtype, data):
    np_dtype = ml_dtypes.bfloat16 if dtype == jnp.bfloat16 else np.float16
    top = BF16_MAX if dtype == jnp.bfloat16 else 65504.0
    x = data.draw(float32_values(top))
    seed = data.draw(st.integers(0, 2 ** 31 - 2))
    out = round_many(x, dtype, seed)
    u = ulp(x, np_dtype)
    x64 = np.float64(x)
    # Every draw is one of the two neighbours of x ...
    assert np.all(np.abs(out - x64) < u) and np.all(np.isfinite(out))
    assert len(np.unique(out)) <= 2
    # ... and their mean is x within 5 standard errors of a Bernoulli(p) between them.
    lo = np.floor(x64 / u) * u
    p = (x64 - lo) / u
    se = u * np.sqrt(max(p * (1 - p), 1.0 / DRAWS) / DRAWS)
    assert abs(out.mean() - x64) <= 5 * se, (x, out.mean(), se)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_inf_and_nan_pass_through_and_representable_values_stay(dtype):
    x = jnp.array([jnp.inf, -jnp.inf, jnp.nan, -jnp.nan, 0.0, -0.0, 1.0, -2.5], jnp.float32)
    x = jnp.tile(x, 512)
    out = np.asarray(optim.stochastic_round(x, dtype, jax.random.key(0)).astype(jnp.float32))
    ref = np.asarray(x)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    finite = ~np.isnan(ref)
    np.testing.assert_array_equal(bits(out[finite]), bits(ref[finite]))  # +-0 and +-inf kept


def test_past_the_bfloat16_maximum_rounds_to_inf_with_its_fraction():
    """Between the largest bfloat16 and where its next step would be: inf with the
    fraction of the step, as rounding to a 9th exponent bit would."""
    x = BF16_MAX + 0.25 * ulp(BF16_MAX, ml_dtypes.bfloat16)
    out = round_many(x, jnp.bfloat16, 1)
    frac = np.mean(np.isinf(out))
    assert abs(frac - 0.25) <= 5 * np.sqrt(0.25 * 0.75 / DRAWS)
    assert np.all(out[~np.isinf(out)] == BF16_MAX)


def test_a_bad_dtype_or_rounding_is_a_one_line_error():
    with pytest.raises(ValueError, match="bfloat16 or float16, not float32"):
        optim.stochastic_round(jnp.ones(3), jnp.float32, jax.random.key(0))
    with pytest.raises(ValueError, match="'stochastc' is not allowed; allowed: nearest"):
        optim.with_update_rounding(optax.sgd(1.0), "stochastc")
    sgd = optax.sgd(1.0)
    assert optim.with_update_rounding(sgd, "nearest") is sgd  # round to nearest: as today


# --- The bitwise skip, accumulation and clipping ------------------------------------------

@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_a_skipped_step_changes_nothing_and_draws_no_bits(rounding):
    """Steps: finite, inf, finite. The inf step keeps params, compensation and counter
    bitwise, so the run equals the same two finite steps without it. Clipping sees the
    unscaled gradients; the gradients are a mean of accumulated micro-steps."""
    tx = optim.with_update_rounding(
        optax.chain(optax.clip_by_global_norm(1.0), optim.adamw(1e-3, mu_dtype="bf16",
                                                                nu_dtype="bf16")),
        rounding, seed=3)
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(64, 32)), jnp.bfloat16),
              "norm": jnp.ones((32,), jnp.float32)}
    scale = StaticLossScale(2.0 ** 4)

    def grads(i, bad=False):
        g = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape) * 10 ** i, jnp.float32),
                         params)
        if bad:
            g["w"] = g["w"].at[3, 4].set(jnp.inf)
        return g

    @jax.jit
    def step(p, s, micro):
        acc = optim.accumulator_init(jax.tree.map(lambda x: x.astype(jnp.float32), p))
        for g in micro:
            acc = optim.accumulate(acc, jax.tree.map(scale.scale, g), scale)
        mean, finite = optim.accumulated_mean(acc)
        out = optim.apply_gradients(tx, mean, s, p, scale, grads_scaled=False,
                                    grads_finite=finite)
        return out.params, out.opt_state, out.applied

    g1, g_bad, g2 = [grads(0), grads(1)], [grads(0), grads(0, bad=True)], [grads(-1), grads(0)]
    s0 = tx.init(params)
    p1, s1, ok1 = step(params, s0, g1)
    p_skip, s_skip, ok_skip = step(p1, s1, g_bad)
    assert bool(ok1) and not bool(ok_skip)
    assert_bitwise_equal((p_skip, s_skip), (p1, s1))
    p2, s2, _ = step(p_skip, s_skip, g2)
    p2_ref, s2_ref, _ = step(p1, s1, g2)
    assert_bitwise_equal((p2, s2), (p2_ref, s2_ref))
    assert int(s2.count) == 2
    assert p2["w"].dtype == jnp.bfloat16 and p2["norm"].dtype == jnp.float32
    assert not np.array_equal(bits(p2["w"]), bits(params["w"]))
    if rounding == "kahan":
        assert s2.compensation["w"].dtype == jnp.bfloat16
        assert isinstance(s2.compensation["norm"], optax.MaskedNode)


# --- One device, zero1 and fsdp: the same bits ---------------------------------------------

# Leaves named and laid out as the model's (logical axes; the trainer's rule tables place
# them): two bfloat16 projections with "embed" first and last, a float32 router and norm.
LEAVES = {"wq": ((64, 4, 16), ("embed", "heads", "head_dim"), jnp.bfloat16),
          "wo": ((4, 16, 64), ("heads", "head_dim", "embed"), jnp.bfloat16),
          "router": ((64, 4), ("embed", None), jnp.float32),
          "scale": ((64,), ("embed",), jnp.float32)}


def pure_config(rounding):
    config = small_config()
    config.precision.policy = "pure_bf16; router: fp32; norm: fp32"
    config.optim.update(dict(update_rounding=rounding, mu_dtype="bfloat16", nu_dtype="bfloat16"))
    return config


def two_updates(rounding, strategy, num_devices):
    """The trainer's optimizer (clipping, AdamW with bf16 moments, the rounding) applied
    twice to the same parameters and float32 gradients, every array laid out on
    ``num_devices`` by ``strategy``'s state rules (jaxmp.sharding.layout)."""
    optim_config = pure_config(rounding).optim
    tx = make_optimizer(optim_config, make_lr_schedule(optim_config, 40), seed=5)
    mesh = sharding.make_mesh(num_devices, expert=1)
    rules = sharding.layout(strategy, 1).state_rules
    where = {shape: sharding.logical_to_sharding(axes, mesh, rules)
             for shape, axes, _ in LEAVES.values()}
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def place(tree):
        return jax.tree.map(lambda x: jax.device_put(x, where.get(np.shape(x), replicated)), tree)

    rng = np.random.default_rng(0)
    host = {k: jnp.asarray(rng.normal(size=shape), dtype)
            for k, (shape, _, dtype) in LEAVES.items()}
    params, opt_state = place(host), place(tx.init(host))

    @jax.jit
    def update(params, opt_state, g):
        out = optim.apply_gradients(tx, g, opt_state, params, NoOpLossScale(), grads_scaled=False)
        return out.params, out.opt_state

    for i in range(2):
        g = place({k: rng.normal(size=shape).astype(np.float32) * 1e-2
                   for k, (shape, _, _) in LEAVES.items()})
        params, opt_state = update(params, opt_state, g)
    hlo = update.lower(params, opt_state, g).compile().as_text()
    return params, opt_state, hlo


def largest_uint32(hlo):
    """Elements of the largest uint32 array of a compiled program (the random bits'
    dtype), 0 without one."""
    shapes = re.findall(r"u32\[([\d,]*)\]", hlo)
    return max((int(np.prod([int(d) for d in s.split(",") if d])) for s in shapes), default=0)


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_zero1_and_fsdp_update_one_devices_params_bitwise(rounding):
    one = jax.device_get(two_updates(rounding, "dp", 1)[:2])
    for strategy in ("zero1", "fsdp"):
        params, opt_state, hlo = two_updates(rounding, strategy, 8)
        # Each device draws the bits of its own slice only (64 * 4 * 16 / 8 = 512), never a
        # whole leaf's (4096) to slice from: counter-based bits, partitioned.
        assert largest_uint32(hlo) == (512 if rounding == "stochastic" else 0)
        for name in ("wq", "wo"):  # each device rounded its own slice
            w = params[name]
            assert w.dtype == jnp.bfloat16 and w.sharding.shard_shape(w.shape) != w.shape
            if rounding == "kahan":
                c = opt_state.compensation[name]
                assert c.dtype == jnp.bfloat16 and c.sharding.is_equivalent_to(w.sharding, w.ndim)
        assert_bitwise_equal(jax.device_get((params, opt_state)), one)


# --- Config ----------------------------------------------------------------------------------

def test_pure_bf16_keeps_bf16_params_and_a_float32_loss():
    rules = validate_config(pure_config("stochastic"), 1).rules
    assert str(rules.default) == "params=bfloat16,compute=bfloat16,output=float32"
    assert rules.resolve("blocks/1/moe/router").param_dtype == jnp.float32
    assert rules.resolve("blocks/0/attn_norm").param_dtype == jnp.float32


@pytest.mark.parametrize("policy", ["fp32", "mixed_bf16; router: fp32; norm: fp32"])
@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_rounding_with_only_float32_params_is_a_one_line_error(policy, rounding):
    config = pure_config(rounding)
    config.precision.policy = policy
    with pytest.raises(ValueError) as e:
        validate_config(config, 1)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"optim.update_rounding={rounding!r} rounds bfloat16/float16 parameters")
    assert "keeps every parameter in float32" in msg and "pure_bf16" in msg


def test_an_unknown_rounding_names_the_allowed_ones():
    with pytest.raises(ValueError, match="optim.update_rounding='sr' is not allowed; it must be "
                                         "one of nearest, stochastic, kahan"):
        validate_config(pure_config("sr"), 1)


def test_the_key_is_in_help_and_a_mixed_experts_rule_is_enough_to_round():
    from jaxmp.train.keys import help_text
    assert "--config.optim.update_rounding='nearest'" in help_text()
    config = pure_config("kahan")
    config.precision.policy = "mixed_bf16; experts: pure_bf16; router: fp32; norm: fp32"
    validate_config(config, 1)  # the experts' params are bfloat16: something is rounded


# --- SIGKILL and resume ----------------------------------------------------------------------

PURE = ["precision.policy=pure_bf16; router: fp32; norm: fp32", "optim.mu_dtype=bfloat16",
        "optim.nu_dtype=bfloat16"]


@pytest.mark.slow
def test_a_sigkilled_stochastic_run_resumes_bitwise_like_an_uninterrupted_one(tmp_path):
    """train.py (tests/test_faults.py's launcher and config) with stochastic rounding,
    checkpointing every 4 steps, killed by SIGKILL at step 6 or later: the steps it logged
    after its last complete checkpoint are the uninterrupted run's. The rerun resumes
    from that checkpoint and logs the same losses, bit for bit: the counter and so the
    random bits come back with the checkpoint, the bfloat16 weights exactly."""
    from test_faults import assert_sigkilled_run_resumes_bitwise

    assert_sigkilled_run_resumes_bitwise(tmp_path, *PURE, "optim.update_rounding=stochastic")


# --- Accounting ------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["dp", "zero1", "fsdp"])
def test_persistent_bytes_per_parameter_by_formula(strategy):
    """Counted from the abstract train state of each report mode (nothing compiled): per
    parameter, float32 masters + bf16 moments 8 bytes, bfloat16 masters with stochastic
    rounding 6, with Kahan 8; the router and norms stay float32 (4 + 4 bytes). zero1 and
    fsdp divide it over the 8 devices of the data axis; ZeRO-1 adds its compute copy."""
    from jaxmp.analysis import accounting

    base = small_config()
    base.parallel.strategy = strategy
    got = {}
    for mode in ("bf16_moments", "pure_bf16_stochastic", "pure_bf16_kahan"):
        exp = Experiment.create(accounting.mode_config(base, mode),
                                mesh=accounting.data_mesh(8))
        got[mode] = accounting.state_bytes(exp)
        leaves = jax.tree.leaves(exp.abstract_state.params)
    n32 = sum(x.size for x in leaves if x.dtype == jnp.float32)
    n16 = sum(x.size for x in leaves if x.dtype == jnp.bfloat16)  # under pure_bf16
    n = n16 + n32
    split = 1 if strategy == "dp" else 8
    copy = (2 * n16 + 4 * n32) if strategy == "zero1" else 0  # bf16 compute, f32 islands
    want = {"bf16_moments": 4 * n + 4 * n, "pure_bf16_stochastic": 2 * n16 + 4 * n32 + 4 * n,
            "pure_bf16_kahan": 2 * n16 + 4 * n32 + 4 * n + 2 * n16}
    for mode, b in got.items():
        persistent = b["params_bytes"] + b["opt_state_bytes"] + b["compute_copy_bytes"]
        scalars = 4 * (2 if mode == "bf16_moments" else 3)  # int32 step counts, replicated
        assert persistent == want[mode] // split + copy + scalars, mode
    assert want["pure_bf16_stochastic"] / n == pytest.approx(6, abs=0.05)
    assert want["bf16_moments"] == want["pure_bf16_kahan"] == 8 * n
    assert accounting._float32_state_bytes(exp) == 4 * n32 // split  # kahan: no float32 else


# --- In the trainer: FP8 from the bfloat16 master, gradient accumulation ----------------------

@pytest.mark.slow
def test_the_trainer_steps_kahan_bf16_masters_under_fp8_and_accumulation():
    """pure bfloat16 masters with FP8 (tensorwise) matmuls, quantized from the bfloat16
    weights, 2 micro-batches per step, Kahan updates: every step applied, the weights stay
    bfloat16 and move, the compensation is bfloat16 and holds what rounding lost."""
    config = small_config(steps=3, grad_accum_steps=2)
    config.precision.policy = "p=bf16,c=bf16,o=f32,fp8=tensorwise; router: fp32; norm: fp32"
    config.optim.update(dict(update_rounding="kahan", mu_dtype="bfloat16", nu_dtype="bfloat16"))
    exp = Experiment.create(config, num_devices=1)
    state = exp.init_state()
    w0 = np.asarray(state.params["blocks"][0]["attn"]["wq"].get_value())
    data = exp.data
    for _ in range(3):
        state, metrics = exp.train_step(state, exp.batch_to_device(next(data.train_iter)))
        assert bool(metrics["applied"]) and np.isfinite(float(metrics["loss"]))
    wq = state.params["blocks"][0]["attn"]["wq"].get_value()
    comp = state.opt_state.compensation["blocks"][0]["attn"]["wq"].get_value()
    assert wq.dtype == comp.dtype == jnp.bfloat16
    assert not np.array_equal(bits(np.asarray(wq)), bits(w0))
    c = np.abs(np.asarray(comp, np.float64))
    w = np.abs(np.asarray(wq, np.float64))
    assert c.max() > 0 and np.all(c <= 2.0 ** -8 * np.maximum(w, 2.0 ** -126))  # < 1 ulp
    assert int(state.opt_state.count) == 3


def test_a_checkpoint_from_before_the_key_resumes_at_nearest_only():
    from jaxmp.train.checkpoint import config_differences
    from jaxmp.train.config import config_to_dict

    now = config_to_dict(small_config())
    old = config_to_dict(small_config())
    del old["optim"]["update_rounding"]  # written before the key existed
    assert config_differences(old, now) == []
    now["optim"]["update_rounding"] = "kahan"
    assert config_differences(old, now) == [("optim.update_rounding", None, "kahan")]
