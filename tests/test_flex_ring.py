"""FlexAttention's options on the sequence-parallel ops (docs/semantics.md, "Custom scores and
masks (FlexAttention semantics), every op"): ``logits_soft_cap``, a ``score_mod`` closing over
a learnable array (ALiBi slopes), a ``mask_mod`` and ``sinks`` on the dilated ring and the
block-sparse ring (4 host devices, shards of 16 positions), causal, with packed documents
crossing shard boundaries. ``q_idx`` / ``kv_idx`` are global positions on every device.
Forward and gradients (q, k, v, the slopes: summed over the devices, the sinks) against a
float64 NumPy oracle with multiplicity weights (the dilated mixture counts each pair once
per branch that allows it). The dilated ring inside a user's ``shard_map`` with
``segment_ids``; the block-sparse ring through ``sequence_parallel=`` with ``segment_ids`` and
a band ``mask_mod``; the dilated door with documents as a ``mask_mod`` (forward). Values
with their own head dim (``dv = d + 8``, MLA-style) on both rings, plain and with the mods.
One compiled program per case, two data sets for the gradient cases.
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
from dilax import flex, patterns
from dilax.dilated.ring import ring_cores
from dilax.reference import dilated_counts
from tests.tolerance import assert_scaled_close

N, H, HK, D, P = 64, 4, 2, 8, 4
WS, RS = (8, 32), (1, 2)  # a branch inside the shards and one across two shards
CAP = 2.0
SHARD = PS(None, "sp")
CUTS = (((0, 9, 25, 57), (0, 40, 41)), ((0, 5, 50), (0, 16, 33)))  # document starts per row


def _ids(layout: int) -> np.ndarray:
    ids = np.zeros((2, N), np.int32)
    for i, cuts in enumerate(CUTS[layout]):
        for j, s in enumerate(cuts):
            ids[i, s:] = 7 * j + 3
    return ids


def _runs(row):
    cut = [0, *np.flatnonzero(row[1:] != row[:-1]) + 1, len(row)]
    return list(zip(cut[:-1], cut[1:]))


def _same_doc(ids):
    doc = np.cumsum(np.concatenate([np.zeros((2, 1), bool), ids[:, 1:] != ids[:, :-1]], 1), 1)
    return (doc[:, :, None] == doc[:, None, :])[:, None]  # (b, 1, n, n)


def _mesh():
    return jax.make_mesh((P,), ("sp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:P])


def _data(seed):
    rng = np.random.default_rng(seed)
    q, k, v, g = (jnp.asarray(rng.normal(size=(2, N, h, D)), jnp.float32)
                  for h in (H, HK, HK, H))
    slopes = jnp.asarray(rng.uniform(0.05, 0.3, H), jnp.float32)
    sinks = jnp.asarray(rng.normal(size=H), jnp.float32)
    return q, k, v, g, slopes, sinks


def oracle(q, k, v, weights, slopes, sinks, dout, cap=CAP):
    """Float64: ``out = sum_t C e^s v / (e^sink + sum_t C e^s)`` with
    ``s = cap tanh(q.k / sqrt(d) / cap) + slope_h (t - p)`` (``cap`` None: no soft-cap), and
    the gradients of ``sum(out * dout)`` w.r.t. q, k, v, the slopes and the sinks. ``v`` may
    have its own head dim ``dv``."""
    q, k, v, dout = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    slopes, sinks = np.asarray(slopes, np.float64), np.asarray(sinks, np.float64)
    b, n, h, d = q.shape
    g = h // k.shape[2]
    kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    raw = np.einsum("bqhd,bkhd->bhqk", q, kr) / np.sqrt(d)
    t = np.tanh(raw / cap) if cap else raw
    rel = (np.arange(n)[None, :] - np.arange(n)[:, None]).astype(np.float64)
    score = (cap * t if cap else raw) + slopes[None, :, None, None] * rel
    w = np.broadcast_to(weights, score.shape)
    score = np.where(w > 0, score, -np.inf)
    sink = np.broadcast_to(sinks[None, :, None, None], (b, h, n, 1))
    m = np.maximum(score.max(-1, keepdims=True), sink)
    e, es = np.where(w > 0, w * np.exp(score - m), 0.0), np.exp(sink - m)
    z = e.sum(-1, keepdims=True) + es
    p, ps = e / z, es / z
    out = np.einsum("bhqk,bkhd->bqhd", p, vr)
    dp = np.einsum("bqhd,bkhd->bhqk", dout, vr)
    delta = np.einsum("bqhd,bqhd->bhq", dout, out)[..., None]
    ds = p * (dp - delta)
    dr = ds * (1 - t**2) if cap else ds
    fold = lambda x: x.reshape(b, n, -1, g, x.shape[-1]).sum(3)  # noqa: E731
    return (out, np.einsum("bhqk,bkhd->bqhd", dr, kr) / np.sqrt(d),
            fold(np.einsum("bhqk,bqhd->bkhd", dr, q) / np.sqrt(d)),
            fold(np.einsum("bhqk,bqhd->bkhd", p, dout)),
            (ds * rel).sum(axis=(0, 2, 3)), -(ps * delta).sum(axis=(0, 2, 3)))


def _dilated_counts(ids, packed: bool):
    """``(b, h, n, n)`` causal mixture counts: per document computed alone (``packed``:
    ``segment_ids``) or on row positions AND same document (a document ``mask_mod``)."""
    if not packed:
        return dilated_counts(N, H, WS, RS, "mixture", True, None)[None] * _same_doc(ids)
    w = np.zeros((2, H, N, N))
    for i in range(2):
        for s, e in _runs(ids[i]):
            w[i, :, s:e, s:e] = dilated_counts(e - s, H, WS, RS, "mixture", True, None)
    return w


@functools.cache
def _grad_program(fn):
    """One jitted program per op function, so that new data reuses its compile."""
    def loss(q, k, v, g, slopes, sinks, ids):
        out = fn(q, k, v, slopes, sinks, ids)
        return jnp.sum(out * g), out

    return jax.jit(jax.value_and_grad(loss, (0, 1, 2, 4, 5), has_aux=True))


def _run(fn, args):
    """``out`` and the gradients of ``sum(out * g)`` w.r.t. q, k, v, slopes, sinks."""
    return _grad_program(fn)(*args)


def _check(got, want, name):
    (_, out), grads = got
    errs = []
    for label, a, e in zip(("out", "dq", "dk", "dv", "dslopes", "dsinks"), (out, *grads), want):
        assert_scaled_close(a, e, 1e-5, err_msg=f"{name} {label}")
        errs.append(float(np.max(np.abs(np.asarray(a, np.float64) - e))))
    print(f"{name}: max |err| {max(errs):.1e}")


PATTERN = patterns.random(N, 8, 0.5, seed=3, num_heads=H)
WINDOW = 20  # the block-sparse case's mask_mod: a band across the shard edges


def _dilated_per_device(q, k, v, slopes, sinks, ids):
    """``ring_dilated_attention`` inside a user's ``shard_map``: soft-cap, ALiBi at global
    positions, sinks, causal, documents as ``segment_ids`` (the local shard)."""
    def body(q, k, v, slopes, sinks, ids):
        return dilax.ring_dilated_attention(
            q, k, v, WS, RS, axis_name="sp", is_causal=True, segment_ids=ids,
            score_mod=flex.alibi(slopes), logits_soft_cap=CAP, sinks=sinks)

    return jax.shard_map(body, mesh=_mesh(), in_specs=(SHARD,) * 3 + (PS(), PS(), SHARD),
                         out_specs=SHARD)(q, k, v, slopes, sinks, ids)


def _block_sparse_whole_mesh(q, k, v, slopes, sinks, ids):
    """``block_sparse_attention(sequence_parallel=)``: the pattern AND ``segment_ids`` AND a
    band ``mask_mod`` at global positions, soft-cap, ALiBi, sinks, causal."""
    return dilax.block_sparse_attention(
        q, k, v, PATTERN, is_causal=True, segment_ids=ids,
        sequence_parallel=dilax.SequenceParallel(_mesh(), "sp"), score_mod=flex.alibi(slopes),
        mask_mod=flex.sliding_window(WINDOW), logits_soft_cap=CAP, sinks=sinks)


def _band():
    pos = np.arange(N)
    return np.abs(pos[:, None] - pos[None]) <= WINDOW


@pytest.mark.parametrize("op", ["dilated", "block_sparse"])
def test_ring_softcap_alibi_sinks_documents_causal(op):
    """Forward and gradients (q, k, v, the ALiBi slopes, the sinks) on two document layouts
    (data: one program per op), with ``v``'s own head dim ``dv = d + 8``."""
    fn = _dilated_per_device if op == "dilated" else _block_sparse_whole_mesh
    for layout in (0, 1):
        q, k, v, g, slopes, sinks = _data_dv(layout)
        ids = _ids(layout)
        got = _run(fn, (q, k, v, g, slopes, sinks, jnp.asarray(ids)))
        if op == "dilated":  # segment_ids: every document computed alone
            w = _dilated_counts(ids, packed=True)
        else:
            w = PATTERN.expanded_mask(N, True)[None] * _same_doc(ids) * _band()
        _check(got, oracle(q, k, v, w, slopes, sinks, g), f"{op} layout {layout}")


