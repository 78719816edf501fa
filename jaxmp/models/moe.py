"""Mixture-of-experts feed-forward layer (DeepSeekMoE style) with per-module precision.

One MoE layer (:class:`MoE`, attribute path ``.../moe``) holds three modules, each with
the :class:`~jaxmp.precision.policy.Policy` its own path resolves to:

* ``.../moe/router`` (:class:`Router`): routing logits always come from
  :func:`jaxmp.ops.router_logits` (a float32 matmul island, float32 result); scores,
  top-k selection and gates are float32 too. Give the router a ``router: fp32`` rule so
  that its weights are not rounded before the island (case OP-3).
* ``.../moe/experts`` (:class:`RoutedExperts`): ``num_experts`` SwiGLU experts of width
  ``d_expert``, run dropless (sort by expert + ``jax.lax.ragged_dot``, the MegaBlocks
  idea, Gale et al. 2022) or with a per-sequence capacity (GShard, Lepikhin et al. 2020).
  Dropless, the grouped matmuls run on the kernel ``moe_kernel`` names
  (:data:`MOE_KERNELS`, :func:`resolve_moe_kernel`): ``jax.lax.ragged_dot``, or the
  Mosaic GPU grouped GEMM of :mod:`jaxmp.precision.grouped_gemm` (``"pallas"``), which
  computes only the routed rows where XLA's GPU lowering of ``ragged_dot`` computes every
  expert for every token.
* ``.../moe/shared_experts`` (:class:`SwiGLU`): ``num_shared_experts`` always-on experts
  (DeepSeekMoE, Dai et al. 2024, section 3.2), merged into one SwiGLU of width
  ``num_shared_experts * d_expert`` (a sum of SwiGLUs is a SwiGLU with the hidden units
  concatenated).

Every module creates its parameters in ``policy.param_dtype``, casts them and its input to
``policy.compute_dtype`` in ``__call__`` and returns ``policy.output_dtype``. Expert outputs
are weighted by the float32 gates and summed in float32. Under an FP8 policy
(``experts: fp8_blockwise``) the experts' grouped matmuls are FP8
(:func:`jaxmp.fp8.grouped_dot`; under the blockwise recipe with ``kernel="auto"`` on a
Hopper target, the grouped FP8 Mosaic GPU kernels of
:mod:`jaxmp.precision._fp8.grouped_kernel`, whatever ``moe_kernel`` says); the router
never is (its logits are a float32 island), nor the gate-weighted sum.

Auxiliary-loss-free balancing (DeepSeek-V3 report, arXiv:2412.19437, section 2.1.2): the
router holds a float32 per-expert bias in a :class:`RouterBias` variable (not an
``nnx.Param``: it gets no gradient). It is added to the scores for top-k selection only,
never to the gate values; the trainer moves it with :func:`update_router_bias`.

Logical axis names of the parameters (mapped to mesh axes only in :mod:`jaxmp.sharding`):
``embed`` (model width), ``mlp`` (dense / shared-expert hidden width), ``expert`` (the
expert index), ``expert_mlp`` (routed-expert hidden width).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmp.models.layers import SwiGLU, add_fp8_states, make_param, matmul
from jaxmp import target as compile_target
from jaxmp.precision import comm, fp8, grouped_gemm, ops
from jaxmp.precision.policy import Policy, PolicyRules

__all__ = [
    "RouterBias",
    "update_router_bias",
    "Routing",
    "Router",
    "RoutedExperts",
    "MoEStats",
    "balance_loss",
    "MoE",
    "expert_capacity",
    "SCORE_FNS",
    "GROUP_SCORES",
    "MOE_KERNELS",
    "EXPERT_ACTIVATIONS",
    "resolve_moe_kernel",
]

SCORE_FNS = ("softmax", "sigmoid")
# A group's score in group-limited routing: the sum of its two best scores (DeepSeek-V3's
# noaux_tc) or its best score (DeepSeek-V2's group_limited_greedy).
GROUP_SCORES = ("top2_sum", "max")
MOE_KERNELS = ("auto", "ragged_dot", "pallas")
# The routed experts' gated activation: SwiGLU, or GPT-OSS's clamped SwiGLU
# ``(clip(up, -l, l) + 1) * g * sigmoid(alpha g)``, ``g = min(gate, l)``.
EXPERT_ACTIVATIONS = ("silu", "clamped_swiglu")


def resolve_moe_kernel(name: str, dtype, d_model: int, d_expert: int, fp8_recipe=None,
                       target: "compile_target.Target | None" = None) -> str:
    """The kernel dropless routed experts run on: ``"ragged_dot"`` or ``"pallas"``.

    ``"auto"`` is ``"pallas"`` where it runs: the compile target
    (:func:`jaxmp.target.current`, the mesh's devices under ``Experiment.create``) is an
    NVIDIA GPU of compute capability >= 9.0 (the kernels use Hopper's WGMMA and TMA), the
    experts compute in float16/bfloat16 without an FP8 recipe, and ``d_model`` and
    ``d_expert`` are multiples of 64 (:func:`jaxmp.precision.grouped_gemm.support`);
    else ``"ragged_dot"``.

    Raises:
      ValueError: an unknown name, or ``"pallas"`` where it cannot run (one line, the
        first failing condition).
    """
    if name not in MOE_KERNELS:
        raise ValueError(f"model.moe_kernel={name!r}; allowed: {', '.join(MOE_KERNELS)}")
    if name == "ragged_dot":
        return name
    tgt = target or compile_target.current()
    reason = None
    if not tgt.is_hopper_or_newer():
        reason = f"the compile target {tgt.describe()} is not an NVIDIA GPU of sm >= 9.0"
    elif fp8_recipe is not None:
        reason = ("the experts run FP8 (fp8.grouped_dot, whose blockwise recipe has its own "
                  "grouped kernel)")
    else:
        for d_in, d_out in ((d_model, d_expert), (d_expert, d_model)):
            ok, why = grouped_gemm.support(dtype, d_in, d_out)
            if not ok:
                reason = why
                break
    if reason is None:
        return "pallas"
    if name == "pallas":
        raise ValueError(f"model.moe_kernel='pallas' cannot run here: {reason}; use 'auto' or "
                         f"'ragged_dot'")
    return "ragged_dot"


class RouterBias(nnx.Variable):
    """Per-expert routing bias of auxiliary-loss-free balancing: float32 [num_experts].

    A variable type of its own, not an ``nnx.Param``: ``nnx.grad`` and optimizers that
    filter on ``nnx.Param`` leave it alone; the trainer updates it with
    :func:`update_router_bias` (DeepSeek-V3 report, section 2.1.2).
    """


def update_router_bias(bias: jax.Array, expert_counts: jax.Array, rate: float) -> jax.Array:
    """One step of auxiliary-loss-free balancing: ``bias + rate * sign(mean(counts) - counts)``.

    Overloaded experts (more tokens than the mean) get their bias lowered by ``rate``,
    underloaded ones raised (DeepSeek-V3 report, section 2.1.2, update speed gamma).

    Args:
      bias: float32 [..., num_experts], the current biases.
      expert_counts: [..., num_experts] (any real dtype), tokens routed to each expert in
        the step; the mean is taken over the last axis.
      rate: the update speed gamma (>= 0); 0 leaves the bias unchanged.

    Returns:
      float32 [..., num_experts], the new biases.

    Raises:
      ValueError: ``rate`` is negative or the last axes differ.
    """
    if isinstance(rate, (int, float)) and rate < 0:
        raise ValueError(f"bias update rate={rate} must be >= 0")
    if jnp.shape(bias)[-1:] != jnp.shape(expert_counts)[-1:]:
        raise ValueError(f"bias shape {jnp.shape(bias)} and expert_counts shape "
                         f"{jnp.shape(expert_counts)} differ in the expert axis")
    counts = jnp.asarray(expert_counts, jnp.float32)
    step = jnp.sign(jnp.mean(counts, axis=-1, keepdims=True) - counts)
    return jnp.asarray(bias, jnp.float32) + jnp.asarray(rate, jnp.float32) * step


class Routing(NamedTuple):
    """What the router decided, all float32 except the int32 expert ids.

    Attributes:
      logits: float32 [..., num_experts], from ``ops.router_logits``.
      scores: float32 [..., num_experts], softmax or sigmoid of the logits (no bias).
      expert_ids: int32 [..., top_k], experts chosen by top-k of ``scores + bias``.
      gates: float32 [..., top_k], ``scores`` at ``expert_ids`` normalized to sum to 1
        (unless the router's ``norm_topk_prob`` is False), times ``routed_scaling_factor``.
    """

    logits: jax.Array
    scores: jax.Array
    expert_ids: jax.Array
    gates: jax.Array


class Router(nnx.Module):
    """Top-k token-to-expert router deciding in float32.

    ``logits = ops.router_logits(x, W)`` (float32 island), ``scores = softmax(logits)`` or
    ``sigmoid(logits)``; the top-k of ``scores + bias`` are selected and their (bias-free)
    scores normalized over the k chosen experts (DeepSeek-V3 report, eqs. 13-16, applied
    to softmax scores too). ``x`` and ``W`` are first cast to the policy's compute dtype,
    so only a float32 policy (rule ``router: fp32``) keeps float32 weights (case OP-3).
    The policy's output dtype is not used: every routing decision is float32.

    Args:
      d_model: input width.
      num_experts: number of routed experts E.
      top_k: experts per token, 1 <= top_k <= E.
      score_fn: ``"softmax"`` or ``"sigmoid"``.
      path: attribute path, e.g. ``blocks/2/moe/router``.
      rules: per-module precision rules.
      rngs: NNX rngs.

      norm_topk_prob: normalize the chosen scores to sum to 1 (False: the raw scores,
        transformers' Qwen3-MoE ``norm_topk_prob=False``).
      routed_scaling_factor: multiplies the gates (DeepSeek-V3's 2.5).
      n_group, topk_group: group-limited routing (DeepSeek-V3 report, section 2.1.2):
        only experts in the ``topk_group`` of ``n_group`` groups with the best group
        scores are eligible; ``topk_group == n_group`` is off.
      group_score: a group's score: ``"top2_sum"``, the sum of its two highest biased
        scores (DeepSeek-V3's ``noaux_tc``), or ``"max"``, its highest (DeepSeek-V2's
        ``group_limited_greedy``, the device-limited routing of the DeepSeek-V2 report,
        section 2.2.2); see :data:`GROUP_SCORES`.
      logit_bias: a learned bias added to the float32 logits (GPT-OSS's
        ``router.bias``), unlike ``bias`` a parameter, and part of the scores.

    Variables: ``kernel`` [d_model, E] (``embed``, ``expert_logit``) in ``policy.param_dtype``;
    with ``logit_bias`` ``logit_bias`` [E] (``expert_logit``), zeros;
    ``bias`` :class:`RouterBias` float32 [E] (``expert_logit``: never split, every device
    routes to every expert), zeros.

    Raises:
      ValueError: bad ``top_k``, ``score_fn`` or ``group_score``.
    """

    def __init__(self, d_model: int, num_experts: int, top_k: int, score_fn: str = "softmax", *,
                 path: str, rules: PolicyRules, rngs: nnx.Rngs, init_std: float = 0.02,
                 norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0,
                 n_group: int = 1, topk_group: int = 1, group_score: str = "top2_sum",
                 logit_bias: bool = False):
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        if score_fn not in SCORE_FNS:
            raise ValueError(f"score_fn={score_fn!r}; allowed: {', '.join(SCORE_FNS)}")
        if n_group < 1 or num_experts % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(f"n_group={n_group} must divide num_experts={num_experts} and "
                             f"topk_group={topk_group} be in [1, n_group]")
        if group_score not in GROUP_SCORES:
            raise ValueError(f"group_score={group_score!r}; allowed: {', '.join(GROUP_SCORES)}")
        self.group_score = group_score
        self.path = path
        self.policy: Policy = rules.resolve(path)
        self.top_k = top_k
        self.score_fn = score_fn
        self.norm_topk_prob = bool(norm_topk_prob)
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.n_group, self.topk_group = int(n_group), int(topk_group)
        self.kernel = make_param(rngs, nnx.initializers.normal(init_std), (d_model, num_experts),
                                 self.policy.param_dtype, ("embed", "expert_logit"))
        self.bias = RouterBias(jnp.zeros((num_experts,), jnp.float32),
                               out_sharding=("expert_logit",),
                               eager_sharding=False)
        if logit_bias:
            self.logit_bias = make_param(rngs, nnx.initializers.zeros, (num_experts,),
                                         self.policy.param_dtype, ("expert_logit",))

    def __call__(self, x: jax.Array) -> Routing:
        """Routes ``x`` [..., d_model]; returns a :class:`Routing` (float32 decisions)."""
        p = self.policy
        logits = ops.router_logits(p.cast_to_compute(x), p.cast_to_compute(self.kernel[...]))
        logits = logits.astype(jnp.float32)
        if hasattr(self, "logit_bias"):  # a learned bias of the logits (GPT-OSS), float32
            logits = logits + self.logit_bias[...].astype(jnp.float32)
        if self.score_fn == "softmax":
            scores = ops.softmax(logits, axis=-1, dtype=jnp.float32)
        else:
            scores = jax.nn.sigmoid(logits)
        # The bias steers selection only; gates stay the bias-free scores (DeepSeek-V3 2.1.2).
        choice = scores + self.bias[...].astype(jnp.float32)
        if self.topk_group < self.n_group:  # group-limited: experts of the best groups only
            choice = self._group_limited(choice)
        _, expert_ids = jax.lax.top_k(choice, self.top_k)
        chosen = jnp.take_along_axis(scores, expert_ids, axis=-1)
        if self.norm_topk_prob:
            # Sigmoid scores can all underflow to 0: keep the denominator positive.
            gates = chosen / jnp.maximum(chosen.sum(-1, keepdims=True),
                                         jnp.finfo(jnp.float32).tiny)
        else:
            gates = chosen
        if self.routed_scaling_factor != 1.0:
            gates = gates * jnp.float32(self.routed_scaling_factor)
        return Routing(logits, scores, expert_ids.astype(jnp.int32), gates)

    def _group_limited(self, choice: jax.Array) -> jax.Array:
        """``choice`` [..., E] with the experts outside the ``topk_group`` best of ``n_group``
        groups set to -inf; a group's score is the sum of its two best choices
        (DeepSeek-V3's ``noaux_tc``, transformers' ``DeepseekV3TopkRouter``) or its best
        (``group_score="max"``: transformers' ``DeepseekV2TopkRouter``,
        ``group_limited_greedy``)."""
        e = choice.shape[-1]
        grouped = choice.reshape(choice.shape[:-1] + (self.n_group, e // self.n_group))
        two = 1 if self.group_score == "max" else min(2, e // self.n_group)
        best = jax.lax.top_k(grouped, two)[0].sum(-1)  # [..., G]
        _, groups = jax.lax.top_k(best, self.topk_group)
        keep = jax.nn.one_hot(groups, self.n_group, dtype=jnp.bool_).any(-2)  # [..., G]
        keep = jnp.repeat(keep, e // self.n_group, axis=-1)
        return jnp.where(keep, choice, -jnp.inf)


def expert_capacity(capacity_factor: float, group_size: int, top_k: int, num_experts: int) -> int:
    """Slots per expert per group: ``ceil(capacity_factor * group_size * top_k / num_experts)``.

    GShard (Lepikhin et al. 2020, section 2.2) with top-k assignments per token; at least 1.
    A group is one sequence (batch row), so results do not depend on how the batch is
    split over devices.
    """
    return max(1, math.ceil(capacity_factor * group_size * top_k / num_experts))


def _dropless(experts, x, expert_ids, gates, grouped=None, operands=None):
    """Every assignment computed: sort by expert, grouped matmuls with ``lax.ragged_dot``.

    x [N, D] (compute dtype), expert_ids/gates [N, k]; the weights of ``experts`` (any
    dtype) are multiplied by :func:`~jaxmp.models.layers.matmul` (``ops.cast_matmul`` or
    FP8), which records its operands in ``operands`` when given. Returns float32 [N, D].
    """
    n, k = expert_ids.shape
    num_experts = experts.w_gate.shape[0]
    flat = expert_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    xs = x[order // k]  # token of each sorted assignment
    grouped_matmul = functools.partial(matmul, group_sizes=group_sizes, grouped=grouped,
                                       operands=operands)
    rows = flat[order]  # the expert of each sorted assignment: its biases' row
    ys = experts.ffn(xs, lambda y, name: grouped_matmul(experts, y, name), rows)
    ys = ys[jnp.argsort(order)].reshape(n, k, -1)  # back to token-major order
    # Gate-weighted sum in float32; the float32 copy of ys is recomputed, not saved.
    return ops.cast_matmul(gates, ys, "nk,nkd->nd")


def _with_capacity(experts, x, expert_ids, gates, capacity, num_experts, expert_axis=None,
                   dispatch_dtype=comm.DEFAULT_DISPATCH_DTYPE, valid_length=None, capacities=None,
                   operands=None):
    """GShard dispatch with ``capacity`` slots per expert and sequence.

    x [B, T, D] (compute dtype), expert_ids/gates [B, T, k]. Within a sequence, all first
    choices are placed before any second choice, each in token order (GShard Algorithm 1);
    assignments past an expert's capacity are dropped (their gate weight is lost, the token
    keeps its residual). Returns (float32 [B, T, D], float32 fraction of assignments dropped).

    With ``expert_axis`` (expert parallelism, inside ``shard_map``) the weights are this
    device's ``num_experts / X`` experts; the dispatched slots ``[B, E, C, D]`` travel to
    the devices of their experts by ``all_to_all`` over ``expert_axis`` (X devices) in the
    compute dtype, each device runs its experts on every peer's slots, and the outputs
    travel back the same way (GShard section 3.2). The result equals the one-device
    dispatch: capacity is counted per sequence, on the device that holds it. With
    ``dispatch_dtype="e4m3"`` the slots travel out as E4M3 with one float32 scale per
    1x128 tile (:func:`jaxmp.fp8.all_to_all`; the experts then see the quantized tokens)
    and the outputs come back in the compute dtype.

    With ``valid_length`` n only the first n tokens take slots, at most
    ``capacities[n]`` per expert (int32 [T + 1], :func:`expert_capacity` of each length);
    ``capacity`` stays the shape of the slot buffers. ``operands``: as for
    :func:`_dropless`.
    """
    mm = functools.partial(matmul, operands=operands)
    b, t, k = expert_ids.shape
    onehot = jax.nn.one_hot(expert_ids, num_experts, dtype=jnp.int32)  # [B, T, k, E]
    if valid_length is not None:  # padding takes no slot; the capacity of n tokens
        real = jnp.arange(t) < valid_length
        onehot = onehot * real[None, :, None, None].astype(jnp.int32)
    by_choice = onehot.transpose(0, 2, 1, 3).reshape(b, k * t, num_experts)
    slot = (jnp.cumsum(by_choice, axis=1) - 1).reshape(b, k, t, num_experts).transpose(0, 2, 1, 3)
    slot = jnp.sum(slot * onehot, axis=-1)  # [B, T, k]: the slot of each assignment
    keep = slot < capacity
    if valid_length is not None:
        keep = keep & (slot < capacities[valid_length]) & real[None, :, None]
    # dropped -> 0 row
    slots = jax.nn.one_hot(jnp.where(keep, slot, capacity), capacity, dtype=jnp.float32)
    expert = onehot.astype(jnp.float32)
    dispatch = jnp.einsum("btke,btkc->btec", expert, slots)
    combine = jnp.einsum("btk,btke,btkc->btec", gates, expert, slots)
    xe = jnp.einsum("btec,btd->becd", dispatch.astype(x.dtype), x)  # one-hot: exact in any dtype
    if expert_axis is None:
        ye = experts.ffn(xe, lambda y, name: mm(experts, y, name, (
            "becf,efd->becd" if name == "w_down" else "becd,edf->becf")),
            (None, slice(None), None))
    else:
        groups = jax.lax.axis_size(expert_axis)
        local = num_experts // groups
        # [B, X, E/X, C, D]: axis 1 is the expert group going out, the source device coming in.
        xe = xe.reshape(b, groups, local, capacity, -1)
        if dispatch_dtype == "e4m3":  # E4M3 with 1x128 tile scales on the wire; combine in compute
            xs = fp8.all_to_all(xe, expert_axis, 1, 1)
        else:
            xs = jax.lax.all_to_all(xe, expert_axis, 1, 1)
        ys = experts.ffn(xs, lambda y, name: mm(experts, y, name, (
            "bsecf,efd->bsecd" if name == "w_down" else "bsecd,edf->bsecf")),
            (None, None, slice(None), None))
        ye = jax.lax.all_to_all(ys, expert_axis, 1, 1).reshape(b, num_experts, capacity, -1)
    y = ops.cast_matmul(combine, ye, "btec,becd->btd")  # float32 sum, as in _dropless
    if valid_length is None:
        dropped = 1.0 - jnp.mean(keep.astype(jnp.float32))
    else:  # of the real tokens' assignments
        dropped = 1.0 - jnp.sum(keep.astype(jnp.float32)) / (b * k * valid_length)
    return y, dropped


class RoutedExperts(nnx.Module):
    """``num_experts`` SwiGLU experts of width ``d_expert``, dropless or capacity-limited.

    Args:
      num_experts: E.
      d_model: input/output width.
      d_expert: hidden width of each expert.
      capacity_factor: None or 0 for dropless dispatch (sort + ``jax.lax.ragged_dot``);
        > 0 for GShard dispatch with :func:`expert_capacity` slots per expert and sequence.
        Capacity dispatch is not causal: a later token's first choice can take the slot
        of an earlier token's second choice.
      moe_kernel: the dropless grouped matmuls' kernel, one of :data:`MOE_KERNELS`,
        resolved once here by :func:`resolve_moe_kernel` for ``target`` (attribute
        ``moe_kernel``: ``"ragged_dot"`` or ``"pallas"``).
      target: the compile target (:class:`jaxmp.target.Target`) the kernel is chosen
        for, and whose SM count the grouped GEMM's grid fills; None =
        :func:`jaxmp.target.current`.
      path: attribute path, e.g. ``blocks/2/moe/experts``.
      rules: per-module precision rules.
      rngs: NNX rngs.
      bias: biases on each expert's projections (GPT-OSS).
      activation: one of :data:`EXPERT_ACTIVATIONS`: ``"silu"`` (SwiGLU) or
        ``"clamped_swiglu"`` (GPT-OSS: ``(clip(up, -limit, limit) + 1) * g *
        sigmoid(alpha g)`` with ``g = min(gate, limit)``, transformers'
        ``GptOssExperts._apply_gate``), in the compute dtype.
      swiglu_alpha, swiglu_limit: the clamped SwiGLU's ``alpha`` and ``limit`` (needed by
        it, unread otherwise).

    Parameters: ``w_gate``, ``w_up`` [E, d_model, d_expert] (``expert``, ``embed``,
    ``expert_mlp``); ``w_down`` [E, d_expert, d_model] (``expert``, ``expert_mlp``,
    ``embed``), in ``policy.param_dtype``; with ``bias`` ``b_gate``, ``b_up``
    [E, d_expert] (``expert``, ``expert_mlp``) and ``b_down`` [E, d_model] (``expert``,
    ``embed``), zeros, added to each product in the compute dtype; under delayed FP8 scaling an
    :class:`~jaxmp.models.layers.FP8State` per weight (one scale for all experts).
    Under expert parallelism (inside the train step's ``shard_map``, ``expert_axis`` of
    :meth:`__call__`) a device holds ``E / X`` of them and capacity dispatch exchanges the
    tokens by all-to-all.

    Raises:
      ValueError: negative ``capacity_factor``; a ``moe_kernel`` that cannot run; an
        unknown ``activation``, or the clamped SwiGLU without its two parameters.
    """

    def __init__(self, num_experts: int, d_model: int, d_expert: int, capacity_factor=None, *,
                 path: str, rules: PolicyRules, rngs: nnx.Rngs, init_std: float = 0.02,
                 out_std: float = 0.02, moe_kernel: str = "ragged_dot",
                 target: Optional[compile_target.Target] = None, bias: bool = False,
                 activation: str = "silu", swiglu_alpha: Optional[float] = None,
                 swiglu_limit: Optional[float] = None):
        if capacity_factor is not None and capacity_factor < 0:
            raise ValueError(f"capacity_factor={capacity_factor} must be None, 0 (dropless) or > 0")
        if activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"expert activation {activation!r}; allowed: "
                             f"{', '.join(EXPERT_ACTIVATIONS)}")
        if activation == "clamped_swiglu" and (swiglu_alpha is None or swiglu_limit is None):
            raise ValueError("the clamped SwiGLU needs swiglu_alpha and swiglu_limit")
        self.activation = activation
        self.swiglu_alpha, self.swiglu_limit = swiglu_alpha, swiglu_limit
        self.path = path
        self.policy: Policy = rules.resolve(path)
        self.capacity_factor = float(capacity_factor or 0.0)
        self.num_experts = num_experts
        dt = self.policy.param_dtype
        shape_in, shape_out = (num_experts, d_model, d_expert), (num_experts, d_expert, d_model)
        axes_in, axes_out = ("expert", "embed", "expert_mlp"), ("expert", "expert_mlp", "embed")
        self.w_gate = make_param(rngs, nnx.initializers.normal(init_std), shape_in, dt, axes_in)
        self.w_up = make_param(rngs, nnx.initializers.normal(init_std), shape_in, dt, axes_in)
        self.w_down = make_param(rngs, nnx.initializers.normal(out_std), shape_out, dt, axes_out)
        add_fp8_states(self, ("w_gate", "w_up", "w_down"))
        if bias:
            zeros = nnx.initializers.zeros
            self.b_gate = make_param(rngs, zeros, (num_experts, d_expert), dt,
                                     ("expert", "expert_mlp"))
            self.b_up = make_param(rngs, zeros, (num_experts, d_expert), dt,
                                   ("expert", "expert_mlp"))
            self.b_down = make_param(rngs, zeros, (num_experts, d_model), dt,
                                     ("expert", "embed"))
        tgt = target or compile_target.current()
        self.moe_kernel = resolve_moe_kernel(moe_kernel, self.policy.compute_dtype, d_model,
                                             d_expert, self.policy.fp8, tgt)
        self.num_sms = tgt.core_count or grouped_gemm.DEFAULT_NUM_SMS

    def ffn(self, x: jax.Array, product, rows) -> jax.Array:
        """The experts' gated FFN of ``x`` (tokens by expert, in a dispatch's layout):
        ``product(y, name)`` multiplies ``y`` by weight ``name`` of each row's expert
        (grouped or by slots); each product gets its bias where the experts have biases:
        ``rows`` an int array, the expert of each row of ``x`` (dropless), or an index
        that lays ``[E, n]`` out as the slots (``(None, slice(None), None)`` for
        ``[B, E, C, n]``)."""
        def biased(y, name):
            y = product(y, f"w_{name}")
            if not hasattr(self, f"b_{name}"):
                return y
            return y + self.policy.cast_to_compute(getattr(self, f"b_{name}")[...][rows])

        return biased(self._activate(biased(x, "gate"), biased(x, "up")), "down")

    def _activate(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        """The gated activation of :data:`EXPERT_ACTIVATIONS` ``self.activation`` of the
        gate and up products (biases added)."""
        if self.activation == "silu":
            return jax.nn.silu(gate) * up
        limit = jnp.asarray(self.swiglu_limit, gate.dtype)
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * jnp.asarray(self.swiglu_alpha,
                                                                    gate.dtype)))

    def __call__(self, x: jax.Array, expert_ids: jax.Array, gates: jax.Array, *,
                 expert_axis: Optional[str] = None,
                 dispatch_dtype: str = comm.DEFAULT_DISPATCH_DTYPE,
                 valid_length: Optional[jax.Array] = None, operands: Optional[dict] = None):
        """Runs the experts.

        Args:
          x: [B, T, d_model], any float dtype (cast to the compute dtype).
          expert_ids: int32 [B, T, k].
          gates: float32 [B, T, k].
          expert_axis: inside ``shard_map``, the mesh axis the experts are split over
            (expert parallelism: this module holds ``E / X`` of them and capacity
            dispatch exchanges the slots by all-to-all over it); None = every expert here.
          dispatch_dtype: one of :data:`jaxmp.sharding.DISPATCH_DTYPES`, the dtype the
            expert-parallel all-to-all sends the tokens in (``"e4m3"``: E4M3 with 1x128
            tile scales, :func:`jaxmp.fp8.all_to_all`).
          valid_length: int32 scalar n (may be traced), ``1 <= n <= T``, or None: only the
            first n tokens of every sequence are real (a fixed-shape sampling buffer,
            :func:`jaxmp.models.sampling.generate`). Under capacity dispatch the tokens
            past n take no expert slot and the capacity is the one of an n-token sequence,
            so with causal attention the first n positions compute what the unpadded
            n-token context computes (the slot buffers keep the padded shape). Dropless
            dispatch routes per token and needs no mask.
          operands: a dict the weight matmuls record their operands in
            (:func:`~jaxmp.models.layers.matmul`), or None.

        Returns:
          ``(y, dropped_fraction)``: y [B, T, d_model] in ``policy.output_dtype``, the
          gate-weighted sum of the chosen experts' outputs (summed in float32);
          dropped_fraction a float32 scalar, dropped assignments / (B * T * k) (0 dropless).
        """
        p = self.policy
        x = p.cast_to_compute(x)
        gates = gates.astype(jnp.float32)
        b, t, d = x.shape
        if self.capacity_factor > 0:
            k = expert_ids.shape[-1]
            capacity = expert_capacity(self.capacity_factor, t, k, self.num_experts)
            capacities = None if valid_length is None else jnp.asarray(
                [expert_capacity(self.capacity_factor, max(m, 1), k, self.num_experts)
                 for m in range(t + 1)], jnp.int32)
            y, dropped = _with_capacity(self, x, expert_ids, gates, capacity, self.num_experts,
                                        expert_axis, dispatch_dtype, valid_length, capacities,
                                        operands)
        elif expert_axis is not None:
            raise ValueError("expert parallelism exchanges fixed-size slots: set "
                             "model.capacity_factor > 0 (dropless dispatch runs with "
                             "parallel.expert=1)")
        else:
            k = expert_ids.shape[-1]
            grouped = (functools.partial(grouped_gemm.grouped_matmul, num_sms=self.num_sms)
                       if self.moe_kernel == "pallas" else None)
            y = _dropless(self, x.reshape(b * t, d), expert_ids.reshape(b * t, k),
                          gates.reshape(b * t, k), grouped, operands)
            y, dropped = y.reshape(b, t, d), jnp.zeros((), jnp.float32)
        return p.cast_to_output(y), dropped


class MoEStats(NamedTuple):
    """Per-layer routing statistics (float32).

    Attributes:
      balance_loss: scalar, the unweighted load-balance loss ``E * sum_e f_e * P_e``
        averaged over sequences (1 when perfectly balanced).
      expert_counts: [E], token-expert assignments per expert over the whole batch
        (before any capacity drop); sums to B * T * top_k.
      dropped_fraction: scalar, dropped assignments / all assignments (0 dropless).
    """

    balance_loss: jax.Array
    expert_counts: jax.Array
    dropped_fraction: jax.Array


def balance_loss(scores: jax.Array, expert_ids: jax.Array, score_fn: str) -> jax.Array:
    """Sequence-wise load-balance loss ``E * sum_e f_e * P_e``, mean over sequences.

    ``f_e``: fraction of the sequence's T * k assignments that went to expert e;
    ``P_e``: mean over the sequence's tokens of the routing probability of e (Switch
    Transformer, Fedus et al. 2021, eq. 4-6, with top-k assignments as in GShard; sigmoid
    scores are first normalized per token, DeepSeek-V3 report eqs. 17-20). Only ``P``
    carries gradient.

    Args:
      scores: float32 [B, T, E]. expert_ids: int32 [B, T, k]. score_fn: as the router's.

    Returns:
      float32 scalar.
    """
    num_experts = scores.shape[-1]
    probs = scores if score_fn == "softmax" else scores / jnp.sum(scores, -1, keepdims=True)
    counts = jax.nn.one_hot(expert_ids, num_experts, dtype=jnp.float32).sum(axis=(1, 2))  # [B, E]
    f = counts / (expert_ids.shape[1] * expert_ids.shape[2])
    p = jnp.mean(probs, axis=1)
    return num_experts * jnp.mean(jnp.sum(f * p, axis=-1))


class MoE(nnx.Module):
    """DeepSeekMoE feed-forward layer: router + routed experts + shared experts.

    ``y = shared_experts(x) + sum_{i in top-k} gate_i * expert_i(x)``, summed in float32
    and cast to this layer's ``policy.output_dtype`` (the only thing this container's own
    policy decides; the children run in theirs).

    Args:
      d_model: width. num_experts: routed experts E. num_shared_experts: always-on experts.
      top_k: routed experts per token. d_expert: width of each expert.
      score_fn: ``"softmax"`` or ``"sigmoid"``. capacity_factor, moe_kernel: see
        :class:`RoutedExperts`.
      path: attribute path, e.g. ``blocks/2/moe``; children at ``path/router``,
        ``path/experts``, ``path/shared_experts``.
      rules: per-module precision rules. rngs: NNX rngs.
      init_std / out_std: normal init std of input / output projections.
      router_options: ``norm_topk_prob``, ``routed_scaling_factor``, ``n_group``,
        ``topk_group``, ``group_score`` of :class:`Router`.
      bias: a learned router logit bias and biases on each expert's projections (GPT-OSS:
        :class:`Router`'s ``logit_bias``, :class:`RoutedExperts`' ``bias``).
      activation, swiglu_alpha, swiglu_limit: the routed experts' activation
        (:class:`RoutedExperts`).
      shared_gate: the shared experts' output times ``sigmoid(x w)`` in float32, ``w``
        ``[d_model, 1]`` (parameter ``shared_gate``, ``embed``; Qwen3-Next's
        ``shared_expert_gate``).
      target: the compile target of :class:`RoutedExperts`' kernel choice.
    """

    def __init__(self, d_model: int, num_experts: int, num_shared_experts: int, top_k: int,
                 d_expert: int, score_fn: str = "softmax", capacity_factor=None, *, path: str,
                 rules: PolicyRules, rngs: nnx.Rngs, init_std: float = 0.02, out_std: float = 0.02,
                 moe_kernel: str = "ragged_dot", target: Optional[compile_target.Target] = None,
                 bias: bool = False, activation: str = "silu",
                 swiglu_alpha: Optional[float] = None, swiglu_limit: Optional[float] = None,
                 shared_gate: bool = False, **router_options):
        self.path = path
        self.policy: Policy = rules.resolve(path)
        self.router = Router(d_model, num_experts, top_k, score_fn, path=f"{path}/router",
                             rules=rules, rngs=rngs, init_std=init_std, logit_bias=bias,
                             **router_options)
        self.experts = RoutedExperts(num_experts, d_model, d_expert, capacity_factor,
                                     path=f"{path}/experts", rules=rules, rngs=rngs,
                                     init_std=init_std, out_std=out_std, moe_kernel=moe_kernel,
                                     target=target, bias=bias, activation=activation,
                                     swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
        self.shared_experts = (
            SwiGLU(d_model, num_shared_experts * d_expert, path=f"{path}/shared_experts",
                   rules=rules, rngs=rngs, init_std=init_std, out_std=out_std)
            if num_shared_experts > 0 else None)
        if shared_gate:  # Qwen3-Next: sigmoid(x w) scales the shared experts' output
            self.shared_gate = make_param(rngs, nnx.initializers.normal(init_std), (d_model, 1),
                                          self.policy.param_dtype, ("embed", None))

    def __call__(self, x: jax.Array, *, expert_axis: Optional[str] = None,
                 dispatch_dtype: str = comm.DEFAULT_DISPATCH_DTYPE,
                 valid_length: Optional[jax.Array] = None,
                 operands: Optional[dict] = None):
        """[B, T, d_model] -> ([B, T, d_model] in ``policy.output_dtype``, :class:`MoEStats`).

        ``expert_axis``, ``dispatch_dtype``, ``valid_length``: the routed experts' (see
        :meth:`RoutedExperts.__call__`); ``operands``: see
        :func:`~jaxmp.models.layers.matmul`.
        """
        # No cast here: each child casts x to its own compute dtype, so a float32 router
        # sees the un-rounded input even when this layer's default is bfloat16.
        routing = self.router(x)
        y, dropped = self.experts(x, routing.expert_ids, routing.gates, expert_axis=expert_axis,
                                  dispatch_dtype=dispatch_dtype, valid_length=valid_length,
                                  operands=operands)
        y = y.astype(jnp.float32)
        if self.shared_experts is not None:
            shared = self.shared_experts(x, operands=operands).astype(jnp.float32)
            if hasattr(self, "shared_gate"):  # a float32 gate of the token (Qwen3-Next)
                shared = shared * jax.nn.sigmoid(jnp.einsum(
                    "btd,do->bto", x.astype(jnp.float32),
                    self.shared_gate[...].astype(jnp.float32)))
            y = y + shared
        num_experts = routing.scores.shape[-1]
        counts = jax.nn.one_hot(routing.expert_ids, num_experts,
                                dtype=jnp.float32).sum(axis=(0, 1, 2))
        stats = MoEStats(balance_loss(routing.scores, routing.expert_ids, self.router.score_fn),
                         counts, dropped)
        return self.policy.cast_to_output(y), stats
