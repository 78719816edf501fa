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
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from jaxmp import sharding
from jaxmp.models import MoETransformer, ModelConfig
from jaxmp.models.lora import merge_lora

# export_hf's dtype: what every weight may be rounded to (--dtype).
EXPORT_DTYPES = ("float32", "bfloat16")
from jaxmp.train.checkpoint import CheckpointError, Checkpointer
from jaxmp.train.config import complete_config, config_to_dict
from jaxmp.train.experiment import Experiment
from jaxmp.train.tokenizer import (ByteTokenizer, HFTokenizer, SentencePieceTokenizer,
                                   kept_tokenizer, kept_tokenizer_path, load_tokenizer)

__all__ = ["load", "read_run", "export", "load_export", "EXPORT_WEIGHTS", "EXPORT_CONFIG"]

EXPORT_WEIGHTS = "model.safetensors"
EXPORT_CONFIG = "config.json"


def load(workdir: str | os.PathLike, step: Optional[int] = None, *,
         num_devices: Optional[int] = None) -> Tuple[MoETransformer, Any,
                                                     ml_collections.ConfigDict]:
    """The trained model of a run directory, its tokenizer and its config.

    The config is the one saved in the checkpoint. With ``num_devices=None`` the model is
    restored onto one device and brought to the host (NumPy-backed, plain data
    parallelism); with ``num_devices=N`` it stays on a mesh of N devices under the run's
    own ``parallel`` settings. The checkpoint is verified (checksums, finite values) as on
    resume; with ``step=None``, a corrupt newest checkpoint is passed over for the next
    older good one, as a resuming trainer does, with a ``RuntimeWarning`` naming it (so is
    one that is another step's checkpoint, copied or renamed, and a step directory that is
    a symbolic link or holds a named pipe). Nothing in ``workdir`` is changed (orbax is
    opened read-only, so a trainer writing into the same workdir is never disturbed); a
    checkpoint the trainer's rotation deletes while it is read is read again at the newest
    step (:meth:`~jaxmp.train.Checkpointer.restore`).

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
      CheckpointError: no checkpoint reads and verifies (``step`` given: that one); the
        checkpoint ``step`` was deleted while it was read; with ``step=None``, a trainer's
        rotation deleted each newest checkpoint while it was read, every time it was read
        again (``jaxmp.train.orbax_items.ROTATION_ATTEMPTS`` times).
    """
    model, tokenizer, config, _, notes = read_run(workdir, step, num_devices)
    for note in notes:
        warnings.warn(note, RuntimeWarning, stacklevel=2)
    return model, tokenizer, config


