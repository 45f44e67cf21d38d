"""Block-sparse flash attention driven by compact block tables, beside its XLA reference.

A pattern with block size ``B`` is given by its compact tables (docs/semantics.md,
"Block-sparse attention"):

* ``kv_block_indices: int32 (H_pat, nq_blocks, max_active)``: the active key blocks of each
  query block, ascending; entries at and beyond the count are padding (ignored);
* ``kv_block_counts: int32 (H_pat, nq_blocks)``;

with ``H_pat = 1`` (shared by every head) or ``H_pat = Hk * G`` (one row per query head, head
``c * G + g``). Splash attention (TPU) scalar-prefetches such tables so that its BlockSpec
index maps pick the key block of each grid step. On GPU (Triton) a program cannot carry an
accumulator across grid steps, so the analogue used here is: the table row of the program's
query block is delivered by the BlockSpec index map, and the program's key loop runs over the
``count`` listed blocks only, dynamic-slicing K/V (resident in HBM/L2) at ``index * B``.
Compute therefore scales with the number of active blocks; nothing of size ``n x n`` exists.

The dk/dv kernel reads the transposed tables (the query blocks that attend each key block),
given or derived by :func:`transpose_block_tables`. With ``is_causal`` listed blocks above the
diagonal are dropped and the diagonal block gets an element mask. Valid lengths (traced,
per batch row and kv head) are handled inside the kernels: key blocks past ``kv_len`` are
not visited, query tiles past ``q_len`` visit nothing. A query with no key gets ``out = 0``,
``lse = -inf``, zero gradient.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import (
    backward_rows,
    cdiv_nonneg,
    check_grouped_qkv,
    dkdv_call,
    dkdv_loop,
    dq_loop,
    for_each_group,
    gpu_only,
    online_softmax,
    output_delta,
    pad_to,
    padded_head_dim,
)
from pallas_kernels.config import KernelConfig, default_config, triton_compiler_params
from pallas_kernels.reference import block_sparse_reference  # noqa: F401 - beside its kernel
from pallas_kernels.tables import (
    block_mask_from_tables,
    check_block_size,
    sparse_lengths,
    sparse_tables,
    tables_from_block_mask,
    transpose_block_tables,
)

__all__ = [
    "block_mask_from_tables",
    "block_sparse_flash_attention",
    "block_sparse_reference",
    "tables_from_block_mask",
    "transpose_block_tables",
]

_F32 = jnp.float32


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


def _lengths(len_ref, seq_len, lengths):
    """``(q_len, kv_len)`` of the program's batch row and kv head: read from ``len_ref``
    (traced) with lengths, else ``(None, seq_len)`` (static)."""
    return (len_ref[0], len_ref[1]) if lengths else (None, seq_len)


def _count_below(entry, count, limit):
    """How many of the ``count`` listed blocks ``entry(s)`` (ascending) lie below ``limit``:
    a prefix of the row, so the loops stop there (blocks past a length are never visited)."""
    return lax.fori_loop(0, count, lambda s, c: c + (entry(s) < limit).astype(jnp.int32),
                         jnp.int32(0))


def _query_tile_segments(idx_ref, cnt, kv_len, *, is_causal, block, block_q, block_k, ragged,
                         lengths):
    """Key-tile segments of query tile ``i`` (forward and dq): the listed blocks cut into
    ``block // block_k`` tiles, unmasked except the last listed block when it is the causal
    diagonal or holds ``kv_len`` (the ragged end of the sequence or a valid length; the
    tables are ascending, so only the last listed block can be either). With ``lengths``
    the listed blocks wholly past ``kv_len`` are dropped first."""
    i = pl.program_id(0)
    sub_q, sub_k = block // block_q, block // block_k
    qb = lax.div(i, jnp.int32(sub_q))
    if lengths:
        cnt = _count_below(lambda s: idx_ref[s], cnt, cdiv_nonneg(kv_len, block))
    if not (is_causal or ragged):
        return [(cnt * sub_k, lambda s: _listed(idx_ref, s, sub_k), False)]
    last = idx_ref[jnp.maximum(cnt - 1, 0)]
    tail_tiles = jnp.int32(sub_k)
    is_tail = jnp.zeros((), jnp.bool_)
    if is_causal:  # key tiles of the diagonal block up to the tile's last query
        diag = last == qb
        rows = (lax.rem(i, jnp.int32(sub_q)) + 1) * block_q
        tail_tiles = jnp.where(diag, jnp.minimum(tail_tiles, cdiv_nonneg(rows, block_k)),
                               tail_tiles)
        is_tail = is_tail | diag
    if ragged:  # key tiles of the last block that hold keys < kv_len
        end = (last + 1) * block > kv_len
        keys = cdiv_nonneg(jnp.maximum(kv_len - last * block, 0), block_k)
        tail_tiles = jnp.where(end, jnp.minimum(tail_tiles, keys), tail_tiles)
        is_tail = is_tail | end
    is_tail = is_tail & (cnt > 0)
    head = (cnt - is_tail.astype(jnp.int32)) * sub_k
    return [(head, lambda s: _listed(idx_ref, s, sub_k), False),
            (jnp.where(is_tail, tail_tiles, 0), lambda s: last * sub_k + s, True)]


def _listed(idx_ref, step, sub):
    """Tile ``step`` of the listed blocks cut into ``sub`` tiles each, in tile units."""
    return idx_ref[lax.div(step, jnp.int32(sub))] * sub + lax.rem(step, jnp.int32(sub))


def _query_tile(idx_ref, cnt_ref, len_ref, *, block_q, seq_len, lengths, **kw):
    """Query positions, segments, ``q_len`` and ``kv_len`` of query tile ``i``; a tile wholly
    past ``q_len`` visits no key."""
    i = pl.program_id(0)
    q_pos = i * block_q + jnp.arange(block_q, dtype=jnp.int32)
    q_len, kv_len = _lengths(len_ref, seq_len, lengths)
    cnt = cnt_ref[0] if q_len is None else jnp.where(i * block_q < q_len, cnt_ref[0], 0)
    segments = _query_tile_segments(idx_ref, cnt, kv_len, block_q=block_q, lengths=lengths,
                                    ragged=lengths or seq_len % kw["block"] != 0, **kw)
    return q_pos, segments, q_len, kv_len


def _fwd_kernel(idx_ref, cnt_ref, len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale,
                is_causal, block_k, **kw):
    q_pos, segments, q_len, kv_len = _query_tile(idx_ref, cnt_ref, len_ref,
                                                 is_causal=is_causal, block_k=block_k, **kw)
    out, lse = online_softmax(
        q_ref[...], q_pos, k_ref, v_ref, segments=segments, kv_len=kv_len, k_offset=0,
        scale=scale, is_causal=is_causal, block_k=block_k,
    )
    if q_len is not None:  # rows past q_len: out 0, lse -inf, so the backward's p is 0
        valid = q_pos < q_len
        out = jnp.where(valid[:, None], out, 0.0)
        lse = jnp.where(valid, lse, -jnp.inf)
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse


def _dq_kernel(idx_ref, cnt_ref, len_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
               dq_ref, *, scale, is_causal, block_k, **kw):
    # rows past q_len have lse = +inf (the forward's -inf, backward_rows): p = 0, dq = 0
    q_pos, segments, _, kv_len = _query_tile(idx_ref, cnt_ref, len_ref, is_causal=is_causal,
                                             block_k=block_k, **kw)
    dq = dq_loop(
        q_ref[...], do_ref[...], lse_ref[...], delta_ref[...], q_pos, k_ref, v_ref,
        segments=segments, kv_len=kv_len, k_offset=0, scale=scale, is_causal=is_causal,
        block_k=block_k,
    )
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkdv_kernel(idx_ref, cnt_ref, len_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
                 dk_ref, dv_ref, *, scale, is_causal, block, block_q, block_k, seq_len, groups,
                 per_head, lengths):
    j = pl.program_id(0)
    sub_q, sub_k = block // block_q, block // block_k
    kb = lax.div(j, jnp.int32(sub_k))
    q_len, kv_len = _lengths(len_ref, seq_len, lengths)
    k_idx = j * block_k + jnp.arange(block_k, dtype=jnp.int32)
    valid = (k_idx < kv_len)[:, None]
    k = jnp.where(valid, k_ref[...], jnp.zeros((), k_ref.dtype))
    v = jnp.where(valid, v_ref[...], jnp.zeros((), v_ref.dtype))
    # A key tile that straddles kv_len needs the mask on every query tile.
    straddles = (j + 1) * block_k > kv_len if lengths or seq_len % block_k else False

    def per_group(g, carry):
        row = g if per_head else 0
        cnt = cnt_ref[row]
        if lengths:  # no work for a key tile past kv_len; no query block past q_len
            below = _count_below(lambda s: idx_ref[row, s], cnt, cdiv_nonneg(q_len, block))
            cnt = jnp.where(j * block_k < kv_len, below, 0)
        head, first = jnp.int32(0), jnp.int32(0)
        if is_causal:  # the diagonal block (listed first) is masked, from its first tile
            head = ((cnt > 0) & (idx_ref[row, 0] == kb)).astype(jnp.int32)  # that sees a key
            first = lax.div(lax.rem(j, jnp.int32(sub_k)) * block_k, jnp.int32(block_q))
        rest = (cnt - head) * sub_q
        segments = [(head * (sub_q - first), lambda s: kb * sub_q + first + s, True)]
        listed = lambda s: _listed_from(idx_ref, row, head, s, sub_q)
        if straddles is False:
            segments.append((rest, listed, False))
        else:
            segments += [(jnp.where(straddles, 0, rest), listed, False),
                         (jnp.where(straddles, rest, 0), listed, True)]
        return dkdv_loop(
            carry, g, k, v, k_idx, kv_len, q_ref, do_ref, lse_ref, delta_ref,
            segments=segments, q_offset=0, k_offset=0, scale=scale, is_causal=is_causal,
            block_q=block_q,
        )

    dp = k_ref.shape[-1]
    init = (jnp.zeros((block_k, dp), _F32), jnp.zeros((block_k, dp), _F32))
    dk, dv = for_each_group(groups, per_group, init)
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _listed_from(idx_ref, row, offset, step, sub):
    """Tile ``step`` of the listed query blocks from entry ``offset`` on, in tile units."""
    return (idx_ref[row, offset + lax.div(step, jnp.int32(sub))] * sub
            + lax.rem(step, jnp.int32(sub)))


# --------------------------------------------------------------------------------------------
# pallas_call wrappers
# --------------------------------------------------------------------------------------------


def _head_maps(groups: int, per_head: bool):
    def kv_of(h):
        return lax.div(h, jnp.int32(groups))

    def grp_of(h):
        return lax.rem(h, jnp.int32(groups))

    def pat_of(h):
        return h if per_head else 0

    return kv_of, grp_of, pat_of


def sparse_tiles(config: KernelConfig, block_size: int) -> tuple[tuple[int, int], ...]:
    """The kernels' tiles ``(fwd, dkv, dq)``, each ``(rows, cols)``: ``config``'s tiles capped
    at the pattern's block size (both powers of two, so a tile divides the block). A block
    larger than the tile is visited as ``block_size / tile`` tiles, so shared memory and
    registers do not grow with the block size."""
    cap = lambda t: tuple(min(x, block_size) for x in t)
    return (cap((config.block_q, config.block_k)), cap(config.dkv_blocks),
            cap(config.dq_blocks))


def _lens_spec(kv_of):
    """``(q_len, kv_len)`` of the program's batch row and kv head, from ``(B, Hk, 2)``."""
    return pl.BlockSpec((None, None, 2), lambda i, b, h: (b, kv_of(h), 0))


