"""The trainer's step compiled by XLA's GPU compiler for a GPU that is not here.

With JAX's CUDA plugin installed (``pip install -e ".[gpu]"``) XLA compiles for an NVIDIA
target described by a ``GpuTargetConfigProto`` on a machine with no GPU, when JAX runs on
the CPU (``JAX_PLATFORMS=cpu``; otherwise the plugin's ``cuInit`` fails with error 303):
``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)``
gives the target's devices, which build an ordinary mesh, and
``Experiment.train_step.lower(...).compile()`` builds the very program ``train.py`` runs
there. :func:`gpu_report` (``python -m jaxmp.report --config C --target H200``) reads it:

* **memory per device**: XLA's ``memory_analysis()`` (arguments, outputs, aliasing,
  temporaries) and the largest buffers of its buffer assignment;
* **kernels**: cuDNN attention, FP8 and other GEMMs, Mosaic GPU and Triton kernels,
  fusions, copies, collectives (:func:`jaxmp.analysis.hlo.hlo_kernels`);
* **GEMM FLOPs** of the compiled program (loop trip counts included) against
  ``6 x active params x tokens`` (Kaplan et al. 2020, 2.1): a G-fold expansion of the
  routed experts or a recomputation shows as a ratio above 1;
* **collectives** by kind, dtype and bytes, from the GPU program;
* a **roofline bound**: each GEMM and attention kernel takes at least
  ``max(FLOPs / dense peak of its dtype, bytes / HBM bandwidth)``, every other kernel
  ``bytes / HBM bandwidth``, every collective its ring wire bytes over the per-GPU NVLink
  bandwidth; kernels run one after another and no collective overlaps compute. The sum
  is a lower bound on the step time and gives an upper bound on MFU.

What a deviceless compile cannot know (:data:`CAVEATS`): autotuning (GEMMs use XLA's
default configurations, and the choice between Triton and cuBLAS may differ on the
GPU), cuDNN's workspace, and the allocator's and NCCL's own buffers.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import importlib.resources
import os
import re
import tempfile
from typing import Dict, List, Optional, Tuple

import jax
import ml_collections
from jax.sharding import Mesh

from jaxmp import sharding, target as compile_target
from jaxmp._checks import check_int
from jaxmp.analysis import cost, hlo
from jaxmp.models.attention import resolve_attention
from jaxmp.train.config import complete_config
from jaxmp.train.experiment import Experiment

__all__ = ["GpuTarget", "TARGETS", "CAVEATS", "FIT_MARGIN", "format_bytes", "get_target",
           "plugin_problem",
           "target_mesh", "full_optimizations", "compile_step", "CompiledStep", "roofline",
           "step_memory", "gpu_report",
           "format_gpu_report"]

CAVEATS = (
    "no autotuning: GEMMs use XLA's default configurations, and Triton vs cuBLAS may be "
    "chosen otherwise on the GPU (gpu_suite.py dumps the GPU's autotune results: "
    "--autotune_results)",
    "cuDNN workspace is not counted",
    "the allocator's fragmentation and NCCL's buffers are not counted",
    "the roofline bound assumes every kernel at its peak and no overlap of communication "
    "with compute: a lower bound on the step time, not a prediction")

# The share of device memory a program may plan for: the rest is left for what a
# deviceless compile does not count (CAVEATS; XLA's own default client preallocates 75%
# and JAX's XLA_PYTHON_CLIENT_MEM_FRACTION defaults to it, but the BFC allocator can grow
# beyond it on demand: 0.9 is a margin, not a JAX default).
FIT_MARGIN = 0.9


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """An NVIDIA GPU to compile for.

    Attributes:
      name: e.g. ``"H200"``.
      proto: the ``GpuTargetConfigProto`` text XLA compiles for.
      hardware: its dense peak throughputs (:data:`jaxmp.analysis.cost.HARDWARE`).
      memory_bytes: device memory (the proto's ``device_memory_size``), bytes.
      hbm_bytes_per_s: HBM bandwidth (the proto's ``memory_bandwidth``), bytes/s.
      nvlink_bytes_per_s: NVLink bandwidth per GPU and direction, bytes/s.
      source: where the figures come from.
    """

    name: str
    proto: str
    hardware: cost.Hardware
    memory_bytes: int
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float
    source: str

    def peak_flops(self, dtype: str, highest: bool = False) -> float:
        """Dense peak FLOP/s for an HLO element type (``bf16``, ``f8e4m3fn``, ``f32``...):
        a float32 GEMM runs on TF32 tensor cores unless it asks for full precision."""
        key = ("fp8" if dtype.startswith("f8") else "bf16" if dtype == "bf16" else
               "fp16" if dtype == "f16" else "fp32" if highest or dtype == "f64" else "tf32")
        peak = self.hardware.peak_tflops[key]
        return 1e12 * (peak if peak else self.hardware.peak_tflops["bf16"])


def _proto_field(proto: str, name: str) -> Optional[float]:
    m = re.search(rf"\b{name}:\s*([\d.e+]+)", proto)
    return float(m.group(1)) if m else None


def _load(file: str) -> str:
    return importlib.resources.files("jaxmp.analysis").joinpath("targets", file).read_text()


# NVLink 4 (Hopper SXM): 900 GB/s per GPU in both directions together, 450 each way; the
# H800 export part: 400 GB/s (200 each way); NVLink 3 (A100 SXM): 600 GB/s (300).
# HBM: H100 SXM 3.35 TB/s, H200 4.8 TB/s, A100 80GB SXM 2.039 TB/s (NVIDIA datasheets).
_TARGETS = {
    "H100": ("h100_sxm.pbtxt", 450e9, "NVIDIA H100 SXM5 80GB datasheet (HBM3 3.35 TB/s, "
                                      "NVLink 900 GB/s)"),
    "H200": ("h200.pbtxt", 450e9, "NVIDIA H200 SXM datasheet (141 GB HBM3e, 4.8 TB/s, "
                                  "NVLink 900 GB/s)"),
    "H800": ("h800.pbtxt", 200e9, "NVIDIA H800 SXM5: the H100 SXM die with NVLink at 400 GB/s "
                                  "(DeepSeek-V3 technical report, section 3.2)"),
    "A100": ("a100_sxm_80gb.pbtxt", 300e9, "NVIDIA A100 80GB SXM datasheet (HBM2e 2.039 TB/s, "
                                           "NVLink 600 GB/s)"),
}
TARGETS: Tuple[str, ...] = tuple(_TARGETS)


def _target(name: str, proto: str, nvlink: float, source: str) -> GpuTarget:
    memory, bandwidth = (_proto_field(proto, "device_memory_size"),
                         _proto_field(proto, "memory_bandwidth"))
    if not memory or not bandwidth or "cuda_compute_capability" not in proto:
        raise ValueError(f"GPU target {name!r}: the proto must give gpu_device_info."
                         f"device_memory_size, memory_bandwidth and cuda_compute_capability")
    if "runtime_version" not in proto:  # without it FP8 dots are not rewritten to FP8 GEMMs
        raise ValueError(f"GPU target {name!r}: the proto has no runtime_version, without which "
                         f"XLA rewrites no FP8 dot into an FP8 GEMM; add e.g. "
                         f"'runtime_version {{ major: 12 minor: 9 }}'")
    major = int(_proto_field(proto, "major") or 0)
    hardware = cost.HARDWARE["A100" if major < 9 else name if name in cost.HARDWARE else "H100"]
    return GpuTarget(name, proto, hardware, int(memory), bandwidth, nvlink, source)


def get_target(name: str) -> GpuTarget:
    """A GPU target by name (:data:`TARGETS`, case-insensitive) or by the path of a
    ``GpuTargetConfigProto`` text file (``.pbtxt``; peaks are Hopper's for compute
    capability 9 and above, A100's below; NVLink 450 GB/s per direction).

    Raises:
      ValueError: an unknown name, an unreadable file, a proto without the fields the
        report needs, or (where XLA's GPU compiler is installed) one it cannot parse; a
        file's error names the file.
    """
    key = str(name).upper()
    if key in _TARGETS:
        file, nvlink, source = _TARGETS[key]
        return _target(key, _load(file), nvlink, source)
    if str(name).endswith(".pbtxt") or os.sep in str(name):
        try:
            with open(name) as f:
                proto = f.read()
        except OSError as e:
            raise ValueError(f"--target {name!r}: cannot read the target description: "
                             f"{e.strerror}") from None
        except UnicodeDecodeError:
            raise ValueError(f"--target {name!r}: not a GpuTargetConfigProto text file (not "
                             f"UTF-8 text)") from None
        try:
            target = _target(os.path.basename(name), proto, 450e9, f"user file {name}")
        except ValueError as e:
            raise ValueError(f"--target {name!r}: {e}") from None
        if plugin_problem() is None:  # XLA's own parse, where its GPU compiler is here
            from jax.experimental import topologies
            try:
                topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                             target_config=proto)
            except Exception as e:  # noqa: BLE001 - XLA's parse error, in one line
                raise ValueError(f"--target {name!r}: not a GpuTargetConfigProto text file "
                                 f"({' '.join(str(e).split())[:200]})") from None
        return target
    raise ValueError(f"--target {name!r}: allowed: {', '.join(TARGETS)}, or the path of a "
                     f"GpuTargetConfigProto .pbtxt file")


@functools.lru_cache(maxsize=None)
def plugin_problem() -> Optional[str]:
    """None when deviceless GPU compilation works here, else why not (one line). Asked once
    per process (it describes a GPU topology): the answer does not change."""
    try:
        import jax_plugins.xla_cuda12  # noqa: F401  (jax[cuda12]'s PJRT plugin)
    except ImportError:
        return ("JAX's CUDA plugin is not installed: pip install -e \".[gpu]\" "
                f"(jax[cuda12]=={jax.__version__})")
    if jax.default_backend() != "cpu":
        return None
    try:
        from jax.experimental import topologies
        topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                     target_config=_load("h200.pbtxt"))
    except Exception as e:  # noqa: BLE001 - the plugin's own error, reported in one line
        return f"the CUDA plugin cannot describe a GPU target here: {str(e).splitlines()[0]}"
    return None


def target_mesh(gpu: GpuTarget, num_devices: int, expert: int = 1) -> Mesh:
    """A ``("data", "expert")`` mesh of ``num_devices`` devices of ``gpu`` (one host).

    Raises:
      ValueError: ``num_devices`` < 1, ``expert`` not dividing it, or no plugin
        (:func:`plugin_problem`).
    """
    check_int("num_devices", num_devices, 1)
    problem = plugin_problem()
    if problem:
        raise ValueError(problem)
    from jax.experimental import topologies
    topo = topologies.get_topology_desc(platform="cuda", topology=f"1x1x{num_devices}",
                                        target_config=gpu.proto)
    return sharding.make_mesh(num_devices, expert=expert, devices=list(topo.devices))


@dataclasses.dataclass
class CompiledStep:
    """The trainer's step compiled for a GPU target.

    Attributes:
      experiment: the :class:`~jaxmp.train.experiment.Experiment` (on the target's mesh).
      compiled: ``jax.stages.Compiled``.
      hlo_text: the optimized GPU HLO (``compiled.as_text()``).
      buffers: ``[(bytes, instruction, shape)]`` of the buffer assignment, largest first.
    """

    experiment: Experiment
    compiled: object
    hlo_text: str
    buffers: List[Tuple[int, str, str]]


_VALUE = re.compile(r"^\s*value: <\d+ ([\w.\-]+)[^>]*> \(size=(\d+),offset=\d+\): (\S+)")


def _buffers(path: str) -> List[Tuple[int, str, str]]:
    seen: Dict[str, Tuple[int, str, str]] = {}
    with open(path) as f:
        for line in f:
            m = _VALUE.match(line)
            if m and (m.group(1) not in seen or int(m.group(2)) > seen[m.group(1)][0]):
                seen[m.group(1)] = (int(m.group(2)), m.group(1), m.group(3).split("{")[0])
    return sorted(seen.values(), key=lambda b: -b[0])


@contextlib.contextmanager
def full_optimizations():
    """XLA's full optimizations within the context, whatever ``jax_disable_most_optimizations``
    says outside (the test suite turns most off): a deviceless compile must build the
    program a GPU run gets (e.g. FP8 dots rewritten into FP8 GEMMs)."""
    old = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", old)


def compile_step(config: ml_collections.ConfigDict, gpu: GpuTarget, num_devices: int = 8,
                 autotune_results: Optional[str] = None) -> CompiledStep:
    """Compiles ``Experiment.create(config).train_step`` for ``num_devices`` x ``gpu``.

    ``model.attention="auto"`` resolves for the target (:mod:`jaxmp.target`): cuDNN's
    fused attention on an NVIDIA GPU for 16-bit compute. The compile runs XLA's full
    optimizations (whatever ``jax_disable_most_optimizations`` says elsewhere), and writes
    no entry to JAX's persistent compilation cache and reads none (its dump is part of
    the result).

    Args:
      config: a trainer config.
      gpu: from :func:`get_target`.
      num_devices: GPUs of one host (the mesh ``num_devices / parallel.expert`` x
        ``parallel.expert``).
      autotune_results: an XLA autotune results file from a real GPU of this kind
        (``benchmarks/gpu_suite.py`` writes one), loaded instead of default configs.

    Raises:
      ValueError: a bad config, too few devices for its layout, or no plugin.
    """
    config = complete_config(config)
    mesh = target_mesh(gpu, num_devices, int(config.parallel.expert))
    options = {"xla_dump_hlo_as_text": True, "xla_enable_dumping": True,
               "xla_dump_hlo_pass_re": "^$"}  # the final program and its buffer assignment only
    if autotune_results:
        if not os.path.isfile(autotune_results):
            raise ValueError(f"--autotune_results {autotune_results!r}: no such file")
        options["xla_gpu_load_autotune_results_from"] = os.path.abspath(autotune_results)
    min_time = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
    try:
        with compile_target.compiling_for(mesh), full_optimizations(), \
                tempfile.TemporaryDirectory() as tmp:
            exp = Experiment.create(config, mesh=mesh)
            lowered = exp.train_step.lower(exp.abstract_state, exp.abstract_batch())
            compiled = lowered.compile(compiler_options={"xla_dump_to": tmp, **options})
            found = sorted(glob.glob(os.path.join(tmp,
                                                  "*after_optimizations-buffer-assignment.txt")))
            buffers = _buffers(found[-1]) if found else []
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_time)
    return CompiledStep(exp, compiled, compiled.as_text(), buffers)


_WIRE = {"all-reduce": lambda n: 2 * (n - 1) / n, "reduce-scatter": lambda n: (n - 1) / n,
         "all-gather": lambda n: (n - 1) / n, "all-to-all": lambda n: (n - 1) / n,
         "ragged-all-to-all": lambda n: (n - 1) / n, "collective-permute": lambda n: 1.0}


def roofline(kernels: List[hlo.Kernel], collectives: List[hlo.Collective], gpu: GpuTarget,
             num_devices: int) -> dict:
    """A lower bound on one step's time on ``gpu``, per device (module docstring).

    Ring collectives move ``2 (N - 1) / N`` of an all-reduce's buffer per device and
    ``(N - 1) / N`` of a reduce-scatter's, all-gather's or all-to-all's (Patarasuk and
    Yuan 2009), N the devices of its group (all ``num_devices`` when the HLO states none).

    Returns:
      ``{"gemm_s", "attention_s", "memory_s", "collective_s", "bound_s"}`` in seconds
      and ``"gemm_flops"``, ``"attention_flops"`` per device and step.
    """
    gemm_s = attention_s = memory_s = collective_s = 0.0
    gemm_flops = attention_flops = 0.0
    for k in kernels:
        if k.kind == "collective":
            continue
        hbm = k.bytes / gpu.hbm_bytes_per_s
        if k.flops:
            t = max(k.flops / gpu.peak_flops(k.gemm_dtype, k.highest), hbm)
            if k.kind.startswith("cudnn_attention"):
                attention_s += k.runs * t
                attention_flops += k.runs * k.flops
            else:
                gemm_s += k.runs * t
                gemm_flops += k.runs * k.flops
        else:
            memory_s += k.runs * hbm
    for c in collectives:
        if not c.moves_data:
            continue
        n = c.group_size or num_devices
        if n <= 1:
            continue
        arrays = c.results if c.op in ("all-gather", "all-to-all") else c.operands
        wire = _WIRE.get(c.op, lambda n: 1.0)(n) * sum(a.nbytes for a in arrays)
        collective_s += c.count * wire / gpu.nvlink_bytes_per_s
    return {"gemm_s": gemm_s, "attention_s": attention_s, "memory_s": memory_s,
            "collective_s": collective_s, "bound_s": gemm_s + attention_s + memory_s + collective_s,
            "gemm_flops": gemm_flops, "attention_flops": attention_flops}


def step_memory(compiled, device_bytes: int) -> dict:
    """Bytes per device of a compiled step, from XLA's ``compiled.memory_analysis()``.

    Args:
      compiled: a ``jax.stages.Compiled`` (e.g. :attr:`CompiledStep.compiled`).
      device_bytes: the device's memory, bytes (:attr:`GpuTarget.memory_bytes`).

    Returns:
      ``{"argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "total_bytes",
      "device_bytes", "fits"}``: ``total_bytes`` = arguments + outputs - aliased (donated
      buffers counted once) + temporaries; ``fits`` when it is at most
      :data:`FIT_MARGIN` of ``device_bytes``.
    """
    stats = compiled.memory_analysis()
    mem = {"argument_bytes": int(stats.argument_size_in_bytes),
           "output_bytes": int(stats.output_size_in_bytes),
           "alias_bytes": int(stats.alias_size_in_bytes),
           "temp_bytes": int(stats.temp_size_in_bytes)}
    mem["total_bytes"] = (mem["argument_bytes"] + mem["output_bytes"] - mem["alias_bytes"]
                          + mem["temp_bytes"])
    mem["device_bytes"] = int(device_bytes)
    mem["fits"] = mem["total_bytes"] <= FIT_MARGIN * device_bytes
    return mem


def gpu_report(config: ml_collections.ConfigDict, gpu: GpuTarget, num_devices: int = 8, *,
               top: int = 10, autotune_results: Optional[str] = None,
               step: Optional[CompiledStep] = None) -> dict:
    """The trainer's step compiled for ``num_devices`` x ``gpu``, read (module docstring).

    ``step``, where given, is that step already compiled (:func:`compile_step` of the
    same ``config``, ``gpu`` and ``num_devices``): it is read instead of compiled again.

    Returns:
      A JSON-able dict: ``target``, ``setup``, ``memory`` (``argument_bytes``,
      ``output_bytes``, ``alias_bytes``, ``temp_bytes``, ``total_bytes`` = arguments +
      outputs - aliased + temporaries, ``device_bytes``, ``fits`` within
      :data:`FIT_MARGIN` of the device), ``largest_buffers`` (``top`` rows: bytes,
      instruction, shape, op_name), ``kernels`` (:func:`jaxmp.analysis.hlo.kernel_counts`),
      ``flops`` (``gemm``, ``attention``, ``model_6nd`` = 6 x active params x tokens per
      device, ``gemm_ratio``), ``collectives`` (``{op: {dtype: bytes}}`` per device and
      step), ``roofline`` (:func:`roofline` plus ``tokens_per_s_bound`` and
      ``mfu_bound``, model FLOPs by :func:`jaxmp.analysis.cost.training_flops` over the
      bound time at the bf16 dense peak) and ``caveats``.

    Raises:
      ValueError: as :func:`compile_step`.
    """
    if step is None:
        step = compile_step(config, gpu, num_devices, autotune_results)
    exp, compiled = step.experiment, step.compiled
    mem = step_memory(compiled, gpu.memory_bytes)
    module = hlo.parse_module(step.hlo_text)
    kernels = hlo.hlo_kernels(module)
    collectives = hlo.hlo_collectives(module)
    bound = roofline(kernels, collectives, gpu, num_devices)
    cfg = exp.config
    tokens = cfg.train.batch_size * cfg.data.seq_len / exp.num_devices
    active = exp.param_counts[1]
    m = exp.model_config
    model_flops = cost.training_flops(active, tokens, num_layers=m.num_layers,
                                      seq_len=cfg.data.seq_len, d_model=m.d_model,
                                      windows=[None if m.layer_type(i) == "linear_attention"
                                               else m.attention_window(i)
                                               for i in range(m.num_layers)])
    six_nd = 6.0 * active * tokens
    bound["tokens_per_s_bound"] = tokens / bound["bound_s"] if bound["bound_s"] else None
    bound["mfu_bound"] = (model_flops / bound["bound_s"] / gpu.peak_flops("bf16")
                          if bound["bound_s"] else None)
    names = {i.name: i.op_name for i in module.instructions}
    return {
        "target": {"name": gpu.name, "memory_bytes": gpu.memory_bytes,
                   "hbm_bytes_per_s": gpu.hbm_bytes_per_s,
                   "nvlink_bytes_per_s": gpu.nvlink_bytes_per_s,
                   "bf16_tflops": gpu.hardware.peak_tflops["bf16"], "source": gpu.source},
        "setup": {"devices": exp.num_devices, "strategy": exp.layout.strategy,
                  "expert": exp.layout.expert, "policy": str(cfg.precision.policy),
                  "remat": m.remat, "attention": m.attention,
                  "attention_path": _attention_path(exp),
                  "tokens_per_device": tokens, "params": exp.param_counts[0],
                  "active_params": active},
        "memory": mem,
        "largest_buffers": [{"bytes": b, "instruction": n, "shape": s,
                             "op_name": names.get(n, "").replace("\\'", "'")}
                            for b, n, s in step.buffers[:top]],
        "kernels": hlo.kernel_counts(kernels),
        "flops": {"gemm": bound["gemm_flops"], "attention": bound["attention_flops"],
                  "model_6nd": six_nd, "gemm_ratio": bound["gemm_flops"] / six_nd,
                  "model": model_flops},
        "collectives": hlo.collective_bytes(collectives),
        "roofline": bound,
        "caveats": list(CAVEATS),
    }


def _attention_path(exp: Experiment) -> str:
    """What ``model.attention`` resolved to for the mesh's devices (layer 0's policy)."""
    m = exp.model_config
    return resolve_attention(m.attention, exp.rules.resolve("blocks/0/attn").compute_dtype,
                             m.head_dim, compile_target.of_device(exp.mesh.devices.flat[0]))


def format_bytes(x: float) -> str:
    """Bytes in decimal units, as GPU memory is sold (GB = 1e9 bytes; MB = 1e6 below 0.01 GB,
    so that a small figure does not read 0.00 GB)."""
    return f"{x / 1e9:.2f} GB" if abs(x) >= 1e7 else f"{x / 1e6:.2f} MB"




def format_gpu_report(report: dict, title: str = "") -> str:
    """A readable table of :func:`gpu_report`'s result."""
    t, s, mem, fl, r = (report["target"], report["setup"], report["memory"], report["flops"],
                        report["roofline"])
    lines = [f"{title} compiled for {s['devices']} x {t['name']} (deviceless; XLA's GPU compiler)",
             f"  layout {s['strategy']}, expert {s['expert']}, policy {s['policy']}, remat "
             f"{s['remat']}, attention {s['attention']} -> {s['attention_path']}",
             "memory per device:",
             f"  arguments {format_bytes(mem['argument_bytes'])}, outputs "
             f"{format_bytes(mem['output_bytes'])}, aliased {format_bytes(mem['alias_bytes'])}, "
             f"temporaries {format_bytes(mem['temp_bytes'])}",
             f"  total {format_bytes(mem['total_bytes'])} of {format_bytes(mem['device_bytes'])}: "
             + ("fits" if mem["fits"] else "DOES NOT FIT")
             + f" (margin: {FIT_MARGIN:.0%} of the device)",
             "largest buffers:"]
    for b in report["largest_buffers"]:
        lines.append(f"  {format_bytes(b['bytes']):>10}  {b['shape']:<28} "
                     f"{b['op_name'] or b['instruction']}")
    lines.append("kernels (sites in the program / launches per step):")
    for kind in hlo.KERNEL_KINDS:
        if kind in report["kernels"]:
            k = report["kernels"][kind]
            lines.append(f"  {kind:<20} {k['sites']:>6} / {k['launches']}")
    lines.append(f"GEMM FLOPs per device and step: {fl['gemm']:.3e} = {fl['gemm_ratio']:.2f} x 6 x "
                 f"active params x tokens ({fl['model_6nd']:.3e}); attention {fl['attention']:.3e}")
    lines.append("collectives per device and step:")
    for op, by in sorted(report["collectives"].items()):
        lines.append("  " + op + ": " + ", ".join(f"{d} {format_bytes(b)}"
                                                  for d, b in sorted(by.items())))
    mfu = r["mfu_bound"]
    lines.append(f"roofline bound: {r['bound_s'] * 1e3:.2f} ms per step (GEMMs "
                 f"{r['gemm_s'] * 1e3:.2f}, attention {r['attention_s'] * 1e3:.2f}, other kernels "
                 f"{r['memory_s'] * 1e3:.2f}, collectives {r['collective_s'] * 1e3:.2f}); at most "
                 f"{r['tokens_per_s_bound']:.0f} tokens/s per device, MFU at most "
                 + (f"{mfu:.1%}" if mfu is not None else "n/a"))
    lines.append("not known without the GPU: " + "; ".join(report["caveats"]))
    return "\n".join(lines)
