"""A trained run as something to use: load it, sample from it, export it.

* :func:`load` ``(workdir, step=None) -> (model, tokenizer, config)``: the NNX model with
  the checkpoint's weights, on the host (default) or on a mesh of ``num_devices``;
* :func:`export` writes ``model.safetensors`` (every array of the model's state, named by
  its dotted path, in its stored dtype), ``config.json`` (the model config, the
  precision policy, the tokenizer's kind, file and end-of-document id, the step) and the
  tokenizer file (``tokenizer.json`` / ``tokenizer.model``; none for bytes);
* :func:`load_export` builds a fresh model from an export directory, without jaxmp's
  checkpoints.

``python -m jaxmp.sample`` and ``python -m jaxmp.export`` are their command lines.
"""
from __future__ import annotations

import json
import os
import pathlib
import warnings
from typing import Any, Optional, Tuple

import jax
import ml_collections
import numpy as np
from flax import nnx

from jaxmp.models import MoETransformer, ModelConfig
from jaxmp.train.checkpoint import CheckpointError, Checkpointer, residual_adapter
from jaxmp.train.config import complete_config, config_to_dict
from jaxmp.train.experiment import Experiment
from jaxmp.train.tokenizer import (ByteTokenizer, HFTokenizer, SentencePieceTokenizer,
                                   load_tokenizer)

__all__ = ["load", "export", "load_export", "EXPORT_WEIGHTS", "EXPORT_CONFIG"]

EXPORT_WEIGHTS = "model.safetensors"
EXPORT_CONFIG = "config.json"


def _saved_config(ckpt: Checkpointer, step: int) -> dict:
    import orbax.checkpoint as ocp
    try:
        return ckpt.manager.restore(step, args=ocp.args.Composite(
            config=ocp.args.JsonRestore()))["config"]
    except Exception as e:  # orbax raises many types for a damaged directory
        raise CheckpointError(f"checkpoint step {step} in {ckpt.directory}: its config does not "
                              f"read ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:200]})") from None


def load(workdir: str | os.PathLike, step: Optional[int] = None, *,
         num_devices: Optional[int] = None) -> Tuple[MoETransformer, Any,
                                                     ml_collections.ConfigDict]:
    """The trained model of a run directory, its tokenizer and its config.

    The config is the one saved in the checkpoint. With ``num_devices=None`` the model is
    restored onto one device and brought to the host (NumPy-backed, plain data
    parallelism); with ``num_devices=N`` it stays on a mesh of N devices under the run's
    own ``parallel`` settings. The checkpoint is verified (checksums, finite values) as on
    resume; with ``step=None``, a corrupt newest checkpoint is passed over for the next
    older good one, as a resuming trainer does, with a ``RuntimeWarning`` naming it.
    Nothing in ``workdir`` is changed (orbax is opened read-only, so a trainer writing
    into the same workdir is never disturbed).

    Args:
      workdir: the ``--workdir`` of a training run.
      step: the checkpoint step (an int); the newest good one when None.
      num_devices: see above.

    Returns:
      ``(model, tokenizer, config)``: an :class:`~jaxmp.models.MoETransformer`, the
      run's tokenizer (:mod:`jaxmp.train.tokenizer`), the completed config.

    Raises:
      ValueError: ``workdir`` holds no checkpoint, or ``step`` is not an int or not one
        of its steps (the steps are listed); the tokenizer cannot be found.
      CheckpointError: no checkpoint reads and verifies (``step`` given: that one).
    """
    model, tokenizer, config, _, notes = _load(workdir, step, num_devices)
    for note in notes:
        warnings.warn(note, RuntimeWarning, stacklevel=2)
    return model, tokenizer, config


