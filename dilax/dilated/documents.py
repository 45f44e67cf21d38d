"""Packed documents (``segment_ids``): every document computed as a sequence of its own.

A document is a maximal run of equal ids in a row (docs/semantics.md, "Packed documents").
Inside it, position ``p`` has document position ``p - start``, and every rule of a branch
``(w, r)`` -- offsets, segments, causality -- applies to document positions. So a branch's
queries of offset ``o`` are the positions with ``(p - start) % r == o``; listed in row order
they form the branch's *document-dilated sequence*, in which every (document, segment) is one
contiguous run of keys. One core call per branch then reads that sequence with per-row key
ranges (:class:`dilax.core.KeyBounds` ``key_range``): cost follows the documents' own attended
pairs plus the edges of their runs, never ``n x n``.

:class:`DocumentBranch` is that branch for the one branch runner
(:func:`dilax.branch.runner.attend_branches`): it gathers the rows of its offsets, runs the core and
puts the results back at their positions (the merge then reads them like any branch's).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from dilax.attention_mask import document_bounds
from dilax.branch.plan import BranchPlan, plan_branch
from dilax.core import (
    XLA,
    BlockSizes,
    Core,
    KeyBounds,
    Mask,
    PairArrays,
    RowLayout,
    SlotView,
    attention,
    static_take,
)
from dilax.core.blocks import default_block_sizes
from dilax.core.ranges import EMPTY

_F32 = jnp.float32
EMPTY_RANGE = EMPTY  # the lower end of an empty key range: the core's own (dilax.core.ranges)

__all__ = ["EMPTY_RANGE", "DocumentBranch", "OffsetTable", "document_tables", "heads_into",
           "offset_table", "run_tiles", "sequence_bounds"]


def _take_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    """``x (b, m, ...)``, ``idx (b, L)`` -> ``x[b, idx[b, i]]`` ``(b, L, ...)``."""
    idx = idx.reshape(idx.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1)


@dataclasses.dataclass(frozen=True)
class OffsetTable:
    """One offset class of a branch: the gather into its document-dilated sequence."""

    rows: jax.Array  # (b, n) positions of the sequence, then n (an empty row) past its end
    back: jax.Array  # (b, n) each position's row in the sequence, n if not selected
    key_lo: jax.Array  # (b, n) key range of each row (empty: EMPTY_RANGE, 0)
    key_hi: jax.Array
    query_lo: jax.Array  # (b, n) the rows that may attend each row's key (its run)
    query_hi: jax.Array
    key_valid: jax.Array | None  # (b, n) per-key validity of each row, or None


def document_tables(start: jax.Array, end: jax.Array, w: int, r: int, offset: int, *,
                    window: int | None = None, q_len=None, kv_len=None, key_valid=None
                    ) -> OffsetTable:
    """The document-dilated sequence of branch ``(w, r)`` at ``offset`` (or of the
    local-window band ``|p - t| <= window`` with ``window``, ``r = 1``), from the documents'
    ``start, end (b, n)``; valid lengths ``(b,)`` and ``key_valid (b, n)`` folded in."""
    b, n = start.shape
    pos = jnp.arange(n, dtype=jnp.int32)[None]
    if window is not None:  # r = 1: the rows are the positions; the band inside the document
        sel = jnp.ones((b, n), bool)
        lo = jnp.maximum(start, pos - window)
        hi = jnp.minimum(end, pos + window + 1)
        count = jnp.broadcast_to(jnp.concatenate([jnp.zeros((1, 1), jnp.int32), pos + 1], 1),
                                 (b, n + 1))
    elif r == 1:  # the rows are the positions
        sel = jnp.ones((b, n), bool)
        count = jnp.broadcast_to(jnp.concatenate([jnp.zeros((1, 1), jnp.int32), pos + 1], 1),
                                 (b, n + 1))
        seg_start = start + ((pos - start) // w) * w
        lo, hi = seg_start, jnp.minimum(seg_start + w, end)
    else:  # every document takes ceil(m / r) rows at every offset (aligned runs)
        doc_pos = pos - start
        sel = doc_pos % r == offset
        first = _sequence_starts(start, end, r)
        before = first + doc_pos // r  # p's row when selected
        seg_start = start + (doc_pos // w) * w
        lo = first + (doc_pos // w) * (w // r)
        hi = lo + _class_count(jnp.minimum(seg_start + w, end) - seg_start, r, offset)
    query_lo, query_hi = lo, hi  # symmetric runs: the queries that may see key t
    if kv_len is not None:  # valid keys are the positions before kv_len
        kv = jnp.clip(jnp.asarray(kv_len, jnp.int32), 0, n)[:, None]
        if window is not None or r == 1:
            hi = jnp.minimum(hi, jnp.take_along_axis(count, kv, axis=1))
        else:
            seg_end = jnp.minimum(jnp.minimum(seg_start + w, end), kv)
            hi = jnp.minimum(hi, lo + _class_count(seg_end - seg_start, r, offset))
    ok = sel
    if q_len is not None:
        ok = ok & (pos < jnp.asarray(q_len, jnp.int32)[:, None])
    lo, hi = jnp.where(ok, lo, EMPTY_RANGE), jnp.where(ok, hi, 0)
    return offset_table(sel, None if window is not None or r == 1 else before, lo, hi,
                        query_lo, query_hi,
                        None if key_valid is None else jnp.asarray(key_valid, bool))


def _class_count(length, r, offset):
    """Positions ``offset, offset + r, ...`` below ``length`` (``>= 0``)."""
    return jnp.maximum(0, -(-(length - offset) // r))


def _sequence_starts(start, end, r):
    """The first sequence row of each position's document when every document takes
    ``ceil(m / r)`` rows (the same rows at every offset, so the runs align across them)."""
    pos = jnp.arange(start.shape[-1], dtype=jnp.int32)[None]
    rows = -(-(end - start) // r)
    return jnp.cumsum(jnp.where(pos == start, rows, 0), axis=1, dtype=jnp.int32) - rows


def sequence_bounds(start: jax.Array, end: jax.Array, r: int) -> tuple[jax.Array, jax.Array]:
    """:func:`document_bounds` of the rows of a rate-``r`` document-dilated sequence
    (:func:`document_tables`): document ``d`` is its ``ceil(m_d / r)`` rows; the rows past
    the last one form one more document."""
    b, n = start.shape
    pos = jnp.arange(n, dtype=jnp.int32)[None]
    first = jnp.where(pos == start, _sequence_starts(start, end, r), n)
    total = jnp.sum(jnp.where(pos == start, -(-(end - start) // r), 0), axis=1)
    marks = jnp.zeros((b, n + 1), jnp.int32).at[jnp.arange(b)[:, None], first].set(1)
    marks = marks.at[jnp.arange(b), total].set(1)[:, :n]
    return document_bounds(jnp.cumsum(marks, axis=1))


def offset_table(sel, before, lo, hi, query_lo, query_hi, key_valid) -> OffsetTable:
    """The :class:`OffsetTable` of selected positions ``sel (b, m)``: ``before`` counts the
    selected positions before each (its row when selected), or is ``None`` when every
    position is a row in place (``r = 1``, the window); the per-position ranges and key
    validity are gathered into row order (rows past the sequence: empty, invalid)."""
    b, m = sel.shape
    pos = jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32)[None], (b, m))
    if before is None:
        rows = back = pos
        take = lambda x, fill: x  # noqa: E731
    else:
        back = jnp.where(sel, before, m)
        rows = jnp.full((b, m + 1), m, jnp.int32).at[jnp.arange(b)[:, None], back].set(
            pos)[:, :m]
        take = lambda x, fill: jnp.take_along_axis(  # noqa: E731
            jnp.pad(x, ((0, 0), (0, 1)), constant_values=fill), rows, axis=1)
    return OffsetTable(rows, back, take(lo, EMPTY_RANGE), take(hi, 0),
                       take(query_lo, EMPTY_RANGE), take(query_hi, 0),
                       None if key_valid is None else take(key_valid, False))


def run_tiles(start: jax.Array, end: jax.Array, w: int, block: int
              ) -> tuple[jax.Array, jax.Array]:
    """Row tiles ``(start, end)`` int32 ``(b, T)`` of at most ``block`` rows aligned to the
    runs of branch ``(w, r = 1)`` (:class:`dilax.core.RowLayout` ``q_tiles``): runs of at least
    ``block / 4`` rows start a tile, and so does every ``block``-th row after such a start;
    shorter runs share tiles. ``T`` bounds the tile count for any documents (unused: empty)."""
    b, n = start.shape
    pos = jnp.arange(n, dtype=jnp.int32)[None]
    seg_start = start + ((pos - start) // w) * w
    long = jnp.minimum(seg_start + w, end) - seg_start >= max(1, block // 4)
    after_long = jnp.concatenate([jnp.ones((b, 1), bool), long[:, :-1]], axis=1)
    anchor = jax.lax.cummax(jnp.where((pos == seg_start) & (long | after_long), pos, 0),
                            axis=1)
    count = -(-n // block) + 2 * -(-n // max(1, block // 4)) + 1
    starts = jax.vmap(lambda x: jnp.nonzero(x, size=count, fill_value=n)[0])(
        (pos - anchor) % block == 0).astype(jnp.int32)
    return starts, jnp.concatenate([starts[:, 1:], jnp.full((b, 1), n, jnp.int32)], axis=1)


@dataclasses.dataclass(frozen=True)
class DocumentBranch:
    """Branch ``plan`` over packed documents as one core call (a :class:`BranchOp` of
    :func:`dilax.branch.runner.attend_branches`).

    ``aux`` = ``(q_len, kv_len, key_valid, start, end)``: valid lengths ``(b,)`` or ``None``,
    per-key validity ``(b, n)`` or ``None``, and the documents' :func:`document_bounds`.
    Results are in the full layout (``result_plan``: one segment, ``r = 1``)."""

    plan: BranchPlan
    n: int
    num_heads: int
    num_kv_heads: int
    scale: float
    is_causal: bool
    block_sizes: BlockSizes | None = None
    core: Core = XLA
    # full-length results: the forward without gradients merges them as they come
    merge_online: ClassVar[bool] = True
    # the forward runs row tiles aligned to the runs (:meth:`_row_tiles`) on the XLA core
    aligned_tiles: ClassVar[bool] = True

    @property
    def result_plan(self) -> BranchPlan:
        heads = tuple(sorted(self.plan.q_heads))
        return plan_branch(self.n, self.num_heads, self.num_kv_heads, self.n, 1, heads,
                           (0,) * len(heads))

    @property
    def _gathers(self) -> bool:
        return self.plan.r > 1 and self.plan.window is None

    @property
    def _blocks(self) -> BlockSizes:
        """The caller's block sizes, or: forward tiles aligned to the runs (:meth:`_row_tiles`)
        as long as the unpacked op's; backward blocks short next to the runs (``w / r``
        rows), since a key block that straddles two runs reads both runs' queries (same-run
        A/B, n = 16384, 2 cores: 256 x 512 0.9-1.2x the unpacked backward, 2048 2.3x)."""
        if self.block_sizes is not None:
            return self.block_sizes
        if self._tiled:  # tiles inside the runs: the unpacked op's forward tiles, shorter
            # at rate r, whose runs are m / r rows of an m-token document (same-run A/B on
            # 2 cores, n = 16384, forward: r = 2 1024 rows 1.05x the unpacked branch, 2048
            # rows 1.25x; r = 4 512 rows 0.90x, 2048 rows 1.40x)
            fwd = default_block_sizes(self.n, self.n, self.num_heads, self.is_causal)
            return dataclasses.replace(fwd, block_q=max(min(256, fwd.block_q),
                                                        fwd.block_q // self.plan.r),
                                       block_q_dkv=256, block_k_dkv=512)
        if self.plan.window is not None:
            return default_block_sizes(self.n, self.n, self.num_heads, self.is_causal,
                                       self.plan.window)
        return BlockSizes(256, 512, 256, 512, None)

    @property
    def _tiled(self) -> bool:
        """Forward row tiles aligned to the runs (:meth:`_row_tiles`)."""
        return self.aligned_tiles and self.plan.window is None and self.core.name == "xla"

    @property
    def _in_place(self) -> bool:
        """No gather and every head in order: the core reads (and adds gradients into) the
        caller's arrays themselves."""
        p = self.plan
        return (not self._gathers and p.q_heads == tuple(range(self.num_heads))
                and p.kv_heads == tuple(range(self.num_kv_heads)))

    def _tables(self, aux):
        q_len, kv_len, key_valid, start, end = aux
        p = self.plan
        offsets = sorted(set(p.kv_slots))
        tables = {o: document_tables(start, end, p.w, p.r, o, window=p.window, q_len=q_len,
                                     kv_len=kv_len, key_valid=key_valid) for o in offsets}
        per_u = [tables[o] for o in p.kv_slots]

        def stack(name):
            xs = [getattr(t, name) for t in per_u]
            return None if xs[0] is None else jnp.stack(xs, axis=1)  # (b, U, n)

        key_valid = stack("key_valid")
        mask = Mask(KeyBounds(is_causal=self.is_causal,
                              key_range=(stack("key_lo"), stack("key_hi")),
                              query_range=(stack("query_lo"), stack("query_hi")),
                              # the runs are symmetric unless lengths cut the key ranges
                              query_range_exact=q_len is None and kv_len is None),
                    None if key_valid is None else PairArrays(kv_valid=key_valid))
        return per_u, mask

    def _view(self) -> SlotView:
        U, G = len(self.plan.kv_heads), self.plan.q_per_kv
        return SlotView(1, U * G, U, tuple(range(U * G)), tuple(range(U)))

    def _gather_in(self, x, heads, per_u, G):
        """``x (b, n, H, ...)`` -> the sequences ``(b, n, U*G, ...)`` of heads ``heads``."""
        x = static_take(x, heads, axis=2)
        if not self._gathers:
            return x
        b, n = x.shape[:2]
        x = jnp.pad(x.reshape(b, n, len(per_u), G, *x.shape[3:]),
                    ((0, 0), (0, 1)) + ((0, 0),) * (x.ndim - 1))
        parts = [_take_rows(x[:, :, u], t.rows) for u, t in enumerate(per_u)]
        return jnp.stack(parts, axis=2).reshape(b, n, len(per_u) * G, *x.shape[4:])

    def _scatter_out(self, y, per_u, G, fill):
        """Sequences ``(b, n, U*G, ...)`` -> positions, heads ascending; ``fill`` elsewhere."""
        b, n = y.shape[:2]
        if self._gathers:
            y = jnp.pad(y.reshape(b, n, len(per_u), G, *y.shape[3:]),
                        ((0, 0), (0, 1)) + ((0, 0),) * (y.ndim - 1), constant_values=fill)
            y = jnp.stack([_take_rows(y[:, :, u], t.back) for u, t in enumerate(per_u)],
                          axis=2).reshape(b, n, len(per_u) * G, *y.shape[4:])
        order = tuple(sorted(range(len(self.plan.q_heads)), key=self.plan.q_heads.__getitem__))
        return static_take(y, order, axis=2)

    def _unscatter(self, y, per_u, G):
        """Inverse of :meth:`_scatter_out` for cotangents: positions -> sequences."""
        heads = sorted(self.plan.q_heads)
        return self._gather_in(y, tuple(heads.index(j) for j in self.plan.q_heads), per_u, G)

    # -- r > 1: the core reads the rows where they lie (no gathered copies) ---------------

    def _row_call(self, mask, per_u):
        """The view and mask of a row-gathered core call (:mod:`dilax.core.rows`)."""
        rows = jnp.minimum(jnp.stack([t.rows for t in per_u], axis=1), self.n - 1)
        p = self.plan
        view = SlotView(1, self.num_heads, self.num_kv_heads, p.q_heads, p.kv_heads)
        return view, dataclasses.replace(mask, layout=dataclasses.replace(
            mask.layout or RowLayout(), rows=(rows, rows)))

    def _columns(self, y, per_u, name, fill):
        """Per head (ascending): column ``c`` of ``y (b, L, H', ...)`` gathered by the
        ``name`` table (``"back"``: sequences -> positions, ``"rows"``: the reverse)."""
        G, m = self.plan.q_per_kv, y.shape[1]
        u_of = {j: i // G for i, j in enumerate(self.plan.q_heads)}

        def column(c, idx):  # index m: no row; no padded copy of y (it is n x h x d)
            x = _take_rows(y[:, :, c], jnp.minimum(idx, m - 1))
            return jnp.where((idx < m).reshape(idx.shape + (1,) * (x.ndim - 2)), x, fill)

        return jnp.stack([column(c, getattr(per_u[u_of[j]], name))
                          for c, j in enumerate(sorted(self.plan.q_heads))], axis=2)

    def _forward_rows(self, q, k, v, per_u, mask):
        view, mask = self._row_call(mask, per_u)
        out, lse = self.core.forward(q, k, v, view=view, mask=mask, scale=self.scale,
                                     block_sizes=self._blocks, out_dtype=_F32)
        return (self._columns(out, per_u, "back", 0.0),
                self._columns(lse, per_u, "back", -jnp.inf), None)

    def _backward_rows(self, q, k, v, per_u, mask, lse, dout, delta, acc):
        view, mask = self._row_call(mask, per_u)
        seq = lambda x: self._columns(x, per_u, "rows", 0.0)  # noqa: E731
        return self.core.backward(q, k, v, view=view, mask=mask, scale=self.scale,
                                  lse=seq(lse), dout=seq(dout), delta=seq(delta),
                                  block_sizes=self._blocks, grad_dtype=_F32, acc=acc)

    @property
    def _reads_rows(self) -> bool:
        return self._gathers and self.core.name == "xla"

    def _row_tiles(self, aux):
        """:func:`run_tiles` of the branch's sequences (the same runs at every offset)."""
        start, end = aux[3:]
        if self.plan.r > 1:
            start, end = sequence_bounds(start, end, self.plan.r)
        return run_tiles(start, end, self.plan.w // self.plan.r,
                         min(self._blocks.block_q, self.n))

    def forward(self, q, k, v, aux):
        per_u, mask = self._tables(aux)
        if self._tiled:
            mask = dataclasses.replace(mask, layout=dataclasses.replace(
                mask.layout or RowLayout(), q_tiles=self._row_tiles(aux)))
        if self._reads_rows:
            return self._forward_rows(q, k, v, per_u, mask)
        p, G = self.plan, self.plan.q_per_kv
        qs = self._gather_in(q, p.q_heads, per_u, G)
        ks = self._gather_in(k, p.kv_heads, per_u, 1)
        vs = self._gather_in(v, p.kv_heads, per_u, 1)
        out, lse = self.core.forward(qs, ks, vs, view=self._view(), mask=mask,
                                     scale=self.scale, block_sizes=self._blocks,
                                     out_dtype=_F32)
        return (self._scatter_out(out, per_u, G, 0.0),
                self._scatter_out(lse, per_u, G, -jnp.inf), None)

    def backward(self, q, k, v, aux, res, lse, dout, dlse, delta, acc):
        del res, dlse
        per_u, mask = self._tables(aux)
        if self._reads_rows:
            return self._backward_rows(q, k, v, per_u, mask, lse, dout, delta, acc)
        p, G, U = self.plan, self.plan.q_per_kv, len(self.plan.kv_heads)
        qs = self._gather_in(q, p.q_heads, per_u, G)
        ks = self._gather_in(k, p.kv_heads, per_u, 1)
        vs = self._gather_in(v, p.kv_heads, per_u, 1)
        in_place = self._in_place and acc is not None
        dq, dk, dv = self.core.backward(
            qs, ks, vs, view=self._view(), mask=mask, scale=self.scale,
            lse=self._unscatter(lse, per_u, G), dout=self._unscatter(dout, per_u, G),
            delta=self._unscatter(delta, per_u, G), block_sizes=self._blocks,
            grad_dtype=_F32, acc=acc if in_place else None)
        if in_place:  # added into the accumulators by the core
            return dq, dk, dv
        b, n = q.shape[:2]
        if self._gathers:  # back to positions: each (position, head) is one row or none
            dq = self._rows_back(dq.reshape(b, n, U, G, -1), per_u).reshape(b, n, U * G, -1)
            dk = self._rows_back(dk[:, :, :, None], per_u)[:, :, :, 0]
            dv = self._rows_back(dv[:, :, :, None], per_u)[:, :, :, 0]
        grads = (heads_into(dq, p.q_heads, q.shape), heads_into(dk, p.kv_heads, k.shape),
                 heads_into(dv, p.kv_heads, v.shape))
        if acc is None:
            return grads
        return tuple(a + g for a, g in zip(acc, grads, strict=True))

    def attend(self, q, k, v, aux, mods=None):
        """This branch as one differentiable core call (:func:`dilax.core.attention`, the
        XLA core reading the rows in place when ``r > 1``) with the core mods ``mods``
        (:class:`dilax.core.mods.Mods` without positions, or None): ``(out, lse)`` float32 in
        the full layout (``result_plan``). The mods see row positions (the sequences' rows
        are positions of the row) and the query heads (:mod:`dilax.dilated.flex`)."""
        per_u, mask = self._tables(aux)
        if self._tiled:
            mask = dataclasses.replace(mask, layout=dataclasses.replace(
                mask.layout or RowLayout(), q_tiles=self._row_tiles(aux)))
        p, G = self.plan, self.plan.q_per_kv
        call = dict(scale=self.scale, core=self.core, block_sizes=self._blocks, out_dtype=_F32)
        if self._reads_rows:
            view, mask = self._row_call(mask, per_u)
            if mods is not None:
                mods = dataclasses.replace(mods, q_pos=mask.rows[0], kv_pos=mask.rows[0],
                                           heads=p.q_heads)
            out, lse = attention(q, k, v, view=view, mask=dataclasses.replace(mask, mods=mods),
                                 **call)
            return (self._columns(out, per_u, "back", 0.0),
                    self._columns(lse, per_u, "back", -jnp.inf))
        if self._gathers:
            raise ValueError("score_mod / mask_mod with packed documents need the XLA core")
        qs = self._gather_in(q, p.q_heads, per_u, G)  # r = 1: rows are positions
        ks, vs = (self._gather_in(x, p.kv_heads, per_u, 1) for x in (k, v))
        if mods is not None:
            mods = dataclasses.replace(mods, heads=p.q_heads)
        out, lse = attention(qs, ks, vs, view=self._view(),
                             mask=dataclasses.replace(mask, mods=mods), **call)
        return self._scatter_out(out, per_u, G, 0.0), self._scatter_out(lse, per_u, G, -jnp.inf)

    @staticmethod
    def _rows_back(y, per_u):
        y = jnp.pad(y, ((0, 0), (0, 1)) + ((0, 0),) * (y.ndim - 2))
        return jnp.stack([_take_rows(y[:, :, u], t.back) for u, t in enumerate(per_u)], axis=2)


def heads_into(g: jax.Array, heads: tuple[int, ...], shape) -> jax.Array:
    """``g (b, n, len(heads), d)`` summed into float32 zeros of ``shape`` at ``heads``
    (a head may appear several times: a kv head read at several offsets)."""
    num = shape[2]
    onehot = np.zeros((len(heads), num), np.float32)
    onehot[np.arange(len(heads)), np.asarray(heads)] = 1.0
    if len(heads) == num and np.array_equal(onehot, np.eye(num, dtype=np.float32)):
        return g.astype(_F32)
    return jnp.einsum("bnud,uh->bnhd", g.astype(_F32), jnp.asarray(onehot),
                      precision=jax.lax.Precision.HIGHEST)
