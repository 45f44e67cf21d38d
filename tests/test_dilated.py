"""dilated_attention: every fast path against the mask-based reference of SPEC.md."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dilax
from dilax import BlockSizes

FP32_TOL = 1e-5
# bf16 has an 8-bit mantissa: one ulp is 2**-7 relative (0.03 at magnitude 4..8), so half
# precision is compared as |a - b| <= 2e-2 * max(1, |b|): 2e-2 absolute for outputs of order 1,
# relative for larger gradients.
BF16_TOL = 2e-2


def make_qkv(b, n, h, hk, d, dtype=jnp.float32, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(k1, (b, n, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(k2, (b, n, hk, d), jnp.float32).astype(dtype)
    v = jax.random.normal(k3, (b, n, hk, d), jnp.float32).astype(dtype)
    return q, k, v


@functools.cache
def _loss_and_grad(impl, ws, rs, mode, causal, block_sizes):
    def loss(q, k, v):
        out = dilax.dilated_attention(q, k, v, ws, rs, mode=mode, is_causal=causal,
                                      implementation=impl, block_sizes=block_sizes)
        # A fixed non-linear read-out so every output element gets its own cotangent.
        return jnp.sum(jnp.sin(out.astype(jnp.float32) * 1.3)), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def check_against_reference(q, k, v, ws, rs, mode, causal, block_sizes=None, tol=FP32_TOL):
    (_, ref), gref = _loss_and_grad("reference", ws, rs, mode, causal, None)(q, k, v)
    (_, out), gout = _loss_and_grad("xla", ws, rs, mode, causal, block_sizes)(q, k, v)
    assert out.dtype == q.dtype
    assert not np.isnan(np.asarray(out, np.float32)).any()
    rtol = 0 if q.dtype == jnp.float32 else tol
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=tol, rtol=rtol)
    for name, a, b in zip("qkv", gout, gref):
        assert not np.isnan(np.asarray(a, np.float32)).any(), name
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   atol=tol, rtol=rtol, err_msg=f"d{name}")


@st.composite
def configs(draw):
    G = draw(st.integers(1, 4))
    rs = tuple(draw(st.sampled_from([1, 2, 3, 4])) for _ in range(G))
    ws = tuple(r * draw(st.integers(1, 6)) for r in rs)
    mode = draw(st.sampled_from(["mixture", "grouped"]))
    h = draw(st.integers(G if mode == "grouped" else 1, 12))
    hk = draw(st.sampled_from([x for x in range(1, h + 1) if h % x == 0]))
    d = draw(st.sampled_from([8, 16, 64]))
    n = draw(st.integers(1, 3 * max(ws) + 3))
    b = draw(st.integers(1, 2))
    causal = draw(st.booleans())
    bs = draw(st.sampled_from([None, BlockSizes(4, 8), BlockSizes(8, 4), BlockSizes(3, 5, 5, 3),
                               BlockSizes(4, 8, heads_per_step=1),
                               BlockSizes(3, 5, 5, 3, heads_per_step=3)]))
    return dict(b=b, n=n, h=h, hk=hk, d=d, ws=ws, rs=rs, mode=mode, causal=causal, bs=bs)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), seed=st.integers(0, 2**16))
def test_xla_matches_reference_fp32_sweep(cfg, seed):
    q, k, v = make_qkv(cfg["b"], cfg["n"], cfg["h"], cfg["hk"], cfg["d"], seed=seed)
    check_against_reference(q, k, v, cfg["ws"], cfg["rs"], cfg["mode"], cfg["causal"], cfg["bs"])


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), seed=st.integers(0, 2**16))
def test_xla_matches_reference_bf16_sweep(cfg, seed):
    q, k, v = make_qkv(cfg["b"], cfg["n"], cfg["h"], cfg["hk"], cfg["d"], jnp.bfloat16, seed)
    check_against_reference(q, k, v, cfg["ws"], cfg["rs"], cfg["mode"], cfg["causal"], cfg["bs"],
                            tol=BF16_TOL)


# Hand-picked cases the sweep must never miss: n not a multiple of any w, w > n, GQA splits
# that do not align with groups, multi-block cores.
EDGE_CASES = [
    # b, n, h, hk, d, ws, rs, mode, causal
    (2, 37, 4, 2, 8, (8, 16), (1, 2), "mixture", False),
    (1, 50, 6, 3, 16, (6, 12, 24), (1, 2, 3), "mixture", True),
    (1, 50, 6, 2, 16, (6, 12, 24), (1, 3, 2), "grouped", True),
    (2, 19, 5, 5, 8, (64, 4), (4, 2), "mixture", True),  # w > n
    (1, 40, 7, 1, 8, (8, 16, 32), (2, 4, 4), "grouped", False),  # MQA, uneven groups
    (1, 1, 3, 1, 8, (4, 2), (2, 1), "mixture", True),  # n = 1
    (1, 45, 12, 4, 64, (9, 15, 30, 45), (1, 3, 3, 3), "mixture", True),
    (1, 45, 12, 3, 64, (9, 15, 30, 45), (1, 3, 3, 3), "grouped", False),
    # uneven GQA split: two virtual kv heads read the same (slot, kv head) -> dk/dv summed
    (1, 1, 4, 1, 8, (3, 2), (3, 2), "mixture", False),
    (1, 20, 6, 1, 8, (6, 4), (3, 2), "mixture", True),
]


@pytest.mark.parametrize("case", EDGE_CASES)
@pytest.mark.parametrize("block_sizes", [None, BlockSizes(4, 8)])
def test_edge_cases_match_reference(case, block_sizes):
    b, n, h, hk, d, ws, rs, mode, causal = case
    q, k, v = make_qkv(b, n, h, hk, d, seed=n)
    check_against_reference(q, k, v, ws, rs, mode, causal, block_sizes)


@pytest.mark.parametrize("case", [EDGE_CASES[i] for i in (0, 1, 2, 9)])
def test_head_groups_match_reference(case):
    """Forward steps over head groups (2 query heads each; a kv head's query heads stay
    together, so MQA groups hold all of them) give the reference, forward and gradients."""
    b, n, h, hk, d, ws, rs, mode, causal = case
    q, k, v = make_qkv(b, n, h, hk, d, seed=n)
    check_against_reference(q, k, v, ws, rs, mode, causal,
                            BlockSizes(4, 8, 8, 4, heads_per_step=2))


@pytest.mark.parametrize("field", ["block_q", "block_k", "block_k_dkv", "heads_per_step"])
@pytest.mark.parametrize("value", [0, -2, 2.0, True])
def test_block_sizes_rejects_non_positive_ints(field, value):
    with pytest.raises(ValueError, match=f"BlockSizes.{field} must be a positive int"):
        BlockSizes(**{field: value})


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_keeps_dtype_and_matches(dtype):
    q, k, v = make_qkv(1, 48, 4, 2, 16, dtype)
    check_against_reference(q, k, v, (8, 16), (1, 2), "mixture", True, BlockSizes(8, 8),
                            tol=BF16_TOL)


def _numpy_pytorch_grouped(q, k, v, ws, rs, causal):
    """Independent oracle: dilated-attention-pytorch's DilatedAttention.forward rebuilt in NumPy.

    Head group i = heads [i*g, (i+1)*g), offset i % r, per-segment softmax attention on the
    dilated rows, results added into a zero tensor, divided by the number of groups.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, n, h, d = q.shape
    G = len(ws)
    g = h // G
    out = np.zeros_like(q)
    for i, (w, r) in enumerate(zip(ws, rs)):
        off, lo, hi = i % r, i * g, (i + 1) * g
        qs = q.reshape(b, n // w, w, h, d)[:, :, off::r, lo:hi]
        ks = k.reshape(b, n // w, w, h, d)[:, :, off::r, lo:hi]
        vs = v.reshape(b, n // w, w, h, d)[:, :, off::r, lo:hi]
        s = np.einsum("bsqhd,bskhd->bshqk", qs, ks) / np.sqrt(d)
        if causal:
            m = qs.shape[2]
            s = np.where(np.tril(np.ones((m, m), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        x = np.einsum("bshqk,bskhd->bsqhd", p, vs)
        view = out.reshape(b, n // w, w, h, d)
        view[:, :, off::r, lo:hi] += x
    return out / G


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "n,h,ws,rs",
    [(48, 6, (8, 16, 24), (1, 2, 4)), (64, 4, (16, 32), (2, 4)), (36, 3, (6, 12, 36), (1, 2, 3))],
)
def test_grouped_reproduces_dilated_attention_pytorch(n, h, ws, rs, causal):
    q, k, v = make_qkv(2, n, h, h, 16, seed=3)
    expected = _numpy_pytorch_grouped(q, k, v, ws, rs, causal)
    for impl in ("xla", "reference"):
        out = dilax.dilated_attention(q, k, v, ws, rs, mode="grouped", is_causal=causal,
                                      implementation=impl, block_sizes=None)
        np.testing.assert_allclose(np.asarray(out), expected, atol=FP32_TOL, rtol=0)


def test_mixture_is_lse_weighted_branch_combination():
    """Mixture mode equals the LongNet Eq. 10 combination of per-branch softmax outputs."""
    n, h, d = 24, 2, 8
    ws, rs = (8, 12), (2, 3)
    q, k, v = make_qkv(1, n, h, h, d, seed=5)
    q64, k64, v64 = (np.asarray(x, np.float64)[0] for x in (q, k, v))
    expected = np.zeros((n, h, d))
    for j in range(h):
        num = np.zeros((n, d))
        den = np.zeros((n, 1))
        for w, r in zip(ws, rs):
            mask = dilax.reference.branch_mask(n, w, r, j % r, False)
            s = q64[:, j] @ k64[:, j].T / np.sqrt(d)
            e = np.where(mask, np.exp(s), 0.0)
            l = e.sum(-1, keepdims=True)  # = exp(lse_i)
            o = np.divide(e @ v64[:, j], l, out=np.zeros((n, d)), where=l > 0)
            num += l * o  # alpha_i * o_i, un-normalized
            den += l
        expected[:, j] = np.divide(num, den, out=np.zeros_like(num), where=den > 0)
    out = dilax.dilated_attention(q, k, v, ws, rs)
    np.testing.assert_allclose(np.asarray(out[0]), expected, atol=FP32_TOL)


def test_unselected_queries_give_zero_and_finite_grads():
    # One branch with r=3: two thirds of the positions of every head are never selected.
    q, k, v = make_qkv(1, 10, 2, 1, 8)
    for impl in ("xla", "reference"):
        f = functools.partial(dilax.dilated_attention, segment_lengths=(6,),
                              dilation_rates=(3,), is_causal=True, implementation=impl)
        out = f(q, k, v)
        sel = np.zeros((10, 2), bool)
        for j in range(2):
            sel[j % 3 :: 3, j] = True
        assert np.all(np.asarray(out)[0][~sel] == 0)
        assert np.all(np.abs(np.asarray(out)[0][sel]).sum(-1) > 0)
        grads = jax.grad(lambda *a, f=f: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2))(q, k, v)
        for g in grads:
            assert np.isfinite(np.asarray(g)).all()
        # Unselected queries receive no gradient.
        assert np.all(np.asarray(grads[0])[0][~sel] == 0)


def test_core_fully_masked_rows_are_zero_without_nan():
    q = jnp.ones((1, 8, 1, 2, 4))
    k = jnp.ones((1, 8, 1, 4)).at[:, 3].set(jnp.nan)  # NaN beyond kv_len must never leak
    v = jnp.ones((1, 8, 1, 4)).at[:, 3].set(jnp.inf)
    kv_len = jnp.array([[3]])
    out, lse = dilax.attention_core(q, k, v, scale=0.5, kv_len=kv_len,
                                    block_sizes=BlockSizes(2, 2))
    np.testing.assert_allclose(np.asarray(out), 1.0)
    # k_offset pushes every key into the future of the first queries: those rows are empty.
    out, lse = dilax.attention_core(q, k, v, scale=0.5, is_causal=True, kv_len=kv_len,
                                    k_offset=5, block_sizes=BlockSizes(2, 2))
    assert np.all(np.asarray(out)[0, :5] == 0) and np.all(np.isneginf(np.asarray(lse)[0, :5]))
    np.testing.assert_allclose(np.asarray(out)[0, 5:], 1.0)
    g = jax.grad(lambda q: jnp.sum(dilax.attention_core(
        q, k, v, scale=0.5, is_causal=True, kv_len=kv_len, k_offset=5,
        block_sizes=BlockSizes(2, 2))[0]))(q)
    assert np.isfinite(np.asarray(g)).all() and np.all(np.asarray(g)[0, :5] == 0)


def test_core_lse_gradient_matches_dense():
    """The custom_vjp takes a cotangent on lse (used by the mixture merge and by ring)."""
    q, k, v = make_qkv(2, 13, 4, 2, 8)
    q = q.reshape(2, 13, 2, 2, 8)

    def dense(q, k, v):
        s = jnp.einsum("bqhgd,bkhd->bhgqk", q, k) * 0.3
        lse = jax.nn.logsumexp(s, axis=-1)
        out = jnp.einsum("bhgqk,bkhd->bqhgd", jax.nn.softmax(s, -1), v)
        return out, lse.transpose(0, 3, 1, 2)

    def core(q, k, v):
        return dilax.attention_core(q, k, v, scale=0.3, block_sizes=BlockSizes(4, 4))

    def loss(fn):
        return lambda *a: jnp.sum(jnp.cos(fn(*a)[0])) + jnp.sum(jnp.sin(fn(*a)[1]))

    for a, b in zip(jax.grad(loss(core), (0, 1, 2))(q, k, v),
                    jax.grad(loss(dense), (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=FP32_TOL)


def test_works_under_jit_vmap_and_checkpoint():
    q, k, v = make_qkv(2, 33, 4, 2, 8)
    ws, rs = (8, 16), (1, 2)
    ref = dilax.dilated_attention(q, k, v, ws, rs, is_causal=True, implementation="reference")

    jitted = jax.jit(dilax.dilated_attention,
                     static_argnames=("segment_lengths", "dilation_rates", "is_causal"))
    out = jitted(q, k, v, segment_lengths=ws, dilation_rates=rs, is_causal=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=FP32_TOL)

    vmapped = jax.vmap(lambda q, k, v: dilax.dilated_attention(q[None], k[None], v[None], ws, rs,
                                                               is_causal=True)[0])
    np.testing.assert_allclose(np.asarray(vmapped(q, k, v)), np.asarray(ref), atol=FP32_TOL)

    def loss(q, k, v):
        return jnp.sum(dilax.dilated_attention(q, k, v, ws, rs, is_causal=True) ** 2)

    g_plain = jax.grad(loss)(q, k, v)
    g_remat = jax.grad(jax.checkpoint(loss))(q, k, v)
    g_ref = jax.grad(lambda q, k, v: jnp.sum(dilax.dilated_attention(
        q, k, v, ws, rs, is_causal=True, implementation="reference") ** 2))(q, k, v)
    np.testing.assert_allclose(np.asarray(g_remat), np.asarray(g_plain), atol=1e-6)
    np.testing.assert_allclose(np.asarray(g_plain), np.asarray(g_ref), atol=FP32_TOL)


def test_no_gather_and_nothing_quadratic_in_hlo():
    """The XLA path dilates by reshape/slice: no gather/scatter, no (n, n) intermediate."""
    n, h, d = 512, 2, 8
    q, k, v = make_qkv(1, n, h, h, d)
    f = jax.jit(lambda q, k, v: dilax.dilated_attention(q, k, v, (64, 128), (1, 2)))
    hlo = f.lower(q, k, v).compile().as_text()
    assert " gather(" not in hlo and " scatter(" not in hlo
    assert f"{n},{n}" not in hlo.replace(" ", "")


@pytest.mark.parametrize("mode", ["mixture", "grouped"])
@pytest.mark.parametrize("causal", [False, True])
def test_attended_pairs_equals_reference_mask_count(mode, causal):
    from dilax.layout import attended_pairs

    for n, h, ws, rs in [(37, 5, (8, 16), (1, 2)), (50, 6, (6, 12, 24), (1, 2, 3)),
                         (19, 3, (64, 4), (4, 2))]:
        expected = dilax.dilated_counts(n, h, ws, rs, mode, causal).sum()
        assert attended_pairs(n, h, ws, rs, mode, causal) == expected
