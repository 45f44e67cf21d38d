"""The command-line tools' persistent compilation cache: a second run of the same command
loads its compiled programs instead of compiling them again.

``python -m dilax.train``, ``python -m dilax.sample`` and ``python -m benchmarks`` (every
command but ``gpu-compile``, whose report times the compiles) call :func:`enable` first. The
cache is JAX's own (``jax_compilation_cache_dir``), in
``$JAX_COMPILATION_CACHE_DIR`` when that is set, else in ``$XDG_CACHE_HOME/dilax/jax``
(``~/.cache/dilax/jax``). Turn it off with ``--no-compile-cache`` or
``DILAX_NO_COMPILE_CACHE=1``; delete the directory to empty it. Programs that compile in
under a second are not cached (JAX's default threshold). Library calls never touch it: only
these entry points do.
"""

from __future__ import annotations

import os

OFF_VARIABLE = "DILAX_NO_COMPILE_CACHE"


def default_dir() -> str:
    """``$JAX_COMPILATION_CACHE_DIR``, else ``$XDG_CACHE_HOME/dilax/jax`` (``~/.cache``)."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dilax", "jax")


def enable(off: bool = False) -> str | None:
    """Points JAX's persistent compilation cache at :func:`default_dir` (created if needed)
    and returns it; ``None`` (nothing changed) when ``off`` or ``DILAX_NO_COMPILE_CACHE`` is
    set to anything but ``0``/empty."""
    if off or os.environ.get(OFF_VARIABLE, "0") not in ("", "0"):
        return None
    import jax

    path = default_dir()
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    return path
