"""The flash kernels' band, per-key and query-length masks (issue 29), in the strict Pallas
interpreter against the float64 oracle: forward, lse and the gradients of the dq and dk/dv
kernels, causal and not, GQA/MQA, fp32 and bf16; block skipping shown by NaN planted where
no visited tile may read it. The dilated op with ``local_window`` + lengths + key padding on
``implementation="pallas"`` runs in tests/test_registry.py's contract test (its kernel calls:
``test_issue_25_...`` there). Tiny shapes, several data sets per compiled function."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_pallas import STRICT, _compare, _grouped_inputs, _oracle, _vjp

from dilax.core import KeyBounds, Mask, PairArrays, PallasCore, identity_view
from pallas_kernels import KernelConfig, flash_attention


def _token_mask(B, Lq, Lk, Hk, G, *, causal, window, q_off, k_off, kv_len, q_len, kv_valid):
    """The explicit ``(B, Hk * G, Lq, Lk)`` mask of every field (query head ``c * G + g``)."""
    t, p = np.arange(Lk), np.arange(Lq)
    m = np.ones((B, Hk, Lq, Lk), bool)
    m &= t[None, None, None, :] < np.asarray(kv_len)[:, :, None, None]
    m &= p[None, None, :, None] < np.asarray(q_len)[:, :, None, None]
    if kv_valid is not None:
        m &= np.asarray(kv_valid)[:, :, None, :]
    rel = (k_off + t)[None, :] - (q_off + p)[:, None]  # key minus query position
    if causal:
        m &= rel <= 0
    left, right = (window, window) if isinstance(window, int) else window
    m &= (rel >= -left) & (rel <= right)
    return np.repeat(m, G, axis=1)


# B, Lq, Lk, Hk, G, d, causal, window, dtype, per-key mask, tiles
CASES = [
    # GQA, a (left, right) band with causality, Lq != Lk, separate backward tiles
    (2, 40, 56, 2, 2, 16, True, (9, 4), "float32", True,
     KernelConfig(16, 16, block_q_dkv=16, block_k_dkv=32, block_q_dq=32, block_k_dq=16)),
    # MQA, a symmetric int band, no causality, half precision
    (1, 48, 48, 1, 3, 32, False, 7, "bfloat16", False, KernelConfig(16, 16)),
]


@functools.cache
def _band_program(i):
    """``jit((q, k, v, (dout, dlse), offsets, kv_len, q_len, kv_valid) -> (out, lse, (dq, dk,
    dv)))`` of ``CASES[i]``: one compiled program per case, shared by the tests below."""
    B, Lq, Lk, Hk, G, d, causal, window, dtype, per_key, cfg = CASES[i]

    @jax.jit
    def run(q, k, v, cot, offs, kv_len, q_len, kv_valid):
        f = functools.partial(flash_attention, scale=1.0 / np.sqrt(d), is_causal=causal,
                              window=window, q_offset=offs[0], k_offset=offs[1], kv_len=kv_len,
                              q_len=q_len, kv_valid=kv_valid if per_key else None,
                              block_sizes=cfg, interpret=STRICT)
        return _vjp(f)(q, k, v, cot)

    return run


@pytest.mark.parametrize("i", range(len(CASES)), ids=["gqa-causal-band-perkey-f32",
                                                      "mqa-band-bf16"])
def test_band_lengths_and_key_mask_match_the_oracle(i):
    """Two data sets per compiled function: traced offsets, kv_len, q_len (an empty head, a
    row past every key, whole query tiles past q_len) and per-key validity."""
    B, Lq, Lk, Hk, G, d, causal, window, dtype, per_key, cfg = CASES[i]
    rng = np.random.default_rng(Lq)
    q, k, v = _grouped_inputs(B, Lq, Lk, Hk, G, d, jnp.dtype(dtype), seed=Lk)
    scale = 1.0 / np.sqrt(d)
    run = _band_program(i)

    for offs in ((0, 6), (21, 3)):  # (0, 6): the first queries see no key
        kv_len = rng.integers(Lk // 2, Lk + 1, (B, Hk))
        q_len = rng.integers(Lq // 4, Lq + 1, (B, Hk))
        kv_len[0, 0], q_len[-1, -1] = 0, 0  # a head with no key, a head with no query
        kv_valid = rng.random((B, Hk, Lk)) < 0.7
        mask = _token_mask(B, Lq, Lk, Hk, G, causal=causal, window=window, q_off=offs[0],
                           k_off=offs[1], kv_len=kv_len, q_len=q_len,
                           kv_valid=kv_valid if per_key else None)
        ref, cot = _oracle(q, k, v, mask, scale, seed=offs[0])
        got = run(q, k, v, cot, jnp.asarray(offs, jnp.int32), jnp.asarray(kv_len, jnp.int32),
                  jnp.asarray(q_len, jnp.int32), jnp.asarray(kv_valid))
        _compare(got, ref, dtype, f"offsets {offs}")
        out, _, (dq, _, _) = got
        rows = np.arange(Lq)[None, :, None] >= q_len[:, None, :]  # (B, Lq, Hk)
        assert not np.asarray(out)[rows].any() and not np.asarray(dq)[rows].any()


def test_band_and_query_lengths_skip_tiles():
    """NaN where only a visited tile could read it: keys outside a query tile's band (forward
    and dq), queries outside a key tile's band and query tiles wholly past ``q_len`` (dk/dv).
    A visited tile would turn ``0 * NaN`` into NaN. On the compiled program of the MQA case
    (L = 48, band 7 on both sides, 16 x 16 tiles, no per-key mask, bfloat16)."""
    B, L, _, Hk, G, d = CASES[1][:6]
    q, k, v = _grouped_inputs(B, L, L, Hk, G, d, jnp.bfloat16)
    run = _band_program(1)

    def call(q, k, v, q_len):
        cot = (jnp.ones_like(q), jnp.zeros(q.shape[:-1], jnp.float32))
        out, _, grads = run(q, k, v, cot, jnp.zeros(2, jnp.int32),
                            jnp.full((B, Hk), L, jnp.int32), jnp.asarray(q_len, jnp.int32),
                            jnp.ones((B, Hk, L), bool))
        return np.asarray(out, np.float32), [np.asarray(g, np.float32) for g in grads]

    nan = lambda x, s: x.at[:, s].set(jnp.nan)  # noqa: E731
    # keys 32..47 lie in no band of queries 0..15 (theirs end at key 22)
    out, (dq, _, _) = call(q, nan(k, slice(32, 48)), nan(v, slice(32, 48)), [[L]])
    assert np.isfinite(out[:, :16]).all() and np.isfinite(dq[:, :16]).all()
    assert np.isnan(out[:, 25:48]).all()  # ... the queries that do read them
    # queries 32..47: outside the band of keys 0..15, and past q_len = 32 for every key tile
    out, (_, dk, dv) = call(nan(q, slice(32, 48)), k, v, [[32]])
    assert np.isfinite(dk).all() and np.isfinite(dv).all()
    assert not out[:, 32:].any()


def test_pallas_core_takes_every_mask_field_but_a_dense_bias():
    """PallasCore hands the band, per-key validity and query lengths to the kernels (their
    values through the dilated op: tests/test_registry.py's contract test) and raises for a
    dense bias or mask, which the registry never sends it (traced only, nothing runs)."""
    q, k, v = _grouped_inputs(1, 32, 32, 1, 2, 16, jnp.float32)
    q = q.reshape(1, 32, 2, 16)
    call = lambda mask: jax.eval_shape(functools.partial(  # noqa: E731
        PallasCore(interpret=True).forward, view=identity_view(1, 2), mask=mask, scale=0.3),
        q, k, v)
    out, lse = call(Mask(KeyBounds(kv_len=jnp.array([[30]]), is_causal=True,
                                   q_len=jnp.array([[20]]), window=(5, 2)),
                         PairArrays(kv_valid=jnp.arange(32)[None, None] % 3 != 1)))
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    with pytest.raises(ValueError, match="bias"):
        call(Mask(arrays=PairArrays(bias=jnp.zeros((1, 1, 32, 32)))))


def test_rows_past_query_lengths_dropped_for_kernels_without_them():
    """The cuDNN core (GPU only) applies query lengths to its result: rows at or past
    ``q_len`` get ``out = 0`` and ``lse = -inf``; checked here on CPU, against the lengths."""
    from dilax.core.interface import _drop_invalid_rows

    B, L, H = 2, 6, 2
    out = jnp.ones((B, L, H, 4))
    lse = jnp.zeros((B, L, H))
    q_len = jnp.array([[4], [0]])
    got, got_lse = _drop_invalid_rows(out, lse, identity_view(1, H),
                                      Mask(KeyBounds(q_len=q_len)), L)
    keep = np.arange(L)[None, :] < np.array([4, 0])[:, None]  # (B, L)
    np.testing.assert_array_equal(np.asarray(got), np.where(keep[..., None, None], 1.0, 0.0)
                                  * np.ones((B, L, H, 4)))
    np.testing.assert_array_equal(np.asarray(got_lse),
                                  np.where(keep[..., None], 0.0, -np.inf) * np.ones((B, L, H)))
