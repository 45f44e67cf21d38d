"""Which tiles a flash kernel's loop visits, and which need the element mask: the key tiles of
a query block (forward, dq) and the query tiles of a key block (dk/dv), as segments
``(num_steps, block_index, masked)`` (:func:`pallas_kernels.common.online_softmax`)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import arange_i32, cdiv_nonneg, floordiv_clamped


def _causal_key_blocks(q_block, block_q, block_k, q_offset, k_offset):
    """Number of leading key blocks holding a key visible to some query of ``q_block``."""
    last = q_offset - k_offset + (q_block + 1) * block_q - 1  # last visible local key index
    return jnp.where(last >= 0, floordiv_clamped(last, block_k) + 1, 0)


def _blocks_through(last, block: int):
    """Number of blocks ``[0, last // block]`` (0 when ``last < 0``)."""
    return jnp.where(last >= 0, floordiv_clamped(last, block) + 1, 0)


def _masked_between(lo, a, b, hi):
    """Tile segments: ``[lo, a)`` masked, ``[a, b)`` unmasked, ``[b, hi)`` masked."""
    return [(a - lo, lambda s: lo + s, True), (b - a, lambda s: a + s, False),
            (hi - b, lambda s: b + s, True)]


def key_segments(i, q_offset, k_offset, kv_len, q_len, *, is_causal, window, per_key,
                  block_q, block_k):
    """Query block ``i``'s positions and its key-tile segments: only the tiles that hold a key
    visible to some of its queries (below ``kv_len``, causal, inside the band), the tiles
    needing no element mask unmasked; none when the block is wholly past ``q_len``."""
    q_pos = q_offset + i * block_q + arange_i32(block_q)
    rel = q_offset - k_offset + i * block_q  # the first query, in local key indices
    hi = cdiv_nonneg(kv_len, block_k)
    full = lax.div(kv_len, jnp.int32(block_k))  # tiles entirely below kv_len
    if is_causal:
        hi = jnp.minimum(hi, _causal_key_blocks(i, block_q, block_k, q_offset, k_offset))
        # tiles whose last key is visible to the tile's first query
        full = jnp.minimum(full, floordiv_clamped(rel + 1, block_k))
    if q_len is not None:  # a query block wholly past the valid rows reads nothing
        hi = jnp.where(i * block_q < q_len, hi, 0)
    if window is None and not per_key:
        full = jnp.minimum(full, hi)
        return q_pos, [(full, lambda s: s, False), (hi - full, lambda s: full + s, True)]
    lo = jnp.int32(0)
    first_full = jnp.int32(0)
    if window is not None:  # only the tiles that meet the band -left <= t - p <= right
        left, right = window
        hi = jnp.minimum(hi, _blocks_through(rel + block_q - 1 + right, block_k))
        lo = floordiv_clamped(rel - left, block_k)
        # tiles inside every query's band: first key >= last query - left, last key <=
        # first query + right
        first_full = cdiv_nonneg(jnp.maximum(rel + block_q - 1 - left, 0), block_k)
        full = jnp.minimum(full, floordiv_clamped(rel + right + 1, block_k))
    lo = jnp.minimum(lo, hi)
    if per_key:  # an arbitrary per-key mask: every tile masked
        return q_pos, [(hi - lo, lambda s: lo + s, True)]
    a = jnp.clip(first_full, lo, hi)
    return q_pos, _masked_between(lo, a, jnp.clip(full, a, hi), hi)


def query_segments(j, q_offset, k_offset, kv_len, q_len, *, is_causal, window, per_key,
                    block_q, block_k, num_q_blocks):
    """Key block ``j``'s query-tile segments (the dk/dv loop): only the query tiles that see
    one of its keys (causal, inside the band, below ``q_len``), those needing no element mask
    unmasked; none when the block is wholly past ``kv_len``."""
    rel = k_offset - q_offset + j * block_k  # the first key, in local query indices
    lo = jnp.int32(0)
    if is_causal:  # first query that can see key j * block_k
        lo = jnp.minimum(floordiv_clamped(rel, block_q), num_q_blocks)
    hi = jnp.where(j * block_k < kv_len, num_q_blocks, lo)
    if q_len is not None:  # query tiles wholly past the valid rows
        hi = jnp.minimum(hi, cdiv_nonneg(q_len, block_q))
    if window is not None:  # only the query tiles that meet the band
        left, right = window
        lo = jnp.maximum(lo, floordiv_clamped(rel - right, block_q))
        hi = jnp.minimum(hi, _blocks_through(rel + block_k - 1 + left, block_q))
    lo = jnp.minimum(lo, hi)
    if per_key:
        return [(hi - lo, lambda s: lo + s, True)]
    # Query tiles [lo, mid) need the element mask (the causal diagonal, the band's lower
    # edge), [mid, end) do not, [end, hi) do (the band's upper edge); a key tile that
    # straddles kv_len needs it everywhere.
    mid = lo
    if is_causal:  # first query tile whose first query sees the tile's last key
        mid = cdiv_nonneg(jnp.maximum(rel + block_k - 1, 0), block_q)
    if window is not None:
        mid = jnp.maximum(mid, cdiv_nonneg(jnp.maximum(rel + block_k - 1 - right, 0), block_q))
    mid = jnp.clip(mid, lo, hi)
    mid = jnp.where((j + 1) * block_k <= kv_len, mid, hi)
    if window is None:
        return [(mid - lo, lambda s: lo + s, True), (hi - mid, lambda s: mid + s, False)]
    end = jnp.clip(floordiv_clamped(rel + left + 1, block_q), mid, hi)
    return _masked_between(lo, mid, end, hi)


def table_segments(table_refs, i, ratios, whole):
    """The segments of program block ``i`` read off a block mask's tables ``(full_idx,
    full_cnt, part_idx, part_cnt)`` (``(Bt, n_blocks, A)`` / ``(Bt, n_blocks)`` refs, batch
    row = program id 1 when ``Bt > 1``): its full blocks (``whole``: masked but without the
    ``mask_mod``), then its partial ones (masked), never the empty ones. ``ratios``: static
    ``(own, loop, n)``: tiles per block on the program's axis and on the loop's axis, and
    the number of blocks on the program's axis (tiles past them, padding, visit nothing)."""
    full_idx, full_cnt, part_idx, part_cnt = table_refs
    own, loop, n = ratios
    bt = pl.program_id(1) if full_idx.shape[0] > 1 else 0
    blk = lax.div(i, jnp.int32(own))
    inside = blk < n
    blk = jnp.minimum(blk, n - 1)

    def segment(idx_ref, cnt_ref, masked):
        def block_index(s):
            return idx_ref[bt, blk, lax.div(s, jnp.int32(loop))] * loop + lax.rem(
                s, jnp.int32(loop))
        return jnp.where(inside, cnt_ref[bt, blk], 0) * loop, block_index, masked

    return [segment(full_idx, full_cnt, whole), segment(part_idx, part_cnt, True)]
