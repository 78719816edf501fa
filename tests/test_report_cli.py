"""``python -m jaxmp.report`` on bad input and on plans that cannot run, and the entry
points on a machine with the CUDA plugin but no GPU: one line each, never a traceback."""
import glob
import os
import subprocess
import sys

import pytest

from _configs import ROOT
from jaxmp._entry import _only_cuda_plugins
from jaxmp.analysis import gpu
from jaxmp.analysis.report import main

needs_plugin = pytest.mark.skipif(gpu.plugin_problem() is not None,
                                  reason=f"deviceless GPU compile: {gpu.plugin_problem()}")


def error_of(argv, capsys):
    """argparse's exit status and its one line for ``argv``."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    return e.value.code, lines[-1]


def test_bad_flags_are_one_line_errors_naming_the_value(tmp_path, capsys):
    assert error_of(["--article", "--top", "-5"], capsys) == (
        2, "python -m jaxmp.report: error: --top must be an integer >= 0, got -5")
    assert error_of(["--article", "--top", "3"], capsys) == (
        2, "python -m jaxmp.report: error: --top goes with --target (the largest buffers of the "
           "GPU compile)")
    file = tmp_path / "FILE"
    file.write_text("a report\n")
    code, line = error_of(["--article", "--json", str(file / "x")], capsys)
    assert (code, line) == (2, f"python -m jaxmp.report: error: --json: cannot write {file / 'x'}: "
                               f"{file} is a file, not a folder")
    assert file.read_text() == "a report\n"
    # (in a subprocess of tests/test_gpu_target.py::test_report_cli_target_json before 2026-12-04)
    code, line = error_of(["--config", str(ROOT / "configs" / "tiny_moe.py"), "--target", "H100",
                           "--modes", "fp32"], capsys)
    assert code == 2 and "--modes is a CPU accounting option" in line, line


@pytest.mark.parametrize("content", [bytes(range(128, 256)), b"hello world\n", (
    b"gpu_device_info { device_memory_size: 1000 memory_bandwidth: 100 "
    b"cuda_compute_capability { major: 9 } }\nruntime_version { major: 12 } @@@ garbage\n")],
    ids=["binary", "text", "unparsable"])
def test_a_garbage_target_file_is_named_in_its_error(tmp_path, capsys, content):
    if content.endswith(b"garbage\n") and gpu.plugin_problem() is not None:
        pytest.skip("only XLA's GPU compiler parses the proto")
    path = tmp_path / "mine.pbtxt"
    path.write_bytes(content)
    code, line = error_of(["--config", "configs/tiny_moe.py", "--target", str(path)], capsys)
    want = f"python -m jaxmp.report: error: --target {str(path)!r}: "
    assert code == 2 and line.startswith(want), line


@needs_plugin
def test_a_target_plan_that_does_not_fit_exits_1(tmp_path, capsys):
    """H200's description with 1 MiB of memory: the tiny model's step does not fit, and
    the exit status says so."""
    h200 = gpu.get_target("H200")
    small = tmp_path / "small.pbtxt"
    small.write_text(h200.proto.replace(f"device_memory_size: {h200.memory_bytes}",
                                        "device_memory_size: 1048576"))
    assert gpu.get_target(str(small)).memory_bytes == 2**20
    status = main(["--config", "configs/tiny_moe.py", "--target", str(small), "--devices", "1"])
    captured = capsys.readouterr()
    assert "DOES NOT FIT" in captured.out
    assert status == 1
    assert captured.err.strip().splitlines()[-1].startswith(
        "python -m jaxmp.report: the step needs ")
    # one unit in the table and the verdict (issue 45: the table said GB, the verdict MiB)
    assert captured.err.strip().endswith("of small.pbtxt's 1.05 MB: it does not fit")
    assert "of 1.05 MB: DOES NOT FIT" in captured.out


@pytest.mark.slow
def test_a_mode_xla_cannot_compile_is_one_line_not_a_48_gib_allocation(capsys):
    """configs/seed_moe.py with top-k compression on 8 devices: the error-feedback
    residual (8 x 24 x 4 x 8192 x 2048 float32, 48 GiB) stays abstract, and XLA:CPU's
    scatter limit (2**31 - 1 indices) is the one line that says why the mode is not
    accounted."""
    status = main(["--config", "configs/seed_moe.py", "--modes", "topk_allreduce"])
    err = capsys.readouterr().err
    assert status == 1, err[-3000:]
    assert err.strip().splitlines() == [  # the progress lines, then the one error line
        "building the model (24 layers) ...", "compiling mode topk_allreduce (1/1) ...",
        "python -m jaxmp.report: error: mode topk_allreduce: XLA cannot compile its step on this "
        "machine (cpu): UNIMPLEMENTED: Scatter operations with more than 2147483647 scatter "
        "indices are not supported."], err[-3000:]


@pytest.mark.skipif(not _only_cuda_plugins() or os.path.exists("/dev/nvidiactl")
                    or bool(glob.glob("/dev/nvidia[0-9]*")),
                    reason="needs JAX's CUDA plugin (the gpu extra) on a machine without a GPU")
def test_entry_points_do_not_greet_a_planning_user_with_the_cuda_plugins_traceback(tmp_path):
    """train.py with a missing data.path starts JAX's backends (the config is checked
    against the devices) and then stops with its one line; JAX_PLATFORMS is not set."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "--workdir", str(tmp_path / "w"),
                           f"--config.data.path={tmp_path / 'none'}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"train.py: error: data.path '{tmp_path / 'none'}' does not exist (give a directory, a "
        "file, a glob such as 'corpus/**/*.txt', or '' for the standard library's sources)"]


@pytest.mark.parametrize("argv, message", [
    (["--config", "configs/tiny_moe.py", "--config.data.seq_len=100000"],
     "data.seq_len=100000 exceeds model.max_len="),
    (["--config", "configs/tiny_moe.py", "--config.model.num_layer=3"],
     "unknown config key 'model.num_layer'"),
])
def test_a_bad_config_value_is_its_line_without_the_usage(argv, message, capsys):
    """A value the user gave that is wrong is the last line on stderr, and argparse's
    usage text (about 10 lines) is not printed above it; the status is argparse's 2."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "usage:" not in err
    assert err.strip().splitlines()[-1].startswith(f"python -m jaxmp.report: error: {message}")
