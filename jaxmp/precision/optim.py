"""Optax integration for mixed precision: Adam with low-precision moments, a skip-safe
update step, and gradient accumulation that one bad micro-step cannot poison.

The recipe (Micikevicius et al. 2018, "Mixed Precision Training", sections 3.1-3.2;
PyTorch ``torch.amp.GradScaler``):

1. keep float32 *master weights* and let the optimizer update those (section 3.1);
2. multiply the loss by the loss scale ``S`` before the backward pass (section 3.2);
3. divide the gradients by ``S`` in float32 **before anything else looks at them**, so
   gradient clipping and the norm you log see true magnitudes (GradScaler's
   ``unscale_`` before ``clip_grad_norm_``; case LS-7);
4. if any gradient is NaN or +-inf, skip the step: parameters, every optimizer state
   leaf (step count included, so a learning-rate schedule does not advance) and any
   other training state stay bitwise unchanged, chosen by a select, never by
   multiplying with 0 (``inf * 0`` is NaN; case LS-6); then back the scale off.

DeepSeek-V3 (technical report, section 3.3) keeps float32 master weights and stores
both AdamW moments in bfloat16; :func:`scale_by_adam` allows that through
``mu_dtype``/``nu_dtype`` while doing the moment arithmetic in float32.

bfloat16 master weights (the ``pure_bf16`` preset) lose every update below half an ulp
under round to nearest (case MW-1); :func:`with_update_rounding` applies the updates by
stochastic rounding (Zamirai et al. 2020; Ozkara et al., AISTATS 2025) or by Kahan-
compensated summation (optimi) instead, with its counter and compensation in the
optimizer state, so the bitwise skip, checkpoints and sharding cover them.

Threading a loss scale through your own train step::

    policy = jaxmp.get_policy("mixed_fp16")
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            jaxmp.optim.adamw(3e-4, weight_decay=0.1))
    opt_state = optimizer.init(params)                 # params are float32
    loss_scale = jaxmp.DynamicLossScale(loss_scale=2.0**15)

    @jax.jit
    def train_step(params, opt_state, loss_scale, batch):
        def loss_fn(p):
            loss = model_loss(policy.cast_to_compute(p), batch)
            return loss_scale.scale(loss), loss
        grads, loss = jax.grad(loss_fn, has_aux=True)(params)   # scaled
        out = jaxmp.optim.apply_gradients(optimizer, grads, opt_state, params, loss_scale)
        return out.params, out.opt_state, out.loss_scale, loss, out.grad_norm

Gradient accumulation: one loss scale and one finiteness verdict per effective batch
(inside ``train_step``, in place of the last two lines of its body)::

    acc = jaxmp.optim.accumulator_init(params)
    def micro(acc, mb):
        grads = jax.grad(lambda p: loss_scale.scale(model_loss(p, mb)))(params)
        return jaxmp.optim.accumulate(acc, grads, loss_scale), None
    acc, _ = jax.lax.scan(micro, acc, micro_batches)
    mean, finite = jaxmp.optim.accumulated_mean(acc)
    out = jaxmp.optim.apply_gradients(optimizer, mean, opt_state, params, loss_scale,
                                      grads_scaled=False, grads_finite=finite)
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from jaxmp._checks import Real, check, is_real

from jaxmp.precision.loss_scale import LossScale, all_finite, as_loss_scale, select_tree
from jaxmp.precision.policy import canonical_dtype

__all__ = [
    "ScaleByAdamState",
    "scale_by_adam",
    "adamw",
    "MixedPrecisionUpdate",
    "apply_gradients",
    "GradAccumulator",
    "accumulator_init",
    "accumulate",
    "accumulated_mean",
    "UPDATE_ROUNDINGS",
    "stochastic_round",
    "UpdateRoundingState",
    "RoundedTransformation",
    "with_update_rounding",
]


def _is_float(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _check_real(name: str, value: Any, lo: float, hi: Optional[float], allowed: str) -> None:
    """A Python number in ``[lo, hi)`` (:func:`jaxmp._checks.check`); arrays pass."""
    if is_real(value):
        check(name, value, Real(lo, hi, hi_open=True, finite=False, text=allowed))


class ScaleByAdamState(NamedTuple):
    """State of :func:`scale_by_adam`.

    Attributes:
      count: int32 scalar, the number of applied updates (the ``t`` of bias correction).
      mu: first moments, a tree like the params, each leaf in ``mu_dtype``.
      nu: second moments, a tree like the params, each leaf in ``nu_dtype``.
    """

    count: jax.Array
    mu: Any
    nu: Any


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                  eps_root: float = 0.0, mu_dtype: Any = None,
                  nu_dtype: Any = None) -> optax.GradientTransformation:
    """Adam's update direction with a storage dtype for each moment.

    Per leaf, in float32 whatever the storage dtypes (Kingma & Ba 2015, Algorithm 1)::

        mu = (1 - b1) * g + b1 * mu           nu = (1 - b2) * g**2 + b2 * nu
        mu_hat = mu / (1 - b1**t)             nu_hat = nu / (1 - b2**t)
        update = mu_hat / (sqrt(nu_hat + eps_root) + eps)

    The moments are then stored in ``mu_dtype``/``nu_dtype`` (DeepSeek-V3 report
    section 3.3.3 keeps both in bfloat16 next to float32 master weights; optax's own
    ``scale_by_adam`` has only ``mu_dtype``). The update has the dtype of the incoming
    gradient leaf. With float32 gradients and float32 moments, under ``jax.jit``, the
    update and both moments agree with ``optax.scale_by_adam`` to within 1 ulp (the same
    formulas; the bias corrections are not rounded in the same order, so an element can
    differ in its last bit).

    Args:
      b1: decay of the first moment, in [0, 1); default 0.9 (Kingma & Ba 2015).
      b2: decay of the second moment, in [0, 1); default 0.999 (Kingma & Ba 2015).
      eps: added to the denominator outside the square root, >= 0; default 1e-8.
      eps_root: added inside the square root, >= 0; default 0 (optax).
      mu_dtype: storage dtype of ``mu`` (e.g. ``"bf16"``); None = each param's dtype.
      nu_dtype: storage dtype of ``nu``; None = each param's dtype.

    Returns:
      An ``optax.GradientTransformation`` with state :class:`ScaleByAdamState`.

    Raises:
      ValueError: ``b1``/``b2`` outside [0, 1), negative ``eps``/``eps_root``, or a
        dtype that is not floating point.
    """
    _check_real("b1", b1, 0.0, 1.0, "in [0, 1)")
    _check_real("b2", b2, 0.0, 1.0, "in [0, 1)")
    _check_real("eps", eps, 0.0, None, ">= 0")
    _check_real("eps_root", eps_root, 0.0, None, ">= 0")
    mu_dtype = None if mu_dtype is None else canonical_dtype(mu_dtype)
    nu_dtype = None if nu_dtype is None else canonical_dtype(nu_dtype)

    def init_fn(params):
        def zeros(dtype):
            return jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), dtype or jnp.asarray(p).dtype),
                                params)
        return ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=zeros(mu_dtype),
                                nu=zeros(nu_dtype))

    def update_fn(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        # Bias corrections in float32 from the int count: 0.999**t in bfloat16 is 1.
        c1 = jnp.asarray(1 - b1 ** count, jnp.float32)
        c2 = jnp.asarray(1 - b2 ** count, jnp.float32)

        def f32(x):
            return x.astype(jnp.float32)

        mu = jax.tree.map(lambda g, m: (1 - b1) * f32(g) + b1 * f32(m), updates, state.mu)
        nu = jax.tree.map(lambda g, v: (1 - b2) * (f32(g) * f32(g)) + b2 * f32(v), updates,
                          state.nu)
        u = jax.tree.map(
            lambda g, m, v: ((m / c1) / (jnp.sqrt(v / c2 + eps_root) + eps)).astype(g.dtype),
            updates, mu, nu)
        m = jax.tree.map(lambda new, old: new.astype(old.dtype), mu, state.mu)
        v = jax.tree.map(lambda new, old: new.astype(old.dtype), nu, state.nu)
        return u, ScaleByAdamState(count=count, mu=m, nu=v)

    return optax.GradientTransformation(init_fn, update_fn)


def adamw(learning_rate: Any, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          weight_decay: float = 1e-4, mu_dtype: Any = None, nu_dtype: Any = None,
          mask: Any = None) -> optax.GradientTransformation:
    """AdamW (Loshchilov & Hutter 2019, decoupled weight decay) with per-moment dtypes.

    ``optax.chain(scale_by_adam(...), optax.add_decayed_weights(weight_decay, mask),
    optax.scale_by_learning_rate(learning_rate))``, i.e. optax.adamw's composition with
    :func:`scale_by_adam` in place of optax's. Defaults as ``optax.adamw``.

    Args:
      learning_rate: a number >= 0 or an optax schedule ``count -> lr``. A schedule
        reads the chain's own step count, which :func:`apply_gradients` leaves
        unchanged on a skipped step.
      b1, b2, eps, mu_dtype, nu_dtype: as in :func:`scale_by_adam`.
      weight_decay: decoupled decay coefficient (multiplied by the learning rate), >= 0.
      mask: optax mask (tree of bools or callable) of the params that decay.

    Returns:
      An ``optax.GradientTransformation``; its state is a tuple whose first element is a
      :class:`ScaleByAdamState`.

    Raises:
      ValueError: a negative ``learning_rate``/``weight_decay``, or as in
        :func:`scale_by_adam`.
    """
    if not callable(learning_rate):
        _check_real("learning_rate", learning_rate, 0.0, None, ">= 0 or an optax schedule")
    _check_real("weight_decay", weight_decay, 0.0, None, ">= 0")
    return optax.chain(
        scale_by_adam(b1=b1, b2=b2, eps=eps, mu_dtype=mu_dtype, nu_dtype=nu_dtype),
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    )


class MixedPrecisionUpdate(NamedTuple):
    """Result of :func:`apply_gradients`.

    Attributes:
      params: new params (old ones, bitwise, on a skipped step); dtypes unchanged.
      opt_state: new optimizer state (old one, bitwise, on a skipped step).
      loss_scale: ``loss_scale.adjust(grads_finite)``.
      extra: ``new_extra`` if the step was applied, else ``extra`` (None if not given).
      grads_finite: bool scalar, the gradient verdict that drives the loss scale.
      grad_norm: float32 scalar, global L2 norm of the unscaled gradients, computed in
        float32 before any clipping (inf/NaN on a skipped step).
      applied: bool scalar, True when the step was applied: the gradients were finite
        AND the new params, optimizer state and extra state are all finite (an update
        can overflow on finite gradients: a huge learning rate, float16 moments).
    """

    params: Any
    opt_state: Any
    loss_scale: LossScale
    extra: Any
    grads_finite: jax.Array
    grad_norm: jax.Array
    applied: jax.Array


def _check_scalar_bool(name: str, value: Any) -> jax.Array:
    value = jnp.asarray(value)
    if value.shape != ():
        raise ValueError(f"{name} must be a scalar bool, got shape {value.shape}")
    return value.astype(jnp.bool_)


def _to_float32(tree: Any, loss_scale: LossScale, grads_scaled: bool) -> Any:
    if grads_scaled:
        return loss_scale.unscale(tree, jnp.float32)
    return jax.tree.map(lambda g: g.astype(jnp.float32) if _is_float(g) else g, tree)


def _check_like(grads: Any, like: Any, what: str) -> None:
    """Raises ValueError unless ``grads`` has the tree structure and shapes of ``like``."""
    g_def, l_def = jax.tree.structure(grads), jax.tree.structure(like)
    if g_def != l_def:
        raise ValueError(f"grads and {what} must have one tree structure, got {g_def} and {l_def}")
    for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(like)):
        if jnp.shape(g) != jnp.shape(p):
            raise ValueError(f"gradient of shape {jnp.shape(g)} for a {what} leaf of shape "
                             f"{jnp.shape(p)}")


def _cast_like(grads: Any, like: Any) -> Any:
    """Casts each float gradient leaf to the dtype of the matching leaf of ``like``."""
    return jax.tree.map(
        lambda g, p: (g.astype(jnp.asarray(p).dtype)
                      if _is_float(g) and _is_float(jnp.asarray(p)) else g),
        grads, like)


def apply_gradients(optimizer: optax.GradientTransformation, grads: Any, opt_state: Any,
                    params: Any, loss_scale: LossScale, *, grads_scaled: bool = True,
                    grads_finite: Optional[jax.Array] = None, extra: Any = None,
                    new_extra: Any = None) -> MixedPrecisionUpdate:
    """One optimizer step under a loss scale, skipped as a whole if gradients overflow.

    Order (Micikevicius et al. 2018, section 3.2; PyTorch GradScaler):

    1. if ``grads_scaled``: ``grads = loss_scale.unscale(grads)`` in float32, first of
       all, so clipping inside ``optimizer`` (e.g. ``optax.chain(
       optax.clip_by_global_norm(1.0), adamw(...))``) and ``grad_norm`` see true
       magnitudes (case LS-7);
    2. ``grad_norm`` = global L2 norm of those float32 gradients;
    3. cast each gradient to its param's dtype (the master dtype, normally float32);
    4. ``finite = all_finite(grads) & grads_finite``; one verdict for all devices;
    5. ``optimizer.update`` and ``optax.apply_updates`` (round to nearest), or, for a
       :class:`RoundedTransformation` (:func:`with_update_rounding`), its own
       ``apply_updates`` (stochastic rounding or a Kahan-compensated sum);
    6. keep the new params, optimizer state (every leaf, counts included) and
       ``new_extra`` only if ``finite`` and they are all finite themselves, by a
       leafwise select (case LS-6): a skipped step is bitwise a no-op, whatever NaN the
       optimizer produced, so a non-finite value never reaches the state;
    7. ``loss_scale.adjust(finite)``: the scale reacts to gradient overflow only.

    Args:
      optimizer: any optax ``GradientTransformation`` (also ``optax.MultiSteps``), or a
        :class:`RoundedTransformation` from :func:`with_update_rounding`.
      grads: gradient tree, same structure and shapes as ``params``; any float dtypes.
      opt_state: ``optimizer.init(params)`` or a later state.
      params: the master weights.
      loss_scale: a :class:`jaxmp.LossScale` (``NoOpLossScale()`` for none) or a jmp
        loss scale, converted by :func:`jaxmp.as_loss_scale` (the returned
        ``loss_scale`` is then the jaxmp equivalent: keep that one).
      grads_scaled: True when ``grads`` are gradients of the scaled loss; False when
        already divided by the scale (e.g. :func:`accumulated_mean`).
      grads_finite: optional bool scalar ANDed into the verdict (e.g. from
        :func:`accumulated_mean`, or a NaN loss).
      extra: optional tree of other training state (e.g. MoE router biases) before
        the step.
      new_extra: that state after the step, same structure and dtypes; kept only if
        the step is applied. Give both or neither.

    Returns:
      A :class:`MixedPrecisionUpdate`.

    Raises:
      ValueError: ``loss_scale`` is not a loss scale; ``grads`` and ``params``
        differ in structure or shapes; ``grads_finite`` is not a scalar; only one of
        ``extra``/``new_extra`` is given.
    """
    loss_scale = as_loss_scale(loss_scale)
    if (extra is None) != (new_extra is None):
        raise ValueError("give both extra and new_extra, or neither")
    _check_like(grads, params, "params")
    if grads_finite is not None:
        grads_finite = _check_scalar_bool("grads_finite", grads_finite)

    grads32 = _to_float32(grads, loss_scale, grads_scaled)
    grad_norm = optax.tree.norm([g for g in jax.tree.leaves(grads32) if _is_float(g)])
    grads = _cast_like(grads32, params)
    finite = all_finite(grads)
    if grads_finite is not None:
        finite = finite & grads_finite

    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    if isinstance(optimizer, RoundedTransformation):  # stochastic or Kahan (bf16 masters)
        new_params, new_opt_state = optimizer.apply_updates(params, updates, new_opt_state)
    else:
        new_params = optax.apply_updates(params, updates)
    applied = finite & all_finite((new_params, new_opt_state, new_extra))
    params, opt_state = select_tree(applied, (new_params, new_opt_state), (params, opt_state))
    if extra is not None:
        extra = select_tree(applied, new_extra, extra)
    return MixedPrecisionUpdate(params=params, opt_state=opt_state,
                                loss_scale=loss_scale.adjust(finite), extra=extra,
                                grads_finite=finite, grad_norm=grad_norm.astype(jnp.float32),
                                applied=applied)


class GradAccumulator(NamedTuple):
    """Running sum of unscaled micro-batch gradients (see :func:`accumulate`).

    Attributes:
      grad_sum: tree like the params, each leaf in its param's dtype (the master
        dtype, normally float32): the sum of the finite micro-steps' gradients.
      count: int32 scalar, micro-steps seen (finite or not).
      finite: bool scalar, False once any micro-step had a NaN or +-inf gradient.
    """

    grad_sum: Any
    count: jax.Array
    finite: jax.Array


def accumulator_init(params: Any) -> GradAccumulator:
    """An empty accumulator: zeros in each param's dtype, ``count`` 0, ``finite`` True."""
    grad_sum = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.asarray(p).dtype), params)
    return GradAccumulator(grad_sum, jnp.zeros((), jnp.int32), jnp.ones((), jnp.bool_))


