"""Sequence-parallel block-sparse attention: K/V chunks travel between the devices that need them.

The sequence axis is split over the ``P`` devices of a mesh axis, device ``i`` holding the
``n / P`` consecutive positions ``[i n/P, (i+1) n/P)`` of q, k and v (docs/semantics.md, "Ring
attention"). Packed documents (``segment_ids``): each device finds the global bounds of its
positions' documents (:func:`dilax.sp.documents.global_document_bounds`) and every core call
gets per-row key ranges: the pattern on row positions AND same document (XLA core).

Which device needs which other device's K/V chunk is read off the static block mask;
:func:`dilax.sp.schedule.plan_streams` (the same planner as the dilated ring) turns it into the
fewest ``lax.ppermute`` hops: cyclic rings inside groups of devices that share
blocks, or a right and a left cyclic shift (a local window needs one hop each way, whatever
``P``). With ``is_causal`` device ``i`` needs chunks ``j <= i`` only (contiguous layout, no
zigzag: causal work is unbalanced across devices).

The hops run on the core :mod:`dilax.registry` picks (a ``"ring_hop"`` request with the
pattern's block size; :func:`hop_core`). The XLA core: every device gathers, per local query
block, the active key blocks of the visiting chunk
(:func:`dilax.block_sparse.tables.gather_key_blocks`) and runs one core call on them; the
causal diagonal blocks of the own chunk are a second, causal call read in place. The Pallas
block-sparse kernel (``implementation="pallas"``, or None on GPU): ONE kernel call per
visiting chunk, read in place through per-hop tables (:class:`dilax.block_sparse.ring_plan.
KernelHops`), the own chunk's causal diagonal included; no XLA matmul is left. Results merge
into a float32 online-softmax state. A device with no block in the visiting chunk skips it
with ``lax.cond``.

The ring is one branch of the one branch runner (:func:`dilax.branch.runner.attend_branches`),
differentiated by hand like the dilated ring: the backward is a second ring
(:func:`dilax.sp.ring_vjp.backward_streams`) in which K, V and their float32 dK/dV
accumulators travel together and every device adds ``core.backward`` of its queries into
them. Per-device memory is O(n / P). Every loop carry and ``cond`` is typed as device-varying:
on the XLA core the ring runs inside a user's ``jax.shard_map`` with its default checks (the
Pallas kernel's outputs carry no such type: ``check_vma=False`` with it).

Validation happens once, at the public entry (:func:`dilax.block_sparse_attention` with
``sequence_parallel=``, or the aliases below).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable

import jax
import jax.numpy as jnp
from jax import lax

from dilax import _validation as V
from dilax.attention_mask import (
    AttentionMask,
    check_segment_ids,
    take_attention_mask,
    unpack_attention_mask,
)
from dilax.block_sparse.ring_plan import (  # noqa: F401 - plan_ring: the ring's plan, re-exported
    KernelHops,
    RingPlan,
    hop_core,
    plan_kernel_hops,
    plan_ring,
)
from dilax.block_sparse.tables import (
    check_pattern,
    default_block_k,
    document_ranges,
    gather_key_blocks,
    row_mods,
    rows_per_step,
)
from dilax.branch.plan import BranchPlan, plan_branch
from dilax.branch.runner import attend_branches
from dilax.core import (
    XLA,
    BlockSizes,
    Core,
    KeyBounds,
    Mask,
    SlotView,
    identity_view,
    merge_attention_states,
)
from dilax.core.arrays import (
    dynamic_slice_in_dim,
    dynamic_update_slice_in_dim,
    varying_axes,
    varying_like,
)
from dilax.flex.api import core_mods, prepare_mods, with_sinks
from dilax.patterns import BlockSparsePattern
from dilax.sp.documents import global_document_bounds
from dilax.sp.mesh import axis_size
from dilax.sp.ring_vjp import backward_streams, stream_loop

_F32 = jnp.float32


def _per_row(x, b: int, U: int):
    """``(Ui, R)`` or ``(b, Ui, R)`` per query block -> ``(b * R, U)`` (the core's rows)."""
    R = x.shape[-1]
    return jnp.broadcast_to(x, (b, U, R)).transpose(0, 2, 1).reshape(b * R, U)


@dataclasses.dataclass(frozen=True)
class BlockSparseRing:
    """The ring on the local shards, as the one :class:`dilax.branch.runner.BranchOp` of
    :func:`dilax.branch.runner.attend_branches`: ``q (b, n/P, h, d)``, ``k, v (b, n/P, hk, d)``;
    results in the shard's own layout. ``aux``: None or the global valid lengths
    ``(q_len, kv_len)`` (each ``(b,)`` or None), then, with packed documents, the global
    document bounds ``(start, end)`` ``(b, n/P)`` of the local rows. ``rows``: query blocks
    per step.
    ``hops``: the Pallas block-sparse kernel runs every hop (one call per chunk, tables of
    :class:`~dilax.block_sparse.ring_plan.KernelHops`), else ``core`` on gathered blocks."""

    plan: RingPlan
    result_plan: BranchPlan
    block_size: int
    axis_name: Hashable
    scale: float
    rows: int
    block_k: int
    core: Core = XLA
    hops: KernelHops | None = None
    with_mods: bool = False  # aux[-1]: score / mask mods (dilax.core.mods.Mods), row positions

    def _diag_view(self, hk: int) -> SlotView:
        """Queries and the own chunk's K/V in place: virtual head ``u`` reads ``kvmap[u]``."""
        p = self.plan
        return SlotView(1, p.U * p.G, hk, tuple(range(p.U * p.G)), p.kvmap)

    def _q_len(self, aux, first, b):
        """Valid rows ``(b * R, 1)`` of the query blocks starting at ``first (R,)``, or None."""
        if aux is None or aux[0] is None:
            return None
        return jnp.clip(aux[0][:, None] - first[None], 0, self.block_size).reshape(-1, 1)

    def _group(self, fn, q, kb, vb, aux, tabs, e, src, g, diag):
        """The core calls of query blocks ``g * R ...`` (rows of ``q (b, R B, h, d)``) against
        chunk ``kb, vb`` of device ``src`` with entry ``e`` of ``tabs`` (and the causal
        diagonals ``diag (P, Ui, nq_l)`` of the own chunks): ``fn(idx, qr, kr, vr, view, mask,
        block_sizes)`` per call, ``idx``: the gathered blocks ``(1, Ui, R, A)`` or None (the
        diagonal, read in place)."""
        B, R, p = self.block_size, self.rows, self.plan
        b, m, d = q.shape[0], kb.shape[1], q.shape[-1]
        me = lax.axis_index(self.axis_name)
        blocks = g * R + jnp.arange(R)
        first = me * m + blocks * B  # global first position of each query block
        mods, aux = (aux[-1], aux[:-1]) if self.with_mods else (None, aux)
        mods_g = mods_d = None
        if mods is not None:  # the mods see global positions, never gathered indices
            gidx = None if tabs is None else (dynamic_slice_in_dim(
                jnp.asarray(tabs.idx)[e], g * R, R, axis=1) + src * (m // B))[None]
            mods_g, mods_d = row_mods(mods, gidx, b, R, B, first)
        q_len = self._q_len(aux, first, b)
        qr = q.reshape(b * R, B, -1, d)
        L = None if aux is None else aux[1]
        res, ranges = [], {}
        if tabs is not None:
            idx = dynamic_slice_in_dim(jnp.asarray(tabs.idx)[e], g * R, R, axis=1)
            cnt = dynamic_slice_in_dim(jnp.asarray(tabs.cnt)[e], g * R, R, axis=1)
        if aux is not None and len(aux) > 2:  # documents: the key runs of the rows' documents
            doc = tuple(dynamic_slice_in_dim(x, g * R * B, R * B, axis=1) for x in aux[2:])
            ranges["gathered"], ranges["diag"] = document_ranges(
                (*doc, None, None), None if tabs is None else idx[None],
                None if tabs is None else cnt[None] * B, b, p.U, B, first, src * m)
        if tabs is not None:
            kv_len = cnt * B  # (Ui, R)
            if L is not None:  # gathered keys are ascending: the valid ones are a prefix
                start = src * m + idx * B  # (Ui, R, A)
                used = jnp.arange(idx.shape[-1])[None, None] < cnt[..., None]
                valid = jnp.clip(L[:, None, None, None] - start[None], 0, B)
                kv_len = jnp.minimum(kv_len[None], jnp.where(used[None], valid, 0).sum(-1))
            kr, vr = (gather_key_blocks(x, idx[None], p.kvmap, B) for x in (kb, vb))
            key_range, query_range = ranges.get("gathered") or (None, None)
            res.append(fn(idx[None], qr, kr, vr, identity_view(p.U, p.G),
                          Mask(KeyBounds(_per_row(kv_len, b, p.U), q_len=q_len,
                                         key_range=key_range, query_range=query_range),
                               mods=mods_g),
                          BlockSizes(block_q=B, block_k=min(self.block_k, idx.shape[-1] * B))))
        if diag is not None:
            dl = dynamic_slice_in_dim(jnp.asarray(diag)[me], g * R, R, axis=1)
            if L is not None:
                dl = jnp.minimum(dl[None], jnp.clip(L[:, None, None] - first[None, None], 0, B))
            rows = lambda x: dynamic_slice_in_dim(x, g * R * B, R * B, axis=1).reshape(
                b * R, B, *x.shape[2:])
            diag_range = ranges.get("diag")
            res.append(fn(None, qr, rows(kb), rows(vb), self._diag_view(kb.shape[2]),
                          Mask(KeyBounds(_per_row(dl, b, p.U), 0, 0, True, q_len,
                                         key_range=diag_range, query_range=diag_range),
                               mods=mods_d),
                          BlockSizes(block_q=B, block_k=B)))
        return res

    def _entry(self, own: bool):
        """The tables (and causal diagonals) of the own chunk's or the pairs' entries."""
        return (self.plan.own, self.plan.diag) if own else (self.plan.pairs, None)

    def _fold(self, state, q, kb, vb, aux, own, e, src):
        """Merges the attention of the local queries to chunk ``kb, vb`` of device ``src``
        (entry ``e`` of the ``own`` or the pair tables) into ``state`` (float32 ``out``,
        ``lse``), ``rows`` query blocks at a time (one kernel call with ``hops``)."""
        if self.hops is not None:
            o, l = self.hops.attend(q, kb, vb, aux, own, e, src, scale=self.scale,
                                    axis_name=self.axis_name)
            return merge_attention_states(*state, o, l)
        RB = self.rows * self.block_size
        tabs, diag = self._entry(own)

        def call(idx, qr, kr, vr, view, mask, blocks):
            return self.core.forward(qr, kr, vr, view=view, mask=mask, scale=self.scale,
                                     block_sizes=blocks, out_dtype=_F32)

        def group(g, state):
            out, lse = state
            rows = lambda x: dynamic_slice_in_dim(x, g * RB, RB, axis=1)
            parts = self._group(call, rows(q), kb, vb, aux, tabs, e, src, g, diag)
            o, l = parts[0]
            for o2, l2 in parts[1:]:
                o, l = merge_attention_states(o, l, o2, l2)
            o, l = merge_attention_states(rows(out), rows(lse), o.reshape(rows(out).shape),
                                          l.reshape(rows(lse).shape))
            return (dynamic_update_slice_in_dim(out, o, g * RB, axis=1),
                    dynamic_update_slice_in_dim(lse, l, g * RB, axis=1))

        steps = q.shape[1] // RB
        return group(0, state) if steps == 1 else lax.fori_loop(0, steps, group, state)

    def _grads(self, acc, q, kb, vb, aux, lse, dout, delta, own, e, src):
        """Adds the gradients of the local queries against chunk ``kb, vb`` (as in
        :meth:`_fold`) into ``acc = (dq, dk, dv)`` (float32; dk, dv: the chunk's)."""
        if self.hops is not None:
            grads = self.hops.grads(q, kb, vb, aux, own, e, src, scale=self.scale,
                                    axis_name=self.axis_name, lse=lse, dout=dout, delta=delta)
            return tuple(a + g for a, g in zip(acc, grads))
        RB, B = self.rows * self.block_size, self.block_size
        tabs, diag = self._entry(own)
        # Only the transpose of the (linear) gather is used: XLA drops its float32 forward.
        scatter = lambda idx: jax.vjp(
            lambda k, v: tuple(gather_key_blocks(x, idx, self.plan.kvmap, B) for x in (k, v)),
            kb.astype(_F32), vb.astype(_F32))[1]

        def group(g, acc):
            dq, dk, dv, *dc = acc  # dc: the mods' consts' cotangents, or []
            rows = lambda x: dynamic_slice_in_dim(x, g * RB, RB, axis=1)
            flat = lambda x: rows(x).reshape(-1, B, *x.shape[2:])

            def call(idx, qr, kr, vr, view, mask, blocks):
                return idx, self.core.backward(
                    qr, kr, vr, view=view, mask=mask, scale=self.scale, lse=flat(lse),
                    dout=flat(dout), delta=flat(delta), block_sizes=blocks, grad_dtype=_F32)

            parts = self._group(call, rows(q), kb, vb, aux, tabs, e, src, g, diag)
            dq_g = rows(dq)
            for idx, (gq, gk, gv, *gc) in parts:
                dq_g = dq_g + gq.reshape(dq_g.shape)
                dc = [a + c for a, c in zip(dc, gc)]
                if idx is not None:  # the gathered blocks' gradients go back to their rows
                    sk, sv = scatter(idx)((gk, gv))
                    dk, dv = dk + sk, dv + sv
                else:  # the diagonal blocks are the rows' own, read in place
                    put = lambda a, x: dynamic_update_slice_in_dim(
                        a, rows(a) + x.reshape(rows(a).shape), g * RB, axis=1)
                    dk, dv = put(dk, gk), put(dv, gv)
            return dynamic_update_slice_in_dim(dq, dq_g, g * RB, axis=1), dk, dv, *dc

        steps = q.shape[1] // RB
        return group(0, acc) if steps == 1 else lax.fori_loop(0, steps, group, acc)

    def _own_only(self, fn, carry):
        """``fn(carry)`` on the devices with work on their own chunk (``carry`` elsewhere)."""
        active = self.plan.own_active
        if active.all():
            return fn(carry)
        me = lax.axis_index(self.axis_name)
        return lax.cond(jnp.asarray(active)[me], fn, lambda c: c, carry)

    def _slot(self, src):
        me = lax.axis_index(self.axis_name)
        return jnp.asarray(self.plan.pair_slot)[me, jnp.maximum(src, 0)]

    def forward(self, q, k, v, aux):
        p, me = self.plan, lax.axis_index(self.axis_name)
        b, m, h = q.shape[:3]
        # the output's head dim is the values' (dv may differ from d)
        state = (varying_like(jnp.zeros((b, m, h, v.shape[-1]), _F32), q, k, v),
                 varying_like(jnp.full((b, m, h), -jnp.inf, _F32), q, k, v))
        state = self._own_only(
            lambda s: self._fold(s, q, k, v, aux, True, me, me), state)
        for st in p.streams:
            def transfer(carry, first, st=st):
                kb, vb, s = carry
                return (*(lax.ppermute(x, self.axis_name, st.perm) for x in (kb, vb)), s)

            def step(carry, src):
                kb, vb, s = carry
                s = lax.cond(src >= 0, lambda s: self._fold(s, q, kb, vb, aux, False,
                                                            self._slot(src), src),
                             lambda s: s, s)
                return kb, vb, s

            _, _, state = stream_loop(st, me, step, (k, v, state), transfer)
        return state[0], state[1], None

    def backward(self, q, k, v, aux, res, lse, dout, dlse, delta, acc):
        del res, dlse
        p, me = self.plan, lax.axis_index(self.axis_name)
        consts = () if not self.with_mods else tuple(  # the float consts' cotangents
            c for c in aux[-1].score_consts if jnp.issubdtype(c.dtype, jnp.inexact))
        if acc is None:
            acc = tuple(varying_like(jnp.zeros(x.shape, _F32), q, k, v, dout)
                        for x in (q, k, v, *consts))
        dq, dk, dv, *dc = acc

        def visit(acc, kb, vb, src):  # acc: ((dq, *dc) staying home, the visitors' dk, dv)
            (dq, *dc), dkb, dvb = acc
            dq, dkb, dvb, *dc = lax.cond(src >= 0, lambda a: self._grads(
                a, q, kb, vb, aux, lse, dout, delta, False, self._slot(src), src),
                lambda a: a, (dq, dkb, dvb, *dc))
            return (dq, *dc), dkb, dvb

        zeros = lambda x: varying_like(jnp.zeros(x.shape, _F32), x, dq)
        (dq, *dc), dk_t, dv_t = backward_streams(p.streams, self.axis_name, me, visit, k, v,
                                                 (dq, *dc), zeros)
        # The own chunk last, straight into the returned accumulators.
        return self._own_only(lambda a: self._grads(a, q, k, v, aux, lse, dout, delta, True,
                                                    me, me),
                              (dq, dk + dk_t, dv + dv_t, *dc))


def ring_block_sparse_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    pattern: BlockSparsePattern,
    *,
    axis_name: str,
    is_causal: bool = False,
    scale: float | None = None,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    implementation: str | None = None,
    interpret: bool = False,
    segment_ids: jax.Array | None = None,
    attention_mask: AttentionMask | None = None,
    mask: AttentionMask | None = None,
    score_mod: Callable | None = None,
    mask_mod: Callable | None = None,
    sinks: jax.Array | None = None,
    logits_soft_cap: float | None = None,
) -> jax.Array:
    """Block-sparse attention on a sequence sharded over mesh axis ``axis_name`` (per-device).

    Call inside ``jax.shard_map`` (default checks or ``check_vma=False``) with the sequence
    axis of ``q, k, v`` sharded over ``axis_name`` (``P`` devices, contiguous layout). The
    result is the local shard of :func:`dilax.block_sparse_attention` on the gathered inputs
    (forward and backward); each device holds ``O(n / P)`` of the data and receives only the
    K/V chunks of devices whose key blocks its queries attend.

    Args:
      q: local shard ``(b, n/P, h, d)``; device ``i`` holds positions ``[i n/P, (i+1) n/P)``.
      k, v: local shards ``(b, n/P, hk, d)``, ``h % hk == 0``; ``v`` may have its own head
        dim ``(b, n/P, hk, dv)`` (XLA hops; the Pallas kernel refuses ``dv != d``).
      pattern: the :class:`dilax.patterns.BlockSparsePattern` of the *full* sequence
        (``n / B`` blocks, 1 or ``h`` heads); ``n/P`` must be a multiple of
        ``pattern.block_size``.
      axis_name: the mesh axis (a str) the sequence is split over.
      is_causal, scale: as in :func:`dilax.block_sparse_attention`.
      query_seq_lengths, key_value_seq_lengths: optional int ``(b,)`` valid lengths in GLOBAL
        positions (the same on every device of ``axis_name``), as in
        :func:`dilax.block_sparse_attention`.
      implementation: the core of the hops, as :mod:`dilax.registry` picks it for a
        ``"ring_hop"`` request with the pattern's block size: ``"pallas"`` (the block-sparse
        kernel, one call per visiting chunk; its rules as for
        :func:`dilax.block_sparse_attention`), ``"xla"``, or None (Pallas on GPU where it
        serves, or with ``interpret``; XLA otherwise).
      interpret: run the Pallas kernel in the interpreter (CPU testing).
      segment_ids: optional int ``(b, n/P)``: packed documents, this device's shard of the
        global ``(b, n)`` document ids (sharded like ``q``; documents may cross shard
        boundaries). The pattern is on row positions AND same document, exactly as
        :func:`dilax.block_sparse_attention` with ``segment_ids`` on the gathered inputs
        (docs/semantics.md, "Packed documents"). XLA core only (the kernel has no per-row
        key ranges).
      attention_mask: a :class:`dilax.AttentionMask` instead of ``is_causal`` / the lengths /
        ``segment_ids`` (lengths global, ``segment_ids`` the local shard; build it with
        ``AttentionMask.build(q, ..., seq_len=n)``). Its ``key_padding_mask`` is refused
        (``ValueError``): pass ``key_value_seq_lengths`` or ``segment_ids``.
      mask: the deprecated spelling of ``attention_mask`` (warns).
      score_mod, mask_mod, sinks, logits_soft_cap: FlexAttention's options, as in
        :func:`dilax.block_sparse_attention`: ``q_idx``, ``kv_idx`` GLOBAL row positions on
        every device, ``b`` the local batch row; arrays the mods close over must hold what
        they index by global position on every device (e.g. the global document ids,
        replicated); gradients into closed-over float arrays are summed over
        ``axis_name``. XLA hops only (the Pallas kernel refuses them, the registry's reason).

    Returns:
      The local shard of the output, ``(b, n/P, h, dv)`` in ``q.dtype``.

    Raises:
      TypeError: ``axis_name`` is not a str, ``pattern`` is not a ``BlockSparsePattern``,
        ``attention_mask`` together with the keywords it holds, dtypes or ``is_causal`` as in
        :func:`dilax.block_sparse_attention`.
      ValueError: ``axis_name`` not bound by an enclosing ``shard_map``, ``n/P`` not a
        multiple of ``pattern.block_size``, a pattern that does not fit ``n = P * n/P``, an
        ``implementation`` that cannot serve the hops (the registry's reason), the Pallas
        kernel under ``shard_map(check_vma=True)`` (its outputs carry no device-varying type:
        use ``check_vma=False``), ``attention_mask.key_padding_mask``, ``segment_ids`` with
        ``implementation="pallas"``, and every input error of
        :func:`dilax.block_sparse_attention`.
    """
    q, k, v = V.check_qkv(q, k, v, value_head_dim=True)
    attention_mask = take_attention_mask(attention_mask, mask, "ring_block_sparse_attention")
    if attention_mask is not None:
        is_causal, query_seq_lengths, key_value_seq_lengths, segment_ids = unpack_attention_mask(
            attention_mask, "ring_block_sparse_attention", is_causal,
            query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
            segment_ids=segment_ids)
    is_causal = V.check_bool(is_causal, "is_causal")
    scale = V.check_scale(scale, q.shape[3])
    if not isinstance(axis_name, str):
        raise TypeError(f"axis_name must be a mesh axis name (str), got {axis_name!r}")
    P = axis_size(axis_name, "ring_block_sparse_attention", "block_sparse_attention")
    b, n_l, h, d = q.shape
    if not isinstance(pattern, BlockSparsePattern):
        check_pattern(pattern, q)  # raises the TypeError
    check_shard(pattern, n_l)
    check_pattern(pattern, jax.ShapeDtypeStruct((b, n_l * P, h, d), q.dtype))
    q_len = V.check_seq_lengths(query_seq_lengths, "query_seq_lengths", b, n_l * P)
    kv_len = V.check_seq_lengths(key_value_seq_lengths, "key_value_seq_lengths", b, n_l * P)
    segment_ids = check_segment_ids(segment_ids, b, n_l)  # the local shard, like q
    flex = prepare_mods("ring_block_sparse_attention", b, h, n_l * P, n_l * P,
                        score_mod=score_mod, mask_mod=mask_mod, sinks=sinks,
                        logits_soft_cap=logits_soft_cap)
    core = hop_core(implementation, V.check_bool(interpret, "interpret"), q, pattern,
                    is_causal, q_len is not None or kv_len is not None, segment_ids is not None,
                    flags=() if flex is None else tuple(flex.request_flags.items()),
                    value_head_dim=v.shape[-1])
    if core.name != "xla" and varying_axes(q, k, v):
        raise ValueError(
            "the ring's hops run the Pallas kernel here, whose outputs carry no device-varying "
            "type: call ring_block_sparse_attention inside jax.shard_map(..., check_vma=False), "
            "or use implementation='xla'")
    return ring_block_sparse_core(q, k, v, pattern, is_causal, scale, axis_name, q_len, kv_len,
                                  core=core, segment_ids=segment_ids, mods=core_mods(flex),
                                  sinks=flex and flex.sinks)


def check_shard(pattern: BlockSparsePattern, n_l: int) -> None:
    if n_l % pattern.block_size != 0:
        raise ValueError(
            f"each device's sequence shard (n/P = {n_l}) must be a multiple of the pattern's "
            f"block_size {pattern.block_size} for ring block-sparse attention"
        )


def ring_block_sparse_core(q, k, v, pattern: BlockSparsePattern, is_causal: bool, scale: float,
                           axis_name: str, query_seq_lengths=None, key_value_seq_lengths=None,
                           *, core: Core = XLA, segment_ids=None, mods=None,
                           sinks=None) -> jax.Array:
    """:func:`ring_block_sparse_attention` on validated arguments (inside ``shard_map``):
    the :class:`BlockSparseRing` of ``pattern`` run by :func:`attend_branches`, every hop on
    ``core``: a ``"pallas"`` core (its ``interpret`` kept) runs the block-sparse kernel on
    each visiting chunk (:class:`KernelHops`), any other core the gathered key blocks.
    Lengths: global, int32 ``(b,)`` or None; ``segment_ids``: the local shard ``(b, n/P)`` of
    the document ids, or None (the XLA core only). ``mods``: a :class:`dilax.core.mods.Mods`
    (no positions: each call adds the global ones) and ``sinks (h,)``, or None (XLA core)."""
    P = int(lax.axis_size(axis_name))
    b, m, h, d = q.shape
    hk = k.shape[2]
    plan = plan_ring(pattern, P, h, hk, is_causal)
    bs = pattern.block_size
    rows = rows_per_step(m // bs, b, plan.max_blocks, bs, plan.U, d, q.dtype.itemsize, ring=True)
    result = plan_branch(m, h, hk, m, 1, tuple(range(h)), (0,) * h)  # the shard as it is
    hops = None
    if core.name == "pallas":
        hops = plan_kernel_hops(pattern, plan, P, is_causal, getattr(core, "interpret", False))
    if hops is not None and (mods is not None or sinks is not None):
        raise ValueError("score_mod / mask_mod / logits_soft_cap / sinks need the XLA core for "
                         "the ring's hops: the Pallas block-sparse kernel has no mods yet")
    op = BlockSparseRing(plan, result, bs, axis_name, float(scale), rows, default_block_k(bs),
                         core, hops, mods is not None)
    aux = None
    if segment_ids is not None:
        if hops is not None:
            raise ValueError("segment_ids (packed documents) need the XLA core for the ring's "
                             "hops: the Pallas block-sparse kernel has no per-row key ranges")
        aux = (query_seq_lengths, key_value_seq_lengths,
               *global_document_bounds(segment_ids, axis_name))
    elif query_seq_lengths is not None or key_value_seq_lengths is not None:
        aux = (query_seq_lengths, key_value_seq_lengths)
    if mods is not None:  # the last entry of aux (BlockSparseRing.with_mods)
        aux = (*(aux or (None, None)), mods)
    if sinks is None:
        return attend_branches(q, k, v, (op,), "mixture", out_dtype=q.dtype, aux=aux)[0]
    out, lse = attend_branches(q, k, v, (op,), "mixture", aux=aux)
    return with_sinks(out, lse, sinks, q.dtype)[0]
