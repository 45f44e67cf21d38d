"""Per-row key ranges of the XLA core (:class:`dilax.core.KeyBounds` ``key_range`` /
``query_range``): the rows' ranges block by block, and the loop bounds that follow them.

A ranged loop does not start at a multiple of the block size: its blocks start at the
lowest range end of the block's rows (``base``) and step by the block size, so a run of
``L`` keys starting anywhere takes ``ceil(L / block)`` blocks, all unmasked when every row
of the tile has that same run (packed documents: runs start wherever documents do). The
last block may reach past the padded inputs; it is then read shifted back to fit
(:func:`block_start`) and the rows or keys it read twice are masked out (``floor``).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from dilax.core.arrays import cdiv, dynamic_slice
from dilax.core.block_mask import block_floor

EMPTY = jnp.iinfo(jnp.int32).max // 2  # the lower end of an empty range


def pad_range(rng, size):
    """A ``(lo, hi)`` row range ``(B, U, L)`` padded to ``size`` rows with empty ranges."""
    if rng is None:
        return None
    lo, hi = rng
    extra = size - lo.shape[-1]
    if extra == 0:
        return lo, hi
    pad = ((0, 0), (0, 0), (0, extra))
    return jnp.pad(lo, pad, constant_values=EMPTY), jnp.pad(hi, pad)


def range_rows(rng, b, u0, u1, start, size):
    """``(lo, hi)`` of rows ``start .. start + size`` of heads ``u0 .. u1``: ``(U, size)``."""
    at = tuple(jnp.asarray(i, jnp.int32) for i in (b, u0, start))
    return tuple(dynamic_slice(x, at, (1, u1 - u0, size))[0] for x in rng)


def range_mask(rng, k_start, block_k, floor=None):
    """``(U, 1, bq, bk)``: key ``k_start + j`` inside row ``i``'s range ``[lo, hi)`` (and at
    or past ``floor``: the keys a shifted last block read again)."""
    lo, hi = rng
    if floor is not None:
        lo = jnp.maximum(lo, floor)
    k_idx = (k_start + lax.iota(jnp.int32, block_k))[None, None, None, :]
    return (k_idx >= lo[:, None, :, None]) & (k_idx < hi[:, None, :, None])


def rows_from(rng, start, floor):
    """Rows ``start ..`` of ``rng`` with the rows before ``floor`` emptied (rows a shifted
    last block read again; ``None``: none)."""
    if floor is None:
        return rng
    lo, hi = rng
    return lo, jnp.where(start + lax.iota(jnp.int32, hi.shape[-1]) >= floor, hi, 0)


def block_start(base, j, block, limit):
    """``(start, floor)`` of block ``j`` of a loop starting at ``base``: ``floor = base + j *
    block``, read from ``start = min(floor, limit - block)`` (in the ``limit`` padded rows)."""
    floor = base + j * block
    return jnp.minimum(floor, limit - block), floor


def within(start, size, lo, hi):
    """``(size,)`` bool: rows ``start ..`` that lie in ``[lo, hi)``."""
    i = start + lax.iota(jnp.int32, size)
    return (i >= lo) & (i < hi)


def key_blocks(rows, end, block, limit, inner_end=None, keep=None):
    """Loop bounds of a tile's ranged blocks: ``(base, inner_lo, inner_hi, count)``.

    ``rows``: the tile's ``(lo, hi)`` ranges ``(U, size)``; ``end``: no block past this
    index is needed (other masks' bounds); ``limit``: the padded length. Blocks
    ``[inner_lo, inner_hi)`` lie inside every row's range (and before ``inner_end``, e.g.
    the causal edge; ``None``: no inner blocks at all) and need no range mask; the others
    of ``[0, count)`` are masked. A row with an empty range leaves no inner block.
    ``keep``: ``(size,)`` bool, the rows whose results count (others: any result)."""
    lo, hi = rows
    if keep is None:
        lo_min, lo_max, hi_min, hi_max = jnp.min(lo), jnp.max(lo), jnp.min(hi), jnp.max(hi)
    else:
        lo_min, lo_max = jnp.min(jnp.where(keep, lo, EMPTY)), jnp.max(jnp.where(keep, lo, 0))
        hi_min, hi_max = jnp.min(jnp.where(keep, hi, EMPTY)), jnp.max(jnp.where(keep, hi, 0))
    base = jnp.clip(lo_min, 0, limit)
    count = jnp.maximum(cdiv(jnp.minimum(end, hi_max) - base, block), 0)
    inner_lo = jnp.clip(cdiv(lo_max - base, block), 0, count)
    if inner_end is None:
        return base, inner_lo, inner_lo, count
    last = jnp.minimum(hi_min, inner_end) - base
    inner_hi = jnp.maximum(block_floor(last, block, count), inner_lo)  # inner_lo <= count
    return base, inner_lo, inner_hi, count
