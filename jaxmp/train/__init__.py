"""The trainer: config, experiment, state, step, loop and hooks, checkpoints, metrics, data.

* :mod:`~jaxmp.train.config`: :func:`load_config`, :func:`default_config`, the one
  :func:`validate_config`;
* :mod:`~jaxmp.train.experiment`: :class:`Experiment`, everything a config describes,
  built once (mesh, model, optimizer, shardings, the jitted steps, data);
* :mod:`~jaxmp.train.state`: :class:`TrainState`;
* :mod:`~jaxmp.train.optimizer`: the learning-rate schedule and AdamW from the config;
* :mod:`~jaxmp.train.step`: the pure ``train_step(state, batch)`` and ``eval_step``;
* :mod:`~jaxmp.train.loop` and :mod:`~jaxmp.train.hooks`: :func:`train_and_evaluate` and
  its periodic actions;
* :mod:`~jaxmp.train.checkpoint`, :mod:`~jaxmp.train.metrics`, :mod:`~jaxmp.train.data`,
  :mod:`~jaxmp.train.workdir` (the run directory's lock), :mod:`~jaxmp.train.tokenizer`
  (``data.tokenizer``), :mod:`~jaxmp.train.keys` (every config key, default and meaning);
* :mod:`~jaxmp.train.artifacts`: :func:`load` a trained run ``(model, tokenizer, config)``
  and :func:`export` it (safetensors, ``config.json``, the tokenizer);
* :mod:`~jaxmp.train.chat`: :func:`encode_conversation`, a conversation rendered by its
  chat template in a sandbox, as ``(ids, loss_mask)``.
"""
from jaxmp.train.artifacts import export, load
from jaxmp.train.chat import encode_conversation
from jaxmp.train.checkpoint import CheckpointError, Checkpointer
from jaxmp.train.config import default_config, load_config, validate_config
from jaxmp.train.experiment import Experiment
from jaxmp.train.hooks import TrainingDiverged, TrainingStalled
from jaxmp.train.loop import Interrupted, train_and_evaluate
from jaxmp.train.state import TrainState
from jaxmp.train.workdir import WorkdirInUse

__all__ = ["Experiment", "TrainState", "train_and_evaluate", "load_config", "default_config",
           "validate_config", "Checkpointer", "CheckpointError", "TrainingStalled",
           "TrainingDiverged",
           "Interrupted", "WorkdirInUse", "load", "export", "encode_conversation"]
