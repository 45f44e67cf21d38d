"""A lowering-time platform check: GPU-only code is refused when the program is lowered for
another platform, not when it is traced.

Whether a program runs on a GPU is decided by what it is *compiled for*, which is known only
at lowering: ``jax.jit(f).lower(...)`` with arguments placed on a CUDA device (a real one, or
a deviceless topology from ``jax.experimental.topologies``) lowers for ``"cuda"`` even in a
process whose default backend is the CPU. :func:`require_platform` marks a value with an
identity primitive whose lowering is a no-op on the allowed platforms and raises
``ValueError(message)`` on every other one, so a GPU kernel either compiles for the GPU it
targets or fails with a message that says what to do instead (instead of XLA's "no lowering
rule for platform cpu").
"""

from __future__ import annotations

import functools

import jax
from jax._src import dispatch
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

__all__ = ["GPU_PLATFORMS", "require_platform"]

GPU_PLATFORMS = ("cuda", "rocm")

_guard_p = Primitive("dilax_require_platform")
# Eager calls compile the primitive for the default device, so they are checked too.
_guard_p.def_impl(functools.partial(dispatch.apply_primitive, _guard_p))
_guard_p.def_abstract_eval(lambda x, **_: x)
batching.primitive_batchers[_guard_p] = (
    lambda args, dims, **kw: (_guard_p.bind(*args, **kw), dims[0]))
ad.primitive_jvps[_guard_p] = (
    lambda primals, tangents, **kw: (_guard_p.bind(*primals, **kw), tangents[0]))
ad.primitive_transposes[_guard_p] = lambda ct, x, **_: [ct]


def _refuse(ctx, x, *, platforms, message):
    del x
    platform = ", ".join(repr(p) for p in ctx.module_context.platforms)
    raise ValueError(f"{message} (this program is being lowered for {platform}; "
                     f"these kernels lower only for {' or '.join(map(repr, platforms))})")


def _lowering(platform: str):
    def rule(ctx, x, *, platforms, message):
        if platform not in platforms:
            return _refuse(ctx, x, platforms=platforms, message=message)
        return [x]

    return rule


mlir.register_lowering(_guard_p, _refuse)
for _platform in GPU_PLATFORMS:
    mlir.register_lowering(_guard_p, _lowering(_platform), platform=_platform)


def require_platform(x: jax.Array, message: str,
                     platforms: tuple[str, ...] = GPU_PLATFORMS) -> jax.Array:
    """``x`` unchanged; lowering the program for a platform outside ``platforms`` raises
    ``ValueError(message + which platform)``.

    ``platforms`` must be a subset of :data:`GPU_PLATFORMS` (the lowerings registered
    here). Put it on an input of the GPU-only computation so that it lowers first."""
    if not set(platforms) <= set(GPU_PLATFORMS):
        raise ValueError(f"platforms must be a subset of {GPU_PLATFORMS}, got {platforms}")
    return _guard_p.bind(x, platforms=tuple(platforms), message=str(message))
