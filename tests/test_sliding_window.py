"""Sliding-window attention (issue 43, point 2): a query sees its own token and the
``window - 1`` before it (transformers' ``kv_idx > q_idx - sliding_window``), per layer
(``ModelConfig.layer_types``), on every attention path, with packed documents, scanned
layers and remat; on the GPU compiler the cuDNN path is cuDNN's own sliding-window
kernel. The families' logits against transformers are in tests/test_hf.py."""
import collections

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmp.models import ModelConfig, MoETransformer
from jaxmp.models.attention import attention_core
from jaxmp.models.transformer import layer_stacks


def _reference(q, k, v, window, seg=None, lengths=None):
    """NumPy float64: causal softmax attention within the window (and segments, lengths)."""
    qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t = qn.shape[:2]
    s = np.einsum("bqhk,bshk->bhqs", qn, kn) / np.sqrt(qn.shape[-1])
    i = np.arange(t)
    m = np.broadcast_to((i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window),
                        (b, 1, t, t))
    valid = np.ones((b, t), bool)
    if seg is not None:
        m = m & (seg[:, None, :, None] == seg[:, None, None, :])
        valid &= seg != 0
    if lengths is not None:
        valid &= i[None, :] < np.asarray(lengths)[:, None]
    m = m & valid[:, None, None, :] & valid[:, None, :, None]
    s = np.where(m, s, -np.inf)
    with np.errstate(invalid="ignore"):
        p = np.exp(s - s.max(-1, keepdims=True))
        p = np.nan_to_num(p / p.sum(-1, keepdims=True))
    return np.einsum("bhqs,bshk->bqhk", p, vn)


@pytest.mark.parametrize("implementation", ["reference", "xla"])
@pytest.mark.parametrize("window", [1, 3, 12, 40])
def test_the_window_on_every_path_is_numpys(implementation, window):
    """Values against float64, with segment ids and with padding lengths; a window of
    one token, one shorter than the row and one longer (no window at all)."""
    rng = np.random.default_rng(window)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 12, 4, 8)), jnp.float32) for _ in range(3))
    seg = np.array([[1] * 5 + [2] * 6 + [0], [3] * 12], np.int32)
    for kwargs in ({}, {"seg": seg}, {"lengths": np.array([9, 12])}):
        out = attention_core(q, k, v, implementation, window=window,
                             segment_ids=None if "seg" not in kwargs else jnp.asarray(seg),
                             lengths=kwargs.get("lengths"))
        np.testing.assert_allclose(np.asarray(out, np.float64),
                                   _reference(q, k, v, window, **kwargs), atol=2e-6)
    full = attention_core(q, k, v, implementation)
    if window >= 12:  # a window longer than the row is none
        np.testing.assert_array_equal(np.asarray(attention_core(q, k, v, implementation,
                                                                window=window)), full)


def test_a_window_changes_the_output_and_bad_windows_are_refused():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 8, 2, 8)), jnp.float32) for _ in range(3))
    assert np.abs(np.asarray(attention_core(q, k, v, "reference", window=2))
                  - np.asarray(attention_core(q, k, v, "reference"))).max() > 1e-2
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match=r"window=.* must be a Python int >= 0"):
            attention_core(q, k, v, "reference", window=bad)


def test_layer_types_say_which_layers_slide_and_are_checked():
    c = ModelConfig(num_layers=3, sliding_window=4,
                    layer_types=("sliding_attention", "full_attention", "sliding_attention"))
    assert [c.attention_window(i) for i in range(3)] == [4, 0, 4]
    assert [ModelConfig(num_layers=2, sliding_window=4).attention_window(i)
            for i in range(2)] == [4, 4]
    assert [ModelConfig(num_layers=2).attention_window(i) for i in range(2)] == [0, 0]
    with pytest.raises(ValueError, match=r"layer_types has 1 entries; it needs one per layer"):
        ModelConfig(num_layers=2, sliding_window=4, layer_types=("full_attention",))
    with pytest.raises(ValueError, match=r"names sliding_attention layers but sliding_window=0"):
        ModelConfig(num_layers=1, layer_types=("sliding_attention",))
    with pytest.raises(ValueError, match=r"layer_types"):
        ModelConfig(num_layers=1, sliding_window=4, layer_types=("chunked_attention",))
    with pytest.raises(ValueError, match=r"sliding_window=4 is not defined for MLA"):
        ModelConfig(sliding_window=4, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8,
                    v_head_dim=8)


T = 16
LAYERS = ("sliding_attention", "sliding_attention", "full_attention", "sliding_attention")


def _model(policy="fp32", scan=False, remat="none", attention="reference", window=3):
    config = ModelConfig(vocab_size=97, num_layers=4, d_model=32, num_heads=4, num_kv_heads=2,
                         d_ff=48, max_len=T, attention=attention, scan_layers=scan, remat=remat,
                         sliding_window=window, layer_types=LAYERS if window else ())
    return MoETransformer(config, policy, rngs=nnx.Rngs(3))


def test_scanned_stacks_split_where_the_window_changes():
    config = _model(scan=True).config
    from jaxmp.precision.policy import get_policy_rules
    assert layer_stacks(config, get_policy_rules("fp32")) == ((0, 1), (2,), (3,))