def accumulate(acc: GradAccumulator, grads: Any, loss_scale: LossScale, *,
               grads_scaled: bool = True) -> GradAccumulator:
    """Adds one micro-step's gradients to ``acc``, unless they are not finite.

    The gradients are unscaled in float32 (if ``grads_scaled``) and cast to the master
    dtype before the sum, so bfloat16/float16 compute gradients never meet a float32
    accumulator in mixed dtypes (case LS-8). A non-finite micro-step leaves
    ``grad_sum`` bitwise unchanged (a select; a multiply by 0 would turn inf into NaN)
    and sets ``finite`` to False, which skips the whole effective batch in
    :func:`apply_gradients`. Every micro-step must use the same ``loss_scale``; adjust
    it once per effective batch. With bfloat16 master weights (the pure ``bf16``
    preset) the sum is bfloat16 too and stops growing once an increment falls below
    its 8-bit mantissa (300 micro-steps of 1.0 average to about 0.85): keep float32
    masters for long accumulations.

    Args:
      acc: the accumulator so far.
      grads: this micro-step's gradients, structured like ``acc.grad_sum``.
      loss_scale: the :class:`jaxmp.LossScale` (or jmp loss scale) the loss was
        multiplied by.
      grads_scaled: False when ``grads`` are already unscaled.

    Returns:
      The new :class:`GradAccumulator` (``count`` + 1).

    Raises:
      ValueError: ``loss_scale`` is not a loss scale, or ``grads`` and
        ``acc.grad_sum`` differ in structure or shapes.
    """
    loss_scale = as_loss_scale(loss_scale)
    _check_like(grads, acc.grad_sum, "accumulator")
    grads = _cast_like(_to_float32(grads, loss_scale, grads_scaled), acc.grad_sum)
    ok = all_finite(grads)
    summed = jax.tree.map(lambda s, g: s + g, acc.grad_sum, grads)
    return GradAccumulator(grad_sum=select_tree(ok, summed, acc.grad_sum),
                           count=acc.count + 1, finite=acc.finite & ok)


