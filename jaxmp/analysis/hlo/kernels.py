"""The kernels of a compiled GPU program by kind, with GEMM FLOPs (:func:`hlo_kernels`,
:func:`kernel_counts`)."""
from __future__ import annotations

import collections
import dataclasses
import re
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from jaxmp.analysis.hlo.collectives import COLLECTIVE_OPS
from jaxmp.analysis.hlo.module import CALLEES, HloModule, Instruction, parse_module

__all__ = ["FP8_GEMM_TARGET", "GEMM_TARGETS", "Kernel", "KERNEL_KINDS", "hlo_kernels",
           "kernel_counts"]


# The custom call XLA's GPU GEMM rewriter emits for an FP8 GEMM on cuBLASLt
# (xla/service/gpu/cublas_cudnn.h, kCublasLtMatmulF8CallTarget).
FP8_GEMM_TARGET = "__cublas$lt$matmul$f8"
# The custom calls XLA's GPU GEMM rewriter emits (xla/service/gpu/cublas_cudnn.h).
GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", FP8_GEMM_TARGET)
_ATTENTION_PREFIX = "__cudnn$fmha"
_GEMM_FUSION_KINDS = ("__triton_gemm", "__triton_nested_gemm_fusion", "__cudnn$fusion")
# Instructions that launch nothing: bookkeeping, control flow (their bodies are counted),
# and the second halves of asynchronous pairs.
_NOT_KERNELS = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional",
    "call", "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency",
    "async-done", "all-gather-done", "all-reduce-done", "collective-permute-done",
    "copy-done", "send-done", "recv-done", "domain", "iota"})
