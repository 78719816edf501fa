"""An :class:`Experiment`: everything a run config describes, built once.

``Experiment.create(config)`` validates the config (once, :func:`validate_config`),
builds the mesh, the model's graph definition under ``nnx.eval_shape`` (nothing is
allocated), the optimizer and its one learning-rate schedule, the abstract train state
and its shardings, and the jitted train and eval steps. The trainer, the report, the
benchmarks, the notebooks and the tests all take their step from here, so what is
measured is what is trained::

    exp = Experiment.create(load_config("configs/tiny_moe.py"))
    state = exp.init_state()                      # sharded over exp.mesh
    batch = exp.batch_to_device(next(exp.data.train_iter))
    state, metrics = exp.train_step(state, batch)
"""
from __future__ import annotations

import dataclasses
import os
import functools
import math
import re
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

import jax
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxmp import sharding, target
from jaxmp.models import ModelConfig, MoETransformer, count_params
from jaxmp.models.lora import TRAINABLE, apply_lora, base_digest, freeze_base
from jaxmp.models.transformer import layer_stacks, model_policy_rules, param_compute_dtypes
from jaxmp.precision import comm
from jaxmp.precision.policy import PolicyRules
from jaxmp.train.config import Settings, validate_config
from jaxmp.train import packing
from jaxmp.train.data import DataPipeline, create_pipeline
from jaxmp.train.tokenizer import load_tokenizer, round_vocab
from jaxmp.train.optimizer import make_lr_schedule, make_optimizer
from jaxmp.train.resume import (relayout_stacks, residual_adapter, saved_stacks,
                                stacks_adapter)
from jaxmp.train.state import (TrainState, create_train_state, split_frozen, split_model,
                               train_state_shardings)
from jaxmp.train.step import DivergenceCheck, GradExchange, make_eval_step, make_train_step

__all__ = ["Experiment", "module_paths", "parameter_bytes", "unmatched_rules", "BASE_DIGEST"]

# The checkpoint meta key holding a LoRA run's base digest (jaxmp.models.lora.base_digest).
BASE_DIGEST = "lora_base_digest"


def module_paths(model: nnx.Module) -> List[str]:
    """The ``/``-joined paths of a model's modules that have a policy: what policy rules
    match against (per layer, ``blocks/{i}/...``, also in the scanned layout: the model's
    own ``module_paths()`` where it has one)."""
    if callable(getattr(model, "module_paths", None)):
        return list(model.module_paths())
    return ["/".join(str(k) for k in path) for path, m in nnx.iter_modules(model)
            if path and hasattr(m, "policy")]


def unmatched_rules(rules: PolicyRules, paths, quiet=()) -> List[str]:
    """Warnings, one per rule pattern that matches no module path: a typo such as
    ``rooter: fp32`` would otherwise be ignored in silence. (Not an error: a shared rule
    string may name modules that one model lacks, e.g. ``router`` in a dense model.)
    Patterns in ``quiet`` (the default policy's own islands) are not warned about."""
    kinds = {re.sub(r"\d+", "{i}", p): None for p in paths}  # one example per kind
    examples = ", ".join(list(kinds)[:10])
    return [f"precision.policy rule {pattern!r} matches no module of this model; module paths "
            f"look like: {examples}, ..." for pattern, _ in rules.rules
            if pattern not in quiet and not any(re.search(pattern, p) for p in paths)]


