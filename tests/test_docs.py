"""docs/ is current: api.md (the API reference page, autodoc directives) equals what
docs/_build_api.py generates and names every public name, every public name has a docstring,
every page is in the site's table of contents, and README.md and docs/*.md link only to files
that exist. ``make docs`` renders the site with Sphinx, warnings as errors."""

from __future__ import annotations

import importlib.util
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _builder():
    spec = importlib.util.spec_from_file_location("docs_build_api", ROOT / "docs" / "_build_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BUILDER = _builder()
PUBLIC = [(f"{mod}.{name}", obj) for mod, names, _ in BUILDER.SECTIONS
          for name, obj in BUILDER.public_names(mod, names)]


def test_api_page_is_current():
    committed = (ROOT / "docs" / "api.md").read_text()
    assert committed == BUILDER.render(), (
        "docs/api.md is stale: run `python docs/_build_api.py` and commit docs/api.md")


def test_api_page_lists_every_exported_name():
    text = (ROOT / "docs" / "api.md").read_text()
    entries = re.findall(r"^\.\. (autofunction|autoclass|py:data):: ([\w.]+)$", text, re.M)
    named = {name for _, name in entries}
    for qualname, _ in PUBLIC:
        assert qualname in named, qualname
    # every name of dilax.__all__ (and of the subpackages' __all__) is on the page
    import dilax
    for mod, names, _ in BUILDER.SECTIONS:
        if names is None:
            module = dilax if mod == "dilax" else getattr(dilax, mod.split(".")[1])
            assert {f"{mod}.{n}" for n in module.__all__} <= named, mod
    assert len(PUBLIC) >= 40
    # a class is rendered with its documented members, a function with its signature
    kinds = dict((name, kind) for kind, name in entries)
    assert kinds["dilax.dilated_attention"] == "autofunction"
    assert kinds["dilax.KVCache"] == "autoclass"


@pytest.mark.parametrize("qualname,obj", [p for p in PUBLIC
                                          if inspect.isclass(p[1]) or inspect.isfunction(p[1])
                                          or inspect.ismodule(p[1])],
                         ids=lambda x: x if isinstance(x, str) else "")
def test_public_name_has_docstring(qualname, obj):
    doc = inspect.getdoc(obj) or ""
    if inspect.isclass(obj) and doc.startswith(obj.__name__ + "("):
        doc = ""  # the dataclass-generated signature is not documentation
    assert len(doc) >= 30, f"{qualname} has no real docstring"


FUNCTIONAL_OPS = ["dilax.dilated_attention", "dilax.block_sparse_attention",
                  "dilax.content_adaptive_attention", "dilax.ring_dilated_attention",
                  "dilax.ring_block_sparse_attention", "dilax.attention_fn"]


@pytest.mark.parametrize("qualname", FUNCTIONAL_OPS)
def test_attention_ops_document_layout_and_dtype(qualname):
    obj = dict(PUBLIC)[qualname]
    doc = inspect.getdoc(obj)
    assert re.search(r"\((b|\.\.\.), n(/P)?, h, d\)", doc), qualname
    assert "dtype" in doc, qualname


def test_every_page_is_in_the_table_of_contents():
    index = (ROOT / "docs" / "index.md").read_text()
    toctrees = "\n".join(re.findall(r"^```\{toctree\}\n(.*?)^```", index, re.M | re.S))
    entries = {line.strip() for line in toctrees.splitlines()
               if line.strip() and not line.startswith(":")}
    for page in sorted((ROOT / "docs").glob("*.md")):
        if page.stem != "index":
            assert page.stem in entries, f"docs/{page.name} is in no toctree of docs/index.md"
    assert "notebooks/*" in entries  # every notebook of notebooks/, rendered unexecuted
    conf = (ROOT / "docs" / "conf.py").read_text()
    assert re.search(r'^nb_execution_mode = "off"', conf, re.M)


def test_pages_link_only_to_existing_files():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)\)", page.read_text()):
            if not re.match(r"[a-z]+:", target):
                assert (page.parent / target).exists(), f"{page.name} links to {target}"
