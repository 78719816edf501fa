"""The ``dot_general`` s of a lowered (StableHLO) program with their element types
(:func:`stablehlo_dots`, :func:`count_fp8_dots`)."""
from __future__ import annotations

import dataclasses
import re
from typing import List, Tuple

__all__ = ["Dot", "stablehlo_dots", "count_fp8_dots"]


_FP8_TYPES = ("f8E4M3FN", "f8E5M2", "f8E4M3FNUZ", "f8E5M2FNUZ", "f8e4m3fn", "f8e5m2")
_SDOT = re.compile(r"stablehlo\.dot_general\b[^\n]*?:\s*\(tensor<([^>]*)>,\s*tensor<([^>]*)>\)"
                   r"\s*->\s*tensor<([^>]*)>")


@dataclasses.dataclass(frozen=True)
class Dot:
    """One ``stablehlo.dot_general`` of a lowered program: its element types.

    Attributes:
      lhs, rhs, out: MLIR element types (``f8E4M3FN``, ``bf16``, ``f32``, ...).
    """

    lhs: str
    rhs: str
    out: str

    @property
    def fp8(self) -> bool:
        """Both operands are FP8: the product itself is an FP8 matmul."""
        return self.lhs in _FP8_TYPES and self.rhs in _FP8_TYPES


def _element_type(tensor_type: str) -> str:
    return tensor_type.rsplit("x", 1)[-1] if "x" in tensor_type else tensor_type


def stablehlo_dots(text: str) -> List[Dot]:
    """The ``dot_general`` ops of a lowered program's StableHLO text
    (``jax.jit(f).lower(...).as_text()``), in text order, with their element types.

    This is the program before XLA optimizes it: what JAX asked for (case FP8-2). A
    quantize-dequantize pattern shows up as a ``bf16``/``f32`` dot here.
    """
    return [Dot(_element_type(a), _element_type(b), _element_type(c))
            for a, b, c in _SDOT.findall(text)]


def count_fp8_dots(text: str) -> Tuple[int, int]:
    """``(fp8, other)``: how many dots of a lowered program have two FP8 operands, and how
    many do not (:func:`stablehlo_dots`)."""
    dots = stablehlo_dots(text)
    fp8 = sum(d.fp8 for d in dots)
    return fp8, len(dots) - fp8