@pytest.mark.parametrize("scan, remat, attention", [(False, "none", "reference"),
                                                    (True, "full", "xla"),
                                                    (False, "attention", "xla")])
def test_the_model_per_layer_windows_are_their_reference(scan, remat, attention):
    """The scanned, rematerialized or XLA-path model (initial weights equal the unscanned
    model's for the same seed) has the unscanned reference model's logits; and the
    windows change them (the model without windows differs)."""
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 97, (2, T)), jnp.int32)
    want = np.asarray(_model()(tokens)[0])
    other = _model(scan=scan, remat=remat, attention=attention)
    logits = np.asarray(jax.jit(lambda t: other(t)[0])(tokens))
    np.testing.assert_allclose(logits, want, atol=2e-5, rtol=2e-5)
    unwindowed = np.asarray(_model(window=0)(tokens)[0])
    assert np.abs(unwindowed - want).max() > 1e-3


@pytest.mark.parametrize("policy, tol", [("fp32", 2e-5), ("mixed_bf16", 1e-6),
                                         ("fp8_blockwise", 1e-6)])
def test_packed_documents_under_windows_have_their_logits_alone(policy, tol):
    """Three documents packed in a row, under per-layer windows: each has the logits it
    has alone (the window counts within its own document)."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 97, n).astype(np.int32) for n in (5, 7, 3)]
    tokens, seg = np.zeros((1, T), np.int32), np.zeros((1, T), np.int32)
    at = 0
    for i, d in enumerate(docs):
        tokens[0, at:at + len(d)], seg[0, at:at + len(d)] = d, i + 1
        at += len(d)
    model = _model(policy, attention="xla")
    graphdef, state = nnx.split(model)
    packed = np.asarray(jax.jit(lambda st, t, s: nnx.merge(graphdef, st)(t, segment_ids=s)[0])(
        state, jnp.asarray(tokens), jnp.asarray(seg)), np.float64)
    alone_fn = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t)[0])
    at = 0
    for d in docs:
        row = np.zeros((1, T), np.int32)
        row[0, :len(d)] = d
        alone = np.asarray(alone_fn(state, jnp.asarray(row)), np.float64)[0, :len(d)]
        np.testing.assert_allclose(packed[0, at:at + len(d)], alone, atol=tol, rtol=0)
        at += len(d)


def test_on_the_gpu_compiler_the_cudnn_path_is_cudnns_sliding_window_kernel():
    """Compiled deviceless for an H200: without segment ids the window is cuDNN's own
    (``sliding_window_length`` = window, causal, no bias operand), forward and backward;
    with segment ids it is part of the segment mask the fused kernel takes as its bias."""
    from jaxmp import target
    from jaxmp.analysis import gpu, hlo

    problem = gpu.plugin_problem()
    if problem:
        pytest.skip(f"deviceless GPU compile: {problem}")
    mesh = gpu.target_mesh(gpu.get_target("H200"), 1)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    b, t, h, d, window = 2, 256, 4, 64, 64
    qkv = [jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16, sharding=rep)] * 3
    seg = jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=rep)
    for packed in (False, True):
        def loss(q, k, v, s):
            out = attention_core(q, k, v, "cudnn", window=window,
                                 segment_ids=s if packed else None)
            return jnp.sum(out.astype(jnp.float32))

        with target.compiling_for(mesh):
            text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*qkv, seg).compile().as_text()
        kinds = collections.Counter(k.kind for k in hlo.hlo_kernels(text))
        assert kinds["cudnn_attention_fwd"] == 1 and kinds["cudnn_attention_bwd"] == 1, kinds
        calls = [line for line in text.splitlines()
                 if "custom-call(" in line and "__cudnn$fmha" in line]
        assert len(calls) == 2
        for call in calls:
            assert '"mask_type": "CAUSAL"' in call
            assert f'"sliding_window_length": {0 if packed else window}' in call
            assert ("ScaleBiasSoftmax" in call) == packed


def test_the_trainer_step_with_windows_keeps_cudnns_sliding_window_kernel():
    """The trainer's own step (gpu.compile_step, what train.py compiles) with per-layer
    windows, for an H200 (deviceless): the sliding layer's attention is cuDNN's fused
    kernel with its window, the global layer's without one, forward and backward."""
    from _compiled import compiled_step
    from jaxmp.analysis import gpu

    problem = gpu.plugin_problem()
    if problem:
        pytest.skip(f"deviceless GPU compile: {problem}")
    step = compiled_step("tiny_moe", ("--config.model.attention=cudnn",
                                      "--config.model.sliding_window=16",
                                      "--config.model.layer_types=('sliding_attention', "
                                      "'full_attention')"))
    cfg = step.experiment.config
    assert cfg.model.num_layers == 2 and cfg.data.seq_len > 16
    calls = [line for line in step.compiled.as_text().splitlines()
             if "custom-call(" in line and "__cudnn$fmha" in line]
    windows = sorted(int(c.split('"sliding_window_length": ')[1].split(",")[0]) for c in calls)
    assert windows == [0, 0, 16, 16], windows  # each layer's forward and backward
