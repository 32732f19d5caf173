"""Run the teaching notebooks and keep their stored outputs true.

    python tools/notebooks.py run   [NOTEBOOK ...]   # execute in place, store outputs and plots
    python tools/notebooks.py check [NOTEBOOK ...]   # execute a copy, compare with what is stored

`make notebooks` runs the first; the test suite runs the second, so a notebook
whose code changed, or whose outputs no longer follow from its code, fails CI.
`run` rewrites a notebook only when `check` would find a difference, so running
it again on an unchanged notebook leaves the file, and the checkout, as they were.

What `check` compares, cell by cell: the source; the kind and order of the
outputs; and every line of text they print.  Lines from a cell tagged
``varies`` (timings, memory, the machine) are compared with their numbers
masked (runs of spaces count as one), so a slower machine still passes while a changed sentence, a new
warning or a different label does not.  Figures are compared by count: their
pixels may hold timings.  Every notebook runs in its own scratch directory
(TMPDIR), with a fixed hash seed.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable, List, Sequence

import nbclient
import nbformat

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
CELL_TIMEOUT = 240  # seconds: a hang fails fast; no cell needs more than a few seconds on 2 cores
VARIES = "varies"  # cell tag: text whose numbers depend on the machine or on timing
SOLUTION = "solution"  # cell tag: an exercise's solution, collapsed when the notebook is opened
NUMBER = re.compile(r"[-+]?(?:\d[\d,_]*)?\.?\d+(?:[eE][-+]?\d+)?")
# text a reader of the stored outputs must never see: paths of the machine that ran them, internal goal lines
FORBIDDEN = (re.compile(r"(?<![\w.])/(?:tmp|home|work|var|private|Users|scratch)/"), re.compile(r"\bMISS\b"))


def notebooks(names: Sequence[str]) -> List[Path]:
    if not names:
        return sorted(NOTEBOOK_DIR.glob("*.ipynb"))
    return [Path(name).resolve() for name in names]


def execute(path: Path) -> nbformat.NotebookNode:
    """The notebook at ``path`` run top to bottom in a fresh kernel (raises on the first failing cell)."""
    notebook = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory(prefix="pf-notebook-") as scratch:
        environment = {"TMPDIR": scratch, "PYTHONHASHSEED": "0", "PYTHONWARNINGS": "default"}
        saved = {name: os.environ.get(name) for name in (*environment, "MPLBACKEND")}
        os.environ.update(environment)
        os.environ.pop("MPLBACKEND", None)  # the kernel's inline backend stores figures as PNG outputs
        try:
            client = nbclient.NotebookClient(
                notebook, timeout=CELL_TIMEOUT, kernel_name="python3", record_timing=False, coalesce_streams=True,
                resources={"metadata": {"path": scratch}},
            )
            client.execute()
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    tidy(notebook)
    return notebook


def tidy(notebook: nbformat.NotebookNode) -> None:
    """Keep what a reader needs; drop what differs between runs for no reason (kernel versions, ids)."""
    notebook.metadata.pop("widgets", None)
    language = notebook.metadata.get("language_info", {})
    for key in ("version", "pygments_lexer"):
        language.pop(key, None)
    for cell in notebook.cells:
        cell.metadata.pop("execution", None)
        if SOLUTION in cell.metadata.get("tags", []):
            cell.metadata.setdefault("jupyter", {})["source_hidden"] = True


def text_lines(output: dict) -> List[str]:
    if output["output_type"] == "stream":
        text = output["text"]
    elif output["output_type"] in ("execute_result", "display_data"):
        text = output.get("data", {}).get("text/plain", "")
    else:
        text = "".join(output.get("traceback", [])) or output.get("evalue", "")
    return "".join(text).splitlines()


def shape(output: dict) -> str:
    if output["output_type"] == "stream":
        return f"stream:{output['name']}"
    return ":".join([output["output_type"], *sorted(output.get("data", {}))])


def problems_in(notebook: nbformat.NotebookNode) -> List[str]:
    """What is wrong with a notebook's outputs on their own: errors, and text no reader should see."""
    found = []
    for number, cell in enumerate(notebook.cells):
        for output in cell.get("outputs", []):
            if output["output_type"] == "error":
                found.append(f"cell {number}: {output['ename']}: {output['evalue']}")
            for line in text_lines(output):
                if any(pattern.search(line) for pattern in FORBIDDEN):
                    found.append(f"cell {number} prints {line.strip()!r}")
    return found


