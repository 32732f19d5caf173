"""The teaching notebooks: stored with their outputs, one lesson each, and those outputs kept true.

The slow tests execute every notebook (as `make notebooks` does) and compare the result with what is
committed, so a notebook that errors, or whose stored outputs no longer follow from its code, fails CI.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("notebook_tool", ROOT / "tools" / "notebooks.py")
assert spec is not None and spec.loader is not None
tool = importlib.util.module_from_spec(spec)
sys.modules["notebook_tool"] = tool
spec.loader.exec_module(tool)

NOTEBOOKS = tool.notebooks([])
LESSONS = ["why_packed_formats", "multi_worker_safety", "convert_and_benchmark", "fast_gpu_pipeline",
           "walltime_resume", "integrity", "object_storage", "segmentation_fields"]


def code_cells(notebook):
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


def test_there_is_one_notebook_per_lesson():
    assert [path.stem for path in NOTEBOOKS] == [f"{n:02d}_{name}" for n, name in enumerate(LESSONS, 1)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_with_its_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    cells = code_cells(notebook)
    assert [cell.execution_count for cell in cells] == list(range(1, len(cells) + 1)), "run `make notebooks`"
    assert tool.problems_in(notebook) == []
    kinds = [tool.shape(output) for cell in cells for output in cell.outputs]
    assert any("image/" in kind for kind in kinds), "every lesson shows at least one figure"
    assert sum(bool(cell.outputs) for cell in cells) >= len(cells) // 2, "a reader of the stored notebook sees results"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_ends_with_exercises_and_hidden_solutions(path):
    notebook = nbformat.read(path, as_version=4)
    prose = [cell.source.splitlines() for cell in notebook.cells if cell.cell_type == "markdown" and cell.source]
    assert prose[0][0].startswith("# "), "a lesson opens with its title"
    assert any(line.startswith("## Exercises") for lines in prose for line in lines)
    solutions = [cell for cell in code_cells(notebook) if tool.SOLUTION in cell.metadata.get("tags", [])]
    assert solutions and all(cell.metadata["jupyter"]["source_hidden"] for cell in solutions)


def _with_output(text, tags=()):
    notebook = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("print(...)", metadata={"tags": list(tags)})
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=text)]
    notebook.cells = [cell]
    return notebook


def test_comparison_masks_numbers_only_in_cells_that_vary():
    stored = _with_output("zip: 1,234 img/s, 3.5x the folder\nlabels: [0, 1, 2]\n", tags=[tool.VARIES])
    fresh = copy.deepcopy(stored)
    fresh.cells[0].outputs[0].text = "zip: 987 img/s, 12.25x the folder\nlabels: [0, 1, 7]\n"
    assert tool.differences(stored, fresh) == []  # every number in a `varies` cell may change
    fresh.cells[0].outputs[0].text = "zip: 987 img/s, 12.25x the archive\nlabels: [0, 1, 7]\n"
    assert len(tool.differences(stored, fresh)) == 1  # its words may not


def test_comparison_catches_changed_text_outputs_and_sources():
    stored = _with_output("sample 3: label 2, CRC ok\n")
    fresh = copy.deepcopy(stored)
    fresh.cells[0].outputs[0].text = "sample 3: label 1, CRC ok\n"
    assert tool.differences(stored, fresh) == [
        "cell 0: stored 'sample 3: label 2, CRC ok', now 'sample 3: label 1, CRC ok'"
    ]
    fresh = copy.deepcopy(stored)
    fresh.cells[0].outputs.append(nbformat.v4.new_output("stream", name="stderr", text="UserWarning: ...\n"))
    assert "outputs" in tool.differences(stored, fresh)[0]
    fresh = copy.deepcopy(stored)
    fresh.cells[0].source = "print(1)"
    assert tool.differences(stored, fresh) == ["cell 0: source differs"]


def test_outputs_that_name_the_machine_running_them_are_refused():
    assert tool.problems_in(_with_output("wrote /tmp/pf-abc/train.zip\n"))
    assert tool.problems_in(_with_output("  MISS encoded >= 1x\n"))
    assert tool.problems_in(_with_output("wrote train.zip (2.4 MB), see docs/benchmarks.rst\n")) == []


@pytest.mark.slow
@pytest.mark.timeout(600)  # a safety net for a shared machine, not a speed target
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_outputs_are_what_the_notebook_produces(path):
    stored = nbformat.read(path, as_version=4)
    fresh = tool.execute(path)  # raises CellExecutionError naming the failing cell
    assert tool.problems_in(fresh) == []
    assert tool.differences(stored, fresh) == [], "run `make notebooks` and commit what it rewrote"