def _load(workdir, step: Optional[int] = None, num_devices: Optional[int] = None):
    """:func:`load`, returning ``(model, tokenizer, config, step, warnings)``: the step
    that was read and the corrupt checkpoints passed over."""
    if step is not None and (isinstance(step, bool) or not isinstance(step, (int, np.integer))):
        raise ValueError(f"step={step!r} ({type(step).__name__}) is not allowed; give a "
                         f"checkpoint step as an int, or None for the newest")
    workdir = pathlib.Path(workdir).expanduser()
    if not (workdir / "checkpoints").is_dir():
        raise ValueError(f"{str(workdir)!r} holds no checkpoints directory; give the --workdir "
                         f"of a training run")
    with Checkpointer(workdir, read_only=True) as ckpt:
        steps = ckpt.all_steps()
        if not steps:
            raise ValueError(f"{ckpt.directory} holds no checkpoint")
        if step is not None and int(step) not in steps:
            raise ValueError(f"step {step} has no checkpoint in {ckpt.directory}; steps: "
                             f"{', '.join(map(str, steps))}")
        # The model is built from the newest config that reads; restore() then verifies
        # each checkpoint, newest first, and passes over the corrupt ones.
        faults = []
        for s in ([int(step)] if step is not None else reversed(steps)):
            try:
                saved_config = _saved_config(ckpt, s)
                break
            except CheckpointError as e:
                faults.append(str(e))
        else:
            raise CheckpointError(f"no checkpoint in {ckpt.directory} can be read: "
                                  f"{'; '.join(faults)}")
        config = complete_config(ml_collections.ConfigDict(saved_config))
        # one device, every array whole; checkpoints restore onto any layout
        if num_devices is None:
            config.parallel.strategy, config.parallel.expert = "dp", 1
            config.parallel.dispatch_dtype = "compute"
            (config.train.num_devices, config.train.batch_size,
             config.train.grad_accum_steps) = 1, 1, 1
        exp = Experiment.create(config, num_devices=num_devices or 1)
        saved = config_to_dict(exp.config)
        for key in ("train", "parallel"):  # what was changed above may differ from the saved run
            saved[key] = saved_config[key]
        read, state, _ = ckpt.restore(exp.checkpoint_template, saved,
                                      step=None if step is None else int(step),
                                      adapt=residual_adapter(exp.num_devices, exp.mesh))
        notes = list(ckpt.warnings)
    if num_devices is None:
        model = exp.host_model(state)
    else:
        model = nnx.merge(exp.graphdef, state.params, state.biases, state.rest)
    d = exp.config.data
    if d.tokenizer.startswith("bpe:") and not (workdir / "tokenizer.json").is_file():
        raise ValueError(f"data.tokenizer={d.tokenizer!r} but {workdir} holds no tokenizer.json")
    tokenizer = load_tokenizer(d.tokenizer, workdir=workdir, eod_id=d.eod_id, save=False)
    return model, tokenizer, exp.config, int(read), notes


