"""The MoE Transformer: routing precision (OP-3), master weights (MW-1), dispatch, RoPE, causality."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxmp.models import (MoE, ModelConfig, MoETransformer, Router, RouterBias, apply_rope,
                          count_params, generate, update_router_bias)
from jaxmp import ops
from jaxmp.analysis import residuals
from jaxmp.precision.policy import get_policy_rules

SEED_RULES = "mixed_fp16; router: fp32; experts: p=f32,c=f16,o=f32"


def tiny_config(**overrides):
    kw = dict(vocab_size=64, num_layers=3, d_model=32, num_heads=4, d_ff=64, max_len=16,
              num_experts=4, num_shared_experts=1, top_k=2, d_expert=16, first_dense_layers=1)
    kw.update(overrides)
    return ModelConfig(**kw)


def tokens(b=2, t=8, seed=0, vocab=64):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (b, t)), jnp.int32)


def abstract_model(rules, **overrides):
    """Shapes and dtypes only (no init compute): enough for dtype, path and count checks."""
    return nnx.eval_shape(lambda: MoETransformer(tiny_config(**overrides), rules, rngs=nnx.Rngs(0)))


@nnx.jit
def forward(model, toks):  # one compilation per model structure beats eager op-by-op
    return model(toks)


@pytest.fixture(scope="module")
def fp32_model():
    return MoETransformer(tiny_config(), "fp32", rngs=nnx.Rngs(0))


# ----------------------------------------------------------------------------- NumPy references

def np_softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_silu(z):
    return z / (1.0 + np.exp(-z))


def np_swiglu(x, wg, wu, wd):
    return (np_silu(x @ wg) * (x @ wu)) @ wd


def np_route(x, kernel, bias, top_k, score_fn):
    """float64 routing: scores, chosen experts (top-k of scores + bias), normalized gates."""
    logits = x @ kernel
    scores = np_softmax(logits) if score_fn == "softmax" else 1.0 / (1.0 + np.exp(-logits))
    ids = np.argsort(-(scores + bias), axis=-1, kind="stable")[..., :top_k]
    chosen = np.take_along_axis(scores, ids, -1)
    return scores, ids, chosen / chosen.sum(-1, keepdims=True)


def f64(v):
    return np.asarray(v[...], np.float64)


def np_moe_dense(layer, x, top_k, score_fn):
    """Every expert on every token, weighted by its gate (0 where not chosen), + shared experts."""
    x = np.asarray(x, np.float64)
    scores, ids, gates = np_route(x, f64(layer.router.kernel), f64(layer.router.bias), top_k, score_fn)
    e = layer.experts
    num_experts = scores.shape[-1]
    weight = np.zeros(scores.shape)
    np.put_along_axis(weight, ids, gates, -1)
    y = sum(weight[..., j:j + 1] * np_swiglu(x, f64(e.w_gate)[j], f64(e.w_up)[j], f64(e.w_down)[j])
            for j in range(num_experts))
    if layer.shared_experts is not None:
        s = layer.shared_experts
        y = y + np_swiglu(x, f64(s.w_gate), f64(s.w_up), f64(s.w_down))
    return y, scores, ids


def all_eqns(jaxpr):
    """Every equation of a jaxpr, sub-jaxprs (pjit, custom_vjp, ...) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (list, tuple)) else [v]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from all_eqns(inner)


# ----------------------------------------------------------------------------- OP-3 router

W_OP3 = np.array([[2.000, 2.004, 1.0, 0.0]], np.float32)  # [d_model=1, E=4]


@pytest.mark.parametrize("rules, expert", [
    ("fp32", 1),
    ("mixed_bf16; router: fp32", 1),
    ("mixed_fp16; router: fp32; experts: p=f32,c=f16,o=f32", 1),
    ("bf16", 0),         # bfloat16 parameters: 2.000 and 2.004 are both stored as 2.0
    ("mixed_bf16", 0),   # float32 masters, but the router computes on bfloat16 copies
])
def test_op3_router_decides_in_float32(rules, expert):
    router = Router(1, 4, 1, "softmax", path="blocks/1/moe/router", rules=get_policy_rules(rules),
                    rngs=nnx.Rngs(0))
    router.kernel[...] = jnp.asarray(W_OP3, router.kernel[...].dtype)
    out = router(jnp.ones((1, 1), jnp.float32))
    assert out.expert_ids.dtype == jnp.int32 and out.gates.dtype == jnp.float32
    assert out.scores.dtype == jnp.float32 and out.logits.dtype == jnp.float32
    assert int(out.expert_ids[0, 0]) == expert
    # The independent expectations: float64 softmax of the weights as the router sees them.
    seen = W_OP3[0].astype(jnp.bfloat16 if expert == 0 else np.float32).astype(np.float64)
    assert int(np.argmax(seen)) == expert  # bfloat16 ties 2.0 == 2.0 and the first wins
    np.testing.assert_allclose(np.asarray(out.scores[0]), np_softmax(seen), rtol=1e-6)
    if expert == 1:
        assert abs(float(out.scores[0, 1]) - 0.400) < 5e-4
    np.testing.assert_array_equal(np.asarray(out.gates), [[1.0]])  # normalized over top-1


