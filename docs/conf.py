"""Sphinx configuration of the dilax docs site (``make docs`` builds it into build/docs).

Pages are MyST Markdown (docs/*.md), the notebooks are notebooks/*.ipynb (docs/notebooks is a
link to that folder), rendered with their committed outputs and never executed, and the API
reference (docs/api.md, written by docs/_build_api.py) is autodoc over the docstrings.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # document this checkout's dilax, whatever is installed

project = "dilax"
author = "the dilax authors"
copyright = "2026, the dilax authors"

extensions = [
    "myst_nb",  # MyST Markdown pages and .ipynb notebooks (includes myst_parser)
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # Google-style "Args:" / "Returns:" sections
    "sphinx.ext.viewcode",
    "sphinx_design",  # the cards of the front page
]

root_doc = "index"
exclude_patterns = ["_build", "**/.ipynb_checkpoints", "notebooks/_*.py"]
# notebooks/*.ipynb are committed executed (notebooks/_build.py runs them): show their outputs
nb_execution_mode = "off"
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3  # [text](page.md#a-heading) links resolve

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autodoc_default_options = {"show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# "Fields:" in the dataclasses' docstrings lists their fields like "Args:"
napoleon_custom_sections = [("Fields", "params_style")]

html_theme = "sphinx_book_theme"
html_title = "dilax"
html_theme_options = {
    "show_toc_level": 2,
    "navigation_with_keys": False,
}
html_static_path: list[str] = []


# The pages are written for two readers: this site, and a code host that shows docs/*.md as
# they are. Their links are relative file paths that work on the code host; this hook turns
# the ones that leave docs/ into what the site has instead: a notebook page
# (../notebooks/x.ipynb, shown at notebooks/x through the docs/notebooks link) or a download of
# the file (../benchmarks/results/x.md, ../tests/x.py: the measurement or test a claim cites).
_OUTSIDE_LINK = re.compile(r"(?<!!)\[([^\]\n]+)\]\(\.\./([^)#\s]+)\)")


def _site_links(app, docname, source):
    if docname.startswith("notebooks/"):
        return  # the notebooks' own links (../docs/x.md) resolve through the link as they are

    def replace(m: re.Match) -> str:
        text, target = m.group(1).replace("`", ""), m.group(2)
        if target.startswith("notebooks/") and target.endswith(".ipynb"):
            return f"{{doc}}`{text} <{target.removesuffix('.ipynb')}>`"
        if not (ROOT / target).is_file():
            return m.group(0)  # left to Sphinx, which warns (tests/test_docs.py fails too)
        return f"{{download}}`{text} <../{target}>`"

    source[0] = _OUTSIDE_LINK.sub(replace, source[0])
    if docname == "index" and not (ROOT / "docs" / "migration.md").is_file():
        # the migration guide (docs/migration.md) is listed once it exists
        source[0] = re.sub(r"^migration\n", "", source[0], flags=re.M)


def setup(app):
    app.connect("source-read", _site_links)
