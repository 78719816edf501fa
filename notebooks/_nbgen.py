"""Shared by the notebook generators: cells in, a notebook without outputs out.

Each ``make_NN_*.py`` holds its notebook's cells as ``("md" | "code", source)`` pairs
and calls :func:`write`; the stored ``.ipynb`` files carry no outputs, so the repository
stays light and CI executes them afresh (tests/test_notebooks.py).
"""
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook


def build(cells) -> nbformat.NotebookNode:
    """The notebook of ``cells`` (``("md" | "code", source)`` pairs), in order, no outputs."""
    nb_cells = [new_markdown_cell(src) if kind == "md" else new_code_cell(src) for kind, src in cells]
    for i, cell in enumerate(nb_cells):
        cell.id = f"cell-{i:02d}"  # stable ids: regenerating gives the same file
    nb = new_notebook(cells=nb_cells)
    nb.metadata = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                   "language_info": {"name": "python"}}
    return nb


def write(cells, out: Path) -> None:
    """Validates the notebook of ``cells`` and writes it to ``out``."""
    nb = build(cells)
    nbformat.validate(nb)
    nbformat.write(nb, out)
    print(f"wrote {out}")