def read_run(workdir: str | os.PathLike, step: Optional[int] = None,
             num_devices: Optional[int] = None, base_dir: Optional[str] = None):
    """:func:`load` for the command-line readers (``jaxmp.sample``, ``jaxmp.export``),
    which print what :func:`load` turns into ``RuntimeWarning`` s.

    Args:
      workdir, step, num_devices: as :func:`load`.
      base_dir: a LoRA run's base checkpoint where it is now, when it moved from the run's
        ``model.init_from`` (checked against the digest the checkpoint records).

    Returns:
      ``(model, tokenizer, config, step, notes)``: :func:`load`'s three, the checkpoint
      step that was read (an int) and the notes (strs: the corrupt checkpoints passed
      over, a missing tokenizer copy).

    Raises:
      ValueError, CheckpointError: as :func:`load`.
    """
    if step is not None and (isinstance(step, bool) or not isinstance(step, (int, np.integer))):
        raise ValueError(f"step={step!r} ({type(step).__name__}) is not allowed; give a "
                         f"checkpoint step as an int, or None for the newest")
    workdir = pathlib.Path(workdir).expanduser()
    if not (workdir / "checkpoints").is_dir():
        raise ValueError(f"{str(workdir)!r} holds no checkpoints directory; give the --workdir "
                         f"of a training run")
    with Checkpointer(workdir, read_only=True) as ckpt:
        # A step refused as damaged (a link, a named pipe inside) counts: restore() says why.
        steps = sorted(set(ckpt.all_steps()) | set(ckpt.refused))
        if not steps:
            raise ValueError(f"{ckpt.directory} holds no checkpoint")
        if step is not None and int(step) not in steps:
            raise ValueError(f"step {step} has no checkpoint in {ckpt.directory}; steps: "
                             f"{', '.join(map(str, steps))}")
        # The model is built from the newest config that reads (the steps listed again as a
        # live trainer's rotation deletes them); restore() then verifies each checkpoint,
        # newest first, passes over the corrupt ones and reads the newest again when the one
        # it reads is deleted.
        _, saved_config = ckpt.read_config(None if step is None else int(step))
        config = complete_config(ml_collections.ConfigDict(saved_config))
        # one device, every array whole; checkpoints restore onto any layout
        if num_devices is None:
            config.parallel.strategy, config.parallel.expert = sharding.DP.name, 1
            config.parallel.dispatch_dtype = sharding.DEFAULT_DISPATCH_DTYPE
            (config.train.num_devices, config.train.batch_size,
             config.train.grad_accum_steps) = 1, 1, 1
        # The architecture is the saved config's and every weight the checkpoint's: the
        # base checkpoint of a fine-tuned run (model.init_from) is not read, so the run
        # loads from any directory and after its base has moved. A LoRA run's checkpoint
        # holds its adapters alone: its base is read again from model.init_from and checked
        # against the digest the checkpoint records (Experiment.restored_state).
        base, config.model.init_from = config.model.init_from, ""
        exp = Experiment.create(config, num_devices=num_devices or 1)
        exp.config.model.init_from = base
        saved = config_to_dict(exp.config)
        for key in ("train", "parallel"):  # what was changed above may differ from the saved run
            saved[key] = saved_config[key]
        if base_dir is not None:  # a LoRA run's moved base (its digest is checked)
            exp.config.model.init_from = os.path.abspath(os.path.expanduser(base_dir))
        read, state, data_state = ckpt.restore(exp.checkpoint_template, saved,
                                               step=None if step is None else int(step),
                                               adapt=exp.checkpoint_adapter())
        state = exp.restored_state(state, ckpt.saved_meta)
        notes = list(ckpt.warnings)
    if num_devices is None:
        model = exp.host_model(state)
    else:
        model = nnx.merge(exp.graphdef, state.params, state.biases, state.rest)
    d = exp.config.data
    if d.tokenizer.startswith("bpe:") and not (workdir / "tokenizer.json").is_file():
        raise ValueError(f"data.tokenizer={d.tokenizer!r} but {workdir} holds no tokenizer.json")
    recorded = (data_state.get("fingerprint") or {}).get("tokenizer") \
        if isinstance(data_state, dict) else None
    kept = kept_tokenizer(workdir, d.tokenizer)  # the run's own copy of a tokenizer file
    copy = kept_tokenizer_path(workdir, d.tokenizer)
    if copy is not None and kept is None:  # a run's copy gone (or a run from before copies)
        if not os.path.isfile(d.tokenizer):
            raise ValueError(f"{copy}: the run's copy of its tokenizer is missing, and "
                             f"data.tokenizer={d.tokenizer} is not there either")
        notes.append(f"the run's copy of its tokenizer ({copy}) is missing: read "
                     f"data.tokenizer={d.tokenizer} instead"
                     + (", which has the SHA-256 its checkpoint recorded" if recorded else ""))
    tokenizer = load_tokenizer(str(kept) if kept else d.tokenizer, workdir=workdir,
                               eod_id=d.eod_id, save=False)
    if recorded is not None and recorded != tokenizer.digest():
        raise ValueError(f"the tokenizer {tokenizer.name} is not the one checkpoint step "
                         f"{read} of {workdir} was trained with (another SHA-256)")
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


def _load_for_export(workdir, out, step, force, notes, base_dir=None):
    """What both exports start with: ``out`` checked (cheap checks first, nothing
    written), the checkpoint read (read-only), ``out`` checked against the run's inputs,
    the corrupt checkpoints passed over added to ``notes`` (or warned about when None).
    Returns ``(model, tokenizer, config, step, out resolved)``."""
    real = _check_out(out, workdir, force)
    model, tokenizer, config, saved_step, passed_over = read_run(workdir, step,
                                                                 base_dir=base_dir)
    _check_out_is_no_input(out, real, config)
    if notes is not None:
        notes.extend(passed_over)
    else:
        for note in passed_over:
            warnings.warn(note, RuntimeWarning, stacklevel=3)
    return model, tokenizer, config, saved_step, real


