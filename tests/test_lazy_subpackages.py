"""Every ``dilax.<subpackage>...`` path the docs use works right after ``import dilax``, in a
fresh interpreter (no earlier import may have loaded the subpackage), and ``import dilax`` alone
still loads no Flax (issue 30)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_imports import IN_A_FORK, _fresh  # a new interpreter on this checkout

REPO = Path(__file__).resolve().parents[1]
# the user-facing docs, and the docstrings and messages of the package itself
_DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
         *sorted((REPO / "dilax").rglob("*.py"))]
# ``python -m dilax.x.script`` names a script to run and ``:mod:`dilax.x.y``` a module to
# read, not attributes to use
_PATH = re.compile(r"(?<!-m )(?<!:mod:`)\bdilax((?:\.[A-Za-z_]\w*)+)")


def _documented_paths() -> dict[str, list[str]]:
    """``{subpackage: [dotted paths under dilax]}`` for every ``dilax.x.y`` the docs write."""
    found: dict[str, set[str]] = {}
    for doc in _DOCS:
        for m in _PATH.finditer(doc.read_text(encoding="utf-8")):
            parts = m.group(1).lstrip(".").split(".")
            pkg = REPO / "dilax" / parts[0]
            if pkg.is_dir() or pkg.with_suffix(".py").is_file():
                found.setdefault(parts[0], set()).add(".".join(parts))
    return {k: sorted(v) for k, v in sorted(found.items())}


PATHS = _documented_paths()


def test_the_docs_name_the_flax_subpackages():
    # the scan below is not vacuous: the paths of the issue are among those checked
    for sub in ("nn", "models", "train"):
        assert sub in PATHS, sorted(PATHS)
    assert "nn.MultiheadDilatedAttention" in PATHS["nn"]


# One fresh interpreter imports dilax, then forks one child per subpackage: each child is a
# copy of an interpreter that has done nothing but ``import dilax`` (what a fresh interpreter
# per subpackage gave, at the cost of 27 interpreter starts and jax imports). The issue's
# example runs in one more child.
_RESOLVE_EACH_IN_A_FORK = IN_A_FORK + """
import dilax
flax = lambda: sorted(m for m in sys.modules if m == 'flax' or m.startswith('flax.'))
flax_before = bool(flax())
def resolve(paths):
    missing = []
    for path in paths:
        obj = dilax
        try:
            for part in path.split('.'):
                obj = getattr(obj, part)
        except AttributeError as e:
            missing.append(f'dilax.{path}: {e}')
    return missing
def issue_example():
    before = flax()
    listed = all(s in dir(dilax) for s in ('nn', 'models', 'train'))
    cls = dilax.nn.MultiheadDilatedAttention
    return dict(before=before, after=bool(flax()), listed=listed,
                cls=cls.__module__ + '.' + cls.__name__,
                same=dilax.models is sys.modules['dilax.models'])
missing = {sub: in_a_fork(lambda: resolve(paths)) for sub, paths in %r.items()}
print(json.dumps(dict(flax_before=flax_before, missing=missing,
                      issue_example=in_a_fork(issue_example))))
"""


@pytest.fixture(scope="module")
def resolved() -> dict:
    return _fresh(_RESOLVE_EACH_IN_A_FORK % (PATHS,))


@pytest.mark.parametrize("sub", sorted(PATHS))
def test_documented_paths_resolve_after_import_dilax(sub, resolved):
    assert not resolved["flax_before"], "import dilax loaded flax"
    assert resolved["missing"][sub] == [], resolved["missing"][sub]


def test_issue_example_and_no_flax_until_used(resolved):
    assert resolved["issue_example"] == {
        "before": [], "after": True, "listed": True,
        "cls": "dilax.nn.attention.MultiheadDilatedAttention", "same": True}
