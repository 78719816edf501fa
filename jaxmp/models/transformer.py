"""Decoder-only MoE Transformer (DeepSeekMoE style) in Flax NNX with per-module precision.

Architecture: token embedding -> ``num_layers`` pre-norm blocks -> final RMSNorm ->
untied output head; logits are returned in the head's compute dtype, for
:func:`jaxmp.ops.cross_entropy` (a float32 island) to upcast. Block ``i``::

    h = h + attn(attn_norm(h))      # causal multi-head attention with RoPE
    h = h + ffn(ffn_norm(h))        # SwiGLU for i < first_dense_layers, else MoE

(with ``post_norms``, Gemma's: ``h + post_attn_norm(attn(attn_norm(h)))`` and
``h + post_ffn_norm(ffn(ffn_norm(h)))``)

Module paths (what :class:`~jaxmp.precision.policy.PolicyRules` patterns are matched against; each
is the module's attribute path in the model, ``/``-joined, and every module resolves its
policy once, at construction)::

    embed                              token embedding
    blocks/{i}/attn_norm               RMSNorm before attention
    blocks/{i}/attn                    attention (q, k, v, o projections; MLA's too)
    blocks/{i}/attn/q_norm, k_norm     per-head q/k RMSNorm       (qk_norm, Qwen3)
    blocks/{i}/attn/q_a_norm, kv_a_norm  MLA's latent RMSNorms   (kv_lora_rank > 0)
    blocks/{i}/post_attn_norm          RMSNorm after attention    (post_norms, Gemma)
    blocks/{i}/ffn_norm                RMSNorm before the FFN
    blocks/{i}/post_ffn_norm           RMSNorm after the FFN      (post_norms, Gemma)
    blocks/{i}/mlp                     dense SwiGLU FFN      (i < first_dense_layers or
                                       i in mlp_only_layers)
    blocks/{i}/moe                     MoE layer (sets only its output dtype)
    blocks/{i}/moe/router              router (float32 logits island always)
    blocks/{i}/moe/experts             routed experts
    blocks/{i}/moe/shared_experts      shared experts (when num_shared_experts > 0)
    final_norm                         final RMSNorm
    head                               output projection (with tie_embeddings, the
                                       policy of the product by embed's table)

Routers and norms compute in float32 by default (:data:`FLOAT32_ISLANDS`, appended after
the user's rules by :func:`jaxmp.precision.policy.with_float32_islands`): ``"mixed_bf16"`` alone
already runs routers and all three kinds of norm in float32 with float32 parameters, and a
user rule that matches them first (``"mixed_bf16; router: p=f32,c=bf16,o=f32"``) overrides
that; and ``experts`` matches both routed and shared experts.

FP8 (``fp8_*`` presets, :mod:`jaxmp.fp8`): a module whose policy has an FP8 recipe runs
its weight matmuls in FP8 (attention projections, dense FFN, routed and shared experts,
the head). As in DeepSeek-V3 (report, section 3.3.1) the embedding and the output head
(:data:`FP8_EXCLUDED`), the routers, the norms and the attention core stay in
bfloat16/float32 under an FP8 *default* policy, unless a user rule names them:
``"fp8_blockwise; router: fp32; norm: fp32"`` puts attention and every FFN in FP8, and
``"mixed_bf16; router: fp32; norm: fp32; experts: fp8_blockwise; mlp: fp8_blockwise"``
only the FFNs. Each module creates its
parameters in ``policy.param_dtype``, casts parameters and inputs to
``policy.compute_dtype`` and returns ``policy.output_dtype`` (the head excepted, see
:class:`~jaxmp.models.layers.Head`). The residual stream keeps the embedding's output dtype.

Activation memory: weights are cast to the compute dtype inside
:func:`jaxmp.ops.cast_matmul`, so the backward pass recasts the float32 masters instead
of keeping low-precision copies (an FP8 matmul keeps its FP8 input and scales and
quantizes the master weight again, :mod:`jaxmp.fp8`); norms and softmaxes save only their
input / output (:mod:`jaxmp.ops`); RoPE recomputes its tables in the backward pass.

Logical axis names of parameters (``out_sharding`` metadata; mapped to mesh axes only in
:mod:`jaxmp.sharding`): ``vocab``, ``embed`` (model width), ``heads``, ``head_dim``,
``mlp`` (dense / shared-expert hidden), ``expert``, ``expert_mlp`` (routed-expert hidden),
and in the scanned layout ``layers`` first (the stacked-layer axis).
Activations ``[B, T, d_model]`` are annotated ``("batch", None, None)`` through
:func:`jaxmp.sharding.constrain` (a no-op outside :func:`jaxmp.sharding.use_rules`).

Scanned layers (``ModelConfig.scan_layers=True``): the blocks are grouped into *stacks*
(:func:`layer_stacks`) of layers of one kind (dense or MoE, attention or linear
attention, one window) whose modules all resolve to the same policies: runs of
consecutive layers, or, where a pattern of layers repeats (GPT-OSS's alternating
windows), one stack per position in the period, interleaved. Stack ``s`` is one
:class:`Block` at attribute ``stacks/{s}`` whose every variable has a leading axis of the
stack's length, with the logical axis name ``layers`` (mapped to None, replicated, in
every rule table of :mod:`jaxmp.sharding`), and each scan group of stacks runs under one
``jax.lax.scan`` (a period's layers in turn per step), so a deep model is traced and
compiled as one layer per stack. Policy rules keep matching the per-layer
paths ``blocks/{i}/...``: a rule that names one layer (``blocks/2/moe/router: fp32``)
ends a stack there and starts another, so every layer runs in exactly the policies it
would unscanned. Attribute paths become ``stacks/{s}/attn``, ``stacks/{s}/moe/router``,
...; each stacked module's ``path`` holds the first layer's path (``blocks/{first}/...``,
the one its policy was resolved from) and :meth:`MoETransformer.module_paths` lists the
path of every layer. The router bias of a MoE stack is float32 ``[layers, num_experts]``,
one row per layer. Initial weights equal the unscanned model's for the same seed (the
layers are created in the same order, then stacked), but the two layouts' states have
different trees: a checkpoint of one does not restore into the other (the saved config
differs in ``model.scan_layers``, which the trainer names).

Rematerialization (``ModelConfig.remat``, :data:`REMAT_POLICIES`), per block:

* ``"none"``: the backward pass keeps everything autodiff keeps (beyond the
  fine-grained recomputation of :mod:`jaxmp.ops` described above).
* ``"attention"``: only the attention core (scores, softmax, context) is recomputed;
  q, k, v and everything else are kept (selective activation recomputation,
  Korthikanti et al. 2022, section 4.2). Removes the ``[B, H, T, T]`` probabilities of
  the ``reference``/``xla`` paths from memory for about one attention-core forward of
  extra FLOPs.
* ``"dots_saveable"``: each block under ``jax.checkpoint`` with
  ``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``: the outputs of the weight
  matmuls (dots without batch dimensions, which :func:`jaxmp.ops.cast_matmul` and
  :func:`~jaxmp.models.layers.apply_rope` wrap in their own checkpoints, so what is kept
  is q and k after RoPE, v, the attention output projection, the dense and shared-expert
  SwiGLU gate and up products, and the router logits) are kept; everything else is
  recomputed: norms, the attention core (its dots have batch dimensions), SwiGLU's
  gating, and the routed experts (``ragged_dot`` is not a dot_general; the capacity
  path's dots have a batch dimension). (JAX's own ``dots_saveable`` would also keep the
  batched attention-score dots, i.e. the float32 ``[B, H, T, T]`` scores: not offered.)
* ``"full"``: each block under ``jax.checkpoint`` with ``nothing_saveable``: only the
  block's input ``[B, T, d_model]`` is kept; the backward pass recomputes the whole
  block's forward (about one more forward of the layers).
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmp import target as compile_target
from jaxmp._checks import check_choice
from jaxmp.models.attention import Attention, MLAttention
from jaxmp.models.linear_attention import GatedDeltaNet
from jaxmp.models.config import REMAT_POLICIES, ModelConfig
from jaxmp.models.layers import Embed, Head, ParamKeys, RMSNorm, SwiGLU
from jaxmp.models.moe import MoE, MoEStats, RoutedExperts
from jaxmp.precision import comm
from jaxmp.precision.policy import PolicyRules, get_policy_rules, with_float32_islands, without_fp8
from jaxmp.sharding import DISPATCH_DTYPES, constrain, fsdp_checkpoint_policy

# ModelConfig and REMAT_POLICIES are jaxmp.models.config's, named here for the readers of
# this module's docstring.
__all__ = ["ModelConfig", "Block", "MoETransformer", "count_params", "FLOAT32_ISLANDS",
           "FP8_EXCLUDED", "REMAT_POLICIES", "layer_stacks", "model_policy_rules",
           "param_compute_dtypes", "segment_positions"]

_BLOCK_CHECKPOINT_POLICIES = {
    "dots_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}

# Module-path patterns that compute in float32 unless a user rule matches them first.
FLOAT32_ISLANDS = ("router", "norm")
# Module-path patterns that an FP8 default policy leaves in its compute dtype (DeepSeek-V3 3.3.1).
FP8_EXCLUDED = ("embed", "head")

_ACT_AXES = ("batch", None, None)  # only the batch: FSDP maps "embed" to the batch axis too


def _std(config: ModelConfig):
    """GPT-2 init: normal(0.02), residual-branch output projections scaled by 1/sqrt(2L)."""
    return 0.02, 0.02 / math.sqrt(2 * config.num_layers)


def _block_module_suffixes(config: ModelConfig, i: int) -> Tuple[str, ...]:
    """The paths, relative to ``blocks/{i}``, of layer ``i``'s modules that have a policy."""
    common = ("attn_norm", "attn", "ffn_norm") + (
        ("post_attn_norm", "post_ffn_norm") if config.post_norms else ())
    if not config.is_moe_layer(i):
        return common + ("mlp",)
    shared = ("moe/shared_experts",) if config.num_shared_experts > 0 else ()
    return common + ("moe", "moe/router", "moe/experts") + shared


