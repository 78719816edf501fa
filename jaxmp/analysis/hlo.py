"""One reader of XLA HLO text, for the CPU accounting and the GPU-target report alike.

:func:`parse_module` reads the text of ``compiled.as_text()`` or of an XLA HLO dump into
:class:`Instruction` s with the number of times each runs per execution of the module
(the product of the trip counts of the ``while`` loops around it: XLA's
``known_trip_count``, or, where XLA has not stated it yet as after SPMD partitioning, the
bound of a counted loop as JAX lowers ``lax.scan``). On it:

* :func:`hlo_collectives` / :func:`collective_bytes`: collectives by kind, dtype, bytes;
* :func:`hlo_dots`: every matrix multiplication with its FLOPs (``dot`` instructions,
  inside fusions too, and cuBLAS / cuBLASLt GEMM custom calls);
* :func:`hlo_kernels`: the GPU program's kernels by kind (cuDNN attention, FP8 GEMMs,
  other GEMMs, Mosaic GPU and Triton custom kernels, fusions, copies);
* :func:`stablehlo_dots` / :func:`count_fp8_dots`: the ``dot_general`` s of a *lowered*
  (StableHLO) program with their element types.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import re
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

@dataclasses.dataclass(frozen=True)
class HloArray:
    """An array type in HLO text, e.g. ``bf16[64,32]``.

    Attributes:
      dtype: the HLO element type (``f32``, ``bf16``, ``s32``, ``pred``, ...).
      shape: the dimensions.
    """

    dtype: str
    shape: Tuple[int, ...]

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        """Bytes: ``pred`` is 1 byte, every other type its bit width / 8 (``bf16`` 2,
        ``s32`` 4, ``c64`` 8, ``f8e4m3fn`` 1), rounded up for packed 4-bit types."""
        bits = 8 if self.dtype == "pred" else int(re.search(r"\d+", self.dtype).group())
        return -(-self.size * bits // 8)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of an HLO module.

    Attributes:
      name: the instruction name, e.g. ``all-reduce.3``.
      op: ``all-reduce``, ``reduce-scatter``, ``all-gather``, ``all-to-all``,
        ``collective-permute`` (``-start`` forms are reported without the suffix).
      operands: the operand arrays, in order.
      results: the result arrays, one per operand (for ``all-gather``, the gathered ones).
      count: times it runs per execution of the module (the product of the trip counts
        of the ``while`` loops around it, XLA's ``known_trip_count`` or a scan's counted
        bound; 1 outside loops or when neither is known).
      op_name: the JAX ``op_name`` metadata, '' if none.
      group_size: devices per replica group (``replica_groups={{0,1},{2,3}}``, the
        iota form ``[2,2]<=[4]`` or the mesh form ``mesh['axis_0'=2,'axis_1'=2]
        {'axis_0'}``); None when not stated (all devices, or a
        ``collective-permute``). A group of 1 moves nothing: a reduction over a mesh
        axis of size 1, which the partitioner keeps and the backend drops.
    """

    name: str
    op: str
    operands: Tuple[HloArray, ...]
    results: Tuple[HloArray, ...]
    count: int
    op_name: str
    group_size: Optional[int] = None

    @property
    def moves_data(self) -> bool:
        """False for a collective whose every replica group is one device."""
        return self.group_size != 1


