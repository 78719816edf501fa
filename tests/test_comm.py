"""Gradient communication on the 8-device CPU mesh: 16-bit reduction, top-k with error
feedback, what the compiled program exchanges, skipped steps, training and checkpoints."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, PartitionSpec as P

from _configs import small_config as _small_config
from jaxmp import comm, sharding
from jaxmp.precision.loss_scale import NoOpLossScale, StaticLossScale
from jaxmp.train import Checkpointer, Experiment, train_and_evaluate
from jaxmp.train.config import config_to_dict, validate_config
from jaxmp.train.state import create_train_state, train_state_shardings
from jaxmp.train.step import GradExchange, make_train_step


def mesh_of(n):
    return Mesh(np.asarray(jax.devices()[:n]), ("data",))


# --------------------------------------------------------------------------- settings


@pytest.mark.parametrize("kwargs, match", [
    (dict(grad_reduce_dtype="float64"), r"'float64'.*float32, bfloat16, float16"),
    (dict(grad_reduce_dtype="fp17"), r"'fp17'"),
    (dict(grad_compression="topq"), r"'topq'.*none or topk"),
    (dict(topk_ratio=0.0), r"topk_ratio=0.0.*\(0, 1\]"),
    (dict(topk_ratio=1.5), r"topk_ratio=1.5"),
    (dict(topk_ratio=True), r"topk_ratio=True"),
])
def test_bad_settings_name_the_value_and_what_is_allowed(kwargs, match):
    with pytest.raises(ValueError, match=match):
        comm.check_comm_config(**kwargs)
    # The trainer checks them once, in validate_config (make_train_step takes them as checked).
    config = small_config()
    for key, value in kwargs.items():
        config.precision[key] = value
    if config.precision.topk_ratio is not True and kwargs.get("topk_ratio") is True:
        return  # a ConfigDict's float key stores True as 1.0, a valid ratio
    with pytest.raises(ValueError, match=match):
        validate_config(config, 8)


def test_bad_precision_keys_fail_config_validation():
    config = small_config()
    config.precision.grad_reduce_dtype = "float64"
    with pytest.raises(ValueError, match="^precision.grad_reduce_dtype='float64' is not allowed; it must be float32, "
                                             "bfloat16, float16"):
        validate_config(config, 8)


@pytest.mark.parametrize("size, ratio, k", [(10, 0.3, 3), (37, 0.3, 11), (1, 0.3, 1), (7, 0.01, 1),
                                            (5, 1.0, 5), (64, 0.25, 16)])
def test_topk_count(size, ratio, k):
    assert comm.topk_count(size, ratio) == k


# --------------------------------------------------------------------------- top-k by hand

G0 = [1.0, -5.0, 2.0, 0.5, 3.0]      # device 0's gradient, both steps
G1 = [-4.0, 1.5, 0.25, 2.0, -0.5]    # device 1's


def test_topk_values_indices_and_residual_by_hand():
    """k = round(0.4 * 5) = 2 largest |residual + grad| on one device."""
    values, indices, residual = comm.topk_compress({"g": jnp.array(G0)}, {"g": jnp.zeros(5)}, 0.4)
    np.testing.assert_array_equal(values[0], [-5.0, 3.0])
    np.testing.assert_array_equal(indices[0], [1, 4])
    assert indices[0].dtype == jnp.int32
    np.testing.assert_array_equal(residual["g"], [1.0, 0.0, 2.0, 0.5, 0.0])
    # Second step: |1 + 1| = 2, |-5|, |2 + 2| = 4, |0.5 + 0.5| = 1, |3| -> -5 and 4 go.
    values, indices, residual = comm.topk_compress({"g": jnp.array(G0)}, residual, 0.4)
    np.testing.assert_array_equal(values[0], [-5.0, 4.0])
    np.testing.assert_array_equal(indices[0], [1, 2])
    np.testing.assert_array_equal(residual["g"], [2.0, 0.0, 0.0, 1.0, 3.0])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_topk_exchange_with_error_feedback_on_two_devices_by_hand(dtype):
    """Every number below is exact in all three dtypes, so the results are too."""
    def exchange(g, res):
        out, new = comm.exchange_gradients(
            {"g": g[0]}, NoOpLossScale(), {"residual": {"g": res[0]}}, grad_reduce_dtype=dtype,
            grad_compression="topk", topk_ratio=0.4)
        return out["g"], new["residual"]["g"][None]

    step = jax.jit(jax.shard_map(exchange, mesh=mesh_of(2), in_specs=(P("data"), P("data")),
                                 out_specs=(P(), P("data"))))
    g = jnp.array([G0, G1])
    mean, res = step(g, jnp.zeros((2, 5)))
    # Device 0 sends -5@1, 3@4; device 1 sends -4@0, 2@3; the sums over 2 devices.
    np.testing.assert_array_equal(mean, [-2.0, -2.5, 0.0, 1.0, 1.5])
    np.testing.assert_array_equal(res, [[1.0, 0.0, 2.0, 0.5, 0.0], [0.0, 1.5, 0.25, 0.0, -0.5]])
    mean, res = step(g, res)
    # Device 0: acc [2, -5, 4, 1, 3] sends -5@1, 4@2; device 1: acc [-4, 3, .5, 2, -1]
    # sends -4@0, 3@1.
    np.testing.assert_array_equal(mean, [-2.0, -1.0, 2.0, 0.0, 0.0])
    np.testing.assert_array_equal(res, [[2.0, 0.0, 0.0, 1.0, 3.0], [0.0, 0.0, 0.5, 2.0, -1.0]])


def test_topk_ranks_non_finite_entries_last():
    values, indices, residual = comm.topk_compress(
        {"g": jnp.array([1.0, jnp.nan, 3.0, -2.0, 0.5])}, {"g": jnp.zeros(5)}, 0.4)
    np.testing.assert_array_equal(indices[0], [2, 3])
    np.testing.assert_array_equal(values[0], [3.0, -2.0])
    assert np.isnan(residual["g"][1])


def test_topk_refuses_a_residual_that_does_not_match_the_gradients_leaf_by_leaf():
    with pytest.raises(ValueError, match="leaf by leaf"):
        comm.topk_compress({"a": jnp.ones(3), "b": jnp.ones(3)}, {"a": jnp.zeros(3), "c": jnp.zeros(3)}, 0.5)
    with pytest.raises(ValueError, match=r"shape \(3,\).*shape \(4,\)"):
        comm.topk_compress({"a": jnp.ones(3)}, {"a": jnp.zeros(4)}, 0.5)
    with pytest.raises(ValueError, match=r"topk_ratio=0"):
        comm.topk_compress({"a": jnp.ones(3)}, {"a": jnp.zeros(3)}, 0)


_topk_jit = jax.jit(comm.topk_compress, static_argnums=(2, 3))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), log_scale=st.floats(-20, 20))
def test_topk_matches_numpy_and_conserves_the_gradient(seed, log_scale):
    """37 elements, ratio 0.3: k = round(11.1) = 11. ``sent + new residual`` is exactly
    ``residual + grad`` in float32 whatever the value dtype (x - bf16(x) is exact)."""
    rng = np.random.default_rng(seed)
    g = (rng.standard_normal(37) * 2.0 ** log_scale).astype(np.float32)
    r = (rng.standard_normal(37) * 2.0 ** log_scale).astype(np.float32)
    acc = r + g  # float32, as the code adds
    top = np.argsort(-np.abs(acc.astype(np.float64)), kind="stable")[:11]
    for dtype in ("float32", "bfloat16"):
        values, indices, residual = _topk_jit([jnp.asarray(g)], [jnp.asarray(r)], 0.3, dtype)
        idx, vals = np.asarray(indices[0]), np.asarray(values[0].astype(jnp.float32))
        assert sorted(idx.tolist()) == sorted(top.tolist())
        sent = np.zeros(37, np.float32)
        sent[idx] = vals
        np.testing.assert_array_equal(sent + np.asarray(residual[0]), acc)
        if dtype == "float32":
            np.testing.assert_array_equal(vals, acc[idx])
            assert np.all(np.asarray(residual[0])[idx] == 0)
        else:
            np.testing.assert_allclose(vals, acc[idx], rtol=2.0 ** -8)


# --------------------------------------------------------------------------- dense 16-bit


def _pmean(dtype):
    """The dense all-reduce of the train step: every leaf summed over "data", divided by 8."""
    def mean(x):
        return comm.reduce_gradients(x[0], comm.LeafReduce(("data",)), 8, dtype)
    return jax.jit(jax.shard_map(mean, mesh=mesh_of(8), in_specs=P("data"), out_specs=P()))


def test_bfloat16_reduce_equals_the_float32_reduce_within_bfloat16_rounding():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((8, 37)) * np.exp(rng.uniform(-5, 5, (8, 37)))).astype(np.float32)
    ref = x.astype(np.float64).mean(0)
    f32, bf16 = np.asarray(_pmean("float32")(x)), np.asarray(_pmean("bfloat16")(x))
    assert f32.dtype == bf16.dtype == np.float32  # cast back before the optimizer
    np.testing.assert_allclose(f32, ref, rtol=1e-6, atol=1e-30)
    # Each of the 8 inputs is rounded once (2**-8 relative), and the sum at most 7 more
    # times: bound the error by 9 roundings of the mean absolute value.
    bound = 9 * 2.0 ** -8 * np.abs(x.astype(np.float64)).mean(0)
    assert np.all(np.abs(bf16 - ref) <= bound)
    assert np.any(bf16 != f32)  # it really went through bfloat16


@pytest.mark.parametrize("value", [65504 / 8 * 1.5, 60000.0])
def test_float16_reduce_does_not_overflow_thanks_to_pre_division(value):
    x = np.full((8, 5), value, np.float32) * np.linspace(0.99, 1.0, 5, dtype=np.float32)
    with np.errstate(over="ignore"):
        naive = np.sum(x.astype(np.float16), axis=0, dtype=np.float16)
    assert np.all(np.isinf(naive))  # what a float16 sum of the raw values gives
    out = np.asarray(_pmean("float16")(x))
    np.testing.assert_allclose(out, x.astype(np.float64).mean(0), rtol=2.0 ** -9)


# --------------------------------------------------------------------------- a toy model

V, SENTINEL = 8, 7  # tokens 0..6 are normal; 7 gives NaN logits and NaN gradient rows


class ToyLM(nnx.Module):
    """A bigram table, ``logits = w[inputs]``, so per-device gradients have a NumPy form."""

    def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (V, V)) * 0.5)

    def __call__(self, inputs):
        # A factor, not a where over two branches: where's unused branch would still send
        # 0 * NaN = NaN back to every row.
        logits = self.w[inputs] * jnp.where(inputs == SENTINEL, jnp.nan, 1.0)[..., None]
        aux = {"aux_loss": jnp.zeros((), jnp.float32), "expert_counts": jnp.zeros((1, 2), jnp.float32),
               "dropped_fraction": jnp.zeros((), jnp.float32)}
        return logits, aux


def toy_batch(seed, rows=8, sentinel_row=None):
    rng = np.random.default_rng(seed)
    inputs = rng.integers(0, SENTINEL, (rows, 4)).astype(np.int32)
    if sentinel_row is not None:
        inputs[sentinel_row, 2] = SENTINEL
    return {"inputs": inputs, "targets": rng.integers(0, SENTINEL, (rows, 4)).astype(np.int32)}


def np_device_grads(w, batch, devices=8):
    """Gradient of each device's mean token cross-entropy (float64): row d = device d.
    A sentinel token's row of ``w`` gets NaN, as in :class:`ToyLM`."""
    w = np.asarray(w, np.float64)
    rows = len(batch["inputs"]) // devices
    out = np.zeros((devices,) + w.shape)
    for d in range(devices):
        x = batch["inputs"][d * rows:(d + 1) * rows].reshape(-1)
        y = batch["targets"][d * rows:(d + 1) * rows].reshape(-1)
        factor = np.where(x == SENTINEL, np.nan, 1.0)[:, None]
        logits = w[x] * factor
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        p[np.arange(len(y)), y] -= 1.0
        np.add.at(out[d], x, factor * p / len(y))
    return out


