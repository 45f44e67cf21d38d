"""Data shipped with dilax: ``fables.txt``, a synthetic character-level corpus.

See :mod:`dilax.data.make_corpus` for how it is generated and what structure it holds.
"""

from __future__ import annotations

from importlib import resources

CORPUS_NAME = "fables.txt"


def load_corpus(name: str = CORPUS_NAME) -> str:
    """Returns the text of a corpus file shipped in ``dilax/data``."""
    return resources.files(__name__).joinpath(name).read_text(encoding="ascii")


__all__ = ["CORPUS_NAME", "load_corpus"]
