"""The package's layers: what may import what, read from the source (every import, at the top of a
module or inside a function, counts).

* The foundations (errors, checksums, codecs, the manifest, the index, policies...) import nothing of
  the package but each other.
* ``backends`` (the formats) imports only foundations: it knows nothing of URLs, stores, datasets or
  loaders.  ``archives`` is where a path or a URL is told apart, above both ``backends`` and
  ``storage``.
* ``loading`` (from an archive to batches) and ``writing`` (from a source to an archive) never import
  each other: what both need is a foundation or a backend.
* The package's parts (its root modules and its subpackages, each as one) import each other without a
  circle.
* Within ``backends``, the contract a format implements (``base.py``) imports neither the ``Reader`` nor
  the ``Writer`` at run time, and the helpers it uses (``files.py``) none of the three.
"""

from __future__ import annotations

import ast
import functools
import os
from typing import Any, Dict, List, Set

import packed_formats

PACKAGE = os.path.dirname(packed_formats.__file__)
FOUNDATIONS = {"errors", "handles", "checksum", "codecs", "native", "manifest", "index", "policy", "tracebacks",
               "fields", "image_decode"}


def modules() -> Dict[str, str]:
    """{dotted module name: file} of every module of the package."""
    found = {}
    for folder, _, names in os.walk(PACKAGE):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path[:-3], os.path.dirname(PACKAGE)).replace(os.sep, ".")
                found[dotted[: -len(".__init__")] if dotted.endswith(".__init__") else dotted] = path
    return found


def imports(name: str, path: str, known: Dict[str, str], run_time: bool = False) -> Set[str]:
    """The package's modules that module ``name`` imports, anywhere in it (``run_time``: but for the imports
    under ``if TYPE_CHECKING:``, which only the type checker makes)."""
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    out: Set[str] = set()
    tree = ast.parse(open(path, encoding="utf-8").read())
    if run_time:
        tree = WithoutTypeCheckingBlocks().visit(tree)
    for node in ast.walk(tree):
        targets: List[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        for target in targets:
            while target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in known and target != name:
                out.add(target)
    return out


class WithoutTypeCheckingBlocks(ast.NodeTransformer):
    """A module's tree without the bodies of its ``if TYPE_CHECKING:`` blocks."""

    def visit_If(self, node: ast.If) -> Any:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            return [self.visit(child) for child in node.orelse]
        return self.generic_visit(node)


def part(module: str) -> str:
    """The part a module belongs to: a root module is its own, a subpackage's modules are the subpackage."""
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else ""


def part_graph() -> Dict[str, Set[str]]:
    """{part: the parts it imports}: a fresh copy each call (a test may add to it), read from the source once."""
    return {source: set(targets) for source, targets in _part_graph().items()}


@functools.lru_cache(maxsize=None)
def _part_graph() -> Dict[str, Set[str]]:
    known = modules()
    graph: Dict[str, Set[str]] = {}
    for name, path in known.items():
        source = part(name)
        if not source:
            continue  # the package's __init__ gathers the public API from everything
        for target in imports(name, path, known):
            if part(target) and part(target) != source:
                graph.setdefault(source, set()).add(part(target))
    return graph


def test_the_foundations_import_only_each_other():
    graph = part_graph()
    for foundation in sorted(FOUNDATIONS):
        assert graph.get(foundation, set()) <= FOUNDATIONS, (foundation, graph.get(foundation, set()) - FOUNDATIONS)


def test_backends_import_only_foundations_and_know_nothing_of_urls():
    above = part_graph().get("backends", set()) - FOUNDATIONS
    assert not above, f"backends imports {sorted(above)}"


def test_the_read_path_and_the_write_path_never_import_each_other():
    graph = part_graph()
    assert "writing" not in graph.get("loading", set()), "loading imports writing"
    assert "loading" not in graph.get("writing", set()), "writing imports loading"
    assert {"backends", "archives"} <= graph["loading"] and {"backends", "sources"} <= graph["writing"]


def test_the_format_contract_imports_no_implementation():
    """``backends/base.py`` is the contract a format implements, readable alone: it imports neither
    ``reader`` nor ``writer`` when it runs (it names the Writer class only for the type checker), and
    ``files.py``, the helpers it shares with them, imports none of the three."""
    known = modules()
    below = {
        "packed_formats.backends.base": {"packed_formats.backends.reader", "packed_formats.backends.writer"},
        "packed_formats.backends.files": {"packed_formats.backends.base", "packed_formats.backends.reader",
                                          "packed_formats.backends.writer"},
    }
    for name, forbidden in below.items():
        found = imports(name, known[name], known, run_time=True) & forbidden
        assert not found, f"{name} imports {sorted(found)}"


def test_run_time_imports_leave_out_only_type_checking_blocks(tmp_path):
    """The check above sees an import made inside a function, and not one made for the type checker."""
    source = tmp_path / "base.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .writer import Writer\n"
                      "else:\n    from . import files\ndef load():\n    from .reader import Reader\n")
    known = {name: "" for name in ("pkg.base", "pkg.files", "pkg.reader", "pkg.writer")}
    assert imports("pkg.base", str(source), known, run_time=True) == {"pkg.files", "pkg.reader"}
    assert imports("pkg.base", str(source), known) == {"pkg.files", "pkg.reader", "pkg.writer"}


def test_the_parts_import_each_other_without_a_circle():
    graph = part_graph()
    state: Dict[str, int] = {}  # 1: on the path being walked, 2: done

    def walk(node: str, path: List[str]) -> None:
        state[node] = 1
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                circle = path[path.index(target):] + [target] if target in path else [node, target]
                raise AssertionError(f"import circle: {' -> '.join(circle)}")
            if target not in state:
                walk(target, path + [target])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node, [node])
    assert {"backends", "storage", "archives", "loading", "writing"} <= set(graph)  # the walk saw the package


def test_the_circle_check_finds_a_circle():
    """The check above fails on a circle (a graph with one added)."""
    graph = part_graph()
    graph.setdefault("backends", set()).add("storage")
    try:
        original, globals()["part_graph"] = part_graph, lambda: graph
        try:
            test_the_parts_import_each_other_without_a_circle()
        except AssertionError as error:
            assert "backends" in str(error) and "storage" in str(error)
        else:
            raise AssertionError("a circle went unseen")
    finally:
        globals()["part_graph"] = original
