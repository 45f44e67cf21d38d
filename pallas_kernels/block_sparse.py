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

The backward needs the transposed tables (the query blocks that attend each key block) for the
dk/dv kernel. Pass them (``q_block_indices``, ``q_block_counts``) when the pattern has them;
otherwise they are derived with :func:`transpose_block_tables` (numpy when the tables are
concrete, XLA scatter + stable sort when traced; the latter is ``O(nq_blocks * nk_blocks)``
integers per pattern head).

With ``is_causal`` key ``t`` is visible to query ``p`` iff ``t <= p``: listed blocks entirely
above the diagonal are dropped from the tables, the cut inside the diagonal block is an
element mask. A query with no key gets ``out = 0``, ``lse = -inf``, zero gradient.
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
from pallas_kernels.config import MIN_BLOCK, KernelConfig, default_config, triton_compiler_params
from pallas_kernels.reference import block_sparse_reference  # noqa: F401 - beside its kernel
from pallas_kernels.tables import (
    block_mask_from_tables,
    causal_counts,
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


def _check_tables(indices, counts, name_i, name_c, num_heads, rows, cols, what_rows):
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


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


def _query_tile_segments(idx_ref, cnt, *, is_causal, block, block_q, block_k, seq_len,
                         num_blocks):
    """Key-tile segments of query tile ``i`` (forward and dq): the listed blocks cut into
    ``block // block_k`` tiles, unmasked except the last listed block when it is the causal
    diagonal or the ragged end of the sequence (the tables are ascending, so only the last
    listed block can be either)."""
    i = pl.program_id(0)
    sub_q, sub_k = block // block_q, block // block_k
    qb = lax.div(i, jnp.int32(sub_q))
    ragged = seq_len % block != 0
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
    if ragged:  # key tiles of the last block that hold keys < seq_len
        end = last == num_blocks - 1
        keys = seq_len - (num_blocks - 1) * block
        tail_tiles = jnp.where(end, jnp.minimum(tail_tiles, -(-keys // block_k)), tail_tiles)
        is_tail = is_tail | end
    is_tail = is_tail & (cnt > 0)
    head = (cnt - is_tail.astype(jnp.int32)) * sub_k
    return [(head, lambda s: _listed(idx_ref, s, sub_k), False),
            (jnp.where(is_tail, tail_tiles, 0), lambda s: last * sub_k + s, True)]


def _listed(idx_ref, step, sub):
    """Tile ``step`` of the listed blocks cut into ``sub`` tiles each, in tile units."""
    return idx_ref[lax.div(step, jnp.int32(sub))] * sub + lax.rem(step, jnp.int32(sub))


def _fwd_kernel(idx_ref, cnt_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale, is_causal,
                block, block_q, block_k, seq_len, num_blocks):
    i = pl.program_id(0)
    q_pos = i * block_q + jnp.arange(block_q, dtype=jnp.int32)
    segments = _query_tile_segments(idx_ref, cnt_ref[0], is_causal=is_causal, block=block,
                                    block_q=block_q, block_k=block_k, seq_len=seq_len,
                                    num_blocks=num_blocks)
    out, lse = online_softmax(
        q_ref[...], q_pos, k_ref, v_ref, segments=segments, kv_len=seq_len, k_offset=0,
        scale=scale, is_causal=is_causal, block_k=block_k,
    )
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse


def _dq_kernel(idx_ref, cnt_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *,
               scale, is_causal, block, block_q, block_k, seq_len, num_blocks):
    i = pl.program_id(0)
    q_pos = i * block_q + jnp.arange(block_q, dtype=jnp.int32)
    segments = _query_tile_segments(idx_ref, cnt_ref[0], is_causal=is_causal, block=block,
                                    block_q=block_q, block_k=block_k, seq_len=seq_len,
                                    num_blocks=num_blocks)
    dq = dq_loop(
        q_ref[...], do_ref[...], lse_ref[...], delta_ref[...], q_pos, k_ref, v_ref,
        segments=segments, kv_len=seq_len, k_offset=0, scale=scale, is_causal=is_causal,
        block_k=block_k,
    )
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkdv_kernel(idx_ref, cnt_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref,
                 dv_ref, *, scale, is_causal, block, block_q, block_k, seq_len, groups,
                 per_head):
    j = pl.program_id(0)
    sub_q, sub_k = block // block_q, block // block_k
    kb = lax.div(j, jnp.int32(sub_k))
    k_idx = j * block_k + jnp.arange(block_k, dtype=jnp.int32)
    valid = (k_idx < seq_len)[:, None]
    k = jnp.where(valid, k_ref[...], jnp.zeros((), k_ref.dtype))
    v = jnp.where(valid, v_ref[...], jnp.zeros((), v_ref.dtype))
    # A key tile that straddles seq_len needs the mask on every query tile.
    straddles = (j + 1) * block_k > seq_len if seq_len % block_k else False

    def per_group(g, carry):
        row = g if per_head else 0
        cnt = cnt_ref[row]
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
            carry, g, k, v, k_idx, seq_len, q_ref, do_ref, lse_ref, delta_ref,
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


def _sparse_forward(q, k, v, kv_idx, kv_cnt, block_size, scale, is_causal, config, interpret,
                    debug):
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
                          block_q=bq, block_k=bk, seq_len=n, num_blocks=nqb),
        grid=(nqb * sub_q, B, Hk * G),
        in_specs=[
            pl.BlockSpec((None, None, width), lambda i, b, h: (pat_of(h), row(i), 0)),
            pl.BlockSpec((None, 1), lambda i, b, h: (pat_of(h), row(i))),
            q_spec, kv_spec, kv_spec,
        ],
        out_specs=[q_spec, pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))],
        out_shape=[jax.ShapeDtypeStruct(qp.shape, q.dtype),
                   jax.ShapeDtypeStruct((B, Hk * G, n_pad), _F32)],
        compiler_params=triton_compiler_params(config, dp, interpret),
        interpret=interpret,
        debug=debug,
        name="dilax_block_sparse_fwd",
    )(kv_idx, kv_cnt, qp, kp, vp)
    out = out[:, :n, :, :, :d]
    lse = lse.reshape(B, Hk, G, n_pad)[..., :n].transpose(0, 3, 1, 2)
    return out, lse


