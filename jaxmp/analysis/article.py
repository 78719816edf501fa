"""The article's memory (section 2.1) and communication (section 2.3) figures, rechecked.

"The article" is the DeepSeek mixed-precision article this project started from: a blog
post on DeepSeek-style FP32 master weights, FP16/BF16 compute and compressed gradient
communication. It prints, for a 67e9-parameter
model, FP32 parameters of "2.68 TB", FP16+FP32 parameters of "132+132 GB", a 40-60% memory
cut from mixed precision, FP16 gradients halving communication, and top-k sparsification
(30%) cutting it to 30%. Only those figures are quoted here. Each row recomputes the
quantity from first principles and is marked ``OK`` when the article's figure agrees within
:data:`TOLERANCE`, ``WRONG`` when it does not, and ``REF`` for reference rows the article
prints no figure for.

Sources: Micikevicius et al. 2018, "Mixed Precision Training", section 3.1 (FP16 weights,
activations and gradients, FP32 master weights); Rajbhandari et al. 2020, "ZeRO",
section 3.1 (mixed-precision Adam holds 2 + 2 + (4 + 4 + 4) = 16 bytes per parameter);
DeepSeek-V3 Technical Report, section 3.3.3 (FP32 master weights and gradients, BF16
Adam moments); Patarasuk and Yuan 2009 and the NCCL performance notes (a ring
all-reduce sends and receives 2 (N - 1) / N times the buffer per device).

GB means 1e9 bytes, as in the article.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

from jaxmp._checks import check_int

__all__ = ["ARTICLE_PARAMS", "TOLERANCE", "Row", "ring_allreduce_factor", "memory_table",
           "communication_table", "STRATEGY_DEVICES", "strategy_table"]

ARTICLE_PARAMS = 67e9
TOLERANCE = 0.05  # relative: a printed figure within 5% of ours counts as OK.

_INDEX_BYTES = 4  # int32 index per kept entry.
_TOPK = 0.3


@dataclasses.dataclass(frozen=True)
class Row:
    """One recomputed figure.

    Attributes:
      item: what is counted.
      formula: how, in bytes per parameter.
      bytes_per_param: the formula's value (None where it is not per parameter).
      bytes: for the article's model: memory rows, the whole model's states (unsharded);
        communication rows, bytes each device sends per step. None where the figure
        depends on more than the parameter count.
      fraction: ``bytes`` (or bytes per element) over ``baseline``'s, or None.
      baseline: what ``fraction`` is relative to.
      article: the article's printed figure, verbatim, or None.
      status: ``"OK"``, ``"WRONG"`` or ``"REF"``.
      reason: why.
    """

    item: str
    formula: str
    bytes_per_param: Optional[float]
    bytes: Optional[float]
    fraction: Optional[float]
    baseline: str
    article: Optional[str]
    status: str
    reason: str

    def as_dict(self) -> dict:
        """Returns the fields as a plain dict (for JSON)."""
        return dataclasses.asdict(self)


def _judge(ours: float, article_range: Tuple[float, float]) -> str:
    lo, hi = article_range
    return "OK" if lo * (1 - TOLERANCE) <= ours <= hi * (1 + TOLERANCE) else "WRONG"


def _gb(x: float) -> str:
    return f"{x / 1e9:,.0f} GB" if x >= 10e9 else f"{x / 1e9:.2f} GB"


def ring_allreduce_factor(num_devices: int) -> float:
    """Bytes each device sends (and receives) in a ring all-reduce, per buffer byte.

    A ring all-reduce is a reduce-scatter then an all-gather, each moving
    ``(N - 1) / N`` of the buffer through every device (Patarasuk and Yuan 2009).

    Args:
      num_devices: N, a positive int.

    Returns:
      ``2 * (N - 1) / N``.

    Raises:
      ValueError: N is not a positive int.
    """
    check_int("num_devices", num_devices, 1)
    return 2.0 * (num_devices - 1) / num_devices


def memory_table() -> List[Row]:
    """Section 2.1: static training memory of the article's 67e9-parameter model.

    Returns:
      Rows: FP32 parameters; FP16 + FP32 parameter copies; FP32 Adam training states
      (16 B/param); mixed-precision Adam (ZeRO section 3.1, 16 B/param); DeepSeek-V3's
      states (12 B/param); activations (where the saving really is).
    """
    p = ARTICLE_PARAMS
    fp32_params = 4 * p
    both = (2 + 4) * p
    article_both = 132e9 + 132e9
    fp32_states = (4 + 4 + 4 + 4) * p
    mixed_states = (2 + 2 + 4 + 4 + 4) * p
    dsv3_states = (4 + 4 + 2 + 2) * p
    claim = (1 - 0.6, 1 - 0.4)  # a 40-60% cut leaves 40-60% of FP32 memory.
    rows = [
        Row("FP32 parameters", "4 B/param", 4, fp32_params, None, "-",
            "2.68 TB", _judge(fp32_params, (2.68e12, 2.68e12)),
            f"{p / 1e9:.0f}e9 x 4 B = {fp32_params / 1e9:.0f}e9 B = {_gb(fp32_params)}; "
            f"2.68 TB is {2.68e12 / fp32_params:.0f}x too large"),
        Row("FP16 + FP32 parameter copies", "2 + 4 B/param", 6, both, both / fp32_params,
            "FP32 parameters", "132+132 GB", _judge(both, (article_both, article_both)),
            f"the FP16 copy is {_gb(2 * p)} and the FP32 master copy is {_gb(4 * p)}, not "
            f"132 GB: together {_gb(both)}, {both / fp32_params:.1f}x FP32 alone; even "
            f"the article's own 132+132 = {_gb(article_both)} is within "
            f"{100 * (1 - article_both / fp32_params):.1f}% of the {_gb(fp32_params)} of FP32 "
            f"alone, so keeping both copies saves essentially nothing"),
        Row("FP32 training, Adam", "params 4 + grads 4 + m 4 + v 4 = 16 B/param", 16,
            fp32_states, 1.0, "FP32 training states", None, "REF",
            "the baseline the memory cut is measured against"),
        Row("mixed precision, Adam (Micikevicius 2018; ZeRO sec. 3.1)",
            "fp16 params 2 + fp16 grads 2 + fp32 master 4 + m 4 + v 4 = 16 B/param", 16,
            mixed_states, mixed_states / fp32_states, "FP32 training states",
            "40-60% less memory", _judge(mixed_states / fp32_states, claim),
            f"{_gb(mixed_states)} = the FP32 {_gb(fp32_states)}: a "
            f"{1 - mixed_states / fp32_states:.0%} cut; the 16-bit copies come on top of "
            f"the FP32 master weights and Adam moments; the saving is in activations"),
        Row("DeepSeek-V3 (report sec. 3.3.3)",
            "fp32 master 4 + fp32 grads 4 + bf16 m 2 + bf16 v 2 = 12 B/param", 12,
            dsv3_states, dsv3_states / fp32_states, "FP32 training states",
            "40-60% less memory", _judge(dsv3_states / fp32_states, claim),
            f"BF16 Adam moments give a {1 - dsv3_states / fp32_states:.0%} cut "
            f"({_gb(dsv3_states)}), below 40-60%, before any low-precision weight copy"),
        Row("activations kept for backward", "2 B vs 4 B per activation element", None, None,
            0.5, "FP32 activations", None, "REF",
            "where mixed precision does save memory: 16-bit activations take half; their "
            "size grows with batch x sequence x width x layers, not with the parameter "
            "count, and the article's table leaves them out"),
    ]
    return rows


def communication_table(num_devices: int = 8) -> List[Row]:
    """Section 2.3: gradient all-reduce bytes per device per step for the article's model.

    Args:
      num_devices: data-parallel devices N in the ring (the ratios of the ring rows do
        not depend on N; the all-gather row does).

    Returns:
      Rows: FP32 ring all-reduce; FP16/BF16; top-k 30% with 16-bit and FP32 values plus
      int32 indices (optimistic: every device keeps the same indices); top-k 30% by
      all-gather (indices differ across devices, as they do in practice).

    Raises:
      ValueError: ``num_devices`` is not an int >= 2.
    """
    check_int("num_devices", num_devices, 2)
    n, p = num_devices, ARTICLE_PARAMS
    ring = ring_allreduce_factor(n)
    dense32, dense16 = 4.0, 2.0
    sparse16 = _TOPK * (2 + _INDEX_BYTES)
    sparse32 = _TOPK * (4 + _INDEX_BYTES)
    gather16 = (n - 1) * sparse16  # each device receives every other device's (value, index) list.
    # (N-1) * sparse16 > 2 (N-1) / N * dense32  <=>  N > 2 * dense32 / sparse16.
    breakeven = 2 * dense32 / sparse16
    at_n = f"(2(N-1)/N = {ring:.3f} at N = {n})"
    return [
        Row("FP32 gradients, ring all-reduce", f"2(N-1)/N x 4 B/param {at_n}", ring * dense32,
            ring * dense32 * p, 1.0, "FP32 ring all-reduce", None, "REF",
            f"{_gb(ring * dense32 * p)} per device per step"),
        Row("FP16/BF16 gradients, ring all-reduce", f"2(N-1)/N x 2 B/param {at_n}", ring * dense16,
            ring * dense16 * p, dense16 / dense32, "FP32 ring all-reduce",
            "halves communication", _judge(dense16 / dense32, (0.5, 0.5)),
            "2 B instead of 4 B per element on the same ring; the sum is then 16-bit too "
            "(DeepSeek-V3 keeps its gradient accumulators in FP32, sec. 3.3.3)"),
        Row("top-k 30%, 16-bit values + int32 indices (same indices everywhere)",
            f"2(N-1)/N x 0.3 x (2 + 4) B/param {at_n}", ring * sparse16, ring * sparse16 * p,
            sparse16 / dense16, "16-bit dense ring all-reduce", "cuts it to 30%",
            _judge(sparse16 / dense16, (0.3, 0.3)),
            f"each kept value carries a 4-byte index: {sparse16:.1f} B/param against "
            f"2 B dense, {sparse16 / dense16:.0%} of the dense traffic "
            f"({sparse16 / dense32:.0%} of FP32), not 30%"),
        Row("top-k 30%, FP32 values + int32 indices (same indices everywhere)",
            f"2(N-1)/N x 0.3 x (4 + 4) B/param {at_n}", ring * sparse32, ring * sparse32 * p,
            sparse32 / dense32, "FP32 dense ring all-reduce", "cuts it to 30%",
            _judge(sparse32 / dense32, (0.3, 0.3)),
            f"{sparse32:.1f} B/param against 4 B dense: {sparse32 / dense32:.0%}, not 30%"),
        Row("top-k 30%, 16-bit values + int32 indices, all-gather",
            "(N-1) x 0.3 x (2 + 4) B/param", gather16, gather16 * p, gather16 / (ring * dense16),
            "16-bit dense ring all-reduce", "cuts it to 30%",
            _judge(gather16 / (ring * dense16), (0.3, 0.3)),
            f"each device picks its own top 30%, so the sum is not 30% sparse and a ring "
            f"cannot reduce it in place; gathering all N lists costs {gather16:.1f} B/param "
            f"for N = {n}, {gather16 / (ring * dense16):.1f}x the dense 16-bit ring "
            f"and more than the dense FP32 ring for every N > {breakeven:.1f}"),
    ]


# The article's setting for its 67e9-parameter model.
STRATEGY_DEVICES = 2048


def strategy_table(num_devices: int = STRATEGY_DEVICES) -> List[Row]:
    """Per-GPU training state of the article's model under dp, zero1 and fsdp.

    Mixed precision as jaxmp trains it: float32 master weights and Adam moments, bf16
    compute (``parallel.strategy`` in :mod:`jaxmp.train.config`); P parameters, N
    data-parallel GPUs. The article prints no figure for these rows (all ``REF``). Bytes
    per GPU, from ZeRO (Rajbhandari et al. 2020, section 5: stage 1 partitions the
    optimizer state, stage 3 the parameters too) with DeepSpeed's bf16 layout (a bf16
    copy of the parameters kept whole under stage 1):

    * dp: master 4P + moments 8P + float32 gradients 4P, everything replicated: 16P;
    * zero1: the bf16 parameter copy 2P whole, master and moments sharded: 2P + 12P/N;
      the bf16 gradients 2P exist during the step and are reduce-scattered;
    * fsdp: everything sharded, 12P/N, plus one layer's gathered bf16 parameters at a
      time (not counted: it depends on the layer, not on P).

    Activations are left out (they depend on batch, sequence and remat, not on the
    strategy). GB = 1e9 bytes.

    Raises:
      ValueError: ``num_devices`` is not an int >= 1.
    """
    check_int("num_devices", num_devices, 1)
    n, p = num_devices, ARTICLE_PARAMS
    rows = []
    for name, formula, per_param, note in (
            ("dp", "4 + 8 + 4 B/param (master, moments, float32 gradients), replicated", 16.0,
             "more than any GPU holds (an H200 has 141 GB)"),
            ("zero1", f"2 + 12 / N B/param (bf16 copy whole; master + moments / N), N = {n}",
             2 + 12 / n,
             "the bf16 copy dominates; the sharded float32 state is small"),
            ("fsdp", f"12 / N B/param (master + moments / N), N = {n}", 12 / n,
             "plus one layer's gathered bf16 weights while it runs")):
        rows.append(Row(f"per-GPU state, {name}, {n} GPUs", formula, per_param, per_param * p,
                        per_param / 16.0, "dp", None, "REF",
                        f"{_gb(per_param * p)} per GPU; {note}"))
    return rows
