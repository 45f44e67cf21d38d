"""FlexAttention mods traced inside the Pallas kernels (pallas_kernels/mods.py), interpret
mode on CPU: the flash forward and backward with soft-cap, ALiBi (learnable slopes),
document and causal ``mask_mod`` s, a relative-bias table, GQA and sinks, and the decode
kernel with a ``score_mod`` and a ``mask_mod``, each against a float64 NumPy oracle; the
registry's answers and the fallback of a mod without a tile form. Tiny shapes; ``n = 72``
spans two 64-row tiles (a ragged one) so the key loops, the dk/dv query loops and the
per-program partial gradients of the closed-over arrays all run over several tiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dilax
from dilax import flex, registry
from dilax.core.mods import trace_mod
from pallas_kernels.decode import DecodeBranch, decode_attention
from pallas_kernels.mods import kernel_mods
from tests.test_flex import _inputs as flex_inputs
from tests.test_flex import oracle
from tests.tolerance import FP32, HALF, assert_scaled_close


def _inputs(b, n, h, hk, d, seed, dtype=jnp.float32):
    """test_flex's inputs with ``s = n`` and ``dv = d`` (the kernels' square case)."""
    return flex_inputs(b, n, n, h, hk, d, d, seed, dtype)


def _run(fn, args, w):
    """``out`` and the gradients of ``sum(out * w)`` w.r.t. every argument (one program),
    and whether that program runs Pallas kernels."""
    def loss(*a):
        out = fn(*a)
        return jnp.sum(out.astype(jnp.float32) * w), out

    grad = jax.value_and_grad(loss, argnums=tuple(range(len(args))), has_aux=True)
    kernels = "pallas_call" in str(jax.make_jaxpr(grad)(*args))
    (_, out), grads = jax.jit(grad)(*args)
    as_np = lambda x: np.asarray(x.astype(jnp.float32))  # noqa: E731
    return as_np(out), [as_np(g) for g in grads], kernels


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_flash_softcap_alibi_causal_gqa_sinks(dtype):
    b, n, h, hk, d, cap = 2, 72, 4, 2, 8, 2.0
    (q, k, v), w, rng = _inputs(b, n, h, hk, d, seed=1, dtype=jnp.dtype(dtype))
    slopes = jnp.asarray(rng.uniform(0.05, 0.5, h), jnp.float32)
    sinks = jnp.asarray(rng.standard_normal(h), jnp.float32)

    def fn(q, k, v, slopes, sinks):
        return dilax.flex_attention(q, k, v, score_mod=flex.alibi(slopes),
                                    mask_mod=flex.causal_mask, sinks=sinks, logits_soft_cap=cap,
                                    implementation="pallas", interpret=True)

    out, grads, kernels = _run(fn, (q, k, v, slopes, sinks), w)
    assert kernels
    qi, ki = np.arange(n)[:, None], np.arange(n)[None, :]
    rel = (ki - qi)[None, None].astype(np.float64)
    bias = np.asarray(slopes, np.float64)[None, :, None, None] * rel
    want, dq, dk, dv, ds, dsinks = oracle(q, k, v, scale=d**-0.5, allowed=qi >= ki, bias=bias,
                                          cap=cap, sinks=sinks, dout=w)
    dslopes = (ds * rel).sum(axis=(0, 2, 3))  # the learnable slopes' gradient
    tol = HALF if dtype == "bfloat16" else FP32
    assert_scaled_close(out, want, tol)
    for got, exp in zip(grads, (dq, dk, dv, dslopes, dsinks)):
        assert_scaled_close(got, exp, tol, scale=max(1.0, float(np.abs(exp).max())))


def test_flash_documents_causal_relative_bias_block_mask():
    """A closed-over per-position array (document ids, read at ``q_idx`` and ``kv_idx``),
    causal, and a per-head relative-bias table whose gradient is a scatter over many
    entries per tile; a per-batch BlockMask of 64-blocks drives the backward kernels' loops
    (whole tiles of dq 64 x 32 and dk/dv 32 x 32), the forward's 128-row query tile visits
    every key tile with the mask_mod."""
    b, n, h, hk, d, radius = 2, 72, 2, 1, 8, 6
    (q, k, v), w, rng = _inputs(b, n, h, hk, d, seed=2)
    seg = np.repeat(np.array([[0, 1, 2, 3], [5, 5, 7, 5]]), [10, 30, 20, 12], axis=1)
    table = jnp.asarray(rng.standard_normal((h, 2 * radius + 1)), jnp.float32)
    mask_mod = flex.and_masks(flex.document_mask(jnp.asarray(seg)), flex.causal_mask)
    bm = dilax.create_block_mask(mask_mod, b, None, n, n, block_size=64)

    def fn(q, k, v, table):
        return dilax.flex_attention(q, k, v, score_mod=flex.relative_bias(table),
                                    block_mask=bm, implementation="pallas", interpret=True)

    out, grads, kernels = _run(fn, (q, k, v, table), w)
    assert kernels
    qi, ki = np.arange(n)[:, None], np.arange(n)[None, :]
    doc = np.cumsum(np.concatenate([np.zeros((b, 1), int), seg[:, 1:] != seg[:, :-1]], 1), 1)
    allowed = ((doc[:, :, None] == doc[:, None, :]) & (qi >= ki)[None])[:, None]
    idx = np.clip(ki - qi, -radius, radius) + radius
    bias = np.asarray(table, np.float64)[:, idx][None]
    want, dq, dk, dv, ds, _ = oracle(q, k, v, scale=d**-0.5, allowed=allowed, bias=bias,
                                     dout=w)
    dtable = np.zeros((h, 2 * radius + 1))
    for j in range(h):
        np.add.at(dtable[j], idx.ravel(), ds[:, j].sum(0).ravel())
    assert_scaled_close(out, want)
    for got, exp in zip(grads, (dq, dk, dv, dtable)):
        assert_scaled_close(got, exp, scale=max(1.0, float(np.abs(exp).max())))


def test_block_mask_tables_steer_the_kernels():
    """With a block mask whose blocks are whole tiles of every kernel (128 x 64 blocks;
    tiles: forward 128 x 64, dq 64 x 32, dk/dv 32 x 32) the kernels visit only its partial
    and full blocks: values of key blocks no query attends (NaN here) are never read,
    forward or backward (their dk, dv are 0); without it every tile is visited and 0 * NaN
    leaks. The full block (queries 128.., keys ..63) skips the mask_mod."""
    b, n, h, d = 1, 192, 2, 8
    (q, k, v), w, _ = _inputs(b, n, h, h, d, seed=5)
    v = v.at[:, 64:].set(jnp.nan)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < 64) & (kv_idx <= q_idx)

    bm = dilax.create_block_mask(mask_mod, None, None, n, n, block_size=(128, 64))
    assert np.asarray(bm.classes)[0, 0].tolist() == [[1, 0, 0], [2, 0, 0]]  # partial, full

    def fn(q, k, v):
        return dilax.flex_attention(q, k, v, block_mask=bm, implementation="pallas",
                                    interpret=True)

    out, grads, kernels = _run(fn, (q, k, v), w)
    assert kernels
    qi, ki = np.arange(n)[:, None], np.arange(n)[None, :]
    want, dq, dk, dv, _, _ = oracle(q, k, np.nan_to_num(np.asarray(v)), scale=d**-0.5,
                                    allowed=(ki < 64) & (ki <= qi), dout=w)
    assert_scaled_close(out, want)
    for got, exp in zip(grads, (dq, dk, dv)):
        assert_scaled_close(got, exp, scale=max(1.0, float(np.abs(exp).max())))
    dense = dilax.flex_attention(q, k, v, mask_mod=mask_mod, implementation="pallas",
                                 interpret=True)
    assert np.isnan(np.asarray(dense)).any()


def _decode_oracle(q, kc, vc, pos, branches, *, scale, cap, slopes, allowed):
    """Float64: per query (row, step, head) one softmax over its branches' keys (a key two
    branches read counts twice: the branches' softmaxes merged), logits capped, plus
    ``slopes[h] * (kv - p)``, kept where ``allowed(b, p, kv)``."""
    q, kc, vc = (np.asarray(x, np.float64) for x in (q, kc, vc))
    b, t, h, d = q.shape
    g = h // kc.shape[2]
    out = np.zeros((b, t, h, d))
    for i in range(b):
        for j in range(t):
            p = int(pos[i, j])
            for hh in range(h):
                keys = []
                for br in branches:
                    start, count = (int(x) for x in br.keys(np.int32(p)))
                    if bool(br.selects(np.int32(p), np.int32(hh))):
                        keys += [start + br.stride * m for m in range(count)]
                keys = [kk for kk in keys if allowed(i, p, kk)]
                if not keys:
                    continue
                s = kc[i, keys, hh // g] @ q[i, j, hh] * scale
                s = cap * np.tanh(s / cap) + slopes[hh] * (np.array(keys) - p)
                e = np.exp(s - s.max())
                out[i, j, hh] = e @ vc[i, keys, hh // g] / e.sum()
    return out


def test_decode_kernel_score_mod_and_mask_mod():
    b, t, h, hk, d, L, cap = 2, 2, 4, 2, 16, 40, 3.0
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
    kc, vc = (jnp.asarray(rng.standard_normal((b, L, hk, d)), jnp.float32) for _ in range(2))
    pos = np.array([[20, 21], [38, 39]], np.int32)
    slopes = rng.uniform(0.05, 0.5, h).astype(np.float32)
    ids = (np.arange(L)[None] >= np.array([[12], [33]])).astype(np.int32)  # document per key
    branches = (DecodeBranch(16, 2, 8, (0, h)), DecodeBranch(None, 1, 6, (0, h)))
    score, score_consts = trace_mod(flex.alibi(jnp.asarray(slopes)), "score_mod")
    mask, mask_consts = trace_mod(lambda b, h, q, kv: jnp.asarray(ids)[b, q] == jnp.asarray(
        ids)[b, kv], "mask_mod")
    mods = kernel_mods(score, score_consts, mask, mask_consts, cap)
    out, lse = decode_attention(q, kc, vc, jnp.asarray(pos), branches=branches, scale=d**-0.5,
                                interpret=True, mods=mods)
    want = _decode_oracle(q, kc, vc, pos, branches, scale=d**-0.5, cap=cap, slopes=slopes,
                          allowed=lambda i, p, kv: ids[i, p] == ids[i, kv])
    assert np.all(np.isfinite(np.asarray(lse)))
    assert_scaled_close(np.asarray(out), want)


def test_registry_serves_flex_mods_and_falls_back():
    pallas = registry.CoreRequest("flex", "float32", 64, has_score_mod=True, has_mask_mod=True,
                                  has_sinks=True, platform="gpu")
    assert registry.supports("pallas", pallas) is None
    assert registry.choose(None, pallas)[0] == "pallas"
    assert registry.choose(None, registry.CoreRequest("flex", platform="cpu"))[0] == "xla"
    assert "dv != d" in registry.supports(
        "pallas", registry.CoreRequest("flex", head_dim=64, value_head_dim=32))
    # the dilated ops' Pallas path takes no mods
    assert "mask_mod" in registry.supports(
        "pallas", registry.CoreRequest("dilated_branch", has_mask_mod=True))
    # a mod reading a closed-over array whole has no tile form: explicit 'pallas' says why,
    # None runs the XLA core
    b, n, h, d = 1, 16, 2, 8
    (q, k, v), _, rng = _inputs(b, n, h, h, d, seed=4)
    bias = jnp.asarray(rng.standard_normal(3), jnp.float32)
    mod = lambda s, b, h, qi, ki: s + jnp.sum(bias)  # noqa: E731
    with pytest.raises(ValueError, match="scalar indexing"):
        dilax.flex_attention(q, k, v, score_mod=mod, implementation="pallas", interpret=True)
    big = flex.relative_bias(jnp.zeros((h, 1025), jnp.float32))  # a gradient too wide
    with pytest.raises(ValueError, match="at most 1024 elements, got 2050"):
        dilax.flex_attention(q, k, v, score_mod=big, implementation="pallas", interpret=True)
    out = dilax.flex_attention(q, k, v, score_mod=mod, interpret=True)
    want = oracle(q, k, v, scale=d**-0.5, allowed=True, bias=float(jnp.sum(bias)))
    assert_scaled_close(np.asarray(out), want)