# ----------------------------------------------------------------------------- precision (MW-1)

@pytest.mark.parametrize("rules, param_dtype", [
    ("mixed_bf16", jnp.float32), ("mixed_fp16", jnp.float32), (SEED_RULES, jnp.float32),
    ("bf16", jnp.bfloat16)])
def test_params_are_created_in_the_param_dtype(rules, param_dtype):
    model = abstract_model(rules)
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert len(params) == 2 + 1 + 3 * 6 + 3 + 2 * (1 + 3 + 3)  # embed/head, final norm, blocks
    assert {p.dtype for p in params} == {jnp.dtype(param_dtype)}
    biases = jax.tree.leaves(nnx.state(model, RouterBias))
    assert len(biases) == 2
    for b in biases:  # float32 whatever the policy
        assert b.dtype == jnp.float32 and b.shape == (4,)


def test_router_bias_starts_at_zero(fp32_model):
    biases = jax.tree.leaves(nnx.state(fp32_model, RouterBias))
    np.testing.assert_array_equal(np.stack([np.asarray(b) for b in biases]), np.zeros((2, 4)))


# Compute dtype expected for each kind of module, written out by hand from the rule strings.
_F32, _BF16, _F16 = "float32", "bfloat16", "float16"
EXPECTED_COMPUTE = {
    "mixed_bf16; router: fp32; norm: fp32": dict(
        embed=_BF16, attn=_BF16, attn_norm=_F32, ffn_norm=_F32, mlp=_BF16, moe=_BF16, router=_F32,
        experts=_BF16, shared_experts=_BF16, final_norm=_F32, head=_BF16),
    # Routers and norms are float32 islands by default (FLOAT32_ISLANDS) ...
    "mixed_bf16": dict(
        embed=_BF16, attn=_BF16, attn_norm=_F32, ffn_norm=_F32, mlp=_BF16, moe=_BF16, router=_F32,
        experts=_BF16, shared_experts=_BF16, final_norm=_F32, head=_BF16),
    SEED_RULES: dict(
        embed=_F16, attn=_F16, attn_norm=_F32, ffn_norm=_F32, mlp=_F16, moe=_F16, router=_F32,
        experts=_F16, shared_experts=_F16, final_norm=_F32, head=_F16),
    # ... unless a user rule matches them first.
    "mixed_bf16; router: bf16; norm: mixed_bf16": dict(
        embed=_BF16, attn=_BF16, attn_norm=_BF16, ffn_norm=_BF16, mlp=_BF16, moe=_BF16, router=_BF16,
        experts=_BF16, shared_experts=_BF16, final_norm=_BF16, head=_BF16),
}


@pytest.mark.parametrize("rules", list(EXPECTED_COMPUTE))
def test_module_paths_and_resolved_policies(rules):
    model = abstract_model(rules)
    seen = set()
    for path, module in nnx.iter_modules(model):
        if not hasattr(module, "policy"):
            continue
        # The documented path is the real attribute path, so rules match what users see.
        assert module.path == "/".join(str(p) for p in path)
        kind = str(path[-1])
        assert module.policy.compute_dtype.name == EXPECTED_COMPUTE[rules][kind], module.path
        assert module.policy.param_dtype.name == (_BF16 if "router: bf16" in rules and kind == "router" else _F32)
        seen.add(module.path)
    assert {"embed", "head", "final_norm", "blocks/0/mlp", "blocks/2/moe/router",
            "blocks/2/moe/experts", "blocks/2/moe/shared_experts", "blocks/1/attn_norm"} <= seen


