"""Writes the notebooks of this directory from their cell lists, executed.

Each notebook's cells are in its own file (``_quickstart.py``, ``_long_context.py``,
``_train_longnet.py``, ``_decoder.py``). Edit the cells there, then run
``python notebooks/_build.py`` (it executes every notebook in a fresh kernel, a minute or two,
and writes it with its outputs and plots, so a code host shows them); commit the cell files,
this script and the ``.ipynb`` files together. ``--no-execute`` writes them without outputs;
notebook names (``python notebooks/_build.py decoder.ipynb``) write only those.
``tests/test_notebooks.py`` checks that the committed cells equal what this script writes (so
the two never drift apart) and re-executes every notebook.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent


def _cell(kind: str, text: str):
    text = text.strip("\n")
    return new_markdown_cell(text) if kind == "md" else new_code_cell(text)


def notebook(cells: list[tuple[str, str]]) -> nbformat.NotebookNode:
    nb = new_notebook(cells=[_cell(kind, text) for kind, text in cells])
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    for i, cell in enumerate(nb.cells):  # stable ids: rebuilding gives identical files
        cell["id"] = f"cell-{i:02d}"
    return nb


def _cells(stem: str, name: str) -> list[tuple[str, str]]:
    """``name`` of ``notebooks/<stem>.py``, loaded by path (this folder is not a package, and
    tests/test_notebooks.py loads this script by path too)."""
    spec = importlib.util.spec_from_file_location(f"notebooks{stem}", HERE / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


# one notebook's cells per file
QUICKSTART = _cells("_quickstart", "QUICKSTART")
LONG_CONTEXT = _cells("_long_context", "LONG_CONTEXT")
TRAIN = _cells("_train_longnet", "TRAIN")
DECODER = _cells("_decoder", "DECODER")


NOTEBOOKS = {
    "quickstart.ipynb": QUICKSTART,
    "long_context.ipynb": LONG_CONTEXT,
    "train_longnet.ipynb": TRAIN,
    "decoder.ipynb": DECODER,
}


def build() -> dict[str, str]:
    """Returns ``{file name: notebook JSON text}``, without outputs."""
    return {name: nbformat.writes(notebook(cells)) + "\n" for name, cells in NOTEBOOKS.items()}


def execute(nb: nbformat.NotebookNode, timeout: int = 300) -> nbformat.NotebookNode:
    """Runs ``nb`` in a fresh ``python3`` kernel in this directory; returns it with outputs.

    No timing metadata is recorded, so re-executing changes only what the cells print.
    """
    from nbclient import NotebookClient

    NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(HERE)}}).execute()
    return nb


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    run = "--no-execute" not in argv
    only = [a for a in argv if a != "--no-execute"]
    unknown = sorted(set(only) - set(NOTEBOOKS))
    if unknown:
        print(f"unknown notebook(s) {unknown}; these are {sorted(NOTEBOOKS)}", file=sys.stderr)
        return 2
    for name, text in build().items():
        if only and name not in only:
            continue
        if run:
            nb = execute(nbformat.reads(text, as_version=4))
            text = nbformat.writes(nb) + "\n"
        (HERE / name).write_text(text)
        print("wrote", HERE / name, "(executed)" if run else "(no outputs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
