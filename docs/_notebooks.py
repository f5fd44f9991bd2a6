"""The notebooks of ``notebooks/`` as pages of the site, without executing them.

Each ``notebooks/NN_name.py`` (a jupytext percent script) becomes ``docs/notebooks/NN_name.ipynb``
(ignored by git). When the notebook tests stored an executed copy (``build/notebooks/NN_name.ipynb``,
written by ``tests/notebooks/test_notebooks.py``) whose cells are the script's cells, that copy is
used, so the page shows the outputs and plots of the small run the tests made; otherwise the page is
the source alone. Either way the site build never starts a kernel.
"""

from __future__ import annotations

from pathlib import Path

import jupytext
import nbformat


def _same_cells(a: nbformat.NotebookNode, b: nbformat.NotebookNode) -> bool:
    return [(c.cell_type, c.source) for c in a.cells] == [(c.cell_type, c.source) for c in b.cells]


def source_of(script: Path, stored: Path) -> tuple[nbformat.NotebookNode, bool]:
    """The notebook of ``script``: the stored executed copy when it matches, else the source.

    Returns:
      The notebook and whether it carries stored outputs.
    """
    nb = jupytext.read(script, fmt="py:percent")
    for i, cell in enumerate(nb.cells):  # nbformat draws random ids: fixed ones keep the page unchanged
        cell["id"] = f"cell-{i}"
    if stored.is_file():
        executed = nbformat.read(stored, as_version=4)
        if _same_cells(nb, executed):
            return executed, True
    return nb, False


def _note(script: Path, executed: bool) -> nbformat.NotebookNode:
    """A line under the title: where the outputs come from and how to run the notebook."""
    run = f"`python notebooks/{script.name}`"
    if executed:
        text = (
            "*The outputs on this page are from the test suite's small run (`META_CONSENSUS_SMALL=1`); "
            f"{run} runs the full settings.*"
        )
    else:
        text = f"*This page shows the notebook's source; {run} runs it.*"
    cell = nbformat.v4.new_markdown_cell(text)
    cell["id"] = "docs-note"
    return cell


def prepare(notebooks: Path, out: Path, stored: Path) -> dict[str, bool]:
    """Write ``out/<stem>.ipynb`` for every ``notebooks/[0-9]*.py``; stem -> rendered with outputs."""
    out.mkdir(parents=True, exist_ok=True)
    done: dict[str, bool] = {}
    stems = set()
    for script in sorted(notebooks.glob("[0-9]*.py")):
        nb, executed = source_of(script, stored / f"{script.stem}.ipynb")
        nb.cells.insert(1, _note(script, executed))
        target = out / f"{script.stem}.ipynb"
        text = nbformat.writes(nb)
        if not target.is_file() or target.read_text(encoding="utf-8") != text:
            target.write_text(text, encoding="utf-8")
        done[script.stem] = executed
        stems.add(target.name)
    for old in out.glob("*.ipynb"):  # a notebook renamed or removed
        if old.name not in stems:
            old.unlink()
    return done