def test_seed_rules_run_experts_in_float16_router_in_float32():
    graphdef, state = nnx.split(abstract_model(SEED_RULES))
    closed = jax.make_jaxpr(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens())
    eqns = list(all_eqns(closed.jaxpr))
    ragged = [e for e in eqns if e.primitive.name == "ragged_dot_general"]
    assert len(ragged) == 2 * 3  # 2 MoE layers x (gate, up, down)
    for e in ragged:
        assert [v.aval.dtype for v in e.invars[:2]] == [jnp.float16] * 2
        assert e.outvars[0].aval.dtype == jnp.float16
    router = [e for e in eqns if e.primitive.name == "dot_general" and e.outvars[0].aval.shape[-1] == 4
              and e.invars[1].aval.shape == (32, 4)]
    assert len(router) == 2
    for e in router:
        assert [v.aval.dtype for v in e.invars] == [jnp.float32] * 2
    logits = closed.out_avals[0]
    # The head's compute dtype: ops.cross_entropy upcasts inside its float32 island.
    assert logits.dtype == jnp.float16 and logits.shape == (2, 8, 64)


@pytest.mark.parametrize("rules, logits_dtype", [
    ("bf16", jnp.bfloat16), (SEED_RULES, jnp.float16), ("mixed_bf16; head: fp32", jnp.float32)])
def test_forward_output_dtypes(rules, logits_dtype):
    logits, aux = forward(MoETransformer(tiny_config(), rules, rngs=nnx.Rngs(0)), tokens())
    assert logits.dtype == logits_dtype and logits.shape == (2, 8, 64)
    assert np.isfinite(np.asarray(logits)).all()
    assert {k: (v.dtype, v.shape) for k, v in aux.items()} == {
        "aux_loss": (jnp.float32, ()), "expert_counts": (jnp.float32, (2, 4)),
        "dropped_fraction": (jnp.float32, ())}
    np.testing.assert_array_equal(np.asarray(aux["expert_counts"]).sum(-1), [2 * 8 * 2] * 2)


# ----------------------------------------------------------------------------- MoE dispatch

def moe_layer(score_fn="softmax", capacity_factor=None, shared=0, top_k=2, rules="fp32", seed=0):
    return MoE(32, 4, shared, top_k, 16, score_fn, capacity_factor, path="blocks/1/moe",
               rules=get_policy_rules(rules), rngs=nnx.Rngs(seed))


def np_balance_loss(scores, ids, num_experts, score_fn):
    probs = scores if score_fn == "softmax" else scores / scores.sum(-1, keepdims=True)
    b, t, k = ids.shape
    losses = []
    for row in range(b):
        f = np.bincount(ids[row].ravel(), minlength=num_experts) / (t * k)
        losses.append(num_experts * np.sum(f * probs[row].mean(0)))
    return np.mean(losses)


@pytest.mark.parametrize("score_fn, capacity_factor, shared", [
    ("softmax", None, 1), ("sigmoid", None, 0), ("softmax", 2.0, 0), ("sigmoid", 2.0, 1)])
def test_dispatch_equals_dense_reference(score_fn, capacity_factor, shared):
    # capacity 2.0 * T * k / E = T slots per expert: nothing can be dropped.
    layer = moe_layer(score_fn, capacity_factor, shared, seed=1)
    x = np.random.default_rng(2).normal(size=(2, 8, 32)).astype(np.float32)
    y, stats = layer(jnp.asarray(x))
    want, scores, ids = np_moe_dense(layer, x, 2, score_fn)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(stats.expert_counts), np.bincount(ids.ravel(), minlength=4))
    assert float(stats.expert_counts.sum()) == 2 * 8 * 2
    assert float(stats.dropped_fraction) == 0.0
    np.testing.assert_allclose(float(stats.balance_loss), np_balance_loss(scores, ids, 4, score_fn), rtol=1e-5)


@pytest.mark.parametrize("capacity_factor", [None, 2.0])
def test_dispatch_gradients_equal_dense_gradients(capacity_factor):
    layer = moe_layer("softmax", capacity_factor, shared=0, seed=3)
    x = jnp.asarray(np.random.default_rng(4).normal(size=(2, 8, 32)), jnp.float32)
    routing = layer.router(x)
    weight = jnp.sum(jax.nn.one_hot(routing.expert_ids, 4) * routing.gates[..., None], axis=-2)

    def dense(w_gate, w_up, w_down):  # every expert on every token, plain jnp float32
        h = jax.nn.silu(jnp.einsum("btd,edf->btef", x, w_gate)) * jnp.einsum("btd,edf->btef", x, w_up)
        return jnp.sum(jnp.einsum("bte,btef,efd->btd", weight, h, w_down) ** 2)

    e = layer.experts
    want = jax.grad(dense, argnums=(0, 1, 2))(e.w_gate[...], e.w_up[...], e.w_down[...])
    grads = nnx.grad(lambda m: jnp.sum(m(x, routing.expert_ids, routing.gates)[0] ** 2))(e)
    for name, w in zip(("w_gate", "w_up", "w_down"), want):
        np.testing.assert_allclose(np.asarray(grads[name][...]), np.asarray(w), rtol=1e-4, atol=1e-7)


