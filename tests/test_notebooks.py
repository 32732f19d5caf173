"""Every teaching notebook runs end to end (a broken notebook fails CI) and is stored clean."""

from __future__ import annotations

import os
from pathlib import Path

import nbclient
import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT = 150  # seconds: a hang fails fast; each notebook takes well under two minutes on 2 cores


def test_there_are_four_teaching_notebooks():
    assert [path.name[:2] for path in NOTEBOOKS] == ["01", "02", "03", "04"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(not cell.outputs and cell.execution_count is None for cell in code)
    assert any(cell.cell_type == "markdown" for cell in notebook.cells)


@pytest.mark.slow
@pytest.mark.timeout(300)  # a safety net for a shared machine, not a speed target
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_end_to_end(path, tmp_path, monkeypatch):
    notebook = nbformat.read(path, as_version=4)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("TMPDIR", os.fspath(tmp_path))  # the notebooks' scratch data lands here
    client = nbclient.NotebookClient(
        notebook, timeout=CELL_TIMEOUT, kernel_name="python3", resources={"metadata": {"path": os.fspath(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError naming the failing cell
    errors = [o for cell in notebook.cells for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    assert errors == []