def parameter_bytes(config: ModelConfig, rules: Any, base: Optional[str] = None) -> int:
    """Bytes of the model's parameters in their ``param_dtype`` s, without building it:
    two abstract one-layer models (its first layer dense, then MoE) give the embedding,
    head and final norm and one block of each kind, and each layer counts as its kind's
    block. Its time does not grow with ``num_layers`` (building 100,000 layers, even
    abstractly, takes many minutes).

    Args:
      config: the :class:`~jaxmp.models.ModelConfig`.
      rules: the run's precision rules (the parameters' dtypes).
      base: a LoRA run's ``lora.base`` (the frozen base's dtypes,
        :func:`jaxmp.models.lora.freeze_base`; the adapters, a small fraction, not
        counted), or None.

    Returns:
      The bytes, a Python int (equal to the built model's: tests/test_silent_faults.py).
    """
    def nbytes(tree) -> int:
        return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))

    counts = {False: config.num_dense_layers, True: config.num_moe_layers}  # not enumerated
    total = glob = 0
    for moe in (False, True):
        if not counts[moe]:
            continue
        one = dataclasses.replace(config, num_layers=1, scan_layers=False, mlp_only_layers=(),
                                  layer_types=(),  # a window adds no parameter
                                  first_dense_layers=0 if moe else 1,
                                  num_experts=config.num_experts if moe else 0)
        def build(one=one):
            model = MoETransformer(one, rules, rngs=nnx.Rngs(0))
            if base is not None:
                freeze_base(model, base)
            return model

        model = nnx.eval_shape(build)
        block = nbytes(nnx.state(model.blocks[0], nnx.Param))
        glob = nbytes(nnx.state(model, nnx.Param)) - block
        total += block * counts[moe]
    return total + glob


def _init_from(path: str, settings, mesh: Mesh, layout, optimizer, shardings) -> TrainState:
    """The initial train state of ``model.init_from=path``: the checkpoint's weights, each
    device reading its own slices (:func:`jaxmp.models.hf.load_weights`) onto the state's
    layout, and a fresh optimizer state."""
    from jaxmp.models import hf

    lora = settings.lora
    model = hf.load_weights(path, settings.model, settings.rules, mesh=mesh,
                            rules=layout.state_rules, target=_target_of(mesh),
                            fp8_base=lora is not None and lora.base == "fp8")
    if settings.lora is not None:
        apply_lora(model, settings.lora, settings.config.seed)
    n = int(mesh.devices.size)
    comm_state = comm.init_comm_state(nnx.state(model, TRAINABLE), n,
                                      settings.comm["grad_compression"])
    state = create_train_state(model, optimizer, settings.loss_scale, settings.config.seed,
                               comm_state=comm_state)[1]
    # One buffer per leaf: the eager state shares its zero scalars, which the donating
    # train step may not receive twice.
    return jax.tree.map(lambda x: x.copy(), jax.device_put(state, shardings))


def vocab_problem(config: ml_collections.ConfigDict, have: int, need: int) -> str:
    """The one-line refusal of ``model.vocab_size=have`` below the ``need`` tokens of
    ``data.tokenizer``, with the fix this config can take: a larger ``model.vocab_size``
    (the next multiple of 128, :func:`~jaxmp.train.tokenizer.round_vocab`), or, with
    ``model.init_from`` (whose vocabulary is the base's), a ``data.tokenizer`` that fits."""
    spec = config.data.tokenizer
    text = (f"model.vocab_size={have} is smaller than the vocabulary of data.tokenizer={spec!r} "
            f"({need} tokens); ")
    if config.model.get("init_from"):
        return text + (f"the vocabulary is model.init_from's ({config.model.init_from}): give "
                       f"data.tokenizer of at most {have} tokens, e.g. the base's tokenizer.json")
    return text + (f"set model.vocab_size={round_vocab(need)} (the next multiple of 128) or at "
                   f"least {need}")


def _target_of(mesh: Mesh) -> target.Target:
    """The compile target of ``mesh``: its devices, which for a deviceless compile are
    topology devices, not this host's (:mod:`jaxmp.target`)."""
    return target.of_device(mesh.devices.flat[0])


def _cast_copy(params: Any, dtypes: dict) -> Any:
    """ZeRO-1's compute-dtype copy of the master ``params`` (an ``nnx.State``): each
    parameter cast to its module's compute dtype (``dtypes``, from
    :func:`jaxmp.models.transformer.param_compute_dtypes`)."""
    return nnx.from_flat_state([(path, var.replace(var.get_value().astype(dtypes[path])))
                                for path, var in nnx.to_flat_state(params)])