def _lens(lengths, B, Hk, n):
    return jnp.full((B, Hk, 2), n, jnp.int32) if lengths is None else lengths


def sparse_forward(q, k, v, tables, *, lengths, block_size: int, scale: float,
                   is_causal: bool, config: KernelConfig, interpret=False, debug=False):
    """Forward kernel on prepared ``tables`` (:func:`sparse_tables`): ``out (B, n, Hk, G, d)``
    in ``q.dtype`` and ``lse (B, n, Hk, G)`` float32. ``lengths``: ``None`` or int32
    ``(B, Hk, 2)``, ``(q_len, kv_len)`` in ``[0, n]`` per batch row and kv head: key blocks
    past ``kv_len`` are not visited, rows past ``q_len`` get ``out = 0``, ``lse = -inf``."""
    kv_idx, kv_cnt = tables[:2]
    B, n, Hk, G, d = q.shape
    dp = padded_head_dim(d)
    nqb = kv_idx.shape[1]
    n_pad = nqb * block_size
    (bq, bk), _, _ = sparse_tiles(config, block_size)
    sub_q = block_size // bq
    per_head = kv_idx.shape[0] > 1
    kv_of, grp_of, pat_of = _head_maps(G, per_head)
    qp = pad_to(gpu_only(q, interpret), {1: n_pad, 4: dp})
    kp = pad_to(k, {1: n_pad, 3: dp})
    vp = pad_to(v, {1: n_pad, 3: dp})
    width = kv_idx.shape[2]
    q_spec = pl.BlockSpec((None, bq, None, None, dp),
                          lambda i, b, h: (b, i, kv_of(h), grp_of(h), 0))
    kv_spec = pl.BlockSpec((None, n_pad, None, dp), lambda i, b, h: (b, 0, kv_of(h), 0))
    row = lambda i: lax.div(i, jnp.int32(sub_q))  # the pattern block of query tile i
    out, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, scale=scale, is_causal=is_causal, block=block_size,
                          block_q=bq, block_k=bk, seq_len=n, lengths=lengths is not None),
        grid=(nqb * sub_q, B, Hk * G),
        in_specs=[
            pl.BlockSpec((None, None, width), lambda i, b, h: (pat_of(h), row(i), 0)),
            pl.BlockSpec((None, 1), lambda i, b, h: (pat_of(h), row(i))),
            _lens_spec(kv_of), q_spec, kv_spec, kv_spec,
        ],
        out_specs=[q_spec, pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))],
        out_shape=[jax.ShapeDtypeStruct(qp.shape, q.dtype),
                   jax.ShapeDtypeStruct((B, Hk * G, n_pad), _F32)],
        compiler_params=triton_compiler_params(config, dp, interpret),
        interpret=interpret,
        debug=debug,
        name="dilax_block_sparse_fwd",
    )(kv_idx, kv_cnt, _lens(lengths, B, Hk, n), qp, kp, vp)
    out = out[:, :n, :, :, :d]
    lse = lse.reshape(B, Hk, G, n_pad)[..., :n].transpose(0, 3, 1, 2)
    return out, lse


