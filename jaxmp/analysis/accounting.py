"""Per-device memory and gradient traffic of the real train step, one row per precision mode.

Every figure is read from the program JAX and XLA build for the config's model, under
abstract evaluation (``jax.eval_shape``, ``jax.make_jaxpr``, ``Lowered.compile``), so no
parameter or activation is ever allocated and a 24-layer model can be counted on a laptop.
Per device, in bytes, for the config's layout (``parallel.strategy`` and
``parallel.expert``, :func:`jaxmp.sharding.layout`) on a ``("data", "expert")`` mesh:

``params_bytes``
    the master weights ``TrainState.params`` as stored (float32 in every mixed mode):
    the device's shard under ``zero1`` and ``fsdp``, everything under ``dp``; in a LoRA
    mode (:data:`LORA_MODES`) the adapters alone.
``frozen_base_bytes``
    a LoRA mode's frozen base (``TrainState.rest``'s :class:`~jaxmp.models.FrozenParam`
    s), laid out as the forward pass reads parameters (whole under ``dp`` and ``zero1``,
    split under ``fsdp``): 4 bytes a parameter for ``lora.base=master``, 2 for
    ``bfloat16``, about 1 for ``fp8`` (E4M3 projections plus a float32 scale per 128 x 128
    block; norms, embeddings, router and head in bfloat16); 0 in every other mode.
``grads_bytes``
    the gradient buffer: one float32 value per parameter (what the step hands
    :func:`jaxmp.optim.apply_gradients`, unscaled), laid out like ``params_bytes``.
``opt_state_bytes``
    ``optimizer.init(params)`` of the real optimizer (moments in ``optim.mu_dtype`` /
    ``nu_dtype`` plus the int32 step counts, and with ``optim.update_rounding=kahan`` a
    compensation buffer per bfloat16 parameter), laid out like the master weights.
``compute_copy_bytes``
    the compute-dtype copy of the parameters the state keeps between steps under
    ``zero1`` (``TrainState.compute_params``, replicated); 0 otherwise.
``comm_state_bytes``
    the top-k error-feedback residual (:func:`jaxmp.comm.init_comm_state`), one float32
    row per device; 0 without compression.
``persistent_bytes``
    what stays in memory between steps: ``params_bytes + frozen_base_bytes +
    opt_state_bytes + compute_copy_bytes + comm_state_bytes`` (divided by the parameter count, the table's
    bytes per parameter: 8 for float32 masters with bf16 moments, 6 for bfloat16 masters
    with stochastic rounding, 8 with Kahan's bfloat16 compensation; divided by the data
    axis under ``zero1`` and ``fsdp``, plus ZeRO-1's replicated compute copy).
``float32_state_bytes``
    of ``params_bytes + opt_state_bytes``, the float32 leaves' bytes.
``activation_bytes``
    the residuals that the forward pass of the train step's loss
    (:func:`jaxmp.train.step.loss_fn`) saves for its backward pass at the per-device
    micro-batch, listed by :func:`saved_residuals` from the traced ``jax.vjp``. Counted:
    every array the forward computes and the backward reads, including the
    compute-dtype casts of the parameters (a bf16 copy of a weight *is* a residual) and
    integer/boolean arrays (routing indices, masks). Not counted: the arguments (master
    params, router biases, loss scale, token batch), which exist whether or not a
    backward pass follows, and literals and constants baked into the program. This is
    the saving precision buys at the JAX level, identical on every backend (under
    ``fsdp``, traced as the step runs it: every module gathers its weights under the FSDP
    checkpoint policy); XLA may
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

import glob
import os
import tempfile
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxmp.analysis.hlo import Collective, collective_bytes, hlo_collectives
from jaxmp.analysis.residuals import Residual, residual_breakdown, saved_residuals
from jaxmp.models.attention import resolve_attention
from jaxmp import sharding
from jaxmp._checks import check_int
from jaxmp.precision import comm
from jaxmp.train.config import complete_config
from jaxmp.train.experiment import Experiment
from jaxmp.train.state import split_frozen
from jaxmp.train.step import forward_args, loss_fn

__all__ = [
    "MODES",
    "TOPK_RATIO",
    "MEMORY_KEYS",
    "mode_config",
    "gradient_collective_bytes",
    "data_mesh",
    "account_mode",
    "accounting_report",
    "micro_batch",
    "step_residuals",
    "state_bytes",
    "lower_train_step",
    "format_accounting",
]

# The top-k fraction of the topk modes: jaxmp.comm's default, the DeepSeek mixed-precision
# article's (section 2.3).
TOPK_RATIO = comm.TOPK_RATIO

# One row per mode, every precision knob set, so that rows differ only where the table
# says. Mixed modes keep the router and norms as float32 islands (DeepSeek-V3 report
# 3.3); float16 needs a loss scale (Micikevicius et al. 2018, 3.2); bf16 moments follow
# DeepSeek-V3 3.3.3; the 16-bit all-reduce and the top-k all-gather (bf16 values + int32
# indices) are the article's section 2.3 proposals (jaxmp.analysis.article).
_MODE_TABLE = (
    # name             policy                                     loss scale
    #                  moments     reduce      compression
    ("fp32",           "fp32",                                     "none",
                       "",         "float32",  "none"),
    ("mixed_bf16",     "mixed_bf16; router: fp32; norm: fp32",     "none",
                       "",         "float32",  "none"),
    ("mixed_fp16",     "mixed_fp16; router: fp32; norm: fp32",     "dynamic:init=2**15",
                       "",         "float32",  "none"),
    ("bf16_moments",   "mixed_bf16; router: fp32; norm: fp32",     "none",
                       "bfloat16", "float32",  "none"),
    ("bf16_allreduce", "mixed_bf16; router: fp32; norm: fp32",     "none",
                       "",         "bfloat16", "none"),
    ("topk_allreduce", "mixed_bf16; router: fp32; norm: fp32",     "none",
                       "",         "bfloat16", "topk"),
    # mixed_bf16 with attention and every FFN in FP8 (jaxmp.fp8; embedding, head, router,
    # norms and the attention core stay bf16/fp32, DeepSeek-V3 3.3.1): their backward
    # passes keep FP8 activations plus float32 scales instead of bf16 ones.
    ("fp8_tensorwise", "fp8_tensorwise; router: fp32; norm: fp32", "none",
                       "",         "float32",  "none"),
    ("fp8_delayed",    "fp8_delayed; router: fp32; norm: fp32",    "none",
                       "",         "float32",  "none"),
    ("fp8_rowwise",    "fp8_rowwise; router: fp32; norm: fp32",    "none",
                       "",         "float32",  "none"),
    ("fp8_blockwise",  "fp8_blockwise; router: fp32; norm: fp32",  "none",
                       "",         "float32",  "none"),
    # bfloat16 master weights (the router and norms stay float32) with bf16 moments: 6
    # bytes of persistent state per parameter with stochastic rounding, 8 with Kahan's
    # bfloat16 compensation buffer (jaxmp.optim.with_update_rounding); bf16_moments is
    # the float32-master baseline at 8.
    ("pure_bf16_stochastic", "pure_bf16; router: fp32; norm: fp32", "none",
                       "bfloat16", "float32",  "none"),
    ("pure_bf16_kahan", "pure_bf16; router: fp32; norm: fp32",     "none",
                       "bfloat16", "float32",  "none"),
)
_UPDATE_ROUNDING = {"pure_bf16_stochastic": "stochastic", "pure_bf16_kahan": "kahan"}

MODES: Mapping[str, Mapping[str, Any]] = {
    name: {"precision.policy": policy, "precision.loss_scale": loss_scale,
           "optim.mu_dtype": moments, "optim.nu_dtype": moments,
           "precision.grad_reduce_dtype": reduce, "precision.grad_compression": compression,
           "precision.topk_ratio": TOPK_RATIO,
           "optim.update_rounding": _UPDATE_ROUNDING.get(name, "nearest"),
           "lora.rank": 0, "lora.base": "master"}
    for name, policy, loss_scale, moments, reduce, compression in _MODE_TABLE}

# The LoRA modes (jaxmp.models.lora): mixed_bf16's settings, rank-r adapters (float32
# masters, Adam moments for them alone) over a frozen base kept as its float32 masters,
# in bfloat16, or as E4M3 with 128 x 128 block scales. The rank is the config's lora.rank,
# or LORA_RANK where it is 0; the router biases are frozen with the base
# (model.bias_update_rate 0, as lora.rank > 0 requires).
LORA_RANK = 16
LORA_MODES: Mapping[str, Mapping[str, Any]] = {
    f"lora_{short}": {**MODES["mixed_bf16"], "lora.rank": None, "lora.base": base}
    for short, base in (("master", "master"), ("bf16", "bfloat16"), ("fp8", "fp8"))}
# Every mode by name: the full-training ones, then the LoRA ones.
ALL_MODES: Mapping[str, Mapping[str, Any]] = {**MODES, **LORA_MODES}

MEMORY_KEYS = ("params_bytes", "frozen_base_bytes", "grads_bytes", "opt_state_bytes",
               "compute_copy_bytes", "comm_state_bytes", "activation_bytes")
# What stays in memory between steps: the master weights, a LoRA run's frozen base, the
# optimizer state (moments, Kahan compensation), ZeRO-1's compute copy and the top-k residual.
PERSISTENT_KEYS = ("params_bytes", "frozen_base_bytes", "opt_state_bytes", "compute_copy_bytes",
                   "comm_state_bytes")


def default_modes(config: ml_collections.ConfigDict) -> list:
    """The modes a report accounts when none are named: :data:`MODES`, and the LoRA ones
    (:data:`LORA_MODES`) too when ``config`` trains adapters (``lora.rank > 0``)."""
    return list(MODES) + (list(LORA_MODES) if complete_config(config).lora.rank else [])


def mode_config(config: ml_collections.ConfigDict, mode: str) -> ml_collections.ConfigDict:
    """A copy of ``config`` with the overrides of ``ALL_MODES[mode]`` applied (a LoRA
    mode's rank: the config's ``lora.rank``, or :data:`LORA_RANK`; a LoRA mode also sets
    ``model.bias_update_rate`` to 0).

    Raises:
      ValueError: ``mode`` is not a key of :data:`ALL_MODES` (they are listed).
    """
    if mode not in ALL_MODES:
        raise ValueError(f"unknown precision mode {mode!r}; allowed: {', '.join(ALL_MODES)}")
    out = complete_config(config)
    for key, value in ALL_MODES[mode].items():
        section, name = key.split(".")
        if key == "lora.rank" and value is None:  # a LoRA mode: the config's rank, or 16
            value = out.lora.rank or LORA_RANK
        out[section][name] = value
    if out.lora.rank:  # the router biases are part of the frozen base
        out.model.bias_update_rate = 0.0
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
            total += c.count * sum(r.nbytes for a,
                                   r in zip(c.operands, c.results) if a.size in sparse)
    return total


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
    check_int("num_devices", num_devices, 1)
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


def _per_device_bytes(tree: Any, shardings: Any, dtype: Any = None,
                      itemsize: Optional[int] = None) -> int:
    """Bytes of ``tree``'s leaves on one device (of ``dtype`` only, when given; each
    element ``itemsize`` bytes, when given, else its dtype's)."""
    total = 0
    for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
        if dtype is not None and np.dtype(x.dtype) != np.dtype(dtype):
            continue
        shape = s.shard_shape(tuple(x.shape)) if isinstance(s, NamedSharding) else x.shape
        total += int(np.prod(shape, dtype=np.int64)) * (itemsize or np.dtype(x.dtype).itemsize)
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


