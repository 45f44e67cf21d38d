"""Compact block tables of a boolean block mask (numpy, or jax for traced tables).

The format every block-sparse path of dilax uses (docs/semantics.md, "Block-sparse
attention"): ``indices (..., nq_blocks, max(1, max_count))`` lists the active key blocks of
each query block in ascending order, padded with the last active index (or 0), and
``counts (..., nq_blocks)`` how many are active. Imports no kernel code.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

__all__ = [
    "block_mask_from_tables",
    "causal_counts",
    "tables_from_block_mask",
    "transpose_block_tables",
]




def tables_from_block_mask(block_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Compact tables of a boolean ``(..., nq_blocks, nk_blocks)`` block mask (numpy).

    Returns ``indices (..., nq_blocks, max(1, max_count))`` (ascending, padded with the last
    active index, or 0) and ``counts (..., nq_blocks)``, both int32.
    """
    block_mask = np.asarray(block_mask, bool)
    counts = block_mask.sum(-1).astype(np.int32)
    width = max(1, int(counts.max(initial=0)))
    order = np.argsort(~block_mask, axis=-1, kind="stable")[..., :width].astype(np.int32)
    pos = np.arange(width)
    last = np.take_along_axis(order, np.maximum(counts - 1, 0)[..., None], axis=-1)
    indices = np.where(pos < counts[..., None], order, np.where(counts[..., None] > 0, last, 0))
    return indices.astype(np.int32), counts


def block_mask_from_tables(indices, counts, num_k_blocks: int):
    """Inverse of :func:`tables_from_block_mask`: ``(H, nq_blocks, num_k_blocks)`` bool.

    Works on numpy and on traced arrays (one scatter-add)."""
    xp = np if isinstance(indices, np.ndarray) and isinstance(counts, np.ndarray) else jnp
    H, nq, A = indices.shape
    valid = xp.arange(A)[None, None, :] < counts[..., None]
    cols = xp.where(valid, indices, num_k_blocks)  # invalid entries land out of range
    h_idx = xp.broadcast_to(xp.arange(H)[:, None, None], (H, nq, A))
    q_idx = xp.broadcast_to(xp.arange(nq)[None, :, None], (H, nq, A))
    if xp is np:
        mask = np.zeros((H, nq, num_k_blocks + 1), bool)
        mask[h_idx, q_idx, cols] = True
        return mask[..., :num_k_blocks]
    mask = jnp.zeros((H, nq, num_k_blocks), jnp.int32)
    mask = mask.at[h_idx, q_idx, cols].add(1, mode="drop")
    return mask > 0


def _causal_cut(block_mask, xp):
    nq, nk = block_mask.shape[1:]
    return block_mask & (xp.arange(nk)[None, None, :] <= xp.arange(nq)[None, :, None])


def transpose_block_tables(indices, counts, num_k_blocks: int, is_causal: bool = False):
    """Tables of the transposed pattern: for each key block, the query blocks that attend it.

    Returns ``(q_indices (H, num_k_blocks, width), q_counts (H, num_k_blocks))`` int32; numpy
    (tight ``width``) for numpy inputs, jax arrays (``width = nq_blocks``) for traced ones.
    """
    mask = block_mask_from_tables(indices, counts, num_k_blocks)
    if isinstance(mask, np.ndarray):
        if is_causal:
            mask = _causal_cut(mask, np)
        return tables_from_block_mask(mask.transpose(0, 2, 1))
    if is_causal:
        mask = _causal_cut(mask, jnp)
    mask_t = mask.transpose(0, 2, 1)
    q_counts = jnp.sum(mask_t, axis=-1, dtype=jnp.int32)
    q_indices = jnp.argsort(~mask_t, axis=-1, stable=True).astype(jnp.int32)
    return q_indices, q_counts


def causal_counts(indices, counts):
    """Counts restricted to blocks ``j <= i`` (the tables are ascending, so a prefix)."""
    nq, A = indices.shape[1:]
    xp = np if isinstance(indices, np.ndarray) and isinstance(counts, np.ndarray) else jnp
    valid = (xp.arange(A)[None, None, :] < counts[..., None]) & (
        indices <= xp.arange(nq)[None, :, None]
    )
    return valid.sum(-1).astype(np.int32)
