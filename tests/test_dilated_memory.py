"""Training-step memory of dilated_attention, compiled (not run): beyond the inputs and the
gradients, the temporaries are a fixed handful of ``(b, n, h, d)`` float32 arrays."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import dilax

N, H, D = 65536, 8, 64  # large enough that the per-block scratch is small beside them
WS, RS = (2048, 4096, 8192), (1, 2, 4)


def _temp_arrays(dtype: str) -> float:
    """Temporaries of the gradient of ``sum(out)``, in ``(1, N, H, D)`` float32 arrays."""
    def loss(q, k, v):
        out = dilax.dilated_attention(q, k, v, WS, RS, implementation="xla")
        return jnp.sum(out.astype(jnp.float32))

    x = jax.ShapeDtypeStruct((1, N, H, D), jnp.dtype(dtype))
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes / (N * H * D * 4)


@pytest.mark.parametrize(("dtype", "bound"), [("float32", 3.0), ("bfloat16", 5.5)])
def test_train_step_temporaries(dtype, bound):
    """float32: the branches add their gradients into the outputs' buffers in place, so the
    temporaries are the cotangent of ``out`` and one branch's ``dO`` (measured 2.3 arrays with
    the per-block scratch; 4.1 when each branch's cond copied the accumulators). bfloat16:
    the float32 dq, dk, dv accumulators, ``dO`` and the bf16 cotangent (4.8; 8.1 when, besides
    that copy, float32 copies of q, k, v were hoisted out of the core's loops)."""
    assert _temp_arrays(dtype) <= bound