def _flat_arrays(model: nnx.Module) -> dict:
    """Every array of ``model``'s state by dotted path (``blocks.0.attn.wq.kernel``)."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model)):
        value = var.get_value() if hasattr(var, "get_value") else var.value
        if jax.dtypes.issubdtype(getattr(value, "dtype", None), jax.dtypes.prng_key):
            continue  # an RNG key is not a weight
        out[".".join(str(p) for p in path)] = np.asarray(jax.device_get(value))
    return out


def _writable_out(out: pathlib.Path, force: bool) -> None:
    """Checks the export directory before any work: it is created when missing; an
    existing one must be empty (unless ``force``) and writable.

    Raises:
      ValueError: ``out`` is a file, holds files (without ``force``), or cannot be
        created or written; the message names it.
    """
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    if out.is_dir() and not force:
        held = sorted(p.name for p in out.iterdir())
        if held:
            raise ValueError(f"--out {out} is not empty ({', '.join(held[:4])}"
                             f"{', ...' if len(held) > 4 else ''}); choose a new directory, or "
                             f"pass --force (force=True) to overwrite the files an export writes")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".jaxmp-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"--out {out} is not writable: {e.strerror or e}; choose a writable "
                         f"directory") from None


def export(workdir: str | os.PathLike, out: str | os.PathLike, step: Optional[int] = None,
           force: bool = False, notes: Optional[list] = None) -> dict:
    """Writes a checkpoint as safetensors weights, a ``config.json`` and the tokenizer.

    The step written into ``config.json`` is the one whose weights were read (one
    checkpoint, read once).

    Args:
      workdir: the training run.
      out: the export directory (created; it must be empty unless ``force``).
      step: the checkpoint step; the newest good one when None.
      force: overwrite the export's files in a directory that is not empty.
      notes: a list that gets a sentence for each corrupt checkpoint passed over (else
        each is a ``RuntimeWarning``).

    Returns:
      The ``config.json`` contents: ``model`` (the model config keys), ``policy``,
      ``tokenizer`` (``kind``: bytes | huggingface | sentencepiece, ``file`` or None,
      ``vocab_size``, ``eos_id``), ``step``, ``format``.

    Raises:
      ValueError: as :func:`load`; ``out`` not empty (without ``force``), or not
        writable (before the checkpoint is read), or a write into it failed.
      CheckpointError: as :func:`load`.
    """
    import safetensors.numpy
    out = pathlib.Path(out).expanduser()
    created = not out.exists()
    _writable_out(out, force)  # cheap checks first
    try:
        model, tokenizer, config, saved_step, passed_over = _load(workdir, step)
    except BaseException:
        if created:  # a failed export leaves no empty directory behind
            out.rmdir()
        raise
    if notes is not None:
        notes.extend(passed_over)
    else:
        for note in passed_over:
            warnings.warn(note, RuntimeWarning, stacklevel=2)
    tensors = _flat_arrays(model)
    try:
        safetensors.numpy.save_file(tensors, str(out / EXPORT_WEIGHTS),
                                    metadata={"format": "jaxmp"})
    except Exception as e:  # safetensors raises its own SafetensorError for an OS failure
        raise ValueError(f"writing {out / EXPORT_WEIGHTS} failed: {type(e).__name__}: "
                         f"{' '.join(str(e).split())[:200]}") from None
    kind = ("bytes" if isinstance(tokenizer, ByteTokenizer) else
            "sentencepiece" if isinstance(tokenizer, SentencePieceTokenizer) else "huggingface")
    file = tokenizer.save(out)
    meta = {"format": "jaxmp-export-1", "step": int(saved_step),
            "model": config.model.to_dict(), "policy": config.precision.policy,
            "tokenizer": {"kind": kind, "file": None if file is None else file.name,
                          "vocab_size": int(tokenizer.vocab_size), "eos_id": int(tokenizer.eos_id)}}
    (out / EXPORT_CONFIG).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return meta


def export_hf(workdir: str | os.PathLike, out: str | os.PathLike,
              step: Optional[int] = None) -> dict:
    """Writes a checkpoint as a Hugging Face model directory (``--format hf``).

    :func:`jaxmp.models.save_pretrained` writes ``config.json`` and the safetensors weights
    of the family the architecture maps to; a Hugging Face tokenizer is written as
    ``tokenizer.json`` with a ``tokenizer_config.json`` naming its end-of-document token
    (``eos_token``), which ``transformers.AutoTokenizer`` reads; the byte tokenizer is
    written as the same ids in that form (:meth:`ByteTokenizer.to_hf`), and a SentencePiece
    model as its ``tokenizers`` counterpart (:meth:`SentencePieceTokenizer.to_hf`, which
    says where the two can differ), with the ``.model`` file beside it.

    Returns:
      ``{"family", "step", "tokenizer"}`` (``tokenizer``: the file written or None).

    Raises:
      ValueError: an architecture that maps to no family (the field named), or a
        SentencePiece model with no exact ``tokenizers`` counterpart, before anything is
        written; and as :func:`load`.
    """
    from jaxmp.models.hf import save_pretrained

    model, tokenizer, _, saved_step, notes = _load(workdir, step)  # read-only, one checkpoint
    for note in notes:
        warnings.warn(note, RuntimeWarning, stacklevel=2)
    out = pathlib.Path(out).expanduser()
    spm_model = tokenizer if isinstance(tokenizer, SentencePieceTokenizer) else None
    if spm_model is not None:  # a model with no exact counterpart is refused before writing
        tokenizer = HFTokenizer(spm_model.to_hf(), spm_model.name, spm_model.eos_id)
    if isinstance(tokenizer, ByteTokenizer):
        tokenizer = HFTokenizer(tokenizer.to_hf(), "bytes", tokenizer.eos_id)
    family = save_pretrained(model, str(out))
    file = None
    if spm_model is not None:
        spm_model.save(out)
    if isinstance(tokenizer, HFTokenizer):
        file = tokenizer.save(out).name
        eos = tokenizer.tokenizer.id_to_token(tokenizer.eos_id)
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos}, indent=2) + "\n")
    return {"family": family, "step": int(saved_step), "tokenizer": file}


def load_export(directory: str | os.PathLike) -> Tuple[MoETransformer, Any, dict]:
    """A fresh model built from an :func:`export` directory, and its tokenizer.

    Returns:
      ``(model, tokenizer, config.json contents)``.

    Raises:
      ValueError: a file is missing, or the tensors do not match the model config (a
        missing, extra or differently shaped array is named).
    """
    import safetensors.numpy
    directory = pathlib.Path(directory)
    for name in (EXPORT_CONFIG, EXPORT_WEIGHTS):
        if not (directory / name).is_file():
            raise ValueError(f"{directory} holds no {name}; give a directory written by "
                             f"python -m jaxmp.export")
    meta = json.loads((directory / EXPORT_CONFIG).read_text())
    model = nnx.eval_shape(lambda: MoETransformer(ModelConfig.from_config(meta["model"]),
                                                  meta["policy"], rngs=nnx.Rngs(0)))
    tensors = safetensors.numpy.load_file(str(directory / EXPORT_WEIGHTS))
    graphdef, state = nnx.split(model)
    flat = []
    for path, var in nnx.to_flat_state(state):
        name = ".".join(str(p) for p in path)
        if name not in tensors:
            raise ValueError(f"{directory / EXPORT_WEIGHTS} has no tensor {name!r}")
        value = tensors.pop(name)
        if value.shape != tuple(var.shape):
            raise ValueError(f"tensor {name!r} is {value.shape}, the model config "
                             f"needs {var.shape}")
        flat.append((path, var.replace(jax.numpy.asarray(value))))
    if tensors:
        raise ValueError(f"{directory / EXPORT_WEIGHTS} has tensors the model lacks: "
                         f"{', '.join(sorted(tensors)[:5])}")
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    tok = meta["tokenizer"]
    if tok["kind"] == "bytes":
        tokenizer = ByteTokenizer()
    elif tok["kind"] == "sentencepiece":
        tokenizer = SentencePieceTokenizer(directory / tok["file"], tok["eos_id"])
    else:
        tokenizer = HFTokenizer.from_file(directory / tok["file"], tok["eos_id"])
    return model, tokenizer, meta
