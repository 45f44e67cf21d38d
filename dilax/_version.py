"""The version of dilax (one place: :mod:`dilax` and :mod:`dilax.backend` read it)."""

__version__ = "0.1.0"
