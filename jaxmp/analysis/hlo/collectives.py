"""The collectives of an HLO module: kind, operand/result arrays, replica group size and
bytes moved per step (:func:`hlo_collectives`, :func:`collective_bytes`)."""
from __future__ import annotations

import dataclasses
import re
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from jaxmp.analysis.hlo.module import HloArray, HloModule, parse_module

__all__ = ["Collective", "COLLECTIVE_OPS", "hlo_collectives", "collective_bytes"]


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



# The HLO collective ops (an async one as its ``-start``); kernels.py counts them too.
COLLECTIVE_OPS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all",
                  "collective-permute", "ragged-all-to-all")
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
        if base not in COLLECTIVE_OPS:
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
