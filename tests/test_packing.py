"""Packed rows (issue 41, point 4): documents packed in one row with segment ids run as
they would alone. Each document's logits in a packed row equal its logits run by itself
(RoPE positions restart per document; attention never crosses a document), per attention
path, with scanned layers and remat, under several policies; padding (segment 0) attends
to nothing."""
import collections

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmp.models import ModelConfig, MoETransformer
from jaxmp.models.attention import attention_core
from jaxmp.models.transformer import segment_positions

LENGTHS = (5, 7, 3)  # three documents packed in a row of 16: one padding token at the end
T = 16


def _docs(vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).astype(np.int32) for n in LENGTHS]


def _packed(docs):
    tokens = np.zeros((1, T), np.int32)
    seg = np.zeros((1, T), np.int32)
    at = 0
    for i, d in enumerate(docs):
        tokens[0, at:at + len(d)], seg[0, at:at + len(d)] = d, i + 1
        at += len(d)
    return tokens, seg


def test_segment_positions_restart_per_document():
    seg = np.array([[1, 1, 1, 2, 2, 3, 0, 0], [4, 4, 4, 4, 4, 4, 4, 4]], np.int32)
    want = [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))]
    assert np.asarray(segment_positions(seg)).tolist() == want


CONFIGS = {
    "dense_gqa": dict(num_kv_heads=2, qk_norm=True),
    "moe": dict(num_experts=4, top_k=2, d_expert=16, num_shared_experts=1, first_dense_layers=1,
                score_fn="sigmoid"),
    "mla": dict(kv_lora_rank=16, q_lora_rank=0, qk_nope_head_dim=8, qk_rope_head_dim=8,
                v_head_dim=8, num_experts=4, top_k=2, d_expert=16),
}


def _model(kind, policy, attention, scan=False, remat="none"):
    config = ModelConfig(vocab_size=97, num_layers=3, d_model=32, num_heads=4, d_ff=48,
                         max_len=T, attention=attention, scan_layers=scan, remat=remat,
                         **CONFIGS[kind])
    return MoETransformer(config, policy, rngs=nnx.Rngs(3))


def _alone_and_packed(model):
    """``[(alone, packed)]`` logits (float64) of each document: alone is the document by
    itself at the start of a row of ``T`` (the rest of the row after it, which a causal
    model's earlier positions never see), without segment ids; packed is its slice of the
    packed row. Both runs jitted, one row shape: two compiles a model."""
    docs = _docs(model.config.vocab_size)
    tokens, seg = _packed(docs)
    graphdef, state = nnx.split(model)
    packed_fn = jax.jit(lambda st, t, s: nnx.merge(graphdef, st)(t, segment_ids=s)[0])
    alone_fn = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t)[0])
    packed = np.asarray(packed_fn(state, jnp.asarray(tokens), jnp.asarray(seg)), np.float64)
    at, pairs = 0, []
    for d in docs:
        row = np.zeros((1, T), np.int32)
        row[0, :len(d)] = d
        alone = np.asarray(alone_fn(state, jnp.asarray(row)), np.float64)[0, :len(d)]
        pairs.append((alone, packed[0, at:at + len(d)]))
        at += len(d)
    return pairs


@pytest.mark.parametrize("kind, attention", [("dense_gqa", "reference"), ("moe", "reference"),
                                             ("mla", "reference"), ("moe", "xla")])
