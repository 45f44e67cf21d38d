"""Combining partial softmax results over disjoint key sets (float32, stable)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_F32 = jnp.float32


def merge_attention_states(
    out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Combines two partial softmax results over disjoint key multisets.

    ``out = (e^{lse_a} out_a + e^{lse_b} out_b) / (e^{lse_a} + e^{lse_b})`` computed stably in
    float32; ``lse = logaddexp(lse_a, lse_b)``. Rows with ``lse = -inf`` on both sides stay
    ``(0, -inf)``; gradients stay finite. ``out_*``: ``(..., d)``, ``lse_*``: ``(...)``.
    """
    m = jnp.maximum(lse_a, lse_b)
    m_safe = lax.stop_gradient(jnp.where(m == -jnp.inf, 0.0, m))
    ea = jnp.exp(lse_a - m_safe)
    eb = jnp.exp(lse_b - m_safe)
    total = ea + eb
    nonzero = total > 0
    total_safe = jnp.where(nonzero, total, 1.0)
    out = (ea / total_safe)[..., None] * out_a.astype(_F32) + (eb / total_safe)[
        ..., None
    ] * out_b.astype(_F32)
    lse = jnp.where(nonzero, m_safe + jnp.log(total_safe), -jnp.inf)
    return out, lse
