"""Built-in ``mask_mod`` and ``score_mod`` functions of :func:`dilax.flex_attention`, and
their combinators (docs/semantics.md, "Custom scores and masks").

A ``mask_mod(b, h, q_idx, kv_idx) -> bool`` and a ``score_mod(score, b, h, q_idx, kv_idx)
-> score`` are called elementwise, on int32 / float32 scalars (PyTorch FlexAttention's
argument order); positions are row positions of the sequence. The makers below close over
their arrays (document ids, slopes, tables); closed-over float arrays receive gradients.
"""

from __future__ import annotations

import operator

import jax.numpy as jnp


def causal_mask(b, h, q_idx, kv_idx):
    """Query ``q`` sees keys ``kv <= q``."""
    del b, h
    return q_idx >= kv_idx


def sliding_window(window: int):
    """The band ``|q - kv| <= window`` (dilax's ``local_window``); with :func:`causal_mask`
    (:func:`and_masks`) the causal sliding window ``0 <= q - kv <= window``."""
    window = _nonneg_int(window, "window")

    def mask_mod(b, h, q_idx, kv_idx):
        del b, h
        return jnp.abs(q_idx - kv_idx) <= window

    return mask_mod


def chunked_mask(chunk: int):
    """Block-diagonal chunks: ``q // chunk == kv // chunk`` (chunked attention; and it with
    :func:`causal_mask` for the causal form)."""
    chunk = _nonneg_int(chunk, "chunk")
    if chunk == 0:
        raise ValueError("chunked_mask: chunk must be a positive int, got 0")

    def mask_mod(b, h, q_idx, kv_idx):
        del b, h
        return q_idx // chunk == kv_idx // chunk

    return mask_mod


def prefix_lm_mask(prefix_len):
    """Prefix-LM: every query sees the prefix ``kv < prefix_len`` and, causally, ``kv <= q``.
    ``prefix_len``: an int or an int array ``(b,)`` (one prefix per batch row; traced
    allowed)."""
    prefix = jnp.asarray(prefix_len, jnp.int32)
    if prefix.ndim > 1:
        raise ValueError(f"prefix_lm_mask: prefix_len must be an int or (b,), got shape "
                         f"{prefix.shape}")

    def mask_mod(b, h, q_idx, kv_idx):
        del h
        p = prefix[b] if prefix.ndim == 1 else prefix
        return (kv_idx <= q_idx) | (kv_idx < p)

    return mask_mod


def document_mask(segment_ids, kv_segment_ids=None):
    """Packed documents: a query sees only keys of its own document, a maximal run of equal
    ids in ``segment_ids (b, n)`` (int, traced allowed), as dilax's ``segment_ids``.
    ``kv_segment_ids (b, s)``: the keys' ids when they differ (then documents are equal
    ids). And it with :func:`causal_mask` for packed causal training."""
    q_ids = jnp.asarray(segment_ids)
    if q_ids.ndim != 2 or not jnp.issubdtype(q_ids.dtype, jnp.integer):
        raise ValueError(f"document_mask: segment_ids must be an int array (b, n), got "
                         f"{q_ids.dtype}{list(q_ids.shape)}")
    if kv_segment_ids is None:  # runs of equal ids: a run number per position
        change = jnp.concatenate([jnp.zeros_like(q_ids[:, :1], dtype=jnp.int32),
                                  (q_ids[:, 1:] != q_ids[:, :-1]).astype(jnp.int32)], axis=1)
        q_ids = kv_ids = jnp.cumsum(change, axis=1)
    else:
        kv_ids = jnp.asarray(kv_segment_ids)

    def mask_mod(b, h, q_idx, kv_idx):
        del h
        return q_ids[b, q_idx] == kv_ids[b, kv_idx]

    return mask_mod


def _combine(mask_mods, op, start: bool, name: str):
    _callables(mask_mods, name)

    def mask_mod(b, h, q_idx, kv_idx):
        out = jnp.asarray(start)
        for m in mask_mods:
            out = op(out, m(b, h, q_idx, kv_idx))
        return out

    return mask_mod


def and_masks(*mask_mods):
    """A pair is kept iff every ``mask_mod`` keeps it (no argument: every pair)."""
    return _combine(mask_mods, operator.and_, True, "and_masks")


def or_masks(*mask_mods):
    """A pair is kept iff some ``mask_mod`` keeps it (no argument: no pair)."""
    return _combine(mask_mods, operator.or_, False, "or_masks")


def soft_cap(cap: float):
    """``score_mod``: ``cap * tanh(score / cap)`` (Gemma-2 / Grok logit soft-capping; the
    same as ``flex_attention(logits_soft_cap=cap)``, which applies it before ``score_mod``)."""
    cap = float(cap)
    if not cap > 0:
        raise ValueError(f"soft_cap: cap must be > 0, got {cap}")

    def score_mod(score, b, h, q_idx, kv_idx):
        del b, h, q_idx, kv_idx
        return cap * jnp.tanh(score / cap)

    return score_mod


def alibi(slopes):
    """``score_mod``: ALiBi, ``score + slopes[h] * (kv - q)`` (``slopes (h,)`` float, e.g.
    learnable: it receives gradients)."""
    slopes = jnp.asarray(slopes)
    if slopes.ndim != 1 or not jnp.issubdtype(slopes.dtype, jnp.floating):
        raise ValueError(f"alibi: slopes must be a float array (h,), got "
                         f"{slopes.dtype}{list(slopes.shape)}")

    def score_mod(score, b, h, q_idx, kv_idx):
        del b
        return score + slopes[h].astype(score.dtype) * (kv_idx - q_idx).astype(score.dtype)

    return score_mod


def relative_bias(table):
    """``score_mod``: a learned relative-position bias, ``score + table[..., kv - q + R]``
    with ``table (2R + 1,)`` (shared) or ``(h, 2R + 1)`` (per head); offsets beyond ``R``
    use the edge entries. The table receives gradients."""
    table = jnp.asarray(table)
    if table.ndim not in (1, 2) or table.shape[-1] % 2 != 1 or not jnp.issubdtype(
            table.dtype, jnp.floating):
        raise ValueError(f"relative_bias: table must be a float array (2R + 1,) or "
                         f"(h, 2R + 1), got {table.dtype}{list(table.shape)}")
    radius = table.shape[-1] // 2

    def score_mod(score, b, h, q_idx, kv_idx):
        del b
        i = jnp.clip(kv_idx - q_idx, -radius, radius) + radius
        bias = table[i] if table.ndim == 1 else table[h, i]
        return score + bias.astype(score.dtype)

    return score_mod


def _nonneg_int(x, name: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 0:
        raise ValueError(f"{name} must be an int >= 0, got {x!r}")
    return x


def _callables(mods, name: str) -> None:
    for i, m in enumerate(mods):
        if not callable(m):
            raise TypeError(f"{name}: argument {i} must be a mask_mod (callable), got "
                            f"{type(m).__name__}")
