"""Content-adaptive block-sparse attention: each query block attends the ``top_k`` key blocks
whose mean key best matches its mean query (a static count, a data-dependent choice), then
exact attention over the chosen blocks with the same gathered core as
:func:`dilax.block_sparse_attention`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dilax import _validation as V
from dilax.batch_dims import fold_batch_dims
from dilax.block_sparse.api import attend_tables, pad_seq
from dilax.core.arrays import cdiv


def _check_top_k(block_size, top_k, n) -> tuple[int, int]:
    block_size = V.static_int(block_size, "block_size")
    if block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size}")
    top_k = V.static_int(top_k, "top_k")
    nb = cdiv(n, block_size)
    if not 1 <= top_k <= nb:
        raise ValueError(
            f"top_k must be in [1, ceil(n / block_size)] = [1, {nb}] key blocks, got {top_k}"
        )
    return block_size, top_k


def _block_means(x: jax.Array, bs: int, lengths: jax.Array | None = None) -> jax.Array:
    """``(b, n, H, d)`` -> float32 ``(b, ceil(n/B), H, d)`` means over each block's tokens
    (only the tokens before ``lengths (b,)`` when given; 0 for a block without any)."""
    b, n, H, d = x.shape
    nb = cdiv(n, bs)
    x = x.astype(jnp.float32)
    if lengths is None:
        sizes = jnp.asarray(np.minimum(bs, n - np.arange(nb) * bs).astype(np.float32))[None]
    else:
        valid = jnp.arange(n)[None, :] < lengths[:, None]  # (b, n)
        x = jnp.where(valid[:, :, None, None], x, 0.0)
        sizes = jnp.clip(lengths[:, None] - jnp.arange(nb)[None] * bs, 0, bs).astype(jnp.float32)
    sums = pad_seq(x, nb * bs).reshape(b, nb, bs, H, d).sum(axis=2)
    return sums / jnp.maximum(sizes, 1.0)[:, :, None, None]


def content_adaptive_selection(
    q: jax.Array,
    k: jax.Array,
    block_size: int,
    top_k: int,
    *,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Key blocks chosen by :func:`content_adaptive_attention`, in the table format.

    Score of (query block ``i``, key block ``j``) for kv head ``c`` is
    ``sum_g mean_q[i, (c, g)] . mean_k[j, c]`` (block means of q and k; the query heads of one
    GQA group share one selection so K/V are gathered once per kv head). The diagonal block is
    always kept; with ``is_causal`` key blocks ``j > i`` are never chosen (rows ``i < top_k - 1``
    then hold ``i + 1`` blocks). The selection is discrete: no gradient flows through it.
    With valid lengths ``(b,)`` the block means use only valid tokens and key blocks without a
    valid key are never chosen (besides the diagonal).

    Returns:
      ``indices``: int32 ``(b, hk, nq, top_k)`` ascending, padded by repeating the last valid
      index; ``counts``: int32 ``(b, hk, nq)``.
    """
    q, k, _ = V.check_qkv(q, k, k)
    is_causal = V.check_bool(is_causal, "is_causal")
    b, n, h, d = q.shape
    hk = k.shape[2]
    bs, top_k = _check_top_k(block_size, top_k, n)
    nb = cdiv(n, bs)
    q_len = V.check_seq_lengths(query_seq_lengths, "query_seq_lengths", b, n)
    kv_len = V.check_seq_lengths(key_value_seq_lengths, "key_value_seq_lengths", b, n)
    qm = lax.stop_gradient(_block_means(q, bs, q_len)).reshape(b, nb, hk, h // hk, d)
    km = lax.stop_gradient(_block_means(k, bs, kv_len))
    scores = jnp.einsum("bicgd,bjcd->bcij", qm, km, precision=lax.Precision.HIGHEST)
    rows = np.arange(nb)
    if kv_len is not None:  # key blocks without a valid key are never worth a slot
        empty = (jnp.arange(nb) * bs)[None, :] >= kv_len[:, None]  # (b, nb)
        scores = jnp.where(empty[:, None, None, :], -jnp.inf, scores)
    scores = jnp.where(jnp.asarray(rows[:, None] == rows[None, :]), jnp.inf, scores)
    if is_causal:
        scores = jnp.where(jnp.asarray(rows[None, :] > rows[:, None]), -jnp.inf, scores)
    vals, idx = lax.top_k(scores, top_k)
    valid = vals > -jnp.inf
    counts = valid.sum(axis=-1).astype(jnp.int32)
    idx = jnp.sort(jnp.where(valid, idx, nb), axis=-1)
    last = jnp.take_along_axis(idx, jnp.maximum(counts - 1, 0)[..., None], axis=-1)
    idx = jnp.where(jnp.arange(top_k)[None, None, None] < counts[..., None], idx, last)
    return idx.astype(jnp.int32), counts


def content_adaptive_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    block_size: int,
    top_k: int,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
) -> jax.Array:
    """Exact attention over the ``top_k`` key blocks each query block selects by content.

    Per query block and kv head, :func:`content_adaptive_selection` picks ``top_k`` key blocks
    by mean-pooled ``q . k`` scores (diagonal always kept, future blocks excluded when causal);
    then every query attends every key of its selected blocks (and ``t <= p`` when causal) with
    one exact softmax, through the same gather + blockwise core as
    :func:`block_sparse_attention`. Gradients flow to q, k and v through the attention; the
    selection itself is discrete.

    Args:
      q: ``(b, n, h, d)``; k, v: ``(b, n, hk, d)`` with ``h % hk == 0`` (any number of
        leading batch dimensions, rank 3 included, as :func:`dilax.dilated_attention`).
      block_size: tokens per block ``B`` (the last block is partial if ``n % B != 0``).
      top_k: key blocks per query block, ``1 <= top_k <= ceil(n / B)``.
      is_causal: restrict query ``p`` to keys ``t <= p``.
      scale: logit scale, default ``1 / sqrt(d)``.
      query_seq_lengths, key_value_seq_lengths: optional int ``(b,)`` valid lengths
        (padding), as in :func:`dilax.dilated_attention`; the selection then looks at valid
        tokens only (:func:`content_adaptive_selection`).

    Returns:
      ``(b, n, h, d)`` in ``q.dtype``.

    Raises:
      TypeError: non-int ``block_size``/``top_k``, bad dtypes (as in
        :func:`block_sparse_attention`).
      ValueError: ``block_size <= 0``; ``top_k`` outside ``[1, ceil(n / B)]``; malformed
        q, k, v shapes (as in :func:`block_sparse_attention`).
    """
    q, k, v, rows, unfold = fold_batch_dims(q, k, v, query_seq_lengths=query_seq_lengths,
                                            key_value_seq_lengths=key_value_seq_lengths)
    query_seq_lengths, key_value_seq_lengths = rows.values()
    q, k, v = V.check_qkv(q, k, v)
    is_causal = V.check_bool(is_causal, "is_causal")
    scale = V.check_scale(scale, q.shape[3])
    b, n, h, d = q.shape
    hk = k.shape[2]
    bs, top_k = _check_top_k(block_size, top_k, n)
    V.check_memory(q, k, op="content_adaptive_attention")
    nb = cdiv(n, bs)
    q_len = V.check_seq_lengths(query_seq_lengths, "query_seq_lengths", b, n)
    kv_len_seq = V.check_seq_lengths(key_value_seq_lengths, "key_value_seq_lengths", b, n)
    idx, counts = content_adaptive_selection(q, k, bs, top_k, is_causal=is_causal,
                                             query_seq_lengths=q_len,
                                             key_value_seq_lengths=kv_len_seq)
    last = jnp.take_along_axis(idx, jnp.maximum(counts - 1, 0)[..., None], axis=-1)[..., 0]
    if is_causal:
        # The diagonal block is the last selected one; it goes through the causal call.
        is_diag = last == jnp.arange(nb, dtype=jnp.int32)[None, None]
        diag = ((counts > 0) & is_diag).astype(jnp.int32)
        gather = top_k > 1
        kv_len, diag_len = (counts - diag) * bs, diag * bs
    else:
        gather = True
        kv_len = counts * bs - (nb * bs - n) * (last == nb - 1).astype(jnp.int32)
        diag_len = None
    out, _ = attend_tables(
        q, k, v, idx if gather else None, kv_len if gather else None, diag_len,
        block_size=bs, U=hk, G=h // hk, kvmap=tuple(range(hk)), scale=scale,
        query_seq_lengths=q_len, key_value_seq_lengths=kv_len_seq,
    )
    return unfold(out)
