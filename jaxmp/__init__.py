"""jaxmp: mixed-precision training for JAX and Flax NNX.

The public surface, in layers (each depends only on the ones before it):

* precision (:mod:`jaxmp.precision`): policies (:class:`Policy`, :func:`get_policy`,
  :func:`get_policy_rules`), loss scales (:class:`NoOpLossScale`,
  :class:`StaticLossScale`, :class:`DynamicLossScale`), :func:`all_finite`,
  :func:`select_tree`, and the modules :mod:`jaxmp.ops`, :mod:`jaxmp.optim`,
  :mod:`jaxmp.comm`, :mod:`jaxmp.diagnostics` and :mod:`jaxmp.fp8` (the same module
  objects as ``jaxmp.precision.ops`` and so on, importable under either name);
* :mod:`jaxmp.sharding`: logical axis names to mesh axes, the one place layouts are decided;
* :mod:`jaxmp.models`: the Flax NNX MoE Transformer;
* :mod:`jaxmp.train`: the config, the :class:`~jaxmp.train.experiment.Experiment`, the
  train step, the loop, checkpoints, metrics and data;
* :mod:`jaxmp.analysis`: memory, communication and cost accounting
  (``python -m jaxmp.report``).
"""
import sys as _sys

from jaxmp.precision.policy import PRESETS, Policy, PolicyRules, get_policy, get_policy_rules
from jaxmp.precision.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    as_loss_scale,
    get_loss_scale,
    select_tree,
)
from jaxmp.precision import comm, diagnostics, fp8, ops, optim

__version__ = "0.1.0"

# `import jaxmp.ops` and `from jaxmp.ops import ...` reach the precision layer's modules.
for _name in ("ops", "optim", "comm", "diagnostics", "fp8"):
    _sys.modules[f"{__name__}.{_name}"] = globals()[_name]
del _name

__all__ = [
    "Policy", "PolicyRules", "PRESETS", "get_policy", "get_policy_rules",
    "LossScale", "NoOpLossScale", "StaticLossScale", "DynamicLossScale", "get_loss_scale",
    "as_loss_scale", "all_finite", "select_tree", "ops", "optim", "diagnostics", "comm", "fp8",
]
