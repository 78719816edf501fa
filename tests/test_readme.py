"""The README's Python examples run as written (so the README stays true to the code)."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def python_blocks():
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_python_block_runs_alone(index):
    block = python_blocks()[index]
    namespace = {}  # each block alone, in a fresh namespace: its own imports suffice
    exec(compile(block, f"README.md block {index}", "exec"), namespace)  # noqa: S102
    if "loss_scale = jaxmp.DynamicLossScale(loss_scale=2.0**15" in block:
        # The threading example ends with one applied step under a float16 policy.
        assert float(namespace["loss_scale"].loss_scale) == 2.0 ** 15
    if "class MLP" in block:
        # The NNX recipe: float32 masters, a float16 hidden layer and a float32 head (by the
        # rules), and a loss that falls over its 30 steps.
        model, losses = namespace["model"], namespace["losses"]
        assert model.hidden.kernel[...].dtype.name == "float32" and model.hidden.dtype.name == "float16"
        assert model.head.dtype.name == "float32"
        assert len(losses) == 30 and losses[-1] < 0.5 * losses[0], losses


def test_readme_has_the_examples():
    blocks = python_blocks()
    assert len(blocks) >= 5
    assert any("class MLP" in b for b in blocks) and any("2.0**15" in b for b in blocks)


def test_readme_first_screen_trains_samples_and_exports():
    text = (ROOT / "README.md").read_text()
    first = text[: text.index("jaxmp gives you")]
    for command in ("--config.data.tokenizer=bpe:", "-m jaxmp.sample --workdir", "-m jaxmp.export --workdir"):
        assert command in first


def test_readme_first_lines_are_the_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    block = lines[lines.index("```bash") + 1: lines.index("```bash") + 3]
    install = re.match(r'python3 -m venv \.venv && \.venv/bin/pip install -e "\.\[([a-z,]+)\]" && ',
                       block[0])
    assert install and {"train", "test"} <= set(install.group(1).split(","))  # the trainer's extra
    assert "train.py --config configs/tiny_moe.py" in block[0]
    assert block[1] == ".venv/bin/python -m pytest -q"
    ci = (ROOT / ".ci" / "run").read_text()
    # CI installs exactly as the README's first command does.
    assert f'.venv/bin/pip install -q -e ".[{install.group(1)}]"' in ci
    assert ".venv/bin/python -m pytest -q" in ci
