"""dilated_attention: every fast path against the mask-based reference of SPEC.md."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dilated_cases import DilatedCase, assert_matches_oracle, case_id, jit_vjp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import attention as attention_oracle
from oracle import dilated as dilated_oracle
from tolerance import FP32, assert_scaled_close

import dilax
from dilax import BlockSizes


def make_inputs(b, n, h, hk, d, dtype=jnp.float32, seed=0, q_scale=1.0):
    """q (times ``q_scale``: sharper or flatter softmax), k, v and an output cotangent."""
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = (q_scale * jax.random.normal(k1, (b, n, h, d), jnp.float32)).astype(dtype)
    k = jax.random.normal(k2, (b, n, hk, d), jnp.float32).astype(dtype)
    v = jax.random.normal(k3, (b, n, hk, d), jnp.float32).astype(dtype)
    dout = jax.random.normal(k4, (b, n, h, d), jnp.float32).astype(dtype)
    return q, k, v, dout


@functools.cache
def _xla_vjp(ws, rs, mode, causal, block_sizes):
    """One jitted forward + backward per static configuration (it compiles once per shape):
    hypothesis examples on the same configuration reuse it."""
    return jit_vjp(functools.partial(
        dilax.dilated_attention, segment_lengths=ws, dilation_rates=rs, mode=mode,
        is_causal=causal, implementation="xla", block_sizes=block_sizes))


def check_against_reference(q, k, v, dout, ws, rs, mode, causal, block_sizes=None):
    """The XLA path's output and d{q,k,v} (cotangent ``dout``) against the float64 oracle of
    the mask-based reference, to FP32 / HALF (by dtype) of each array's magnitude."""
    out, grads = _xla_vjp(ws, rs, mode, causal, block_sizes)(q, k, v, dout)
    assert out.shape == q.shape
    ref = dilated_oracle(q, k, v, ws, rs, mode, causal, dout=dout)
    assert_matches_oracle(out, grads, ref, q.dtype)


def _check_case(case: DilatedCase, block_sizes, seed, q_scale=1.0):
    q, k, v, dout = make_inputs(*case[:5], dtype=jnp.dtype(case.dtype), seed=seed,
                                q_scale=q_scale)
    check_against_reference(q, k, v, dout, case.ws, case.rs, case.mode, case.causal, block_sizes)


# The sweeps: a fixed pool of static configurations (each one compiled program, forward and
# backward), hypothesis drawing the data (inputs, cotangent, softmax sharpness) on each: an
# example after the first costs milliseconds, a configuration a compile (~1 s). The
# pool spans what a free draw of (b, n, h, hk, d, ws, rs, mode, causal, block sizes) would:
# G = 1..4 branches, r = 1..4, w = r * (1..6), h up to 12 with every kind of GQA split (MHA,
# GQA, MQA, uneven grouped-mode head groups), d in {8, 16, 64}, n from 2 to 3 * max(w) + 3
# (w > n, n not a multiple of any w), b in {1, 2}, both modes, both masks, and every block-size
# variant (defaults, q/k blocks either larger, non-powers of two, head groups of 1 and 3).
SWEEP_FP32 = [
    (DilatedCase(2, 23, 3, 1, 8, (4,), (1,), "mixture", True), None),
    (DilatedCase(1, 40, 8, 4, 16, (6, 12), (2, 3), "mixture", False), BlockSizes(4, 8)),
    (DilatedCase(2, 31, 6, 2, 64, (3, 8, 12), (1, 4, 3), "grouped", True), BlockSizes(8, 4)),
    (DilatedCase(1, 75, 12, 3, 8, (2, 6, 12, 24), (1, 2, 3, 4), "mixture", True),
     BlockSizes(3, 5, 5, 3)),
    (DilatedCase(1, 17, 4, 4, 16, (24, 8), (4, 2), "grouped", False),
     BlockSizes(4, 8, heads_per_step=1)),
    (DilatedCase(2, 48, 9, 3, 8, (5, 10, 15), (1, 2, 3), "mixture", False),
     BlockSizes(3, 5, 5, 3, heads_per_step=3)),
    (DilatedCase(1, 2, 2, 1, 64, (4, 2), (4, 2), "grouped", True), None),
    (DilatedCase(1, 39, 10, 5, 16, (3, 9, 12), (3, 3, 2), "grouped", True),
     BlockSizes(4, 8, heads_per_step=1)),
]
SWEEP_BF16 = [
    (DilatedCase(2, 37, 4, 2, 16, (8, 16), (2, 4), "mixture", True, "bfloat16"),
     BlockSizes(4, 8)),
    (DilatedCase(1, 30, 6, 3, 64, (3, 6, 9), (1, 2, 3), "grouped", False, "bfloat16"), None),
    (DilatedCase(1, 13, 5, 1, 8, (12,), (2,), "mixture", False, "bfloat16"),
     BlockSizes(3, 5, 5, 3, heads_per_step=3)),
]


