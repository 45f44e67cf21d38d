"""Packed documents on the per-device ring ops, and every op against every mask field.

1. ``ring_dilated_attention`` and ``ring_block_sparse_attention`` inside a user's
   ``jax.shard_map`` (4 host devices, shards of 16 positions) with ``segment_ids`` (the local
   shard of the global ids) whose documents cross shard boundaries: exactly the single-device
   packed result (docs/semantics.md, "Packed documents"), by the float64 oracle
   (``tests/oracle.py``), forward and gradients. Each program is compiled once and run on two
   document layouts (data, not configuration).
2. The op x field matrix: every op that takes a mask, with each ``AttentionMask`` field set
   (``query_seq_lengths``, ``key_value_seq_lengths``, ``key_padding_mask``, ``segment_ids``,
   ``is_causal``), either matches the oracle with that field (and the field changes the
   oracle's result, so an ignored field fails) or raises a ``ValueError``/``TypeError``
   naming the field. One program per op: the fields are data (neutral values: lengths ``n``,
   every key valid, one document per row), every program causal.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as PS

import dilax
from dilax import patterns
from dilax.reference import dilated_counts
from tests import oracle
from tests.tolerance import FP32, assert_scaled_close

N, H, HK, D, P = 64, 4, 2, 8, 4
WS, RS = (8, 32), (1, 2)  # a local branch and one that rings over two shards
SHARD = PS(None, "sp")
# Documents as runs of equal ids (any integers; an id may come back as a new document).
# Layout A: row 0 has one-token documents and documents across the shard boundaries 16, 32
# and 48; row 1 one document over three shards, a one-token one and a tail. Layout B: row 0
# one document over all four shards; row 1 ids 1, 2, 1 (two documents with the same id),
# one boundary on a shard edge and one just past it.
LAYOUTS = {"A": ((0, 1, 2, 9, 25, 57), (0, 40, 41, 48)), "B": ((0, 5, 50), (0, 16, 33))}


def _ids(layout: str) -> np.ndarray:
    ids = np.zeros((2, N), np.int32)
    for i, cuts in enumerate(LAYOUTS[layout]):
        for j, s in enumerate(cuts):
            ids[i, s:] = (1, 2)[j % 2] if layout == "B" and i == 1 else 7 * j + 3
    return ids


def _runs(ids_row: np.ndarray) -> list[tuple[int, int]]:
    cut = [0, *np.flatnonzero(ids_row[1:] != ids_row[:-1]) + 1, len(ids_row)]
    return list(zip(cut[:-1], cut[1:]))


def _mesh():
    return jax.make_mesh((P,), ("sp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:P])


def _data(seed, hq=H, hk=HK):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.normal(size=(2, N, h, D)), jnp.float32)
                 for h in (hq, hk, hk, hq))


# -- float64 oracle weights (b, h, n, n) ----------------------------------------------------


def _dilated_weights(ids, causal, mode="mixture", window=None, h=H):
    """The count matrix of each document, computed as a sequence of its own, on the block
    diagonal of its row (``ids`` None: one document per row)."""
    w = np.zeros((2, h, N, N))
    for i in range(2):
        for s, e in _runs(ids[i]) if ids is not None else [(0, N)]:
            w[i, :, s:e, s:e] = dilated_counts(e - s, h, WS, RS, mode, causal, window)
    return w


def _sparse_weights(pattern, ids, causal):
    w = np.broadcast_to(pattern.expanded_mask(N, causal)[None].astype(np.float64), (2, H, N, N))
    return w if ids is None else w * _same_run(ids)


def _same_run(ids):
    """``(b, 1, n, n)``: both positions in one document (a maximal run)."""
    doc = np.cumsum(np.concatenate([np.zeros((2, 1), bool), ids[:, 1:] != ids[:, :-1]], 1), 1)
    return (doc[:, :, None] == doc[:, None, :])[:, None]


def _with_fields(w, q_len=None, kv_len=None, key_valid=None):
    pos = np.arange(N)
    if q_len is not None:
        w = w * (pos[None] < np.asarray(q_len)[:, None])[:, None, :, None]
    if kv_len is not None:
        w = w * (pos[None] < np.asarray(kv_len)[:, None])[:, None, None, :]
    if key_valid is not None:
        w = w * np.asarray(key_valid)[:, None, None, :]
    return w


def _oracle(q, k, v, w, g=None, groups=1):
    r = oracle.attention(q, k, v, w, D ** -0.5, None if g is None else oracle.f64(g) / groups)
    return r._replace(out=r.out / groups)


def _check(out, grads, want, name):
    """Output and gradients against the oracle; returns the max-abs errors."""
    got = (out, *grads) if grads is not None else (out,)
    exp = (want.out, want.dq, want.dk, want.dv)[:len(got)]
    errs = {}
    for label, a, e in zip(("out", "dq", "dk", "dv"), got, exp):
        assert_scaled_close(a, e, FP32, err_msg=f"{name} {label}")
        errs[label] = float(np.max(np.abs(np.asarray(a, np.float64) - e)))
    return errs


ERRORS: dict[str, dict[str, float]] = {}  # max-abs errors, printed with pytest -s


# -- 1. documents on the per-device ring ops, forward and gradients -------------------------


def _grad_program(body, in_specs):
    """jit of ``(out, grads of sum(out * g))`` of ``shard_map(body)``."""
    f = jax.shard_map(body, mesh=_mesh(), in_specs=in_specs, out_specs=SHARD)

    def loss(q, k, v, g, *rest):
        out = f(q, k, v, *rest)
        return jnp.sum(out * g), out

    return jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))


@pytest.mark.parametrize("case", ["mixture_causal_lengths_mask", "grouped_keyword"])
def test_ring_dilated_attention_documents_cross_shards(case):
    """Per-device ``ring_dilated_attention`` with documents across shards: mixture + causal +
    valid lengths, all in an ``AttentionMask.build(..., seq_len=n)``; grouped (non-causal,
    GQA) with ``segment_ids=``. Exactly each document alone. (The local window on the
    document ring: the whole-mesh test in test_documents.py, the same core.)"""
    grouped = case == "grouped_keyword"
    mode, causal, window = ("grouped", False, None) if grouped else ("mixture", True, None)
    q_len, kv_len = np.array([50, 64], np.int32), np.array([60, 44], np.int32)

    def body(q, k, v, ids, ql, kl):
        if grouped:
            return dilax.ring_dilated_attention(q, k, v, WS, RS, axis_name="sp", mode=mode,
                                                segment_ids=ids)
        mask = dilax.AttentionMask.build(q, is_causal=True, segment_ids=ids, seq_len=N,
                                         query_seq_lengths=ql, key_value_seq_lengths=kl)
        return dilax.ring_dilated_attention(q, k, v, WS, RS, axis_name="sp", attention_mask=mask)

    run = _grad_program(body, (SHARD, SHARD, SHARD, SHARD, PS(), PS()))
    for seed, layout in enumerate(LAYOUTS):
        q, k, v, g = _data(seed)
        ids = _ids(layout)
        (_, out), grads = run(q, k, v, g, jnp.asarray(ids), q_len, kv_len)
        G = len(WS) if grouped else 1
        fields = (lambda w: w) if grouped else (lambda w: _with_fields(w, q_len, kv_len))
        want = _oracle(q, k, v, fields(_dilated_weights(ids, causal, mode, window)), g, G)
        ERRORS[f"ring_dilated {case} {layout}"] = _check(out, grads, want, f"{case} {layout}")
        # the documents matter: the unpacked result is far from it
        unpacked = _oracle(q, k, v, fields(_dilated_weights(None, causal, mode, window)),
                           groups=G)
        assert np.max(np.abs(want.out - unpacked.out)) > 0.1


def test_ring_block_sparse_attention_documents_cross_shards():
    """Per-device ``ring_block_sparse_attention`` with
    ``attention_mask=AttentionMask(segment_ids=..., is_causal=True, lengths)``: the pattern
    (random, per head, GQA) on row positions AND same document, forward and gradients."""
    pattern = patterns.random(N, 8, 0.5, seed=3, num_heads=H)
    q_len, kv_len = np.array([60, 64], np.int32), np.array([64, 37], np.int32)

    def body(q, k, v, ids, ql, kl):
        mask = dilax.AttentionMask(segment_ids=ids, is_causal=True, query_seq_lengths=ql,
                                   key_value_seq_lengths=kl)
        return dilax.ring_block_sparse_attention(q, k, v, pattern, axis_name="sp",
                                                 attention_mask=mask)

    run = _grad_program(body, (SHARD, SHARD, SHARD, SHARD, PS(), PS()))
    for seed, layout in enumerate(LAYOUTS):
        q, k, v, g = _data(10 + seed)
        ids = _ids(layout)
        (_, out), grads = run(q, k, v, g, jnp.asarray(ids), q_len, kv_len)
        want = _oracle(q, k, v, _with_fields(_sparse_weights(pattern, ids, True), q_len, kv_len),
                       g)
        ERRORS[f"ring_block_sparse causal {layout}"] = _check(out, grads, want, layout)
        unpacked = _oracle(q, k, v, _with_fields(_sparse_weights(pattern, None, True), q_len,
                                                 kv_len))
        assert np.max(np.abs(want.out - unpacked.out)) > 0.1


def test_ring_documents_refusals():
    """What the per-device ring ops cannot honour raises, naming the field."""
    q, k, v, _ = _data(0)
    ids = jnp.asarray(_ids("A"))
    pattern = patterns.local_window(N, 8, 8)
    # one device: attention_mask= is the keywords (bitwise), its key_padding_mask refused
    want = dilax.block_sparse_attention(q, k, v, pattern, is_causal=True, segment_ids=ids)
    got = dilax.block_sparse_attention(
        q, k, v, pattern, attention_mask=dilax.AttentionMask(segment_ids=ids, is_causal=True))
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="key_padding_mask is not supported"):
        dilax.block_sparse_attention(q, k, v, pattern, attention_mask=dilax.AttentionMask(
            key_padding_mask=jnp.ones((2, N), bool)))

    def trace(body, *args):
        f = jax.shard_map(body, mesh=_mesh(), in_specs=(SHARD,) * (3 + len(args)),
                          out_specs=SHARD, check_vma=False)
        return jax.eval_shape(f, q, k, v, *args)

    ring = functools.partial(dilax.ring_dilated_attention, axis_name="sp")
    sparse = functools.partial(dilax.ring_block_sparse_attention, pattern=pattern,
                               axis_name="sp")
    ops = {"ring_dilated": functools.partial(ring, segment_lengths=WS, dilation_rates=RS),
           "ring_block_sparse": sparse}
    for op in ops.values():
        with pytest.raises(ValueError, match="key_padding_mask"):
            trace(lambda q, k, v, kv, op=op: op(q, k, v, attention_mask=dilax.AttentionMask(
                key_padding_mask=kv)), jnp.ones((2, N), bool))
        with pytest.warns(DeprecationWarning, match="pass it as attention_mask="):  # old name
            trace(lambda q, k, v, s, op=op: op(q, k, v, mask=dilax.AttentionMask(segment_ids=s)),
                  ids)
        with pytest.raises(TypeError, match="segment_ids"):  # attention_mask= and the keyword
            trace(lambda q, k, v, s, op=op: op(q, k, v, segment_ids=s,
                                               attention_mask=dilax.AttentionMask()), ids)
        with pytest.raises(ValueError, match=r"segment_ids must have shape \(b, n\)"):
            trace(lambda q, k, v, s, op=op: op(q, k, v, segment_ids=s[:, :-1]), ids)
    pallas = dilax.DilatedSettings(WS, RS, implementation="pallas", interpret=True)
    with pytest.raises(ValueError, match="per-row key ranges"):  # the kernels have none
        trace(lambda q, k, v, s: ring(q, k, v, settings=pallas, segment_ids=s), ids)
    with pytest.raises(ValueError, match="per-row key ranges"):
        trace(lambda q, k, v, s: sparse(q, k, v, segment_ids=s, implementation="pallas",
                                        interpret=True), ids)
    with pytest.raises(ValueError, match="segment_ids on the ring need layout='contiguous'"):
        trace(lambda q, k, v, s: ops["ring_dilated"](q, k, v, segment_ids=s, layout="zigzag"),
              ids)


# -- 2. every op x every mask field ---------------------------------------------------------

FIELDS = ("query_seq_lengths", "key_value_seq_lengths", "key_padding_mask", "segment_ids",
          "is_causal")
_KEY_VALID = np.random.default_rng(5).random((2, N)) < 0.7
ACTIVE = {"query_seq_lengths": np.array([37, 50], np.int32),
          "key_value_seq_lengths": np.array([45, 29], np.int32),
          "key_padding_mask": _KEY_VALID, "segment_ids": _ids("A")}
NEUTRAL = {"query_seq_lengths": np.full(2, N, np.int32),
           "key_value_seq_lengths": np.full(2, N, np.int32),
           "key_padding_mask": np.ones((2, N), bool), "segment_ids": np.zeros((2, N), np.int32)}
SPARSE = patterns.random(N, 8, 0.5, seed=3, num_heads=H)
TOP_K = 3


def _dilated_base(q, k, ids, q_len, kv_len, causal):
    return _dilated_weights(ids, causal)


def _sparse_base(q, k, ids, q_len, kv_len, causal):
    return _sparse_weights(SPARSE, ids, causal)


def _dense_base(q, k, ids, q_len, kv_len, causal):
    w = np.tril(np.ones((N, N))) if causal else np.ones((N, N))
    w = np.broadcast_to(w, (2, H, N, N))
    return w if ids is None else w * _same_run(ids)


def _adaptive_base(q, k, ids, q_len, kv_len, causal):
    """The blocks ``content_adaptive_selection`` picks (with the same lengths), per kv head."""
    idx, cnt = dilax.block_sparse.content_adaptive.content_adaptive_selection(
        q, k, 8, TOP_K, is_causal=causal, query_seq_lengths=q_len, key_value_seq_lengths=kv_len)
    idx, cnt = np.asarray(idx), np.asarray(cnt)
    nb = N // 8
    blocks = np.zeros((2, HK, nb, nb), bool)
    for b, c, i in np.ndindex(2, HK, nb):
        blocks[b, c, i, idx[b, c, i, :cnt[b, c, i]]] = True
    w = np.repeat(np.repeat(np.repeat(blocks, H // HK, axis=1), 8, axis=2), 8, axis=3)
    return w * (np.tril(np.ones((N, N))) if causal else 1.0)


def _in_shard_map(body, specs):
    return jax.shard_map(body, mesh=_mesh(), in_specs=(SHARD,) * 3 + specs, out_specs=SHARD)


def _sp():
    return dilax.SequenceParallel(_mesh(), seq_axis="sp")


def _ring_dilated(q, k, v, query_seq_lengths, key_value_seq_lengths, segment_ids):
    def body(q, k, v, ql, kl, ids):
        mask = dilax.AttentionMask(query_seq_lengths=ql, key_value_seq_lengths=kl,
                                   segment_ids=ids, is_causal=True)
        return dilax.ring_dilated_attention(q, k, v, WS, RS, axis_name="sp", attention_mask=mask)

    return _in_shard_map(body, (PS(), PS(), SHARD))(q, k, v, query_seq_lengths,
                                                    key_value_seq_lengths, segment_ids)


def _ring_sparse(q, k, v, query_seq_lengths, key_value_seq_lengths, segment_ids):
    def body(q, k, v, ql, kl, ids):
        mask = dilax.AttentionMask(query_seq_lengths=ql, key_value_seq_lengths=kl,
                                   segment_ids=ids, is_causal=True)
        return dilax.ring_block_sparse_attention(q, k, v, SPARSE, axis_name="sp",
                                                 attention_mask=mask)

    return _in_shard_map(body, (PS(), PS(), SHARD))(q, k, v, query_seq_lengths,
                                                    key_value_seq_lengths, segment_ids)


def _ring_refusal(op):
    """A per-device ring op given ``key_padding_mask`` (in its mask), traced in a shard_map."""
    def call(q, k, v):
        def body(q, k, v, kv):
            return op(q, k, v, attention_mask=dilax.AttentionMask(key_padding_mask=kv,
                                                                  is_causal=True))

        return jax.eval_shape(_in_shard_map(body, (SHARD,)), q, k, v, NEUTRAL["key_padding_mask"])
    return call


_LENGTHS = ("query_seq_lengths", "key_value_seq_lengths")
_NO_KPM = (TypeError, "key_padding_mask")  # no such keyword: Python names it
# op: (fields it takes as data, the call, the oracle's weights, {field: (error, call)})
OPS = {
    "dilated_attention": (
        (*_LENGTHS, "key_padding_mask", "segment_ids"),
        lambda q, k, v, **f: dilax.dilated_attention(q, k, v, WS, RS, is_causal=True, **f),
        _dilated_base, {}),
    "dilated_attention(sequence_parallel=)": (
        (*_LENGTHS, "segment_ids"),
        lambda q, k, v, **f: dilax.dilated_attention(q, k, v, WS, RS, is_causal=True,
                                                     sequence_parallel=_sp(), **f),
        _dilated_base,
        {"key_padding_mask": (ValueError, lambda q, k, v: dilax.dilated_attention(
            q, k, v, WS, RS, is_causal=True, sequence_parallel=_sp(),
            key_padding_mask=NEUTRAL["key_padding_mask"]))}),
    "ring_dilated_attention": (
        (*_LENGTHS, "segment_ids"), _ring_dilated, _dilated_base,
        {"key_padding_mask": (ValueError, _ring_refusal(functools.partial(
            dilax.ring_dilated_attention, segment_lengths=WS, dilation_rates=RS,
            axis_name="sp")))}),
    "block_sparse_attention": (
        (*_LENGTHS, "segment_ids"),
        lambda q, k, v, **f: dilax.block_sparse_attention(q, k, v, SPARSE, is_causal=True,
                                                          implementation="xla", **f),
        _sparse_base,
        {"key_padding_mask": (TypeError, lambda q, k, v: dilax.block_sparse_attention(
            q, k, v, SPARSE, key_padding_mask=NEUTRAL["key_padding_mask"]))}),
    "block_sparse_attention(sequence_parallel=)": (
        (*_LENGTHS, "segment_ids"),
        lambda q, k, v, **f: dilax.block_sparse_attention(q, k, v, SPARSE, is_causal=True,
                                                          sequence_parallel=_sp(), **f),
        _sparse_base,
        {"key_padding_mask": (TypeError, lambda q, k, v: dilax.block_sparse_attention(
            q, k, v, SPARSE, sequence_parallel=_sp(),
            key_padding_mask=NEUTRAL["key_padding_mask"]))}),
    "ring_block_sparse_attention": (
        (*_LENGTHS, "segment_ids"), _ring_sparse, _sparse_base,
        {"key_padding_mask": (ValueError, _ring_refusal(functools.partial(
            dilax.ring_block_sparse_attention, pattern=SPARSE, axis_name="sp")))}),
    # key_padding_mask as jax's boolean mask (B, 1, 1, S)
    "dot_product_attention": (
        (*_LENGTHS, "key_padding_mask", "segment_ids"),
        lambda q, k, v, key_padding_mask, **f: dilax.dot_product_attention(
            q, k, v, mask=key_padding_mask[:, None, None, :], is_causal=True, **f),
        _dense_base, {}),
    # key_padding_mask as flax's (B, 1, 1, S) mask; is_causal as the module passes it
    "attention_fn": (
        ("key_padding_mask",),
        lambda q, k, v, key_padding_mask: dilax.attention_fn(WS, RS)(
            q, k, v, mask=key_padding_mask[:, None, None, :], is_causal=True),
        _dilated_base,
        {f: (TypeError, lambda q, k, v, f=f: dilax.attention_fn(WS, RS)(
            q, k, v, **{f: NEUTRAL[f]})) for f in (*_LENGTHS, "segment_ids")}),
    # a chunk of N new positions into an empty cache: the causal op's rows (always causal)
    "dilated_attention_decode": (
        ("query_seq_lengths",),
        lambda q, k, v, **f: dilax.dilated_attention_decode(
            q, k, v, dilax.KVCache.init(2, N, HK, D), WS, RS, **f)[0],
        _dilated_base,
        {f: (TypeError, lambda q, k, v, f=f: dilax.dilated_attention_decode(
            q, k, v, dilax.KVCache.init(2, N, HK, D), WS, RS, **{f: NEUTRAL[f]}))
         for f in ("key_value_seq_lengths", "key_padding_mask", "segment_ids")}),
    "content_adaptive_attention": (
        _LENGTHS,
        lambda q, k, v, **f: dilax.content_adaptive_attention(q, k, v, 8, TOP_K,
                                                              is_causal=True, **f),
        _adaptive_base,
        {f: (TypeError, lambda q, k, v, f=f: dilax.content_adaptive_attention(
            q, k, v, 8, TOP_K, **{f: NEUTRAL[f]})) for f in ("key_padding_mask", "segment_ids")}),
}
# what each op does with each field: "honours" (matches the oracle) or "refuses" (raises)
EXPECTED = {op: {f: "refuses" if f in spec[3] else "honours" for f in FIELDS}
            for op, spec in OPS.items()}
MATRIX: dict[str, dict[str, str]] = {}


@pytest.mark.parametrize("op", list(OPS))
def test_every_op_honours_or_refuses_every_mask_field(op):
    """Each field set alone (the others neutral, one compiled program): the op equals the
    float64 oracle with the field (which differs from the oracle without it), or raises a
    ValueError/TypeError naming the field. Every program is causal: ``is_causal`` is the run
    with every field neutral, against the causal oracle (which differs from the non-causal
    one)."""
    takes, call, base, refused = OPS[op]
    program = jax.jit(call)
    q, k, v, _ = _data(20)
    row = {}
    for field in FIELDS:
        if field in refused:
            error, attempt = refused[field]
            with pytest.raises(error, match=field):
                attempt(q, k, v)
            row[field] = "refuses"
            continue
        values = {**NEUTRAL, **({field: ACTIVE[field]} if field in ACTIVE else {})}
        out = program(q, k, v, **{f: jnp.asarray(values[f]) for f in takes})
        ids = ACTIVE["segment_ids"] if field == "segment_ids" else None
        q_len, kv_len = (jnp.asarray(values[f]) if f in takes and f == field else None
                         for f in _LENGTHS)

        def weights(ids, q_len, kv_len, key_valid, causal=True):
            w = base(q, k, ids, q_len, kv_len, causal)
            return _with_fields(w, q_len, kv_len, key_valid)

        key_valid = ACTIVE["key_padding_mask"] if field == "key_padding_mask" else None
        want = _oracle(q, k, v, weights(ids, q_len, kv_len, key_valid))
        without = _oracle(q, k, v, weights(None, None, None, None, field != "is_causal"))
        assert np.max(np.abs(want.out - without.out)) > 0.05, f"{op}: {field} has no effect"
        ERRORS[f"matrix {op} {field}"] = _check(out, None, want, f"{op} {field}")
        row[field] = "honours"
    MATRIX[op] = row
    assert row == EXPECTED[op]


def teardown_module(module):
    for name, errs in ERRORS.items():
        print(name, " ".join(f"{k}={v:.2e}" for k, v in errs.items()))
    for op, row in MATRIX.items():
        print(op, row)
