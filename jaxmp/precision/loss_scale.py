"""Loss scales as pure pytrees, and the finiteness verdict that drives them.

Loss scaling (Micikevicius et al. 2018, "Mixed Precision Training", section 3.2)
multiplies the loss by ``S`` before the backward pass so that small float16 gradients
do not flush to zero, then divides the gradients by ``S`` in float32 before the
optimizer sees them. A *dynamic* loss scale finds ``S`` at run time: it grows by
``growth_factor`` after ``growth_interval`` finite steps in a row and backs off by
``backoff_factor`` when gradients overflow (PyTorch ``torch.amp.GradScaler``; jmp
``DynamicLossScale``; Flax ``DynamicScale``), optionally only after ``hysteresis``
overflowing steps (Megatron-LM ``DynamicGradScaler``).

Every loss scale here is an immutable pytree whose *every* field is a leaf, so the
whole configuration (not only the scale) survives ``jax.jit``, ``jax.tree`` round trips
and an orbax checkpoint; ``adjust`` is pure and returns a new object of the same type.
The scale is always float32 and the counters int32, whatever the compute dtype
(case LS-1: 65536 is ``inf`` in float16).

Threading a loss scale through your own train step::

    loss_scale = jaxmp.DynamicLossScale(loss_scale=2.0**15)

    @jax.jit
    def train_step(params, opt_state, loss_scale, batch):
        def loss_fn(p):
            loss = model_loss(policy.cast_to_compute(p), batch)  # float32 loss
            return loss_scale.scale(loss), loss
        grads, loss = jax.grad(loss_fn, has_aux=True)(params)
        grads = loss_scale.unscale(grads)                 # float32, true magnitude
        finite = jaxmp.all_finite(grads)                  # one verdict, every device
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jaxmp.select_tree(
            finite, (new_params, new_opt_state), (params, opt_state))
        return params, opt_state, loss_scale.adjust(finite), loss

:func:`jaxmp.optim.apply_gradients` packages exactly these lines.
"""
from __future__ import annotations

import re
from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._checks import F32_MAX

__all__ = [
    "LossScale",
    "NoOpLossScale",
    "StaticLossScale",
    "DynamicLossScale",
    "all_finite",
    "select_tree",
    "get_loss_scale",
    "as_loss_scale",
]


def _is_float_array(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _scale_leaf(x, factor):
    """Multiplies in (at least) float32 and casts back, so the scale itself never overflows
    ``x.dtype``."""
    if not _is_float_array(x):
        return x
    wide = jnp.promote_types(x.dtype, jnp.float32)
    return (x.astype(wide) * factor).astype(x.dtype)


def _unscale_leaf(x, loss_scale, dtype):
    if not _is_float_array(x):
        return x
    wide = jnp.promote_types(x.dtype, jnp.float32)
    out = x.astype(wide) / loss_scale.astype(wide)
    return out.astype(dtype if dtype is not None else x.dtype)


def _concrete(x) -> Optional[float]:
    """The Python value of ``x`` if it is known at trace time, else None."""
    if isinstance(x, jax.core.Tracer):
        return None
    try:
        return float(np.asarray(x))
    except Exception:  # pragma: no cover - odd leaves during tree manipulation
        return None


def _int32_at_least(v: float, lo: int) -> bool:
    return bool(np.isfinite(v)) and float(v).is_integer() and lo <= v <= np.iinfo(np.int32).max


class _PytreeMixin:
    """Registers a class whose fields (``_fields``) are all pytree leaves, with key paths.

    Not ``jax.tree_util.register_dataclass`` or ``flax.struct``: they unflatten through
    the constructor, and the constructors here check concrete values on the host
    (``float(np.asarray(x))``) and cast; on unflatten that would read back every jit output
    and refuse per-leaf maps (``jax.tree.map(lambda x: x.nbytes, ls)``). Unflattening here
    sets the leaves as they are.
    """

    _fields: Sequence[str] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        jax.tree_util.register_pytree_with_keys(
            cls,
            lambda obj: (tuple((jax.tree_util.GetAttrKey(f), getattr(obj, f)) for f in cls._fields),
                         None),
            lambda _, leaves: cls._from_leaves(leaves),
            flatten_func=lambda obj: (tuple(getattr(obj, f) for f in cls._fields), None),
        )

    @classmethod
    def _from_leaves(cls, leaves):
        # Bypasses __init__: leaves may be tracers, shape structs or sentinels.
        obj = object.__new__(cls)
        for f, v in zip(cls._fields, leaves):
            object.__setattr__(obj, f, v)
        return obj

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is immutable; use .replace(...) "
                             f"or .adjust(...)")

    def replace(self, **changes):
        """Returns a copy with some fields replaced (no validation: for advanced use)."""
        unknown = set(changes) - set(self._fields)
        if unknown:
            raise ValueError(f"unknown field(s) {sorted(unknown)}; fields: {list(self._fields)}")
        return self._from_leaves([changes.get(f, getattr(self, f)) for f in self._fields])

    def __repr__(self):
        def fmt(v):
            if isinstance(v, jax.core.Tracer) or np.ndim(v) != 0:
                return repr(v)
            return repr(np.asarray(v).item())
        body = ", ".join(f"{f}={fmt(getattr(self, f))}" for f in self._fields)
        return f"{type(self).__name__}({body})"


