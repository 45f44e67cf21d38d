"""Bad input -> ValueError/TypeError at trace time naming the argument (SPEC.md, "Errors").

The table doubles as documentation: (description, call, exception, message fragment).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import dilax

Q = jnp.zeros((1, 16, 4, 8))
KV = jnp.zeros((1, 16, 2, 8))


def call(q=Q, k=KV, v=KV, ws=(8,), rs=(2,), **kw):
    return lambda: dilax.dilated_attention(q, k, v, ws, rs, **kw)


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
    ("k/v shapes differ", call(v=jnp.zeros((1, 16, 2, 4))), ValueError,
     "k and v must have the same shape"),
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
