"""from_pretrained streams: the host memory it needs beyond the loaded parameters stays
near the largest tensor as the checkpoint grows (benchmarks/hf_load_memory.py at toy
size; each load in a fresh process, its peak resident set from the kernel)."""
import importlib.util

import pytest

from _configs import ROOT

pytest.importorskip("safetensors", reason="the train extra (safetensors) is not installed")

_spec = importlib.util.spec_from_file_location(
    "hf_load_memory", ROOT / "benchmarks" / "hf_load_memory.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_peak_memory_beyond_the_model_does_not_grow_with_it(tmp_path):
    """2 and 12 layers of the same width (the largest tensor, the 8 MB embedding, is the
    same): the peak growth beyond the model's own bytes stays a few largest tensors and
    does not follow the 129 MB the model grows by. A loader that kept the files' pages
    resident (or read whole files) adds about the model's bytes again."""
    result = bench.run([2, 12], d_model=512, d_ff=1408, vocab=4096, workdir=tmp_path)
    small, large = result["rows"]
    largest = large["largest_tensor_bytes"]
    assert small["largest_tensor_bytes"] == largest == 4096 * 512 * 4
    grown = large["model_bytes"] - small["model_bytes"]
    assert grown > 10 * largest  # the model grows far past its largest tensor
    for row in (small, large):
        assert row["growth"] >= row["model_bytes"]  # the CPU's parameters are in host memory
    assert large["overhead"] < 0.5 * large["model_bytes"], large
    assert large["overhead"] - small["overhead"] < 0.25 * grown, result["rows"]
