"""The blockwise XLA attention core: online softmax forward, recomputing backward.

Never materializes a (query, key) matrix larger than one ``(block_q, block_k)`` pair per head,
forward or backward: the backward recomputes each block from the saved log-sum-exp (the
FlashAttention-2 recipe, written for XLA). Inputs are read through a
:class:`dilax.core.view.SlotView`, so dilated rows are read in place. GQA/MQA never repeats
K/V in memory: virtual query head ``(u, g)`` reads virtual kv head ``u``.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from dilax.core import mods as MD
from dilax.core import pairwise
from dilax.core import ranges as RG
from dilax.core import rows as R
from dilax.core import tiles as TL
from dilax.core.arrays import (
    cdiv,
    div_rem,
    dynamic_slice,
    dynamic_update_slice,
    mark_varying,
    varying_axes,
)
from dilax.core.block_mask import (
    block_mask,
    key_blocks,
    query_blocks,
    query_valid,
    zero_invalid_keys,
)
from dilax.core.blocks import BlockSizes
from dilax.core.mask import Mask
from dilax.core.view import SlotView, static_take

_F32 = jnp.float32


def _head_groups(num_kv: int, q_per_kv: int, heads_per_step: int | None):
    """Static ``(u0, u1)`` ranges of virtual kv heads processed together, as even as possible,
    each with at most ``heads_per_step`` query heads (at least one kv head)."""
    if heads_per_step is None:
        return ((0, num_kv),)
    per = max(1, heads_per_step // q_per_kv)
    count = cdiv(num_kv, per)
    size = cdiv(num_kv, count)
    return tuple((u, min(num_kv, u + size)) for u in range(0, num_kv, size))


def _pad_keys(k, v, kv_len, kv_valid, size, U):
    """K, V and the per-key validity padded to ``size`` keys; ``kv_len (B, U)`` made explicit
    when padding adds keys that must get no weight."""
    Lk = k.shape[1]
    if kv_len is None and size != Lk:
        kv_len = jnp.full((k.shape[0], U), Lk, jnp.int32)
    if kv_valid is not None:
        kv_valid = _pad_axis(kv_valid, 2, size)
    return _pad_axis(k, 1, size), _pad_axis(v, 1, size), kv_len, kv_valid


def _pad_axis(x, axis, size):
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def _rows_setup(rows, q, k, v, view, size_q, size_k):
    """The :class:`~dilax.core.rows.RowReader` of a row-gathered call, or None."""
    if rows is None:
        return None
    return R.RowReader(_pad_axis(rows[0], 2, size_q), _pad_axis(rows[1], 2, size_k),
                       tuple(_as_bits(x).reshape(-1, x.shape[-1]) for x in (q, k, v)),
                       (q.dtype, k.dtype, v.dtype), q.shape[1],
                       R.heads_of(view.q_index, q.shape[2], view.q_per_kv),
                       R.heads_of(view.kv_index, k.shape[2]))


def _starts(*idx):
    """Slice start indices as int32 (under ``jax_enable_x64`` a Python ``0`` would be int64,
    and ``lax.dynamic_slice`` needs one index type)."""
    return tuple(jnp.asarray(i, jnp.int32) for i in idx)


def _key_valid_block(kv_valid, b, u0, u1, k_start, block_k):
    """``kv_valid[b, u0:u1, k_start:k_start+block_k]`` (padded: ``(B, U, nk*bk)``) or None."""
    if kv_valid is None:
        return None
    return dynamic_slice(kv_valid, _starts(b, u0, k_start), (1, u1 - u0, block_k))[0]


def _scaled(qb, scale):
    """``q * scale``: in place for float32; half types are widened first so the logits match
    a float32 computation (rounding ``q * scale`` to bf16 would shift every score)."""
    if qb.dtype == _F32:
        return qb * jnp.asarray(scale, _F32)
    return qb.astype(_F32) * jnp.asarray(scale, _F32)


def _as_bits(x):
    """bf16/fp16 ``x`` as its uint16 bits (a bitcast; others as is). XLA:CPU materializes the
    bits once per core call: a uint16 copy, half the bytes of the float32 copy it replaces.

    XLA:CPU's float normalization widens every half-precision op to float32, the slices that
    the loops take of a whole input included; the widening of a loop-invariant input is then
    hoisted out of the loops: a float32 copy of the whole input, per input and per branch.
    Integers are sliced as they are, so the loops read the bits and widen one block at a time
    (:func:`_slice_rows`). Zero bits are +0.0, so the bits can be padded as they are."""
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize == 2:
        return lax.bitcast_convert_type(x, jnp.uint16)
    return x


# The backward reads half-precision inputs as bits (:func:`_as_bits`) when the float32
# copies of q, k, v and dO that XLA:CPU would hoist out of its loops exceed this many bytes.
# Below it the copies are cheap and the loops faster (same-run A/B on 2 cores, n = 16384,
# bf16: fwd+bwd 1.05-1.2x slower with bits); above it the copies decide what fits (a
# million-token step: 15.3 GiB with bits, 21.2 GiB without).
_WIDEN_LIMIT = 256 << 20


def backward_reads_bits(*sizes: int) -> bool:
    """Whether :func:`backward` reads half-precision operands of these element counts
    (q, k, v, dO) as bits: when their float32 copies would exceed ``_WIDEN_LIMIT``."""
    return 4 * sum(sizes) > _WIDEN_LIMIT


def _plain(x):
    return x


def _slice_rows(x, b, start, size, dtype=None):
    """``x[b, start:start+size]`` for ``x: (B, L, ...)``, read as ``dtype`` (``x`` may hold
    the bits of a ``dtype`` array, :func:`_as_bits`)."""
    x = dynamic_slice(x, _starts(b, start, *(0,) * (x.ndim - 2)), (1, size) + x.shape[2:])[0]
    return x if dtype is None or x.dtype == dtype else lax.bitcast_convert_type(x, dtype)


# forward and backward are ~90 lines each on purpose: their loop bodies are closures over the
# padded inputs, the view and the static tiles, and the causal/ragged loop bounds sit next to
# the body they bound; split apart, every level would pass the same dozen arguments down.
def online_softmax_step(m, l, acc, s, v):
    """One key block folded into the float32 online-softmax state of a query block (the
    step the Pallas kernels name the same, :func:`pallas_kernels.common.online_softmax_step`).

    ``m``, ``l``: running max and denominator ``(..., bq)``; ``acc``: unnormalized output
    ``(..., bq, d)``; ``s``: float32 logits ``(U, G, bq, bk)`` or ``(U, G * bq, bk)``
    (``-inf`` = masked); ``v``: values ``(U, bk, d)``. A row with no key so far keeps
    ``m = -inf`` and adds nothing (its max is taken as 0, so no ``inf - inf``)."""
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - m_safe[..., None])
    corr = jnp.exp(m - m_safe)
    l = l * corr + jnp.sum(p, axis=-1)
    pv = jnp.einsum("hgqk,hkd->hgqd" if s.ndim == 4 else "hqk,hkd->hqd", p, v.astype(_F32),
                    preferred_element_type=_F32)
    return m_new, l, acc * corr[..., None] + pv


def online_softmax_result(m, l, acc):
    """``(out, lse)`` of a finished online-softmax state: float32 ``acc / l`` and
    ``m + log l``; a row with no key gets 0 and ``lse = -inf`` (never NaN)."""
    has_key = l > 0
    out = acc / jnp.where(has_key, l, 1.0)[..., None]
    lse = jnp.where(has_key, m + jnp.log(jnp.where(has_key, l, 1.0)), -jnp.inf)
    return out, lse


def forward(q, k, v, *, view: SlotView, mask: Mask, scale: float, block_sizes: BlockSizes,
            out_dtype=None):
    """``(out, lse)`` of the queries of ``view``: ``out (B, Lq, H_out, d)`` in ``out_dtype``
    (default ``q.dtype``), ``lse (B, Lq, H_out)`` float32. ``mask`` must be resolved
    (:meth:`Mask.resolve`) and ``block_sizes`` clipped (:meth:`BlockSizes.clipped`)."""
    bounds = mask.bounds  # the rows' key intervals (dilax.core.mask.KeyBounds)
    kv_len, q_offset, k_offset, is_causal = bounds.kv_len, bounds.q_offset, bounds.k_offset, \
        bounds.is_causal
    q_len, window, kv_valid = bounds.q_len, bounds.window, mask.kv_valid
    dense = pairwise.prepare(mask, view)  # None without a bias or mask
    mods = mask.mods  # None without score/mask mods (dilax.core.mods)
    if mods is not None:
        MD.check_view(view, mods)
    block_q, block_k = block_sizes.block_q, block_sizes.block_k
    heads_per_step = block_sizes.heads_per_step
    ranged = bounds.key_range is not None
    B, Lq = q.shape[:2]
    Lk, d = k.shape[1], v.shape[-1]  # d: the values' head dim (the output's)
    U, G = len(view.kv_index), view.q_per_kv
    nq, nk = cdiv(Lq, block_q), cdiv(Lk, block_k)
    qp = _pad_axis(_as_bits(q), 1, nq * block_q)
    kp, vp, kv_len, kv_valid = _pad_keys(_as_bits(k), _as_bits(v), kv_len, kv_valid,
                                         nk * block_k, U)
    axes = varying_axes(q, k, v, kv_len, q_offset, k_offset, q_len)
    key_range = RG.pad_range(bounds.key_range, nq * block_q)
    gathered = _rows_setup(mask.rows, q, k, v, view, nq * block_q, nk * block_k)

    groups = _head_groups(U, G, heads_per_step)

    def row(idx, tile=None):
        if len(groups) == 1:
            return row_heads(idx, view, 0, U, tile)
        # One loop per head group: per-head products stay large while the tile stays small.
        parts = [row_heads(idx, view.sub_view(u0, u1), u0, u1, tile) for u0, u1 in groups]
        order = view.group_order(groups)
        return tuple(static_take(jnp.concatenate(x, axis=1), order, axis=1)
                     for x in zip(*parts))

    def row_heads(idx, view, u0, u1, tile):
        U = u1 - u0
        if tile is None:
            bi, qi = div_rem(idx, nq)
            q0 = qi * block_q
        else:  # rows q0 .. q0 + bq; only those in [start, end) are kept (dilax.core.tiles)
            bi, q0, start, end = tile
        if gathered is None:  # (U, G, bq, d)
            qb = view.select_q(_slice_rows(qp, bi, q0, block_q, q.dtype))
        else:
            qb = gathered.read_q(bi, q0, block_q, u0, u1)
        qb = _scaled(qb, scale)
        kl = None if kv_len is None else kv_len[bi, u0:u1]
        ql = None if q_len is None else q_len[bi, u0:u1]
        q_valid = query_valid(q0, block_q, ql)
        q_first = q_offset + q0
        q_pos = q_first + lax.iota(jnp.int32, block_q)
        lo, full, hi = key_blocks(q0, q_first, block_q, block_k, nk, kl, ql, k_offset,
                                  is_causal, window)
        rows, pre, base = None, None, None
        if ranged:  # only the blocks the rows' ranges meet, from their lowest key on
            rows = RG.range_rows(key_range, bi, u0, u1, q0, block_q)
            # blocks inside every row's range need no range mask (nor a causal one before
            # ``full``); not with a band, whose edges are elsewhere
            base, inner_lo, full, hi = RG.key_blocks(
                rows, hi * block_k, block_k, nk * block_k,
                None if window is not None else full * block_k if is_causal else nk * block_k,
                None if tile is None else RG.within(q0, block_q, start, end))
            pre, lo = (0, inner_lo), inner_lo

        def make_body(causal_block, with_mod=True, starts=None):
            def body(j, carry):
                m, l, acc = carry
                if starts is not None:  # a block table (dilax.core.mods.Mods.kv_blocks)
                    k0, floor = starts[j] * block_k, None  # whole blocks: nothing read twice
                elif base is None:
                    k0 = j * block_k
                else:
                    k0, floor = RG.block_start(base, j, block_k, nk * block_k)
                if gathered is None:  # (U, bk, d)
                    kb = view.select_kv(_slice_rows(kp, bi, k0, block_k, k.dtype))
                    vb = view.select_kv(_slice_rows(vp, bi, k0, block_k, v.dtype))
                else:
                    kb, vb = gathered.read_kv(bi, k0, block_k, u0, u1)
                if flat:  # (U, G * bq, bk): see ``flat`` below
                    s = jnp.einsum("hqd,hkd->hqk", qb, kb, preferred_element_type=_F32)
                else:
                    s = jnp.einsum("hgqd,hkd->hgqk", qb, kb, preferred_element_type=_F32)
                kvb = _key_valid_block(kv_valid, bi, u0, u1, k0, block_k)
                mask = block_mask(k0, block_k, kl, q_pos, k_offset, causal_block and is_causal,
                             q_valid, window if causal_block else None, kvb)
                if rows is not None and causal_block:
                    in_range = RG.range_mask(rows, k0, block_k, floor)
                    mask = in_range if mask is None else mask & in_range
                if dense is not None:  # the caller's (B, N, T, S) bias / mask, one block
                    s, mask = pairwise.apply(s, *pairwise.terms(
                        dense, bi, u0, u1, G, q0, block_q, k0, block_k), mask)
                if mods is not None:  # cap, score_mod, mask_mod on the block
                    s, mask = MD.scores(mods, s, mask, bi, u0, U, G, q_pos, k0, block_k,
                                        k_offset, with_mod)
                if mask is not None:
                    if flat:
                        mask = jnp.broadcast_to(mask, (U, G, block_q, block_k)).reshape(s.shape)
                    s = jnp.where(mask, s, -jnp.inf)
                    vb = zero_invalid_keys(vb, k0, kl, kvb)
                return online_softmax_step(m, l, acc, s, vb)

            return body

        # Ranged loops have data-dependent trip counts, and XLA:CPU then lays the
        # (U, G, bq, bk) products out so that every block pays a copy of its score tile;
        # with G folded into the rows there is no such copy (same-run A/B: ~1.2x faster).
        flat = ranged and dense is None
        rows_q = (U, G * block_q) if flat else (U, G, block_q)
        if flat:
            qb = qb.reshape(U, G * block_q, q.shape[-1])
        carry = mark_varying(
            axes,
            jnp.full(rows_q, -jnp.inf, _F32),
            jnp.zeros(rows_q, _F32),
            jnp.zeros(rows_q + (d,), _F32),
        )
        if mods is not None and mods.kv_blocks is not None:  # whole blocks, then partial
            for starts, count, with_mod in MD.table_loops(mods.kv_blocks, bi, q0 // block_q):
                carry = lax.fori_loop(0, count, make_body(True, with_mod, starts), carry)
        else:
            if pre is not None:
                carry = lax.fori_loop(*pre, make_body(True), carry)
            carry = lax.fori_loop(lo, full, make_body(False), carry)
            if is_causal or window is not None or ranged:
                carry = lax.fori_loop(full, hi, make_body(True), carry)
        m, l, acc = carry
        if flat:
            m, l, acc = m.reshape(U, G, block_q), l.reshape(U, G, block_q), \
                acc.reshape(U, G, block_q, d)
        out, lse = online_softmax_result(m, l, acc)
        return view.expand_q(out.astype(out_dtype or q.dtype)), view.expand_q(lse)

    if mask.q_tiles is not None:  # tiles of rows aligned to the key runs
        return TL.tiled(row, mask.q_tiles, nq * block_q, block_q, Lq)
    out, lse = lax.map(row, jnp.arange(B * nq, dtype=jnp.int32))
    out = out.reshape(B, nq * block_q, *out.shape[2:])[:, :Lq]
    lse = lse.reshape(B, nq * block_q, *lse.shape[2:])[:, :Lq]
    return out, lse


def backward(q, k, v, *, view: SlotView, mask: Mask, scale: float, block_sizes: BlockSizes,
             lse, dout, delta, grad_dtype=None, acc=None):
    """Gradients ``(dq, dk, dv)`` of :func:`forward` in the input layouts, in ``grad_dtype``
    (default: the input dtypes), and ``dbias`` (the bias's shape and dtype) when
    ``mask.bias`` is set. ``lse, dout, delta`` are in the output layout;
    ``delta = output_delta(out, dout, dlse)``. ``acc``: optional ``(dq, dk, dv)`` in the input
    layouts (e.g. earlier branches' gradients) that the gradients are added into, in float32,
    without buffers of their own."""
    bounds = mask.bounds  # the rows' key intervals (dilax.core.mask.KeyBounds)
    kv_len, q_offset, k_offset, is_causal = bounds.kv_len, bounds.q_offset, bounds.k_offset, \
        bounds.is_causal
    q_len, window, kv_valid = bounds.q_len, bounds.window, mask.kv_valid
    dense = pairwise.prepare(mask, view)  # None without a bias or mask
    mods = mask.mods
    block_q, block_k = block_sizes.backward
    B, Lq = q.shape[:2]
    Lk, d = k.shape[1], k.shape[-1]
    U, G = len(view.kv_index), view.q_per_kv
    nq, nk = cdiv(Lq, block_q), cdiv(Lk, block_k)
    lse_safe = jnp.where(lse == -jnp.inf, 0.0, lse)
    pad_q = functools.partial(_pad_axis, axis=1, size=nq * block_q)
    # Bits (no float32 copies of the inputs) only where the copies would be large: below
    # the limit the hoisted copies cost little memory and the loops run ~10-20 % faster.
    bits = _as_bits if backward_reads_bits(q.size, k.size, v.size, dout.size) else _plain
    qp, dop = pad_q(bits(q)), pad_q(bits(dout))
    lsep, deltap = pad_q(lse_safe), pad_q(delta)
    kp, vp, kv_len, kv_valid = _pad_keys(bits(k), bits(v), kv_len, kv_valid, nk * block_k, U)
    axes = varying_axes(q, k, v, kv_len, q_offset, k_offset, dout, delta, q_len)
    key_range = RG.pad_range(bounds.key_range, nq * block_q)
    query_range = RG.pad_range(bounds.query_range, nk * block_k)
    ranged = key_range is not None
    # exact query ranges: the query blocks inside every key's range need no mask at all
    exact = ranged and bounds.query_range_exact and not is_causal and window is None
    gathered = _rows_setup(mask.rows, q, k, v, view, nq * block_q, nk * block_k)
    out_view = view.output_view()  # reads dout, lse, delta (output layout) per block

    # float32 accumulators in the input layouts, padded to whole blocks; ``acc`` (gradients
    # of earlier branches) is added into in place, so a branch needs no gradient buffers of
    # its own. Heads/slots the view does not read receive zeros.
    if acc is None:
        acc = mark_varying(axes, *(jnp.zeros(x.shape, _F32) for x in (q, k, v)))
    dq0 = _pad_axis(acc[0].astype(_F32), 1, nq * block_q)
    dk0 = _pad_axis(acc[1].astype(_F32), 1, nk * block_k)
    dv0 = _pad_axis(acc[2].astype(_F32), 1, nk * block_k)

    def add_rows(x, b, start, block):
        at = _starts(b, start, *(0,) * (x.ndim - 2))
        cur = dynamic_slice(x, at, (1,) + block.shape)
        return dynamic_update_slice(x, cur + block[None], at)

    key_major = pairwise.key_major(mask.bias, B)

    def column(carry, idx):
        dq, dk_acc, dv_acc, *db = carry  # db: the bias gradient's carry, or []
        db, dc = db[:len(db0)], db[len(db0):]  # dc: the mods' consts' cotangents, or []
        kj, bi = div_rem(idx, B) if key_major else div_rem(idx, nk)[::-1]
        db = pairwise.column_start(db, bi)
        k0 = kj * block_k
        kl = None if kv_len is None else kv_len[bi]
        kvb = _key_valid_block(kv_valid, bi, 0, U, k0, block_k)
        if gathered is None:
            kb = view.select_kv(_slice_rows(kp, bi, k0, block_k, k.dtype))
            vb = view.select_kv(_slice_rows(vp, bi, k0, block_k, v.dtype))
        else:
            kb, vb = gathered.read_kv(bi, k0, block_k, 0, U)
        kb, vb = (zero_invalid_keys(x, k0, kl, kvb) for x in (kb, vb))
        ql = None if q_len is None else q_len[bi]
        lo, full_lo, hi = query_blocks(k0, block_q, block_k, nq, kl, ql, q_offset, k_offset,
                                       is_causal, window)
        q_base, inner = None, None
        if ranged:  # only the query rows that may attend this key block, masked unless
            # inside every key's (exact) query range
            q_rows = RG.range_rows(query_range, bi, 0, U, k0, block_k)
            q_base, inner_lo, inner_hi, hi = RG.key_blocks(
                (jnp.maximum(q_rows[0], lo * block_q), q_rows[1]), hi * block_q, block_q,
                nq * block_q, nq * block_q if exact else None)
            lo, inner = 0, (inner_lo, inner_hi) if exact else None
        hi = jnp.maximum(hi, lo)
        full_lo = hi if window is not None or ranged else jnp.minimum(full_lo, hi)

        def make_body(causal_block, with_mod=True, starts=None):
            def body(qi, carry):
                dk, dv, dq, *db = carry
                db, dc = db[:len(db0)], db[len(db0):]
                if starts is not None:  # a block table (dilax.core.mods.Mods.q_blocks)
                    q0, floor = starts[qi] * block_q, None  # whole blocks: nothing read twice
                elif q_base is None:
                    q0 = qi * block_q
                else:
                    q0, floor = RG.block_start(q_base, qi, block_q, nq * block_q)
                qb = _scaled(view.select_q(_slice_rows(qp, bi, q0, block_q, q.dtype))
                             if gathered is None else gathered.read_q(bi, q0, block_q, 0, U),
                             scale)
                dob = out_view.select_q(_slice_rows(dop, bi, q0, block_q, dout.dtype))
                lse_b = out_view.select_q(_slice_rows(lsep, bi, q0, block_q))
                del_b = out_view.select_q(_slice_rows(deltap, bi, q0, block_q))
                s = jnp.einsum("hgqd,hkd->hgqk", qb, kb, preferred_element_type=_F32)
                q_pos = q_offset + q0 + lax.iota(jnp.int32, block_q)
                mask = block_mask(k0, block_k, kl, q_pos, k_offset, causal_block and is_causal,
                             query_valid(q0, block_q, ql), window if causal_block else None, kvb)
                if ranged and causal_block:
                    in_range = RG.range_mask(RG.rows_from(
                        RG.range_rows(key_range, bi, 0, U, q0, block_q), q0, floor), k0, block_k)
                    mask = in_range if mask is None else mask & in_range
                if dense is not None:
                    s, mask = pairwise.apply(s, *pairwise.terms(
                        dense, bi, 0, U, G, q0, block_q, k0, block_k, Lq), mask)
                if mods is not None:  # recomputed modded logits; vjp: d(score)/d(raw)
                    s, mask, mod_vjp = MD.scores_vjp(mods, s, mask, bi, U, G, q_pos, k0,
                                                     block_k, k_offset, with_mod)
                if mask is not None:
                    s = jnp.where(mask, s, -jnp.inf)
                p = jnp.exp(s - lse_b[..., None])  # (U, G, bq, bk); masked -> 0
                dv = dv + jnp.einsum("hgqk,hgqd->hkd", p, dob.astype(_F32),
                                     preferred_element_type=_F32)
                dp = jnp.einsum("hgqd,hkd->hgqk", dob, vb, preferred_element_type=_F32)
                # ds stays float32: rounding it to bf16 before the sums over many query
                # heads (GQA/MQA) and branches costs ~1e-2 relative in dK.
                ds = p * (dp - del_b[..., None])
                if mods is not None:
                    ds, dc_b = mod_vjp(ds)
                    dc = [a + g for a, g in zip(dc, dc_b)]
                if db:  # d(bias) = dS, summed over the bias's broadcast dims
                    db = pairwise.add_grad(db, dense.dtype, ds, bi, 0, U, G, q0, block_q, k0,
                                           block_k)
                dk = dk + jnp.einsum("hgqk,hgqd->hkd", ds, qb.astype(_F32),
                                     preferred_element_type=_F32)
                if gathered is not None:  # added where the rows lie
                    dq_b = jnp.einsum("hgqk,hkd->hgqd", ds, kb.astype(_F32),
                                      preferred_element_type=_F32)
                    return dk, dv, gathered.add_q(dq, bi, q0, block_q, dq_b * scale), *db, *dc
                dq_b = jnp.einsum("hgqk,hkd->qhgd", ds, kb.astype(_F32),
                                  preferred_element_type=_F32)
                dq_b = view.expand_rows_q(dq_b.reshape(block_q, U * G, d) * scale)
                dq = add_rows(dq, bi, q0, dq_b)
                return dk, dv, dq, *db, *dc

            return body

        carry = mark_varying(axes, jnp.zeros((U, block_k, d), _F32),
                             jnp.zeros((U, block_k, v.shape[-1]), _F32)) + (dq, *db, *dc)
        if mods is not None and mods.q_blocks is not None:  # whole blocks, then partial
            # a key column narrower than the tables' key block reads its block's row
            for starts, count, with_mod in MD.table_loops(mods.q_blocks, bi,
                                                          kj // MD.column_split(mods, block_k)):
                carry = lax.fori_loop(0, count, make_body(True, with_mod, starts), carry)
        elif inner is not None:
            carry = lax.fori_loop(0, inner[0], make_body(True), carry)
            carry = lax.fori_loop(*inner, make_body(False), carry)
            carry = lax.fori_loop(inner[1], hi, make_body(True), carry)
        elif is_causal or window is not None or ranged:
            carry = lax.fori_loop(lo, full_lo, make_body(True), carry)
            carry = lax.fori_loop(full_lo, hi, make_body(False), carry)
        else:
            carry = lax.fori_loop(lo, hi, make_body(False), carry)
        dk, dv, dq, *db = carry
        db, dc = db[:len(db0)], db[len(db0):]
        db = pairwise.column_end(db, None if dense is None else dense.dtype, bi, B, k0, block_k)
        if gathered is not None:
            dk_acc, dv_acc = gathered.add_kv(dk_acc, dv_acc, bi, k0, block_k, dk, dv)
        else:
            dk_acc = add_rows(dk_acc, bi, k0, view.expand_kv(dk))
            dv_acc = add_rows(dv_acc, bi, k0, view.expand_kv(dv))
        return (dq, dk_acc, dv_acc, *db, *dc), None

    db0 = pairwise.grad_init(mask.bias, B, nk, block_k)
    (dq, dk, dv, *db), _ = lax.scan(column, (dq0, dk0, dv0, *db0,
                                               *mark_varying(axes, *MD.grad_init(mods))),
                                    jnp.arange(B * nk, dtype=jnp.int32))
    db, dc = db[:len(db0)], db[len(db0):]
    grads = (dq[:, :Lq].astype(grad_dtype or q.dtype), dk[:, :Lk].astype(grad_dtype or k.dtype),
             dv[:, :Lk].astype(grad_dtype or v.dtype))
    return (grads + pairwise.grad_result(db, None if mask.bias is None else mask.bias.dtype)
            + MD.grad_result(dc, mods))


