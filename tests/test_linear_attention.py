"""Gated DeltaNet (issue 43, point 2; Qwen3-Next's linear_attention layers): the chunked
gated delta rule against a NumPy float64 recurrence token by token, with chunk sizes that
do and do not divide the sequence, packed documents, and gradients against a per-token
JAX recurrence; the causal convolution against NumPy; the model's linear layers under
packing, scanned layers, remat and every policy. The qwen3_next family's logits against
transformers are in tests/test_hf.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _packed import assert_documents_alone
from jaxmp.models import ModelConfig, MoETransformer
from jaxmp.models.linear_attention import causal_conv, gated_delta_rule

B, T, H, DK, DV = 2, 37, 3, 8, 6


def np_delta_rule(q, k, v, g, beta, seg=None):
    """float64, token by token: ``S = e^g S``; ``S += k (beta (v - S^T k))^T``; ``o = S^T q``,
    the state zeroed where a segment starts (Yang et al. 2024, eq. 10)."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    out = np.zeros(v.shape)
    for b in range(q.shape[0]):
        s = np.zeros((q.shape[2], q.shape[3], v.shape[3]))
        for t in range(q.shape[1]):
            if seg is not None and t and seg[b, t] != seg[b, t - 1]:
                s = np.zeros_like(s)
            s = s * np.exp(g[b, t])[:, None, None]
            delta = beta[b, t][:, None] * (v[b, t] - np.einsum("hkv,hk->hv", s, k[b, t]))
            s = s + np.einsum("hk,hv->hkv", k[b, t], delta)
            out[b, t] = np.einsum("hkv,hk->hv", s, q[b, t])
    return out


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((B, T, H, DK)) for _ in range(2))
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, H, DV))
    g = -0.3 * np.abs(rng.standard_normal((B, T, H)))
    beta = 1 / (1 + np.exp(-rng.standard_normal((B, T, H))))
    return [jnp.asarray(x, jnp.float32) for x in (q * DK ** -0.5, k, v, g, beta)]


@pytest.mark.parametrize("chunk", [5, 16, 64])
def test_the_chunked_rule_is_the_recurrence(chunk):
    args = _inputs()
    np.testing.assert_allclose(np.asarray(gated_delta_rule(*args, chunk_size=chunk)),
                               np_delta_rule(*args), atol=2e-6)


def test_packed_documents_start_from_an_empty_state():
    """Three documents in a row (boundaries inside and across chunks of 8) and padding
    (segment 0): each document's outputs are the recurrence over it alone."""
    args = _inputs(1)
    seg = np.array([[1] * 10 + [2] * 20 + [3] * 5 + [0] * 2, [4] * T], np.int32)
    out = np.asarray(gated_delta_rule(*args, segment_ids=jnp.asarray(seg), chunk_size=8))
    np.testing.assert_allclose(out, np_delta_rule(*args, seg=seg), atol=2e-6)
    a, b = 10, 30
    alone = np_delta_rule(*(x[:1, a:b] for x in args))
    np.testing.assert_allclose(out[:1, a:b], alone, atol=2e-6)


def test_gradients_are_the_per_token_recurrences():
    """jax.grad through the chunked form (triangular solves and the chunk scan) equals
    jax.grad through the per-token recurrence, in every input."""
    args = _inputs(2)
    w = jnp.asarray(np.random.default_rng(3).standard_normal((B, T, H, DV)), jnp.float32)

    def recurrent(q, k, v, g, beta):
        def step(s, x):
            qt, kt, vt, gt, bt = x
            s = s * jnp.exp(gt)[..., None, None]
            delta = bt[..., None] * (vt - jnp.einsum("bhkv,bhk->bhv", s, kt))
            s = s + jnp.einsum("bhk,bhv->bhkv", kt, delta)
            return s, jnp.einsum("bhkv,bhk->bhv", s, qt)
        xs = [jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta)]
        _, out = jax.lax.scan(step, jnp.zeros((B, H, DK, DV)), xs)
        return jnp.sum(jnp.moveaxis(out, 0, 1) * w)

    def chunked(*a):
        return jnp.sum(gated_delta_rule(*a, chunk_size=8) * w)

    want = jax.grad(recurrent, argnums=range(5))(*args)
    got = jax.grad(chunked, argnums=range(5))(*args)
    for name, x, y in zip("q k v g beta".split(), got, want):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=5e-5, err_msg=name)


def test_the_causal_convolution_is_numpys_and_stops_at_segments():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 9, 5)).astype(np.float32)
    w = rng.standard_normal((5, 4)).astype(np.float32)
    seg = np.array([[1] * 4 + [2] * 5, [3] * 9])
    want = np.zeros_like(x, np.float64)
    for b in range(2):
        for t in range(9):
            for j in range(4):  # torch Conv1d(padding=K - 1) cut to T: x[t - 3 + j] w[:, j]
                src = t - 3 + j
                if src >= 0 and seg[b, src] == seg[b, t]:
                    want[b, t] += x[b, src] * w[:, j]
    got = causal_conv(jnp.asarray(x), jnp.asarray(w), jnp.asarray(seg))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)