def np_gpt_oss_experts(x, router_w, router_b, e, top_k, alpha, limit):
    """GPT-OSS's MoE (transformers' GptOssTopKRouter + GptOssExperts) in float64: the
    softmax over the top-k biased logits, the clamped SwiGLU with biases, one loop per
    token and choice."""
    x = np.asarray(x, np.float64).reshape(-1, router_w.shape[0])
    logits = x @ router_w + router_b
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        top = np.argsort(-logits[n], kind="stable")[:top_k]
        w = np.exp(logits[n, top] - logits[n, top].max())
        for j, gate_w in zip(top, w / w.sum()):
            gate = np.minimum(x[n] @ f64(e.w_gate)[j] + f64(e.b_gate)[j], limit)
            up = np.clip(x[n] @ f64(e.w_up)[j] + f64(e.b_up)[j], -limit, limit)
            h = (up + 1) * gate / (1 + np.exp(-alpha * gate))
            out[n] += gate_w * (h @ f64(e.w_down)[j] + f64(e.b_down)[j])
    return out


@pytest.mark.parametrize("capacity_factor", [None, 4.0])
def test_gpt_oss_experts_are_numpys(capacity_factor):
    """Router and expert biases and the clamped SwiGLU (a limit small enough to cut both
    gate and up), dropless and with room for every assignment: NumPy float64's."""
    layer = MoE(16, 4, 0, 2, 8, "softmax", capacity_factor, path="blocks/1/moe",
                rules=get_policy_rules("fp32"), rngs=nnx.Rngs(3), bias=True,
                activation="clamped_swiglu", swiglu_alpha=1.3, swiglu_limit=0.5, init_std=0.3)
    rng = np.random.default_rng(8)
    for name in ("b_gate", "b_up", "b_down"):
        var = getattr(layer.experts, name)
        var[...] = jnp.asarray(0.3 * rng.standard_normal(var.shape), jnp.float32)
    layer.router.logit_bias[...] = jnp.asarray(rng.standard_normal(4), jnp.float32)
    x = rng.normal(size=(2, 6, 16)).astype(np.float32)
    gate = np.asarray(x.reshape(-1, 16) @ np.asarray(layer.experts.w_gate[...])[0])
    assert (gate > 0.5).any() and (gate < -0.5).any()  # the clamp cuts
    y, stats = layer(jnp.asarray(x))
    want = np_gpt_oss_experts(x, f64(layer.router.kernel), f64(layer.router.logit_bias),
                              layer.experts, 2, 1.3, 0.5)
    np.testing.assert_allclose(np.asarray(y, np.float64).reshape(-1, 16), want, rtol=1e-4,
                               atol=1e-5)
    assert float(stats.dropped_fraction) == 0.0
    with pytest.raises(ValueError, match="needs swiglu_alpha and swiglu_limit"):
        MoE(16, 4, 0, 2, 8, path="m", rules=get_policy_rules("fp32"), rngs=nnx.Rngs(0),
            activation="clamped_swiglu")


@pytest.mark.parametrize("top_k, bias, capacity_factor, dropped", [
    # Bias 10 on expert 0 sends every token there; capacity ceil(1.0 * 4 * 1 / 4) = 1 slot
    # per sequence: 3 of 4 assignments dropped in each row.
    (1, [10, 0, 0, 0], 1.0, 3 / 4),
    # Every token picks experts 0 and 1; 2 slots each: tokens 0, 1 kept, 2, 3 dropped.
    (2, [10, 5, 0, 0], 1.0, 4 / 8),
    (2, [10, 5, 0, 0], 2.0, 0.0),
    (2, [10, 5, 0, 0], 0.5, 6 / 8),
])
def test_capacity_drops_hand_built(top_k, bias, capacity_factor, dropped):
    layer = moe_layer(capacity_factor=capacity_factor, top_k=top_k, seed=5)
    layer.router.bias[...] = jnp.asarray(bias, jnp.float32)
    x = np.random.default_rng(6).normal(size=(2, 4, 32)).astype(np.float32)
    y, stats = layer(jnp.asarray(x))
    assert abs(float(stats.dropped_fraction) - dropped) < 1e-7
    np.testing.assert_array_equal(np.asarray(stats.expert_counts), np.bincount(
        np.tile(np.arange(top_k), 2 * 4), minlength=4))  # counted before drops
    # Token 0 of each row always keeps every choice (first in line everywhere).
    want, _, _ = np_moe_dense(layer, x, top_k, "softmax")
    np.testing.assert_allclose(np.asarray(y[:, 0]), want[:, 0], rtol=1e-4, atol=1e-6)
    if dropped == 3 / 4:
        np.testing.assert_array_equal(np.asarray(y[:, 1:]), 0.0)


