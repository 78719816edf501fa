"""The stored notebooks' outputs name no file of the machine that executed them and hold
no traceback (issue 29, point 10): they are executed with ``JAX_PLATFORMS=cpu``, so JAX's
CUDA plugin does not log its failed initialization, and nothing prints a temporary or
virtual-environment path."""
import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
# An absolute path into a machine's directories, an installed package's file, a traceback.
MACHINE = re.compile(r"(?:^|[\s'\"(=])/(?:work|tmp|home|root|usr|opt|var|private|Users)/|"
                     r"site-packages|dist-packages|Traceback \(most recent call last\)")


def output_texts(cell):
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            yield "error", f"{out.get('ename')}: {out.get('evalue')}"
        for key in ("text", "traceback"):
            if key in out:
                value = out[key]
                yield out["output_type"], "".join(value) if isinstance(value, list) else value
        for mime, value in out.get("data", {}).items():
            if mime.startswith("text/"):
                yield mime, "".join(value) if isinstance(value, list) else value


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_output_names_a_machine_path_or_holds_a_traceback(path):
    found = []
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        for kind, text in output_texts(cell):
            if kind == "error":
                found.append(f"cell {i}: {text}")
            found += [f"cell {i} ({kind}): ...{text[max(0, m.start() - 40):m.end() + 60]}..."
                      for m in MACHINE.finditer(text)]
    assert not found, "\n".join(found)


def test_the_pattern_catches_what_it_is_for():
    for bad in ("  File \"/work/x/.venv/lib/python3.11/site-packages/jax/_src/xla_bridge.py\"",
                "written to /tmp/h12/fid/fidelity.json", "Traceback (most recent call last):"):
        assert MACHINE.search(bad), bad
    for fine in ("python benchmarks/fidelity.py --json fidelity.json", "2^15 -> 2^19", "x/y"):
        assert not MACHINE.search(fine), fine
