"""Attention sinks (issue 43, point 2; GPT-OSS): a learned logit per head in every query's
softmax denominator, with no value. Values and gradients of every path that runs here
against a NumPy float64 attention and its hand-derived backward pass, with grouped
heads, windows, packed documents and padding; the fused cuDNN path compiled deviceless for
an H200; the model's sinks under scanned layers, remat, packing and every policy. The
GPT-OSS family's logits against transformers are in tests/test_hf.py."""
import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _packed import assert_documents_alone
from jaxmp.models import ModelConfig, MoETransformer
from jaxmp.models.attention import attention_core

B, T, H, K, HD = 2, 12, 4, 2, 8
SEG = np.array([[1] * 5 + [2] * 6 + [0], [3] * 12], np.int32)
LENGTHS = np.array([9, 12], np.int32)


def np_sink_attention(q, k, v, sinks, w, window=0, seg=None, lengths=None):
    """float64 ``softmax([q k^T / sqrt(h), sink])[:T] v`` (transformers'
    ``eager_attention_forward`` of GPT-OSS) and its gradients at output cotangent ``w``:
    ``dS = P (dP - D)``, ``D = sum_j P_j dP_j`` (the sink's ``dP`` is 0), ``dsink = -sum
    P_sink D`` over batch and queries; grouped heads summed over their group."""
    q, k, v, w = (np.asarray(x, np.float64) for x in (q, k, v, w))
    sinks = np.asarray(sinks, np.float64)
    g = q.shape[2] // k.shape[2]
    kr, vr = np.repeat(k, g, 2), np.repeat(v, g, 2)
    scale = 1 / np.sqrt(q.shape[-1])
    s = np.einsum("bqhd,bshd->bhqs", q, kr) * scale
    i = np.arange(T)
    m = i[:, None] >= i[None, :]
    if window:
        m = m & (i[:, None] - i[None, :] < window)
    m = np.broadcast_to(m, (B, 1, T, T))
    valid = np.ones((B, T), bool)
    if seg is not None:
        m = m & (seg[:, None, :, None] == seg[:, None, None, :])
        valid &= seg != 0
    if lengths is not None:
        valid &= i[None, :] < lengths[:, None]
    m = m & valid[:, None, None, :] & valid[:, None, :, None]
    sink = np.broadcast_to(sinks[None, :, None, None], (B, H, T, 1))
    ext = np.concatenate([np.where(m, s, -np.inf), sink], -1)
    p = np.exp(ext - ext.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    p = np.where(valid[:, None, :, None], p, 0.0)  # a padded query attends to nothing
    out = np.einsum("bhqs,bshd->bqhd", p[..., :T], vr)
    dp = np.einsum("bqhd,bshd->bhqs", w, vr)
    d = np.sum(p[..., :T] * dp, -1, keepdims=True)
    ds = p[..., :T] * (dp - d)
    dq = np.einsum("bhqs,bshd->bqhd", ds, kr) * scale
    dk = np.einsum("bhqs,bqhd->bshd", ds, q) * scale
    dv = np.einsum("bhqs,bqhd->bshd", p[..., :T], w)
    dsink = -np.sum(p[..., T] * d[..., 0], axis=(0, 2))
    fold = lambda x: x.reshape(B, T, K, g, HD).sum(3)  # noqa: E731
    return out, (dq, fold(dk), fold(dv), dsink)


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, H, HD))
    k, v = (rng.standard_normal((B, T, K, HD)) for _ in range(2))
    return q, k, v, 2.0 * rng.standard_normal(H), rng.standard_normal((B, T, H, HD))


@pytest.mark.parametrize("implementation", ["reference", "xla"])
@pytest.mark.parametrize("case", ["causal", "window", "segments", "lengths"])
def test_sinks_on_every_path_are_numpys_values_and_gradients(implementation, case):
    q, k, v, sinks, w = _inputs()
    kwargs = {"window": dict(window=3), "segments": dict(seg=SEG),
              "lengths": dict(lengths=LENGTHS)}.get(case, {})
    ref, ref_grads = np_sink_attention(q, k, v, sinks, w, **kwargs)

    def loss(q, k, v, sinks):
        out = attention_core(q, k, v, implementation, window=kwargs.get("window", 0),
                             segment_ids=None if "seg" not in kwargs else jnp.asarray(SEG),
                             lengths=kwargs.get("lengths"), sinks=sinks)
        return jnp.sum(out * jnp.asarray(w, jnp.float32)), out

    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v, sinks)]
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(*args)
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=2e-6)
    for name, got, want in zip(("q", "k", "v", "sinks"), grads, ref_grads):
        np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=1e-5, err_msg=name)
    # a sink takes its share: with the sink at -inf (e^-inf = 0) the output is plain
    # attention's, and a larger sink shrinks every row
    plain = attention_core(*args[:3], implementation, window=kwargs.get("window", 0))
    none = attention_core(*args[:3], implementation, window=kwargs.get("window", 0),
                          sinks=jnp.full((H,), -jnp.inf))
    np.testing.assert_allclose(np.asarray(none), np.asarray(plain), atol=1e-6)


