"""``dilax.dot_product_attention`` (op ``"dense"``) with FlexAttention's options on the Pallas
flash kernels (the path ``flex_attention(implementation="pallas")`` takes, mods traced inside
the kernels): soft-cap, ALiBi (learnable slopes), a document ``mask_mod`` with causality and
lengths, sinks, GQA, forward and gradients against the float64 oracle of tests/test_flex.py
and the XLA path; ``implementation=None`` takes the kernels on a GPU; what they cannot express
(a dense bias / mask, segment_ids, dv != d, a mod without a tile form) is refused by
:mod:`dilax.registry` with its reason. dot_product_attention has no ``interpret`` switch (jax's
signature), so ``registry.core`` is patched to hand out the interpreted kernels on CPU. Tiny
shapes: ``n = 72`` spans two 64-row tiles (a ragged one)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dilax
from dilax import flex, registry
from tests.test_flex import _inputs, oracle
from tests.test_pallas_mods import _run  # out, grads, whether kernels ran
from tests.tolerance import FP32, HALF, assert_scaled_close

_CORE = registry.core


@pytest.fixture
def interpreted(monkeypatch):
    """The Pallas kernels of every registry choice run in the Pallas interpreter (CPU)."""
    monkeypatch.setattr(registry, "core", lambda name, interpret=False: _CORE(name, True))


def _check(got, want, tol):
    """Asserts each array against the oracle at its own scale; the largest scaled error."""
    worst = 0.0
    for g, e in zip(got, want):
        scale = max(1.0, float(np.abs(e).max()))
        assert_scaled_close(g, e, tol, scale=scale)
        worst = max(worst, float(np.abs(g - e).max()) / scale)
    return worst


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_softcap_alibi_sinks_causal_lengths_gqa(dtype, interpreted):
    b, n, h, hk, d, cap = 2, 72, 4, 2, 16, 2.0
    (q, k, v), w, rng = _inputs(b, n, n, h, hk, d, d, seed=21, dtype=jnp.dtype(dtype))
    slopes = jnp.asarray(rng.uniform(0.05, 0.5, h), jnp.float32)
    sinks = jnp.asarray(rng.standard_normal(h), jnp.float32)
    kv_len = jnp.asarray([n, 61], jnp.int32)

    def fn(impl):
        return lambda q, k, v, slopes, sinks: dilax.dot_product_attention(
            q, k, v, is_causal=True, key_value_seq_lengths=kv_len, score_mod=flex.alibi(slopes),
            sinks=sinks, logits_soft_cap=cap, implementation=impl)

    args = (q, k, v, slopes, sinks)
    out, grads, kernels = _run(fn("pallas"), args, w)
    assert kernels
    qi, ki = np.arange(n)[:, None], np.arange(n)[None, :]
    allowed = ((ki <= qi)[None] & (ki[None] < np.asarray(kv_len)[:, None, None]))[:, None]
    rel = (ki - qi)[None, None].astype(np.float64)
    bias = np.asarray(slopes, np.float64)[None, :, None, None] * rel
    want, dq, dk, dv, ds, dsinks = oracle(q, k, v, scale=d**-0.5, allowed=allowed, bias=bias,
                                          cap=cap, sinks=sinks, dout=w)
    tol = HALF if dtype == "bfloat16" else FP32
    worst = _check((out, *grads), (want, dq, dk, dv, (ds * rel).sum(axis=(0, 2, 3)), dsinks),
                   tol)
    xla_out, xla_grads, xla_kernels = _run(fn("xla"), args, w)
    assert not xla_kernels
    _check((out, *grads), (xla_out, *xla_grads), tol)  # the XLA path, the same numbers
    print(f"dense pallas {dtype}: max scaled error vs oracle {worst:.2e}")


def test_document_mask_mod_causal_window_query_lengths(interpreted):
    """A closed-over per-position array (document ids, read at ``q_idx`` and ``kv_idx``) as
    the ``mask_mod`` of a block mask, with the call's own causality, band and query lengths;
    a query row past its length gets 0."""
    b, n, h, hk, d = 2, 72, 4, 1, 16
    (q, k, v), w, _ = _inputs(b, n, n, h, hk, d, d, seed=22)
    seg = np.repeat(np.array([[0, 1, 2, 3], [5, 5, 7, 5]]), [10, 30, 20, 12], axis=1)
    q_len = jnp.asarray([n, 50], jnp.int32)

    # its per-batch BlockMask of 64-blocks: the mask_mod, and tables for the kernels' loops
    bm = dilax.create_block_mask(flex.document_mask(jnp.asarray(seg)), b, None, n, n,
                                 block_size=64)

    def fn(q, k, v):
        return dilax.dot_product_attention(
            q, k, v, is_causal=True, local_window_size=(24, 0), query_seq_lengths=q_len,
            block_mask=bm, implementation="pallas")

    out, grads, kernels = _run(fn, (q, k, v), w)
    assert kernels
    qi, ki = np.arange(n)[:, None], np.arange(n)[None, :]
    doc = np.cumsum(np.concatenate([np.zeros((b, 1), int), seg[:, 1:] != seg[:, :-1]], 1), 1)
    allowed = ((doc[:, :, None] == doc[:, None, :]) & (ki <= qi)[None] & (qi - ki <= 24)[None]
               & (qi[None] < np.asarray(q_len)[:, None, None]))[:, None]
    want, dq, dk, dv, _, _ = oracle(q, k, v, scale=d**-0.5, allowed=allowed, dout=w)
    worst = _check((out, *grads), (want, dq, dk, dv), FP32)
    assert not np.asarray(out)[1, 50:].any()
    print(f"dense pallas documents: max scaled error vs oracle {worst:.2e}")


def test_none_takes_the_kernels_on_gpu_and_refusals_name_the_reason(interpreted, monkeypatch):
    b, n, h, d = 1, 16, 2, 8
    (q, k, v), _, rng = _inputs(b, n, n, h, h, d, d, seed=23)
    f = dilax.dot_product_attention

    def uses_kernels(value=v, **kw):
        jaxpr = jax.make_jaxpr(lambda q, k, v: f(q, k, v, **kw))(q, k, value)
        return "pallas_call" in str(jaxpr)

    assert not uses_kernels(logits_soft_cap=3.0)  # None on a CPU: the XLA core
    monkeypatch.setattr(registry, "current_platform", lambda: "gpu")
    mods = registry.CoreRequest("dense", "bfloat16", 64, True, has_score_mod=True,
                                has_sinks=True, platform="gpu")
    assert registry.choose(None, mods)[0] == "pallas"
    assert uses_kernels(logits_soft_cap=3.0, is_causal=True)
    assert uses_kernels(mask_mod=flex.causal_mask, sinks=jnp.zeros((h,)))
    # without mods None stays jax's default, the XLA path (and its programs are unchanged)
    assert registry.choose(None, registry.CoreRequest("dense", platform="gpu"))[0] == "xla"
    assert not uses_kernels(is_causal=True)
    # what the kernels cannot express: explicit 'pallas' raises the reason, None runs XLA
    # (each case's extra operand leaves the values alone: zero bias, all-true mask, one
    # document, a mod adding 0)
    table = jnp.asarray(rng.standard_normal((h, 2 * n - 1)), jnp.float32)

    def whole(score, b, h, q_idx, kv_idx):  # reads its array whole: no tile form
        return score + jnp.sum(table[h]) * 0.0

    cases = (
        (dict(bias=jnp.zeros((1, 1, n, n))), "no bias or mask operand"),
        (dict(mask=jnp.ones((1, 1, n, n), bool)), "no bias or mask operand"),
        (dict(segment_ids=jnp.zeros((b, n), jnp.int32)), "segment_ids"),
        (dict(value=jnp.concatenate([v, v], -1)), "dv != d"),
        (dict(score_mod=whole), "one element at a time"),
    )
    for kw, why in cases:
        kw = dict(dict(value=v, logits_soft_cap=3.0), **kw)
        value = kw.pop("value")
        with pytest.raises(ValueError, match=why):
            f(q, k, value, implementation="pallas", **kw)
        assert not uses_kernels(value, **kw)  # None: the XLA core, with the same values
        want = oracle(q, k, value, scale=d**-0.5, allowed=True, cap=3.0)  # each kw a no-op
        assert_scaled_close(np.asarray(f(q, k, value, **kw)), want)