def _sparse_backward(q, k, v, kv_idx, kv_cnt, q_idx, q_cnt, out, lse, dout, dlse, block_size,
                     scale, is_causal, config, interpret, debug):
    B, n, Hk, G, d = q.shape
    dp = padded_head_dim(d)
    nqb = kv_idx.shape[1]
    nkb = q_idx.shape[1]
    n_pad = nqb * block_size
    _, (bq_kv, bk_kv), (bq_q, bk_q) = sparse_tiles(config, block_size)
    per_head = kv_idx.shape[0] > 1
    kv_of, grp_of, pat_of = _head_maps(G, per_head)
    lse_rows, delta_rows = backward_rows(lse, output_delta(out, dout, dlse), n_pad)
    qp = pad_to(gpu_only(q, interpret), {1: n_pad, 4: dp})
    dop = pad_to(dout.astype(q.dtype), {1: n_pad, 4: dp})
    kp = pad_to(k, {1: n_pad, 3: dp})
    vp = pad_to(v, {1: n_pad, 3: dp})
    params = triton_compiler_params(config, dp, interpret)

    sub_q = block_size // bq_q
    q_spec = pl.BlockSpec((None, bq_q, None, None, dp),
                          lambda i, b, h: (b, i, kv_of(h), grp_of(h), 0))
    row_spec = pl.BlockSpec((None, None, None, bq_q),
                            lambda i, b, h: (b, kv_of(h), grp_of(h), i))
    kv_full = pl.BlockSpec((None, n_pad, None, dp), lambda i, b, h: (b, 0, kv_of(h), 0))
    row = lambda i: lax.div(i, jnp.int32(sub_q))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, is_causal=is_causal, block=block_size,
                          block_q=bq_q, block_k=bk_q, seq_len=n, num_blocks=nqb),
        grid=(nqb * sub_q, B, Hk * G),
        in_specs=[
            pl.BlockSpec((None, None, kv_idx.shape[2]), lambda i, b, h: (pat_of(h), row(i), 0)),
            pl.BlockSpec((None, 1), lambda i, b, h: (pat_of(h), row(i))),
            q_spec, kv_full, kv_full, q_spec, row_spec, row_spec,
        ],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(qp.shape, q.dtype),
        compiler_params=params,
        interpret=interpret,
        debug=debug,
        name="dilax_block_sparse_dq",
    )(kv_idx, kv_cnt, qp, kp, vp, dop, lse_rows, delta_rows)

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
        functools.partial(_dkdv_kernel, scale=scale, is_causal=is_causal, block=block_size,
                          block_q=bq_kv, block_k=bk_kv, seq_len=n, groups=G,
                          per_head=per_head),
        grid=(nkb * sub_k, B, Hk),
        table_specs=[
            pl.BlockSpec((None, rows, None, width),
                         lambda j, b, c: (c_map(c), 0, key_block(j), 0)),
            pl.BlockSpec((None, rows, None), lambda j, b, c: (c_map(c), 0, key_block(j))),
        ],
        len_pad=n_pad, groups=G, dp=dp, block_k=bk_kv, kv_shape=kp.shape,
        k_dtype=k.dtype, v_dtype=v.dtype, compiler_params=params, interpret=interpret,
        debug=debug, name="dilax_block_sparse_dkdv",
    )(q_idx4, q_cnt3, qp, kp, vp, dop, lse_rows, delta_rows)
    return dq[:, :n, ..., :d], dk[:, :n, :, :d], dv[:, :n, :, :d]


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11, 12))
def _sparse(q, k, v, kv_idx, kv_cnt, q_idx, q_cnt, block_size, scale, is_causal, config,
            interpret, debug):
    return _sparse_forward(q, k, v, kv_idx, kv_cnt, block_size, scale, is_causal, config,
                           interpret, debug)


