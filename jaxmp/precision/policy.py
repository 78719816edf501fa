"""Precision policies: which dtype parameters are stored in, computed in, and returned in.

A :class:`Policy` is the jmp idea (``jmp.Policy``, github.com/google-deepmind/jmp) kept
as a tiny frozen, hashable dataclass so it can be a static argument under ``jax.jit``:

* ``param_dtype``: the dtype of the *master weights* the optimizer updates. Mixed
  precision keeps them in float32 (Micikevicius et al. 2018, "Mixed Precision
  Training", section 3.1) so that small updates are not rounded away.
* ``compute_dtype``: the dtype matmuls and activations run in (bfloat16 / float16).
* ``output_dtype``: the dtype a module hands back to its caller.
* ``fp8``: None, or a :class:`jaxmp.fp8.Recipe`: the module's matmuls multiply FP8
  operands scaled by that recipe (:mod:`jaxmp.precision.fp8`), the rest of the module
  computing in ``compute_dtype``.

:func:`get_policy` parses jmp's grammar (``params=float32,compute=bfloat16,output=float32``
or ``p=f32,c=bf16,o=f32`` or a bare dtype), jaxmp's ``fp8=RECIPE`` key, and the presets
in :data:`PRESETS`.

:class:`PolicyRules` maps module paths to policies (per-module overrides such as
"router and norms in float32", DeepSeek-V3 report section 3.3), resolved once per
module when the model is built.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp.precision._fp8.recipe import Recipe

__all__ = [
    "Policy",
    "get_policy",
    "PolicyRules",
    "get_policy_rules",
    "with_float32_islands",
    "without_fp8",
    "canonical_dtype",
    "PRESETS",
    "DTYPE_NAMES",
]

# Accepted spellings of each dtype (jmp's plus the short forms used in configs).
DTYPE_NAMES: Mapping[str, str] = {
    "float32": "float32", "f32": "float32", "fp32": "float32", "full": "float32",
    "single": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "f16": "float16", "fp16": "float16", "half": "float16",
    "float64": "float64", "f64": "float64", "double": "float64",
}

_KEYS = {
    "params": "param_dtype", "param": "param_dtype", "p": "param_dtype",
    "compute": "compute_dtype", "c": "compute_dtype",
    "output": "output_dtype", "o": "output_dtype",
    "fp8": "fp8",
}

PRESETS: Mapping[str, str] = {
    # Plain float32 training: the reference every mixed mode is compared against.
    "fp32": "params=float32,compute=float32,output=float32",
    # FP32 master weights, BF16 compute, FP32 outputs (loss in float32).
    "mixed_bf16": "params=float32,compute=bfloat16,output=float32",
    # FP32 master weights, FP16 compute: needs a loss scale (Micikevicius et al. 2018).
    "mixed_fp16": "params=float32,compute=float16,output=float32",
    # Pure bfloat16: parameters too. Kept for comparison; small updates are lost (case MW-1).
    "bf16": "params=bfloat16,compute=bfloat16,output=bfloat16",
    # bfloat16 master weights with a float32 loss: pair with optim.update_rounding=stochastic
    # or kahan (jaxmp.optim.with_update_rounding), else small updates are lost as with bf16.
    "pure_bf16": "params=bfloat16,compute=bfloat16,output=float32",
    # mixed_bf16 with the module's matmuls in FP8 by a jaxmp.fp8 recipe (jaxmp.precision.fp8).
    "fp8_tensorwise": "params=float32,compute=bfloat16,output=float32,fp8=tensorwise",
    "fp8_delayed": "params=float32,compute=bfloat16,output=float32,fp8=delayed",
    "fp8_rowwise": "params=float32,compute=bfloat16,output=float32,fp8=rowwise",
    "fp8_blockwise": "params=float32,compute=bfloat16,output=float32,fp8=blockwise",
}


def canonical_dtype(name: Any) -> jnp.dtype:
    """Turns a dtype spelling into a ``jnp.dtype``.

    Args:
      name: a string from :data:`DTYPE_NAMES` (case-insensitive), or anything
        ``jnp.dtype`` accepts that is a floating-point dtype.

    Returns:
      The floating-point ``jnp.dtype``.

    Raises:
      ValueError: the name is unknown or not a floating-point dtype; the message
        names the bad value and lists the accepted names.
    """
    if name is None:  # jnp.dtype(None) would silently give the default float dtype
        raise ValueError(f"dtype None is not allowed; allowed: {', '.join(sorted(DTYPE_NAMES))}")
    if isinstance(name, str):
        key = name.strip().lower()
        if key not in DTYPE_NAMES:
            raise ValueError(
                f"unknown dtype {name!r}; allowed: {', '.join(sorted(DTYPE_NAMES))}")
        return jnp.dtype(DTYPE_NAMES[key])
    try:
        dtype = jnp.dtype(name)
    except TypeError as e:
        raise ValueError(f"unknown dtype {name!r}; allowed: "
                         f"{', '.join(sorted(DTYPE_NAMES))}") from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype {dtype} is not a floating-point dtype; a policy needs one of "
                         f"{', '.join(sorted(set(DTYPE_NAMES.values())))}")
    return dtype


def _cast_floating(tree: Any, dtype: jnp.dtype) -> Any:
    """Casts the floating-point array leaves of ``tree`` to ``dtype``; others pass through."""

    def cast(x):
        if (isinstance(x, (jax.Array, np.ndarray, np.generic))
            and jnp.issubdtype(x.dtype, jnp.floating)):
            return x.astype(dtype)
        if isinstance(x, float):  # Python floats become arrays of the target dtype.
            return jnp.asarray(x, dtype)
        return x

    return jax.tree.map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
    """A mixed-precision policy: parameter, compute and output dtypes.

    Frozen and hashable, so it can be a static argument of ``jax.jit`` and a field of
    an NNX module. ``str(policy)`` gives ``params=float32,compute=bfloat16,output=float32``
    (plus ``,fp8=blockwise`` with an FP8 recipe) which :func:`get_policy` parses back to an
    equal policy.

    Attributes:
      param_dtype: dtype of the master weights (float32 for mixed precision).
      compute_dtype: dtype of matmuls and activations.
      output_dtype: dtype of a module's result.
      fp8: None, or the :class:`jaxmp.fp8.Recipe` of the module's matmuls (a recipe
        name such as ``"blockwise"`` is parsed by :meth:`jaxmp.fp8.Recipe.parse`).

    Raises:
      ValueError: a bad dtype, float64 without ``jax_enable_x64``, or a bad recipe.
    """

    param_dtype: jnp.dtype
    compute_dtype: jnp.dtype
    output_dtype: jnp.dtype
    fp8: Optional[Recipe] = None

    def __post_init__(self):
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(self, field, canonical_dtype(getattr(self, field)))
            if getattr(self, field) == jnp.float64 and not jax.config.read("jax_enable_x64"):
                raise ValueError(f"{field}=float64 needs jax_enable_x64 (JAX would silently use "
                                 "float32); enable it with jax.config.update('jax_enable_x64', "
                                 "True)")
        if isinstance(self.fp8, str):
            object.__setattr__(self, "fp8", None if self.fp8.strip().lower() == "none"
                               else Recipe.parse(self.fp8))
        if self.fp8 is not None and not isinstance(self.fp8, Recipe):
            raise ValueError(f"fp8={self.fp8!r} must be None, a jaxmp.fp8.Recipe or a recipe name")

    def cast_to_param(self, tree: Any) -> Any:
        """Casts floating-point leaves of ``tree`` to ``param_dtype``; ints, bools pass through."""
        return _cast_floating(tree, self.param_dtype)

    def cast_to_compute(self, tree: Any) -> Any:
        """Casts floating-point leaves of ``tree`` to ``compute_dtype``; ints, bools pass
        through."""
        return _cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        """Casts floating-point leaves of ``tree`` to ``output_dtype``; ints, bools pass through."""
        return _cast_floating(tree, self.output_dtype)

    def with_param_dtype(self, dtype: Any) -> "Policy":
        """Returns a copy with another ``param_dtype``."""
        return dataclasses.replace(self, param_dtype=dtype)

    def with_compute_dtype(self, dtype: Any) -> "Policy":
        """Returns a copy with another ``compute_dtype``."""
        return dataclasses.replace(self, compute_dtype=dtype)

    def with_output_dtype(self, dtype: Any) -> "Policy":
        """Returns a copy with another ``output_dtype``."""
        return dataclasses.replace(self, output_dtype=dtype)

    def with_fp8(self, recipe: Optional[Recipe]) -> "Policy":
        """Returns a copy with another FP8 recipe (None: matmuls in ``compute_dtype``)."""
        return dataclasses.replace(self, fp8=recipe)

    @property
    def needs_loss_scale(self) -> bool:
        """True when gradients flow through float16, whose range needs a loss scale."""
        return jnp.dtype(jnp.float16) in (self.compute_dtype, self.param_dtype)

    def __str__(self) -> str:
        fp8 = "" if self.fp8 is None else f",fp8={self.fp8}"
        return (f"params={self.param_dtype.name},compute={self.compute_dtype.name},"
                f"output={self.output_dtype.name}{fp8}")


def get_policy(spec: Union[str, Policy, Any]) -> Policy:
    """Builds a :class:`Policy` from a string, a ``Policy`` or a ``jmp.Policy``.

    Grammar (jmp's, ``jmp.get_policy``): comma-separated ``key=dtype`` pairs with keys
    ``params``/``p``, ``compute``/``c``, ``output``/``o``, each at most once. Missing keys
    follow jmp: params default to float32, compute to the param dtype, output to the
    compute dtype (``"c=bf16"`` is ``p=f32,c=bf16,o=bf16``). A bare dtype (``"bf16"``)
    sets all three. jaxmp adds the key ``fp8`` (default ``none``): ``fp8=tensorwise``,
    ``rowwise``, ``blockwise``, ``delayed`` or ``delayed/HISTORY[/MARGIN]`` puts the
    module's matmuls in FP8 by that :class:`jaxmp.fp8.Recipe`. Presets: ``fp32``,
    ``mixed_bf16``, ``mixed_fp16``, ``bf16``, ``pure_bf16`` (bfloat16 master weights,
    float32 output; see :func:`jaxmp.optim.with_update_rounding`), ``fp8_tensorwise``,
    ``fp8_delayed``, ``fp8_rowwise``, ``fp8_blockwise`` (see :data:`PRESETS`; each ``fp8_*`` is
    ``mixed_bf16`` plus its recipe). Unlike jmp, ``half`` always means float16 (jmp picks
    bfloat16 on TPU), so a config means the same on every backend.

    Args:
      spec: the policy description.

    Returns:
      The parsed policy.

    Raises:
      ValueError: an unknown key, dtype or malformed pair; the message names the bad
        token and what is allowed.
      TypeError: ``spec`` is neither a string nor a policy object.
    """
    if isinstance(spec, Policy):
        return spec
    if all(hasattr(spec, a) for a in ("param_dtype", "compute_dtype", "output_dtype")):
        return Policy(spec.param_dtype, spec.compute_dtype, spec.output_dtype)  # jmp.Policy
    if not isinstance(spec, str):
        raise TypeError(f"policy spec must be a string or a Policy, got {type(spec).__name__}")
    text = spec.strip()
    if text.lower() in PRESETS:
        text = PRESETS[text.lower()]
    if "=" not in text:
        if text.lower() not in DTYPE_NAMES:
            raise ValueError(
                f"unknown policy or dtype {spec!r}; allowed presets: {', '.join(PRESETS)}; "
                f"dtypes: {', '.join(sorted(DTYPE_NAMES))}; or key=dtype pairs with keys "
                f"{', '.join(sorted(_KEYS))}")
        dtype = canonical_dtype(text)
        return Policy(dtype, dtype, dtype)
    fields = {}
    for pair in text.split(","):
        if pair.count("=") != 1:
            raise ValueError(f"malformed policy item {pair.strip()!r} in {spec!r}; "
                             f"expected key=dtype")
        key, value = (s.strip().lower() for s in pair.split("="))
        if key not in _KEYS:
            raise ValueError(f"unknown policy key {key!r} in {spec!r}; allowed: "
                             f"{', '.join(sorted(_KEYS))}")
        if _KEYS[key] in fields:
            raise ValueError(f"policy key {key!r} in {spec!r} sets {_KEYS[key]} twice")
        try:
            if key == "fp8":
                fields["fp8"] = None if value == "none" else Recipe.parse(value)
            else:
                fields[_KEYS[key]] = canonical_dtype(value)
        except ValueError as e:
            raise ValueError(f"{e} (in policy {spec!r})") from None
    # jmp's defaults: params float32, compute follows params, output follows compute.
    param = fields.get("param_dtype", jnp.dtype(jnp.float32))
    compute = fields.get("compute_dtype", param)
    return Policy(param, compute, fields.get("output_dtype", compute), fields.get("fp8"))


@dataclasses.dataclass(frozen=True)
class PolicyRules:
    """Per-module policies: an ordered list of ``(pattern, policy)`` plus a default.

    A module's path is its attribute path in the model joined by ``/`` (for example
    ``blocks/3/moe/router``). :meth:`resolve` returns the policy of the **first** rule
    whose pattern (a Python regular expression) is found anywhere in the path
    (``re.search``); when several patterns match, the earlier rule wins, so put the most
    specific patterns first. With no match, the default applies. Rules are resolved once
    per module when the model is built, never inside the step.

    As one config string (see :func:`get_policy_rules`)::

        "mixed_fp16; router: fp32; norm: fp32; experts: p=f32,c=f16,o=f32"

    Attributes:
      default: the policy of modules no rule matches (anything :func:`get_policy` takes).
      rules: the ``(pattern, policy)`` pairs in priority order, or an ordered mapping
        ``{pattern: policy}``; stored as a tuple of pairs so the rules stay hashable.

    Raises:
      ValueError: a rule that is not a ``(pattern, policy)`` pair, a bad regular
        expression, or a bad policy.
    """

    default: Policy
    rules: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "default", get_policy(self.default))
        items = self.rules.items() if isinstance(self.rules, Mapping) else self.rules
        rules = []
        for item in items:
            if not (isinstance(item, (tuple, list)) and len(item) == 2
                    and isinstance(item[0], str)):
                raise ValueError(f"a policy rule must be a (pattern, policy) pair with a string "
                                 f"pattern, got {item!r}")
            pattern, policy = item
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"bad module pattern {pattern!r}: {e}") from e
            rules.append((str(pattern), get_policy(policy)))
        object.__setattr__(self, "rules", tuple(rules))

    def resolve(self, path: Union[str, Sequence[Any]]) -> Policy:
        """Returns the policy of the module at ``path`` (a ``/``-joined string or a sequence
        of keys)."""
        if not isinstance(path, str):
            path = "/".join(str(p) for p in path)
        for pattern, policy in self.rules:
            if re.search(pattern, path):
                return policy
        return self.default

    def __str__(self) -> str:
        parts = [str(self.default)] + [f"{pattern}: {policy}" for pattern, policy in self.rules]
        return "; ".join(parts)


def get_policy_rules(spec: Union[str, Policy, PolicyRules, Iterable]) -> PolicyRules:
    """Parses per-module policies from one string.

    Grammar: ``;``-separated items. An item without ``:`` is the default policy (at most
    one; float32 if absent); ``PATTERN: POLICY`` adds a rule, in order. ``POLICY`` is
    anything :func:`get_policy` accepts. Example: ``"mixed_bf16; router: fp32; norm: fp32"``.
    A pattern may contain ``:`` (the item is split at its last ``:``) but not ``;``.
    ``get_policy_rules(str(rules)) == rules`` for rules whose patterns have no ``;``.

    Args:
      spec: the rules string, a single policy (no rules), or a ``PolicyRules``.

    Returns:
      The parsed :class:`PolicyRules`.

    Raises:
      ValueError: two defaults, an empty pattern, a bad regular expression or a bad policy.
    """
    if isinstance(spec, PolicyRules):
        return spec
    if not isinstance(spec, str):
        return PolicyRules(default=get_policy(spec))
    default = None
    rules = []
    for item in (s.strip() for s in spec.split(";")):
        if not item:
            continue
        if ":" in item:
            # Policies never contain ':', patterns may ('(?:a|b)'): split at the last one.
            pattern, policy = (s.strip() for s in item.rsplit(":", 1))
            if not pattern:
                raise ValueError(f"empty module pattern in rule {item!r} of {spec!r}")
            rules.append((pattern, get_policy(policy)))
        else:
            if default is not None:
                raise ValueError(f"two default policies in {spec!r}: {str(default)!r} and {item!r}")
            default = get_policy(item)
    return PolicyRules(default=default or get_policy("fp32"), rules=tuple(rules))


def with_float32_islands(rules: PolicyRules, patterns: Sequence[str]) -> PolicyRules:
    """Adds float32-compute rules for ``patterns`` *after* the user's rules.

    Modules that none of the user's rules match but one of ``patterns`` does compute in
    float32, with the default policy's parameter dtype and output dtype (an island: the
    result goes back to the caller's dtype). A user's rule that matches such a module
    still wins, so ``"mixed_bf16; router: p=f32,c=bf16,o=f32"`` really computes the router in
    bfloat16 (a bare ``router: bf16`` would store its parameters in bfloat16 too).
    DeepSeek-V3 (report section 3.3) keeps the MoE gating and normalization in higher
    precision; Micikevicius et al. 2018 (section 3.3) do reductions in float32.

    Args:
      rules: the user's rules.
      patterns: module-path patterns of the islands, e.g. ``("router", "norm")``.

    Returns:
      The extended :class:`PolicyRules`. The islands' policy has no FP8 recipe, even when
      the default has one.
    """
    return _append_rules(rules, patterns,
                         rules.default.with_compute_dtype(jnp.float32).with_fp8(None))


def without_fp8(rules: PolicyRules, patterns: Sequence[str]) -> PolicyRules:
    """Keeps ``patterns`` out of a default FP8 recipe, *after* the user's rules.

    When the default policy has an FP8 recipe, modules that none of the user's rules
    match but one of ``patterns`` does get the default policy without it (bfloat16
    matmuls under ``fp8_*``): DeepSeek-V3 (report, section 3.3.1) keeps the embedding and
    the output head in their original precision. A user's rule still wins
    (``"fp8_blockwise; head: fp8_blockwise"`` puts the head in FP8 too). Without a default
    recipe the rules are returned unchanged.

    Args:
      rules: the user's rules.
      patterns: module-path patterns, e.g. ``("embed", "head")``.

    Returns:
      The extended :class:`PolicyRules`.
    """
    if rules.default.fp8 is None:
        return rules
    return _append_rules(rules, patterns, rules.default.with_fp8(None))


def _append_rules(rules: PolicyRules, patterns: Sequence[str], policy: Policy) -> PolicyRules:
    """``rules`` plus ``(pattern, policy)`` for each pattern the user's rules do not name."""
    known = {pattern for pattern, _ in rules.rules}
    extra = tuple((p, policy) for p in patterns if p not in known)
    return PolicyRules(default=rules.default, rules=tuple(rules.rules) + extra)
