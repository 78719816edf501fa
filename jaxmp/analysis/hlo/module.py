"""XLA HLO text parsed into instructions with their execution counts (:func:`parse_module`).

The reader the other :mod:`jaxmp.analysis.hlo` modules build on (see the package
docstring)."""
from __future__ import annotations

import collections
import dataclasses
import json
import re
from typing import Dict, List, Optional, Tuple

import numpy as np

__all__ = ["HloArray", "Instruction", "HloModule", "parse_module", "CALLEES"]


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




_ARRAY = re.compile(r"\b(pred|[a-z]+\d+[a-z0-9]*)\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_HEADER = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*[\s(].*\{\s*$")
# The attributes naming a called computation (also read by kernels.py to walk the calls).
CALLEES = re.compile(r"\b(body|condition|to_apply|calls|true_computation|false_computation)"
                     r"=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')


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
    callees = dict(CALLEES.findall(attrs))
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
        for key, callee in CALLEES.findall(attrs):
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
