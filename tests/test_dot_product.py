"""dilax.dot_product_attention against jax.nn.dot_product_attention and the float64 oracle.

Each case is one static configuration (one compile of the forward and its VJP); the data
vary within it. Rows that see no key are where dilax and jax's XLA path differ on purpose
(dilax: ``out = 0``, ``lse = -inf``; jax: the mean of ``value``), so comparisons with jax
skip them and :func:`test_fully_masked_rows` pins both behaviours.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from tolerance import FP32, HALF, assert_scaled_close

import dilax
from dilax.core import BlockSizes, Mask, PairArrays, SlotView, attention, identity_view

B, T, S, N, K, H = 2, 21, 29, 4, 2, 8  # T != S, GQA (two query heads per kv head)


def _inputs(seed, dtype=jnp.float32, b=B, t=T, s=S, n=N, k=K):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, t, n, H), dtype)
    kk = jax.random.normal(ks[1], (b, s, k, H), dtype)
    v = jax.random.normal(ks[2], (b, s, k, H), dtype)
    dout = jax.random.normal(ks[3], (b, t, n, H), dtype)
    return q, kk, v, dout


def _allowed(mask=None, is_causal=False, window=None, q_len=None, kv_len=None, t=T, s=S):
    """The ``(B, N, T, S)`` bool rule of jax's docstring, in NumPy."""
    i, j = np.arange(t)[:, None], np.arange(s)[None, :]
    ok = np.ones((B, N, t, s), bool)
    if mask is not None:
        ok &= np.asarray(mask)
    if is_causal:
        ok &= j <= i
    if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        ok &= (j - i <= right) & (i - j <= left)
    if q_len is not None:
        ok &= i < np.asarray(q_len)[:, None, None, None]
    if kv_len is not None:
        ok &= j < np.asarray(kv_len)[:, None, None, None]
    return ok


def _case(name):
    """Keyword arguments of one case (drawn once, deterministic)."""
    rng = np.random.default_rng(len(name))
    lengths = dict(query_seq_lengths=jnp.array([T - 5, T], jnp.int32),
                   key_value_seq_lengths=jnp.array([S, 9], jnp.int32))
    key_mask = rng.random((B, 1, T, S)) < 0.7
    # every row keeps a key (fully masked rows: their own test)
    key_mask[..., 0] = key_mask[..., np.arange(T), np.arange(T)] = True
    return {
        "plain": {},
        "causal_lengths": dict(is_causal=True, **lengths),
        "bias_heads": dict(bias=jnp.asarray(rng.normal(size=(1, N, T, S)), jnp.float32)),
        "bias_keys": dict(bias=jnp.asarray(rng.normal(size=(B, 1, 1, S)), jnp.float32),
                          **lengths),
        "mask_band": dict(mask=jnp.asarray(key_mask), local_window_size=(6, 2)),
        "all": dict(bias=jnp.asarray(rng.normal(size=(B, N, T, S)), jnp.float32),
                    mask=jnp.asarray(key_mask[:1]), is_causal=True, local_window_size=4,
                    query_seq_lengths=lengths["query_seq_lengths"],
                    key_value_seq_lengths=jnp.array([S, T - 3], jnp.int32)),
    }[name]


def _run(f, q, k, v, dout, kw):
    """``(out, lse, dq, dk, dv, dbias)`` of ``f`` with ``return_residual=True``, jitted as
    one program (forward and VJP)."""
    bias = kw.get("bias")
    rest = {key: val for key, val in kw.items() if key != "bias"}

    def fn(q, k, v, bias):
        return f(q, k, v, bias, return_residual=True, **rest)

    @jax.jit
    def run(q, k, v, bias, dout):
        (out, lse), vjp = jax.vjp(fn, q, k, v, bias)
        return (out, lse, *vjp((dout, jnp.zeros_like(lse))))

    return run(q, k, v, bias, dout)


_CASES = [(name, "xla") for name in ("plain", "causal_lengths", "bias_heads", "bias_keys",
                                       "mask_band", "all")]