class LossScale(_PytreeMixin):
    """Common interface of the loss scales.

    Attributes:
      loss_scale: float32 scalar, the factor ``S`` the loss is multiplied by.
    """

    loss_scale: jax.Array

    def scale(self, tree: Any) -> Any:
        """Multiplies every floating-point leaf by ``loss_scale``.

        The product is formed in float32 and cast back, so each leaf keeps its dtype
        (a float16 loss stays float16, case LS-1) and the scale itself is never rounded
        to ``inf`` in float16; a product beyond the leaf dtype's range still becomes
        ``inf``, which is the overflow signal :meth:`adjust` reacts to.
        """
        return jax.tree.map(lambda x: _scale_leaf(x, self.loss_scale), tree)

    def unscale(self, tree: Any, dtype: Any = jnp.float32) -> Any:
        """Divides every floating-point leaf by ``loss_scale``, in float32.

        Args:
          tree: scaled gradients (any floating dtypes).
          dtype: dtype of the result; float32 by default, because a true gradient can
            exceed float16's range (case LS-3: 5e4 * 2 = 1e5 > 65504). ``None`` keeps
            each leaf's dtype (so a float16 leaf can overflow again).
        """
        return jax.tree.map(lambda x: _unscale_leaf(x, self.loss_scale, dtype), tree)

    def adjust(self, grads_finite: jax.Array) -> "LossScale":
        """Returns the loss scale for the next step given this step's verdict."""
        raise NotImplementedError


class NoOpLossScale(LossScale):
    """No loss scaling: ``scale`` and ``adjust`` change nothing (``loss_scale`` is 1)."""

    _fields = ()

    def __init__(self):
        pass

    @property
    def loss_scale(self) -> jax.Array:
        return jnp.ones((), jnp.float32)

    def scale(self, tree):
        return tree

    def adjust(self, grads_finite):
        return self


class StaticLossScale(LossScale):
    """A fixed loss scale (Micikevicius et al. 2018, section 3.2: a constant such as 8 to 32K).

    Args:
      loss_scale: the factor, > 0; stored as a float32 scalar.

    Raises:
      ValueError: ``loss_scale`` is not a positive finite number.
    """

    _fields = ("loss_scale",)

    def __init__(self, loss_scale: Union[float, jax.Array]):
        if np.ndim(loss_scale) != 0:
            raise ValueError(f"loss_scale must be a scalar, got shape {np.shape(loss_scale)}")
        value = _concrete(loss_scale)
        if value is not None and not (np.isfinite(value) and 0 < value <= F32_MAX):
            raise ValueError(f"loss_scale must be a positive finite float32, got {value}")
        object.__setattr__(self, "loss_scale", jnp.asarray(loss_scale, jnp.float32))

    def adjust(self, grads_finite):
        return self


