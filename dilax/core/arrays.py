"""The core's array helpers, shared by every layer above it: ceiling division, the
device-varying type of values under ``shard_map``, the backward's row term, dynamic slices of
nonnegative starts. Internal: not part of the public API.

Imports nothing of dilax (with it, :mod:`dilax.core` imports nothing outside itself).
"""

from __future__ import annotations

from collections.abc import Hashable

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["cdiv", "div_rem", "dynamic_slice", "dynamic_slice_in_dim", "dynamic_update_slice",
           "dynamic_update_slice_in_dim", "mark_varying", "output_delta", "varying_axes",
           "varying_like"]


def cdiv(a, b):
    """``ceil(a / b)`` for ints ``b > 0`` (Python or traced ``a``)."""
    return (a + b - 1) // b


def div_rem(x, d):
    """``(x // d, x % d)`` for a traced integer ``x >= 0`` and a static int ``d > 0``: lax's
    truncating division, without the sign fix-ups that ``//`` and ``%`` stage (about ten
    operations each) for negative operands."""
    x = jnp.asarray(x)
    d = lax.convert_element_type(d, x.dtype)
    return lax.div(x, d), lax.rem(x, d)


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


# lax's dynamic slices for starts that are never negative (every start dilax computes): lax's
# default wraps a negative traced start around the dimension, which stages a compare, an add
# and a select per index; a quarter of a dilated program's equations were those. Out-of-range
# starts still clamp as in XLA; a negative static start raises.


def dynamic_slice(x, starts, sizes):
    """``lax.dynamic_slice`` of nonnegative ``starts``."""
    return lax.dynamic_slice(x, starts, sizes, allow_negative_indices=False)


def dynamic_update_slice(x, update, starts):
    """``lax.dynamic_update_slice`` at nonnegative ``starts``."""
    return lax.dynamic_update_slice(x, update, starts, allow_negative_indices=False)


def dynamic_slice_in_dim(x, start, size, axis=0):
    """``lax.dynamic_slice_in_dim`` of a nonnegative ``start``."""
    return lax.dynamic_slice_in_dim(x, start, size, axis, allow_negative_indices=False)


def dynamic_update_slice_in_dim(x, update, start, axis):
    """``lax.dynamic_update_slice_in_dim`` at a nonnegative ``start``."""
    return lax.dynamic_update_slice_in_dim(x, update, start, axis, allow_negative_indices=False)