def _sweep_id(entry):
    case, bs = entry
    if bs is None:
        return f"{case_id(case)}-default"
    bq, bk = bs.backward
    return f"{case_id(case)}-bs{bs.block_q}x{bs.block_k}-{bq}x{bk}-hps{bs.heads_per_step}"


@pytest.mark.parametrize("entry", SWEEP_FP32, ids=_sweep_id)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), q_scale=st.sampled_from([0.3, 1.0, 3.0]))
def test_xla_matches_reference_fp32_sweep(entry, seed, q_scale):
    _check_case(*entry, seed, q_scale)


@pytest.mark.parametrize("entry", SWEEP_BF16, ids=_sweep_id)
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), q_scale=st.sampled_from([0.3, 1.0, 3.0]))
def test_xla_matches_reference_bf16_sweep(entry, seed, q_scale):
    _check_case(*entry, seed, q_scale)


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


# Each edge case with the default blocks (one block per segment) and with BlockSizes(4, 8)
# (several), except where the second run would repeat a program or a path run elsewhere:
# - cases 5, 8 (n = 1) and 9 (w / r <= 2 rows per segment) clamp both to the same blocks, and
#   their lowered StableHLO is identical (checked when this list was made);
# - cases 0 and 1: their BlockSizes(4, 8) blocks run in test_head_groups_match_reference, with
#   steps of 2 heads on top (all heads per step over several blocks: the fp32 sweep's
#   mixture-full-b1n40h8hk4 and grouped-causal-b2n31h6hk2);
# - case 6 (four mixture branches, causal, h = 12): over several blocks in the fp32 sweep's
#   mixture-causal-b1n75h12hk3 (four branches, BlockSizes(3, 5, 5, 3));
# - case 7 (grouped, non-causal, h = 12; by default steps of 4 heads): grouped non-causal over
#   several blocks in the fp32 sweep's grouped-full-b1n17h4hk4 (w > n too).
# Case 1 (mixture, causal, GQA, three branches, r not dividing n) runs only in
# test_head_groups_match_reference (several blocks, steps of 2 heads): its default blocks would
# repeat the path of case 6 (mixture, causal, GQA, four branches, n not a multiple of w = 30,
# one block per segment) and of cases 3 and 9.
_DEFAULT_BLOCKS_ONLY = (0, 1, 5, 6, 7, 8, 9)
_HEAD_GROUPS_ONLY = (1,)
EDGE_RUNS = [pytest.param(case, bs, id=f"case{i}-{'default' if bs is None else 'bs4x8'}")
             for i, case in enumerate(EDGE_CASES) for bs in (None, BlockSizes(4, 8))
             if (bs is None and i not in _HEAD_GROUPS_ONLY)
             or (bs is not None and i not in _DEFAULT_BLOCKS_ONLY)]


@pytest.mark.parametrize("case, block_sizes", EDGE_RUNS)
def test_edge_cases_match_reference(case, block_sizes):
    _check_case(DilatedCase(*case), block_sizes, seed=case[1])


