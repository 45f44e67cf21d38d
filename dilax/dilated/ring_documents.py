"""Packed documents on the ring: ``segment_ids`` with the sequence split over devices.

Documents may cross shard boundaries. Each device finds the global bounds of the documents
of its positions from a ``P``-entry summary of every shard
(:func:`dilax.sp.documents.global_document_bounds`, shared with the block-sparse ring),
then every branch runs on its *document-dilated sequence* (:mod:`dilax.dilated.documents`) in global
row coordinates: device ``i`` holds rows ``[c_i, c_i + m_i)`` of it (``c_i``: the rows of the
shards before it, one ``all_gather`` of ``P`` counts), and the key range of every row is
computed in closed form from its document and segment. The key chunks (K, V, their validity
and the row ranges of their queries) travel around the ring with ``lax.ppermute``, ``P``
hops; the core skips every block outside the rows' ranges, so a hop with no shared document
costs a table lookup. The backward is a second ring in which the dK, dV accumulators travel
with their chunk and arrive home after ``P`` hops (:meth:`DocumentRingBranch.backward`).

Memory per device is ``O(n / P)`` (summaries are ``O(P)``); causality is part of the ranges
(a row's keys end at itself), so hops need no global offsets.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Hashable
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from dilax.attention_mask import AttentionMask
from dilax.branch.plan import dilated_branches, window_plan
from dilax.branch.runner import attend_branches
from dilax.core import KeyBounds, Mask, PairArrays, merge_attention_states
from dilax.core.arrays import cdiv, varying_like
from dilax.dilated.documents import (
    EMPTY_RANGE,
    DocumentBranch,
    heads_into,
    offset_table,
)
from dilax.dilated.settings import DilatedSettings
from dilax.flex.api import core_mods, prepare_mods, with_sinks
from dilax.registry import CoreRequest, select
from dilax.sp.config import SequenceParallel
from dilax.sp.documents import global_document_bounds
from dilax.sp.mesh import shard_sequence

__all__ = ["document_core", "global_document_bounds", "ring_documents_core",
           "sharded_documents"]

_I32 = jnp.int32


def _ring_tables(start, end, axis_name, w: int, r: int, offset: int, window, is_causal,
                 q_len, kv_len):
    """One offset class of a branch on this shard: the local rows of the global sequence,
    their global key ranges (causal cut included), the query ranges of the keys, key
    validity, and ``c`` ``(b,)``: the global row of the shard's first row."""
    b, m = start.shape
    i = lax.axis_index(axis_name)
    pos = i * m + jnp.arange(m, dtype=_I32)[None]
    if window is not None:
        sel = jnp.ones((b, m), bool)
        lo = jnp.maximum(start, pos - window)
        hi = jnp.minimum(end, pos + window + 1)
        rank = jnp.broadcast_to(pos, (b, m))
        before = rank - i * m
        c = jnp.full((b,), i * m, _I32)
    else:
        doc_pos = pos - start
        sel = doc_pos % r == offset
        before = jnp.cumsum(sel, axis=1, dtype=_I32) - sel
        every = lax.all_gather(jnp.sum(sel, axis=1, dtype=_I32), axis_name)  # (P, b)
        c = (jnp.cumsum(every, axis=0) - every)[i]
        rank = c[:, None] + before
        seg_start = start + (doc_pos // w) * w
        seg_end = jnp.minimum(seg_start + w, end)
        lo = rank - jnp.maximum(cdiv(pos - seg_start - offset, r), 0)
        hi = lo + jnp.maximum(cdiv(seg_end - seg_start - offset, r), 0)
    query_lo, query_hi = lo, hi
    if is_causal:
        hi = jnp.minimum(hi, rank + 1)
    ok = sel if q_len is None else sel & (pos < q_len[:, None])
    lo, hi = jnp.where(ok, lo, EMPTY_RANGE), jnp.where(ok, hi, 0)
    key_ok = sel if kv_len is None else sel & (pos < kv_len[:, None])
    table = offset_table(sel, None if window is not None or r == 1 else before, lo, hi,
                         query_lo, query_hi, key_ok)
    return table, c


@dataclasses.dataclass(frozen=True)
class DocumentRingBranch(DocumentBranch):
    """:class:`~dilax.dilated.documents.DocumentBranch` on the local shard of a ring: ``n`` is the
    shard length, ``aux = (q_len, kv_len, start, end)`` with global lengths and document
    bounds (:func:`global_document_bounds`)."""

    aligned_tiles: ClassVar[bool] = False  # its forward (per hop) builds no row tiles

    axis_name: Hashable = None

    def _ring(self, aux):
        q_len, kv_len, start, end = aux[:4]  # aux[4]: score / mask mods, when given
        p = self.plan
        made = {o: _ring_tables(start, end, self.axis_name, p.w, p.r, o, p.window,
                                self.is_causal, q_len, kv_len) for o in sorted(set(p.kv_slots))}
        per_u = [made[o][0] for o in p.kv_slots]
        stack = lambda name: jnp.stack([getattr(t, name) for t in per_u], axis=1)  # noqa: E731
        c = jnp.stack([made[o][1] for o in p.kv_slots], axis=1)  # (b, U)
        keys = (stack("key_valid"), stack("query_lo"), stack("query_hi"), c)
        return per_u, (stack("key_lo"), stack("key_hi")), keys, c

    def _shift(self, xs):
        P = lax.axis_size(self.axis_name)
        perm = [(j, (j + 1) % P) for j in range(P)]
        return tuple(lax.ppermute(x, self.axis_name, perm) for x in xs)

    def _hop_mask(self, key_range, keys, c_here, mods=None, q_pos=None):
        valid, q_lo, q_hi, c_keys = keys[:4]
        at = lambda x, c: x - c[:, :, None]  # noqa: E731 - global rows -> the chunk's own
        if mods is not None:  # the rows' and the visiting keys' global positions (keys[4])
            mods = dataclasses.replace(mods, q_pos=q_pos, kv_pos=keys[4],
                                       heads=tuple(self.plan.q_heads))
        bounds = KeyBounds(key_range=(at(key_range[0], c_keys), at(key_range[1], c_keys)),
                           query_range=(at(q_lo, c_here), at(q_hi, c_here)))
        return Mask(bounds, None if valid is None else PairArrays(kv_valid=valid), mods)

    def _positions(self, per_u, m):
        """Global positions ``(b, U, m)`` of the local rows of each virtual kv head (the
        mods see positions, never rows of the document-dilated sequence)."""
        rows = jnp.minimum(jnp.stack([t.rows for t in per_u], axis=1), m - 1)
        return lax.axis_index(self.axis_name) * m + rows

    def _start(self, q, k, v, aux):
        """The shard's rows, key ranges, queries and the first visiting chunk (K, V, the
        keys' tables and, with mods, positions); the mods and the queries' positions."""
        per_u, key_range, keys, c = self._ring(aux)
        p, G = self.plan, self.plan.q_per_kv
        mods = aux[4] if len(aux) > 4 else None
        pos = None if mods is None else (self._positions(per_u, q.shape[1]),)
        qs = self._gather_in(q, p.q_heads, per_u, G)
        chunk = (self._gather_in(k, p.kv_heads, per_u, 1),
                 self._gather_in(v, p.kv_heads, per_u, 1)) + keys + (pos or ())
        return per_u, key_range, c, qs, chunk, mods, pos and pos[0]

    def forward(self, q, k, v, aux):
        per_u, key_range, c, qs, chunk, mods, q_pos = self._start(q, k, v, aux)
        G = self.plan.q_per_kv
        out = lse = None
        for hop in range(lax.axis_size(self.axis_name)):
            if hop:
                chunk = self._shift(chunk)
            o, s = self.core.forward(qs, chunk[0], chunk[1], view=self._view(),
                                     mask=self._hop_mask(key_range, chunk[2:], c, mods, q_pos),
                                     scale=self.scale, block_sizes=self._blocks,
                                     out_dtype=jnp.float32)
            out, lse = (o, s) if out is None else merge_attention_states(out, lse, o, s)
        return (self._scatter_out(out, per_u, G, 0.0),
                self._scatter_out(lse, per_u, G, -jnp.inf), None)

    def backward(self, q, k, v, aux, res, lse, dout, dlse, delta, acc):
        del res, dlse
        per_u, key_range, c, qs, (ks, vs, *keys), mods, q_pos = self._start(q, k, v, aux)
        p, G, U = self.plan, self.plan.q_per_kv, len(self.plan.kv_heads)
        zeros = lambda x: varying_like(jnp.zeros(x.shape, jnp.float32), q)  # noqa: E731
        dq = zeros(qs)
        dc = None  # the mods' consts' cotangents, summed over the hops
        chunk = (ks, vs, zeros(ks), zeros(vs), *keys)
        lse_s, dout_s, delta_s = (self._unscatter(x, per_u, G) for x in (lse, dout, delta))
        for hop in range(lax.axis_size(self.axis_name)):
            if hop:
                chunk = self._shift(chunk)
            dq, dk, dv, *extra = self.core.backward(
                qs, chunk[0], chunk[1], view=self._view(),
                mask=self._hop_mask(key_range, chunk[4:], c, mods, q_pos), scale=self.scale,
                lse=lse_s, dout=dout_s, delta=delta_s, block_sizes=self._blocks,
                grad_dtype=jnp.float32, acc=(dq, chunk[2], chunk[3]))
            dc = extra if dc is None else [a + g for a, g in zip(dc, extra)]
            chunk = chunk[:2] + (dk, dv) + chunk[4:]
        dk, dv = self._shift(chunk[2:4])  # the accumulators' last hop: home
        b, m = q.shape[:2]
        if self._gathers:
            dq = self._rows_back(dq.reshape(b, m, U, G, -1), per_u).reshape(b, m, U * G, -1)
            dk = self._rows_back(dk[:, :, :, None], per_u)[:, :, :, 0]
            dv = self._rows_back(dv[:, :, :, None], per_u)[:, :, :, 0]
        grads = (heads_into(dq, p.q_heads, q.shape), heads_into(dk, p.kv_heads, k.shape),
                 heads_into(dv, p.kv_heads, v.shape), *dc)
        return grads if acc is None else tuple(a + g for a, g in zip(acc, grads, strict=True))


def ring_documents_core(q, k, v, segment_ids, mask: AttentionMask, settings: DilatedSettings,
                        *, axis_name: Hashable, core, mods=None, sinks=None) -> jax.Array:
    """Packed-document dilated attention on the local shard (inside ``shard_map``; contiguous
    layout); ``mask`` holds the global valid lengths. ``segment_ids`` None: one document per
    row (the ring of FlexAttention's options). ``mods``: a :class:`dilax.core.mods.Mods`
    (score / mask mods, soft-cap; no positions: every hop adds the rows' global positions),
    ``sinks (h,)``: one more logit per head in the merged softmax's denominator."""
    if segment_ids is None:
        segment_ids = jnp.zeros(q.shape[:2], _I32)
    b, m, h, d = q.shape
    plans = tuple(dilated_branches(lax.axis_size(axis_name) * m, h, k.shape[2],
                                   settings.segment_lengths, settings.dilation_rates,
                                   settings.mode))
    if settings.local_window is not None:
        plans += (window_plan(m, h, k.shape[2], settings.local_window),)
    ops = tuple(DocumentRingBranch(p, m, h, k.shape[2], float(settings.scale_for(d)),
                                   bool(settings.is_causal), settings.block_sizes, core,
                                   axis_name=axis_name) for p in plans)
    aux = (mask.query_seq_lengths, mask.key_value_seq_lengths,
           *global_document_bounds(segment_ids, axis_name)) + (() if mods is None else (mods,))
    if sinks is None:
        return attend_branches(q, k, v, ops, settings.mode, out_dtype=q.dtype, aux=aux)[0]
    out, lse = attend_branches(q, k, v, ops, settings.mode, aux=aux)
    return with_sinks(out, lse, sinks, q.dtype)[0]


def sharded_documents(q, k, v, mask: AttentionMask, settings: DilatedSettings,
                      sp: SequenceParallel, *, score_mod=None, mask_mod=None, sinks=None,
                      logits_soft_cap=None) -> jax.Array:
    """:func:`dilax.dilated_attention` with ``segment_ids`` or FlexAttention's options, and
    ``sequence_parallel``, on validated arguments (global view): the shard_map of
    :func:`ring_documents_core`. The mods see global positions; the arrays they close over
    and ``sinks`` reach every device whole (replicated), and their gradients are summed
    over the devices."""
    flex = prepare_mods("dilated_attention", q.shape[0], q.shape[2], q.shape[1], q.shape[1],
                        score_mod=score_mod, mask_mod=mask_mod, sinks=sinks,
                        logits_soft_cap=logits_soft_cap)
    if sp.layout != "contiguous":
        what = "segment_ids" if flex is None else "score_mod / mask_mod / sinks / soft-cap"
        raise ValueError(f"{what} with sequence_parallel need layout='contiguous' (the "
                         f"document ring), got {sp.layout!r}")
    flags = None if flex is None else tuple(sorted(flex.request_flags.items()))
    document_core(settings, q.dtype, q.shape[-1], flags, v.shape[-1])  # raises if it cannot serve
    if flex is None:
        return _documents_jit(q, k, v, mask, settings, sp)
    return _documents_jit(q, k, v, mask, settings, sp, core_mods(flex), flex.sinks,
                          flags=flags)


def document_core(settings: DilatedSettings, dtype, head_dim: int, flags=None,
                  value_head_dim: int | None = None):
    """The core of the document ring's hops, as :mod:`dilax.registry` picks it for
    ``settings.implementation`` (the XLA core: the kernels have no per-row key ranges nor
    mods; an explicit other name raises ``ValueError`` with the reason). ``flags``: the
    items of :attr:`dilax.flex.api.FlexMods.request_flags`, or None; ``value_head_dim``: ``dv``
    of ``v (b, n, hk, dv)``, when known."""
    return select(settings.implementation, CoreRequest(
        "ring_hop", dtype, head_dim, settings.is_causal, has_documents=True,
        interpret=settings.interpret, value_head_dim=value_head_dim, **dict(flags or ())))


@functools.partial(jax.jit, static_argnames=("settings", "sp", "flags"))
def _documents_jit(q, k, v, mask, settings, sp, mods=None, sinks=None, flags=None):
    core = document_core(settings, q.dtype, q.shape[-1], flags, v.shape[-1])
    ids = mask.segment_ids
    extra = tuple(x for x in (mods, sinks) if x is not None)

    def body(q, k, v, *rest):
        doc, rest = (rest[0], rest[1:]) if ids is not None else (None, rest)
        q_len, kv_len, *rep = rest
        local = AttentionMask(query_seq_lengths=q_len, key_value_seq_lengths=kv_len,
                              is_causal=mask.is_causal)
        mods_l = rep.pop(0) if mods is not None else None
        sinks_l = rep.pop(0) if sinks is not None else None
        if mods_l is not None and sp.batch_axis is not None:  # the mods' b: global rows
            b = q.shape[0]
            mods_l = dataclasses.replace(mods_l, batch=lax.axis_index(sp.batch_axis) * b
                                         + jnp.arange(b, dtype=_I32))
        return ring_documents_core(q, k, v, doc, local, settings, axis_name=sp.seq_axis,
                                   core=core, mods=mods_l, sinks=sinks_l)

    return shard_sequence(body, sp.mesh, sp.seq_axis, sp.batch_axis, q, k, v,
                          mask.query_seq_lengths, mask.key_value_seq_lengths,
                          per_position=() if ids is None else (ids,), replicated=extra)