def test_dilated_whole_mesh_document_mask_mod():
    """``dilated_attention(sequence_parallel=)`` with documents as a ``mask_mod`` closing over
    the global ids (replicated): pairs removed from the row's own branches, unlike
    ``segment_ids``; forward (the gradients' path is the test above's and the block-sparse
    door's)."""
    sp = dilax.SequenceParallel(_mesh(), "sp")
    q, k, v, g, slopes, sinks = _data(2)
    ids = _ids(0)
    out = dilax.dilated_attention(q, k, v, WS, RS, is_causal=True, sequence_parallel=sp,
                                  score_mod=flex.alibi(slopes), logits_soft_cap=CAP,
                                  mask_mod=flex.document_mask(jnp.asarray(ids)), sinks=sinks)
    want = oracle(q, k, v, _dilated_counts(ids, packed=False), slopes, sinks, g)[0]
    assert_scaled_close(out, want, 1e-5)
    packed = oracle(q, k, v, _dilated_counts(ids, packed=True), slopes, sinks, g)[0]
    assert np.max(np.abs(want - packed)) > 0.1  # the two document semantics differ here
    print(f"dilated whole_mesh mask_mod: max |err| {np.max(np.abs(np.asarray(out) - want)):.1e}")


DV = D + 8  # v's own head dim (MLA-style)
WS_DV, RS_DV, W_DV = (8, 12, 32), (1, 1, 2), 3  # a local, a halo and a ring branch; a window
KV_LEN = (50, 64)


