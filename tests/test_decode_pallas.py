"""The Pallas decode kernel (pallas_kernels/decode.py) in the Pallas interpreter.

* kernel level, in the strict interpreter (:data:`STRICT`: an out-of-bounds read raises):
  :func:`decode_attention` in bfloat16 equals the float64 oracle (tests/oracle.py, with the
  branches' key multiplicities built in NumPy from their definitions), as does its plain-jnp
  reference :func:`decode_reference`, for b > 1, t > 1, GQA with a group size that needs
  padding rows, mixture and grouped head ranges (one kv head serving two), a local window,
  the split-K merge (an explicit split count, one split empty) and each way the kernel reads
  a window: strided slices of cache rows (``pl.ds(row, block, r)``, moved back inside the
  cache at its end: the local window and branch ``(16, 4)`` at the last rows), unit-step
  tiles keeping every ``r``-th row for a cache shorter than ``r`` tiles (branch ``(32, 8)``),
  and a cache shorter than one tile (12 rows, padded to 16).
* through :func:`dilax.dilated_attention_decode`: ``implementation="pallas"`` equals the
  float64 oracle of causal dilated attention (the rows of :func:`dilax.dilated_attention`,
  which tests/test_dilated.py checks against it) over a schedule of padded chunks and single
  steps with rows of different lengths (SPEC.md, "Decoding with a KV cache"), in float32
  with two splits. These run with ``interpret=True`` (the only value dilax's ``interpret``
  takes): the strict interpreter spends ~10 ms per kernel program on its checked reads, and
  the schedules run ~600 programs.

(Decode has no gradient: the XLA decode is not differentiable either.)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracle import attention as oracle_attention
from test_pallas import STRICT
from tolerance import FP32, HALF, assert_scaled_close

import dilax
from dilax import KVCache, dilated_attention_decode, registry
from dilax.semantics import dilated_counts
from pallas_kernels.decode import DecodeBranch, DecodeConfig, decode_attention, decode_reference

# -- the kernel against the oracle ----------------------------------------------------------

_KB, _KT, _KH, _KHK, _KD, _KL = 2, 3, 6, 2, 16, 64  # G = 3: padded to 16 rows
_KBRANCHES = (
    DecodeBranch(64, 1, 64, (0, 6)),  # 4 tiles of 16: three splits, the last one empty
    # grouped-style head ranges (kv head 1 serves heads 3, 4, 5: both ranges) and offsets;
    # r * 16 > L = 64: unit-step tiles, every 8th row
    DecodeBranch(32, 8, 4, (0, 4), offset=1),
    DecodeBranch(16, 4, 4, (4, 6), offset=0),  # stride-4 tiles, moved back at the cache end
    DecodeBranch(None, 1, 4, (0, 6)),  # local window W = 3
)


def _branch_weights(pos, branches, h: int, L: int) -> np.ndarray:
    """``(b, h, t, L)`` key multiplicities of SPEC.md's decode branches, in NumPy from the
    definitions (not :meth:`DecodeBranch.keys`): dilated ``(w, r)``: the keys of ``p``'s
    segment in ``p``'s offset class up to ``p``, for the heads whose offset is ``p % r``;
    the local window: keys ``p - W .. p``. A key two branches give counts twice."""
    pos = np.asarray(pos)
    key = np.arange(L)
    weights = np.zeros((pos.shape[0], h, pos.shape[1], L))
    for (b, i), p in np.ndenumerate(pos):
        for br in branches:
            if br.segment is None:
                keys = (key <= p) & (key >= p - (br.window - 1))
            else:
                keys = (key <= p) & (key // br.segment == p // br.segment)
                keys &= key % br.stride == p % br.stride
            for head in range(*br.heads):
                offset = head % br.stride if br.offset is None else br.offset
                if br.segment is None or br.stride == 1 or p % br.stride == offset:
                    weights[b, head, i] += keys
    return weights


def test_kernel_bf16_equals_oracle():
    """bfloat16 inputs (float32 statistics) in the strict interpreter against the float64
    oracle on the same values, and the jnp reference; float32 through
    ``dilated_attention_decode`` below."""
    dtype = jnp.bfloat16
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(ks[0], (_KB, _KT, _KH, _KD)).astype(dtype)
    kc = jax.random.normal(ks[1], (_KB, _KL, _KHK, _KD)).astype(dtype)
    vc = jax.random.normal(ks[2], (_KB, _KL, _KHK, _KD)).astype(dtype)
    # segment starts, ends, a full window, p = 0, the last cache row
    pos = jnp.array([[0, 31, 63], [5, 47, 48]], jnp.int32)
    kernel = functools.partial(decode_attention, branches=_KBRANCHES, scale=0.3,
                               config=DecodeConfig(16, num_splits=3), interpret=STRICT)
    tiny = 12  # a cache shorter than a tile (padded to 16 rows), in the same program

    @jax.jit
    def run(q, kc, vc, pos):
        f32 = (x.astype(jnp.float32) for x in (q, kc, vc))  # the same values, in float32
        return (kernel(q, kc, vc, pos), kernel(q, kc[:, :tiny], vc[:, :tiny], pos % tiny),
                decode_reference(*f32, pos, branches=_KBRANCHES, scale=0.3))

    oracles = [oracle_attention(q, kc[:, :L], vc[:, :L], _branch_weights(p, _KBRANCHES, _KH, L),
                                0.3) for p, L in ((pos, _KL), (pos % tiny, tiny), (pos, _KL))]
    for (out, lse), oracle, tol in zip(run(q, kc, vc, pos), oracles, (HALF, HALF, FP32)):
        assert_scaled_close(out, oracle.out, tol)  # the kernel rounds P to bf16 for P @ V
        assert_scaled_close(lse, oracle.lse, tol)
        assert out.dtype == lse.dtype == jnp.float32
    with pytest.raises(ValueError, match=r"a power of two in \[16, 256\] \(cache rows"):
        jax.eval_shape(lambda: decode_attention(
            jnp.zeros((1, 1, 2, 24)), jnp.zeros((1, 8, 1, 24)), jnp.zeros((1, 8, 1, 24)),
            jnp.zeros((1, 1), jnp.int32), branches=_KBRANCHES[:1], scale=1.0))


# -- through dilated_attention_decode ---------------------------------------------------------

B, H, HK, D, N = 2, 4, 2, 16, 72
# Branch (128, 2) has 36-key windows on a 72-position cache: two 32-key float32 tiles, so the
# step runs two splits (the first alone for queries early in the segment).
WS, RS, WINDOW = (16, 128), (1, 2), 5
CHUNK, CHUNKS, STEPS = 8, 8, 4  # row 1 brings 5 of each chunk: lengths 64 / 40, then steps


def _inputs(seed):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (np.asarray(jax.random.normal(ks[0], (B, N, H, D))),
            np.asarray(jax.random.normal(ks[1], (B, N, HK, D))),
            np.asarray(jax.random.normal(ks[2], (B, N, HK, D))))


def _schedule(q, k, v, steps, **cfg):
    """Padded chunks (row 1 brings fewer positions), then ``steps`` single steps, under jit
    with the cache donated; returns ``[(row, start, out_rows)]`` of the valid rows."""
    step = jax.jit(functools.partial(dilated_attention_decode, **cfg), donate_argnums=3)
    cache, lengths, got = KVCache.init(B, N, HK, D), np.zeros(B, int), []
    for count in [np.array([CHUNK, 5])] * CHUNKS + [np.array([1, 1])] * steps:
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
def test_pallas_decode_equals_oracle_and_causal_rows(mode):
    """Mixture with a local window, given as one settings value, over chunks and steps;
    grouped, given as keywords, over the chunks. (The XLA decode equals the same oracle in
    tests/test_decode.py.)"""
    q, k, v = _inputs(seed=3)
    window = WINDOW if mode == "mixture" else None
    counts = dilated_counts(N, H, WS, RS, mode, True, local_window=window)
    oracle = oracle_attention(q, k, v, counts[None], 1.0 / np.sqrt(D)).out
    if mode == "grouped":
        oracle = oracle / len(WS)
    if mode == "mixture":
        settings = dilax.DilatedSettings(WS, RS, local_window=WINDOW, implementation="pallas",
                                         interpret=True)
        got = _schedule(q, k, v, STEPS, settings=settings)
    else:
        got = _schedule(q, k, v, 0, segment_lengths=WS, dilation_rates=RS, mode=mode,
                        implementation="pallas", interpret=True)
    for row, start, out in got:
        rows = slice(start, start + out.shape[0])
        assert_scaled_close(out, oracle[row, rows], FP32, err_msg=f"{mode} row {row} at {start}")


def test_pallas_decode_is_chosen_and_settings_are_one_value():
    # implementation=None: the kernel on GPU (and in the interpreter), XLA on the CPU
    req = registry.CoreRequest("decode", "bfloat16", 128, True, has_window=True,
                               has_lengths=True)
    for platform, interpret, want in (("gpu", False, "pallas"), ("cpu", False, "xla"),
                                      ("cpu", True, "pallas")):
        got = registry.choose(None, dataclasses.replace(req, platform=platform,
                                                        interpret=interpret))[0]
        assert got == want, (platform, interpret)
    q = jnp.zeros((B, 1, H, D))
    kv = jnp.zeros((B, 1, HK, D))
    cache = KVCache.init(B, N, HK, D)
    with pytest.raises(TypeError, match="settings= holds the whole configuration"):
        dilated_attention_decode(q, kv, kv, cache, WS, RS, settings=dilax.DilatedSettings(WS, RS))
    with pytest.raises(ValueError, match="must be divisible by dilation_rates"):
        dilated_attention_decode(q, kv, kv, cache, (16, 129), RS)