def model_policy_rules(rules) -> PolicyRules:
    """The rules a :class:`MoETransformer` runs by: ``rules`` (anything
    :func:`~jaxmp.precision.policy.get_policy_rules` parses) with routers and norms as
    float32 islands (:data:`FLOAT32_ISLANDS`) and, under an FP8 default, the embedding and
    head out of FP8 (:data:`FP8_EXCLUDED`), unless one of the user's rules says
    otherwise."""
    return without_fp8(with_float32_islands(get_policy_rules(rules), FLOAT32_ISLANDS),
                       FP8_EXCLUDED)


def layer_stacks(config: ModelConfig, rules: PolicyRules,
                 interleave: bool = True) -> Tuple[Tuple[int, ...], ...]:
    """The layer indices of each stack of the scanned layout, in the order they run.

    Two layers may share a stack when they are of the same kind (dense FFN or MoE), layer
    type (attention or linear attention) and attention window
    (:meth:`~jaxmp.models.ModelConfig.attention_window`), and their modules
    (``blocks/{i}/attn_norm``, ``.../attn``, ``.../ffn_norm``, ``.../mlp`` or ``.../moe``,
    ``.../moe/router``, ``.../moe/experts``, ``.../moe/shared_experts``) resolve to the
    same policies under ``rules`` (the model's rules, float32 islands included): the
    layer's *signature*.

    The layers are cut into *scan groups*, each a span of ``P * R`` consecutive layers
    whose signatures repeat with period ``P`` (``R`` times); the group's ``P`` stacks
    hold layers ``a + p, a + p + P, ...`` (``p < P``) and run together under one
    ``jax.lax.scan`` of ``R`` steps, each step the ``P`` layers of one period in order.
    ``P = 1`` is a run of identical layers. The cut minimizes the number of distinct
    layer bodies traced and compiled (the sum of the groups' ``P``), preferring runs of
    one signature and then fewer groups on a tie, and is taken only where it at least
    halves the bodies of runs alone; otherwise the stacks are the runs. (A period's
    layers in one scan step cost memory: compiled deviceless for 8 x H100, Gemma-3-4B's
    7 interleaved stacks took 1.5 GB more per device under fsdp and 2.8 GB more under
    zero1 than its 11 runs, ``benchmarks/README.md``.) So a model of one kind of layer is
    one stack; Gemma 3's five local layers then one global (34 layers) keep their 11
    runs; GPT-OSS's alternating windows are 2 stacks of 12 and Qwen3-Next's three
    linear-attention layers then one full 4 stacks of 12 (24 runs each, whose compile
    took up to 14 minutes per cell on 2 cores, and now takes a uniform model's time). A
    stack spans the layers of its group only, so a dense-then-MoE model is still
    ``((0,), (1, 2, 3))``.

    Args:
      config: the model config.
      rules: the model's rules (:func:`model_policy_rules`).
      interleave: False gives the runs alone, the layout of every scanned model before
        jaxmp 460f087 (2026-12-06), which :func:`jaxmp.train.resume.relayout_stacks`
        converts checkpoints from.

    Returns:
      e.g. ``((0,), (1, 2, 3))`` for one dense layer then three MoE layers;
      ``((0, 2, 4), (1, 3, 5))`` for three periods of a local then a global layer.
    """
    n = config.num_layers
    sig = [(config.is_moe_layer(i), config.layer_type(i), config.attention_window(i),
            tuple(rules.resolve(f"blocks/{i}/{sub}") for sub in _block_module_suffixes(config, i)))
           for i in range(n)]

    def cut(max_period):
        """``(bodies, choice)``: the fewest layer bodies (then groups) of a cut whose
        periods are at most ``max_period``, and ``choice[a] = (P, R)`` of the group that
        starts at layer ``a`` (``max_period=1``: the runs of one signature)."""
        best, choice = [(0, 0)] * (n + 1), [None] * (n + 1)  # best[a]: of layers a..
        for a in range(n - 1, -1, -1):
            for period in range(1, max(1, min(max_period, (n - a) // 2)) + 1):
                repeats = 1
                while a + period * (repeats + 1) <= n and all(
                        sig[a + period * repeats + k] == sig[a + k] for k in range(period)):
                    repeats += 1
                if period > 1 and repeats == 1:  # no repetition: single layers do as well
                    continue
                for r in range(repeats, 0, -1):
                    bodies, groups = best[a + period * r]
                    cand = (bodies + period, groups + 1)
                    if choice[a] is None or cand < best[a]:
                        best[a], choice[a] = cand, (period, r)
        return best[0][0], choice

    runs, choice = cut(1)
    if interleave:
        bodies, periodic = cut(n)
        if 2 * bodies <= runs:  # interleaving at least halves the bodies compiled
            choice = periodic
    stacks, a = [], 0
    while a < n:
        period, repeats = choice[a]
        stacks.extend(tuple(range(a + p, a + period * repeats, period)) for p in range(period))
        a += period * repeats
    return tuple(stacks)


def _scan_groups(stacks) -> list:
    """``[(first stack index, P)]``: the scan groups of :func:`layer_stacks`' stacks, each
    ``P`` consecutive stacks that interleave with stride ``P`` (``P = 1``: contiguous)."""
    groups, s = [], 0
    while s < len(stacks):
        layers = stacks[s]
        period = layers[1] - layers[0] if len(layers) > 1 else 1
        groups.append((s, period))
        s += period
    return groups


class Block(nnx.Module):
    """Pre-norm block: attention and a dense (``mlp``) or MoE (``moe``) FFN, each residual.

    ``__call__(h [B, T, d], *, expert_axis, dispatch_dtype, valid_length, segment_ids,
    positions, operands) ->
    (h, MoEStats or None)`` (the keywords as :meth:`MoETransformer.__call__`'s); the
    residual keeps ``h``'s dtype. ``layers`` holds the indices of the layers this block
    is: ``(index,)``, or in the scanned layout the stack's layers (its variables then have
    a leading ``layers`` axis). ``target``: the compile target of the attention and routed experts'
    kernel choices (:class:`MoETransformer`).
    """

    def __init__(self, config: ModelConfig, index: int, *, rules: PolicyRules, rngs: nnx.Rngs,
                 target: Optional[compile_target.Target] = None):
        path = f"blocks/{index}"
        self.layers = (index,)
        std, out_std = _std(config)
        norm = functools.partial(RMSNorm, config.d_model, config.norm_eps, rules=rules,
                                 rngs=rngs, plus_one=config.norm_plus_one)
        self.attn_norm = norm(path=f"{path}/attn_norm")
        if config.layer_type(index) == "linear_attention":  # Qwen3-Next: Gated DeltaNet
            self.attn = GatedDeltaNet(config.d_model, config.linear_num_key_heads,
                                      config.linear_num_value_heads, config.linear_key_head_dim,
                                      config.linear_value_head_dim, config.linear_conv_kernel,
                                      path=f"{path}/attn", rules=rules, rngs=rngs,
                                      init_std=std, out_std=out_std, norm_eps=config.norm_eps,
                                      projections=config.linear_projections)
        elif config.is_mla:
            self.attn = MLAttention(config.d_model, config.num_heads,
                                    q_lora_rank=config.q_lora_rank,
                                    kv_lora_rank=config.kv_lora_rank,
                                    qk_nope_head_dim=config.qk_nope_head_dim,
                                    qk_rope_head_dim=config.qk_rope_head_dim,
                                    v_head_dim=config.v_head_dim, rope=config.rope,
                                    path=f"{path}/attn", rules=rules, rngs=rngs, init_std=std,
                                    out_std=out_std, implementation=config.attention,
                                    recompute_core=config.remat == "attention", target=target)
        else:
            self.attn = Attention(config.d_model, config.num_heads, config.rope_theta,
                                  path=f"{path}/attn",
                                  rules=rules, rngs=rngs, init_std=std, out_std=out_std,
                                  implementation=config.attention,
                                  recompute_core=config.remat == "attention",
                                  num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                                  qk_norm=config.qk_norm, qkv_bias=config.qkv_bias,
                                  o_bias=config.o_bias,
                                  norm_eps=config.norm_eps, rope=config.layer_rope(index),
                                  target=target, window=config.attention_window(index),
                                  scale=(config.query_pre_attn_scalar ** -0.5
                                         if config.query_pre_attn_scalar else None),
                                  norm_plus_one=config.norm_plus_one,
                                  sinks=config.attention_sinks,
                                  output_gate=config.attention_output_gate)
        self.ffn_norm = norm(path=f"{path}/ffn_norm")
        if config.post_norms:  # Gemma's sandwich: each branch normalized before its add
            self.post_attn_norm = norm(path=f"{path}/post_attn_norm")
            self.post_ffn_norm = norm(path=f"{path}/post_ffn_norm")
        if config.is_moe_layer(index):
            self.moe = MoE(config.d_model, config.num_experts, config.num_shared_experts,
                           config.top_k,
                           config.d_expert, config.score_fn, config.capacity_factor,
                           path=f"{path}/moe",
                           rules=rules, rngs=rngs, init_std=std, out_std=out_std,
                           moe_kernel=config.moe_kernel, norm_topk_prob=config.norm_topk_prob,
                           routed_scaling_factor=config.routed_scaling_factor,
                           n_group=config.n_group, topk_group=config.topk_group,
                           group_score=config.group_score, target=target,
                           bias=config.moe_bias, activation=config.expert_activation,
                           swiglu_alpha=config.swiglu_alpha, swiglu_limit=config.swiglu_limit,
                           shared_gate=config.shared_expert_gate)
        else:
            self.mlp = SwiGLU(config.d_model, config.d_ff, path=f"{path}/mlp", rules=rules,
                              rngs=rngs, init_std=std, out_std=out_std,
                              activation=config.mlp_activation)

    def __call__(self, h: jax.Array, *, expert_axis: Optional[str] = None,
                 dispatch_dtype: str = comm.DEFAULT_DISPATCH_DTYPE,
                 valid_length: Optional[jax.Array] = None,
                 segment_ids: Optional[jax.Array] = None, positions: Optional[jax.Array] = None,
                 operands: Optional[dict] = None):
        """One block; the keyword arguments are :meth:`MoETransformer.__call__`'s."""
        y = self.attn(self.attn_norm(h), segment_ids=segment_ids, positions=positions,
                      operands=operands)
        if hasattr(self, "post_attn_norm"):
            y = self.post_attn_norm(y)
        h = h + y.astype(h.dtype)
        stats = None
        if hasattr(self, "moe"):
            y, stats = self.moe(self.ffn_norm(h), expert_axis=expert_axis,
                                dispatch_dtype=dispatch_dtype, valid_length=valid_length,
                                operands=operands)
        else:
            y = self.mlp(self.ffn_norm(h), operands=operands)
        if hasattr(self, "post_ffn_norm"):
            y = self.post_ffn_norm(y)
        return h + y.astype(h.dtype), stats


def _stack(blocks) -> Block:
    """One :class:`Block` holding ``blocks``' variables stacked on a new leading axis.

    The first block is reused as the template (its policies are every block's, by
    :func:`layer_stacks`); each variable gets the logical axis ``layers`` first.
    """
    template = blocks[0]
    nnx.update(template, jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(b) for b in blocks]))
    for _, var in nnx.iter_graph(template):
        if isinstance(var, nnx.Variable):
            axes = var.get_metadata().get("out_sharding") or (None,) * (var.get_value().ndim - 1)
            var.set_metadata(out_sharding=("layers",) + tuple(axes))
    template.layers = tuple(i for b in blocks for i in b.layers)
    return template


def _run_block(graphdef, remat: str, prevent_cse: bool, gather=None, dtypes=None,
               block_args: Optional[Mapping[str, Any]] = None):
    """``(block state, h) -> (h, stats)`` for one block called with ``block_args``
    (:meth:`Block.__call__`'s keywords), under ``jax.checkpoint`` when ``remat`` asks for
    a block-level policy. With ``gather`` (FSDP) the block's parameters are gathered
    inside, and the block always runs under :func:`jaxmp.sharding.fsdp_checkpoint_policy`
    of ``remat``'s policy: it keeps its split parameters and gathers them again for the
    backward pass, and saves no more than ``remat`` allows."""
    block_args = dict(block_args or {})

    def run(state, h):
        if gather is not None:
            state = _gathered(state, dtypes, gather)
        return nnx.merge(graphdef, state)(h, **block_args)

    policy = _BLOCK_CHECKPOINT_POLICIES.get(remat)
    if gather is not None:  # FSDP: the remat policy, and never a gathered weight
        policy = fsdp_checkpoint_policy(policy)
    elif policy is None:
        return run
    return jax.checkpoint(run, policy=policy, prevent_cse=prevent_cse)


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """int32 [B, T]: each token's position within its segment, 0 where the segment id
    changes along the row (packed documents restart their RoPE positions).

    >>> segment_positions(jnp.array([[1, 1, 1, 2, 2, 0]])).tolist()
    [[0, 1, 2, 0, 1, 0]]
    """
    seg = jnp.asarray(segment_ids)
    t = jnp.arange(seg.shape[-1], dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones_like(seg[..., :1], bool), seg[..., 1:] != seg[..., :-1]],
                             axis=-1)
    return t - jax.lax.cummax(jnp.where(starts, t, 0), axis=seg.ndim - 1)