def export(workdir: str | os.PathLike, out: str | os.PathLike, step: Optional[int] = None,
           force: bool = False, notes: Optional[list] = None,
           base_dir: Optional[str] = None) -> dict:
    """Writes a checkpoint as safetensors weights, a ``config.json`` and the tokenizer.

    The step written into ``config.json`` is the one whose weights were read (one
    checkpoint, read once). The files are written into a new temporary directory beside
    ``out`` and only moved into ``out`` once all of them are written
    (:func:`_write_export`): a failed export (an exception, a full disk, a file-size limit)
    leaves an existing ``out`` as it was, and creates nothing.

    Args:
      workdir: the training run.
      out: the export directory (created; it must be empty unless ``force``).
      step: the checkpoint step; the newest good one when None.
      force: replace the export's files in a directory that is not empty.
      notes: a list that gets a sentence for each corrupt checkpoint passed over (else
        each is a ``RuntimeWarning``).
      base_dir: a LoRA run's base checkpoint where it is now, when it moved from the
        run's ``model.init_from`` (``--base``; checked against the checkpoint's digest).

    Returns:
      The ``config.json`` contents: ``model`` (the model config keys), ``policy``,
      ``tokenizer`` (``kind``: bytes | huggingface | sentencepiece, ``file`` or None,
      ``vocab_size``, ``eos_id``), ``step``, ``format``.

    Raises:
      ValueError: as :func:`load`; before the checkpoint is read, ``out`` not empty
        (without ``force``), a file, or not writable, or ``out`` the run's ``workdir`` or
        inside it (even with ``force``); before anything is written, ``out`` the run's
        ``model.init_from`` directory, inside it or containing it (even with ``force``);
        a write that failed (one line naming the file and the OS error; ``out`` is left
        as it was). Paths are compared resolved (symbolic links, ``..``).
      CheckpointError: as :func:`load`.
    """
    from jaxmp.models.hf.files import save_safetensors
    model, tokenizer, config, saved_step, real = _load_for_export(workdir, out, step, force,
                                                                  notes, base_dir)
    tensors = _flat_arrays(merge_lora(model))  # a LoRA run's adapters merged into its base
    kind = ("bytes" if isinstance(tokenizer, ByteTokenizer) else
            "sentencepiece" if isinstance(tokenizer, SentencePieceTokenizer) else "huggingface")

    def write(directory: pathlib.Path) -> dict:
        save_safetensors(tensors, str(directory / EXPORT_WEIGHTS), {"format": "jaxmp"})
        file = tokenizer.save(directory)
        meta = {"format": "jaxmp-export-1", "step": int(saved_step),
                "model": config.model.to_dict(), "policy": config.precision.policy,
                "tokenizer": {"kind": kind, "file": None if file is None else file.name,
                              "vocab_size": int(tokenizer.vocab_size),
                              "eos_id": int(tokenizer.eos_id)}}
        (directory / EXPORT_CONFIG).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        return meta

    return _write_export(out, real, write, stale=lambda name: False,
                         weights=lambda directory: EXPORT_WEIGHTS)


_HF_WEIGHT_FILE = r"model(-\d+-of-\d+|-part-\d+)?\.safetensors(\.index\.json)?"


def _real(path: str | os.PathLike) -> pathlib.Path:
    """``path`` with ``~`` expanded and symbolic links and ``..`` resolved
    (``os.path.realpath``; relative to the working directory)."""
    return pathlib.Path(os.path.realpath(os.path.expanduser(os.fspath(path))))


def _same_or_inside(path: pathlib.Path, root: pathlib.Path) -> bool:
    return path == root or root in path.parents