def np_topk_rows(acc, k):
    """Per device: keep the k largest |acc| (non-finite last); returns (sent, residual)."""
    sent = np.zeros_like(acc)
    for d in range(len(acc)):
        flat = acc[d].reshape(-1)
        key = np.where(np.isfinite(flat), np.abs(flat), -1.0)
        idx = np.argsort(-key, kind="stable")[:k]
        sent[d].reshape(-1)[idx] = flat[idx]
    return sent, acc - sent


LR, MOMENTUM = 0.5, 0.9


def toy_plan(mesh, state, grad_reduce_dtype="float32", **comm_kwargs):
    """The data-parallel StepPlan of ``state`` on ``mesh`` and make_train_step's
    GradExchange, after the check validate_config makes."""
    reduce_dtype = comm.check_comm_config(grad_reduce_dtype, **comm_kwargs)
    plan = sharding.StepPlan(mesh, sharding.layout("dp", 1), state.params, state.params,
                             reduce_dtype)
    exchange = GradExchange(comm_kwargs.get("grad_compression", "none"),
                            comm_kwargs.get("topk_ratio", GradExchange().topk_ratio))
    return plan, exchange


def toy_setup(mesh, loss_scale=None, grad_accum_steps=1, **comm_kwargs):
    optimizer = optax.sgd(LR, momentum=MOMENTUM)  # a state to keep on skipped steps
    model = ToyLM(nnx.Rngs(0))
    n = mesh.shape["data"]
    comm_state = comm.init_comm_state(nnx.state(model, nnx.Param), n,
                                      comm_kwargs.get("grad_compression", "none"))
    graphdef, state = create_train_state(model, optimizer, loss_scale or NoOpLossScale(), 0,
                                         comm_state=comm_state)
    state_sh = train_state_shardings(state, mesh, sharding.DATA_PARALLEL_RULES)
    batch_sh = sharding.batch_sharding(mesh, sharding.DATA_PARALLEL_RULES)
    plan, exchange = toy_plan(mesh, state, **comm_kwargs)
    step = jax.jit(make_train_step(graphdef, optimizer, lr_schedule=optax.constant_schedule(LR),
                                   grad_accum_steps=grad_accum_steps, plan=plan,
                                   exchange=exchange),
                   in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None))
    return step, jax.device_put(state, state_sh), lambda b: jax.device_put(b, batch_sh)