def accumulated_mean(acc: GradAccumulator) -> tuple:
    """The mean gradient of an effective batch and its finiteness verdict.

    Args:
      acc: an accumulator after at least one :func:`accumulate`.

    Returns:
      ``(mean_grads, finite)``: ``grad_sum / count`` in each leaf's dtype (divided in
      float32), and the bool scalar ``acc.finite``. Pass both to :func:`apply_gradients`
      with ``grads_scaled=False, grads_finite=finite``.

    Raises:
      ValueError: ``acc.count`` is concretely 0 (nothing was accumulated).
    """
    if not isinstance(acc.count, jax.core.Tracer) and int(acc.count) == 0:
        raise ValueError("accumulated_mean of an empty accumulator (count=0); call "
                         "accumulate first")
    n = jnp.maximum(acc.count, 1).astype(jnp.float32)
    mean = jax.tree.map(lambda s: ((s.astype(jnp.float32) / n).astype(s.dtype)
                                   if _is_float(s) else s),
                        acc.grad_sum)
    return mean, acc.finite


# --- Low-precision master weights: how an update is rounded into a bfloat16 parameter ----

UPDATE_ROUNDINGS = ("nearest", "stochastic", "kahan")

_LOW_PRECISION = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _is_low_precision(x) -> bool:
    return hasattr(x, "dtype") and jnp.dtype(x.dtype) in _LOW_PRECISION