def param_compute_dtypes(module: nnx.Module) -> dict:
    """``{path: compute dtype}`` of every parameter of ``module``, from the policy of the
    module that holds it: what a compute-dtype copy (ZeRO-1) or gather (FSDP) casts it
    to (a ``lora.base=fp8`` model's E4M3 weights and their scales keep their own dtypes).
    Paths are those of ``nnx.to_flat_state(nnx.state(module, nnx.Param))``."""
    out = {}
    for path, m in nnx.iter_modules(module):
        policy = getattr(m, "policy", None)
        if policy is None:
            continue
        for name, value in vars(m).items():
            if isinstance(value, nnx.Param):  # a frozen E4M3 weight or its scales: as stored
                stored = value.get_value().dtype
                keep = jnp.dtype(stored).itemsize == 1 or name.endswith("_scale_inv")
                out[tuple(path) + (name,)] = stored if keep else policy.compute_dtype
    return out


def _gathered(state, dtypes: dict, gather):
    """``state`` with each parameter gathered whole by ``gather`` (FSDP, inside the train
    step); other variables (router biases) pass through. A scanned layer's slice keeps
    its stacked variable's axis names: the leading ``layers`` is dropped to match."""
    flat = []
    for path, var in nnx.to_flat_state(state):
        if isinstance(var, nnx.Param) and path in dtypes:
            value = var.get_value()
            axes = tuple(var.get_metadata().get("out_sharding") or ())
            if len(axes) == value.ndim + 1 and axes[:1] == ("layers",):
                axes = axes[1:]
            var = var.replace(gather(value, axes, dtypes[path]))
        flat.append((path, var))
    return nnx.from_flat_state(flat)