def test_the_step_needs_a_plan_and_topk_needs_a_residual():
    # A batch the devices and micro-batches do not divide is validate_config's error
    # (tests/test_train.py::test_bad_input_is_a_clear_error_before_training).
    for plan in (None, mesh_of(8)):
        with pytest.raises(ValueError, match="needs plan= a jaxmp.sharding.StepPlan"):
            make_train_step(None, optax.sgd(0.1), plan=plan,
                            lr_schedule=optax.constant_schedule(0.1))
    model = ToyLM(nnx.Rngs(0))
    graphdef, state = create_train_state(model, optax.sgd(0.1), NoOpLossScale(), 0)  # no comm_state
    plan, exchange = toy_plan(mesh_of(8), state, grad_compression="topk")
    step = make_train_step(graphdef, optax.sgd(0.1), lr_schedule=optax.constant_schedule(0.1),
                           plan=plan, exchange=exchange)
    with pytest.raises(ValueError, match="comm_state"):
        jax.eval_shape(step, state, toy_batch(0))


@pytest.fixture(scope="module")
def toy_topk():
    return toy_setup(mesh_of(8), grad_compression="topk", topk_ratio=0.25)


def test_toy_topk_steps_match_numpy_per_device_error_feedback(toy_topk):
    """SGD with momentum on ``mean_d(sent_d)``: every number checkable in NumPy."""
    step, state, put = toy_topk
    (w0,) = jax.tree.leaves(state.params)
    w_ref, res_ref, trace = np.asarray(w0, np.float64), np.zeros((8, V, V)), 0.0
    for seed in (1, 2):
        batch = toy_batch(seed)
        acc = res_ref + np_device_grads(w_ref, batch)
        sent, res_ref = np_topk_rows(acc, 16)  # k = 0.25 * 64
        dense = sent.mean(0)
        trace = dense + MOMENTUM * trace
        w_ref = w_ref - LR * trace
        state, metrics = step(state, put(batch))
        assert bool(metrics["grads_finite"])
        np.testing.assert_allclose(float(metrics["grad_norm"]), np.linalg.norm(dense), rtol=1e-5)
        (w,) = jax.tree.leaves(state.params)
        np.testing.assert_allclose(np.asarray(w), w_ref, rtol=1e-5, atol=1e-7)
        (res,) = jax.tree.leaves(state.comm_state)
        assert res.shape == (8, V, V) and res.sharding.spec == P("data", None, None)
        np.testing.assert_allclose(np.asarray(res), res_ref, rtol=1e-5, atol=1e-7)


