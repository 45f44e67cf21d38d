"""Flash attention (forward + backward) as Pallas kernels, beside its XLA reference.

:func:`flash_attention` returns ``(out, lse)`` and is differentiable in ``q, k, v`` with a
cotangent on ``lse`` too; its dense reference is :func:`flash_attention_reference`.
:func:`flash_forward` and :func:`flash_backward` are the two passes on their own, for callers
that write their own backward (dilax's core interface adapts them). Written in the style of
``jax.experimental.pallas.ops.gpu.attention``:

* forward: one program per ``(query block, batch, query head)``; it keeps its query tile
  resident and streams the key/value tiles of its kv head with an online softmax (float32
  statistics and accumulator, ``out`` in ``q.dtype``, ``lse`` float32). The kv head of query
  head ``h = c * G + g`` is ``c = h // G``, computed in the BlockSpec index map, so GQA/MQA
  never repeats K/V in memory.
* causal block skipping: the key loop of a query block stops at the last key block that holds
  a visible key (``k_offset + t <= q_offset + p``), and at ``kv_len``; the dk/dv kernel starts
  at the first query block that can see its key block.
* backward: ``delta = rowsum(dO * O) - dlse`` (one fused XLA reduction), then two kernels
  without atomics: dq (one program per query block, loop over key blocks) and dk/dv (one
  program per key block and kv head, loop over the ``G`` query heads of that kv head and over
  query blocks), both recomputing probabilities from the saved ``lse``.
* masks (optional, each compiled in only when given): a band ``window`` (only the key tiles
  that meet it are visited, forward and dq, and only the query tiles that meet it, dk/dv:
  ``O(L * W)`` work), a per-key ``kv_valid`` table and query lengths ``q_len`` (query tiles
  wholly past them skipped; their rows get ``out = 0``, ``lse = -inf``, zero gradient).
  Tiles wholly inside the band and the lengths run the unmasked loop body (every tile is
  masked under ``kv_valid``).
* ragged lengths: ``Lq``/``Lk`` are zero-padded to a multiple of the tiles and the padded keys
  are masked through ``kv_len``; ``head_dim`` is zero-padded to a power of two >= 16.
* on GPU the Triton lowering is selected with ``jax.experimental.pallas.triton.CompilerParams``
  (imported lazily); ``interpret=True`` runs the same kernels on any backend (tests on CPU).

A query with no visible key gets ``out = 0``, ``lse = -inf`` and zero gradient, never NaN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import (
    arange_i32,
    backward_rows,
    band,
    cdiv_nonneg,
    check_grouped_qkv,
    dkdv_call,
    dkdv_loop,
    dq_loop,
    floordiv_clamped,
    for_each_group,
    gpu_only,
    mask_tables,
    online_softmax,
    output_delta,
    pad_to,
    padded_head_dim,
)
from pallas_kernels.config import (
    KernelConfig,
    default_config,
    tile,
    triton_compiler_params,
)
from pallas_kernels.reference import attention_reference

__all__ = [
    "flash_attention",
    "flash_attention_reference",
    "flash_backward",
    "flash_forward",
    "resolve_config",
]

_F32 = jnp.float32


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


def _causal_key_blocks(q_block, block_q, block_k, q_offset, k_offset):
    """Number of leading key blocks holding a key visible to some query of ``q_block``."""
    last = q_offset - k_offset + (q_block + 1) * block_q - 1  # last visible local key index
    return jnp.where(last >= 0, floordiv_clamped(last, block_k) + 1, 0)


def _blocks_through(last, block: int):
    """Number of blocks ``[0, last // block]`` (0 when ``last < 0``)."""
    return jnp.where(last >= 0, floordiv_clamped(last, block) + 1, 0)


def _tables(refs, has_q_len: bool, has_kv_valid: bool):
    """Splits a kernel's refs into ``(q_offset, k_offset, kv_len, q_len or None,
    kv_valid_ref or None, rest)``; the optional tables are passed only when given."""
    offs_ref, kvlen_ref, *refs = refs
    q_len = refs.pop(0)[0] if has_q_len else None
    kv_valid_ref = refs.pop(0) if has_kv_valid else None
    return offs_ref[0], offs_ref[1], kvlen_ref[0], q_len, kv_valid_ref, refs


def _masked_between(lo, a, b, hi):
    """Tile segments: ``[lo, a)`` masked, ``[a, b)`` unmasked, ``[b, hi)`` masked."""
    return [(a - lo, lambda s: lo + s, True), (b - a, lambda s: a + s, False),
            (hi - b, lambda s: b + s, True)]


def _key_segments(i, q_offset, k_offset, kv_len, q_len, *, is_causal, window, per_key,
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


def _fwd_kernel(*refs, scale, is_causal, window, has_q_len, has_kv_valid, block_q, block_k):
    q_offset, k_offset, kv_len, q_len, kv_valid_ref, refs = _tables(refs, has_q_len,
                                                                    has_kv_valid)
    q_ref, k_ref, v_ref, o_ref, lse_ref = refs
    i = pl.program_id(0)
    q_pos, segments = _key_segments(i, q_offset, k_offset, kv_len, q_len, is_causal=is_causal,
                                    window=window, per_key=has_kv_valid, block_q=block_q,
                                    block_k=block_k)
    out, lse = online_softmax(
        q_ref[...], q_pos, k_ref, v_ref, segments=segments, kv_len=kv_len, k_offset=k_offset,
        scale=scale, is_causal=is_causal, block_k=block_k, window=window,
        kv_valid_ref=kv_valid_ref,
    )
    if q_len is not None:  # rows past q_len: out 0, lse -inf (the backward then skips them)
        row_ok = i * block_q + arange_i32(block_q) < q_len
        out = jnp.where(row_ok[:, None], out, 0.0)
        lse = jnp.where(row_ok, lse, float("-inf"))
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse


def _dq_kernel(*refs, scale, is_causal, window, has_q_len, has_kv_valid, block_q, block_k):
    q_offset, k_offset, kv_len, q_len, kv_valid_ref, refs = _tables(refs, has_q_len,
                                                                    has_kv_valid)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref = refs
    q_pos, segments = _key_segments(pl.program_id(0), q_offset, k_offset, kv_len, q_len,
                                    is_causal=is_causal, window=window, per_key=has_kv_valid,
                                    block_q=block_q, block_k=block_k)
    # rows past q_len: lse = +inf (backward_rows), so p = 0 and dq = 0 there
    dq = dq_loop(
        q_ref[...], do_ref[...], lse_ref[...], delta_ref[...], q_pos, k_ref, v_ref,
        segments=segments, kv_len=kv_len, k_offset=k_offset, scale=scale, is_causal=is_causal,
        block_k=block_k, window=window, kv_valid_ref=kv_valid_ref,
    )
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _query_segments(j, q_offset, k_offset, kv_len, q_len, *, is_causal, window, per_key,
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


def _dkdv_kernel(*refs, scale, is_causal, window, has_q_len, has_kv_valid, block_q, block_k,
                 num_q_blocks, groups):
    q_offset, k_offset, kv_len, q_len, kv_valid_ref, refs = _tables(refs, has_q_len,
                                                                    has_kv_valid)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref = refs
    j = pl.program_id(0)
    k_idx = j * block_k + arange_i32(block_k)
    k_valid = None if kv_valid_ref is None else kv_valid_ref[...] != 0
    valid = k_idx < kv_len if k_valid is None else (k_idx < kv_len) & k_valid
    k = jnp.where(valid[:, None], k_ref[...], jnp.zeros((), k_ref.dtype))
    v = jnp.where(valid[:, None], v_ref[...], jnp.zeros((), v_ref.dtype))
    segments = _query_segments(j, q_offset, k_offset, kv_len, q_len, is_causal=is_causal,
                               window=window, per_key=has_kv_valid, block_q=block_q,
                               block_k=block_k, num_q_blocks=num_q_blocks)

    def per_group(g, carry):
        return dkdv_loop(
            carry, g, k, v, k_idx, kv_len, q_ref, do_ref, lse_ref, delta_ref,
            segments=segments, q_offset=q_offset, k_offset=k_offset, scale=scale,
            is_causal=is_causal, block_q=block_q, window=window, k_valid=k_valid,
        )

    dp = k_ref.shape[-1]
    init = (jnp.zeros((block_k, dp), _F32), jnp.zeros((block_k, dp), _F32))
    dk, dv = for_each_group(groups, per_group, init)
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# --------------------------------------------------------------------------------------------
# pallas_call wrappers
# --------------------------------------------------------------------------------------------


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _tiles(config: KernelConfig, len_q: int, len_k: int):
    fwd = (tile(config.block_q, len_q), tile(config.block_k, len_k))
    dkv = tuple(tile(b, n) for b, n in zip(config.dkv_blocks, (len_q, len_k), strict=True))
    dq = tuple(tile(b, n) for b, n in zip(config.dq_blocks, (len_q, len_k), strict=True))
    lq_pad = _round_up(len_q, max(fwd[0], dkv[0], dq[0]))
    lk_pad = _round_up(len_k, max(fwd[1], dkv[1], dq[1]))
    return fwd, dkv, dq, lq_pad, lk_pad


def _kv_of(h, groups: int):
    return lax.div(h, jnp.int32(groups))


def _group_of(h, groups: int):
    return lax.rem(h, jnp.int32(groups))


def flash_forward(q, k, v, *, kv_len, offsets, scale: float, is_causal: bool,
                  config: KernelConfig, interpret: bool = False, debug: bool = False,
                  window=None, q_len=None, kv_valid=None):
    """Forward kernel: ``out (B, Lq, Hk, G, d)`` in ``q.dtype`` and ``lse (B, Lq, Hk, G)``.

    ``kv_len``: int32 ``(B, Hk)`` in ``[0, Lk]``; ``offsets``: int32 ``(2,)``, the global
    positions ``(q_offset, k_offset)`` of index 0. Optional: ``window`` (static int or
    ``(left, right)``, see :func:`band`), ``q_len`` int32 ``(B, Hk)`` in ``[0, Lq]`` and
    ``kv_valid`` bool ``(B, Hk, Lk)``."""
    B, Lq, Hk, G, d = q.shape
    Lk = k.shape[1]
    dp = padded_head_dim(d)
    (bq, bk), _, _, lq_pad, lk_pad = _tiles(config, Lq, Lk)
    qp = pad_to(gpu_only(q, interpret), {1: lq_pad, 4: dp})
    kp = pad_to(k, {1: lk_pad, 3: dp})
    vp = pad_to(v, {1: lk_pad, 3: dp})
    q_spec = pl.BlockSpec(
        (None, bq, None, None, dp),
        lambda i, b, h: (b, i, _kv_of(h, G), _group_of(h, G), 0),
    )
    kv_spec = pl.BlockSpec((None, lk_pad, None, dp), lambda i, b, h: (b, 0, _kv_of(h, G), 0))
    len_spec = pl.BlockSpec((None, 1), lambda i, b, h: (b, _kv_of(h, G)))
    extra, extra_specs, flags = mask_tables(
        q_len, kv_valid, lk_pad, len_spec,
        pl.BlockSpec((None, None, lk_pad), lambda i, b, h: (b, _kv_of(h, G), 0)))
    out, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, scale=scale, is_causal=is_causal, window=band(window),
                          block_q=bq, block_k=bk, **flags),
        grid=(lq_pad // bq, B, Hk * G),
        in_specs=[
            pl.BlockSpec((2,), lambda i, b, h: (0,)), len_spec, *extra_specs,
            q_spec, kv_spec, kv_spec,
        ],
        out_specs=[q_spec, pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))],
        out_shape=[
            jax.ShapeDtypeStruct(qp.shape, q.dtype),
            jax.ShapeDtypeStruct((B, Hk * G, lq_pad), _F32),
        ],
        compiler_params=triton_compiler_params(config, dp, interpret),
        interpret=interpret,
        debug=debug,
        name="dilax_flash_fwd",
    )(offsets, kv_len, *extra, qp, kp, vp)
    out = out[:, :Lq, :, :, :d]
    lse = lse.reshape(B, Hk, G, lq_pad)[..., :Lq].transpose(0, 3, 1, 2)
    return out, lse