def _call_gathered(module: nnx.Module, gather, *args, method: str = "__call__", **kwargs):
    """``module.method(*args, **kwargs)``, with its parameters gathered first by ``gather``
    (FSDP, not None) under :func:`jaxmp.sharding.fsdp_checkpoint_policy`: the backward
    pass gathers them again."""
    if gather is None:
        return getattr(module, method)(*args, **kwargs)
    graphdef, state = nnx.split(module)
    dtypes = param_compute_dtypes(module)

    def run(state, *args):
        module = nnx.merge(graphdef, _gathered(state, dtypes, gather))
        return getattr(module, method)(*args, **kwargs)

    return jax.checkpoint(run, policy=fsdp_checkpoint_policy())(state, *args)


class MoETransformer(nnx.Module):
    """Decoder-only MoE Transformer; see the module docstring for paths and precision.

    Args:
      config: the :class:`ModelConfig`.
      rules: per-module precision (a :class:`~jaxmp.precision.policy.PolicyRules` or anything
        :func:`~jaxmp.precision.policy.get_policy_rules` parses, e.g.
        ``"mixed_bf16; router: fp32"``).
      rngs: NNX rngs (stream ``params``).
      target: the compile target (:class:`jaxmp.target.Target`, the devices the program
        will run on, which for a deviceless compile are not this host's) that the
        hardware choices are made for, once, here: ``config.attention="auto"``
        (:func:`~jaxmp.models.attention.resolve_attention`) and ``config.moe_kernel="auto"``
        (:func:`~jaxmp.models.moe.resolve_moe_kernel`). None = :func:`jaxmp.target.current`
        (this host's first device outside :func:`jaxmp.target.compiling_for`);
        :meth:`jaxmp.train.Experiment.create` passes the mesh's.

    Attributes: ``embed``, ``final_norm``, ``head``, and ``blocks`` (a list of
    :class:`Block`, one per layer) or, with ``config.scan_layers``, ``stacks`` (one
    stacked :class:`Block` per entry of :func:`layer_stacks`).

    Raises:
      ValueError: an attention path that cannot run here (``"cudnn"`` off a GPU).
    """

    def __init__(self, config: ModelConfig, rules: PolicyRules, *, rngs: nnx.Rngs,
                 target: Optional[compile_target.Target] = None):
        # Routers and norms are float32 islands, and an FP8 default leaves the embedding and
        # head alone, unless one of the user's rules says otherwise.
        rules = model_policy_rules(rules)
        self.rules = rules
        self.config = config
        rngs = ParamKeys(rngs)  # the same keys as rngs.params(), drawn in time linear in layers
        self.embed = Embed(config.vocab_size, config.d_model, path="embed", rules=rules, rngs=rngs,
                           head_path="head" if config.tie_embeddings else None,
                           scale=config.embed_scale)
        target = target or compile_target.current()
        blocks = [Block(config, i, rules=rules, rngs=rngs, target=target)
                  for i in range(config.num_layers)]
        if config.scan_layers:
            self.stacks = nnx.List([_stack([blocks[i] for i in layers])
                                    for layers in layer_stacks(config, rules)])
        else:
            self.blocks = nnx.List(blocks)
        self.final_norm = RMSNorm(config.d_model, config.norm_eps, path="final_norm", rules=rules,
                                  rngs=rngs, plus_one=config.norm_plus_one)
        if not config.tie_embeddings:
            self.head = Head(config.d_model, config.vocab_size, path="head", rules=rules,
                             rngs=rngs)
        rngs.commit()  # the stream's count, as if each key had been drawn from it

    def layer_blocks(self):
        """The model's :class:`Block` s in the order they run: one per layer, or one per
        stack (:func:`layer_stacks`; a scan group's stacks interleave)."""
        return list(self.stacks if self.config.scan_layers else self.blocks)

    def routers(self):
        """``[(Router, num_layers)]`` of the MoE layers: one router per MoE layer in layer
        order, or per MoE stack in stack order with its ``[num_layers, E]`` bias (the rows
        of ``aux["expert_counts"]`` follow this order: each stack's layers in turn, which
        is layer order unless a scan group interleaves MoE stacks)."""
        return [(b.moe.router, len(b.layers)) for b in self.layer_blocks() if hasattr(b, "moe")]

    def module_paths(self):
        """The per-layer paths (``blocks/{i}/attn``, ...) of every module with a policy,
        which policy rules are matched against, in either layout."""
        out = []
        for path, module in nnx.iter_modules(self):
            if not path or not hasattr(module, "policy"):
                continue
            if self.config.scan_layers and path[0] == "stacks":
                rest = module.path.split("/", 2)[2]
                out.extend(f"blocks/{i}/{rest}" for i in self.stacks[int(path[1])].layers)
            else:
                out.append(module.path)
        return out

    def __call__(self, tokens: jax.Array, *, param_gather: Optional[Callable] = None,
                 expert_axis: Optional[str] = None,
                 dispatch_dtype: str = comm.DEFAULT_DISPATCH_DTYPE,
                 valid_length: Optional[jax.Array] = None,
                 segment_ids: Optional[jax.Array] = None, positions: Optional[jax.Array] = None,
                 operands: Optional[dict] = None):
        """Forward pass.

        The keyword arguments matter only inside the train and eval steps' ``shard_map``
        (the first three: :func:`jaxmp.train.step.forward_args` of the run's
        :class:`~jaxmp.sharding.StepPlan`), for sampling from a fixed-shape buffer
        (``valid_length``) and for diagnostics (``operands``); their defaults run the
        model on whole arrays.

        Args:
          tokens: int [B, T] token ids, T <= max_len.
          param_gather: ``gather(value, logical_axes, dtype) -> value``, the FSDP all-gather
            of a parameter split over the data axis (``StepPlan.gather``,
            :func:`jaxmp.comm.gather_param`), or None (parameters are whole). Each module
            gathers its own parameters, under :func:`jaxmp.sharding.fsdp_checkpoint_policy`
            (the backward pass gathers them again).
          expert_axis: the mesh axis the routed experts are split over (expert
            parallelism), or None (:meth:`~jaxmp.models.moe.RoutedExperts.__call__`).
          dispatch_dtype: one of :data:`jaxmp.sharding.DISPATCH_DTYPES`: the dtype the
            expert-parallel all-to-all sends tokens in.
          valid_length: int32 scalar n (may be traced), ``1 <= n <= T``: only the first n
            tokens of each row are real (capacity dispatch then gives the padding no
            expert slot, :meth:`~jaxmp.models.moe.RoutedExperts.__call__`); None = all T.
          segment_ids: int [B, T], the document of each token of packed rows (0 =
            padding), or None (each row one sequence). A token attends only to earlier
            tokens of its own document, so each document's logits are those of the
            document run alone (with dropless MoE dispatch; capacity dispatch shares
            expert slots across the batch, padding included, as does the load-balance
            statistic; a tensor-wise FP8 recipe scales by the amax of the whole row, so
            its documents round apart from alone, where the blockwise recipe's tiles do
            not); padding's hidden states are not zero but attend to nothing.
          positions: int [B, T] (or [T]) RoPE positions; None = ``0 .. T-1``, or with
            ``segment_ids`` each document's own, restarting at 0 where its segment id
            changes.
          operands: a dict that every weight matmul records its operands in, keyed
            ``"<module path>/<weight>"`` (:func:`~jaxmp.models.layers.matmul`;
            :func:`jaxmp.diagnostics.fp8_report` reads it), or None. Run the model eagerly,
            unscanned and without block remat to get arrays rather than tracers.

        Returns:
          ``(logits, aux)``: logits [B, T, vocab_size] in the head's compute dtype
          (bfloat16 under ``mixed_bf16``; pass them to :func:`jaxmp.ops.cross_entropy`,
          which computes in float32, or upcast them); aux a dict of float32
          ``aux_loss`` (scalar, ``aux_loss_weight * sum`` of the MoE layers' balance
          losses), ``expert_counts`` ([num_moe_layers, num_experts], token-expert
          assignments per expert over the whole batch, rows in :meth:`routers` order; [0, 0]
          without MoE layers) and ``dropped_fraction`` (scalar, mean over MoE layers of
          the fraction of assignments dropped by capacity; 0 dropless).

        Raises:
          ValueError: tokens not an integer [B, T] array, T > max_len, a
            ``dispatch_dtype`` not in :data:`jaxmp.sharding.DISPATCH_DTYPES`, or
            ``segment_ids`` / ``positions`` not integer arrays of the tokens' shape.
        """
        cfg = self.config
        if jnp.ndim(tokens) != 2 or not jnp.issubdtype(jnp.result_type(tokens), jnp.integer):
            raise ValueError("tokens must be an integer [B, T] array, got shape "
                             f"{jnp.shape(tokens)} dtype {jnp.result_type(tokens)}")
        if tokens.shape[1] > cfg.max_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_len={cfg.max_len}")
        check_choice("dispatch_dtype", dispatch_dtype, DISPATCH_DTYPES)
        for name, x in (("segment_ids", segment_ids), ("positions", positions)):
            if x is not None and (jnp.shape(x) not in (tokens.shape, tokens.shape[1:])
                                  or not jnp.issubdtype(jnp.result_type(x), jnp.integer)
                                  or (name == "segment_ids" and jnp.ndim(x) != 2)):
                raise ValueError(f"{name} must be an integer array of the tokens' shape "
                                 f"{list(tokens.shape)}, got shape {list(jnp.shape(x))} dtype "
                                 f"{jnp.result_type(x)}")
        if segment_ids is not None and positions is None:
            positions = segment_positions(segment_ids)
        block_args = dict(expert_axis=expert_axis, dispatch_dtype=dispatch_dtype,
                          valid_length=valid_length, segment_ids=segment_ids,
                          positions=positions, operands=operands)
        # FSDP (param_gather): each module gathers its own weights.
        h = constrain(_call_gathered(self.embed, param_gather, tokens), _ACT_AXES)
        stats = []  # MoEStats with a leading layer axis, in routers() order
        blocks = self.layer_blocks()
        groups = (_scan_groups([b.layers for b in blocks]) if cfg.scan_layers
                  else [(i, 1) for i in range(len(blocks))])
        for first, period in groups:
            runs, states = [], []
            for block in blocks[first:first + period]:
                graphdef, state = nnx.split(block)
                # scan needs no CSE guard
                runs.append(_run_block(graphdef, cfg.remat, prevent_cse=not cfg.scan_layers,
                                       gather=param_gather, block_args=block_args,
                                       dtypes=param_compute_dtypes(block) if param_gather
                                       else None))
                states.append(state)

            def body(h, group_state, runs=runs):  # one period: each stack's layer in turn
                out = []
                for run, layer_state in zip(runs, group_state):
                    h, s = run(layer_state, h)
                    h = constrain(h, _ACT_AXES)
                    out.append(s)
                return h, out

            if cfg.scan_layers:
                h, out = jax.lax.scan(body, h, states)
            else:
                h, out = body(h, states)
                out = [None if s is None else jax.tree.map(lambda x: x[None], s) for s in out]
            stats.extend(s for s in out if s is not None)
        h = _call_gathered(self.final_norm, param_gather, h)
        if cfg.tie_embeddings:
            logits = _call_gathered(self.embed, param_gather, h, method="attend")
        else:
            logits = _call_gathered(self.head, param_gather, h, operands=operands)
        if stats:
            stats = MoEStats(*(jnp.concatenate(parts) for parts in zip(*stats)))
            balance, counts = jnp.sum(stats.balance_loss), stats.expert_counts
            dropped = jnp.mean(stats.dropped_fraction)
        else:
            balance = dropped = jnp.zeros((), jnp.float32)
            counts = jnp.zeros((0, 0), jnp.float32)
        aux = {"aux_loss": (cfg.aux_loss_weight * balance).astype(jnp.float32),
               "expert_counts": counts.astype(jnp.float32),
               "dropped_fraction": dropped.astype(jnp.float32)}
        return logits, aux


