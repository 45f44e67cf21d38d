"""Every public dilax name the README's and the guides' code uses (code blocks and inline code)
has an entry in the API reference, docs/api.md (issue 30: ``load_model`` and ``sample_text``
had none)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
API = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
# the guides: every page of the docs site but the reference itself
GUIDES = {p.name: p.read_text(encoding="utf-8") for p in sorted((ROOT / "docs").glob("*.md"))
          if p.name != "api.md"}
# autodoc directives: ".. automodule:: dilax.train", ".. autofunction:: dilax.train.load_model",
# ".. autoclass:: dilax.KVCache" (with its members), ".. py:data:: dilax.sp.LAYOUTS"
DOCUMENTED = set(re.findall(r"^\.\. (?:auto\w+|py:data):: ([\w.]+)$", API, re.M))
CLASSES = set(re.findall(r"^\.\. autoclass:: ([\w.]+)$", API, re.M))


def _code(text: str) -> str:
    """The code of ``text``: fenced blocks and inline spans."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S)
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.M | re.S)
    return "\n".join(blocks + re.findall(r"`([^`\n]+)`", prose))


def used_names(text: str) -> set[str]:
    """Dotted public names under dilax that ``text``'s code uses: ``dilax.a.b`` chains (not
    ``python -m dilax.x``, a command) and ``from dilax.x import a, b``."""
    code = _code(text)
    names = {m[1] for m in re.finditer(r"(?<!-m )\b(dilax(?:\.[A-Za-z]\w*)+)", code)}
    for mod, imported in re.findall(r"from (dilax(?:\.\w+)*) import (\([^)]*\)|[^\n]+)", code):
        for part in imported.strip("()").split(","):
            name = part.split(" as ")[0].strip()
            if name and not name.startswith("_"):
                names.add(f"{mod}.{name}")
    return names


def _entry(name: str) -> str | None:
    """The api.md entry that documents ``name``: itself, or the class whose attribute it is
    (``dilax.KVCache.init``: ``autoclass`` documents its members); a module's section does
    not document the names in it."""
    if name in DOCUMENTED:
        return name
    parts = name.split(".")
    owners = (".".join(parts[:i]) for i in range(len(parts) - 1, 1, -1))
    return next((o for o in owners if o in CLASSES), None)


def test_the_scan_finds_the_readme_names():
    names = used_names(README)
    assert {"dilax.dilated_attention", "dilax.AttentionMask.build",
            "dilax.nn.MultiheadDilatedAttention", "dilax.SequenceParallel"} <= names, sorted(names)


def test_the_scan_finds_the_guides_names():
    names = set().union(*(used_names(text) for text in GUIDES.values()))
    assert "dilax.sample" not in names  # training.md runs it (python -m dilax.sample), a command
    assert {"dilax.train.load_model", "dilax.train.sample_text", "dilax.models.generate",
            "dilax.KVCache.init", "dilax.ring_dilated_attention",
            "dilax.nn.MultiheadDilatedAttention", "dilax.dilated_attention_decode",
            "dilax.SequenceParallel"} <= names, sorted(names)


def test_every_public_name_readme_uses_is_in_api_md():
    missing = sorted(n for n in used_names(README) if _entry(n) is None)
    assert missing == [], f"README uses names docs/api.md does not document: {missing}"


def test_every_public_name_the_guides_use_is_in_api_md():
    missing = sorted(f"{page}: {n}" for page, text in GUIDES.items()
                     for n in used_names(text) if _entry(n) is None)
    assert missing == [], f"the guides use names docs/api.md does not document: {missing}"
