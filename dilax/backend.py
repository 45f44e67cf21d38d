"""Which implementation runs where: ``implementation=`` resolution and :func:`describe`.

Thin users of :mod:`dilax.registry`, the one table of what each core serves:
``implementation=None`` means the best core for the current default backend, per request
(the Pallas kernels on GPU, the blockwise XLA core elsewhere and for what the kernels have no
mask for). Everything GPU-only is imported lazily, so importing dilax never needs a GPU jaxlib.
"""

from __future__ import annotations

import sys
from typing import TextIO

import jax

from dilax import registry
from dilax.core.platform import (  # noqa: F401 - re-exported here
    CUDNN_NEEDS_GPU,
    cuda_plugin_available,
    require_cudnn,
)

IMPLEMENTATIONS = registry.IMPLEMENTATIONS


def current_backend() -> str:
    """``jax.default_backend()`` (``"cpu"``, ``"gpu"``, ``"tpu"``)."""
    return jax.default_backend()


def default_implementation(backend: str | None = None) -> str:
    """What ``implementation=None`` runs for a plain dilated branch on ``backend``
    (:mod:`dilax.registry`): ``"pallas"`` on GPU, ``"xla"`` otherwise."""
    backend = current_backend() if backend is None else backend
    return registry.choose(None, registry.CoreRequest("dilated_branch", platform=backend))[0]


def resolve_implementation(implementation: str | None, *, interpret: bool = False,
                           allowed: tuple[str, ...] = IMPLEMENTATIONS,
                           backend: str | None = None) -> str:
    """Validates ``implementation`` and resolves ``None`` for a plain request (no window,
    no per-key mask) with :mod:`dilax.registry`.

    ``None`` follows the runtime backend (``backend``, default :func:`current_backend`).
    An explicit ``"pallas"`` or ``"cudnn"`` follows the *compile target*: it is accepted
    here whatever the runtime backend, and the program fails at lowering, with a
    ``ValueError`` naming ``interpret=True`` and ``"xla"``, when it is lowered for a platform
    the kernels do not support (:mod:`pallas_kernels.platform`). So a CPU process can compile
    the GPU kernels for a CUDA target (``jax.jit(f).lower(<arguments placed on a CUDA
    device>).compile()``, e.g. a deviceless ``jax.experimental.topologies`` target), and a
    CPU program that asks for them still gets a clear error. Ops whose requests differ per
    branch (a local window, a key padding mask) ask the registry per branch.

    Raises:
      ValueError: unknown name.
    """
    implementation = registry.check_name(implementation, allowed)
    if implementation is not None:
        return implementation
    backend = current_backend() if backend is None else backend
    request = registry.CoreRequest("dilated_branch", platform=backend, interpret=interpret)
    return registry.choose(None, request, allowed)[0]


def resolve_core(implementation: str | None, *, interpret: bool = False,
                 allowed: tuple[str, ...] = IMPLEMENTATIONS):
    """What a dilated op runs (:func:`dilax.registry.resolve`): the explicit name's
    :class:`dilax.core.Core`, ``None`` for ``"reference"`` (a whole op, not a core), or
    :class:`dilax.registry.Auto` for ``None`` (the core is chosen per branch once the
    branches are known, :func:`dilax.registry.branch_cores`)."""
    return registry.resolve(implementation, interpret=interpret, allowed=allowed)


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


def gpu_choice(*, kind: str = "dilated", dtype=None, head_dim: int | None = None,
               window: bool = False) -> tuple[str, str]:
    """The implementation ``"auto"`` picks on a GPU for one request, and why (see
    :func:`create_attention <dilax.factory.create_attention>`).

    :mod:`dilax.registry`'s choice (the Pallas kernels: forward *and* backward kernels, any
    dtype, the local-window branch included), except that a bf16/fp16 dilated branch with a
    head dim cuDNN supports on every GPU (``% 8 == 0``, ``<= 128``) takes cuDNN's fused
    forward when the caller says so by passing ``dtype`` and ``head_dim`` (inference-style
    use, where only cuDNN's forward runs; its backward is the XLA core)."""
    if kind != "dilated":
        name, why = registry.choose(None, registry.CoreRequest("block_sparse", platform="gpu"))
        return name, f"{kind}: cuDNN has no such attention; {why}"
    request = registry.CoreRequest("window" if window else "dilated_branch", dtype, head_dim,
                                   platform="gpu")
    name, why = registry.choose(None, request)
    if dtype is None or head_dim is None:
        return name, f"{why}; pass dtype and head_dim to consider cuDNN"
    reason = registry.supports("cudnn", request)
    if reason is None and head_dim > 128:  # 129..256 compile on Hopper only
        reason = (f"cuDNN needs head_dim % 8 == 0 and <= 128 (256 on Hopper), got "
                  f"head_dim={head_dim}")
    if reason is not None:
        return name, f"{why}; not 'cudnn': {reason}"
    return "cudnn", (f"GPU, {request.dtype}, head_dim={head_dim}: cuDNN's fused forward (its "
                     "backward is the XLA core; use 'pallas' for training)")


def describe(file: TextIO | None = None) -> None:
    """Prints the backend, devices, available kernels and the core ``implementation=None``
    runs for each op (:mod:`dilax.registry`) (to ``file``, default stdout).

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
    lines.append("implementation=None runs (dilax.registry):")
    lines += [f"  {op:14s} {name!r}: {why}" for op, name, why in registry.table()]
    print("\n".join(lines), file=file or sys.stdout)
