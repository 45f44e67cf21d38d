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
    cdiv_nonneg,
    check_grouped_qkv,
    dkdv_call,
    dkdv_loop,
    dq_loop,
    floordiv_clamped,
    for_each_group,
    gpu_only,
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


def _key_segments(offs_ref, kvlen_ref, is_causal, block_q, block_k):
    """A query-block program's positions, its key-tile segments (unmasked tiles first, then
    the tiles that straddle ``kv_len`` or the causal diagonal), ``kv_len`` and ``k_offset``."""
    i = pl.program_id(0)
    q_offset, k_offset, kv_len = offs_ref[0], offs_ref[1], kvlen_ref[0]
    q_pos = q_offset + i * block_q + arange_i32(block_q)
    hi = cdiv_nonneg(kv_len, block_k)
    full = lax.div(kv_len, jnp.int32(block_k))  # tiles entirely below kv_len
    if is_causal:
        hi = jnp.minimum(hi, _causal_key_blocks(i, block_q, block_k, q_offset, k_offset))
        # tiles whose last key is visible to the tile's first query
        first_q = q_offset - k_offset + i * block_q
        full = jnp.minimum(full, floordiv_clamped(first_q + 1, block_k))
    full = jnp.minimum(full, hi)
    segments = [(full, lambda s: s, False), (hi - full, lambda s: full + s, True)]
    return q_pos, segments, kv_len, k_offset


def _fwd_kernel(offs_ref, kvlen_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale, is_causal,
                block_q, block_k):
    q_pos, segments, kv_len, k_offset = _key_segments(offs_ref, kvlen_ref, is_causal, block_q,
                                                      block_k)
    out, lse = online_softmax(
        q_ref[...], q_pos, k_ref, v_ref, segments=segments, kv_len=kv_len, k_offset=k_offset,
        scale=scale, is_causal=is_causal, block_k=block_k,
    )
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse


