"""The trainer end to end on 8 CPU devices: training, resume, device-count invariance,
skipped steps, configs, the command line, and bad input."""
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _configs import ROOT, load_config, small_config
from jaxmp import sharding
from jaxmp.checkpoint import CheckpointError
from jaxmp.data import create_pipeline
from jaxmp.loss_scale import get_loss_scale
from jaxmp.models import MoETransformer, ModelConfig
from jaxmp.policy import get_policy_rules
from jaxmp.train_step import (create_train_state, make_lr_schedule, make_optimizer, make_train_step,
                              split_model)
from jaxmp.trainer import build, train_and_evaluate

def read_metrics(workdir, split="train"):
    lines = (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


@pytest.mark.slow
def test_resumed_run_matches_uninterrupted_run_loss_by_loss(tmp_path):
    """20 steps, stop, continue to 40 == 40 uninterrupted steps, on the 8-device mesh."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    summary = train_and_evaluate(small_config(steps=40, checkpoint_every=20), str(straight))
    train_and_evaluate(small_config(steps=20, checkpoint_every=20), str(resumed))
    train_and_evaluate(small_config(steps=40, checkpoint_every=20), str(resumed))

    a, b = read_metrics(straight), read_metrics(resumed)
    assert [r["step"] for r in a] == list(range(1, 41)) == [r["step"] for r in b]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["loss_scale"] for r in a] == [r["loss_scale"] for r in b]
    # The run itself: it learned, on every device, and wrote what a user looks at.
    assert summary["step"] == 40 and jax.device_count() == 8
    first, last = a[0]["loss"], np.mean([r["loss"] for r in a[-5:]])
    assert last < 0.9 * first
    for key in ("step", "split", "loss", "lr", "grad_norm", "loss_scale", "skipped_steps",
                "tokens_per_s", "expert_load_max", "expert_load_cv", "dropped_fraction"):
        assert key in a[-1], key
    assert read_metrics(straight, "eval")[-1]["step"] == 40
    assert list((straight / "tensorboard").iterdir())
    assert (straight / "sample.txt").read_text().startswith("def ")


@pytest.mark.slow
def test_tiny_moe_config_loss_falls_over_40_steps(tmp_path):
    """The acceptance bar: configs/tiny_moe.py as shipped (whole stdlib corpus), 40 steps."""
    config = load_config("tiny_moe")
    config.train.update(dict(steps=40, log_every=1, eval_every=40, checkpoint_every=40))
    train_and_evaluate(config, str(tmp_path))
    losses = [r["loss"] for r in read_metrics(tmp_path)]
    assert len(losses) == 40
    # First step vs the mean of the last five: more than 15% lower.
    assert np.mean(losses[-5:]) < 0.85 * losses[0], losses


def _steps_on_mesh(config, num_devices, batches, explicit=True):
    """Runs the train step on a mesh: with the mesh passed in (per-device shard_map and an
    explicit all-reduce, as the trainer does) or left to XLA's automatic partitioning."""
    mesh = sharding.make_mesh(num_devices)
    _, _, graphdef, state, optimizer, lr_schedule, _ = build(config)
    rules = sharding.DATA_PARALLEL_RULES
    state_sh = sharding.state_shardings(state, mesh, rules)
    batch_sh = sharding.batch_sharding(mesh, rules)
    step = jax.jit(make_train_step(graphdef, optimizer, lr_schedule=lr_schedule,
                                   bias_update_rate=config.model.bias_update_rate,
                                   grad_accum_steps=config.train.grad_accum_steps,
                                   mesh=mesh if explicit else None),
                   in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None))
    state = jax.device_put(state, state_sh)
    losses = []
    for batch in batches:
        state, metrics = step(state, jax.device_put(batch, batch_sh))
        losses.append(float(metrics["loss"]))
    return losses, state


def _batches(config, n):
    data = create_pipeline(config.data, global_batch_size=config.train.batch_size, seed=0)
    return [next(data.train_iter) for _ in range(n)]


