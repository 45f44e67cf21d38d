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
    WHOLE,
    arange_i32,
    backward_rows,
    band,
    check_grouped_qkv,
    dkdv_call,
    dkdv_loop,
    dq_loop,
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
from pallas_kernels.mods import BoundMods, KernelMods, operand
from pallas_kernels.reference import attention_reference
from pallas_kernels.segments import key_segments, query_segments, table_segments

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


def _tables(refs, has_q_len: bool, has_kv_valid: bool, mods: KernelMods | None = None,
            head=None, blocks=None):
    """Splits a kernel's refs into ``(q_offset, k_offset, kv_len, q_len or None,
    kv_valid_ref or None, bound mods or None, block table refs or None, rest)``, the optional
    operands passed only when given: ``mods`` bound to this program's batch row and query
    ``head`` (default: program id 2), then (``blocks``) a block mask's 4 tables."""
    offs_ref, kvlen_ref, *refs = refs
    q_len = refs.pop(0)[0] if has_q_len else None
    kv_valid_ref = refs.pop(0) if has_kv_valid else None
    out = (offs_ref[0], offs_ref[1], kvlen_ref[0], q_len, kv_valid_ref)
    if mods is None:
        return (*out, None, None, refs)
    n = len(mods.score_avals) + len(mods.mask_avals)
    head = pl.program_id(2) if head is None else head
    bound = BoundMods(mods, tuple(refs[:n]), pl.program_id(1), head)
    if blocks is None:
        return (*out, bound, None, refs[n:])
    return (*out, bound, refs[n:n + 4], refs[n + 4:])


def _every_tile_masked(has_kv_valid, mods):
    return has_kv_valid or (mods is not None and mods.mask is not None)


def _fwd_kernel(*refs, scale, is_causal, window, has_q_len, has_kv_valid, block_q, block_k,
                mods=None, blocks=None):
    q_offset, k_offset, kv_len, q_len, kv_valid_ref, bound, table_refs, refs = _tables(
        refs, has_q_len, has_kv_valid, mods, blocks=blocks)
    q_ref, k_ref, v_ref, o_ref, lse_ref = refs
    i = pl.program_id(0)
    q_pos, segments = key_segments(i, q_offset, k_offset, kv_len, q_len, is_causal=is_causal,
                                   window=window, per_key=_every_tile_masked(has_kv_valid, mods),
                                   block_q=block_q, block_k=block_k)
    if blocks is not None:  # a block mask's key blocks instead (every tile masked)
        segments = table_segments(table_refs, i, blocks, WHOLE)
    out, lse = online_softmax(
        q_ref[...], q_pos, k_ref, v_ref, segments=segments, kv_len=kv_len, k_offset=k_offset,
        scale=scale, is_causal=is_causal, block_k=block_k, window=window,
        kv_valid_ref=kv_valid_ref, **({} if bound is None else dict(mods=bound)),
    )
    if q_len is not None:  # rows past q_len: out 0, lse -inf (the backward then skips them)
        row_ok = i * block_q + arange_i32(block_q) < q_len
        out = jnp.where(row_ok[:, None], out, 0.0)
        lse = jnp.where(row_ok, lse, float("-inf"))
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse


