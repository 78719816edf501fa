"""Run configs: the one loader, every key with its default, and the one validation.

A run config is an ``ml_collections.ConfigDict`` with the sections ``model``,
``precision``, ``optim``, ``data``, ``train`` and a top-level ``seed`` (the Flax
examples' layout: a config file's ``get_config()`` returns it). :func:`default_config`
holds every key the trainer reads, with its default (each key is declared once, in
:mod:`jaxmp.train.keys`); a config file may leave keys out (they get these defaults) but
may not add any: a key that is not here is a typo, and :func:`validate_config` names it
with the closest valid key.

* :func:`load_config` runs a config file's ``get_config()``, completes it with every
  default and applies ``KEY=VALUE`` overrides: the one loader of ``train.py``, the
  report, the benchmarks and the tests, and the one completion of a run (a complete
  config, :func:`is_complete`, is only copied by :func:`complete_config` after).
* :func:`validate_config` checks every value before any work is done and returns the
  parsed :class:`Settings` (model shape, policy rules, loss scale, gradient
  communication), so nothing is parsed twice. The
  :class:`~jaxmp.train.experiment.Experiment` calls it once.
"""
from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import importlib.util
import json
import math
import os
import pathlib
import weakref
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import ml_collections
from flax.traverse_util import flatten_dict

from jaxmp import sharding
from jaxmp._checks import is_int, is_real
from jaxmp.models import Lora, ModelConfig
from jaxmp.precision import comm
from jaxmp.precision.loss_scale import LossScale, get_loss_scale
from jaxmp.precision.policy import PRESETS, PolicyRules, get_policy_rules
from jaxmp.train.keys import DEFAULTS, KEYS

__all__ = ["default_config", "complete_config", "is_complete", "load_config", "apply_overrides",
           "config_to_dict", "Settings", "ALLOWED", "validate_config",
           "flat_keys", "closest_key"]

_REPO = pathlib.Path(__file__).resolve().parents[2]  # where configs/ and train.py live


def default_config() -> ml_collections.ConfigDict:
    """Every key the trainer reads, with its default, locked (a new key is a typo).

    Built from :data:`jaxmp.train.keys.KEYS`, the one declaration of each key (the
    ``model.*`` keys are :class:`~jaxmp.models.ModelConfig`'s fields: ``ModelConfig()``
    is the default model, a tiny dense Transformer on bytes). A config file may start from
    it and change what differs (``configs/tiny_moe.py``); as ``ml_collections`` does for a
    locked config, setting a key that does not exist raises, naming the keys that do.
    """
    c = ml_collections.ConfigDict()
    for key in KEYS:
        section, _, leaf = key.name.rpartition(".")
        if section and section not in c:
            c[section] = ml_collections.ConfigDict()
        (c[section] if section else c)[leaf] = key.default
    c.lock()
    return c


def flat_keys(config: ml_collections.ConfigDict, prefix: str = "") -> List[str]:
    """Every leaf key of ``config`` as a dotted path (``train.steps``), in order, each
    after ``prefix``."""
    return [prefix + key for key in flatten_dict(config.to_dict(), sep=".")]


def closest_key(key: str, valid: Iterable[str]) -> Optional[str]:
    """The valid dotted key most like ``key`` (``difflib``), or None when none is close."""
    valid = list(valid)
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if not match:  # compare the last component within the same section
        section, _, leaf = key.rpartition(".")
        same = [v for v in valid if v.rpartition(".")[0] == section]
        leaves = difflib.get_close_matches(leaf, [v.rpartition(".")[2] for v in same], n=1,
                                           cutoff=0.5)
        match = [f"{section}.{leaves[0]}" if section else leaves[0]] if leaves else []
    return match[0] if match else None


def _unknown_key_error(key: str, valid: Sequence[str], where: str) -> ValueError:
    near = closest_key(key, valid)
    hint = f"; did you mean {near!r}?" if near else ""
    return ValueError(f"unknown config key {key!r} {where}{hint} (the keys are listed in "
                      f"jaxmp.train.config.default_config)")


