"""``python -m jaxmp.sample --workdir DIR [--prompt TEXT] [--tokens N] [--temperature T]``.

Samples from the newest good (or ``--step``) checkpoint of a training run: the model and
its tokenizer come from :func:`jaxmp.train.load` (read-only: a trainer writing into the
same workdir is not disturbed; a corrupt newest checkpoint is passed over with a warning),
the tokens from :func:`jaxmp.models.generate` (one compiled step for every token, a
progress bar on stderr; only ids the tokenizer has, when the model's vocabulary is
padded). The prompt followed by the sample is printed to stdout. An empty prompt starts
a new document (the end-of-document token).
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser."""
    p = argparse.ArgumentParser(prog="python -m jaxmp.sample", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True, help="the --workdir of a training run")
    p.add_argument("--prompt", default="", help="text to continue ('' = a new document)")
    p.add_argument("--tokens", type=int, default=100, help="tokens to sample (default 100)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the command; returns the exit status (argparse exits 2 on bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.tokens < 0:
        parser.error(f"--tokens must be >= 0, got {args.tokens}")
    if not args.temperature >= 0:
        parser.error(f"--temperature must be >= 0, got {args.temperature}")
    import numpy as np
    from jaxmp.models import generate
    from jaxmp.train import CheckpointError
    from jaxmp.train.artifacts import _load
    from jaxmp.train.checkpoint import quiet_orbax_tracebacks
    restore = quiet_orbax_tracebacks()  # an orbax failure is the one line below
    try:
        model, tokenizer, _, _, notes = _load(args.workdir, args.step)
    except (ValueError, CheckpointError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    finally:
        restore()
    for note in notes:
        print(f"warning: {note}", file=sys.stderr)
    prompt = (tokenizer.encode(args.prompt, add_eos=False) if args.prompt
              else np.asarray([tokenizer.eos_id], np.int32))
    ids = generate(model, prompt, args.tokens, temperature=args.temperature, rng=args.seed,
                   progress=True, vocab_limit=tokenizer.vocab_size)
    print(tokenizer.decode(ids))
    return 0


if __name__ == "__main__":
    from jaxmp._entry import cpu_without_a_gpu

    cpu_without_a_gpu()  # no CUDA plugin traceback on a machine without a GPU
    sys.exit(main())
