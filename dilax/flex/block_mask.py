"""Block masks of :func:`dilax.flex_attention`: a ``mask_mod`` classified once per
``(query block, key block)`` pair as empty, partial or full (docs/semantics.md, "Custom
scores and masks").

:func:`create_block_mask` evaluates the ``mask_mod`` on device one block pair at a time
(``lax.map`` over the pairs, a few pairs vectorized per step: never an ``n x n`` array) and
reads off the tables the XLA core's key loop runs on (:class:`dilax.core.mods.Mods`): per
query block the key blocks seen whole (no ``mask_mod``) and in part (``mask_mod`` applied);
empty blocks are never visited. The same tables transposed drive the backward. A block mask
is an optimization only: the result equals the mods applied pair by pair.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from dilax.core.arrays import cdiv
from dilax.core.mods import on_block, trace_mod

EMPTY, PARTIAL, FULL = 0, 1, 2
# elements of the mask_mod evaluated per step of the classification
_CHUNK_ELEMENTS = 1 << 22


def _static(**kw):
    return dataclasses.field(metadata=dict(static=True), **kw)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockMask:
    """A ``mask_mod`` classified per block pair (a pytree: arrays as leaves, sizes and the
    ``mask_mod`` static); build it with :func:`create_block_mask`, once, and pass it to every
    call of :func:`dilax.flex_attention` with ``block_mask=``.

    Fields:
      classes: int8 ``(B, H, nq, nk)``: :data:`EMPTY` (0), :data:`PARTIAL` (1) or
        :data:`FULL` (2) per batch row and head (``B``/``H`` 1: the same for all).
      kv_blocks: ``(full_idx, full_cnt, part_idx, part_cnt)``, int32 ``(B, nq, nk)`` /
        ``(B, nq)``: per query block, the key blocks full (resp. partial) for every head,
        ascending, first ``cnt`` valid (a block full for some heads only is partial).
      q_blocks: the same per key block ``(B, nk, nq)`` / ``(B, nk)`` (the backward's).
      shape: ``(B, H, Q_LEN, KV_LEN)``; block_size: ``(q_block, kv_block)``;
      mask_mod: the function (used by ``flex_attention`` when it gets no ``mask_mod``).
    """

    classes: jax.Array
    kv_blocks: tuple
    q_blocks: tuple
    shape: tuple[int, int, int, int] = _static()
    block_size: tuple[int, int] = _static()
    mask_mod: Any = _static(default=None)

    @property
    def num_blocks(self) -> tuple[int, int]:
        return self.classes.shape[-2:]

    def density(self) -> jax.Array:
        """Fraction of block pairs visited (partial or full), over every batch row and head."""
        return jnp.mean((self.classes != EMPTY).astype(jnp.float32))

    def __repr__(self) -> str:
        return (f"BlockMask(shape={self.shape}, block_size={self.block_size}, "
                f"blocks={self.num_blocks})")


def _pos_int(x, name: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x <= 0:
        raise ValueError(f"create_block_mask: {name} must be a positive int, got {x!r}")
    return x


def _tables(sel):
    """``(idx, cnt)`` of a boolean ``(..., m)``: the True indices first, ascending."""
    idx = jnp.argsort(~sel, axis=-1, stable=True).astype(jnp.int32)
    return idx, jnp.sum(sel, axis=-1, dtype=jnp.int32)


def create_block_mask(mask_mod, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int, *,
                      block_size: int | tuple[int, int] = 128) -> BlockMask:
    """Classifies ``mask_mod(b, h, q_idx, kv_idx)`` per ``(query block, key block)``.

    Args:
      mask_mod: the mask function (see :func:`dilax.flex_attention`); it may close over
        arrays (traced ones included: then build the block mask inside the same ``jit``).
      B, H: batch rows and heads to evaluate (``None`` or 1: evaluated at ``b = 0`` /
        ``h = 0`` and shared; pass the batch when the mask depends on ``b``, e.g.
        :func:`dilax.flex.document_mask`, and the heads when it depends on ``h``).
      Q_LEN, KV_LEN: the query and key lengths of the calls it will serve.
      block_size: an int or ``(q_block, kv_block)``: the tile of the core's loops too.

    Returns:
      a :class:`BlockMask`.

    Raises:
      ValueError: non-positive sizes; TypeError: ``mask_mod`` not callable or not
      returning a bool.
    """
    Bm = 1 if B is None else _pos_int(B, "B")
    Hm = 1 if H is None else _pos_int(H, "H")
    Q_LEN, KV_LEN = _pos_int(Q_LEN, "Q_LEN"), _pos_int(KV_LEN, "KV_LEN")
    qb, kb = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    qb, kb = _pos_int(qb, "block_size"), _pos_int(kb, "block_size")
    qb, kb = min(qb, Q_LEN), min(kb, KV_LEN)  # as the core clips its tiles
    fn, consts = trace_mod(mask_mod, "mask_mod")
    nq, nk = cdiv(Q_LEN, qb), cdiv(KV_LEN, kb)
    heads = lax.iota(jnp.int32, Hm)

    def classify(pair):
        qi, kj = pair // nk, pair % nk
        q = qi * qb + lax.iota(jnp.int32, qb)
        kv = kj * kb + lax.iota(jnp.int32, kb)
        allowed = jax.vmap(lambda b: on_block(fn, consts, b, heads, q, kv))(
            lax.iota(jnp.int32, Bm))  # (Bm, Hm, qb, kb)
        valid = ((q < Q_LEN)[:, None] & (kv < KV_LEN)[None])[None, None]
        some = jnp.any(allowed & valid, axis=(2, 3))
        every = jnp.all(allowed | ~valid, axis=(2, 3))
        return jnp.where(every, FULL, jnp.where(some, PARTIAL, EMPTY)).astype(jnp.int8)

    per = Bm * Hm * qb * kb
    classes = lax.map(classify, jnp.arange(nq * nk, dtype=jnp.int32),
                      batch_size=max(1, min(nq * nk, _CHUNK_ELEMENTS // per)))
    classes = jnp.moveaxis(classes.reshape(nq, nk, Bm, Hm), (2, 3), (0, 1))
    return BlockMask(classes, *block_tables(classes), shape=(Bm, Hm, Q_LEN, KV_LEN),
                     block_size=(qb, kb), mask_mod=mask_mod)


def block_tables(classes) -> tuple[tuple, tuple]:
    """``(kv_blocks, q_blocks)`` of ``classes (B, H, nq, nk)`` (see :class:`BlockMask`)."""
    full = jnp.all(classes == FULL, axis=1)  # (B, nq, nk): full for every head
    part = ~full & jnp.any(classes != EMPTY, axis=1)
    kv = (*_tables(full), *_tables(part))
    q = (*_tables(jnp.swapaxes(full, 1, 2)), *_tables(jnp.swapaxes(part, 1, 2)))
    return kv, q
