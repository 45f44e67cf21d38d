"""The notebooks in ``notebooks/`` run end to end, fast, match their generator and are
committed executed.

Each notebook is executed with nbclient in a fresh ``python3`` kernel (jupyter_client starts
it with this interpreter, ``sys.executable``); any cell error fails the test. Every notebook
has a time budget, and the budgets add up to the 3 minutes allowed for all of them: the test
prints each run's wall time against its budget (a report, not an assertion: wall time depends
on the machine's load, and a loaded machine must not fail the suite).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import nbformat
import pytest
from conftest import xla_flags
from jupyter_client import KernelManager
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"

# seconds per notebook (wall time, kernel start included); the sum is the 3-minute limit
BUDGET_S = {"quickstart.ipynb": 50, "long_context.ipynb": 30, "train_longnet.ipynb": 45,
            "decoder.ipynb": 55}
# Environment the notebooks read for the test run: long_context runs 16,384 tokens, not the
# 262,144 of its committed outputs (its checks do not depend on n: the first 1,024 positions
# against the reference, the ring on the first 16,384, i.e. all of it here); with that it
# compiles more than it runs, so every notebook gets the session's compile-speed flags.
NOTEBOOK_ENV = {"DILAX_NOTEBOOK_N": "16384"}
CELL_TIMEOUT_S = 120


def _load_builder():
    spec = importlib.util.spec_from_file_location("notebooks_build", NOTEBOOKS / "_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_budgets_cover_every_notebook_within_three_minutes():
    assert set(BUDGET_S) == {p.name for p in NOTEBOOKS.glob("*.ipynb")}
    assert sum(BUDGET_S.values()) <= 180


def _cells(nb) -> list[tuple[str, str, str]]:
    return [(c.cell_type, c.get("id", ""), c.source) for c in nb.cells]


def test_committed_notebooks_match_generator_and_are_executed():
    """The committed notebooks hold the generator's cells, executed in order without errors,
    with their outputs (a code host shows the results and the plots)."""
    built = _load_builder().build()
    assert set(built) == set(BUDGET_S)
    for name, text in built.items():
        committed = nbformat.reads((NOTEBOOKS / name).read_text(), as_version=4)
        nbformat.validate(committed)
        assert _cells(committed) == _cells(nbformat.reads(text, as_version=4)), (
            f"{name} differs from notebooks/_build.py: rerun it")
        code = [c for c in committed.cells if c.cell_type == "code"]
        assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), name
        outputs = [o for c in code for o in c.outputs]
        assert not [o for o in outputs if o.output_type == "error"], name
        assert any(o.output_type == "stream" for o in outputs), name
        if "matplotlib" in text:  # its plots are in the file
            assert any("image/png" in o.get("data", {}) for o in outputs), name


def test_python3_kernel_is_this_interpreter():
    # The kernelspec says "python"; jupyter_client starts it as sys.executable, so the
    # notebooks see this environment (and the dilax that PYTHONPATH / the install points to).
    cmd = KernelManager(kernel_name="python3").format_kernel_cmd()
    assert Path(cmd[0]).resolve() == Path(sys.executable).resolve(), cmd


@pytest.mark.parametrize("name", sorted(BUDGET_S))
def test_notebook_runs(name, capsys):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    t0 = time.perf_counter()
    env = dict(os.environ, XLA_FLAGS=xla_flags(), **NOTEBOOK_ENV)
    client.execute(env=env)  # raises CellExecutionError (with the traceback) if a cell fails
    elapsed = time.perf_counter() - t0
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors, errors
    ran = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in ran), "some cells did not run"
    with capsys.disabled():
        over = " OVER BUDGET" if elapsed > BUDGET_S[name] else ""
        print(f"\nnotebook {name}: {elapsed:.1f} s (budget {BUDGET_S[name]} s){over}")