class DynamicLossScale(LossScale):
    """Dynamic loss scaling with growth interval, backoff, hysteresis and bounds.

    Semantics of :meth:`adjust` (PyTorch GradScaler; hysteresis as in Megatron-LM
    ``DynamicGradScaler``):

    * finite step: ``counter += 1``; when it reaches ``growth_interval`` the scale becomes
      ``min(loss_scale * growth_factor, max_loss_scale)``, except that when the float32
      product overflows to ``inf`` the scale stays unchanged (jmp); ``counter`` resets to 0
      and the hysteresis budget refills to ``hysteresis``.
    * non-finite step: ``counter = 0`` and one unit of hysteresis budget is spent; once
      the budget is spent (after ``hysteresis`` non-finite steps since the last growth)
      the scale becomes ``max(loss_scale * backoff_factor, min_loss_scale)`` on each
      non-finite step.

    With ``backoff_factor = 1 / growth_factor``, ``hysteresis = 1`` and
    ``min_loss_scale = 1`` this is exactly ``jmp.DynamicLossScale``.

    Defaults: initial scale 256 (the DeepSeek mixed-precision article's stated default; it advises
    1024 or 4096 when training is unstable); ``growth_interval`` 2000 (PyTorch GradScaler, jmp);
    ``growth_factor`` 2 and ``backoff_factor`` 0.5 (PyTorch); ``hysteresis`` 1 (back off at once,
    PyTorch; Megatron-LM uses 2); ``min_loss_scale`` 1 (jmp, Megatron-LM), which may be set below 1
    (case LS-3); ``max_loss_scale`` the largest float32, so growth never produces ``inf``.

    All arguments are keyword-only; ``counter`` and ``hysteresis_counter`` (default
    ``hysteresis``) set a mid-training state. Every field is a pytree leaf: ``loss_scale``,
    ``min_loss_scale``, ``max_loss_scale``, ``growth_factor``, ``backoff_factor`` are
    float32 scalars; ``counter``, ``hysteresis_counter``, ``growth_interval``,
    ``hysteresis`` are int32 scalars.

    Raises:
      ValueError: on construction with concrete values that break
        ``0 < min_loss_scale <= loss_scale <= max_loss_scale <= float32 max``,
        ``growth_interval >= 1``, ``growth_factor >= 1``, ``0 < backoff_factor <= 1``,
        ``hysteresis >= 1``, ``counter >= 0`` or ``0 <= hysteresis_counter <= hysteresis``.
    """

    _fields = ("loss_scale", "counter", "hysteresis_counter", "growth_interval",
               "growth_factor", "backoff_factor", "hysteresis", "min_loss_scale",
               "max_loss_scale")

    def __init__(self, *, loss_scale=256.0, growth_interval=2000, growth_factor=2.0,
                 backoff_factor=0.5, hysteresis=1, min_loss_scale=1.0,
                 max_loss_scale=F32_MAX, counter=0, hysteresis_counter=None):
        if hysteresis_counter is None:
            hysteresis_counter = hysteresis
        values = dict(loss_scale=loss_scale, growth_interval=growth_interval,
                      growth_factor=growth_factor, backoff_factor=backoff_factor,
                      hysteresis=hysteresis, min_loss_scale=min_loss_scale,
                      max_loss_scale=max_loss_scale, counter=counter,
                      hysteresis_counter=hysteresis_counter)
        c = {k: _concrete(v) for k, v in values.items()}
        checks = [
            ("min_loss_scale", lambda v: 0 < v <= F32_MAX, "a positive finite float32"),
            ("max_loss_scale", lambda v: 0 < v <= F32_MAX, "a positive finite float32"),
            ("loss_scale", lambda v: np.isfinite(v) and v > 0, "a positive finite float32"),
            ("growth_interval", lambda v: _int32_at_least(v, 1), "an int32 >= 1"),
            ("growth_factor", lambda v: 1 <= v <= F32_MAX, "a finite float32 >= 1"),
            ("backoff_factor", lambda v: 0 < v <= 1, "in (0, 1]"),
            ("hysteresis", lambda v: _int32_at_least(v, 1), "an int32 >= 1"),
            ("counter", lambda v: _int32_at_least(v, 0), "an int32 >= 0"),
            ("hysteresis_counter", lambda v: _int32_at_least(v, 0), "an int32 >= 0"),
        ]
        for name, ok, allowed in checks:
            if c[name] is not None and not ok(c[name]):
                raise ValueError(f"{name}={c[name]!r} is not allowed; it must be {allowed}")
        lo, s, hi = c["min_loss_scale"], c["loss_scale"], c["max_loss_scale"]
        if None not in (lo, s, hi) and not lo <= s <= hi:
            raise ValueError(f"loss_scale={s!r} must lie in [min_loss_scale={lo!r}, "
                             f"max_loss_scale={hi!r}]")
        if (None not in (c["hysteresis"], c["hysteresis_counter"])
            and c["hysteresis_counter"] > c["hysteresis"]):
            raise ValueError(f"hysteresis_counter={c['hysteresis_counter']!r} must not exceed "
                             f"hysteresis={c['hysteresis']!r}")
        f32, i32 = jnp.float32, jnp.int32
        for name, dtype in (("loss_scale", f32), ("counter", i32),
                            ("hysteresis_counter", i32), ("growth_interval", i32),
                            ("growth_factor", f32), ("backoff_factor", f32),
                            ("hysteresis", i32), ("min_loss_scale", f32),
                            ("max_loss_scale", f32)):
            object.__setattr__(self, name, jnp.asarray(values[name], dtype))

    def adjust(self, grads_finite: jax.Array) -> "DynamicLossScale":
        """Returns the next loss scale given this step's global finiteness verdict.

        Args:
          grads_finite: bool scalar, from :func:`all_finite` on the unscaled gradients.

        Returns:
          A new ``DynamicLossScale``; all fields keep their dtypes (float32 / int32).

        Raises:
          ValueError: ``grads_finite`` is not a scalar.
        """
        finite = jnp.asarray(grads_finite)
        if finite.shape != ():
            raise ValueError(f"adjust needs one bool verdict (shape ()), got shape {finite.shape}; "
                             f"reduce with all_finite(grads)")
        finite = finite.astype(jnp.bool_)
        # Finite step: count, and grow after `growth_interval` finite steps in a row.
        counter = self.counter + 1
        grow = counter >= self.growth_interval
        grown = self.loss_scale * self.growth_factor
        grown = jnp.where(jnp.isfinite(grown), jnp.minimum(grown, self.max_loss_scale),
                          self.loss_scale)
        scale_if_finite = jnp.where(grow, grown, self.loss_scale)
        counter_if_finite = jnp.where(grow, 0, counter)
        hyst_if_finite = jnp.where(grow, self.hysteresis, self.hysteresis_counter)
        # Non-finite step: spend hysteresis; back off once it is spent (Megatron-LM).
        hyst_left = jnp.maximum(self.hysteresis_counter - 1, 0)
        backed_off = jnp.maximum(self.loss_scale * self.backoff_factor, self.min_loss_scale)
        scale_if_nonfinite = jnp.where(hyst_left <= 0, backed_off, self.loss_scale)
        return self.replace(
            loss_scale=jnp.where(finite, scale_if_finite, scale_if_nonfinite).astype(jnp.float32),
            counter=jnp.where(finite, counter_if_finite, 0).astype(jnp.int32),
            hysteresis_counter=jnp.where(finite, hyst_if_finite, hyst_left).astype(jnp.int32),
        )


