"""Sphinx configuration of the packed_formats documentation: ``make docs`` builds it into docs/_build/html."""

import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE / "_ext"))

import packed_formats  # noqa: E402

project = "packed_formats"
author = "packed_formats authors"
copyright = "packed_formats authors, MIT licence"
version = release = packed_formats.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # the docstrings' "Args:" and "Raises:" sections
    "sphinx.ext.viewcode",
    "myst_nb",  # the notebooks, with the outputs stored in them (never executed here)
    "pf_docs",  # the public API from __all__, and the command line's --help
]

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_class_signature = "mixed"
autodoc_inherit_docstrings = False  # nn.Module's docstrings are not ours
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_param = False  # "a, b: what both are" stays one entry, not the same paragraph under each name
nb_execution_mode = "off"
myst_heading_anchors = 3
suppress_warnings = [
    "myst.header",  # notebooks start with a level-2 heading below their title cell
]
exclude_patterns = ["_build", "**.ipynb_checkpoints"]
html_theme = "alabaster"
html_title = f"packed_formats {release}"

# The notebooks live in notebooks/ at the top of the repository (where `make notebooks` runs and
# stores them); a fresh copy is rendered from docs/notebooks/ with the outputs they hold.
_notebooks = HERE / "notebooks"
shutil.rmtree(_notebooks, ignore_errors=True)
_notebooks.mkdir()
for _notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
    shutil.copy2(_notebook, _notebooks / _notebook.name)
