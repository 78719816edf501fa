"""The building blocks of the Transformer: parameters, norms, embedding, head, SwiGLU, RoPE.

Every module resolves its :class:`~jaxmp.precision.policy.Policy` once, from its own
attribute path (``rules.resolve(path)``), creates its parameters in
``policy.param_dtype`` (the master weights), casts them and its input to
``policy.compute_dtype`` in ``__call__`` and returns ``policy.output_dtype``. Weights
are cast inside :func:`jaxmp.ops.cast_matmul`, so the backward pass recasts the float32
masters instead of keeping low-precision copies alive between the passes.

Every weight matmul goes through :func:`matmul`, which follows the module's policy: with
an FP8 recipe (``policy.fp8``, e.g. the ``fp8_blockwise`` preset) it is
:func:`jaxmp.fp8.matmul`, otherwise :func:`jaxmp.ops.cast_matmul`. Under the delayed
recipe each such weight has an :class:`FP8State` variable (``<weight>_amax``) with its
amax histories, created by :func:`add_fp8_states`.

Parameters carry logical axis names (``out_sharding`` metadata): ``vocab``, ``embed``
(model width), ``mlp`` (dense / shared-expert hidden width); :mod:`jaxmp.sharding` maps
them to mesh axes.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Sequence, Tuple

import numpy as np

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmp.models import lora
from jaxmp.precision import fp8, ops
from jaxmp.precision.policy import Policy, PolicyRules

__all__ = ["make_param", "RMSNorm", "Embed", "Head", "SwiGLU", "apply_rope", "FP8State",
           "add_fp8_states", "matmul", "Rope", "ROPE_LAYOUTS",
           "ROPE_SCALINGS", "MLP_ACTIVATIONS"]


class FP8State(nnx.Variable):
    """The amax histories of one FP8 matmul under delayed scaling: float32 ``[3, history]``.

    Rows: activation, weight, output gradient (:func:`jaxmp.fp8.init_state`). A variable
    type of its own, not an ``nnx.Param``: no optimizer touches it. The train step
    differentiates the loss with respect to it and *replaces* it with that cotangent,
    the updated history (:mod:`jaxmp.fp8`, "overwrite with gradient"); it lives in
    ``TrainState.rest`` and is checkpointed with the rest of the state. Replicated on a
    mesh (no logical axes).
    """


def add_fp8_states(module: nnx.Module, names) -> None:
    """Records ``names`` as the weights ``module`` multiplies by :func:`matmul`
    (``module.matmul_weights``: what :func:`jaxmp.models.lora.apply_lora` may adapt) and
    gives it an :class:`FP8State` ``<name>_amax`` per weight when its policy's FP8 recipe
    keeps a state (delayed scaling)."""
    module.matmul_weights = tuple(names)
    recipe = module.policy.fp8
    if recipe is not None and recipe.has_state:
        for name in names:
            setattr(module, f"{name}_amax", FP8State(fp8.init_state(recipe)))


def matmul(module: nnx.Module, x: jax.Array, name: str, spec: Optional[str] = None, *,
           group_sizes: Optional[jax.Array] = None, grouped=None,
           operands: Optional[dict] = None) -> jax.Array:
    """``x`` times the weight ``name`` of ``module``, by the module's policy.

    :func:`jaxmp.fp8.matmul` with ``module.policy.fp8`` (and the weight's
    :class:`FP8State` under delayed scaling) when the policy has an FP8 recipe, else
    :func:`jaxmp.ops.cast_matmul`. Both take the master weight as it is stored. A weight
    with a low-rank adapter (:func:`jaxmp.models.lora.apply_lora`) adds
    :func:`jaxmp.models.lora.lora_product`, in the compute dtype. A frozen E4M3 weight
    (``lora.base=fp8``: ``<name>_scale_inv`` beside it) is read as stored by the blockwise
    recipe (the policy's, or ``Recipe.blockwise()``), its scales passed to
    :func:`jaxmp.fp8.matmul`.

    Args:
      module: a module with a ``policy`` and the weight as attribute ``name``.
      x: the input in the compute dtype.
      name: the weight's attribute name (``"w_gate"``, ``"wq"``, ...).
      spec: an ``einsum`` spec, as for :func:`jaxmp.ops.cast_matmul`.
      group_sizes: int ``[G]`` for a grouped (``ragged_dot``) matmul.
      grouped: the grouped matmul that replaces ``ragged_dot`` without FP8 (see
        :func:`jaxmp.ops.cast_matmul`); an FP8 policy never gets one.
      operands: a dict to record the operands in, or None (nothing recorded): the entry
        ``"<module path>/<name>"`` is set to ``{"x": x, "w": the master weight, "spec":
        spec, "fp8": the policy's recipe or None}`` (the last call wins for a module run
        twice). The model passes it down from ``MoETransformer.__call__(operands=)``;
        :func:`jaxmp.diagnostics.fp8_report` reads it. Values are arrays when the model
        runs eagerly, tracers under ``jax.jit``, ``lax.scan`` or ``jax.checkpoint``.

    Returns:
      The product in ``x``'s dtype.
    """
    w = getattr(module, name)[...]
    recipe = module.policy.fp8
    if operands is not None:
        operands[f"{module.path}/{name}"] = {"x": x, "w": w, "spec": spec, "fp8": recipe}
    scales = lora.frozen_fp8(module, name)
    if scales is not None:  # a frozen E4M3 base weight (lora.base=fp8), read as stored
        blockwise = recipe if recipe is not None and recipe.name == "blockwise" \
            else fp8.Recipe.blockwise()
        y = fp8.matmul(x, w, blockwise, None, spec, group_sizes=group_sizes, scales=scales)
    elif recipe is None:
        y = ops.cast_matmul(x, w, spec, group_sizes=group_sizes, grouped=grouped)
    else:
        state = getattr(module, f"{name}_amax", None)
        y = fp8.matmul(x, w, recipe, None if state is None else state[...], spec,
                       group_sizes=group_sizes)
    adapter = lora.adapted(module, name)
    if adapter is None:
        return y
    return y + lora.lora_product(x, *adapter, spec).astype(y.dtype)


def make_param(rngs: "nnx.Rngs | ParamKeys", init, shape: Sequence[int], dtype, axes: Sequence[Optional[str]]
               ) -> nnx.Param:
    """Creates an ``nnx.Param`` in ``dtype`` carrying logical axis names.

    The names go into the variable's ``out_sharding`` metadata via
    ``nnx.with_partitioning``; ``eager_sharding=False`` because the logical names only
    become mesh axes in :mod:`jaxmp.sharding`, not at creation.

    Args:
      rngs: the NNX rng streams (``params`` is used).
      init: a ``jax.nn.initializers`` initializer.
      shape: the parameter shape.
      dtype: the parameter dtype (the policy's ``param_dtype``).
      axes: one logical axis name (or None) per dimension.
    """
    if len(axes) != len(shape):
        raise ValueError(f"{len(axes)} logical axes {tuple(axes)} for a parameter of shape "
                         f"{tuple(shape)}")
    initializer = nnx.with_partitioning(init, tuple(axes), eager_sharding=False)
    return nnx.Param(initializer(rngs.params(), tuple(shape), dtype))


class ParamKeys:
    """The keys ``rngs.params()`` would draw, one by one, with a single update of the
    stream's count at the end (:meth:`commit`): what :func:`make_param` draws from while a
    whole model is built.

    NNX draws a key as ``fold_in(key, count)`` and then updates its count variable; inside
    a trace (``nnx.eval_shape``, ``jax.jit``) each such update costs time in proportion to
    the trace so far (flax's ``Variable.set_value`` compares the new value's ``sharding``,
    and a tracer's ``.sharding`` raises an error whose message JAX builds by walking the
    trace, flax 0.12 / jax 0.10), so building a model of n layers took time ~n**2: 32
    layers of tiny_moe 1.8 s, 300 over a minute, 3,000 never. The keys here are the same
    ones (``fold_in(key, count + i)``), so the parameters are bitwise those NNX draws.

    Args:
      rngs: the model's ``nnx.Rngs`` (its ``params`` stream, or ``default`` where it has
        no ``params`` one, as NNX resolves it).
    """

    def __init__(self, rngs: nnx.Rngs):
        self._stream = rngs.params
        self._key, self._start, self._drawn = self._stream.key[...], self._stream.count[...], 0

    def params(self) -> jax.Array:
        """The next key of the ``params`` stream."""
        key = jax.random.fold_in(self._key, self._start + np.uint32(self._drawn))
        self._drawn += 1
        return key

    def commit(self) -> None:
        """Advances the stream's count past the keys drawn, as NNX's own draws would."""
        self._stream.count[...] = self._start + np.uint32(self._drawn)


class RMSNorm(nnx.Module):
    """RMSNorm (Zhang & Sennrich 2019) via ``ops.rms_norm`` (float32 statistics).

    The result is computed in ``policy.compute_dtype`` from ``x`` rounded to it, or
    from ``x`` itself when the compute dtype holds every value of ``x``'s dtype.
    Parameter ``scale`` [dim] (logical axis ``axis``, default ``embed``; ``head_dim`` for
    the per-head q/k norms of Qwen3, None for MLA's latent norms), ones, in
    ``policy.param_dtype``. With ``plus_one`` (Gemma's norms; Qwen3-Next's "zero-centred"
    ones) the gain is ``1 + scale``, added in float32 to the scale in the compute dtype
    (transformers' ``Gemma3RMSNorm``: ``(1.0 + weight.float())``), and ``scale`` starts
    at zeros.
    """

    def __init__(self, dim: int, eps: float, *, path: str, rules: PolicyRules, rngs: nnx.Rngs,
                 axis: Optional[str] = "embed", plus_one: bool = False):
        self.path = path
        self.policy: Policy = rules.resolve(path)
        self.eps = eps
        self.plus_one = bool(plus_one)
        init = nnx.initializers.zeros if plus_one else nnx.initializers.ones
        self.scale = make_param(rngs, init, (dim,), self.policy.param_dtype, (axis,))

    def __call__(self, x: jax.Array) -> jax.Array:
        """[..., dim] -> [..., dim] in ``policy.output_dtype``."""
        p = self.policy
        x = jnp.asarray(x)
        # ops.rms_norm computes in float32 whatever x's dtype, so a widening cast (a
        # bfloat16 stream into a float32 norm) would change no value, only keep a wider
        # copy of x for the backward pass. A narrowing one rounds x, as the policy says.
        if jnp.promote_types(x.dtype, p.compute_dtype) != p.compute_dtype:
            x = p.cast_to_compute(x)
        scale = p.cast_to_compute(self.scale[...])
        if self.plus_one:
            scale = 1.0 + scale.astype(jnp.float32)
        y = ops.rms_norm(x, scale, self.eps, dtype=p.compute_dtype)
        return p.cast_to_output(y)


class Embed(nnx.Module):
    """Token embedding: table [vocab, d_model] (``vocab``, ``embed``).

    The table is normal(0.02) (GPT-2) in ``policy.param_dtype``; looked-up rows are cast
    to the compute dtype, multiplied by ``scale`` (Gemma's ``sqrt(d_model)``;
    ``ModelConfig.embed_scale``), then cast to the output dtype.

    With ``head_path`` (tied embeddings, ``ModelConfig.tie_embeddings``) the table is the
    output projection too: :meth:`attend` multiplies by its transpose in the policy that
    ``head_path`` resolves to (``head_policy``), as :class:`Head` would.

    Raises:
      ValueError: tied embeddings whose head policy has an FP8 recipe (not supported).
    """

    def __init__(self, vocab_size: int, d_model: int, *, path: str, rules: PolicyRules,
                 rngs: nnx.Rngs, head_path: Optional[str] = None, scale: float = 1.0):
        self.path = path
        self.policy: Policy = rules.resolve(path)
        self.scale = float(scale)
        self.table = make_param(rngs, nnx.initializers.normal(0.02), (vocab_size, d_model),
                                self.policy.param_dtype, ("vocab", "embed"))
        self.head_policy: Optional[Policy] = None
        if head_path is not None:
            self.head_policy = rules.resolve(head_path)
            if self.head_policy.fp8 is not None:
                raise ValueError(f"model.tie_embeddings=True with an FP8 policy for "
                                 f"{head_path!r}; allowed: a non-FP8 head policy")

    def attend(self, x: jax.Array) -> jax.Array:
        """Tied output projection: [..., d_model] -> [..., vocab] in the head's compute
        dtype (``x @ table.T``)."""
        p = self.head_policy
        return ops.cast_matmul(p.cast_to_compute(x), self.table[...], "...d,vd->...v")

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """int [B, T] -> [B, T, d_model] in ``policy.output_dtype``; the rows times
        ``scale`` (in the compute dtype, as transformers' ``Gemma3TextScaledWordEmbedding``
        multiplies in the weights' dtype) where it is not 1."""
        rows = self.policy.cast_to_compute(jnp.take(self.table[...], tokens, axis=0))
        if self.scale != 1.0:
            rows = rows * jnp.asarray(self.scale, rows.dtype)
        return self.policy.cast_to_output(rows)


class Head(nnx.Module):
    """Untied output projection: kernel [d_model, vocab] (``embed``, ``vocab``).

    Returns the logits in ``policy.compute_dtype``; ``policy.output_dtype`` is not used
    (as for the router). Under an ``fp8_*`` default policy the head stays in bfloat16
    (:data:`jaxmp.models.transformer.FP8_EXCLUDED`) unless a rule names it. The loss,
    :func:`jaxmp.ops.cross_entropy`, upcasts them to float32 inside its island, so the values and
    gradients are those of a float32 cast here, but the ``[B, T, vocab]`` array kept for the
    backward pass is not a float32 copy.
    """

    def __init__(self, d_model: int, vocab_size: int, *, path: str, rules: PolicyRules,
                 rngs: nnx.Rngs):
        self.path = path
        self.policy: Policy = rules.resolve(path)
        self.kernel = make_param(rngs, nnx.initializers.normal(0.02), (d_model, vocab_size),
                                 self.policy.param_dtype, ("embed", "vocab"))
        add_fp8_states(self, ("kernel",))

    def __call__(self, x: jax.Array, *, operands: Optional[dict] = None) -> jax.Array:
        """[..., d_model] -> [..., vocab] in ``policy.compute_dtype``; ``operands``: see
        :func:`matmul`."""
        p = self.policy
        return matmul(self, p.cast_to_compute(x), "kernel", operands=operands)


# The gated FFN's activations (ModelConfig.mlp_activation): SiLU (SwiGLU) or GELU with
# the tanh approximation (GeGLU; transformers' "gelu_pytorch_tanh", Gemma).
MLP_ACTIVATIONS = {"silu": jax.nn.silu,
                   "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


def _swiglu(module, x, operands=None):
    """SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer"): (silu(x Wg) * x Wu) Wd,
    or GeGLU with ``module.activation == "gelu_tanh"`` (:data:`MLP_ACTIVATIONS`).

    x in the compute dtype; the (master) weights ``w_gate``, ``w_up``, ``w_down`` of
    ``module`` are multiplied by :func:`matmul` (cast by ``ops.cast_matmul``, or FP8).
    """
    act = MLP_ACTIVATIONS[getattr(module, "activation", "silu")]
    h = (act(matmul(module, x, "w_gate", operands=operands))
         * matmul(module, x, "w_up", operands=operands))
    return matmul(module, h, "w_down", operands=operands)


class SwiGLU(nnx.Module):
    """SwiGLU feed-forward network: the dense FFN and the shared experts.

    Args:
      d_model: input/output width.
      d_hidden: hidden width.
      path: the module's attribute path (its policy is ``rules.resolve(path)``).
      rules: the per-module precision rules.
      rngs: NNX rngs.
      init_std: std of the input projections (normal init).
      out_std: std of the output projection (scaled down for residual branches, GPT-2).
      activation: a key of :data:`MLP_ACTIVATIONS` (``"gelu_tanh"``: GeGLU).

    Parameters: ``w_gate``, ``w_up`` [d_model, d_hidden] (``embed``, ``mlp``), ``w_down``
    [d_hidden, d_model] (``mlp``, ``embed``), in ``policy.param_dtype``; under delayed FP8
    scaling an :class:`FP8State` per weight.
    """

    def __init__(self, d_model: int, d_hidden: int, *, path: str, rules: PolicyRules,
                 rngs: nnx.Rngs, init_std: float = 0.02, out_std: float = 0.02,
                 activation: str = "silu"):
        self.path = path
        self.policy: Policy = rules.resolve(path)
        self.activation = activation
        dt = self.policy.param_dtype
        self.w_gate = make_param(rngs, nnx.initializers.normal(init_std), (d_model, d_hidden), dt,
                                 ("embed", "mlp"))
        self.w_up = make_param(rngs, nnx.initializers.normal(init_std), (d_model, d_hidden), dt,
                               ("embed", "mlp"))
        self.w_down = make_param(rngs, nnx.initializers.normal(out_std), (d_hidden, d_model), dt,
                                 ("mlp", "embed"))
        add_fp8_states(self, ("w_gate", "w_up", "w_down"))

    def __call__(self, x: jax.Array, *, operands: Optional[dict] = None) -> jax.Array:
        """[..., d_model] -> [..., d_model] in ``policy.output_dtype``; ``operands``: see
        :func:`matmul`."""
        p = self.policy
        return p.cast_to_output(_swiglu(self, p.cast_to_compute(x), operands))


def apply_rope(x: jax.Array, positions: jax.Array, theta: float = 10000.0,
               rope: Optional[Rope] = None) -> jax.Array:
    """Rotary position embedding (Su et al. 2021, RoFormer, eq. 34), half-split layout.

    Dimension ``i < h/2`` is paired with ``i + h/2`` (GPT-NeoX / LLaMA layout) and the
    pair is rotated by ``position * theta ** (-2 i / h)`` radians. Angles and the
    rotation are computed in float32; the result has ``x``'s dtype. The backward pass
    (a rotation by the opposite angles) recomputes the float32 ``cos``/``sin`` tables
    from ``positions`` (``jax.checkpoint``) instead of keeping them between the passes.

    Args:
      x: [B, T, H, h] queries or keys, h even.
      positions: integer positions, [T] (every row alike) or [B, T] (per row: packed
        documents restart at 0, :meth:`jaxmp.models.MoETransformer.__call__`).
      theta: the base.
      rope: a :class:`Rope` (partial rotary, interleaved layout, llama3/yarn scaling);
        when given, ``theta`` is ignored. None or a plain one is the rotation above.

    Returns:
      Rotated ``x``, same shape and dtype.
    """
    if rope is not None and not rope.is_plain():
        return jax.checkpoint(functools.partial(_rope_general, rope=rope),
                              policy=jax.checkpoint_policies.nothing_saveable)(x, positions)
    if rope is not None:
        theta = rope.theta
    return jax.checkpoint(functools.partial(_rope, theta=theta),
                          policy=jax.checkpoint_policies.nothing_saveable)(x, positions)


ROPE_LAYOUTS = ("half", "interleaved")
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class Rope:
    """The rotary embedding of released checkpoints: base, rotated width, layout, scaling.

    Attributes:
      theta: the base (Su et al. 2021).
      dim: rotated dimensions per head (even); the first ``dim`` of the head are rotated,
        the rest pass through (partial rotary, GPT-NeoX / GLM); 0 = the whole head.
      layout: ``"half"`` pairs dimension ``i`` with ``i + dim/2`` (GPT-NeoX / LLaMA);
        ``"interleaved"`` pairs ``2i`` with ``2i + 1`` (RoFormer, DeepSeek's
        ``rope_interleave``).
      scaling: ``"none"``, ``"linear"`` (position interpolation, Chen et al. 2023: every
        frequency divided by ``factor``; Gemma 3's global layers), ``"llama3"`` (Llama 3.1
        frequency-band interpolation) or
        ``"yarn"`` (Peng et al. 2023, YaRN, with DeepSeek's ``mscale`` /
        ``mscale_all_dim``); formulas as transformers' ``modeling_rope_utils``
        (``_compute_llama3_parameters``, ``_compute_yarn_parameters`` with ``truncate``).
      factor: context extension factor (linear, llama3, yarn).
      original_max_len: the pre-extension context (llama3, yarn).
      low_freq_factor, high_freq_factor: llama3's band edges.
      beta_fast, beta_slow: yarn's ramp edges in rotations.
      mscale, mscale_all_dim: yarn's attention-factor scalars (0 = unset).
      truncate: yarn's ``truncate``: the ramp's edges rounded out to whole dimensions
        (``floor`` / ``ceil``), else fractional (GPT-OSS).
    """

    # No defaults here: ModelConfig's ``rope_<name>`` fields (config keys ``model.rope_*``)
    # declare them once, and ModelConfig.rope builds this from them by name.
    theta: float
    dim: int
    layout: str
    scaling: str
    factor: float
    original_max_len: int
    low_freq_factor: float
    high_freq_factor: float
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float
    truncate: bool

    def is_plain(self) -> bool:
        """True for the whole-head, half-split, unscaled RoPE of :func:`apply_rope`'s default."""
        return self.dim == 0 and self.layout == "half" and self.scaling == "none"

    def inv_freq(self, dim: int) -> Tuple[np.ndarray, float]:
        """``(inverse frequencies float64 [dim/2], attention factor)`` for ``dim`` rotated
        dimensions; the factor multiplies cos and sin (1 unless yarn)."""
        inv = 1.0 / self.theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        if self.scaling == "linear":
            return inv / self.factor, 1.0
        if self.scaling == "llama3":
            low_wl = self.original_max_len / self.low_freq_factor
            high_wl = self.original_max_len / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wl, inv / self.factor, inv)
            smooth = ((self.original_max_len / wavelen - self.low_freq_factor)
                      / (self.high_freq_factor - self.low_freq_factor))
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= high_wl) & (wavelen <= low_wl)
            return np.where(medium, smoothed, scaled), 1.0
        if self.scaling == "yarn":
            def correction(rotations):
                return (dim * math.log(self.original_max_len / (rotations * 2 * math.pi))
                        / (2 * math.log(self.theta)))

            low, high = correction(self.beta_fast), correction(self.beta_slow)
            if self.truncate:
                low, high = math.floor(low), math.ceil(high)
            low, high = max(low, 0), min(high, dim - 1)
            if low == high:
                high += 0.001
            ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
            extrapolate = 1 - ramp
            inv = inv / self.factor * (1 - extrapolate) + inv * extrapolate
            if self.mscale and self.mscale_all_dim:
                factor = yarn_mscale(self.factor, self.mscale) / yarn_mscale(
                    self.factor, self.mscale_all_dim)
            else:
                factor = yarn_mscale(self.factor)
            return inv, factor
        return inv, 1.0


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 mscale ln(factor) + 1`` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope_general(x, positions, rope: Rope):
    h = x.shape[-1]
    r = rope.dim or h
    inv, factor = rope.inv_freq(r)
    angle = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv, jnp.float32)
    cos = (jnp.cos(angle) * factor)[..., None, :]  # [(B,) T, 1, r/2]: over the heads
    sin = (jnp.sin(angle) * factor)[..., None, :]
    x32 = x.astype(jnp.float32)
    xr, rest = x32[..., :r], x32[..., r:]
    if rope.layout == "half":
        x1, x2 = xr[..., : r // 2], xr[..., r // 2:]
        out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(xr.shape)
    return jnp.concatenate([out, rest], axis=-1).astype(x.dtype)


def _rope(x, positions, theta):
    h = x.shape[-1]
    inv_freq = theta ** (-jnp.arange(0, h // 2, dtype=jnp.float32) * 2.0 / h)
    angle = positions.astype(jnp.float32)[..., None] * inv_freq  # [(B,) T, h/2]
    cos, sin = jnp.cos(angle)[..., None, :], jnp.sin(angle)[..., None, :]  # over the heads
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., : h // 2], x32[..., h // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


