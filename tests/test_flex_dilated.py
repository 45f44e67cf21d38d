"""FlexAttention's options on dilated attention (docs/semantics.md, "Custom scores and masks
(FlexAttention semantics), every op"): ``dilax.dilated_attention`` with ``score_mod`` /
``mask_mod`` / ``block_mask`` / ``sinks`` / ``logits_soft_cap`` and ``dv != d``, forward and
gradients (q, k, v, the closed-over ALiBi slopes, sinks) against a float64 NumPy oracle: the
SPEC's count matrix of the configuration (``dilax.dilated_counts``: a pair counted once per
branch that selects it) times the mods, applied pair by pair on row positions. Tiny shapes,
one compiled program per case."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dilax
from dilax import flex
from dilax.reference import document_counts
from tests.test_flex import oracle
from tests.tolerance import assert_scaled_close


def _grads(fn, args, w):
    """``out`` and the gradients of ``sum(out * w)`` w.r.t. every argument (one program)."""
    def loss(*a):
        out = fn(*a)
        return jnp.sum(out.astype(jnp.float32) * w), out

    (_, out), g = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args))),
                                             has_aux=True))(*args)
    return (np.asarray(out.astype(jnp.float32)),
            [np.asarray(x.astype(jnp.float32)) for x in g])


def _check(got_all, want_all, tol=None):
    """Asserts each array against the oracle (error relative to its scale); returns the
    largest such error."""
    worst = 0.0
    for got, want in zip(got_all, want_all, strict=True):
        scale = max(1.0, float(np.abs(want).max()))
        assert np.all(np.isfinite(got))
        if tol is None:
            assert_scaled_close(got, want, scale=scale)
        else:
            np.testing.assert_allclose(got, want, atol=tol * scale, rtol=0)
        worst = max(worst, float(np.abs(got - want).max()) / scale)
    return worst


B, N, H, HK, D, DV = 2, 24, 4, 2, 8, 12  # n % 16 != 0: a ragged last segment
WS, RS = (8, 16), (1, 2)


def _setup(seed, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q, k = (jnp.asarray(rng.standard_normal((B, N, h, D)), dtype) for h in (H, HK))
    v = jnp.asarray(rng.standard_normal((B, N, HK, DV)), dtype)
    w = rng.standard_normal((B, N, H, DV)).astype(np.float32)
    slopes = jnp.asarray(rng.uniform(0.05, 0.5, H), jnp.float32)
    sinks = jnp.asarray(rng.standard_normal(H), jnp.float32)
    ids = np.array([[0] * 10 + [1] * 14, [0] * 17 + [1] * 7], np.int32)  # two documents
    return q, k, v, w, slopes, sinks, ids


def _mods_oracle(slopes, ids, window, no_key_row=None):
    """The ALiBi bias ``slopes[h] (kv - q)`` and the documents AND ``|q - kv| <= window``
    mask (AND ``q != no_key_row``) on row positions."""
    qi, ki = np.arange(N)[:, None], np.arange(N)[None, :]
    rel = (ki - qi)[None, None].astype(np.float64)
    bias = np.asarray(slopes, np.float64)[None, :, None, None] * rel
    allowed = (ids[:, :, None] == ids[:, None, :]) & (np.abs(qi - ki) <= window)[None]
    if no_key_row is not None:
        allowed = allowed & (qi != no_key_row)[None]
    return rel, bias, allowed[:, None]


@pytest.mark.parametrize("case", ["mask_mod", "block_mask", "bf16"])
def test_mixture_causal_gqa_softcap_alibi_documents_window_sinks_dv(case):
    """Mixture mode (with a local-window branch), causal, GQA, dv != d: soft-cap + ALiBi
    (closed-over slopes), documents AND a sliding window as mask_mod (or its BlockMask),
    sinks; forward and gradients into q, k, v, slopes and sinks."""
    dtype = jnp.bfloat16 if case == "bf16" else jnp.float32
    q, k, v, w, slopes, sinks, ids = _setup(3, dtype)
    cap, window, lw = 2.0, 9, 3
    mask_mod = flex.and_masks(flex.document_mask(jnp.asarray(ids)), flex.sliding_window(window))
    bm = None
    if case == "block_mask":
        bm = dilax.create_block_mask(mask_mod, B, None, N, N, block_size=8)

    def fn(q, k, v, slopes, sinks):
        return dilax.dilated_attention(
            q, k, v, WS, RS, is_causal=True, local_window=lw,
            score_mod=flex.alibi(slopes), mask_mod=None if bm else mask_mod, block_mask=bm,
            sinks=sinks, logits_soft_cap=cap)

    out, grads = _grads(fn, (q, k, v, slopes, sinks), w)
    assert out.shape == (B, N, H, DV)
    rel, bias, allowed = _mods_oracle(slopes, ids, window)
    counts = dilax.dilated_counts(N, H, WS, RS, "mixture", True, local_window=lw)
    want, dq, dk, dvv, ds, dsinks = oracle(q, k, v, scale=D**-0.5, weights=counts * allowed,
                                           bias=bias, cap=cap, sinks=sinks, dout=w)
    dslopes = (ds * rel).sum(axis=(0, 2, 3))
    tol = 2e-2 if case == "bf16" else None  # bf16 inputs, outputs and gradients
    worst = _check((out, *grads), (want, dq, dk, dvv, dslopes, dsinks), tol)
    print(f"dilated mixture {case}: max scaled error {worst:.2e}")


def test_grouped_softcap_alibi_mask_no_key_rows():
    """Grouped mode (each group's own softmax, output / G), not causal: soft-cap + ALiBi,
    documents AND window AND a query row with no key at all (0, finite gradients), sinks."""
    q, k, v, w, slopes, sinks, ids = _setup(5)
    cap, window, empty = 3.0, 6, 13
    base = flex.and_masks(flex.document_mask(jnp.asarray(ids)), flex.sliding_window(window))

    def mask_mod(b, h, q_idx, kv_idx):
        return base(b, h, q_idx, kv_idx) & (q_idx != empty)

    def fn(q, k, v, slopes, sinks):
        return dilax.dilated_attention(q, k, v, WS, RS, mode="grouped", mask_mod=mask_mod,
                                       score_mod=flex.alibi(slopes), logits_soft_cap=cap,
                                       sinks=sinks)

    out, grads = _grads(fn, (q, k, v, slopes, sinks), w)
    rel, bias, allowed = _mods_oracle(slopes, ids, window, no_key_row=empty)
    counts = dilax.dilated_counts(N, H, WS, RS, "grouped", False)
    want, dq, dk, dvv, ds, dsinks = oracle(q, k, v, scale=D**-0.5, weights=counts * allowed,
                                           bias=bias, cap=cap, sinks=sinks, dout=w,
                                           div=len(WS))
    assert np.all(out[:, empty] == 0.0)  # no key: exactly 0
    worst = _check((out, *grads), (want, dq, dk, dvv, (ds * rel).sum(axis=(0, 2, 3)),
                                   dsinks))
    print(f"dilated grouped: max scaled error {worst:.2e}")


def test_mods_see_row_positions_heads_and_batch():
    """A mask_mod / score_mod that read ``b``, ``h``, ``q_idx``, ``kv_idx`` as numbers (a
    per-(b, h) key cutoff, a bias table by absolute key position): forward only, mixture,
    no sinks, with key_value_seq_lengths; an uneven GQA split (h=6, hk=2: one virtual kv head
    per query head), three branches up to r = 4 and one query head per core step (the core's
    head groups slice the mods' head list)."""
    b, n, h, hk, d = 2, 40, 6, 2, 8
    rng = np.random.default_rng(8)
    q, k, v = (jnp.asarray(rng.standard_normal((b, n, x, d)), jnp.float32) for x in (h, hk, hk))
    cut = rng.integers(4, n, (b, h)).astype(np.int32)
    table = rng.standard_normal(n).astype(np.float32)
    kv_len = np.array([n, 29], np.int32)
    ws, rs = (8, 16, 32), (1, 2, 4)

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx < jnp.asarray(cut)[b, h]

    def score_mod(s, b, h, q_idx, kv_idx):
        return s + jnp.asarray(table)[kv_idx] * (q_idx % 3)

    out = dilax.dilated_attention(q, k, v, ws, rs, mask_mod=mask_mod, score_mod=score_mod,
                                  key_value_seq_lengths=jnp.asarray(kv_len),
                                  block_sizes=dilax.BlockSizes(8, 8, heads_per_step=1))
    qi, ki = np.arange(n)[:, None], np.arange(n)[None, :]
    allowed = (ki[None, None] < cut[:, :, None, None]) & (ki < kv_len[:, None, None, None])
    bias = (table[ki] * (qi % 3))[None, None].astype(np.float64)
    counts = dilax.dilated_counts(n, h, ws, rs, "mixture", False)
    want = oracle(q, k, v, scale=d**-0.5, weights=counts * allowed, bias=bias)
    worst = _check((np.asarray(out),), (want,))
    print(f"dilated positions: max scaled error {worst:.2e}")


def test_packed_documents_with_mods_and_sinks():
    """``segment_ids`` (each document computed as a sequence of its own: segments and
    offsets on document positions) with mods on ROW positions: a bias table indexed by the
    absolute key position (closed over, receives gradients) plus ALiBi, a sliding window,
    soft-cap and sinks; mixture with a local window, causal, GQA; forward and gradients."""
    q, k, v, w, slopes, sinks, _ = _setup(6)
    ids = np.array([[0] * 10 + [1] * 9 + [2] * 5, [3] * 3 + [4] * 21], np.int32)
    table = jnp.asarray(np.random.default_rng(16).standard_normal(N), jnp.float32)
    cap, window, lw = 2.5, 11, 2

    def fn(q, k, v, slopes, table, sinks):
        alibi = flex.alibi(slopes)

        def score_mod(s, b, h, q_idx, kv_idx):
            return alibi(s, b, h, q_idx, kv_idx) + table[kv_idx]

        return dilax.dilated_attention(
            q, k, v, WS, RS, is_causal=True, local_window=lw, segment_ids=jnp.asarray(ids),
            score_mod=score_mod, mask_mod=flex.sliding_window(window), sinks=sinks,
            logits_soft_cap=cap)

    out, grads = _grads(fn, (q, k, v, slopes, table, sinks), w)
    qi, ki = np.arange(N)[:, None], np.arange(N)[None, :]
    rel = (ki - qi)[None, None].astype(np.float64)
    bias = np.asarray(slopes, np.float64)[None, :, None, None] * rel + np.asarray(
        table, np.float64)[None, None, None, :]
    counts = np.asarray(document_counts(ids, H, WS, RS, "mixture", True, local_window=lw))
    want, dq, dk, dvv, ds, dsinks = oracle(
        q, k, v, scale=D**-0.5, weights=counts * (np.abs(qi - ki) <= window)[None, None],
        bias=bias, cap=cap, sinks=sinks, dout=w)
    worst = _check((out, *grads), (want, dq, dk, dvv, (ds * rel).sum(axis=(0, 2, 3)),
                                   ds.sum(axis=(0, 1, 2)), dsinks))
    print(f"dilated documents: max scaled error {worst:.2e}")


def test_errors_and_refusals():
    q, k, v, _, slopes, sinks, ids = _setup(0)
    alibi = flex.alibi(slopes)
    with pytest.raises(ValueError, match="pallas.*score_mod"):
        dilax.dilated_attention(q, k, v, WS, RS, score_mod=alibi, implementation="pallas",
                                interpret=True)
    with pytest.raises(ValueError, match="reference"):
        dilax.dilated_attention(q, k, v, WS, RS, sinks=sinks, implementation="reference")
    with pytest.raises(ValueError, match=r"sinks must be a float array \(h,\)"):
        dilax.dilated_attention(q, k, v, WS, RS, sinks=sinks[:2])
    with pytest.raises(ValueError, match="logits_soft_cap"):
        dilax.dilated_attention(q, k, v, WS, RS, logits_soft_cap=-1.0)
    with pytest.raises(TypeError, match="mask_mod"):
        dilax.dilated_attention(q, k, v, WS, RS, mask_mod=lambda b, h, qi, ki: qi - ki)
    with pytest.raises(ValueError, match="block_mask"):
        dilax.dilated_attention(q, k, v, WS, RS, block_mask=dilax.create_block_mask(
            flex.causal_mask, None, None, N + 8, N + 8, block_size=8))
    with pytest.raises(ValueError, match=r"v must be \(b, n, hk, dv\) with k's b, n, hk"):
        dilax.dilated_attention(q, k, v[:, :, :1], WS, RS)


def test_value_head_dim_without_options():
    """``dv != d`` alone runs the fused branch runner (the usual program, XLA core): forward
    and gradients against the oracle, mixture, causal, GQA."""
    q, k, v, w, _, _, _ = _setup(9)

    def fn(q, k, v):
        return dilax.dilated_attention(q, k, v, WS, RS, is_causal=True)

    out, grads = _grads(fn, (q, k, v), w)
    counts = dilax.dilated_counts(N, H, WS, RS, "mixture", True)
    want, dq, dk, dvv, _, _ = oracle(q, k, v, scale=D**-0.5, weights=counts, dout=w)
    worst = _check((out, *grads), (want, dq, dk, dvv))
    print(f"dilated dv != d: max scaled error {worst:.2e}")


def test_attention_fn_passes_the_options():
    """``dilax.attention_fn(..., logits_soft_cap=, score_mod=, mask_mod=, sinks=)``: the
    returned function (as flax's MultiHeadAttention calls it, causal at call time) equals the
    oracle."""
    q, k, v, _, slopes, sinks, ids = _setup(4)
    cap, window = 2.0, 7
    mask_mod = flex.and_masks(flex.document_mask(jnp.asarray(ids)), flex.sliding_window(window))
    fn = dilax.attention_fn(WS, RS, logits_soft_cap=cap, score_mod=flex.alibi(slopes),
                            mask_mod=mask_mod, sinks=sinks)
    out = fn(q, k, v, is_causal=True)
    _, bias, allowed = _mods_oracle(slopes, ids, window)
    counts = dilax.dilated_counts(N, H, WS, RS, "mixture", True)
    want = oracle(q, k, v, scale=D**-0.5, weights=counts * allowed, bias=bias, cap=cap,
                  sinks=sinks)
    worst = _check((np.asarray(out),), (want,))
    print(f"attention_fn: max scaled error {worst:.2e}")
    with pytest.raises(ValueError, match="logits_soft_cap"):
        dilax.attention_fn(WS, RS, logits_soft_cap=0.0)
    with pytest.raises(TypeError, match="score_mod must be callable"):
        dilax.attention_fn(WS, RS, score_mod=1.0)


def _module_reference(m, x, cap, is_causal):
    """The module's forward written with the functional op on its own parameters, and the
    VJP of its output projection (sub-LayerNorm + out_proj)."""
    from dilax.nn._heads import output_projection, project_qkv

    q, k, v = project_qkv(m, x, None, None)
    att = dilax.dilated_attention(q, k, v, WS, RS, is_causal=is_causal, logits_soft_cap=cap,
                                  sinks=m.sinks[...])
    y, pull = jax.vjp(lambda a: output_projection(m, a.reshape(x.shape)), att)
    return (q, k, v), y, pull


def test_module_softcap_learnable_sinks_forward_and_sink_gradients():
    """``MultiheadDilatedAttention(logits_soft_cap=, learnable_sinks=True)``: forward equals
    the functional op with the module's parameters; the sinks are an ``nnx.Param (h,)`` whose
    gradient equals the oracle's (the output projection's VJP gives the attention output's
    cotangent)."""
    from flax import nnx

    E, cap = H * D, 2.0
    m = dilax.nn.MultiheadDilatedAttention(E, H, WS, RS, num_kv_heads=HK, logits_soft_cap=cap,
                                           learnable_sinks=True, rngs=nnx.Rngs(0))
    assert isinstance(m.sinks, nnx.Param) and m.sinks[...].shape == (H,)
    rng = np.random.default_rng(12)
    m.sinks[...] = jnp.asarray(rng.standard_normal(H), jnp.float32)
    x = jnp.asarray(rng.standard_normal((B, N, E)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((B, N, E)), jnp.float32)

    @nnx.jit
    def loss_and_grad(m, x):
        return nnx.value_and_grad(lambda m: jnp.sum(m(x, is_causal=True) * w))(m)

    _, grads = loss_and_grad(m, x)
    (q, k, v), y, pull = _module_reference(m, x, cap, True)
    np.testing.assert_allclose(np.asarray(m(x, is_causal=True)), np.asarray(y), atol=1e-6)
    (g_att,) = pull(w)
    counts = dilax.dilated_counts(N, H, WS, RS, "mixture", True)
    *_, dsinks = oracle(q, k, v, scale=D**-0.5, weights=counts, cap=cap, sinks=m.sinks[...],
                        dout=np.asarray(g_att))
    worst = _check((np.asarray(grads.sinks[...]),), (dsinks,))
    print(f"module sinks gradient: max scaled error {worst:.2e}")
    # KV-cache decoding with the soft-cap and the learned sinks: the rows of the causal call
    y1, cache = m.decode(x[:, :N - 3], m.init_cache(B, N))
    y2, _ = m.decode(x[:, N - 3:], cache)
    np.testing.assert_allclose(np.concatenate([y1, y2], axis=1), np.asarray(y), atol=1e-5)


def test_model_config_softcap_and_attention_sinks():
    """``LongNetConfig(logits_soft_cap=, attention_sinks=True)``: every attention of a layer
    soft-caps and learns sinks; its self-attention equals the functional op with its
    parameters, and the layer's sink gradient equals central finite differences."""
    from flax import nnx

    from dilax.models import DilatedTransformerEncoderLayer, LongNetConfig

    E, cap = H * D, 3.0
    cfg = LongNetConfig(d_model=E, num_heads=H, dim_feedforward=32, segment_lengths=WS,
                        dilation_rates=RS, num_kv_heads=HK, position_scheme="none",
                        logits_soft_cap=cap, attention_sinks=True)
    layer = DilatedTransformerEncoderLayer(config=cfg, rngs=nnx.Rngs(1))
    attn = layer.self_attn
    assert attn.attention.logits_soft_cap == cap and attn.sinks[...].shape == (H,)
    rng = np.random.default_rng(13)
    attn.sinks[...] = jnp.asarray(rng.standard_normal(H), jnp.float32)
    x = jnp.asarray(rng.standard_normal((B, N, E)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((B, N, E)), jnp.float32)
    _, y, _ = _module_reference(attn, x, cap, True)
    np.testing.assert_allclose(np.asarray(attn(x, is_causal=True)), np.asarray(y), atol=1e-6)

    graph, params, rest = nnx.split(layer, nnx.Param, ...)

    def loss(sinks):
        p = jax.tree.map(lambda a: a, params)
        p["self_attn"]["sinks"] = p["self_attn"]["sinks"].replace(sinks)
        out = nnx.merge(graph, p, rest)(x, is_causal=True)
        return jnp.sum(out * w)

    value_and_grad = jax.jit(jax.value_and_grad(loss))  # one program for both
    s0 = attn.sinks[...]
    got = np.asarray(value_and_grad(s0)[1])
    eps = 1e-2
    at = lambda i, e: float(value_and_grad(s0.at[i].add(e))[0])  # noqa: E731
    fd = np.array([(at(i, eps) - at(i, -eps)) / (2 * eps) for i in range(H)])
    # float32 losses differenced over 2 eps (rounding ~1e-5 / 2e-2) plus O(eps^2) truncation:
    # measured 3.5e-4 - 5e-4 of the largest component; 2e-3 of it leaves a 4x margin
    np.testing.assert_allclose(got, fd, rtol=0, atol=2e-3 * np.abs(fd).max())
    print(f"model sinks gradient vs finite differences: max error "
          f"{np.abs(got - fd).max():.2e}")


def test_block_sparse_modules_pass_the_options():
    """``BlockSparseAttention(score_mod=, logits_soft_cap=)(..., sinks=)`` and
    ``BlockSparseMultiheadAttention(..., learnable_sinks=True)`` equal
    :func:`dilax.block_sparse_attention` with the same options and parameters (whose values
    tests/test_flex_ops.py checks against the oracle)."""
    from flax import nnx

    from dilax.nn._heads import output_projection, project_qkv

    q, k, v, _, slopes, sinks, _ = _setup(10)
    v = v[..., :D]
    pattern = dilax.patterns.local_window(N, 8, 1)
    opts = dict(score_mod=flex.alibi(slopes), logits_soft_cap=2.0)
    want = dilax.block_sparse_attention(q, k, v, pattern, is_causal=True, sinks=sinks, **opts)
    got = dilax.nn.BlockSparseAttention(pattern, is_causal=True, **opts)(q, k, v, sinks=sinks)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    m = dilax.nn.BlockSparseMultiheadAttention(H * D, H, pattern, num_kv_heads=HK,
                                               learnable_sinks=True, rngs=nnx.Rngs(2), **opts)
    assert isinstance(m.sinks, nnx.Param) and m.sinks[...].shape == (H,)
    m.sinks[...] = sinks
    x = jnp.asarray(np.random.default_rng(3).standard_normal((B, N, H * D)), jnp.float32)
    qp, kp, vp = project_qkv(m, x, None, None)
    ref = output_projection(m, dilax.block_sparse_attention(
        qp, kp, vp, pattern, is_causal=True, sinks=sinks, **opts).reshape(x.shape))
    np.testing.assert_allclose(np.asarray(m(x, is_causal=True)), np.asarray(ref), atol=1e-6)
