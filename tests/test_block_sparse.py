"""Block-sparse attention: XLA path against the dense reference with the expanded mask.

Compilation dominates on CPU, so most cases share compiled programs: the XLA path is
``plan_pattern`` (static NumPy tables) + ``attend_tables`` (the jitted gather + core); the
sweep feeds each pattern's own plan through one jitted ``attend_tables`` per head layout, and
the reference takes its token mask as an argument. A handful of tests then go through the
public ``block_sparse_attention`` end to end.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerance import FP32, HALF, assert_scaled_close

import dilax
from dilax import patterns as P
from dilax.block_sparse import api as BS
from dilax.block_sparse import content_adaptive as CA
from dilax.block_sparse import tables as BT
from dilax.nn import BlockSparseAttention, BlockSparseMultiheadAttention
from dilax.reference import masked_attention

B, N, D, BSZ = 2, 60, 8, 8  # n = 60 -> 8 blocks, the last one partial
NB = -(-N // BSZ)
SCALE = 1 / np.sqrt(D)


def inputs(h, hk, n=N, seed=0, dtype=jnp.float32):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(ks[0], (B, n, h, D), dtype)
    k = jax.random.normal(ks[1], (B, n, hk, D), dtype)
    v = jax.random.normal(ks[2], (B, n, hk, D), dtype)
    cot = jax.random.normal(ks[3], (B, n, h, D), dtype)
    return q, k, v, cot


@jax.jit
def reference_vjp(q, k, v, mask, cot):
    out, vjp = jax.vjp(lambda q, k, v: masked_attention(q, k, v, mask, SCALE), q, k, v)
    return out, vjp(cot)


@functools.cache
def xla_vjp_fn(U, G, kvmap, causal):
    def f(q, k, v, idx, kv_len, diag_len, cot, lengths):
        def fwd(q, k, v):
            return BS.attend_tables(q, k, v, idx, kv_len, diag_len if causal else None,
                                    block_size=BSZ, U=U, G=G, kvmap=kvmap, scale=SCALE,
                                    **lengths)[0]

        out, vjp = jax.vjp(fwd, q, k, v)
        return out, vjp(cot)

    return jax.jit(f)


def xla_vjp_via_plan(pattern, q, k, v, cot, causal, lengths=None):
    """The XLA path's plan, padded to A = NB slots so all patterns share one compile;
    ``lengths``: traced ``(q_len, kv_len)``, as ``block_sparse_attention`` passes them."""
    h, hk = q.shape[2], k.shape[2]
    plan = BS.plan_pattern(pattern, q.shape[1], h, hk, causal)
    idx = np.zeros(plan.idx.shape[:3] + (NB,), np.int32)
    idx[..., : plan.idx.shape[-1]] = plan.idx
    diag = plan.diag_len if causal else np.zeros_like(plan.kv_len)
    fn = xla_vjp_fn(plan.U, plan.G, plan.kvmap, causal)
    kw = {} if lengths is None else dict(query_seq_lengths=jnp.asarray(lengths[0]),
                                         key_value_seq_lengths=jnp.asarray(lengths[1]))
    return fn(q, k, v, idx, plan.kv_len, diag, cot, kw)


def valid_mask(q_len, kv_len, n=N):
    """``(b, 1, n, n)``: query ``p < q_len[i]`` and key ``t < kv_len[i]`` (NumPy)."""
    pos = np.arange(n)
    return ((pos[:, None] < np.asarray(q_len)[:, None, None, None])
            & (pos < np.asarray(kv_len)[:, None, None, None])).astype(np.float32)


def assert_close(got, want, tol=FP32):
    """``(out, (dq, dk, dv))`` pairs, each to ``tol`` of its magnitude (``tests/tolerance.py``)."""
    (o1, g1), (o2, g2) = got, want
    for name, a, b in zip(("out", "dq", "dk", "dv"), (o1, *g1), (o2, *g2), strict=True):
        assert_scaled_close(a, b, tol, err_msg=name)


def check(pattern, h, hk, causal, n=N, seed=0, lengths=None):
    q, k, v, cot = inputs(h, hk, n, seed)
    mask = pattern.expanded_mask(n, causal).astype(np.float32) * (
        1 if lengths is None else valid_mask(*lengths, n))
    assert_close(xla_vjp_via_plan(pattern, q, k, v, cot, causal, lengths),
                 reference_vjp(q, k, v, mask, cot))


GQA = (4, 2)
PATTERNS = {
    "local_window": P.local_window(N, BSZ, 9),
    "dilated": P.dilated(N, BSZ, (3, 4)),
    "global_local": P.global_local(N, BSZ, 5, 4),
    "hierarchical": P.hierarchical(N, ((8, 0), (16, 1), (32, 1))),
    "random": P.random(N, BSZ, 0.3, seed=1),
    "from_mask": P.from_mask(np.tril(np.ones((NB, NB), bool))[::-1], BSZ),
    "dilated_segments": P.dilated_segments(N, BSZ, (16, 32), (2, 4)),
    "combined": (P.local_window(N, BSZ, 0) | P.dilated(N, BSZ, (5,))) & P.random(N, BSZ, .7),
}
LENGTHS = (np.array([N, 29]), np.array([43, N]))  # inside blocks, and the full row


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_every_pattern_shared_gqa(name, causal):
    """Every pattern through the XLA path's tables with traced valid lengths (both skip key
    slots past ``kv_len`` and zero the rows past ``q_len``) on a partial last block."""
    check(PATTERNS[name], *GQA, causal, lengths=LENGTHS)


PER_HEAD = {
    # differs inside GQA groups: every query head gathers its own blocks
    "random_per_head": P.random(N, BSZ, 0.35, seed=2, num_heads=4),
    "dilated_segments_per_head": P.dilated_segments(N, BSZ, (8, 16, 24, 32), (1, 2, 3, 4),
                                                    num_heads=4, mode="grouped"),
    # identical inside each GQA group: gathered once per kv head
    "grouped_per_head": P.from_mask(np.repeat(P.random(N, BSZ, .4, 5, num_heads=2).block_mask,
                                              2, axis=0), BSZ),
}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", sorted(PER_HEAD))
def test_per_head_patterns(name, causal):
    pattern = PER_HEAD[name]
    layout = BS.plan_pattern(pattern, N, *GQA, causal)
    assert (layout.U, layout.G) == ((2, 2) if name == "grouped_per_head" else (4, 1))
    check(pattern, *GQA, causal)


@settings(max_examples=30, deadline=None)
@given(
    layout=st.sampled_from([(4, 2, 1), (4, 2, 4)]),
    p=st.floats(0.0, 1.0),
    empty_rows=st.integers(0, 4),
    empty_head=st.booleans(),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_masks_hypothesis(layout, p, empty_rows, empty_head, causal, seed):
    h, hk, hp = layout
    rng = np.random.default_rng(seed)
    mask = rng.random((hp, NB, NB)) < p
    for _ in range(empty_rows):
        mask[rng.integers(hp), rng.integers(NB)] = False
    if empty_head:
        mask[rng.integers(hp)] = False
    check(P.from_mask(mask, BSZ), h, hk, causal, seed=seed % 7)


# -- the public op end to end -------------------------------------------------------------


def public_vjp(pattern, q, k, v, cot, causal, impl):
    fwd = functools.partial(dilax.block_sparse_attention, pattern=pattern, is_causal=causal,
                            implementation=impl)
    out, vjp = jax.vjp(fwd, q, k, v)
    return out, vjp(cot)


def test_public_op_shared_gqa_whole_blocks():
    pattern = P.local_window(64, 16, 20)
    q, k, v, cot = inputs(4, 2, n=64)
    got = jax.jit(functools.partial(public_vjp, pattern, causal=False, impl="xla"))(q, k, v, cot)
    assert_close(got, public_vjp(pattern, q, k, v, cot, False, "reference"))


def test_public_op_per_head_empty_rows_and_heads_zero_with_zero_gradient():
    mask = np.array(P.random(N, BSZ, 0.5, seed=3, num_heads=4).block_mask)
    mask[1] = False  # an empty head
    mask[0, 2] = False  # an empty query block
    mask[2, 0] = False
    pattern = P.from_mask(mask, BSZ)
    q, k, v, cot = inputs(4, 4)
    out, (dq, dk, dv) = jax.jit(functools.partial(public_vjp, pattern, causal=True,
                                                  impl="xla"))(q, k, v, cot)
    for x in (out, dq, dk, dv):
        assert np.isfinite(np.asarray(x)).all()
    assert not np.asarray(out[:, :, 1]).any() and not np.asarray(dq[:, :, 1]).any()
    assert not np.asarray(dk[:, :, 1]).any() and not np.asarray(dv[:, :, 1]).any()
    assert not np.asarray(out[:, 16:24, 0]).any() and not np.asarray(dq[:, 16:24, 0]).any()
    assert_close((out, (dq, dk, dv)), public_vjp(pattern, q, k, v, cot, True, "reference"))


def test_all_empty_pattern_gives_zeros():
    q, k, v, cot = inputs(2, 2)
    pattern = P.from_mask(np.zeros((NB, NB), bool), BSZ)
    out, grads = public_vjp(pattern, q, k, v, cot, True, "xla")
    assert not np.asarray(out).any() and all(not np.asarray(g).any() for g in grads)


def test_public_op_mqa_row_chunked_partial_last_block(monkeypatch):
    """Few rows per lax.map step (as at long n), MQA, the partial last block gathered."""
    monkeypatch.setattr(BT, "_ROW_BUDGET_BYTES", 1)
    pattern = P.global_local(N, BSZ, 3, 0) | P.from_mask(np.eye(NB, dtype=bool)[::-1], BSZ)
    q, k, v, cot = inputs(3, 1)
    assert BT.rows_per_step(NB, B, 3, BSZ, 1, D, 4) == 1
    got = jax.jit(functools.partial(public_vjp, pattern, causal=False, impl="xla"))(q, k, v, cot)
    assert_close(got, public_vjp(pattern, q, k, v, cot, False, "reference"))


def test_bf16_matches_reference():
    q, k, v, _ = inputs(4, 2, dtype=jnp.bfloat16)
    pattern = P.local_window(N, BSZ, 12)
    out = jax.jit(functools.partial(dilax.block_sparse_attention, pattern=pattern,
                                    is_causal=True))(q, k, v)
    assert out.dtype == jnp.bfloat16
    ref = masked_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                           pattern.expanded_mask(N, True).astype(np.float32), SCALE)
    assert_scaled_close(out, ref, HALF)


def test_memory_scales_with_active_blocks_not_n_squared():
    """Compiled (not run) at n = 4096: temporaries are the gathered active blocks of one
    lax.map step (linear in the busiest row's count) plus O(n) state, below one dense score
    matrix."""
    n, h, d, bs = 4096, 4, 32, 128
    q = jax.ShapeDtypeStruct((1, n, h, d), jnp.float32)
    io_bytes = 4 * n * h * d * 4
    scores = n * n * h * 4

    def memory(density):
        pattern = P.random(n, bs, density, seed=0)
        fn = functools.partial(dilax.block_sparse_attention, pattern=pattern)
        temp = jax.jit(fn).lower(q, q, q).compile().memory_analysis().temp_size_in_bytes
        max_active = pattern.tables()[0].shape[-1]
        rows = BT.rows_per_step(n // bs, 1, max_active, bs, h, d, 4)  # per lax.map step
        gathered = 2 * rows * max_active * bs * h * d * 4  # K and V blocks, f32
        return temp, gathered

    (low, g_low), (high, g_high) = memory(0.02), memory(0.5)
    assert low <= g_low + 3 * io_bytes and high <= g_high + 3 * io_bytes
    # The growth with density is the growth of the gathered blocks, nothing n^2.
    assert 0.5 * (g_high - g_low) <= high - low <= 1.5 * (g_high - g_low)
    assert high < scores


# -- content-adaptive ---------------------------------------------------------------------


def selection_mask(q, k, bs, top_k, causal):
    idx, cnt = jax.jit(lambda q, k: CA.content_adaptive_selection(  # one program, not eager
        q, k, bs, top_k, is_causal=causal))(q, k)
    idx, cnt = np.asarray(idx), np.asarray(cnt)
    b, n, h, _ = q.shape
    hk, nb = k.shape[2], -(-n // bs)
    blocks = np.zeros((b, hk, nb, nb), bool)
    for bi, c, i in np.ndindex(b, hk, nb):
        blocks[bi, c, i, idx[bi, c, i, : cnt[bi, c, i]]] = True
    blocks = np.repeat(blocks, h // hk, axis=1)
    pos = np.arange(n) // bs
    mask = blocks[:, :, pos][:, :, :, pos]
    if causal:
        mask &= np.tril(np.ones((n, n), bool))
    return mask.astype(np.float32), idx, cnt


@pytest.mark.parametrize("causal,top_k", [(False, 3), (True, 3)])
def test_content_adaptive_matches_reference_on_its_selection(causal, top_k):
    q, k, v, cot = inputs(4, 2)
    mask, idx, cnt = selection_mask(q, k, BSZ, top_k, causal)
    # Selection format: the diagonal is always kept, future blocks never, ascending order.
    rows = np.arange(NB)
    assert (idx == rows[None, None, :, None]).any(-1).all()
    if causal:
        np.testing.assert_array_equal(cnt, np.broadcast_to(np.minimum(rows + 1, top_k),
                                                           cnt.shape))
        assert (idx <= rows[None, None, :, None]).all()
    else:
        assert (cnt == top_k).all()
    assert (np.diff(idx, axis=-1) >= 0).all()
    fwd = functools.partial(dilax.content_adaptive_attention, block_size=BSZ, top_k=top_k,
                            is_causal=causal)

    @jax.jit
    def run(q, k, v, cot):
        out, vjp = jax.vjp(fwd, q, k, v)
        return out, vjp(cot)

    assert_close(run(q, k, v, cot), reference_vjp(q, k, v, mask, cot))


def test_content_adaptive_trains_on_planted_blocks():
    """Block i's queries carry a random signature that only block pi(i)'s keys repeat, and
    the target is block pi(i)'s payload: learned q/k projections must find pi(i)."""
    nb, bs, sig, pay, top_k, dk = 8, 4, 8, 8, 3, 16
    n, dim = nb * bs, 2 * sig + pay

    def batch(key, size):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        s = jax.random.normal(k1, (size, nb, sig))
        perm = jax.vmap(lambda kk: jax.random.permutation(kk, nb))(jax.random.split(k2, size))
        nxt = jnp.take_along_axis(perm, (jnp.argsort(perm, axis=1) + 1) % nb, axis=1)
        inv = jnp.argsort(nxt, axis=1)  # pi = nxt (a cycle: pi(i) != i)
        payload = jax.random.normal(k3, (size, nb, pay))
        blocks = jnp.concatenate([s, jnp.take_along_axis(s, inv[..., None], axis=1), payload],
                                 -1)
        x = jnp.repeat(blocks, bs, axis=1) + 0.1 * jax.random.normal(k4, (size, n, dim))
        target = jnp.repeat(jnp.take_along_axis(payload, nxt[..., None], axis=1), bs, axis=1)
        return x, target, nxt

    def qkv(params, x):
        v = jnp.pad(x[..., 2 * sig:], ((0, 0), (0, 0), (0, dk - pay)))
        return (x @ params["wq"])[:, :, None], (x @ params["wk"])[:, :, None], v[:, :, None]

    def loss_fn(params, x, target):
        out = dilax.content_adaptive_attention(*qkv(params, x), bs, top_k)
        return jnp.mean((out[:, :, 0, :pay] - target) ** 2)

    @jax.jit
    def evaluate(params, key):
        x, target, nxt = batch(key, 64)
        q, k, _ = qkv(params, x)
        idx, _ = CA.content_adaptive_selection(q, k, bs, top_k)
        hit = (idx[:, 0] == nxt[..., None]).any(-1)
        return hit.mean(), loss_fn(params, x, target)

    def accuracy(params, key):
        return tuple(float(x) for x in evaluate(params, key))

    import optax

    init = jax.random.split(jax.random.PRNGKey(1), 2)
    params = {"wq": 0.3 * jax.random.normal(init[0], (dim, dk)),
              "wk": 0.3 * jax.random.normal(init[1], (dim, dk))}
    opt = optax.adam(0.03)
    state = opt.init(params)

    @jax.jit
    def step(params, state, key):
        x, target, _ = batch(key, 16)
        loss, grads = jax.value_and_grad(loss_fn)(params, x, target)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    held_out = jax.random.PRNGKey(99)
    acc0, loss0 = accuracy(params, held_out)
    for i in range(60):
        params, state, _ = step(params, state, jax.random.PRNGKey(1000 + i))
    acc1, loss1 = accuracy(params, held_out)
    assert acc0 < 0.6, acc0  # the selection starts near chance (2 of 7 other blocks)
    assert acc1 >= 0.95, acc1  # and ends on the planted blocks
    assert loss1 < 0.25 * loss0, (loss0, loss1)


# -- modules ------------------------------------------------------------------------------


def test_multihead_module_matches_numpy_composition_and_trains():
    embed, h, hk, n = 32, 4, 2, 64
    pattern = P.random(n, 16, 0.5, seed=4, num_heads=4)
    m = BlockSparseMultiheadAttention(embed, h, pattern, num_kv_heads=hk, gamma_init=0.7,
                                      rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(5), (2, n, embed))
    graphdef, params = nnx.split(m, nnx.Param)

    @jax.jit
    def run(params, x):
        def loss(p):
            y = nnx.merge(graphdef, p)(x)
            return jnp.sum(y ** 2), y

        return jax.grad(loss, has_aux=True)(params)

    grads, out = run(params, x)

    # Independent composition: NumPy projections, reference attention, NumPy LayerNorm.
    def lin(layer, z):
        return np.asarray(z) @ np.asarray(layer.kernel[...]) + np.asarray(layer.bias[...])

    xs = np.asarray(x)
    q = lin(m.q_proj, xs).reshape(2, n, h, 8)
    k = lin(m.k_proj, xs).reshape(2, n, hk, 8)
    v = lin(m.v_proj, xs).reshape(2, n, hk, 8)
    att = np.asarray(masked_attention(q, k, v, pattern.expanded_mask(n).astype(np.float32),
                                      1 / np.sqrt(8))).reshape(2, n, embed)
    mu, var = att.mean(-1, keepdims=True), att.var(-1, keepdims=True)
    normed = (att - mu) / np.sqrt(var + 1e-5) * np.asarray(m.norm.scale[...]) + np.asarray(
        m.norm.bias[...])
    assert_scaled_close(out, lin(m.out_proj, normed))

    leaves = jax.tree_util.tree_leaves_with_path(grads)
    assert len(leaves) == 10  # 4 kernels + 4 biases + LayerNorm scale and bias
    for path, g in leaves:
        assert np.abs(np.asarray(g)).max() > 0, path


def test_multihead_init_statistics_and_validation():
    pattern = P.local_window(64, 16, 16)
    m = BlockSparseMultiheadAttention(512, 8, pattern, num_kv_heads=2, gamma_init=0.5,
                                      rngs=nnx.Rngs(1))
    std = lambda layer: float(np.asarray(layer.kernel[...]).std())
    xavier = lambda fi, fo, gain: gain * np.sqrt(2.0 / (fi + fo))
    assert std(m.q_proj) == pytest.approx(xavier(512, 512, 1.0), rel=0.05)
    assert std(m.k_proj) == pytest.approx(xavier(512, 128, 1.0), rel=0.05)
    assert std(m.v_proj) == pytest.approx(xavier(512, 128, 0.5), rel=0.05)
    assert std(m.out_proj) == pytest.approx(xavier(512, 512, 0.5), rel=0.05)
    assert not np.asarray(m.q_proj.bias[...]).any()
    with pytest.raises(ValueError, match="divisible by num_heads"):
        BlockSparseMultiheadAttention(30, 4, pattern, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_kv_heads"):
        BlockSparseMultiheadAttention(32, 4, pattern, num_kv_heads=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="pattern has 3 heads"):
        BlockSparseMultiheadAttention(32, 4, P.random(64, 16, .5, num_heads=3), rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="pattern must be"):
        BlockSparseAttention(np.ones((4, 4)))


def test_parameter_free_module():
    pattern = P.dilated(N, BSZ, (2,))
    q, k, v, _ = inputs(4, 2)
    mod = BlockSparseAttention(pattern, is_causal=True, implementation="reference")
    for causal in (True, False):
        want = masked_attention(q, k, v, pattern.expanded_mask(N, causal).astype(np.float32),
                                SCALE)
        got = mod(q, k, v) if causal else mod(q, k, v, is_causal=False)
        assert_scaled_close(got, want)


# -- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize("pattern,fragment", [
    (P.local_window(64, 8, 8), "pattern has 8x8 blocks"),  # n = 60 -> 8 blocks: fits
    (P.local_window(128, 8, 8), "pattern has 16x16 blocks"),
    (P.random(N, BSZ, .5, num_heads=3), "pattern has 3 heads"),
])
def test_pattern_shape_errors(pattern, fragment):
    q, k, v, _ = inputs(4, 2)
    if pattern.num_q_blocks == NB and pattern.num_heads == 1:
        dilax.block_sparse_attention(q, k, v, pattern)  # ceil(60 / 8) == 8: accepted
        q, k, v = q[:, :56], k[:, :56], v[:, :56]
        fragment = "ceil(n / block_size) = 7"
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        dilax.block_sparse_attention(q, k, v, pattern)


