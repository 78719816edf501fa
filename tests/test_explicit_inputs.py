"""The model's inputs are all in sight (issue 29, point 2): what the train step, sampling
and diagnostics need are arguments of ``MoETransformer.__call__`` and the compile target is
an argument of its constructor; nothing is read from, or left in, process-wide state. And
the step's settings and per-device results travel as named structures (point 6)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from _bitwise import assert_bitwise_equal
from jaxmp import sharding, target
from jaxmp.models import MoETransformer, ModelConfig
from jaxmp.train.step import (DivergenceCheck, GradExchange, _DeviceGrads, _DeviceInputs,
                              forward_args)

CONFIG = ModelConfig(vocab_size=64, num_layers=2, d_model=64, num_heads=2, d_ff=128, max_len=16,
                     num_experts=4, top_k=2, d_expert=64, first_dense_layers=1,
                     capacity_factor=1.0)
TOKENS = (jnp.arange(32, dtype=jnp.int32).reshape(2, 16) * 7) % 64


@pytest.fixture(scope="module")
def model():
    return MoETransformer(CONFIG, "mixed_bf16", rngs=nnx.Rngs(0))


def test_the_compile_target_is_a_constructor_argument():
    """An H200 target, described by hand, picks cuDNN attention for bfloat16 and the Mosaic GPU
    grouped GEMM (132 SMs) for 64-aligned experts, with no compiling_for around the
    construction, and leaves this process's own target as it was."""
    h200 = target.Target("gpu", "NVIDIA H200", (9, 0), core_count=132, deviceless=True)
    before = target.current()
    m = nnx.eval_shape(lambda: MoETransformer(CONFIG, "mixed_bf16", rngs=nnx.Rngs(0),
                                              target=h200))
    assert [b.attn.implementation for b in m.blocks] == ["cudnn", "cudnn"]
    assert (m.blocks[1].moe.experts.moe_kernel, m.blocks[1].moe.experts.num_sms) == ("pallas", 132)
    assert target.current() == before and before.platform == jax.devices()[0].platform
    here = nnx.eval_shape(lambda: MoETransformer(CONFIG, "mixed_bf16", rngs=nnx.Rngs(0)))
    assert here.blocks[0].attn.implementation == "reference"  # on this CPU host
    assert here.blocks[1].moe.experts.moe_kernel == "ragged_dot"


def test_an_explicit_param_gather_sees_every_parameter_and_changes_no_bit(model):
    """A gather that only casts (what FSDP's all-gather does on one device) is handed every
    parameter with its logical axes and its module's compute dtype; the logits are those
    of the plain call, bitwise."""
    seen = []

    def gather(value, axes, dtype):
        seen.append((value.shape, tuple(axes), jnp.dtype(dtype)))
        return value.astype(dtype)

    plain, _ = model(TOKENS)
    gathered, _ = model(TOKENS, param_gather=gather)
    assert_bitwise_equal(plain, gathered)
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert sorted(s for s, _, _ in seen) == sorted(p.shape for p in params)
    assert all(len(axes) == len(shape) for shape, axes, _ in seen)
    # mixed_bf16 with the float32 islands: norms and routers in float32, the rest bfloat16.
    assert {d for _, _, d in seen} == {jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)}


def test_valid_length_gives_the_padding_no_expert_slot(model):
    """Capacity dispatch with ``valid_length=n`` on a padded buffer computes, at the first n
    positions, what the unpadded n-token sequence computes (causal attention, capacity of
    n tokens); without it the padding takes slots and the capacity is T's."""
    n = 5
    short, _ = model(TOKENS[:, :n])
    padded, _ = model(TOKENS.at[:, n:].set(0), valid_length=jnp.int32(n))
    np.testing.assert_allclose(np.asarray(padded[:, :n], np.float32),
                               np.asarray(short, np.float32), rtol=0, atol=0)


def test_operands_are_recorded_only_into_the_dict_given(model):
    found = {}
    model(TOKENS, operands=found)
    expected = {f"blocks/{i}/attn/{w}" for i in (0, 1) for w in ("wq", "wk", "wv", "wo")}
    expected |= {f"blocks/0/mlp/{w}" for w in ("w_gate", "w_up", "w_down")}
    expected |= {f"blocks/1/moe/experts/{w}" for w in ("w_gate", "w_up", "w_down")}
    expected |= {"head/kernel"}
    assert set(found) == expected
    x, w = found["head/kernel"]["x"], found["head/kernel"]["w"]
    assert x.shape == (2, 16, 64) and x.dtype == jnp.bfloat16
    assert w.shape == (64, 64) and w.dtype == jnp.float32  # the master weight as stored
    entries = {k: v["x"] for k, v in found.items()}
    model(TOKENS)  # a call without the dict leaves the one of the call before alone
    assert {k: v["x"] for k, v in found.items()} == entries


def test_a_bad_dispatch_dtype_is_named(model):
    with pytest.raises(ValueError, match=r"dispatch_dtype='e5m2'.*allowed: compute, e4m3"):
        model(TOKENS, dispatch_dtype="e5m2")


def _plan(strategy, expert, n=8):
    mesh = sharding.make_mesh(n, expert=expert)
    params = nnx.state(nnx.eval_shape(lambda: MoETransformer(CONFIG, "fp32", rngs=nnx.Rngs(0))),
                       nnx.Param)
    return sharding.StepPlan(mesh, sharding.layout(strategy, expert), params, params)


@pytest.mark.parametrize("strategy,expert,keys", [
    ("dp", 1, set()), ("zero1", 1, set()), ("fsdp", 1, {"param_gather"}),
    ("dp", 2, {"expert_axis", "dispatch_dtype"}),
    ("fsdp", 2, {"param_gather", "expert_axis", "dispatch_dtype"})])
def test_forward_args_are_those_the_plan_uses(strategy, expert, keys):
    args = forward_args(_plan(strategy, expert))
    assert set(args) == keys
    if "expert_axis" in keys:
        assert (args["expert_axis"], args["dispatch_dtype"]) == ("expert", "compute")


def test_the_named_structures_carry_their_specs():
    plan = _plan("zero1", 1)
    inputs, outputs = _DeviceInputs.specs(plan), _DeviceGrads.specs(plan)
    split = PartitionSpec(("data", "expert"))
    assert (inputs.batch, inputs.residual, inputs.loss_scale) == (split, split, PartitionSpec())
    assert inputs.params is plan.compute_specs and outputs.grads is plan.state_specs
    assert (outputs.finite, outputs.loss, outputs.residual) == (PartitionSpec(), PartitionSpec(),
                                                                split)
    # zero1: the masters' specs split "embed" over data, the forward's copy does not.
    flat_state = jax.tree.leaves(plan.state_specs, is_leaf=lambda s: isinstance(s, PartitionSpec))
    flat_compute = jax.tree.leaves(plan.compute_specs,
                                   is_leaf=lambda s: isinstance(s, PartitionSpec))
    assert any("data" in str(s) for s in flat_state)
    assert not any("data" in str(s) for s in flat_compute)
    assert GradExchange() == ("none", 0.3) and DivergenceCheck() == (3.0, 100.0)