# (EDGE_CASES[2], grouped mode, lowers to the very program of its BlockSizes(4, 8) run in
# test_edge_cases_match_reference, same inputs: not repeated here.)
@pytest.mark.parametrize("case", [EDGE_CASES[i] for i in (0, 1, 9)])
def test_head_groups_match_reference(case):
    """Forward steps over head groups (2 query heads each; a kv head's query heads stay
    together, so MQA groups hold all of them) give the reference, forward and gradients."""
    _check_case(DilatedCase(*case), BlockSizes(4, 8, 8, 4, heads_per_step=2), seed=case[1])


@pytest.mark.parametrize("field", ["block_q", "block_k", "block_k_dkv", "heads_per_step"])
@pytest.mark.parametrize("value", [0, -2, 2.0, True])
def test_block_sizes_rejects_non_positive_ints(field, value):
    with pytest.raises(ValueError, match=f"BlockSizes.{field} must be a positive int"):
        BlockSizes(**{field: value})


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


# Each geometry once, causal and non-causal both run (each pair compiles its own programs).
@pytest.mark.parametrize(
    "n,h,ws,rs,causal",
    [(48, 6, (8, 16, 24), (1, 2, 4), False), (64, 4, (16, 32), (2, 4), True),
     (36, 3, (6, 12, 36), (1, 2, 3), True)],
)
def test_grouped_reproduces_dilated_attention_pytorch(n, h, ws, rs, causal):
    q, k, v, _ = make_inputs(2, n, h, h, 16, seed=3)
    expected = _numpy_pytorch_grouped(q, k, v, ws, rs, causal)
    impls = ("xla", "reference")
    outs = jax.jit(lambda q, k, v: [dilax.dilated_attention(  # both in one program
        q, k, v, ws, rs, mode="grouped", is_causal=causal, implementation=impl,
        block_sizes=None) for impl in impls])(q, k, v)
    for impl, out in zip(impls, outs):
        assert_scaled_close(out, expected, err_msg=impl)


def test_mixture_is_lse_weighted_branch_combination():
    """Mixture mode equals the LongNet Eq. 10 combination of per-branch softmax outputs."""
    n, h, d = 24, 2, 8
    ws, rs = (8, 12), (2, 3)
    q, k, v, _ = make_inputs(1, n, h, h, d, seed=5)
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
    assert_scaled_close(out[0], expected)


def test_unselected_queries_give_zero_and_finite_grads():
    # One branch with r=3: two thirds of the positions of every head are never selected.
    q, k, v, _ = make_inputs(1, 10, 2, 1, 8)
    impls = ("xla", "reference")

    def loss(q, k, v, impl):
        out = dilax.dilated_attention(q, k, v, segment_lengths=(6,), dilation_rates=(3,),
                                      is_causal=True, implementation=impl)
        return jnp.sum(out**2), out

    # the outputs and the gradients of sum(out ** 2) of both implementations, in one program
    both = jax.jit(lambda q, k, v: [jax.value_and_grad(
        functools.partial(loss, impl=impl), argnums=(0, 1, 2), has_aux=True)(q, k, v)
        for impl in impls])(q, k, v)
    for (_, out), grads in both:
        sel = np.zeros((10, 2), bool)
        for j in range(2):
            sel[j % 3 :: 3, j] = True
        assert np.all(np.asarray(out)[0][~sel] == 0)
        assert np.all(np.abs(np.asarray(out)[0][sel]).sum(-1) > 0)
        for g in grads:
            assert np.isfinite(np.asarray(g)).all()
        # Unselected queries receive no gradient.
        assert np.all(np.asarray(grads[0])[0][~sel] == 0)


