"""Per-block masks of the XLA core (:mod:`dilax.core.xla`): valid lengths, per-key
validity, causality and a local band, built for one ``(block_q, block_k)`` pair; and which
blocks a query block (forward) or key block (backward) visits at all."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from dilax.core import pairwise
from dilax.core.arrays import cdiv


def block_mask(k_start, block_k, kv_len, q_pos, k_offset, is_causal, q_valid=None, window=None,
          k_valid=None):
    """Allowed ``(U or 1, 1, bq or 1, bk)`` mask of one block pair, or None when nothing is
    masked (``kv_len``, ``q_valid (U, bq)``, ``window`` and ``k_valid (U, bk)`` may be None)."""
    k_idx = k_start + lax.iota(jnp.int32, block_k)
    mask = None

    def add(m):
        return m if mask is None else mask & m

    if kv_len is not None:
        mask = add((k_idx[None, :] < kv_len[:, None])[:, None, None, :])
    if q_valid is not None:
        mask = add(q_valid[:, None, :, None])
    if k_valid is not None:
        mask = add(k_valid[:, None, None, :])
    if is_causal:
        mask = add(((k_offset + k_idx)[None, :] <= q_pos[:, None])[None, None])
    if isinstance(window, int):
        mask = add((jnp.abs((k_offset + k_idx)[None, :] - q_pos[:, None]) <= window)[None, None])
    elif window is not None:  # (left, right): -left <= t - p <= right
        delta = (k_offset + k_idx)[None, :] - q_pos[:, None]
        mask = add(((delta <= window[1]) & (delta >= -window[0]))[None, None])
    return mask


def query_valid(q_start, block_q, q_len):
    """``(U, bq)``: which rows of the query block starting at ``q_start`` are valid."""
    if q_len is None:
        return None
    return (q_start + lax.iota(jnp.int32, block_q))[None, :] < q_len[:, None]


def block_floor(x, block, limit):
    """``clip(x // block, 0, limit)`` for a possibly negative traced int ``x`` (divided after
    ``max(x, 0)``, so lax's truncating division is the floor: no sign fix-ups staged)."""
    x = jnp.maximum(x, 0)
    return jnp.minimum(lax.div(x, lax.convert_element_type(block, x.dtype)), limit)


def zero_invalid_keys(x, k_start, kv_len, k_valid=None):
    """Zeroes rows of ``x: (U, bk, d)`` at or beyond ``kv_len`` or not ``k_valid (U, bk)``
    (NaN padding never leaks)."""
    if kv_len is None and k_valid is None:
        return x
    valid = True
    if kv_len is not None:
        valid = (k_start + lax.iota(jnp.int32, x.shape[1]))[None, :] < kv_len[:, None]
    if k_valid is not None:
        valid = valid & k_valid
    return jnp.where(valid[..., None], x, jnp.zeros((), x.dtype))


def key_blocks(q0, q_first, block_q: int, block_k: int, nk: int, kl, ql, k_offset,
               is_causal: bool, window):
    """``(lo, full, hi)``: the key blocks a query block (rows ``q0 ...``, first position
    ``q_first``) reads, ``[lo, hi)``, of which ``[lo, full)`` need no mask (causal: the blocks
    wholly at or before its first query; a band masks every block). ``kl``/``ql``: the
    heads' key/query lengths or ``None``; blocks wholly past them are not read."""
    hi = nk if kl is None else jnp.minimum(nk, cdiv(jnp.max(kl), block_k))
    if ql is not None:  # a query block wholly past the valid rows reads no key block
        hi = jnp.where(q0 < jnp.max(ql), hi, 0)
    lo = 0
    if is_causal:
        last = q_first + block_q - 1 - k_offset
        hi = block_floor(last + block_k, block_k, hi)  # through the last query's block
        # Key blocks entirely at or before the first query need no causal mask.
        full = block_floor(q_first - k_offset + 1, block_k, hi)
    else:
        full = hi
    if window is not None:  # only the key blocks that meet the band, all masked
        left, right = pairwise.band(window)
        hi = jnp.minimum(hi, block_floor(q_first + block_q - 1 + right - k_offset,
                                          block_k, nk - 1) + 1)
        lo = full = jnp.minimum(block_floor(q_first - left - k_offset, block_k, nk), hi)
    return lo, full, hi


def query_blocks(k0, block_q: int, block_k: int, nq: int, kl, ql, q_offset, k_offset,
                 is_causal: bool, window):
    """``(lo, full_lo, hi)``: the query blocks that attend a key block (first key ``k0``),
    ``[lo, hi)``, of which ``[full_lo, hi)`` see the whole block unmasked when causal (the
    backward's mirror of :func:`key_blocks`)."""
    hi = nq if kl is None else jnp.where(k0 < jnp.max(kl), nq, 0)
    if ql is not None:  # query blocks wholly past the valid rows are skipped
        hi = jnp.minimum(hi, cdiv(jnp.max(ql), block_q))
    if is_causal:
        lo = block_floor(k_offset + k0 - q_offset, block_q, nq)
        # Query blocks whose first query sees the whole key block need no causal mask.
        full_lo = jnp.clip(cdiv(k_offset + k0 + block_k - 1 - q_offset, block_q), lo, nq)
    else:
        lo = full_lo = 0
    if window is not None:  # only the query blocks that meet the band, all masked
        left, right = pairwise.band(window)
        lo = jnp.maximum(lo, block_floor(k_offset + k0 - right - q_offset, block_q, nq))
        hi = jnp.minimum(hi, block_floor(k_offset + k0 + block_k - 1 + left - q_offset,
                                          block_q, nq - 1) + 1)
    return lo, full_lo, hi
