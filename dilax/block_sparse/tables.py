"""The table-driven gather + core of block-sparse attention, below both of its users.

:func:`dilax.block_sparse_attention` (one device) runs :func:`sparse_attention_tables` on
tables read off the pattern, the block-sparse ring (:mod:`dilax.block_sparse.ring`) the same
gather (:func:`gather_key_blocks`) at every hop; the method is described in
:mod:`dilax.block_sparse.api`. This module
imports neither, so the public op can dispatch to the ring without an import cycle.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dilax.core import BlockSizes, attention_core, merge_attention_states
from dilax.core.arrays import cdiv
from dilax.patterns import BlockSparsePattern

# The one row budget of the gathered block-sparse paths, one device and ring: bytes of the
# key/value blocks one step of query blocks may gather (:func:`rows_per_step`).
_ROW_BUDGET_BYTES = 64 * 2**20



# -- validation ---------------------------------------------------------------------------


def check_pattern(pattern, q: jax.Array) -> BlockSparsePattern:
    """Checks that ``pattern`` fits ``q: (b, n, h, d)`` (block counts and heads)."""
    if not isinstance(pattern, BlockSparsePattern):
        raise TypeError(
            "pattern must be a dilax.patterns.BlockSparsePattern (e.g. "
            f"dilax.patterns.local_window(...)), got {type(pattern).__name__}"
        )
    _, n, h, _ = q.shape
    bs = pattern.block_size
    nb = cdiv(n, bs)
    if pattern.num_q_blocks != nb or pattern.num_k_blocks != nb:
        raise ValueError(
            f"pattern has {pattern.num_q_blocks}x{pattern.num_k_blocks} blocks of block_size "
            f"{bs}, but q/k have seq_len n={n}, which needs ceil(n / block_size) = {nb} query "
            f"and key blocks"
        )
    if pattern.num_heads not in (1, h):
        raise ValueError(
            f"pattern has {pattern.num_heads} heads; it must have 1 (shared) or one per query "
            f"head of q (h={h})"
        )
    return pattern


def head_layout(mask: np.ndarray, h: int, hk: int) -> tuple[int, int, tuple[int, ...], np.ndarray]:
    """Returns ``(U, G, kvmap, per-virtual-head mask (1 or U, nq, nk))``."""
    group = h // hk
    if mask.shape[0] == 1:
        return hk, group, tuple(range(hk)), mask
    grouped = mask.reshape(hk, group, *mask.shape[1:])
    if np.all(grouped == grouped[:, :1]):
        return hk, group, tuple(range(hk)), np.ascontiguousarray(grouped[:, 0])
    return h, 1, tuple(j // group for j in range(h)), mask



# -- gather + core ------------------------------------------------------------------------


def _shared_gather(idx_shape: tuple[int, ...], kvmap: tuple[int, ...], hk: int) -> bool:
    """Whether every batch row and virtual head uses the same table and kv heads in order."""
    return idx_shape[0] == 1 and idx_shape[1] == 1 and kvmap == tuple(range(hk))


def _gather_source(x: jax.Array, shared: bool, bs: int) -> jax.Array:
    """K or V ``(b, nk*B, hk, d)`` viewed as blocks, laid out for :func:`_gather_blocks`
    (done once, outside the row loop): ``(b, nk, B, hk, d)`` or ``(b, hk, nk, B, d)``."""
    b, nkb, hk, d = x.shape
    xb = x.reshape(b, nkb // bs, bs, hk, d)
    return xb if shared else xb.transpose(0, 3, 1, 2, 4)


def _gather_blocks(src: jax.Array, idx: jax.Array, kvmap: tuple[int, ...], shared: bool,
                   bs: int) -> jax.Array:
    """Gathers key blocks for ``idx (Bi, Ui, R, A)`` -> ``(b * R, A * B, U, d)``; virtual head
    ``u`` reads kv head ``kvmap[u]``."""
    _, R, A = idx.shape[1:]
    U = len(kvmap)
    if shared:
        b, d = src.shape[0], src.shape[-1]
        g = jnp.take(src, idx[0, 0].reshape(-1), axis=1, mode="clip")  # (b, R*A, B, hk, d)
        return g.reshape(b * R, A * bs, U, d)
    b, d = src.shape[0], src.shape[-1]
    bix = jnp.arange(b, dtype=jnp.int32)[:, None, None, None]
    kix = jnp.asarray(np.asarray(kvmap, np.int32))[None, :, None, None]
    g = src[bix, kix, jnp.broadcast_to(idx, (b, U, R, A))]  # (b, U, R, A, B, d)
    return g.transpose(0, 2, 3, 4, 1, 5).reshape(b * R, A * bs, U, d)


def gather_key_blocks(x: jax.Array, idx: jax.Array, kvmap: tuple[int, ...],
                      block_size: int) -> jax.Array:
    """K or V ``(b, nk*B, hk, d)`` -> the key blocks of the tables ``idx (Bi, Ui, R, A)``,
    ``(b * R, A * B, U, d)``: row ``i * R + r`` holds, in table order, the blocks of query block
    ``r`` of batch row ``i``; virtual kv head ``u`` reads kv head ``kvmap[u]`` (the layout
    :func:`sparse_attention_tables` runs the core on; the block-sparse ring's hops too)."""
    shared = _shared_gather(idx.shape, kvmap, x.shape[2])
    return _gather_blocks(_gather_source(x, shared, block_size), idx, kvmap, shared, block_size)


def _rows_kv_len(kv_len: jax.Array, b: int, U: int) -> jax.Array:
    """``(Bi, Ui, R)`` -> ``(b * R, U)``."""
    Bi, Ui, R = kv_len.shape
    return jnp.broadcast_to(kv_len, (b, U, R)).transpose(0, 2, 1).reshape(b * R, U)


def _head_take(x: jax.Array, kvmap: tuple[int, ...]) -> jax.Array:
    if kvmap == tuple(range(x.shape[2])):
        return x
    return jnp.take(x, jnp.asarray(np.asarray(kvmap, np.int32)), axis=2)


def document_ranges(doc, idx, kv_len, b, U, bs, q_first=None, k_first=0):
    """Packed documents on one group of ``R`` query blocks: ``doc = (start, end, key_start,
    key_end)``, the documents' bounds ``(b, R*B)`` of the query rows and ``(b, nk*B)`` of every
    key (``key_start`` None: the query ranges of the keys are every row, a superset). Returns
    the key/query ranges ``(b*R, U, B)`` of the gathered call (the gathered keys are in
    position order, so a document's keys are one run of them) and of the diagonal call.
    ``q_first (R,)``: the position of each query block's first row (default ``r * B``);
    ``k_first``: the position of key block 0 (the block-sparse ring's hops: a chunk's)."""
    start, end, key_start, key_end = doc
    R = start.shape[1] // bs
    first = (jnp.arange(R, dtype=jnp.int32) * bs if q_first is None else q_first)[None, :, None]
    rows = lambda x: jnp.clip(x.reshape(b, R, bs) - first, 0, bs)  # noqa: E731
    to_rows = lambda x: jnp.broadcast_to(x, (b, U, R, bs)).transpose(0, 2, 1, 3).reshape(  # noqa: E731
        b * R, U, bs)
    diag = (to_rows(rows(start)[:, None]), to_rows(rows(end)[:, None]))
    if idx is None:
        return None, diag
    idx = jnp.asarray(idx, jnp.int32)  # (Bi, Ui, R, A)
    A = idx.shape[-1]
    used = (jnp.arange(A, dtype=jnp.int32) * bs)[None, None, None] < jnp.asarray(
        kv_len, jnp.int32)[..., None]  # (Bi, Ui, R, A)
    block0 = idx * bs  # first position of each gathered block (from key block 0)

    def count(x):  # gathered keys before position x (b, R, bs), per head: (b, U, R, bs)
        per = jnp.clip(x.reshape(b, 1, R, bs, 1) - k_first - block0[:, :, :, None, :], 0, bs)
        return jnp.sum(jnp.where(used[:, :, :, None, :], per, 0), axis=-1)

    keys = (to_rows(count(start)), to_rows(count(end)))
    if key_start is None:
        every = jnp.zeros((b * R, U, A * bs), jnp.int32)
        return (keys, (every, every + bs)), diag
    key_pos = block0[..., None] + jnp.arange(bs, dtype=jnp.int32).reshape(
        (1,) * block0.ndim + (bs,))  # (Bi, Ui, R, A, B)
    key_pos = jnp.broadcast_to(key_pos, (b, U, R, A, bs)).reshape(b, U, R, A * bs)
    take = lambda x: jnp.take_along_axis(  # noqa: E731 - the keys' documents, as query rows
        x[:, None, None], jnp.clip(key_pos, 0, x.shape[1] - 1), axis=-1)
    qrng = tuple(jnp.clip(take(x) - first[:, None], 0, bs).transpose(0, 2, 1, 3).reshape(
        b * R, U, A * bs) for x in (key_start, key_end))
    return (keys, qrng), diag


def row_mods(mods, idx, b, R, bs, q_first=None):
    """The :class:`dilax.core.mods.Mods` of the gathered and the diagonal call of one group of
    ``R`` query blocks (or None): the mods see row positions, never gathered indices. Row
    ``i * R + r`` of the calls is batch row ``i``; its queries are at ``q_first[r] + 0 .. bs``
    (default ``r * bs``), its gathered keys at ``idx[i, u, r, a] * bs + 0 .. bs`` per virtual
    kv head ``u`` (the table's own head axis, 1 or ``U``), the diagonal's at the queries'."""
    if mods is None:
        return None, None
    first = jnp.arange(R, dtype=jnp.int32) * bs if q_first is None else q_first
    rows = first[:, None] + jnp.arange(bs, dtype=jnp.int32)[None]  # (R, bs)
    q_pos = jnp.broadcast_to(rows[None], (b, R, bs)).reshape(b * R, bs)
    batch = jnp.repeat(jnp.arange(b, dtype=jnp.int32), R)
    if mods.batch is not None:  # the caller's own map (a ring's global batch rows)
        batch = jnp.take(mods.batch, batch)
    diag = dataclasses.replace(mods, q_pos=q_pos, kv_pos=q_pos[:, None], batch=batch)
    if idx is None:
        return None, diag
    idx = jnp.asarray(idx, jnp.int32)  # (Bi, Ui, R, A)
    Ui, A = idx.shape[1], idx.shape[-1]
    offsets = jnp.arange(bs, dtype=jnp.int32).reshape((1,) * idx.ndim + (bs,))
    keys = (idx[..., None] * bs + offsets).reshape(*idx.shape[:3], -1)
    keys = jnp.broadcast_to(keys, (b, Ui, R, A * bs)).transpose(0, 2, 1, 3)
    return dataclasses.replace(mods, q_pos=q_pos, kv_pos=keys.reshape(b * R, Ui, A * bs),
                               batch=batch), diag


def _attend_rows(q, k, v, kd, vd, idx, kv_len, diag_len, q_len=None, doc=None, q_first=None,
                 *, bs, U, G, kvmap, shared, scale, block_k, mods=None):
    """One group of ``R`` query blocks.

    q: ``(b, R*B, h, d)``; k, v: all key blocks as laid out by :func:`_gather_source`;
    kd, vd: ``(b, R*B, hk, d)`` the rows' own key blocks (diagonal, causal only) or None;
    idx: ``(Bi, Ui, R, A)``; kv_len, diag_len: ``(Bi, Ui, R)``; q_first: ``(R,)`` the
    position of each query block's first row (documents; default ``r * B``: the first group).
    mods: score / mask mods without positions (:func:`row_mods` adds them), or None.
    Returns ``out (b, R*B, h, d)`` float32 and ``lse (b, R*B, h)``.
    """
    b, RB, h, d = q.shape
    dv = (vd if v is None else v).shape[-1]  # the values' head dim (the output's)
    R = RB // bs
    mods_g, mods_d = row_mods(mods, idx, b, R, bs, q_first)
    qr = q.reshape(b * R, bs, U, G, d)
    q_len = None if q_len is None else _rows_kv_len(q_len, b, U)
    gathered = diag = None
    if doc is not None:
        gathered, diag = document_ranges(doc, idx, kv_len, b, U, bs, q_first)
    out = lse = None
    if idx is not None:
        kg = _gather_blocks(k, idx, kvmap, shared, bs)
        vg = _gather_blocks(v, idx, kvmap, shared, bs)
        bk = min(block_k, kg.shape[1])
        out, lse = attention_core(qr, kg, vg, scale=scale, kv_len=_rows_kv_len(kv_len, b, U),
                                  block_sizes=BlockSizes(block_q=bs, block_k=bk), q_len=q_len,
                                  key_range=gathered and gathered[0],
                                  query_range=gathered and gathered[1], mods=mods_g)
    if diag_len is not None:
        kr = _head_take(kd, kvmap).reshape(b * R, bs, U, d)
        vr = _head_take(vd, kvmap).reshape(b * R, bs, U, dv)
        o2, l2 = attention_core(qr, kr, vr, scale=scale, is_causal=True,
                                kv_len=_rows_kv_len(diag_len, b, U),
                                block_sizes=BlockSizes(block_q=bs, block_k=bs), q_len=q_len,
                                key_range=diag, query_range=diag, mods=mods_d)
        if out is None:
            out, lse = o2.astype(jnp.float32), l2
        else:
            out, lse = merge_attention_states(out, lse, o2, l2)
    return out.astype(jnp.float32).reshape(b, RB, h, dv), lse.reshape(b, RB, h)


def rows_per_step(nq: int, b: int, A: int, bs: int, U: int, d: int, itemsize: int, *,
                  ring: bool = False) -> int:
    """Query blocks per step ``R``: the largest divisor of ``nq`` whose gathered key and value
    blocks, ``2 * b * U * R * A * bs * d`` elements (``A``: key blocks of the busiest row,
    ``U``: virtual kv heads), fit :data:`_ROW_BUDGET_BYTES` (at least one).

    Per element, one device (:func:`sparse_attention_tables`, a ``lax.map`` over steps) counts
    the inputs' ``itemsize``. The ring (``ring=True``,
    :class:`~dilax.block_sparse.ring.BlockSparseRing`, whose explicit backward also holds the
    gathered blocks' float32 gradients) counts ``itemsize + 4``, twice: its steps keep to half
    the budget, as with the 32 MiB of their own they had before (they run beside the visiting
    chunk, the one in flight and the shard's float32 accumulators). ``32 MiB // x`` equals
    ``64 MiB // 2x``, so both paths keep their step sizes, hence their programs.
    """
    per_element = 2 * (itemsize + 4) if ring else itemsize
    per_row = 2 * b * A * bs * U * d * per_element
    target = max(1, _ROW_BUDGET_BYTES // max(per_row, 1))
    return max((r for r in range(1, min(nq, target) + 1) if nq % r == 0), default=1)


def default_block_k(bs: int) -> int:
    """Core key block for pattern block size ``bs``: whole pattern blocks, about 256 keys."""
    return bs * max(1, 256 // bs)


def sparse_attention_tables(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    idx: jax.Array | np.ndarray | None,
    kv_len: jax.Array | np.ndarray | None,
    diag_len: jax.Array | np.ndarray | None,
    *,
    block_size: int,
    U: int,
    G: int,
    kvmap: tuple[int, ...],
    scale: float,
    block_k: int | None = None,
    q_len: jax.Array | None = None,
    doc: tuple[jax.Array, jax.Array] | None = None,
    mods=None,
) -> tuple[jax.Array, jax.Array]:
    """Attention of every query block over table-selected key blocks (internal building block).

    Args:
      q: ``(b, nq*B, h, d)``, ``h = U * G``; k, v: ``(b, nk*B, hk, d)`` (padded to blocks).
      idx: ``(Bi, Ui, nq, A)`` key-block indices (``Bi`` in {1, b}, ``Ui`` in {1, U}) or None
        (no gathered call); kv_len: ``(Bi, Ui, nq)`` valid gathered keys per row.
      diag_len: ``(Bi, Ui, nq)`` causal diagonal-block keys (``B`` or 0), or None (no diagonal
        call). Requires ``nq == nk``.
      q_len: ``(Bi, 1, nq)`` valid query rows of each query block, or None (all valid).
      doc: packed documents, ``(start, end)`` int32 ``(b, nq*B)`` (:mod:`dilax.dilated.documents`),
        or None: a query attends only keys of its own document.
      mods: a :class:`dilax.core.mods.Mods` (score / mask mods, cap; no tables, no
        positions) applied at the rows' positions, or None.
    Returns:
      ``out (b, nq*B, h, d)`` float32 and ``lse (b, nq*B, h)`` float32.
    """
    b, nqb, h, d = q.shape
    bs = block_size
    nq = nqb // bs
    block_k = default_block_k(bs) if block_k is None else block_k
    A = 0 if idx is None else idx.shape[-1]
    step = rows_per_step(nq, b, A, bs, U, d, q.dtype.itemsize) if idx is not None else nq
    shared = idx is not None and _shared_gather(idx.shape, kvmap, k.shape[2])
    ks = _gather_source(k, shared, bs) if idx is not None else None
    vs = _gather_source(v, shared, bs) if idx is not None else None
    fn = functools.partial(_attend_rows, bs=bs, U=U, G=G, kvmap=kvmap, shared=shared,
                           scale=scale, block_k=block_k, mods=mods)
    causal = diag_len is not None
    if step == nq:
        return fn(q, ks, vs, k if causal else None, v if causal else None, idx, kv_len,
                  diag_len, q_len, None if doc is None else (*doc, *doc))
    steps = nq // step

    def split_rows(x, axis):  # (..., nq*stuff ...) -> (steps, ..., step*stuff, ...)
        if x is None:
            return None
        x = jnp.asarray(x)
        shape = x.shape
        x = x.reshape(shape[:axis] + (steps, shape[axis] // steps) + shape[axis + 1:])
        return jnp.moveaxis(x, axis, 0)

    xs = (split_rows(q, 1), split_rows(k, 1) if causal else None,
          split_rows(v, 1) if causal else None, split_rows(idx, 2), split_rows(kv_len, 2),
          split_rows(diag_len, 2), split_rows(q_len, 2),
          None if doc is None else tuple(split_rows(x, 1) for x in doc),
          split_rows(jnp.arange(nq, dtype=jnp.int32) * bs, 0))  # each block's first row

    def body(args):
        qc, kc, vc, ic, lc, dc, qlc, docc, firsts = args
        return fn(qc, ks, vs, kc, vc, ic, lc, dc, qlc, None if doc is None else (*docc, *doc),
                  firsts)

    out, lse = lax.map(body, xs)
    out = jnp.moveaxis(out, 0, 1).reshape(b, nqb, h, v.shape[-1])
    lse = jnp.moveaxis(lse, 0, 1).reshape(b, nqb, h)
    return out, lse
