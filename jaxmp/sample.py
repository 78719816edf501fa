"""``python -m jaxmp.sample --workdir DIR [--prompt TEXT] [--chat [--system TEXT]] [--tokens N]
[--temperature T]``.

Samples from the newest good (or ``--step``) checkpoint of a training run: the model and
its tokenizer come from :func:`jaxmp.train.load` (read-only: a trainer writing into the
same workdir is not disturbed; a corrupt newest checkpoint is passed over with a warning),
the tokens from :func:`jaxmp.models.generate` (one compiled step for every token, a
progress bar on stderr; only ids the tokenizer has, when the model's vocabulary is
padded). The prompt followed by the sample is printed to stdout. An empty prompt starts
a new document (the end-of-document token).

With ``--chat`` (a run that trained on conversations, which keeps its chat template and
the special tokens it rendered it with: :func:`jaxmp.train.chat.keep_chat_template`), the
prompt is a user message (after a ``--system`` message when given), rendered by that
template with its generation prompt (:func:`jaxmp.train.chat.render_conversation`, in
the sandbox), sampling stops at the template's end-of-turn token
(:func:`jaxmp.train.chat.end_of_turn_ids`), and the assistant's reply alone is printed.

Refused with a one-line error (exit status 2) before the checkpoint is read: ``--tokens``
below 0, ``--temperature`` below 0, infinite or NaN, a ``--seed`` outside ``[0, 2**64)`` (each of
those seeds is its own sampling key: :func:`seed_key`), and a ``--prompt`` that is not
valid UTF-8 text (an argument byte that does not decode, such as ``$'\\xff'``, which Python
keeps as a lone surrogate); ``--system`` without ``--chat``, and ``--chat`` with an empty
prompt. After it: ``--chat`` on a run without a kept chat template.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

SEED_BOUND = 2 ** 64  # --seed is an integer in [0, SEED_BOUND)


def _seed(text: str) -> int:
    """``--seed``'s type: an integer in ``[0, 2**64)``.

    Raises:
      argparse.ArgumentTypeError: anything else (argparse names the flag).
    """
    import re

    shown = text if len(text) <= 40 else f"{text[:20]}... ({len(text)} characters)"
    try:
        seed = int(text)
    except ValueError:  # not a number, or one of more digits than int() reads
        if not re.fullmatch(r"\s*[+-]?\d[\d_]*\s*", text):
            raise argparse.ArgumentTypeError(f"invalid int value: {shown!r}") from None
        seed = SEED_BOUND
    if not 0 <= seed < SEED_BOUND:
        raise argparse.ArgumentTypeError(f"{shown} is not in [0, 2**64); give a non-negative "
                                         f"seed of at most 64 bits")
    return seed


def seed_key(seed: int):
    """The sampling key of ``--seed``: all 64 bits count.

    ``jax.random.key(seed)`` of seeds below ``2**32`` (the key the command always gave
    them); a larger seed's high 32 bits are folded into the key of its low 32 bits, since
    ``jax.random.key`` keeps only the low 32 bits of a seed (without 64-bit mode), which
    would give ``2**32`` the samples of ``0``.

    Raises:
      ValueError: ``seed`` is not an int in ``[0, 2**64)``.
    """
    import jax

    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_BOUND:
        raise ValueError(f"seed={seed!r} is not an int in [0, 2**64)")
    low, high = seed & 0xFFFFFFFF, seed >> 32
    key = jax.random.key(low)
    return key if high == 0 else jax.random.fold_in(key, high)


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser."""
    p = argparse.ArgumentParser(prog="python -m jaxmp.sample", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True, help="the --workdir of a training run")
    p.add_argument("--prompt", default="", help="text to continue ('' = a new document)")
    p.add_argument("--tokens", type=int, default=100, help="tokens to sample (default 100)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--seed", type=_seed, default=0, help="sampling seed, an integer in "
                   "[0, 2**64) (default 0)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    p.add_argument("--chat", action="store_true", help="the prompt is a user message, rendered "
                   "by the run's chat template; stop at its end of turn and print the reply")
    p.add_argument("--system", default=None, help="with --chat: a system message before it")
    return p


