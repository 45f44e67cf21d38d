"""dilax.attention_fn inside flax's own modules (issue 27): ``decode=True`` (flax's KV cache)
equals the full causal forward, ``sow_weights=True`` stores the weights dilated attention
uses, and linen's ``nn.MultiHeadDotProductAttention`` runs it like nnx does; what it refuses
for packed documents names the route that serves them (issue 39)."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx
from oracle import attention
from tolerance import FP32, assert_scaled_close

import dilax
from dilax.dropin.attention_fn import OWN_MODULE_ROUTE
from dilax.reference import dilated_counts

WS, RS = (4, 8), (1, 2)
E, H, N = 16, 4, 12


def _x(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _mha(decode, **kw):
    return nnx.MultiHeadAttention(H, E, num_kv_heads=2, decode=decode, rngs=nnx.Rngs(0),
                                  attention_fn=dilax.attention_fn(WS, RS, is_causal=True), **kw)


def test_nnx_decode_equals_full_causal_forward():
    """Token by token through flax's cache (GQA, a left-padded row): every step equals the
    row of the causal forward over the whole sequence; fully padded steps give 0."""
    x = _x(0, (2, N, E))
    key_valid = np.ones((2, N), bool)
    key_valid[1, :3] = False  # row 1 is left-padded by 3
    mask = nnx.make_attention_mask(jnp.ones((2, 1)), jnp.asarray(key_valid))  # (2, 1, 1, N)
    full = _mha(False)(x, mask=mask)
    mha = _mha(True)
    mha.init_cache((2, N, E))
    step = nnx.jit(lambda m, x: m(x, mask=mask))
    steps = [step(mha, x[:, i:i + 1]) for i in range(N)]
    assert_scaled_close(jnp.concatenate(steps, axis=1), full)
    assert int(mha.cache_index[...]) == N


def test_sow_weights_are_the_dilated_weights():
    """The sown weights are the SPEC's: ``C e^s / sum C e^s`` (float64 oracle), they
    reproduce the output, and with the dense configuration they are flax's own weights."""
    q, k, v = _x(1, (2, N, H, 8)), _x(2, (2, N, 2, 8)), _x(3, (2, N, 2, 8))
    key_valid = np.random.default_rng(4).random((2, N)) > 0.3
    mask = jnp.asarray(key_valid)[:, None, None, :]

    class Sink(nnx.Module):
        pass

    sink = Sink()
    out = dilax.attention_fn(WS, RS, is_causal=True)(q, k, v, mask=mask, module=sink)
    (weights,) = nnx.pop(sink, nnx.Intermediate)["attention_weights"]
    counts = dilated_counts(N, H, WS, RS, "mixture", True)[None] * key_valid[:, None, None, :]
    scores = np.einsum("bqhd,bkhd->bhqk", np.float64(q), np.repeat(np.float64(k), 2, 2))
    e = counts * np.exp(scores / np.sqrt(8) - 30.0)  # |scores| < 30 here: no overflow
    den = e.sum(-1, keepdims=True)
    assert_scaled_close(weights, e / np.where(den > 0, den, 1.0))
    ref = attention(q, k, v, counts, 1 / np.sqrt(8)).out
    assert_scaled_close(out, ref)
    assert_scaled_close(jnp.einsum("bhqk,bkhd->bqhd", weights, jnp.repeat(v, 2, 2)), ref)

    # dense configuration (one segment of n, rate 1) inside the module: flax's own weights
    def sown(attention_fn):
        mha = nnx.MultiHeadAttention(H, E, decode=False, rngs=nnx.Rngs(0),
                                     **({} if attention_fn is None else
                                        dict(attention_fn=attention_fn)))
        y = mha(_x(5, (2, N, E)), sow_weights=True)
        return y, nnx.pop(mha, nnx.Intermediate)["attention_weights"][0]

    y_ours, w_ours = sown(dilax.attention_fn((N,), (1,)))
    y_flax, w_flax = sown(None)
    assert_scaled_close(w_ours, w_flax)
    assert_scaled_close(y_ours, y_flax)


def test_linen_module_forward_and_decode():
    """linen's MultiHeadDotProductAttention with dilax.attention_fn: the forward equals the
    oracle on linen's own projections, and decode=True reproduces it step by step."""
    fn = dilax.attention_fn(WS, RS, is_causal=True)
    x = _x(6, (2, N, E))
    mod = linen.MultiHeadDotProductAttention(H, qkv_features=E, attention_fn=fn)
    params = mod.init(jax.random.key(0), x)["params"]
    y = mod.apply({"params": params}, x)
    p_np = jax.tree.map(np.asarray, params)

    def proj(name):
        p = p_np[name]
        return np.einsum("bnf,fhd->bnhd", np.asarray(x), p["kernel"]) + p["bias"]

    q, k, v = proj("query"), proj("key"), proj("value")
    a = attention(q, k, v, dilated_counts(N, H, WS, RS, "mixture", True),
                  1 / np.sqrt(E // H)).out
    p = p_np["out"]
    assert_scaled_close(y, np.einsum("bnhd,hdf->bnf", a, p["kernel"]) + p["bias"], FP32)

    dec = linen.MultiHeadDotProductAttention(H, qkv_features=E, attention_fn=fn, decode=True)
    cache = dec.init(jax.random.key(0), x)["cache"]
    step = jax.jit(lambda cache, xi: dec.apply({"params": params, "cache": cache}, xi,
                                               mutable=["cache"]))
    outs = []
    for i in range(N):
        o, upd = step(cache, x[:, i:i + 1])
        cache = upd["cache"]
        outs.append(o)
    assert_scaled_close(jnp.concatenate(outs, axis=1), y)


def test_refusals_of_packed_documents_name_the_own_module_route():
    """Issue 39: a segment mask, ``segment_ids=`` (at construction or at call time) and any
    other unknown option are refused with the route that serves packed documents and rotary
    positions (your own module on dilax.nn.DilatedAttention, notebooks/decoder.ipynb)."""
    route = re.escape(OWN_MODULE_ROUTE)
    assert "segment_ids=" in OWN_MODULE_ROUTE and "rotary_qk" in OWN_MODULE_ROUTE
    assert (Path(__file__).resolve().parents[1] / "notebooks/decoder.ipynb").exists()
    ids = jnp.asarray([[1] * 5 + [2] * 7, [3] * 12])
    segment_mask = nnx.make_attention_mask(ids, ids, jnp.equal)  # (2, 1, N, N)
    x = _x(5, (2, N, E))
    with pytest.raises(ValueError, match=r"supports only a key-padding `mask`(.|\n)*" + route):
        _mha(False)(x, mask=segment_mask)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['segment_ids'\].*" + route):
        dilax.attention_fn(WS, RS, segment_ids=ids)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['rope'\].*" + route):
        dilax.attention_fn(WS, RS, rope=True)
    q = _x(6, (2, N, H, 8))
    with pytest.raises(TypeError, match=r"unexpected keyword\(s\) \['segment_ids'\].*" + route):
        dilax.attention_fn(WS, RS)(q, q, q, segment_ids=ids)
