"""Scale-out on 8 CPU devices: dp, zero1 and fsdp and expert parallelism give one
device's losses; a skipped step leaves every shard bitwise; checkpoints reshard across
strategies and device counts; the partitioned program holds the collectives each
strategy promises, in the dtypes it promises; the report's per-device bytes follow the
ZeRO formulas (Rajbhandari et al. 2020, section 5), computed here from the parameter
shapes."""
import json
import pathlib
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from _bitwise import assert_bitwise_equal, bits
from _configs import small_config
from _train_py import run_train_py
from jaxmp.analysis import accounting
from jaxmp.train import Experiment, train_and_evaluate
from jaxmp.train.data import create_pipeline
from jaxmp.train.hooks import _say

STEPS = 10
# float32 sums over 8 devices add in another order than one device's; 10 Adam steps.
RTOL = 1e-5


def config_for(strategy="dp", expert=1, policy="fp32", **precision):
    # capacity_factor = num_experts / top_k (4 / 2): an expert's slots hold every token
    # of its group, so no token is ever dropped and the capacity path equals dropless.
    config = small_config(model=dict(capacity_factor=2.0))
    config.precision.policy = policy
    config.precision.update(precision)
    config.parallel.strategy, config.parallel.expert = strategy, expert
    return config


@pytest.fixture(scope="module")
def batches():
    data = create_pipeline(config_for().data, global_batch_size=16, seed=0)
    return [next(data.train_iter) for _ in range(STEPS)]


def run(config, batches, num_devices=8):
    exp = Experiment.create(config, num_devices=num_devices)
    state, losses = exp.init_state(), []
    for b in batches:
        state, metrics = exp.train_step(state, exp.batch_to_device(b))
        losses.append(float(metrics["loss"]))
    return losses, exp, state


@pytest.fixture(scope="module")
def one_device(batches):
    return run(config_for(), batches, num_devices=1)[0]


