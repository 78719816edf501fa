"""Scanned layers and rematerialization (jaxmp.models.transformer): the scanned model with
the unscanned model's weights gives the same loss and gradients; per-layer rules split
stacks; logical axes, router biases (one per layer) and checkpoints keep working; every
remat setting gives the same loss and gradients as "none" and saves no more bytes."""
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _configs import small_config
from jaxmp import ops, sharding
from jaxmp.analysis import accounting
from jaxmp.analysis.residuals import saved_residuals
from jaxmp.models import ModelConfig, MoETransformer
from jaxmp.models.transformer import REMAT_POLICIES, layer_stacks
from jaxmp.precision._paths import path_name
from jaxmp.precision.policy import get_policy_rules, with_float32_islands
from jaxmp.train import CheckpointError, Experiment, train_and_evaluate
from jaxmp.train.experiment import module_paths, unmatched_rules
from jaxmp.train.data import create_pipeline

# 1 dense layer, then 2 MoE layers (router, 4 experts top-2, 1 shared expert).
KW = dict(vocab_size=64, num_layers=3, d_model=32, num_heads=4, d_ff=64, max_len=16,
          num_experts=4, num_shared_experts=1, top_k=2, d_expert=16, first_dense_layers=1)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 16)), jnp.int32)


def model(rules="fp32", **overrides):
    return MoETransformer(ModelConfig(**{**KW, **overrides}), rules, rngs=nnx.Rngs(0))


def loss_and_grads(m):
    graphdef, params, rest = nnx.split(m, nnx.Param, ...)

    def loss(params):
        logits, aux = nnx.merge(graphdef, params, rest)(TOKENS)
        return ops.cross_entropy(logits, jnp.roll(TOKENS, -1, axis=1)) + aux["aux_loss"], aux

    (value, aux), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return float(value), aux, {path_name(p): np.asarray(g, np.float64)
                               for p, g in jax.tree_util.tree_flatten_with_path(grads)[0]}


def stacked_like(unscanned: dict, stacks) -> dict:
    """The unscanned leaves ``blocks/{i}/rest`` stacked as the scanned layout's
    ``stacks/{s}/rest``, by path (written here, independently of the model)."""
    out = {}
    for name, x in unscanned.items():
        m = re.fullmatch(r"blocks/(\d+)/(.*)", name)
        if not m:
            out[name] = x
            continue
        layer, rest = int(m.group(1)), m.group(2)
        s = next(s for s, layers in enumerate(stacks) if layer in layers)
        out.setdefault(f"stacks/{s}/{rest}", [None] * len(stacks[s]))[stacks[s].index(layer)] = x
    return {k: (np.stack(v) if isinstance(v, list) else v) for k, v in out.items()}


