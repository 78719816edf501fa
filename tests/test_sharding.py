"""Logical axes -> mesh axes on 8 host CPU devices: data parallelism and FSDP tables."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxmp import sharding
from jaxmp.precision.comm import LeafReduce
from jaxmp.models import ModelConfig, MoETransformer


@pytest.fixture(scope="module")
def mesh():
    return sharding.make_mesh(8)


def test_make_mesh(mesh):
    assert mesh.axis_names == ("data",) and mesh.devices.shape == (8,)
    assert sharding.make_mesh(2, axis_name="x").shape == {"x": 2}
    for bad in (0, 9):
        with pytest.raises(ValueError, match=f"num_devices={bad} must be an integer in \\[1, 8\\]"):
            sharding.make_mesh(bad)


def test_the_steps_run_by_the_plan_built_once_in_create(monkeypatch):
    from _configs import small_config
    from jaxmp.train import Experiment

    config = small_config(model=dict(capacity_factor=2.0))
    config.parallel.strategy = "zero1"
    exp = Experiment.create(config, num_devices=8)
    plan = exp.plan
    assert plan.layout.strategy == "zero1" and plan.axes == ("data", "expert") and plan.total == 8
    # zero1: the master weights' embed axis is split over "data", the forward's copy is
    # whole, so a gradient leaf with an embed axis is reduce-scattered along it; it is
    # summed over the batch axes it is not split over (a routed expert's "expert" axis
    # is on mesh axis "expert"): read from each parameter's logical axes.
    is_reduce = lambda x: isinstance(x, LeafReduce)  # noqa: E731
    reduces = jax.tree.leaves(plan.reduces, is_leaf=is_reduce)
    params = jax.tree.leaves(exp.abstract_state.params,
                             is_leaf=lambda x: isinstance(x, nnx.Variable))
    assert len(reduces) == len(params) > 0
    for r, var in zip(reduces, params):
        axes = tuple(var.get_metadata().get("out_sharding") or ())
        scatter = "data" if "embed" in axes else None
        sums = tuple(a for a in ("data", "expert") if a != scatter and a not in axes)
        assert r == LeafReduce(sums, scatter, axes.index("embed") if scatter else 0)
    monkeypatch.setattr(sharding.StepPlan, "__init__", lambda *a, **k: pytest.fail("plan rebuilt"))
    state, batch = exp.abstract_state, exp.abstract_batch()
    jax.eval_shape(exp.train_step, state, batch)
    jax.eval_shape(exp.eval_step, state, batch)


def test_logical_to_sharding(mesh):
    dp, fsdp = sharding.DATA_PARALLEL_RULES, sharding.FSDP_RULES
    assert sharding.logical_to_sharding(("batch", None), mesh, dp).spec == P("data", None)
    assert sharding.logical_to_sharding(("expert", "embed", "expert_mlp"), mesh, dp).spec == P(None, None, None)
    assert sharding.logical_to_sharding(("vocab", "embed"), mesh, fsdp).spec == P(None, "data")
    assert sharding.logical_to_sharding(("batch",), mesh, {"batch": ("data",)}).spec == P(("data",))
    # The scanned layout's stacked-layer axis is replicated in both tables.
    for rules in (dp, fsdp):
        assert sharding.logical_to_sharding(("layers", "embed", "heads"), mesh, rules).spec == \
            P(None, None if rules is dp else "data", None)
    with pytest.raises(ValueError, match="logical axis 'stage' has no rule"):
        sharding.logical_to_sharding(("stage",), mesh, dp)
    with pytest.raises(ValueError, match="mesh axis 'model' is not in the mesh"):
        sharding.logical_to_sharding(("heads",), mesh, {"heads": "model"})
    with pytest.raises(ValueError, match="mesh axis 'data' would shard two dimensions"):
        sharding.logical_to_sharding(("batch", "embed"), mesh, fsdp)


CONFIG = dict(vocab_size=64, num_layers=2, d_model=32, num_heads=4, d_ff=64, max_len=8,
              num_experts=4, num_shared_experts=1, top_k=2, d_expert=16, first_dense_layers=1)

# Which dimension of each parameter carries the "embed" axis, from the model's layout.
EMBED_DIM = {"table": 1, "kernel": 0, "wq": 0, "wk": 0, "wv": 0, "wo": 2, "scale": 0,
             "w_gate": -2, "w_up": -2, "w_down": -1}


def test_state_shardings(mesh):
    model = nnx.eval_shape(lambda: MoETransformer(ModelConfig(**CONFIG), "mixed_bf16", rngs=nnx.Rngs(0)))
    state = nnx.state(model)
    dp = sharding.state_shardings(state, mesh, sharding.DATA_PARALLEL_RULES)
    fsdp = sharding.state_shardings(state, mesh, sharding.FSDP_RULES)
    assert jax.tree.structure(dp) == jax.tree.structure(state)
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    flat = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_var)[0]
    assert len(flat) == 2 + 1 + 2 * 6 + 3 + (2 + 3 + 3)  # embed/head, final norm, blocks
    for (path, var), v_dp, v_fsdp in zip(flat, jax.tree.leaves(dp, is_leaf=is_var),
                                         jax.tree.leaves(fsdp, is_leaf=is_var)):
        name, leaf = path[-1].key, var.get_value()
        s_dp, s_fsdp = v_dp.get_value(), v_fsdp.get_value()
        assert s_dp.is_fully_replicated and s_dp.mesh == mesh
        if name == "bias":  # router bias: ("expert",), replicated in both tables
            assert s_fsdp.spec == P(None)
            continue
        want = [None] * leaf.ndim
        want[EMBED_DIM[name]] = "data"
        assert s_fsdp.spec == P(*want), jax.tree_util.keystr(path)
    # Leaves without sharding metadata (plain arrays, untagged variables) are replicated.
    other = sharding.state_shardings({"a": jnp.zeros(3), "v": nnx.Variable(jnp.zeros(2))}, mesh,
                                     sharding.FSDP_RULES)
    assert other["a"].spec == P() and other["v"].get_value().spec == P()


@pytest.mark.parametrize("rules, capacity_factor", [
    (sharding.DATA_PARALLEL_RULES, None), (sharding.FSDP_RULES, 1.0)])
def test_sharded_forward_equals_unsharded(mesh, rules, capacity_factor):
    config = ModelConfig(**CONFIG, capacity_factor=capacity_factor)
    model = MoETransformer(config, "fp32", rngs=nnx.Rngs(0))
    toks = jnp.asarray(np.random.default_rng(0).integers(0, 64, (16, 8)), jnp.int32)
    graphdef, state = nnx.split(model)

    def fwd(state, toks):
        logits, aux = nnx.merge(graphdef, state)(toks)
        return logits, aux["dropped_fraction"]

    want, want_dropped = jax.jit(fwd)(state, toks)
    state_sh = sharding.state_shardings(state, mesh, rules)
    batch_sh = sharding.batch_sharding(mesh, rules)
    def constraints():
        eqns = jax.make_jaxpr(fwd)(state, toks).jaxpr.eqns
        return [e.params["sharding"].spec for e in eqns if e.primitive.name == "sharding_constraint"]

    assert constraints() == []  # no annotation outside use_rules
    with sharding.use_rules(mesh, rules):  # activations constrained to the batch split too
        assert constraints() == [P("data", None, None)] * (1 + config.num_layers)
        got, dropped = jax.jit(fwd, in_shardings=(state_sh, batch_sh))(
            jax.device_put(state, state_sh), jax.device_put(toks, batch_sh))
    assert got.sharding.spec[0] == "data"
    assert {s.data.shape for s in got.addressable_shards} == {(2, 8, 64)}
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(dropped), float(want_dropped))
    if capacity_factor:
        assert float(dropped) > 0  # capacity ceil(8 * 2 / 4) = 4 slots: some are dropped