def test_core_fully_masked_rows_are_zero_without_nan():
    q = jnp.ones((1, 8, 1, 2, 4))
    k = jnp.ones((1, 8, 1, 4)).at[:, 3].set(jnp.nan)  # NaN beyond kv_len must never leak
    v = jnp.ones((1, 8, 1, 4)).at[:, 3].set(jnp.inf)
    kv_len = jnp.array([[3]])
    plain = lambda q: dilax.attention_core(  # noqa: E731
        q, k, v, scale=0.5, kv_len=kv_len, block_sizes=BlockSizes(2, 2))
    # k_offset pushes every key into the future of the first queries: those rows are empty.
    shifted = lambda q: dilax.attention_core(  # noqa: E731
        q, k, v, scale=0.5, is_causal=True, kv_len=kv_len, k_offset=5,
        block_sizes=BlockSizes(2, 2))
    # (Both forwards and the gradient of sum(shifted out) w.r.t. q in one program.)
    (out, _), (shifted_out, lse), g = jax.jit(lambda q: (plain(q), shifted(q), jax.grad(
        lambda q: jnp.sum(shifted(q)[0]))(q)))(q)
    # A softmax-weighted mean of ones: 1 up to the rounding of the normalization (a few ulps,
    # depending on the kernel's order of summation), hence FP32 rather than exact.
    assert_scaled_close(out, np.ones(out.shape))
    out = shifted_out
    assert np.all(np.asarray(out)[0, :5] == 0) and np.all(np.isneginf(np.asarray(lse)[0, :5]))
    assert_scaled_close(np.asarray(out)[0, 5:], np.ones(out[0, 5:].shape))
    assert np.isfinite(np.asarray(g)).all() and np.all(np.asarray(g)[0, :5] == 0)


def test_core_lse_gradient_matches_oracle():
    """The custom_vjp takes a cotangent on lse (used by the mixture merge and by ring):
    out, lse and d{q,k,v} under cotangents on both, against the float64 oracle."""
    q, k, v, dout = make_inputs(2, 13, 4, 2, 8)
    dlse = jax.random.normal(jax.random.PRNGKey(9), (2, 13, 4))
    grouped = lambda x: x.reshape(2, 13, 2, 2, *x.shape[3:])  # noqa: E731 (head c*2+g)

    @jax.jit
    def core_vjp(q, k, v, dout, dlse):
        fwd = lambda q, k, v: dilax.attention_core(  # noqa: E731
            q, k, v, scale=0.3, block_sizes=BlockSizes(4, 4))
        (out, lse), vjp = jax.vjp(fwd, grouped(q), k, v)
        return out, lse, vjp((grouped(dout), grouped(dlse)))

    out, lse, (dq, dk, dv) = core_vjp(q, k, v, dout, dlse)
    ref = attention_oracle(q, k, v, 1.0, 0.3, dout, dlse)
    assert_scaled_close(out.reshape(q.shape), ref.out, err_msg="out")
    assert_scaled_close(lse.reshape(ref.lse.shape), ref.lse, err_msg="lse")
    for name, a, b in zip(("dq", "dk", "dv"), (dq.reshape(q.shape), dk, dv), ref[2:]):
        assert_scaled_close(a, b, err_msg=name)


def test_works_under_jit_vmap_and_checkpoint():
    """The public function traced under jit, vmap (a per-example call), grad and grad of a
    checkpointed loss, all in one jitted program, against the oracle."""
    q, k, v, g = make_inputs(2, 33, 4, 2, 8)
    ws, rs = (8, 16), (1, 2)
    ref = dilated_oracle(q, k, v, ws, rs, is_causal=True, dout=g)

    def attend(q, k, v):
        return dilax.dilated_attention(q, k, v, segment_lengths=ws, dilation_rates=rs,
                                       is_causal=True)

    def loss(q, k, v):
        return jnp.sum(attend(q, k, v) * g)

    @jax.jit
    def run(q, k, v):
        # the output and the plain gradients (those of sum(out * g)) from one vjp
        out, vjp = jax.vjp(attend, q, k, v)
        vmapped = jax.vmap(lambda q, k, v: dilax.dilated_attention(
            q[None], k[None], v[None], ws, rs, is_causal=True)[0])(q, k, v)
        return (out, vmapped, vjp(g), jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2))(q, k, v))

    out, vmapped, g_plain, g_remat = run(q, k, v)
    assert_scaled_close(out, ref.out)
    assert_scaled_close(vmapped, ref.out)
    for name, plain, remat, want in zip("qkv", g_plain, g_remat, ref[2:]):
        # Rematerialization recomputes the same forward ops: equal up to a few ulps of
        # reordering (XLA may fuse the two differently), 10x tighter than against the oracle.
        assert_scaled_close(remat, plain, FP32 / 10, err_msg=f"remat d{name}")
        assert_scaled_close(plain, want, err_msg=f"d{name}")