def sparse_backward(q, k, v, tables, *, lengths, lse, dout, delta, block_size: int,
                    scale: float, is_causal: bool, config: KernelConfig, interpret=False,
                    debug=False):
    """Backward kernels: ``(dq, dk, dv)`` in the input dtypes, recomputed from ``lse``
    (:func:`sparse_forward`'s) with ``delta = rowsum(dO * O) - dlse`` ``(B, n, Hk, G)``."""
    kv_idx, kv_cnt, q_idx, q_cnt = tables
    B, n, Hk, G, d = q.shape
    dp = padded_head_dim(d)
    nqb = kv_idx.shape[1]
    nkb = q_idx.shape[1]
    n_pad = nqb * block_size
    _, (bq_kv, bk_kv), (bq_q, bk_q) = sparse_tiles(config, block_size)
    per_head = kv_idx.shape[0] > 1
    kv_of, grp_of, pat_of = _head_maps(G, per_head)
    lse_rows, delta_rows = backward_rows(lse, delta, n_pad)
    qp = pad_to(gpu_only(q, interpret), {1: n_pad, 4: dp})
    dop = pad_to(dout.astype(q.dtype), {1: n_pad, 4: dp})
    kp = pad_to(k, {1: n_pad, 3: dp})
    vp = pad_to(v, {1: n_pad, 3: dp})
    params = triton_compiler_params(config, dp, interpret)
    lens = _lens(lengths, B, Hk, n)
    statics = dict(scale=scale, is_causal=is_causal, block=block_size, seq_len=n,
                   lengths=lengths is not None)

    sub_q = block_size // bq_q
    q_spec = pl.BlockSpec((None, bq_q, None, None, dp),
                          lambda i, b, h: (b, i, kv_of(h), grp_of(h), 0))
    row_spec = pl.BlockSpec((None, None, None, bq_q),
                            lambda i, b, h: (b, kv_of(h), grp_of(h), i))
    kv_full = pl.BlockSpec((None, n_pad, None, dp), lambda i, b, h: (b, 0, kv_of(h), 0))
    row = lambda i: lax.div(i, jnp.int32(sub_q))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, block_q=bq_q, block_k=bk_q, **statics),
        grid=(nqb * sub_q, B, Hk * G),
        in_specs=[
            pl.BlockSpec((None, None, kv_idx.shape[2]), lambda i, b, h: (pat_of(h), row(i), 0)),
            pl.BlockSpec((None, 1), lambda i, b, h: (pat_of(h), row(i))),
            _lens_spec(kv_of), q_spec, kv_full, kv_full, q_spec, row_spec, row_spec,
        ],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(qp.shape, q.dtype),
        compiler_params=params,
        interpret=interpret,
        debug=debug,
        name="dilax_block_sparse_dq",
    )(kv_idx, kv_cnt, lens, qp, kp, vp, dop, lse_rows, delta_rows)

    # Transposed tables grouped by kv head: (Hk or 1, G or 1, nkb, width) and (.., nkb).
    rows = G if per_head else 1
    heads = Hk if per_head else 1
    width = q_idx.shape[2]
    q_idx4 = q_idx.reshape(heads, rows, nkb, width)
    q_cnt3 = q_cnt.reshape(heads, rows, nkb)
    c_map = (lambda c: c) if per_head else (lambda c: 0)
    sub_k = block_size // bk_kv
    key_block = lambda j: lax.div(j, jnp.int32(sub_k))
    dk, dv = dkdv_call(
        functools.partial(_dkdv_kernel, block_q=bq_kv, block_k=bk_kv, groups=G,
                          per_head=per_head, **statics),
        grid=(nkb * sub_k, B, Hk),
        table_specs=[
            pl.BlockSpec((None, rows, None, width),
                         lambda j, b, c: (c_map(c), 0, key_block(j), 0)),
            pl.BlockSpec((None, rows, None), lambda j, b, c: (c_map(c), 0, key_block(j))),
            pl.BlockSpec((None, None, 2), lambda j, b, c: (b, c, 0)),
        ],
        len_pad=n_pad, groups=G, dp=dp, block_k=bk_kv, kv_shape=kp.shape,
        k_dtype=k.dtype, v_dtype=v.dtype, compiler_params=params, interpret=interpret,
        debug=debug, name="dilax_block_sparse_dkdv",
    )(q_idx4, q_cnt3, lens, qp, kp, vp, dop, lse_rows, delta_rows)
    return dq[:, :n, ..., :d], dk[:, :n, :, :d], dv[:, :n, :, :d]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _sparse(q, k, v, tables, lengths, statics):
    return sparse_forward(q, k, v, tables, lengths=lengths, **dict(statics))


