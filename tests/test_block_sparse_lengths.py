"""Valid lengths in the block-sparse Pallas kernel, and the registry's block-sparse rules.

* The kernel (:func:`pallas_kernels.block_sparse_flash_attention`) with traced
  ``query_seq_lengths`` / ``key_value_seq_lengths``, in the *strict* Pallas interpreter (an
  out-of-bounds read raises, unwritten memory is NaN), against the float64 oracle
  (tests/oracle.py): out, lse and dq/dk/dv under cotangents on out *and* lse; causal and not,
  GQA, shared and per-head tables, a partial last block, blocks larger than the tile, rows
  with ``q_len = 0`` or ``kv_len = 0`` (0, never NaN). One compile per static configuration;
  the lengths vary as data.
* The public op with ``implementation="pallas"`` runs the kernel through the core interface:
  its program holds the kernels and no XLA matmul.
* :mod:`dilax.registry`: an explicit ``"pallas"`` the kernel cannot serve raises naming the
  reason; ``implementation=None`` takes ``"xla"`` and says why.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from oracle import attention as oracle_attention
from tolerance import FP32, assert_scaled_close

import dilax
from dilax import patterns, registry
from pallas_kernels import KernelConfig, block_sparse_flash_attention
from pallas_kernels.tables import tables_from_block_mask

STRICT = pltpu.InterpretParams(out_of_bounds_reads="raise", uninitialized_memory="nan")
B, HK, G, D = 3, 1, 2, 8
SCALE = 0.3

# (n, block_size, per_head, causal, kernel tiles): 40 = 2.5 blocks of 16 (a partial last
# block), each block visited as 2 x 2 tiles of 8. The non-causal, shared-pattern case with
# lengths runs through the public op in tests/test_registry.py (block-sparse-lengths-pallas).
N, BS, TILE = 40, 16, 8
# (q_len, kv_len) per batch row: inside a tile, across a block edge, no key at all
Q_LEN, KV_LEN = [40, 23, 11], [19, 0, 40]


def _block_mask(n, bs, per_head, seed):
    nb = -(-n // bs)
    mask = np.random.default_rng(seed).random((HK * G if per_head else 1, nb, nb)) < 0.6
    mask[:, :, 0] = True  # every query block sees block 0 (rows with keys, for kv_len > 0)
    mask[0, 1, :] = False  # a query block with no key at all
    return mask


def _weights(mask, bs, n, causal, q_len, kv_len):
    """The oracle's ``(b, h, n, n)`` 0/1 weights: pattern, causal cut, valid lengths."""
    tokens = np.repeat(np.repeat(mask, bs, 1), bs, 2)[:, :n, :n].astype(np.float64)
    if causal:
        tokens = tokens * np.tril(np.ones((n, n)))
    pos = np.arange(n)
    rows = pos[None, :, None] < np.asarray(q_len)[:, None, None]
    cols = pos[None, None, :] < np.asarray(kv_len)[:, None, None]
    return np.broadcast_to(tokens, (HK * G, n, n))[None] * (rows & cols)[:, None]


def test_kernel_lengths_match_the_oracle_forward_and_gradients():
    """Causal, GQA, per-head tables, sub-tiled partial blocks, strict interpreter."""
    mask = _block_mask(N, BS, per_head=True, seed=3)
    idx, cnt = tables_from_block_mask(mask)
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(ks[0], (B, N, HK, G, D))
    k, v = (jax.random.normal(key, (B, N, HK, D)) for key in ks[1:3])
    dout = jax.random.normal(ks[3], q.shape)
    flat = lambda x: np.asarray(x).reshape(B, N, HK * G, *np.shape(x)[4:])  # noqa: E731
    w = _weights(mask, BS, N, True, Q_LEN, KV_LEN)
    lse_ref = oracle_attention(flat(q), k, v, w, SCALE).lse  # (b, n, h)
    dlse = np.where(np.isfinite(lse_ref), np.random.default_rng(1).standard_normal(
        lse_ref.shape), 0.0).astype(np.float32)
    ref = oracle_attention(flat(q), k, v, w, SCALE, flat(dout), dlse)

    @jax.jit
    def run(q, k, v, q_len, kv_len, dout, dlse):
        def fwd(q, k, v):
            return block_sparse_flash_attention(
                q, k, v, idx, cnt, block_size=BS, scale=SCALE, is_causal=True,
                interpret=STRICT, config=KernelConfig(TILE, TILE), query_seq_lengths=q_len,
                key_value_seq_lengths=kv_len)

        (out, lse), vjp = jax.vjp(fwd, q, k, v)
        return out, lse, vjp((dout, dlse))

    out, lse, grads = run(q, k, v, jnp.asarray(Q_LEN), jnp.asarray(KV_LEN), dout,
                          jnp.asarray(dlse).reshape(B, N, HK, G))
    assert all(np.all(np.isfinite(np.asarray(x))) for x in (out, *grads))
    assert_scaled_close(flat(out), ref.out, FP32, err_msg="out")
    lse = flat(lse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref.lse))
    finite = np.isfinite(ref.lse)
    assert_scaled_close(lse[finite], ref.lse[finite], FP32, err_msg="lse")
    for name, got, want in zip(("dq", "dk", "dv"), (flat(grads[0]), *grads[1:]),
                               (ref.dq, ref.dk, ref.dv)):
        assert_scaled_close(got, want, FP32, depth=4, err_msg=name)
    # rows past q_len, and the row without keys: exactly 0, with 0 gradient
    dead = (np.arange(N)[None, :] >= np.asarray(Q_LEN)[:, None]) | (
        np.asarray(KV_LEN)[:, None] == 0)
    assert np.all(flat(out)[dead] == 0) and np.all(flat(grads[0])[dead] == 0)
    assert np.all(np.asarray(grads[1])[1] == 0) and np.all(np.asarray(grads[2])[1] == 0)


