"""Training cost model: FLOPs, GPU-hours, days and energy from parameter and token counts.

The model is the usual one (Kaplan et al. 2020, "Scaling Laws for Neural Language
Models", section 2.1 and Table 1; Chowdhery et al. 2022, "PaLM", appendix B):

* training FLOPs per token ~ ``6 * N_active`` (2 for the forward matmuls, 4 for the
  backward) plus ``6 * n_layers * seq_len * d_model`` for causal self-attention;
* wall time = FLOPs / (num_gpus * peak FLOP/s * MFU), where MFU ("model FLOPs
  utilization", PaLM appendix B) is the fraction of the dense peak that the model
  FLOPs achieve;
* energy = GPU-hours * watts per GPU (the GPUs only: no host, network or cooling).

:data:`DEEPSEEK_V3` holds the published figures of DeepSeek-V3 (technical report,
arXiv:2412.19437, Table 1 and section 4.2) so that :func:`implied_mfu` can solve for the
MFU those figures imply.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Mapping, Optional, Sequence

from jaxmp._checks import Kind, Real, check, check_int, check_real

__all__ = [
    "DTYPES",
    "Hardware",
    "HARDWARE",
    "CostEstimate",
    "PublishedRun",
    "DEEPSEEK_V3",
    "training_flops",
    "estimate",
    "implied_mfu",
    "peak_tflops",
]

# fp32 is the non-tensor-core (CUDA core) rate; the others are dense tensor-core rates.
DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")

_HOPPER_SOURCE = (
    "NVIDIA {name} datasheet: the tensor-core figures there are 'with sparsity'; dense = "
    "half (TF32 494.7, BF16/FP16 989.4, FP8 1978.9 TFLOP/s); FP32 66.9 TFLOP/s")


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator's dense peak throughput, memory and power.

    Attributes:
      name: the marketing name, also the key in :data:`HARDWARE`.
      peak_tflops: dense (no 2:4 sparsity) peak in TFLOP/s for each name in
        :data:`DTYPES`; ``None`` where the chip has no such mode (FP8 on A100).
      memory_gb: HBM capacity in GB (1e9 bytes).
      tdp_watts: board power limit in watts.
      source: where the numbers come from.
    """

    name: str
    peak_tflops: Mapping[str, Optional[float]]
    memory_gb: float
    tdp_watts: float
    source: str

    def __post_init__(self):
        if set(self.peak_tflops) != set(DTYPES):
            raise ValueError(f"{self.name}: peak_tflops must have exactly the keys {DTYPES}, "
                             f"got {sorted(self.peak_tflops)}")
        object.__setattr__(self, "peak_tflops", types.MappingProxyType(dict(self.peak_tflops)))


_HOPPER = {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9}

HARDWARE: Mapping[str, Hardware] = types.MappingProxyType({
    # H800 is the export variant of H100 SXM: same tensor cores, NVLink cut to 400 GB/s
    # and FP64 cut; the BF16/FP8 rates DeepSeek-V3 trained with are the H100 SXM ones.
    "H800": Hardware("H800", _HOPPER, 80.0, 700.0,
                     _HOPPER_SOURCE.format(name="H800 SXM5 (= H100 SXM tensor throughput)")),
    "H100": Hardware("H100", _HOPPER, 80.0, 700.0, _HOPPER_SOURCE.format(name="H100 SXM5")),
    # H200 is the H100 SXM die with 141 GB of HBM3e: same compute.
    "H200": Hardware("H200", _HOPPER, 141.0, 700.0,
                     _HOPPER_SOURCE.format(name="H200 SXM (same compute as H100 SXM)")),
    "A100": Hardware(
        "A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0, "fp8": None},
        80.0, 400.0,
        "NVIDIA A100 80GB SXM datasheet: FP32 19.5, TF32 156, BF16/FP16 312 TFLOP/s dense "
        "(312/624 with sparsity); Ampere tensor cores have no FP8"),
})