def micro_batch(exp: Experiment) -> jax.ShapeDtypeStruct:
    """The per-device micro-batch of token ids, abstract: int32 ``[train.batch_size /
    train.grad_accum_steps / devices, data.seq_len]``."""
    t = exp.config.train
    return jax.ShapeDtypeStruct((t.batch_size // t.grad_accum_steps // exp.num_devices,
                                 exp.config.data.seq_len), jnp.int32)


def step_residuals(exp: Experiment) -> List[Residual]:
    """The residuals the train step's loss keeps at the per-device micro-batch.

    Under ``fsdp`` the loss runs as in the step: inside ``shard_map`` (over one device)
    with every module gathering its weights (the step's :class:`jaxmp.sharding.StepPlan`
    gather, here over an axis of one) under :func:`jaxmp.sharding.fsdp_checkpoint_policy`, so the
    count is what that policy saves with the model's remat policy, not what plain autodiff of whole
    parameters would save.
    """
    state, micro = exp.abstract_state, micro_batch(exp)

    def loss(params, biases, rest, loss_scale, batch, forward=None):
        return loss_fn(exp.graphdef, params, biases, rest, loss_scale, batch,
                       forward=forward)[0]

    if exp.layout.declared.splits_compute:
        # The step's own plan (its FSDP gather and dispatch dtype), on one device.
        one_device = Mesh(np.array(jax.devices("cpu")[:1]), (sharding.DATA_AXIS,))
        plan = sharding.StepPlan(one_device, exp.layout, state.params, state.params,
                                 exp.plan.reduce_dtype)

        def per_device(params, biases, rest, loss_scale, batch):
            return loss(params, biases, rest, loss_scale, batch, forward_args(plan))

        spec = jax.sharding.PartitionSpec()
        fsdp_loss = jax.shard_map(per_device, mesh=one_device, in_specs=spec, out_specs=spec,
                                  check_vma=False)
        plain = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                             (state.params, state.biases, state.rest, state.loss_scale))
        return saved_residuals(fsdp_loss, *plain, {"inputs": micro, "targets": micro}, argnums=0)
    return saved_residuals(loss, state.params, state.biases, state.rest, state.loss_scale,
                           {"inputs": micro, "targets": micro}, argnums=0)