_CONTRACTING = re.compile(r"\blhs_contracting_dims=\{([\d,]*)\}")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel launch site of a compiled GPU program (an instruction of a control-flow
    computation that runs on the device).

    Attributes:
      name: the instruction name.
      kind: one of :data:`KERNEL_KINDS`.
      runs: launches per execution of the module (loop trip counts included).
      flops: matrix-multiply FLOPs of one launch (2 per multiply-add; attention's two
        or five batched matmuls for cuDNN's forward / backward, halved when causal; a
        Mosaic GPU GEMM by its shapes, :func:`_mosaic_gemm_flops`).
      gemm_dtype: the operands' element type of a GEMM or attention kernel, '' otherwise.
      highest: a float32 GEMM that asks for full float32 precision (no TF32).
      bytes: HBM bytes one launch reads and writes at least: its operands and results,
        an operand that the kernel only slices (directly or through bitcasts, which move
        no data) counted at the slices' size, an in-place
        ``dynamic-update-slice`` result at the update's size.
      op_name: the JAX ``op_name`` metadata.
      target: the custom-call target, or the fusion's backend kind.
    """

    name: str
    kind: str
    runs: int
    flops: float
    gemm_dtype: str
    highest: bool
    bytes: int
    op_name: str
    target: str


KERNEL_KINDS = ("cudnn_attention_fwd", "cudnn_attention_bwd", "fp8_gemm", "gemm", "mosaic_gpu",
                "triton", "fusion", "copy", "collective", "other")


def _prod(shape) -> int:
    return int(np.prod(shape, dtype=np.int64)) if len(shape) else 1


def _dot_flops(module: HloModule, ins: Instruction) -> Tuple[float, str, bool]:
    """``(flops, lhs dtype, highest)`` of a ``dot`` or a GEMM custom call; (0, '', False)
    for anything else."""
    if ins.op == "dot":
        m = _CONTRACTING.search(ins.attrs)
        contracting = [int(d) for d in m.group(1).split(",") if d] if m else []
    elif ins.op == "custom-call" and ins.target in GEMM_TARGETS:
        dims = ins.backend_config.get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
        contracting = [int(d) for d in dims.get("lhs_contracting_dimensions", [])]
    else:
        return 0.0, "", False
    lhs = module.arrays(ins.operands[0]) if ins.operands else ()
    out = ins.results
    if not lhs or not out:
        return 0.0, "", False
    k = _prod([lhs[0].shape[d] for d in contracting])
    highest = "highest" in ins.attrs.lower()
    return 2.0 * out[0].size * k, lhs[0].dtype, highest


def _mosaic_gemm_flops(module: HloModule, ins: Instruction) -> float:
    """FLOPs of a Mosaic GPU GEMM kernel, read off its shapes (0 for any other kernel).

    Grouped forward and ``dx``: a result ``[M, N]`` from tokens ``[M, K]`` and expert
    weights ``[G, K, N]`` (``jax.experimental.pallas.ops.gpu.ragged_dot_mgpu``); grouped
    ``dw``: a result ``[G, K, N]`` from tokens ``[M, K]`` and gradients ``[M, N]`` (its
    transposed twin), or, token-minor (the blockwise FP8 ``dw`` of
    :mod:`jaxmp.precision._fp8.grouped_kernel`), from ``x^T [K, M]`` and ``g^T [N, M]`` of
    8-bit values; each token row meets one group: ``2 M K N``, not ``G`` times that.
    Dense (the blockwise FP8 GEMM): a result ``[M, N]`` from ``A [M, K]`` and
    ``B^T [N, K]`` (their float32 scales aside): ``2 M N K``.
    """
    out = ins.results[0] if ins.results else None
    mats = [a for a in module.operand_arrays(ins) if len(a.shape) in (2, 3) and a.dtype != "s32"]
    if out is None:
        return 0.0
    if len(out.shape) == 2:
        m, n = out.shape
        for a in mats:
            for w in mats:
                if len(a.shape) == 2 and len(w.shape) == 3 and a.shape[0] == m and \
                        a.shape[1] in w.shape[1:] and n in w.shape[1:]:
                    return 2.0 * m * a.shape[1] * n
    if len(out.shape) == 3:
        _, k, n = out.shape
        two = [a for a in mats if len(a.shape) == 2 and a.dtype not in ("f32", "f64")]
        for a in two:
            for b in two:
                if a is not b and a.shape[0] == b.shape[0] and a.shape[1] == k and b.shape[1] == n:
                    return 2.0 * a.shape[0] * k * n
        for a in two:  # token-minor: [K', M] and [N', M], K' and N' padded to whole tiles
            for b in two:
                if (a is not b and a.shape[1] == b.shape[1] and a.shape[0] >= k
                        and b.shape[0] >= n and a.dtype.startswith("f8")):
                    return 2.0 * a.shape[1] * k * n
    if len(out.shape) == 2:  # a dense (scaled) GEMM: A [M, K] and B^T [N, K] of 8/16-bit values
        m, n = out.shape
        narrow = [a for a in mats if len(a.shape) == 2 and a.dtype not in ("f32", "f64")]
        for a in narrow:
            for b in narrow:
                if a is not b and a.shape[0] == m and b.shape[0] == n and a.shape[1] == b.shape[1]:
                    return 2.0 * m * n * a.shape[1]
    return 0.0


def _attention_flops(module: HloModule, ins: Instruction) -> float:
    """FLOPs of a cuDNN fused-attention call: 2 x |scores| x head_dim per batched matmul,
    2 matmuls forward, 5 backward (FlashAttention-2, Dao 2023, section 3.1: the backward
    recomputes the probabilities), halved under a causal mask."""
    cfg = ins.backend_config.get("cudnn_fmha_backend_config", {})
    scores = [int(d) for d in cfg.get("intermediate_tensor_shape", {}).get("dimensions", [])]
    q = module.arrays(ins.operands[0]) if ins.operands else ()
    if len(scores) != 4 or not q:
        return 0.0
    head_dim = q[0].size // _prod(scores[:3])  # scores [B, heads, T, S]; q B*T*heads*head_dim
    matmuls = 5 if "Backward" in ins.target else 2
    causal = 0.5 if cfg.get("mask_type") == "CAUSAL" else 1.0
    return 2.0 * _prod(scores) * head_dim * matmuls * causal


def _fusion_bytes(module: HloModule, ins: Instruction, callee: str) -> int:
    """HBM bytes one run of the fusion ``ins`` (computation ``callee``) reads and writes."""
    inner = module.computation(callee)
    users: Dict[str, List[Instruction]] = collections.defaultdict(list)
    index_of: Dict[str, int] = {}
    for i in inner:
        if i.op == "parameter" and i.operands and i.operands[0].isdigit():
            index_of[i.name] = int(i.operands[0])
        for operand in i.operands:
            users[operand].append(i)
    def sliced(name: str) -> Optional[int]:
        """Bytes of the slices ``name`` is read through, when every use (through bitcasts,
        which move no data) slices it; else None."""
        uses, out = users.get(name, []), 0
        for u in uses:
            if u.op == "bitcast":
                part = sliced(u.name)
                if part is None:
                    return None
                out += part
            elif u.op in ("dynamic-slice", "slice", "gather") and u.operands[0] == name:
                out += sum(r.nbytes for r in u.results)
            else:
                return None
        return out if uses else None

    total = 0
    operand_arrays = [module.arrays(n) for n in ins.operands]
    for pname, idx in index_of.items():
        full = sum(a.nbytes for a in operand_arrays[idx]) if idx < len(operand_arrays) else 0
        uses = users.get(pname, [])
        part = sliced(pname)
        if part is not None:
            total += min(full, part)
        elif uses and all(u.op == "dynamic-update-slice" and u.operands[0] == pname for u in uses):
            continue  # the buffer updated in place: only the update is written (below)
        else:
            total += full
    root = module.by_name.get(module.roots.get(callee, ""))
    if root is not None and root.op == "dynamic-update-slice" and len(root.operands) > 1:
        total += sum(a.nbytes for a in module.arrays(root.operands[1]))  # in place
    else:
        total += sum(a.nbytes for a in ins.results)
    return total


def hlo_kernels(hlo_text) -> List[Kernel]:
    """The kernels of a compiled GPU program (``compiled.as_text()``), in text order.

    Every instruction of a control-flow computation (the entry, loop bodies and
    conditions, branches) that launches work on the device is one kernel: a fusion, a
    custom call (cuBLAS/cuBLASLt GEMM, cuDNN attention, a Mosaic GPU or Triton kernel),
    a copy, a collective. A fusion whose backend is a Triton or cuDNN GEMM is a GEMM; one
    with FP8 operands, or a ``__cublas$lt$matmul$f8`` call, an FP8 GEMM.

    Args:
      hlo_text: HLO text, or an :class:`HloModule`.

    Returns:
      :class:`Kernel` s.
    """
    module = hlo_text if isinstance(hlo_text, HloModule) else parse_module(hlo_text)
    callers: Dict[str, str] = {}  # fused computation -> the fusion instruction that runs it
    for ins in module.instructions:
        for key, callee in CALLEES.findall(ins.attrs):
            if ins.op == "fusion" and key == "calls":
                callers[callee] = ins.name
    for ins in module.instructions:  # nested fusions belong to the outermost fusion
        if ins.computation in module.fused and ins.computation in callers:
            for key, callee in CALLEES.findall(ins.attrs):
                callers.setdefault(callee, callers[ins.computation])
    inner_flops: Dict[str, List[Tuple[float, str, bool]]] = collections.defaultdict(list)
    for ins in module.instructions:
        if ins.computation in module.fused:
            f = _dot_flops(module, ins)
            if f[0]:
                inner_flops[callers.get(ins.computation, "")].append(f)

    out = []
    for ins in module.instructions:
        if ins.computation in module.fused or ins.computation not in module.control:
            continue
        if ins.op in _NOT_KERNELS or ins.op.endswith("-done"):
            continue
        base = ins.op[:-len("-start")] if ins.op.endswith("-start") else ins.op
        flops, dtype, highest, kind, tgt = 0.0, "", False, "other", ins.target
        operands = module.operand_arrays(ins)
        nbytes = sum(a.nbytes for a in operands) + sum(a.nbytes for a in ins.results)
        if base in COLLECTIVE_OPS:
            kind = "collective"
        elif ins.op == "custom-call":
            if tgt.startswith(_ATTENTION_PREFIX):
                kind = "cudnn_attention_bwd" if "Backward" in tgt else "cudnn_attention_fwd"
                flops = _attention_flops(module, ins)
                dtype = operands[0].dtype if operands else ""
            elif tgt in GEMM_TARGETS:
                flops, dtype, highest = _dot_flops(module, ins)
                kind = "fp8_gemm" if tgt == FP8_GEMM_TARGET or dtype.startswith("f8") else "gemm"
            elif "mosaic_gpu" in tgt:
                kind = "mosaic_gpu"
                flops = _mosaic_gemm_flops(module, ins)
                dtype = next((a.dtype for a in operands if a.dtype != "s32"), "")
            elif "triton" in tgt:
                kind = "triton"
        elif ins.op == "fusion":
            tgt = ins.backend_config.get("fusion_backend_config", {}).get("kind", "")
            callee = dict(CALLEES.findall(ins.attrs)).get("calls", "")
            nbytes = _fusion_bytes(module, ins, callee) if callee else nbytes
            dots = inner_flops.get(ins.name, [])
            flops = sum(f for f, _, _ in dots)
            dtype = dots[0][1] if dots else ""
            highest = any(h for _, _, h in dots)
            if dots or tgt in _GEMM_FUSION_KINDS:
                kind = "fp8_gemm" if dtype.startswith("f8") else "gemm"
            else:
                kind = "fusion"
        elif ins.op in ("copy", "copy-start", "transpose", "dynamic-update-slice", "dynamic-slice"):
            kind = "copy"
        elif ins.op == "dot":
            flops, dtype, highest = _dot_flops(module, ins)
            kind = "fp8_gemm" if dtype.startswith("f8") else "gemm"
        out.append(Kernel(ins.name, kind, ins.runs, flops, dtype, highest, nbytes, ins.op_name,
                          tgt))
    return out


def kernel_counts(kernels: Sequence[Kernel]) -> Dict[str, Dict[str, int]]:
    """``{kind: {"sites": launch sites in the program text, "launches": per execution}}``."""
    out: Dict[str, Dict[str, int]] = {}
    for k in kernels:
        row = out.setdefault(k.kind, {"sites": 0, "launches": 0})
        row["sites"] += 1
        row["launches"] += k.runs
    return out
