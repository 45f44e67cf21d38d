"""dilax.flex_attention (docs/semantics.md, "Custom scores and masks (FlexAttention
semantics)"): forward and gradients (q, k, v, sinks, closed-over float arrays) against a
float64 NumPy oracle written here, create_block_mask against a brute-force classification,
the registry's answers and the errors. Tiny shapes, one compiled program per case."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dilax
from dilax import flex, registry
from tests.tolerance import FP32, HALF, assert_scaled_close


def oracle(q, k, v, *, scale, allowed=None, weights=None, bias=0.0, cap=None, sinks=None,
           dout=None, div=1):
    """Float64: ``out``, and with ``dout`` the gradients ``dq, dk, dv, dscore, dsinks``
    (``dscore (b, h, n, s)``: the cotangent of the score after the cap, i.e. of ``bias``).

    ``allowed`` (bool, broadcast to ``(b, h, n, s)``) or ``weights``: multiplicities of the
    pairs in the one softmax (0 = not attended; a dilated mixture's count matrix); ``div``:
    the result divided by it (grouped mode's ``G``)."""
    q, k, v = (np.asarray(np.asarray(x, np.float32), np.float64) for x in (q, k, v))
    b, n, h, _ = q.shape
    g = h // k.shape[2]
    kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    raw = np.einsum("bqhd,bkhd->bhqk", q, kr) * scale
    t = np.tanh(raw / cap) if cap else None
    score = (cap * t if cap else raw) + bias
    w = np.broadcast_to(np.asarray(allowed if weights is None else weights, np.float64),
                        score.shape)
    score = np.where(w > 0, score, -np.inf)
    sink = (np.full(h, -np.inf) if sinks is None else np.asarray(sinks, np.float64))
    sink = np.broadcast_to(sink[None, :, None, None], (b, h, n, 1))
    m = np.maximum(np.max(score, axis=-1, keepdims=True), sink)
    m = np.where(np.isfinite(m), m, 0.0)
    e, es = np.where(w > 0, w * np.exp(score - m), 0.0), np.exp(sink - m)
    z = e.sum(-1, keepdims=True) + es
    zs = np.where(z > 0, z, 1.0)
    p, ps = e / zs, es / zs
    out = np.einsum("bhqk,bkhd->bqhd", p, vr)
    if dout is None:
        return out / div
    dout = np.asarray(dout, np.float64) / div
    dp = np.einsum("bqhd,bkhd->bhqk", dout, vr)
    delta = np.einsum("bqhd,bqhd->bhq", dout, out)[..., None]
    ds = p * (dp - delta)
    dsinks = -(ps * delta).sum(axis=(0, 2, 3))
    dr = ds * (1 - t**2) if cap else ds
    dq = np.einsum("bhqk,bkhd->bqhd", dr, kr) * scale
    fold = lambda x: x.reshape(b, x.shape[1], -1, g, x.shape[-1]).sum(3)  # noqa: E731
    dk = fold(np.einsum("bhqk,bqhd->bkhd", dr, q) * scale)
    dv = fold(np.einsum("bhqk,bqhd->bkhd", p, dout))
    return out / div, dq, dk, dv, ds, dsinks


def _inputs(b, n, s, h, hk, d, dv, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in
               ((b, n, h, d), (b, s, hk, d), (b, s, hk, dv)))
    w = rng.standard_normal((b, n, h, dv)).astype(np.float32)  # the loss's weights = dout
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v)), w, rng


def _run(fn, args, w):
    """``out`` and the gradients of ``sum(out * w)`` w.r.t. every argument, one program."""
    def loss(*a):
        out = fn(*a)
        return jnp.sum(out.astype(jnp.float32) * w), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args))),
                                                 has_aux=True))(*args)
    return np.asarray(out.astype(jnp.float32)), [np.asarray(x.astype(jnp.float32))
                                                 for x in grads]


def _positions(n, s):
    return np.arange(n)[:, None], np.arange(s)[None, :]


