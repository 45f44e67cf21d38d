"""Row tiles of the XLA forward given by a table (:class:`dilax.core.RowLayout` ``q_tiles``).

A tile ``[start, end)`` of at most ``block_q`` rows is computed as the ``block_q`` rows
from ``start`` (shifted back to fit the padded rows); only its own rows are written, so a
tile may be short and rows outside it cost nothing but their share of the tile. Packed
documents give tiles aligned to their key runs: a tile inside one run reads that run's keys
only, so tiles as long as the unpacked op's need no more work than it does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from dilax.core.arrays import div_rem, dynamic_slice, dynamic_update_slice
from dilax.core.ranges import within

_F32 = jnp.float32


def tiled(row, tiles, size, block_q, length):
    """``(out, lse)`` ``(B, length, ...)`` of ``row(b, (b, q0, start, end))`` -> the
    ``block_q`` results of rows ``q0 ..``, over the tiles ``(start, end)`` ``(B, T)``;
    ``size``: the padded row count. Rows of no tile: 0 and ``-inf``."""
    starts, ends = tiles
    B, T = starts.shape
    shapes = _result_shapes(row, block_q)
    out = jnp.zeros((B, size) + shapes[0].shape[1:], shapes[0].dtype)
    lse = jnp.full((B, size) + shapes[1].shape[1:], -jnp.inf, _F32)

    def step(carry, idx):
        b, t = div_rem(idx, T)
        start, end = starts[b, t], ends[b, t]
        q0 = jnp.clip(start, 0, size - block_q)

        def run(out, lse):
            res = row(b, (b, q0, start, end))
            keep = within(q0, block_q, start, end)
            return tuple(_write(buf, b, q0, keep, x) for buf, x in zip((out, lse), res))

        return lax.cond(start < end, run, lambda *c: c, *carry), None

    (out, lse), _ = lax.scan(step, (out, lse), jnp.arange(B * T, dtype=jnp.int32))
    return out[:, :length], lse[:, :length]


def _write(buf, b, q0, keep, x):
    """``buf[b, q0:q0 + len(x)]`` set to ``x`` where ``keep``."""
    at = (b, q0) + (jnp.int32(0),) * (buf.ndim - 2)
    old = dynamic_slice(buf, at, (1,) + x.shape)[0]
    keep = keep.reshape(keep.shape + (1,) * (x.ndim - 1))
    return dynamic_update_slice(buf, jnp.where(keep, x.astype(buf.dtype), old)[None], at)


def _result_shapes(row, block_q):
    zero = jnp.int32(0)
    return jax.eval_shape(lambda: row(zero, (zero, zero, zero, jnp.int32(block_q))))
