"""The trainer end to end on 8 CPU devices: one gradient path from one Experiment, resume,
device-count invariance, skipped steps, configs, the command line, and bad input."""
import json
import os
import pathlib
import subprocess
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from _bitwise import assert_bitwise_equal
from _configs import ROOT, load_config, small_config
from _train_py import run_train_py
from jaxmp.train import CheckpointError, Experiment, TrainingStalled, train_and_evaluate
from jaxmp.train.data import create_pipeline
from jaxmp.train.metrics import read_metrics as _read_metrics

sys.path.insert(0, str(ROOT))  # benchmarks/ is not an installed package
from benchmarks import _common as bench_common  # noqa: E402


XDIST_PER_TEST = True  # no shared fixture: test by test over both workers (tests/conftest.py)


def read_metrics(workdir, split="train"):
    return _read_metrics(pathlib.Path(workdir) / "metrics.jsonl", split)


@pytest.mark.slow
def test_resumed_run_matches_uninterrupted_run_loss_by_loss(tmp_path):
    """6 steps, stop, continue to 12 == 12 uninterrupted steps, on the 8-device mesh
    (each strategy's resume: tests/test_parallel.py; learning: the next test)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    summary = train_and_evaluate(small_config(steps=12, checkpoint_every=6), str(straight))
    train_and_evaluate(small_config(steps=6, checkpoint_every=6), str(resumed))
    train_and_evaluate(small_config(steps=12, checkpoint_every=6), str(resumed))

    a, b = read_metrics(straight), read_metrics(resumed)
    assert [r["step"] for r in a] == list(range(1, 13)) == [r["step"] for r in b]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["loss_scale"] for r in a] == [r["loss_scale"] for r in b]
    # The run itself: on every device, and it wrote what a user looks at.
    assert summary["step"] == 12 and jax.device_count() == 8
    for key in ("step", "split", "loss", "lr", "grad_norm", "loss_scale", "skipped_steps",
                "consecutive_skips", "tokens_per_s", "expert_load_max", "expert_load_cv",
                "dropped_fraction"):
        assert key in a[-1], key
    assert read_metrics(straight, "eval")[-1]["step"] == 12
    assert list((straight / "tensorboard").iterdir())
    # The default prompt is the start of the first eval document (train.sample_prompt="").
    config = small_config(steps=12)
    data = create_pipeline(config.data, global_batch_size=config.train.batch_size, seed=config.seed)
    prompt = data.tokenizer.decode(data.sample_prompt)
    sample = (straight / "sample.txt").read_text()
    assert prompt and sample.startswith(prompt) and len(sample) > len(prompt)


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


def _batches(config, n):
    data = create_pipeline(config.data, global_batch_size=config.train.batch_size, seed=0)
    return [next(data.train_iter) for _ in range(n)]


def _run(config, num_devices, batches):
    """The trainer's own step (its Experiment) on a mesh of ``num_devices``."""
    exp = Experiment.create(config, num_devices=num_devices)
    state = exp.init_state()
    losses = []
    for batch in batches:
        state, metrics = exp.train_step(state, exp.batch_to_device(batch))
        losses.append(float(metrics["loss"]))
    return losses, state