def flash_backward(q, k, v, *, kv_len, offsets, lse, dout, delta, scale: float,
                   is_causal: bool, config: KernelConfig, interpret: bool = False,
                   debug: bool = False, window=None, q_len=None, kv_valid=None):
    """Backward kernels: ``(dq, dk, dv)`` in the input dtypes, recomputed from ``lse``.

    ``lse, dout`` as :func:`flash_forward` returned them and their cotangent;
    ``delta = output_delta(out, dout, dlse)`` ``(B, Lq, Hk, G)``. Other arguments as in
    :func:`flash_forward`; rows at or past ``q_len`` get zero gradient whatever ``lse``."""
    B, Lq, Hk, G, d = q.shape
    Lk = k.shape[1]
    dp = padded_head_dim(d)
    _, (bq_kv, bk_kv), (bq_q, bk_q), lq_pad, lk_pad = _tiles(config, Lq, Lk)
    lse_rows, delta_rows = backward_rows(lse, delta, lq_pad, q_len)
    qp = pad_to(gpu_only(q, interpret), {1: lq_pad, 4: dp})
    dop = pad_to(dout.astype(q.dtype), {1: lq_pad, 4: dp})
    kp = pad_to(k, {1: lk_pad, 3: dp})
    vp = pad_to(v, {1: lk_pad, 3: dp})
    params = triton_compiler_params(config, dp, interpret)
    offs_spec = pl.BlockSpec((2,), lambda *_: (0,))
    masks = dict(is_causal=is_causal, window=band(window))

    # dq: one program per (query block, batch, query head), loop over key blocks.
    q_spec = pl.BlockSpec(
        (None, bq_q, None, None, dp),
        lambda i, b, h: (b, i, _kv_of(h, G), _group_of(h, G), 0),
    )
    row_spec = pl.BlockSpec(
        (None, None, None, bq_q), lambda i, b, h: (b, _kv_of(h, G), _group_of(h, G), i)
    )
    kv_full = pl.BlockSpec((None, lk_pad, None, dp), lambda i, b, h: (b, 0, _kv_of(h, G), 0))
    len_spec = pl.BlockSpec((None, 1), lambda i, b, h: (b, _kv_of(h, G)))
    extra, extra_specs, flags = mask_tables(
        q_len, kv_valid, lk_pad, len_spec,
        pl.BlockSpec((None, None, lk_pad), lambda i, b, h: (b, _kv_of(h, G), 0)))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, block_q=bq_q, block_k=bk_q, **masks,
                          **flags),
        grid=(lq_pad // bq_q, B, Hk * G),
        in_specs=[
            offs_spec, len_spec, *extra_specs,
            q_spec, kv_full, kv_full, q_spec, row_spec, row_spec,
        ],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(qp.shape, q.dtype),
        compiler_params=params,
        interpret=interpret,
        debug=debug,
        name="dilax_flash_dq",
    )(offsets, kv_len, *extra, qp, kp, vp, dop, lse_rows, delta_rows)

    # dk, dv: one program per (key block, batch, kv head), loop over its G heads and q blocks.
    len_spec = pl.BlockSpec((None, 1), lambda j, b, c: (b, c))
    extra, extra_specs, flags = mask_tables(
        q_len, kv_valid, lk_pad, len_spec,
        pl.BlockSpec((None, None, bk_kv), lambda j, b, c: (b, c, j)))
    dk, dv = dkdv_call(
        functools.partial(_dkdv_kernel, scale=scale, block_q=bq_kv, block_k=bk_kv,
                          num_q_blocks=lq_pad // bq_kv, groups=G, **masks, **flags),
        grid=(lk_pad // bk_kv, B, Hk),
        table_specs=[offs_spec, len_spec, *extra_specs],
        len_pad=lq_pad, groups=G, dp=dp, block_k=bk_kv, kv_shape=kp.shape, k_dtype=k.dtype,
        v_dtype=v.dtype, compiler_params=params, interpret=interpret, debug=debug,
        name="dilax_flash_dkdv",
    )(offsets, kv_len, *extra, qp, kp, vp, dop, lse_rows, delta_rows)
    return dq[:, :Lq, ..., :d], dk[:, :Lk, :, :d], dv[:, :Lk, :, :d]


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11, 12))
def _flash(q, k, v, kv_len, offsets, q_len, kv_valid, scale, is_causal, window, config,
           interpret, debug):
    return flash_forward(q, k, v, kv_len=kv_len, offsets=offsets, scale=scale,
                         is_causal=is_causal, config=config, interpret=interpret, debug=debug,
                         window=window, q_len=q_len, kv_valid=kv_valid)