@pytest.mark.parametrize("strategy,expert", [("dp", 1), ("zero1", 1), ("fsdp", 1), ("zero1", 2), ("fsdp", 4)])
def test_every_strategy_gives_one_devices_losses(strategy, expert, batches, one_device):
    losses, exp, state = run(config_for(strategy, expert), batches)
    assert exp.mesh.shape == {"data": 8 // expert, "expert": expert}
    np.testing.assert_allclose(losses, one_device, rtol=RTOL)
    # The state really is laid out as the strategy says.
    wq = state.params["blocks"][0]["attn"]["wq"].get_value()  # [embed, heads, head_dim]
    if strategy == "dp":
        assert wq.sharding.shard_shape(wq.shape) == wq.shape
    else:
        assert wq.sharding.shard_shape(wq.shape)[0] == wq.shape[0] // (8 // expert)
    if strategy == "zero1":
        copy = state.compute_params["blocks"][0]["attn"]["wq"].get_value()
        assert copy.shape == wq.shape and copy.sharding.shard_shape(copy.shape) == copy.shape


# The newer families' layers, scanned as interleaved stacks (issue 43): GPT-OSS's sinks,
# biases, clamped SwiGLU and alternating windows; Qwen3-Next's Gated DeltaNet, gated
# attention and gated shared expert.
NEW_FAMILY_LAYERS = {
    "gpt_oss": dict(num_layers=4, first_dense_layers=0, num_shared_experts=0, qkv_bias=True,
                    o_bias=True, attention_sinks=True, sliding_window=8, moe_bias=True,
                    expert_activation="clamped_swiglu", swiglu_limit=0.5,
                    layer_types=("sliding_attention", "full_attention") * 2),
    "qwen3_next": dict(num_layers=4, first_dense_layers=0, qk_norm=True, norm_plus_one=True,
                       attention_output_gate=True, rope_dim=8, shared_expert_gate=True,
                       layer_types=("linear_attention", "full_attention") * 2,
                       linear_num_key_heads=1, linear_num_value_heads=2,
                       linear_key_head_dim=16, linear_value_head_dim=16),
}


@pytest.mark.parametrize("family, strategy, expert", [("gpt_oss", "fsdp", 2),
                                                      ("qwen3_next", "zero1", 2)])
def test_the_newer_families_layers_give_one_devices_losses_sharded(family, strategy, expert,
                                                                    batches):
    def config(strategy="dp", expert=1):
        c = config_for(strategy, expert)
        c.model.update(dict(NEW_FAMILY_LAYERS[family], scan_layers=True))
        return c

    ref = run(config(), batches[:3], num_devices=1)[0]
    losses, exp, _ = run(config(strategy, expert), batches[:3])
    assert exp.stacks() == ((0, 2), (1, 3))  # interleaved: one scan over the period
    np.testing.assert_allclose(losses, ref, rtol=RTOL)


def test_bf16_reduce_scatter_is_within_bf16_rounding(batches, one_device):
    """zero1 reducing in bfloat16: each device's share of a gradient is rounded to bf16
    (relative error <= 2**-9) and summed over 8 devices in bf16 (<= 3 more roundings in
    a tree); after 10 Adam steps, whose normalised updates damp relative gradient error,
    the losses stay within 1e-3 of float32's."""
    losses = run(config_for("zero1", grad_reduce_dtype="bfloat16"), batches)[0]
    np.testing.assert_allclose(losses, one_device, rtol=1e-3)
    assert losses != one_device  # it did reduce in bf16


@pytest.mark.parametrize("strategy,expert", [("zero1", 1), ("fsdp", 1), ("dp", 2)])
def test_an_overflowing_step_leaves_every_shard_bitwise(strategy, expert, batches):
    """float16 with a loss scale of 2**40: every scaled gradient is inf, on every device."""
    config = config_for(strategy, expert, policy="mixed_fp16", loss_scale="dynamic:init=2**40,growth_interval=100")
    config.model.bias_update_rate = 0.5
    exp = Experiment.create(config, num_devices=8)
    state0 = exp.init_state()
    before = jax.device_get(state0)  # the step donates state0
    state1, metrics = exp.train_step(state0, exp.batch_to_device(batches[0]))
    after = jax.device_get(state1)
    assert not bool(metrics["applied"]) and int(after.skipped_steps) == 1
    assert float(after.loss_scale.loss_scale) == 2.0 ** 39
    names = ("params", "opt_state", "biases") + (("compute_params",) if strategy == "zero1" else ())
    for name in names:
        assert_bitwise_equal(getattr(before, name), getattr(after, name))
    # One verdict: the loss scale and the router biases are the same on every device.
    for leaf in [state1.loss_scale.loss_scale] + jax.tree.leaves(state1.biases):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        for s in shards[1:]:
            np.testing.assert_array_equal(bits(s), bits(shards[0]))


def rows(workdir):
    lines = (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == "train"]


def test_a_zero1_checkpoint_resumes_on_zero1_and_reshards_onto_fsdp_with_fewer_devices(tmp_path, capsys,
                                                                                        one_device):
    def cfg(strategy, steps, expert=1):
        c = config_for(strategy, expert)
        c.train.update(dict(steps=steps, checkpoint_every=2, eval_every=0, sample_tokens=0))
        return c

    same, other = tmp_path / "same", tmp_path / "other"
    train_and_evaluate(cfg("zero1", 2), str(same), num_devices=8)
    shutil.copytree(same, other)
    capsys.readouterr()
    train_and_evaluate(cfg("zero1", 4), str(same), num_devices=8)
    assert "resharded" not in capsys.readouterr().out
    train_and_evaluate(cfg("fsdp", 4, expert=2), str(other), num_devices=4)
    assert ("saved with parallel.strategy=zero1, parallel.expert=1 on 8 devices and is resharded onto "
            "parallel.strategy=fsdp, parallel.expert=2 on 4 devices") in capsys.readouterr().out
    for workdir in (same, other):  # the trainer's batches are the fixture's (seed 0)
        got = rows(workdir)
        assert [r["step"] for r in got] == [1, 2, 3, 4]
        np.testing.assert_allclose([r["loss"] for r in got], one_device[:4], rtol=RTOL)


# ----------------------------------------------------------------------------- the partitioned program


def leaves(exp):
    """``[(path, global size, compute itemsize)]`` of the parameters, from their shapes
    and the float32 islands (router and norms) of the mixed_bf16 rules."""
    out = []
    for path, var in nnx.to_flat_state(exp.abstract_state.params):
        name = "/".join(map(str, path))
        island = "router" in name or "norm" in name
        out.append((name, int(np.prod(var.get_value().shape)), 4 if island else 2))
    return out


@pytest.fixture(scope="module", params=["dp", "zero1", "fsdp", "fsdp+scan"])
def accounted(request):
    strategy, _, scan = request.param.partition("+")
    config = config_for(strategy, policy="fp32")
    if scan:  # a stack of 3 MoE layers: FSDP gathers and reduce-scatters inside the loop
        config.model.update(dict(scan_layers=True, num_layers=4))
    row = accounting.account_mode(config, "bf16_allreduce", 8)
    exp = Experiment.create(accounting.mode_config(config, "bf16_allreduce"), num_devices=8)
    return strategy, row, exp


@pytest.mark.xdist_group("parallel_accounting")
def test_persistent_bytes_per_device_follow_the_zero_formulas(accounted):
    strategy, row, exp = accounted
    ls = leaves(exp)
    p = sum(n for _, n, _ in ls)
    n_dev = 8
    # Every parameter of this model has an embed axis, which zero1 and fsdp split 8 ways.
    master = 4 * p if strategy == "dp" else 4 * p // n_dev
    assert row["params_bytes"] == master
    # Adam's two float32 moments laid out like the master, plus int32 step counts.
    assert 2 * master <= row["opt_state_bytes"] <= 2 * master + 64
    copy = sum(n * size for _, n, size in ls) if strategy == "zero1" else 0
    assert row["compute_copy_bytes"] == copy
    persistent = row["params_bytes"] + row["opt_state_bytes"] + row["compute_copy_bytes"]
    islands = sum(n * 2 for _, n, size in ls if size == 4)  # their copy is float32, not bf16
    if strategy == "zero1":
        assert persistent <= 2 * p + islands + 12 * p / n_dev + 64
    if strategy == "fsdp":
        assert persistent <= 12 * p / n_dev + 64


@pytest.mark.xdist_group("parallel_accounting")
def test_each_strategy_moves_what_it_promises_in_the_dtype_it_promises(accounted):
    """Whole buffers per device per step, from the HLO after SPMD partitioning."""
    strategy, row, exp = accounted
    ls = leaves(exp)
    p = sum(n for _, n, _ in ls)
    coll = row["collective_bytes"]
    grads_bf16 = 2 * p  # every gradient reduced once, in bfloat16 (bf16_allreduce mode)
    if strategy == "dp":
        assert set(coll) == {"all-reduce"}
        assert coll["all-reduce"]["bf16"] == grads_bf16
    else:
        assert "reduce-scatter" in coll and "bf16" in coll["reduce-scatter"]
        assert coll["reduce-scatter"] == {"bf16": grads_bf16}
        gathered = sum(n * size for _, n, size in ls)  # the parameters in their compute dtypes
        bf16 = sum(n * size for _, n, size in ls if size == 2)
        got = coll["all-gather"]
        if strategy == "zero1":  # the new parameters, once, in the compute dtype
            assert got["bf16"] == bf16 and got.get("f32", 0) == gathered - bf16
        else:  # fsdp: gathered for the forward pass and again for the backward pass,
            # except the embedding table, whose backward needs only the token ids
            embed = next(n for name, n, _ in ls if name.startswith("embed"))
            assert got["bf16"] == 2 * bf16 - 2 * embed
    assert row["grad_allreduce_bytes"] == grads_bf16


@pytest.mark.xdist_group("parallel_accounting")
def test_expert_parallel_tokens_travel_by_all_to_all_in_the_compute_dtype():
    config = config_for("dp", 4, policy="mixed_bf16")
    row = accounting.account_mode(config, "mixed_bf16", 8)
    a2a = row["collective_bytes"]["all-to-all"]
    assert set(a2a) == {"bf16"}
    # Per MoE layer, forward and backward, tokens there and back: 4 exchanges of a
    # device's [sequences, experts, capacity, d_model] slots; capacity per sequence.
    m = config.model
    sequences, seq_len = 16 // 8, config.data.seq_len
    capacity = int(np.ceil(m.capacity_factor * seq_len * m.top_k / m.num_experts))
    moe_layers = m.num_layers - m.first_dense_layers
    assert a2a["bf16"] == moe_layers * 4 * sequences * m.num_experts * capacity * m.d_model * 2
    # dp with expert parallelism: the parameters are never gathered.
    assert "all-gather" not in row["collective_bytes"] or "bf16" not in row["collective_bytes"]["all-gather"]


# ----------------------------------------------------------------------------- the command line


@pytest.mark.parametrize("override,message", [
    ("parallel.strategy=zero2", "parallel.strategy='zero2' is not allowed; it must be dp | zero1 | "
                                "fsdp"),
    ("parallel.expert=0", "parallel.expert=0 is not allowed; it must be an integer >= 1"),
    ("parallel.expert=3", "parallel.expert=3 does not divide the 8 devices; allowed: 1, 2, 4, 8"),
])
def test_parallel_overrides_reach_a_config_file_that_predates_them(override, message, capsys):
    """configs/tiny_moe.py has no ``parallel`` section: the file is completed with every
    default before the command line's overrides, which then fail (or work) by value.
    train.py's flag parsing and main in this process (tests/_train_py.py)."""
    status, out, err = run_train_py(capsys, "/nonexistent/never-created", override)
    assert status != 0 and "Traceback" not in err, err[-2000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1] == f"train.py: error: {message}", err[-2000:]
    assert not pathlib.Path("/nonexistent/never-created").exists()


def test_only_a_process_whose_bar_is_shown_writes_lines_above_it():
    class Bar:
        def __init__(self, disable):
            self.disable, self.lines = disable, []

        def write(self, text):
            self.lines.append(text)

    shown, hidden = Bar(False), Bar(True)
    _say(shown, "step 6: eval loss 4.6")
    _say(hidden, "step 6: eval loss 4.6")
    assert shown.lines == ["step 6: eval loss 4.6"] and hidden.lines == []
