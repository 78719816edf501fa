"""Per-device memory and gradient traffic of the real train step, one row per precision mode.

Every figure is read from the program JAX and XLA build for the config's model, under
abstract evaluation (``jax.eval_shape``, ``jax.make_jaxpr``, ``Lowered.compile``), so no
parameter or activation is ever allocated and a 24-layer model can be counted on a laptop.
Per device, in bytes, for the config's layout (``parallel.strategy`` and
``parallel.expert``, :func:`jaxmp.sharding.layout`) on a ``("data", "expert")`` mesh:

``params_bytes``
    the master weights ``TrainState.params`` as stored (float32 in every mixed mode):
    the device's shard under ``zero1`` and ``fsdp``, everything under ``dp``.
``grads_bytes``
    the gradient buffer: one value per parameter in its master dtype (what
    :func:`jaxmp.optim.apply_gradients` receives), laid out like ``params_bytes``.
``opt_state_bytes``
    ``optimizer.init(params)`` of the real optimizer (moments in ``optim.mu_dtype`` /
    ``nu_dtype`` plus the int32 step counts), laid out like the master weights.
``compute_copy_bytes``
    the compute-dtype copy of the parameters the state keeps between steps under
    ``zero1`` (``TrainState.compute_params``, replicated); 0 otherwise.
``comm_state_bytes``
    the top-k error-feedback residual (:func:`jaxmp.comm.init_comm_state`), one float32
    row per device; 0 without compression.
``activation_bytes``
    the residuals that the forward pass of the train step's loss
    (:func:`jaxmp.train.step.loss_fn`) saves for its backward pass at the per-device
    micro-batch, listed by :func:`saved_residuals` from the traced ``jax.vjp``. Counted:
    every array the forward computes and the backward reads, including the
    compute-dtype casts of the parameters (a bf16 copy of a weight *is* a residual) and
    integer/boolean arrays (routing indices, masks). Not counted: the arguments (master
    params, router biases, loss scale, token batch), which exist whether or not a
    backward pass follows, and literals and constants baked into the program. This is
    the saving precision buys at the JAX level, identical on every backend; XLA may
    later fuse, rematerialize or (XLA:CPU) widen some of them, which the compiled memory
    analysis printed on a GPU shows.
``grad_allreduce_bytes``
    traffic of the gradient collectives per step: read from the trainer's own step
    (:attr:`jaxmp.train.experiment.Experiment.train_step`) lowered over a ``"data"`` mesh
    and compiled, in the HLO module right after XLA's SPMD partitioner (before backend
    passes such as XLA:CPU's ``all-reduce-promotion``, which widens 16-bit
    all-reduces to float32 because the CPU runtime reduces 32-bit types only). Each
    collective counts the size of its whole buffer: operand bytes of an ``all-reduce``
    or ``reduce-scatter``, result bytes of an ``all-gather`` (times its loop trip count
    inside a ``while``). See :func:`gradient_collective_bytes` for which operands are
    gradients.
``collective_bytes``
    every collective of the partitioned step, ``{op: {dtype: bytes}}`` (ops
    ``all-reduce``, ``reduce-scatter``, ``all-gather``, ``all-to-all``,
    ``collective-permute``), whole buffers as :func:`collective_bytes` counts them:
    gradients, parameter gathers, expert-parallel token exchanges and scalar metrics
    alike. A ring moves
    ``(N - 1) / N`` of each buffer per device over the wire (N devices in the group).
``total_bytes``
    the sum of the memory rows (params, grads, optimizer state, compute copy,
    communication state, activations); the collective traffic is not memory and is not
    added.

The modes (:data:`MODES`) are complete sets of config overrides, so each row describes
the same model under one precision recipe whatever the config itself chose.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import glob
import os
import re
import tempfile
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxmp.models.attention import Attention, cudnn_support, resolve_attention, trace_cudnn_without_gpu
from jaxmp.models.transformer import REMAT_POLICIES
from jaxmp import sharding
from jaxmp.precision import comm
from jaxmp.train.config import complete_config
from jaxmp.train.experiment import Experiment
from jaxmp.train.step import loss_fn

__all__ = [
    "MODES",
    "TOPK_RATIO",
    "MEMORY_KEYS",
    "mode_config",
    "Residual",
    "saved_residuals",
    "residual_breakdown",
    "HloArray",
    "Collective",
    "hlo_collectives",
    "gradient_collective_bytes",
    "collective_bytes",
    "Dot",
    "stablehlo_dots",
    "count_fp8_dots",
    "FP8_GEMM_TARGET",
    "data_mesh",
    "account_mode",
    "accounting_report",
    "format_accounting",
    "SETTING_ATTENTIONS",
    "activation_settings",
    "format_settings",
]

# The DeepSeek mixed-precision article's top-k fraction (section 2.3), also jaxmp.comm's default.
TOPK_RATIO = 0.3

# One row per mode, every precision knob set, so that rows differ only where the table
# says. Mixed modes keep the router and norms as float32 islands (DeepSeek-V3 report
# 3.3); float16 needs a loss scale (Micikevicius et al. 2018, 3.2); bf16 moments follow
# DeepSeek-V3 3.3.3; the 16-bit all-reduce and the top-k all-gather (bf16 values + int32
# indices) are the article's section 2.3 proposals (jaxmp.analysis.article).
_MODE_TABLE = (
    # name             policy                                  loss scale           moments     reduce      compression
    ("fp32",           "fp32",                                 "none",              "",         "float32",  "none"),
    ("mixed_bf16",     "mixed_bf16; router: fp32; norm: fp32", "none",              "",         "float32",  "none"),
    ("mixed_fp16",     "mixed_fp16; router: fp32; norm: fp32", "dynamic:init=2**15", "",        "float32",  "none"),
    ("bf16_moments",   "mixed_bf16; router: fp32; norm: fp32", "none",              "bfloat16", "float32",  "none"),
    ("bf16_allreduce", "mixed_bf16; router: fp32; norm: fp32", "none",              "",         "bfloat16", "none"),
    ("topk_allreduce", "mixed_bf16; router: fp32; norm: fp32", "none",              "",         "bfloat16", "topk"),
    # mixed_bf16 with attention and every FFN in FP8 (jaxmp.fp8; embedding, head, router,
    # norms and the attention core stay bf16/fp32, DeepSeek-V3 3.3.1): their backward
    # passes keep FP8 activations plus float32 scales instead of bf16 ones.
    ("fp8_tensorwise", "fp8_tensorwise; router: fp32; norm: fp32", "none",          "",         "float32",  "none"),
    ("fp8_delayed",    "fp8_delayed; router: fp32; norm: fp32", "none",             "",         "float32",  "none"),
    ("fp8_rowwise",    "fp8_rowwise; router: fp32; norm: fp32", "none",             "",         "float32",  "none"),
    ("fp8_blockwise",  "fp8_blockwise; router: fp32; norm: fp32", "none",           "",         "float32",  "none"),
)

MODES: Mapping[str, Mapping[str, Any]] = {
    name: {"precision.policy": policy, "precision.loss_scale": loss_scale,
           "optim.mu_dtype": moments, "optim.nu_dtype": moments,
           "precision.grad_reduce_dtype": reduce, "precision.grad_compression": compression,
           "precision.topk_ratio": TOPK_RATIO}
    for name, policy, loss_scale, moments, reduce, compression in _MODE_TABLE}

MEMORY_KEYS = ("params_bytes", "grads_bytes", "opt_state_bytes", "compute_copy_bytes",
               "comm_state_bytes", "activation_bytes")


def mode_config(config: ml_collections.ConfigDict, mode: str) -> ml_collections.ConfigDict:
    """A copy of ``config`` with the overrides of ``MODES[mode]`` applied.

    Raises:
      ValueError: ``mode`` is not a key of :data:`MODES` (they are listed).
    """
    if mode not in MODES:
        raise ValueError(f"unknown precision mode {mode!r}; allowed: {', '.join(MODES)}")
    out = complete_config(config)
    for key, value in MODES[mode].items():
        section, name = key.split(".")
        out[section][name] = value
    return out


# ----------------------------------------------------------------------------- residuals


@dataclasses.dataclass(frozen=True)
class Residual:
    """One array the forward pass keeps for the backward pass.

    Attributes:
      shape: the array's shape.
      dtype: its dtype name (``"bfloat16"``, ``"int32"``, ...); the E4M3 activation that
        :mod:`jaxmp.fp8` saves as uint8 bits is named ``"float8_e4m3fn"``.
      nbytes: ``prod(shape) * itemsize``.
      kind: ``"computed"`` (counted as activation memory), ``"argument"``, ``"literal"``
        or ``"constant"``.
      source: where it comes from, as JAX describes it, e.g. ``"output of exp from
        jaxmp/ops.py:157:8 (_masked_softmax_f32)"``.
    """

    shape: Tuple[int, ...]
    dtype: str
    nbytes: int
    kind: str
    source: str


def _kind(source: str) -> str:
    if source.startswith("from the argument"):
        return "argument"
    if source == "from a literal":
        return "literal"
    if source == "from a constant":
        return "constant"
    return "computed"


def saved_residuals(fn: Callable, *args, argnums: Any = 0) -> List[Residual]:
    """The residuals ``jax.vjp`` of ``fn`` with respect to ``args[argnums]`` saves.

    Like ``jax.ad_checkpoint.print_saved_residuals``, but only the ``argnums`` arguments
    are differentiated (as ``jax.grad(fn, argnums)`` does): the others are traced as
    plain inputs, so a residual that *is* one of them is reported as an argument, and
    computations on them that need no derivative save nothing. Works on abstract
    arguments (``jax.ShapeDtypeStruct`` leaves); nothing is allocated.

    Args:
      fn: a function of ``args`` returning a pytree of float arrays (e.g. a loss).
      *args: pytrees of arrays or ``jax.ShapeDtypeStruct``.
      argnums: int or sequence of ints, the arguments to differentiate.

    Returns:
      One :class:`Residual` per saved array, in the order JAX lists them.

    Raises:
      ValueError: an ``argnums`` entry outside ``[0, len(args))``.
    """
    # Private but documented by its public printer; no public call returns the list.
    from jax._src.ad_checkpoint import _saved_residuals

    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not nums or any(not isinstance(i, int) or not 0 <= i < len(args) for i in nums):
        raise ValueError(f"argnums={argnums!r} must name arguments in [0, {len(args)})")
    flat, tree = jax.tree_util.tree_flatten_with_path(args)
    leaves = [x for _, x in flat]
    names = [jax.tree_util.keystr(p) for p, _ in flat]

    def forward(*leaves_in):
        full = list(jax.tree.unflatten(tree, leaves_in))

        def of_diff(*diff):
            call = list(full)
            for i, d in zip(nums, diff):
                call[i] = d
            return fn(*call)

        return jax.vjp(of_diff, *(full[i] for i in nums))

    closed, shapes = jax.make_jaxpr(forward, return_shape=True)(*leaves)
    num_res = len(jax.tree.leaves(shapes[1]))
    jaxpr = closed.jaxpr
    info = jaxpr.debug_info
    jaxpr = jaxpr.replace(outvars=jaxpr.outvars[len(jaxpr.outvars) - num_res:],
                          debug_info=info._replace(result_paths=None) if info is not None else None)
    out = []
    for aval, source in _saved_residuals(jaxpr, names):
        shape = tuple(int(d) for d in aval.shape)
        dtype = np.dtype(aval.dtype)
        name = dtype.name
        if name == "uint8" and "(_stash)" in source:
            # jaxmp.fp8 saves its E4M3 activation as uint8 bits (safe under jax.checkpoint):
            # report what the bits are.
            name = "float8_e4m3fn"
        out.append(Residual(shape, name, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize,
                            _kind(source), source))
    return out


def residual_breakdown(residuals: Sequence[Residual], top: Optional[int] = None) -> List[dict]:
    """Counted (``kind == "computed"``) residual bytes grouped by source and dtype.

    Returns:
      ``[{"source": str, "dtype": str, "count": int, "bytes": int}, ...]``, largest
      ``bytes`` first, at most ``top`` rows (all when None). A source names the
      primitive and the line that produced the array.
    """
    groups: Dict[Tuple[str, str], List[int]] = collections.defaultdict(lambda: [0, 0])
    for r in residuals:
        if r.kind == "computed":
            g = groups[(r.source, r.dtype)]
            g[0] += 1
            g[1] += r.nbytes
    rows = [{"source": s, "dtype": d, "count": c, "bytes": b} for (s, d), (c, b) in groups.items()]
    rows.sort(key=lambda r: (-r["bytes"], r["source"]))
    return rows if top is None else rows[:top]


# ----------------------------------------------------------------------------- HLO collectives


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
_CALLEES = re.compile(r"\b(body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_GROUPS_LIST = re.compile(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}")


def _group_size(attrs: str) -> Optional[int]:
    m = _GROUPS_MESH.search(attrs)  # mesh['axis_0'=8,'axis_1'=1] {'axis_0'}: the named axes' product
    if m:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
        named = re.findall(r"'([^']+)'", m.group(2))
        return int(np.prod([int(sizes[a]) for a in named if a in sizes], dtype=np.int64)) if named else 1
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
    return (_operand_names(args)[0], int(index.group(1))) if op == "get-tuple-element" and index else None


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
    if element is None or stop is None or len(init) != 1 or instrs.get(init[0], ("",))[0] != "tuple":
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


def hlo_collectives(hlo_text: str) -> List[Collective]:
    """Parses the collective instructions of an HLO module's text.

    Reads the text of ``compiled.as_text()`` or of an XLA HLO dump: computations,
    instruction lines like ``%all-reduce.3 = (f32[64,32]{1,0}, bf16[8]{0})
    all-reduce(%a, %b), ..., to_apply=%add``, and the ``while`` loops (``body=``,
    ``backend_config={"known_trip_count":{"n":"4"}}``, or where XLA has not stated it
    yet, as after SPMD partitioning, the bound of a counted loop as JAX lowers
    ``lax.scan``: see :func:`_counted_loop_trips`) and calls that decide how often
    each computation runs. Operand types are looked up by operand name. ``*-done``
    halves of async pairs are skipped; a ``*-start`` is reported as its collective, and
    the operand copies in an async ``all-gather-start``'s result tuple are dropped.

    Returns:
      The :class:`Collective` s in text order.

    Raises:
      ValueError: a line with unbalanced parentheses.
    """
    types: Dict[str, str] = {}
    instrs: Dict[str, Tuple[str, str, str]] = {}  # name -> (op, args, attrs); names are module-wide
    roots: Dict[str, str] = {}  # computation -> its ROOT instruction
    order: List[str] = []
    calls: Dict[str, List[Tuple[str, int]]] = collections.defaultdict(list)
    found: List[Tuple[str, str, str, str, str, str]] = []  # computation, name, type, op, args, attrs
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
        types[name] = type_text
        instrs[name] = (op, args, attrs)
        if line.lstrip().startswith("ROOT"):
            roots[current] = name
        trip = _TRIP.search(attrs)
        trips = int(trip.group(1)) if trip else (
            _counted_loop_trips(instrs, roots, args, attrs) if op == "while" else None)
        for key, callee in _CALLEES.findall(attrs):
            calls[current].append((callee, (trips or 1) if key == "body" else 1))
        for group in _BRANCHES.findall(attrs):
            calls[current].extend((b.strip().lstrip("%"), 1) for b in group.split(",") if b.strip())
        base = op[:-len("-start")] if op.endswith("-start") else op
        if base in _COLLECTIVES:
            found.append((current, name, type_text, op, args, attrs))

    runs = collections.defaultdict(int)
    runs[entry] = 1
    for comp in reversed(order):  # XLA prints callees before callers
        for callee, factor in calls.get(comp, ()):
            runs[callee] += runs[comp] * factor

    out = []
    for comp, name, type_text, op, args, attrs in found:
        operands = tuple(a for n in _operand_names(args) for a in _arrays(types.get(n, "")))
        results = _arrays(type_text)
        base = op[:-len("-start")] if op.endswith("-start") else op
        if op.endswith("-start") and len(results) == 2 * len(operands) and results[:len(operands)] == operands:
            results = results[len(operands):]
        m = _OP_NAME.search(attrs)
        out.append(Collective(name, base, operands, results, runs.get(comp) or 1, m.group(1) if m else "",
                              _group_size(attrs)))
    return out


def gradient_collective_bytes(collectives: Sequence[Collective], dense_sizes: Sequence[int],
                              sparse_sizes: Sequence[int] = ()) -> int:
    """Bytes of the gradient-path collectives, per device per step.

    The rule, per operand, since XLA merges many leaves (and scalar metrics) into one
    tuple collective:

    * an ``all-reduce`` / ``reduce-scatter`` operand whose element count is that of a
      gradient leaf on one device (``dense_sizes``; for a scanned model
      :func:`account_mode` adds one layer's slice of each stacked leaf, which FSDP
      reduces inside the loop) counts its operand bytes: the whole buffer that is summed
      (XLA may transpose or reshape a leaf, never resize it);
    * an ``all-gather`` operand whose element count is in ``sparse_sizes`` (the top-k
      counts of the leaves, :func:`jaxmp.comm.topk_count`) counts its result bytes:
      every device's values or indices, as each device receives them;
    * collectives over one-device groups move nothing and are left out;
    * anything else is not gradient traffic: the loss, finiteness flags and the other
      metric reductions (scalars, ``[num_experts]`` counts), and activations the
      partitioner moves (e.g. the tokens of a dropless MoE layer that XLA's automatic
      partitioning gathers from all devices, and their cotangents).

    Each counted operand is multiplied by :attr:`Collective.count`. An activation
    whose element count happens to equal a gradient leaf's would be counted too;
    :func:`hlo_collectives` lists every collective for a check by eye.

    Args:
      collectives: from :func:`hlo_collectives`.
      dense_sizes: element counts of the per-device gradient leaves.
      sparse_sizes: element counts sent per leaf under top-k (empty without it).

    Returns:
      Bytes as an int.
    """
    dense, sparse = set(int(s) for s in dense_sizes), set(int(s) for s in sparse_sizes)
    total = 0
    for c in collectives:
        if not c.moves_data:
            continue
        if c.op in ("all-reduce", "reduce-scatter"):
            total += c.count * sum(a.nbytes for a in c.operands if a.size in dense)
        elif c.op == "all-gather":
            total += c.count * sum(r.nbytes for a, r in zip(c.operands, c.results) if a.size in sparse)
    return total


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
_SDOT = re.compile(r"stablehlo\.dot_general\b[^\n]*?:\s*\(tensor<([^>]*)>,\s*tensor<([^>]*)>\)\s*->\s*tensor<([^>]*)>")


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
    return [Dot(_element_type(a), _element_type(b), _element_type(c)) for a, b, c in _SDOT.findall(text)]


def count_fp8_dots(text: str) -> Tuple[int, int]:
    """``(fp8, other)``: how many dots of a lowered program have two FP8 operands, and how
    many do not (:func:`stablehlo_dots`)."""
    dots = stablehlo_dots(text)
    fp8 = sum(d.fp8 for d in dots)
    return fp8, len(dots) - fp8


# ----------------------------------------------------------------------------- one mode


def data_mesh(num_devices: int, expert: int = 1) -> Mesh:
    """A ``("data", "expert")`` mesh of ``num_devices`` devices of the default backend,
    or of the host CPU when the default backend has fewer (collectives are counted from
    the partitioned program, which does not depend on the platform; set
    ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before JAX starts to get N
    CPU devices), with ``expert`` devices along ``"expert"`` (as
    :func:`jaxmp.sharding.make_mesh`).

    Raises:
      ValueError: ``num_devices`` < 1 or more than either backend has, or ``expert``
        not dividing it.
    """
    if isinstance(num_devices, bool) or not isinstance(num_devices, (int, np.integer)) or num_devices < 1:
        raise ValueError(f"num_devices={num_devices!r} must be an integer >= 1")
    devices = jax.devices()
    if len(devices) < num_devices:
        devices = jax.devices("cpu")
    if len(devices) < num_devices:
        found = (f"{len(devices)} cpu" if jax.default_backend() == "cpu" else
                 f"{len(jax.devices())} {jax.default_backend()} and {len(devices)} cpu")
        raise ValueError(f"num_devices={num_devices} but only {found} devices exist; set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={num_devices} "
                         f"before JAX starts")
    return sharding.make_mesh(num_devices, expert=expert, devices=devices)


def _per_device_bytes(tree: Any, shardings: Any) -> int:
    total = 0
    for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
        shape = s.shard_shape(tuple(x.shape)) if isinstance(s, NamedSharding) else x.shape
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total


# A CPU program compiled only to be read is never run: skip the costly code generation
# (4-5x faster; the partitioner, which places the collectives, runs all the same).
_CPU_READ_ONLY = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
                  "xla_cpu_use_fusion_emitters": False}


def _partitioned_hlo(lowered, cpu: bool) -> Tuple[str, Any, str]:
    """Compiles ``lowered`` and returns (HLO text after SPMD partitioning, compiled, note).

    The partitioner's dump is written only by a real compilation, and JAX's persistent
    compilation cache (``JAX_COMPILATION_CACHE_DIR``) leaves the dump options out of its
    key. So this compile passes ``xla_enable_dumping`` (on by default: no effect on the
    program, but part of the key, so no other compile's entry matches) and writes no
    cache entry of its own (the minimum compile time to be cached is raised meanwhile).
    """
    min_time = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            compiled = lowered.compile(compiler_options={
                "xla_dump_to": tmp, "xla_dump_hlo_as_text": True, "xla_enable_dumping": True,
                "xla_dump_hlo_pass_re": "spmd-partitioning", **(_CPU_READ_ONLY if cpu else {})})
            dumps = sorted(glob.glob(os.path.join(tmp, "*after_spmd-partitioning*.txt")))
            if dumps:
                with open(dumps[-1]) as f:
                    return f.read(), compiled, "HLO after SPMD partitioning"
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_time)
    # No dump (not expected): the final program, whose 16-bit reductions XLA:CPU may
    # have widened.
    return compiled.as_text(), compiled, "compiled HLO (no partitioner dump was written)"


def _memory_analysis(compiled) -> Optional[dict]:
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    keys = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
            "temp_size_in_bytes", "generated_code_size_in_bytes")
    return {k: int(getattr(stats, k)) for k in keys if hasattr(stats, k)}


def _micro_batch(exp: Experiment) -> jax.ShapeDtypeStruct:
    """The per-device micro-batch of token ids: ``[batch / accum / devices, seq_len]``."""
    t = exp.config.train
    return jax.ShapeDtypeStruct((t.batch_size // t.grad_accum_steps // exp.num_devices,
                                 exp.config.data.seq_len), jnp.int32)


def _step_residuals(exp: Experiment) -> List[Residual]:
    """The residuals the train step's loss keeps at the per-device micro-batch."""
    state, micro = exp.abstract_state, _micro_batch(exp)

    def loss(params, biases, rest, loss_scale, batch):
        return loss_fn(exp.graphdef, params, biases, rest, loss_scale, batch)[0]

    return saved_residuals(loss, state.params, state.biases, state.rest, state.loss_scale,
                           {"inputs": micro, "targets": micro}, argnums=0)


def _state_bytes(exp: Experiment) -> Dict[str, int]:
    """Per-device params, gradient, optimizer-state, compute-copy and top-k residual bytes."""
    state, state_sh = exp.abstract_state, exp.state_shardings
    params = _per_device_bytes(state.params, state_sh.params)
    copy = state.compute_params
    return {"params_bytes": params,
            "grads_bytes": params,  # one master-dtype value per parameter, laid out like it
            "opt_state_bytes": _per_device_bytes(state.opt_state, state_sh.opt_state),
            "compute_copy_bytes": 0 if copy is None else _per_device_bytes(copy, state_sh.compute_params),
            "comm_state_bytes": _per_device_bytes(state.comm_state, state_sh.comm_state)}


def _lower_step(exp: Experiment, global_batch: int):
    """The experiment's jitted train step lowered with abstract inputs (nothing allocated)."""
    return exp.train_step.lower(exp.abstract_state, exp.abstract_batch(global_batch))


def account_mode(config: ml_collections.ConfigDict, mode: str, num_devices: int = 8, *,
                 breakdown: int = 0, mesh: Optional[Mesh] = None) -> dict:
    """Accounts one precision mode of ``config``'s model, per device.

    Builds the :class:`~jaxmp.train.experiment.Experiment` of ``mode_config(config,
    mode)`` (abstract: nothing is allocated); lists the loss's residuals at the
    per-device micro-batch (``train.batch_size / train.grad_accum_steps / num_devices``
    sequences of ``data.seq_len`` tokens); lowers the experiment's own jitted train step
    over a ``"data"`` mesh of ``num_devices`` with abstract inputs, compiles it and
    reads its collectives (see the module docstring for every figure). When
    the default backend is an accelerator, XLA's ``memory_analysis()`` of the step
    compiled for it is added: on the mesh itself if it has the devices, else on one
    device with that device's share of the batch.

    Args:
      config: a trainer config (e.g. ``configs/tiny_moe.py``'s ``get_config()``).
      mode: a key of :data:`MODES`.
      num_devices: devices of the mesh (``num_devices / parallel.expert`` along
        ``"data"``).
      breakdown: also return the top ``breakdown`` residual groups (0 = none).
      mesh: the mesh to lower over (default :func:`data_mesh` ``(num_devices,
        parallel.expert)``).

    Returns:
      ``{"policy": str, "strategy": str, "expert": int, "params_bytes": int,
      "grads_bytes": int, "opt_state_bytes": int, "compute_copy_bytes": int,
      "comm_state_bytes": int, "activation_bytes": int, "grad_allreduce_bytes": int,
      "collective_bytes": {op: {dtype: int}}, "total_bytes": int}`` plus ``"xla_memory"`` (the ``memory_analysis()`` byte counts,
      None on CPU), ``"hlo_source"`` (which HLO the collectives were read from),
      ``"attention_path"`` (what ``model.attention`` resolved to on this machine, e.g.
      ``"xla"`` for ``"auto"`` on CPU) and, if asked, ``"breakdown"`` (rows of
      :func:`residual_breakdown`).

    Raises:
      ValueError: an unknown mode, a config the trainer rejects (e.g. a micro-batch the
        devices do not divide), or too few devices.
    """
    cfg = mode_config(config, mode)
    mesh = data_mesh(num_devices, int(cfg.parallel.expert)) if mesh is None else mesh
    exp = Experiment.create(cfg, mesh=mesh)
    n, t = exp.num_devices, exp.config.train
    state = exp.abstract_state

    lowered = _lower_step(exp, t.batch_size)
    on_cpu = mesh.devices.flat[0].platform == "cpu"
    hlo, compiled, hlo_source = _partitioned_hlo(lowered, on_cpu)
    settings = exp.settings.comm
    # A device's gradient as it enters the reduction has the layout of ``dp``'s
    # parameters (whole, but for the expert-parallel split): every strategy reduces that.
    grad_sh = sharding.state_shardings(state.params, mesh, sharding.layout("dp", exp.layout.expert).on(mesh).compute_rules)
    dense = []
    variables = jax.tree.leaves(state.params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    for var, s in zip(variables, jax.tree.leaves(grad_sh)):
        shape = tuple(var.get_value().shape)
        dense.append(int(np.prod(s.shard_shape(shape), dtype=np.int64)))
        if tuple(var.get_metadata().get("out_sharding") or ())[:1] == ("layers",):
            dense.append(dense[-1] // shape[0])  # scanned: one layer's slice, reduced in the loop
    sparse = ([comm.topk_count(d, settings["topk_ratio"]) for d in dense]
              if settings["grad_compression"] == "topk" else [])

    residuals = _step_residuals(exp)
    collectives = hlo_collectives(hlo)
    out = {"policy": cfg.precision.policy, "strategy": exp.layout.strategy, "expert": exp.layout.expert,
           **_state_bytes(exp),
           "activation_bytes": sum(r.nbytes for r in residuals if r.kind == "computed"),
           "grad_allreduce_bytes": gradient_collective_bytes(collectives, dense, sparse),
           "collective_bytes": collective_bytes(collectives)}
    out["total_bytes"] = sum(out[k] for k in MEMORY_KEYS)
    out["xla_memory"] = None
    if jax.default_backend() != "cpu":
        if not on_cpu:
            out["xla_memory"] = _memory_analysis(compiled)
        elif exp.layout.strategy == "dp" and exp.layout.expert == 1:
            # One device with its share of the batch: the same per-device program.
            one = Experiment.create(cfg, mesh=data_mesh(1))
            out["xla_memory"] = _memory_analysis(_lower_step(one, t.batch_size // n).compile())
    out["hlo_source"] = hlo_source
    m = exp.model_config
    out["attention_path"] = resolve_attention(m.attention, exp.rules.resolve("blocks/0/attn").compute_dtype,
                                              m.head_dim)
    if breakdown:
        out["breakdown"] = residual_breakdown(residuals, breakdown)
    return out


# ----------------------------------------------------------------------------- all modes


def accounting_report(config: ml_collections.ConfigDict, modes: Optional[Sequence[str]] = None,
                      num_devices: int = 8, *, breakdown: int = 0) -> dict:
    """:func:`account_mode` for each mode, as the JSON of ``python -m jaxmp.report --config``.

    Args:
      config: a trainer config.
      modes: keys of :data:`MODES` (default: all, in table order).
      num_devices: data-parallel devices.
      breakdown: top residual groups to keep per mode (0 = none).

    Returns:
      ``{"model": {"params": int, "active_params": int}, "setup": {...}, "modes":
      {NAME: {"policy", "strategy", "expert", "params_bytes", "grads_bytes",
      "opt_state_bytes", "compute_copy_bytes", "comm_state_bytes", "activation_bytes",
      "grad_allreduce_bytes", "collective_bytes", "total_bytes"}},
      "details": {NAME: {"xla_memory", "hlo_source", "attention_path"[, "breakdown"]}}}``,
      bytes per device.

    Raises:
      ValueError: an unknown mode (before any work), or as :func:`account_mode`.
    """
    modes = list(MODES) if modes is None else list(modes)
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown precision mode {mode!r}; allowed: {', '.join(MODES)}")
    config = complete_config(config)
    mesh = data_mesh(num_devices, int(config.parallel.expert))
    total, active = Experiment.create(config, mesh=mesh).param_counts
    t = config.train
    out = {
        "model": {"params": int(total), "active_params": int(active)},
        "setup": {"devices": num_devices, "platform": mesh.devices.flat[0].platform,
                  "strategy": str(config.parallel.strategy), "expert": int(config.parallel.expert),
                  "default_backend": jax.default_backend(),
                  "attention": str(config.model.attention), "remat": str(config.model.remat),
                  "scan_layers": bool(config.model.scan_layers),
                  "micro_batch_per_device": t.batch_size // t.grad_accum_steps // num_devices,
                  "grad_accum_steps": int(t.grad_accum_steps), "seq_len": int(config.data.seq_len)},
        "modes": {},
        "details": {},
    }
    for mode in modes:
        row = account_mode(config, mode, num_devices, breakdown=breakdown, mesh=mesh)
        out["details"][mode] = {k: row.pop(k) for k in ("xla_memory", "hlo_source", "attention_path",
                                                        "breakdown") if k in row}
        out["modes"][mode] = row
    return out


# ----------------------------------------------------------------------------- attention x remat

SETTING_ATTENTIONS = ("reference", "xla", "cudnn")


def _attention_residual_bytes(exp: Experiment) -> int:
    """Bytes one attention sublayer (``blocks/0/attn``: projections, RoPE, core) keeps
    for its backward pass at the per-device micro-batch, differentiated in its weights
    and its input, outside any block-level checkpoint."""

    cfg, rules = exp.model_config, exp.rules
    module = nnx.eval_shape(lambda: Attention(
        cfg.d_model, cfg.num_heads, cfg.rope_theta, path="blocks/0/attn", rules=rules,
        rngs=nnx.Rngs(0), implementation=cfg.attention, recompute_core=cfg.remat == "attention"))
    graphdef, params = nnx.split(module, nnx.Param)
    micro = _micro_batch(exp)
    # The residual stream's dtype: the embedding's output dtype.
    x = jax.ShapeDtypeStruct(micro.shape + (cfg.d_model,), rules.resolve("embed").output_dtype)
    res = saved_residuals(lambda p, x: nnx.merge(graphdef, p)(x).astype(jnp.float32).sum(),
                          params, x, argnums=(0, 1))
    return sum(r.nbytes for r in res if r.kind == "computed")


def _cost_flops(analysis) -> Optional[float]:
    if isinstance(analysis, (list, tuple)):  # older jax: one dict per computation
        analysis = analysis[0] if analysis else None
    return None if not analysis or "flops" not in analysis else float(analysis["flops"])


def _step_flops(config: ml_collections.ConfigDict) -> Tuple[Optional[float], Optional[float]]:
    """``(lowered, compiled)`` cost-analysis FLOPs of the train step on one device at the
    per-device micro-batch. ``lowered`` is the program JAX hands XLA (recomputation
    included); ``compiled`` is XLA's optimized program, None on CPU: XLA:CPU expands the
    optimization barriers that keep ``jax.checkpoint`` 's recomputation apart before it
    eliminates common subexpressions, so it merges the recomputation back into the
    forward pass (measured: a checkpointed attention core compiles to the un-checkpointed
    program), which XLA:GPU, whose barriers hold until scheduling, does not."""
    exp = Experiment.create(config, mesh=data_mesh(1))
    lowered = _lower_step(exp, config.train.batch_size)
    if exp.mesh.devices.flat[0].platform == "cpu":
        return _cost_flops(lowered.cost_analysis()), None
    return _cost_flops(lowered.cost_analysis()), _cost_flops(lowered.compile().cost_analysis())


def activation_settings(config: ml_collections.ConfigDict, mode: str = "mixed_bf16",
                        num_devices: int = 8, *,
                        attentions: Sequence[str] = SETTING_ATTENTIONS,
                        remats: Sequence[str] = REMAT_POLICIES, flops: bool = False,
                        flops_attention: str = "reference") -> dict:
    """Per-device memory of ``config``'s model under each attention path x remat setting.

    For each pair, the experiment of ``mode_config(config, mode)`` with
    ``model.attention`` and ``model.remat`` set is built abstractly and the train
    step's loss is traced as in :func:`account_mode` (``activation_bytes``: every
    residual the forward keeps; ``total_bytes``: plus params, gradients, optimizer state
    and top-k residual); ``attention_bytes_per_layer`` is what one attention sublayer
    keeps (projections, RoPE and core, its block-level checkpoint aside). Where cuDNN
    is absent (CPU), the ``"cudnn"`` rows are traced with
    :func:`~jaxmp.models.attention.trace_cudnn_without_gpu`: the residuals of JAX's
    own cuDNN forward/backward rule, not run.

    With ``flops``, each remat setting's train step is also lowered (and, off CPU,
    compiled) on one device at the per-device micro-batch, with
    ``attention=flops_attention`` and ``scan_layers=False`` (XLA's cost analysis counts
    a loop body once and a custom call, such as the cuDNN kernel, as 0 FLOPs), and its
    cost-analysis FLOPs are reported with ``recompute_flops`` = FLOPs minus those of
    ``remat="none"``: what the setting recomputes, per device and step. The figure is
    the lowered program's (what JAX asks XLA to run); the compiled program's is added
    off CPU only (see :func:`_step_flops` for why XLA:CPU's is not the recompute).

    Args:
      config: a trainer config.
      mode: a key of :data:`MODES`.
      num_devices: data-parallel devices (the per-device micro-batch is
        ``batch_size / grad_accum_steps / num_devices``).
      attentions: paths among :data:`SETTING_ATTENTIONS`.
      remats: settings among :data:`~jaxmp.models.transformer.REMAT_POLICIES`.
      flops: also lower (off CPU: compile) for the FLOPs (slow for deep models: one
        unscanned lowering per remat setting).
      flops_attention: the path the FLOPs are compiled with (``"reference"`` or
        ``"xla"``: paths XLA counts).

    Returns:
      ``{"mode", "setup": {...}, "rows": [{"attention", "remat", "activation_bytes",
      "attention_bytes_per_layer", "total_bytes", "traced_only"}, ...], "flops": [{"remat",
      "attention", "step_flops", "recompute_flops", "compiled_step_flops"}, ...]}``
      (``flops`` empty unless asked; ``compiled_step_flops`` None on CPU), bytes per
      device.

    Raises:
      ValueError: an unknown mode, path or remat setting (before any work), or a config
        the trainer rejects.
    """
    if mode not in MODES:
        raise ValueError(f"unknown precision mode {mode!r}; allowed: {', '.join(MODES)}")
    for a in attentions:
        if a not in SETTING_ATTENTIONS:
            raise ValueError(f"attention path {a!r}; allowed: {', '.join(SETTING_ATTENTIONS)}")
    for r in remats:
        if r not in REMAT_POLICIES:
            raise ValueError(f"remat setting {r!r}; allowed: {', '.join(REMAT_POLICIES)}")
    if flops_attention not in ("reference", "xla"):
        raise ValueError(f"flops_attention={flops_attention!r}; allowed: reference, xla")
    mesh = data_mesh(num_devices)
    base = mode_config(config, mode)
    head_dim = base.model.d_model // base.model.num_heads
    rows, flop_rows = [], []
    for attention in attentions:
        for remat in remats:
            cfg = base.copy_and_resolve_references()
            cfg.model.attention, cfg.model.remat = attention, remat
            trace_only = attention == "cudnn" and not cudnn_support(jnp.bfloat16, head_dim)[0]
            with trace_cudnn_without_gpu() if trace_only else contextlib.nullcontext():
                exp = Experiment.create(cfg, mesh=mesh)
                activations = sum(r.nbytes for r in _step_residuals(exp) if r.kind == "computed")
                attention_bytes = _attention_residual_bytes(exp)
            state = _state_bytes(exp)
            rows.append({"attention": attention, "remat": remat, "activation_bytes": activations,
                         "attention_bytes_per_layer": attention_bytes,
                         "total_bytes": sum(state.values()) + activations, "traced_only": trace_only})
    if flops:
        t = base.train
        none_flops = None
        for remat in ["none"] + [r for r in remats if r != "none"]:
            cfg = base.copy_and_resolve_references()
            cfg.model.update(dict(attention=flops_attention, remat=remat, scan_layers=False))
            cfg.train.batch_size = t.batch_size // num_devices
            value, compiled = _step_flops(cfg)
            none_flops = value if remat == "none" else none_flops
            flop_rows.append({"remat": remat, "attention": flops_attention, "step_flops": value,
                              "recompute_flops": value - none_flops,
                              "compiled_step_flops": compiled})
    t = base.train
    return {"mode": mode, "rows": rows, "flops": flop_rows,
            "setup": {"devices": num_devices, "micro_batch_per_device":
                      t.batch_size // t.grad_accum_steps // num_devices,
                      "seq_len": int(base.data.seq_len), "num_layers": int(base.model.num_layers),
                      "scan_layers": bool(base.model.scan_layers),
                      "state_bytes": sum(_state_bytes(exp).values())}}


def format_settings(report: dict) -> str:
    """Formats :func:`activation_settings` for the terminal (GB = 1e9 bytes)."""
    s = report["setup"]
    lines = [f"Saved activations per attention path x remat setting, mode {report['mode']}: "
             f"{s['devices']} devices, micro-batch {s['micro_batch_per_device']} x {s['seq_len']} "
             f"tokens, {s['num_layers']} layers; state (params + grads + optimizer) "
             f"{s['state_bytes'] / 1e9:,.3f} GB per device",
             f"  {'attention':10s}{'remat':15s}{'activations GB':>16s}{'attention/layer GB':>20s}"
             f"{'total GB':>11s}"]
    for r in report["rows"]:
        note = "  (traced, not run: no cuDNN here)" if r["traced_only"] else ""
        lines.append(f"  {r['attention']:10s}{r['remat']:15s}{r['activation_bytes'] / 1e9:16,.3f}"
                     f"{r['attention_bytes_per_layer'] / 1e9:20,.4f}{r['total_bytes'] / 1e9:11,.3f}{note}")
    if report["flops"]:
        base = report["flops"][0]["step_flops"]
        lines += ["", f"Train-step FLOPs per device of the lowered program, recomputation included "
                      f"(attention {report['flops'][0]['attention']}, layers unscanned, one device at "
                      f"the micro-batch):"]
        for f in report["flops"]:
            share = f"{f['recompute_flops'] / base:+.1%}" if base else "-"
            compiled = (f"  compiled {f['compiled_step_flops']:.4g}" if f["compiled_step_flops"]
                        else "")
            lines.append(f"  {f['remat']:15s}{f['step_flops']:14.4g} FLOPs  recompute "
                         f"{f['recompute_flops']:12.4g} ({share}){compiled}")
    lines.append("activations: residuals the loss's forward keeps for the backward pass (as in the "
                 "mode tables); the working set of one block's recomputation is not included.")
    return "\n".join(lines)


def _mib(x: int) -> str:
    return f"{x / 2**20:,.3f}"


def format_accounting(report: dict, title: str = "") -> str:
    """Formats :func:`accounting_report` for the terminal: one table per mode."""
    s, params = report["setup"], report["model"]["params"]
    lines = [f"Per-device memory and gradient traffic{': ' + title if title else ''}",
             f"  model: {params:,} parameters ({report['model']['active_params']:,} active per "
             f"token); {s['devices']} devices, parallel.strategy={s.get('strategy', 'dp')}, "
             f"parallel.expert={s.get('expert', 1)}; per-device micro-batch "
             f"{s['micro_batch_per_device']} x {s['seq_len']} tokens"
             f"{', ' + str(s['grad_accum_steps']) + ' micro-batches per step' if s['grad_accum_steps'] > 1 else ''}",
             f"  model.attention={s.get('attention')}, model.remat={s.get('remat')}, "
             f"model.scan_layers={s.get('scan_layers')}",
             "  bytes per device (MiB = 2**20 bytes); 'vs fp32' divides by the fp32 mode's figure"]
    base = report["modes"].get("fp32")
    rows = (("params", "params_bytes", True), ("grads", "grads_bytes", True),
            ("optimizer state", "opt_state_bytes", True), ("compute copy", "compute_copy_bytes", True),
            ("top-k residual", "comm_state_bytes", True),
            ("activations", "activation_bytes", False), ("total memory", "total_bytes", False),
            ("grad reduction", "grad_allreduce_bytes", True))
    for mode, r in report["modes"].items():
        o = MODES[mode]
        lines += ["", f"mode {mode}: policy \"{r['policy']}\"; loss scale {o['precision.loss_scale']}; "
                      f"Adam moments {o['optim.mu_dtype'] or 'in the master dtype'}; grad_reduce_dtype "
                      f"{o['precision.grad_reduce_dtype']}; grad_compression {o['precision.grad_compression']}"
                  + (f" (ratio {o['precision.topk_ratio']:g})" if o["precision.grad_compression"] == "topk" else ""),
            f"  {'':18s}{'bytes':>19s}{'MiB':>14s}{'B/param':>10s}{'vs fp32':>9s}"]
        for label, key, per_param in rows:
            v = r[key]
            ratio = f"{v / base[key]:9.3f}" if base and base[key] else f"{'-':>9s}"
            bpp = f"{v / params:10.3f}" if per_param else f"{'-':>10s}"
            note = "  (traffic per step, not memory)" if key == "grad_allreduce_bytes" else ""
            lines.append(f"  {label:18s}{v:19,d}{_mib(v):>14s}{bpp}{ratio}{note}")
        for op, by_dtype in sorted(r.get("collective_bytes", {}).items()):
            for dtype, v in sorted(by_dtype.items()):
                lines.append(f"  {op + ' ' + dtype:18s}{v:19,d}{_mib(v):>14s}{v / params:10.3f}"
                             f"{'-':>9s}  (per step, all collectives)")
        d = report.get("details", {}).get(mode, {})
        if d.get("attention_path"):
            lines.append(f"  attention path on this machine: {d['attention_path']}"
                         + (" (model.attention=auto: cuDNN's fused kernel on an NVIDIA GPU for a 16-bit "
                            "compute dtype; compare "
                            "--settings)" if s.get("attention") == "auto" and d["attention_path"] != "cudnn"
                            else ""))
        if d.get("xla_memory"):
            m = d["xla_memory"]
            lines.append(f"  XLA memory_analysis ({s['default_backend']}): temp "
                         f"{_mib(m.get('temp_size_in_bytes', 0))} MiB (activations and scratch), "
                         f"arguments {_mib(m.get('argument_size_in_bytes', 0))} MiB, outputs "
                         f"{_mib(m.get('output_size_in_bytes', 0))} MiB")
        for b in d.get("breakdown", []):
            lines.append(f"    {b['bytes']:>19,d} B {b['count']:4d} x {b['dtype']:9s} {b['source']}")
    lines += ["", "activations: residuals the loss's forward pass saves for the backward pass, "
                  "counted from the traced jax.vjp (arguments, literals and constants excluded)."]
    if s["default_backend"] == "cpu":
        lines.append("XLA memory_analysis skipped on CPU: XLA:CPU computes bfloat16 in float32 "
                     "internally, so its buffer sizes would hide the saving.")
    lines.append("grad reduction: gradient collectives (all-reduce; reduce-scatter under zero1/fsdp) in the "
                 "HLO after SPMD partitioning (whole buffers: all-reduce and reduce-scatter operands, "
                 "all-gather results).")
    lines.append("op dtype rows: every collective of the step by kind and element type (operands of "
                 "all-reduce/reduce-scatter, results of all-gather/all-to-all); a ring moves (N-1)/N of "
                 "each buffer per device.")
    return "\n".join(lines)
