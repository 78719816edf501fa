"""jaxmp: mixed-precision training for JAX and Flax NNX.

The public surface, in layers (each depends only on the ones before it):

* precision (:mod:`jaxmp.precision`): policies (:class:`Policy`, :func:`get_policy`,
  :func:`get_policy_rules`), loss scales (:class:`NoOpLossScale`,
  :class:`StaticLossScale`, :class:`DynamicLossScale`), :func:`all_finite`,
  :func:`select_tree`, and the modules :mod:`jaxmp.ops`, :mod:`jaxmp.optim`,
  :mod:`jaxmp.comm`, :mod:`jaxmp.diagnostics` and :mod:`jaxmp.fp8`, re-exported: the
  module objects ``jaxmp.precision.ops`` and so on (``from jaxmp import fp8``); a dotted
  import names the defining module (``from jaxmp.precision.fp8 import Recipe``);
* :mod:`jaxmp.sharding`: logical axis names to mesh axes, the one place layouts are decided;
* :mod:`jaxmp.models`: the Flax NNX MoE Transformer;
* :mod:`jaxmp.train`: the config, the :class:`~jaxmp.train.experiment.Experiment`, the
  train step, the loop, checkpoints, metrics and data;
* :mod:`jaxmp.analysis`: memory, communication and cost accounting
  (``python -m jaxmp.report``).
"""
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

__all__ = [
    "Policy", "PolicyRules", "PRESETS", "get_policy", "get_policy_rules",
    "LossScale", "NoOpLossScale", "StaticLossScale", "DynamicLossScale", "get_loss_scale",
    "as_loss_scale", "all_finite", "select_tree", "ops", "optim", "diagnostics", "comm", "fp8",
]
