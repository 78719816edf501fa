"""The loss over the trained tokens of a whole global batch (issue 41, point 3): with a
``loss_mask`` in the batch, one step with gradient accumulation 4 equals one without, to
float32 rounding, when the micro-batches hold different numbers of trained tokens (the mean
of per-micro-batch means would not: transformers' gradient-accumulation fault of October
2024), and the loss is the masked mean a NumPy float64 reference computes from the model's
own logits. The trainer's step (its Experiment), on a mesh of 2 CPU devices (8 rows each,
4 micro-batches of 2 rows)."""
import numpy as np
import pytest

import jax
from flax import nnx

from _configs import small_config
from jaxmp.train.experiment import Experiment


def _batch(config, seed=0):
    b, t = config.train.batch_size, config.data.seq_len
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 256, (b, t + 1)).astype(np.int32)
    # Row r trains its last k_r tokens, k_r from 0 to t: the micro-batches of 2 rows (and
    # the two devices' 8 rows) hold very different numbers of trained tokens.
    k = np.array([0, 1, 2, 3, 30, 31, 32, 29, 5, 7, 9, 11, 16, 0, 24, 2])[:b]
    mask = np.arange(t)[None, :] >= (t - k)[:, None]
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": mask}


@pytest.fixture(scope="module")
def steps():
    config = small_config()
    config.precision.policy = "fp32"
    out = {}
    batch = _batch(config)
    for accum in (1, 4):
        config.train.grad_accum_steps = accum
        exp = Experiment.create(config, num_devices=2)
        state0 = exp.init_state()
        logits, _ = nnx.merge(exp.graphdef, state0.params, state0.biases, state0.rest)(
            jax.numpy.asarray(batch["inputs"]))
        state1, metrics = exp.train_step(state0, exp.batch_to_device(batch))
        ev = exp.eval_step(state1, exp.batch_to_device(batch))
        out[accum] = (np.asarray(logits, np.float64), state1, jax.device_get(metrics),
                      jax.device_get(ev))
    return batch, out


def _nll(logits, targets):
    z = logits - logits.max(-1, keepdims=True)
    lse = np.log(np.exp(z).sum(-1))
    return lse - np.take_along_axis(z, targets[..., None], -1)[..., 0]


def test_the_loss_is_the_mean_over_the_global_batchs_trained_tokens(steps):
    batch, out = steps
    logits, _, metrics, _ = out[1]
    nll, mask = _nll(logits, batch["targets"]), batch["loss_mask"]
    want = (nll * mask).sum() / mask.sum()
    for accum in (1, 4):
        assert float(out[accum][2]["trained_tokens"]) == mask.sum()
        np.testing.assert_allclose(float(out[accum][2]["loss"]), want, rtol=2e-6)
    # The mean of the eight micro-batches' means (2 devices x 4, 2 rows each) is another
    # number: the test can fail.
    means = [(nll[i:i + 2] * mask[i:i + 2]).sum() / max(mask[i:i + 2].sum(), 1)
             for i in range(0, 16, 2)]
    assert abs(np.mean(means) - want) > 100 * 2e-6 * want  # far outside the tolerance


def test_accumulation_4_steps_as_accumulation_1_with_uneven_masks(steps):
    _, out = steps
    for a, b in zip(jax.tree.leaves(out[1][1].params), jax.tree.leaves(out[4][1].params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(out[4][2]["grad_norm"]), float(out[1][2]["grad_norm"]),
                               rtol=1e-5)


def test_eval_sums_the_trained_tokens_only(steps):
    batch, out = steps
    ev = out[1][3]
    assert float(ev["tokens"]) == batch["loss_mask"].sum()
