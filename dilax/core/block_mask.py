"""Per-block masks of the XLA core (:mod:`dilax.core.xla`): valid lengths, per-key
validity, causality and a local band, built for one ``(block_q, block_k)`` pair."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


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