def count_params(model: MoETransformer) -> tuple[int, int]:
    """Total and per-token active parameter counts (``nnx.Param`` only, not router biases,
    nor the block scales of a ``lora.base=fp8`` model's E4M3 weights; a LoRA model's
    adapters included).

    Active = everything except the routed experts a token does not use: embeddings,
    attention, norms, head, dense FFNs, shared experts, routers, and ``top_k`` of the
    ``num_experts`` routed experts per MoE layer (their weights and biases). Embedding table and output head are
    counted in both numbers, as in DeepSeek-V3's "671B total, 37B activated" (that 37B
    is only reached with its 2 x 0.93B embedding/head parameters included). The same in
    either layout (a stack's routed experts hold all its layers).

    Returns:
      ``(total, active_per_token)`` as Python ints.
    """
    total = sum(int(np.prod(v.get_value().shape))
                for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
                if not str(path[-1]).endswith("_scale_inv"))  # a frozen E4M3 weight's scales
    inactive = 0
    cfg = model.config
    for _, module in nnx.iter_modules(model):
        if isinstance(module, RoutedExperts):
            routed = sum(int(np.prod(getattr(module, name).shape))  # weights, and biases
                         for name in ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")
                         if hasattr(module, name))
            inactive += routed // cfg.num_experts * (cfg.num_experts - cfg.top_k)
    return total, total - inactive
