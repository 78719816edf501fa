"""Configs for the tests: the shipped files, loaded by path, and tiny_moe shrunk further."""
import pathlib

from jaxmp.train.config import load_config as _load_file

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_config(name, overrides=()):
    """``configs/NAME.py``'s ``get_config()``, completed (jaxmp.train.config.load_config)."""
    return _load_file(ROOT / "configs" / f"{name}.py", overrides)


def small_config(model=None, **train):
    """tiny_moe shrunk so that a step compiles and runs in moments; ``model`` overrides
    model keys, the keyword arguments ``train`` keys."""
    config = load_config("tiny_moe")
    config.model.update(dict(num_layers=2, d_model=32, num_heads=2, d_ff=64, d_expert=32, max_len=32))
    config.model.update(model or {})
    config.data.update(dict(seq_len=32, max_tokens=60_000, num_eval_batches=1))
    config.train.update(dict(steps=4, batch_size=16, log_every=1, eval_every=1000,
                             checkpoint_every=1000, sample_tokens=4))
    config.optim.decay_steps = 40
    config.train.update(train)
    return config
