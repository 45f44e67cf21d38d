"""Which keys a query may see, in one general form: per-row key bounds, arrays over keys and
pairs, and mods (score / mask functions with their block tables).

Each of dilax's masks is an instance of it: causal, a local window and valid lengths are
:class:`KeyBounds` (an interval of keys per row, affine in the row's position or read from
``(B, U)`` lengths); packed documents are bounds too (per-row key ranges); key padding and a
caller's ``(B, N, T, S)`` bias / boolean mask are :class:`PairArrays`; FlexAttention's
``score_mod`` / ``mask_mod``, soft-cap and block tables are :class:`~dilax.core.mods.Mods`;
a call in its own row order names it in :class:`RowLayout`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dilax.core.mods import Mods


def _static(**kw):
    return dataclasses.field(metadata=dict(static=True), **kw)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KeyBounds:
    """The keys each query row may see as an interval (a pytree; ``is_causal``, ``window``
    and ``query_range_exact`` static).

    Query ``i`` (global position ``p = q_offset + i``) of virtual kv head ``u`` in batch row
    ``b`` may see key ``t`` (position ``k_offset + t``) iff ``lo <= t < hi`` with

    * ``hi <= kv_len[b, u]`` (valid keys), and no key at all when ``i >= q_len[b, u]``;
    * when ``is_causal``: ``k_offset + t <= p``;
    * when ``window`` is set: ``|(k_offset + t) - p| <= window`` (or, for a pair
      ``(left, right)``, ``-left <= (k_offset + t) - p <= right``);
    * when ``key_range = (lo, hi)`` is given: ``lo[b, u, i] <= t < hi[b, u, i]`` (packed
      documents: the key run of the query's chunk; ``lo >= hi`` = no key).

    The affine bounds (causal, window) and the lengths cost nothing per block: key blocks
    outside every row's interval are skipped, blocks inside it get no mask.

    Fields:
      kv_len, q_len: int ``(B, U)`` (or broadcastable) or ``None`` (all keys / rows valid; no
        key mask is built at all).
      q_offset, k_offset: int scalars (may be traced), the global positions of index 0.
      is_causal, window: static; ``window`` an int ``>= 0``, a pair or ``None``.
      key_range: ``None`` or ``(lo, hi)`` int32 ``(B, U, Lq)``.
      query_range: ``(lo, hi)`` int32 ``(B, U, Lk)``, given with ``key_range``: a superset of
        the queries that may see key ``t`` (the backward visits only those query blocks).
      query_range_exact: ``query_range`` is exactly the queries whose ``key_range`` holds
        ``t`` (e.g. symmetric runs): query blocks inside every key's range get no mask.
    """

    kv_len: jax.Array | None = None
    q_offset: jax.Array | int = 0
    k_offset: jax.Array | int = 0
    is_causal: bool = _static(default=False)
    q_len: jax.Array | None = None
    window: int | tuple[int, int] | None = _static(default=None)
    key_range: tuple[jax.Array, jax.Array] | None = None
    query_range: tuple[jax.Array, jax.Array] | None = None
    query_range_exact: bool = _static(default=False)

    def resolve(self, batch: int, num_kv: int, len_k: int, len_q: int | None) -> KeyBounds:
        kv_len, q_len = self.kv_len, self.q_len
        if kv_len is not None:
            kv_len = jnp.minimum(
                jnp.broadcast_to(jnp.asarray(kv_len, jnp.int32), (batch, num_kv)), len_k)
        if q_len is not None:
            q_len = jnp.broadcast_to(jnp.asarray(q_len, jnp.int32), (batch, num_kv))
            if len_q is not None:
                q_len = jnp.minimum(q_len, len_q)
        key_range, query_range = self.key_range, self.query_range
        if key_range is not None:
            key_range, query_range = (_per_kv_head(r, batch, num_kv)
                                      for r in (key_range, query_range))
        return KeyBounds(kv_len, jnp.asarray(self.q_offset, jnp.int32),
                         jnp.asarray(self.k_offset, jnp.int32), bool(self.is_causal), q_len,
                         _static_window(self.window), key_range, query_range,
                         bool(self.query_range_exact))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PairArrays:
    """Masks and scores given as arrays (a pytree), read one block at a time.

    Fields:
      kv_valid: bool ``(B, U, Lk)`` (or broadcastable) or ``None``: an arbitrary per-key
        validity (key padding); pair it with ``KeyBounds.kv_len`` (one past the last valid
        key) so that trailing invalid key blocks are skipped.
      bias: float ``(Bb, Nb, Tb, Sb)`` or ``None``: added to the scaled logits, each dim 1 or
        the full ``B``, query heads ``H``, ``Lq``, ``Lk`` (kept as given; sliced per block;
        identity views only). The XLA core's backward also returns its gradient.
      allowed: bool shaped like ``bias`` (its own dims) or ``None``: query ``i`` may see key
        ``t`` of head ``h`` only where ``allowed[b, h, i, t]`` (broadcast).
    """

    kv_valid: jax.Array | None = None
    bias: jax.Array | None = None
    allowed: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowLayout:
    """A call whose rows are not in position order, or tiled by a table (a pytree).

    Fields:
      rows: ``None`` or ``(q_rows (B, U, Lq), k_rows (B, U, Lk))`` int32: the inputs are in
        their own position layout ``(B, n, H, d)`` and row ``i`` of virtual head ``u`` is
        position ``rows[b, u, i]`` (:mod:`dilax.core.rows`; XLA core, identity-slot views).
      q_tiles: ``None`` or ``(start, end)`` int32 ``(B, T)``: the XLA forward computes row
        tiles ``[start, end)`` (at most ``block_q`` rows each, in order, covering the rows;
        ``start >= end``: no tile) instead of every ``block_q`` rows (tiles aligned to the
        key runs waste no work on rows of two runs; :mod:`dilax.core.tiles`).
    """

    rows: tuple[jax.Array, jax.Array] | None = None
    q_tiles: tuple[jax.Array, jax.Array] | None = None


_ALL_KEYS = KeyBounds()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mask:
    """The mask description every core implementation takes (a pytree): the general form.

    A query sees a key iff the key lies in the row's :class:`KeyBounds` interval, the
    :class:`PairArrays` allow it and the :class:`~dilax.core.mods.Mods`' ``mask_mod`` allows
    it; the scores are the scaled logits plus the arrays' bias, then the mods' soft-cap and
    ``score_mod``. Key blocks outside the bounds or the mods' block tables are never visited.
    A query with no key gets ``out = 0``, ``lse = -inf`` and zero gradient.

    Fields:
      bounds: :class:`KeyBounds` (default: every key, no offsets).
      arrays: :class:`PairArrays` or ``None``.
      mods: :class:`~dilax.core.mods.Mods` or ``None`` (XLA core; identity views or a head
        map, see ``Mods.heads``).
      layout: :class:`RowLayout` or ``None`` (rows in position order, block tiles).
    """

    bounds: KeyBounds = _ALL_KEYS
    arrays: PairArrays | None = None
    mods: Mods | None = None
    layout: RowLayout | None = None

    def resolve(self, batch: int, num_kv: int, len_k: int, len_q: int | None = None) -> Mask:
        """int32 arrays: ``kv_len`` (``q_len``) broadcast to ``(batch, num_kv)`` and capped at
        ``len_k`` (``len_q``); ranges, rows and ``kv_valid`` per virtual kv head."""
        arrays, layout = self.arrays, self.layout
        if arrays is not None and arrays.kv_valid is not None:
            kv_valid = arrays.kv_valid
            arrays = dataclasses.replace(arrays, kv_valid=jnp.broadcast_to(
                jnp.asarray(kv_valid, bool), (batch, num_kv, kv_valid.shape[-1])))
        if layout is not None and layout.rows is not None:
            layout = dataclasses.replace(layout, rows=_per_kv_head(layout.rows, batch, num_kv))
        return Mask(self.bounds.resolve(batch, num_kv, len_k, len_q), arrays, self.mods,
                    layout)

    # the parts a core reads most, by name
    @property
    def rows(self):
        return None if self.layout is None else self.layout.rows

    @property
    def q_tiles(self):
        return None if self.layout is None else self.layout.q_tiles

    @property
    def kv_valid(self):
        return None if self.arrays is None else self.arrays.kv_valid

    @property
    def bias(self):
        return None if self.arrays is None else self.arrays.bias

    @property
    def allowed(self):
        return None if self.arrays is None else self.arrays.allowed


def _per_kv_head(pair, batch, num_kv):
    return tuple(jnp.broadcast_to(jnp.asarray(x, jnp.int32), (batch, num_kv, x.shape[-1]))
                 for x in pair)


def _static_window(window):
    if isinstance(window, (tuple, list)):
        return tuple(int(w) for w in window)
    return None if window is None else int(window)