def _check_out(out: str | os.PathLike, workdir: str | os.PathLike, force: bool) -> pathlib.Path:
    """The checks of an export directory before the checkpoint is read; nothing is written.

    Returns:
      ``out`` resolved (:func:`_real`).

    Raises:
      ValueError: ``out`` is the run's ``workdir`` or inside it (even with ``force``: an
        export never writes into the run it reads), is not a directory, holds files
        (without ``force``), or it (or the folder it is to be made in) is not writable;
        one line naming it.
    """
    import errno
    real, run = _real(out), _real(workdir)
    if _same_or_inside(real, run):
        where = "the run's workdir" if real == run else f"inside the run's workdir {run}"
        raise ValueError(f"--out {out} is {where}; an export never writes into the run it "
                         f"reads, even with --force; choose a directory outside {run}")
    if real.exists() and not real.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    if real.is_dir() and not force:
        held = sorted(os.listdir(real))
        if held:
            raise ValueError(f"--out {out} is not empty ({', '.join(held[:4])}"
                             f"{', ...' if len(held) > 4 else ''}); choose a new directory, or "
                             f"pass --force (force=True) to replace the files an export writes")
    existing = real  # out, or the nearest folder above it that exists (where it is made)
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"--out {out}: {existing} is not a directory")
    effective = os.access in os.supports_effective_ids
    if not os.access(existing, os.W_OK | os.X_OK, effective_ids=effective):
        read_only = bool(os.statvfs(existing).f_flag & getattr(os, "ST_RDONLY", 1))
        code = errno.EROFS if read_only else errno.EACCES
        raise _not_writable(out, OSError(code, os.strerror(code), str(existing)))
    return real


def _not_writable(out, e: OSError) -> ValueError:
    """The one-line error of an export directory that cannot be written: the OS error and
    the folder."""
    where = f" ({os.fspath(e.filename)})" if e.filename else ""
    return ValueError(f"--out {out} is not writable: {e.strerror or e} [Errno {e.errno}]{where}; "
                      f"choose a writable directory")


def _check_out_is_no_input(out: str | os.PathLike, real: pathlib.Path, config) -> None:
    """Refuses an export directory that is the run's ``model.init_from`` directory (the
    base checkpoint the run started from), is inside it or contains it: an export must not
    write over its own inputs, even with ``force``.

    Raises:
      ValueError: one line naming both directories.
    """
    try:
        base = config.model.get("init_from") if config is not None else None
    except AttributeError:
        base = None
    if not base:
        return
    root = _real(base)
    if _same_or_inside(real, root) or _same_or_inside(root, real):
        how = "is" if real == root else "is inside" if root in real.parents else "contains"
        shown = base if str(root) == str(base) else f"{base}, {root}"
        raise ValueError(f"--out {out} {how} the run's base checkpoint (model.init_from={shown}); "
                         f"an export never writes over its own inputs, even with --force; "
                         f"choose another directory")


def _write_error(out, e: BaseException, name: str, moved: bool,
                 tmp: Optional[pathlib.Path] = None) -> ValueError:
    """The one-line error of a failed write: the file (by its name in the export when it
    was one in the temporary directory ``tmp``) and the OS error."""
    import re
    if isinstance(e, OSError):
        name = os.fspath(e.filename) if e.filename else name
        if tmp is not None and name.startswith(f"{tmp}{os.sep}"):
            name = name[len(f"{tmp}{os.sep}"):]
        reason = f"[Errno {e.errno}] {e.strerror}" if e.strerror else str(e)
    else:  # safetensors' SafetensorError: "I/O error: File too large (os error 27)"
        text = " ".join(str(e).split())
        code = re.search(r"os error (\d+)", text)
        reason = (f"[Errno {code[1]}] {os.strerror(int(code[1]))}" if code else
                  f"{type(e).__name__}: {text[:200]}")
    state = (f"{out} holds part of the new export; export again" if moved else
             f"{out} is left as it was")
    return ValueError(f"--out {out}: writing {name} failed: {reason}; {state}")


