"""dilax.nn modules and dilax.attention_fn against hand-written references (issue 4, 1-3)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from flax import nnx
from tolerance import HALF, assert_scaled_close, assert_trees_close

import dilax
from dilax.nn import DilatedAttention, MultiheadDilatedAttention
from dilax.reference import dilated_counts, masked_attention

WS, RS = (4, 16), (1, 4)  # two branches, one dilated: offsets 0..3 over the heads
# The XLA path is what users run, and the tests of module *semantics* (output, gradients,
# transforms, GQA in flax's module) use it. Tests of pure wiring (dropout placement, batch
# axes, validation) pass implementation="reference" (the dense SPEC oracle) to keep the suite
# fast on CPU: the XLA path's compile time dominates otherwise, and its equality with the
# reference is tested by the functional op's own suite.
REF = "reference"


def _randomize(module: nnx.Module, seed: int) -> None:
    """Replaces every parameter by N(0, 0.5) noise, so zero biases / unit scales hide nothing.

    NumPy draws the noise: eager jax.random calls would compile one small program per shape.
    """
    rng = np.random.default_rng(seed)
    state = nnx.state(module, nnx.Param)
    nnx.update(module, jax.tree.map(
        lambda x: jnp.asarray(0.5 * rng.standard_normal(x.shape), x.dtype), state))


def _build(ctor, seed: int = 1):
    """``ctor()`` without running its initializers (abstract init), then random parameters."""
    module = nnx.eval_shape(ctor)
    _randomize(module, seed)
    return module


def _params(module: nnx.Module) -> dict:
    return nnx.to_pure_dict(nnx.state(module, nnx.Param))


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6))
def ref_dilated(q, k, v, ws, rs, mode="mixture", is_causal=False):
    """SPEC reference: dense attention with the count matrix (grouped: divided by G)."""
    n, h, d = q.shape[1], q.shape[2], q.shape[3]
    counts = dilated_counts(n, h, ws, rs, mode, is_causal)
    out = masked_attention(q, k, v, counts, 1.0 / np.sqrt(d))
    return out / len(ws) if mode == "grouped" else out


def ref_layer_norm(x, p, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + eps) * p["scale"] + p["bias"]


@functools.partial(jax.jit, static_argnames=("num_heads", "num_kv_heads", "ws", "rs", "mode",
                                             "is_causal", "layer_norm"))
def ref_mhda(p, xq, xk, xv, *, num_heads, num_kv_heads, ws, rs, mode="mixture",
             is_causal=False, layer_norm=True):
    """Hand-written multi-head dilated attention from the parameter dict ``p``."""
    b, n, e = xq.shape
    d = e // num_heads
    lin = lambda x, q: x @ q["kernel"] + q["bias"]
    q = lin(xq, p["q_proj"]).reshape(b, n, num_heads, d)
    k = lin(xk, p["k_proj"]).reshape(b, n, num_kv_heads, d)
    v = lin(xv, p["v_proj"]).reshape(b, n, num_kv_heads, d)
    x = ref_dilated(q, k, v, ws, rs, mode, is_causal).reshape(b, n, e)
    if layer_norm:
        x = ref_layer_norm(x, p["norm"])
    return lin(x, p["out_proj"])


def _x(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


# ----------------------------------------------------------------------------- DilatedAttention


@pytest.mark.parametrize("mode,is_causal", [("mixture", True), ("grouped", False)])
def test_dilated_attention_module_matches_reference(mode, is_causal):
    q, k, v = _x(0, (2, 16, 6, 8)), _x(1, (2, 16, 3, 8)), _x(2, (2, 16, 3, 8))
    mod = DilatedAttention(WS, RS, mode=mode, is_causal=is_causal)

    @nnx.jit
    def run(mod, q, k, v):  # call-time is_causal overrides the constructor's
        return mod(q, k, v), mod(q, k, v, is_causal=not is_causal)

    out, flipped = run(mod, q, k, v)  # against the float64 oracle (nothing to compile)
    assert_scaled_close(out, oracle.dilated(q, k, v, WS, RS, mode, is_causal).out)
    assert_scaled_close(flipped, oracle.dilated(q, k, v, WS, RS, mode, not is_causal).out)


def test_dilated_attention_module_validates_at_construction():
    with pytest.raises(ValueError, match=r"segment_lengths\[1\]=6 must be divisible"):
        DilatedAttention((4, 6), (1, 4))
    with pytest.raises(ValueError, match="same length"):
        DilatedAttention((4, 8), (1,))
    with pytest.raises(ValueError, match="mode"):
        DilatedAttention((4,), (1,), mode="sum")
    with pytest.raises(ValueError, match="implementation"):
        DilatedAttention((4,), (1,), implementation="cuda")


# ----------------------------------------------------------------------------- MHDA vs reference


CASES = [
    dict(num_heads=4, num_kv_heads=2, mode="mixture", is_causal=True, layer_norm=True, impl=None),
    dict(num_heads=4, num_kv_heads=None, mode="mixture", is_causal=False, layer_norm=True,
         impl=REF),
    dict(num_heads=6, num_kv_heads=1, mode="grouped", is_causal=True, layer_norm=False, impl=REF),
    dict(num_heads=6, num_kv_heads=3, mode="grouped", is_causal=False, layer_norm=True, impl=REF),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_mhda_matches_hand_written_composition(case):
    e = 24
    hk = case["num_kv_heads"] or case["num_heads"]
    m = _build(lambda: MultiheadDilatedAttention(
        e, case["num_heads"], WS, RS, num_kv_heads=case["num_kv_heads"], mode=case["mode"],
        layer_norm=case["layer_norm"], implementation=case["impl"], rngs=nnx.Rngs(0)))
    xq, xk, xv = _x(2, (2, 16, e)), _x(3, (2, 16, e)), _x(4, (2, 16, e))
    kw = dict(num_heads=case["num_heads"], num_kv_heads=hk, ws=WS, rs=RS, mode=case["mode"],
              is_causal=case["is_causal"], layer_norm=case["layer_norm"])
    # cross-attention (distinct key and value inputs) and self-attention (key=value=query)
    cross, self_ = nnx.jit(lambda m, a, b, c: (m(a, b, c, is_causal=case["is_causal"]),
                                               m(a, is_causal=case["is_causal"])))(m, xq, xk, xv)
    assert_scaled_close(cross, ref_mhda(_params(m), xq, xk, xv, **kw))
    assert_scaled_close(self_, ref_mhda(_params(m), xq, xq, xq, **kw))


def test_mhda_implementation_passthrough():
    m = _build(lambda: MultiheadDilatedAttention(16, 4, WS, RS, implementation="reference",
                                                 rngs=nnx.Rngs(0)))
    x = _x(2, (2, 16, 16))
    ref = ref_mhda(_params(m), x, x, x, num_heads=4, num_kv_heads=4, ws=WS, rs=RS)
    assert_scaled_close(nnx.jit(lambda m, x: m(x))(m, x), ref)
    assert m.attention.implementation == "reference"


def test_mhda_validates_arguments():
    with pytest.raises(ValueError, match=r"embed_dim % num_heads.*embed_dim=10, num_heads=4"):
        MultiheadDilatedAttention(10, 4, WS, RS, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError,
                       match=r"num_heads % num_kv_heads.*num_heads=4, num_kv_heads=3"):
        MultiheadDilatedAttention(16, 4, WS, RS, num_kv_heads=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"segment_lengths\[0\]=6 must be divisible"):
        MultiheadDilatedAttention(16, 4, (6,), (4,), rngs=nnx.Rngs(0))
    m = _build(lambda: MultiheadDilatedAttention(16, 4, WS, RS, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="embed_dim=16"):
        m(jnp.zeros((1, 8, 12)))


# ----------------------------------------------------------------------------- transforms


def test_mhda_under_nnx_transforms_and_gradients():
    """nnx.jit, nnx.grad (vs the reference composition), nnx.remat, nnx.vmap over batch."""
    m = _build(lambda: MultiheadDilatedAttention(16, 4, WS, RS, num_kv_heads=2,
                                                 rngs=nnx.Rngs(0)))
    x = _x(2, (3, 16, 16))
    kw = dict(num_heads=4, num_kv_heads=2, ws=WS, rs=RS, is_causal=True)
    ct = _x(3, x.shape)

    def remat_loss(m, x):
        out = nnx.remat(lambda m, x: m(x, is_causal=True))(m, x)
        return jnp.sum(out * ct), out

    def ref_loss(p, x):
        ref = ref_mhda(p, x, x, x, **kw)
        return jnp.sum(ref * ct), ref

    # nnx.vmap over the batch: one example at a time
    per_example = nnx.vmap(lambda m, xi: m(xi[None], is_causal=True)[0], in_axes=(None, 0))

    @nnx.jit  # one program: the call, its gradients, the vmapped call and the reference's
    def run(m, x, p):
        return (nnx.value_and_grad(remat_loss, argnums=(0, 1), has_aux=True)(m, x),
                per_example(m, x),
                jax.value_and_grad(ref_loss, argnums=(0, 1), has_aux=True)(p, x))

    # nnx.grad of an nnx.remat-ed call under nnx.jit, w.r.t. every parameter and the input,
    # vs the reference composition (plain nnx.grad without remat runs in tests/test_train.py)
    ((value, out), (g_m, g_x)), mapped, ((ref_value, ref), (r_m, r_x)) = run(m, x, _params(m))
    assert_scaled_close(out, ref, err_msg="output")
    assert_scaled_close(value, ref_value, err_msg="loss")
    g_m = nnx.to_pure_dict(g_m)
    assert_trees_close(g_m, r_m, err_msg="d params")
    assert_scaled_close(g_x, r_x, err_msg="d input")
    flat = jax.tree_util.tree_flatten_with_path(g_m)[0]
    assert len(flat) == 10  # q/k/v/out kernels and biases + LayerNorm scale and bias
    for path, g in flat:
        assert np.abs(np.asarray(g)).max() > 0, f"no gradient reaches {jax.tree_util.keystr(path)}"
    # one example at a time equals the batched reference
    assert_scaled_close(mapped, ref)


# ----------------------------------------------------------------------------- dropout / dtype


def test_mhda_dropout_on_attention_output():
    m1 = _build(lambda: MultiheadDilatedAttention(16, 4, WS, RS, num_kv_heads=2, dropout=0.5,
                                                  keep_rngs=False, implementation=REF,
                                                  rngs=nnx.Rngs(0)))
    x = _x(1, (2, 16, 16))

    @nnx.jit
    def run(m1, x):
        return m1(x, deterministic=True), m1(x, deterministic=False, rngs=nnx.Rngs(dropout=7))

    (y_det, y1), (_, y2) = run(m1, x), run(m1, x)
    assert_scaled_close(y_det, ref_mhda(_params(m1), x, x, x, num_heads=4, num_kv_heads=2,
                                               ws=WS, rs=RS))
    np.testing.assert_array_equal(y1, y2)
    assert float(jnp.abs(y1 - y_det).max()) > 1e-3
    # the dropout sits before the sub-LayerNorm: reproduce it by hand with the same mask
    p = _params(m1)
    b, n, e = x.shape
    q = (x @ p["q_proj"]["kernel"] + p["q_proj"]["bias"]).reshape(b, n, 4, 4)
    k = (x @ p["k_proj"]["kernel"] + p["k_proj"]["bias"]).reshape(b, n, 2, 4)
    v = (x @ p["v_proj"]["kernel"] + p["v_proj"]["bias"]).reshape(b, n, 2, 4)
    a = ref_dilated(q, k, v, WS, RS).reshape(b, n, e)
    keep = jax.random.bernoulli(nnx.Rngs(dropout=7).dropout(), 0.5, a.shape)
    a = jnp.where(keep, a / 0.5, 0.0)
    ref = ref_layer_norm(a, p["norm"]) @ p["out_proj"]["kernel"] + p["out_proj"]["bias"]
    assert_scaled_close(y1, ref)


def test_mhda_bfloat16_compute_float32_params():
    m16 = _build(lambda: MultiheadDilatedAttention(32, 4, WS, RS, dtype=jnp.bfloat16,
                                                   rngs=nnx.Rngs(0)))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(m16, nnx.Param)))
    x = _x(1, (2, 16, 32))
    y16 = nnx.jit(lambda m, x: m(x, is_causal=True))(m16, x)
    y32 = ref_mhda(_params(m16), x, x, x, num_heads=4, num_kv_heads=4, ws=WS, rs=RS,
                   is_causal=True)
    assert y16.dtype == jnp.bfloat16
    assert_scaled_close(y16, y32, HALF)


# ----------------------------------------------------------------------------- init statistics


def test_mhda_init_statistics_xavier_normal_times_gain():
    e, h, hk, gain = 512, 8, 2, 2.5
    m = MultiheadDilatedAttention(e, h, WS, RS, num_kv_heads=hk, gamma_init=gain,
                                  rngs=nnx.Rngs(0))
    kv = hk * e // h

    def check(kernel, fan_in, fan_out, g):
        w = np.asarray(kernel)
        expected = g * np.sqrt(2.0 / (fan_in + fan_out))
        assert w.shape == (fan_in, fan_out)
        assert abs(w.std() / expected - 1) < 0.05, (w.std(), expected)
        assert abs(w.mean()) < 0.05 * expected
        # a plain normal (torch.nn.init.xavier_normal_), not a truncated one: ~4.55% of the
        # entries lie beyond two standard deviations (a 2-sigma truncation would give 0)
        tail = np.mean(np.abs(w) > 2 * expected)
        assert 0.035 < tail < 0.056, tail

    check(m.q_proj.kernel[...], e, e, 1.0)
    check(m.k_proj.kernel[...], e, kv, 1.0)
    check(m.v_proj.kernel[...], e, kv, gain)
    check(m.out_proj.kernel[...], e, e, gain)
    for lin in (m.q_proj, m.k_proj, m.v_proj, m.out_proj):
        np.testing.assert_array_equal(lin.bias[...], 0.0)
    np.testing.assert_array_equal(m.norm.scale[...], 1.0)
    np.testing.assert_array_equal(m.norm.bias[...], 0.0)


# ----------------------------------------------------------------------------- attention_fn


def _copy_into_flax_mha(src: MultiheadDilatedAttention, mha: nnx.MultiHeadAttention) -> None:
    """Copies (E, H*D) / (H*D, E) kernels of ``src`` into flax's (E, H, D) / (H, D, E) layout."""
    h, hk, d, e = src.num_heads, src.num_kv_heads, src.head_dim, src.embed_dim
    for name, lin, heads in (("query", src.q_proj, h), ("key", src.k_proj, hk),
                             ("value", src.v_proj, hk)):
        dst = getattr(mha, name)
        dst.kernel[...] = lin.kernel[...].reshape(e, heads, d)
        dst.bias[...] = lin.bias[...].reshape(heads, d)
    mha.out.kernel[...] = src.out_proj.kernel[...].reshape(h, d, e)
    mha.out.bias[...] = src.out_proj.bias[...]