def _uniform_bits(key: jax.Array, shape) -> jax.Array:
    """uint32 random bits of ``shape``, each a function of ``key`` and its flat index only.

    ``jax.random.bits`` with a threefry key is counter based (Salmon et al. 2011, "Parallel
    random numbers: as easy as 1, 2, 3"): under ``jax.threefry_partitionable`` (set here
    while tracing; JAX's default since 0.5) element ``i`` is threefry2x32 of (key, i),
    whatever the sharding, so each device of a sharded leaf computes only its own slice of
    the one-device bits.
    """
    with jax.threefry_partitionable(True):  # read when traced: whatever the process's flag
        return jax.random.bits(key, tuple(shape), jnp.uint32)


def stochastic_round(x: jax.Array, dtype: Any, key: jax.Array) -> jax.Array:
    """Rounds ``x`` to ``dtype`` up or down at random, so that ``E[round(x)] = x``.

    bfloat16 (Zamirai et al. 2020, "Revisiting BFloat16 Training", section 3; torchao's
    ``_fp32_to_bf16_sr``): ``x`` is read as float32 bits, 16 uniform random bits are
    added below the bfloat16 mantissa and the low 16 bits are cut off. ``x`` rounds away
    from zero with probability (distance to the value toward zero) / (its ulp), the same
    rule on normals and subnormals and for either sign (sign-magnitude bits). A finite
    ``x`` within one ulp above the largest bfloat16 rounds to +-inf with that probability
    (round to nearest gives inf past half an ulp); inf and NaN pass through unchanged.

    float16: the two float16 neighbours of ``x`` bracket it and the upper one is taken
    with probability (|x| - |lower|) / (|upper| - |lower|), drawn from 24 random bits
    (the same rule; above 65504 the upper neighbour is inf, one ulp of 32 away).

    Args:
      x: any float array (cast to float32 first; bfloat16/float16 inputs are exact).
      dtype: ``bfloat16`` or ``float16`` (names as :func:`canonical_dtype`).
      key: a threefry PRNG key; element ``i`` of the result depends only on ``key``, ``i``
        and ``x[i]`` (:func:`with_update_rounding` derives the key from the seed, the
        step and the leaf).

    Returns:
      An array of ``dtype`` with the shape of ``x``.

    Raises:
      ValueError: ``dtype`` is not bfloat16 or float16.
    """
    dtype = canonical_dtype(dtype)
    if dtype not in _LOW_PRECISION:
        raise ValueError(f"stochastic_round rounds to bfloat16 or float16, not {dtype}")
    x = jnp.asarray(x).astype(jnp.float32)
    bits = _uniform_bits(key, x.shape)
    if dtype == jnp.bfloat16:
        xb = jax.lax.bitcast_convert_type(x, jnp.uint32)
        # A finite float32 plus at most 0xFFFF stays below the NaN patterns: the largest
        # finite (0x7F7FFFFF) reaches 0x7F80FFFE, which truncates to inf.
        cut = (xb + (bits >> 16)) >> 16
        out = jax.lax.bitcast_convert_type(cut.astype(jnp.uint16), jnp.bfloat16)
    else:
        info = jnp.finfo(dtype)
        near = x.astype(dtype)
        zero = jnp.zeros((), dtype)
        # The neighbour toward zero, and the one away from it.
        lower = jnp.where(jnp.abs(near.astype(jnp.float32)) > jnp.abs(x),
                          jnp.nextafter(near, zero), near)
        away = jnp.where(x < 0, jnp.asarray(-jnp.inf, dtype), jnp.asarray(jnp.inf, dtype))
        upper = jnp.nextafter(lower, away)
        lo32, up32 = jnp.abs(lower.astype(jnp.float32)), jnp.abs(upper.astype(jnp.float32))
        top_ulp = float(info.max) - float(jnp.nextafter(jnp.asarray(info.max, dtype), zero))
        width = jnp.where(jnp.isinf(up32), top_ulp, up32 - lo32)
        frac = (jnp.abs(x) - lo32) / jnp.where(width > 0, width, 1.0)
        u = (bits >> 8).astype(jnp.float32) * (2.0 ** -24)  # uniform on [0, 1)
        out = jnp.where(u < frac, upper, lower)
    return jnp.where(jnp.isfinite(x), out, x.astype(dtype))


