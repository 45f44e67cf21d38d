"""FlexAttention's options on the other ops (docs/semantics.md, "Custom scores and masks
(FlexAttention semantics), every op"): ``dilax.dot_product_attention`` and
``dilax.block_sparse_attention`` with ``score_mod`` / ``mask_mod`` / ``block_mask`` /
``sinks`` / ``logits_soft_cap`` (and ``dv != d``), forward and gradients (q, k, v, sinks and
the mods' closed-over float arrays) against the float64 oracle of tests/test_flex.py; the
errors naming the argument and the registry's refusals. Tiny shapes, one program per case."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dilax
from dilax import flex, registry
from dilax.block_sparse import tables
from tests.test_flex import oracle
from tests.tolerance import assert_scaled_close


def _arrays(b, n, s, h, hk, d, dv, seed):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal(x), jnp.float32) for x in
               ((b, n, h, d), (b, s, hk, d), (b, s, hk, dv)))
    w = rng.standard_normal((b, n, h, dv)).astype(np.float32)
    return q, k, v, w, rng


def _grads(fn, args, w):
    """``out`` and the gradients of ``sum(out * w)`` w.r.t. every argument (one program)."""
    def loss(*a):
        out = fn(*a)
        return jnp.sum(out * w), out

    (_, out), g = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args))),
                                             has_aux=True))(*args)
    return np.asarray(out), [np.asarray(x) for x in g]


def _check(out, grads, want, exp):
    """Asserts against the oracle; returns the largest error relative to each scale."""
    worst = 0.0
    for got, e in zip((out, *grads), (want, *exp)):
        scale = max(1.0, float(np.abs(e).max()))
        assert_scaled_close(got, e, scale=scale)
        worst = max(worst, float(np.abs(got - e).max()) / scale)
    return worst


@pytest.mark.parametrize("case", ["causal_lengths", "block_mask", "block_mask_documents"])
def test_dot_product_softcap_alibi_sinks_dv_gqa(case):
    b, n, s, h, hk, d, dv, cap = 2, 32, 40, 4, 2, 8, 12, 2.0
    s = n if case == "block_mask_documents" else s  # segment_ids: self-attention
    q, k, v, w, rng = _arrays(b, n, s, h, hk, d, dv, seed=11)
    slopes = jnp.asarray(rng.uniform(0.05, 0.5, h), jnp.float32)
    sinks = jnp.asarray(rng.standard_normal(h), jnp.float32)
    kv_len = jnp.asarray([s, 29], jnp.int32)
    qi, ki = np.arange(n)[:, None], np.arange(s)[None, :]
    allowed = (ki <= qi)[None] & (ki[None] < np.asarray(kv_len)[:, None, None])
    bm, ids = None, None
    if case != "causal_lengths":  # the causal band |q - kv| <= 9 as a block mask
        band = flex.and_masks(flex.causal_mask, flex.sliding_window(9))
        bm = dilax.create_block_mask(band, None, None, n, s, block_size=8)
        allowed = allowed & (qi - ki <= 9)[None]
    if case == "block_mask_documents":  # AND packed documents (the core's key ranges)
        ids = np.cumsum(rng.random((b, n)) < 0.2, axis=1).astype(np.int32)
        allowed = allowed & (ids[:, :, None] == ids[:, None, :])
        ids = jnp.asarray(ids)

    def fn(q, k, v, slopes, sinks):
        return dilax.dot_product_attention(
            q, k, v, is_causal=bm is None, key_value_seq_lengths=kv_len, segment_ids=ids,
            score_mod=flex.alibi(slopes), block_mask=bm, sinks=sinks, logits_soft_cap=cap)

    out, grads = _grads(fn, (q, k, v, slopes, sinks), w)
    assert out.shape == (b, n, h, dv)
    rel = (ki - qi)[None, None].astype(np.float64)
    bias = np.asarray(slopes, np.float64)[None, :, None, None] * rel
    want, dq, dk, dvv, ds, dsinks = oracle(q, k, v, scale=d**-0.5, allowed=allowed[:, None],
                                           bias=bias, cap=cap, sinks=sinks, dout=w)
    dslopes = (ds * rel).sum(axis=(0, 2, 3))
    worst = _check(out, grads, want, (dq, dk, dvv, dslopes, dsinks))
    print(f"dot_product {case}: max scaled error {worst:.2e}")
    # return_residual: the lse of the denominator with the sinks, as flex_attention's
    _, lse = dilax.dot_product_attention(q, k, v, is_causal=True, score_mod=flex.alibi(slopes),
                                         sinks=sinks, return_residual=True)
    _, ref = dilax.flex_attention(q, k, v, mask_mod=flex.causal_mask, sinks=sinks,
                                  score_mod=flex.alibi(slopes), return_residual=True)
    assert_scaled_close(np.asarray(lse), np.asarray(ref))


def test_dot_product_mods_errors_and_refusals():
    b, n, h, d = 1, 16, 2, 8
    q, k, v, _, _ = _arrays(b, n, n, h, h, d, d, seed=12)
    f = dilax.dot_product_attention
    with pytest.raises(ValueError, match="sinks"):
        f(q, k, v, sinks=jnp.zeros((3,)))
    with pytest.raises(TypeError, match="score_mod"):
        f(q, k, v, score_mod=3)
    with pytest.raises(TypeError, match="mask_mod"):
        f(q, k, v, mask_mod=lambda b, h, q, kv: q - kv)  # not a bool
    with pytest.raises(ValueError, match="logits_soft_cap"):
        f(q, k, v, logits_soft_cap=-1.0)
    bm = dilax.create_block_mask(flex.causal_mask, None, None, n + 8, n, block_size=8)
    with pytest.raises(ValueError, match="block_mask"):
        f(q, k, v, block_mask=bm)
    with pytest.raises(ValueError, match="score_mod is not supported with dilation"):
        f(q, k, v, score_mod=flex.soft_cap(2.0), segment_lengths=(8,), dilation_rates=(1,))
    for name, why in (("cudnn", "cuDNN"), ("reference", "reference")):
        with pytest.raises(ValueError, match=why):
            f(q, k, v, mask_mod=flex.causal_mask, implementation=name)
    # the Pallas kernels take the mods (tests/test_pallas_dense_mods.py), not a dense bias
    with pytest.raises(ValueError, match="Pallas flash kernel has no bias or mask operand"):
        f(q, k, v, jnp.zeros((1, 1, n, n)), mask_mod=flex.causal_mask, implementation="pallas")
    # dv != d alone: the XLA core serves it, cuDNN refuses by name
    vv = jnp.concatenate([v, v], axis=-1)
    out = f(q, k, vv, is_causal=True)
    assert out.shape == (b, n, h, 2 * d)
    np.testing.assert_allclose(np.asarray(out[..., :d]), np.asarray(f(q, k, v, is_causal=True)),
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="dv != d"):
        f(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), vv.astype(jnp.bfloat16),
          implementation="cudnn")
    for name, op in (("pallas", "block_sparse"), ("cudnn", "dense"), ("cudnn", "block_sparse")):
        why = registry.supports(name, registry.CoreRequest(op, has_score_mod=True))
        assert why is not None and "score_mod" in why
    assert registry.supports("pallas", registry.CoreRequest("dense", has_score_mod=True)) is None


@pytest.mark.parametrize("case", ["per_head_causal", "per_head_causal_steps", "shared_lengths"])
def test_block_sparse_score_and_mask_mods(case, monkeypatch):
    """The pattern on row positions AND the mask_mod; the score_mod sees row positions (never
    gathered-block indices), per query head, per batch row ("steps": two query blocks per
    step of the row loop, so the positions of later steps are offset)."""
    b, n, h, hk, d, bs = 2, 44, 4, 2, 8, 8
    q, k, v, w, rng = _arrays(b, n, n, h, hk, d, d, seed=13)
    nb = -(-n // bs)
    causal = case.startswith("per_head_causal")
    scale = 0.3 if case.endswith("steps") else d**-0.5  # another static config: a new program
    if case.endswith("steps"):
        monkeypatch.setattr(tables, "rows_per_step", lambda *a, **kw: 2)
    heads = h if causal else 1  # per-head tables (a head per virtual kv head) or one shared
    blocks = rng.random((heads, nb, nb)) < 0.5
    blocks[:, np.arange(nb), np.arange(nb)] = True
    pattern = dilax.patterns.from_mask(blocks, bs)
    seg = np.repeat(np.array([[0, 1, 2], [3, 3, 4]]), [13, 20, 11], axis=1)
    kv_len = np.array([n, 37])
    qi, ki = np.arange(n)[:, None], np.arange(n)[None, :]
    doc = np.cumsum(np.concatenate([np.zeros((b, 1), int), seg[:, 1:] != seg[:, :-1]], 1), 1)
    allowed = pattern.expanded_mask(n, causal)[None] & (doc[:, :, None] == doc[:, None, :])[
        :, None]
    if causal:
        table = jnp.asarray(rng.standard_normal((h, 2 * 5 + 1)), jnp.float32)
        score_mod, lengths = flex.relative_bias(table), None
        idx = np.clip(ki - qi, -5, 5) + 5
        bias = np.asarray(table, np.float64)[:, idx][None]
    else:
        table = jnp.asarray(rng.uniform(0.05, 0.5, h), jnp.float32)
        score_mod, lengths = flex.alibi(table), jnp.asarray(kv_len, jnp.int32)
        bias = np.asarray(table, np.float64)[None, :, None, None] * (ki - qi)[None, None]
        allowed = allowed & (ki[None, None] < kv_len[:, None, None, None])
    sinks = jnp.asarray(rng.standard_normal(h), jnp.float32)
    mask_mod = flex.document_mask(jnp.asarray(seg))

    def fn(q, k, v, table, sinks):
        mod = flex.relative_bias(table) if causal else flex.alibi(table)
        return dilax.block_sparse_attention(q, k, v, pattern, is_causal=causal, scale=scale,
                                            key_value_seq_lengths=lengths, score_mod=mod,
                                            mask_mod=mask_mod, sinks=sinks, logits_soft_cap=3.0)

    del score_mod
    out, grads = _grads(fn, (q, k, v, table, sinks), w)
    want, dq, dk, dvv, ds, dsinks = oracle(q, k, v, scale=scale, allowed=allowed, bias=bias,
                                           cap=3.0, sinks=sinks, dout=w)
    if causal:
        dtable = np.zeros((h, 11))
        for j in range(h):
            np.add.at(dtable[j], idx.ravel(), ds[:, j].sum(0).ravel())
    else:
        dtable = (ds * (ki - qi)[None, None]).sum(axis=(0, 2, 3))
    worst = _check(out, grads, want, (dq, dk, dvv, dtable, dsinks))
    print(f"block_sparse {case}: max scaled error {worst:.2e}")


def test_block_sparse_mods_refusals():
    b, n, h, d, bs = 1, 32, 2, 8, 16
    q, k, v, _, _ = _arrays(b, n, n, h, h, d, d, seed=14)
    pattern = dilax.patterns.local_window(n, bs, 1)
    f = dilax.block_sparse_attention
    for name, why in (("pallas", "Pallas"), ("reference", "reference"), ("cudnn", "cuDNN")):
        with pytest.raises(ValueError, match=why):
            f(q, k, v, pattern, score_mod=flex.soft_cap(2.0), implementation=name,
              interpret=True)
    with pytest.raises(ValueError, match="sinks"):
        f(q, k, v, pattern, sinks=jnp.zeros((h + 1,)))
    with pytest.raises(TypeError, match="mask_mod"):
        f(q, k, v, pattern, mask_mod="causal")
    with pytest.raises(ValueError, match="logits_soft_cap"):
        f(q, k, v, pattern, logits_soft_cap=0.0)
    # a mask_mod that removes every pair of a row: out 0, never NaN
    out = f(q, k, v, pattern, mask_mod=lambda b, h, qi, ki: qi != 3)
    assert np.all(np.asarray(out[:, 3]) == 0) and np.all(np.isfinite(np.asarray(out)))


def test_block_sparse_dv_segment_ids_and_mods():
    """``v`` with its own head dim (``dv != d``) together with ``segment_ids`` (the pattern
    AND same document), a band ``mask_mod``, ALiBi, the soft-cap and sinks, causal: forward and
    gradients (q, k, v, slopes, sinks) against the oracle; the Pallas kernel refuses
    ``dv != d`` with the registry's reason."""
    b, n, h, hk, d, dv, bs = 2, 40, 4, 2, 8, 12, 8
    q, k, v, w, rng = _arrays(b, n, n, h, hk, d, dv, seed=21)
    nb = n // bs
    blocks = rng.random((h, nb, nb)) < 0.6
    blocks[:, np.arange(nb), np.arange(nb)] = True
    pattern = dilax.patterns.from_mask(blocks, bs)
    seg = np.repeat(np.array([[0, 1, 2], [3, 3, 4]]), [11, 17, 12], axis=1).astype(np.int32)
    slopes = jnp.asarray(rng.uniform(0.05, 0.3, h), jnp.float32)
    sinks = jnp.asarray(rng.standard_normal(h), jnp.float32)

    def fn(q, k, v, slopes, sinks):
        return dilax.block_sparse_attention(
            q, k, v, pattern, is_causal=True, segment_ids=jnp.asarray(seg),
            score_mod=flex.alibi(slopes), mask_mod=flex.sliding_window(14), sinks=sinks,
            logits_soft_cap=3.0)

    out, grads = _grads(fn, (q, k, v, slopes, sinks), w)
    assert out.shape == (b, n, h, dv)
    qi, ki = np.arange(n)[:, None], np.arange(n)[None, :]
    doc = np.cumsum(np.concatenate([np.zeros((b, 1), int), seg[:, 1:] != seg[:, :-1]], 1), 1)
    allowed = (pattern.expanded_mask(n, True)[None] & (np.abs(qi - ki) <= 14)[None, None]
               & (doc[:, :, None] == doc[:, None, :])[:, None])
    rel = (ki - qi)[None, None].astype(np.float64)
    bias = np.asarray(slopes, np.float64)[None, :, None, None] * rel
    want, dq, dk, dvv, ds, dsinks = oracle(q, k, v, scale=d**-0.5, allowed=allowed, bias=bias,
                                           cap=3.0, sinks=sinks, dout=w)
    worst = _check(out, grads, want, (dq, dk, dvv, (ds * rel).sum(axis=(0, 2, 3)), dsinks))
    print(f"block_sparse dv != d, segment_ids and mods: max scaled error {worst:.2e}")
    with pytest.raises(ValueError, match="dv != d"):
        dilax.block_sparse_attention(q, k, v, pattern, implementation="pallas", interpret=True)