@dataclasses.dataclass(eq=False)
class Experiment:
    """A validated run config and everything built from it.

    Attributes:
      settings: what :func:`~jaxmp.train.config.validate_config` parsed (``config``,
        ``model``, user ``rules``, initial ``loss_scale``, ``comm`` keywords).
      mesh: the device mesh ``("data", "expert")``; the batch is split over both axes.
      layout: the :class:`jaxmp.sharding.Layout` (``parallel.strategy`` and
        ``parallel.expert``): where the state and the parameters live.
      rules: the model's resolved policy rules (the user's plus the float32 islands).
      graphdef: the model's NNX graph definition.
      module_paths: the paths policy rules match against (``blocks/0/attn``, ...).
      param_counts: ``(total, active_per_token)`` (:func:`jaxmp.models.count_params`).
      lr_schedule: the one learning-rate schedule (``count -> lr``).
      optimizer: the optax transformation built on it.
      abstract_state: the :class:`TrainState` as ``jax.ShapeDtypeStruct`` leaves with
        their shardings (:meth:`checkpoint_template` is what checkpoints restore onto).
      state_shardings: the :class:`TrainState` of ``NamedSharding``.
      batch_sharding: the ``NamedSharding`` of an int32 ``[B, T]`` token batch.
      train_step: ``jax.jit`` of :func:`~jaxmp.train.step.make_train_step` with these
        shardings, the state donated: ``(state, batch) -> (state, metrics)``.
      eval_step: ``jax.jit`` of :func:`~jaxmp.train.step.make_eval_step`:
        ``(state, batch) -> {"loss", "tokens"}`` summed over the batch.
      plan: the :class:`jaxmp.sharding.StepPlan` both steps run by, built once here.
      workdir: the run directory (set by the trainer before :attr:`data` is read), where
        a ``bpe:VOCAB`` tokenizer is kept; None trains one in memory.
      progress: say what reading the data does (lines on stdout; progress bars on stderr
        for reading the files, training a BPE and tokenizing); set by the trainer on
        process 0.
    """

    settings: Settings
    mesh: Mesh
    layout: sharding.Layout
    rules: PolicyRules
    graphdef: Any
    module_paths: Tuple[str, ...]
    param_counts: Tuple[int, int]
    lr_schedule: optax.Schedule
    optimizer: optax.GradientTransformation
    abstract_state: TrainState
    state_shardings: TrainState
    batch_sharding: NamedSharding
    train_step: Callable
    eval_step: Callable
    plan: Optional[sharding.StepPlan] = None
    _init: Callable = dataclasses.field(repr=False, default=None)
    _copy: Optional[Callable] = dataclasses.field(repr=False, default=None)
    workdir: Optional[Any] = None
    progress: bool = False
    _digest: Optional[str] = dataclasses.field(repr=False, default=None)

    @classmethod
    def create(cls, config: ml_collections.ConfigDict, *, num_devices: Optional[int] = None,
               mesh: Optional[Mesh] = None) -> "Experiment":
        """Validates ``config`` and builds the experiment; nothing is allocated on devices.

        Args:
          config: a run config (e.g. ``load_config("configs/tiny_moe.py")``).
          num_devices: devices of the mesh (default ``train.num_devices``, 0 = all);
            the mesh is ``(num_devices / parallel.expert, parallel.expert)``.
          mesh: a ready mesh with a ``"data"`` axis (and an ``"expert"`` one for expert
            parallelism) instead; ``num_devices`` is then ignored.

        Raises:
          ValueError: any bad config value (:func:`validate_config`), or more devices
            than exist.
        """
        if mesh is None:  # validated first, so a bad layout is named before the mesh is built
            settings = validate_config(config, num_devices or None)
            mesh = sharding.make_mesh(settings.num_devices, expert=settings.layout.expert)
        else:
            settings = validate_config(config, int(mesh.devices.size))
        n = int(mesh.devices.size)
        cfg = settings.config
        layout = settings.layout.on(mesh)
        lr_schedule = make_lr_schedule(cfg.optim, cfg.train.steps)
        optimizer = make_optimizer(cfg.optim, lr_schedule, cfg.seed)

        # Hardware choices (attention and moe_kernel "auto") follow the devices the step is
        # compiled for, which for a deviceless compile are topology devices (jaxmp.target).
        compile_for = _target_of(mesh)

        def build() -> MoETransformer:
            model = MoETransformer(settings.model, settings.rules, rngs=nnx.Rngs(cfg.seed),
                                   target=compile_for)
            if settings.lora is not None:  # adapters, and the base frozen
                apply_lora(model, settings.lora, cfg.seed)
            return model

        def init() -> TrainState:
            model = build()
            comm_state = comm.init_comm_state(nnx.state(model, TRAINABLE), n,
                                              settings.comm["grad_compression"])
            # ZeRO-1's compute copy is cast afterwards, from the stored params (restored_state).
            return create_train_state(model, optimizer, settings.loss_scale, cfg.seed,
                                      comm_state=comm_state)[1]

        model = nnx.eval_shape(build)
        graphdef = split_model(model)[0]
        abstract = jax.eval_shape(init)
        copy_fn = functools.partial(_cast_copy, dtypes=param_compute_dtypes(model))
        if layout.compute_copy:
            abstract = abstract.replace(compute_params=jax.eval_shape(copy_fn, abstract.params))
        state_sh = train_state_shardings(abstract, mesh, layout)
        # The steps' per-device layout, worked out once from the abstract state.
        plan = sharding.StepPlan(
            mesh, layout, abstract.compute_params if layout.compute_copy else abstract.params,
            abstract.params, settings.reduce_dtype, frozen=split_frozen(abstract.rest)[0])
        batch_sh = sharding.batch_sharding(mesh, layout.state_rules)
        abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                abstract, state_sh)
        step = make_train_step(
            graphdef, optimizer, plan=plan, lr_schedule=lr_schedule,
            bias_update_rate=settings.model.bias_update_rate,
            grad_accum_steps=cfg.train.grad_accum_steps,
            exchange=GradExchange(settings.comm["grad_compression"], settings.comm["topk_ratio"]),
            divergence=DivergenceCheck(cfg.train.loss_spike_factor,
                                       cfg.train.grad_norm_spike_factor))
        return cls(
            settings=settings, mesh=mesh, layout=layout, rules=model.rules,
            graphdef=graphdef, module_paths=tuple(module_paths(model)),
            param_counts=count_params(model), lr_schedule=lr_schedule, optimizer=optimizer,
            abstract_state=abstract, state_shardings=state_sh, batch_sharding=batch_sh,
            train_step=jax.jit(step, in_shardings=(state_sh, batch_sh),
                               out_shardings=(state_sh, None), donate_argnums=0),
            eval_step=jax.jit(make_eval_step(graphdef, plan=plan),
                              in_shardings=(state_sh, batch_sh)),
            plan=plan,
            _init=(functools.partial(_init_from, cfg.model.init_from, settings, mesh, layout,
                                     optimizer, state_sh.replace(compute_params=None))
                   if cfg.model.init_from else
                   jax.jit(init, out_shardings=state_sh.replace(compute_params=None))),
            _copy=(jax.jit(copy_fn, out_shardings=state_sh.compute_params)
                   if layout.compute_copy else None))

    @property
    def checkpoint_template(self) -> TrainState:
        """:attr:`abstract_state` as a checkpoint holds it: without the compute-dtype
        copy of the parameters (ZeRO-1's ``compute_params``), which is rebuilt from the
        master weights on restore. The saved tree is therefore the same under every
        ``parallel.strategy`` and ``parallel.expert``: a checkpoint restores onto any of
        them and any device count, resharded by orbax onto this layout. A LoRA run's frozen
        base is not saved either: the checkpoint's meta holds its :meth:`base_digest`, and
        :meth:`restored_state` reads the base again (``model.init_from``, or the seed)."""
        return self.checkpoint_state(self.abstract_state)

    def checkpoint_state(self, state: TrainState) -> TrainState:
        """``state`` as it is saved (see :attr:`checkpoint_template`)."""
        return state.replace(compute_params=None, rest=split_frozen(state.rest)[1])

    def base_digest(self, state: TrainState) -> Optional[str]:
        """The :func:`jaxmp.models.lora.base_digest` of ``state``'s frozen base (computed
        once per run: the base never changes), None without adapters."""
        if self.settings.lora is None:
            return None
        if self._digest is None:
            self._digest = base_digest(split_frozen(state.rest)[0])
        return self._digest

    def stacks(self, interleave: bool = True) -> Optional[Tuple[Tuple[int, ...], ...]]:
        """The scanned layout's stacks (:func:`jaxmp.models.layer_stacks` of the model's
        rules; ``interleave=False``: the runs alone, the layout before 460f087), None for
        an unscanned model."""
        if not self.model_config.scan_layers:
            return None
        return layer_stacks(self.model_config, model_policy_rules(self.settings.rules),
                            interleave)

    def checkpoint_adapter(self) -> Callable[[dict, Any], Any]:
        """The ``adapt`` of :meth:`jaxmp.train.checkpoint.Checkpointer.restore` for this
        run: a top-k residual saved for another device count
        (:func:`~jaxmp.train.resume.residual_adapter`) and scanned stacks saved in another
        layout (:func:`~jaxmp.train.resume.stacks_adapter`) are restored as saved;
        :meth:`restored_state` converts them."""
        return stacks_adapter(self.stacks(), self.stacks(interleave=False),
                              residual_adapter(self.num_devices, self.mesh))

    def restored_state(self, state: TrainState, meta: Optional[dict] = None) -> TrainState:
        """A state restored onto :attr:`checkpoint_template`, completed for this layout:
        with the checkpoint's ``meta`` (``Checkpointer.saved_meta``), its scanned stacks
        (:func:`jaxmp.train.resume.saved_stacks`, restored in that layout by
        :meth:`checkpoint_adapter`) re-stacked as :meth:`stacks` and put on this run's
        shardings; under ZeRO-1, the compute-dtype copy cast from the restored master
        weights (what the step that saved them had all-gathered). A LoRA run's frozen base,
        which checkpoints do not hold, is read again and checked against the digest
        ``meta`` records.

        Raises:
          ValueError: the base read now is not the one the checkpoint's adapters were
            trained on (another digest), or the checkpoint records none.
        """
        state = self._with_base(state, meta)
        stacks = self.stacks()
        if meta is not None and stacks is not None:
            moved = relayout_stacks(state, saved_stacks(meta, self.stacks(interleave=False)),
                                    stacks)
            if moved is not state:
                template = self.checkpoint_template
                state = moved.replace(**{k: jax.tree.map(
                    lambda x, t: jax.device_put(x, t.sharding), getattr(moved, k),
                    getattr(template, k)) for k in ("params", "biases", "rest", "opt_state")})
        if self._copy is None:
            return state
        return state.replace(compute_params=self._copy(state.params))

    def _with_base(self, state: TrainState, meta: Optional[dict]) -> TrainState:
        """``state`` with the frozen base, when it has none (restored from a checkpoint)."""
        if self.settings.lora is None or len(split_frozen(state.rest)[0]):
            return state
        path = self.config.model.init_from  # read now: an export sets it after create
        where = path or f"the random base of seed={self.config.seed}"
        saved = (meta or {}).get(BASE_DIGEST)
        if not isinstance(saved, str):
            raise ValueError(f"the checkpoint holds adapters but records no digest of their base "
                             f"({BASE_DIGEST!r} in its meta): it cannot be checked against {where}")
        if path and not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"this LoRA run's base model.init_from={path} holds no config.json "
                             f"(moved or deleted?): its checkpoints hold the adapters and a "
                             f"digest of the base, which is read from there; give its new "
                             f"place (python -m jaxmp.export --base DIR)")
        base = (_init_from(path, self.settings, self.mesh, self.layout, self.optimizer,
                           self.state_shardings.replace(compute_params=None))
                if path else self._init())
        frozen = split_frozen(base.rest)[0]
        digest = base_digest(frozen)
        if digest != saved:
            raise ValueError(f"the checkpoint's adapters were trained on another base than "
                             f"{where} (base digest {saved[:16]}..., this one {digest[:16]}...); "
                             f"give the model.init_from they were trained on")
        self._digest = digest  # this run's base, which its checkpoints record
        return state.replace(rest=nnx.merge_state(state.rest, frozen))

    @property
    def config(self) -> ml_collections.ConfigDict:
        """The validated, completed config."""
        return self.settings.config

    @property
    def model_config(self):
        """The :class:`~jaxmp.models.ModelConfig`."""
        return self.settings.model

    @property
    def num_devices(self) -> int:
        """Devices of the mesh (the batch is split over all of them)."""
        return self.settings.num_devices

    def init_state(self) -> TrainState:
        """The initial train state, created on the devices with its shardings (one jitted
        initialisation: no host copy of the model; under ZeRO-1 the compute copy is
        then cast from the stored master weights, as :meth:`restored_state` does)."""
        return self.restored_state(self._init())

    @functools.cached_property
    def data(self) -> DataPipeline:
        """This process's data pipeline (built on first use; reads and tokenizes the corpus).

        Raises:
          ValueError: ``model.vocab_size`` below the tokenizer's vocabulary (the message
            gives the size to set, rounded up to a multiple of 128), or a bad data setting
            or corpus (:func:`~jaxmp.train.data.create_pipeline`).
        """
        cfg = self.config
        self.check_tokenizer()
        data = create_pipeline(cfg.data, global_batch_size=cfg.train.batch_size, seed=cfg.seed,
                               process_index=jax.process_index(), process_count=jax.process_count(),
                               workdir=self.workdir, progress=self.progress)
        self._check_vocab(data.tokenizer)
        return data

    def check_init_from(self) -> None:
        """The cheap checks of ``model.init_from``'s weights, before any document is read:
        the tensors' names, shapes and dtypes from the safetensors headers, and a tied
        head against the embedding (:func:`jaxmp.models.hf.check_weights`); no other
        weight is read. Nothing without ``model.init_from``.

        Raises:
          ValueError: ``model.init_from`` is not a checkpoint directory (a config.json
            file plans a run, it does not start one), or a tensor is missing, unused,
            misshapen or not a float, or a tied head differs from the embedding (one line
            naming the file and tensor); ``lora.base=fp8`` over a checkpoint that is not
            blockwise FP8 in 128 x 128 blocks.
        """
        path = self.config.model.init_from
        if path:
            from jaxmp.models import hf

            lora = self.settings.lora
            if lora is None or lora.base != "fp8":
                hf.check_weights(path, self.model_config, self.settings.rules,
                                 target=_target_of(self.mesh))
                return
            hf.check_directory(path)  # an FP8 base: its quantization first, then the tensors
            text, _ = hf.text_config(hf.read_config(path))
            q = hf.quantization(text["model_type"], text)
            if q is None or q[0] != "fp8":
                raise ValueError(f"lora.base=fp8 needs a blockwise-FP8 base, and "
                                 f"model.init_from={path} has "
                                 f"{'no quantization_config' if q is None else q[0] + ' weights'}; "
                                 f"allowed: a checkpoint with quantization_config quant_method "
                                 f"fp8 (export --format hf --quantize fp8 writes one), or "
                                 f"lora.base=bfloat16")
            block = list(q[1]["weight_block_size"])
            if block != [128, 128]:
                raise ValueError(f"lora.base=fp8: model.init_from={path} has "
                                 f"weight_block_size {block}; allowed: [128, 128] (the "
                                 f"blocks the blockwise FP8 kernels read), or "
                                 f"lora.base=bfloat16")
            # check_weights' checks, and every projection's E4M3 form, in one read
            hf.check_fp8_base(path, self.model_config, self.settings.rules,
                              target=_target_of(self.mesh))

    def check_tokenizer(self) -> None:
        """The cheap checks of ``data.tokenizer`` against ``model.vocab_size``, before any
        document is read: ``bpe:VOCAB`` compared by its number, bytes' 257 ids, a
        ``tokenizer.json`` or ``.model`` file loaded (no BPE trained, no corpus read).

        Raises:
          ValueError: the vocabulary is larger than ``model.vocab_size`` (the message gives
            the size to set), or the file does not load.
        """
        cfg = self.config
        spec, have = cfg.data.tokenizer, self.model_config.vocab_size
        if spec.startswith("bpe:") and spec[4:].isdigit() and int(spec[4:]) > have:
            raise ValueError(vocab_problem(cfg, have, int(spec[4:])))  # before BPE training
        if spec in ("", "bytes") or spec.lower().endswith((".json", ".model")):  # no corpus read
            self._check_vocab(load_tokenizer(spec, eod_id=cfg.data.eod_id, save=False))

    def _check_vocab(self, tokenizer) -> None:
        """Raises ValueError when ``model.vocab_size`` is below ``tokenizer``'s vocabulary."""
        cfg, have = self.config, self.model_config.vocab_size
        need = tokenizer.vocab_size
        if have < need:
            raise ValueError(vocab_problem(cfg, have, need))

    def batch_to_device(self, batch: Mapping[str, np.ndarray]) -> dict:
        """A process-local ``{"inputs", "targets"}`` batch as global arrays on the mesh."""
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(v))
                for k, v in batch.items()}

    def abstract_batch(self, global_batch: Optional[int] = None,
                       keys: Optional[Sequence[str]] = None) -> dict:
        """``jax.ShapeDtypeStruct`` s of a token batch (for ``train_step.lower``): ``keys``
        (default: what the config says the data gives,
        :func:`jaxmp.train.packing.batch_keys`), int32 ``[B, seq_len]`` each, the
        ``loss_mask`` bool."""
        b = global_batch or self.config.train.batch_size
        keys = keys or packing.batch_keys(self.config.data)
        return {k: jax.ShapeDtypeStruct((b, self.config.data.seq_len),
                                        np.bool_ if k == "loss_mask" else np.int32,
                                        sharding=self.batch_sharding) for k in keys}

    def evaluate_metrics(self, state: TrainState) -> Optional[dict]:
        """Eval loss in the units people quote; None when there are no eval batches.

        Returns:
          ``{"loss": nats/token, "perplexity": exp(loss), "bits_per_byte": ...}``: the
          mean token cross-entropy (natural log), its exponential, and where the tokenizer
          knows each token's UTF-8 bytes (:attr:`DataPipeline.eval_bytes`) the summed
          cross-entropy over ``ln 2`` times the bytes the eval targets stand for (the
          end-of-document tokens' loss counts, their bytes are 0); floats.
        """
        loss = tokens = 0.0
        for batch in self.data.eval_batches:
            out = jax.device_get(self.eval_step(state, self.batch_to_device(batch)))
            loss, tokens = loss + float(out["loss"]), tokens + float(out["tokens"])
        if not tokens:
            return None
        mean = loss / tokens
        out = {"loss": mean, "perplexity": math.exp(mean) if mean < 700 else math.inf}
        if self.data.eval_bytes is not None and sum(self.data.eval_bytes):
            out["bits_per_byte"] = loss / math.log(2) / sum(self.data.eval_bytes)
        return out

    def evaluate(self, state: TrainState) -> Optional[float]:
        """Mean token cross-entropy (nats/token) over the eval batches; None when there
        are none (:meth:`evaluate_metrics` adds perplexity and bits per byte)."""
        out = self.evaluate_metrics(state)
        return None if out is None else out["loss"]

    def host_model(self, state: TrainState) -> MoETransformer:
        """The model with ``state``'s weights, on the host (for sampling)."""
        return nnx.merge(self.graphdef, *jax.device_get((state.params, state.biases, state.rest)))