class UpdateRoundingState(NamedTuple):
    """State of :func:`with_update_rounding`.

    Attributes:
      inner: the wrapped optimizer's state.
      count: int32 scalar, updates applied so far; the step of the stochastic counter.
        It advances only with the rest of the optimizer state, so a skipped step
        (:func:`apply_gradients` selects the old state back) draws no bits.
      compensation: ``kahan`` only (None otherwise): a tree like the params, each
        bfloat16/float16 leaf's lost low-order part in that leaf's dtype (built with
        ``jax.tree.map`` over the params, so NNX variables keep their sharding metadata
        and the buffer is sharded like its parameter); ``optax.MaskedNode()`` at float32
        leaves, which are updated exactly as without rounding.
    """

    inner: Any
    count: jax.Array
    compensation: Any


class RoundedTransformation(NamedTuple):
    """An optax-style transformation that also says how its updates reach the params.

    ``init`` and ``update`` are those of an ``optax.GradientTransformation`` (the updates
    pass through unchanged; ``update`` advances the counter). ``apply_updates(params,
    updates, state) -> (new_params, new_state)`` replaces ``optax.apply_updates``;
    :func:`apply_gradients` calls it. Wrap nothing around it (an ``optax.chain`` or
    ``optax.MultiSteps`` would drop ``apply_updates``): it is the outermost transformation.
    """

    init: Any
    update: Any
    apply_updates: Any