def test_each_document_of_a_packed_row_has_its_logits_alone_fp32(kind, attention):
    for alone, packed in _alone_and_packed(_model(kind, "fp32", attention)):
        np.testing.assert_allclose(packed, alone, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("scan, remat", [(True, "full"), (False, "dots_saveable")])
def test_packed_rows_under_scanned_layers_and_remat(scan, remat):
    for alone, packed in _alone_and_packed(_model("moe", "fp32", "reference", scan, remat)):
        np.testing.assert_allclose(packed, alone, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("policy, tol", [("mixed_bf16", 1e-6), ("fp8_blockwise", 1e-6),
                                         ("fp8_tensorwise", 0.02)])
def test_packed_rows_under_low_precision_policies(policy, tol):
    """Under mixed_bf16 and fp8_blockwise (1 x 128 / 128 x 128 tiles: per token and per
    weight block) a document's arithmetic in a packed row is its arithmetic alone:
    measured equal to the bit on 2026-12-06. fp8_tensorwise scales each activation by the
    amax of the whole tensor, so the other documents of the row set its scale: measured
    0.0065 apart on logits of 0.38 (an O(1) miss would be a crossing document)."""
    for alone, packed in _alone_and_packed(_model("moe", policy, "xla")):
        np.testing.assert_allclose(packed, alone, atol=tol, rtol=0)


def test_a_document_that_crossed_would_be_caught():
    """The check above can fail: without segment ids the second document sees the first."""
    model = _model("dense_gqa", "fp32", "reference")
    docs = _docs(model.config.vocab_size)
    tokens, _ = _packed(docs)
    unmasked = np.asarray(model(jnp.asarray(tokens))[0], np.float64)[0, 5:12]
    alone = np.asarray(model(jnp.asarray(docs[1][None]))[0], np.float64)[0]  # its own length
    assert np.max(np.abs(unmasked - alone)) > 1e-2


@pytest.mark.parametrize("implementation", ["reference", "xla"])
def test_padding_rows_are_zero_with_zero_gradient(implementation):
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 8, 4, 8)), jnp.float32) for _ in range(3))
    seg = jnp.asarray([[1, 1, 2, 2, 2, 0, 0, 0], [3, 3, 3, 3, 3, 3, 3, 0]], jnp.int32)

    def f(q, k, v):
        return attention_core(q, k, v, implementation, segment_ids=seg)

    out = f(q, k, v)
    assert np.all(np.asarray(out)[np.asarray(seg) == 0] == 0)
    g = jax.grad(lambda q: jnp.sum(f(q, k, v) ** 2))(q)
    assert np.all(np.asarray(g)[np.asarray(seg) == 0] == 0)
    # a document's rows equal attention over its own tokens alone (NumPy float64)
    qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
    for b, (lo, hi) in ((0, (2, 5)), (1, (0, 7))):
        s = np.einsum("qhk,shk->hqs", qn[b, lo:hi], kn[b, lo:hi]) / np.sqrt(8)
        s = np.where(np.tril(np.ones((hi - lo, hi - lo), bool))[None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        np.testing.assert_allclose(np.asarray(out)[b, lo:hi],
                                   np.einsum("hqs,shk->qhk", p, vn[b, lo:hi]), atol=1e-5)


def test_bad_segment_ids_are_one_line():
    model = _model("dense_gqa", "fp32", "reference")
    tokens = jnp.zeros((1, 8), jnp.int32)
    with pytest.raises(ValueError, match=r"^segment_ids must be an integer array of the tokens' "
                                         r"shape \[1, 8\], got shape \[1, 7\]"):
        model(tokens, segment_ids=jnp.zeros((1, 7), jnp.int32))
    with pytest.raises(ValueError, match=r"^positions must be an integer array"):
        model(tokens, positions=jnp.zeros((1, 8), jnp.float32))


def test_the_cudnn_path_with_segments_stays_one_fused_kernel_each_way():
    """Compiled by XLA's GPU compiler for an H200 (deviceless), the cuDNN core with packed
    documents is cuDNN's fused attention, forward and backward, its segment mask going in
    as the kernel's bias: no [B, H, T, T] softmax of XLA's own."""
    from jaxmp import target
    from jaxmp.analysis import gpu, hlo

    problem = gpu.plugin_problem()
    if problem:
        pytest.skip(f"deviceless GPU compile: {problem}")
    h200 = gpu.get_target("H200")
    mesh = gpu.target_mesh(h200, 1)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    b, t, h, d = 2, 256, 4, 64
    qkv = [jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16, sharding=rep)] * 3
    seg = jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=rep)

    def loss(q, k, v, seg):
        return jnp.sum(attention_core(q, k, v, "cudnn", segment_ids=seg).astype(jnp.float32))

    with target.compiling_for(mesh):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*qkv, seg).compile().as_text()
    kinds = collections.Counter(k.kind for k in hlo.hlo_kernels(text))
    assert kinds["cudnn_attention_fwd"] == 1 and kinds["cudnn_attention_bwd"] == 1, kinds


def test_the_trainer_step_on_packed_chat_rows_keeps_cudnn_fused_attention():
    """The trainer's own step (``gpu.compile_step``, what ``train.py`` compiles) for a chat
    config, whose batches carry ``segment_ids`` and ``positions``, compiled by XLA's GPU
    compiler for an H200 (deviceless): each layer's attention is cuDNN's fused kernel
    forward and backward (``__cudnn$fmhaScaleBiasSoftmax[Backward]``), the segment mask
    going in as its ``[B, 1, T, T]`` bias operand; no XLA softmax of its own."""
    from _compiled import compiled_step
    from jaxmp.analysis import gpu, hlo
    from jaxmp.train.packing import PACKED_KEYS

    problem = gpu.plugin_problem()
    if problem:
        pytest.skip(f"deviceless GPU compile: {problem}")
    step = compiled_step("tiny_moe", ("--config.data.format=chat",
                                      "--config.model.attention=cudnn"))
    cfg = step.experiment.config
    b, t, layers = cfg.train.batch_size, cfg.data.seq_len, cfg.model.num_layers
    assert sorted(step.experiment.abstract_batch()) == sorted(PACKED_KEYS)
    text = step.compiled.as_text()
    kinds = collections.Counter(k.kind for k in hlo.hlo_kernels(text))
    assert kinds["cudnn_attention_fwd"] == layers and kinds["cudnn_attention_bwd"] == layers, kinds
    calls = [line for line in text.splitlines() if "custom-call(" in line and "__cudnn$fmha" in line]
    forward = [c for c in calls if 'custom_call_target="__cudnn$fmhaScaleBiasSoftmax"' in c]
    assert len(forward) == layers
    for call in forward:  # q, k, v, then the segment mask as a bias over every query/key pair
        operands = call.split("operand_layout_constraints={")[1].split("}, api_version")[0]
        assert operands.count(f"[{b},{t},") == 3 and f"bf16[{b},1,{t},{t}]" in operands, operands