def all_finite(tree: Any, axis_name: Optional[Union[str, Sequence[str]]] = None) -> jax.Array:
    """One verdict: are all floating-point values in ``tree`` finite (no NaN, no +-inf)?

    Under ``jax.jit`` with sharded arrays the reduction spans every shard and device:
    XLA inserts the cross-device reduction, so all replicas get the same verdict (case
    LS-5). Inside ``shard_map``/``pmap``, where arrays are per-device, pass ``axis_name``
    to reduce the verdict over those mesh axes too.

    Args:
      tree: a pytree; non-floating leaves (ints, bools) are ignored.
      axis_name: mesh axis name(s) to reduce over inside ``shard_map``/``pmap``.

    Returns:
      A bool scalar; True for a tree with no floating-point leaves.
    """
    # Python floats count too: a NaN loss returned as a float must not pass.
    leaves = [jnp.asarray(x) if isinstance(x, float) else x for x in jax.tree.leaves(tree)]
    leaves = [x for x in leaves if _is_float_array(x)]
    verdict = jnp.array(True)
    for x in leaves:
        verdict = verdict & jnp.all(jnp.isfinite(x))
    if axis_name is not None:
        verdict = jax.lax.pmin(verdict.astype(jnp.int32), axis_name).astype(jnp.bool_)
    return verdict