def leaves(tree) -> dict:
    return {path_name(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


# GPT-OSS's pattern: MoE on every layer, windows alternating local and global.
ALTERNATING = dict(num_layers=4, first_dense_layers=0, sliding_window=6,
                   layer_types=("sliding_attention", "full_attention") * 2)


@pytest.mark.parametrize("rules, layers, stacks, rows", [
    ("fp32", {}, ((0,), (1, 2)), [0, 1]),
    ("mixed_bf16", {}, ((0,), (1, 2)), [0, 1]),
    # a repeating pattern: one scan of two steps over interleaved stacks, whose
    # expert_counts rows follow routers() (stack order: layers 0, 2, then 1, 3)
    ("fp32", ALTERNATING, ((0, 2), (1, 3)), [0, 2, 1, 3]),
])
def test_scanned_and_unscanned_models_give_the_same_loss_and_gradients(rules, layers, stacks,
                                                                       rows):
    plain, scanned = model(rules, **layers), model(rules, scan_layers=True, **layers)
    assert layer_stacks(plain.config, plain.rules) == stacks
    assert [b.layers for b in scanned.stacks] == list(stacks)
    # Same seed, same creation order: the scanned weights are the unscanned ones stacked.
    want = stacked_like(leaves(nnx.state(plain)), stacks)
    got = leaves(nnx.state(scanned))
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    loss_a, aux_a, grads_a = loss_and_grads(plain)
    loss_b, aux_b, grads_b = loss_and_grads(scanned)
    assert sum(n for _, n in scanned.routers()) == len(rows) == aux_a["expert_counts"].shape[0]
    np.testing.assert_array_equal(np.asarray(aux_b["expert_counts"]),
                                  np.asarray(aux_a["expert_counts"])[rows])
    rtol = 1e-6 if rules == "fp32" else 2 ** -7
    np.testing.assert_allclose(loss_b, loss_a, rtol=rtol)
    want = stacked_like(grads_a, stacks)
    assert sorted(grads_b) == sorted(want)
    for name, g in want.items():
        np.testing.assert_allclose(grads_b[name], g, rtol=rtol * 10, atol=rtol * np.abs(g).max(),
                                   err_msg=name)


@pytest.mark.parametrize("types, want", [
    # Gemma 3's five local layers and one global, 62 layers (Gemma-3-27B): ten periods and
    # a run of two, 7 layer bodies in one of two equal cuts, where runs would be 21
    ((("s",) * 5 + ("f",)) * 10 + ("s",) * 2, 7),
    # 34 layers (Gemma-3-4B): a cut of 7 bodies saves less than half of the 11 runs
    ((("s",) * 5 + ("f",)) * 5 + ("s",) * 4,
     tuple(x for k in range(5) for x in (tuple(range(6 * k, 6 * k + 5)), (6 * k + 5,)))
     + ((30, 31, 32, 33),)),
    # two periods only: the runs, 5 bodies, beat the period's 7
    (("s",) * 5 + ("f",) + ("s",) * 5 + ("f",) + ("s",) * 2,
     ((0, 1, 2, 3, 4), (5,), (6, 7, 8, 9, 10), (11,), (12, 13))),
    # Qwen3-Next's three linear layers and one full: 4 bodies for 12 runs
    (("l", "l", "l", "f") * 6, tuple(tuple(range(p, 24, 4)) for p in range(4))),
    # three periods: 4 bodies do not halve 6 runs
    (("l", "l", "l", "f") * 3, ((0, 1, 2), (3,), (4, 5, 6), (7,), (8, 9, 10), (11,))),
    # GPT-OSS's alternating windows
    (("s", "f") * 4, ((0, 2, 4, 6), (1, 3, 5, 7))),
    # no repetition worth a period: runs of one kind
    (("s",) * 4 + ("f",) + ("s",) * 4 + ("f",), ((0, 1, 2, 3), (4,), (5, 6, 7, 8), (9,))),
    (("s", "s", "f", "f", "f"), ((0, 1), (2, 3, 4))),
])
def test_layer_stacks_trace_the_fewest_layer_bodies(types, want):
    names = {"s": "sliding_attention", "f": "full_attention", "l": "linear_attention"}
    config = ModelConfig(vocab_size=64, num_layers=len(types), d_model=32, num_heads=4, d_ff=64,
                         max_len=16, sliding_window=4, layer_types=tuple(names[t] for t in types),
                         linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                         linear_value_head_dim=8)
    stacks = layer_stacks(config, get_policy_rules("fp32"))
    if isinstance(want, int):  # the number of stacks, each one layer body
        assert len(stacks) == want
    else:
        assert stacks == want
    assert sorted(i for s in stacks for i in s) == list(range(len(types)))
    for s in stacks:  # one kind of layer per stack, strided evenly
        assert len({types[i] for i in s}) == 1 and len(set(np.diff(s))) <= 1
    if isinstance(want, int):  # two scans: one of the period, one of the run of two locals
        period = [s for s in stacks if len(s) == 10]
        assert len(period) == 6 and all(set(np.diff(s)) == {6} for s in period)


def test_a_per_layer_rule_keeps_its_meaning_by_splitting_the_stack():
    rules = "mixed_bf16; blocks/2/moe/router: bf16"
    m = nnx.eval_shape(lambda: model(rules, scan_layers=True, num_layers=4))
    assert layer_stacks(m.config, m.rules) == ((0,), (1,), (2,), (3,))
    kernels = [b.moe.router.kernel for b in m.stacks if hasattr(b, "moe")]
    assert [k.dtype for k in kernels] == [jnp.float32, jnp.bfloat16, jnp.float32]
    assert [k.shape for k in kernels] == [(1, 32, 4)] * 3
    # A rule naming layer 3's experts only: layers 1-2 stay one stack.
    rules3 = with_float32_islands(get_policy_rules("mixed_bf16; blocks/3/moe/experts: fp32"),
                                  ("router", "norm"))
    assert layer_stacks(m.config, rules3) == ((0,), (1, 2), (3,))
    # Rules still match per-layer paths: the rule is found, no warning.
    paths = module_paths(m)
    assert "blocks/2/moe/router" in paths and "blocks/3/moe/shared_experts" in paths
    assert sorted(paths) == sorted(module_paths(nnx.eval_shape(lambda: model(rules, num_layers=4))))
    assert unmatched_rules(get_policy_rules(rules), paths) == []
    assert m.stacks[2].moe.router.path == "blocks/2/moe/router"


def test_stacked_variables_carry_the_layers_axis_and_shard_by_the_rules():
    exp = Experiment.create(small_config(model=dict(num_layers=3, first_dense_layers=1, scan_layers=True)),
                            num_devices=8)
    state = exp.abstract_state
    specs = {path_name(p): s.spec for p, s in jax.tree_util.tree_flatten_with_path(exp.state_shardings.params)[0]}
    assert any(n.startswith("stacks/1/moe/experts") for n in specs)
    for name, spec in specs.items():  # replicated (dp), but the routed experts' expert axis
        want = [None] * len(spec)
        if "/moe/experts/" in name:
            want[1 if name.startswith("stacks/") else 0] = "expert"  # [layers,] expert, ...
        assert spec == jax.sharding.PartitionSpec(*want), (name, spec)
    m = nnx.eval_shape(lambda: MoETransformer(exp.model_config, exp.settings.rules, rngs=nnx.Rngs(0)))
    variables = [v for _, v in nnx.iter_graph(m) if isinstance(v, nnx.Variable)]
    stacked = [v for _, v in nnx.iter_graph(m.stacks) if isinstance(v, nnx.Variable)]
    assert stacked and all(v.get_metadata()["out_sharding"][0] == "layers" for v in stacked)
    assert all(len(v.get_metadata()["out_sharding"]) == v.get_value().ndim for v in variables)
    wq = m.stacks[1].attn.wq
    assert wq.shape == (2, 32, 2, 16)
    spec = sharding.state_shardings(nnx.state(m.stacks[1].attn), exp.mesh, sharding.FSDP_RULES)
    assert spec["wq"].get_value().spec == jax.sharding.PartitionSpec(None, "data", None, None)
    bias = jax.tree.leaves(state.biases)
    assert [b.shape for b in bias] == [(2, 4)]  # one row per MoE layer of the stack


def _batch(config):
    data = create_pipeline(config.data, global_batch_size=config.train.batch_size, seed=0)
    return next(data.train_iter)


@pytest.mark.parametrize("layers", [dict(num_layers=3, first_dense_layers=1),
                                    dict(ALTERNATING, sliding_window=8)])
def test_router_biases_of_a_stack_move_per_layer(layers):
    gamma = 0.5
    config = small_config(model=dict(layers, scan_layers=True, bias_update_rate=gamma))
    exp = Experiment.create(config, num_devices=8)
    state, metrics = exp.train_step(exp.init_state(), exp.batch_to_device(_batch(config)))
    counts = np.asarray(metrics["expert_counts"], np.float64)
    moe_layers = layers["num_layers"] - layers["first_dense_layers"]
    assert counts.shape == (moe_layers, 4)
    # the leaves in stack order take the rows in turn (interleaved stacks: 0, 2 then 1, 3)
    bias = np.concatenate([np.asarray(state.biases["stacks"][s]["moe"]["router"]["bias"].get_value())
                           for s in sorted(state.biases["stacks"])])
    want = gamma * np.sign(counts.mean(-1, keepdims=True) - counts)  # biases start at 0
    np.testing.assert_array_equal(bias, want.astype(np.float32))


@pytest.mark.parametrize("recorded", [True, False])
def test_a_checkpoint_in_the_runs_layout_resumes_and_exports_in_the_interleaved_one(
        tmp_path, monkeypatch, recorded):
    """A scanned run saved with one stack per run of identical layers (the layout before
    460f087; ``recorded=False``: without the stacks in its meta, as those checkpoints
    are) resumes and exports under interleaved stacks: the export's weights are bitwise
    the ones the old layout exports, and the resumed step is the old layout's step."""
    from safetensors.numpy import load_file

    from jaxmp import export
    from jaxmp.models import transformer
    from jaxmp.train import experiment, loop

    config = small_config(model=dict(ALTERNATING, scan_layers=True, bias_update_rate=0.5),
                          steps=2, checkpoint_every=2, sample_tokens=0)
    config.precision.policy = "fp32"
    def runs(config, rules, interleave=True):
        return layer_stacks(config, rules, interleave=False)

    with monkeypatch.context() as m:  # the old layout, everywhere
        m.setattr(transformer, "layer_stacks", runs)
        m.setattr(experiment, "layer_stacks", runs)
        if not recorded:
            m.setattr(loop, "SAVED_STACKS", "not_recorded")
        train_and_evaluate(config, str(tmp_path / "run"))
        assert export.main(["--workdir", str(tmp_path / "run"), "--out", str(tmp_path / "old")]) == 0
        config.train.steps = 3  # the step the old layout takes next, in a copy of the run
        shutil.copytree(tmp_path / "run", tmp_path / "run_old")
        old = train_and_evaluate(config, str(tmp_path / "run_old"))
        assert export.main(["--workdir", str(tmp_path / "run_old"),
                            "--out", str(tmp_path / "old3")]) == 0
    exp = Experiment.create(config, num_devices=1)
    assert exp.stacks() == ((0, 2), (1, 3)) != exp.stacks(interleave=False)
    assert export.main(["--workdir", str(tmp_path / "run"), "--out", str(tmp_path / "new")]) == 0

    def per_layer(directory, stacks):  # stacks.{s}.rest [layers of s, ...] -> layer {i}.rest
        out = {}
        for name, x in load_file(str(tmp_path / directory / "model.safetensors")).items():
            m = re.fullmatch(r"stacks\.(\d+)\.(.*)", name)
            if m is None:
                out[name] = x
                continue
            for j, layer in enumerate(stacks[int(m.group(1))]):
                out[f"layer {layer}.{m.group(2)}"] = x[j]
        return out

    before = per_layer("old", ((0,), (1,), (2,), (3,)))
    after = per_layer("new", ((0, 2), (1, 3)))
    assert sorted(before) == sorted(after)
    for name in before:  # master weights, router biases: per layer, bitwise
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    new = train_and_evaluate(config, str(tmp_path / "run"))  # moments and biases moved too
    assert new["step"] == old["step"] == 3
    np.testing.assert_allclose(new["train_losses"][-1], old["train_losses"][-1], rtol=1e-6)
    assert export.main(["--workdir", str(tmp_path / "run"), "--out", str(tmp_path / "new3")]) == 0
    before, after = per_layer("old3", ((0,), (1,), (2,), (3,))), per_layer("new3", ((0, 2), (1, 3)))
    second = per_layer("old", ((0,), (1,), (2,), (3,)))
    for name in before:  # the third step's update read the moved Adam moments
        np.testing.assert_allclose(after[name], before[name], rtol=1e-5, atol=1e-7, err_msg=name)
    assert sum(not np.array_equal(before[n], second[n]) for n in before) > len(before) // 2


def test_a_scanned_run_resumes_and_the_other_layout_is_a_clear_error(tmp_path):
    scanned = small_config(model=dict(scan_layers=True), steps=2, checkpoint_every=2)
    train_and_evaluate(scanned, str(tmp_path))
    scanned.train.steps = 3
    summary = train_and_evaluate(scanned, str(tmp_path))  # restores the stacked state
    assert summary["step"] == 3
    # Sampling from the stacks, from the default prompt (the first eval document's start).
    data = create_pipeline(scanned.data, global_batch_size=scanned.train.batch_size, seed=scanned.seed)
    prompt = data.tokenizer.decode(data.sample_prompt)
    assert (tmp_path / "sample.txt").read_text().startswith(prompt) and prompt
    plain = small_config(steps=4)
    with pytest.raises(CheckpointError, match=r"model\.scan_layers: saved True, now False"):
        train_and_evaluate(plain, str(tmp_path))


def test_the_report_reads_a_scanned_model():
    """Same state bytes and gradient all-reduce bytes in both layouts (the same
    parameters, stacked), read from the trainer's own compiled step."""
    rows = {scan: accounting.account_mode(small_config(model=dict(scan_layers=scan)), "fp32", 8)
            for scan in (False, True)}
    for key in ("params_bytes", "grads_bytes", "opt_state_bytes", "grad_allreduce_bytes"):
        assert rows[True][key] == rows[False][key], key
    assert rows[True]["grad_allreduce_bytes"] == rows[True]["params_bytes"]  # float32, once
    assert rows[True]["activation_bytes"] > 0


def residual_bytes(m):
    graphdef, params, rest = nnx.split(m, nnx.Param, ...)

    def loss(params, rest, toks):
        logits, aux = nnx.merge(graphdef, params, rest)(toks)
        return ops.cross_entropy(logits, jnp.roll(toks, -1, axis=1)) + aux["aux_loss"]

    res = saved_residuals(loss, params, rest, jax.ShapeDtypeStruct(TOKENS.shape, jnp.int32))
    return sum(r.nbytes for r in res if r.kind == "computed")


@pytest.fixture(scope="module")
def no_remat():
    assert REMAT_POLICIES == ("none", "attention", "dots_saveable", "full")  # each one tested below
    return {scan: (loss_and_grads(model("mixed_bf16", scan_layers=scan)),
                   residual_bytes(nnx.eval_shape(lambda: model("mixed_bf16", scan_layers=scan))))
            for scan in (False, True)}


@pytest.mark.parametrize("remat, scan", [("attention", False), ("dots_saveable", False), ("full", False),
                                         ("full", True)])
def test_every_remat_setting_gives_the_same_loss_and_gradients_and_saves_no_more(no_remat, remat, scan):
    (loss0, aux0, grads0), bytes0 = no_remat[scan]
    m = model("mixed_bf16", scan_layers=scan, remat=remat)
    loss, aux, grads = loss_and_grads(m)
    # The recomputation redoes the same operations on the same inputs.
    np.testing.assert_allclose(loss, loss0, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(aux["expert_counts"]), np.asarray(aux0["expert_counts"]))
    for name, g in grads0.items():
        np.testing.assert_allclose(grads[name], g, rtol=1e-5, atol=1e-6 * np.abs(g).max(), err_msg=name)
    saved = residual_bytes(nnx.eval_shape(lambda: model("mixed_bf16", scan_layers=scan, remat=remat)))
    assert saved < bytes0
    if remat == "full":  # by hand: per layer only its float32 [B, T, d] input (mixed_bf16 outputs float32)
        blocks = 3 * TOKENS.size * 32 * 4
        assert saved == blocks + outside_the_blocks()


def outside_the_blocks():
    """Bytes the embedding, final norm, head and loss keep, by hand: the token indices
    (int32 [B, T, 1]), the final norm's float32 input and per-row rsqrt, the head's
    bf16 input, the bf16 logits, the int32 labels and the float32 per-token logsumexp."""
    b, t, d, v = TOKENS.shape[0], TOKENS.shape[1], 32, 64
    return b * t * 4 + (b * t * d * 4 + b * t * 4) + b * t * d * 2 + b * t * v * 2 + 2 * b * t * 4
