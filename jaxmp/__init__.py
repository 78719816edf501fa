"""jaxmp: mixed-precision training for JAX and Flax NNX.

Precision policies (:mod:`jaxmp.policy`), loss scales (:mod:`jaxmp.loss_scale`),
precision-safe numerics (:mod:`jaxmp.ops`), optax integration (:mod:`jaxmp.optim`) and
underflow diagnostics (:mod:`jaxmp.diagnostics`).
"""
from jaxmp.policy import PRESETS, Policy, PolicyRules, get_policy, get_policy_rules
from jaxmp.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    get_loss_scale,
    select_tree,
)

__version__ = "0.1.0"

__all__ = [
    "Policy", "PolicyRules", "PRESETS", "get_policy", "get_policy_rules",
    "LossScale", "NoOpLossScale", "StaticLossScale", "DynamicLossScale", "get_loss_scale",
    "all_finite", "select_tree", "ops", "optim", "diagnostics", "comm",
]

from jaxmp import diagnostics, ops, optim  # noqa: E402  (submodules as jaxmp.ops, ...)
from jaxmp import comm  # noqa: E402
