"""The notebooks: stored executed with their outputs and plots, current with their
generators, and executing top to bottom again (at small size) without errors.

The kernel is started from this test's interpreter (``sys.executable``), not from
whatever ``python3`` kernelspec is installed, so the notebooks see the same packages
as the tests; an appended cell checks that. ``JAXMP_NOTEBOOK_SMALL=1`` lets notebooks
pick small sizes, and ``MPLBACKEND=Agg`` draws figures off-screen.
"""
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 600  # generous: a busy 2-core machine, never a measure of speed
_MARKER = "JAXMP_KERNEL_CHECK "

sys.path.insert(0, str(NOTEBOOK_DIR))
import _nbgen  # noqa: E402


def generator(path):
    """The ``make_NN_*.py`` module that writes ``path``."""
    files = list(NOTEBOOK_DIR.glob(f"make_{path.name.split('_', 1)[0]}_*.py"))
    assert len(files) == 1, f"{path.name}: expected one generator, found {files}"
    spec = importlib.util.spec_from_file_location(files[0].stem, files[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines CELLS; writes nothing unless run as a script
    return module


def test_notebooks_exist():
    assert NOTEBOOKS, f"no notebooks found in {NOTEBOOK_DIR}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_executed_with_its_outputs_and_current(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    cells = generator(path).CELLS
    # Current: the stored cells are the generator's, and it recorded their digest when it ran.
    assert [(("md" if c.cell_type == "markdown" else "code"), c.source) for c in nb.cells] == [tuple(c) for c in cells]
    assert nb.metadata["jaxmp"]["cells_sha256"] == _nbgen.cells_digest(cells), (
        f"{path.name} is stale: rerun python notebooks/{generator(path).__name__}.py")
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1))  # in order, all of them
    for i, cell in enumerate(code):
        errors = [o for o in cell.outputs if o.output_type == "error"]
        assert not errors, f"{path.name} code cell {i}: {errors[0].ename}"
    assert sum(bool(c.outputs) for c in code) >= len(code) // 2  # outputs are there to read
    if any("plt." in src for _, src in cells):
        images = [o for c in code for o in c.outputs if "image/png" in o.get("data", {})]
        assert images, f"{path.name} draws figures but stores none"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes_without_errors(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:  # run afresh, not from the stored state
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nb.cells.append(nbformat.v4.new_code_cell(
        "import json as _j, os as _o, sys as _s\n"
        f"print({_MARKER!r} + _j.dumps({{'executable': _s.executable, "
        "'small': _o.environ.get('JAXMP_NOTEBOOK_SMALL')}))"))
    env = {**os.environ, "JAXMP_NOTEBOOK_SMALL": "1", "MPLBACKEND": "Agg"}
    _nbgen.execute(nb, NOTEBOOK_DIR, env, timeout=CELL_TIMEOUT_S)  # raises naming the failing cell
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            errors = [o for o in cell.outputs if o.output_type == "error"]
            assert not errors, f"{path.name} cell {i}: {errors[0].ename}: {errors[0].evalue}"
    text = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.output_type == "stream")
    assert _MARKER in text, text
    check = json.loads(text.split(_MARKER, 1)[1])
    assert check == {"executable": sys.executable, "small": "1"}