def _data_dv(seed):
    q, k, _, _, slopes, sinks = _data(seed)
    rng = np.random.default_rng(seed + 100)
    v, g = (jnp.asarray(rng.normal(size=(2, N, h, DV)), jnp.float32) for h in (HK, H))
    return q, k, v, g, slopes, sinks


def _dilated_plain(q, k, v, slopes, sinks, ids):
    """The dilated ring without mods (its local, halo and ring branches and the window),
    causal, valid key lengths."""
    del slopes, sinks, ids
    return dilax.dilated_attention(q, k, v, WS_DV, RS_DV, is_causal=True, local_window=W_DV,
                                   key_value_seq_lengths=jnp.asarray(KV_LEN),
                                   sequence_parallel=dilax.SequenceParallel(_mesh(), "sp"))


def _block_sparse_plain(q, k, v, slopes, sinks, ids):
    """The block-sparse ring without mods, causal, valid key lengths."""
    del slopes, sinks, ids
    return dilax.block_sparse_attention(
        q, k, v, PATTERN, is_causal=True, key_value_seq_lengths=jnp.asarray(KV_LEN),
        sequence_parallel=dilax.SequenceParallel(_mesh(), "sp"))


# with mods: test_ring_softcap_alibi_sinks_documents_causal (its v has dv too)
_DV_CASES = {"dilated": _dilated_plain, "block_sparse": _block_sparse_plain}


@pytest.mark.parametrize("op", list(_DV_CASES))
def test_ring_value_head_dim(op):
    """``v (b, n, hk, dv)`` with ``dv = d + 8`` on the rings without mods (a local, a halo
    and a ring branch, a window, key lengths): the output and the values' buffers and
    accumulators travel with ``dv``. Forward and gradients against the float64 oracle."""
    q, k, v, g, slopes, sinks = _data_dv(4)
    ids = _ids(1)
    got = _run(_DV_CASES[op], (q, k, v, g, slopes, sinks, jnp.asarray(ids)))
    assert got[0][1].shape == (2, N, H, DV)
    keys = (np.arange(N)[None] < np.asarray(KV_LEN)[:, None])[:, None, None]  # (b, 1, 1, n)
    if op == "dilated":
        w = dilated_counts(N, H, WS_DV, RS_DV, "mixture", True, W_DV)[None] * keys
    else:
        w = PATTERN.expanded_mask(N, True)[None] * keys
    # no mods: no soft-cap, no slopes, no sink; out, dq, dk, dv only
    want = oracle(q, k, v, w, np.zeros(H), np.full(H, -1e30), g, cap=None)
    _check(got, want[:4], f"{op} dv={DV}")


