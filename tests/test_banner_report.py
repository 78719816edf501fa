"""The banner's per-device memory under fsdp and the report's default modes under zero1
(issue 21, points 2, 3 and 9)."""
import types

import pytest

from jaxmp.analysis.accounting import MODES
from jaxmp.analysis.report import runnable_modes
from jaxmp.train.config import load_config
from jaxmp.train.experiment import Experiment
from jaxmp.train.preflight import banner


@pytest.mark.parametrize("strategy, devices", [("dp", 1), ("dp", 8), ("fsdp", 8), ("zero1", 8)])
def test_banner_memory_is_per_device(strategy, devices):
    config = load_config("configs/tiny_moe.py", [f"parallel.strategy={strategy}"])
    exp = Experiment.create(config, num_devices=devices)
    data = types.SimpleNamespace(num_documents=1, train_tokens=10, eval_tokens=5,
                                 tokenizer=types.SimpleNamespace(name="bytes"))
    text = banner(exp, data)
    total, _ = exp.param_counts
    # float32 gradients, one per parameter; fsdp and zero1 split every one over the 8 devices
    # (d_model 64 / 8), dp keeps them whole.
    split = devices if strategy != "dp" else 1
    assert f"gradients {total * 4 / split / 2**20:.2f} MiB under {strategy}" in text
    assert f"parallel    : {strategy}" in text and "1 document," in text


def test_report_skips_the_modes_a_layout_cannot_run():
    zero1 = load_config("configs/tiny_moe.py", ["parallel.strategy=zero1"])
    run, skipped = runnable_modes(zero1, MODES)
    assert skipped == ["topk_allreduce"] and run == [m for m in MODES if m != "topk_allreduce"]
    assert runnable_modes(load_config("configs/tiny_moe.py"), MODES) == (list(MODES), [])


def test_a_dense_model_has_a_dense_banner_and_no_warning_about_the_default_router_rule():
    """Issue 45: a dense model (the default config) was announced as '0 routed + 0 shared
    experts, top-2' and warned that the default policy's 'router' rule matches no module,
    a rule the user never wrote. A rule the user writes is still checked."""
    from jaxmp.train.preflight import precision_warnings

    dense = Experiment.create(load_config("configs/tiny_moe.py", ["model.num_experts=0",
                                                                  "model.num_shared_experts=0"]),
                              num_devices=1)
    data = types.SimpleNamespace(num_documents=1, train_tokens=10, eval_tokens=5,
                                 tokenizer=types.SimpleNamespace(name="bytes"))
    line = next(l for l in banner(dense, data).splitlines() if "model       :" in l)
    assert line.endswith(f"4 heads, dense (feed-forward width {dense.settings.model.d_ff})")
    assert "routed" not in line
    assert precision_warnings(dense) == []
    typo = Experiment.create(load_config("configs/tiny_moe.py", [
        "model.num_experts=0", "model.num_shared_experts=0",
        "precision.policy=mixed_bf16; rooter: fp32; norm: fp32"]), num_devices=1)
    assert [w.split(";")[0] for w in precision_warnings(typo)] == [
        "precision.policy rule 'rooter' matches no module of this model"]
    moe = Experiment.create(load_config("configs/tiny_moe.py"), num_devices=1)
    assert "4 routed + 1 shared experts, top-2" in banner(moe, data)
