"""Compact block tables of a boolean block mask (numpy, or jax for traced tables).

The format every block-sparse path of dilax uses (docs/semantics.md, "Block-sparse
attention"): ``indices (..., nq_blocks, max(1, max_count))`` lists the active key blocks of
each query block in ascending order, padded with the last active index (or 0), and
``counts (..., nq_blocks)`` how many are active. Also the checks and preparation of the
tables and lengths the block-sparse kernels read (:func:`sparse_tables`,
:func:`sparse_lengths`). Imports no kernel code.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.config import MIN_BLOCK

__all__ = [
    "block_mask_from_tables",
    "causal_counts",
    "check_block_size",
    "check_tables",
    "sparse_lengths",
    "sparse_tables",
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


def check_tables(indices, counts, name_i, name_c, num_heads, rows, cols, what_rows):
    """Static checks of compact tables (shape, dtype, heads; values when numpy)."""
    if indices.ndim != 3 or counts.ndim != 2:
        raise ValueError(
            f"{name_i} must be (H_pat, {what_rows}, max_active) and {name_c} (H_pat, "
            f"{what_rows}), got {name_i} {tuple(indices.shape)} and {name_c} "
            f"{tuple(counts.shape)}"
        )
    if not (jnp.issubdtype(indices.dtype, jnp.integer) and jnp.issubdtype(counts.dtype,
                                                                         jnp.integer)):
        raise TypeError(
            f"{name_i} and {name_c} must be integer arrays, got {indices.dtype} and "
            f"{counts.dtype}"
        )
    h_pat = indices.shape[0]
    if h_pat not in (1, num_heads) or counts.shape[0] != h_pat:
        raise ValueError(
            f"{name_i}/{name_c} must have H_pat = 1 or H_pat = number of query heads "
            f"({num_heads}) rows, got {indices.shape[0]} and {counts.shape[0]}"
        )
    if indices.shape[1] != rows or counts.shape[1] != rows:
        raise ValueError(
            f"{name_i}/{name_c} must have {rows} {what_rows} (= ceil(n / block_size)), got "
            f"{indices.shape[1]} and {counts.shape[1]}"
        )
    if isinstance(indices, np.ndarray) and isinstance(counts, np.ndarray):
        width = indices.shape[2]
        if counts.min(initial=0) < 0 or counts.max(initial=0) > width:
            raise ValueError(f"{name_c} must lie in [0, {width}] (the table width)")
        valid = np.arange(width)[None, None, :] < counts[..., None]
        used = np.where(valid, indices, 0)
        if used.min(initial=0) < 0 or used.max(initial=0) >= cols:
            raise ValueError(f"{name_i} must list block indices in [0, {cols})")
        steps = np.diff(indices, axis=-1)
        if np.any((steps <= 0) & valid[..., 1:]):
            raise ValueError(f"{name_i} must list each row's active blocks strictly ascending")


def check_block_size(block_size, interpret) -> int:
    """The pattern's block size as the kernels take it: a power of two, >= 16 (the smallest
    Triton tile) unless ``interpret``."""
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise TypeError(f"block_size must be a static int, got {type(block_size).__name__}")
    min_block = 1 if interpret else MIN_BLOCK
    if block_size < min_block or block_size & (block_size - 1):
        raise ValueError(
            f"block_size must be a power of two >= {min_block} (Triton tiles), got {block_size}"
        )
    return int(block_size)


def sparse_tables(kv_block_indices, kv_block_counts, *, n: int, block_size: int,
                  num_heads: int, is_causal: bool, q_block_indices=None, q_block_counts=None):
    """Checks the compact tables and prepares what the kernels read: ``(kv_idx, kv_cnt,
    q_idx, q_cnt)`` int32 (the causal cut applied, the transposed tables derived when not
    given; see :func:`block_sparse_flash_attention` for the arguments)."""
    nqb = -(-n // block_size)
    kv_idx, kv_cnt = kv_block_indices, kv_block_counts
    if not isinstance(kv_idx, (np.ndarray, jax.Array)) or not isinstance(
            kv_cnt, (np.ndarray, jax.Array)):
        kv_idx, kv_cnt = np.asarray(kv_idx), np.asarray(kv_cnt)
    check_tables(kv_idx, kv_cnt, "kv_block_indices", "kv_block_counts", num_heads, nqb, nqb,
                 "query blocks")
    if (q_block_indices is None) != (q_block_counts is None):
        raise ValueError("q_block_indices and q_block_counts must be given together")
    if q_block_indices is None:
        q_idx, q_cnt = transpose_block_tables(kv_idx, kv_cnt, nqb, is_causal)
    else:
        q_idx, q_cnt = q_block_indices, q_block_counts
        check_tables(q_idx, q_cnt, "q_block_indices", "q_block_counts", num_heads, nqb, nqb,
                     "key blocks")
        if q_idx.shape[0] != kv_idx.shape[0]:
            raise ValueError("q_block_indices must have the same H_pat as kv_block_indices")
    if is_causal:
        kv_cnt = causal_counts(kv_idx, kv_cnt)
    clip = lambda x: jnp.clip(jnp.asarray(x, jnp.int32), 0, nqb - 1)
    return (clip(kv_idx), jnp.asarray(kv_cnt, jnp.int32), clip(q_idx),
            jnp.asarray(q_cnt, jnp.int32))


def sparse_lengths(query_seq_lengths, key_value_seq_lengths, B: int, Hk: int, n: int):
    """``None`` without lengths, else int32 ``(B, Hk, 2)``: ``(q_len, kv_len)`` broadcast
    from ``(B,)`` or ``(B, Hk)`` (a missing one is ``n``) and clipped to ``[0, n]``."""
    if query_seq_lengths is None and key_value_seq_lengths is None:
        return None
    one = lambda x: jnp.broadcast_to(
        jnp.asarray(n if x is None else x, jnp.int32).reshape(
            (B, -1) if x is not None and jnp.ndim(x) else ()), (B, Hk))
    return jnp.clip(jnp.stack([one(query_seq_lengths), one(key_value_seq_lengths)], -1), 0, n)
