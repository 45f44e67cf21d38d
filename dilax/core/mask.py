"""Which keys a query may see: valid key lengths, global offsets and causality."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mask:
    """The mask description every core implementation takes (a pytree; ``is_causal`` static).

    Query ``i`` (global position ``q_offset + i``) may attend key ``t`` (global position
    ``k_offset + t``) of virtual kv head ``u`` in batch row ``b`` iff ``t < kv_len[b, u]`` and,
    when ``is_causal``, ``k_offset + t <= q_offset + i``.

    Fields:
      kv_len: int ``(B, U)`` (or broadcastable), or ``None``: all keys valid and no key mask
        is built at all.
      q_offset, k_offset: int scalars (may be traced), the global positions of index 0.
      is_causal: static bool.
    """

    kv_len: jax.Array | None = None
    q_offset: jax.Array | int = 0
    k_offset: jax.Array | int = 0
    is_causal: bool = dataclasses.field(default=False, metadata=dict(static=True))

    def resolve(self, batch: int, num_kv: int, len_k: int) -> Mask:
        """int32 arrays: ``kv_len`` broadcast to ``(batch, num_kv)`` and capped at ``len_k``."""
        kv_len = self.kv_len
        if kv_len is not None:
            kv_len = jnp.minimum(
                jnp.broadcast_to(jnp.asarray(kv_len, jnp.int32), (batch, num_kv)), len_k)
        return Mask(kv_len, jnp.asarray(self.q_offset, jnp.int32),
                    jnp.asarray(self.k_offset, jnp.int32), bool(self.is_causal))
