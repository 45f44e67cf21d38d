"""Dense ``(B, N, T, S)`` biases and boolean masks read one ``(block_q, block_k)`` block at a
time by the XLA core (:mod:`dilax.core.xla`), and the bias gradient written the same way.

An operand keeps the shape the caller gave: each dim is 1 (broadcast) or full, and a block is a
``dynamic_slice`` over the full dims only, so no ``(B, N, T, S)`` copy is ever made. The core
pads sequences to whole blocks but not these operands: the last, partial block is read at the
clamped start ``L - block`` (where ``dynamic_slice`` puts it) and rolled into place; the rows it
rolls in stand for padding positions, which the core masks.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from dilax.core.arrays import dynamic_slice, dynamic_update_slice

_F32 = jnp.float32


class Dense(NamedTuple):
    """The pairwise operands of a :class:`~dilax.core.mask.Mask` as the loops read them."""

    bias: jax.Array | None  # a half-precision bias as its uint16 bits
    dtype: object  # the bias's dtype
    mask: jax.Array | None


def prepare(mask, view) -> Dense | None:
    """``None`` without a bias or mask. A bf16/fp16 bias is read as its bits, widened one
    block at a time: XLA:CPU would otherwise hoist a float32 copy of the whole bias out of
    the loops (the reason for :func:`dilax.core.xla._as_bits`). ``view`` must be an identity
    view (query head ``h`` is the bias's head ``h``)."""
    if mask.bias is None and mask.allowed is None:
        return None
    heads = tuple(range(len(getattr(view, "q_index", ()))))
    if getattr(view, "num_slots", None) != 1 or view.q_index != heads:
        raise ValueError("a Mask with a bias or mask needs an identity view "
                         "(dilax.core.identity_view): its heads are the query heads")
    bias = mask.bias
    if bias is not None and jnp.issubdtype(bias.dtype, jnp.floating) and bias.dtype.itemsize == 2:
        bias = lax.bitcast_convert_type(bias, jnp.uint16)
    return Dense(bias, None if mask.bias is None else mask.bias.dtype, mask.allowed)


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
    blk = _roll(dynamic_slice(x, starts, sizes)[0], x.shape, q0, bq, k0, bk, -1)
    if x.shape[1] > 1:
        return blk.reshape(nh // G, G, *blk.shape[1:])
    return blk[None]


def terms(dense: Dense, b, u0, u1, G, q0, bq, k0, bk, len_q=None):
    """``(bias_block, allowed_block)`` of the :func:`prepare` d operands for virtual kv heads
    ``u0 .. u1 - 1`` of an identity view (query heads ``u0 * G ..``), either ``None``.
    ``len_q``: also disallow query rows at or past it (padding rows, so that a bias can
    never make their recomputed probabilities overflow)."""
    bias = allowed = None
    h0, nh = u0 * G, (u1 - u0) * G
    if dense.bias is not None:
        bias = read_block(dense.bias, b, h0, nh, G, q0, bq, k0, bk)
        if bias.dtype != dense.dtype:  # bits
            bias = lax.bitcast_convert_type(bias, dense.dtype)
        bias = bias.astype(_F32)
    if dense.mask is not None:
        allowed = read_block(dense.mask, b, h0, nh, G, q0, bq, k0, bk)
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


def key_major(bias, batch: int) -> bool:
    """Whether the backward visits the batch rows of one key block in a row (key blocks
    outer): for a half-precision ``(1, N or 1, T, S)`` bias of a batch > 1, whose rows' sums
    then meet in a float32 column ``(1, N or 1, T, block_k)`` instead of a float32 copy of the
    whole bias."""
    if bias is None:
        return False
    Bx, _, Tx, Sx = bias.shape
    return Bx == 1 < batch and Tx > 1 and Sx > 1 and bias.dtype.itemsize < 4


def grad_init(bias, batch: int, num_k_blocks: int, block_k: int) -> list:
    """The backward's bias-gradient carry: ``[]`` without a bias; ``[acc, column]`` when
    :func:`key_major`; else ``[acc]``, in the bias's dtype when every element receives one
    block's sum (written once), in float32 when blocks of several batch rows or key blocks
    add into it (then ``acc`` is O(n): the bias broadcasts over queries or keys) or the bias
    is float32."""
    if bias is None:
        return []
    Bx, Nx, Tx, Sx = bias.shape
    own = jnp.zeros(bias.shape, _bits_dtype(bias.dtype))  # zero bits are +0.0
    if key_major(bias, batch):
        return [own, jnp.zeros((1, Nx, Tx, block_k), _F32)]
    many = (Bx == 1 and batch > 1) or (Sx == 1 and num_k_blocks > 1)
    return [jnp.zeros(bias.shape, _F32) if many or bias.dtype == _F32 else own]


def _bits_dtype(dtype):
    """uint16 for a half-precision dtype (kept as bits: XLA:CPU widens every bf16/fp16
    update to float32, and would widen the whole accumulator), else ``dtype``."""
    floating = jnp.issubdtype(dtype, jnp.floating)
    return jnp.dtype(jnp.uint16) if floating and jnp.dtype(dtype).itemsize == 2 else dtype


def grad_result(db: list, dtype):
    """The bias gradient in the bias's ``dtype``: ``()`` without a bias, else a 1-tuple."""
    if not db:
        return ()
    acc = db[0]
    if acc.dtype == jnp.uint16 and acc.dtype != dtype:
        return (lax.bitcast_convert_type(acc, dtype),)
    return (acc.astype(dtype),)


def _update(acc, starts, sizes, new, dtype):
    """``acc[starts : starts + sizes] += new`` (float32), ``acc`` float or ``dtype``'s bits."""
    cur = dynamic_slice(acc, starts, sizes)
    if acc.dtype == jnp.uint16 and acc.dtype != dtype:
        cur = lax.bitcast_convert_type(cur, dtype)
        out = lax.bitcast_convert_type((cur.astype(_F32) + new).astype(dtype), jnp.uint16)
    else:
        out = (cur.astype(_F32) + new).astype(acc.dtype)
    return dynamic_update_slice(acc, out, starts)


def column_start(db: list, b) -> list:
    """A key-major column starts afresh at batch row 0."""
    if len(db) == 2:
        db = [db[0], jnp.where(b == 0, jnp.zeros((), _F32), db[1])]
    return db


def column_end(db: list, dtype, b, batch: int, k0, bk) -> list:
    """A key-major column's sum is added into the gradient after its last batch row."""
    if len(db) != 2:
        return db
    acc, col = db
    shape = acc.shape
    starts, sizes = _starts_sizes(shape, 0, 0, shape[1], 0, shape[2], k0, bk)
    new = _roll(col[0], shape, 0, shape[2], k0, bk, 1)[None]
    new = jnp.where(b == batch - 1, new, jnp.zeros((), _F32))  # + 0 keeps every bit
    return [_update(acc, starts, sizes, new, dtype), col]


def add_grad(db: list, dtype, ds, b, u0, u1, G, q0, bq, k0, bk) -> list:
    """The carry with the block ``ds: (U, G, bq, bk)`` added, summed over the bias's
    broadcast dims (into the column when key-major)."""
    if len(db) == 2:
        return [db[0], _add(db[1], _F32, ds, 0, u0, u1, G, q0, bq, 0, bk)]
    return [_add(db[0], dtype, ds, b, u0, u1, G, q0, bq, k0, bk)]


def _add(acc, dtype, ds, b, u0, u1, G, q0, bq, k0, bk):
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
    return _update(acc, starts, sizes, ds, dtype)