def test_bad_sinks_are_refused():
    q, k, v, *_ = (jnp.asarray(x, jnp.float32) for x in _inputs())
    with pytest.raises(ValueError, match=r"sinks of shape \(2,\); expected \[H\] = \[4\]"):
        attention_core(q, k, v, "reference", sinks=jnp.zeros(2))
    with pytest.raises(ValueError, match="attention_sinks are not defined for MLA"):
        ModelConfig(attention_sinks=True, kv_lora_rank=8, qk_nope_head_dim=8,
                    qk_rope_head_dim=4, v_head_dim=8, num_experts=2, d_expert=8)


def test_on_the_gpu_compiler_sinks_keep_cudnns_fused_kernels():
    """Compiled deviceless for an H200: with sinks the cuDNN path stays fused, forward
    and backward, with its sliding window: the output's kernel pair plus the pair that
    gives the log-sum-exp its gradient (attention with the keys as values, and its
    backward pass)."""
    from jaxmp import target
    from jaxmp.analysis import gpu, hlo

    problem = gpu.plugin_problem()
    if problem:
        pytest.skip(f"deviceless GPU compile: {problem}")
    mesh = gpu.target_mesh(gpu.get_target("H200"), 1)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    b, t, d, window = 2, 256, 64, 64
    q = jax.ShapeDtypeStruct((b, t, 4, d), jnp.bfloat16, sharding=rep)
    kv = jax.ShapeDtypeStruct((b, t, 2, d), jnp.bfloat16, sharding=rep)
    sinks = jax.ShapeDtypeStruct((4,), jnp.float32, sharding=rep)

    def loss(q, k, v, s):
        out = attention_core(q, k, v, "cudnn", window=window, sinks=s)
        return jnp.sum(out.astype(jnp.float32))

    with target.compiling_for(mesh):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(q, kv, kv, sinks) \
            .compile().as_text()
    kinds = collections.Counter(k.kind for k in hlo.hlo_kernels(text))
    assert kinds["cudnn_attention_fwd"] == 2 and kinds["cudnn_attention_bwd"] == 2, kinds
    calls = [line for line in text.splitlines()
             if "custom-call(" in line and "__cudnn$fmha" in line]
    assert len(calls) == 4
    assert all(f'"sliding_window_length": {window}' in c for c in calls)


BASE = dict(vocab_size=64, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, max_len=32,
            d_ff=64, attention_sinks=True, sliding_window=5,
            layer_types=("sliding_attention", "full_attention"), attention="reference")
TOKENS = jax.random.randint(jax.random.key(0), (2, 16), 0, 64)


def _model(**overrides):
    model = MoETransformer(ModelConfig(**{**BASE, **overrides}), "fp32", rngs=nnx.Rngs(0))
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if path[-1] == "sinks":  # transformers' init (std 0.02) leaves sinks at ~e^0
            var.set_value(3.0 * jax.random.normal(jax.random.key(len(path)), var.shape))
    return model


def _logits(model, tokens=TOKENS, **kwargs):
    return np.asarray(jax.jit(lambda t: model(t, **kwargs)[0])(tokens), np.float64)


@pytest.mark.parametrize("scan, remat, attention", [(True, "full", "reference"),
                                                     (True, "attention", "xla"),
                                                     (False, "dots_saveable", "xla")])
def test_the_models_sinks_under_scan_remat_and_paths_are_the_unscanned_reference(
        scan, remat, attention):
    """The same parameters scanned (a stack per window), rematerialized or on the xla
    path give the unscanned reference's logits and loss gradient."""
    ref = _model()
    other = _model(scan_layers=scan, remat=remat, attention=attention)
    assert set(np.unique([p[-1] for p, _ in nnx.to_flat_state(nnx.state(other))])) >= {"sinks"}
    np.testing.assert_allclose(_logits(other), _logits(ref), atol=2e-5)

    def grad_norm(model):
        graphdef, state = nnx.split(model, nnx.Param)

        def loss(params):
            logits = nnx.merge(graphdef, params)(TOKENS)[0]
            return jnp.mean(jax.nn.logsumexp(logits, -1))

        g = jax.jit(jax.grad(loss))(state)
        return float(np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2)
                                 for x in jax.tree.leaves(g))))
    assert abs(grad_norm(other) - grad_norm(ref)) < 1e-4 * grad_norm(ref)


def test_a_packed_document_with_sinks_has_its_logits_alone():
    """Two documents packed in a row (segment ids, positions restarting) give each
    document the logits it has alone: the sink is per query, not per row."""
    assert_documents_alone(_model(), [TOKENS[0, :7], TOKENS[1, :9]], atol=2e-5)
