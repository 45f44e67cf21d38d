"""Which platform a core compiles for: the cuDNN check (:class:`dilax.core.CudnnCore`), read
by :mod:`dilax.registry` too. Below the cores, so that they need not import the backend."""

from __future__ import annotations

import jax

CUDNN_NEEDS_GPU = ("implementation='cudnn' runs cuDNN's fused attention, which compiles only "
                   "for a CUDA GPU: use implementation='xla', or 'pallas' with interpret=True "
                   "to run the Pallas kernels in the interpreter")


def cuda_plugin_available() -> bool:
    """Whether this jaxlib has the CUDA plugin (``jax[cuda12]``), with or without a GPU."""
    try:
        from jax._src.lib import cuda_versions
    except ImportError:  # pragma: no cover - depends on the jax build
        return False
    return cuda_versions is not None


def require_cudnn(x: jax.Array) -> jax.Array:
    """``x``, checked to be compiled for a CUDA device (at lowering), in a jaxlib that has
    cuDNN (now: jax's cuDNN attention needs the CUDA plugin already to trace)."""
    from pallas_kernels.platform import require_platform  # lazy: kernels are optional

    if not cuda_plugin_available():
        raise ValueError(f"{CUDNN_NEEDS_GPU} (this jaxlib has no CUDA plugin; "
                         "pip install 'jax[cuda12]' to compile for a CUDA target)")
    return require_platform(x, CUDNN_NEEDS_GPU, platforms=("cuda",))
