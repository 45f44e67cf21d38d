"""Dense ``(B, N, T, S)`` biases and boolean masks read one ``(block_q, block_k)`` block at a
time by the XLA core (:mod:`dilax.core.xla`), and the bias gradient written the same way.

An operand keeps the shape the caller gave: each dim is 1 (broadcast) or full, and a block is a
``dynamic_slice`` over the full dims only, so no ``(B, N, T, S)`` copy is ever made. The core
pads sequences to whole blocks but not these operands: the last, partial block is read at the
clamped start ``L - block`` (where ``dynamic_slice`` puts it) and rolled into place; the rows it
rolls in stand for padding positions, which the core masks.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

_F32 = jnp.float32


def band(window):
    """``(left, right)`` of a core window: ``w -> (w, w)``; a pair as is."""
    return (window, window) if isinstance(window, int) else tuple(window)


def _starts_sizes(shape, b, h0, nh, q0, bq, k0, bk):
    full = tuple(n > 1 for n in shape)
    starts = tuple(jnp.asarray(s if f else 0, jnp.int32)  # one index dtype, also under x64
                   for s, f in zip((b, h0, q0, k0), full))
    sizes = tuple(s if f else 1 for s, f in zip((1, nh, bq, bk), full))
    return starts, sizes


def _shift(start, block, length):
    """How far ``dynamic_slice`` moved a block that starts at ``start`` (clamped to
    ``length - block``); 0 when blocks tile ``length`` exactly (static)."""
    if length % block == 0:
        return None
    return jnp.maximum(start - (length - block), 0)


def _roll(x, shape, q0, bq, k0, bk, sign):
    for axis, start, block, length in ((1, q0, bq, shape[2]), (2, k0, bk, shape[3])):
        shift = _shift(start, block, length) if length > 1 else None
        if shift is not None:
            x = jnp.roll(x, sign * shift, axis=axis)
    return x


def read_block(x, b, h0, nh, G, q0, bq, k0, bk):
    """``x[b, h0:h0+nh, q0:q0+bq, k0:k0+bk]`` of ``x: (Bx, Nx, Tx, Sx)`` (each dim 1 or full)
    as ``(nh/G or 1, G or 1, bq or 1, bk or 1)``, broadcastable against a ``(U, G, bq, bk)``
    score block. Positions past ``Tx`` / ``Sx`` hold other rows' values (see module doc)."""
    starts, sizes = _starts_sizes(x.shape, b, h0, nh, q0, bq, k0, bk)
    blk = _roll(lax.dynamic_slice(x, starts, sizes)[0], x.shape, q0, bq, k0, bk, -1)
    if x.shape[1] > 1:
        return blk.reshape(nh // G, G, *blk.shape[1:])
    return blk[None]


def terms(mask, b, u0, u1, G, q0, bq, k0, bk, len_q=None):
    """``(bias_block, allowed_block)`` of ``mask.bias`` / ``mask.mask`` for virtual kv heads
    ``u0 .. u1 - 1`` of an identity view (query heads ``u0 * G ..``), either ``None``.
    ``len_q``: also disallow query rows at or past it (padding rows, so that a bias can
    never make their recomputed probabilities overflow)."""
    bias = allowed = None
    h0, nh = u0 * G, (u1 - u0) * G
    if mask.bias is not None:
        bias = read_block(mask.bias, b, h0, nh, G, q0, bq, k0, bk).astype(_F32)
    if mask.mask is not None:
        allowed = read_block(mask.mask, b, h0, nh, G, q0, bq, k0, bk)
    if len_q is not None and bias is not None and len_q % bq:
        rows = ((q0 + lax.iota(jnp.int32, bq)) < len_q)[None, None, :, None]
        allowed = rows if allowed is None else allowed & rows
    return bias, allowed


def apply(s, bias, allowed, mask):
    """Scores plus the bias block; the allowed block and-ed into the core's mask."""
    if bias is not None:
        s = s + bias
    if allowed is not None:
        mask = allowed if mask is None else mask & allowed
    return s, mask


def grad_dtype(bias, batch: int, num_k_blocks: int):
    """The bias-gradient accumulator's dtype: the bias's own when every element receives one
    block's sum (written once), float32 when blocks of several batch rows or key blocks add
    into it."""
    Bx, _, _, Sx = bias.shape
    if (Bx == 1 and batch > 1) or (Sx == 1 and num_k_blocks > 1) or bias.dtype == _F32:
        return _F32
    return bias.dtype


def add_grad(acc, ds, b, u0, u1, G, q0, bq, k0, bk):
    """``acc`` (shaped like the bias) plus the block ``ds: (U, G, bq, bk)`` summed over the
    bias's broadcast dims, at the block's place."""
    shape = acc.shape
    nh = (u1 - u0) * G
    axes = tuple(a for a, n in ((0, shape[1]), (1, shape[1]), (2, shape[2]), (3, shape[3]))
                 if n == 1)
    if axes:
        ds = jnp.sum(ds, axis=axes, keepdims=True)
    ds = ds.reshape(-1, *ds.shape[2:])[None]  # (1, nh or 1, bq or 1, bk or 1)
    starts, sizes = _starts_sizes(shape, b, u0 * G, nh, q0, bq, k0, bk)
    ds = _roll(ds[0], shape, q0, bq, k0, bk, 1)[None]
    cur = lax.dynamic_slice(acc, starts, sizes)
    return lax.dynamic_update_slice(acc, (cur.astype(_F32) + ds).astype(acc.dtype), starts)
