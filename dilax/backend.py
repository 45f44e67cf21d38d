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
from dilax.core.platform import (  # noqa: F401 - re-exported here
    CUDNN_NEEDS_GPU,
    cuda_plugin_available,
    require_cudnn,
)

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

    ``None`` follows the runtime backend (``backend``, default :func:`current_backend`).
    An explicit ``"pallas"`` or ``"cudnn"`` follows the *compile target*: it is accepted
    here whatever the runtime backend, and the program fails at lowering, with a
    ``ValueError`` naming ``interpret=True`` and ``"xla"``, when it is lowered for a platform
    the kernels do not support (:mod:`pallas_kernels.platform`). So a CPU process can compile
    the GPU kernels for a CUDA target (``jax.jit(f).lower(<arguments placed on a CUDA
    device>).compile()``, e.g. a deviceless ``jax.experimental.topologies`` target), and a
    CPU program that asks for them still gets a clear error.

    Raises:
      ValueError: unknown name.
    """
    implementation = V.check_implementation(implementation, allowed)
    if implementation is None:
        implementation = "pallas" if interpret else default_implementation(backend)
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
    """What each implementation needs and whether this process can compile or run it."""
    on_gpu = current_backend() in ("gpu", "cuda", "rocm")
    plugin = cuda_plugin_available()
    return {
        "reference": "available (dense mask, small n only)",
        "xla": "available (blockwise core, any backend)",
        "pallas": ("available: Pallas kernels through jax's Triton lowering (forward, dq and "
                   "dk/dv kernels)" if on_gpu else
                   "interpret mode here (interpret=True); compiles for CUDA/ROCm targets "
                   "(jax.jit(...).lower(<arrays on a GPU device>).compile(); "
                   "make gpu-check does it without a GPU)"),
        "cudnn": ("available: cuDNN fused attention forward via jax.nn.dot_product_attention, "
                  "bf16/fp16, XLA-core backward" if on_gpu else
                  "compiles for CUDA targets only" + (
                      " (jax's CUDA plugin is installed)" if plugin else
                      "; needs jax's CUDA plugin (pip install 'jax[cuda12]')")),
    }


def gpu_choice(*, kind: str = "dilated", dtype=None, head_dim: int | None = None
               ) -> tuple[str, str]:
    """The implementation ``"auto"`` picks on a GPU, and why (see :func:`create_attention
    <dilax.factory.create_attention>`).

    From what compiles (``make gpu-check``) and the kernels' resource report: the Pallas
    kernels compile for every dtype, head_dim <= 256 and block size, with forward *and*
    backward kernels; cuDNN's fused attention takes bf16/fp16 with ``head_dim % 8 == 0`` and
    ``<= 128`` (256 on Hopper), has no block-sparse form, and its backward here is the XLA
    core. So: ``"pallas"``, except a bf16/fp16 dilated configuration with a head dim cuDNN
    supports when the caller says so by passing ``dtype`` and ``head_dim`` (inference-style
    use, where only cuDNN's forward runs)."""
    if kind != "dilated":
        return "pallas", f"{kind}: cuDNN has no such attention; the Pallas kernels do"
    if dtype is None or head_dim is None:
        return "pallas", ("GPU: the Pallas kernels (forward and backward kernels, any dtype, "
                          "head_dim <= 256); pass dtype and head_dim to consider cuDNN")
    import jax.numpy as jnp

    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return "pallas", f"GPU, {jnp.dtype(dtype).name}: cuDNN attention takes bf16/fp16 only"
    if head_dim % 8 or head_dim > 128:
        return "pallas", (f"GPU, head_dim={head_dim}: cuDNN needs head_dim % 8 == 0 and "
                          "<= 128 (256 on Hopper)")
    return "cudnn", (f"GPU, {jnp.dtype(dtype).name}, head_dim={head_dim}: cuDNN's fused "
                     "forward (its backward is the XLA core; use 'pallas' for training)")


def describe(file: TextIO | None = None) -> None:
    """Prints the backend, devices and available kernels (to ``file``, default stdout).

    Returns ``None``, like :func:`help`, so a REPL or notebook shows the text once.
    """
    from dilax._version import __version__

    lines = [
        f"dilax {__version__}, jax {jax.__version__}",
        f"backend: {current_backend()}  default implementation: {default_implementation()}",
        f"devices ({jax.device_count()}): " + ", ".join(str(d) for d in jax.devices()[:8])
        + (" ..." if jax.device_count() > 8 else ""),
        "kernels:",
    ]
    lines += [f"  {name:10s} {status}" for name, status in kernels_available().items()]
    print("\n".join(lines), file=file or sys.stdout)
