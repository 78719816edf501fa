"""FP8 recipes (:class:`Recipe`) and the delayed recipe's amax-history state.

The recipes and their sources: the table in :mod:`jaxmp.precision.fp8`. What differs
between recipes is one row of :data:`_TRAITS` here (format of the gradient, state) and
one scheme in :mod:`jaxmp.precision._fp8.gemm` (how the operands are scaled).
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from jaxmp._checks import Int, check
from jaxmp.precision._fp8.quant import _F32, E4M3, E5M2, _check_margin

RECIPES = ("tensorwise", "delayed", "rowwise", "blockwise")
# Which GEMM runs the blockwise recipe: "pallas" (the Mosaic GPU kernel,
# jaxmp.precision._fp8.kernel), "xla" (one FP8 dot_general per 128 of K, the reference),
# "auto" (pallas where the compile target is an NVIDIA GPU of compute capability >= 9.0).
KERNELS = ("auto", "pallas", "xla")


class _Traits(NamedTuple):
    bwd_dtype: jnp.dtype   # format of the output gradient
    has_state: bool        # keeps an amax history (delayed scaling)


_TRAITS = {
    "tensorwise": _Traits(E5M2, False),
    "delayed": _Traits(E5M2, True),
    "rowwise": _Traits(E4M3, False),
    "blockwise": _Traits(E4M3, False),
}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How an FP8 matmul scales its operands (see :mod:`jaxmp.precision.fp8`'s table).

    Frozen and hashable: a static argument of ``jax.jit`` and a field of a
    :class:`~jaxmp.precision.policy.Policy`. Build it with a preset. ``str(recipe)`` is
    the name a policy string uses (``fp8=blockwise``, ``fp8=delayed/16/0`` for a delayed
    recipe other than the default, ``fp8=blockwise/xla`` for a kernel other than
    ``auto``) and :meth:`parse` reads it back.

    Attributes:
      name: ``"tensorwise"``, ``"delayed"``, ``"rowwise"`` or ``"blockwise"``.
      history_length: amax history length of ``delayed`` (>= 1); 0 for the others.
      margin: binades of headroom below the format's maximum (:func:`scale_from_amax`),
        an integer >= 0.
      kernel: the blockwise GEMM, one of :data:`KERNELS`: ``"pallas"`` (the Mosaic GPU
        kernel, promotion every 128 of K inside it), ``"xla"`` (one FP8 ``dot_general``
        per 128 of K, scaled and summed by XLA: the reference), ``"auto"`` (``pallas``
        when compiling for an NVIDIA GPU of compute capability 9.0 or newer, else
        ``xla``). The other recipes take ``"auto"`` only (they are one FP8 GEMM each).

    Raises:
      ValueError: an unknown name or kernel, a history length that does not fit the
        name, a kernel other than ``auto`` for a recipe that is not blockwise, or a bad
        margin.
    """

    name: str
    history_length: int = 0
    margin: int = 0
    kernel: str = "auto"

    def __post_init__(self):
        if self.name not in RECIPES:
            raise ValueError(f"unknown FP8 recipe {self.name!r}; allowed: {', '.join(RECIPES)}")
        h = self.history_length
        check("history_length", h, Int())
        if self.name == "delayed" and h < 1:
            raise ValueError(f"a delayed recipe needs history_length >= 1, got {h}")
        if self.name != "delayed" and h != 0:
            raise ValueError(f"history_length={h} is only for the delayed recipe, "
                             f"not {self.name!r}")
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel={self.kernel!r}; allowed: {', '.join(KERNELS)}")
        if self.name != "blockwise" and self.kernel != "auto":
            raise ValueError(f"kernel={self.kernel!r} is only for the blockwise recipe, "
                             f"not {self.name!r} (allowed there: 'auto')")
        object.__setattr__(self, "history_length", int(h))
        object.__setattr__(self, "margin", _check_margin(self.margin))

    @classmethod
    def tensorwise(cls) -> "Recipe":
        """Current per-tensor scaling: E4M3 forward, E5M2 gradients (TE's HYBRID format)."""
        return cls("tensorwise")

    @classmethod
    def delayed(cls, history_length: int = 1024, margin: int = 0) -> "Recipe":
        """Per-tensor scales from the max of an amax history of ``history_length`` steps.

        Transformer Engine's ``DelayedScaling`` (default ``amax_history_len=1024``,
        ``margin=0``, ``amax_compute_algo="max"``, HYBRID format: E4M3 forward, E5M2
        gradients) and Flax's Linen ``fp8_ops``.
        """
        return cls("delayed", history_length=history_length, margin=margin)

    @classmethod
    def rowwise(cls) -> "Recipe":
        """One scale per row of the activation / gradient and per output column of the
        weight, E4M3 throughout (torchao's ``Float8LinearRecipeName.ROWWISE``)."""
        return cls("rowwise")

    @classmethod
    def blockwise(cls, kernel: str = "auto") -> "Recipe":
        """DeepSeek-V3 (report, section 3.3.2): 1x128 activation and gradient tiles,
        128x128 weight blocks, E4M3 forward and backward, float32 promotion every 128
        elements of the contraction; ``kernel`` as in the class docstring."""
        return cls("blockwise", kernel=kernel)

    @property
    def fwd_dtype(self) -> jnp.dtype:
        """Format of the activation and the weight: E4M3 in every recipe."""
        return E4M3

    @property
    def bwd_dtype(self) -> jnp.dtype:
        """Format of the output gradient: E5M2 for tensorwise/delayed, E4M3 otherwise."""
        return _TRAITS[self.name].bwd_dtype

    @property
    def has_state(self) -> bool:
        """True for ``delayed``: :func:`dot` needs an amax-history state."""
        return _TRAITS[self.name].has_state

    def __str__(self) -> str:
        parts = [self.name]
        if self.name == "delayed" and (self.history_length, self.margin) != (1024, 0):
            parts += [str(self.history_length), str(self.margin)]
        elif self.name != "delayed" and self.margin:
            parts.append(str(self.margin))
        if self.kernel != "auto":
            parts.append(self.kernel)
        return "/".join(parts)

    @classmethod
    def parse(cls, text: str) -> "Recipe":
        """Reads ``str(recipe)``: ``tensorwise``, ``rowwise``, ``blockwise``, ``delayed``
        (history 1024, margin 0), ``delayed/H`` or ``delayed/H/M``; ``NAME/M`` sets a
        margin; ``blockwise[/M]/KERNEL`` a kernel (``auto``, ``pallas``, ``xla``).

        Raises:
          ValueError: anything else (the message lists the forms).
        """
        parts = str(text).strip().lower().split("/")
        forms = ("tensorwise, rowwise, blockwise, blockwise/KERNEL (auto, pallas, xla), "
                 "delayed, delayed/HISTORY, delayed/HISTORY/MARGIN")
        name, kernel = parts[0], "auto"
        if name == "blockwise" and len(parts) > 1 and parts[-1] in KERNELS:
            kernel, parts = parts[-1], parts[:-1]
        try:
            nums = [int(p) for p in parts[1:]]
        except ValueError:
            raise ValueError(f"bad FP8 recipe {text!r}; allowed: {forms}") from None
        if name == "delayed" and len(nums) <= 2:
            return cls.delayed(*nums) if nums else cls.delayed()
        if name in RECIPES and name != "delayed" and len(nums) <= 1:
            return cls(name, 0, *nums, kernel=kernel)
        raise ValueError(f"bad FP8 recipe {text!r}; allowed: {forms}")


