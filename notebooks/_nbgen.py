"""Shared by the notebook generators: cells in, an executed notebook with its outputs out.

Each ``make_NN_*.py`` holds its notebook's cells as ``("md" | "code", source)`` pairs and
calls :func:`write`, which builds the notebook, executes it top to bottom in a kernel of
this interpreter (full size: ``JAXMP_NOTEBOOK_SMALL`` unset), and stores it with its
outputs and plots, so that a reader sees them without running anything. The notebook's
metadata records the SHA-256 of its cells (:func:`cells_digest`), the versions it ran
with, and when: ``tests/test_notebooks.py`` checks that the stored notebook is its
generator's, executed, and executes it again at small size.
"""
import datetime
import hashlib
import json
import os
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

__all__ = ["build", "cells_digest", "execute", "write"]


def cells_digest(cells) -> str:
    """SHA-256 (hex) of the ``(kind, source)`` pairs: what the stored notebook must match."""
    return hashlib.sha256(json.dumps([list(c) for c in cells]).encode()).hexdigest()


def build(cells) -> nbformat.NotebookNode:
    """The notebook of ``cells`` (``("md" | "code", source)`` pairs), in order, no outputs."""
    nb_cells = [new_markdown_cell(src) if kind == "md" else new_code_cell(src) for kind, src in cells]
    for i, cell in enumerate(nb_cells):
        cell.id = f"cell-{i:02d}"  # stable ids: regenerating gives the same cells
    nb = new_notebook(cells=nb_cells)
    nb.metadata = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                   "language_info": {"name": "python"}}
    return nb


def execute(nb: nbformat.NotebookNode, cwd: Path, env: dict, timeout: int = 1800) -> nbformat.NotebookNode:
    """Runs every cell of ``nb`` in a kernel started from this interpreter; outputs stay in.

    Raises:
      nbclient.exceptions.CellExecutionError: a cell failed (it is named).
    """
    import nbclient
    from jupyter_client.kernelspec import KernelSpec
    from jupyter_client.manager import KernelManager

    class ThisInterpreter(KernelManager):
        @property
        def kernel_spec(self):
            return KernelSpec(argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                              display_name="python3", language="python", name="python3")

    km = ThisInterpreter(kernel_name="python3")
    client = nbclient.NotebookClient(nb, km=km, kernel_name="python3", timeout=timeout,
                                     resources={"metadata": {"path": str(cwd)}})
    try:
        client.execute(env=env)
    finally:
        if km.has_kernel:
            km.shutdown_kernel(now=True)
    return nb


def write(cells, out: Path) -> None:
    """Builds, executes (full size) and writes the notebook of ``cells`` to ``out``."""
    import jax

    nb = build(cells)
    nbformat.validate(nb)
    env = {k: v for k, v in os.environ.items() if k != "JAXMP_NOTEBOOK_SMALL"}
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    execute(nb, out.parent, env)
    nb.metadata["jaxmp"] = {
        "cells_sha256": cells_digest(cells),
        "executed": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "jax": jax.__version__, "python": sys.version.split()[0],
    }
    nbformat.validate(nb)
    nbformat.write(nb, out)
    print(f"wrote {out} (executed)")