# implementation="reference" on two cases only (compile budget)
@pytest.mark.parametrize("name, impl", _CASES + [("plain", "reference"), ("all", "reference")])
def test_matches_jax_and_oracle(name, impl):
    kw = _case(name)
    q, k, v, dout = _inputs(1)
    got = _run(lambda *a, **kw: dilax.dot_product_attention(*a, implementation=impl, **kw),
               q, k, v, dout, kw)
    want = _run(jax.nn.dot_product_attention, q, k, v, dout, kw)

    allowed = _allowed(kw.get("mask"), kw.get("is_causal", False), kw.get("local_window_size"),
                       kw.get("query_seq_lengths"), kw.get("key_value_seq_lengths"))
    weights = allowed * np.exp(oracle.f64(kw["bias"])) if "bias" in kw else allowed
    ref = oracle.attention(q, k, v, weights, 1 / np.sqrt(H), dout=dout)
    has_key = allowed.any(-1).transpose(0, 2, 1)  # (B, T, N)
    for got_x, ref_x in zip((got[0], got[2], got[3], got[4]), (ref.out, ref.dq, ref.dk, ref.dv)):
        assert_scaled_close(got_x, ref_x, FP32)
    lse = np.asarray(got[1])
    assert np.array_equal(np.isfinite(lse), has_key)  # -inf exactly where no key
    assert_scaled_close(lse[has_key], ref.lse[has_key], FP32)
    # jax: the same results where a row has a key (jax zeroes rows past query_seq_lengths)
    assert_scaled_close(got[0], want[0], FP32)
    assert_scaled_close(lse[has_key], np.asarray(want[1])[has_key], FP32)
    for got_g, want_g in zip(got[2:], want[2:]):
        if want_g is not None:  # dq, dk, dv and d(bias), jax's broadcast-summed shape
            assert got_g.shape == want_g.shape and got_g.dtype == want_g.dtype
            assert_scaled_close(got_g, want_g, FP32)


def test_rank3_vmap_and_bf16():
    """Rank-3 calls under jax.vmap (a per-example bias) equal the rank-4 call and jax's, in
    bfloat16 (HALF: jax rounds the probabilities to bf16 before P @ V, dilax keeps float32)."""
    q, k, v, dout = _inputs(2, jnp.bfloat16)
    bias = jax.random.normal(jax.random.key(3), (B, N, T, S), jnp.bfloat16)

    def loss(f, q, k, v, bias):
        return jnp.sum(f(q, k, v, bias).astype(jnp.float32) * dout.astype(jnp.float32))

    per_example = jax.vmap(lambda q, k, v, b: dilax.dot_product_attention(q, k, v, b[None]))
    batched = lambda q, k, v, b: dilax.dot_product_attention(q, k, v, b)  # noqa: E731

    @jax.jit  # one program for the three values and gradients
    def run(*a):
        return tuple(jax.value_and_grad(lambda *a, f=f: loss(f, *a), argnums=(0, 1, 2, 3))(*a)
                     for f in (per_example, batched, jax.nn.dot_product_attention))

    got, whole, want = run(q, k, v, bias)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(whole)):
        assert g.dtype == w.dtype
        assert_scaled_close(g, w, HALF)
    for g, w in zip(got[1], want[1]):
        assert g.shape == w.shape and g.dtype == w.dtype == jnp.bfloat16
        assert_scaled_close(g, w, HALF)
    out3 = dilax.dot_product_attention(q[0], k[0], v[0], return_residual=True)
    ref = oracle.attention(q[:1], k[:1], v[:1], 1.0, 1 / np.sqrt(H))
    assert out3[0].shape == (T, N, H) and out3[1].shape == (T, N)
    assert out3[1].dtype == jnp.bfloat16  # jax: the residual in the key's dtype
    assert_scaled_close(out3[0], ref.out[0], HALF)
    assert_scaled_close(out3[1], ref.lse[0], HALF)


