"""Sphinx directives that build the reference from the package itself, so that it never falls behind.

``.. public-api:: packed_formats`` documents names of a module's ``__all__`` (classes with their
public methods, functions, exceptions, constants): every name, or with ``:names:`` the ones of one
page of the reference.  Across the build, each name in the ``__all__`` of a module that a page
documents must be on exactly one page: a name on none (a new one) or on two is a warning, so
``make docs`` (warnings are errors) fails until it has its place.  ``.. cli-help::`` shows the
``--help`` of ``packed-formats`` and of each of its commands, exactly as the command line prints them.
"""

from __future__ import annotations

import importlib
import inspect
import os
from typing import Any, Dict, List

from docutils import nodes
from docutils.parsers.rst import directives
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

logger = logging.getLogger(__name__)

# The public constants: what each is (data has no docstring of its own).
CONSTANTS: Dict[str, str] = {
    "packed_formats.FORMATS": "The names of every format a Reader opens (``format=`` everywhere), "
    "the plain image folder included. Formats registered at run time appear here too.",
    "packed_formats.PACKED_FORMATS": "The names of the formats ``convert`` and ``open_writer`` write.",
    "packed_formats.transforms.IMAGENET_MEAN": "ImageNet's per-channel mean, in [0, 1] units "
    "(``Normalize``'s default).",
    "packed_formats.transforms.IMAGENET_STD": "ImageNet's per-channel standard deviation, in [0, 1] units "
    "(``Normalize``'s default).",
    "packed_formats.transforms.UINT8_TO_UNIT": "1 / 255: the scale from uint8 pixels to [0, 1].",
    "packed_formats.transforms.Size": "An output size: an int (a square, or for ``Resize`` the shorter side) "
    "or (height, width).",
}


class PublicApi(SphinxDirective):
    """``.. public-api:: <module>``: an autodoc entry for each name in the module's ``__all__``.

    ``:names:`` (whitespace-separated) documents only those names, in that order; ``Name:a,b``
    shows only the members ``a`` and ``b`` of class ``Name`` (its other public methods are
    internal to the library).
    """

    required_arguments = 1
    option_spec = {"names": directives.unchanged_required}

    def run(self) -> List[nodes.Node]:
        module = importlib.import_module(self.arguments[0])
        wanted = self.options.get("names", "").split() or list(module.__all__)
        lines: List[str] = []
        documented = _documented(self.env)
        for entry in wanted:
            name, _, members = entry.partition(":")
            if name not in module.__all__:
                logger.warning(f"{name} is not in {module.__name__}.__all__", location=self.get_location())
                continue
            qualified = f"{module.__name__}.{name}"
            documented.setdefault(qualified, []).append(self.env.docname)
            lines += self._entry(qualified, getattr(module, name), members.replace(",", ", ")) + [""]
        content = StringList(lines, source=f"<public-api {module.__name__}>")
        section = nodes.section()
        section.document = self.state.document
        nested_parse_with_titles(self.state, content, section)
        return section.children

    def _entry(self, qualified: str, obj: Any, members: str = "") -> List[str]:
        if inspect.ismodule(obj):
            return [f"``{qualified}``: the batch transforms, documented in :doc:`/transforms`."]
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            return [f".. autoexception:: {qualified}", "   :show-inheritance:"]
        if inspect.isclass(obj):
            return [f".. autoclass:: {qualified}", f"   :members: {members}".rstrip(), "   :show-inheritance:"]
        if callable(obj) and not hasattr(obj, "__origin__"):
            return [f".. autofunction:: {qualified}"]
        if qualified not in CONSTANTS:
            logger.warning(f"public name {qualified} has no description: add one to CONSTANTS in {__file__}",
                           location=self.get_location())
            return []
        module, name = qualified.rsplit(".", 1)
        return [f".. py:data:: {name}", f"   :module: {module}", f"   :value: {obj!r}", "",
                f"   {CONSTANTS[qualified]}"]


class CliHelp(SphinxDirective):
    """``.. cli-help::``: ``packed-formats --help`` and ``packed-formats <command> --help``, each in a section."""

    def run(self) -> List[nodes.Node]:
        from packed_formats.cli import build_parser

        os.environ["COLUMNS"] = "100"  # argparse wraps help to the terminal's width: one width for the page
        parser = build_parser()
        lines = self._block(parser.format_help())
        commands = next(a for a in parser._actions if a.choices and hasattr(a, "add_parser"))
        for name, command in commands.choices.items():
            title = f"packed-formats {name}"
            lines += [title, "-" * len(title), ""] + self._block(command.format_help())
        content = StringList(lines, source="<cli-help>")
        section = nodes.section()
        section.document = self.state.document
        nested_parse_with_titles(self.state, content, section)
        return section.children

    @staticmethod
    def _block(text: str) -> List[str]:
        return [".. code-block:: text", ""] + [f"   {line}".rstrip() for line in text.splitlines()] + [""]


def _documented(env: Any) -> Dict[str, List[str]]:
    """qualified public name -> the pages that document it, for this build."""
    if not hasattr(env, "pf_public_api"):
        env.pf_public_api = {}
    return env.pf_public_api


def _purge(app: Sphinx, env: Any, docname: str) -> None:
    for pages in _documented(env).values():
        pages[:] = [page for page in pages if page != docname]


def _merge(app: Sphinx, env: Any, docnames: Any, other: Any) -> None:
    for qualified, pages in _documented(other).items():
        _documented(env).setdefault(qualified, []).extend(pages)


def _check_every_name_has_one_page(app: Sphinx, env: Any) -> None:
    documented = {q: pages for q, pages in _documented(env).items() if pages}
    modules = {q.rsplit(".", 1)[0] for q in documented}
    for module_name in sorted(modules):
        module = importlib.import_module(module_name)
        for name in module.__all__:
            pages = documented.get(f"{module_name}.{name}", [])
            if not pages:
                logger.warning(f"public name {module_name}.{name} is on no page of the reference: "
                               f"add it to the :names: of one public-api directive")
            elif len(pages) > 1:
                logger.warning(f"public name {module_name}.{name} is on several pages: {sorted(pages)}")


def setup(app: Sphinx) -> Dict[str, Any]:
    app.add_directive("public-api", PublicApi)
    app.add_directive("cli-help", CliHelp)
    app.connect("env-purge-doc", _purge)
    app.connect("env-merge-info", _merge)
    app.connect("env-check-consistency", _check_every_name_has_one_page)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
