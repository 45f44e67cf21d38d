"""Packed documents on a sequence split over devices: the global bounds of each local
position's document, shared by both rings (:mod:`dilax.dilated.ring_documents`,
:mod:`dilax.block_sparse.ring`)."""

from __future__ import annotations

from collections.abc import Hashable

import jax
import jax.numpy as jnp
from jax import lax

from dilax.attention_mask import document_bounds

__all__ = ["global_document_bounds"]

_I32 = jnp.int32


def global_document_bounds(segment_ids: jax.Array, axis_name: Hashable
                           ) -> tuple[jax.Array, jax.Array]:
    """``(start, end)`` int32 ``(b, m)`` in global positions for the local shard
    ``segment_ids (b, m)`` of a sequence split over ``axis_name`` (inside ``shard_map``).

    Every shard contributes five numbers per row (its first and last id, whether it is one
    run, the start of its last run and the end of its first): a document that crosses shards
    is followed through them in ``O(P)``."""
    P, i = lax.axis_size(axis_name), lax.axis_index(axis_name)
    m = segment_ids.shape[1]
    ls, le = document_bounds(segment_ids)
    base = i * m
    summary = jnp.stack([segment_ids[:, 0], segment_ids[:, -1], (le[:, 0] == m).astype(_I32),
                         ls[:, -1] + base, le[:, 0] + base], axis=1)
    every = lax.all_gather(summary, axis_name)  # (P, b, 5)
    first, last, single, last_start, first_end = (every[..., c] for c in range(5))
    starts = [jnp.zeros_like(first[0])]
    for j in range(1, P):  # the run holding shard j's first position starts ...
        joined = first[j] == last[j - 1]
        starts.append(jnp.where(joined, jnp.where(single[j - 1] == 1, starts[-1],
                                                  last_start[j - 1]), j * m))
    ends = [jnp.full_like(first[0], P * m)]
    for j in range(P - 2, -1, -1):  # ... and the run holding its last position ends
        joined = last[j] == first[j + 1]
        ends.insert(0, jnp.where(joined, jnp.where(single[j + 1] == 1, ends[0],
                                                   first_end[j + 1]), (j + 1) * m))
    s_i, e_i = jnp.stack(starts)[i], jnp.stack(ends)[i]
    start = jnp.where(ls == 0, s_i[:, None], ls + base)
    end = jnp.where(le == m, e_i[:, None], le + base)
    return start.astype(_I32), end.astype(_I32)