def _assert_same_params(state_a, state_b):
    for a, b in zip(jax.tree.leaves(state_a.params), jax.tree.leaves(state_b.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_gradient_accumulation_matches_the_full_batch():
    """Two micro-batches of 8 == one batch of 16 (equal sizes: mean of means = mean)."""
    config = small_config()
    config.precision.policy = "fp32"
    batches = _batches(config, 2)
    full, state_full = _run(config, 8, batches)
    config.train.grad_accum_steps = 2
    accum, state_accum = _run(config, 8, batches)
    # The first loss is the same forward pass; the second follows one identical update.
    np.testing.assert_allclose(accum, full, rtol=1e-5)
    _assert_same_params(state_full, state_accum)


@pytest.mark.parametrize("num_devices", [1, 8])
def test_overflowing_step_is_bitwise_a_no_op_on_the_trainers_path(num_devices):
    """float16 compute with a loss scale of 2**40: every scaled gradient is inf. The
    trainer's own compiled step, on a 1- and an 8-device mesh."""
    config = small_config()
    config.precision.policy = "mixed_fp16"
    config.precision.loss_scale = "dynamic:init=2**40,growth_interval=100"
    config.model.bias_update_rate = 0.5
    exp = Experiment.create(config, num_devices=num_devices)
    state0 = exp.init_state()
    before = jax.device_get(state0)  # the step donates state0
    state1, metrics = exp.train_step(state0, exp.batch_to_device(_batches(config, 1)[0]))
    after = jax.device_get(state1)
    assert not bool(metrics["grads_finite"]) and not bool(metrics["applied"])
    assert int(after.skipped_steps) == 1 and int(after.consecutive_skips) == 1 and int(after.step) == 1
    assert float(after.loss_scale.loss_scale) == 2.0 ** 39
    for name in ("params", "opt_state", "biases"):
        assert_bitwise_equal(getattr(before, name), getattr(after, name))


def test_consecutive_skips_count_up_and_reset_exactly():
    """Steps 1-2 overflow (scale 2**40, then 2**39), step 3 with the scale backed off far
    enough is applied: the counter reads 1, 2, 0."""
    config = small_config()
    config.precision.policy = "mixed_fp16"
    config.precision.loss_scale = "dynamic:init=2**40,backoff_factor=2**-30,min=1"
    exp = Experiment.create(config, num_devices=8)
    state = exp.init_state()
    seen = []
    for batch in _batches(config, 3):
        state, metrics = exp.train_step(state, exp.batch_to_device(batch))
        seen.append((bool(metrics["applied"]), int(metrics["consecutive_skips"]),
                     int(metrics["skipped_steps"])))
    # 2**40 -> 2**10 after one backoff of 2**-30: finite from the second step on.
    assert seen == [(False, 1, 1), (True, 0, 1), (True, 0, 1)]


def test_router_biases_move_toward_balance_on_a_finite_step():
    config = small_config()
    gamma = 0.5
    config.model.bias_update_rate = gamma
    exp = Experiment.create(config, num_devices=8)
    state1, metrics = exp.train_step(exp.init_state(), exp.batch_to_device(_batches(config, 1)[0]))
    counts = np.asarray(metrics["expert_counts"], np.float64)
    (bias,) = [np.asarray(b) for b in jax.tree.leaves(state1.biases)]  # one MoE layer
    expected = gamma * np.sign(counts[0].mean() - counts[0])  # biases start at zero
    np.testing.assert_array_equal(bias, expected.astype(np.float32))


def test_benchmarks_and_the_trainer_compile_the_same_step():
    """benchmarks/_common.experiment is the trainer's Experiment on one device: the same
    jitted function lowers to the same program for the same config."""
    config = small_config()
    trainer_exp = Experiment.create(config, num_devices=1)
    bench_exp = bench_common.experiment(config)
    assert type(bench_exp) is Experiment
    a = trainer_exp.train_step.lower(trainer_exp.abstract_state, trainer_exp.abstract_batch()).as_text()
    b = bench_exp.train_step.lower(bench_exp.abstract_state, bench_exp.abstract_batch()).as_text()
    assert a == b
    assert "stablehlo.all_reduce" in a  # the explicit gradient reduction of the one path


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "configs").glob("*.py")))
def test_every_config_builds_and_traces_under_eval_shape(name, tmp_path):
    overrides = ()
    if name == "finetune":  # no architecture of its own: a released config.json, shrunk
        hf = json.loads((ROOT / "configs" / "hf" / "Llama-3.1-8B.json").read_text())
        hf.update(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=2, vocab_size=256,
                  max_position_embeddings=512)
        (tmp_path / "config.json").write_text(json.dumps(hf))
        overrides = (f"model.init_from={tmp_path}",)  # as train.py's --config.model.init_from
    config = load_config(name, overrides)
    exp = Experiment.create(config, num_devices=8)
    params = jax.tree.leaves(exp.abstract_state.params)
    assert all(p.dtype == jnp.float32 for p in params)  # float32 master weights
    # Trace one full train step on the config's own batch shape, without running it.
    new_state, metrics = jax.eval_shape(exp.train_step, exp.abstract_state, exp.abstract_batch())
    assert metrics["loss"].dtype == jnp.float32
    assert jax.tree.structure(new_state) == jax.tree.structure(exp.abstract_state)