def _dq_kernel(offs_ref, kvlen_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *,
               scale, is_causal, block_q, block_k):
    q_pos, segments, kv_len, k_offset = _key_segments(offs_ref, kvlen_ref, is_causal, block_q,
                                                      block_k)
    dq = dq_loop(
        q_ref[...], do_ref[...], lse_ref[...], delta_ref[...], q_pos, k_ref, v_ref,
        segments=segments, kv_len=kv_len, k_offset=k_offset, scale=scale, is_causal=is_causal,
        block_k=block_k,
    )
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkdv_kernel(offs_ref, kvlen_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref,
                 dv_ref, *, scale, is_causal, block_q, block_k, num_q_blocks, groups):
    j = pl.program_id(0)
    q_offset, k_offset, kv_len = offs_ref[0], offs_ref[1], kvlen_ref[0]
    k_idx = j * block_k + arange_i32(block_k)
    valid = (k_idx < kv_len)[:, None]
    k = jnp.where(valid, k_ref[...], jnp.zeros((), k_ref.dtype))
    v = jnp.where(valid, v_ref[...], jnp.zeros((), v_ref.dtype))
    lo = jnp.int32(0)
    if is_causal:  # first query that can see key j * block_k
        first = k_offset - q_offset + j * block_k
        lo = jnp.minimum(floordiv_clamped(first, block_q), num_q_blocks)
    hi = jnp.where(j * block_k < kv_len, num_q_blocks, lo)
    # Query tiles [lo, mid) need the element mask (the causal diagonal), [mid, hi) do not;
    # a key tile that straddles kv_len needs it everywhere.
    mid = lo
    if is_causal:  # first query tile whose first query sees the tile's last key
        last_key = k_offset - q_offset + j * block_k + block_k - 1
        mid = jnp.clip(cdiv_nonneg(jnp.maximum(last_key, 0), block_q), lo, hi)
    mid = jnp.where((j + 1) * block_k <= kv_len, mid, hi)

    def per_group(g, carry):
        return dkdv_loop(
            carry, g, k, v, k_idx, kv_len, q_ref, do_ref, lse_ref, delta_ref,
            segments=[(mid - lo, lambda s: lo + s, True), (hi - mid, lambda s: mid + s, False)],
            q_offset=q_offset, k_offset=k_offset, scale=scale, is_causal=is_causal,
            block_q=block_q,
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
                  config: KernelConfig, interpret: bool = False, debug: bool = False):
    """Forward kernel: ``out (B, Lq, Hk, G, d)`` in ``q.dtype`` and ``lse (B, Lq, Hk, G)``.

    ``kv_len``: int32 ``(B, Hk)`` in ``[0, Lk]``; ``offsets``: int32 ``(2,)``, the global
    positions ``(q_offset, k_offset)`` of index 0."""
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
    out, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, scale=scale, is_causal=is_causal, block_q=bq,
                          block_k=bk),
        grid=(lq_pad // bq, B, Hk * G),
        in_specs=[
            pl.BlockSpec((2,), lambda i, b, h: (0,)),
            pl.BlockSpec((None, 1), lambda i, b, h: (b, _kv_of(h, G))),
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
    )(offsets, kv_len, qp, kp, vp)
    out = out[:, :Lq, :, :, :d]
    lse = lse.reshape(B, Hk, G, lq_pad)[..., :Lq].transpose(0, 3, 1, 2)
    return out, lse


def flash_backward(q, k, v, *, kv_len, offsets, lse, dout, delta, scale: float,
                   is_causal: bool, config: KernelConfig, interpret: bool = False,
                   debug: bool = False):
    """Backward kernels: ``(dq, dk, dv)`` in the input dtypes, recomputed from ``lse``.

    ``lse, dout`` as :func:`flash_forward` returned them and their cotangent;
    ``delta = output_delta(out, dout, dlse)`` ``(B, Lq, Hk, G)``. Other arguments as in
    :func:`flash_forward`."""
    B, Lq, Hk, G, d = q.shape
    Lk = k.shape[1]
    dp = padded_head_dim(d)
    _, (bq_kv, bk_kv), (bq_q, bk_q), lq_pad, lk_pad = _tiles(config, Lq, Lk)
    lse_rows, delta_rows = backward_rows(lse, delta, lq_pad)
    qp = pad_to(gpu_only(q, interpret), {1: lq_pad, 4: dp})
    dop = pad_to(dout.astype(q.dtype), {1: lq_pad, 4: dp})
    kp = pad_to(k, {1: lk_pad, 3: dp})
    vp = pad_to(v, {1: lk_pad, 3: dp})
    params = triton_compiler_params(config, dp, interpret)
    offs_spec = pl.BlockSpec((2,), lambda *_: (0,))

    # dq: one program per (query block, batch, query head), loop over key blocks.
    q_spec = pl.BlockSpec(
        (None, bq_q, None, None, dp),
        lambda i, b, h: (b, i, _kv_of(h, G), _group_of(h, G), 0),
    )
    row_spec = pl.BlockSpec(
        (None, None, None, bq_q), lambda i, b, h: (b, _kv_of(h, G), _group_of(h, G), i)
    )
    kv_full = pl.BlockSpec((None, lk_pad, None, dp), lambda i, b, h: (b, 0, _kv_of(h, G), 0))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, is_causal=is_causal, block_q=bq_q,
                          block_k=bk_q),
        grid=(lq_pad // bq_q, B, Hk * G),
        in_specs=[
            offs_spec,
            pl.BlockSpec((None, 1), lambda i, b, h: (b, _kv_of(h, G))),
            q_spec, kv_full, kv_full, q_spec, row_spec, row_spec,
        ],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(qp.shape, q.dtype),
        compiler_params=params,
        interpret=interpret,
        debug=debug,
        name="dilax_flash_dq",
    )(offsets, kv_len, qp, kp, vp, dop, lse_rows, delta_rows)

    # dk, dv: one program per (key block, batch, kv head), loop over its G heads and q blocks.
    dk, dv = dkdv_call(
        functools.partial(_dkdv_kernel, scale=scale, is_causal=is_causal, block_q=bq_kv,
                          block_k=bk_kv, num_q_blocks=lq_pad // bq_kv, groups=G),
        grid=(lk_pad // bk_kv, B, Hk),
        table_specs=[offs_spec, pl.BlockSpec((None, 1), lambda j, b, c: (b, c))],
        len_pad=lq_pad, groups=G, dp=dp, block_k=bk_kv, kv_shape=kp.shape, k_dtype=k.dtype,
        v_dtype=v.dtype, compiler_params=params, interpret=interpret, debug=debug,
        name="dilax_flash_dkdv",
    )(offsets, kv_len, qp, kp, vp, dop, lse_rows, delta_rows)
    return dq[:, :Lq, ..., :d], dk[:, :Lk, :, :d], dv[:, :Lk, :, :d]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _flash(q, k, v, kv_len, offsets, scale, is_causal, config, interpret, debug):
    return flash_forward(q, k, v, kv_len=kv_len, offsets=offsets, scale=scale,
                         is_causal=is_causal, config=config, interpret=interpret, debug=debug)


def _flash_fwd(q, k, v, kv_len, offsets, scale, is_causal, config, interpret, debug):
    out, lse = _flash(q, k, v, kv_len, offsets, scale, is_causal, config, interpret, debug)
    return (out, lse), (q, k, v, kv_len, offsets, out, lse)


def _flash_bwd(scale, is_causal, config, interpret, debug, res, cotangents):
    q, k, v, kv_len, offsets, out, lse = res
    dout, dlse = cotangents
    dq, dk, dv = flash_backward(q, k, v, kv_len=kv_len, offsets=offsets, lse=lse, dout=dout,
                                delta=output_delta(out, dout, dlse), scale=scale,
                                is_causal=is_causal, config=config, interpret=interpret,
                                debug=debug)
    return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def resolve_config(config: KernelConfig | None, len_q: int, len_k: int, head_dim: int,
                   dtype) -> KernelConfig:
    """``None`` -> :func:`default_config`; a :class:`KernelConfig` as is."""
    if config is None:
        return default_config(len_q, len_k, head_dim, dtype)
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

    Returns:
      ``out: (B, Lq, Hk, G, d)`` in ``q.dtype`` and ``lse: (B, Lq, Hk, G)`` float32; rows with
      no visible key get ``out = 0``, ``lse = -inf``. Differentiable in ``q, k, v`` (custom
      VJP; the cotangent of ``lse`` is honoured).
    """
    check_grouped_qkv(q, k, v)
    B, Lq, Hk, G, d = q.shape
    Lk = k.shape[1]
    config = resolve_config(block_sizes, Lq, Lk, d, q.dtype)
    if kv_len is None:
        kv_len = jnp.full((B, Hk), Lk, jnp.int32)
    kv_len = jnp.clip(jnp.broadcast_to(jnp.asarray(kv_len, jnp.int32), (B, Hk)), 0, Lk)
    offsets = jnp.stack([jnp.asarray(q_offset, jnp.int32), jnp.asarray(k_offset, jnp.int32)])
    return _flash(q, k, v, kv_len, offsets, float(scale), bool(is_causal), config,
                  interpret or False, bool(debug))


flash_attention_reference = attention_reference