def test_a_nan_that_topk_would_drop_still_skips_the_step(toy_topk):
    step, state, put = toy_topk
    state, _ = step(state, put(toy_batch(1)))  # a finite step: the residual is not zero
    (w1,) = jax.tree.leaves(state.params)
    (res1,) = jax.tree.leaves(state.comm_state)
    batch = toy_batch(3, sentinel_row=3)  # only device 3 sees token 7
    acc = np.asarray(res1, np.float64) + np_device_grads(w1, batch)
    assert np.isnan(acc[3]).sum() == V and np.isfinite(np.delete(acc, 3, 0)).all()
    sent, _ = np_topk_rows(acc, 16)
    assert np.isfinite(sent).all()  # top-k drops the NaN row: the exchange alone would hide it

    before = jax.device_get(state)
    after, metrics = step(state, put(batch))
    after = jax.device_get(after)
    assert not bool(metrics["grads_finite"]) and int(after.skipped_steps) == 1
    for name in ("params", "opt_state", "comm_state"):
        x, y = jax.tree.leaves(getattr(before, name)), jax.tree.leaves(getattr(after, name))
        assert len(x) == len(y) > 0
        for a, b in zip(x, y):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype, loss_scale, accum", [("bfloat16", None, 1), ("float16", 1024.0, 2)])
