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
    """Query/key block sizes of the blockwise core (static, hashable)."""

    block_q: int = 256
    block_k: int = 512

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"BlockSizes.{name} must be a positive int, got {value!r}")


def default_block_sizes(len_q: int, len_k: int, head_dim: int) -> BlockSizes:
    """Per-shape defaults, tuned for CPU caches (see benchmarks/README.md)."""
    del head_dim
    return BlockSizes(block_q=min(256, len_q), block_k=min(512, len_k))


def _cdiv(a, b):
    return (a + b - 1) // b


def _pad_axis(x, axis, size):
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def _block_mask(k_start, block_k, kv_len, q_pos, k_offset, is_causal):
    """Allowed ``(Hk, 1, bq or 1, bk)`` mask for one block pair."""
    k_idx = k_start + lax.iota(jnp.int32, block_k)
    mask = (k_idx[None, :] < kv_len[:, None])[:, None, None, :]
    if is_causal:
        mask = mask & ((k_offset + k_idx)[None, :] <= q_pos[:, None])[None, None]
    return mask


def _scores(qb, kb, scale):
    # qb: (bq, Hk, G, d), kb: (bk, Hk, d) -> (Hk, G, bq, bk) in float32
    return jnp.einsum("qhgd,khd->hgqk", qb, kb, preferred_element_type=_F32) * scale


