"""The version of dilax (one place: :mod:`dilax` and :mod:`dilax.registry` read it)."""

__version__ = "0.1.0"