def _assert_same_params(state_a, state_b):
    for a, b in zip(jax.tree.leaves(state_a.params), jax.tree.leaves(state_b.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("explicit", [True, False], ids=["explicit_reduce", "xla_auto"])
def test_one_device_and_eight_devices_give_the_same_losses(explicit):
    config = small_config()
    config.precision.policy = "fp32"
    batches = _batches(config, 3)
    one, state1 = _steps_on_mesh(config, 1, batches, explicit)
    eight, state8 = _steps_on_mesh(config, 8, batches, explicit)
    np.testing.assert_allclose(eight, one, rtol=2e-5)
    _assert_same_params(state1, state8)


def test_gradient_accumulation_matches_the_full_batch():
    """Two micro-batches of 8 == one batch of 16 (equal sizes: mean of means = mean)."""
    config = small_config()
    config.precision.policy = "fp32"
    batches = _batches(config, 2)
    full, state_full = _steps_on_mesh(config, 8, batches)
    config.train.grad_accum_steps = 2
    config.train.batch_size = 16
    accum, state_accum = _steps_on_mesh(config, 8, batches)
    # The first loss is the same forward pass; the second follows one identical update.
    np.testing.assert_allclose(accum, full, rtol=1e-5)
    _assert_same_params(state_full, state_accum)


def test_overflowing_step_never_reaches_params_optimizer_state_or_router_biases():
    """float16 compute with a loss scale of 2**40: every scaled gradient is inf."""
    config = small_config()
    config.precision.policy = "mixed_fp16"
    config.precision.loss_scale = "dynamic:init=2**40,growth_interval=100"
    batches = _batches(config, 1)
    _, _, graphdef, state0, optimizer, lr_schedule, _ = build(config)
    step = jax.jit(make_train_step(graphdef, optimizer, lr_schedule=lr_schedule, bias_update_rate=0.5))
    state1, metrics = step(state0, batches[0])
    assert not bool(metrics["grads_finite"])
    assert int(state1.skipped_steps) == 1 and int(state1.step) == 1
    assert float(state1.loss_scale.loss_scale) == 2.0 ** 39
    for name in ("params", "opt_state", "biases"):
        before, after = jax.tree.leaves(getattr(state0, name)), jax.tree.leaves(getattr(state1, name))
        assert len(before) == len(after) > 0
        for x, y in zip(before, after):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_router_biases_move_toward_balance_on_a_finite_step():
    config = small_config()
    batches = _batches(config, 1)
    _, _, graphdef, state0, optimizer, lr_schedule, _ = build(config)
    gamma = 0.5
    step = jax.jit(make_train_step(graphdef, optimizer, lr_schedule=lr_schedule, bias_update_rate=gamma))
    state1, metrics = step(state0, batches[0])
    counts = np.asarray(metrics["expert_counts"], np.float64)
    (bias,) = [np.asarray(b) for b in jax.tree.leaves(state1.biases)]  # one MoE layer
    expected = gamma * np.sign(counts[0].mean() - counts[0])  # biases start at zero
    np.testing.assert_array_equal(bias, expected.astype(np.float32))


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "configs").glob("*.py")))
def test_every_config_builds_and_traces_under_eval_shape(name):
    config = load_config(name)
    model_config = ModelConfig.from_config(config.model)
    rules = get_policy_rules(config.precision.policy)
    optimizer = make_optimizer(config.optim, config.train.steps)

    def init():
        model = MoETransformer(model_config, rules, rngs=nnx.Rngs(0))
        return create_train_state(model, optimizer, get_loss_scale(config.precision.loss_scale), 0)[1]

    abstract = jax.eval_shape(init)
    params = jax.tree.leaves(abstract.params)
    assert all(p.dtype == jnp.float32 for p in params)  # float32 master weights
    # Trace one full train step on the config's own batch shape, without running it.
    graphdef = split_model(nnx.eval_shape(lambda: MoETransformer(model_config, rules, rngs=nnx.Rngs(0))))[0]
    step = make_train_step(graphdef, optimizer,
                           lr_schedule=make_lr_schedule(config.optim, config.train.steps),
                           bias_update_rate=model_config.bias_update_rate)
    batch = {k: jax.ShapeDtypeStruct((config.train.batch_size, config.data.seq_len), jnp.int32)
             for k in ("inputs", "targets")}
    new_state, metrics = jax.eval_shape(step, abstract, batch)
    assert metrics["loss"].dtype == jnp.float32
    assert jax.tree.structure(new_state) == jax.tree.structure(abstract)


