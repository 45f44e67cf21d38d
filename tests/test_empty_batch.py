"""An empty batch (b = 0) gives the empty result ``jax.nn.dot_product_attention`` gives, with
empty gradients, in the dilated and block-sparse ops (every core), decoding and the modules
(issue 30); the ops that cannot (content-adaptive, sequence-parallel) refuse it by name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dilax
from dilax import patterns

N, H, HK, D = 16, 4, 2, 8


def _empty(dtype=jnp.float32):
    return (jnp.zeros((0, N, H, D), dtype), jnp.zeros((0, N, HK, D), dtype),
            jnp.zeros((0, N, HK, D), dtype))


def _dense(q, k, v, is_causal=False):
    return jax.nn.dot_product_attention(q, k, v, is_causal=is_causal)


OPS = {
    "dilated-reference": lambda q, k, v: dilax.dilated_attention(
        q, k, v, (8, 16), (1, 2), is_causal=True, implementation="reference"),
    "dilated-xla": lambda q, k, v: dilax.dilated_attention(
        q, k, v, (8, 16), (1, 2), is_causal=True, implementation="xla"),
    "dilated-pallas": lambda q, k, v: dilax.dilated_attention(
        q, k, v, (8, 16), (1, 2), is_causal=True, implementation="pallas", interpret=True),
    "dilated-lengths": lambda q, k, v: dilax.dilated_attention(
        q, k, v, (8,), (1,), implementation="xla", local_window=2,
        query_seq_lengths=jnp.zeros((0,), jnp.int32)),
    "block-sparse-reference": lambda q, k, v: dilax.block_sparse_attention(
        q, k, v, patterns.local_window(N, 4, 4), implementation="reference"),
    "block-sparse-xla": lambda q, k, v: dilax.block_sparse_attention(
        q, k, v, patterns.local_window(N, 4, 4), implementation="xla"),
}


@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_empty_batch_gives_jax_attentions_empty_result_and_gradients(name, dtype):
    q, k, v = _empty(dtype)
    want = _dense(q, k, v)
    got = OPS[name](q, k, v)
    assert (got.shape, got.dtype) == (want.shape, want.dtype) == ((0, N, H, D), dtype)
    loss = lambda f: lambda q, k, v: f(q, k, v).astype(jnp.float32).sum()
    grads = jax.grad(loss(OPS[name]), argnums=(0, 1, 2))(q, k, v)
    want_grads = jax.grad(loss(_dense), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(grads, want_grads, strict=True):
        assert (g.shape, g.dtype) == (w.shape, w.dtype)
    # under jit as well (one compile for the shape)
    np.testing.assert_array_equal(np.asarray(jax.jit(OPS[name])(q, k, v)), np.asarray(want))


def test_empty_batch_decodes_and_the_modules_run_on_it():
    q, k, v = _empty()
    cache = dilax.KVCache.init(0, N, HK, D)
    out, cache = jax.jit(lambda q, k, v, c: dilax.dilated_attention_decode(
        q, k, v, c, (8, 16), (1, 2)))(q[:, :3], k[:, :3], v[:, :3], cache)
    assert out.shape == (0, 3, H, D) and cache.lengths.shape == (0,)
    assert cache.overflow.shape == (0,)
    mha = dilax.nn.MultiheadDilatedAttention(32, H, (8, 16), (1, 2), rngs=nnx.Rngs(0))
    x = jnp.zeros((0, N, 32))
    y = mha(x, x, x, is_causal=True)
    assert y.shape == (0, N, 32) and y.dtype == x.dtype
    y, _ = mha.decode(x[:, :1], mha.init_cache(0, N))
    assert y.shape == (0, 1, 32)
    lm = dilax.models.LongNetLM(20, config=dilax.models.LongNetConfig(32, 2, 64, (8,), (1,)),
                                num_encoder_layers=0, num_decoder_layers=1, rngs=nnx.Rngs(0))
    assert lm(jnp.zeros((0, N), jnp.int32)).shape == (0, N, 20)


def test_ops_without_an_empty_batch_path_refuse_it_by_name():
    q, k, v = _empty()
    with pytest.raises(ValueError, match=r"batch, heads and head_dim must be positive, got q "
                                         r"\(0, 16, 4, 8\)"):
        dilax.content_adaptive_attention(q, k, v, 4, 2)
    with pytest.raises(ValueError, match=r"batch must be >= 0 and max_len, num_kv_heads and "
                                         r"head_dim positive, got \(-1, 16, 2, 8\)"):
        dilax.KVCache.init(-1, N, HK, D)