def _forward(q, k, v, kv_len, q_offset, k_offset, scale, is_causal, block_q, block_k):
    B, Lq, Hk, G, d = q.shape
    Lk = k.shape[1]
    nq, nk = _cdiv(Lq, block_q), _cdiv(Lk, block_k)
    qp = _pad_axis(q, 1, nq * block_q)
    kp = _pad_axis(k, 1, nk * block_k)
    vp = _pad_axis(v, 1, nk * block_k)

    def row(idx):
        bi, qi = idx // nq, idx % nq
        qb = lax.dynamic_slice(qp, (bi, qi * block_q, 0, 0, 0), (1, block_q, Hk, G, d))[0]
        kl = kv_len[bi]
        q_pos = q_offset + qi * block_q + lax.iota(jnp.int32, block_q)
        hi = _cdiv(jnp.max(kl), block_k)
        if is_causal:
            last_visible = q_offset + qi * block_q + block_q - 1 - k_offset
            hi = jnp.minimum(hi, jnp.where(last_visible >= 0, last_visible // block_k + 1, 0))

        def body(j, carry):
            m, l, acc = carry
            kb = lax.dynamic_slice(kp, (bi, j * block_k, 0, 0), (1, block_k, Hk, d))[0]
            vb = lax.dynamic_slice(vp, (bi, j * block_k, 0, 0), (1, block_k, Hk, d))[0]
            mask = _block_mask(j * block_k, block_k, kl, q_pos, k_offset, is_causal)
            s = jnp.where(mask, _scores(qb, kb, scale), -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p = jnp.exp(s - m_safe[..., None])
            corr = jnp.exp(m - m_safe)
            l = l * corr + jnp.sum(p, axis=-1)
            # Zero keys beyond kv_len so NaN/inf padding can never leak through 0 * x.
            kmask = (j * block_k + lax.iota(jnp.int32, block_k))[:, None] < kl[None, :]
            vb = jnp.where(kmask[..., None], vb, jnp.zeros((), vb.dtype))
            pv = jnp.einsum("hgqk,khd->hgqd", p.astype(v.dtype), vb, preferred_element_type=_F32)
            return m_new, l, acc * corr[..., None] + pv

        init = (
            jnp.full((Hk, G, block_q), -jnp.inf, _F32),
            jnp.zeros((Hk, G, block_q), _F32),
            jnp.zeros((Hk, G, block_q, d), _F32),
        )
        m, l, acc = lax.fori_loop(0, hi, body, init)
        has_key = l > 0
        out = acc / jnp.where(has_key, l, 1.0)[..., None]
        lse = jnp.where(has_key, m + jnp.log(jnp.where(has_key, l, 1.0)), -jnp.inf)
        return out.transpose(2, 0, 1, 3).astype(q.dtype), lse.transpose(2, 0, 1)

    out, lse = lax.map(row, jnp.arange(B * nq, dtype=jnp.int32))
    out = out.reshape(B, nq * block_q, Hk, G, d)[:, :Lq]
    lse = lse.reshape(B, nq * block_q, Hk, G)[:, :Lq]
    return out, lse


def _backward(q, k, v, kv_len, q_offset, k_offset, out, lse, dout, dlse, scale, is_causal,
              block_q, block_k):
    B, Lq, Hk, G, d = q.shape
    Lk = k.shape[1]
    nq, nk = _cdiv(Lq, block_q), _cdiv(Lk, block_k)
    # delta_p = rowsum(dO * O) - dlse: the lse cotangent enters ds exactly like -delta.
    delta = jnp.sum(dout.astype(_F32) * out.astype(_F32), axis=-1) - dlse.astype(_F32)
    lse_safe = jnp.where(lse == -jnp.inf, 0.0, lse)
    qp = _pad_axis(q, 1, nq * block_q)
    dop = _pad_axis(dout, 1, nq * block_q)
    lsep = _pad_axis(lse_safe, 1, nq * block_q)
    deltap = _pad_axis(delta, 1, nq * block_q)
    kp = _pad_axis(k, 1, nk * block_k)
    vp = _pad_axis(v, 1, nk * block_k)

    def column(dq, idx):
        bi, kj = idx // nk, idx % nk
        kb = lax.dynamic_slice(kp, (bi, kj * block_k, 0, 0), (1, block_k, Hk, d))[0]
        vb = lax.dynamic_slice(vp, (bi, kj * block_k, 0, 0), (1, block_k, Hk, d))[0]
        kl = kv_len[bi]
        kmask = (kj * block_k + lax.iota(jnp.int32, block_k))[:, None] < kl[None, :]
        vb = jnp.where(kmask[..., None], vb, jnp.zeros((), vb.dtype))
        kb_safe = jnp.where(kmask[..., None], kb, jnp.zeros((), kb.dtype))
        lo = 0
        hi = jnp.where(kj * block_k < jnp.max(kl), nq, 0)
        if is_causal:
            first = k_offset + kj * block_k - q_offset
            lo = jnp.clip(first // block_q, 0, nq)

        def body(qi, carry):
            dk, dv, dq = carry
            qb = lax.dynamic_slice(qp, (bi, qi * block_q, 0, 0, 0), (1, block_q, Hk, G, d))[0]
            dob = lax.dynamic_slice(dop, (bi, qi * block_q, 0, 0, 0), (1, block_q, Hk, G, d))[0]
            lse_b = lax.dynamic_slice(lsep, (bi, qi * block_q, 0, 0), (1, block_q, Hk, G))[0]
            del_b = lax.dynamic_slice(deltap, (bi, qi * block_q, 0, 0), (1, block_q, Hk, G))[0]
            q_pos = q_offset + qi * block_q + lax.iota(jnp.int32, block_q)
            mask = _block_mask(kj * block_k, block_k, kl, q_pos, k_offset, is_causal)
            s = jnp.where(mask, _scores(qb, kb, scale), -jnp.inf)
            p = jnp.exp(s - lse_b.transpose(1, 2, 0)[..., None])  # (Hk, G, bq, bk)
            dv = dv + jnp.einsum("hgqk,qhgd->khd", p.astype(dout.dtype), dob,
                                 preferred_element_type=_F32)
            dp = jnp.einsum("qhgd,khd->hgqk", dob, vb, preferred_element_type=_F32)
            ds = p * (dp - del_b.transpose(1, 2, 0)[..., None])
            dk = dk + jnp.einsum("hgqk,qhgd->khd", ds, qb.astype(_F32),
                                 preferred_element_type=_F32)
            dq_b = jnp.einsum("hgqk,khd->qhgd", ds, kb_safe.astype(_F32),
                              preferred_element_type=_F32)
            cur = lax.dynamic_slice(dq, (bi, qi * block_q, 0, 0, 0), (1, block_q, Hk, G, d))
            dq = lax.dynamic_update_slice(dq, cur + dq_b[None], (bi, qi * block_q, 0, 0, 0))
            return dk, dv, dq

        init = (jnp.zeros((block_k, Hk, d), _F32), jnp.zeros((block_k, Hk, d), _F32), dq)
        dk, dv, dq = lax.fori_loop(lo, jnp.maximum(hi, lo), body, init)
        return dq, (dk * scale, dv)

    dq0 = jnp.zeros((B, nq * block_q, Hk, G, d), _F32)
    dq, (dk, dv) = lax.scan(column, dq0, jnp.arange(B * nk, dtype=jnp.int32))
    dq = (dq[:, :Lq] * scale).astype(q.dtype)
    dk = dk.reshape(B, nk * block_k, Hk, d)[:, :Lk].astype(k.dtype)
    dv = dv.reshape(B, nk * block_k, Hk, d)[:, :Lk].astype(v.dtype)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _core(q, k, v, kv_len, q_offset, k_offset, scale, is_causal, block_q, block_k):
    return _forward(q, k, v, kv_len, q_offset, k_offset, scale, is_causal, block_q, block_k)


def _core_fwd(q, k, v, kv_len, q_offset, k_offset, scale, is_causal, block_q, block_k):
    out, lse = _forward(q, k, v, kv_len, q_offset, k_offset, scale, is_causal, block_q, block_k)
    return (out, lse), (q, k, v, kv_len, q_offset, k_offset, out, lse)


def _core_bwd(scale, is_causal, block_q, block_k, res, cotangents):
    q, k, v, kv_len, q_offset, k_offset, out, lse = res
    dout, dlse = cotangents
    dq, dk, dv = _backward(q, k, v, kv_len, q_offset, k_offset, out, lse, dout, dlse, scale,
                           is_causal, block_q, block_k)
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
      kv_len: int ``(B, Hk)``; keys at index ``>= kv_len`` are masked (default ``Lk``).
      q_offset, k_offset: global positions of index 0 (int scalars, may be traced).
      block_sizes: static block sizes; default :func:`default_block_sizes`.

    Returns:
      ``out: (B, Lq, Hk, G, d)`` in ``q.dtype`` and ``lse: (B, Lq, Hk, G)`` float32. A query
      with no visible key gets ``out = 0`` and ``lse = -inf`` (zero gradient, never NaN).
    """
    B, Lq, Hk, G, d = q.shape
    Lk = k.shape[1]
    if block_sizes is None:
        block_sizes = default_block_sizes(Lq, Lk, d)
    bq, bk = min(block_sizes.block_q, Lq), min(block_sizes.block_k, Lk)
    if kv_len is None:
        kv_len = jnp.full((B, Hk), Lk, jnp.int32)
    kv_len = jnp.minimum(jnp.broadcast_to(jnp.asarray(kv_len, jnp.int32), (B, Hk)), Lk)
    q_offset = jnp.asarray(q_offset, jnp.int32)
    k_offset = jnp.asarray(k_offset, jnp.int32)
    return _core(q, k, v, kv_len, q_offset, k_offset, float(scale), bool(is_causal), bq, bk)


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
