"""The one attention core: blockwise, online softmax, float32 statistics, returns LSE.

Dilated, block-sparse and ring attention all reduce to calls of :func:`attention_core` plus
:func:`merge_attention_states`. The core never materializes a (query, key) matrix larger than
one ``(block_q, block_k)`` pair per head, in the forward or in the backward pass: the backward
is a ``jax.custom_vjp`` that recomputes each block from the saved log-sum-exp (the
FlashAttention-2 recipe, written for XLA).

Layout: queries are grouped by their key/value head, ``q: (B, Lq, Hk, G, d)``, with
``k, v: (B, Lk, Hk, d)``; query head ``(c, g)`` reads kv head ``c``. GQA/MQA therefore never
repeats K/V in memory.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Block sizes of the blockwise core (static, hashable).

    The forward visits key blocks of ``block_k`` for a row of ``block_q`` queries; the backward
    visits query blocks of ``block_q_dkv`` for a column of ``block_k_dkv`` keys. On CPU the
    iterated block should be short and the row/column long, so that every step is a few
    million multiply-adds that XLA spreads over all cores.
    """

    block_q: int = 1024
    block_k: int = 256
    block_q_dkv: int | None = None  # default: block_k
    block_k_dkv: int | None = None  # default: block_q

    def __post_init__(self):
        for name in ("block_q", "block_k", "block_q_dkv", "block_k_dkv"):
            value = getattr(self, name)
            if value is None and name.endswith("dkv"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"BlockSizes.{name} must be a positive int, got {value!r}")

    @property
    def backward(self) -> tuple[int, int]:
        """``(block_q_dkv, block_k_dkv)``."""
        bq = self.block_q_dkv if self.block_q_dkv is not None else self.block_k
        bk = self.block_k_dkv if self.block_k_dkv is not None else self.block_q
        return bq, bk


_SCORE_BUDGET = 1 << 21  # floats in one (heads, rows, block) score tile: 8 MiB