def _sparse_fwd(q, k, v, kv_idx, kv_cnt, q_idx, q_cnt, block_size, scale, is_causal, config,
                interpret, debug):
    out, lse = _sparse_forward(q, k, v, kv_idx, kv_cnt, block_size, scale, is_causal, config,
                               interpret, debug)
    return (out, lse), (q, k, v, kv_idx, kv_cnt, q_idx, q_cnt, out, lse)


def _sparse_bwd(block_size, scale, is_causal, config, interpret, debug, res, cotangents):
    q, k, v, kv_idx, kv_cnt, q_idx, q_cnt, out, lse = res
    dout, dlse = cotangents
    dq, dk, dv = _sparse_backward(q, k, v, kv_idx, kv_cnt, q_idx, q_cnt, out, lse, dout, dlse,
                                  block_size, scale, is_causal, config, interpret, debug)
    return dq, dk, dv, None, None, None, None


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
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise TypeError(f"block_size must be a static int, got {type(block_size).__name__}")
    block_size = int(block_size)
    min_block = 1 if interpret else MIN_BLOCK
    if block_size < min_block or block_size & (block_size - 1):
        raise ValueError(
            f"block_size must be a power of two >= {min_block} (Triton tiles), got {block_size}"
        )
    if config is None:
        config = default_config(n, n, d, q.dtype)
    elif not isinstance(config, KernelConfig):
        raise TypeError(f"config must be a pallas_kernels.KernelConfig or None, got "
                        f"{type(config).__name__}")
    overrides = {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages))
                 if v is not None}
    config = dataclasses.replace(config, **overrides)
    nqb = -(-n // block_size)
    H = Hk * G
    kv_idx, kv_cnt = kv_block_indices, kv_block_counts
    if not isinstance(kv_idx, (np.ndarray, jax.Array)) or not isinstance(
            kv_cnt, (np.ndarray, jax.Array)):
        kv_idx, kv_cnt = np.asarray(kv_idx), np.asarray(kv_cnt)
    _check_tables(kv_idx, kv_cnt, "kv_block_indices", "kv_block_counts", H, nqb, nqb,
                  "query blocks")
    if (q_block_indices is None) != (q_block_counts is None):
        raise ValueError("q_block_indices and q_block_counts must be given together")
    if q_block_indices is None:
        q_idx, q_cnt = transpose_block_tables(kv_idx, kv_cnt, nqb, is_causal)
    else:
        q_idx, q_cnt = q_block_indices, q_block_counts
        _check_tables(q_idx, q_cnt, "q_block_indices", "q_block_counts", H, nqb, nqb,
                      "key blocks")
        if q_idx.shape[0] != kv_idx.shape[0]:
            raise ValueError("q_block_indices must have the same H_pat as kv_block_indices")
    if is_causal:
        kv_cnt = causal_counts(kv_idx, kv_cnt)
    kv_idx = jnp.clip(jnp.asarray(kv_idx, jnp.int32), 0, nqb - 1)
    q_idx = jnp.clip(jnp.asarray(q_idx, jnp.int32), 0, nqb - 1)
    kv_cnt = jnp.asarray(kv_cnt, jnp.int32)
    q_cnt = jnp.asarray(q_cnt, jnp.int32)
    return _sparse(q, k, v, kv_idx, kv_cnt, q_idx, q_cnt, block_size, float(scale),
                   bool(is_causal), config, interpret or False, bool(debug))