def _check_recipe(recipe: Any) -> Recipe:
    if not isinstance(recipe, Recipe):
        raise ValueError(f"recipe must be a jaxmp.fp8.Recipe (e.g. Recipe.blockwise()), "
                         f"got {recipe!r}")
    return recipe


# ----------------------------------------------------------------------------- state


def init_state(recipe: Recipe) -> Optional[jax.Array]:
    """The initial state of one :func:`dot` call under ``recipe``.

    Returns:
      For ``delayed``: float32 zeros ``[3, history_length]``, the amax histories of the
      activation, the weight and the output gradient (newest first); their first scale is
      therefore 1.0 (:func:`scale_from_amax` of 0). None for the other recipes.

    Raises:
      ValueError: ``recipe`` is not a :class:`Recipe`.
    """
    recipe = _check_recipe(recipe)
    if not recipe.has_state:
        return None
    return jnp.zeros((3, recipe.history_length), _F32)


def roll_history(history: jax.Array, amax: jax.Array) -> jax.Array:
    """``history`` shifted one place to the back, ``amax`` in front, the oldest dropped.

    Args:
      history: float32 ``[..., L]`` (newest first).
      amax: float ``[...]``, this step's amax.

    Returns:
      float32 ``[..., L]``: ``[amax, history[..., 0], ..., history[..., L - 2]]``.
    """
    history = jnp.asarray(history, _F32)
    amax = jnp.asarray(amax, _F32)[..., None]
    return jnp.concatenate([amax, history[..., :-1]], axis=-1)


def merge_states(a: Any, b: Any) -> Any:
    """Combines the updated states of two micro-batches (or devices) of one step.

    Each micro-batch's backward pass returns the old history rolled once with its own
    amax in front, so the elementwise max keeps the old entries and puts the largest
    amax in front (case FP8-1: 1, 8, 2, 1 over four micro-batches gives 8). Any pytree
    of states; ``-inf`` leaves are the identity (an accumulator's start).
    """
    return jax.tree.map(jnp.maximum, a, b)


def _check_state(recipe: Recipe, state: Any) -> Optional[jax.Array]:
    if not recipe.has_state:
        if state is not None:
            raise ValueError(f"the {recipe.name!r} recipe keeps no state; pass state=None")
        return None
    if state is None:
        raise ValueError("the delayed recipe needs its amax-history state: "
                         "state=jaxmp.fp8.init_state(recipe), kept between steps")
    want = (3, recipe.history_length)
    if tuple(jnp.shape(state)) != want or jnp.result_type(state) != _F32:
        raise ValueError(f"a delayed-scaling state must be float32 {want} (rows: activation, "
                         f"weight, gradient amax histories), got {jnp.result_type(state)} "
                         f"{jnp.shape(state)}")
    return jnp.asarray(state)

