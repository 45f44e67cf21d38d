"""Dense XLA references of the kernels (explicit masks; small ``n`` only, for tests)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_F32 = jnp.float32


def masked_reference(q, k, v, mask, scale: float):
    """Dense softmax attention over the keys allowed by a boolean mask, with its lse.

    Args:
      q: ``(b, n, h, d)``; k, v: ``(b, m, hk, d)`` with ``h % hk == 0`` (query head ``j`` reads
        kv head ``j // (h // hk)``).
      mask: bool ``(h or 1, n, m)`` or ``(b, h or 1, n, m)``.
      scale: logit scale.
    Returns:
      ``out (b, n, h, d)`` in ``q.dtype`` (0 for a query with no key) and ``lse (b, n, h)``
      float32 (``-inf`` there). Logits and statistics in float32 at full matmul precision.
    """
    rep = q.shape[2] // k.shape[2]
    k = jnp.repeat(k, rep, axis=2)
    v = jnp.repeat(v, rep, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=_F32,
                   precision=lax.Precision.HIGHEST) * scale
    mask = jnp.asarray(mask, bool)
    s = jnp.where(mask if mask.ndim == 4 else mask[None], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.where(jnp.isfinite(lse)[..., None], jnp.exp(s - jnp.where(
        jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(_F32), precision=lax.Precision.HIGHEST)
    return out.astype(q.dtype), lse.transpose(0, 2, 1)


def attention_reference(q, k, v, *, scale: float, is_causal: bool = False, kv_len=None,
                        q_offset=0, k_offset=0):
    """Dense reference of :func:`pallas_kernels.flash_attention`, same arguments and layout.

    ``q (B, Lq, Hk, G, d)``, ``k, v (B, Lk, Hk, d)``; returns ``out (B, Lq, Hk, G, d)`` and
    ``lse (B, Lq, Hk, G)``.
    """
    B, Lq, Hk, G, d = q.shape
    Lk = k.shape[1]
    t = jnp.arange(Lk)
    if kv_len is None:
        kv_len = Lk
    valid = t[None, None, :] < jnp.broadcast_to(jnp.asarray(kv_len), (B, Hk))[..., None]
    mask = jnp.repeat(valid, G, axis=1)[:, :, None, :]  # (B, H, 1, Lk)
    if is_causal:
        q_pos = q_offset + jnp.arange(Lq)
        mask = mask & ((k_offset + t)[None, :] <= q_pos[:, None])[None, None]
    mask = jnp.broadcast_to(mask, (B, Hk * G, Lq, Lk))
    out, lse = masked_reference(q.reshape(B, Lq, Hk * G, d), k, v, mask, scale)
    return out.reshape(q.shape), lse.reshape(B, Lq, Hk, G)


__all__ = ["attention_reference", "masked_reference"]


def block_sparse_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    block_mask: np.ndarray,
    *,
    block_size: int,
    scale: float,
    is_causal: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Dense XLA reference of
    :func:`pallas_kernels.block_sparse.block_sparse_flash_attention` from a boolean block mask.

    ``block_mask: (H_pat, nq_blocks, nk_blocks)``. Builds the explicit ``(H_pat, n, n)`` mask
    (small ``n`` only) and returns ``(out, lse)`` in the grouped layout.
    """
    B, n, Hk, G, d = q.shape
    mask = np.repeat(np.repeat(np.asarray(block_mask, bool), block_size, 1), block_size, 2)
    mask = mask[:, :n, :n]
    if is_causal:
        mask = mask & np.tril(np.ones((n, n), bool))[None]
    out, lse = masked_reference(q.reshape(B, n, Hk * G, d), k, v, mask, scale)
    return out.reshape(q.shape), lse.reshape(B, n, Hk, G)
