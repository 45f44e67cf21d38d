"""Bad input -> ValueError/TypeError at trace time naming the argument (SPEC.md, "Errors").

The table doubles as documentation: (description, call, exception, message fragment).
The first rows cover ``dilated_attention``; the rest one row per other entry point.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dilax

Q = jnp.zeros((1, 16, 4, 8))
KV = jnp.zeros((1, 16, 2, 8))


def call(q=Q, k=KV, v=KV, ws=(8,), rs=(2,), **kw):
    return lambda: dilax.dilated_attention(q, k, v, ws, rs, **kw)


def call_bs(q=Q, k=KV, v=None, pattern=None, **kw):
    v = k if v is None else v
    return lambda: dilax.block_sparse_attention(q, k, v, pattern or PATTERN, **kw)


ERROR_TABLE = [
    ("list lengths differ", call(ws=(4, 8), rs=(1,)), ValueError,
     "segment_lengths and dilation_rates must have the same length"),
    ("empty configuration", call(ws=(), rs=()), ValueError, "at least one branch"),
    ("w % r != 0", call(ws=(6,), rs=(4,)), ValueError,
     "segment_lengths[0]=6 must be divisible by dilation_rates[0]=4"),
    ("zero segment length", call(ws=(0,), rs=(1,)), ValueError,
     "segment_lengths[0] must be positive"),
    ("negative dilation", call(ws=(8,), rs=(-2,)), ValueError,
     "dilation_rates[0] must be positive"),
    ("float segment length", call(ws=(8.0,), rs=(1,)), TypeError,
     "segment_lengths[0] must be an int"),
    ("h % hk != 0", call(k=jnp.zeros((1, 16, 3, 8)), v=jnp.zeros((1, 16, 3, 8))), ValueError,
     "h % hk == 0"),
    ("grouped with h < G", call(q=jnp.zeros((1, 16, 2, 8)), ws=(4, 8, 16), rs=(1, 2, 4),
                                mode="grouped"), ValueError, "num_heads >= len(segment_lengths)"),
    ("unknown mode", call(mode="sum"), ValueError, "mode must be one of"),
    ("rank 3 q", call(q=jnp.zeros((16, 4, 8))), ValueError, "q must have rank 4"),
    ("k/v shapes differ", call(v=jnp.zeros((1, 16, 1, 8))), ValueError,  # dv != d is fine
     "v must be (b, n, hk, dv) with k's b, n, hk"),
    ("seq_len differs", call(k=jnp.zeros((1, 8, 2, 8)), v=jnp.zeros((1, 8, 2, 8))), ValueError,
     "same seq_len"),
    ("head_dim differs", call(k=jnp.zeros((1, 16, 2, 4)), v=jnp.zeros((1, 16, 2, 4))),
     ValueError, "same head_dim"),
    ("batch differs", call(k=jnp.zeros((2, 16, 2, 8)), v=jnp.zeros((2, 16, 2, 8))), ValueError,
     "same batch size"),
    ("n = 0", call(q=jnp.zeros((1, 0, 4, 8)), k=jnp.zeros((1, 0, 2, 8)),
                   v=jnp.zeros((1, 0, 2, 8))), ValueError, "seq_len must be >= 1"),
    ("mixed dtypes", call(k=KV.astype(jnp.bfloat16), v=KV.astype(jnp.bfloat16)), TypeError,
     "same dtype"),
    ("integer inputs", call(q=jnp.zeros((1, 16, 4, 8), jnp.int32)), TypeError,
     "q must have a floating dtype"),
    ("bad scale", call(scale=-1.0), ValueError, "scale must be a finite positive float"),
    ("bad implementation", call(implementation="cuda"), ValueError,
     "implementation must be one of"),
    ("non-bool causal", call(is_causal="yes"), TypeError, "is_causal must be a bool"),
]


BIG = jax.ShapeDtypeStruct((1, 2**31, 8, 64), jnp.float32)  # 4 TiB per tensor, never allocated
PATTERN = dilax.patterns.local_window(16, 4, 4)


def _eval(fn, *args):
    return lambda: jax.eval_shape(fn, *args)


def _mesh():
    from jax.sharding import AxisType, Mesh

    return Mesh(np.array(jax.devices()[:2]), ("sp",), axis_types=(AxisType.Auto,))


def _cli(*flags):
    from dilax import train

    base = ["--d-model", "32", "--num-heads", "2", "--segment-lengths", "16,32",
            "--dilation-rates", "1,2", "--seq-len", "32"]
    return lambda: train.configs_from_argv(base + list(flags))


# Every other public entry point: same contract (see tests/test_fuzz_*.py for the fuzz).
ERROR_TABLE += [
    ("huge n fails fast from the shapes", _eval(
        lambda q: dilax.dilated_attention(q, q, q, (2048,), (1,)), BIG), ValueError,
     "would need about 16.06 TiB (at least), this machine has"),
    ("block mask of the wrong shape", call_bs(q=jnp.zeros((1, 20, 4, 8)),
                                              k=jnp.zeros((1, 20, 2, 8))), ValueError,
     "pattern has 4x4 blocks of block_size 4, but q/k have seq_len n=20"),
    ("pattern heads != h", lambda: dilax.block_sparse_attention(
        Q, KV, KV, dilax.patterns.random(16, 4, 0.5, num_heads=3)), ValueError,
     "pattern has 3 heads"),
    ("pallas block-sparse with a block size not a power of two", lambda:
     dilax.block_sparse_attention(
        jnp.zeros((1, 18, 4, 8)), jnp.zeros((1, 18, 2, 8)), jnp.zeros((1, 18, 2, 8)),
        dilax.patterns.local_window(18, 6, 6), implementation="pallas", interpret=True),
     ValueError, "needs pattern.block_size to be a power of two (Triton tiles), got "
                 "block_size=6"),
    ("content-adaptive top_k too large", lambda: dilax.content_adaptive_attention(
        Q, KV, KV, 4, 5), ValueError, "top_k must be in [1, ceil(n / block_size)] = [1, 4]"),
    ("pattern too large to build", lambda: dilax.patterns.local_window(2**40, 1, 4),
     ValueError, "a block pattern for n=1099511627776 with block_size=1"),
    ("from_mask of rank 4", lambda: dilax.patterns.from_mask(np.ones((1, 1, 2, 2)), 4),
     ValueError, "block_mask must have shape (nq, nk) or (heads, nq, nk)"),
    ("ring: n not divisible by devices", lambda: dilax.sharded_dilated_attention(
        jnp.zeros((1, 15, 4, 8)), jnp.zeros((1, 15, 2, 8)), jnp.zeros((1, 15, 2, 8)), (8,),
        (1,), mesh=_mesh()), ValueError, "seq_len n=15 must be divisible by the size 2"),
    ("ring outside shard_map", lambda: dilax.ring_dilated_attention(Q, KV, KV, (8,), (1,),
                                                                    axis_name="sp"),
     ValueError, "axis_name='sp' is not a mesh axis bound here"),
    ("block-sparse ring outside shard_map", lambda: dilax.ring_block_sparse_attention(
        Q, KV, KV, PATTERN, axis_name="sp"), ValueError,
     "axis_name='sp' is not a mesh axis bound here; call ring_block_sparse_attention"),
    ("block-sparse ring: axis_name not a str", lambda: dilax.ring_block_sparse_attention(
        Q, KV, KV, PATTERN, axis_name=("sp",)), TypeError,
     "axis_name must be a mesh axis name (str)"),
    ("block-sparse ring: n not divisible by devices", lambda: (
        dilax.sharded_block_sparse_attention(
            jnp.zeros((1, 15, 4, 8)), jnp.zeros((1, 15, 2, 8)), jnp.zeros((1, 15, 2, 8)),
            dilax.patterns.local_window(15, 4, 4), mesh=_mesh())), ValueError,
     "seq_len n=15 must be divisible by the size 2"),
    ("block-sparse ring: shard not a block multiple", lambda: (
        dilax.sharded_block_sparse_attention(
            jnp.zeros((1, 24, 4, 8)), jnp.zeros((1, 24, 2, 8)), jnp.zeros((1, 24, 2, 8)),
            dilax.patterns.local_window(24, 8, 8), mesh=_mesh())), ValueError,
     "(n/P = 12) must be a multiple of the pattern's block_size 8"),
    ("block-sparse ring: batch_axis not a mesh axis", lambda: (
        dilax.sharded_block_sparse_attention(Q, KV, KV, PATTERN, mesh=_mesh(),
                                             batch_axis="dp")), ValueError,
     "batch_axis='dp' is not an axis of the mesh"),
    ("block-sparse ring: mesh of the wrong type", lambda: (
        dilax.sharded_block_sparse_attention(Q, KV, KV, PATTERN, mesh="sp")), TypeError,
     "mesh must be a jax.sharding.Mesh"),
    ("factory: mesh of the wrong type", lambda: dilax.create_attention(
        segment_lengths=(8,), dilation_rates=(1,), mesh="sp"), TypeError,
     "mesh must be a jax.sharding.Mesh"),
    ("factory: unknown backend", lambda: dilax.create_attention(
        segment_lengths=(8,), dilation_rates=(1,), backend="quantum"), ValueError,
     "backend must be None (detect) or one of"),
    ("module: embed_dim % num_heads", lambda: _mha(18, 4), ValueError,
     "embed_dim must be divisible by num_heads"),
    ("CLI: odd --d-model", _cli("--d-model=31"), ValueError,
     "d_model (--d-model)=31 must be divisible by num_heads"),
    ("CLI: unknown flag", _cli("--lr-max", "1"), ValueError,
     "unrecognized arguments: --lr-max"),
    ("CLI: --stop-after beyond --steps", _cli("--steps", "5", "--stop-after", "6"), ValueError,
     "stop_after (--stop-after) must be in [1, --steps=5]"),
    ("CLI: batch that cannot fit", _cli("--batch-size", "100000000000"), ValueError,
     "would need about"),
]


def _mha(embed_dim, num_heads):
    from flax import nnx

    from dilax.nn import MultiheadDilatedAttention

    return MultiheadDilatedAttention(embed_dim, num_heads, (8,), (1,), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("desc,fn,exc,fragment", ERROR_TABLE, ids=[r[0] for r in ERROR_TABLE])
def test_error_table(desc, fn, exc, fragment):
    with pytest.raises(exc) as info:
        fn()
    assert fragment in str(info.value), f"{desc}: {info.value}"


def test_errors_raise_at_trace_time_under_jit():
    @jax.jit
    def f(q, k, v):
        return dilax.dilated_attention(q, k, v, (6,), (4,))

    with pytest.raises(ValueError, match="must be divisible by dilation_rates"):
        f.lower(Q, KV, KV)


def test_traced_configuration_is_rejected():
    @jax.jit
    def f(q, k, v, w):
        return dilax.dilated_attention(q, k, v, (w,), (1,))

    with pytest.raises(TypeError, match="segment_lengths.* static"):
        f(Q, KV, KV, 8)