def test_toy_dense_16bit_reduce_matches_the_float64_mean(dtype, loss_scale, accum):
    """One SGD step (momentum starts at 0), per-device micro-batches too; float16
    carries the loss scale."""
    scale = None if loss_scale is None else StaticLossScale(loss_scale)
    step, state, put = toy_setup(mesh_of(8), scale, accum, grad_reduce_dtype=dtype)
    batch = toy_batch(5, rows=16)
    (w0,) = jax.tree.leaves(state.params)
    g = np_device_grads(w0, batch)  # the mean over a device's 2 rows = its micro-steps' mean
    state, metrics = step(state, put(batch))
    (w1,) = jax.tree.leaves(state.params)
    update = (np.asarray(w0, np.float64) - np.asarray(w1)) / LR
    eps = 2.0 ** -8 if dtype == "bfloat16" else 2.0 ** -11
    bound = 9 * eps * np.abs(g).mean(0) + 1e-6
    assert np.all(np.abs(update - g.mean(0)) <= bound)
    logits = np.asarray(w0, np.float64)[batch["inputs"]]
    nll = np.log(np.exp(logits).sum(-1)) - np.take_along_axis(logits, batch["targets"][..., None], -1)[..., 0]
    np.testing.assert_allclose(float(metrics["loss"]), nll.mean(), rtol=1e-5)


# --------------------------------------------------------------------------- the MoE model


def small_config(**train):
    # One MoE layer: fewer leaves, faster compiles; the exchange does not depend on depth.
    return _small_config(model=dict(num_layers=1, first_dense_layers=0), **train)