def test_capacity_places_first_choices_before_second_choices():
    # Tokens 0, 1 choose (expert 0, expert 1); tokens 2, 3 choose (1, 0). One slot per
    # expert: GShard fills slots with all first choices in token order, so token 0 keeps
    # expert 0 and token 2 keeps expert 1; everything else is dropped.
    layer = moe_layer(capacity_factor=0.5, top_k=2, seed=7)
    kernel = np.zeros((32, 4), np.float32)
    kernel[0] = [2, -2, 0, 0]
    kernel[1] = [0, 0, -9, -9]
    layer.router.kernel[...] = jnp.asarray(kernel)
    x = np.random.default_rng(8).normal(size=(1, 4, 32)).astype(np.float32) * 0.1
    x[0, :, 0] = [1, 1, -1, -1]
    x[0, :, 1] = 1
    y, stats = layer(jnp.asarray(x))
    assert float(stats.dropped_fraction) == 0.75
    _, ids, gates = np_route(x[0].astype(np.float64), kernel.astype(np.float64), 0.0, 2, "softmax")
    np.testing.assert_array_equal(ids, [[0, 1], [0, 1], [1, 0], [1, 0]])
    e = layer.experts
    want = np.zeros((4, 32))
    for token, expert in ((0, 0), (2, 1)):
        want[token] = gates[token, 0] * np_swiglu(x[0, token].astype(np.float64), f64(e.w_gate)[expert],
                                                  f64(e.w_up)[expert], f64(e.w_down)[expert])
    np.testing.assert_allclose(np.asarray(y[0]), want, rtol=1e-4, atol=1e-7)


# ----------------------------------------------------------------------------- router bias

def test_update_router_bias_arithmetic():
    bias = jnp.asarray([[0.1, -0.2, 0.0, 0.3], [0.0, 0.0, 0.0, 0.0]], jnp.float32)
    counts = jnp.asarray([[5, 1, 3, 3], [0, 8, 4, 4]], jnp.float32)  # means 3 and 4
    new = update_router_bias(bias, counts, 0.01)
    assert new.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(new), [[0.09, -0.19, 0.0, 0.3], [0.01, -0.01, 0.0, 0.0]],
                               rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(update_router_bias(bias, counts, 0.0)), np.asarray(bias))
    with pytest.raises(ValueError, match="rate=-0.1"):
        update_router_bias(bias, counts, -0.1)


def test_router_bias_changes_selection_not_gates():
    router = Router(32, 4, 2, "sigmoid", path="r", rules=get_policy_rules("fp32"), rngs=nnx.Rngs(9))
    x = np.random.default_rng(10).normal(size=(6, 32)).astype(np.float32)
    before = router(jnp.asarray(x))
    router.bias[...] = jnp.asarray([0.0, 0.0, 0.0, 5.0], jnp.float32)
    after = router(jnp.asarray(x))
    kernel = f64(router.kernel)
    scores, ids, gates = np_route(x.astype(np.float64), kernel, np.array([0, 0, 0, 5.0]), 2, "sigmoid")
    assert (ids[:, 0] == 3).all()  # expert 3 is now everyone's first pick ...
    assert not (np.asarray(before.expert_ids) == 3).any(axis=-1).all()
    np.testing.assert_array_equal(np.asarray(after.expert_ids), ids)
    # ... but gates are the bias-free scores of the chosen experts, normalized.
    np.testing.assert_allclose(np.asarray(after.gates), gates, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(after.scores), np.asarray(before.scores), rtol=0, atol=0)


def test_router_bias_gets_no_gradient(fp32_model):
    model = fp32_model
    grads = nnx.jit(nnx.grad(lambda m, t: m(t)[0].sum()))(model, tokens())
    leaves = jax.tree_util.tree_flatten_with_path(grads)[0]
    names = [jax.tree_util.keystr(p) for p, _ in leaves]
    assert not any("bias" in n for n in names)
    assert any("router" in n and "kernel" in n for n in names)
    assert len(leaves) == len(jax.tree.leaves(nnx.state(model, nnx.Param)))


# ----------------------------------------------------------------------------- whole model