def _prompt_error(prompt: str) -> Optional[str]:
    """Why ``prompt`` is not UTF-8 text (None when it is): the first character that does
    not encode, with the argument byte it stands for when it is a surrogate escape."""
    try:
        prompt.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        bad = e.object[e.start]
        what = (f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF
                else f"character U+{ord(bad):04X}")
        return (f"--prompt is not valid UTF-8 text: {what} at character {e.start}; give the "
                f"prompt as UTF-8")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the command; returns the exit status.

    Raises:
      SystemExit: status 2 (argparse's one-line error naming the flag) for bad input,
        before the checkpoint is read: ``--tokens`` < 0, ``--temperature`` < 0, inf or NaN,
        ``--seed`` not an integer in ``[0, 2**64)``, a ``--prompt`` that is not UTF-8
        text; after it, a workdir with no readable checkpoint.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.tokens < 0:
        parser.error(f"--tokens must be >= 0, got {args.tokens}")
    if not 0 <= args.temperature < float("inf"):  # inf: every logit equal, NaN probabilities
        parser.error(f"--temperature must be a finite number >= 0, got {args.temperature}")
    bad_prompt = _prompt_error(args.prompt) or _prompt_error(args.system or "")
    if bad_prompt:
        parser.error(bad_prompt)
    if args.system is not None and not args.chat:
        parser.error("--system is a message of a conversation: give it with --chat")
    if args.chat and not args.prompt.strip():
        parser.error("--chat needs a --prompt: the user's message")
    import numpy as np
    from jaxmp.models import generate
    from jaxmp.train import CheckpointError
    from jaxmp.train.artifacts import read_run
    from jaxmp._entry import quiet_orbax_tracebacks
    restore = quiet_orbax_tracebacks()  # an orbax failure is the one line below
    try:
        model, tokenizer, _, _, notes = read_run(args.workdir, args.step)
    except (ValueError, CheckpointError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    finally:
        restore()
    for note in notes:
        print(f"warning: {note}", file=sys.stderr)
    stops = ()
    if args.chat:
        try:
            prompt, stops = chat_prompt(args.workdir, tokenizer, args.prompt, args.system)
        except ValueError as e:
            parser.exit(2, f"{parser.prog}: error: {e}\n")
    else:
        prompt = (tokenizer.encode(args.prompt, add_eos=False) if args.prompt
                  else np.asarray([tokenizer.eos_id], np.int32))
    ids = generate(model, prompt, args.tokens, temperature=args.temperature,
                   rng=seed_key(args.seed), progress=True, vocab_limit=tokenizer.vocab_size,
                   stop_ids=stops)
    if args.chat:
        reply = ids[len(prompt):]
        ended = np.flatnonzero(np.isin(reply, stops))
        print(tokenizer.decode(reply[:ended[0]] if ended.size else reply))
    else:
        print(tokenizer.decode(ids))
    return 0


def chat_prompt(workdir, tokenizer, message: str, system: Optional[str] = None):
    """``(prompt ids, end-of-turn ids)`` of a user ``message`` (after a ``system`` one when
    given), rendered with its generation prompt by the chat template a run trained with and
    the special tokens it rendered it with (:func:`jaxmp.train.chat.kept_chat_template`),
    tokenized without added special tokens (the template writes them).

    Args:
      workdir: the run's directory.
      tokenizer: the run's tokenizer (:func:`jaxmp.train.load`); a Hugging Face one.
      message, system: the messages' text.

    Returns:
      int32 ``[n]`` prompt ids and the list of end-of-turn ids
      (:func:`jaxmp.train.chat.end_of_turn_ids`).

    Raises:
      ValueError: the run kept no chat template (it did not train on conversations), its
        tokenizer is not a Hugging Face one, the template fails or its tokenizer lacks its
        special tokens (one line).
    """
    from jaxmp.train import chat

    template = chat.kept_chat_template(workdir)
    inner = getattr(tokenizer, "tokenizer", None)
    if template is None or not hasattr(inner, "encode"):
        raise ValueError(f"--chat: {workdir} kept no chat template ({chat.KEPT_TEMPLATE}): the "
                         f"run did not train on conversations; sample without --chat")
    tokens = chat.kept_chat_tokens(workdir)
    chat.check_special_tokens(template, inner, tokens, str(tokenizer.name))
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": message}]
    return (chat.prompt_ids(messages, template, inner, **tokens),
            chat.end_of_turn_ids(template, inner, tokens))


if __name__ == "__main__":
    from jaxmp._entry import cpu_without_a_gpu

    cpu_without_a_gpu()  # no CUDA plugin traceback on a machine without a GPU
    sys.exit(main())
