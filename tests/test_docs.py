"""docs/ is current: api.md equals what docs/_build_api.py generates, every public name has a
docstring, and README.md and docs/*.md link only to files that exist."""

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
PUBLIC = [(f"{mod}.{name}", obj) for mod, names in BUILDER.SECTIONS
          for name, obj in BUILDER.public_names(mod, names)]


def test_api_page_is_current():
    committed = (ROOT / "docs" / "api.md").read_text()
    assert committed == BUILDER.render(), (
        "docs/api.md is stale: run `python docs/_build_api.py` and commit docs/api.md")


def test_api_page_lists_every_exported_name():
    text = (ROOT / "docs" / "api.md").read_text()
    for qualname, _ in PUBLIC:
        assert f"### `{qualname}`" in text, qualname
    assert len(PUBLIC) >= 40


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


def test_pages_link_only_to_existing_files():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)\)", page.read_text()):
            if not re.match(r"[a-z]+:", target):
                assert (page.parent / target).exists(), f"{page.name} links to {target}"
