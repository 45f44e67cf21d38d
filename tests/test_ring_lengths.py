"""Ring attention with valid lengths and the local-window branch vs single-device
``dilated_attention`` with the same arguments (SPEC.md, "Valid lengths", "Local window
branch", "Ring"): forward output and input gradients.

Needs 4 host devices (``tests/conftest.py`` sets ``XLA_FLAGS``). One geometry covers the three
kinds of ring branch: on ``P = 4`` devices of ``n/P = 24`` positions, ``w = 12`` is local,
``w = 16`` (not aligned with shards) is a halo branch and ``w = 40`` spans devices (ring, two
segment candidates per block, last segment shorter).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import AxisType
from test_ring import _FAST
from test_ring import _inputs as ring_inputs
from tolerance import assert_scaled_close

from dilax import dilated_attention, sharded_dilated_attention

P, N = 4, 96
WS, RS = (12, 16, 40), (1, 2, 2)
# Rows of different lengths, 0 and n included; query and key lengths differ.
Q_LEN = np.array([96, 0, 50], np.int32)
KV_LEN = np.array([37, 96, 0], np.int32)


@pytest.fixture(autouse=True, scope="module")
def _eight_devices():
    assert jax.device_count() >= P, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"


def _inputs(b=3, h=4, hk=2, d=8, seed=0):
    return ring_inputs(b, N, h, hk, d, seed)


def _value_and_grads(fn, q, k, v, g, q_len, kv_len):
    def run(q, k, v, g, q_len, kv_len):  # lengths traced: one compile for any values
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, q_len, kv_len), q, k, v)
        return out, vjp(g)

    args = (q, k, v, g, q_len, kv_len)
    return jax.jit(run).lower(*args).compile(compiler_options=_FAST)(*args)


def _check(is_causal, layout="contiguous", window=None, q_len=Q_LEN, kv_len=KV_LEN, ws=WS,
           rs=RS):
    q, k, v, g = _inputs()
    mesh = jax.make_mesh((P,), ("sp",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:P])
    ring = lambda q, k, v, ql, kl: sharded_dilated_attention(
        q, k, v, ws, rs, mesh=mesh, is_causal=is_causal, layout=layout, local_window=window,
        query_seq_lengths=ql, key_value_seq_lengths=kl)
    ref = lambda q, k, v, ql, kl: dilated_attention(
        q, k, v, ws, rs, is_causal=is_causal, implementation="reference", local_window=window,
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


# Two compiles, both with valid lengths and the local window (W = 5 <= the local chunk, 12 with
# zigzag: halos from both neighbouring chunks, from the left one only when causal). Causal
# contiguous: all three kinds of ring branch. Zigzag (two chunks per device, so chunk starts
# that are not device starts): a local and a single-segment ring branch (the zigzag halo and
# two-candidate ring programs take several times longer to compile on CPU).
def test_lengths_and_window_contiguous_causal():
    _check(True, window=5)


def test_lengths_and_window_zigzag():
    _check(False, layout="zigzag", window=5, ws=(12, 96), rs=(2, 4))


def test_errors():
    q, k, v, _ = _inputs()
    mesh = jax.make_mesh((P,), ("sp",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:P])
    call = lambda **kw: sharded_dilated_attention(q, k, v, WS, RS, mesh=mesh, **kw)
    with pytest.raises(ValueError, match="local_window=13 must be at most the local chunk"):
        call(local_window=13, layout="zigzag")  # chunk of n/(2P) = 12
    with pytest.raises(ValueError, match="local_window"):
        call(local_window=2, mode="grouped")
    with pytest.raises(ValueError, match=r"key_value_seq_lengths must lie in \[0, n=96\]"):
        call(key_value_seq_lengths=np.array([1, 97, 3]))
    with pytest.raises(ValueError, match="query_seq_lengths must have shape"):
        call(query_seq_lengths=np.array([1, 2]))
