"""Each setting of the train step is checked once, by validate_config, before any work
(issue 29, point 7): the batch split over the devices and micro-batches, the gradient
communication (comm.check_comm_config) and top-k compression only under data
parallelism. make_train_step and make_eval_step take a StepPlan and trust the settings.
"""
import optax
import pytest

from _configs import small_config
from jaxmp.train.config import validate_config
from jaxmp.train.step import make_eval_step, make_train_step


@pytest.mark.parametrize("strategy, expert", [("zero1", 1), ("fsdp", 1), ("dp", 2)])
def test_topk_outside_data_parallelism_is_a_config_error(strategy, expert):
    config = small_config({"capacity_factor": 2.0})
    config.precision.grad_compression = "topk"
    config.parallel.strategy, config.parallel.expert = strategy, expert
    with pytest.raises(ValueError, match=rf"^precision.grad_compression='topk' runs with "
                                         rf"parallel.strategy='dp' and parallel.expert=1, not "
                                         rf"'{strategy}' and {expert}$"):
        validate_config(config, 8)
    config.parallel.strategy, config.parallel.expert = "dp", 1
    assert validate_config(config, 8).layout.strategy == "dp"


@pytest.mark.parametrize("batch_size, accum, devices, ok", [
    (16, 1, 8, True), (16, 2, 8, True), (24, 3, 8, True), (12, 1, 8, False),
    (16, 3, 8, False), (16, 4, 8, False), (8, 1, 1, True)])
def test_the_batch_split_is_checked_by_the_config(batch_size, accum, devices, ok):
    config = small_config(batch_size=batch_size, grad_accum_steps=accum)
    # B splits into `devices` x `accum` micro-batches exactly when B % (devices * accum) == 0.
    assert ok == (batch_size % (devices * accum) == 0)
    if ok:
        validate_config(config, devices)
    else:
        with pytest.raises(ValueError, match=rf"batch_size={batch_size} .*not divisible|"
                                             rf"micro-batch of .* not divisible by the "
                                             rf"{devices} devices"):
            validate_config(config, devices)


def test_the_steps_take_a_plan_not_a_mesh():
    with pytest.raises(TypeError, match="mesh"):
        make_train_step(None, optax.sgd(0.1), mesh=None, lr_schedule=optax.constant_schedule(1.0))
    for make in (lambda p: make_train_step(None, optax.sgd(0.1), plan=p,
                                           lr_schedule=optax.constant_schedule(1.0)),
                 lambda p: make_eval_step(None, plan=p)):
        with pytest.raises(ValueError, match=r"needs plan= a jaxmp.sharding.StepPlan .*got None"):
            make(None)
