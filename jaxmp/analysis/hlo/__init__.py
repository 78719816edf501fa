"""One reader of XLA HLO text, for the CPU accounting and the GPU-target report alike.

:func:`parse_module` (:mod:`~jaxmp.analysis.hlo.module`) reads the text of
``compiled.as_text()`` or of an XLA HLO dump into :class:`Instruction` s with the number of
times each runs per execution of the module (the product of the trip counts of the
``while`` loops around it: XLA's ``known_trip_count``, or, where XLA has not stated it yet
as after SPMD partitioning, the bound of a counted loop as JAX lowers ``lax.scan``). On it:

* :mod:`~jaxmp.analysis.hlo.collectives`: :func:`hlo_collectives` /
  :func:`collective_bytes`, collectives by kind, dtype, bytes;
* :mod:`~jaxmp.analysis.hlo.kernels`: :func:`hlo_kernels`, the GPU program's kernels by
  kind (cuDNN attention, FP8 GEMMs, other GEMMs, Mosaic GPU and Triton custom kernels,
  fusions, copies) with the FLOPs of every matrix multiplication (``dot`` instructions,
  inside fusions too, and cuBLAS / cuBLASLt GEMM custom calls), and :func:`kernel_counts`.

Apart from the compiled HLO, :mod:`~jaxmp.analysis.hlo.stablehlo`:
:func:`stablehlo_dots` / :func:`count_fp8_dots`, the ``dot_general`` s of a *lowered*
(StableHLO) program with their element types.
"""
from jaxmp.analysis.hlo.collectives import (COLLECTIVE_OPS, Collective, collective_bytes,
                                            hlo_collectives)
from jaxmp.analysis.hlo.kernels import (FP8_GEMM_TARGET, GEMM_TARGETS, KERNEL_KINDS, Kernel,
                                        hlo_kernels, kernel_counts)
from jaxmp.analysis.hlo.module import HloArray, HloModule, Instruction, parse_module
from jaxmp.analysis.hlo.stablehlo import Dot, count_fp8_dots, stablehlo_dots

__all__ = ["HloArray", "Instruction", "HloModule", "parse_module", "Collective",
           "COLLECTIVE_OPS", "hlo_collectives", "collective_bytes", "Dot", "stablehlo_dots",
           "count_fp8_dots", "FP8_GEMM_TARGET", "GEMM_TARGETS", "Kernel", "KERNEL_KINDS",
           "hlo_kernels", "kernel_counts"]
