"""Ring attention with valid lengths and the local-window branch vs single-device
``dilated_attention`` with the same arguments (SPEC.md, "Valid lengths", "Local window
branch", "Ring"): forward output and input gradients.

Needs 8 host devices (``tests/conftest.py`` sets ``XLA_FLAGS``). One geometry covers the three
kinds of ring branch: on ``P = 8`` devices of ``n/P = 12`` positions, ``w = 12`` is local,
``w = 8`` (not aligned with shards) is a halo branch and ``w = 28`` spans devices (ring).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from tolerance import assert_scaled_close

from dilax import dilated_attention, sharded_dilated_attention

P, N = 8, 96
WS, RS = (8, 12, 28), (1, 2, 2)
# Rows of different lengths, 0 and n included; query and key lengths differ.
Q_LEN = np.array([96, 0, 50], np.int32)
KV_LEN = np.array([37, 96, 0], np.int32)


@pytest.fixture(autouse=True, scope="module")
def _eight_devices():
    assert jax.device_count() >= 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"


def _inputs(b=3, h=4, hk=2, d=8, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(ks[0], (b, N, h, d), jnp.float32)
    k = jax.random.normal(ks[1], (b, N, hk, d), jnp.float32)
    v = jax.random.normal(ks[2], (b, N, hk, d), jnp.float32)
    g = jax.random.normal(ks[3], (b, N, h, d), jnp.float32)
    return q, k, v, g


def _value_and_grads(fn, q, k, v, g, q_len, kv_len):
    @jax.jit
    def run(q, k, v, g, q_len, kv_len):  # lengths traced: one compile for any values
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, q_len, kv_len), q, k, v)
        return out, vjp(g)

    return run(q, k, v, g, q_len, kv_len)


def _check(is_causal, layout="contiguous", window=None, q_len=Q_LEN, kv_len=KV_LEN):
    q, k, v, g = _inputs()
    mesh = jax.make_mesh((P,), ("sp",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:P])
    ring = lambda q, k, v, ql, kl: sharded_dilated_attention(
        q, k, v, WS, RS, mesh=mesh, is_causal=is_causal, layout=layout, local_window=window,
        query_seq_lengths=ql, key_value_seq_lengths=kl)
    ref = lambda q, k, v, ql, kl: dilated_attention(
        q, k, v, WS, RS, is_causal=is_causal, implementation="reference", local_window=window,
        query_seq_lengths=ql, key_value_seq_lengths=kl)
    out, grads = _value_and_grads(ring, q, k, v, g, q_len, kv_len)
    ref_out, ref_grads = _value_and_grads(ref, q, k, v, g, q_len, kv_len)
    assert_scaled_close(out, ref_out)
    for name, a, e in zip("qkv", grads, ref_grads, strict=True):
        assert_scaled_close(a, e, err_msg=f"d{name}")
    # rows past q_len: exactly 0 (and no NaN anywhere)
    pos = np.arange(N)[None, :]
    assert np.all(np.asarray(out)[pos >= np.asarray(q_len)[:, None]] == 0)
    assert np.all(np.isfinite(np.asarray(out)))


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_lengths_match_single_device(is_causal):
    _check(is_causal)


@pytest.mark.parametrize("layout, is_causal", [("zigzag", False), ("contiguous", True)])
def test_local_window_matches_single_device(layout, is_causal):
    # W = 5 <= the chunk length (6 with zigzag): halos from both neighbours (one when causal)
    _check(is_causal, layout=layout, window=5)
