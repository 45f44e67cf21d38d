"""Numeric edge cases every implementation must get right (issue #9).

Implementations: dilated ``reference``, ``xla``, ``pallas`` (interpreter), ``ring``
(``sharded_dilated_attention`` on 2 devices) and block-sparse ``bs-reference``, ``bs-xla``,
``bs-pallas`` (interpreter). The oracle is an independent float64 NumPy softmax over the SPEC's
token mask (``dilated_counts`` multiplicities / the pattern's expanded mask), forward and
backward.

- huge logits: magnitude ~1e4 in float32, and exactly the float16 / bfloat16 maximum for
  half-precision inputs: finite and equal to the oracle;
- fully masked query rows: output 0, gradient 0, nothing NaN;
- a NaN in one key poisons exactly the queries that attend that key (not padding, not other
  segments / blocks / heads);
- bitwise identical results across repeated calls and between ``jax.jit`` and eager calls.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh
from oracle import attention as attention_oracle
from tolerance import FP32, HALF, assert_scaled_close

import dilax
from dilax import patterns
from dilax.reference import dilated_counts

IMPLS = ["reference", "xla", "pallas", "ring", "bs-reference", "bs-xla", "bs-pallas"]
WS, RS = (4, 8), (1, 2)
BLOCK = 4
BLOCK_MASK = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [1, 0, 1, 1]], bool)
# The shared programs' configuration (n = 16, h = 2, scale 1): rows no key reaches.
# Dilated: two branches (8, 2), (16, 4): head 0 (offset 0 in both) never selects odd
# positions, head 1 (offset 1) never even ones; the rows 0 mod 4 of head 0 (1 mod 4 of head 1)
# merge both branches. Block-sparse: query block 2 attends nothing.
SHARED_WS, SHARED_RS = (8, 16), (2, 4)
SHARED_BLOCK_MASK = BLOCK_MASK & np.array([1, 1, 0, 1], bool)[:, None]


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:2]), ("sp",), axis_types=(AxisType.Auto,))


def attention(impl: str, n: int, h: int, *, ws=WS, rs=RS, block_mask=BLOCK_MASK, scale=None,
              eager=False):
    """``(fn(q, k, v), weights (h, n, n))`` of an implementation (``fn`` jitted unless
    ``eager``)."""
    if impl.startswith("bs-"):
        pattern = patterns.from_mask(block_mask, BLOCK)
        kw = {"bs-reference": dict(implementation="reference"),
              "bs-xla": dict(implementation="xla"),
              "bs-pallas": dict(implementation="pallas", interpret=True)}[impl]
        fn = functools.partial(dilax.block_sparse_attention, pattern=pattern, scale=scale, **kw)
        mask = pattern.expanded_mask(n).astype(np.float64)
        return (fn if eager else jax.jit(fn)), np.broadcast_to(mask, (h, n, n))
    if impl == "ring":
        fn = functools.partial(dilax.sharded_dilated_attention, segment_lengths=ws,
                               dilation_rates=rs, mesh=_mesh(), scale=scale)
    else:
        kw = dict(implementation="pallas", interpret=True) if impl == "pallas" else dict(
            implementation=impl)
        fn = functools.partial(dilax.dilated_attention, segment_lengths=ws, dilation_rates=rs,
                               scale=scale, **kw)
    return (fn if eager else jax.jit(fn)), dilated_counts(n, h, ws, rs).astype(np.float64)


# ----------------------------------------------------------------------------- float64 oracle


def oracle(q, k, v, weights, scale, dout=None):
    """Weighted softmax attention in float64 (``tests/oracle.py``); returns ``out`` or
    ``(out, dq, dk, dv)``."""
    r = attention_oracle(q, k, v, weights, scale, dout)
    return r.out if dout is None else (r.out, r.dq, r.dk, r.dv)


def value_and_grads(fn, q, k, v, dout):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(dout.astype(out.dtype)))


def fwd_bwd(fn):
    """``jit((q, k, v, dout) -> (out, dq, dk, dv))``: forward and backward in one program."""
    return jax.jit(functools.partial(value_and_grads, fn))


@functools.cache
def shared_attention(impl: str):
    """``attention(impl, 16, 2)`` (eager) of the shared configuration, scale 1."""
    return attention(impl, 16, 2, ws=SHARED_WS, rs=SHARED_RS, block_mask=SHARED_BLOCK_MASK,
                     scale=1.0, eager=True)


@functools.cache
def shared_fwd_bwd(impl: str):
    """``fwd_bwd`` of ``shared_attention(impl)``: one compiled program per implementation for
    the huge-logit, the fully-masked-row and the determinism tests."""
    return fwd_bwd(shared_attention(impl)[0])


def assert_close(actual, expected, tol, what):
    """Finite, and ``assert_scaled_close`` (tolerance ``tol`` of the expected magnitude)."""
    actual = np.asarray(actual, np.float64)
    assert np.isfinite(actual).all(), f"{what}: not finite"
    assert_scaled_close(actual, expected, tol, err_msg=what)


def _check_against_oracle(run, weights, q, k, v, scale, tol, grad_tol=None):
    """``run``: a ``fwd_bwd`` program."""
    dout = jax.random.normal(jax.random.key(7), q.shape, jnp.float32)
    out, dq, dk, dv = run(q, k, v, dout)
    ref = oracle(q, k, v, weights, scale, np.asarray(dout.astype(q.dtype), np.float64))
    for name, a, r in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), ref):
        assert_close(a, r, tol if name == "out" else (grad_tol or tol), name)


# ----------------------------------------------------------------------------- huge logits


@pytest.mark.parametrize("impl", IMPLS)
def test_logits_of_magnitude_1e4_fp32(impl):
    """Integer q, k with scale 1: every logit is an exact integer up to ~1e4 in float32."""
    b, n, h, hk, d = 1, 16, 2, 1, 8
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.integers(-40, 41, (b, n, h, d)), jnp.float32)
    k = jnp.asarray(rng.integers(-100, 101, (b, n, hk, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, n, hk, d)), jnp.float32)
    weights = shared_attention(impl)[1]
    logits = np.einsum("bqhd,bkhd->bhqk", np.asarray(q), np.repeat(np.asarray(k), 2, 2))
    assert np.abs(logits).max() >= 5e3  # the case is what it says
    # Gradients to 10x FP32: the logits are exact integers, but an lse of magnitude ~1e4 is
    # rounded to ulp(1e4) / 2 ~ 5e-4, so the probabilities the backward recomputes as
    # exp(s - lse) carry that error, times |k| <= 100 in dq = ds @ k, against gradients of
    # magnitude ~1; observed <= 5e-5. That rounding is the values', not the CPU's (integer dot
    # products are exact in any order).
    _check_against_oracle(shared_fwd_bwd(impl), weights, q, k, v, 1.0, FP32,
                          grad_tol=10 * FP32)


def _onehot_inputs(dtype, big_q, big_k, n=16, h=2, hk=1, d=8, seed=1):
    """q rows ``±big_q * e_a``, k rows ``±big_k * e_b``: logits are exactly 0 or
    ``±big_q * big_k`` (one non-zero product, no rounding in any summation order)."""
    rng = np.random.default_rng(seed)

    def rows(shape, big):
        x = np.zeros(shape, np.float32)
        idx = rng.integers(0, 3, shape[:-1])  # 3 of d coordinates: many equal logits
        sign = rng.choice([-1.0, 1.0], shape[:-1])
        np.put_along_axis(x, idx[..., None], (sign * big)[..., None], axis=-1)
        return x

    q = jnp.asarray(rows((1, n, h, d), big_q), dtype)
    k = jnp.asarray(rows((1, n, hk, d), big_k), dtype)
    v = jnp.asarray(rng.standard_normal((1, n, hk, d)), dtype)
    return q, k, v


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_logits_at_the_half_precision_maximum(impl, dtype):
    """Logits of exactly +-max(dtype) (65504 for float16, ~3.39e38 for bfloat16)."""
    dt = jnp.dtype(dtype)
    big = float(jnp.finfo(dt).max)
    if dtype == "float16":
        big_q, big_k = 256.0, big / 256.0  # 256 * 255.875 = 65504
    else:
        big_q, big_k = 2.0**64, big / 2.0**64
    q, k, v = _onehot_inputs(dt, big_q, big_k)
    assert float(big_q) * float(big_k) == big and float(k.astype(jnp.float32).max()) == big_k
    # One softmax per query (one branch): at |logits| >= 2**24 a float32 log-sum-exp cannot
    # carry the branch weights of a mixture, see test_mixture_weights_at_huge_logits.
    fn, weights = attention(impl, 16, 2, ws=(8,), rs=(1,), scale=1.0, eager=True)
    # forward and the gradients of sum(out) in one program
    out, *grads = fwd_bwd(fn)(q, k, v, jnp.ones(q.shape, jnp.float32))
    assert out.dtype == dt
    ref = oracle(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), weights,
                 1.0)
    assert_close(out, ref, HALF, "out")
    for name, g in zip("qkv", grads):
        assert np.isfinite(np.asarray(g, np.float32)).all(), f"d{name} not finite"


# ----------------------------------------------------------------------------- masked rows


@pytest.mark.parametrize("impl", IMPLS)
def test_fully_masked_rows_give_zero_with_zero_gradient(impl):
    n, h, hk, d = 16, 2, 1, 8
    # the shared program (SHARED_WS / SHARED_BLOCK_MASK: rows with no key), scale 1
    weights = shared_attention(impl)[1]
    run = shared_fwd_bwd(impl)
    masked = weights.sum(-1) == 0  # (h, n)
    assert masked.any() and not masked.all()
    kq, kk, kv = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(kq, (1, n, h, d))
    k = jax.random.normal(kk, (1, n, hk, d))
    v = jax.random.normal(kv, (1, n, hk, d))
    dout = jax.random.normal(jax.random.key(4), q.shape)
    out, dq, dk, dv = run(q, k, v, dout)
    rows = np.moveaxis(masked, 0, 1)[None]  # (1, n, h)
    assert np.all(np.asarray(out)[rows] == 0.0)
    assert np.all(np.asarray(dq)[rows] == 0.0)
    never_read = weights.sum((0, 1)) == 0  # keys no query attends (all heads share kv head 0)
    assert np.all(np.asarray(dk)[0, never_read] == 0.0)
    assert np.all(np.asarray(dv)[0, never_read] == 0.0)
    _check_against_oracle(run, weights, q, k, v, 1.0, FP32)


# ----------------------------------------------------------------------------- NaN isolation


def _nan_case(impl):
    """n = 20 is not a multiple of w = 8, 16 (padded last segment); the pattern's 14 tokens
    leave a partial last block (except for Pallas, which needs whole blocks)."""
    if impl.startswith("bs-"):
        return (16 if impl == "bs-pallas" else 14), (3, 9, 13)
    return 20, (2, 9, 17, 19)


@functools.cache
def _nan_attention(impl):
    """``attention(impl, n, 4)`` at the NaN cases' n: one jitted function (one compile) for the
    poisoned keys and the poisoned values."""
    return attention(impl, _nan_case(impl)[0], 4)


@pytest.mark.parametrize("which,impl", [
    (w, i) for w in ("k", "v") for i in IMPLS])
def test_nan_in_one_key_poisons_only_its_queries(impl, which):
    h, hk, d = 4, 2, 8
    n, positions = _nan_case(impl)
    fn, weights = _nan_attention(impl)
    kq, kk, kv = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(kq, (1, n, h, d))
    k = jax.random.normal(kk, (1, n, hk, d))
    v = jax.random.normal(kv, (1, n, hk, d))
    clean = np.asarray(fn(q, k, v))
    for t0 in positions:
        for c in range(hk):
            x = (k if which == "k" else v).at[0, t0, c, d // 2].set(jnp.nan)
            out = np.asarray(fn(q, x, v) if which == "k" else fn(q, k, x))
            heads = np.arange(h) // (h // hk) == c
            expected = (weights[:, :, t0] > 0) & heads[:, None]  # (h, n) attend key t0
            expected = np.moveaxis(expected, 0, 1)  # (n, h)
            if which == "v":  # only the poisoned feature of the value
                got = np.isnan(out[0, :, :, d // 2])
            else:
                got = np.isnan(out[0]).any(-1)
            assert np.array_equal(got, expected), (
                f"key {t0}, kv head {c}: NaN at {np.argwhere(got ^ expected)[:6].tolist()} "
                "(query, head) disagrees with the set of queries that attend it")
            assert np.isnan(out[0][expected]).any(-1).all()
            np.testing.assert_array_equal(out[0][~expected], clean[0][~expected])


# ----------------------------------------------------------------------------- determinism


def _bits(x):
    return np.asarray(x).view(np.uint8)


@pytest.mark.parametrize("impl", IMPLS)
def test_bitwise_identical_across_runs_and_jit(impl):
    n, h, hk, d = 16, 2, 1, 8
    fn = shared_attention(impl)[0]
    kq, kk, kv = jax.random.split(jax.random.key(6), 3)
    q = jax.random.normal(kq, (1, n, h, d))
    k = jax.random.normal(kk, (1, n, hk, d))
    v = jax.random.normal(kv, (1, n, hk, d))
    dout = jax.random.normal(jax.random.key(8), q.shape)

    # two compilations (the shared program, also run by test_logits_of_magnitude_1e4_fp32,
    # and a fresh jit of the same function), three runs
    shared = shared_fwd_bwd(impl)
    compiled = [shared(q, k, v, dout), shared(q, k, v, dout), fwd_bwd(fn)(q, k, v, dout)]
    for other in compiled[1:]:
        for name, a, b in zip(("out", "dq", "dk", "dv"), compiled[0], other):
            np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"jit vs jit: {name}")
    # eager calls against the jitted output (the shared program's forward: no third compile)
    for _ in range(2):
        np.testing.assert_array_equal(_bits(fn(q, k, v)), _bits(compiled[0][0]),
                                      err_msg="eager vs jit: out")