@pytest.mark.parametrize("case", ["dense", "block_mask", "bf16", "block_mask_256"])
def test_softcap_alibi_causal_sinks_gqa(case):
    # block_mask_256: the XLA backward splits the tables' 256-key blocks into 128-key columns
    b, n, h, hk, d = 2, 300 if case == "block_mask_256" else 40, 4, 2, 8
    dtype = jnp.bfloat16 if case == "bf16" else jnp.float32
    (q, k, v), w, rng = _inputs(b, n, n, h, hk, d, d, seed=1, dtype=dtype)
    slopes = jnp.asarray(rng.uniform(0.05, 0.5, h), jnp.float32)
    sinks = jnp.asarray(rng.standard_normal(h), jnp.float32)
    cap = 2.0
    bm = (dilax.create_block_mask(flex.causal_mask, None, None, n, n,
                                  block_size=256 if case == "block_mask_256" else 16)
          if case.startswith("block_mask") else None)

    def fn(q, k, v, slopes, sinks):
        return dilax.flex_attention(q, k, v, score_mod=flex.alibi(slopes),
                                    mask_mod=None if bm else flex.causal_mask, block_mask=bm,
                                    sinks=sinks, logits_soft_cap=cap)

    out, grads = _run(fn, (q, k, v, slopes, sinks), w)
    qi, ki = _positions(n, n)
    rel = (ki - qi)[None, None].astype(np.float64)
    bias = np.asarray(slopes, np.float64)[None, :, None, None] * rel
    want, dq, dk, dv, ds, dsinks = oracle(q, k, v, scale=d**-0.5, allowed=qi >= ki, bias=bias,
                                          cap=cap, sinks=sinks, dout=w)
    dslopes = (ds * rel).sum(axis=(0, 2, 3))
    tol = HALF if case == "bf16" else FP32
    assert_scaled_close(out, want, tol)
    for got, exp in zip(grads, (dq, dk, dv, dslopes, dsinks)):
        assert_scaled_close(got, exp, tol, scale=max(1.0, float(np.abs(exp).max())))


def test_documents_and_window_with_block_mask_relative_bias():
    b, n, h, d, window = 2, 64, 2, 8, 9
    (q, k, v), w, rng = _inputs(b, n, n, h, h, d, d, seed=2)
    seg = np.repeat(np.array([[0, 1, 2, 3], [5, 5, 7, 5]]), [10, 30, 20, 4], axis=1)
    table = jnp.asarray(rng.standard_normal((h, 2 * 6 + 1)), jnp.float32)
    mask_mod = flex.and_masks(flex.document_mask(jnp.asarray(seg)), flex.sliding_window(window))
    bm = dilax.create_block_mask(mask_mod, b, None, n, n, block_size=16)

    def fn(q, k, v, table):
        return dilax.flex_attention(q, k, v, score_mod=flex.relative_bias(table), block_mask=bm)

    out, grads = _run(fn, (q, k, v, table), w)
    qi, ki = _positions(n, n)
    doc = np.cumsum(np.concatenate([np.zeros((b, 1), int), seg[:, 1:] != seg[:, :-1]], 1), 1)
    allowed = ((doc[:, :, None] == doc[:, None, :]) & (np.abs(qi - ki) <= window)[None])[:, None]
    idx = np.clip(ki - qi, -6, 6) + 6
    bias = np.asarray(table, np.float64)[:, idx][None]
    want, dq, dk, dv, ds, _ = oracle(q, k, v, scale=d**-0.5, allowed=allowed, bias=bias,
                                     dout=w)
    dtable = np.zeros((h, 13))
    for j in range(h):
        np.add.at(dtable[j], idx.ravel(), ds[:, j].sum(0).ravel())
    assert_scaled_close(out, want)
    for got, exp in zip(grads, (dq, dk, dv, dtable)):
        assert_scaled_close(got, exp, scale=max(1.0, float(np.abs(exp).max())))
    # the rows' last document (4 keys, id 5 again) is its own document: a run, not an id
    assert np.all(np.asarray(bm.classes)[1, 0, 3, :2] == 0)


def test_prefix_lm_traced_prefix():
    b, n, h, d = 2, 24, 2, 8
    (q, k, v), w, _ = _inputs(b, n, n, h, 1, d, d, seed=3)
    prefix = jnp.asarray([5, 13], jnp.int32)

    def fn(q, k, v, prefix):  # prefix traced inside the jitted program
        return dilax.flex_attention(q, k, v, mask_mod=flex.prefix_lm_mask(prefix))

    out, grads = _run(lambda q, k, v: fn(q, k, v, prefix), (q, k, v), w)
    qi, ki = _positions(n, n)
    allowed = ((ki <= qi)[None] | (ki[None] < np.asarray(prefix)[:, None, None]))[:, None]
    want, *exp = oracle(q, k, v, scale=d**-0.5, allowed=allowed, dout=w)
    assert_scaled_close(out, want)
    for got, e in zip(grads, exp[:3]):
        assert_scaled_close(got, e)
    jitted = jax.jit(fn)(q, k, v, prefix)
    assert_scaled_close(np.asarray(jitted), want)
    # grad of jit: the mod's closed-over traced prefix is an operand, not a captured tracer
    dq = jax.grad(lambda q: jnp.sum(jax.jit(fn)(q, k, v, prefix) * w))(q)
    assert_scaled_close(np.asarray(dq), exp[0])


