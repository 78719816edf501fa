"""Checkpoint verification: the per-array checksums, the config comparison on resume, and
a top-k residual moved between device counts."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from _configs import small_config
from jaxmp.train import Checkpointer, Experiment, train_and_evaluate
from jaxmp.train.checkpoint import config_differences, state_checksums
from jaxmp.train.config import config_to_dict, default_config
from jaxmp.train.loop import _restore_or_init

DTYPES = [np.float32, jnp.bfloat16, np.float16, np.int32, np.uint8, np.bool_, jnp.float8_e4m3fn]


def _flip(x, index, bit):
    """``x`` with one bit of element ``index`` flipped, by NumPy on the raw bytes."""
    raw = np.asarray(x).copy()
    view = raw.reshape(-1).view(np.uint8).reshape(raw.size, -1)
    view[index, bit // 8] ^= np.uint8(1 << (bit % 8))
    return raw


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(DTYPES), n=st.integers(1, 300), data=st.data())
def test_any_single_flipped_bit_changes_the_checksum(dtype, n, data):
    rng = np.random.default_rng(n)
    if dtype == np.bool_:
        x = rng.integers(0, 2, n).astype(bool)
    else:
        x = np.asarray(rng.integers(0, 100, n)).astype(dtype)
    bits = 1 if dtype == np.bool_ else 8 * np.dtype(dtype).itemsize
    index, bit = data.draw(st.integers(0, n - 1)), data.draw(st.integers(0, bits - 1))
    flipped = _flip(x, index, bit)
    if dtype == np.bool_:  # a bool is one byte holding 0 or 1: flip the value itself
        flipped = x.copy()
        flipped[index] = not x[index]
    before = state_checksums({"w": jnp.asarray(x)})
    after = state_checksums({"w": jnp.asarray(flipped)})
    assert before.keys() == after.keys() == {"0:w"}
    assert before != after


def test_the_checksum_is_the_same_however_the_array_is_sharded():
    x = np.arange(8 * 6, dtype=np.float32).reshape(8, 6) / 7
    mesh = Mesh(np.asarray(jax.devices()[:8]), ("data",))
    sharded = jax.device_put(x, NamedSharding(mesh, P("data", None)))
    replicated = jax.device_put(x, NamedSharding(mesh, P()))
    assert state_checksums([sharded]) == state_checksums([replicated]) == state_checksums([jnp.asarray(x)])


def test_swapped_elements_and_renamed_leaves_change_the_checksums():
    x = np.arange(10, dtype=np.float32)
    y = x.copy()
    y[[2, 7]] = y[[7, 2]]
    assert state_checksums([x]) != state_checksums([y])  # the weights depend on the position
    assert set(state_checksums({"a": x})) != set(state_checksums({"b": x}))


@pytest.mark.slow
def test_config_differences_name_each_incompatible_leaf_by_its_dotted_key():
    saved = config_to_dict(default_config())
    current = config_to_dict(default_config())
    current["model"]["d_model"] = saved["model"]["d_model"] * 2  # incompatible
    current["optim"]["decay_steps"] = 123  # in MAY_CHANGE_KEYS
    current["train"]["steps"] = saved["train"]["steps"] + 1  # train.steps may change
    current["seed"] = saved["seed"] + 1  # a top-level leaf
    del saved["data"]["eod_id"]  # a key an older checkpoint lacks
    assert config_differences(saved, current) == [
        ("model.d_model", saved["model"]["d_model"], current["model"]["d_model"]),
        ("data.eod_id", None, current["data"]["eod_id"]),
        ("seed", saved["seed"], saved["seed"] + 1)]
    assert config_differences(current, current) == []


def test_a_dtype_spelled_otherwise_is_the_same_setting_on_resume():
    """' BF16 ' then 'bfloat16' name one dtype: a resume is not refused for it (a helper
    found it was); another dtype still is, and the saved spelling is reported as given."""
    saved = config_to_dict(default_config())
    current = config_to_dict(default_config())
    saved["precision"]["grad_reduce_dtype"], current["precision"]["grad_reduce_dtype"] = (
        " BF16 ", "bfloat16")
    saved["optim"]["mu_dtype"], current["optim"]["mu_dtype"] = "bf16", "bfloat16"
    assert config_differences(saved, current) == []
    current["precision"]["grad_reduce_dtype"] = "float16"
    assert config_differences(saved, current) == [
        ("precision.grad_reduce_dtype", " BF16 ", "float16")]


def test_a_topk_residual_saved_on_8_devices_resumes_on_4_keeping_its_mean(tmp_path, capsys):
    """The residual is what each device has not delivered of its gradients; resumed on 4
    devices, every device holds the mean of the 8 saved rows, so mean_j new_j equals
    mean_i old_i exactly (NumPy float64 on the saved rows)."""
    config = small_config(model=dict(num_layers=1, first_dense_layers=0), steps=2, checkpoint_every=2)
    config.precision.update(dict(grad_reduce_dtype="bfloat16", grad_compression="topk", topk_ratio=0.3))
    train_and_evaluate(config, str(tmp_path), num_devices=8)
    eight = Experiment.create(config, num_devices=8)
    with Checkpointer(tmp_path) as ckpt:
        _, saved, _ = ckpt.restore(eight.abstract_state, config_to_dict(eight.config))
    old = [np.asarray(r, np.float64) for r in jax.tree.leaves(saved.comm_state)]
    assert all(r.shape[0] == 8 for r in old) and any(np.abs(r).max() > 0 for r in old)

    four = Experiment.create(config, num_devices=4)
    with Checkpointer(tmp_path) as ckpt:
        step, state, notes = _restore_or_init(four, ckpt, four.data, config_to_dict(four.config))
    assert step == 2 and "saved for 8 devices and this mesh has 4" in notes[0]
    new = [np.asarray(r, np.float64) for r in jax.tree.leaves(state.comm_state)]
    for a, b in zip(old, new):
        assert b.shape == (4,) + a.shape[1:]
        np.testing.assert_allclose(b.mean(0), a.mean(0), rtol=1e-6, atol=1e-12)
        np.testing.assert_array_equal(b[0], b[3])
    assert jax.tree.leaves(state.comm_state)[0].sharding.spec[0] == ("data", "expert")  # the batch axes
    # The trainer resumes on 4 devices and says what it did.
    capsys.readouterr()
    longer = config.copy_and_resolve_references()
    longer.train.steps = 3
    summary = train_and_evaluate(longer, str(tmp_path), num_devices=4)
    assert summary["step"] == 3 and "each device now holds the mean of the saved rows" in capsys.readouterr().out


def test_a_step_set_aside_twice_keeps_both_copies(tmp_path):
    """A step directory found corrupt again (rewritten after the first was set aside) goes
    to corrupt/STEP.1: the first copy is not deleted, and the warning names where each went."""
    ckpt = Checkpointer(tmp_path)
    try:
        for i in range(2):
            (ckpt.directory / "7").mkdir()
            (ckpt.directory / "7" / "f").write_text(str(i))
            ckpt._set_aside(7, "unreadable", 5)
        corrupt = ckpt.directory / "corrupt"
        assert (corrupt / "7" / "f").read_text() == "0"
        assert (corrupt / "7.1" / "f").read_text() == "1"
        assert not (ckpt.directory / "7").exists()
        assert [w.split("moved to ")[1].split(";")[0] for w in ckpt.warnings] == [
            str(corrupt / "7"), str(corrupt / "7.1")]
    finally:
        ckpt.close()


def test_a_reader_lists_the_steps_again_when_a_live_trainer_changes_them(tmp_path, monkeypatch):
    """orbax lists the steps, then reads each one's metadata: a step a trainer prunes in
    between is a FileNotFoundError (seen beside a live trainer: tests/test_readers_beside_trainer.py).
    A reader lists them again; a writer, or a reader whose directory is gone, fails at once
    with one line."""
    from jaxmp.train import checkpoint as ckpt_module

    (tmp_path / "checkpoints").mkdir()
    real, calls = ckpt_module.ocp.CheckpointManager, []

    def racing(*args, **kwargs):  # the first listing loses a race with the trainer
        calls.append(1)
        if len(calls) == 1:
            raise FileNotFoundError(2, "No such file or directory")
        return real(*args, **kwargs)

    monkeypatch.setattr(ckpt_module.ocp, "CheckpointManager", racing)
    with Checkpointer(tmp_path, read_only=True) as ckpt:
        assert ckpt.all_steps() == [] and len(calls) == 2

    def always(*args, **kwargs):
        calls.append(1)
        raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr(ckpt_module.ocp, "CheckpointManager", always)
    calls.clear()
    with pytest.raises(ckpt_module.CheckpointError, match="cannot read the checkpoints in"):
        Checkpointer(tmp_path, read_only=True)
    assert len(calls) == ckpt_module.READER_ATTEMPTS == 5
    calls.clear()
    with pytest.raises(ckpt_module.CheckpointError, match="cannot create the checkpoint directory"):
        Checkpointer(tmp_path)
    assert len(calls) == 1
