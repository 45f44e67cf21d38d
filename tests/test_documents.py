"""Packed documents (docs/semantics.md, "Packed documents"): a packed row equals each of its
documents computed alone, by the float64 oracle (tests/oracle.py), forward and gradients."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dilax
from dilax.attention_mask import document_bounds, document_positions
from dilax.dilated.documents import run_tiles, sequence_bounds
from dilax.reference import dilated_counts
from tests import oracle
from tests.tolerance import FP32, HALF, assert_scaled_close

# Two branches, a local one and a dilated one (compile time grows with the branch count, ~1.7
# CPU-s per branch for forward and gradients; the merge of several branches and uneven grouped
# head splits are the same code with or without documents, tested in test_dilated*.py).
WS, RS = (8, 32), (1, 4)
N, H, HK, D = 64, 4, 2, 8
# Row 0: one-token documents, documents shorter than both segments, between them (16), equal
# to (32) and longer than one; row 1: one document past every segment, a one-token one and a
# short tail.
CUTS = ((0, 1, 2, 9, 25, 57), (0, 40, 41, 48))


def _ids(cuts=CUTS, n=N):
    ids = np.zeros((len(cuts), n), np.int32)
    for i, c in enumerate(cuts):
        for j, s in enumerate(c):
            ids[i, s:] = 7 * j + 3  # any integer ids: documents are runs
    return ids


TILES = (4, 8, 4, 8)


def _data(seed, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q, k, v, g = (jnp.asarray(rng.normal(size=(2, N, h, D)), dtype)
                  for h in (H, HK, HK, H))
    return q, k, v, g


def _alone(q, k, v, g, mode, causal, window, q_len=None, kv_len=None, ws=WS, rs=RS):
    """Each document of each row through the oracle on its own; padded positions keep their
    row index (lengths are row positions)."""
    out, dq = np.zeros(q.shape), np.zeros(q.shape)
    dk, dv = np.zeros(k.shape), np.zeros(v.shape)
    for i, cuts in enumerate(CUTS):
        for s, e in zip(cuts, (*cuts[1:], N)):
            L = e - s
            counts = dilated_counts(L, H, ws, rs, mode, causal, window).astype(np.float64)
            pos = np.arange(s, e)
            if q_len is not None:
                counts = counts * (pos < q_len[i])[None, :, None]
            if kv_len is not None:
                counts = counts * (pos < kv_len[i])[None, None, :]
            G = len(ws) if mode == "grouped" else 1
            r = oracle.attention(q[i:i + 1, s:e], k[i:i + 1, s:e], v[i:i + 1, s:e], counts,
                                 1 / np.sqrt(D), oracle.f64(g[i:i + 1, s:e]) / G)
            out[i, s:e], dq[i, s:e] = r.out[0] / G, r.dq[0]
            dk[i, s:e], dv[i, s:e] = r.dk[0], r.dv[0]
    return out, dq, dk, dv


def _attend(q, k, v, ids, q_len, kv_len, mode, causal, window, lengths, tiles=None):
    return dilax.dilated_attention(
        q, k, v, WS, RS, mode=mode, is_causal=causal, local_window=window,
        segment_ids=ids, implementation="xla",
        # small tiles: blocks inside, across and at the edges of the key runs
        block_sizes=dilax.core.BlockSizes(*tiles) if tiles else
        dilax.core.BlockSizes(8, 16, 16, 8) if lengths else None,
        query_seq_lengths=q_len if lengths else None,
        key_value_seq_lengths=kv_len if lengths else None)


@functools.cache
def _program(mode, causal, window, lengths, tiles=None):
    def loss(q, k, v, g, ids, q_len, kv_len):
        out = _attend(q, k, v, ids, q_len, kv_len, mode, causal, window, lengths, tiles)
        return jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32)), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


# Mixture, non-causal with the default tiles runs in bfloat16 below (float32: default tiles
# in the grouped case, mixture non-causal with the small tiles), one compile fewer.
@pytest.mark.parametrize("mode,causal,window,lengths,tiles", [
    # tiles no longer than the runs (w / r = 8 rows): unmasked blocks inside a run, both
    # passes, blocks starting mid-block and last blocks shifted back to fit
    ("mixture", False, None, False, TILES),
    ("mixture", True, 3, True, None),
    ("grouped", True, None, False, None),
])
def test_packed_row_equals_documents_alone(mode, causal, window, lengths, tiles):
    q_len, kv_len = np.array([50, 64]), np.array([60, 44])
    ids = jnp.asarray(_ids())
    for seed in (0, 1):  # data varies, the program does not
        q, k, v, g = _data(seed)
        (_, out), grads = _program(mode, causal, window, lengths, tiles)(
            q, k, v, g, ids, jnp.asarray(q_len), jnp.asarray(kv_len))
        want = _alone(q, k, v, g, mode, causal, window, *((q_len, kv_len) if lengths else ()))
        for got, exp, name in zip((out, *grads), want, ("out", "dq", "dk", "dv")):
            assert_scaled_close(got, exp, FP32, err_msg=f"{name} seed={seed}")
    if tiles:  # without gradients the mixture merges the branches as they come
        out = jax.jit(functools.partial(_attend, mode=mode, causal=causal, window=window,
                                        lengths=lengths, tiles=tiles))(
            q, k, v, ids, jnp.asarray(q_len), jnp.asarray(kv_len))
        assert_scaled_close(out, want[0], FP32, err_msg="forward without gradients")


def test_packed_bfloat16_and_one_document_is_the_plain_op():
    q, k, v, g = _data(2, jnp.bfloat16)  # mixture, non-causal, default tiles
    (_, out), grads = _program("mixture", False, None, False)(
        q, k, v, g, jnp.asarray(_ids()), jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32))
    want = _alone(q, k, v, g, "mixture", False, None)
    for got, exp in zip((out, *grads), want):
        assert_scaled_close(got, exp, HALF)
    # one document per row: the op without segment_ids, by the oracle (float32: the program
    # of test_packed_row_equals_documents_alone's small tiles, compiled once for both tests)
    q, k, v, g = _data(3)
    (_, one), grads = _program("mixture", False, None, False, TILES)(
        q, k, v, g, jnp.ones((2, N), jnp.int32), jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32))
    want = oracle.dilated(q, k, v, WS, RS, "mixture", False, dout=g)
    for got, exp in zip((one, *grads), (want.out, want.dq, want.dk, want.dv)):
        assert_scaled_close(got, exp, FP32)


def test_document_tables():
    # one program (eager calls would compile each primitive on its own)
    start, end, positions = jax.jit(lambda ids: (*document_bounds(ids), document_positions(ids)))(
        jnp.asarray(_ids()))
    for i, cuts in enumerate(CUTS):
        edges = np.asarray((*cuts, N))
        doc = np.searchsorted(edges, np.arange(N), side="right") - 1
        np.testing.assert_array_equal(start[i], edges[doc])
        np.testing.assert_array_equal(end[i], edges[doc + 1])
        np.testing.assert_array_equal(positions[i], np.arange(N) - edges[doc])


def test_run_tiles_follow_the_runs():
    # one-token documents, a document of three runs (w = 16) and one of two
    tiles = jax.jit(lambda ids: run_tiles(*document_bounds(ids), 16, 8))  # one program each
    starts, ends = (np.asarray(x[0]) for x in tiles(jnp.asarray(_ids(((0, 1, 2, 3, 40, 41),)))))
    used = starts < ends
    # runs of >= 8 / 4 rows start tiles of <= 8 rows; the one-token runs share one
    want = [(0, 3), (3, 11), (11, 19), (19, 27), (27, 35), (35, 40), (40, 41), (41, 49),
            (49, 57), (57, 64)]
    assert list(zip(starts[used].tolist(), ends[used].tolist())) == want
    assert (starts[~used] == N).all()
    # rate 2: documents of 1, 1, 7, 16, 32 and 7 tokens take 1, 1, 4, 8, 16 and 4 rows
    start, end = jax.jit(lambda ids: sequence_bounds(*document_bounds(ids), 2))(
        jnp.asarray(_ids(CUTS[:1])))
    edges = np.array([0, 1, 2, 6, 14, 30, 34, N])
    np.testing.assert_array_equal(start[0], np.repeat(edges[:-1], np.diff(edges)))
    np.testing.assert_array_equal(end[0], np.repeat(edges[1:], np.diff(edges)))


def test_segment_ids_errors_and_refusals():
    q, k, v, _ = _data(0)
    with pytest.raises(TypeError, match="segment_ids must be an integer array"):
        dilax.dilated_attention(q, k, v, WS, RS, segment_ids=jnp.zeros((2, N)))
    with pytest.raises(ValueError, match=r"segment_ids must have shape \(b, n\)"):
        dilax.dilated_attention(q, k, v, WS, RS, segment_ids=jnp.zeros((2, N - 1), jnp.int32))
    with pytest.raises(ValueError, match="per-row key ranges"):
        jax.eval_shape(functools.partial(
            dilax.dilated_attention, segment_lengths=WS, dilation_rates=RS,
            implementation="pallas", interpret=True), q, k, v,
            segment_ids=jnp.zeros((2, N), jnp.int32))


SP_WS, SP_RS = (8, 32), (1, 2)


def test_sequence_parallel_documents_cross_shards():
    """On 4 host devices (shards of 16 positions) documents cross shard boundaries (row 0:
    9..25, 25..57; row 1: 0..40, 48..64): the ring equals each document alone, forward and
    gradients, causal, with the local window and lengths. Two branches (a local one and one
    that rings over two shards) keep the program small."""
    from jax.sharding import AxisType

    mesh = jax.make_mesh((4,), ("sp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
    sp = dilax.SequenceParallel(mesh, seq_axis="sp")
    q_len, kv_len = np.array([50, 64]), np.array([60, 44])
    q, k, v, g = _data(4)

    def loss(q, k, v):
        out = dilax.dilated_attention(
            q, k, v, SP_WS, SP_RS, is_causal=True, local_window=3,
            segment_ids=jnp.asarray(_ids()), sequence_parallel=sp,
            query_seq_lengths=jnp.asarray(q_len), key_value_seq_lengths=jnp.asarray(kv_len))
        return jnp.sum(out * g), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    want = _alone(q, k, v, g, "mixture", True, 3, q_len, kv_len, SP_WS, SP_RS)
    for got, exp, name in zip((out, *grads), want, ("out", "dq", "dk", "dv")):
        assert_scaled_close(got, exp, FP32, err_msg=name)


def test_dot_product_attention_documents():
    """``dilax.dot_product_attention(segment_ids=...)``: each document equals
    ``jax.nn.dot_product_attention`` on it alone (causal, jax's band); output and gradients
    equal the float64 oracle with the causal band AND same document."""
    q, k, v, g = _data(5)
    ids = _ids()

    def f(q, k, v):
        return dilax.dot_product_attention(
            q, k, v, is_causal=True, local_window_size=(5, 0), segment_ids=jnp.asarray(ids),
            implementation="xla")

    @jax.jit  # one program for dilax's output and gradients and jax's documents
    def run(q, k, v):
        alone = [jax.nn.dot_product_attention(q[i:i + 1, s:e], k[i:i + 1, s:e],
                                              v[i:i + 1, s:e], is_causal=True,
                                              local_window_size=(5, 0))
                 for i, cuts in enumerate(CUTS) for s, e in zip(cuts, (*cuts[1:], N))]
        out, vjp = jax.vjp(f, q, k, v)
        return out, alone, vjp(g)

    out, alone, grads = run(q, k, v)
    docs = [(i, s, e) for i, cuts in enumerate(CUTS) for s, e in zip(cuts, (*cuts[1:], N))]
    for (i, s, e), ref in zip(docs, alone, strict=True):
        assert_scaled_close(out[i, s:e], ref[0], FP32)
    pos = np.arange(N)
    band = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] <= 5)
    same = ids[:, :, None] == ids[:, None, :]
    want = oracle.attention(q, k, v, (band & same)[:, None], 1 / np.sqrt(D), g)
    for got, exp, name in zip((out, *grads), (want.out, want.dq, want.dk, want.dv),
                              ("out", "dq", "dk", "dv")):
        assert_scaled_close(got, exp, FP32, err_msg=name)


def test_block_sparse_documents_are_pattern_and_same_document():
    """``block_sparse_attention(segment_ids=...)``: the pattern on row positions AND same
    document, by the float64 oracle (causal, GQA, a random per-head pattern), forward and
    gradients."""
    from dilax import patterns

    pattern = patterns.random(N, 8, 0.5, seed=3, num_heads=H)
    q, k, v, g = _data(6)
    ids = _ids()
    weights = _pattern_and_documents(pattern, ids)

    def loss(q, k, v):
        out = dilax.block_sparse_attention(q, k, v, pattern, is_causal=True,
                                           segment_ids=jnp.asarray(ids), implementation="xla")
        return jnp.sum(out * g), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    want = oracle.attention(q, k, v, weights, 1 / np.sqrt(D), g)
    for got, exp, name in zip((out, *grads), (want.out, want.dq, want.dk, want.dv),
                              ("out", "dq", "dk", "dv")):
        assert_scaled_close(got, exp, FP32, err_msg=name)


def _pattern_and_documents(pattern, ids) -> np.ndarray:
    """The oracle's weights (b, h, n, n): the causal pattern AND same document."""
    doc = np.cumsum(np.concatenate([np.zeros((2, 1), bool), ids[:, 1:] != ids[:, :-1]], 1), 1)
    return (np.asarray(pattern.expanded_mask(N, True))[None]
            * (doc[:, None, :, None] == doc[:, None, None, :]))


def test_block_sparse_documents_rows_in_several_steps(monkeypatch):
    """The XLA path runs a few query blocks per step when the gathered keys would be large
    (:func:`dilax.block_sparse.tables.sparse_attention_tables`); the documents of the rows of
    every step are in row positions too (a step's first query block is not row 0). A row
    budget of one byte forces one query block per step; forward and gradients by the oracle."""
    from dilax import patterns
    from dilax.block_sparse import tables
    from dilax.block_sparse.api import block_sparse_attention_xla

    monkeypatch.setattr(tables, "_ROW_BUDGET_BYTES", 1)
    pattern = patterns.random(N, 8, 0.5, seed=4, num_heads=H)
    q, k, v, g = _data(7)
    ids = _ids()
    weights = _pattern_and_documents(pattern, ids)

    def loss(q, k, v):
        out = block_sparse_attention_xla(q, k, v, pattern, is_causal=True, scale=D ** -0.5,
                                         segment_ids=jnp.asarray(ids))
        return jnp.sum(out * g), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    want = oracle.attention(q, k, v, weights, 1 / np.sqrt(D), g)
    for got, exp, name in zip((out, *grads), (want.out, want.dq, want.dk, want.dv),
                              ("out", "dq", "dk", "dv")):
        assert_scaled_close(got, exp, FP32, err_msg=name)