def select_tree(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    """Leafwise ``pred ? on_true : on_false`` with a scalar predicate.

    Selects, never multiplies by a mask: ``inf * 0`` is NaN (case LS-6), so a skipped
    step must keep the old values bitwise. Both trees must have the same structure,
    shapes and dtypes.

    Raises:
      ValueError: the structures, shapes or dtypes differ, or ``pred`` is not a scalar.
    """
    pred = jnp.asarray(pred)
    if pred.shape != ():
        raise ValueError(f"select_tree needs a scalar predicate, got shape {pred.shape}")
    t1, t2 = jax.tree.structure(on_true), jax.tree.structure(on_false)
    if t1 != t2:
        raise ValueError(f"select_tree needs two trees of one structure, got {t1} and {t2}")

    def select(a, b):
        a, b = jnp.asarray(a), jnp.asarray(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(f"select_tree leaves differ: {a.shape} {a.dtype} vs "
                             f"{b.shape} {b.dtype}")
        return jax.lax.select(pred.astype(jnp.bool_), a, b)

    return jax.tree.map(select, on_true, on_false)


def _jmp_kind(obj: Any) -> Optional[str]:
    """``"NoOpLossScale"`` etc. for an object of jmp's loss-scale classes, else None.

    Matched by module and class name, so jaxmp need not import jmp to recognise them.
    """
    cls = type(obj)
    if cls.__module__.split(".")[0] == "jmp" and cls.__name__ in (
            "NoOpLossScale", "StaticLossScale", "DynamicLossScale"):
        return cls.__name__
    return None


def as_loss_scale(loss_scale: Any, what: str = "loss_scale") -> LossScale:
    """A jaxmp loss scale for a jaxmp or a ``jmp`` loss scale.

    jaxmp's own loss scales are returned as they are. jmp's are converted field by
    field, to the jaxmp scale with the same behaviour under ``adjust``:

    * ``jmp.NoOpLossScale()`` -> :class:`NoOpLossScale`;
    * ``jmp.StaticLossScale(s)`` -> :class:`StaticLossScale` ``(s)`` (float32);
    * ``jmp.DynamicLossScale(loss_scale, counter, period, factor, min_loss_scale)`` ->
      :class:`DynamicLossScale` with ``growth_interval=period``,
      ``growth_factor=factor``, ``backoff_factor=1/factor``, ``hysteresis=1`` and
      ``max_loss_scale`` = float32 max: jmp grows after ``period`` finite steps in a
      row, unless the product is not finite, and backs off to
      ``max(min_loss_scale, loss_scale / factor)`` at once on a non-finite step
      (``jmp/_src/loss_scale.py``), which is what these fields mean here. The scale
      becomes float32 and the counter int32 whatever their jmp dtypes (case LS-1).

    Works on concrete values and under ``jax.jit`` (jmp's fields may be tracers).

    Args:
      loss_scale: a :class:`LossScale` or a jmp loss scale.
      what: the argument's name, for the error message.

    Returns:
      A :class:`LossScale`.

    Raises:
      ValueError: ``loss_scale`` is neither; or a jmp scale whose values jaxmp refuses
        (e.g. a scale of 0: jaxmp requires a positive scale).
    """
    if isinstance(loss_scale, LossScale):
        return loss_scale
    kind = _jmp_kind(loss_scale)
    if kind == "NoOpLossScale":
        return NoOpLossScale()
    if kind == "StaticLossScale":
        return StaticLossScale(jnp.asarray(loss_scale.loss_scale, jnp.float32))
    if kind == "DynamicLossScale":
        factor = loss_scale.factor
        return DynamicLossScale(
            loss_scale=jnp.asarray(loss_scale.loss_scale, jnp.float32),
            counter=jnp.asarray(loss_scale.counter, jnp.int32),
            growth_interval=loss_scale.period, growth_factor=factor,
            backoff_factor=1.0 / jnp.asarray(factor, jnp.float32), hysteresis=1,
            min_loss_scale=jnp.asarray(loss_scale.min_loss_scale, jnp.float32))
    raise ValueError(f"{what} must be a loss scale: jaxmp's NoOpLossScale, StaticLossScale or "
                     f"DynamicLossScale, or jmp's classes of the same names; got "
                     f"{type(loss_scale).__module__}.{type(loss_scale).__name__}")


def get_loss_scale(spec: Union[str, LossScale]) -> LossScale:
    """Builds a loss scale from a config string (or converts a jmp loss scale).

    Grammar: ``none`` | ``static:S`` | ``dynamic`` | ``dynamic:key=value,...`` with keys
    ``init`` (or ``loss_scale``), ``growth_interval``, ``growth_factor``,
    ``backoff_factor``, ``hysteresis``, ``min`` (``min_loss_scale``), ``max``
    (``max_loss_scale``). Values accept Python number syntax and ``2**k``.
    Example: ``dynamic:init=256,growth_interval=500``. A jaxmp loss scale is returned as
    it is, a jmp one converted by :func:`as_loss_scale`.

    Raises:
      ValueError: unknown kind or key, a key given twice, a value that is not a number
        (or not an integer for ``growth_interval``/``hysteresis``), or values the
        constructor rejects; the message names the bad token and what is allowed.
    """
    if isinstance(spec, LossScale) or _jmp_kind(spec):
        return as_loss_scale(spec)
    text = str(spec).strip()
    kind, _, args = text.partition(":")
    kind = kind.strip().lower()

    def number(token):
        token = token.strip()
        m = re.fullmatch(r"2\s*\*\*\s*(-?\d+)", token)
        out_of_range = ValueError(f"loss scale value {token!r} in {spec!r} is outside "
                                  f"float32's range")
        if m and not -149 <= int(m.group(1)) <= 127:  # float32's powers of two
            raise out_of_range
        try:
            value = 2.0 ** int(m.group(1)) if m else float(token)
        except OverflowError:
            raise out_of_range from None
        except ValueError:
            raise ValueError(f"loss scale value {token!r} in {spec!r} is not a number") from None
        with np.errstate(over="ignore", under="ignore"):
            f32 = np.float32(value)
        if np.isfinite(value) and value != 0 and (not np.isfinite(f32) or f32 == 0):
            raise out_of_range
        return value

    if kind in ("none", "noop", "no_op", ""):
        if args.strip():
            raise ValueError(f"loss scale 'none' takes no arguments, got {spec!r}")
        return NoOpLossScale()
    if kind == "static":
        if not args.strip():
            raise ValueError(f"static loss scale needs a value, e.g. 'static:1024', got {spec!r}")
        return StaticLossScale(number(args))
    if kind == "dynamic":
        keys = {"init": "loss_scale", "loss_scale": "loss_scale",
                "growth_interval": "growth_interval",
                "growth_factor": "growth_factor", "backoff_factor": "backoff_factor",
                "hysteresis": "hysteresis", "min": "min_loss_scale",
                "min_loss_scale": "min_loss_scale",
                "max": "max_loss_scale", "max_loss_scale": "max_loss_scale"}
        kwargs = {}
        for item in filter(None, (s.strip() for s in args.split(","))):
            key, eq, value = item.partition("=")
            key = key.strip().lower()
            if key not in keys:
                raise ValueError(f"unknown dynamic loss scale key {key!r} in {spec!r}; "
                                 f"allowed: {', '.join(sorted(keys))}")
            if not eq:
                raise ValueError(f"dynamic loss scale item {item!r} in {spec!r} needs a value: "
                                 f"{key}=VALUE")
            if keys[key] in kwargs:
                raise ValueError(f"dynamic loss scale key {key!r} in {spec!r} sets "
                                 f"{keys[key]} twice")
            v = number(value)
            if keys[key] in ("growth_interval", "hysteresis"):
                if not v.is_integer():
                    raise ValueError(f"{key}={value.strip()!r} in {spec!r} must be an integer")
                v = int(v)
            kwargs[keys[key]] = v
        return DynamicLossScale(**kwargs)
    raise ValueError(f"unknown loss scale kind {kind!r} in {spec!r}; allowed: none, static:S, "
                     f"dynamic[:key=value,...]")