def _write_export(out, real: pathlib.Path, write, stale, weights):
    """Runs ``write(directory)`` into a new temporary directory beside ``real`` (same
    parent, so one filesystem) and, once it has returned, moves each of its files into
    ``real`` (``os.replace``; the whole directory is renamed when ``real`` does not exist),
    then removes the files of ``real`` that ``stale(name)`` says belong to an old export
    and the new one does not have (old weight shards, a chat run's
    ``generation_config.json``). When the parent is not writable,
    the temporary directory is made inside an existing ``real`` instead.

    On any failure the temporary directory (and any folder made above ``real``) is
    removed, and ``real`` is left as it was.

    Args:
      out: ``--out`` as given (for messages).
      real: ``out`` resolved.
      write: writes the export into the directory it is given; returns the result.
      stale: ``stale(name)``: a file name of ``real`` is an old export's own (a weight
        file, a ``generation_config.json``).
      weights: ``weights(directory)``: the weight file being written, for the message
        of a safetensors failure.

    Returns:
      What ``write`` returned.

    Raises:
      ValueError: ``real`` or the folder it is made in cannot be written, a write or a
        rename failed (one line naming the file or folder and the OS error); and what
        ``write`` raises as ValueError.
    """
    import secrets
    import shutil
    if real.is_dir():  # the files are moved into it: a file written there and removed
        probe = real / f".jaxmp-write-test-{os.getpid()}"
        try:
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise _not_writable(out, e) from None
    made = []  # folders made above real, the top one first
    try:
        for folder in reversed(real.parents):
            if not folder.exists():
                folder.mkdir()
                made.append(folder)
    except OSError as e:
        _remove_made(made)
        raise _not_writable(out, e) from None
    name = f".{real.name or 'export'}.export-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        tmp = real.parent / name
        tmp.mkdir()
    except OSError as e:
        if not real.is_dir():
            _remove_made(made)
            raise _not_writable(out, e) from None
        try:  # the parent is not writable: beside the files, in out itself
            tmp = real / name
            tmp.mkdir()
        except OSError as e2:
            raise _not_writable(out, e2) from None
    moved = False  # whether a file of real was replaced
    try:
        result = write(tmp)
        if not real.exists():
            os.rename(tmp, real)
            return result
        new = sorted(os.listdir(tmp))
        for file in new:
            os.replace(tmp / file, real / file)
            moved = True
        for file in os.listdir(real):
            if file not in new and stale(file) and (real / file).is_file():
                os.remove(real / file)
        os.rmdir(tmp)
        return result
    except BaseException as e:
        try:
            file = weights(tmp)  # for the message: before tmp is removed
        except Exception:  # noqa: BLE001 (the message only)
            file = "the weights"
        shutil.rmtree(tmp, ignore_errors=True)
        if not moved:
            _remove_made(made)
        if isinstance(e, ValueError) or not isinstance(e, Exception):
            raise
        raise _write_error(out, e, file, moved, tmp) from None


def _remove_made(made) -> None:
    """Removes the folders ``_write_export`` made above the export directory, if empty."""
    for folder in reversed(made):
        try:
            folder.rmdir()
        except OSError:
            break


def _hf_weights_written(directory: pathlib.Path) -> str:
    """The weight file :func:`jaxmp.models.hf.save_pretrained` was writing: its shards are
    written in turn as ``model-part-NNNNN.safetensors``, one shard being ``model.safetensors``."""
    import re
    parts = [f for f in os.listdir(directory) if re.fullmatch(r"model-part-\d+\.safetensors", f)]
    return ("model.safetensors" if not parts else
            f"shard {len(parts) + 1} of model*.safetensors")