@pytest.mark.parametrize("num_kv_heads,mode,is_causal,impl",
                         [(2, "mixture", True, None), (None, "mixture", False, REF),
                          (1, "grouped", True, REF)])
def test_attention_fn_in_flax_mha_equals_mhda(num_kv_heads, mode, is_causal, impl):
    """flax's MultiHeadAttention does GQA itself (num_kv_heads): K/V reach attention_fn with
    hk heads and dilax.dilated_attention handles them without repeating."""
    e, h = 32, 4
    ours = _build(lambda: MultiheadDilatedAttention(
        e, h, WS, RS, num_kv_heads=num_kv_heads, mode=mode, layer_norm=False,
        implementation=impl, rngs=nnx.Rngs(0)))
    mha = _build(lambda: nnx.MultiHeadAttention(
        h, e, num_kv_heads=num_kv_heads, decode=False, rngs=nnx.Rngs(5),
        attention_fn=dilax.attention_fn(WS, RS, mode=mode, implementation=impl)), seed=9)
    assert mha.key.kernel.shape == (e, num_kv_heads or h, e // h)
    _copy_into_flax_mha(ours, mha)
    xq, xk = _x(2, (2, 16, e)), _x(3, (2, 16, e))

    @nnx.jit
    def run(mha, ours, xq, xk):
        return (mha(xq, is_causal=is_causal), ours(xq, is_causal=is_causal),
                mha(xq, xk, is_causal=is_causal), ours(xq, xk, is_causal=is_causal))

    theirs_self, ours_self, theirs_cross, ours_cross = run(mha, ours, xq, xk)
    assert_scaled_close(theirs_self, ours_self)
    assert_scaled_close(theirs_cross, ours_cross)
    # and both equal the hand-written composition
    ref = ref_mhda(_params(ours), xq, xk, xk, num_heads=h, num_kv_heads=num_kv_heads or h,
                   ws=WS, rs=RS, mode=mode, is_causal=is_causal, layer_norm=False)
    assert_scaled_close(theirs_cross, ref)


def test_attention_fn_factory_is_causal():
    mha = _build(lambda: nnx.MultiHeadAttention(
        4, 16, num_kv_heads=2, decode=False, rngs=nnx.Rngs(0),
        attention_fn=dilax.attention_fn(WS, RS, is_causal=True, implementation=REF)))
    x = _x(2, (2, 16, 16))
    p = nnx.to_pure_dict(nnx.state(mha, nnx.Param))
    q = jnp.einsum("bne,ehd->bnhd", x, p["query"]["kernel"]) + p["query"]["bias"]
    k = jnp.einsum("bne,ehd->bnhd", x, p["key"]["kernel"]) + p["key"]["bias"]
    v = jnp.einsum("bne,ehd->bnhd", x, p["value"]["kernel"]) + p["value"]["bias"]
    a = ref_dilated(q, k, v, WS, RS, is_causal=True)
    ref = jnp.einsum("bnhd,hde->bne", a, p["out"]["kernel"]) + p["out"]["bias"]
    assert_scaled_close(nnx.jit(lambda m, x: m(x))(mha, x), ref)


def test_attention_fn_batch_axes_and_dtype():
    fn = dilax.attention_fn(WS, RS, implementation=REF)
    q, k, v = _x(0, (2, 3, 16, 4, 8)), _x(1, (2, 3, 16, 2, 8)), _x(2, (2, 3, 16, 2, 8))

    @jax.jit
    def run(q, k, v):
        return (fn(q, k, v), fn(q[0, 0], k[0, 0], v[0, 0]), fn(q, k, v, dtype=jnp.bfloat16),
                fn(q, k, v, dropout_rate=0.1, deterministic=True))

    out, unbatched, out16, det = run(q, k, v)
    ref = ref_dilated(q.reshape(6, 16, 4, 8), k.reshape(6, 16, 2, 8), v.reshape(6, 16, 2, 8),
                      WS, RS)
    assert_scaled_close(out, ref.reshape(out.shape))
    assert_scaled_close(unbatched, ref[0])  # no batch axis at all
    assert out16.dtype == jnp.bfloat16
    assert_scaled_close(out16, out, HALF)
    np.testing.assert_array_equal(det, out)  # dropout_rate > 0 is fine when deterministic


def test_attention_fn_refuses_what_it_cannot_do():
    fn = dilax.attention_fn(WS, RS)
    q = _x(0, (1, 16, 2, 8))
    with pytest.raises(ValueError, match="supports only a key-padding `mask`"):
        fn(q, q, q, mask=jnp.ones((1, 2, 16, 16), bool))
    with pytest.raises(ValueError, match="bias"):
        fn(q, q, q, bias=jnp.zeros((1, 2, 16, 16)))
    with pytest.raises(ValueError, match="attention-weight dropout"):
        fn(q, q, q, dropout_rate=0.1, deterministic=False, dropout_rng=jax.random.key(0))
    with pytest.raises(ValueError, match="KV cache"):
        fn(q[:, :1], q, q)
    with pytest.raises(TypeError, match="unknown option"):
        dilax.attention_fn(WS, RS, causal=True)
    with pytest.raises(ValueError, match=r"segment_lengths\[0\]=6 must be divisible"):
        dilax.attention_fn((6,), (4,))
    # through the flax module: a query-dependent mask and attention dropout are refused
    mha = _build(lambda: nnx.MultiHeadAttention(2, 16, decode=False, rngs=nnx.Rngs(0),
                                                attention_fn=dilax.attention_fn(WS, RS)))
    x = _x(1, (1, 16, 16))
    with pytest.raises(ValueError, match="supports only a key-padding `mask`"):
        mha(x, mask=jnp.ones((1, 2, 16, 16), bool))
    mha_drop = _build(lambda: nnx.MultiHeadAttention(
        2, 16, decode=False, dropout_rate=0.1, keep_rngs=False, rngs=nnx.Rngs(0),
        attention_fn=dilax.attention_fn(WS, RS)))
    with pytest.raises(ValueError, match="attention-weight dropout"):
        mha_drop(x, deterministic=False, rngs=nnx.Rngs(dropout=0))