MODES = {"bfloat16": dict(grad_reduce_dtype="bfloat16"),
         "topk": dict(grad_reduce_dtype="bfloat16", grad_compression="topk", topk_ratio=0.3)}
STEPS = 25

_OP = re.compile(r"=\s*(?P<type>\([^()]*\)|\w+\[[\d,]*\](?:\{[\d,]*\})?)\s+(?P<op>all-reduce|all-gather)(?:-start)?\(")
_ARRAY = re.compile(r"\b(pred|s32|u32|bf16|f16|f32|f64)\[([\d,]*)\]")


def collectives(hlo: str):
    """``[(op, dtype, shape)]`` of every all-reduce / all-gather result in HLO text."""
    out = []
    for m in _OP.finditer(hlo):
        for dtype, dims in _ARRAY.findall(m.group("type")):
            out.append((m.group("op"), dtype, tuple(int(d) for d in dims.split(",") if d)))
    return out


def moe_run(mode):
    """Compiles the small MoE model's step (the trainer's, from its Experiment) and trains
    it for 25 steps on 8 devices."""
    config = small_config()
    config.precision.update(MODES[mode])
    exp = Experiment.create(config, num_devices=8)
    batches = [exp.batch_to_device(next(exp.data.train_iter)) for _ in range(STEPS)]
    state = exp.init_state()
    lowered = exp.train_step.lower(state, batches[0])
    compiled = lowered.compile()
    run = dict(mode=mode, config=exp.config, experiment=exp, initial=jax.device_get(state),
               hlo=lowered.compiler_ir("hlo").as_hlo_text(), compiled_hlo=compiled.as_text(), losses=[])
    for batch in batches:
        state, metrics = compiled(state, batch)
        run["losses"].append(float(metrics["loss"]))
        assert bool(metrics["grads_finite"])
    run["state"] = state
    return run


@pytest.fixture(scope="module")
def bfloat16_run():
    return moe_run("bfloat16")


@pytest.fixture(scope="module")
def topk_run():
    return moe_run("topk")


def _gradient_sizes(state):
    return [int(np.prod(p.shape)) for p in jax.tree.leaves(state.params)]


@pytest.mark.parametrize("run", ["bfloat16_run", "topk_run"])
def test_hlo_exchanges_gradients_in_the_requested_form(request, run):
    result = request.getfixturevalue(run)
    sizes = _gradient_sizes(result["initial"])
    c = result["config"].model
    # loss, aux_loss, dropped_fraction + expert counts of the MoE layers: the metrics.
    metric_elems = 3 + (c.num_layers - c.first_dense_layers) * c.num_experts
    for name in ("hlo", "compiled_hlo"):
        ops = collectives(result[name])
        reduced = [(d, int(np.prod(s))) for op, d, s in ops if op == "all-reduce"]
        float_reduced = sum(n for d, n in reduced if d in ("bf16", "f16", "f32", "f64"))
        if result["mode"] == "bfloat16":
            if name == "hlo":
                # Before backend passes: every gradient element in one bf16 all-reduce, and
                # no float32 all-reduce beyond the metrics.
                assert sum(n for d, n in reduced if d == "bf16") == sum(sizes)
                assert sum(n for d, n in reduced if d == "f32") <= metric_elems
            # Compiled (XLA:CPU widens 16-bit all-reduces to float32): still one reduction
            # of the gradients, none added by the partitioner.
            assert sum(sizes) <= float_reduced <= sum(sizes) + metric_elems
            assert not [op for op, _, _ in ops if op == "all-gather"]
        else:
            assert float_reduced <= metric_elems  # no dense gradient all-reduce
            # Values in bf16 and int32 indices, [devices, k] per leaf. XLA:CPU widens bf16
            # collectives to f32 when compiling (its bf16 float normalization).
            value_dtype = "bf16" if name == "hlo" else ("bf16", "f32")
            gathered = [(d, s) for op, d, s in ops if op == "all-gather"]
            values = sorted(s for d, s in gathered if d in value_dtype)
            indices = sorted(s for d, s in gathered if d == "s32")
            expected = sorted((8, comm.topk_count(n, 0.3)) for n in sizes)
            assert values == expected and indices == expected and len(gathered) == 2 * len(sizes)


