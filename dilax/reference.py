"""Mask-based reference of docs/semantics.md: the test oracle (small n only), and
``implementation="reference"``.

It takes the explicit ``(h, n, n)`` count matrix ``C`` of a dilated configuration
(:func:`dilax.semantics.dilated_counts`) and runs dense attention with bias ``log C``.
:func:`masked_softmax` is the library's one dense masked softmax: the dense reference of
:func:`dilax.dot_product_attention` and the weights of ``sow_weights=True`` call it too. A
leaf: it imports nothing of dilax but :mod:`dilax.semantics`. Nothing here is fast; everything
here is simple enough to check by eye against the spec.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# The count matrix is the semantics' (dilax.semantics); re-exported for the tests.
from dilax.semantics import branch_heads, branch_mask, dilated_counts, group_sizes, window_mask

__all__ = [
    "branch_mask",
    "dilated_attention_reference",
    "dense_attention",
    "dilated_counts",
    "document_counts",
    "group_sizes",
    "length_mask",
    "masked_attention",
    "masked_softmax",
    "window_mask",
]


def length_mask(n: int, query_seq_lengths=None, key_value_seq_lengths=None,
                key_padding_mask=None):
    """``(b, 1, n, n)`` float32 validity of (query, key) pairs, or ``None`` without lengths:
    query ``p < query_seq_lengths[i]``, key ``t < key_value_seq_lengths[i]`` and
    ``key_padding_mask[i, t]``."""
    if query_seq_lengths is None and key_value_seq_lengths is None and key_padding_mask is None:
        return None
    pos = jnp.arange(n)
    valid = True
    if query_seq_lengths is not None:
        valid = valid & (pos[None, :, None] < jnp.asarray(query_seq_lengths)[:, None, None])
    if key_value_seq_lengths is not None:
        valid = valid & (pos[None, None, :] < jnp.asarray(key_value_seq_lengths)[:, None, None])
    if key_padding_mask is not None:
        valid = valid & jnp.asarray(key_padding_mask, bool)[:, None, :]
    return jnp.broadcast_to(valid, (valid.shape[0], n, n))[:, None].astype(jnp.float32)


def document_counts(segment_ids, num_heads: int, segment_lengths, dilation_rates,
                    mode: str = "mixture", is_causal: bool = False,
                    local_window: int | None = None) -> jax.Array:
    """``C[b, j, p, t]`` of packed documents (docs/semantics.md, "Packed documents"): the rules
    of :func:`dilated_counts` on document positions ``p - start``, and no pair across two
    documents. ``segment_ids (b, n)``; returns float32 ``(b, h, n, n)``."""
    ids = jnp.asarray(segment_ids)
    n = ids.shape[1]
    pos = jnp.arange(n)
    change = jnp.concatenate([jnp.zeros_like(ids[:, :1], bool), ids[:, 1:] != ids[:, :-1]], 1)
    doc = jnp.cumsum(change, axis=1)
    same_doc = doc[:, :, None] == doc[:, None, :]  # (b, n, n)
    start = jnp.argmax(same_doc, axis=2)  # the first position of p's document
    dpos = pos[None] - start
    allowed = same_doc
    if is_causal:
        allowed = allowed & (pos[None, None, :] <= pos[None, :, None])
    counts = jnp.zeros((ids.shape[0], num_heads, n, n), jnp.float32)
    for br in branch_heads(num_heads, segment_lengths, dilation_rates, mode):
        for j, o in zip(br.heads, br.offsets):
            sel = dpos % br.r == o
            seg = dpos // br.w
            m = allowed & sel[:, :, None] & sel[:, None, :] & (seg[:, :, None] == seg[:, None, :])
            counts = counts.at[:, j].add(m.astype(jnp.float32))
    if mode == "mixture" and local_window is not None:
        band = jnp.abs(pos[:, None] - pos[None, :]) <= local_window
        counts = counts + (allowed & band[None]).astype(jnp.float32)[:, None]
    return counts


def _as_rank4(x: jax.Array) -> jax.Array:
    """Leading unit axes up to rank 4 (explicit ranks: works under rank promotion "raise")."""
    return x.reshape((1,) * (4 - x.ndim) + x.shape)


def _allowed(weight: jax.Array) -> jax.Array:
    """The attended pairs of a :func:`masked_softmax` ``weight`` (bool mask or counts)."""
    return weight if weight.dtype == bool else weight > 0


def masked_softmax(
    q: jax.Array, k: jax.Array, weight: jax.Array | np.ndarray, scale: float,
    bias: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The library's one dense masked softmax: ``P = C e^s / sum_t C e^s`` with
    ``s = scale q k^T + bias``, 0 in a row that sees no key (never NaN).

    Every dense reference calls it: :func:`masked_attention` (the dilated and block-sparse
    references, ``implementation="reference"``), the dense reference of
    :func:`dilax.dot_product_attention` and the weights ``sow_weights=True`` stores
    (:func:`dilax.dropin.attention_fn.dilated_weights`).

    Args:
      q: ``(b, n, h, d)``; k: ``(b, m, hk, d)`` with ``h % hk == 0``.
      weight: broadcastable to ``(b, h, n, m)`` (rank <= 4, leading axes added): a bool mask
        (True = attend) or non-negative multiplicities ``C`` (0 = masked).
      scale: logit scale.
      bias: optional, broadcastable to ``(b, h, n, m)`` likewise, added to the scaled logits.
    Returns:
      ``(p, lse)``: ``p (b, h, n, m)`` float32 and the log-sum-exp ``lse (b, n, h)`` float32
      of the weighted logits (``-inf`` where a row sees no key). The row maximum is held
      without gradient.
    """
    k = jnp.repeat(k, q.shape[2] // k.shape[2], axis=2)
    s = jnp.einsum(
        "bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32,
        precision=jax.lax.Precision.HIGHEST,
    ) * scale
    if bias is not None:
        s = s + _as_rank4(jnp.asarray(bias).astype(jnp.float32))
    weight = _as_rank4(jnp.asarray(weight))
    allowed = _allowed(weight)
    if weight.dtype != bool:  # a pair of multiplicity C weighs C e^s = e^(s + log C)
        s = s + jnp.log(jnp.where(allowed, weight.astype(jnp.float32), 1.0))
    s = jnp.where(allowed, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    e = jnp.exp(s - m)  # masked: exp(-inf) = 0, no NaN
    den = jnp.sum(e, axis=-1, keepdims=True)
    seen = den > 0
    p = e / jnp.where(seen, den, 1.0)
    lse = jnp.where(seen, jnp.log(jnp.where(seen, den, 1.0)) + m, -jnp.inf)
    return p, jnp.moveaxis(lse[..., 0], 1, 2)


def dense_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, weight: jax.Array | np.ndarray, scale: float,
    bias: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``(out (b, n, h, d) in q.dtype, lse (b, n, h) float32)``: ``out = P v`` with the
    :func:`masked_softmax` ``P`` of the same arguments (``v (b, m, hk, d)``). A NaN value
    reaches exactly the queries that attend its key; an infinite one reaches every query."""
    p, lse = masked_softmax(q, k, weight, scale, bias)
    v32 = jnp.repeat(v, q.shape[2] // v.shape[2], axis=2).astype(jnp.float32)
    bad = jnp.isnan(v32)
    out = jnp.einsum(
        "bhqk,bkhd->bqhd", p, jnp.where(bad, 0.0, v32), precision=jax.lax.Precision.HIGHEST
    )
    # A NaN value reaches exactly the queries that attend its key (0 * NaN would reach all).
    allowed = jnp.broadcast_to(_allowed(_as_rank4(jnp.asarray(weight))), p.shape)
    hit = jnp.einsum("bhqk,bkhd->bqhd", allowed.astype(jnp.float32), bad.astype(jnp.float32))
    # The NaN is taken from v itself (-inf when v has none): no NaN is created from a clean
    # input, so jax_debug_nans never trips on this line, even op by op.
    out = jnp.where(hit > 0, jnp.max(jnp.where(bad, v32, -jnp.inf)), out)
    return out.astype(q.dtype), lse


def masked_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, counts: jax.Array | np.ndarray, scale: float
) -> jax.Array:
    """Dense attention with multiplicity weights: ``sum_t C e^s v / sum_t C e^s``, 0 if no key
    (:func:`dense_attention`'s output).

    Args:
      q: ``(b, n, h, d)``; k, v: ``(b, m, hk, d)`` with ``h % hk == 0``.
      counts: ``(h or 1, n, m)`` or ``(b, h or 1, n, m)`` non-negative weights, 0 = masked.
      scale: logit scale.
    Returns:
      ``(b, n, h, d)`` in ``q.dtype``; softmax statistics in float32.
    """
    return dense_attention(q, k, v, jnp.asarray(counts, jnp.float32), scale)[0]


def dilated_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_lengths: tuple[int, ...],
    dilation_rates: tuple[int, ...],
    *,
    is_causal: bool = False,
    scale: float,
    mode: str = "mixture",
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window: int | None = None,
    key_padding_mask: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Dilated attention from the explicit mask (docs/semantics.md). Arguments must be
    validated; lengths ``(b,)`` in ``[0, n]`` zero the count of invalid (query, key) pairs;
    ``segment_ids (b, n)``: packed documents (:func:`document_counts`)."""
    n, h = q.shape[1], q.shape[2]
    if segment_ids is not None:
        counts = document_counts(segment_ids, h, segment_lengths, dilation_rates, mode,
                                 is_causal, local_window)
    else:
        counts = dilated_counts(n, h, segment_lengths, dilation_rates, mode, is_causal,
                                local_window)
    valid = length_mask(n, query_seq_lengths, key_value_seq_lengths, key_padding_mask)
    if valid is not None:
        counts = jnp.asarray(counts) * valid if counts.ndim == 4 else (
            jnp.asarray(counts)[None] * valid)
    out = masked_attention(q, k, v, counts, scale)
    if mode == "grouped":
        out = (out.astype(jnp.float32) / len(segment_lengths)).astype(q.dtype)
    return out