def test_ring_value_head_dim_pallas_refused():
    """The Pallas hops have no ``dv != d``: an explicit ``"pallas"`` raises with the
    registry's reason; ``None`` with ``interpret=True`` runs every ring call on XLA."""
    sp = dilax.SequenceParallel(_mesh(), "sp")
    q, k, v, *_ = _data_dv(5)
    with pytest.raises(ValueError, match="dv != d"):
        dilax.dilated_attention(q, k, v, WS_DV, RS_DV, sequence_parallel=sp,
                                implementation="pallas", interpret=True)
    with pytest.raises(ValueError, match="dv != d"):
        dilax.block_sparse_attention(q, k, v, PATTERN, sequence_parallel=sp,
                                     implementation="pallas", interpret=True)
    settings = dilax.DilatedSettings(WS_DV, RS_DV, local_window=W_DV, interpret=True)
    cores = ring_cores(settings, dilax.AttentionMask(), jnp.float32, D, DV)
    assert [c.name for c in cores] == ["xla"] * 3
    assert [c.name for c in ring_cores(settings, dilax.AttentionMask(), jnp.float32, D, D)
            ][:2] == ["pallas"] * 2  # dv == d: the kernels serve the branches and the hops


def test_ring_mods_refusals():
    """What the rings cannot serve with mods raises at trace time, naming it."""
    mesh = _mesh()
    q, k, v, _, slopes, sinks = _data(0)
    zigzag = dilax.SequenceParallel(mesh, "sp", layout="zigzag")
    with pytest.raises(ValueError, match="layout='contiguous'"):
        dilax.dilated_attention(q, k, v, WS, RS, is_causal=True, sequence_parallel=zigzag,
                                logits_soft_cap=CAP)
    sp = dilax.SequenceParallel(mesh, "sp")
    with pytest.raises(ValueError, match="score_mod"):  # the registry's reason
        dilax.dilated_attention(q, k, v, WS, RS, sequence_parallel=sp, implementation="pallas",
                                interpret=True, score_mod=flex.alibi(slopes))
    with pytest.raises(ValueError, match="sinks"):
        dilax.block_sparse_attention(q, k, v, PATTERN, sequence_parallel=sp,
                                     implementation="pallas", interpret=True, sinks=sinks)
    with pytest.raises(ValueError, match="sinks must be a float array"):
        dilax.block_sparse_attention(q, k, v, PATTERN, sequence_parallel=sp,
                                     sinks=jnp.zeros(H + 1))


def test_block_sparse_ring_batch_axis_mods_see_global_rows():
    """With the batch sharded too (``SequenceParallel(mesh, "sp", "b")``), a mod's ``b`` is
    the global batch row: the result equals the one-device op (forward), and the mod's ``b``
    matters in it."""
    mesh = jax.make_mesh((2, 2), ("b", "sp"), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices()[:4])
    q, k, v, _, _, sinks = _data(3)

    def mod(s, b, h, q_idx, kv_idx):
        del h, q_idx
        return s + 0.7 * b.astype(s.dtype) * (kv_idx % 3 == 0)

    ring = dilax.block_sparse_attention(q, k, v, PATTERN, is_causal=True, score_mod=mod,
                                        sinks=sinks,
                                        sequence_parallel=dilax.SequenceParallel(mesh, "sp", "b"))
    one = dilax.block_sparse_attention(q, k, v, PATTERN, is_causal=True, score_mod=mod,
                                       sinks=sinks)
    plain = dilax.block_sparse_attention(q, k, v, PATTERN, is_causal=True, sinks=sinks)
    ring, one, plain = (np.asarray(x, np.float64) for x in (ring, one, plain))
    assert_scaled_close(ring, one, 1e-5)
    assert np.max(np.abs(one[1] - plain[1])) > 0.1 and np.max(np.abs(one[0] - plain[0])) == 0