def test_random_block_table_n_ne_s_dv_ne_d_empty_rows():
    b, n, s, h, hk, d, dv = 2, 40, 56, 4, 2, 8, 12
    (q, k, v), w, rng = _inputs(b, n, s, h, hk, d, dv, seed=4)
    blocks = rng.random((b, h, 5, 4)) < 0.5  # random (8 x 16) block table
    dense = np.repeat(np.repeat(blocks, 8, 2), 16, 3)[:, :, :n, :s]
    dense &= rng.random(dense.shape) < 0.8  # partial blocks too
    dense[:, :, 3] = False  # query row 3 sees no key in any head
    dense[0, 1, :8] = False  # a whole query block without keys in one head
    allowed = jnp.asarray(dense)

    def mask_mod(b, h, q_idx, kv_idx):
        return allowed[b, h, q_idx, kv_idx]

    bm = dilax.create_block_mask(mask_mod, b, h, n, s, block_size=(8, 16))
    out, grads = _run(lambda q, k, v: dilax.flex_attention(q, k, v, block_mask=bm),
                      (q, k, v), w)
    want, *exp = oracle(q, k, v, scale=d**-0.5, allowed=dense, dout=w)
    assert out.shape == (b, n, h, dv)
    assert np.all(np.isfinite(out)) and all(np.all(np.isfinite(g)) for g in grads)
    assert np.all(out[:, 3] == 0) and np.all(out[0, :8, 1] == 0)
    assert np.all(grads[0][:, 3] == 0)
    assert_scaled_close(out, want)
    for got, e in zip(grads, exp[:3]):
        assert_scaled_close(got, e)