def test_argument_errors():
    q, k, v, _ = inputs(4, 2)
    pattern = P.local_window(N, BSZ, 8)
    with pytest.raises(TypeError, match="pattern must be"):
        dilax.block_sparse_attention(q, k, v, np.ones((NB, NB), bool))
    with pytest.raises(ValueError, match="implementation"):
        dilax.block_sparse_attention(q, k, v, pattern, implementation="pallas-gpu")
    with pytest.raises(TypeError, match="is_causal"):
        dilax.block_sparse_attention(q, k, v, pattern, is_causal="yes")
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        dilax.block_sparse_attention(q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, 2),
                                     pattern)
    with pytest.raises(ValueError, match="top_k"):
        dilax.content_adaptive_attention(q, k, v, BSZ, NB + 1)
    with pytest.raises(ValueError, match="block_size"):
        dilax.content_adaptive_attention(q, k, v, 0, 1)


# -- the same pattern set through every public implementation ------------------------------


def _public_cases():
    """Each (pattern, causal) pair through one implementation, alternating: each one sees
    every pattern and both causal settings (every pair, same lengths, runs through the XLA
    path's tables in test_every_pattern_shared_gqa)."""
    return [(name, causal, ("xla", "pallas-interpret")[(i + causal) % 2])
            for i, name in enumerate(sorted(PATTERNS)) for causal in (False, True)]