def export_hf(workdir: str | os.PathLike, out: str | os.PathLike,
              step: Optional[int] = None, force: bool = False,
              notes: Optional[list] = None, quantize: Optional[str] = None,
              dtype: Optional[str] = None, base_dir: Optional[str] = None) -> dict:
    """Writes a checkpoint as a Hugging Face model directory (``--format hf``).

    :func:`jaxmp.models.save_pretrained` writes ``config.json`` and the safetensors weights
    of the family the architecture maps to; a Hugging Face tokenizer is written as
    ``tokenizer.json`` with a ``tokenizer_config.json`` naming its end-of-document token
    (``eos_token``; and for a chat run the chat template it trained with and the special
    tokens it rendered it with, :func:`jaxmp.train.chat.keep_chat_template`, as
    ``chat_template``, ``bos_token``, ``eos_token``, ..., so that ``apply_chat_template``
    renders as training did, with a ``generation_config.json`` whose ``eos_token_id`` is
    the template's end-of-turn tokens, :func:`jaxmp.train.chat.end_of_turn_ids`, where
    ``generate`` stops), which ``transformers.AutoTokenizer`` reads, and config.json's
    ``bos_token_id`` and ``eos_token_id`` are those tokens' ids (null for a bos token the
    run has none of; transformers' config classes would default to others); the byte
    tokenizer is
    written as the same ids in that form (:meth:`ByteTokenizer.to_hf`), and a SentencePiece
    model as its ``tokenizers`` counterpart (:meth:`SentencePieceTokenizer.to_hf`, which
    says where the two can differ), with the ``.model`` file beside it. As with
    :func:`export`, the files are written into a new temporary directory beside ``out``
    and moved into place once all are written; with ``force``, the old export's weight
    files that the new one does not have (old shards, their index) are then removed, and
    a failed export leaves the old one as it was.

    Args:
      workdir: the training run.
      out: the export directory (created; it must be empty unless ``force``).
      step: the checkpoint step; the newest good one when None.
      force: replace the export's files in a directory that is not empty.
      notes, base_dir: as :func:`export`.
      quantize: None, or ``"fp8"``: the projections in blockwise FP8 (E4M3, one float32
        scale per 128 x 128 block) with config.json's ``quantization_config``, as
        :func:`jaxmp.models.save_pretrained` writes them (``--quantize fp8``).
      dtype: None (the weights as trained: the master weights, a LoRA run's merged in
        float32), ``"float32"`` or ``"bfloat16"`` (every weight rounded to it, nearest
        even; ``--dtype``).

    Returns:
      ``{"family", "step", "tokenizer"}`` (``tokenizer``: the file written or None).

    Raises:
      ValueError: the refusals of :func:`export` (``out`` not empty without ``force``;
        ``out`` the run's ``workdir``, inside it, or the run's ``model.init_from``
        directory, inside it or containing it, even with ``force``; not writable; a
        failed write, named, with ``out`` left as it was); an architecture that maps to
        no family (the field named), a SentencePiece model with no exact
        ``tokenizers`` counterpart, or a ``quantize`` the family has no checkpoint format
        for, before anything is written; and as :func:`load`.
      CheckpointError: as :func:`load`.
    """
    import re

    from jaxmp.models.hf import save_pretrained

    model, tokenizer, config, saved_step, real = _load_for_export(workdir, out, step, force,
                                                                  notes, base_dir)
    model = merge_lora(model)  # a LoRA run's adapters merged into its base
    if dtype is not None:
        if dtype not in EXPORT_DTYPES:
            raise ValueError(f"dtype={dtype!r}; allowed: {', '.join(EXPORT_DTYPES)}")
        weights = nnx.state(model, nnx.Param)
        nnx.update(model, jax.tree.map(lambda x: np.asarray(jax.device_get(x)).astype(
            jnp.dtype(dtype)), weights))
    from jaxmp.train.chat import end_of_turn_ids, kept_chat_template, kept_chat_tokens

    template = kept_chat_template(workdir)  # the one a chat run trained with
    tokens = kept_chat_tokens(workdir) if template else {}
    spm_model = tokenizer if isinstance(tokenizer, SentencePieceTokenizer) else None
    if spm_model is not None:  # a model with no exact counterpart is refused before writing
        tokenizer = HFTokenizer(spm_model.to_hf(), spm_model.name, spm_model.eos_id)
    if isinstance(tokenizer, ByteTokenizer):
        tokenizer = HFTokenizer(tokenizer.to_hf(), "bytes", tokenizer.eos_id)

    # A chat run's end-of-turn tokens, where transformers' generate stops (refused before
    # anything is written when the template has none).
    stops = (end_of_turn_ids(template, tokenizer.tokenizer, tokens)
             if template and isinstance(tokenizer, HFTokenizer) else None)

    special = {"eos_token": tokenizer.tokenizer.id_to_token(tokenizer.eos_id), **tokens} \
        if isinstance(tokenizer, HFTokenizer) else {}
    # config.json's token ids are the tokenizer's (transformers' config classes default to
    # others: LlamaConfig's bos 1 and eos 2).
    token_ids = None
    if special:
        token_ids = {f"{k}_id": tokenizer.tokenizer.token_to_id(special[k]) if k in special
                     else None for k in ("bos_token", "eos_token")}
        token_ids["pad_token_id"] = None

    def write(directory: pathlib.Path) -> dict:
        family = save_pretrained(model, str(directory), token_ids=token_ids, quantize=quantize,
                                 notes=notes)
        file = None
        if spm_model is not None:
            spm_model.save(directory)
        if isinstance(tokenizer, HFTokenizer):
            file = tokenizer.save(directory).name
            (directory / "tokenizer_config.json").write_text(json.dumps(
                {"tokenizer_class": "PreTrainedTokenizerFast", **special,
                 **({"chat_template": template} if template else {})}, indent=2,
                ensure_ascii=False) + "\n")
        if stops:
            (directory / "generation_config.json").write_text(json.dumps(
                {"eos_token_id": stops if len(stops) > 1 else stops[0]}, indent=2) + "\n")
        return {"family": family, "step": int(saved_step), "tokenizer": file}

    return _write_export(out, real, write,
                         stale=lambda name: re.fullmatch(_HF_WEIGHT_FILE, name) is not None
                         or name == "generation_config.json",
                         weights=_hf_weights_written)