@pytest.mark.parametrize("overrides, match", [
    (dict(train=dict(batch_size=12)), r"12 sequences.*not divisible by the 8 devices"),
    (dict(train=dict(grad_accum_steps=3)), r"batch_size=16 is not divisible by train.grad_accum_steps=3"),
    (dict(train=dict(batch_size=1e8)), r"train.batch_size=100000000.0 is not allowed; it must be an integer"),
    (dict(model=dict(num_heads=3)), r"num_heads=3"),
    (dict(model=dict(top_k=5)), r"top_k=5"),
    (dict(model=dict(aux_loss_weight=float("inf"))), r"model.aux_loss_weight=inf .*finite"),
    (dict(model=dict(rope_theta=float("inf"))), r"model.rope_theta=inf .*finite"),
    (dict(precision=dict(policy="mixed_bf16; router: p=f32,c=fp17")), r"fp17"),
    (dict(precision=dict(loss_scale="dynamic:growth=2")), r"growth"),
    (dict(data=dict(path="/nonexistent/dir/*.txt")), r"/nonexistent/dir/\*\.txt"),
    (dict(data=dict(seq_len=64)), r"seq_len=64 exceeds model.max_len=32"),
    (dict(data=dict(text_field="")), r"data.text_field='' is not allowed"),
    (dict(train=dict(steps=0)), r"train.steps=0 is not allowed"),
    (dict(train=dict(stesp=10)), r"unknown config key 'train.stesp' in the config; did you mean 'train.steps'"),
    (dict(optim=dict(learning_rate=-1.0)), r"optim.learning_rate=-1.0"),
    (dict(optim=dict(warmup_steps=-3)), r"optim.warmup_steps=-3"),
    (dict(optim=dict(mu_dtype="bfloat17")), r"optim.mu_dtype.*bfloat17"),
    (dict(model=dict(vocab_size=200)), r"vocab_size=200 is smaller"),
    (dict(model=dict(remat="some")), r"model.remat='some' is not allowed; it must be one of none, "
                                     r"attention, dots_saveable, full"),
    (dict(model=dict(scan_layers=1)), r"model.scan_layers=1 is not allowed; it must be True or False"),
    # Off a GPU the fused kernel cannot run: one line before any work, not an XLA crash.
    *([(dict(model=dict(attention="cudnn")), r"model.attention='cudnn' cannot run here")]
      if jax.default_backend() != "gpu" else []),
])
def test_bad_input_is_a_clear_error_before_training(tmp_path, overrides, match):
    config = small_config().to_dict()  # a plain dict takes any type, as a config file may
    for section, values in overrides.items():
        config[section].update(values)
    with pytest.raises(ValueError, match=match):
        train_and_evaluate(ml_collections.ConfigDict(config), str(tmp_path))
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
    # Refused before the corpus is read and the step compiled (issue 45: it came after both).
    from jaxmp.train import experiment, loop

    def never(self):
        raise AssertionError("the corpus was read before the settings were compared")

    with mock.patch.object(experiment.Experiment, "data", property(never)), \
            mock.patch.object(loop, "Compilation", side_effect=AssertionError("compiled")):
        with pytest.raises(CheckpointError, match=r"model\.d_model: saved 32, now 64"):
            train_and_evaluate(other, str(tmp_path))
    # Damage every file of the saved state.
    for f in (tmp_path / "checkpoints" / "2" / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* can be restored \(step 2: it does "
                                              r"not read as this model's state .*\); use a new --workdir"):
        train_and_evaluate(small_config(steps=4), str(tmp_path))
    assert read_metrics(tmp_path)[-1]["step"] == 2  # nothing was trained past the checkpoint
    assert (tmp_path / "checkpoints" / "2").is_dir()  # no good one to fall back to: nothing moved


ENV = dict(os.environ, JAX_DISABLE_MOST_OPTIMIZATIONS="1")  # the 8-device XLA_FLAGS are inherited
CLI = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/tiny_moe.py"),
       "--config.model.num_layers=1", "--config.model.first_dense_layers=0",
       "--config.data.max_tokens=50000", "--config.data.num_eval_batches=1",
       "--config.train.log_every=1", "--config.train.sample_tokens=2"]