@settings(max_examples=12, deadline=None)
@given(t=st.integers(0, 7), new=st.integers(0, 63))
def test_causal(fp32_model, t, new):
    base = np.asarray(tokens(b=1, seed=11))
    changed = base.copy()
    changed[0, t] = new
    a = np.asarray(forward(fp32_model, jnp.asarray(base))[0])
    b = np.asarray(forward(fp32_model, jnp.asarray(changed))[0])
    np.testing.assert_array_equal(a[:, :t], b[:, :t])
    if new != base[0, t]:
        assert not np.allclose(a[:, t], b[:, t])


def np_rope(x, pos, theta=10000.0):
    """Rotate pair (i, i + h/2) by pos * theta^(-2i/h), float64."""
    h = x.shape[-1]
    out = np.empty_like(x)
    for i in range(h // 2):
        a = pos * theta ** (-2.0 * i / h)
        out[..., i] = x[..., i] * math.cos(a) - x[..., i + h // 2] * math.sin(a)
        out[..., i + h // 2] = x[..., i] * math.sin(a) + x[..., i + h // 2] * math.cos(a)
    return out


@settings(max_examples=25, deadline=None)
@given(m=st.integers(0, 200), n=st.integers(0, 200), shift=st.integers(0, 300), seed=st.integers(0, 99))
def test_rope_relative_position(m, n, shift, seed):
    rng = np.random.default_rng(seed)
    q, k = rng.normal(size=(2, 8))
    pos = jnp.asarray([m, n, m + shift, n + shift])
    x = jnp.asarray(np.stack([q, k, q, k])[None, :, None, :], jnp.float32)  # [1, T=4, H=1, 8]
    r = np.asarray(apply_rope(x, pos), np.float64)[0, :, 0]
    for i, p in enumerate([m, n, m + shift, n + shift]):
        np.testing.assert_allclose(r[i], np_rope(np.stack([q, k, q, k])[i], p), atol=2e-4)
    # q.k depends only on the offset m - n, as in float64.
    np.testing.assert_allclose(r[0] @ r[1], r[2] @ r[3], atol=1e-3)
    np.testing.assert_allclose(r[0] @ r[1], np_rope(q, m - n) @ k, atol=1e-3)


def test_model_without_moe_layers():
    model = MoETransformer(tiny_config(num_experts=0, num_layers=2), "fp32", rngs=nnx.Rngs(0))
    logits, aux = forward(model, tokens(t=4))
    assert logits.shape == (2, 4, 64)
    assert aux["expert_counts"].shape == (0, 0)
    assert float(aux["aux_loss"]) == 0.0 and float(aux["dropped_fraction"]) == 0.0


@nnx.jit
def _aux_and_layer_losses(model, toks):
    _, aux = model(toks)
    h, losses = model.embed(toks), []
    for block in model.blocks:  # replay the blocks and keep the per-layer losses
        h, s = block(h)
        if s is not None:
            losses.append(s.balance_loss)
    return aux["aux_loss"], losses


def test_aux_loss_is_weighted_sum_of_layer_losses(fp32_model):
    aux_loss, losses = _aux_and_layer_losses(fp32_model, tokens())
    assert len(losses) == 2 and all(float(l) >= 1.0 - 1e-6 for l in losses)  # E sum f P >= 1
    np.testing.assert_allclose(float(aux_loss), 0.01 * sum(float(l) for l in losses), rtol=1e-6)


def test_count_params_by_hand():
    v, d, f, fe = 64, 32, 64, 16
    attn, norms = 4 * d * d, 2 * d
    dense_ffn, router, expert, shared = 3 * d * f, d * 4, 3 * d * fe, 3 * d * fe
    total = 2 * v * d + d + 3 * (attn + norms) + dense_ffn + 2 * (router + 4 * expert + shared)
    active = total - 2 * (4 - 2) * expert
    assert (total, active) == (38368, 32224)
    assert count_params(abstract_model("mixed_bf16")) == (total, active)
    assert count_params(abstract_model("mixed_bf16", scan_layers=True)) == (total, active)


def test_generate_greedy_matches_step_by_step_argmax(fp32_model):
    prompt = np.asarray(tokens(b=2, t=15, seed=12))
    out = generate(fp32_model, prompt, 3, temperature=0.0)
    assert out.shape == (2, 18) and out.dtype == np.int32
    np.testing.assert_array_equal(out[:, :15], prompt)
    ctx = prompt
    for _ in range(3):  # unpadded recompute, context truncated to max_len = 16
        logits, _ = forward(fp32_model, jnp.asarray(ctx[:, -16:]))
        ctx = np.concatenate([ctx, np.argmax(np.asarray(logits[:, -1]), -1)[:, None]], 1)
    np.testing.assert_array_equal(out, ctx)
    sampled = generate(fp32_model, prompt[0], 2, temperature=1.0, rng=jax.random.key(1))
    assert sampled.shape == (17,) and ((0 <= sampled) & (sampled < 64)).all()


def test_generate_stops_each_row_at_its_first_stop_id(fp32_model):
    """stop_ids: the unstopped greedy sample, cut by hand after each row's first stop id
    (that id repeated after it), ends when every row has stopped; an id outside the
    vocabulary is refused."""
    prompt = np.asarray(tokens(b=2, t=6, seed=3))
    free = generate(fp32_model, prompt, 6, temperature=0.0)
    stops = [int(free[0, 6 + 2]), int(free[1, 6 + 1])]  # row 0's third token, row 1's second
    out = generate(fp32_model, prompt, 6, temperature=0.0, stop_ids=stops)
    want, ends = free.copy(), []
    for row in want:
        first = int(np.flatnonzero(np.isin(row[6:], stops))[0])
        row[6 + first:] = row[6 + first]
        ends.append(6 + first + 1)
    assert max(ends) < free.shape[1]  # both rows stop early: the loop ends before 6 tokens
    np.testing.assert_array_equal(out, want[:, :max(ends)])
    with pytest.raises(ValueError, match=r"stop_ids=\[64\] must be ids in \[0, vocab_size=64\)"):
        generate(fp32_model, prompt, 1, stop_ids=[64])


def test_generate_with_capacity_compiles_once_and_matches_unpadded(fp32_model):
    # Capacity dispatch (expert parallelism needs it): the padded, fixed-shape buffer gives
    # each step the logits of the unpadded context (padding takes no slot, the capacity is
    # the real context's), and one compiled step serves every token (before: one per length).
    from jaxmp.models import sampling
    graphdef = nnx.graphdef(abstract_model("fp32", capacity_factor=0.5))  # drops at 0.5
    model = nnx.merge(graphdef, nnx.state(fp32_model))  # fp32_model's weights, capacity dispatch
    prompt = np.asarray(tokens(b=2, t=3, seed=5))
    before = sampling._next_token._cache_size()
    out = generate(model, prompt, 5, temperature=0.0)
    generate(model, prompt, 2, temperature=0.7, rng=3)  # a temperature is an argument, not a constant
    assert sampling._next_token._cache_size() - before == 1
    ctx, dropped = prompt, []
    for _ in range(5):  # unpadded recompute, one compilation per length
        logits, aux = forward(model, jnp.asarray(ctx))
        dropped.append(float(aux["dropped_fraction"]))
        ctx = np.concatenate([ctx, np.argmax(np.asarray(logits[:, -1]), -1)[:, None]], 1)
    assert max(dropped) > 0  # the capacity did drop assignments: the mask is exercised
    np.testing.assert_array_equal(out, ctx)


# ----------------------------------------------------------------------------- validation

@pytest.mark.parametrize("overrides, message", [
    (dict(num_heads=5), "num_heads=5 must divide d_model=32"),
    (dict(top_k=5), r"top_k=5 must be in \[1, num_experts=4\]"),
    (dict(top_k=0), r"top_k=0 must be an integer >= 1"),
    (dict(d_model=12, num_heads=4), "head_dim = d_model / num_heads = 3 must be even"),
    (dict(first_dense_layers=4), r"first_dense_layers=4 must be in \[0, num_layers=3\]"),
    (dict(vocab_size=0), "vocab_size=0 must be an integer >= 1"),
    (dict(score_fn="relu"), "score_fn='relu'"),
    (dict(capacity_factor=-1.0), "capacity_factor=-1.0"),
    (dict(d_expert=0), "d_expert=0"),
    (dict(attention="flash"), "attention='flash' must be one of reference, xla, cudnn, auto"),
    (dict(remat="some"), "remat='some' must be one of none, attention, dots_saveable, full"),
    (dict(scan_layers="yes"), "scan_layers='yes' must be True or False"),
])
def test_config_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**overrides)


def test_from_config():
    cfg = ml_collections.ConfigDict(dict(vocab_size=64, num_layers=2, d_model=32, num_heads=4, d_ff=64,
                                         max_len=16, num_experts=4, top_k=1, d_expert=8))
    mc = ModelConfig.from_config(cfg)
    assert (mc.head_dim, mc.num_moe_layers, mc.top_k, mc.capacity_factor) == (8, 2, 1, 0.0)
    cfg.num_expert = 3
    with pytest.raises(ValueError, match="unknown model config keys \\['num_expert'\\]"):
        ModelConfig.from_config(cfg)
    # No field is required any more: a left-out one takes its declared default (that these
    # are the run config's defaults is tests/test_config_schema.py's check).
    assert ModelConfig.from_config({k: v for k, v in cfg.items() if k not in (
        "max_len", "num_expert")}).max_len == next(
        f.default for f in dataclasses.fields(ModelConfig) if f.name == "max_len")


def test_too_long_sequence_is_rejected(fp32_model):
    with pytest.raises(ValueError, match="sequence length 17 exceeds max_len=16"):
        fp32_model(tokens(t=17))


# ----------------------------------------------------------------------------- activation memory

def _model_loss(graphdef):
    def loss(params, rest, toks):
        logits, aux = nnx.merge(graphdef, params, rest)(toks)
        return ops.cross_entropy(logits, jnp.roll(toks, -1, axis=1)) + aux["aux_loss"]
    return loss


@pytest.mark.parametrize("rules", ["mixed_bf16", SEED_RULES, "fp32"])
def test_no_weight_copy_is_kept_for_the_backward_pass(rules):
    # Shapes chosen so that no activation has a parameter's shape: every residual of a
    # parameter's shape would be a cast copy of a weight.
    model = nnx.eval_shape(lambda: MoETransformer(
        tiny_config(vocab_size=40, d_ff=48, d_expert=24), rules, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    param_shapes = {tuple(p.shape) for p in jax.tree.leaves(params)}
    toks = jax.ShapeDtypeStruct((1, 5), jnp.int32)
    res = residuals.saved_residuals(_model_loss(graphdef), params, rest, toks, argnums=0)
    computed = [r for r in res if r.kind == "computed"]
    assert computed and not [r for r in computed if r.shape in param_shapes]
    # The weights the backward pass needs are read from the float32 masters themselves.
    assert {r.shape for r in res if r.kind == "argument"} <= param_shapes
    assert {r.dtype for r in res if r.kind == "argument"} == {"float32"}
    # No float32 [B, T, vocab] array: the logits are kept in the head's compute dtype.
    logits_res = [r for r in computed if r.shape[-1:] == (40,)]
    assert [r.dtype for r in logits_res] == ["float32" if rules == "fp32" else
                                             model.head.policy.compute_dtype.name]


def test_low_precision_logits_train_like_float32_logits():
    """Gradients of the loss on the head's bfloat16 logits (upcast inside ops.cross_entropy)
    equal those through an explicit float32 upcast and optax's float32 cross-entropy."""
    import optax

    model = MoETransformer(tiny_config(num_layers=2), "mixed_bf16", rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    toks = tokens(seed=13)
    targets = jnp.roll(toks, -1, axis=1)

    def ours(params):
        logits, _ = nnx.merge(graphdef, params, rest)(toks)
        assert logits.dtype == jnp.bfloat16
        return ops.cross_entropy(logits, targets)

    def upcast(params):
        logits, _ = nnx.merge(graphdef, params, rest)(toks)
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()

    (l1, g1), (l2, g2) = jax.jit(jax.value_and_grad(ours))(params), jax.jit(jax.value_and_grad(upcast))(params)
    np.testing.assert_allclose(float(l1), float(l2), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        assert a.dtype == b.dtype == jnp.float32
        # The float32 cotangents may differ in their last bits, and then round to a
        # neighbouring bfloat16 value at the head's output: a few bfloat16 ulps.
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2 ** -6,
                                   atol=2 ** -6 * float(jnp.abs(b).max()))


def test_count_params_of_biased_experts_by_hand():
    """GPT-OSS's expert biases are the experts': a token uses top_k of them. One MoE layer,
    E = 4, k = 2, d = 32, d_expert = 16; router and expert biases, attention biases, sinks."""
    cfg = ModelConfig(vocab_size=64, num_layers=1, d_model=32, num_heads=4, num_experts=4,
                      top_k=2, d_expert=16, d_ff=0, moe_bias=True, qkv_bias=True, o_bias=True,
                      attention_sinks=True, expert_activation="clamped_swiglu",
                      attention="reference", moe_kernel="ragged_dot")
    v, d, fe, e = 64, 32, 16, 4
    attn = 4 * d * d + 3 * d + d + 4  # q, k, v, o weights and biases, a sink per head
    expert = 3 * d * fe + 2 * fe + d  # w_gate, w_up, w_down, b_gate, b_up, b_down
    total = 2 * v * d + d + attn + 2 * d + (d * e + e) + e * expert
    model = nnx.eval_shape(lambda: MoETransformer(cfg, "fp32", rngs=nnx.Rngs(0)))
    assert count_params(model) == (total, total - (e - 2) * expert)