def _flash_fwd(q, k, v, kv_len, offsets, q_len, kv_valid, scale, is_causal, window, config,
               interpret, debug):
    out, lse = _flash(q, k, v, kv_len, offsets, q_len, kv_valid, scale, is_causal, window,
                      config, interpret, debug)
    return (out, lse), (q, k, v, kv_len, offsets, q_len, kv_valid, out, lse)


def _flash_bwd(scale, is_causal, window, config, interpret, debug, res, cotangents):
    q, k, v, kv_len, offsets, q_len, kv_valid, out, lse = res
    dout, dlse = cotangents
    dq, dk, dv = flash_backward(q, k, v, kv_len=kv_len, offsets=offsets, lse=lse, dout=dout,
                                delta=output_delta(out, dout, dlse), scale=scale,
                                is_causal=is_causal, config=config, interpret=interpret,
                                debug=debug, window=window, q_len=q_len, kv_valid=kv_valid)
    return dq, dk, dv, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def resolve_config(config: KernelConfig | None, len_q: int, len_k: int, head_dim: int,
                   dtype, *, masked: bool = False) -> KernelConfig:
    """``None`` -> :func:`default_config` (``masked``: for the band / per-key / query-length
    masks); a :class:`KernelConfig` as is."""
    if config is None:
        return default_config(len_q, len_k, head_dim, dtype, masked=masked)
    if isinstance(config, KernelConfig):
        return config
    raise TypeError(
        f"block_sizes must be a pallas_kernels.KernelConfig or None, got {type(config).__name__}"
    )


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: float,
    is_causal: bool = False,
    kv_len: jax.Array | None = None,
    q_offset: jax.Array | int = 0,
    k_offset: jax.Array | int = 0,
    block_sizes: KernelConfig | None = None,
    interpret: bool = False,
    debug: bool = False,
    window: int | tuple[int, int] | None = None,
    q_len: jax.Array | None = None,
    kv_valid: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Pallas flash attention returning ``(out, lse)`` (reference:
    :func:`flash_attention_reference`).

    Args:
      q: ``(B, Lq, Hk, G, d)`` queries grouped by kv head (query head ``(c, g)`` reads kv
        head ``c``).
      k, v: ``(B, Lk, Hk, d)``.
      scale: logit scale (static float).
      is_causal: key ``t`` is visible to query ``p`` iff ``k_offset + t <= q_offset + p``;
        key blocks entirely in the future are not visited.
      kv_len: int ``(B, Hk)`` (broadcastable); keys at index ``>= kv_len`` are masked.
      q_offset, k_offset: global positions of index 0 (int scalars, may be traced).
      block_sizes: :class:`KernelConfig` (tiles, warps, stages) or ``None`` for
        :func:`pallas_kernels.config.default_config`.
      interpret: run the kernels with the Pallas interpreter (any backend, e.g. CPU tests):
        ``True``, or ``jax.experimental.pallas.tpu.InterpretParams(...)`` for the strict
        interpreter (out-of-bounds reads raise, uninitialized memory is NaN).
      debug: print the kernels' jaxprs (``pallas_call(debug=True)``).
      window: static band: an int ``W`` (``|(k_offset + t) - (q_offset + p)| <= W``) or a
        ``(left, right)`` pair (``-left <= (k_offset + t) - (q_offset + p) <= right``); only
        the key tiles that meet it are visited (``O(Lq * W)`` work), forward and backward.
      q_len: int ``(B, Hk)`` (broadcastable): query rows at index ``>= q_len`` get
        ``out = 0``, ``lse = -inf`` and zero gradient; query tiles wholly past it are skipped.
      kv_valid: bool ``(B, Hk, Lk)`` (broadcastable): an arbitrary per-key validity,
        combined with ``kv_len`` (pass ``kv_len`` too, so that trailing invalid tiles are
        skipped).

    Returns:
      ``out: (B, Lq, Hk, G, d)`` in ``q.dtype`` and ``lse: (B, Lq, Hk, G)`` float32; rows with
      no visible key get ``out = 0``, ``lse = -inf``. Differentiable in ``q, k, v`` (custom
      VJP; the cotangent of ``lse`` is honoured).
    """
    check_grouped_qkv(q, k, v)
    B, Lq, Hk, G, d = q.shape
    Lk = k.shape[1]
    config = resolve_config(block_sizes, Lq, Lk, d, q.dtype,
                            masked=window is not None or q_len is not None or kv_valid is not None)
    if kv_len is None:
        kv_len = jnp.full((B, Hk), Lk, jnp.int32)
    kv_len = jnp.clip(jnp.broadcast_to(jnp.asarray(kv_len, jnp.int32), (B, Hk)), 0, Lk)
    offsets = jnp.stack([jnp.asarray(q_offset, jnp.int32), jnp.asarray(k_offset, jnp.int32)])
    if q_len is not None:
        q_len = jnp.clip(jnp.broadcast_to(jnp.asarray(q_len, jnp.int32), (B, Hk)), 0, Lq)
    if kv_valid is not None:
        kv_valid = jnp.broadcast_to(jnp.asarray(kv_valid, bool), (B, Hk, Lk))
    return _flash(q, k, v, kv_len, offsets, q_len, kv_valid, float(scale), bool(is_causal),
                  band(window), config, interpret or False, bool(debug))


flash_attention_reference = attention_reference
