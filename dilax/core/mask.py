"""Which keys a query may see: valid lengths, global offsets, causality, a local window and
dense ``(B, N, T, S)`` masks and biases read block by block."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dilax.core.mods import Mods


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mask:
    """The mask description every core implementation takes (a pytree; ``is_causal`` and
    ``window`` static).

    Query ``i`` (global position ``q_offset + i``) of virtual kv head ``u`` in batch row ``b``
    may attend key ``t`` (global position ``k_offset + t``) iff ``t < kv_len[b, u]``,
    ``kv_valid[b, u, t]``,
    ``i < q_len[b, u]``, when ``is_causal`` ``k_offset + t <= q_offset + i``, and when
    ``window`` is set ``|(k_offset + t) - (q_offset + i)| <= window``. A query with no key
    gets ``out = 0``, ``lse = -inf`` and zero gradient.

    Fields:
      kv_len: int ``(B, U)`` (or broadcastable), or ``None``: all keys valid and no key mask
        is built at all.
      q_offset, k_offset: int scalars (may be traced), the global positions of index 0.
      is_causal: static bool.
      q_len: int ``(B, U)`` (or broadcastable), or ``None``: all query rows valid. Rows at or
        past ``q_len`` see no key (query blocks wholly past it are skipped).
      window: static int ``>= 0`` or ``None``: the local band ``|p - t| <= window`` (key
        blocks outside the band are skipped).
      kv_valid: bool ``(B, U, Lk)`` (or broadcastable), or ``None``: an arbitrary per-key
        validity (e.g. a key-padding mask); pair it with ``kv_len`` (one past the last valid
        key) so that trailing invalid key blocks are skipped.
      bias: float ``(Bb, Nb, Tb, Sb)`` or ``None``: added to the scaled logits, each dim 1 or
        the full ``B``, query heads ``H``, ``Lq``, ``Lk`` (kept as given; the core slices one
        block at a time). Identity views only. The XLA core's backward then also returns its
        gradient (``dS`` summed over the broadcast dims).
      mask: bool, shaped like ``bias`` (its own dims), or ``None``: query ``i`` may attend key
        ``t`` of head ``h`` only where ``mask[b, h, i, t]`` (broadcast) is True.
      key_range: ``None`` or a pair ``(lo, hi)`` of int32 ``(B, U, Lq)``: query ``i`` may
        attend only keys ``lo[b, u, i] <= t < hi[b, u, i]`` (packed documents: the key run of
        the query's document chunk; ``lo >= hi`` = no key). Key blocks outside the rows'
        ranges are skipped.
      query_range: ``None`` or ``(lo, hi)`` int32 ``(B, U, Lk)``, given with ``key_range``: a
        superset of the queries that may attend key ``t`` (the backward visits only those
        query blocks; the exact rule is ``key_range``'s).
      query_range_exact: static bool: ``query_range`` is exactly the queries whose
        ``key_range`` holds ``t`` (e.g. symmetric runs); the backward then skips the range
        mask on query blocks inside every key's range.
      q_tiles: ``None`` or ``(start, end)`` int32 ``(B, T)``: the XLA forward computes row
        tiles ``[start, end)`` (at most ``block_q`` rows each, in order, covering the rows;
        ``start >= end``: no tile) instead of every ``block_q`` rows (tiles aligned to the
        key runs waste no work on rows of two runs; :mod:`dilax.core.tiles`).
      rows: ``None`` or ``(q_rows (B, U, Lq), k_rows (B, U, Lk))`` int32: the inputs are in
        their own position layout ``(B, n, H, d)`` and row ``i`` of virtual head ``u`` is
        position ``rows[b, u, i]`` (:mod:`dilax.core.rows`; XLA core, identity-slot views).
      mods: ``None`` or a :class:`dilax.core.mods.Mods`: a soft-cap, ``score_mod`` and
        ``mask_mod`` applied to each block's scaled logits (XLA core, identity views), and
        optional block tables (key blocks visited whole, in part or not at all).

    ``window`` may also be a ``(left, right)`` pair of ints: the band
    ``-left <= (k_offset + t) - (q_offset + i) <= right``.
    """

    kv_len: jax.Array | None = None
    q_offset: jax.Array | int = 0
    k_offset: jax.Array | int = 0
    is_causal: bool = dataclasses.field(default=False, metadata=dict(static=True))
    q_len: jax.Array | None = None
    window: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    kv_valid: jax.Array | None = None
    bias: jax.Array | None = None
    mask: jax.Array | None = None
    key_range: tuple[jax.Array, jax.Array] | None = None
    query_range: tuple[jax.Array, jax.Array] | None = None
    rows: tuple[jax.Array, jax.Array] | None = None
    query_range_exact: bool = dataclasses.field(default=False, metadata=dict(static=True))
    q_tiles: tuple[jax.Array, jax.Array] | None = None
    mods: Mods | None = None

    def resolve(self, batch: int, num_kv: int, len_k: int, len_q: int | None = None) -> Mask:
        """int32 arrays: ``kv_len`` (``q_len``) broadcast to ``(batch, num_kv)`` and capped at
        ``len_k`` (``len_q``)."""
        kv_len, q_len = self.kv_len, self.q_len
        if kv_len is not None:
            kv_len = jnp.minimum(
                jnp.broadcast_to(jnp.asarray(kv_len, jnp.int32), (batch, num_kv)), len_k)
        if q_len is not None:
            q_len = jnp.broadcast_to(jnp.asarray(q_len, jnp.int32), (batch, num_kv))
            if len_q is not None:
                q_len = jnp.minimum(q_len, len_q)
        kv_valid = self.kv_valid
        if kv_valid is not None:
            kv_valid = jnp.broadcast_to(jnp.asarray(kv_valid, bool),
                                        (batch, num_kv, kv_valid.shape[-1]))
        key_range, query_range = self.key_range, self.query_range
        if key_range is not None:
            key_range = tuple(jnp.broadcast_to(jnp.asarray(x, jnp.int32),
                                               (batch, num_kv, x.shape[-1])) for x in key_range)
            query_range = tuple(jnp.broadcast_to(jnp.asarray(x, jnp.int32),
                                                 (batch, num_kv, x.shape[-1]))
                                for x in query_range)
        rows = self.rows
        if rows is not None:
            rows = tuple(jnp.broadcast_to(jnp.asarray(x, jnp.int32),
                                          (batch, num_kv, x.shape[-1])) for x in rows)
        return Mask(kv_len, jnp.asarray(self.q_offset, jnp.int32),
                    jnp.asarray(self.k_offset, jnp.int32), bool(self.is_causal), q_len,
                    _static_window(self.window), kv_valid, self.bias, self.mask, key_range,
                    query_range, rows, bool(self.query_range_exact), self.q_tiles,
                    self.mods)


def _static_window(window):
    if isinstance(window, (tuple, list)):
        return tuple(int(w) for w in window)
    return None if window is None else int(window)
