"""The Pallas decode kernel (pallas_kernels/decode.py) in the Pallas interpreter.

* kernel level: :func:`decode_attention` equals its plain-jnp reference
  :func:`decode_reference` (gathered windows, dense softmax) for b > 1, t > 1, GQA with a
  group size that needs padding rows, mixture and grouped head ranges, a local window, and
  the split-K merge (an explicit split count, one split empty); float32 and bfloat16.
* through :func:`dilax.dilated_attention_decode`: ``implementation="pallas"`` equals the
  float64 oracle (tests/oracle.py), the rows of causal :func:`dilax.dilated_attention` and
  the XLA decode, over a schedule of padded chunks and single steps with rows of different
  lengths (SPEC.md, "Decoding with a KV cache").

The strict interpreter (``pltpu.InterpretParams``) refuses gathered (advanced-index) reads,
which this kernel is made of, so these run with ``interpret=True``; the kernel clamps every
row index into the cache, so no read is out of bounds by construction.
(Decode has no gradient: the XLA decode is not differentiable either.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracle import attention as oracle_attention
from tolerance import FP32, HALF, assert_scaled_close

import dilax
from dilax import KVCache, dilated_attention_decode, registry
from dilax.semantics import dilated_counts
from pallas_kernels.decode import DecodeBranch, DecodeConfig, decode_attention, decode_reference

# -- the kernel against its reference -------------------------------------------------------

_KB, _KT, _KH, _KHK, _KD, _KL = 2, 3, 6, 2, 16, 64  # G = 3: padded to 16 rows
_KBRANCHES = (
    DecodeBranch(64, 1, 64, (0, 6)),  # 4 tiles of 16: three splits, the last one empty
    DecodeBranch(32, 2, 16, (0, 3), offset=1),  # grouped-style head ranges and offsets
    DecodeBranch(16, 4, 4, (3, 6), offset=0),
    DecodeBranch(None, 1, 4, (0, 6)),  # local window W = 3
)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_equals_reference(dtype):
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(ks[0], (_KB, _KT, _KH, _KD)).astype(dtype)
    kc = jax.random.normal(ks[1], (_KB, _KL, _KHK, _KD)).astype(dtype)
    vc = jax.random.normal(ks[2], (_KB, _KL, _KHK, _KD)).astype(dtype)
    # segment starts, ends, a full window, p = 0, the last cache row
    pos = jnp.array([[0, 31, 63], [5, 47, 48]], jnp.int32)
    run = jax.jit(functools.partial(decode_attention, branches=_KBRANCHES, scale=0.3,
                                    config=DecodeConfig(16, num_splits=3), interpret=True))
    out, lse = run(q, kc, vc, pos)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731  (the reference from the same inputs)
    ref_out, ref_lse = decode_reference(f32(q), f32(kc), f32(vc), pos, branches=_KBRANCHES,
                                        scale=0.3)
    tol = FP32 if dtype == jnp.float32 else HALF  # bf16: P is rounded to bf16 for P @ V
    assert_scaled_close(out, ref_out, tol)
    assert_scaled_close(lse, ref_lse, tol)
    assert out.dtype == lse.dtype == jnp.float32
    with pytest.raises(ValueError, match=r"a power of two in \[16, 256\] \(cache rows"):
        jax.eval_shape(lambda: decode_attention(
            jnp.zeros((1, 1, 2, 24)), jnp.zeros((1, 8, 1, 24)), jnp.zeros((1, 8, 1, 24)),
            jnp.zeros((1, 1), jnp.int32), branches=_KBRANCHES[:1], scale=1.0))


# -- through dilated_attention_decode ---------------------------------------------------------

B, H, HK, D, N = 2, 4, 2, 16, 72
WS, RS, WINDOW = (16, 64), (1, 2), 5
CHUNK, CHUNKS, STEPS = 8, 8, 4  # row 1 brings 5 of each chunk: lengths 64 / 40, then steps


def _inputs(seed):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (np.asarray(jax.random.normal(ks[0], (B, N, H, D))),
            np.asarray(jax.random.normal(ks[1], (B, N, HK, D))),
            np.asarray(jax.random.normal(ks[2], (B, N, HK, D))))


def _schedule(q, k, v, **cfg):
    """Padded chunks (row 1 brings fewer positions), then single steps, under jit with the
    cache donated; returns ``[(row, start, out_rows)]`` of the valid rows."""
    step = jax.jit(functools.partial(dilated_attention_decode, segment_lengths=WS,
                                     dilation_rates=RS, **cfg), donate_argnums=3)
    cache, lengths, got = KVCache.init(B, N, HK, D), np.zeros(B, int), []
    counts = [np.array([CHUNK, 5])] * CHUNKS + [np.array([1, 1])] * STEPS
    for count in counts:
        t = 1 if count.max() == 1 else CHUNK
        new = [np.stack([x[i, lengths[i]:lengths[i] + t] for i in range(B)]) for x in (q, k, v)]
        out, cache = step(*new, cache, query_seq_lengths=None if t == 1 else count)
        out = np.asarray(out)
        for i in range(B):
            got.append((i, int(lengths[i]), out[i, :count[i]]))
            np.testing.assert_array_equal(out[i, count[i]:], 0.0)  # padded rows
        lengths = lengths + count
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)
    return got


@pytest.mark.parametrize("mode", ["mixture", "grouped"])
def test_pallas_decode_equals_oracle_full_op_and_xla(mode):
    q, k, v = _inputs(seed=3)
    window = WINDOW if mode == "mixture" else None
    counts = dilated_counts(N, H, WS, RS, mode, True, local_window=window)
    oracle = oracle_attention(q, k, v, counts[None], 1.0 / np.sqrt(D)).out
    if mode == "grouped":
        oracle = oracle / len(WS)
    full = np.asarray(dilax.dilated_attention(q, k, v, WS, RS, is_causal=True, mode=mode,
                                              local_window=window))
    got = _schedule(q, k, v, mode=mode, local_window=window, implementation="pallas",
                    interpret=True)
    for row, start, out in got:
        rows = slice(start, start + out.shape[0])
        assert_scaled_close(out, oracle[row, rows], FP32, err_msg=f"{mode} row {row} at {start}")
        assert_scaled_close(out, full[row, rows], FP32, err_msg=f"{mode} row {row} at {start}")
    if mode == "mixture":  # the XLA decode over the same schedule, output for output
        for (_, _, a), (_, _, b) in zip(got, _schedule(q, k, v, local_window=window)):
            assert_scaled_close(a, b, FP32)


def test_pallas_decode_is_chosen_and_settings_go_through_whole():
    # implementation=None: the kernel on GPU (and in the interpreter), XLA on the CPU
    req = registry.CoreRequest("decode", "bfloat16", 128, True, has_window=True,
                               has_lengths=True)
    assert registry.choose(None, registry.dataclasses.replace(req, platform="gpu"))[0] == "pallas"
    assert registry.choose(None, registry.dataclasses.replace(req, platform="cpu"))[0] == "xla"
    # settings= is the same call as the keywords (one value, passed whole to the jitted step)
    q, k, v = (jnp.asarray(x[:, :3]) for x in _inputs(seed=4))
    s = dilax.DilatedSettings(WS, RS, local_window=WINDOW, implementation="pallas",
                              interpret=True)
    cache = KVCache.init(B, N, HK, D)
    by_settings, _ = dilated_attention_decode(q, k, v, cache, settings=s)
    by_keywords, _ = dilated_attention_decode(q, k, v, cache, WS, RS, local_window=WINDOW,
                                              implementation="pallas", interpret=True)
    np.testing.assert_array_equal(np.asarray(by_settings), np.asarray(by_keywords))
    with pytest.raises(TypeError, match="settings= holds the whole configuration"):
        dilated_attention_decode(q, k, v, cache, WS, RS, settings=s)
