"""KV cache overflow under ``jit`` (issue 30): positions past ``max_len`` are never written,
output 0 and set the row's sticky ``overflow`` flag; earlier entries and outputs are intact."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerance import FP32, assert_scaled_close

from dilax import KVCache, dilated_attention, dilated_attention_decode

MAX, STEPS, H, HK, D = 8, 10, 2, 1, 4
WS, RS = (4, 8), (1, 2)
_decode = functools.partial(dilated_attention_decode, segment_lengths=WS, dilation_rates=RS)


def _qkv(b, n, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (np.asarray(jax.random.normal(k1, (b, n, H, D))),
            np.asarray(jax.random.normal(k2, (b, n, HK, D))),
            np.asarray(jax.random.normal(k3, (b, n, HK, D))))


def test_jitted_steps_past_max_len_set_the_flag_and_write_nothing():
    q, k, v = _qkv(1, STEPS)
    step = jax.jit(_decode, donate_argnums=3)
    cache = KVCache.init(1, MAX, HK, D)
    outs, flags, lengths = [], [], []
    for i in range(STEPS):
        out, cache = step(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], cache)
        outs.append(np.asarray(out[:, 0]))
        flags.append(bool(cache.overflow[0]))
        lengths.append(int(cache.lengths[0]))
    assert flags == [False] * MAX + [True] * (STEPS - MAX)  # sticky from the first overflow
    assert lengths == list(range(1, MAX + 1)) + [MAX] * (STEPS - MAX)
    # nothing past max_len was written (not even clipped onto the last row): the cache holds
    # exactly the first MAX keys and values
    np.testing.assert_array_equal(np.asarray(cache.k), k[:, :MAX])
    np.testing.assert_array_equal(np.asarray(cache.v), v[:, :MAX])
    # the steps that fit equal causal dilated attention over the first MAX positions
    full = dilated_attention(jnp.asarray(q[:, :MAX]), jnp.asarray(k[:, :MAX]),
                             jnp.asarray(v[:, :MAX]), WS, RS, is_causal=True,
                             implementation="reference")
    assert_scaled_close(np.stack(outs[:MAX], 1), full, FP32)
    np.testing.assert_array_equal(np.stack(outs[MAX:], 1), 0.0)


def test_a_chunk_that_overflows_keeps_the_positions_that_fit():
    q, k, v = _qkv(2, MAX + 2, seed=1)
    step = jax.jit(_decode)
    prefill, t = 6, 4  # positions 6, 7 fit; 8, 9 do not
    _, cache = step(q[:, :prefill], k[:, :prefill], v[:, :prefill], KVCache.init(2, MAX, HK, D))
    # row 1 brings only 2 positions (padding past them is not an overflow)
    out, cache = step(q[:, prefill:], k[:, prefill:], v[:, prefill:], cache,
                      query_seq_lengths=jnp.array([t, 2]))
    assert np.asarray(cache.overflow).tolist() == [True, False]
    assert np.asarray(cache.lengths).tolist() == [MAX, MAX]
    np.testing.assert_array_equal(np.asarray(cache.k), k[:, :MAX])
    full = dilated_attention(jnp.asarray(q[:, :MAX]), jnp.asarray(k[:, :MAX]),
                             jnp.asarray(v[:, :MAX]), WS, RS, is_causal=True,
                             implementation="reference")
    assert_scaled_close(np.asarray(out)[:, :2], np.asarray(full)[:, prefill:], FP32)
    np.testing.assert_array_equal(np.asarray(out)[:, 2:], 0.0)


def test_concrete_overflow_still_raises_and_hand_built_caches_work():
    q, k, v = _qkv(1, 2)
    cache = KVCache.init(1, MAX, HK, D).with_lengths(jnp.array([MAX - 1]))
    with pytest.raises(ValueError, match=r"writing t=2 positions past cache lengths \[7\] "
                                         r"overflows max_len=8"):
        _decode(q, k, v, cache)
    # a KVCache built by hand without the flag: no overflow so far
    bare = KVCache(cache.k, cache.v, jnp.array([MAX - 1]))
    _, after = jax.jit(_decode)(q, k, v, bare)
    assert np.asarray(after.overflow).tolist() == [True]
