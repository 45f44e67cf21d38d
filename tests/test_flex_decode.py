"""FlexAttention's options on decoding with a KV cache (``dilax.dilated_attention_decode``,
XLA path): a chunk of prefill and then one generated token with soft-cap, ALiBi (closing over
slopes), a document ``mask_mod`` (closing over ids of the cache's positions), sinks and the
local window give exactly the rows of causal dilated attention over the whole sequence with
the same options (float64 oracle of tests/test_flex_ring.py): ``q_idx`` is the new token's
position, ``kv_idx`` the cache slot's; in ``mode="grouped"`` too (each head group's own
softmax, ``h`` the real query head, sinks once per head), against the oracle and the rows of
``dilated_attention(mode="grouped")``. And the refusal (Pallas)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import dilax
from dilax import flex
from dilax.reference import dilated_counts
from tests.test_flex_ring import CAP, oracle
from tests.tolerance import assert_scaled_close

B, H, HK, D, MAX = 2, 4, 2, 8, 40
WS, RS, W = (8, 16), (1, 2), 3


def _prefill_chunk_token(q, k, v, t0, kw):
    """Decodes ``q, k, v (B, L, .., D)`` as a prefill of ``t0`` positions, a chunk up to
    ``L - 1`` and one token: the outputs concatenated ``(B, L, H, D)`` and the cache."""
    L = q.shape[1]
    cache = dilax.KVCache.init(B, MAX, HK, D)
    outs = []
    for lo, hi in ((0, t0), (t0, L - 1), (L - 1, L)):
        out, cache = dilax.dilated_attention_decode(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi],
                                                    cache, WS, RS, **kw)
        outs.append(np.asarray(out))
    return np.concatenate(outs, axis=1), cache


def test_decode_softcap_alibi_documents_sinks_window():
    rng = np.random.default_rng(0)
    L, t0 = 19, 13  # a prefill chunk of 13 positions, then a chunk of 5 and one token
    q, k, v = (rng.normal(size=(B, L, h, D)).astype(np.float32) for h in (H, HK, HK))
    slopes = jnp.asarray(rng.uniform(0.05, 0.3, H), jnp.float32)
    sinks = jnp.asarray(rng.normal(size=H), jnp.float32)
    ids = np.zeros((B, MAX), np.int32)
    ids[0, 6:], ids[1, 15:] = 1, 1  # a document boundary before and inside the chunks
    kw = dict(local_window=W, score_mod=flex.alibi(slopes), logits_soft_cap=CAP, sinks=sinks,
              mask_mod=flex.document_mask(jnp.asarray(ids)))
    got, cache = _prefill_chunk_token(q, k, v, t0, kw)
    doc = ids[:, :L]
    w = dilated_counts(L, H, WS, RS, "mixture", True, W)[None] * (
        doc[:, :, None] == doc[:, None, :])[:, None]
    want = oracle(q, k, v, w, slopes, sinks, np.zeros((B, L, H, D)))[0]
    assert_scaled_close(got, want, 1e-5)
    print(f"decode with mods: max |err| {np.max(np.abs(got - want)):.1e}")
    assert np.asarray(cache.lengths).tolist() == [L, L]


def test_decode_mods_refusals():
    x = jnp.zeros((1, 1, 2, 16))
    cache = dilax.KVCache.init(1, 8, 2, 16)
    with pytest.raises(ValueError, match="score_mod"):  # the registry's reason
        dilax.dilated_attention_decode(x, x, x, cache, (4,), (1,), implementation="pallas",
                                       interpret=True, logits_soft_cap=1.0)


def test_decode_grouped_softcap_alibi_documents_sinks():
    """``mode="grouped"``: prefill, a chunk and one token equal the causal rows of the
    one-device grouped op with the same mods (and the float64 oracle: per head its group's
    branch, the sink in its softmax, divided by the number of groups). ALiBi slopes differ
    per head, so a wrong head of a group's virtual heads would show."""
    rng = np.random.default_rng(1)
    L, t0 = 19, 11
    q, k, v = (rng.normal(size=(B, L, h, D)).astype(np.float32) for h in (H, HK, HK))
    slopes = jnp.asarray(rng.uniform(0.05, 0.3, H), jnp.float32)
    sinks = jnp.asarray(rng.normal(size=H), jnp.float32)
    ids = np.zeros((B, MAX), np.int32)
    ids[0, 4:], ids[1, 12:] = 1, 1
    kw = dict(mode="grouped", score_mod=flex.alibi(slopes), logits_soft_cap=CAP, sinks=sinks,
              mask_mod=flex.document_mask(jnp.asarray(ids)))
    got, cache = _prefill_chunk_token(q, k, v, t0, kw)
    whole = np.asarray(dilax.dilated_attention(q, k, v, WS, RS, is_causal=True, **kw))
    doc = ids[:, :L]
    w = dilated_counts(L, H, WS, RS, "grouped", True, None)[None] * (
        doc[:, :, None] == doc[:, None, :])[:, None]
    want = oracle(q, k, v, w, slopes, sinks, np.zeros((B, L, H, D)))[0] / len(WS)
    assert_scaled_close(whole, want, 1e-5)
    assert_scaled_close(got, whole, 1e-5)
    print(f"grouped decode with mods: max |err| {np.max(np.abs(got - want)):.1e} (oracle), "
          f"{np.max(np.abs(got - whole)):.1e} (dilated_attention)")
    assert np.asarray(cache.lengths).tolist() == [L, L]
