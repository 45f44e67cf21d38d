"""Ordering work in XLA's schedule without changing what it computes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from dilax.core.arrays import mark_varying


def fence_after(x: jax.Array) -> jax.Array:
    """A boolean scalar that is always true but that XLA only knows once ``x`` exists.

    ``x0 <= inf or isnan(x0)`` cannot be constant-folded. Work run under :func:`when` with it
    is ordered after ``x``: XLA:CPU's default (concurrency-optimized) scheduler would otherwise
    start independent work -- and allocate its buffers -- as early as possible, and
    ``lax.optimization_barrier`` does not survive to its scheduler."""
    x0 = lax.stop_gradient(jnp.ravel(x)[0])
    return (x0 <= jnp.inf) | jnp.isnan(x0)


def when(fence, fn, operands: tuple, carry: tuple = ()):
    """``fn(*operands, *carry)``, inside a ``lax.cond`` on ``fence`` (:func:`fence_after`) if
    given.

    Nothing of ``fn`` can be hoisted out of the conditional, so its working buffers are
    allocated only once ``fence`` is known. Use it on primal computations only (inside a
    ``custom_vjp``): differentiating through the cond would copy its inputs as residuals.
    ``carry``: arrays that ``fn`` returns updated, as a tuple of the same types (e.g.
    accumulators). The other branch returns them as they are, so XLA updates them in place;
    a branch of zeros would give the cond's results buffers of their own, a second copy of
    every carried array while ``fn`` runs."""
    if fence is None:
        return fn(*operands, *carry)
    if carry:
        return lax.cond(fence, lambda ops, c: fn(*ops, *c), lambda ops, c: tuple(c), operands,
                        tuple(carry))
    skip = lambda ops: jax.tree.map(_zeros_like_type, jax.eval_shape(lambda o: fn(*o), ops))
    return lax.cond(fence, lambda ops: fn(*ops), skip, operands)


def _zeros_like_type(s: jax.ShapeDtypeStruct) -> jax.Array:
    """Zeros of the type of ``s``, device-varying over the same mesh axes under
    ``shard_map`` (the two branches of a ``cond`` must have equal types there)."""
    z = jnp.zeros(s.shape, s.dtype)
    mat = getattr(s, "manual_axis_type", None)
    axes = tuple(sorted(mat.varying, key=str)) if mat is not None else ()
    return mark_varying(axes, z)[0]
