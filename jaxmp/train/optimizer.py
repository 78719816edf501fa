"""The optimizer and its learning-rate schedule, from the ``optim`` section of a config.

One schedule object serves both the optimizer and the logged learning rate: the
:class:`~jaxmp.train.experiment.Experiment` builds it once with :func:`make_lr_schedule`
and hands it to :func:`make_optimizer` and to the train step.
"""
from __future__ import annotations

import jax
import optax

from jaxmp.precision import optim
from jaxmp.precision.policy import canonical_dtype

__all__ = ["SCHEDULES", "make_lr_schedule", "make_optimizer"]

SCHEDULES = ("cosine", "constant")


def make_lr_schedule(optim_config, total_steps: int) -> optax.Schedule:
    """Linear warm-up then cosine decay to ``lr * final_lr_fraction`` (optax schedules).

    The cosine decays over ``optim.decay_steps`` steps, or over ``total_steps`` when that
    is 0. Fix ``decay_steps`` when a run may be stopped and continued to more steps, so
    that the schedule does not depend on ``train.steps``. ``schedule="constant"`` holds
    ``learning_rate`` after the warm-up.

    Args:
      optim_config: the config's ``optim`` section (``learning_rate``, ``warmup_steps``,
        ``schedule``, ``decay_steps``, ``final_lr_fraction``).
      total_steps: ``train.steps``.

    Returns:
      ``count -> learning rate``, where ``count`` is the optimizer's count of applied
      updates (a skipped step does not advance it).

    Raises:
      ValueError: unknown ``optim.schedule`` (allowed: ``cosine``, ``constant``).
    """
    lr = float(optim_config.learning_rate)
    warmup = int(optim_config.warmup_steps)
    kind = optim_config.schedule
    if kind == "constant":
        if warmup == 0:
            return optax.constant_schedule(lr)
        return optax.join_schedules(
            [optax.linear_schedule(0.0, lr, warmup), optax.constant_schedule(lr)], [warmup])
    if kind == "cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=lr, warmup_steps=warmup,
            decay_steps=max(int(optim_config.get("decay_steps", 0)) or total_steps, warmup + 1),
            end_value=lr * float(optim_config.final_lr_fraction))
    raise ValueError(f"optim.schedule={kind!r} is not allowed; allowed: "
                     f"{', '.join(repr(s) for s in SCHEDULES)}")


def make_optimizer(optim_config, lr_schedule: optax.Schedule,
                   seed: int = 0) -> optax.GradientTransformation:
    """Global-norm clipping (on unscaled float32 gradients) then AdamW with configurable
    moment dtypes (``mu_dtype``/``nu_dtype``; DeepSeek-V3 section 3.3.3 keeps both in bf16).

    Weight decay skips vectors (norm scales; router biases are not params anyway),
    following common practice (e.g. nanoGPT, Megatron-LM).

    Args:
      optim_config: the config's ``optim`` section (``grad_clip`` 0 = no clipping,
        ``b1``, ``b2``, ``eps``, ``weight_decay``, ``mu_dtype``, ``nu_dtype``; ``""``
        keeps a moment in the master dtype; ``update_rounding``, absent = ``nearest``).
      lr_schedule: from :func:`make_lr_schedule`.
      seed: the run's seed, the stochastic rounding's bits' seed.

    Returns:
      ``optax.chain([clip_by_global_norm,] jaxmp.optim.adamw)``, wrapped by
      :func:`jaxmp.optim.with_update_rounding` for ``stochastic`` and ``kahan``.
    """
    def decay_mask(params):
        return jax.tree.map(lambda p: p.ndim >= 2, params)

    def dtype_or_none(name):
        return None if not name else canonical_dtype(name)

    parts = []
    if optim_config.grad_clip and optim_config.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(float(optim_config.grad_clip)))
    parts.append(optim.adamw(
        lr_schedule, b1=optim_config.b1, b2=optim_config.b2,
        eps=optim_config.eps, weight_decay=optim_config.weight_decay,
        mu_dtype=dtype_or_none(optim_config.mu_dtype),
                             nu_dtype=dtype_or_none(optim_config.nu_dtype),
        mask=decay_mask))
    return optim.with_update_rounding(optax.chain(*parts),
                                      optim_config.get("update_rounding", "nearest"), seed)