def _sparse_fwd(q, k, v, tables, lengths, statics):
    out, lse = sparse_forward(q, k, v, tables, lengths=lengths, **dict(statics))
    return (out, lse), (q, k, v, tables, lengths, out, lse)


def _sparse_bwd(statics, res, cotangents):
    q, k, v, tables, lengths, out, lse = res
    dout, dlse = cotangents
    dq, dk, dv = sparse_backward(q, k, v, tables, lengths=lengths, lse=lse, dout=dout,
                                 delta=output_delta(out, dout, dlse), **dict(statics))
    return dq, dk, dv, None, None


_sparse.defvjp(_sparse_fwd, _sparse_bwd)


def block_sparse_flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv_block_indices: jax.Array | np.ndarray,
    kv_block_counts: jax.Array | np.ndarray,
    *,
    block_size: int,
    scale: float,
    is_causal: bool = False,
    interpret: bool = False,
    q_block_indices: jax.Array | np.ndarray | None = None,
    q_block_counts: jax.Array | np.ndarray | None = None,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    config: KernelConfig | None = None,
    debug: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Block-sparse attention visiting only the listed ``(query block, key block)`` pairs.

    Args:
      q: ``(B, n, Hk, G, d)`` queries grouped by kv head (query head ``c * G + g``).
      k, v: ``(B, n, Hk, d)``.
      kv_block_indices: int ``(H_pat, ceil(n / block_size), max_active)``, the active key
        blocks of each query block in ascending order (entries beyond the count are ignored);
        ``H_pat`` is 1 (shared) or ``Hk * G`` (per query head).
      kv_block_counts: int ``(H_pat, ceil(n / block_size))``.
      block_size: the pattern's block size, a power of two (>= 16 unless ``interpret``).
      scale: logit scale.
      is_causal: additionally require ``t <= p`` (blocks above the diagonal are skipped).
      interpret: run the kernels with the Pallas interpreter (CPU tests).
      q_block_indices, q_block_counts: optional transposed tables
        (``(H_pat, nk_blocks, width)``, ``(H_pat, nk_blocks)``) for the dk/dv kernel; derived
        with :func:`transpose_block_tables` when omitted.
      query_seq_lengths, key_value_seq_lengths: optional int ``(B,)`` or ``(B, Hk)`` valid
        lengths (traced allowed, clipped to ``[0, n]``): keys ``t >= kv_len`` get no weight
        (their blocks are not visited), query rows ``p >= q_len`` get ``out = 0``,
        ``lse = -inf`` and zero gradient.
      num_warps, num_stages: Triton launch parameters (override ``config``'s).
      config: the kernels' tiles, warps and stages (default
        :func:`pallas_kernels.default_config` of the shape); each tile is capped at
        ``block_size``, and a larger block is visited tile by tile, so any block size
        compiles with the same shared memory and registers as the flash kernels.
      debug: print the kernels' jaxprs.

    Returns:
      ``out: (B, n, Hk, G, d)`` in ``q.dtype`` and ``lse: (B, n, Hk, G)`` float32 (one softmax
      over all attended keys; ``0`` / ``-inf`` for queries with none). Differentiable in
      ``q, k, v`` including the ``lse`` cotangent.
    """
    check_grouped_qkv(q, k, v, "block_sparse_flash_attention")
    B, n, Hk, G, d = q.shape
    if k.shape[1] != n:
        raise ValueError(f"block_sparse_flash_attention: q and k must have the same length n, "
                         f"got {n} and {k.shape[1]}")
    block_size = check_block_size(block_size, interpret)
    if config is None:
        config = default_config(n, n, d, q.dtype)
    elif not isinstance(config, KernelConfig):
        raise TypeError(f"config must be a pallas_kernels.KernelConfig or None, got "
                        f"{type(config).__name__}")
    overrides = {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages))
                 if v is not None}
    config = dataclasses.replace(config, **overrides)
    tables = sparse_tables(kv_block_indices, kv_block_counts, n=n, block_size=block_size,
                           num_heads=Hk * G, is_causal=is_causal,
                           q_block_indices=q_block_indices, q_block_counts=q_block_counts)
    lengths = sparse_lengths(query_seq_lengths, key_value_seq_lengths, B, Hk, n)
    statics = dict(block_size=block_size, scale=float(scale), is_causal=bool(is_causal),
                   config=config, interpret=interpret or False, debug=bool(debug))
    return _sparse(q, k, v, tables, lengths, tuple(statics.items()))