@pytest.mark.parametrize("name,causal,impl", _public_cases())
def test_every_pattern_public_op_per_implementation(name, causal, impl):
    """The shared pattern set, run through ``block_sparse_attention`` end to end, with
    traced valid lengths (both paths skip key blocks past ``kv_len`` and zero the rows past
    ``q_len``) on a partial last block. One program per pattern: the lengths are data."""
    pattern = PATTERNS[name]
    q, k, v, cot = inputs(*GQA)
    kwargs = dict(implementation="pallas", interpret=True) if impl == "pallas-interpret" else \
        dict(implementation=impl)
    fwd = functools.partial(dilax.block_sparse_attention, pattern=pattern, is_causal=causal,
                            **kwargs)

    @jax.jit  # one program for forward and backward
    def run(q, k, v, cot, q_len, kv_len):
        out, vjp = jax.vjp(lambda q, k, v: fwd(q, k, v, query_seq_lengths=q_len,
                                               key_value_seq_lengths=kv_len), q, k, v)
        return out, vjp(cot)

    q_len, kv_len = LENGTHS
    mask = pattern.expanded_mask(N, causal).astype(np.float32)[None] * valid_mask(q_len, kv_len)
    assert_close(run(q, k, v, cot, jnp.asarray(q_len), jnp.asarray(kv_len)),
                 reference_vjp(q, k, v, mask, cot))
