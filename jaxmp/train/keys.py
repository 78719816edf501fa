"""Every run-config key, declared once: its default, the values it allows and its meaning.

The ``model.*`` keys are the fields of :class:`jaxmp.models.ModelConfig` (each declared
there by :func:`jaxmp._checks.option`; models cannot import the trainer, so the trainer
reads them) plus ``model.init_from``; every other key is declared here. A key's type is its
default's. :func:`jaxmp.train.config.default_config` is built from :data:`KEYS`,
:data:`jaxmp.train.config.ALLOWED` (the checks of :func:`~jaxmp.train.config.validate_config`)
is read from it, ``python train.py --help`` prints it (:func:`help_text`) and
``docs/CONFIG.md`` is generated from it (:func:`markdown`; a test checks the file is
current), so none of them can disagree.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any, NamedTuple, Tuple

import numpy as np

from jaxmp._checks import F32_MAX, Choice, Int, Kind, Real, is_real
from jaxmp import sharding
from jaxmp.models import ModelConfig, lora
from jaxmp.precision import comm
from jaxmp.precision.loss_scale import DynamicLossScale
from jaxmp.precision.optim import UPDATE_ROUNDINGS
from jaxmp.precision.policy import canonical_dtype
from jaxmp.train.optimizer import SCHEDULES
from jaxmp.train import packing
from jaxmp.train.step import LOSS_SPIKE_FLOOR, DivergenceCheck
from jaxmp.train.tokenizer import BPE_MIN_VOCAB

__all__ = ["Key", "KEYS", "DEFAULTS", "help_text", "markdown"]


class Key(NamedTuple):
    """One config key: dotted ``name``, ``default``, a one-line ``meaning`` and the spec of
    the values it allows (:mod:`jaxmp._checks`; None: parsed whole by the validator, e.g.
    the policy, the loss scale, the parallel layout)."""

    name: str
    default: Any
    meaning: str
    allowed: Any = None


_I32_MAX = 2**31 - 1  # the train state's step counters are int32
_STEPS = Int(1, _I32_MAX, "an integer in [1, 2**31 - 1] (the train state counts steps in int32)")
_COUNT = Int(1)
_SPIKE = Kind(lambda v: is_real(v) and (v == 0 or 1 < v < math.inf),
              "0 (off) or a finite number > 1")
_UNIT_OPEN = Real(0, 1, hi_open=True, text="in [0, 1)")
# Adam's betas are applied in float32: a value in [0, 1) that float32 rounds to 1.0 (above
# 1 - 2**-25) stops the moments from learning and makes every step's update 0 / 0.
_BETA = Kind(lambda v: _UNIT_OPEN.ok(v) and float(np.float32(v)) < 1.0,
             "in [0, 1) as float32 holds it (at most 1 - 2**-24 = 0.99999994; float32 "
             "rounds anything above 1 - 2**-25 to 1.0)")
_MOMENT_DTYPE = Kind(lambda v: not v or canonical_dtype(v) is not None,
                     "'' (the master dtype) or a dtype name such as bfloat16")


def _is_text(v: Any) -> bool:
    """A str that UTF-8 encodes: not one holding a lone surrogate (bytes that are not UTF-8
    on the command line reach Python as such)."""
    try:
        return isinstance(v, str) and v.encode("utf-8") is not None
    except UnicodeEncodeError:
        return False


_TEXT = Kind(_is_text, "text (a string that UTF-8 encodes)")

# The run's seed (the run config's ``seed``): the model's initialisation, the data order
# and the sample all take it (jaxmp.train.data checks create_pipeline's seed with it).
SEED = Int(0, 2**31 - 2, text="an integer in [0, 2**31 - 1)")
# The dtypes of .bin token shards (jaxmp.train.shards reads them).
TOKEN_DTYPES = ("uint16", "uint32")

# DynamicLossScale's initial scale, as its signature declares it.
_DYNAMIC_INIT = inspect.signature(DynamicLossScale).parameters["loss_scale"].default

KEYS: Tuple[Key, ...] = (
    Key("seed", 0, "seed of the initialisation, the data order and the sample, in [0, 2**31 - 1)",
        SEED),
    # model: the fields of jaxmp.models.ModelConfig, and where its weights come from
    *(Key(f"model.{f.name}", f.default, f.metadata["meaning"], f.metadata["allowed"])
      for f in dataclasses.fields(ModelConfig)),
    Key("model.init_from", "", "a Hugging Face checkpoint directory: its config.json is the "
                               "architecture, its weights the start ('' = random init); a "
                               "config.json file alone plans a run (jaxmp.report), not trains",
        Kind(lambda v: isinstance(v, str), "'' or a checkpoint directory")),
    # precision
    Key("precision.policy", "mixed_bf16; router: fp32; norm: fp32",
        "a policy, then 'pattern: policy' rules; the first matching module path wins"),
    Key("precision.loss_scale", "none",
        "none | static:S | dynamic[:init=..,growth_interval=..,hysteresis=..,min=..] "
        f"(dynamic starts at {_DYNAMIC_INIT:g})"),
    Key("precision.grad_reduce_dtype", "float32", f"dtype of the cross-device gradient sum: "
                                          f"{comm.REDUCE_DTYPE.allowed}",
        comm.REDUCE_DTYPE),
    Key("precision.grad_compression", "none",
        "gradient compression (topk: top-k values + indices, error feedback)", comm.COMPRESSION),
    Key("precision.topk_ratio", comm.TOPK_RATIO, "fraction of each leaf sent per step under topk",
        comm.TOPK_RATIO_RANGE),
    # optim
    Key("optim.learning_rate", 3e-3, "peak learning rate",
        Real(0, F32_MAX, lo_open=True, text="a number > 0 that float32 can hold")),
    Key("optim.warmup_steps", 5, "linear warm-up steps", Int(0, _I32_MAX)),
    Key("optim.schedule", "cosine", "learning-rate decay after warm-up (jaxmp.train.optimizer)",
        Choice(SCHEDULES)),
    Key("optim.final_lr_fraction", 0.1, "final learning rate / peak, in [0, 1]",
        Real(0, 1, text="in [0, 1]")),
    Key("optim.decay_steps", 0, "steps of the schedule (0 = train.steps; fix it to extend a run)",
        Int(0, _I32_MAX, "an integer in [0, 2**31 - 1] (0 = train.steps)")),
    Key("optim.b1", 0.9, "Adam beta1, in [0, 1) in float32", _BETA),
    Key("optim.b2", 0.95, "Adam beta2, in [0, 1) in float32", _BETA),
    Key("optim.eps", 1e-8, "Adam epsilon", Real(0, lo_open=True)),
    Key("optim.weight_decay", 0.01, "decoupled weight decay (AdamW)", Real(0)),
    Key("optim.grad_clip", 1.0, "global-norm clip of the unscaled gradients (0 = off)",
        Real(0, text="a finite number >= 0 (0 = off)")),
    Key("optim.mu_dtype", "", "Adam first moment dtype ('' = master dtype; bfloat16 "
                              "as DeepSeek-V3)", _MOMENT_DTYPE),
    Key("optim.nu_dtype", "", "Adam second moment dtype ('' = master dtype)", _MOMENT_DTYPE),
    Key("optim.update_rounding", "nearest", "nearest | stochastic | kahan: how updates reach "
                                            "bfloat16/float16 params (e.g. pure_bf16)",
        Choice(UPDATE_ROUNDINGS)),
    # data
    Key("data.path", "", "'' = the Python standard library's .py files; a directory, a glob, "
                         ".jsonl or .parquet files, or .bin/.npy token shards",
        Kind(lambda v: v is None or isinstance(v, str),
             "a path, a glob or '' (the stdlib corpus)")),
    Key("data.text_field", "text", "the field holding the text in .jsonl and .parquet files",
        Kind(lambda v: isinstance(v, str) and v.strip() != "", "a non-empty field name")),
    Key("data.format", "auto", "what a .jsonl or .parquet record is (jaxmp.train.packing; "
                               "auto: from its fields)", Choice(packing.FORMATS, " | ".join(packing.FORMATS))),
    Key("data.loss_on", "", "the tokens learned ('' = the format's: all for text, assistant "
                            "for chat, completion for prompt_completion)",
        Choice(packing.LOSS_ON, "'', all, assistant or completion")),
    Key("data.packing", "", "how examples fill rows ('' = concat for text, isolated for chat "
                            "and prompt_completion)",
        Choice(packing.PACKINGS, "'', concat, isolated or padded")),
    Key("data.truncate", "split", "an example longer than a row (data.seq_len tokens): "
                                  "split into rows, or truncate to its first row",
        Choice(packing.TRUNCATIONS, "split or truncate")),
    Key("data.chat_template", "", "chat template file ('' = the tokenizer's own: "
                                  "chat_template.jinja or tokenizer_config.json)",
        Kind(lambda v: isinstance(v, str), "'' or a template file")),
    Key("data.tokenizer", "bytes", "bytes | PATH/tokenizer.json | PATH.model (SentencePiece) | "
                                   "bpe:VOCAB (trained on the train split, kept in the workdir)",
        Kind(lambda v: isinstance(v, str) and (not v.startswith("bpe:") or (
            v[4:].isdigit() and int(v[4:]) >= BPE_MIN_VOCAB)),
             f"'bytes', a tokenizer.json or SentencePiece .model path, or 'bpe:VOCAB' with "
             f"VOCAB an integer >= {BPE_MIN_VOCAB} (the 256 bytes and <|endoftext|>)")),
    Key("data.token_dtype", "uint16", "dtype of .bin token shards: uint16 or uint32",
        Choice(TOKEN_DTYPES, "uint16 or uint32")),
    Key("data.eod_id", -1, "end-of-document token id (-1 = the tokenizer's own)",
        Int(-1, text="an integer >= 0, or -1 (the tokenizer's own)")),
    Key("data.seq_len", 64, "tokens per training sequence", _COUNT),
    Key("data.eval_fraction", 0.02, "share of documents (of shard tokens) held out for eval, "
                                    "in [0, 1)", _UNIT_OPEN),
    Key("data.num_eval_batches", 4, "batches per evaluation (0 = no evaluation)",
        Int(0, text="an integer >= 0 (0 = no evaluation)")),
    Key("data.max_tokens", 0, "cap on each split's tokens (0 = the whole corpus)",
        Int(0, text="an integer >= 0 (0 = all)", none_ok=True)),
    # train
    Key("train.steps", 200, "optimizer steps in all", _STEPS),
    Key("train.batch_size", 16, "global batch, in sequences", _COUNT),
    Key("train.grad_accum_steps", 1, "micro-batches per step", _COUNT),
    Key("train.num_devices", 0, "devices of the mesh (0 = all local devices)",
        Int(0, text="an integer >= 0 (0 = all devices)")),
    Key("train.log_every", 5, "steps between metric lines", _STEPS),
    Key("train.eval_every", 50, "steps between evaluations, and at the last step (0 = never)",
        Int(0, _I32_MAX, "an integer in [0, 2**31 - 1] (0 = never)")),
    Key("train.checkpoint_every", 100, "steps between checkpoints, and at the last step", _STEPS),
    Key("train.keep_checkpoints", 2, "newest checkpoints kept (besides the last healthy one "
        "and the one of the lowest eval loss)", _COUNT),
    Key("train.max_consecutive_skips", 100, "stop when this many steps in a row were skipped",
        _STEPS),
    Key("train.loss_spike_factor", DivergenceCheck().loss_spike_factor,
        f"a loss above this x its running mean (and {LOSS_SPIKE_FLOOR:g} nats) looks "
        "divergent (0 = off)",
        _SPIKE),
    Key("train.grad_norm_spike_factor", DivergenceCheck().grad_norm_spike_factor,
        "a gradient norm above this x its running mean looks divergent (0 = off)", _SPIKE),
    Key("train.max_divergent_steps", 10, "stop after this many divergent-looking steps in a row",
        _STEPS),
    Key("train.sample_prompt", "", "prompt of the final sample ('' = the start of the first eval "
                                   "document; a chat run's: a user message, rendered by its "
                                   "template)", _TEXT),
    Key("train.sample_tokens", 80, "tokens of the final sample (0 = none)", Int(0)),
    Key("train.sample_temperature", 0.8, "sampling temperature (0 = greedy)",
        Real(0, text="a finite number >= 0 (0 = greedy)")),
    # lora: low-rank adapters over a frozen base (jaxmp.models.lora)
    Key("lora.rank", 0, "rank r of the low-rank adapters (0 = off: every parameter trains)",
        Int(0, text="an integer >= 0 (0 = off)")),
    Key("lora.alpha", 16.0, "the adapter product is scaled by alpha / rank (PEFT's lora_alpha)",
        Real(0, F32_MAX, lo_open=True, text="a finite number > 0")),
    Key("lora.targets", lora.DEFAULT_TARGETS,
        "';'-separated regular expressions over blocks/{i}/<module>/<weight>: the projections "
        "that get adapters (routed experts take none)",
        Kind(lambda v: isinstance(v, str) and v.strip(";").strip() != "",
             "';'-separated regular expressions")),
    Key("lora.base", "master", "what the frozen base weights are stored as",
        Choice(lora.LORA_BASES, " | ".join(lora.LORA_BASES))),
    # parallel
    Key("parallel.strategy", sharding.DP.name, "how the state is split over 'data'",
        Choice(sharding.STRATEGIES, " | ".join(sharding.STRATEGIES))),
    Key("parallel.expert", 1, "devices along 'expert' (expert parallelism; needs "
                              "capacity_factor > 0)", _COUNT),
    Key("parallel.dispatch_dtype", comm.DEFAULT_DISPATCH_DTYPE,
        "dtype of the expert-parallel all-to-all", comm.DISPATCH_DTYPE),
)

# Each dotted key's default.
DEFAULTS = {k.name: k.default for k in KEYS}


def _meaning(k: Key) -> str:
    """``k.meaning``, followed by the choices of a :class:`Choice` key whose meaning does
    not list them (they are declared once, in the table the key reads)."""
    if isinstance(k.allowed, Choice) and not all(str(c) in k.meaning for c in k.allowed.choices):
        return f"{k.meaning}: {k.allowed.allowed}"
    return k.meaning


def help_text() -> str:
    """Every key as ``--config.KEY=DEFAULT  meaning``, one line each, by section."""
    width = max(len(f"--config.{k.name}={k.default!r}") for k in KEYS)
    lines, section = [], None
    for k in KEYS:
        top = k.name.split(".")[0] if "." in k.name else ""
        if top != section:
            section = top
            lines.append(f"{section or 'top level'}:")
        lines.append(f"  {f'--config.{k.name}={k.default!r}':<{width}}  {_meaning(k)}")
    return "\n".join(lines)


def markdown() -> str:
    """``docs/CONFIG.md``: the table as Markdown, with each key's allowed values."""
    rows = ["# Run-config keys", "",
            "Generated from `jaxmp.train.keys.KEYS` (the `model.*` keys are the fields of",
            "`jaxmp.models.ModelConfig`) by `python -m jaxmp.train.keys > docs/CONFIG.md`;",
            "`python train.py --help` prints the same table. A key's type is its default's.", "",
            "| key | default | allowed | meaning |", "| --- | --- | --- | --- |"]
    for k in KEYS:
        allowed = k.allowed.allowed if k.allowed is not None else "as the meaning says"
        cells = [c.replace("|", "\\|") for c in (allowed, k.meaning)]
        rows.append(f"| `{k.name}` | `{k.default!r}` | {cells[0]} | {cells[1]} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
