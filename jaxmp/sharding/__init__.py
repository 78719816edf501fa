"""Logical axis names -> mesh axes: the one place the project decides how arrays are laid out.

Models name the axes of their parameters with logical names (``out_sharding`` metadata,
see :mod:`jaxmp.models.transformer`) and annotate activations with ``"batch"``. A *rule
table* maps each logical name to a mesh axis name, a tuple of mesh axis names, or None
(replicated), in the format of Flax's ``LogicalRules`` (a tuple of pairs). A new
parallelism layout is a new table, not a model change:

* :data:`DATA_PARALLEL_RULES`: the batch is split over mesh axis ``"data"``, every
  parameter is replicated (the scanned layout's stacked ``layers`` axis included).
* :data:`FSDP_RULES`: as above, plus every parameter's ``embed`` axis split over
  ``"data"``.

The trainer runs on a 2-D mesh ``("data", "expert")`` (:func:`make_mesh` with
``expert=``) and takes its tables from :func:`layout` (``parallel.strategy`` and
``parallel.expert``): where the float32 master weights and optimizer state live at
rest, and where the parameters are as the forward pass reads them:

============ ================================ =====================================
strategy     state at rest (master, moments)  parameters in the forward pass
============ ================================ =====================================
``dp``       replicated                       replicated
``zero1``    ``embed`` split over ``data``    a compute-dtype copy, replicated
``fsdp``     ``embed`` split over ``data``    split; each layer gathers its own
============ ================================ =====================================

In every strategy the routed experts' ``expert`` axis is split over ``"expert"``
(expert parallelism) and the batch over both mesh axes. The router's output axis is
``expert_logit``, never split: every device routes to every expert. Inside the train
step (``shard_map``), the model is told which mesh axis carries expert parallelism, how
to gather an FSDP-split parameter and in which dtype the expert dispatch travels by
arguments of its call (:class:`StepPlan`'s ``expert_axis``, ``gather`` and
``layout.dispatch_dtype``, :func:`jaxmp.train.step.forward_args`); without them the
model runs on whole arrays.

``parallel.dispatch_dtype`` (:data:`DISPATCH_DTYPES`): ``"compute"`` sends the tokens of
the expert-parallel all-to-all in the compute dtype; ``"e4m3"`` sends them as E4M3 with
one float32 scale per 1x128 tile alongside (DeepSeek-V3 report, section 3.3.4: dispatch
in FP8, combine in bfloat16), :func:`jaxmp.fp8.all_to_all`.

The package, one concept to a module (everything is re-exported here):

* :mod:`jaxmp.sharding.rules`: the rule tables, the axis names, :class:`Layout` and
  :func:`layout`, :func:`make_mesh`, and the shardings of whole arrays
  (:func:`logical_to_sharding`, :func:`state_shardings`, :func:`batch_sharding`);
* :mod:`jaxmp.sharding.context`: the rule table a trace annotates activations by
  (:func:`use_rules` / :func:`constrain`);
* :mod:`jaxmp.sharding.plan`: :class:`StepPlan`, the steps' per-device layout built once
  per run (specs at rest and in the forward pass, each gradient leaf's all-reduce or
  reduce-scatter, the FSDP gather, ZeRO-1's compute-copy all-gather), and
  :func:`fsdp_checkpoint_policy`.
"""
from jaxmp.sharding import context, plan, rules
from jaxmp.sharding.context import *  # noqa: F403
from jaxmp.sharding.plan import *  # noqa: F403
from jaxmp.sharding.rules import *  # noqa: F403
from jaxmp.sharding.rules import Rules

__all__ = [*rules.__all__, "Rules", *context.__all__, *plan.__all__]