def test_command_line_trains_and_resumes(tmp_path, capsys):
    """The first run a real train.py process; the rerun and a bad value train.py's main in
    this process (tests/_train_py.py: the same exit status and lines)."""
    cmd = CLI + ["--workdir", str(tmp_path)]
    first = subprocess.run(cmd + ["--config.train.steps=2"], capture_output=True, text=True, cwd=tmp_path, env=ENV)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "parameters" in first.stdout and "policy" in first.stdout and "loss scale" in first.stdout
    overrides = [a.removeprefix("--config.") for a in CLI[4:]]
    status, out, err = run_train_py(capsys, tmp_path, *overrides, "train.steps=3")
    assert status == 0, err[-3000:]
    assert "resumed" in out and "at step 2" in out
    # The banner comes first, then where the run resumed from.
    assert out.index("jaxmp trainer") < out.index("resumed from")
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    status, out, err = run_train_py(capsys, tmp_path, *overrides, "precision.policy=mixed_fp17")
    assert status != 0 and "mixed_fp17" in err


def test_a_config_key_typo_on_the_command_line_is_one_line_naming_the_closest_key(tmp_path, capsys):
    """train.py's flag parsing and main in this process (tests/_train_py.py)."""
    overrides = [a.removeprefix("--config.") for a in CLI[4:]]
    status, out, err = run_train_py(capsys, tmp_path, *overrides, "train.stesp=100")
    assert status != 0
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == ["train.py: error: unknown config key 'train.stesp' on the command line; did "
                     "you mean 'train.steps'? (the keys are listed in "
                     "jaxmp.train.config.default_config)"], err
    assert not (tmp_path / "checkpoints").exists()


def test_a_run_whose_every_step_is_skipped_stops_with_a_clear_error(tmp_path):
    """Learning rate 1e30: the first update makes the weights huge (still finite), after
    which every gradient overflows; those steps are skipped and the trainer stops
    instead of idling."""
    config = small_config(steps=20, max_consecutive_skips=3, checkpoint_every=1)
    config.optim.update(dict(learning_rate=1e30, warmup_steps=0, grad_clip=0.0))
    with pytest.raises(TrainingStalled, match="last 3 steps .* were all skipped"):
        train_and_evaluate(config, str(tmp_path))
    records = read_metrics(tmp_path)
    assert [r["skipped_steps"] for r in records[-3:]] == [1, 2, 3]
    assert [r["consecutive_skips"] for r in records[-3:]] == [1, 2, 3]
    assert not any(r["applied"] for r in records[-3:])
    assert len(records) == 4 and records[0]["applied"]
    # Strict JSON: the skipped steps' non-finite values are null, not NaN.
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    for line in text.splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


def test_a_run_that_ends_in_skipped_steps_fails_below_the_stall_limit(tmp_path):
    """Learning rate 1e30 over 6 steps with the stall guard's limit at 100: step 1 applies,
    steps 2-6 are skipped. Before, the run exited 0 with its checkpoint (as a run at
    optim.learning_rate=1e10 did with 39 of 40 steps skipped); a run whose last steps, at
    least half of them, were all skipped now fails and says so."""
    config = small_config(steps=6, max_consecutive_skips=100, checkpoint_every=1)
    config.optim.update(dict(learning_rate=1e30, warmup_steps=0, grad_clip=0.0))
    with pytest.raises(TrainingStalled, match=r"^the run ended in skipped steps: the last 5 "
                                              r"steps \(to step 6\) were all skipped.*not "
                                              r"changed since step 1"):
        train_and_evaluate(config, str(tmp_path))
    records = read_metrics(tmp_path)
    assert [r["applied"] for r in records] == [True] + [False] * 5


def test_the_stall_guard_is_exact_at_a_longer_log_interval(tmp_path):
    """Logging every 5 steps: the guard stops at the first check after 3 skips, and the
    message gives the exact run of skipped steps (4 at step 5: steps 2-5)."""
    config = small_config(steps=20, max_consecutive_skips=3, log_every=5)
    config.optim.update(dict(learning_rate=1e30, warmup_steps=0, grad_clip=0.0))
    with pytest.raises(TrainingStalled, match=r"the last 4 steps \(to step 5\) were all skipped.*"
                                              r"not changed since step 1"):
        train_and_evaluate(config, str(tmp_path))


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


