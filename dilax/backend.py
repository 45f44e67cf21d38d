"""Which implementation runs where: ``implementation=`` resolution and :func:`describe`.

``implementation=None`` means the best one for the current default backend: the Pallas
kernels on GPU, the blockwise XLA core elsewhere. Everything GPU-only is imported lazily, so
importing dilax never needs a GPU jaxlib.
"""

from __future__ import annotations

import sys
from typing import TextIO

import jax

from dilax import _validation as V

IMPLEMENTATIONS = V.IMPLEMENTATIONS


def current_backend() -> str:
    """``jax.default_backend()`` (``"cpu"``, ``"gpu"``, ``"tpu"``)."""
    return jax.default_backend()


def default_implementation(backend: str | None = None) -> str:
    """``"pallas"`` on GPU, ``"xla"`` otherwise."""
    backend = current_backend() if backend is None else backend
    return "pallas" if backend in ("gpu", "cuda", "rocm") else "xla"


def resolve_implementation(implementation: str | None, *, interpret: bool = False,
                           allowed: tuple[str, ...] = IMPLEMENTATIONS,
                           backend: str | None = None) -> str:
    """Validates ``implementation`` and resolves ``None``.

    Raises:
      ValueError: unknown name, or ``"cudnn"`` off GPU, or ``"pallas"`` off GPU without
        ``interpret=True``.
    """
    implementation = V.check_implementation(implementation, allowed)
    if implementation is None:
        implementation = "pallas" if interpret else default_implementation(backend)
    backend = current_backend() if backend is None else backend
    on_gpu = backend in ("gpu", "cuda", "rocm")
    if implementation == "cudnn" and not on_gpu:
        raise ValueError("implementation='cudnn' needs a CUDA GPU backend; the current "
                         f"backend is {backend!r} (use 'xla', or 'pallas' with interpret=True)")
    if implementation == "pallas" and not on_gpu and not interpret:
        raise ValueError(f"implementation='pallas' compiles Triton kernels for a GPU; the "
                         f"current backend is {backend!r}: pass interpret=True to run the "
                         "kernels in the Pallas interpreter, or use implementation='xla'")
    return implementation


def resolve_core(implementation: str | None, *, interpret: bool = False,
                 allowed: tuple[str, ...] = IMPLEMENTATIONS):
    """:func:`resolve_implementation`, then the :class:`dilax.core.Core` that runs it, once.

    Returns ``None`` for ``"reference"`` (the mask-based reference is a whole op, not a core).
    """
    from dilax.core import core_for  # lazy: the checks above need no core

    name = resolve_implementation(implementation, interpret=interpret, allowed=allowed)
    return None if name == "reference" else core_for(name, interpret=interpret)


def kernels_available() -> dict[str, str]:
    """What each implementation needs and whether this process has it."""
    on_gpu = current_backend() == "gpu"
    return {
        "reference": "available (dense mask, small n only)",
        "xla": "available (blockwise core, any backend)",
        "pallas": ("available (jax's built-in Pallas Triton lowering)" if on_gpu
                   else "interpret mode only (interpret=True); compiling needs a GPU backend"),
        "cudnn": ("available through jax.nn.dot_product_attention" if on_gpu
                  else "unavailable (needs a CUDA GPU)"),
    }


def describe(file: TextIO | None = None) -> None:
    """Prints the backend, devices and available kernels (to ``file``, default stdout).

    Returns ``None``, like :func:`help`, so a REPL or notebook shows the text once.
    """
    from dilax import __version__

    lines = [
        f"dilax {__version__}, jax {jax.__version__}",
        f"backend: {current_backend()}  default implementation: {default_implementation()}",
        f"devices ({jax.device_count()}): " + ", ".join(str(d) for d in jax.devices()[:8])
        + (" ..." if jax.device_count() > 8 else ""),
        "kernels:",
    ]
    lines += [f"  {name:10s} {status}" for name, status in kernels_available().items()]
    print("\n".join(lines), file=file or sys.stdout)
