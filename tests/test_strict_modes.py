"""Strict JAX modes (issue 27): the public ops, modules, models and dilax.attention_fn under
``jax_numpy_rank_promotion="raise"``, ``jax_enable_x64=True`` and ``jax_debug_nans=True``, all
three at once, with values checked against the float64 oracle (the modules and the LM: against
their reference implementation, run in normal mode).

Under x64 float32/bfloat16 inputs keep their dtype; float64 inputs are computed with float32
logits and softmax statistics (docs/semantics.md, "Numerics"), so they meet the float32
tolerance. Every case has padded or fully masked rows (``kv_len = 0``, an all-False key mask):
debug_nans would raise on a NaN in any jitted output, gradients included; one case also runs
op by op (``jax.disable_jit``), where a NaN anywhere, even in a discarded ``jnp.where``
branch, raises. Other modules run that way with ``pytest --jax-strict=rank,x64,nans``.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from oracle import attention
from tolerance import FP32, HALF, assert_scaled_close

import dilax
from dilax import patterns
from dilax.reference import dilated_counts

WS, RS = (4, 8), (1, 2)


@contextlib.contextmanager
def strict(x64: bool = True):
    with jax.numpy_rank_promotion("raise"), jax.debug_nans(True), jax.enable_x64(x64):
        yield


def _rand(shape, seed, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _qkvg(b, n, h, hk, d=8, dtype=jnp.float32):
    return (_rand((b, n, h, d), 0, dtype), _rand((b, n, hk, d), 1, dtype),
            _rand((b, n, hk, d), 2, dtype), _rand((b, n, h, d), 3, dtype))


def _masked_counts(counts, q_len=None, kv_len=None, key_valid=None):
    """``(h, n, n)`` counts -> ``(b, h, n, n)`` with rows ``p >= q_len`` and keys
    ``t >= kv_len`` (or not ``key_valid``) removed."""
    n = counts.shape[-1]
    b = len(q_len if q_len is not None else kv_len if kv_len is not None else key_valid)
    ok_q = np.ones((b, n), bool) if q_len is None else np.arange(n) < np.asarray(q_len)[:, None]
    ok_k = np.ones((b, n), bool) if kv_len is None else np.arange(n) < np.asarray(kv_len)[:, None]
    if key_valid is not None:
        ok_k = ok_k & np.asarray(key_valid)
    return counts[None] * (ok_q[:, None, :, None] & ok_k[:, None, None, :])


def _fwd_grad(fn, q, k, v, g):
    """Output and ``d <out, g> / d(q, k, v)``, jitted as one program."""
    def run(q, k, v):
        out, vjp = jax.vjp(fn, q, k, v)
        return (out, *vjp(g.astype(out.dtype)))
    return jax.jit(run)(q, k, v)


def _check(res, weights, q, k, v, g, tol=FP32, divide=1):
    ref = attention(q, k, v, weights, 1 / np.sqrt(q.shape[-1]), dout=np.asarray(g) / divide)
    for got, want in zip(res, (ref.out / divide, ref.dq, ref.dk, ref.dv), strict=True):
        assert got.dtype == q.dtype
        assert_scaled_close(got, want, tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float64])
def test_dilated_mixture_lengths_window_gqa(dtype):
    """Mixture, causal, local window, GQA, query and key lengths (a row of query length 0
    and one of key length 0): forward and gradients vs the oracle, in the input dtype."""
    q, k, v, g = _qkvg(3, 16, 4, 2)
    q_len, kv_len = np.array([16, 0, 11]), np.array([9, 16, 0])
    with strict():
        q, k, v, g = (x.astype(dtype) for x in (q, k, v, g))  # float64 needs x64 on
        res = _fwd_grad(lambda q, k, v: dilax.dilated_attention(
            q, k, v, WS, RS, is_causal=True, local_window=2, query_seq_lengths=q_len,
            key_value_seq_lengths=kv_len), q, k, v, g)
    counts = dilated_counts(16, 4, WS, RS, "mixture", True, local_window=2)
    _check(res, _masked_counts(counts, q_len, kv_len), q, k, v, g,
           HALF if dtype == jnp.bfloat16 else FP32)


def test_dilated_grouped_key_padding_mask():
    """Grouped mode with an arbitrary key-padding mask, one row without any valid key."""
    q, k, v, g = _qkvg(2, 16, 4, 4)
    key_valid = np.random.default_rng(4).random((2, 16)) > 0.4
    key_valid[1] = False
    with strict():
        res = _fwd_grad(lambda q, k, v: dilax.dilated_attention(
            q, k, v, WS, RS, mode="grouped", key_padding_mask=key_valid), q, k, v, g)
    counts = dilated_counts(16, 4, WS, RS, "grouped")
    _check(res, _masked_counts(counts, key_valid=key_valid), q, k, v, g, divide=len(WS))
    assert not np.any(np.asarray(res[0])[1])


def test_pallas_interpret_kernels():
    """The Pallas kernels in the interpreter: dilated (causal) and block-sparse, fwd+grad."""
    q, k, v, g = _qkvg(1, 32, 2, 2, d=16)
    pattern = patterns.local_window(32, 16, 16)
    with strict():
        dil = _fwd_grad(lambda q, k, v: dilax.dilated_attention(
            q, k, v, (16, 32), (1, 2), is_causal=True, interpret=True), q, k, v, g)
        bs = _fwd_grad(lambda q, k, v: dilax.block_sparse_attention(
            q, k, v, pattern, is_causal=True, interpret=True), q, k, v, g)
    _check(dil, dilated_counts(32, 2, (16, 32), (1, 2), "mixture", True)[None], q, k, v, g)
    dense = np.kron(pattern.causal_mask(), np.ones((16, 16))) * np.tril(np.ones(32))
    _check(bs, dense[None], q, k, v, g)


def test_op_by_op_debug_nans_on_masked_rows():
    """Without jit every primitive is checked: padded query rows and a row without keys must
    not create a NaN anywhere in the forward or the backward (XLA core and mask reference)."""
    q, k, v, g = _qkvg(2, 8, 2, 2, d=4)
    q_len, kv_len = np.array([5, 8]), np.array([8, 0])
    counts = _masked_counts(dilated_counts(8, 2, (4,), (1,), "mixture", True), q_len, kv_len)
    for impl in ("xla", "reference"):
        with strict(x64=False), jax.disable_jit():
            out, vjp = jax.vjp(lambda q, k, v, impl=impl: dilax.dilated_attention(
                q, k, v, (4,), (1,), is_causal=True, implementation=impl,
                query_seq_lengths=q_len, key_value_seq_lengths=kv_len), q, k, v)
            res = (out, *vjp(g))
        _check(res, counts, q, k, v, g)


def test_decode_matches_oracle():
    """Prefill of 5 positions then one step (GQA, local window): the causal rows."""
    q, k, v, _ = _qkvg(2, 6, 4, 2)
    counts = dilated_counts(6, 4, WS, RS, "mixture", True, local_window=2)
    ref = attention(q, k, v, counts, 1 / np.sqrt(8)).out
    with strict():
        cache = dilax.KVCache.init(2, 16, 2, 8)
        o1, cache = dilax.dilated_attention_decode(q[:, :5], k[:, :5], v[:, :5], cache, WS, RS,
                                                   local_window=2)
        o2, cache = dilax.dilated_attention_decode(q[:, 5:], k[:, 5:], v[:, 5:], cache, WS, RS,
                                                   local_window=2)
    assert o1.dtype == o2.dtype == jnp.float32 and cache.lengths.dtype == jnp.int32
    assert_scaled_close(np.concatenate([o1, o2], axis=1), ref)
    np.testing.assert_array_equal(cache.lengths, [6, 6])


def test_block_sparse_with_empty_row():
    pattern = patterns.local_window(32, 8, 8) | patterns.global_local(32, 8, 8, 0)
    q, k, v, g = _qkvg(2, 32, 4, 2)
    kv_len = np.array([32, 0])
    with strict():
        res = _fwd_grad(lambda q, k, v: dilax.block_sparse_attention(
            q, k, v, pattern, is_causal=True, key_value_seq_lengths=kv_len), q, k, v, g)
    dense = np.kron(pattern.causal_mask(), np.ones((8, 8)))[:, :32, :32] * np.tril(np.ones(32))
    _check(res, _masked_counts(dense, kv_len=kv_len), q, k, v, g)


def test_sequence_parallel_eight_devices():
    """The ring op on 8 host devices: causal, window, lengths, GQA."""
    mesh = jax.make_mesh((8,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
    q, k, v, g = _qkvg(1, 64, 4, 2)
    q_len, kv_len = np.array([50]), np.array([40])
    with strict():
        res = _fwd_grad(lambda q, k, v: dilax.sharded_dilated_attention(
            q, k, v, (8, 32), (1, 2), mesh=mesh, is_causal=True, local_window=2,
            query_seq_lengths=q_len, key_value_seq_lengths=kv_len), q, k, v, g)
    counts = dilated_counts(64, 4, (8, 32), (1, 2), "mixture", True, local_window=2)
    _check(res, _masked_counts(counts, q_len, kv_len), q, k, v, g)


def test_modules_and_longnet_lm_training_step():
    """MultiheadDilatedAttention (call and decode), LongNetLM forward, one train step of
    dilax.train.steps, under the strict modes: the call and the logits equal the same
    parameters with every attention the dense reference (implementation="reference", run
    in normal mode: a second compile of the strict programs is not needed), decode equals
    the causal rows of the call, the step's loss is the reference logits' cross-entropy
    (float64), and the step keeps the parameters (its learning rate is 0 at the first warmup
    step) and their dtype."""
    from dilax.models import LongNetLM
    from dilax.nn import MultiheadDilatedAttention
    from dilax.train import steps

    x = _rand((2, 16, 16), 5)
    tokens = jnp.asarray(np.random.default_rng(6).integers(0, 17, (2, 16)), jnp.int32)
    targets = jnp.roll(tokens, -1, 1)

    def build(implementation=None):
        mha = MultiheadDilatedAttention(16, 4, WS, RS, num_kv_heads=2,
                                        implementation=implementation, rngs=nnx.Rngs(0))
        lm = LongNetLM(17, 16, 2, 0, 1, 32, WS, RS, implementation=implementation,
                       rngs=nnx.Rngs(0))
        return mha, lm

    with strict():
        mha, lm = build()
        y, (y_dec, _), logits = nnx.jit(lambda mha, lm: (  # one program for the three calls
            mha(x, is_causal=True), mha.decode(x[:, :4], mha.init_cache(2, 16)), lm(tokens)))(
                mha, lm)
        before = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(lm, nnx.Param)))
        opt = nnx.Optimizer(lm, steps.make_tx(10, 1e-2, 1, 0.1, 1.0), wrt=nnx.Param)
        loss = steps.train_step(lm, opt, tokens, targets, jax.random.key(0))
        after = nnx.to_pure_dict(nnx.state(lm, nnx.Param))
    # the same parameters, every attention the mask-based reference: built abstractly and given
    # the strict modules' parameters (an eager init would compile each of its ops again); the
    # assert checks that the copy reached every parameter (an abstract leaf left would fail it)
    ref_mha, ref_lm = nnx.eval_shape(lambda: build("reference"))
    nnx.update(ref_mha, nnx.state(mha))
    nnx.update(ref_lm, jax.tree.map(jnp.asarray, before))
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(ref_lm, nnx.Param)),
                 before)
    y_ref, logits_ref = nnx.jit(lambda m, lm: (m(x, is_causal=True), lm(tokens)))(ref_mha,
                                                                                   ref_lm)
    for got in (y, y_dec, logits, loss):
        assert got.dtype == jnp.float32
    assert_scaled_close(y, y_ref)
    assert_scaled_close(y_dec, y[:, :4])  # decode = the causal rows of the call
    assert_scaled_close(logits, logits_ref, depth=2)
    z = np.asarray(logits_ref, np.float64)
    z = z - z.max(-1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(-1, keepdims=True))
    want = -np.take_along_axis(log_p, np.asarray(targets)[..., None], -1).mean()
    assert_scaled_close(loss, want, depth=2)
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(after))
    jax.tree.map(np.testing.assert_array_equal, after, before)


def test_flax_attention_fn_decode_sow_and_linen():
    """tests/test_attention_fn_flax.py under the strict modes: flax decode=True (nnx and
    linen) against the full causal forward, sow_weights against the oracle."""
    import test_attention_fn_flax as F

    with strict():
        F.test_nnx_decode_equals_full_causal_forward()
        F.test_sow_weights_are_the_dilated_weights()
        F.test_linen_module_forward_and_decode()