_ARRAY = re.compile(r"\b(pred|[a-z]+\d+[a-z0-9]*)\[([\d,]*)\]")
_COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute",
                "ragged-all-to-all")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_HEADER = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*[\s(].*\{\s*$")
_CALLEES = re.compile(r"\b(body|condition|to_apply|calls|true_computation|false_computation)"
                      r"=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_GROUPS_LIST = re.compile(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}")


def _group_size(attrs: str) -> Optional[int]:
    # mesh['axis_0'=8,'axis_1'=1] {'axis_0'}: the named axes' product
    m = _GROUPS_MESH.search(attrs)
    if m:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
        named = re.findall(r"'([^']+)'", m.group(2))
        return (int(np.prod([int(sizes[a]) for a in named if a in sizes], dtype=np.int64)) if named
                else 1)
    m = _GROUPS_IOTA.search(attrs)
    if m:
        return int(m.group(2))
    m = _GROUPS_LIST.search(attrs)
    if m:
        first = m.group(1).split("}")[0].strip("{")
        return len([d for d in first.split(",") if d]) or None
    return None


def _arrays(type_text: str) -> Tuple[HloArray, ...]:
    return tuple(HloArray(t, tuple(int(d) for d in dims.split(",") if d))
                 for t, dims in _ARRAY.findall(re.sub(r"/\*.*?\*/", "", type_text)))


def _closing(text: str, start: int) -> int:
    """Index of the parenthesis closing the one at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    raise ValueError(f"unbalanced parentheses in HLO line: {text[:200]!r}")


def _split_instruction(rest: str) -> Tuple[str, str, str, str]:
    """``TYPE op(ARGS), ATTRS`` -> (type, op, args, attrs)."""
    if rest.startswith("("):
        end = _closing(rest, 0) + 1
    else:
        end = rest.index(" ") if " " in rest else len(rest)
    type_text, tail = rest[:end], rest[end:].lstrip()
    m = re.match(r"([\w\-]+)\(", tail)
    if not m:
        return type_text, "", "", tail
    close = _closing(tail, m.end() - 1)
    return type_text, m.group(1), tail[m.end():close], tail[close + 1:]


def _operand_names(args: str) -> List[str]:
    names, depth, token = [], 0, ""
    for ch in re.sub(r"/\*.*?\*/", "", args) + ",":
        depth += {"(": 1, "{": 1, "[": 1, ")": -1, "}": -1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            if token.strip():
                names.append(token.split()[-1].lstrip("%"))
            token = ""
        else:
            token += ch
    return names


def _scalar_constant(instrs: Dict[str, Tuple[str, str, str]], name: str) -> Optional[int]:
    op, args, _ = instrs.get(name, ("", "", ""))
    return int(args) if op == "constant" and re.fullmatch(r"-?\d+", args.strip()) else None


def _tuple_element(instrs: Dict[str, Tuple[str, str, str]], name: str) -> Optional[Tuple[str, int]]:
    """(tuple operand, index) of a ``get-tuple-element``, else None."""
    op, args, attrs = instrs.get(name, ("", "", ""))
    index = re.search(r"\bindex=(\d+)", attrs)
    return ((_operand_names(args)[0], int(index.group(1))) if op == "get-tuple-element"
            and index else None)


def _counted_loop_trips(instrs: Dict[str, Tuple[str, str, str]], roots: Dict[str, str],
                        args: str, attrs: str) -> Optional[int]:
    """Trips of a ``while`` whose backend config states none, read off the loop itself.

    XLA adds ``known_trip_count`` only in passes after SPMD partitioning, so the
    partitioner's dump of a scanned model (``nnx.scan`` / ``lax.scan``) has none. JAX
    lowers a scan of length N as a counted loop: tuple element k starts at a constant
    S, the condition's root is ``compare(gte(p, k), constant(N)), direction=LT`` and the
    body's root tuple holds ``add(gte(p, k), constant(1))`` at k; its trips are N - S.
    Any other shape gives None (counted once, as before).
    """
    callees = dict(_CALLEES.findall(attrs))
    cond = instrs.get(roots.get(callees.get("condition", ""), ""))
    body = instrs.get(roots.get(callees.get("body", ""), ""))
    if cond is None or body is None or cond[0] != "compare" or body[0] != "tuple":
        return None
    direction = re.search(r"\bdirection=(\w+)", cond[2])
    pair = _operand_names(cond[1])
    if direction is None or len(pair) != 2 or direction.group(1) not in ("LT", "GT"):
        return None
    counter, bound = pair if direction.group(1) == "LT" else pair[::-1]
    element, stop = _tuple_element(instrs, counter), _scalar_constant(instrs, bound)
    init = _operand_names(args)
    if (element is None or stop is None or len(init) != 1
        or instrs.get(init[0], ("",))[0] != "tuple"):
        return None
    k = element[1]
    starts, nexts = _operand_names(instrs[init[0]][1]), _operand_names(body[1])
    if k >= len(starts) or k >= len(nexts):
        return None
    start = _scalar_constant(instrs, starts[k])
    step_op, step_args, _ = instrs.get(nexts[k], ("", "", ""))
    step = _operand_names(step_args)

    def counter_plus_one(a: str, b: str) -> bool:
        element = _tuple_element(instrs, a)
        return element is not None and element[1] == k and _scalar_constant(instrs, b) == 1

    steps_by_one = step_op == "add" and len(step) == 2 and (
        counter_plus_one(*step) or counter_plus_one(*step[::-1]))
    if start is None or not steps_by_one or stop <= start:
        return None
    return stop - start


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One instruction of an HLO module.

    Attributes:
      computation: the computation that holds it.
      name: its name (unique in the module), e.g. ``fusion.12``.
      op: the opcode (``fusion``, ``custom-call``, ``dot``, ``all-gather-start``, ...).
      type_text: the result type as written, e.g. ``(f32[8,4]{1,0}, s8[1024]{0})``.
      operands: the operand names, in order.
      attrs: the text after the operand list (``calls=``, ``backend_config=``, ...).
      runs: times it runs per execution of the module (see :func:`parse_module`).
    """

    computation: str
    name: str
    op: str
    type_text: str
    operands: Tuple[str, ...]
    attrs: str
    runs: int

    @property
    def results(self) -> Tuple[HloArray, ...]:
        """The result arrays (the elements of a tuple result, in order)."""
        return _arrays(self.type_text)

    @property
    def op_name(self) -> str:
        """The JAX ``op_name`` metadata, '' if none."""
        m = _OP_NAME.search(self.attrs)
        return m.group(1) if m else ""

    @property
    def target(self) -> str:
        """The ``custom_call_target`` of a custom call, '' otherwise."""
        m = _TARGET.search(self.attrs)
        return m.group(1) if m else ""

    @property
    def backend_config(self) -> dict:
        """The JSON ``backend_config``, {} when absent or not JSON."""
        start = self.attrs.find("backend_config=")
        if start < 0 or self.attrs[start + len("backend_config="):][:1] != "{":
            return {}
        text = self.attrs[start + len("backend_config="):]
        try:
            return json.JSONDecoder().raw_decode(text)[0]
        except ValueError:
            return {}


@dataclasses.dataclass
class HloModule:
    """An HLO module's instructions, as :func:`parse_module` reads them.

    Attributes:
      instructions: every instruction, in text order.
      entry: the name of the entry computation.
      fused: the computations called by a ``fusion`` (their instructions run inside one
        kernel); the others are control flow (entry, loop bodies, branches, calls) or
        reducers (``to_apply`` of a reduction).
      roots: computation -> its ROOT instruction's name.
      control: the computations whose instructions launch kernels: the entry, loop
        bodies and conditions, branches and called computations.
    """

    instructions: List[Instruction]
    entry: str
    fused: frozenset
    roots: Dict[str, str]
    control: frozenset = frozenset()

    def __post_init__(self):
        self.by_name = {i.name: i for i in self.instructions}

    def arrays(self, name: str) -> Tuple[HloArray, ...]:
        """The result arrays of the instruction ``name`` (empty if unknown)."""
        ins = self.by_name.get(name)
        return ins.results if ins is not None else ()

    def operand_arrays(self, ins: Instruction) -> Tuple[HloArray, ...]:
        """The arrays ``ins`` reads, operand by operand (tuples flattened)."""
        return tuple(a for n in ins.operands for a in self.arrays(n))

    def computation(self, name: str) -> List[Instruction]:
        """The instructions of computation ``name``, in text order."""
        return [i for i in self.instructions if i.computation == name]


def parse_module(hlo_text: str) -> HloModule:
    """Reads an HLO module's text into :class:`Instruction` s with their run counts.

    Reads the text of ``compiled.as_text()`` or of an XLA HLO dump: computations,
    instruction lines like ``%all-reduce.3 = (f32[64,32]{1,0}, bf16[8]{0})
    all-reduce(%a, %b), ..., to_apply=%add``, and the ``while`` loops (``body=``,
    ``backend_config={"known_trip_count":{"n":"4"}}``, or where XLA has not stated it
    yet, as after SPMD partitioning, the bound of a counted loop as JAX lowers
    ``lax.scan``: see :func:`_counted_loop_trips`) and calls that decide how often
    each computation runs: a loop body runs its trip count times per run of the loop,
    every other callee (fusions, branches, reducers) once per run of its caller.

    Raises:
      ValueError: a line with unbalanced parentheses.
    """
    instrs: Dict[str, Tuple[str, str, str]] = {}  # name -> (op, args, attrs); names are module-wide
    roots: Dict[str, str] = {}
    order: List[str] = []
    calls: Dict[str, List[Tuple[str, int]]] = collections.defaultdict(list)
    rows: List[Tuple[str, str, str, str, str, str]] = []  # computation, name, type, op, args, attrs
    fused, control = set(), set()
    entry, current = None, None
    for line in hlo_text.splitlines():
        if line.startswith("HloModule"):
            continue
        m = _INSTR.match(line)
        if m is None or current is None:
            h = _HEADER.match(line)
            if h and " = " not in line.split("(")[0]:
                current = h.group(1)
                order.append(current)
                if line.lstrip().startswith("ENTRY"):
                    entry = current
            continue
        name, rest = m.groups()
        type_text, op, args, attrs = _split_instruction(rest)
        instrs[name] = (op, args, attrs)
        if line.lstrip().startswith("ROOT"):
            roots[current] = name
        trip = _TRIP.search(attrs)
        trips = int(trip.group(1)) if trip else (
            _counted_loop_trips(instrs, roots, args, attrs) if op == "while" else None)
        for key, callee in _CALLEES.findall(attrs):
            calls[current].append((callee, (trips or 1) if key == "body" else 1))
            if op == "fusion" and key == "calls":
                fused.add(callee)
            elif op in ("while", "conditional", "call", "async-start") or key in (
                    "true_computation", "false_computation"):
                control.add(callee)
        for group in _BRANCHES.findall(attrs):
            branches = [b.strip().lstrip("%") for b in group.split(",") if b.strip()]
            calls[current].extend((b, 1) for b in branches)
            control.update(branches)
        rows.append((current, name, type_text, op, args, attrs))

    runs = collections.defaultdict(int)
    runs[entry] = 1
    for comp in reversed(order):  # XLA prints callees before callers
        for callee, factor in calls.get(comp, ()):
            runs[callee] += runs[comp] * factor
    # A computation fused into a kernel is part of the kernel: its callees too.
    for comp in order:
        if comp in fused:
            fused.update(c for c, _ in calls.get(comp, ()))
    instructions = [Instruction(comp, name, op, type_text, tuple(_operand_names(args)), attrs,
                                runs.get(comp) or 1)
                    for comp, name, type_text, op, args, attrs in rows]
    control.add(entry or "")
    return HloModule(instructions, entry or "", frozenset(fused), roots, frozenset(control - fused))


def hlo_collectives(hlo_text: str) -> List[Collective]:
    """Parses the collective instructions of an HLO module's text (:func:`parse_module`).

    Operand types are looked up by operand name. ``*-done`` halves of async pairs are
    skipped; a ``*-start`` is reported as its collective, and the operand copies in an
    async ``all-gather-start``'s result tuple are dropped.

    Returns:
      The :class:`Collective` s in text order.

    Raises:
      ValueError: a line with unbalanced parentheses.
    """
    module = hlo_text if isinstance(hlo_text, HloModule) else parse_module(hlo_text)
    out = []
    for ins in module.instructions:
        base = ins.op[:-len("-start")] if ins.op.endswith("-start") else ins.op
        if base not in _COLLECTIVES:
            continue
        operands = module.operand_arrays(ins)
        results = ins.results
        if ins.op.endswith("-start") and len(results) == 2 * len(operands) \
                and results[:len(operands)] == operands:
            results = results[len(operands):]
        out.append(Collective(ins.name, base, operands, results, ins.runs, ins.op_name,
                              _group_size(ins.attrs)))
    return out


def collective_bytes(collectives: Sequence[Collective]) -> Dict[str, Dict[str, int]]:
    """Bytes of every collective per device per step, by op and element type.

    An ``all-reduce``, ``reduce-scatter`` or ``collective-permute`` counts its operand
    bytes; an ``all-gather`` or ``all-to-all`` its result bytes (what each device
    holds once it is done); each times :attr:`Collective.count`. Collectives over
    one-device groups (:attr:`Collective.moves_data`) are left out. An op's dtype is its
    buffers' HLO element type (``bf16``, ``f32``, ``f8e4m3fn``, ``s32``, ...).

    Args:
      collectives: from :func:`hlo_collectives`.

    Returns:
      ``{op: {dtype: bytes}}``, only for ops and dtypes that occur.
    """
    out: Dict[str, Dict[str, int]] = {}
    for c in collectives:
        if not c.moves_data:
            continue
        arrays = c.results if c.op in ("all-gather", "all-to-all") else c.operands
        for a in arrays:
            by_dtype = out.setdefault(c.op, {})
            by_dtype[a.dtype] = by_dtype.get(a.dtype, 0) + c.count * a.nbytes
    return out


# ----------------------------------------------------------------------------- dots

# The custom call XLA's GPU GEMM rewriter emits for an FP8 GEMM on cuBLASLt
# (xla/service/gpu/cublas_cudnn.h, kCublasLtMatmulF8CallTarget).
FP8_GEMM_TARGET = "__cublas$lt$matmul$f8"
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


# ----------------------------------------------------------------------------- GEMMs and kernels

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
        for key, callee in _CALLEES.findall(ins.attrs):
            if ins.op == "fusion" and key == "calls":
                callers[callee] = ins.name
    for ins in module.instructions:  # nested fusions belong to the outermost fusion
        if ins.computation in module.fused and ins.computation in callers:
            for key, callee in _CALLEES.findall(ins.attrs):
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
        if base in _COLLECTIVES:
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
            callee = dict(_CALLEES.findall(ins.attrs)).get("calls", "")
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
