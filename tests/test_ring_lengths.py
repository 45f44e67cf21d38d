"""Ring attention with valid lengths and the local-window branch vs the float64 oracle of
the mask-based definition with the same arguments (SPEC.md, "Valid lengths", "Local window
branch", "Ring"; ``tests/ring_oracle.py``, nothing to compile): forward output and input
gradients of ``ring_dilated_attention`` inside a user's ``jax.shard_map``.

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
from jax.sharding import PartitionSpec as Ps
from ring_oracle import assert_matches
from ring_oracle import dilated as dilated_oracle
from test_ring import _FAST
from test_ring import _inputs as ring_inputs

from dilax import ring_dilated_attention, sharded_dilated_attention
from dilax.sp import zigzag_permutation

P, N = 4, 96
WS, RS = (12, 16, 40), (1, 2, 2)
# Rows of different lengths, 0 and n included; query and key lengths differ. The lengths are
# traced: the second set runs on the same compiled program.
Q_LEN = np.array([96, 0, 50], np.int32)
KV_LEN = np.array([37, 96, 0], np.int32)
LENGTHS = ((Q_LEN, KV_LEN), (np.array([13, 71, 96], np.int32), np.array([96, 24, 59], np.int32)))


@pytest.fixture(autouse=True, scope="module")
def _eight_devices():
    assert jax.device_count() >= P, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"


def _inputs(b=3, h=4, hk=2, d=8, seed=0):
    return ring_inputs(b, N, h, hk, d, seed)


def _value_and_grads(fn, q, k, v, g, q_len, kv_len):
    """The compiled ``(q, k, v, g, q_len, kv_len) -> (out, (dq, dk, dv))``."""
    def run(q, k, v, g, q_len, kv_len):  # lengths traced: one compile for any values
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, q_len, kv_len), q, k, v)
        return out, vjp(g)

    return jax.jit(run).lower(q, k, v, g, q_len, kv_len).compile(compiler_options=_FAST)


def _check(is_causal, layout="contiguous", window=None, ws=WS, rs=RS, check_vma=True):
    """``ring_dilated_attention`` as a user calls it, inside their ``jax.shard_map`` (with its
    default checks, ``check_vma=True``: every loop carry and cond typed as device-varying, or
    without), the lengths replicated; zigzag: on shards the user permuted with
    ``zigzag_permutation``, the result and gradients brought back to natural order."""
    q, k, v, g = _inputs()
    mesh = jax.make_mesh((P,), ("sp",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:P])
    spec = Ps(None, "sp")
    per_device = jax.shard_map(
        lambda q, k, v, ql, kl: ring_dilated_attention(
            q, k, v, ws, rs, axis_name="sp", is_causal=is_causal, layout=layout,
            local_window=window, query_seq_lengths=ql, key_value_seq_lengths=kl),
        mesh=mesh, in_specs=(spec,) * 3 + (Ps(),) * 2, out_specs=spec, check_vma=check_vma)
    perm = zigzag_permutation(N, P) if layout == "zigzag" else np.arange(N)
    inverse = np.argsort(perm)
    ring = lambda q, k, v, ql, kl: per_device(q[:, perm], k[:, perm], v[:, perm], ql,
                                              kl)[:, inverse]
    compiled = _value_and_grads(ring, q, k, v, g, *LENGTHS[0])
    for q_len, kv_len in LENGTHS:
        out, grads = compiled(q, k, v, g, q_len, kv_len)
        assert_matches(out, grads, dilated_oracle(q, k, v, g, ws, rs, is_causal, q_len, kv_len,
                                                  window), err_msg=f"lengths {q_len} {kv_len}")
        # rows past q_len: exactly 0 (and no NaN anywhere)
        pos = np.arange(N)[None, :]
        assert np.all(np.asarray(out)[pos >= np.asarray(q_len)[:, None]] == 0)
        assert np.all(np.isfinite(np.asarray(out)))


# Two compiles, both with valid lengths and the local window (W = 5 <= the local chunk, 12 with
# zigzag: halos from both neighbouring chunks, from the left one only when causal), both the
# direct call as a user writes it (the alias runs this per-device ring in its own shard_map,
# with check_vma=True for these XLA cores; the alias's lengths: test_ring_pallas.py's causal
# test, its relayout: test_ring.py's test_zigzag_layout). Causal contiguous, with shard_map's
# default checks: all three kinds of ring branch. Zigzag (two chunks per device, so chunk
# starts that are not device starts), on pre-permuted shards with check_vma=False: a local and
# a single-segment ring branch (the zigzag halo and two-candidate ring programs take several
# times longer to compile on CPU).
def test_lengths_and_window_contiguous_causal_direct_call():
    _check(True, window=5)


def test_lengths_and_window_zigzag_direct_call_no_vma_check():
    _check(False, layout="zigzag", window=5, ws=(12, 96), rs=(2, 4), check_vma=False)


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