@pytest.mark.parametrize("run", ["bfloat16_run", "topk_run"])
def test_training_with_16bit_or_topk_communication_lowers_the_loss(request, run):
    losses = request.getfixturevalue(run)["losses"]
    assert len(losses) == STEPS and np.all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < 0.85 * losses[0], losses


def test_checkpoint_round_trip_restores_the_residual_exactly(topk_run, tmp_path):
    state = topk_run["state"]
    config_dict = config_to_dict(topk_run["config"])
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(STEPS, state, {"position": 7}, config_dict)
    with Checkpointer(tmp_path) as ckpt:
        step, restored, data_state = ckpt.restore(topk_run["experiment"].abstract_state, config_dict)
    assert step == STEPS and data_state == {"position": 7}
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
    residual = jax.tree.leaves(restored.comm_state)
    assert all(r.shape[0] == 8 and r.sharding.spec[0] == ("data", "expert") for r in residual)  # the batch axes
    assert all(np.abs(np.asarray(r)).max() > 0 for r in residual)


def test_trainer_passes_the_settings_through_and_checkpoints_the_residual(tmp_path):
    config = small_config(steps=2, checkpoint_every=2)
    config.precision.update(MODES["topk"])
    summary = train_and_evaluate(config, str(tmp_path))
    assert summary["step"] == 2 and summary["skipped_steps"] == 0
    exp = Experiment.create(config, num_devices=8)
    with Checkpointer(tmp_path) as ckpt:
        _, restored, _ = ckpt.restore(exp.abstract_state, config_to_dict(exp.config))
    residual = jax.tree.leaves(restored.comm_state)
    params = jax.tree.leaves(restored.params)
    assert [r.shape for r in residual] == [(8,) + p.shape for p in params]
    # Only the top-k path writes the residual; each device keeps its own row.
    for r in map(np.asarray, residual):
        assert np.abs(r).max() > 0 and not all(np.array_equal(r[0], row) for row in r[1:])


# --------------------------------------------------------------------------- per-leaf layouts


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reduce_gradients_by_layout_on_a_2d_mesh(dtype):
    """A (data=2, expert=4) mesh, one gradient per device: the mean over all 8 devices,
    whole (all-reduce over both axes), reduce-scattered over data (each data row keeps
    half of dim 0) and summed over expert, summed over data only (an expert-sharded leaf),
    or left alone (already summed)."""
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), ("data", "expert"))
    rng = np.random.default_rng(0)
    g = rng.integers(-64, 64, (2, 4, 6, 3)).astype(np.float32) / 8  # exact in bfloat16
    layouts = {"whole": comm.LeafReduce(("data", "expert")),
               "zero": comm.LeafReduce(("expert",), "data", 0),
               "expert_param": comm.LeafReduce(("data",)),
               "done": comm.LeafReduce()}

    def per_device(x):
        out = comm.reduce_gradients({k: x[0, 0] for k in layouts}, layouts, 8, dtype)
        return {k: v[None, None] for k, v in out.items()}

    f = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("data", "expert"),
                              out_specs={"whole": P(None, None), "zero": P("data", None),
                                         "expert_param": P(None, "expert"), "done": P("data", "expert")},
                              check_vma=False))
    out = jax.device_get(f(g))
    ref = g.astype(np.float64) / 8
    np.testing.assert_array_equal(out["whole"][0, 0], ref.sum((0, 1)))
    # data row r keeps rows [3r, 3r + 3) of dim 0 of the sum over all devices.
    np.testing.assert_array_equal(np.concatenate([out["zero"][r, 0] for r in range(2)]), ref.sum((0, 1)))
    assert out["zero"].shape == (2, 1, 3, 3)
    for e in range(4):  # each expert column: the sum over data of its own gradients
        np.testing.assert_array_equal(out["expert_param"][0, e], ref[:, e].sum(0))
    np.testing.assert_array_equal(out["done"], ref)
