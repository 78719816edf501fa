"""``python -m jaxmp.export --workdir DIR --out DIR [--step N] [--format jaxmp|hf|peft]
[--quantize fp8] [--dtype float32|bfloat16] [--base DIR] [--force]``.

``--format jaxmp`` (the default) writes a training run's checkpoint as
``model.safetensors`` (every array of the model by its dotted path), ``config.json``
(model config, precision policy, tokenizer, step) and the tokenizer file, with
:func:`jaxmp.train.artifacts.export`; :func:`jaxmp.train.artifacts.load_export` reads it
back into a fresh model. ``--format hf`` writes a directory that transformers'
``AutoModelForCausalLM`` and ``AutoTokenizer`` load (a SentencePiece model as its
``tokenizers`` counterpart, :meth:`jaxmp.train.tokenizer.SentencePieceTokenizer.to_hf`),
with :func:`jaxmp.train.artifacts.export_hf`; an architecture that maps to no family is a
one-line error naming what does not map. ``--format hf --quantize fp8`` stores the
projections of attention, MLPs and experts as DeepSeek-V3's and Qwen3's FP8 releases do:
E4M3 weights with a float32 ``weight_scale_inv`` per 128 x 128 block, quantized by
:func:`jaxmp.fp8.quantize_blocks`, and config.json's ``quantization_config``
(:func:`jaxmp.models.save_pretrained`), which transformers and ``from_pretrained`` load. The workdir is only read (a trainer may be
writing into it); a corrupt newest checkpoint is passed over with a warning.

A LoRA run (``lora.rank > 0``): its checkpoints hold the adapters, and its base is read
again from ``model.init_from`` (or rebuilt from the seed) and checked against the digest
the checkpoint records. ``--format jaxmp`` and ``--format hf`` (``--quantize fp8``
included) write the merged model, ``W + (alpha / r) A B`` per adapted weight
(:func:`jaxmp.models.lora.merge_lora`), in float32 (in the parameter dtype: float32
under the mixed presets; ``--dtype bfloat16`` rounds every weight of an hf export to
bfloat16); ``--format peft`` writes the adapters alone as
``adapter_config.json`` and ``adapter_model.safetensors``
(:func:`jaxmp.train.artifacts.export_peft`), which ``peft.PeftModel.from_pretrained(base,
DIR)`` loads; a run without adapters is refused, as is one over a multimodal wrapper.
``--base DIR``: a LoRA run's base where it is now, when it moved from the run's
``model.init_from``.

Every format writes into a new temporary directory beside ``--out`` and moves the files
into place only once all are written: a failed export (a full disk, a file-size limit, a
read-only folder) is a one-line error naming the file and the OS error, and leaves an
existing ``--out`` as it was; with ``--force``, the old export's weight files the new one
does not have (old shards) are removed after the new ones are in place.

Refused with a one-line error (exit status 2), for every format: an ``--out`` that is not
empty, unless ``--force``; and, even with ``--force``, an ``--out`` that is the run's
``--workdir`` or inside it (checked before the checkpoint is read), or that is the run's
base checkpoint (its ``model.init_from`` directory), inside it or contains it (checked
before anything is written): an export never writes over its own inputs. Paths are
compared resolved (``os.path.realpath``: symbolic links and ``..`` do not get around it).
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the command; returns the exit status.

    Raises:
      SystemExit: status 2 with a one-line error: bad arguments (argparse), a workdir with
        no readable checkpoint, an ``--out`` refused (see the module docstring), a failed
        write (the file and the OS error named; ``--out`` left as it was).
    """
    p = argparse.ArgumentParser(prog="python -m jaxmp.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True, help="the --workdir of a training run")
    p.add_argument("--out", required=True, help="the export directory (created; must be empty "
                   "unless --force; never the run's workdir or its model.init_from directory)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    p.add_argument("--format", choices=("jaxmp", "hf", "peft"), default="jaxmp",
                   help="jaxmp (default), hf (a Hugging Face model directory; a LoRA run's "
                   "adapters merged) or peft (a LoRA run's adapters as a PEFT adapter)")
    p.add_argument("--quantize", choices=("fp8",), default=None,
                   help="with --format hf: fp8 writes the projections as blockwise FP8 (E4M3, "
                   "a float32 scale per 128 x 128 block) with a quantization_config")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="with --format hf: every weight rounded to this dtype (default: as "
                   "trained; a LoRA run's merged weights in float32)")
    p.add_argument("--base", default=None, metavar="DIR",
                   help="a LoRA run's base checkpoint where it is now, when it moved from the "
                   "run's model.init_from (checked against the digest its checkpoints record)")
    p.add_argument("--force", action="store_true", help="replace the export's files in a "
                   "directory that is not empty (its other files are kept)")
    args = p.parse_args(argv)
    if args.dtype and args.format != "hf":
        p.exit(2, f"{p.prog}: error: --dtype {args.dtype} needs --format hf (a jaxmp export "
                  f"keeps the master weights)\n")
    if args.quantize and args.format != "hf":
        p.exit(2, f"{p.prog}: error: --quantize {args.quantize} needs --format hf (a jaxmp "
                  f"export keeps the master weights)\n")
    from jaxmp.train import CheckpointError
    from jaxmp.train.artifacts import export, export_hf, export_peft
    from jaxmp._entry import quiet_orbax_tracebacks
    restore = quiet_orbax_tracebacks()  # an orbax failure is the one line below
    notes = []
    try:
        if args.format == "hf":
            meta = export_hf(args.workdir, args.out, args.step, force=args.force, notes=notes,
                             quantize=args.quantize, dtype=args.dtype, base_dir=args.base)
        elif args.format == "peft":
            meta = export_peft(args.workdir, args.out, args.step, force=args.force, notes=notes,
                               base_dir=args.base)
        else:
            meta = export(args.workdir, args.out, args.step, force=args.force, notes=notes,
                          base_dir=args.base)
    except (ValueError, CheckpointError, OSError) as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    finally:
        restore()
    for note in notes:
        print(f"warning: {note}", file=sys.stderr)
    if args.format == "peft":
        print(f"exported the adapters of step {meta['step']} of {args.workdir} to {args.out}: "
              f"adapter_config.json, adapter_model.safetensors ({meta['targets']} modules; "
              f"base {meta['base'] or 'a random initialisation'})")
        return 0
    if args.format == "hf":
        print(f"exported step {meta['step']} of {args.workdir} to {args.out} as "
              f"{meta['family']}: config.json, safetensors weights"
              f"{' (projections in blockwise FP8)' if args.quantize else ''}"
              f"{', ' + meta['tokenizer'] if meta['tokenizer'] else ' (no tokenizer.json)'}")
        return 0
    tok = meta["tokenizer"]
    print(f"exported step {meta['step']} of {args.workdir} to {args.out}: model.safetensors, "
          f"config.json{', ' + tok['file'] if tok['file'] else ''} (tokenizer {tok['kind']}, "
          f"vocabulary {tok['vocab_size']})")
    return 0


if __name__ == "__main__":
    from jaxmp._entry import cpu_without_a_gpu

    cpu_without_a_gpu()  # no CUDA plugin traceback on a machine without a GPU
    sys.exit(main())
