"""Pallas kernels (interpret mode on CPU) against the XLA core and the mask-based reference.

GPU compilation (Triton lowering) is not exercised here (``make gpu-check`` compiles them for
H100/A100 targets without a GPU): these tests run the same kernels in the Pallas interpreter.
The kernel tests use the *strict* interpreter (:data:`STRICT`): an out-of-bounds read raises
(plain ``interpret=True`` clamps it silently) and memory never written is NaN. Shapes are
tiny because the interpreter compiles every grid program.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dilated_cases import CASES, case_id, implementation, run_case
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from oracle import Result
from oracle import attention as attention_oracle
from tolerance import assert_scaled_close, tol_for

import dilax
import pallas_kernels.autotune as at
from dilax.core import attention_core
from pallas_kernels import (
    KernelConfig,
    block_sparse_flash_attention,
    default_config,
    flash_attention,
    tables_from_block_mask,
    transpose_block_tables,
)
from pallas_kernels.block_sparse import block_mask_from_tables

# The strict interpreter (jax's TPU interpret mode runs these Triton-style kernels too):
# out-of-bounds reads raise, uninitialized buffers hold NaN.
STRICT = pltpu.InterpretParams(out_of_bounds_reads="raise", uninitialized_memory="nan")

# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _grouped_inputs(B, Lq, Lk, Hk, G, d, dtype, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(k1, (B, Lq, Hk, G, d), jnp.float32).astype(dtype)
    k = jax.random.normal(k2, (B, Lk, Hk, d), jnp.float32).astype(dtype)
    v = jax.random.normal(k3, (B, Lk, Hk, d), jnp.float32).astype(dtype)
    return q, k, v


def _flash_mask(B, Lq, Lk, Hk, G, *, is_causal, kv_len, q_offset, k_offset):
    """The explicit ``(B, Hk * G, Lq, Lk)`` token mask (query head ``c * G + g``)."""
    kv_len = np.broadcast_to(np.asarray(Lk if kv_len is None else kv_len), (B, Hk))
    t = np.arange(Lk)
    p = np.arange(Lq)
    mask = t[None, None, None, :] < kv_len[:, :, None, None]  # (B, Hk, 1, Lk)
    if is_causal:
        mask = mask & (k_offset + t[None, :] <= q_offset + p[:, None])[None, None]
    return np.repeat(np.broadcast_to(mask, (B, Hk, Lq, Lk)), G, axis=1)


def _oracle(q, k, v, mask, scale, seed=7):
    """Float64 oracle in the grouped layout: ``(Result, (dout, dlse))`` under random cotangents
    on out and on lse (so dlse != 0; 0 on the rows with no key, where lse = -inf)."""
    B, Lq, Hk, G, d = q.shape
    flat = lambda x: np.asarray(x).reshape(B, Lq, Hk * G, *np.shape(x)[4:])  # noqa: E731
    lse = attention_oracle(flat(q), k, v, mask, scale).lse.reshape(B, Lq, Hk, G)
    rng = np.random.default_rng(seed)
    dout = jnp.asarray(rng.standard_normal(q.shape, np.float32)).astype(q.dtype)
    dlse = np.where(np.isfinite(lse), rng.standard_normal(lse.shape), 0.0).astype(np.float32)
    r = attention_oracle(flat(q), k, v, mask, scale, flat(dout), flat(dlse))
    ref = Result(r.out.reshape(q.shape), r.lse.reshape(lse.shape), r.dq.reshape(q.shape),
                 r.dk, r.dv)
    return ref, (dout, jnp.asarray(dlse))


def _vjp(fn):
    """``jit((q, k, v, (dout, dlse)) -> (out, lse, (dq, dk, dv)))`` of ``fn -> (out, lse)``."""

    @jax.jit
    def run(q, k, v, cotangents):
        (out, lse), vjp = jax.vjp(fn, q, k, v)
        return out, lse, vjp(cotangents)

    return run


def _compare(got, want: Result, dtype, tag):
    """out, lse (same -inf rows) and d{q,k,v} against ``want``, each to ``tol_for(dtype)``
    of its magnitude."""
    out, lse, grads = got
    tol = tol_for(dtype)
    assert out.dtype == jnp.dtype(dtype) and lse.dtype == jnp.float32, tag
    assert_scaled_close(out, want.out, tol, err_msg=f"{tag} out")
    lse = np.asarray(lse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want.lse),
                                  err_msg=f"{tag} lse -inf")
    finite = np.isfinite(want.lse)
    assert_scaled_close(lse[finite], want.lse[finite], tol, err_msg=f"{tag} lse")
    for name, g, g_w in zip(("dq", "dk", "dv"), grads, want[2:], strict=True):
        assert_scaled_close(g, g_w, tol, err_msg=f"{tag} {name}")


# --------------------------------------------------------------------------------------------
# flash attention
# --------------------------------------------------------------------------------------------

FLASH_CASES = [
    # B, Lq, Lk, Hk, G, d, causal, kv_len, q_off, k_off, dtype, config
    # odd block counts (40 = 3 x 16 with padding), GQA, ragged kv_len incl. an empty head
    (2, 40, 40, 2, 2, 32, False, ((40, 17), (0, 33)), 0, 0, "float32", KernelConfig(16, 16)),
    (2, 40, 40, 2, 2, 32, True, ((40, 17), (0, 33)), 3, 5, "float32", KernelConfig(16, 16)),
    # Lq != Lk, chunk at the end of the sequence, separate backward tiles, MHA
    (1, 24, 56, 2, 1, 64, True, None, 32, 0, "float32",
     KernelConfig(16, 32, block_q_dkv=32, block_k_dkv=16, block_q_dq=16, block_k_dq=16)),
    # MQA (Hk = 1), head_dim 128, default (per-shape) config
    (1, 48, 48, 1, 4, 128, False, None, 0, 0, "float32", None),
    # head_dim not a power of two (zero-padded to 64)
    (1, 33, 33, 1, 3, 40, True, None, 0, 0, "float32", KernelConfig(16, 16)),
    # half precision
    (1, 48, 48, 2, 2, 64, True, ((48, 30),), 0, 0, "bfloat16", KernelConfig(16, 32)),
    (2, 32, 40, 1, 2, 32, False, ((7,), (40,)), 0, 0, "float16", KernelConfig(16, 16)),
]


def _flash_id(c):
    B, Lq, Lk, Hk, G, d, causal, kv_len, qo, ko, dtype, cfg = c
    tag = "causal" if causal else "full"
    return f"{tag}-B{B}Lq{Lq}Lk{Lk}Hk{Hk}G{G}d{d}-len{kv_len is not None}-off{qo},{ko}-{dtype}"


@pytest.mark.parametrize("case", FLASH_CASES, ids=_flash_id)
def test_flash_attention_matches_core_and_reference(case):
    B, Lq, Lk, Hk, G, d, causal, kv_len, q_off, k_off, dtype, config = case
    q, k, v = _grouped_inputs(B, Lq, Lk, Hk, G, d, jnp.dtype(dtype), seed=Lq + d)
    kv = None if kv_len is None else jnp.broadcast_to(jnp.asarray(kv_len, jnp.int32), (B, Hk))
    scale = 1.0 / np.sqrt(d)
    common = dict(scale=scale, is_causal=causal, kv_len=kv, q_offset=q_off, k_offset=k_off)
    mask = _flash_mask(B, Lq, Lk, Hk, G, is_causal=causal, kv_len=kv_len, q_offset=q_off,
                       k_offset=k_off)
    ref, cot = _oracle(q, k, v, mask, scale)
    got = _vjp(functools.partial(flash_attention, **common, block_sizes=config,
                                 interpret=STRICT))(q, k, v, cot)
    _compare(got, ref, dtype, "flash")
    if kv_len is None and q_off == k_off == 0:
        return  # the XLA core without lengths or offsets: tests/test_dilated.py, every case
    # the XLA core on the same inputs (its kv_len / offsets against the same oracle)
    core = _vjp(functools.partial(attention_core, **common))(q, k, v, cot)
    _compare(core, ref, dtype, "core")


def test_flash_traced_offsets_vmap_and_causal_block_skipping():
    """Offsets may be traced (ring attention passes lax.axis_index-derived values) and the
    kernel batches under vmap. Causal block skipping on the same program: NaN planted in keys
    no query can see never reaches the output (a visited block would turn 0 * NaN into NaN in
    p @ v)."""
    q, k, v = _grouped_inputs(1, 32, 64, 1, 2, 16, jnp.float32)
    v = v.at[:, 48:].set(jnp.nan)  # keys 48..63: beyond every query's causal horizon
    qs, ks, vs = (jnp.stack([x, 2 * x]) for x in (q, k, v))
    offsets = jnp.array([16, 0], jnp.int32)  # queries 16..47 (the key tile 48..63 unseen)

    def one(q, k, v, q_off):
        return flash_attention(q, k, v, scale=0.25, is_causal=True, q_offset=q_off,
                               block_sizes=KernelConfig(16, 16), interpret=True)

    out, lse = jax.jit(jax.vmap(one))(qs, ks, vs, offsets)
    for i in range(2):
        mask = _flash_mask(1, 32, 48, 1, 2, is_causal=True, kv_len=None,
                           q_offset=int(offsets[i]), k_offset=0)
        ref = attention_oracle(qs[i].reshape(1, 32, 2, 16), ks[i][:, :48], vs[i][:, :48],
                               mask, 0.25)
        assert_scaled_close(out[i].reshape(ref.out.shape), ref.out, err_msg="vmap out")
        ref_lse = ref.lse.reshape(lse[i].shape)
        np.testing.assert_array_equal(np.isneginf(lse[i]), np.isneginf(ref_lse))
        fin = np.isfinite(ref_lse)
        assert_scaled_close(np.asarray(lse[i])[fin], ref_lse[fin], err_msg="vmap lse")


def test_kernel_config_validation():
    with pytest.raises(ValueError, match="power of two"):
        KernelConfig(block_q=48)
    with pytest.raises(ValueError, match="num_stages"):
        KernelConfig(num_stages=0)
    with pytest.raises(ValueError, match="num_warps"):
        KernelConfig(num_warps=3)
    cfg = default_config(4096, 4096, 128, jnp.bfloat16)
    assert hash(cfg) == hash(default_config(4096, 4096, 128, jnp.bfloat16))
    q, k, v = _grouped_inputs(1, 8, 8, 1, 1, 16, jnp.float32)
    with pytest.raises(TypeError, match="block_sizes"):
        flash_attention(q, k, v, scale=1.0, block_sizes=(16, 16), interpret=True)
    with pytest.raises(TypeError, match="KernelConfig"):
        flash_attention(q, k, v, scale=1.0, block_sizes=dilax.BlockSizes(16, 16), interpret=True)
    # dilax's BlockSizes reach the kernels through dilax's Pallas core, as Triton tiles.
    with pytest.raises(ValueError, match="powers of two"):
        dilax.dilated_attention(q[:, :, 0], k, v, (8,), (1,), implementation="pallas",
                                interpret=True, block_sizes=dilax.BlockSizes(3, 5))
    with pytest.raises(ValueError, match=r"\(B, Lk, Hk, d\)"):
        flash_attention(q, k[:, :, :, :8], v[:, :, :, :8], scale=1.0, interpret=True)
    with pytest.raises(TypeError, match="dtype"):
        flash_attention(q, k.astype(jnp.bfloat16), v, scale=1.0, interpret=True)


# --------------------------------------------------------------------------------------------
# block-sparse
# --------------------------------------------------------------------------------------------

SPARSE_CASES = [
    # B, n, Hk, G, d, block_size, per_head, causal, density, dtype, traced_tables
    # (kernel tiles 16 x 16: a 32-block is visited as 2 x 2 tiles)
    (2, 40, 2, 2, 32, 16, False, False, 0.5, "float32", False),
    (1, 72, 2, 2, 32, 32, True, True, 0.6, "float32", False),
    (1, 64, 1, 3, 64, 16, True, False, 0.4, "float32", True),
    (1, 48, 2, 1, 128, 16, False, True, 0.7, "float32", True),
    (1, 64, 2, 2, 64, 16, True, True, 0.5, "bfloat16", False),
]


def _sparse_id(c):
    B, n, Hk, G, d, bs, per_head, causal, dens, dtype, traced = c
    return (f"{'causal' if causal else 'full'}-B{B}n{n}Hk{Hk}G{G}d{d}-bs{bs}-"
            f"{'perhead' if per_head else 'shared'}-{'traced' if traced else 'static'}-{dtype}")


@pytest.mark.parametrize("case", SPARSE_CASES, ids=_sparse_id)
def test_block_sparse_matches_dense_reference(case):
    B, n, Hk, G, d, bs, per_head, causal, density, dtype, traced = case
    rng = np.random.default_rng(n * d)
    nb = -(-n // bs)
    h_pat = Hk * G if per_head else 1
    mask = rng.random((h_pat, nb, nb)) < density
    mask[0, nb - 1, :] = False  # a query block with no key at all
    mask[-1, 0, 0] = True
    idx, cnt = tables_from_block_mask(mask)
    np.testing.assert_array_equal(block_mask_from_tables(idx, cnt, nb), mask)
    q, k, v = _grouped_inputs(B, n, n, Hk, G, d, jnp.dtype(dtype), seed=n)
    scale = 1.0 / np.sqrt(d)

    if traced:  # tables as traced jit arguments: the XLA path derives the transposed tables
        def run(q, k, v, idx, cnt):
            return block_sparse_flash_attention(q, k, v, idx, cnt, block_size=bs, scale=scale,
                                                is_causal=causal, interpret=STRICT,
                                                config=KernelConfig(16, 16))

        fn = lambda q, k, v: run(q, k, v, jnp.asarray(idx), jnp.asarray(cnt))
    else:
        fn = functools.partial(block_sparse_flash_attention, kv_block_indices=idx,
                               kv_block_counts=cnt, block_size=bs, scale=scale,
                               is_causal=causal, interpret=STRICT, config=KernelConfig(16, 16))
    # the explicit token mask of the block mask, for every query head c * G + g
    tokens = np.repeat(np.repeat(mask, bs, 1), bs, 2)[:, :n, :n]
    if causal:
        tokens = tokens & np.tril(np.ones((n, n), bool))
    tokens = np.broadcast_to(tokens, (Hk * G, n, n))
    ref, cot = _oracle(q, k, v, tokens, scale)
    got = _vjp(fn)(q, k, v, cot)
    _compare(got, ref, dtype, "vs reference")
    out, lse, _ = got
    rows = np.zeros((n,), bool)
    rows[(nb - 1) * bs:] = True
    if h_pat == 1:
        assert np.all(np.asarray(out)[:, rows] == 0)
        assert np.all(np.isneginf(np.asarray(lse)[:, rows]))


def test_block_sparse_full_mask_and_explicit_transposed_tables():
    """An all-ones causal pattern with explicitly given transposed tables: the kernel is causal
    dense attention (the oracle). (The XLA core's causal dense attention: every causal case of
    tests/test_dilated.py.)"""
    B, n, Hk, G, d, bs = 1, 48, 1, 2, 32, 16
    nb = 3
    mask = np.ones((1, nb, nb), bool)
    idx, cnt = tables_from_block_mask(mask)
    q_idx, q_cnt = transpose_block_tables(idx, cnt, nb, is_causal=True)
    np.testing.assert_array_equal(q_cnt, [[3, 2, 1]])
    q, k, v = _grouped_inputs(B, n, n, Hk, G, d, jnp.float32)
    ref, cot = _oracle(q, k, v, np.tril(np.ones((n, n), bool)), 0.2)
    got = _vjp(functools.partial(
        block_sparse_flash_attention, kv_block_indices=idx, kv_block_counts=cnt, block_size=bs,
        scale=0.2, is_causal=True, interpret=True, q_block_indices=q_idx,
        q_block_counts=q_cnt))(q, k, v, cot)
    _compare(got, ref, "float32", "block-sparse")


def test_transpose_block_tables_numpy_and_traced_agree():
    rng = np.random.default_rng(1)
    mask = rng.random((3, 5, 5)) < 0.4
    idx, cnt = tables_from_block_mask(mask)
    for causal in (False, True):
        expect = mask & np.tril(np.ones((5, 5), bool)) if causal else mask
        t_idx, t_cnt = transpose_block_tables(idx, cnt, 5, causal)
        np.testing.assert_array_equal(block_mask_from_tables(t_idx, t_cnt, 5),
                                      expect.transpose(0, 2, 1))
        j_idx, j_cnt = jax.jit(transpose_block_tables, static_argnums=(2, 3))(
            jnp.asarray(idx), jnp.asarray(cnt), 5, causal)
        np.testing.assert_array_equal(
            np.asarray(block_mask_from_tables(j_idx, j_cnt, 5)), expect.transpose(0, 2, 1))


def test_block_sparse_validation():
    q, k, v = _grouped_inputs(1, 32, 32, 1, 2, 16, jnp.float32)
    idx, cnt = tables_from_block_mask(np.ones((1, 2, 2), bool))
    call = functools.partial(block_sparse_flash_attention, block_size=16, scale=1.0,
                             interpret=True)
    with pytest.raises(ValueError, match="query blocks"):
        call(q, k, v, idx[:, :1], cnt[:, :1])
    with pytest.raises(ValueError, match="H_pat"):
        call(q, k, v, np.concatenate([idx] * 3), np.concatenate([cnt] * 3))
    with pytest.raises(ValueError, match="ascending"):
        call(q, k, v, idx[..., ::-1].copy(), cnt)
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        call(q, k, v, idx + 1, cnt)
    with pytest.raises(ValueError, match="block_size"):
        block_sparse_flash_attention(q, k, v, idx, cnt, block_size=12, scale=1.0)
    with pytest.raises(TypeError, match="integer"):
        call(q, k, v, idx.astype(np.float32), cnt)


def test_strict_interpreter_catches_out_of_bounds_reads():
    """The reason for :data:`STRICT`: a dynamic out-of-bounds slice is clamped silently by
    plain ``interpret=True`` and raises under the strict interpreter."""

    def kernel(start_ref, x_ref, o_ref):
        o_ref[...] = x_ref[pl.ds(start_ref[0], 8)]

    call = lambda interpret: pl.pallas_call(  # noqa: E731
        kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32), interpret=interpret)(
        jnp.array([12], jnp.int32), jnp.arange(16, dtype=jnp.float32))
    np.testing.assert_array_equal(call(True), np.arange(8, 16))  # clamped to [8, 16)
    with pytest.raises(Exception, match="Out-of-bounds read"):
        jax.block_until_ready(call(STRICT))


def test_kernels_strict_randomized_tiles_groups_head_dims():
    """Seeded random tiles (each kernel its own), GQA group size, head dim, lengths, kv_len and
    offsets for the flash kernels: forward and gradients against the float64 oracle under the
    strict interpreter. (The block-sparse cases above run strict too, one with blocks larger
    than the tiles.)"""
    rng = np.random.default_rng(15)
    tile = lambda: int(rng.choice([16, 32]))  # noqa: E731
    G = int(rng.integers(1, 5))
    Hk, d = (1 if G > 2 else 2), int(rng.choice([16, 24, 48]))
    Lq, Lk = (int(x) for x in rng.integers(17, 70, 2))
    q_off, k_off = (int(x) for x in rng.integers(0, 24, 2))
    kv_len = rng.integers(Lk // 2, Lk + 1, (1, Hk))
    cfg = KernelConfig(tile(), tile(), block_q_dkv=tile(), block_k_dkv=tile(),
                       block_q_dq=tile(), block_k_dq=tile())
    q, k, v = _grouped_inputs(1, Lq, Lk, Hk, G, d, jnp.float32, seed=5)
    scale = 1.0 / np.sqrt(d)
    mask = _flash_mask(1, Lq, Lk, Hk, G, is_causal=True, kv_len=kv_len, q_offset=q_off,
                       k_offset=k_off)
    ref, cot = _oracle(q, k, v, mask, scale)
    got = _vjp(functools.partial(flash_attention, scale=scale, is_causal=True,
                                 kv_len=jnp.asarray(kv_len, jnp.int32), q_offset=q_off,
                                 k_offset=k_off, block_sizes=cfg, interpret=STRICT))(
        q, k, v, cot)
    _compare(got, ref, "float32", f"flash G={G} d={d} {cfg}")


# --------------------------------------------------------------------------------------------
# dilated attention through the Pallas kernel (cases shared with the XLA path)
# --------------------------------------------------------------------------------------------


# The Pallas kernels only: the XLA path runs these geometries (n not a multiple of w, r not
# dividing n, uneven grouped-mode MQA groups, w > n, n = 1, GQA) in tests/test_dilated.py's
# edge cases and sweeps (bf16 and head_dim 64 there too), against the same oracle.
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_dilated_matches_reference(case):
    run_case(case, implementation("pallas-interpret"))


def test_dilated_pallas_rejects_bad_input():
    pallas = functools.partial(dilax.dilated_attention, implementation="pallas", interpret=True)
    q = jnp.zeros((1, 16, 4, 16))
    k = jnp.zeros((1, 16, 3, 16))
    with pytest.raises(ValueError, match="h % hk"):
        pallas(q, k, k, (8,), (1,))
    with pytest.raises(ValueError, match="divisible"):
        pallas(q, q, q, (8,), (3,))
    with pytest.raises(TypeError, match="block_sizes"):
        pallas(q, q, q, (8,), (1,), block_sizes=(8, 8))


# --------------------------------------------------------------------------------------------
# autotune
# --------------------------------------------------------------------------------------------


def test_autotune_picks_a_candidate_and_reuses_the_cached_winner(tmp_path):
    at.clear_cache()
    q, k, v = _grouped_inputs(1, 32, 32, 1, 1, 16, jnp.float32)
    candidates = [KernelConfig(16, 16), KernelConfig(32, 32)]
    built = []

    def factory(cfg):
        built.append(cfg)
        return jax.jit(functools.partial(flash_attention, scale=0.25, block_sizes=cfg,
                                         interpret=True))

    cache_file = tmp_path / "tune.json"
    best = at.autotune(factory, candidates, q, k, v, key="flash-test", cache_file=cache_file,
                       warmup=1, iters=2)
    assert best in candidates
    assert built == candidates  # every candidate was timed once
    assert set(at.TIMINGS[at.cache_key("flash-test", q, k, v)]) == {repr(c) for c in candidates}
    stored = json.loads(cache_file.read_text())
    assert stored == {at.cache_key("flash-test", q, k, v): repr(best)}

    # Same key and shapes: the in-process winner, nothing built or timed.
    assert at.autotune(factory, candidates, q, k, v, key="flash-test") is best
    assert len(built) == 2
    # A fresh process (cleared cache) reads the winner back from the JSON file.
    at.clear_cache()
    assert at.autotune(factory, candidates, q, k, v, key="flash-test",
                       cache_file=cache_file) == best
    assert len(built) == 2
    # Other shapes are a different key: timed again.
    q2 = q[:, :16]
    at.autotune(factory, candidates, q2, k, v, key="flash-test", warmup=1, iters=1)
    assert len(built) == 4


def test_autotune_skips_failing_candidates():
    at.clear_cache()
    x = jnp.ones((8,))

    def factory(c):
        if c == "broken":
            def fail(x):
                raise RuntimeError("does not compile")
            return fail
        return jax.jit(lambda x: x * c)

    assert at.autotune(factory, ["broken", 2.0], x, key="skip", iters=1) == 2.0
    with pytest.raises(RuntimeError, match="every candidate failed"):
        at.autotune(factory, ["broken"], x, key="all-broken", iters=1)
    with pytest.raises(ValueError, match="at least one candidate"):
        at.autotune(factory, [], x)