def state_bytes(exp: Experiment) -> Dict[str, int]:
    """Per-device bytes of the persistent train state, from its abstract shapes and shardings.

    Returns:
      ``{"params_bytes", "frozen_base_bytes", "grads_bytes", "opt_state_bytes",
      "compute_copy_bytes", "comm_state_bytes"}``: the master weights (a LoRA run's
      adapters), a LoRA run's frozen base (0 otherwise; E4M3 weights and their scales
      under ``lora.base=fp8``), their gradient (one master-dtype value per trained
      parameter, laid out like it), the optimizer state, ZeRO-1's compute-dtype copy and
      the top-k residual, in bytes on one device.
    """
    state, state_sh = exp.abstract_state, exp.state_shardings
    params = _per_device_bytes(state.params, state_sh.params)
    copy = state.compute_params
    frozen = split_frozen(state.rest)[0]
    return {"params_bytes": params,
            "frozen_base_bytes": _per_device_bytes(frozen, split_frozen(state_sh.rest)[0]),
            # The step hands the optimizer unscaled float32 gradients, laid out like the
            # params, whatever their dtype (bfloat16 masters cast them afterwards).
            "grads_bytes": _per_device_bytes(state.params, state_sh.params, itemsize=4),
            "opt_state_bytes": _per_device_bytes(state.opt_state, state_sh.opt_state),
            "compute_copy_bytes": (0 if copy is None
                                   else _per_device_bytes(copy, state_sh.compute_params)),
            "comm_state_bytes": _per_device_bytes(state.comm_state, state_sh.comm_state)}


