"""Small helpers every layer of dilax shares: ceiling division, the device-varying type of
values under ``shard_map``, the backward's row term. Internal: not part of the public API.

Imports nothing of dilax (it sits beside :mod:`dilax.semantics` at the bottom).
"""

from __future__ import annotations

from collections.abc import Hashable

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["cdiv", "mark_varying", "output_delta", "varying_axes", "varying_like"]


def cdiv(a, b):
    """``ceil(a / b)`` for ints ``b > 0`` (Python or traced ``a``)."""
    return (a + b - 1) // b


def varying_axes(*refs) -> tuple[Hashable, ...]:
    """The mesh axes any of ``refs`` varies over under ``shard_map`` (sorted; ``None`` refs
    skipped); ``()`` outside ``shard_map``."""
    axes = set()
    for ref in refs:
        if ref is not None:
            aval = jax.typeof(ref)
            manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
            axes |= set(manual.varying if manual is not None else getattr(aval, "vma", ()))
    return tuple(sorted(axes, key=str))


def mark_varying(axes: tuple[Hashable, ...], *xs: jax.Array) -> tuple[jax.Array, ...]:
    """``xs`` typed as device-varying over ``axes`` (unchanged when ``axes`` is empty).

    Under ``shard_map(check_vma=True)`` a freshly created constant (zeros, -inf) is not
    per-device, but loop carries and ``lax.cond`` branches must keep one type: fresh carries
    are marked varying over the axes their updates vary over.
    """
    if not axes:
        return xs
    return tuple(lax.pcast(x, axes, to="varying") for x in xs)


def varying_like(x: jax.Array, *refs: jax.Array) -> jax.Array:
    """``x`` typed as varying over the mesh axes the ``refs`` vary over (and ``x`` does not)."""
    have = varying_axes(x)
    missing = tuple(a for a in varying_axes(*refs) if a not in have)
    return mark_varying(missing, x)[0]


def output_delta(out, dout, dlse):
    """``delta = rowsum(dO * O) - dlse`` (float32): the lse cotangent enters ``ds`` like
    ``-delta``, and it is all a backward needs of ``out``."""
    f32 = jnp.float32
    return jnp.sum(dout.astype(f32) * out.astype(f32), axis=-1) - dlse.astype(f32)