@dataclasses.dataclass(frozen=True)
class CostEstimate:
    """The result of :func:`estimate`: the inputs echoed and the derived costs.

    Attributes:
      total_params, active_params: parameter counts (active = used per token).
      tokens: training tokens.
      hardware, dtype: keys of :data:`HARDWARE` and :data:`DTYPES`.
      peak_tflops: the dense peak used, TFLOP/s per GPU.
      mfu: model FLOPs utilization in (0, 1].
      num_gpus: GPUs training together.
      watts_per_gpu: average power per GPU in watts.
      num_layers, seq_len, d_model: the attention-term inputs (0 when not used).
      flops: training FLOPs.
      gpu_hours: GPU-hours.
      days: wall-clock days on ``num_gpus`` GPUs.
      tokens_per_s: cluster throughput in tokens/s.
      energy_kwh, energy_mwh: GPU energy in kWh and MWh.
    """

    total_params: float
    active_params: float
    tokens: float
    hardware: str
    dtype: str
    peak_tflops: float
    mfu: float
    num_gpus: int
    watts_per_gpu: float
    num_layers: int
    seq_len: int
    d_model: int
    flops: float
    gpu_hours: float
    days: float
    tokens_per_s: float
    energy_kwh: float
    energy_mwh: float

    def as_dict(self) -> dict:
        """Returns the fields as a plain dict (for JSON)."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class PublishedRun:
    """A training run's published figures.

    Attributes:
      name: the model.
      total_params, active_params: parameter counts.
      tokens: pre-training tokens.
      hardware: key of :data:`HARDWARE`.
      num_gpus: GPUs in the cluster.
      num_layers, d_model, seq_len: the attention-term inputs of pre-training.
      gpu_hours: GPU-hours per stage, including ``"total"``.
      source: where the figures are printed.
    """

    name: str
    total_params: float
    active_params: float
    tokens: float
    hardware: str
    num_gpus: int
    num_layers: int
    d_model: int
    seq_len: int
    gpu_hours: Mapping[str, float]
    source: str


DEEPSEEK_V3 = PublishedRun(
    name="DeepSeek-V3",
    total_params=671e9,
    active_params=37e9,
    tokens=14.8e12,
    hardware="H800",
    num_gpus=2048,
    num_layers=61,
    d_model=7168,
    seq_len=4096,
    gpu_hours=types.MappingProxyType({
        "pre-training": 2664e3, "context extension": 119e3, "post-training": 5e3,
        "total": 2788e3}),
    source="DeepSeek-V3 Technical Report (arXiv:2412.19437), Table 1 (GPU-hours), "
           "sections 3.1 (2048 H800), 4.2 (61 layers, d_model 7168, 14.8T tokens, "
           "4K sequences)",
)


def _check_positive(name: str, value, integer: bool = False) -> None:
    check(name, value, Real(0, lo_open=True, text="a positive finite number"))
    if integer:
        check(name, value, Kind(lambda v: v == int(v), "a positive integer"))


def peak_tflops(hardware: str, dtype: str) -> float:
    """Looks up a dense peak.

    Args:
      hardware: a key of :data:`HARDWARE` (case-insensitive).
      dtype: a name in :data:`DTYPES` (case-insensitive).

    Returns:
      The dense peak in TFLOP/s per GPU.

    Raises:
      ValueError: unknown hardware or dtype, or the chip has no such mode; the message
        names the bad value and the allowed ones.
    """
    hw_key = {k.lower(): k for k in HARDWARE}.get(str(hardware).lower())
    if hw_key is None:
        raise ValueError(f"unknown hardware {hardware!r}; allowed: {', '.join(HARDWARE)}")
    key = str(dtype).lower()
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
    peak = HARDWARE[hw_key].peak_tflops[key]
    if peak is None:
        supported = [d for d, p in HARDWARE[hw_key].peak_tflops.items() if p is not None]
        raise ValueError(f"{hw_key} has no {key} mode; supported on {hw_key}: "
                         f"{', '.join(supported)}")
    return peak


def training_flops(active_params: float, tokens: float, *, num_layers: int = 0,
                   seq_len: int = 0, d_model: int = 0, windows: Sequence[int] = ()) -> float:
    """Training FLOPs of a decoder-only transformer.

    ``tokens * (6 * active_params + 6 * num_layers * seq_len * d_model)``.
    The first term is Kaplan et al. 2020, section 2.1 (forward 2N, backward 4N FLOPs
    per token). The second is causal self-attention: PaLM appendix B counts
    ``12 * L * H * Q * T`` per token for the ``QK^T`` and ``AV`` matmuls with
    ``H * Q = d_model``; a causal mask halves it, which equals Kaplan's Table 1
    (``2 * n_layer * n_ctx * d_attn`` forward, times 3 for training). ``d_model`` stands
    for the attention width ``heads * head_dim``; where that differs (DeepSeek-V3's MLA
    attends with 128 heads of 192 QK / 128 V dims), pass that width instead.

    A layer with a sliding window of ``W < seq_len`` tokens attends to ``min(i + 1, W)``
    keys at position ``i``: on average ``W - W**2 / (2 T)`` where full causal attention
    counts ``T / 2`` (the two agree at ``W = T``), so its term is
    ``12 * d_model * (W - W**2 / (2 T))`` per token instead of ``6 * T * d_model``. A
    linear-attention layer (Gated DeltaNet) has no such term: its state updates,
    ``O(d_k d_v)`` per token and head, are not counted (the figure is a lower bound).

    Args:
      active_params: parameters used per token (for a MoE, the active ones, not the total).
      tokens: training tokens.
      num_layers, seq_len, d_model: give all three for the attention term, or none.
      windows: each layer's sliding window in tokens, 0 for full attention
        (:meth:`jaxmp.models.ModelConfig.attention_window`), None for a linear-attention
        layer; empty: every layer full.

    Returns:
      Training FLOPs (float).

    Raises:
      ValueError: non-positive counts, negative attention inputs, only some of the
        three attention inputs given, or ``windows`` not one int >= 0 per layer.
    """
    _check_positive("active_params", active_params)
    _check_positive("tokens", tokens)
    attn = {"num_layers": num_layers, "seq_len": seq_len, "d_model": d_model}
    for name, value in attn.items():
        check_int(name, value, 0)
    given = [name for name, value in attn.items() if value > 0]
    if given and len(given) != 3:
        raise ValueError(f"the attention term needs num_layers, seq_len and d_model together; "
                         f"got only {', '.join(given)}")
    windows = list(windows)
    if windows and (len(windows) != num_layers or
                    not all(w is None or (isinstance(w, int) and not isinstance(w, bool)
                                          and w >= 0) for w in windows)):
        raise ValueError(f"windows must give one int >= 0 (or None) per layer ({num_layers}), "
                         f"got {len(windows)} entries")
    t = float(seq_len)
    context = sum(0.0 if w is None else w - w * w / (2 * t) if 0 < w < t else t / 2
                  for w in windows) if windows \
        else float(num_layers) * t / 2  # keys attended per token, summed over the layers
    return float(tokens) * (6.0 * float(active_params) + 12.0 * context * float(d_model))


def estimate(total_params: float, active_params: float, tokens: float, *,
             hardware: str = "H800", dtype: str = "bf16", mfu: float = 0.4,
             num_gpus: int = 2048, watts_per_gpu: Optional[float] = None,
             num_layers: int = 0, seq_len: int = 0, d_model: int = 0) -> CostEstimate:
    """Estimates the compute, time and energy of a training run.

    ``gpu_hours = flops / (peak_tflops * 1e12 * mfu) / 3600``;
    ``days = gpu_hours / num_gpus / 24``; ``energy_kwh = gpu_hours * watts_per_gpu / 1e3``.
    FLOPs from :func:`training_flops`; MFU as in PaLM appendix B.

    Args:
      total_params: all parameters (for a MoE, every expert); must be >= active_params.
      active_params: parameters used per token.
      tokens: training tokens.
      hardware: a key of :data:`HARDWARE`.
      dtype: the matmul dtype whose dense peak the MFU refers to (:data:`DTYPES`).
      mfu: model FLOPs utilization, in (0, 1].
      num_gpus: GPUs training together (positive int).
      watts_per_gpu: average power per GPU in watts; default: the chip's TDP.
      num_layers, seq_len, d_model: the attention term of :func:`training_flops`.

    Returns:
      A :class:`CostEstimate`.

    Raises:
      ValueError: ``mfu`` outside (0, 1]; unknown hardware or dtype; a dtype the chip
        lacks (fp8 on A100); non-positive counts; active_params > total_params.
    """
    _check_positive("total_params", total_params)
    _check_positive("active_params", active_params)
    if active_params > total_params:
        raise ValueError(f"active_params={active_params!r} exceeds total_params={total_params!r}")
    _check_positive("num_gpus", num_gpus, integer=True)
    check_real("mfu", mfu, 0, 1, lo_open=True)
    peak = peak_tflops(hardware, dtype)
    hw = next(h for h in HARDWARE.values() if h.name.lower() == str(hardware).lower())
    watts = hw.tdp_watts if watts_per_gpu is None else watts_per_gpu
    _check_positive("watts_per_gpu", watts)
    flops = training_flops(active_params, tokens, num_layers=num_layers, seq_len=seq_len,
                           d_model=d_model)
    gpu_seconds = flops / (peak * 1e12 * mfu)
    gpu_hours = gpu_seconds / 3600.0
    wall_seconds = gpu_seconds / num_gpus
    energy_kwh = gpu_hours * watts / 1e3
    return CostEstimate(
        total_params=float(total_params), active_params=float(active_params),
        tokens=float(tokens), hardware=hw.name, dtype=str(dtype).lower(), peak_tflops=peak,
        mfu=float(mfu), num_gpus=int(num_gpus), watts_per_gpu=float(watts),
        num_layers=int(num_layers), seq_len=int(seq_len), d_model=int(d_model), flops=flops,
        gpu_hours=gpu_hours, days=wall_seconds / 86400.0,
        tokens_per_s=float(tokens) / wall_seconds, energy_kwh=energy_kwh,
        energy_mwh=energy_kwh / 1e3)


def implied_mfu(flops: float, gpu_hours: float, *, hardware: str = "H800",
                dtype: str = "bf16") -> float:
    """Solves ``gpu_hours = flops / (peak * mfu) / 3600`` for the MFU.

    Args:
      flops: the run's model FLOPs (e.g. from :func:`training_flops`).
      gpu_hours: the GPU-hours it took.
      hardware, dtype: whose dense peak to measure against.

    Returns:
      The MFU as a fraction; a value above 1 means the hours are impossible at that peak.

    Raises:
      ValueError: non-positive inputs, unknown or unsupported hardware/dtype.
    """
    _check_positive("flops", flops)
    _check_positive("gpu_hours", gpu_hours)
    return flops / (gpu_hours * 3600.0 * peak_tflops(hardware, dtype) * 1e12)
