"""The README's Python examples run as written (so the README stays true to the code)."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def python_blocks():
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_python_examples_run():
    blocks = python_blocks()
    assert len(blocks) >= 2
    namespace = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102
    # The threading example ends with one applied step under a float16 policy.
    assert namespace["params"]["w"].dtype.name == "float32"
    assert float(namespace["loss_scale"].loss_scale) == 2.0 ** 15


def test_readme_first_lines_are_the_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    block = lines[lines.index("```bash") + 1: lines.index("```bash") + 3]
    assert block[0].startswith("python3 -m venv .venv && .venv/bin/pip install -e \".[test]\"")
    assert "train.py --config configs/tiny_moe.py" in block[0]
    assert block[1] == ".venv/bin/python -m pytest -q"
    ci = (ROOT / ".ci" / "run").read_text()
    assert ".venv/bin/pip install -q -e \".[test]\"" in ci and ".venv/bin/python -m pytest -q" in ci