@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_head_groups_under_strict_rank_promotion(impl):
    """Eight query heads (the forward then takes 4 at a time, dilax.core.default_block_sizes;
    non-causal without a band) with a per-head bias and mask and key lengths, under
    numpy_rank_promotion="raise"."""
    n, k_heads = 8, 2
    q, k, v, dout = _inputs(8, n=n, k=k_heads)
    rng = np.random.default_rng(8)
    kw = dict(bias=jnp.asarray(rng.normal(size=(B, n, T, S)), jnp.float32),
              mask=jnp.asarray(rng.random((1, n, T, S)) < 0.8),
              key_value_seq_lengths=jnp.array([S, 20], jnp.int32))
    kw["mask"] = kw["mask"].at[..., np.arange(T), np.arange(T)].set(True)  # a key per row
    with jax.numpy_rank_promotion("raise"):
        got = _run(lambda *a, **kw: dilax.dot_product_attention(*a, implementation=impl, **kw),
                   q, k, v, dout, kw)
    want = _run(jax.nn.dot_product_attention, q, k, v, dout, kw)
    for g, w in zip(got, want):
        assert_scaled_close(g, w, FP32)


def test_fully_masked_rows():
    """A row whose mask admits no key: dilax gives out 0, lse -inf, zero gradients, no NaN
    (also under jax_debug_nans); jax's XLA path gives the mean of value over all keys."""
    q, k, v, dout = _inputs(4)
    mask = np.ones((B, N, T, S), bool)
    mask[0, 1, 3] = False
    mask[1, :, 7] = False
    bias = jnp.zeros((1, 1, T, S))
    with jax.debug_nans(True):
        out, lse, dq, dk, dv, db = _run(dilax.dot_product_attention, q, k, v, dout,
                                        dict(mask=jnp.asarray(mask), bias=bias))
    assert np.all(np.asarray(out)[0, 3, 1] == 0) and np.all(np.asarray(out)[1, 7] == 0)
    assert np.isneginf(lse[0, 3, 1]) and np.all(np.isneginf(lse[1, 7]))
    assert np.all(np.asarray(dq)[1, 7] == 0)
    for g in (dq, dk, dv, db):
        assert np.all(np.isfinite(g))
    ref = oracle.attention(q, k, v, mask, 1 / np.sqrt(H), dout=dout)
    for got_x, ref_x in zip((out, dq, dk, dv), (ref.out, ref.dq, ref.dk, ref.dv)):
        assert_scaled_close(got_x, ref_x, FP32)
    jax_out = jax.nn.dot_product_attention(q, k, v, mask=jnp.asarray(mask))
    assert_scaled_close(jax_out[1, 7], jnp.repeat(v[1].mean(0), N // K, axis=0), FP32)


@pytest.mark.parametrize("shape", [(1, N, 96, 96), (B, 1, 1, 96)])
def test_bias_read_by_blocks_without_dense_float32_copies(shape):
    """A bf16 bias with its gradient through the core at small blocks: exact against jax, and
    the compiled program holds no float32 array of a (.., N, T, S) bias's size. (1, N, T, S):
    the batch rows' gradients meet in a float32 column; (B, 1, 1, S): in a float32 (B, 1, 1, S)
    accumulator."""
    t = s = 96
    q, k, v, dout = _inputs(5, t=t, s=s, k=N)
    bias = jax.random.normal(jax.random.key(6), shape, jnp.bfloat16)
    view = identity_view(N, 1)

    def ours(q, k, v, bias):  # partial last blocks on both axes: 96 = 2 * 40 + 16
        return attention(q, k, v, view=view, scale=0.3, mask=Mask(arrays=PairArrays(bias=bias)),
                         block_sizes=BlockSizes(40, 40, 40, 40))[0]

    def loss(f, *a):
        return jnp.sum(f(*a) * dout)

    grad = jax.jit(jax.grad(lambda *a: loss(ours, *a), argnums=(0, 3)))
    hlo = grad.lower(q, k, v, bias).compile().as_text()
    assert f"f32[1,{N},{t},{s}]" not in hlo and f"f32[{N},{t},{s}]" not in hlo
    got = grad(q, k, v, bias)
    ref = jax.jit(jax.grad(lambda *a: loss(lambda q, k, v, b: jax.nn.dot_product_attention(
        q, k, v, b, scale=0.3), *a), argnums=(0, 3)))(q, k, v, bias)
    assert got[1].dtype == jnp.bfloat16
    assert_scaled_close(got[0], ref[0], FP32)
    assert_scaled_close(got[1], ref[1], HALF)  # rounded once to bf16, as jax's


def test_dilation_settings_call_dilated_attention():
    n = 32
    q, k, v, _ = _inputs(7, t=n, s=n)
    key_ok = np.ones((B, n), bool)
    key_ok[1, 20:] = False
    got = dilax.dot_product_attention(q, k, v, mask=jnp.asarray(key_ok)[:, None, None],
                                      is_causal=True, segment_lengths=(8, 16),
                                      dilation_rates=(1, 2))
    want = dilax.dilated_attention(q, k, v, (8, 16), (1, 2), is_causal=True,
                                   key_padding_mask=jnp.asarray(key_ok))
    np.testing.assert_array_equal(got, want)
    settings = dilax.DilatedSettings((8, 16), (1, 2))
    by_value = dilax.dot_product_attention(q, k, v, mask=jnp.asarray(key_ok)[:, None, None],
                                           is_causal=True, settings=settings)
    np.testing.assert_array_equal(by_value, want)
    with pytest.raises(TypeError, match="settings= holds the whole dilated configuration"):
        dilax.dot_product_attention(q, k, v, settings=settings, segment_lengths=(8,))
    with pytest.raises(ValueError, match="bias is not supported with dilation"):
        dilax.dot_product_attention(q, k, v, jnp.zeros((1, 1, n, n)), segment_lengths=(8,),
                                    dilation_rates=(1,))


_ERROR_NAMES = ("value dtype", "query head_dim", "query batch", "heads multiple", "mask dtype",
                "mask rank", "bias rank", "lengths dtype", "lengths shape", "implementation")


@functools.cache  # built at the first test, not at collection (in every xdist worker)
def _errors():
    q, k, v, _ = _inputs(0)
    bad = {
        "value dtype": (q, k, v.astype(jnp.bfloat16)),
        "query head_dim": (q[..., :4], k, v),
        "query batch": (q[:1], k, v),
        "heads multiple": (q[:, :, :3], k, v),
        "mask dtype": (q, k, v, None, jnp.ones((1, 1, T, S), jnp.int32)),
        "mask rank": (q, k, v, None, jnp.ones((1, 1, 1, T, S), bool)),
        "bias rank": (q, k, v, jnp.ones((1, 1, 1, T, S))),
        "lengths dtype": (q, k, v, None, None, dict(query_seq_lengths=jnp.ones((B,), float))),
        "lengths shape": (q, k, v, None, None, dict(key_value_seq_lengths=jnp.ones((3,),
                                                                                   jnp.int32))),
        "implementation": (q, k, v, None, None, dict(implementation="triton")),
    }
    return {name: (args[:5], args[5] if len(args) > 5 else {}) for name, args in bad.items()}


@pytest.mark.parametrize("name", _ERROR_NAMES)
def test_errors_as_jax(name):
    assert tuple(_errors()) == _ERROR_NAMES
    args, kw = _errors()[name]
    with pytest.raises(ValueError) as ours:
        dilax.dot_product_attention(*args, **kw)
    with pytest.raises(ValueError):
        jax.nn.dot_product_attention(*args, **kw)
    assert str(ours.value)


def test_errors_beyond_jax():
    q, k, v, _ = _inputs(0)
    with pytest.raises(ValueError, match="broadcastable to"):
        dilax.dot_product_attention(q, k, v, jnp.ones((1, 3, T, S)))
    with pytest.raises(ValueError, match="pallas"):
        dilax.dot_product_attention(q, k, v, jnp.ones((1, 1, T, S)), implementation="pallas")
    with pytest.raises(TypeError, match="local_window_size"):
        dilax.dot_product_attention(q, k, v, local_window_size=2.5)
    permuted = SlotView(1, N, K, (1, 0, 2, 3), (0, 1))  # query head 0 reads slot 1
    with pytest.raises(ValueError, match="identity view"):
        attention(q, k, v, view=permuted, scale=0.3,
                  mask=Mask(arrays=PairArrays(bias=jnp.zeros((1, N, T, S)))))


def test_cudnn_is_jax_cudnn():
    """implementation="cudnn" is jax's own cuDNN call: the same result, or (no cuDNN, e.g.
    on CPU) the same exception."""
    q, k, v, _ = _inputs(9, jnp.bfloat16)
    try:
        want = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    except Exception as e:  # noqa: BLE001 - whatever jax raises, dilax must raise too
        with pytest.raises(type(e)):
            dilax.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    else:
        np.testing.assert_array_equal(
            dilax.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"), want)