@pytest.mark.parametrize("body, cause", [
    ("def get_config(:\n", r" has a syntax error at line 1: "),
    ("def get_config():\n    raise RuntimeError('no such preset')\n",
     r": get_config\(\) raised RuntimeError: no such preset"),
    ("def get_config():\n    return 42\n", r": get_config\(\) returned 42 \(a int\); it must return an "
                                          r"ml_collections.ConfigDict"),
    ("import no_such_module_anywhere\n", r" fails to run: ModuleNotFoundError: No module named"),
])
def test_a_config_file_that_fails_is_one_line_naming_the_file(tmp_path, body, cause):
    from jaxmp.train.config import load_config
    file = tmp_path / "bad.py"
    file.write_text(body)
    with pytest.raises(ValueError, match=rf"^config file {str(file)!r}" + cause) as e:
        load_config(file)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("override, match", [
    ("train.steps=100000000000000000000", r"train.steps=100000000000000000000 is not allowed; it must be an "
                                          r"integer in \[1, 2\*\*31 - 1\]"),
    ("precision.policy=", r"precision.policy='' is not allowed; it must name a preset"),
    ("model.max_len=100000000000", r"model.max_len=100000000000 is not allowed; it must be an integer "
                                    r"in \[1, 2\*\*31 - 1\]"),
])
def test_values_beyond_what_the_run_can_hold_are_refused(tmp_path, override, match):
    from jaxmp.train.config import apply_overrides
    config = apply_overrides(small_config(), [override])
    with pytest.raises(ValueError, match=match):
        train_and_evaluate(config, str(tmp_path))
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "1e999", "NaN"])
def test_a_non_finite_number_on_the_command_line_is_refused_as_such(text):
    from jaxmp.train.config import apply_overrides
    with pytest.raises(ValueError, match=rf"config override optim.learning_rate={text!r}: the value must "
                                         rf"be a finite number \(the key holds 0.003\)"):
        apply_overrides(small_config(), [f"optim.learning_rate={text}"])


def test_a_max_len_whose_sample_cannot_fit_is_refused_before_any_work(tmp_path, monkeypatch):
    """A device of 64 MiB (patched in): the sample's context of max_len = 2**17 tokens
    needs at least 2**17 x (4 + 2 x 257) B = 64.75 MiB (int32 ids + bfloat16 logits) and,
    on CPU (model.attention=auto is the reference path, which materializes its scores),
    2 heads x (2**17)**2 x 4 B = 128 GiB of one layer's float32 scores."""
    from jaxmp.train import loop
    from jaxmp.train import preflight
    monkeypatch.setattr(preflight, "device_memory", lambda device: (64 << 20, "a 64 MiB test device"))
    config = small_config()
    config.model.max_len = 2**17
    need = (2**17 * (4 + 2 * 257) + 2 * (2**17) ** 2 * 4) / 2**30
    with pytest.raises(ValueError, match=rf"model.max_len=131072: the closing sample runs the model over "
                                         rf"131072 tokens, which needs at least {need:.2f} GiB .* but a device "
                                         rf"has 0.06 GiB \(a 64 MiB test device\); lower model.max_len"):
        train_and_evaluate(config, str(tmp_path))
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("override, message", [
    ("data.path=/no/such/corpus", "data.path '/no/such/corpus' does not exist"),
    ("train.steps=-1", "train.steps=-1 is not allowed"),
    ("parallel.strategy=zero9", "parallel.strategy='zero9' is not allowed"),
])
def test_bad_input_fails_before_the_step_compiles_or_the_workdir_is_made(
        tmp_path, monkeypatch, override, message):
    from jaxmp.train import loop

    def no_compile(*args, **kwargs):
        raise AssertionError("the step started compiling")

    monkeypatch.setattr(loop, "Compilation", no_compile)
    workdir = tmp_path / "run"
    with pytest.raises(ValueError, match=message):
        train_and_evaluate(load_config("tiny_moe", [f"--config.{override}"]), str(workdir))
    assert not workdir.exists()