def is_complete(config: Any) -> bool:
    """Whether ``config`` is a complete run config: a locked ``ConfigDict`` (what
    :func:`default_config`, :func:`complete_config` and :func:`load_config` return) that has
    every key."""
    return (isinstance(config, ml_collections.ConfigDict) and config.is_locked
            and sorted(flat_keys(config)) == _FLAT_KEYS)


def complete_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A copy of ``config`` with every missing key set to its default, locked (as
    :func:`default_config`: a new key raises). A config that :func:`is_complete` is only
    copied: a run completes its config once, when :func:`load_config` reads it.

    Raises:
      ValueError: ``config`` has a key that :func:`default_config` does not (a typo),
        named with the closest valid key.
    """
    if is_complete(config):
        return copy.deepcopy(config)
    defaults = default_config()
    valid = flat_keys(defaults)
    given = config.to_dict() if isinstance(config, ml_collections.ConfigDict) else dict(config)
    sections = {k for k, v in defaults.items() if isinstance(v, ml_collections.ConfigDict)}
    for key, value in given.items():
        if key in sections:
            if not isinstance(value, dict):
                raise ValueError(f"config key {key!r} must be a section (a ConfigDict), got "
                                 f"{value!r}")
            for sub in value:
                if f"{key}.{sub}" not in valid:
                    raise _unknown_key_error(f"{key}.{sub}", valid, "in the config")
        elif key not in valid:
            raise _unknown_key_error(key, valid, "in the config")
    merged = defaults.to_dict()
    for key, value in given.items():
        if key in sections:
            for sub, v in value.items():
                default = merged[key][sub]
                if isinstance(default, float) and is_int(v):
                    v = float(v)  # learning_rate=1 means 1.0: keep the key a float
                merged[key][sub] = v
        else:
            merged[key] = value
    out = ml_collections.ConfigDict(merged)
    out.lock()
    return out


def _parse_value(text: str) -> Any:
    """A Python literal (``3``, ``1e-3``, ``True``, ``'a'``, ``None``), else the text itself."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        lowered = text.strip().lower()
        if lowered in ("true", "false"):
            return lowered == "true"
        return text