def test_no_gather_and_nothing_quadratic_in_hlo():
    """The XLA path dilates by reshape/slice: no gather/scatter, no (n, n) intermediate."""
    n, h, d = 512, 2, 8
    q, k, v, _ = make_inputs(1, n, h, h, d)
    f = jax.jit(lambda q, k, v: dilax.dilated_attention(q, k, v, (64, 128), (1, 2)))
    hlo = f.lower(q, k, v).compile().as_text()
    assert " gather(" not in hlo and " scatter(" not in hlo
    assert f"{n},{n}" not in hlo.replace(" ", "")


@pytest.mark.parametrize("mode", ["mixture", "grouped"])
@pytest.mark.parametrize("causal", [False, True])
def test_attended_pairs_equals_reference_mask_count(mode, causal):
    from dilax.branch.plan import attended_pairs

    for n, h, ws, rs in [(37, 5, (8, 16), (1, 2)), (50, 6, (6, 12, 24), (1, 2, 3)),
                         (19, 3, (64, 4), (4, 2))]:
        expected = dilax.dilated_counts(n, h, ws, rs, mode, causal).sum()
        assert attended_pairs(n, h, ws, rs, mode, causal) == expected


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_backward_bits_and_widened_reads_match(dtype, monkeypatch):
    """The backward reads half-precision inputs as uint16 bits when float32 copies of them
    would be large (``dilax.core.xla._WIDEN_LIMIT``; a million-token step) and lets XLA widen
    them otherwise: both reads against the oracle, in the input dtype (the widened one is what
    this case runs at the default limit; for bfloat16 it is only lowered here, its values being
    the bf16 sweep's). Last in this file: it clears jit caches."""
    from dilax.core import xla as core_xla

    case = DilatedCase(1, 48, 4, 2, 16, (8, 16), (1, 2), "mixture", True, dtype)
    q, k, v, dout = make_inputs(*case[:5], dtype=jnp.dtype(dtype), seed=1)
    ref = dilated_oracle(q, k, v, case.ws, case.rs, case.mode, case.causal, dout=dout)
    bit_casts = []
    for limit in (0, 1 << 62):
        monkeypatch.setattr(core_xla, "_WIDEN_LIMIT", limit)
        jax.clear_caches()  # the core's jitted inner function was traced with the old limit
        fn = jit_vjp(functools.partial(
            dilax.dilated_attention, segment_lengths=case.ws, dilation_rates=case.rs,
            mode=case.mode, is_causal=case.causal, implementation="xla",
            block_sizes=BlockSizes(8, 8)))
        lowered = fn.lower(q, k, v, dout)
        bit_casts.append(lowered.as_text().count("xui16>"))
        if limit and dtype == "bfloat16":
            # the widened read at the default limit: its bfloat16 values are checked by
            # test_xla_matches_reference_bf16_sweep (mixture, causal, GQA, BlockSizes(4, 8))
            continue
        out, grads = lowered.compile()(q, k, v, dout)
        assert_matches_oracle(out, grads, ref, q.dtype)
    jax.clear_caches()
    # the forward reads bits either way; only the first backward does too
    assert bit_casts[0] > bit_casts[1] > 0, bit_casts
