"""Every notebook in notebooks/ runs top to bottom without errors and is stored without outputs.

The kernel is started from this test's interpreter (``sys.executable``), not from
whatever ``python3`` kernelspec is installed, so the notebooks see the same packages
as the tests; an appended cell checks that. ``JAXMP_NOTEBOOK_SMALL=1`` lets notebooks
pick small sizes, and ``MPLBACKEND=Agg`` draws figures off-screen.
"""
import json
import os
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
from jupyter_client.kernelspec import KernelSpec  # noqa: E402
from jupyter_client.manager import KernelManager  # noqa: E402

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 120
_MARKER = "JAXMP_KERNEL_CHECK "


class _ThisInterpreterKernel(KernelManager):
    """A python3 kernel launched with ``sys.executable``, ignoring installed kernelspecs."""

    @property
    def kernel_spec(self):
        return KernelSpec(argv=[sys.executable, "-m", "ipykernel_launcher", "-f",
                                "{connection_file}"],
                          display_name="python3 (test interpreter)", language="python",
                          name="python3")


def test_notebooks_exist():
    assert NOTEBOOKS, f"no notebooks found in {NOTEBOOK_DIR}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name} cell {i} has stored outputs"
            assert cell.execution_count is None, f"{path.name} cell {i} has an execution count"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes_without_errors(path):
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(
        "import json as _j, os as _o, sys as _s\n"
        f"print({_MARKER!r} + _j.dumps({{'executable': _s.executable, "
        "'small': _o.environ.get('JAXMP_NOTEBOOK_SMALL')}))"))
    env = {**os.environ, "JAXMP_NOTEBOOK_SMALL": "1", "MPLBACKEND": "Agg"}
    km = _ThisInterpreterKernel(kernel_name="python3")
    client = nbclient.NotebookClient(nb, km=km, kernel_name="python3", timeout=CELL_TIMEOUT_S,
                                     resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    try:
        client.execute(env=env)  # raises CellExecutionError naming the failing cell
    finally:
        if km.has_kernel:
            km.shutdown_kernel(now=True)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            errors = [o for o in cell.outputs if o.output_type == "error"]
            assert not errors, f"{path.name} cell {i}: {errors[0].ename}: {errors[0].evalue}"
    text = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.output_type == "stream")
    assert _MARKER in text, text
    check = json.loads(text.split(_MARKER, 1)[1])
    assert check == {"executable": sys.executable, "small": "1"}