@pytest.mark.parametrize("overrides, match", [
    (dict(train=dict(batch_size=12)), r"12 sequences.*not divisible by the 8 devices"),
    (dict(train=dict(grad_accum_steps=3)), r"batch_size=16 is not divisible by train.grad_accum_steps=3"),
    (dict(model=dict(num_heads=3)), r"num_heads=3"),
    (dict(model=dict(top_k=5)), r"top_k=5"),
    (dict(precision=dict(policy="mixed_bf16; router: p=f32,c=fp17")), r"fp17"),
    (dict(precision=dict(loss_scale="dynamic:growth=2")), r"growth"),
    (dict(data=dict(path="/nonexistent/dir/*.txt")), r"/nonexistent/dir/\*\.txt"),
    (dict(data=dict(seq_len=64)), r"seq_len=64 exceeds model.max_len=32"),
    (dict(train=dict(steps=0)), r"train.steps must be >= 1"),
    (dict(optim=dict(learning_rate=-1.0)), r"optim.learning_rate=-1.0"),
    (dict(optim=dict(warmup_steps=-3)), r"optim.warmup_steps=-3"),
    (dict(optim=dict(mu_dtype="bfloat17")), r"optim.mu_dtype.*bfloat17"),
    (dict(model=dict(vocab_size=200)), r"vocab_size=200 is smaller"),
])
def test_bad_input_is_a_clear_error_before_training(tmp_path, overrides, match):
    config = small_config()
    for section, values in overrides.items():
        config[section].update(values)
    with pytest.raises(ValueError, match=match):
        train_and_evaluate(config, str(tmp_path))
    assert not (tmp_path / "checkpoints").exists()


def test_corpus_shorter_than_one_sequence_is_a_clear_error(tmp_path):
    (tmp_path / "a.txt").write_text("too short")
    config = small_config()
    config.data.update(dict(path=str(tmp_path / "*.txt"), num_eval_batches=0))
    with pytest.raises(ValueError, match=r"33"):  # seq_len + 1 tokens needed
        train_and_evaluate(config, str(tmp_path / "run"))


def test_corrupt_or_incompatible_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    config = small_config(steps=2, checkpoint_every=2)
    train_and_evaluate(config, str(tmp_path))
    # Another model shape in the same workdir.
    other = small_config(steps=4)
    other.model.d_model = 64
    with pytest.raises(CheckpointError, match=r"model\.d_model: saved 32, now 64"):
        train_and_evaluate(other, str(tmp_path))
    # Damage every file of the saved state.
    for f in (tmp_path / "checkpoints" / "2" / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="step 2 .* cannot be restored.*corrupt.*new --workdir"):
        train_and_evaluate(small_config(steps=4), str(tmp_path))
    assert read_metrics(tmp_path)[-1]["step"] == 2  # nothing was trained past the checkpoint


def test_command_line_trains_and_resumes(tmp_path):
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/tiny_moe.py"),
           "--workdir", str(tmp_path), "--config.model.num_layers=1", "--config.model.first_dense_layers=0",
           "--config.data.max_tokens=50000", "--config.data.num_eval_batches=1",
           "--config.train.log_every=1", "--config.train.sample_tokens=2"]
    env = dict(os.environ, JAX_DISABLE_MOST_OPTIMIZATIONS="1")  # the 8-device XLA_FLAGS are inherited
    first = subprocess.run(cmd + ["--config.train.steps=2"], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "parameters" in first.stdout and "policy" in first.stdout and "loss scale" in first.stdout
    again = subprocess.run(cmd + ["--config.train.steps=3"], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed" in again.stdout and "at step 2" in again.stdout
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    bad = subprocess.run(cmd + ["--config.precision.policy=mixed_fp17"], capture_output=True,
                         text=True, cwd=tmp_path, env=env)
    assert bad.returncode != 0 and "mixed_fp17" in bad.stderr


def test_a_run_whose_every_step_is_skipped_stops_with_a_clear_error(tmp_path):
    """Learning rate 1e30: the first update makes the weights huge (still finite), after
    which every gradient overflows; those steps are skipped and the trainer stops
    instead of idling."""
    from jaxmp.trainer import TrainingStalled
    config = small_config(steps=20, max_consecutive_skips=3, checkpoint_every=1)
    config.optim.update(dict(learning_rate=1e30, warmup_steps=0, grad_clip=0.0))
    with pytest.raises(TrainingStalled, match="last 3 steps .* were all skipped"):
        train_and_evaluate(config, str(tmp_path))
    records = read_metrics(tmp_path)
    assert [r["skipped_steps"] for r in records[-3:]] == [1, 2, 3]
    assert not any(r["applied"] for r in records[-3:])
    assert len(records) == 4 and records[0]["applied"]


def test_fresh_run_does_not_append_to_an_old_runs_metrics(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 7, "split": "train", "loss": 1.0}\n')
    train_and_evaluate(small_config(steps=2), str(tmp_path))
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_a_policy_rule_that_matches_no_module_is_named_in_a_warning(tmp_path, capsys):
    config = small_config(steps=1)
    config.precision.policy = "mixed_bf16; rooter: fp32"
    train_and_evaluate(config, str(tmp_path))
    out = capsys.readouterr().out
    assert "warning: precision.policy rule 'rooter' matches no module" in out
    assert "blocks/{i}/moe/router" in out