def _pow2_at_most(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def default_block_sizes(len_q: int, len_k: int, num_heads: int, is_causal: bool) -> BlockSizes:
    """Per-shape defaults tuned on a 2-core x86 CPU (see benchmarks/README.md).

    The short (iterated) side is 256; the long side fills a score tile of ~2M floats, capped at
    512 when causal so that blocks entirely in the future are skipped at a fine grain.
    """
    short = 256
    long_cap = 512 if is_causal else 4096
    long = max(short, min(long_cap, _pow2_at_most(_SCORE_BUDGET // (num_heads * short))))
    bq = len_q if len_q <= long else long
    bk = len_k if len_k <= short else short
    bq_dkv = len_q if len_q <= short else short
    bk_dkv = len_k if len_k <= long else long
    return BlockSizes(bq, bk, bq_dkv, bk_dkv)


def _cdiv(a, b):
    return (a + b - 1) // b


def _pad_axis(x, axis, size):
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def _head_major_q(x):
    # (bq, Hk, G, ...) -> (Hk, G, bq, ...)
    return jnp.moveaxis(x, 0, 2)


def _mask(k_start, block_k, kv_len, q_pos, k_offset, is_causal):
    """Allowed ``(Hk or 1, 1, bq or 1, bk)`` mask of one block pair (``kv_len`` may be None)."""
    k_idx = k_start + lax.iota(jnp.int32, block_k)
    mask = None
    if kv_len is not None:
        mask = (k_idx[None, :] < kv_len[:, None])[:, None, None, :]
    if is_causal:
        c = ((k_offset + k_idx)[None, :] <= q_pos[:, None])[None, None]
        mask = c if mask is None else mask & c
    return mask


def _zero_invalid_keys(x, k_start, kv_len):
    """Zeroes rows of ``x: (Hk, bk, d)`` at or beyond ``kv_len`` (NaN padding never leaks)."""
    if kv_len is None:
        return x
    valid = (k_start + lax.iota(jnp.int32, x.shape[1]))[None, :] < kv_len[:, None]
    return jnp.where(valid[..., None], x, jnp.zeros((), x.dtype))


def _forward(q, k, v, kv_len, q_offset, k_offset, scale, is_causal, block_q, block_k):
    B, Lq, Hk, G, d = q.shape
    Lk = k.shape[1]
    nq, nk = _cdiv(Lq, block_q), _cdiv(Lk, block_k)
    qp = _pad_axis(q, 1, nq * block_q)
    kp = _pad_axis(k, 1, nk * block_k)
    vp = _pad_axis(v, 1, nk * block_k)
    if kv_len is None and nk * block_k != Lk:
        kv_len = jnp.full((B, Hk), Lk, jnp.int32)

    def row(idx):
        bi, qi = idx // nq, idx % nq
        qb = lax.dynamic_slice(qp, (bi, qi * block_q, 0, 0, 0), (1, block_q, Hk, G, d))[0]
        qb = _head_major_q(qb * jnp.asarray(scale, q.dtype))  # (Hk, G, bq, d)
        kl = None if kv_len is None else kv_len[bi]
        q_first = q_offset + qi * block_q
        q_pos = q_first + lax.iota(jnp.int32, block_q)
        hi = nk if kl is None else jnp.minimum(nk, _cdiv(jnp.max(kl), block_k))
        if is_causal:
            last = q_first + block_q - 1 - k_offset
            hi = jnp.clip(jnp.where(last >= 0, last // block_k + 1, 0), 0, hi)
            # Key blocks entirely at or before the first query need no causal mask.
            full = jnp.clip(jnp.where(q_first - k_offset + 1 >= 0,
                                      (q_first - k_offset + 1) // block_k, 0), 0, hi)
        else:
            full = hi

        def make_body(causal_block):
            def body(j, carry):
                m, l, acc = carry
                k0 = j * block_k
                kb = lax.dynamic_slice(kp, (bi, k0, 0, 0), (1, block_k, Hk, d))[0].swapaxes(0, 1)
                vb = lax.dynamic_slice(vp, (bi, k0, 0, 0), (1, block_k, Hk, d))[0].swapaxes(0, 1)
                s = jnp.einsum("hgqd,hkd->hgqk", qb, kb, preferred_element_type=_F32)
                mask = _mask(k0, block_k, kl, q_pos, k_offset, causal_block)
                if mask is not None:
                    s = jnp.where(mask, s, -jnp.inf)
                    vb = _zero_invalid_keys(vb, k0, kl)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                p = jnp.exp(s - m_safe[..., None])
                corr = jnp.exp(m - m_safe)
                l = l * corr + jnp.sum(p, axis=-1)
                pv = jnp.einsum("hgqk,hkd->hgqd", p.astype(v.dtype), vb,
                                preferred_element_type=_F32)
                return m_new, l, acc * corr[..., None] + pv

            return body

        carry = (
            jnp.full((Hk, G, block_q), -jnp.inf, _F32),
            jnp.zeros((Hk, G, block_q), _F32),
            jnp.zeros((Hk, G, block_q, d), _F32),
        )
        carry = lax.fori_loop(0, full, make_body(False), carry)
        if is_causal:
            carry = lax.fori_loop(full, hi, make_body(True), carry)
        m, l, acc = carry
        has_key = l > 0
        out = acc / jnp.where(has_key, l, 1.0)[..., None]
        lse = jnp.where(has_key, m + jnp.log(jnp.where(has_key, l, 1.0)), -jnp.inf)
        return jnp.moveaxis(out, 2, 0).astype(q.dtype), jnp.moveaxis(lse, 2, 0)

    out, lse = lax.map(row, jnp.arange(B * nq, dtype=jnp.int32))
    out = out.reshape(B, nq * block_q, Hk, G, d)[:, :Lq]
    lse = lse.reshape(B, nq * block_q, Hk, G)[:, :Lq]
    return out, lse


def _backward(q, k, v, kv_len, q_offset, k_offset, out, lse, dout, dlse, scale, is_causal,
              block_q, block_k):
    B, Lq, Hk, G, d = q.shape
    Lk = k.shape[1]
    nq, nk = _cdiv(Lq, block_q), _cdiv(Lk, block_k)
    # delta = rowsum(dO * O) - dlse: the lse cotangent enters ds exactly like -delta.
    delta = jnp.sum(dout.astype(_F32) * out.astype(_F32), axis=-1) - dlse.astype(_F32)
    lse_safe = jnp.where(lse == -jnp.inf, 0.0, lse)
    qp = _pad_axis(q, 1, nq * block_q)
    dop = _pad_axis(dout, 1, nq * block_q)
    lsep = _pad_axis(lse_safe, 1, nq * block_q)
    deltap = _pad_axis(delta, 1, nq * block_q)
    kp = _pad_axis(k, 1, nk * block_k)
    vp = _pad_axis(v, 1, nk * block_k)
    if kv_len is None and nk * block_k != Lk:
        kv_len = jnp.full((B, Hk), Lk, jnp.int32)
    q_scale = jnp.asarray(scale, q.dtype)

    def column(dq, idx):
        bi, kj = idx // nk, idx % nk
        k0 = kj * block_k
        kb = lax.dynamic_slice(kp, (bi, k0, 0, 0), (1, block_k, Hk, d))[0].swapaxes(0, 1)
        vb = lax.dynamic_slice(vp, (bi, k0, 0, 0), (1, block_k, Hk, d))[0].swapaxes(0, 1)
        kl = None if kv_len is None else kv_len[bi]
        kb = _zero_invalid_keys(kb, k0, kl)
        vb = _zero_invalid_keys(vb, k0, kl)
        hi = nq if kl is None else jnp.where(k0 < jnp.max(kl), nq, 0)
        if is_causal:
            lo = jnp.clip((k_offset + k0 - q_offset) // block_q, 0, nq)
            # Query blocks whose first query sees the whole key block need no causal mask.
            full_lo = jnp.clip(_cdiv(k_offset + k0 + block_k - 1 - q_offset, block_q), lo, nq)
        else:
            lo = full_lo = 0
        hi = jnp.maximum(hi, lo)
        full_lo = jnp.minimum(full_lo, hi)

        def make_body(causal_block):
            def body(qi, carry):
                dk, dv, dq = carry
                q0 = qi * block_q
                qb = lax.dynamic_slice(qp, (bi, q0, 0, 0, 0), (1, block_q, Hk, G, d))[0]
                qb = _head_major_q(qb * q_scale)
                dob = _head_major_q(
                    lax.dynamic_slice(dop, (bi, q0, 0, 0, 0), (1, block_q, Hk, G, d))[0])
                lse_b = _head_major_q(
                    lax.dynamic_slice(lsep, (bi, q0, 0, 0), (1, block_q, Hk, G))[0])
                del_b = _head_major_q(
                    lax.dynamic_slice(deltap, (bi, q0, 0, 0), (1, block_q, Hk, G))[0])
                s = jnp.einsum("hgqd,hkd->hgqk", qb, kb, preferred_element_type=_F32)
                q_pos = q_offset + q0 + lax.iota(jnp.int32, block_q)
                mask = _mask(k0, block_k, kl, q_pos, k_offset, causal_block)
                if mask is not None:
                    s = jnp.where(mask, s, -jnp.inf)
                p = jnp.exp(s - lse_b[..., None])  # (Hk, G, bq, bk); masked -> 0
                dv = dv + jnp.einsum("hgqk,hgqd->hkd", p.astype(dout.dtype), dob,
                                     preferred_element_type=_F32)
                dp = jnp.einsum("hgqd,hkd->hgqk", dob, vb, preferred_element_type=_F32)
                ds = (p * (dp - del_b[..., None])).astype(q.dtype)
                dk = dk + jnp.einsum("hgqk,hgqd->hkd", ds, qb, preferred_element_type=_F32)
                dq_b = jnp.einsum("hgqk,hkd->hgqd", ds, kb, preferred_element_type=_F32)
                cur = lax.dynamic_slice(dq, (bi, 0, 0, q0, 0), (1, Hk, G, block_q, d))
                dq = lax.dynamic_update_slice(dq, cur + dq_b[None], (bi, 0, 0, q0, 0))
                return dk, dv, dq

            return body

        carry = (jnp.zeros((Hk, block_k, d), _F32), jnp.zeros((Hk, block_k, d), _F32), dq)
        if is_causal:
            carry = lax.fori_loop(lo, full_lo, make_body(True), carry)
            carry = lax.fori_loop(full_lo, hi, make_body(False), carry)
        else:
            carry = lax.fori_loop(lo, hi, make_body(False), carry)
        dk, dv, dq = carry
        return dq, (dk.swapaxes(0, 1), dv.swapaxes(0, 1))

    dq0 = jnp.zeros((B, Hk, G, nq * block_q, d), _F32)
    dq, (dk, dv) = lax.scan(column, dq0, jnp.arange(B * nk, dtype=jnp.int32))
    dq = (jnp.moveaxis(dq, 3, 1)[:, :Lq] * scale).astype(q.dtype)
    dk = dk.reshape(B, nk * block_k, Hk, d)[:, :Lk].astype(k.dtype)
    dv = dv.reshape(B, nk * block_k, Hk, d)[:, :Lk].astype(v.dtype)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _core(q, k, v, kv_len, q_offset, k_offset, scale, is_causal, blocks):
    return _forward(q, k, v, kv_len, q_offset, k_offset, scale, is_causal, *blocks[:2])


def _core_fwd(q, k, v, kv_len, q_offset, k_offset, scale, is_causal, blocks):
    out, lse = _forward(q, k, v, kv_len, q_offset, k_offset, scale, is_causal, *blocks[:2])
    return (out, lse), (q, k, v, kv_len, q_offset, k_offset, out, lse)


def _core_bwd(scale, is_causal, blocks, res, cotangents):
    q, k, v, kv_len, q_offset, k_offset, out, lse = res
    dout, dlse = cotangents
    dq, dk, dv = _backward(q, k, v, kv_len, q_offset, k_offset, out, lse, dout, dlse, scale,
                           is_causal, *blocks[2:])
    return dq, dk, dv, None, None, None


_core.defvjp(_core_fwd, _core_bwd)


def attention_core(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: float,
    is_causal: bool = False,
    kv_len: jax.Array | None = None,
    q_offset: jax.Array | int = 0,
    k_offset: jax.Array | int = 0,
    block_sizes: BlockSizes | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Blockwise exact attention returning ``(out, lse)``.

    Args:
      q: ``(B, Lq, Hk, G, d)`` queries grouped by kv head.
      k, v: ``(B, Lk, Hk, d)``.
      scale: logit scale (static float).
      is_causal: key ``t`` is visible to query ``p`` iff ``k_offset + t <= q_offset + p``.
      kv_len: int, broadcastable to ``(B, Hk)``; keys at index ``>= kv_len`` are masked.
        ``None`` (default) means all ``Lk`` keys are valid and skips the mask entirely.
      q_offset, k_offset: global positions of index 0 (int scalars, may be traced).
      block_sizes: static block sizes; default :func:`default_block_sizes`.

    Returns:
      ``out: (B, Lq, Hk, G, d)`` in ``q.dtype`` and ``lse: (B, Lq, Hk, G)`` float32. A query
      with no visible key gets ``out = 0`` and ``lse = -inf`` (zero gradient, never NaN).
    """
    B, Lq, Hk, G, d = q.shape
    Lk = k.shape[1]
    if block_sizes is None:
        block_sizes = default_block_sizes(Lq, Lk, Hk * G, bool(is_causal))
    bq_dkv, bk_dkv = block_sizes.backward
    blocks = (min(block_sizes.block_q, Lq), min(block_sizes.block_k, Lk), min(bq_dkv, Lq),
              min(bk_dkv, Lk))
    if kv_len is not None:
        kv_len = jnp.minimum(jnp.broadcast_to(jnp.asarray(kv_len, jnp.int32), (B, Hk)), Lk)
    q_offset = jnp.asarray(q_offset, jnp.int32)
    k_offset = jnp.asarray(k_offset, jnp.int32)
    return _core(q, k, v, kv_len, q_offset, k_offset, float(scale), bool(is_causal), blocks)


def merge_attention_states(
    out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Combines two partial softmax results over disjoint key multisets.

    ``out = (e^{lse_a} out_a + e^{lse_b} out_b) / (e^{lse_a} + e^{lse_b})`` computed stably in
    float32; ``lse = logaddexp(lse_a, lse_b)``. Rows with ``lse = -inf`` on both sides stay
    ``(0, -inf)``; gradients stay finite. ``out_*``: ``(..., d)``, ``lse_*``: ``(...)``.
    """
    m = jnp.maximum(lse_a, lse_b)
    m_safe = lax.stop_gradient(jnp.where(m == -jnp.inf, 0.0, m))
    ea = jnp.exp(lse_a - m_safe)
    eb = jnp.exp(lse_b - m_safe)
    total = ea + eb
    nonzero = total > 0
    total_safe = jnp.where(nonzero, total, 1.0)
    out = (ea / total_safe)[..., None] * out_a.astype(_F32) + (eb / total_safe)[
        ..., None
    ] * out_b.astype(_F32)
    lse = jnp.where(nonzero, m_safe + jnp.log(total_safe), -jnp.inf)
    return out, lse
