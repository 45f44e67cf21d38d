"""Leading batch dimensions (flax's ``[batch..., length, heads, features]``): rank 3 and
rank 5 inputs give the rank-4 results row by row, checked against the float64 oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest

import dilax
from dilax.patterns import local_window

N, H, HK, D = 32, 4, 2, 8
WS, RS = (8, 16), (1, 2)


def _qkv(batch, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(ks[0], (*batch, N, H, D), jnp.float32)
    k = jax.random.normal(ks[1], (*batch, N, HK, D), jnp.float32)
    v = jax.random.normal(ks[2], (*batch, N, HK, D), jnp.float32)
    return q, k, v


def _oracle_rows(q, k, v, lengths=None, **kw):
    """The float64 oracle on every row of the flattened batch, reshaped back. A row of valid
    length ``L`` is the op on its first ``L`` positions, then zeros (docs/semantics.md)."""
    batch = q.shape[:-3]
    flat = [np.asarray(x, np.float64).reshape(-1, *x.shape[-3:]) for x in (q, k, v)]
    lens = np.full(flat[0].shape[0], N) if lengths is None else np.asarray(lengths).reshape(-1)
    out = np.zeros_like(flat[0])
    for i, n in enumerate(lens):
        out[i, :n] = oracle.dilated(*(x[i:i + 1, :n] for x in flat), WS, RS, **kw).out[0]
    return out.reshape(*batch, *q.shape[-3:])


def test_rank_3_and_rank_5_equal_the_oracle_row_by_row():
    q, k, v = _qkv((2, 3))
    lengths = jnp.array([[32, 20, 7], [1, 32, 16]], jnp.int32)
    out5 = dilax.dilated_attention(q, k, v, WS, RS, is_causal=True, query_seq_lengths=lengths,
                                   key_value_seq_lengths=lengths)
    assert out5.shape == q.shape
    np.testing.assert_allclose(out5, _oracle_rows(q, k, v, lengths, is_causal=True),
                               rtol=2e-5, atol=2e-5)
    out3 = dilax.dilated_attention(q[0, 1], k[0, 1], v[0, 1], WS, RS, is_causal=True)
    np.testing.assert_allclose(out3, _oracle_rows(q[0, 1], k[0, 1], v[0, 1], is_causal=True),
                               rtol=2e-5, atol=2e-5)


def test_vmap_over_the_batch_equals_the_batched_call_and_its_gradient():
    q, k, v = _qkv((3,), seed=1)
    f = lambda q, k, v: dilax.dilated_attention(q, k, v, WS, RS)
    loss = lambda q: jnp.sum(jax.vmap(f, in_axes=(0, 0, 0))(q, k, v) ** 2)
    ref = lambda q: jnp.sum(f(q, k, v) ** 2)
    # one program for both values and both gradients
    mapped, batched, g_mapped, g_batched = jax.jit(
        lambda q: (jax.vmap(f)(q, k, v), f(q, k, v), jax.grad(loss)(q), jax.grad(ref)(q)))(q)
    np.testing.assert_allclose(mapped, batched, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(g_mapped, g_batched, rtol=1e-5, atol=1e-5)


def test_block_sparse_folds_batch_dims_and_lengths():
    q, k, v = _qkv((2, 2), seed=2)
    pattern = local_window(N, 8, 1)
    lengths = jnp.array([[32, 9], [17, 4]], jnp.int32)
    out = dilax.block_sparse_attention(q, k, v, pattern, is_causal=True,
                                       key_value_seq_lengths=lengths)
    flat = dilax.block_sparse_attention(
        *(x.reshape(4, *x.shape[2:]) for x in (q, k, v)), pattern, is_causal=True,
        key_value_seq_lengths=lengths.reshape(4), implementation="reference")
    np.testing.assert_allclose(out, flat.reshape(out.shape), rtol=2e-5, atol=2e-5)


def test_content_adaptive_folds_batch_dims():
    q, k, v = _qkv((2, 2), seed=3)
    # jitted: the op is not, and eager calls would compile each of its primitives on its own
    op = jax.jit(lambda q, k, v: dilax.content_adaptive_attention(q, k, v, 8, 2, is_causal=True))
    out = op(q, k, v)
    flat = op(*(x.reshape(4, *x.shape[2:]) for x in (q, k, v)))
    np.testing.assert_array_equal(out, flat.reshape(out.shape))
    out3 = op(q[1, 0], k[1, 0], v[1, 0])
    np.testing.assert_allclose(out3, flat[2], rtol=1e-6, atol=1e-6)


def test_mismatched_leading_dims_are_named():
    q, k, v = _qkv((2, 3))
    with pytest.raises(ValueError, match="same leading batch dimensions"):
        dilax.dilated_attention(q, k[:1], v[:1], WS, RS)
    with pytest.raises(ValueError, match="query_seq_lengths must have the leading batch"):
        dilax.dilated_attention(q, k, v, WS, RS, query_seq_lengths=jnp.array([3, 4]))
