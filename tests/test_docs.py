"""The API reference: every public name has a docstring that names its arguments, and the Sphinx
build of docs/ (docstrings, command-line help, README guide, benchmarks, notebooks) passes with
warnings as errors and lists every public name."""

from __future__ import annotations

import importlib.util
import inspect
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, List, Tuple

import pytest

import packed_formats as pf
from packed_formats import transforms as T

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# the reference, one page per area; the format contract's page is for people who add a format
REFERENCE_PAGES = ("datasets", "transforms", "conversion", "storage", "cli", "errors", "formats")


def public_names() -> Iterator[Tuple[str, Any]]:
    """(qualified name, object) of everything in ``packed_formats.__all__`` and the transforms' ``__all__``."""
    for name in pf.__all__:
        yield f"packed_formats.{name}", getattr(pf, name)
    for name in T.__all__:
        yield f"packed_formats.transforms.{name}", getattr(T, name)


def documented_callables() -> Iterator[Tuple[str, Any]]:
    """The public classes and functions (constants and modules have no arguments to describe)."""
    for qualified, obj in public_names():
        if inspect.isclass(obj) or inspect.isfunction(obj):
            yield qualified, obj


def parameters(obj: Any) -> List[str]:
    """The names of the arguments a caller gives (``self``, ``*args`` and ``**kwargs`` left out)."""
    target = obj.__init__ if inspect.isclass(obj) else obj
    if target is object.__init__:
        return []
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return []
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p.name for p in signature.parameters.values() if p.name != "self" and p.kind not in variadic]


def docstring(obj: Any) -> str:
    """The text that describes ``obj``: its docstring, and for a class that of the ``__init__`` it runs
    (its own, or the base class's that defines it, with that class's docstring)."""
    parts = [inspect.getdoc(obj) or ""]
    if inspect.isclass(obj):
        owner = next((c for c in obj.__mro__ if "__init__" in vars(c)), object)
        if owner is not object:
            parts += [owner.__doc__ or "", owner.__init__.__doc__ or ""]
    return "\n".join(parts)


@pytest.mark.parametrize("qualified, obj", list(documented_callables()), ids=lambda v: v if isinstance(v, str) else "")
def test_every_public_name_has_a_docstring_naming_its_arguments(qualified, obj):
    text = docstring(obj)
    assert (inspect.getdoc(obj) or "").strip(), f"{qualified} has no docstring"
    missing = [p for p in parameters(obj) if not re.search(rf"\b{re.escape(p)}\b", text)]
    assert not missing, f"{qualified}'s docstring does not mention its arguments {missing}"


def test_every_public_constant_has_a_description_in_the_reference():
    """The reference documents each name in ``__all__``; constants, which have no docstring, take theirs
    from the docs extension's table."""
    pytest.importorskip("sphinx", reason="Sphinx is not installed: pip install -e '.[docs]'")
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        from pf_docs import CONSTANTS
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    constants = [q for q, obj in public_names() if not (inspect.isclass(obj) or callable(obj) or inspect.ismodule(obj))
                 or getattr(obj, "__origin__", None) is not None]
    assert constants and not [q for q in constants if q not in CONSTANTS]


@pytest.mark.slow
def test_the_docs_build_without_warnings(tmp_path):
    pytest.importorskip("sphinx", reason="Sphinx is not installed: pip install -e '.[docs]'")
    pytest.importorskip("myst_nb", reason="myst-nb is not installed: pip install -e '.[docs]'")
    out = tmp_path / "html"
    result = subprocess.run(  # as `make docs` does: warnings are errors
        [sys.executable, "-m", "sphinx", "-E", "-W", "--keep-going", "-q", "-b", "html", str(DOCS), str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-6000:]
    pages = {name: (out / f"{name}.html").read_text(encoding="utf-8") for name in REFERENCE_PAGES}
    assert 'id="module-packed_formats.transforms"' in pages["transforms"]
    for qualified, obj in public_names():
        on = [name for name, page in pages.items() if f'id="{qualified}"' in page]
        assert inspect.ismodule(obj) or len(on) == 1, f"{qualified} is on the reference pages {on}, not on one"
    api = (out / "api.html").read_text(encoding="utf-8")
    assert all(f'href="{name}.html"' in api for name in REFERENCE_PAGES), "the API page lists every page"
    for name, page in pages.items():  # each page opens with a short example, before its first entry
        first_entry = min((page.find(mark) for mark in ('class="py ', 'id="packed-formats-') if mark in page),
                          default=len(page))
        assert 'class="highlight' in page[:first_entry], f"{name} does not open with an example"
    assert 'id="packed_formats.Reader.read"' in pages["formats"]
    assert 'id="packed_formats.Reader.check_sample"' not in pages["formats"], "Reader's internals are not the API"
    import packed_formats.cli

    for command in packed_formats.cli.COMMANDS:
        assert f"usage: packed-formats {command}" in pages["cli"]
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):  # rendered with their stored outputs
        assert "cell_output" in (out / "notebooks" / f"{notebook.stem}.html").read_text(encoding="utf-8")


def notebook_tool():
    """tools/notebooks.py (what ``make notebooks`` runs) as a module."""
    spec = importlib.util.spec_from_file_location("notebooks_tool_for_docs", ROOT / "tools" / "notebooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_make_notebooks_leaves_a_notebook_whose_outputs_did_not_change_in_substance_as_it_is(tmp_path):
    """Running the notebooks again rewrites none whose outputs differ only in timings (a ``varies`` cell),
    so ``git status`` stays clean; a changed word is stored."""
    nbformat = pytest.importorskip("nbformat")
    tool = notebook_tool()
    path = tmp_path / "lesson.ipynb"
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell('import time\nprint(f"took {time.perf_counter_ns()} ns")',
                                  metadata={"tags": [tool.VARIES]}),
        nbformat.v4.new_code_cell('print("labels: [0, 1]")'),
    ]
    nbformat.write(notebook, path)
    assert tool.run([path]) == 0
    stored = path.read_bytes()
    assert tool.run([path]) == 0
    assert path.read_bytes() == stored, "a run that changed only a timing rewrote the notebook"
    changed = nbformat.read(path, as_version=4)
    changed.cells[1].outputs[0].text = "labels: [0, 2]\n"  # stored outputs the code no longer produces
    nbformat.write(changed, path)
    assert tool.run([path]) == 0
    assert "labels: [0, 1]" in path.read_text(encoding="utf-8")