def differences(stored: nbformat.NotebookNode, fresh: nbformat.NotebookNode) -> List[str]:
    """How the stored outputs differ from a fresh run's, ignoring what the ``varies`` tag allows."""
    if len(stored.cells) != len(fresh.cells):
        return [f"{len(stored.cells)} cells stored, {len(fresh.cells)} run"]
    found = []
    for number, (old, new) in enumerate(zip(stored.cells, fresh.cells)):
        where = f"cell {number}"
        if old.source != new.source:
            found.append(f"{where}: source differs")
            continue
        if old.cell_type != "code":
            continue
        old_outputs, new_outputs = old.get("outputs", []), new.get("outputs", [])
        if [shape(o) for o in old_outputs] != [shape(o) for o in new_outputs]:
            found.append(f"{where}: outputs {[shape(o) for o in old_outputs]} stored, "
                         f"{[shape(o) for o in new_outputs]} now")
            continue
        masked = VARIES in old.metadata.get("tags", [])
        for old_output, new_output in zip(old_outputs, new_outputs):
            found += _line_differences(where, text_lines(old_output), text_lines(new_output), masked)
    return found


def _line_differences(where: str, old: List[str], new: List[str], masked: bool) -> List[str]:
    if masked:  # numbers, and the padding that aligns them, may change
        old, new = ([" ".join(NUMBER.sub("#", line).split()) for line in lines] for lines in (old, new))
    if len(old) != len(new):
        return [f"{where}: {len(old)} lines stored, {len(new)} now (first new: {new[:1]})"]
    return [f"{where}: stored {a!r}, now {b!r}" for a, b in zip(old, new) if a != b][:3]


def run(paths: Iterable[Path]) -> int:
    """Execute each notebook and store its outputs, rewriting the file only when they changed in substance.

    "In substance" is what ``check`` compares: a run that differs from the stored outputs only in what
    ``varies`` allows (timings, memory figures, a figure's pixels) leaves the file as it is, so that
    running the notebooks again does not dirty the checkout.
    """
    status = 0
    for path in paths:
        stored = nbformat.read(path, as_version=4)
        start = time.perf_counter()
        notebook = execute(path)
        problems = problems_in(notebook)
        current = not problems_in(stored) and not differences(stored, notebook)
        if not current:
            nbformat.write(notebook, path)
        verdict = "stored outputs are current, file left as it is" if current else "outputs stored"
        print(f"{path.name}: ran in {time.perf_counter() - start:.1f} s, {verdict}", flush=True)
        for problem in problems:
            print(f"  {problem}")
            status = 1
    return status


def check(paths: Iterable[Path]) -> int:
    status = 0
    for path in paths:
        stored = nbformat.read(path, as_version=4)
        start = time.perf_counter()
        fresh = execute(path)
        found = problems_in(stored) + differences(stored, fresh)
        verdict = "stored outputs are current" if not found else "stored outputs are out of date"
        print(f"{path.name}: ran in {time.perf_counter() - start:.1f} s, {verdict}", flush=True)
        for difference in found:
            print(f"  {difference}")
        status |= bool(found)
    if status:
        print("run `make notebooks` and commit the notebooks it rewrote")
    return status


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("run", "check"))
    parser.add_argument("notebooks", nargs="*", help="default: every notebook in notebooks/")
    args = parser.parse_args(argv)
    paths = notebooks(args.notebooks)
    return run(paths) if args.action == "run" else check(paths)


if __name__ == "__main__":
    sys.exit(main())
