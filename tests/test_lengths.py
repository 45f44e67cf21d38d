"""Valid lengths (padding) and the local-window branch (SPEC "Valid lengths", "Local window
branch"), against the mask reference, forward and gradient.

Rows of every length 0..n are covered by giving each batch row another length (data, not
static configuration), so each configuration compiles once. The expected values come from the
float64 NumPy oracle of the mask reference (tests/oracle.py), which compiles nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from oracle import attention as attention_oracle
from tolerance import FP32, assert_scaled_close, assert_trees_close

import dilax
from dilax import patterns as P
from dilax.block_sparse import content_adaptive as CA
from dilax.core import BlockSizes
from dilax.models import LongNetConfig, LongNetLM
from dilax.nn import MultiheadDilatedAttention
from dilax.reference import dilated_counts

N, H, HK, D = 13, 4, 2, 8
WS, RS = (4, 8), (1, 2)
LENGTHS_Q = np.arange(N + 1)  # batch row i: query length i, every length 0..n
LENGTHS_K = np.array([N, 0, 5, 1, 13, 7, 2, 9, 11, 3, 12, 4, 6, 10])  # every length too


def _inputs(b, n=N, h=H, hk=HK, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    return (jax.random.normal(ks[0], (b, n, h, D)), jax.random.normal(ks[1], (b, n, hk, D)),
            jax.random.normal(ks[2], (b, n, hk, D)), jax.random.normal(ks[3], (b, n, h, D)))


@functools.cache
def _vjp(**kw):
    @jax.jit
    def run(q, k, v, cot, q_len, kv_len):
        f = lambda q, k, v: dilax.dilated_attention(
            q, k, v, WS, RS, query_seq_lengths=q_len, key_value_seq_lengths=kv_len, **kw)
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(cot)

    return run


def _oracle(q, k, v, cot, q_len, kv_len, causal, window):
    """Explicit float64 count matrix of the spec: branch counts (+1 in the band), times the
    validity of (query, key) pairs; then the dense weighted softmax (float64 NumPy oracle):
    ``(out, (dq, dk, dv))``."""
    b, n = q.shape[:2]
    counts = np.array(dilated_counts(n, H, WS, RS, "mixture", causal), np.float64)
    if window is not None:
        pos = np.arange(n)
        band = np.abs(pos[:, None] - pos[None, :]) <= window
        counts = counts + (band & (pos[None, :] <= pos[:, None]) if causal else band)
    valid = (np.arange(n)[None, :, None] < q_len[:, None, None]) & (
        np.arange(n)[None, None, :] < kv_len[:, None, None])
    counts = counts[None] * valid[:, None]
    ref = attention_oracle(q, k, v, counts, 1 / np.sqrt(D), cot)
    return ref.out, (ref.dq, ref.dk, ref.dv)


@pytest.mark.parametrize("causal,window,impl", [
    (False, 2, "xla"), (True, 3, "xla"), (True, None, "pallas"),
])
def test_lengths_and_window_match_reference(causal, window, impl):
    b = len(LENGTHS_Q)
    q, k, v, cot = _inputs(b)
    q_len, kv_len = jnp.asarray(LENGTHS_Q), jnp.asarray(LENGTHS_K)
    kw = dict(is_causal=causal, local_window=window)
    if impl == "pallas":
        kw.update(implementation="pallas", interpret=True)
    else:  # small blocks: the band and the lengths skip whole blocks
        kw.update(implementation="xla", block_sizes=BlockSizes(4, 4))
    out, grads = _vjp(**kw)(q, k, v, cot, q_len, kv_len)
    ref_out, ref_grads = _oracle(q, k, v, cot, LENGTHS_Q, LENGTHS_K, causal, window)
    assert_scaled_close(out, ref_out, FP32, depth=2)
    assert_trees_close(grads, ref_grads, FP32, depth=4)
    # Padded query rows: exactly 0, zero gradient; padded keys: zero gradient; no NaN.
    rows = np.arange(N)[None, :] >= LENGTHS_Q[:, None]
    keys = np.arange(N)[None, :] >= LENGTHS_K[:, None]
    assert np.all(np.isfinite(out)) and all(np.all(np.isfinite(g)) for g in grads)
    assert np.all(np.asarray(out)[rows] == 0) and np.all(np.asarray(grads[0])[rows] == 0)
    assert np.all(np.asarray(grads[1])[keys] == 0) and np.all(np.asarray(grads[2])[keys] == 0)
    if impl == "xla" and causal:  # the implementation="reference" op agrees with the oracle
        ref_op = _vjp(is_causal=causal, local_window=window, implementation="reference")
        assert_trees_close(ref_op(q, k, v, cot, q_len, kv_len), (ref_out, ref_grads), FP32,
                           depth=4)


def test_padded_prefix_equals_unpadded_sequence_and_none_is_todays_program():
    q, k, v, _ = _inputs(2)
    L = 9
    padded = dilax.dilated_attention(q, k, v, WS, RS, is_causal=True, local_window=1,
                                     query_seq_lengths=jnp.array([L, N]),
                                     key_value_seq_lengths=jnp.array([L, N]))
    # the unpadded L-token sequence by the float64 oracle (not a second compiled program)
    short, _ = _oracle(q[:, :L], k[:, :L], v[:, :L], np.zeros(q[:, :L].shape), np.array([L, L]),
                       np.array([L, L]), True, 1)
    assert_scaled_close(padded[0, :L], short[0], FP32)
    # Lengths None: the very program without lengths (same HLO text).
    f = lambda *a, **kw: dilax.dilated_attention(*a, WS, RS, **kw)
    plain = jax.jit(lambda q, k, v: f(q, k, v)).lower(q, k, v).as_text()
    none = jax.jit(lambda q, k, v: f(q, k, v, query_seq_lengths=None,
                                     key_value_seq_lengths=None)).lower(q, k, v).as_text()
    assert plain == none


def test_length_and_window_errors_and_traced_clipping():
    q, k, v, _ = _inputs(2)
    with pytest.raises(ValueError, match=r"key_value_seq_lengths must lie in \[0, n=13\]"):
        dilax.dilated_attention(q, k, v, WS, RS, key_value_seq_lengths=np.array([3, 14]))
    with pytest.raises(ValueError, match="query_seq_lengths must have shape"):
        dilax.dilated_attention(q, k, v, WS, RS, query_seq_lengths=np.array([3]))
    with pytest.raises(TypeError, match="integer dtype"):
        dilax.dilated_attention(q, k, v, WS, RS, query_seq_lengths=np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="local_window .* mode='mixture'"):
        dilax.dilated_attention(q, k, v, WS, RS, mode="grouped", local_window=2)
    with pytest.raises(ValueError, match="local_window must be >= 0"):
        dilax.dilated_attention(q, k, v, WS, RS, local_window=-1)
    # Traced values are clipped to [0, n]: -3 acts as 0, 99 as n.
    f = jax.jit(lambda q, k, v, kl: dilax.dilated_attention(q, k, v, WS, RS,
                                                            key_value_seq_lengths=kl))
    clipped = f(q, k, v, jnp.array([-3, 99]))
    assert np.all(np.asarray(clipped[0]) == 0)
    unmasked, _ = _oracle(q, k, v, np.zeros(q.shape), np.array([N, N]), np.array([N, N]),
                          False, None)  # float64 oracle of the op without lengths
    assert_scaled_close(clipped[1], unmasked[1], FP32)


def test_block_sparse_and_content_adaptive_lengths_match_reference():
    b, n, bs = 4, 20, 4
    q, k, v, cot = _inputs(b, n=n)
    q_len, kv_len = jnp.array([0, 7, 20, 13]), jnp.array([20, 3, 0, 14])
    valid = (np.arange(n)[None, :, None] < np.asarray(q_len)[:, None, None]) & (
        np.arange(n)[None, None, :] < np.asarray(kv_len)[:, None, None])
    pattern = P.random(n, bs, 0.5, seed=1)
    for causal in (True,):  # gathered blocks and the causal diagonal call
        mask = pattern.expanded_mask(n, causal)[None] & valid[:, None]

        @jax.jit
        def run(q, k, v, cot, q_len, kv_len, causal=causal):
            f = lambda q, k, v: dilax.block_sparse_attention(
                q, k, v, pattern, is_causal=causal, query_seq_lengths=q_len,
                key_value_seq_lengths=kv_len)
            out, vjp = jax.vjp(f, q, k, v)
            return out, vjp(cot)

        ref = attention_oracle(q, k, v, mask, 1 / np.sqrt(D), cot)
        assert_trees_close(run(q, k, v, cot, q_len, kv_len),
                           (ref.out, (ref.dq, ref.dk, ref.dv)), FP32, depth=2)
    # content-adaptive: exact attention over its selection, restricted to the valid pairs
    # (the selection comes out of the attention's program: op by op it would compile each op)
    @jax.jit
    def run_ca(q, k, v, cot, q_len, kv_len):
        f = lambda q, k, v: dilax.content_adaptive_attention(
            q, k, v, bs, 2, is_causal=True, query_seq_lengths=q_len,
            key_value_seq_lengths=kv_len)
        out, vjp = jax.vjp(f, q, k, v)
        selection = CA.content_adaptive_selection(q, k, bs, 2, is_causal=True,
                                                  query_seq_lengths=q_len,
                                                  key_value_seq_lengths=kv_len)
        return (out, vjp(cot)), selection

    got, (idx, cnt) = run_ca(q, k, v, cot, q_len, kv_len)
    idx, cnt = np.asarray(idx), np.asarray(cnt)
    nb = n // bs
    blocks = np.zeros((b, HK, nb, nb), bool)
    for bi, c, i in np.ndindex(b, HK, nb):
        blocks[bi, c, i, idx[bi, c, i, :cnt[bi, c, i]]] = True
    pos = np.arange(n) // bs
    mask = np.repeat(blocks, H // HK, axis=1)[:, :, pos][:, :, :, pos]
    mask = mask & np.tril(np.ones((n, n), bool)) & valid[:, None]
    ref = attention_oracle(q, k, v, mask, 1 / np.sqrt(D), cot)
    assert_trees_close(got, (ref.out, (ref.dq, ref.dk, ref.dv)), FP32, depth=2)


def test_attention_fn_padding_mask_equals_flax_attention():
    b, n, e = 3, 16, 32
    x = jax.random.normal(jax.random.PRNGKey(1), (b, n, e))
    key_valid = jax.random.bernoulli(jax.random.PRNGKey(2), 0.6, (b, n)).at[:, 0].set(True)
    mask = nnx.make_attention_mask(jnp.ones((b, 1), bool), key_valid)  # (b, 1, 1, n)
    make = lambda **kw: nnx.MultiHeadAttention(num_heads=4, in_features=e, decode=False,
                                               rngs=nnx.Rngs(0), **kw)
    ours, flax_mha = make(attention_fn=dilax.attention_fn((n,), (1,))), make()

    @nnx.jit  # one program: both modules' outputs and input gradients
    def run(ours, flax_mha, x, mask):  # traced mask: any pattern, exactly
        def out_and_grad(m):
            loss = lambda x: jnp.sum(jnp.sin(m(x, mask=mask)))  # noqa: E731
            return m(x, mask=mask), jax.grad(loss)(x)

        return out_and_grad(ours), out_and_grad(flax_mha)

    (out, grad), (want_out, want_grad) = run(ours, flax_mha, x, mask)
    assert_scaled_close(out, want_out, FP32)
    assert_scaled_close(grad, want_grad, FP32, depth=2)
    with pytest.raises(ValueError, match=r"key-padding `mask` of shape \(\.\.\., 1, 1, n\)"):
        # traced only: the refusal comes at trace time, nothing compiles
        nnx.eval_shape(lambda m: m(x, mask=nnx.make_attention_mask(key_valid, key_valid)), ours)


def test_modules_and_models_take_lengths_and_window():
    b, n, e = 2, 12, 16
    x = jax.random.normal(jax.random.PRNGKey(3), (b, n, e))
    lengths = jnp.array([7, n])
    mha = MultiheadDilatedAttention(e, 4, WS, RS, num_kv_heads=2, local_window=2,
                                    rngs=nnx.Rngs(0))
    from dilax.nn._heads import output_projection

    @nnx.jit  # one program for the module and its composition (op by op: a compile per op)
    def module_and_composition(mha, x, lengths):
        y = mha(x, is_causal=True, query_seq_lengths=lengths, key_value_seq_lengths=lengths)
        q, k, v = (t.reshape(b, n, -1, e // 4) for t in (mha.q_proj(x), mha.k_proj(x),
                                                         mha.v_proj(x)))
        att = dilax.dilated_attention(q, k, v, WS, RS, is_causal=True, local_window=2,
                                      query_seq_lengths=lengths, key_value_seq_lengths=lengths,
                                      implementation="reference")
        return y, output_projection(mha, att.reshape(b, n, e))

    y, want = module_and_composition(mha, x, lengths)
    assert_scaled_close(y, want, FP32)
    with pytest.raises(ValueError, match="local_window"):
        LongNetConfig(16, 4, 32, WS, RS, mode="grouped", local_window=2)
    # LongNetLM: a padded row equals the same row with other padding (non-causal, so the
    # padding would be visible without the lengths).
    lm = LongNetLM(20, config=LongNetConfig(16, 4, 32, WS, RS, local_window=1),
                   num_encoder_layers=0, num_decoder_layers=1, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.PRNGKey(4), (b, n), 0, 20)
    other = tokens.at[0, 7:].set(3)
    run = nnx.jit(lambda lm, t, lengths: lm(t, is_causal=False, seq_lengths=lengths))
    a = run(lm, tokens, lengths)  # jitted: one compile, not one per op of the model
    c = run(lm, other, lengths)
    assert_scaled_close(a[0, :7], c[0, :7], FP32)
    assert_scaled_close(a[1], run(lm, tokens[1:], None)[0], FP32)  # full row: unchanged


def test_lm_loss_of_a_padded_batch_is_the_loss_of_its_valid_tokens():
    from dilax.train.steps import lm_loss

    lm = LongNetLM(20, config=LongNetConfig(16, 2, 32, WS, RS), num_encoder_layers=0,
                   num_decoder_layers=1, rngs=nnx.Rngs(0))
    import optax

    x = jax.random.randint(jax.random.PRNGKey(5), (2, 10), 0, 20)
    y = jnp.roll(x, -1, axis=1)

    @nnx.jit  # one program for the padded loss and the unpadded per-position losses
    def losses(lm, x, y):
        padded = lm_loss(lm, x, y, None, True, lengths=jnp.array([6, 10]))
        return padded, optax.softmax_cross_entropy_with_integer_labels(
            lm(x).astype(jnp.float32), y)

    padded, per_pos = losses(lm, x, y)
    # causal: a valid position sees no padding anyway, so its loss is the unmasked one
    expected = (per_pos[0, :6].sum() + per_pos[1].sum()) / 16
    assert_scaled_close(padded, expected, FP32)