def with_update_rounding(optimizer: optax.GradientTransformation, rounding: str = "nearest",
                         seed: int = 0):
    """How ``optimizer``'s updates are added to bfloat16/float16 master weights.

    Round to nearest loses every update below half an ulp of the weight (2**-9 to 2**-8
    of |w| in bfloat16; case MW-1), so pure-bfloat16 weights stop learning at small
    learning rates. Two remedies keep 16-bit weights learning:

    * ``"stochastic"``: ``w <- stochastic_round(w + u)`` (:func:`stochastic_round`),
      unbiased, E[w_new] = w + u. Zamirai et al. 2020, "Revisiting BFloat16 Training";
      Ozkara et al., AISTATS 2025 (arXiv 2502.20566), bfloat16 with stochastic rounding
      matching bf16/fp32 mixed precision up to 6.7B; torchao's
      ``_AdamW(bf16_stochastic_round=True)``, llm.c. The random bits are counter based:
      ``threefry(key(seed), count, leaf index, element index)`` (:func:`_uniform_bits`),
      so a resumed run, a resharded one (zero1, fsdp) and one device draw the same bits.
    * ``"kahan"``: Kahan-compensated summation (Kahan 1965; optimi's Kahan-summation
      optimizers, ``optimi.utils.kahan``): a buffer ``c`` per parameter in its dtype keeps
      what rounding lost, ``y = c + u`` (float32), ``w_new = round(w + y)``,
      ``c_new = round(y - (w_new - w))``. Deterministic; costs one 16-bit buffer per
      parameter (8 bytes per parameter with bfloat16 moments and no float32 anywhere).
    * ``"nearest"``: returns ``optimizer`` itself (``optax.apply_updates``: round to
      nearest, as without this wrapper).

    Only bfloat16/float16 leaves are rounded this way; float32 leaves (norm scales and the
    router kept in float32 by a policy rule) get ``w + u`` in float32, as always.
    Under :func:`apply_gradients` a skipped step keeps the params, the compensation and
    the counter bitwise (the state is selected back), so the next step draws the bits
    the skipped one would have.

    Args:
      optimizer: the optax transformation computing the updates (clipping included).
      rounding: one of :data:`UPDATE_ROUNDINGS`.
      seed: int in [0, 2**31 - 1), the stochastic bits' seed (the trainer's ``seed``).

    Returns:
      ``optimizer`` for ``"nearest"``; else a :class:`RoundedTransformation` with state
      :class:`UpdateRoundingState`.

    Raises:
      ValueError: ``rounding`` not in :data:`UPDATE_ROUNDINGS`; a bad ``seed``.
    """
    if rounding not in UPDATE_ROUNDINGS:
        raise ValueError(f"update rounding {rounding!r} is not allowed; allowed: "
                         f"{', '.join(UPDATE_ROUNDINGS)}")
    if rounding == "nearest":
        return optimizer
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31 - 1:
        raise ValueError(f"seed={seed!r} is not allowed; it must be an int in [0, 2**31 - 1)")
    kahan = rounding == "kahan"

    def init_fn(params):
        comp = None
        if kahan:
            comp = jax.tree.map(lambda p: (jnp.zeros(jnp.shape(p), jnp.asarray(p).dtype)
                                           if _is_low_precision(p) else optax.MaskedNode()),
                                params)
        return UpdateRoundingState(inner=optimizer.init(params),
                                   count=jnp.zeros([], jnp.int32), compensation=comp)

    def update_fn(updates, state, params=None):
        updates, inner = optimizer.update(updates, state.inner, params)
        return updates, UpdateRoundingState(inner=inner, count=optax.safe_increment(state.count),
                                            compensation=state.compensation)

    def apply_fn(params, updates, state):
        flat_p, treedef = jax.tree.flatten(params)
        flat_u = treedef.flatten_up_to(updates)
        if kahan:
            flat_c = treedef.flatten_up_to(state.compensation)
        step_key = jax.random.fold_in(jax.random.key(seed, impl="threefry2x32"), state.count)
        new_p, new_c = [], []
        for i, (p, u) in enumerate(zip(flat_p, flat_u)):
            if not _is_low_precision(p):
                new_p.append(jnp.asarray(p + u).astype(jnp.asarray(p).dtype))
                new_c.append(flat_c[i] if kahan else None)
                continue
            p32 = p.astype(jnp.float32)
            if kahan:
                y = flat_c[i].astype(jnp.float32) + u.astype(jnp.float32)
                w = (p32 + y).astype(p.dtype)
                new_p.append(w)
                new_c.append((y - (w.astype(jnp.float32) - p32)).astype(p.dtype))
            else:
                new_p.append(stochastic_round(p32 + u.astype(jnp.float32), p.dtype,
                                              jax.random.fold_in(step_key, i)))
        comp = treedef.unflatten(new_c) if kahan else None
        return treedef.unflatten(new_p), state._replace(compensation=comp)

    return RoundedTransformation(init_fn, update_fn, apply_fn)