def export_peft(workdir: str | os.PathLike, out: str | os.PathLike,
                step: Optional[int] = None, force: bool = False,
                notes: Optional[list] = None, base_dir: Optional[str] = None) -> dict:
    """Writes a LoRA run's adapters as a PEFT adapter directory (``--format peft``):
    ``adapter_config.json`` and ``adapter_model.safetensors``
    (:func:`jaxmp.models.hf.peft.save_adapters`), which
    ``peft.PeftModel.from_pretrained(base, out)`` loads onto the run's ``model.init_from``
    with the logits of the run's model. Written as :func:`export` writes (a temporary
    directory moved into place).

    Args:
      workdir, out, step, force, notes, base_dir: as :func:`export`.

    Returns:
      ``{"step", "targets", "base"}``: the step read, the number of modules adapted and the
      base model's path.

    Raises:
      ValueError: a run without adapters (``lora.rank=0``), or over a multimodal wrapper's
        text model (``gemma3``, ``qwen3_5_moe``: peft names its modules otherwise), before
        anything is written;
        the refusals of :func:`export`; as :func:`load` (a base whose digest is not the
        checkpoint's).
      CheckpointError: as :func:`load`.
    """
    from jaxmp.models.hf.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, save_adapters

    model, _, config, saved_step, real = _load_for_export(workdir, out, step, force, notes,
                                                          base_dir)
    if not config.lora.rank:  # before anything is written
        raise ValueError(f"{workdir} was trained without adapters (lora.rank=0): a PEFT export "
                         f"needs a run with lora.rank > 0; use --format hf or jaxmp")
    from jaxmp.models import hf

    base = config.model.init_from
    wrapper = hf.text_config(hf.read_config(base))[1] if base else None
    if wrapper is not None:  # peft would look for the text model's modules at the top level
        raise ValueError(f"the base {base} is a multimodal {wrapper} checkpoint, whose text "
                         f"model's modules peft names under the wrapper; a PEFT export of its "
                         f"adapters is not supported: export the merged text model with "
                         f"--format hf")

    def write(directory: pathlib.Path) -> dict:
        written = save_adapters(model, str(directory), rank=config.lora.rank,
                                alpha=config.lora.alpha,
                                base_model=config.model.init_from or None)
        return {"step": int(saved_step), "targets": len(written["target_modules"]),
                "base": config.model.init_from}

    return _write_export(out, real, write,
                         stale=lambda name: name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS),
                         weights=lambda directory: ADAPTER_WEIGHTS)


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