def _non_finite(value: Any) -> bool:
    """``nan``, ``inf``, ``-inf`` (as text: Python has no literal for them) or a float
    literal that overflows to infinity (``1e999``)."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return False
    return isinstance(value, float) and not math.isfinite(value)


def _split_override(item: str) -> Tuple[str, str, str]:
    """``(key, "=", value)`` of an override item, ``--config.`` stripped from its key
    (``"--config.train.steps=3"`` and ``"train.steps=3"`` both give ``train.steps``)."""
    text = item[len("--config."):] if item.startswith("--config.") else item
    key, eq, value = text.partition("=")
    return key.strip(), eq, value


def apply_overrides(config: ml_collections.ConfigDict, overrides: Sequence[str],
                    where: str = "in the overrides") -> ml_collections.ConfigDict:
    """Applies ``KEY=VALUE`` strings (``train.steps=100``, optionally ``--config.`` first).

    Values are Python literals where they parse as one (numbers, ``True``, ``None``,
    quoted strings), else plain strings, and must suit the key's type (an int key takes
    an int; a float key an int or a float), as ``ml_collections.config_flags`` does.

    Raises:
      ValueError: a malformed item, an unknown key (named with the closest valid one),
        or a value of the wrong type.
    """
    valid = flat_keys(config)
    for item in overrides:
        key, eq, value = _split_override(item)
        if not eq or not key:
            raise ValueError(f"config override {item!r} must be KEY=VALUE, e.g. train.steps=100")
        if key not in valid:
            raise _unknown_key_error(key, valid, where)
        node = config
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        old, new = node[leaf], _parse_value(value)
        if isinstance(old, (int, float)) and not isinstance(old, bool) and _non_finite(new):
            raise ValueError(f"config override {key}={value!r}: the value must be a finite number "
                             f"(the key holds {old!r})")
        if isinstance(old, str) and not isinstance(new, str):
            new = value  # a string key keeps the text as given: policy "fp32" or "1"
        if isinstance(old, float) and isinstance(new, int) and not isinstance(new, bool):
            new = float(new)
        if old is not None and type(new) is not type(old) and not (
                isinstance(old, (int, float)) and new is None):
            raise ValueError(f"config override {key}={value!r}: {type(old).__name__} expected "
                             f"(the key holds {old!r}), got {type(new).__name__}")
        node[leaf] = new
    return config


def load_config(path: str | pathlib.Path, overrides: Sequence[str] = (),
                where: str = "in the overrides") -> ml_collections.ConfigDict:
    """Runs ``get_config()`` of a config file given by path, completes it, applies overrides.

    The one config loader of ``train.py`` (``--config PATH --config.KEY=VALUE``), the
    report, the benchmarks and the tests. The file's config is completed before the
    overrides, so a key the file leaves out (``parallel.strategy`` in a config written
    before it existed) can still be overridden.

    Args:
      path: e.g. ``configs/tiny_moe.py``; a relative path that does not exist from the
        current directory is looked up in the repository root (next to ``train.py``),
        so the shipped configs load from any directory.
      overrides: ``KEY=VALUE`` strings (see :func:`apply_overrides`).
      where: where the overrides come from, for the error naming an unknown key.

    Returns:
      The completed config (:func:`complete_config`); with ``model.init_from=DIR`` its
      ``model.*`` keys are DIR's config.json (see :func:`validate_config`).

    Raises:
      ValueError: the file does not exist, does not run (a syntax error, an exception),
        defines no ``get_config``, leaves ``model.init_from`` a placeholder (``None``, as
        configs/finetune.py does) that no override fills or that one fills with ``''``, or
        its ``get_config()`` raises (an exception or a ``KeyboardInterrupt`` the file's
        code raises) or returns something
        other than a ConfigDict or dict (each one line naming the file and the cause); an
        unknown key in it or in ``overrides``; a value of the wrong type.
    """
    file = pathlib.Path(path).expanduser()
    if not file.is_file() and not file.is_absolute() and (_REPO / file).is_file():
        file = _REPO / file  # configs/NAME.py from any directory: the shipped configs
    name = repr(str(path))
    if not file.is_file():
        raise ValueError(f"config file {name} does not exist")
    spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise ValueError(f"config file {name} has a syntax error at line {e.lineno}: "
                         f"{e.msg}") from None
    except (Exception, KeyboardInterrupt) as e:  # the file is the user's code: any error is
        # reported as its own (a real Ctrl-C reaches train.py's SIGINT handler, which exits)
        raise ValueError(f"config file {name} fails to run: {type(e).__name__}: "
                         f"{' '.join(str(e).split())}") from None
    if not callable(getattr(module, "get_config", None)):
        raise ValueError(f"config file {name} defines no get_config()")
    try:
        config = module.get_config()
    except (Exception, KeyboardInterrupt) as e:  # raised by the file's code (a real Ctrl-C
        # reaches train.py's own SIGINT handler, which exits at once)
        raise ValueError(f"config file {name}: get_config() raised {type(e).__name__}: "
                         f"{' '.join(str(e).split())}") from None
    if not isinstance(config, (ml_collections.ConfigDict, dict)):
        raise ValueError(f"config file {name}: get_config() returned {config!r} (a "
                         f"{type(config).__name__}); it must return an ml_collections.ConfigDict")
    given = set(_given(config)) | {_split_override(text)[0] for text in overrides}
    model = config.get("model") if hasattr(config, "get") else None
    placeholder = hasattr(model, "get") and "init_from" in model and model.get("init_from") is None
    config = apply_overrides(complete_config(config), overrides, where)
    _remember_given(config, given)
    if config.model.init_from is None:  # a placeholder: configs/finetune.py, DIR not given
        raise ValueError(f"config file {name} sets no model architecture (it comes from "
                         f"model.init_from): give --config.model.init_from=DIR, a Hugging "
                         f"Face checkpoint directory")
    if placeholder and not config.model.init_from.strip():  # e.g. an unset shell variable
        raise ValueError(f"model.init_from={config.model.init_from!r} is empty, and config file "
                         f"{name} takes its model from it: give --config.model.init_from=DIR, "
                         f"a Hugging Face checkpoint directory (an empty value would train a "
                         f"random model)")
    if config.model.init_from:  # the architecture from DIR, checked against what is set
        _apply_init_from(config, {k: _get(config, k) for k in given if _has(config, k)})
    return config


def _has(config: ml_collections.ConfigDict, key: str) -> bool:
    try:
        _get(config, key)
        return True
    except (KeyError, AttributeError):
        return False


def config_to_dict(config: ml_collections.ConfigDict) -> dict:
    """The config as plain JSON-compatible data (stored in checkpoints)."""
    return json.loads(config.to_json_best_effort(sort_keys=True))


@dataclasses.dataclass(frozen=True)
class Settings:
    """What :func:`validate_config` parsed, so that nothing is parsed twice.

    Attributes:
      config: the completed config (every key present).
      model: the :class:`~jaxmp.models.ModelConfig`.
      rules: the user's :class:`~jaxmp.precision.policy.PolicyRules` (before the model
        adds its float32 islands).
      loss_scale: the initial loss scale.
      comm: the gradient-communication settings as given (``grad_reduce_dtype``,
        ``grad_compression``, ``topk_ratio``), checked by
        :func:`jaxmp.comm.check_comm_config`.
      num_devices: devices of the mesh (the batch is split over all of them).
      layout: the :class:`jaxmp.sharding.Layout` of ``parallel.strategy``,
        ``parallel.expert`` and ``parallel.dispatch_dtype``.
      reduce_dtype: ``precision.grad_reduce_dtype`` as a ``jnp.dtype``.
      lora: the ``lora.*`` section as a :class:`jaxmp.models.Lora`, or None
        (``lora.rank=0``: the whole model trains).
    """

    config: ml_collections.ConfigDict
    model: ModelConfig
    rules: PolicyRules
    loss_scale: LossScale
    comm: Dict[str, Any]
    num_devices: int
    layout: Any = None
    reduce_dtype: Any = None
    lora: Optional[Lora] = None


# Every checked key and what it allows (each key's declaration in jaxmp.train.keys, the
# model.* keys' in ModelConfig's fields); train.* are checked first (the batch split needs
# them), then the others in the order of KEYS. The keys without a spec are parsed whole
# below (the policy, the loss scale, the gradient communication, the parallel layout).
ALLOWED: Dict[str, Any] = {k.name: k.allowed for k in sorted(
    KEYS, key=lambda k: not k.name.startswith("train.")) if k.allowed is not None}
_FLAT_KEYS = sorted(DEFAULTS)


def _get(config: ml_collections.ConfigDict, key: str) -> Any:
    node = config
    for part in key.split("."):
        node = node[part]
    return node


def _check_table(config: ml_collections.ConfigDict, keys: Sequence[str]) -> None:
    for key in keys:
        value, spec = _get(config, key), ALLOWED[key]
        if not spec.ok(value):
            raise ValueError(f"{key}={value!r} is not allowed; it must be {spec.allowed}")


def _check_lora(config: ml_collections.ConfigDict, model: ModelConfig,
                rules: PolicyRules) -> Optional[Lora]:
    """The ``lora.*`` section as a :class:`~jaxmp.models.Lora` (None at rank 0, where a
    ``lora.alpha``, ``lora.targets`` or ``lora.base`` the config gives is refused: it would
    not be used), refusing what adapters cannot take: router biases that move (``model.bias_update_rate``; a
    PEFT adapter cannot carry them) and an FP8 base under an FP8 recipe other than
    blockwise (an FP8 base that is not a blockwise-FP8 checkpoint is refused by
    :meth:`jaxmp.train.Experiment.check_init_from`)."""
    c = config.lora
    if not c.rank:
        given = _given(config)
        unused = [k for k in ("lora.alpha", "lora.targets", "lora.base") if k in given]
        if unused:
            raise ValueError(f"{unused[0]}={given[unused[0]]!r} is set with lora.rank=0 (no "
                             f"adapters: every parameter trains); set lora.rank > 0, or leave "
                             f"{unused[0]} out")
        return None
    lora = Lora(rank=int(c.rank), alpha=float(c.alpha), targets=Lora.parse_targets(c.targets),
                base=c.base)
    recipes = {p.fp8.name for p in [rules.default, *(p for _, p in rules.rules)]
               if p.fp8 is not None}
    if lora.base == "fp8" and recipes - {"blockwise"}:
        raise ValueError(f"lora.base=fp8 with precision.policy={config.precision.policy!r}, whose "
                         f"FP8 recipe is {sorted(recipes - {'blockwise'})[0]}: the frozen E4M3 "
                         f"base is read by the blockwise products; allowed: a policy without FP8 "
                         f"(the base product is blockwise FP8 anyway) or fp8_blockwise")
    if model.bias_update_rate:
        raise ValueError(f"lora.rank={c.rank} with model.bias_update_rate="
                         f"{model.bias_update_rate!r}: the router biases are part of the frozen "
                         f"base (a PEFT adapter cannot carry them); set model.bias_update_rate=0")
    return lora


def validate_config(config: ml_collections.ConfigDict,
                    num_devices: Optional[int] = None) -> Settings:
    """Checks every setting of a run before any work is done; returns what it parsed.

    Each key of :data:`ALLOWED` is checked against its entry, then what takes parsing
    (the policy, the loss scale, the gradient communication, the model, the parallel
    layout) is parsed once, and the keys that constrain each other are checked together.

    Args:
      config: a run config (missing keys take :func:`default_config`'s values; a
        complete one, :func:`is_complete`, is not completed again).
      num_devices: devices of the mesh, ``data`` times ``expert`` (the batch is split
        over all of them); None: ``train.num_devices``, or all devices when it is 0.

    Returns:
      The :class:`Settings`.

    With ``model.init_from=DIR`` the architecture keys (``model.*`` but the run's own,
    :data:`jaxmp.models.hf.RUNTIME_FIELDS`: ``max_len``, ``attention``, ``moe_kernel``,
    ``scan_layers``, ``remat``, ``capacity_factor``, ``aux_loss_weight``,
    ``bias_update_rate``; ``max_len`` and the two balancing keys take DIR's values unless
    given) are DIR's config.json's (:func:`jaxmp.models.hf.config_from_hf`): one that the
    config sets to another value is an error; DIR's ``tokenizer.json`` is the data
    tokenizer unless ``data.tokenizer`` is set.

    Raises:
      ValueError: an unknown key (named with the closest valid one); a value outside
        its :data:`ALLOWED` entry; the global batch cannot be split into
        ``grad_accum_steps`` micro-batches that the devices divide; a bad model shape
        or value (e.g. heads not dividing the width, top-k above the number of
        experts), policy, loss scale, data setting or gradient communication; a
        parallel layout that the devices or the model cannot take (``parallel.expert``
        not dividing the devices or the experts, expert parallelism without capacity
        dispatch, ``parallel.dispatch_dtype`` other than ``compute`` without expert
        parallelism, zero1/fsdp with ``d_model`` not divisible by the data axis, top-k
        compression outside data parallelism). The message names the value and what is
        allowed.
    """
    given = _given(config)
    config = complete_config(config)  # a copy only, for a config that load_config read
    _check_table(config, ["model.init_from"])  # read as a path below
    _apply_init_from(config, given)  # a second time (after load_config) changes nothing
    t, d, p = config.train, config.data, config.precision
    if num_devices is None:
        _check_table(config, ["train.num_devices"])
        num_devices = t.num_devices or len(jax.devices())
    keys = list(ALLOWED)
    after = sum(k.startswith("train.") for k in keys)  # the batch split is checked after train.*
    _check_table(config, keys[:after])
    if t.batch_size % t.grad_accum_steps:
        raise ValueError(f"train.batch_size={t.batch_size} is not divisible by "
                         f"train.grad_accum_steps={t.grad_accum_steps}")
    micro = t.batch_size // t.grad_accum_steps
    if micro % num_devices:
        raise ValueError(
            f"the micro-batch of {micro} sequences (train.batch_size={t.batch_size} / "
            f"train.grad_accum_steps={t.grad_accum_steps}) is not divisible by the "
            f"{num_devices} devices of the mesh; use a multiple of {num_devices}")
    _check_table(config, keys[after:])
    lr, wd = config.optim.learning_rate, config.optim.weight_decay
    # AdamW's decoupled decay (Loshchilov & Hutter 2019, Algorithm 2) multiplies every weight
    # by 1 - lr * wd each step. A decay coefficient of 1 or more that takes this factor to
    # zero or below flips or grows the weights instead of shrinking them. (A learning rate
    # so large that it does so with a small coefficient is left to the divergence guard.)
    if wd >= 1 and lr * wd >= 1:
        raise ValueError(f"optim.weight_decay={wd!r} with optim.learning_rate={lr!r} is not "
                         f"allowed: the decay multiplies every weight by 1 - learning_rate * "
                         f"weight_decay = {1 - lr * wd:.3g} each step (past zero: it flips or "
                         f"grows the weights); it must be below 1 / learning_rate = {1 / lr:.3g}")
    model = ModelConfig.from_config(config.model)
    if d.seq_len > model.max_len:
        raise ValueError(f"data.seq_len={d.seq_len} exceeds model.max_len={model.max_len}"
                         + (" (model.init_from's max_position_embeddings unless given): give "
                            "a smaller data.seq_len, or model.max_len (RoPE is not trained "
                            "beyond the base's)" if config.model.get("init_from") else ""))
    if not isinstance(p.policy, str) or not p.policy.strip():
        raise ValueError(f"precision.policy={p.policy!r} is not allowed; it must name a preset "
                         f"({', '.join(PRESETS)}) or a dtype, with optional 'MODULE: POLICY' rules")
    rules = get_policy_rules(p.policy)
    _check_update_rounding(config.optim.update_rounding, rules)
    try:
        loss_scale = get_loss_scale(p.loss_scale)
    except ValueError as e:  # its message names the value and the kinds: add the key
        raise ValueError(f"precision.loss_scale={p.loss_scale!r}: {e}") from None
    comm_kwargs = dict(grad_reduce_dtype=p.grad_reduce_dtype, grad_compression=p.grad_compression,
                       topk_ratio=p.topk_ratio)
    try:
        reduce_dtype = comm.check_comm_config(**comm_kwargs)
    except ValueError as e:
        raise ValueError(f"precision: {e}") from None
    layout = _check_parallel(config, model, int(num_devices))
    lora = _check_lora(config, model, rules)
    return Settings(config=config, model=model, rules=rules, loss_scale=loss_scale, lora=lora,
                    comm=comm_kwargs, num_devices=int(num_devices), layout=layout,
                    reduce_dtype=reduce_dtype)


# The keys that the file and the command line gave each config :func:`load_config`
# returned, by the config's id (with a weak reference, so that a reused id is told apart).
# A complete config cannot tell a value given from an equal default; a value the user gave
# is the user's all the same (``data.tokenizer=bytes`` beside ``model.init_from``).
_GIVEN_KEYS: Dict[int, Tuple[Any, frozenset]] = {}


def _remember_given(config: ml_collections.ConfigDict, keys: Iterable[str]) -> None:
    ident = id(config)
    ref = weakref.ref(config, lambda _, ident=ident: _GIVEN_KEYS.pop(ident, None))
    _GIVEN_KEYS[ident] = (ref, frozenset(keys))


def _given(config) -> Dict[str, Any]:
    """The dotted keys the config file or command line sets, with their values: those it
    has, or for a complete config (one built from :func:`default_config`) those that
    differ from their defaults, and those :func:`load_config` was given (even where
    equal to the default)."""
    data = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    given = flatten_dict(data, sep=".")
    if is_complete(config):
        entry = _GIVEN_KEYS.get(id(config))
        named = entry[1] if entry is not None and entry[0]() is config else frozenset()
        given = {k: v for k, v in given.items() if v != DEFAULTS[k] or k in named}
    return given


def _apply_init_from(config: ml_collections.ConfigDict, given: Dict[str, Any]) -> None:
    """With ``model.init_from=DIR``: the ``model.*`` architecture keys from DIR's config.json
    (:func:`jaxmp.models.hf.config_from_hf`), the data tokenizer from DIR's
    ``tokenizer.json`` unless ``data.tokenizer`` is set.

    Raises:
      ValueError: a ``model.*`` key the config sets that contradicts DIR's config.json, or
        a config.json that cannot be represented (one line, named).
    """
    path = config.model.init_from
    if not path:
        return
    # Absolute, as provenance: the run's readers need nothing from DIR (the architecture is
    # the run's config, the weights its checkpoints, the tokenizer its own copy).
    path = config.model.init_from = os.path.abspath(os.path.expanduser(path))
    from jaxmp.models import hf

    arch = hf.config_from_hf(hf.read_config(path))
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    for field in defaults:
        key = f"model.{field}"
        if field in hf.RUNTIME_FIELDS:  # the run's, but max_len and the balancing from DIR
            if key not in given and field in ("max_len", "aux_loss_weight", "bias_update_rate") \
                    and field in arch:
                config.model[field] = arch[field]
            continue
        want = arch.get(field, defaults[field])
        if key in given:
            have = given[key]
            same = (have == want or (isinstance(want, float) and is_real(have)
                                     and math.isclose(have, want))
                    or (field == "mlp_only_layers" and tuple(have) == tuple(want)))
            if not same:
                raise ValueError(f"{key}={have!r} contradicts {path}/config.json ({want!r}); "
                                 f"leave it unset with model.init_from")
        config.model[field] = tuple(want) if isinstance(want, list) else want
    if "data.tokenizer" not in given:
        found = hf.tokenizer_eos(path)
        if found is not None:
            config.data.tokenizer = found[0]
            if found[1] is not None and "data.eod_id" not in given:
                config.data.eod_id = found[1]


def _check_update_rounding(rounding: str, rules: PolicyRules) -> None:
    """Stochastic or Kahan rounding needs a policy that stores some parameter in 16 bits."""
    policies = [rules.default] + [policy for _, policy in rules.rules]
    if rounding != "nearest" and all(jnp.dtype(q.param_dtype).itemsize >= 4 for q in policies):
        raise ValueError(f"optim.update_rounding={rounding!r} rounds bfloat16/float16 "
                         f"parameters, but precision.policy={str(rules)!r} keeps every parameter "
                         f"in float32; use a policy with bfloat16 params (e.g. 'pure_bf16; "
                         f"router: fp32; norm: fp32') or optim.update_rounding='nearest'")


def _check_parallel(config, model: ModelConfig, num_devices: int):
    """The parallel layout, after checking the devices and the model can take it."""
    par = config.parallel
    layout = sharding.layout(par.strategy, par.expert, par.dispatch_dtype)  # names a bad value
    x = layout.expert
    if num_devices % x:
        raise ValueError(
            f"parallel.expert={x} does not divide the {num_devices} devices; allowed: "
            f"{', '.join(str(d) for d in range(1, num_devices + 1) if num_devices % d == 0)}")
    if layout.dispatch_dtype != comm.DEFAULT_DISPATCH_DTYPE and x == 1:
        raise ValueError(f"parallel.dispatch_dtype={layout.dispatch_dtype!r} sets the dtype of the "
                         f"expert-parallel all-to-all; it needs parallel.expert > 1")
    data = num_devices // x
    if x > 1:
        if model.num_moe_layers == 0:
            raise ValueError(f"parallel.expert={x}: the model has no MoE layer "
                             f"(model.num_experts=0)")
        if model.num_experts % x:
            raise ValueError(f"parallel.expert={x} does not divide "
                             f"model.num_experts={model.num_experts}")
        if not model.capacity_factor:
            raise ValueError(f"parallel.expert={x}: expert parallelism exchanges fixed-size slots; "
                             "set model.capacity_factor > 0 (e.g. 2.0), or parallel.expert=1 for "
                             "dropless")
    if layout.declared.splits_state and model.d_model % data:
        raise ValueError(f"parallel.strategy={layout.strategy!r} splits every parameter's d_model "
                         f"axis over the {data} devices of the data axis, which do not divide "
                         f"model.d_model={model.d_model}")
    if config.precision.grad_compression == "topk" and (layout.declared.splits_state or x > 1):
        raise ValueError(f"precision.grad_compression='topk' runs with parallel.strategy='dp' and "
                         f"parallel.expert=1, not {layout.strategy!r} and {x}")
    return layout
