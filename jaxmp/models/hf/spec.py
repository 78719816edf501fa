"""The language of a family's record: how a ``config.json`` field is read (:class:`Field`),
what a family is (:class:`Family`), the specs fields share, and the one-line messages.

Each family module in :mod:`jaxmp.models.hf.families` builds its :class:`Family` from these;
:mod:`jaxmp.models.hf.config` reads a ``config.json`` through it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Dict, Optional, Tuple

from jaxmp._checks import BOOL, F32_MAX, Choice, Int, Kind, Real, is_int

__all__ = ["Field", "Family", "WINDOWS", "FEATURES", "MAX_LISTED_LAYERS", "WRAPPER_SPECS", "IGNORED_FIELDS", "NEEDED", "ABSENT", "REFUSED", "fixed",
           "common_specs", "COMMON_FIELDS", "COUNT", "COUNT0", "POSITIVE", "OBJECT", "STRING",
           "NAMES", "INDICES", "short", "field_name", "inexact", "not_allowed", "missing",
           "non_finite", "read_field"]

# Fields that do not change what the model computes in jaxmp (training or generation
# settings of transformers, metadata).
IGNORED_FIELDS = frozenset({
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version",
    "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "initializer_range",
    "output_router_logits", "router_aux_loss_coef", "aux_loss_alpha", "seq_aux",
    "_name_or_path", "tokenizer_class", "auto_map", "ep_size",
    "return_dict", "output_hidden_states", "output_attentions", "tie_encoder_decoder",
    "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
    "problem_type", "max_window_layers", "qk_head_dim", "head_dim_for_mla",
})


# How a family reads a sliding window (Family.window).
WINDOWS = ("", "uniform", "layered")

# Architecture features that only some families have, each a test of a ModelConfig
# (Family.features): a family is chosen for a model (family_of) only when it has every
# feature the model uses, so a feature added for one family needs no other family's
# ``maps`` to exclude it.
FEATURES: Dict[str, Callable[[Any], bool]] = {
    "norm_plus_one": lambda c: c.norm_plus_one,
    "post_norms": lambda c: c.post_norms,
    "embed_scale": lambda c: c.embed_scale != 1.0,
    "query_pre_attn_scalar": lambda c: c.query_pre_attn_scalar != 0,
    "mlp_activation": lambda c: c.mlp_activation != "silu",
    "rope_local_theta": lambda c: c.rope_local_theta != 0,
    "o_bias": lambda c: c.o_bias,
    "attention_sinks": lambda c: c.attention_sinks,
    "moe_bias": lambda c: bool(c.num_experts and c.moe_bias),
    "expert_activation": lambda c: bool(c.num_experts and c.expert_activation != "silu"),
    "linear_attention": lambda c: "linear_attention" in c.layer_types,
    "attention_output_gate": lambda c: c.attention_output_gate,
    "shared_expert_gate": lambda c: bool(c.num_experts and c.shared_expert_gate),
    "linear_projections": lambda c: ("linear_attention" in c.layer_types
                                     and c.linear_projections != "grouped"),
}

# The most layers a config.json may have where its sliding and global layers are listed
# one by one (no released model has a thousand; a file announcing 2**31 must not allocate
# a list of them before its tensors are looked at).
MAX_LISTED_LAYERS = 1 << 20

NEEDED = type("_Needed", (), {"__repr__": lambda self: "NEEDED"})()
ABSENT = type("_Absent", (), {"__repr__": lambda self: "ABSENT"})()
REFUSED = type("_Refused", (), {"__repr__": lambda self: "REFUSED"})()


@dataclasses.dataclass(frozen=True)
class Field:
    """How one ``config.json`` field is read (an entry of :attr:`Family.specs`).

    Attributes:
      allowed: the values it may hold, a :mod:`jaxmp._checks` spec (``Int``, ``Real``,
        ``Choice``, ``Kind``, ``BOOL``): integers are never bools, reals are finite.
      default: its value when config.json leaves it out, transformers' default for the
        family (None: as if ``null``); ``NEEDED``: required (transformers has no default,
        or it is a shape field); ``ABSENT``: not read when left out (an alias).
      null: what a JSON ``null`` stands for (``REFUSED``: null is not allowed).
      exact: ``allowed`` lists the only values jaxmp computes exactly (a value outside it
        "cannot be represented exactly" rather than being ill-typed).
    """

    allowed: Any
    default: Any = NEEDED
    null: Any = REFUSED
    exact: bool = False


_MAX_INT = 2 ** 31 - 1  # every count and size is an int32 array dimension or position
COUNT = Int(1, _MAX_INT)
COUNT0 = Int(0, _MAX_INT)
POSITIVE = Real(0.0, lo_open=True)
# An epsilon the float32 norms add: finite in float32 (1e308 would be inf there).
EPS = Real(0.0, F32_MAX, lo_open=True, text="a finite number > 0 that float32 holds")
OBJECT = Kind(lambda v: isinstance(v, dict), "a JSON object {...} or null")
STRING = Kind(lambda v: isinstance(v, str), "a string")
NAMES = Kind(lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v),
              "a list of strings or null")
INDICES = Kind(lambda v: isinstance(v, list) and all(is_int(i) and 0 <= i <= _MAX_INT
                                                     for i in v),
                "a list of layer indices (integers >= 0) or null")


def fixed(*values: Any, text: Optional[str] = None) -> Field:
    """A field with the only value(s) jaxmp computes; absent means the first."""
    return Field(Choice(values, text or " or ".join(map(repr, values))), values[0],
                 exact=True)


# The fields every multimodal wrapper (Family.text_of) reads: its text model's config,
# the vision config it skips, and the text model's quantization, which transformers
# writes on the wrapper.
WRAPPER_SPECS = {"text_config": Field(OBJECT, None, null={}),
                 "vision_config": Field(OBJECT, None, null={}),
                 "quantization_config": Field(OBJECT, None, null=None)}


def common_specs(*, max_len: int, kv_heads: Optional[int] = None, head_dim: Optional[int] = None,
           eps: float = 1e-6, theta: float = 10000.0, partial: float = 1.0,
           d_ff: Any = COUNT, window: Optional[int] = None, window_switch: Any = ABSENT,
           windows: bool = False, mtp: int = 0, **extra: Field) -> Dict[str, Field]:
    """A family's :attr:`Family.specs`: the fields every family reads, with the
    family's transformers defaults (``max_len``: ``max_position_embeddings``, ``eps``:
    ``rms_norm_eps``, ``window``: ``sliding_window``, ``window_switch``:
    ``use_sliding_window``, ``mtp``: ``num_nextn_predict_layers``), and ``extra``.
    ``windows``: the family computes sliding windows (:attr:`Family.window`), so
    ``use_sliding_window`` may be true; else only false is exact."""
    specs = {
        "vocab_size": Field(COUNT), "hidden_size": Field(COUNT),
        "num_hidden_layers": Field(COUNT), "num_attention_heads": Field(COUNT),
        "num_key_value_heads": Field(COUNT, kv_heads, null=0),  # 0: num_attention_heads
        "head_dim": Field(COUNT, head_dim, null=0),  # 0: hidden_size / num_attention_heads
        "intermediate_size": Field(d_ff),
        "max_position_embeddings": Field(COUNT, max_len),
        "rms_norm_eps": Field(EPS, eps),
        "tie_word_embeddings": Field(BOOL, False),
        "rope_theta": Field(POSITIVE, theta),
        "partial_rotary_factor": Field(Real(0.0, 1.0, lo_open=True), partial),
        "rope_scaling": Field(OBJECT, None, null={}),
        "rope_parameters": Field(OBJECT, None, null={}),
        "layer_types": Field(NAMES, None, null=[]),
        # MTP layers (DeepSeek-V3, GLM-4.5) are not read; their tensors are skipped.
        "num_nextn_predict_layers": Field(COUNT0, mtp, null=0),
        "hidden_act": fixed("silu"), "attention_dropout": fixed(0.0, 0),
        "mlp_bias": fixed(False), "pretraining_tp": fixed(1),
        "router_jitter_noise": fixed(0.0, 0),
        "sliding_window": Field(COUNT, window, null=None),
        # Quantized weights (DeepSeek-V3's FP8, GPT-OSS's MXFP4) are refused by the reader
        # in its own words (hf.config.config_from_hf), not as an unknown field.
        "quantization_config": Field(OBJECT, None, null=None),
        "use_sliding_window": (Field(BOOL, window_switch) if windows else
                               Field(Choice((False,), "False"), window_switch, exact=True)),
    }
    specs.update(extra)
    return specs


# The config.json fields every family maps to ModelConfig fields of the same meaning.
COMMON_FIELDS = {"vocab_size": "vocab_size", "hidden_size": "d_model",
                 "num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
                 "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim",
                 "intermediate_size": "d_ff", "max_position_embeddings": "max_len",
                 "rms_norm_eps": "norm_eps", "tie_word_embeddings": "tie_embeddings"}


@dataclasses.dataclass(frozen=True)
class Family:
    """One ``model_type``: the record a family module declares, all that is its own.

    The shared reader and writer (:mod:`jaxmp.models.hf.config`, :mod:`~jaxmp.models.hf.load`,
    :mod:`~jaxmp.models.hf.save`) read every family through these attributes alone; the
    tensor names of attention, dense MLPs and norms are transformers' common ones
    (:mod:`jaxmp.models.hf.layout`), and ``moe`` names the rest.

    Attributes:
      model_type: ``config.json``'s ``model_type`` (the key of :data:`FAMILIES`).
      architecture: the ``architectures`` entry written (``LlamaForCausalLM``, ...).
      summary: one line for the docs: the models and features the family covers.
      fields: ``{config.json field: ModelConfig field}`` read as they are.
      fixed: ModelConfig fields the family always has (``qk_norm=True`` for Qwen3).
      moe: the MoE tensor names ``{"block": ..., "experts": (gate, up, down), "router": ...,
        "bias": ..., "shared": ...}`` (None: a dense family); ``"bias"`` present means the
        family stores a router bias (DeepSeek-V3's ``e_score_correction_bias``);
        ``"fused": True`` means the experts are stored stacked, ``experts.gate_up_proj``
        ``[E, d, 2 * d_expert]`` with gate and up columns interleaved and
        ``experts.down_proj`` ``[E, d_expert, d]`` (GPT-OSS), with their ``_bias``
        tensors where the model has ``moe_bias`` (and ``experts`` is not given). ``"shared_gate"``: the name of the shared experts' gate
        (Qwen3-Next's ``shared_expert_gate``, ``[1, d]``).
      specs: ``{config.json field: Field}``, every field the family reads (``fields`` and
        those its hooks read): its type, range and default. A field neither here nor in
        :data:`IGNORED_FIELDS` is refused.
      read: ``read(vals, hf, out)``: the family's own reading, after the shared one has
        mapped ``fields`` and ``fixed`` into ``out`` (``vals``: the checked fields with
        their defaults, ``hf``: the file as given); edits ``out`` in place or raises a
        one-line ``ValueError``. None: nothing more.
      write: ``write(config, hf)``: the fields the family writes beyond ``fields`` (edits
        ``hf`` in place). None: nothing more.
      maps: ``maps(config) -> bool``: whether ``config``'s architecture is this family's
        (:func:`jaxmp.models.hf.family_of`; exactly one family maps any architecture that
        one can hold). None: never chosen by itself (a family that writes the same files
        as another with nothing of its own).
      partial_rotary: transformers' model of the family rotates only
        ``partial_rotary_factor`` of each head (GLM-4.5); False: it rotates the whole head
        whatever the field says, so a factor other than 1 cannot be represented.
      window: how transformers' model of the family reads a sliding window
        (:data:`WINDOWS`): ``""`` it has none (``sliding_window`` must be null, every
        ``layer_types`` entry ``full_attention``); ``"uniform"`` every layer slides by
        ``sliding_window`` (Mistral, Mixtral, Qwen3-MoE; ``use_sliding_window`` where
        the family has that switch), and ``layer_types``, which it does not read, must
        agree; ``"layered"`` the layers ``layer_types`` names slide, or without it those
        from ``max_window_layers`` on (Qwen2, Qwen3), when ``use_sliding_window`` is true
        (Gemma 3, whose specs hold ``sliding_window_pattern``: every layer but each
        ``pattern``-th, with no switch).
      features: the names of :data:`FEATURES` the family has; a model using another is
        not the family's (:func:`~jaxmp.models.hf.family_of`).
      text_of: a multimodal wrapper (Gemma 3's ``gemma3``): its ``text_config`` is a
        config.json of family ``text_of``, which is what jaxmp reads (the wrapper's own
        fields are checked by ``specs``), and its text model's tensors are those named
        under one of ``text_prefixes`` (the checkpoint's other tensors, the vision tower's
        and the projector's, are skipped with a warning). ``""``: a text family.
      text_prefixes: ``((prefix, head), ...)``: where a wrapper's checkpoint keeps the
        text model's ``model.*`` tensors and its ``lm_head.weight``, one pair per naming
        transformers has used.
      mtp_prefix: where the family keeps its multi-token-prediction layers, which are not
        read (Qwen3-Next's and Qwen3.5's ``mtp.``, which transformers ignores too); ``""``:
        they are the ``model.layers.{n}..`` after the model's (DeepSeek-V3's
        ``num_nextn_predict_layers``), or there are none.
      quantization: the ``quantization_config.quant_method`` values whose weights the
        loader dequantizes: blockwise ``"fp8"`` (E4M3 ``weight`` and ``weight_scale_inv``
        per ``nn.Linear``: :meth:`~jaxmp.models.hf.files.Files.take_fp8`), GPT-OSS's
        ``"mxfp4"`` experts (:meth:`~jaxmp.models.hf.files.Files.take_mxfp4`); any
        other is refused.
    """

    model_type: str
    architecture: str
    summary: str
    fields: Dict[str, str]
    fixed: Dict[str, Any]
    moe: Optional[Dict[str, Any]] = None
    specs: Dict[str, Field] = dataclasses.field(default_factory=dict)
    read: Optional[Callable[[Dict[str, Any], Dict[str, Any], Dict[str, Any]], None]] = None
    write: Optional[Callable[[Any, Dict[str, Any]], None]] = None
    maps: Optional[Callable[[Any], bool]] = None
    partial_rotary: bool = False
    window: str = ""
    features: frozenset = frozenset()
    text_of: str = ""
    text_prefixes: Tuple[Tuple[str, str], ...] = ()
    quantization: Tuple[str, ...] = ("fp8",)
    mtp_prefix: str = ""

    def __post_init__(self):
        unknown = set(self.features) - set(FEATURES)
        if unknown:
            raise ValueError(f"family {self.model_type}: features {sorted(unknown)}; allowed: "
                             f"{', '.join(FEATURES)}")
        if self.window not in WINDOWS:
            raise ValueError(f"family {self.model_type}: window={self.window!r}; allowed: "
                             f"{', '.join(map(repr, WINDOWS))}")
        extra = set(self.fields) - set(self.specs)  # every field a family maps is in its table
        if extra:
            raise ValueError(f"family {self.model_type}: fields {sorted(extra)} have no spec")


# ---- reading a field, and the one-line messages ------------------------------------------


def short(value: Any, limit: int = 80) -> str:
    """``repr(value)`` on one line, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def field_name(key: Any) -> str:
    """A field's name for a one-line message (``repr`` when it is not printable text)."""
    return key if isinstance(key, str) and key.isprintable() else repr(key)


def inexact(model_type: str, field: str, value: Any, allowed: str) -> ValueError:
    """The one line of a value jaxmp cannot compute exactly (a sliding window, ...)."""
    return ValueError(f"config.json ({model_type}): {field}={short(value)} cannot be "
                      f"represented exactly; allowed: {allowed}")


def not_allowed(model_type: str, field: str, value: Any, allowed: str) -> ValueError:
    """The one line of an ill-typed, null or out-of-range value."""
    return ValueError(f"config.json ({model_type}): {field}={short(value)} is not allowed; "
                      f"allowed: {allowed}")


def missing(model_type: str, field: str, allowed: str, why: str = "") -> ValueError:
    """The one line of a required field left out."""
    return ValueError(f"config.json ({model_type}): {field} is missing{why}; it is required "
                      f"(allowed: {allowed})")


def non_finite(data: Any) -> Optional[Tuple[str, Any]]:
    """``(path, value)`` of the first non-finite number (NaN, Infinity) anywhere in parsed
    JSON ``data`` (``rope_scaling.factor``, ``mlp_only_layers[2]``), else None."""
    stack = [("", data)]
    while stack:
        path, x = stack.pop()
        if isinstance(x, float) and not math.isfinite(x):
            return path or "(the whole file)", x
        if isinstance(x, dict):
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in
                         reversed(list(x.items())))
        elif isinstance(x, list):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(x))))
    return None


def read_field(model_type: str, name: str, spec: Field, present: bool, value: Any) -> Any:
    """The checked value of one field (``present``: config.json gives ``value``), its
    default when absent, what null stands for when null; ``ABSENT`` when not read."""
    if not present:
        if spec.default is NEEDED:
            raise missing(model_type, name, spec.allowed.allowed)
        if spec.default is ABSENT:
            return ABSENT
        value = spec.default
    if value is None:
        if spec.null is REFUSED:
            raise not_allowed(model_type, name, None, spec.allowed.allowed)
        return spec.null
    if not spec.allowed.ok(value):
        raise (inexact if spec.exact else not_allowed)(model_type, name, value,
                                                       spec.allowed.allowed)
    return value