def _dq_kernel(*refs, scale, is_causal, window, has_q_len, has_kv_valid, block_q, block_k,
               mods=None, blocks=None):
    q_offset, k_offset, kv_len, q_len, kv_valid_ref, bound, table_refs, refs = _tables(
        refs, has_q_len, has_kv_valid, mods, blocks=blocks)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *dc_ref = refs
    q_pos, segments = key_segments(pl.program_id(0), q_offset, k_offset, kv_len, q_len,
                                   is_causal=is_causal, window=window,
                                   per_key=_every_tile_masked(has_kv_valid, mods),
                                   block_q=block_q, block_k=block_k)
    if blocks is not None:
        segments = table_segments(table_refs, pl.program_id(0), blocks, WHOLE)
    # rows past q_len: lse = +inf (backward_rows), so p = 0 and dq = 0 there
    dq = dq_loop(
        q_ref[...], do_ref[...], lse_ref[...], delta_ref[...], q_pos, k_ref, v_ref,
        segments=segments, kv_len=kv_len, k_offset=k_offset, scale=scale, is_causal=is_causal,
        block_k=block_k, window=window, kv_valid_ref=kv_valid_ref,
        **({} if bound is None else dict(mods=bound)),
    )
    if dc_ref:  # this program's partial gradient of the score mod's float consts
        dq, dc_ref[0][...] = dq
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkdv_kernel(*refs, scale, is_causal, window, has_q_len, has_kv_valid, block_q, block_k,
                 num_q_blocks, groups, mods=None, blocks=None):
    q_offset, k_offset, kv_len, q_len, kv_valid_ref, bound, table_refs, refs = _tables(
        refs, has_q_len, has_kv_valid, mods, head=pl.program_id(2) * groups, blocks=blocks)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref = refs
    j = pl.program_id(0)
    k_idx = j * block_k + arange_i32(block_k)
    k_valid = None if kv_valid_ref is None else kv_valid_ref[...] != 0
    valid = k_idx < kv_len if k_valid is None else (k_idx < kv_len) & k_valid
    k = jnp.where(valid[:, None], k_ref[...], jnp.zeros((), k_ref.dtype))
    v = jnp.where(valid[:, None], v_ref[...], jnp.zeros((), v_ref.dtype))
    segments = query_segments(j, q_offset, k_offset, kv_len, q_len, is_causal=is_causal,
                              window=window, per_key=_every_tile_masked(has_kv_valid, mods),
                              block_q=block_q, block_k=block_k, num_q_blocks=num_q_blocks)
    if blocks is not None:  # a block mask's query blocks of this key block
        segments = table_segments(table_refs, j, blocks, WHOLE)

    def per_group(g, carry):
        return dkdv_loop(
            carry, g, k, v, k_idx, kv_len, q_ref, do_ref, lse_ref, delta_ref,
            segments=segments, q_offset=q_offset, k_offset=k_offset, scale=scale,
            is_causal=is_causal, block_q=block_q, window=window, k_valid=k_valid,
            **({} if bound is None else dict(mods=bound.at_head(bound.h + g))),
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
                  window=None, q_len=None, kv_valid=None, mods=None, block_tables=None):
    """Forward kernel: ``out (B, Lq, Hk, G, d)`` in ``q.dtype`` and ``lse (B, Lq, Hk, G)``.

    ``kv_len``: int32 ``(B, Hk)`` in ``[0, Lk]``; ``offsets``: int32 ``(2,)``, the global
    positions ``(q_offset, k_offset)`` of index 0. Optional: ``window`` (static int or
    ``(left, right)``, see :func:`band`), ``q_len`` int32 ``(B, Hk)`` in ``[0, Lq]``,
    ``kv_valid`` bool ``(B, Hk, Lk)`` and ``mods``: FlexAttention mods
    ``(KernelMods, operands)`` of :func:`pallas_kernels.mods.kernel_mods`, applied to the
    scaled logits at positions ``q_offset + row``, ``k_offset + key``, batch row ``b`` and
    query head ``c * G + g``; ``block_tables`` (with ``mods``): a block mask's
    ``(kv_blocks, q_blocks, (q_block, kv_block))`` (``dilax.flex.BlockMask``): where its
    blocks are whole tiles of a kernel, that kernel visits only their partial and full
    blocks, ``mask_mod`` on the partial ones only; else every tile, ``mask_mod`` on each."""
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
    extra, extra_specs, flags = _with_mods(mods, extra, extra_specs, flags, block_tables,
                                           (bq, bk, False), (lq_pad, lk_pad))
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
                   debug: bool = False, window=None, q_len=None, kv_valid=None, mods=None,
                   block_tables=None):
    """Backward kernels: ``(dq, dk, dv)`` in the input dtypes, recomputed from ``lse``.

    ``lse, dout`` as :func:`flash_forward` returned them and their cotangent;
    ``delta = output_delta(out, dout, dlse)`` ``(B, Lq, Hk, G)``. Other arguments as in
    :func:`flash_forward`; rows at or past ``q_len`` get zero gradient whatever ``lse``.
    With ``mods`` whose ``score_mod`` closes over float arrays, ``(dq, dk, dv, dconsts)``:
    ``dconsts`` their float32 gradients in order (the dq kernel's per-program partials,
    summed here)."""
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
    extra, extra_specs, flags = _with_mods(mods, extra, extra_specs, flags, block_tables,
                                           (bq_q, bk_q, False), (lq_pad, lk_pad))
    width = 0 if mods is None else mods[0].grad_width  # the consts' partial gradients
    nq = lq_pad // bq_q
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, block_q=bq_q, block_k=bk_q, **masks,
                          **flags),
        grid=(nq, B, Hk * G),
        in_specs=[
            offs_spec, len_spec, *extra_specs,
            q_spec, kv_full, kv_full, q_spec, row_spec, row_spec,
        ],
        out_specs=[q_spec] + ([pl.BlockSpec((None, None, None, width),
                                            lambda i, b, h: (i, b, h, 0))] if width else []),
        out_shape=[jax.ShapeDtypeStruct(qp.shape, q.dtype)] + (
            [jax.ShapeDtypeStruct((nq, B, Hk * G, width), _F32)] if width else []),
        compiler_params=params,
        interpret=interpret,
        debug=debug,
        name="dilax_flash_dq",
    )(offsets, kv_len, *extra, qp, kp, vp, dop, lse_rows, delta_rows)
    dq, *dc = dq

    # dk, dv: one program per (key block, batch, kv head), loop over its G heads and q blocks.
    len_spec = pl.BlockSpec((None, 1), lambda j, b, c: (b, c))
    extra, extra_specs, flags = mask_tables(
        q_len, kv_valid, lk_pad, len_spec,
        pl.BlockSpec((None, None, bk_kv), lambda j, b, c: (b, c, j)))
    extra, extra_specs, flags = _with_mods(mods, extra, extra_specs, flags, block_tables,
                                           (bk_kv, bq_kv, True), (lk_pad, lq_pad))
    dk, dv = dkdv_call(
        functools.partial(_dkdv_kernel, scale=scale, block_q=bq_kv, block_k=bk_kv,
                          num_q_blocks=lq_pad // bq_kv, groups=G, **masks, **flags),
        grid=(lk_pad // bk_kv, B, Hk),
        table_specs=[offs_spec, len_spec, *extra_specs],
        len_pad=lq_pad, groups=G, dp=dp, block_k=bk_kv, kv_shape=kp.shape, k_dtype=k.dtype,
        v_dtype=v.dtype, compiler_params=params, interpret=interpret, debug=debug,
        name="dilax_flash_dkdv",
    )(offsets, kv_len, *extra, qp, kp, vp, dop, lse_rows, delta_rows)
    grads = dq[:, :Lq, ..., :d], dk[:, :Lk, :, :d], dv[:, :Lk, :, :d]
    if not width:
        return grads
    total = jnp.sum(dc[0], axis=(0, 1, 2))
    return (*grads, [total[off:off + size].reshape(mods[0].score_avals[i][0])
                     for i, off, size in mods[0].grad_slots])


def _with_mods(mods, extra, extra_specs, flags, block_tables=None, tiles=None, pads=None):
    """The mods' closed-over arrays appended to a call's tables, passed whole to every
    program (``mods``: ``(KernelMods, operands)`` or None: the call as without), then a
    block mask's tables when its blocks are whole tiles of this kernel: ``block_tables``
    ``(kv_blocks, q_blocks, (q_block, kv_block))``, ``tiles`` the kernel's ``(own, loop)``
    tiles (own: the program's axis; ``pads``: both axes' padded lengths), ``q_blocks`` read
    when the program's axis is the keys' (``tiles[2]``: True)."""
    if mods is None:
        return extra, extra_specs, flags
    km, operands = mods
    operands = list(operands)
    if block_tables is not None:
        kv_blocks, q_blocks, (qb, kb) = block_tables
        own, loop, key_side = tiles
        own_b, loop_b = (kb, qb) if key_side else (qb, kb)
        table = q_blocks if key_side else kv_blocks
        n_own, n_loop = table[1].shape[1], table[0].shape[2]
        if own_b % own == 0 and loop_b % loop == 0 and n_loop * loop_b <= pads[1]:
            operands += [operand(x) for x in table]
            flags = dict(flags, blocks=(own_b // own, loop_b // loop, n_own))
    specs = [pl.BlockSpec(x.shape, functools.partial(lambda n, *_: (0,) * n, x.ndim))
             for x in operands]
    return [*extra, *operands], [*extra_specs, *specs], dict(flags, mods=km)


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
