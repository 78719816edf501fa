"""bench_h200's train step compiled for one H200 with no GPU: the routed experts as kernels.

Deviceless compilation (XLA's GPU compiler on the CPU host, jax's CUDA plugin and
/work/shared/gpu-targets/h200.pbtxt, as issue 17 describes); skipped with a reason where
the plugin or the target file is absent. The compile helper here is local until the
project's jaxmp.analysis.gpu module lands.
"""
import pathlib
import re

import jax
import pytest

from jaxmp.train.config import load_config
from jaxmp.train.experiment import Experiment

ROOT = pathlib.Path(__file__).resolve().parents[1]
TARGET = pathlib.Path("/work/shared/gpu-targets/h200.pbtxt")


def _h200_mesh():
    if not TARGET.exists():
        pytest.skip(f"no GPU target description at {TARGET}")
    try:
        from jax.experimental import topologies

        topo = topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                            target_config=TARGET.read_text())
    except Exception as e:  # no jax CUDA plugin: nothing to compile with
        pytest.skip(f"deviceless GPU compilation unavailable: {type(e).__name__}: {e}"[:200])
    import numpy as np

    return jax.sharding.Mesh(np.array(topo.devices).reshape(1, 1), ("data", "expert"))


def _compile(mesh, moe_kernel):
    config = load_config(ROOT / "configs" / "bench_h200.py", [f"--config.model.moe_kernel={moe_kernel}"])
    exp = Experiment.create(config, mesh=mesh)
    compiled = exp.train_step.lower(exp.abstract_state, exp.abstract_batch()).compile()
    return exp, compiled


@pytest.fixture(scope="module")
def compiled_pair():
    mesh = _h200_mesh()
    return {kernel: _compile(mesh, kernel) for kernel in ("auto", "ragged_dot")}


def _mosaic_calls(hlo: str):
    return re.findall(r"custom_call_target=\"mosaic_gpu[^\"]*\"", hlo)


def test_auto_resolves_to_the_kernel_for_h200_and_compiles_to_it(compiled_pair):
    exp, compiled = compiled_pair["auto"]
    hlo = compiled.as_text()
    # One MoE stack (scanned): w_gate, w_up, w_down forward (3) + dx (3) + dw (3) kernels,
    # the forward recomputed nowhere (remat="none"): at least 9 Mosaic calls in the program.
    assert len(_mosaic_calls(hlo)) >= 9, _mosaic_calls(hlo)
    _, plain = compiled_pair["ragged_dot"]
    assert _mosaic_calls(plain.as_text()) == []


def test_kernel_temporaries_are_no_larger_than_ragged_dots(compiled_pair):
    auto = compiled_pair["auto"][1].memory_analysis()
    plain = compiled_pair["ragged_dot"][1].memory_analysis()
    assert auto.temp_size_in_bytes <= plain.temp_size_in_bytes, (
        auto.temp_size_in_bytes, plain.temp_size_in_bytes)