def _float32_state_bytes(exp: Experiment) -> int:
    """Per-device bytes of the float32 leaves of the params and the optimizer state."""
    state, state_sh = exp.abstract_state, exp.state_shardings
    return _per_device_bytes((state.params, state.opt_state),
                             (state_sh.params, state_sh.opt_state), np.float32)


def lower_train_step(exp: Experiment, global_batch: int):
    """The experiment's jitted train step lowered for a ``[global_batch, data.seq_len]``
    batch, with abstract inputs (nothing allocated): a ``jax.stages.Lowered``."""
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
      mode: a key of :data:`ALL_MODES`.
      num_devices: devices of the mesh (``num_devices / parallel.expert`` along
        ``"data"``).
      breakdown: also return the top ``breakdown`` residual groups (0 = none).
      mesh: the mesh to lower over (default :func:`data_mesh` ``(num_devices,
        parallel.expert)``).

    Returns:
      ``{"policy": str, "strategy": str, "expert": int, "lora_rank": int,
      "params_bytes": int, "frozen_base_bytes": int, "grads_bytes": int, "opt_state_bytes": int, "compute_copy_bytes": int,
      "comm_state_bytes": int, "activation_bytes": int, "grad_allreduce_bytes": int,
      "collective_bytes": {op: {dtype: int}}, "total_bytes": int}`` plus ``"xla_memory"`` (the
      ``memory_analysis()`` byte counts, None on CPU), ``"hlo_source"`` (which HLO the collectives
      were read from), ``"attention_path"`` (what ``model.attention`` resolved to on this machine,
      e.g. ``"xla"`` for ``"auto"`` on CPU) and, if asked, ``"breakdown"`` (rows of
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

    lowered = lower_train_step(exp, t.batch_size)
    on_cpu = mesh.devices.flat[0].platform == "cpu"
    hlo, compiled, hlo_source = _partitioned_hlo(lowered, on_cpu)
    settings = exp.settings.comm
    # A device's gradient as it enters the reduction has the layout of ``dp``'s
    # parameters (whole, but for the expert-parallel split): every strategy reduces that.
    dp = sharding.layout(sharding.DP.name, exp.layout.expert)
    grad_sh = sharding.state_shardings(state.params, mesh, dp.on(mesh).compute_rules)
    dense = []
    variables = jax.tree.leaves(state.params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    for var, s in zip(variables, jax.tree.leaves(grad_sh)):
        shape = tuple(var.get_value().shape)
        dense.append(int(np.prod(s.shard_shape(shape), dtype=np.int64)))
        if tuple(var.get_metadata().get("out_sharding") or ())[:1] == ("layers",):
            dense.append(dense[-1] // shape[0])  # scanned: one layer's slice, reduced in the loop
    sparse = ([comm.topk_count(d, settings["topk_ratio"]) for d in dense]
              if settings["grad_compression"] == "topk" else [])

    residuals = step_residuals(exp)
    collectives = hlo_collectives(hlo)
    out = {"policy": cfg.precision.policy, "strategy": exp.layout.strategy,
           "expert": exp.layout.expert, "lora_rank": int(cfg.lora.rank),
           **state_bytes(exp),
           "activation_bytes": sum(r.nbytes for r in residuals if r.kind == "computed"),
           "grad_allreduce_bytes": gradient_collective_bytes(collectives, dense, sparse),
           "collective_bytes": collective_bytes(collectives)}
    out["total_bytes"] = sum(out[k] for k in MEMORY_KEYS)
    out["persistent_bytes"] = sum(out[k] for k in PERSISTENT_KEYS)
    out["float32_state_bytes"] = _float32_state_bytes(exp)
    out["xla_memory"] = None
    if jax.default_backend() != "cpu":
        if not on_cpu:
            out["xla_memory"] = _memory_analysis(compiled)
        elif not exp.layout.declared.splits_state and exp.layout.expert == 1:
            # One device with its share of the batch: the same per-device program.
            one = Experiment.create(cfg, mesh=data_mesh(1))
            out["xla_memory"] = _memory_analysis(lower_train_step(one, t.batch_size // n).compile())
    out["hlo_source"] = hlo_source
    m = exp.model_config
    out["attention_path"] = resolve_attention(m.attention,
                                              exp.rules.resolve("blocks/0/attn").compute_dtype,
                                              m.head_dim)
    if breakdown:
        out["breakdown"] = residual_breakdown(residuals, breakdown)
    return out


# ----------------------------------------------------------------------------- all modes


def accounting_report(config: ml_collections.ConfigDict, modes: Optional[Sequence[str]] = None,
                      num_devices: int = 8, *, breakdown: int = 0,
                      skip_failed: bool = False,
                      progress: Optional[Callable[[str], None]] = None) -> dict:
    """:func:`account_mode` for each mode, as the JSON of ``python -m jaxmp.report --config``.

    Args:
      config: a trainer config.
      modes: keys of :data:`ALL_MODES` (default :func:`default_modes`, in table order).
      num_devices: data-parallel devices.
      breakdown: top residual groups to keep per mode (0 = none).
      skip_failed: a mode whose step XLA cannot compile here (e.g. XLA:CPU's limit of
        2**31 - 1 scatter indices, which top-k compression of a large model exceeds) is
        left out of ``"modes"`` and its one-line reason put in ``"skipped"``, instead of
        raising.
      progress: called with a line before each mode's compile (``"compiling mode NAME
        (i/n) ..."``) and before the model is built: a model of thousands of layers takes
        minutes per mode (``python -m jaxmp.report`` prints them on stderr).

    Returns:
      ``{"model": {"params": int, "active_params": int}, "setup": {...}, "modes":
      {NAME: {"policy", "strategy", "expert", "params_bytes", "grads_bytes",
      "opt_state_bytes", "compute_copy_bytes", "comm_state_bytes", "activation_bytes",
      "grad_allreduce_bytes", "collective_bytes", "total_bytes"}},
      "details": {NAME: {"xla_memory", "hlo_source", "attention_path"[, "breakdown"]}},
      "skipped": {NAME: reason}}``, bytes per device.

    Raises:
      ValueError: an unknown mode (before any work), or as :func:`account_mode`.
      jax.errors.JaxRuntimeError: XLA cannot compile a mode's step (unless ``skip_failed``).
    """
    modes = default_modes(config) if modes is None else list(modes)
    for mode in modes:
        if mode not in ALL_MODES:
            raise ValueError(f"unknown precision mode {mode!r}; allowed: {', '.join(ALL_MODES)}")
    say = progress or (lambda text: None)
    config = complete_config(config)
    mesh = data_mesh(num_devices, int(config.parallel.expert))
    m = config.model
    say(f"building the model ({m.num_layers} layers"
        + (", unscanned: XLA compiles each layer on its own, so the compiles grow with "
           "the layers; model.scan_layers=True compiles one" if not m.scan_layers
           and m.num_layers > 32 else "") + ") ...")
    counted = complete_config(config)  # the model's parameters, without adapters
    counted.lora.rank = 0
    total, active = Experiment.create(counted, mesh=mesh).param_counts
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
        "skipped": {},
    }
    for i, mode in enumerate(modes, 1):
        say(f"compiling mode {mode} ({i}/{len(modes)}) ...")
        try:
            row = account_mode(config, mode, num_devices, breakdown=breakdown, mesh=mesh)
        except jax.errors.JaxRuntimeError as e:
            if not skip_failed:
                raise
            first = " ".join(str(e).split())
            first = first[:first.find(". ") + 1 or None][:300]  # its first sentence
            out["skipped"][mode] = (f"XLA cannot compile its step on this machine "
                                    f"({out['setup']['platform']}): {first}")
            continue
        out["details"][mode] = {k: row.pop(k)
                                for k in ("xla_memory", "hlo_source", "attention_path",
                                                        "breakdown") if k in row}
        out["modes"][mode] = row
    return out


# ----------------------------------------------------------------------------- attention x remat

def _mib(x: int) -> str:
    return f"{x / 2**20:,.3f}"


def format_accounting(report: dict, title: str = "") -> str:
    """Formats :func:`accounting_report` for the terminal: one table per mode."""
    s, params = report["setup"], report["model"]["params"]
    accum = (f", {s['grad_accum_steps']} micro-batches per step"
             if s["grad_accum_steps"] > 1 else "")
    lines = [f"Per-device memory and gradient traffic{': ' + title if title else ''}",
             f"  model: {params:,} parameters ({report['model']['active_params']:,} active per "
             f"token); {s['devices']} devices, parallel.strategy={s.get('strategy', 'dp')}, "
             f"parallel.expert={s.get('expert', 1)}; per-device micro-batch "
             f"{s['micro_batch_per_device']} x {s['seq_len']} tokens"
             f"{accum}",
             f"  model.attention={s.get('attention')}, model.remat={s.get('remat')}, "
             f"model.scan_layers={s.get('scan_layers')}",
             "  bytes per device (MiB = 2**20 bytes); 'vs fp32' divides by the fp32 mode's figure"]
    base = report["modes"].get("fp32")
    rows = (("params", "params_bytes", True), ("frozen base", "frozen_base_bytes", True),
            ("grads", "grads_bytes", True),
            ("optimizer state", "opt_state_bytes", True),
            ("compute copy", "compute_copy_bytes", True),
            ("top-k residual", "comm_state_bytes", True),
            ("persistent state", "persistent_bytes", True),
            ("  of it float32", "float32_state_bytes", True),
            ("activations", "activation_bytes", False), ("total memory", "total_bytes", False),
            ("grad reduction", "grad_allreduce_bytes", True))
    for mode, reason in report.get("skipped", {}).items():
        lines += ["", f"mode {mode}: not accounted: {reason}"]
    for mode, r in report["modes"].items():
        o = ALL_MODES[mode]
        lora = (f"; LoRA rank {r['lora_rank']} adapters (trained, float32 masters, Adam "
                f"moments) over a frozen {o['lora.base']} base" if r.get("lora_rank") else "")
        lines += ["", f"mode {mode}: policy \"{r['policy']}\"{lora}; loss scale "
                      f"{o['precision.loss_scale']}; Adam moments "
                      f"{o['optim.mu_dtype'] or 'in the master dtype'}; update rounding "
                      f"{o['optim.update_rounding']}; grad_reduce_dtype "
                      f"{o['precision.grad_reduce_dtype']}; grad_compression "
                      f"{o['precision.grad_compression']}"
                  + (f" (ratio {o['precision.topk_ratio']:g})"
                     if o["precision.grad_compression"] == "topk" else ""),
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
                         + (" (model.attention=auto: cuDNN's fused kernel on an NVIDIA "
                            "GPU for a 16-bit "
                            "compute dtype; compare "
                            "--settings)" if s.get("attention") == "auto"
                            and d["attention_path"] != "cudnn"
                            else ""))
        if d.get("xla_memory"):
            m = d["xla_memory"]
            lines.append(f"  XLA memory_analysis ({s['default_backend']}): temp "
                         f"{_mib(m.get('temp_size_in_bytes', 0))} MiB (activations and scratch), "
                         f"arguments {_mib(m.get('argument_size_in_bytes', 0))} MiB, outputs "
                         f"{_mib(m.get('output_size_in_bytes', 0))} MiB")
        for b in d.get("breakdown", []):
            lines.append(f"    {b['bytes']:>19,d} B {b['count']:4d} x "
                         f"{b['dtype']:9s} {b['source']}")
    lines += ["", "activations: residuals the loss's forward pass saves for the backward pass, "
                  "counted from the traced jax.vjp (arguments, literals and constants excluded)."]
    if s["default_backend"] == "cpu":
        lines.append("XLA memory_analysis skipped on CPU: XLA:CPU computes bfloat16 in float32 "
                     "internally, so its buffer sizes would hide the saving.")
    lines.append("grad reduction: gradient collectives (all-reduce; reduce-scatter under "
                 "zero1/fsdp) in the HLO after SPMD partitioning (whole buffers: all-reduce and "
                 "reduce-scatter operands, all-gather results).")
    lines.append("op dtype rows: every collective of the step by kind and element type (operands "
                 "of all-reduce/reduce-scatter, results of all-gather/all-to-all); a ring moves "
                 "(N-1)/N of each buffer per device.")
    return "\n".join(lines)