BASE = dict(vocab_size=64, num_layers=3, d_model=32, num_heads=4, num_kv_heads=2, head_dim=16,
            max_len=80, d_ff=64, attention="reference", moe_kernel="ragged_dot",
            layer_types=("linear_attention", "full_attention", "linear_attention"),
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=8, attention_output_gate=True, qk_norm=True,
            norm_plus_one=True, rope_dim=4)
TOKENS = jax.random.randint(jax.random.key(0), (2, 70), 0, 64)


def _logits(model, tokens=TOKENS, **kwargs):
    return np.asarray(jax.jit(lambda t: model(t, **kwargs)[0])(tokens), np.float64)


def test_a_packed_document_has_its_logits_alone():
    """Documents packed in a row (segment ids, positions restarting): the linear layers'
    state and convolution restart at each document, so each document's logits are those
    it has alone."""
    model = MoETransformer(ModelConfig(**BASE), "fp32", rngs=nnx.Rngs(0))
    assert_documents_alone(model, [TOKENS[0, :30], TOKENS[1, :40]], atol=2e-5)


@pytest.mark.parametrize("scan, remat", [(True, "full"), (True, "attention"),
                                         (False, "dots_saveable")])
def test_scanned_and_rematerialized_linear_layers_are_the_plain_model(scan, remat):
    ref = MoETransformer(ModelConfig(**BASE), "fp32", rngs=nnx.Rngs(0))
    other = MoETransformer(ModelConfig(**BASE, scan_layers=scan, remat=remat), "fp32",
                           rngs=nnx.Rngs(0))
    np.testing.assert_allclose(_logits(other), _logits(ref), atol=2e-5)


def test_bad_linear_attention_configs_are_named():
    with pytest.raises(ValueError, match="linear_num_key_heads, linear_num_value_heads"):
        ModelConfig(**{**BASE, "linear_num_key_heads": 0})
    with pytest.raises(ValueError, match="linear_num_value_heads=5 must be a multiple of "
                                         "linear_num_key_heads=2"):
        ModelConfig(**{**BASE, "linear_num_value_heads": 5})
    with pytest.raises(ValueError, match="shared_expert_gate needs shared experts"):
        ModelConfig(**{**BASE, "shared_expert_gate": True, "num_experts": 4, "d_expert": 8})


def test_the_trainers_step_with_linear_layers_compiles_for_a_gpu():
    """The trainer's own step (gpu.compile_step, what train.py compiles) with a Gated
    DeltaNet layer and a full-attention one, for an H200 (deviceless): the full layer is
    cuDNN's fused kernel forward and backward, the linear layer XLA's chunked form (its
    UT transforms cuBLAS's triangular solves, the rest XLA's fusions and GEMMs): no fused
    kernel of its own yet."""
    from _compiled import compiled_step
    from jaxmp.analysis import gpu, hlo

    problem = gpu.plugin_problem()
    if problem:
        pytest.skip(f"deviceless GPU compile: {problem}")
    step = compiled_step("tiny_moe", (
        "--config.model.layer_types=('linear_attention', 'full_attention')",
        "--config.model.linear_num_key_heads=2", "--config.model.linear_num_value_heads=4",
        "--config.model.linear_key_head_dim=16", "--config.model.linear_value_head_dim=16"))
    text = step.compiled.as_text()
    kinds = [k.kind for k in hlo.hlo_kernels(text)]
    assert kinds.count("cudnn_attention_fwd") == kinds.count("cudnn_attention_bwd") == 1
    assert "__cublas$triangularSolve" in text


def test_forward_substitution_is_the_triangular_solve():
    """The CPU's forward substitution and jax.scipy's triangular solve (the GPU's) give
    one (I + L)^-1 x, values and gradients; neither reads the diagonal or upper part."""
    from jaxmp.models.linear_attention import unit_lower_solve

    rng = np.random.default_rng(5)
    a = jnp.asarray(rng.standard_normal((2, 3, 16, 16)) * 0.3, jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 3, 16, 5)), jnp.float32)
    want = np.linalg.solve(np.tril(np.asarray(a, np.float64), -1) + np.eye(16),
                           np.asarray(x, np.float64))
    for substitution in (False, True):
        got = unit_lower_solve(a, x, substitution)
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
    grads = [jax.grad(lambda a, x, s=s: jnp.sum(unit_lower_solve(a, x, s) ** 2),
                      argnums=(0, 1))(a, x) for s in (False, True)]
    for g, h in zip(*grads):
        np.testing.assert_allclose(np.asarray(jnp.tril(g, -1) if g.shape == a.shape else g),
                                   np.asarray(jnp.tril(h, -1) if h.shape == a.shape else h),
                                   atol=1e-4)


def test_linear_layers_on_a_two_device_mesh_past_one_chunk():
    """A model with a Gated DeltaNet layer, 70 tokens (two chunks), jitted under a mesh of
    2 of the 8 CPU devices: the logits of one device (XLA:CPU's LAPACK solve hung here with
    as many devices as cores: the CPU uses forward substitution)."""
    from jaxmp import sharding

    model = MoETransformer(ModelConfig(**BASE), "fp32", rngs=nnx.Rngs(0))
    ref = _logits(model)
    with jax.set_mesh(sharding.make_mesh(2)):
        np.testing.assert_allclose(_logits(model), ref, atol=1e-5)