def _top_level_primitives(jaxpr) -> list[str]:
    """Primitive names of a jaxpr, entering sub-jaxprs (jit, custom_vjp, scan...) but not
    the kernels (a ``pallas_call``'s body is the kernel, not XLA)."""
    names = []
    for eqn in jaxpr.eqns:
        names.append(eqn.primitive.name)
        if eqn.primitive.name == "pallas_call":
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's jaxpr
                if hasattr(sub, "eqns"):
                    names += _top_level_primitives(sub)
    return names


def test_public_op_with_lengths_runs_the_kernels_and_no_xla_matmul():
    n, h = 32, 4
    pattern = patterns.local_window(n, 8, 8)
    q = jnp.zeros((2, n, h, D))
    kv = jnp.zeros((2, n, HK, D))
    lengths = jnp.array([32, 9])

    def loss(q, k, v, q_len, kv_len):
        return dilax.block_sparse_attention(
            q, k, v, pattern, is_causal=True, implementation="pallas", interpret=True,
            query_seq_lengths=q_len, key_value_seq_lengths=kv_len).sum()

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, kv, kv, lengths, lengths)
    prims = _top_level_primitives(jaxpr.jaxpr)
    assert prims.count("pallas_call") == 3, prims  # forward, dq, dk/dv
    assert "dot_general" not in prims, prims


@pytest.mark.parametrize("block_size,interpret,why", [
    (6, True, "needs pattern.block_size to be a power of two (Triton tiles), got block_size=6"),
    (8, False, "needs pattern.block_size >= 16 on GPU (the smallest Triton tile; "
               "interpret=True runs smaller), got block_size=8"),
])
def test_explicit_pallas_the_kernel_cannot_serve_raises_its_reason(block_size, interpret, why):
    n = 4 * block_size
    q = jnp.zeros((1, n, 4, D))
    kv = jnp.zeros((1, n, HK, D))
    call = lambda q, k, v: dilax.block_sparse_attention(  # noqa: E731
        q, k, v, patterns.local_window(n, block_size, block_size), implementation="pallas",
        interpret=interpret, query_seq_lengths=jnp.array([n - 1]))
    with pytest.raises(ValueError, match=re.escape(why)) as info:
        jax.eval_shape(call, q, kv, kv)  # refused while tracing: nothing compiles
    assert "implementation='pallas' cannot run block-sparse attention" in str(info.value)
    assert "use implementation=None to run it on 'xla'" in str(info.value)


def test_registry_block_sparse_rules_and_none_reports_xla_with_the_reason():
    gpu = dict(platform="gpu", block_size=64, dtype="bfloat16", head_dim=128)
    served = registry.CoreRequest("block_sparse", has_lengths=True, is_causal=True, **gpu)
    assert registry.supports("pallas", served) is None  # lengths: the kernel serves them
    assert registry.choose(None, served)[0] == "pallas"
    f64 = registry.CoreRequest("block_sparse", **dict(gpu, dtype="float64"))
    assert registry.supports("pallas", f64) == (
        "the Pallas block-sparse kernel takes bf16/fp16/fp32 on GPU, got float64")
    name, why = registry.choose(None, registry.CoreRequest("block_sparse",
                                                           **dict(gpu, block_size=8)))
    assert name == "xla" and "not 'pallas': the Pallas block-sparse kernel needs " \
        "pattern.block_size >= 16 on GPU" in why
    # create_attention records the choice and its reason
    choice = dilax.create_attention(pattern=patterns.local_window(64, 8, 8), backend="gpu").choice
    assert choice.implementation == "xla" and "block_size >= 16 on GPU" in choice.reason
    choice = dilax.create_attention(pattern=patterns.local_window(64, 16, 16),
                                    backend="gpu").choice
    assert choice.implementation == "pallas" and "cuDNN has no such attention" in choice.reason
