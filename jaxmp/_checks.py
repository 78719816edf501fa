"""Argument checks: one description of each kind of allowed value, shared by the public
functions' own checks and by the run-config table (:func:`jaxmp.train.config.validate_config`).

A *spec* (:class:`Int`, :class:`Real`, :class:`Choice`, :class:`Kind`) says whether a value
is allowed (``spec.ok(value)``) and how to say what is (``spec.allowed``: "an integer
>= 1"). :func:`check` raises the one-line error ``NAME=VALUE must be ALLOWED``; the config
validator words it ``KEY=VALUE is not allowed; it must be ALLOWED``. Booleans are never
numbers here (``True`` is not the integer 1), and NumPy scalars count as numbers.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Callable, Optional, Sequence

__all__ = ["Int", "Real", "Choice", "Kind", "BOOL", "option", "is_int", "is_real", "check",
           "check_int", "check_real", "check_choice", "check_float", "check_matmul", "F32_MAX"]

# float32's largest finite value, (2 - 2**-23) * 2**127 (IEEE 754 binary32), as a Python
# float: float(np.finfo(np.float32).max). The bound of every float32-held setting.
F32_MAX = (2.0 - 2.0 ** -23) * 2.0 ** 127


def is_int(value: Any) -> bool:
    """An integer (Python or NumPy), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """A real number (Python or NumPy, integers included), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _num(x) -> str:
    """``0.0`` as ``0``: bounds read as the interval a person writes."""
    return str(int(x)) if isinstance(x, float) and x.is_integer() else str(x)


def _bound(lo, hi, lo_open=False, hi_open=False) -> str:
    lo, hi = (None if b is None else _num(b) for b in (lo, hi))
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo}"
    return f"{'<' if hi_open else '<='} {hi}" if hi is not None else ""


@dataclasses.dataclass(frozen=True)
class Int:
    """An integer in ``[lo, hi]`` (either end None: unbounded); ``none_ok`` lets None pass.
    ``text`` replaces the generated description (to name what the bounds mean)."""

    lo: Optional[int] = None
    hi: Optional[int] = None
    text: Optional[str] = None
    none_ok: bool = False

    def ok(self, value: Any) -> bool:
        if value is None:
            return self.none_ok
        return is_int(value) and (self.lo is None or value >= self.lo) and (
            self.hi is None or value <= self.hi)

    @property
    def allowed(self) -> str:
        return self.text or " ".join(filter(None, ("an integer", _bound(self.lo, self.hi))))


@dataclasses.dataclass(frozen=True)
class Real:
    """A real number between ``lo`` and ``hi`` (each end closed unless ``lo_open`` /
    ``hi_open``; None: unbounded), finite when ``finite``."""

    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False
    finite: bool = True
    text: Optional[str] = None

    def ok(self, value: Any) -> bool:
        if not is_real(value) or math.isnan(value) or (self.finite and not math.isfinite(value)):
            return False
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)

    @property
    def allowed(self) -> str:
        what = "a finite number" if self.finite else "a number"
        return self.text or " ".join(filter(None, (what, _bound(self.lo, self.hi, self.lo_open,
                                                                  self.hi_open))))


@dataclasses.dataclass(frozen=True)
class Choice:
    """One of ``choices`` (compared with ``==``)."""

    choices: Sequence[Any]
    text: Optional[str] = None

    def ok(self, value: Any) -> bool:
        try:
            return any(value == c and type(value) is type(c) for c in self.choices)
        except (TypeError, ValueError):
            return False

    @property
    def allowed(self) -> str:
        return self.text or f"one of {', '.join(str(c) for c in self.choices)}"


@dataclasses.dataclass(frozen=True)
class Kind:
    """Any value for which ``test(value)`` is true, described by ``text``."""

    test: Callable[[Any], bool]
    text: str

    def ok(self, value: Any) -> bool:
        try:
            return bool(self.test(value))
        except (TypeError, ValueError):
            return False

    @property
    def allowed(self) -> str:
        return self.text


def _is_bool(value: Any) -> bool:
    import numpy as np  # NumPy's bool_ (what a comparison of arrays gives) counts too

    return isinstance(value, (bool, np.bool_))


BOOL = Kind(_is_bool, "True or False")


def option(default: Any, meaning: str, allowed: Any = None) -> Any:
    """A dataclass field that declares one config key: its ``default``, the values it
    allows (a spec; None: any) and its one-line ``meaning``, kept in the field's metadata.

    :class:`jaxmp.models.ModelConfig` declares the run config's ``model.*`` keys this way;
    :mod:`jaxmp.train.keys` reads them (``dataclasses.fields``), so the default, the check,
    ``train.py --help`` and docs/CONFIG.md come from this one place. The key's type is its
    default's (as a ``ml_collections.ConfigDict`` types a field by its first value).
    """
    return dataclasses.field(default=default, metadata={"meaning": meaning, "allowed": allowed})


def check(name: str, value: Any, spec) -> Any:
    """``value`` when ``spec`` allows it.

    Raises:
      ValueError: ``NAME=VALUE must be ALLOWED``, e.g. "num_devices=0 must be an integer
        >= 1".
    """
    if not spec.ok(value):
        raise ValueError(f"{name}={value!r} must be {spec.allowed}")
    return value


def check_int(name: str, value: Any, lo: Optional[int] = None, hi: Optional[int] = None,
              allowed: Optional[str] = None) -> int:
    """``int(value)`` for an integer in ``[lo, hi]``; else ValueError as :func:`check`."""
    return int(check(name, value, Int(lo, hi, allowed)))


def check_real(name: str, value: Any, lo: Optional[float] = None, hi: Optional[float] = None, *,
               lo_open: bool = False, hi_open: bool = False, finite: bool = True,
               allowed: Optional[str] = None) -> float:
    """``float(value)`` for a number in the interval; else ValueError as :func:`check`."""
    return float(check(name, value, Real(lo, hi, lo_open, hi_open, finite, allowed)))


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> Any:
    """``value`` when it is one of ``choices``; else ValueError naming them."""
    if not Choice(choices).ok(value):
        raise ValueError(f"{name}={value!r} is not allowed; allowed: "
                         f"{', '.join(str(c) for c in choices)}")
    return value


def check_float(name: str, x: Any) -> None:
    """Raises ``ValueError`` ("NAME must have a floating-point dtype, got int32") unless
    ``x`` (an array or anything ``jnp.result_type`` takes) has a floating-point dtype."""
    import jax.numpy as jnp  # jax's dtype rules (bfloat16, float8 are floating)

    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise ValueError(f"{name} must have a floating-point dtype, got {jnp.result_type(x)}")


def check_matmul(x: Any, w: Any, k: str = "K", n: str = "N") -> None:
    """Floating ``x [..., k]`` and a 2-D floating ``w [k, n]``; else a ValueError naming the
    shapes (``k`` and ``n`` name the dimensions in the message)."""
    import jax.numpy as jnp

    check_float("x", x)
    check_float("w", w)
    if jnp.ndim(w) != 2:
        raise ValueError(f"w must be a 2-D [{k}, {n}] weight, got shape {jnp.shape(w)}")
    if jnp.ndim(x) < 1 or jnp.shape(x)[-1] != jnp.shape(w)[0]:
        raise ValueError(f"x of shape {jnp.shape(x)} must end in {k} = {jnp.shape(w)[0]} "
                         f"(w of shape {jnp.shape(w)})")