def _brute_classes(dense, qb, kb):
    B, H, n, s = dense.shape
    nq, nk = -(-n // qb), -(-s // kb)
    out = np.zeros((B, H, nq, nk), np.int8)
    for i in range(nq):
        for j in range(nk):
            blk = dense[:, :, i * qb:(i + 1) * qb, j * kb:(j + 1) * kb]
            out[:, :, i, j] = np.where(blk.all((2, 3)), 2, np.where(blk.any((2, 3)), 1, 0))
    return out


def test_create_block_mask_classification():
    B, H, n, s = 2, 3, 50, 37
    seg = np.repeat(np.array([[0, 1, 2], [4, 4, 4]]), [10, 25, 15], axis=1)
    segk = seg[:, :s]
    mask_mod = flex.or_masks(
        flex.and_masks(flex.document_mask(jnp.asarray(seg), jnp.asarray(segk)),
                       flex.causal_mask),
        lambda b, h, q, kv: (kv < h + 1) & (q % 7 == 0))
    bm = dilax.create_block_mask(mask_mod, B, H, n, s, block_size=(8, 16))
    qi, ki = _positions(n, s)
    hh = np.arange(H)[:, None, None]
    dense = ((seg[:, None, :, None] == segk[:, None, None, :]) & (qi >= ki)[None, None]) | (
        (ki < hh + 1) & (qi % 7 == 0))[None]
    want = _brute_classes(dense, 8, 16)
    np.testing.assert_array_equal(np.asarray(bm.classes), want)
    full_idx, full_cnt, part_idx, part_cnt = (np.asarray(x) for x in bm.kv_blocks)
    for bi in range(B):
        for i in range(want.shape[2]):
            full = np.flatnonzero((want[bi, :, i] == 2).all(0))
            some = np.flatnonzero((want[bi, :, i] != 0).any(0))
            assert list(full_idx[bi, i, :full_cnt[bi, i]]) == list(full)
            assert list(part_idx[bi, i, :part_cnt[bi, i]]) == sorted(set(some) - set(full))
    assert 0 < float(bm.density()) < 1
    shared = dilax.create_block_mask(flex.causal_mask, None, None, 33, 33, block_size=64)
    assert shared.block_size == (33, 33) and np.asarray(shared.classes).shape == (1, 1, 1, 1)


def test_registry_serves_flex_on_xla_and_pallas():
    for name in ("pallas", "cudnn"):
        for req, word in ((registry.CoreRequest("flex"), "flex_attention"),
                          (registry.CoreRequest("dilated_branch", has_mask_mod=True),
                           "mask_mod"),
                          (registry.CoreRequest("dilated_branch", head_dim=64,
                                                value_head_dim=32), "dv != d"),
                          (registry.CoreRequest("block_sparse", has_sinks=True), "sinks")):
            reason = registry.supports(name, req)
            if name == "pallas" and req.op == "flex":
                assert reason is None
                continue
            assert reason is not None and word in reason, (name, req, reason)
    assert registry.supports("xla", registry.CoreRequest("flex", has_score_mod=True)) is None
    # the Pallas kernels trace flex_attention's mods (tests/test_pallas_mods.py)
    assert registry.choose(None, registry.CoreRequest("flex", platform="gpu"))[0] == "pallas"


def test_errors_name_the_argument():
    (q, k, v), _, _ = _inputs(1, 8, 8, 2, 1, 4, 4)
    fa = dilax.flex_attention
    assert fa(q[:0], k[:0], v[:0]).shape == (0, 8, 2, 4)  # empty batch: no error
    np.testing.assert_array_equal(np.asarray(fa(q, k[:, :0], v[:, :0])), 0)  # no keys
    with pytest.raises(ValueError, match="query must be rank 4"):
        fa(q[0], k, v)
    with pytest.raises(ValueError, match="value must be"):
        fa(q, k, v[:, :4])
    with pytest.raises(ValueError, match="key head dim"):
        fa(q, k[..., :2], v)
    with pytest.raises(TypeError, match="one dtype"):
        fa(q, k, v.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="multiple of the key heads"):
        fa(q[:, :, :1], k[:, :, :1].repeat(2, 2), v[:, :, :1].repeat(2, 2))
    with pytest.raises(TypeError, match="score_mod must be callable"):
        fa(q, k, v, score_mod=3.0)
    with pytest.raises(TypeError, match="mask_mod must be callable"):
        fa(q, k, v, mask_mod="causal")
    with pytest.raises(TypeError, match="score_mod must return a floating"):
        fa(q, k, v, score_mod=lambda s, b, h, qi, ki: qi > ki)
    with pytest.raises(TypeError, match="mask_mod must return a bool"):
        fa(q, k, v, mask_mod=lambda b, h, qi, ki: (qi - ki).astype(jnp.float32))
    with pytest.raises(TypeError, match="mask_mod must return a bool"):
        fa(q, k, v, mask_mod=lambda b, h, qi, ki: jnp.stack([qi >= ki, qi >= ki]))
    with pytest.raises(ValueError, match="sinks must be"):
        fa(q, k, v, sinks=jnp.zeros(3))
    with pytest.raises(ValueError, match="logits_soft_cap must be"):
        fa(q, k, v, logits_soft_cap=-1.0)
    bm = dilax.create_block_mask(flex.causal_mask, None, None, 16, 8, block_size=8)
    with pytest.raises(ValueError, match="block_mask of shape"):
        fa(q, k, v, block_mask=bm)
    with pytest.raises(TypeError, match="block_mask must be"):
        fa(q, k, v, block_mask=np.ones((1, 1, 1, 1), bool))
    with pytest.raises(ValueError, match="'cudnn'.*cuDNN's fused attention: no flex_attention"):
        fa(q, k, v, implementation="cudnn")
    with pytest.raises(ValueError, match="compile Triton code for a GPU: pass interpret=True"):
        fa(q, k, v, implementation="pallas")  # a CPU program: the kernels need interpret
    with pytest.raises(ValueError, match="Q_LEN must be a positive int"):
        dilax.create_block_mask(flex.causal_mask, None, None, 0, 8)
    with pytest.raises(TypeError, match="and_masks: argument 1"):
        flex.and_masks(flex.causal_mask, None)


def test_block_mask_never_visits_empty_blocks():
    """Values of key blocks that no query attends are never read with a block mask (NaN
    there stays out); without one the dense loop reads them (0 * NaN)."""
    b, n, h, d = 1, 48, 2, 8
    (q, k, v), _, _ = _inputs(b, n, n, h, h, d, d, seed=5)
    v = v.at[:, 16:32].set(jnp.nan)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < 16) | (kv_idx >= 32)

    bm = dilax.create_block_mask(mask_mod, None, None, n, n, block_size=16)
    out = np.asarray(dilax.flex_attention(q, k, v, block_mask=bm))
    qi, ki = _positions(n, n)
    want = oracle(q, k, np.nan_to_num(np.asarray(v)), scale=d**-0.5,
                  allowed=(ki < 16) | (ki >= 32))
    assert_scaled_close(out, want)
    assert np.isnan(np.asarray(dilax.flex_attention(q, k, v, mask_mod=mask_mod))).any()
