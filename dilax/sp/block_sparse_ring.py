"""Sequence-parallel block-sparse attention: K/V chunks travel between the devices that need them.

The sequence axis is split over the ``P`` devices of a mesh axis, device ``i`` holding the
``n / P`` consecutive positions ``[i n/P, (i+1) n/P)`` of q, k and v (docs/semantics.md, "Ring
attention"). Which device needs which other device's K/V chunk is read off the static block
mask; :func:`dilax.sp.schedule.plan_streams` (the same planner as the dilated ring) turns it
into the fewest ``lax.ppermute`` hops: cyclic rings inside groups of devices that share
blocks, or a right and a left cyclic shift (a local window needs one hop each way, whatever
``P``). With ``is_causal`` device ``i`` needs chunks ``j <= i`` only (contiguous layout, no
zigzag: causal work is unbalanced across devices).

At each hop every device gathers, per local query block, the active key blocks of the visiting
chunk (:func:`dilax.block_sparse_tables.gather_key_blocks`) and runs one
:class:`dilax.core.Core` call on them (the XLA core today); the causal diagonal blocks of the
own chunk are a second, causal call read in place; results merge into a float32 online-softmax
state. A device with no block in the visiting chunk skips it with ``lax.cond``.

The ring is one branch of the one branch runner (:func:`dilax.branches.attend_branches`),
differentiated by hand like the dilated ring: the backward is a second ring
(:func:`dilax.sp.ring_vjp.backward_streams`) in which K, V and their float32 dK/dV
accumulators travel together and every device adds ``core.backward`` of its queries into
them. Per-device memory is O(n / P). Every loop carry and ``cond`` is typed as device-varying:
the ring runs inside a user's ``jax.shard_map`` with its default checks.

Validation happens once, at the public entry (:func:`dilax.block_sparse_attention` with
``sequence_parallel=``, or the aliases below).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Hashable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

from dilax import _validation as V
from dilax.block_sparse_tables import (
    check_pattern,
    default_block_k,
    gather_key_blocks,
    head_layout,
)
from dilax.branches import attend_branches
from dilax.core import XLA, BlockSizes, Core, Mask, SlotView, identity_view, merge_attention_states
from dilax.layout import BranchPlan, plan_branch
from dilax.patterns import BlockSparsePattern, mask_tables
from dilax.sp.config import SequenceParallel, check_sequence_parallel
from dilax.sp.mesh import axis_size, check_sharded_shape, shard_sequence
from dilax.sp.ring_vjp import backward_streams, stream_loop
from dilax.sp.schedule import Stream, needs_matrix, plan_streams
from dilax.utils import varying_like

_F32 = jnp.float32
# Gathered K/V (and, backward, their float32 gradients) of one step of query blocks: a few
# query blocks at a time, so the gather stays small next to a shard.
_ROW_BUDGET_BYTES = 32 * 2**20


@dataclasses.dataclass(frozen=True, eq=False)
class Tables:
    """Key-block tables of local query blocks against one K/V chunk, stacked over entries:
    ``idx[e, u, i]`` the active key blocks (chunk-local, ascending, padded) of query block
    ``i`` of virtual head ``u`` (``Ui``: 1 or ``U``), ``cnt[e, u, i]`` how many."""

    idx: np.ndarray  # (E, Ui, nq_l, A) int32
    cnt: np.ndarray  # (E, Ui, nq_l) int32


def _tables(sub: np.ndarray) -> Tables | None:
    """Tables of the block masks ``sub (E, Ui, nq_l, nk_l)``; None when nothing is active."""
    return Tables(*mask_tables(sub)) if sub.any() else None


@dataclasses.dataclass(frozen=True, eq=False)
class RingPlan:
    """Static plan of a pattern on ``P`` devices: the schedule and the tables of every hop.

    ``needs[i, j]``: device ``i`` attends some key block of device ``j``'s chunk (``i != j``).
    ``own``: entry ``i``, device ``i``'s queries against its own chunk (causal: the blocks
    strictly before the diagonal); ``diag (P, Ui, nq_l)``: the causal diagonal block's keys
    (``B`` or 0), or None; ``own_active (P,)``: device has work on its own chunk. ``pairs``:
    entry ``pair_slot[i, j]`` for every needed pair. None where nothing is active.
    """

    U: int
    G: int
    kvmap: tuple[int, ...]
    needs: np.ndarray
    streams: tuple[Stream, ...]
    own: Tables | None
    diag: np.ndarray | None
    own_active: np.ndarray
    pairs: Tables | None
    pair_slot: np.ndarray

    @property
    def max_blocks(self) -> int:
        """Most key blocks one query block gathers at one hop."""
        return max([t.idx.shape[-1] for t in (self.own, self.pairs) if t is not None] + [1])


@functools.lru_cache(maxsize=64)
def plan_ring(pattern: BlockSparsePattern, num_devices: int, h: int, hk: int,
              is_causal: bool) -> RingPlan:
    """Static per-(device, chunk) tables of ``pattern`` on a ring of ``num_devices``."""
    U, G, kvmap, m = head_layout(pattern.block_mask, h, hk)
    P = num_devices
    nq_l = pattern.num_q_blocks // P
    rows = np.arange(nq_l)

    def sub(i, j):  # (Ui, nq_l, nq_l): query blocks of device i x key blocks of device j
        s = m[:, i * nq_l:(i + 1) * nq_l, j * nq_l:(j + 1) * nq_l]
        return np.zeros_like(s) if is_causal and j > i else s

    own = np.stack([sub(i, i) for i in range(P)])  # (P, Ui, nq_l, nq_l)
    diag = None
    if is_causal:
        diag = (own[:, :, rows, rows] * pattern.block_size).astype(np.int32)
        own = own & (rows[None, :] < rows[:, None])
        diag = diag if diag.any() else None
    own_active = own.reshape(P, -1).any(axis=1)
    if diag is not None:
        own_active |= diag.reshape(P, -1).any(axis=1)
    needs = needs_matrix(P, lambda i, j: bool(sub(i, j).any()))
    pairs = np.argwhere(needs)
    slot = np.zeros((P, P), np.int32)
    slot[pairs[:, 0], pairs[:, 1]] = np.arange(len(pairs))
    hop = _tables(np.stack([sub(i, j) for i, j in pairs])) if len(pairs) else None
    return RingPlan(U, G, kvmap, needs, plan_streams(needs), _tables(own), diag, own_active,
                    hop, slot)


def _per_row(x, b: int, U: int):
    """``(Ui, R)`` or ``(b, Ui, R)`` per query block -> ``(b * R, U)`` (the core's rows)."""
    R = x.shape[-1]
    return jnp.broadcast_to(x, (b, U, R)).transpose(0, 2, 1).reshape(b * R, U)


@dataclasses.dataclass(frozen=True)
class BlockSparseRing:
    """The ring on the local shards, as the one :class:`dilax.branches.BranchOp` of
    :func:`dilax.branches.attend_branches`: ``q (b, n/P, h, d)``, ``k, v (b, n/P, hk, d)``;
    results in the shard's own layout. ``aux``: None or the global valid lengths
    ``(q_len, kv_len)`` (each ``(b,)`` or None). ``rows``: query blocks per step."""

    plan: RingPlan
    result_plan: BranchPlan
    block_size: int
    axis_name: Hashable
    scale: float
    rows: int
    block_k: int
    core: Core = XLA

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
        q_len = self._q_len(aux, first, b)
        qr = q.reshape(b * R, B, -1, d)
        L = None if aux is None else aux[1]
        res = []
        if tabs is not None:
            idx = lax.dynamic_slice_in_dim(jnp.asarray(tabs.idx)[e], g * R, R, axis=1)
            cnt = lax.dynamic_slice_in_dim(jnp.asarray(tabs.cnt)[e], g * R, R, axis=1)
            kv_len = cnt * B  # (Ui, R)
            if L is not None:  # gathered keys are ascending: the valid ones are a prefix
                start = src * m + idx * B  # (Ui, R, A)
                used = jnp.arange(idx.shape[-1])[None, None] < cnt[..., None]
                valid = jnp.clip(L[:, None, None, None] - start[None], 0, B)
                kv_len = jnp.minimum(kv_len[None], jnp.where(used[None], valid, 0).sum(-1))
            kr, vr = (gather_key_blocks(x, idx[None], p.kvmap, B) for x in (kb, vb))
            res.append(fn(idx[None], qr, kr, vr, identity_view(p.U, p.G),
                          Mask(_per_row(kv_len, b, p.U), q_len=q_len),
                          BlockSizes(block_q=B, block_k=min(self.block_k, idx.shape[-1] * B))))
        if diag is not None:
            dl = lax.dynamic_slice_in_dim(jnp.asarray(diag)[me], g * R, R, axis=1)
            if L is not None:
                dl = jnp.minimum(dl[None], jnp.clip(L[:, None, None] - first[None, None], 0, B))
            rows = lambda x: lax.dynamic_slice_in_dim(x, g * R * B, R * B, axis=1).reshape(
                b * R, B, *x.shape[2:])
            res.append(fn(None, qr, rows(kb), rows(vb), self._diag_view(kb.shape[2]),
                          Mask(_per_row(dl, b, p.U), 0, 0, True, q_len),
                          BlockSizes(block_q=B, block_k=B)))
        return res

    def _fold(self, state, q, kb, vb, aux, tabs, e, src, diag=None):
        """Merges the attention of the local queries to chunk ``kb, vb`` into ``state``
        (float32 ``out``, ``lse``), ``rows`` query blocks at a time."""
        RB = self.rows * self.block_size

        def call(idx, qr, kr, vr, view, mask, blocks):
            return self.core.forward(qr, kr, vr, view=view, mask=mask, scale=self.scale,
                                     block_sizes=blocks, out_dtype=_F32)

        def group(g, state):
            out, lse = state
            rows = lambda x: lax.dynamic_slice_in_dim(x, g * RB, RB, axis=1)
            parts = self._group(call, rows(q), kb, vb, aux, tabs, e, src, g, diag)
            o, l = parts[0]
            for o2, l2 in parts[1:]:
                o, l = merge_attention_states(o, l, o2, l2)
            o, l = merge_attention_states(rows(out), rows(lse), o.reshape(rows(out).shape),
                                          l.reshape(rows(lse).shape))
            return (lax.dynamic_update_slice_in_dim(out, o, g * RB, axis=1),
                    lax.dynamic_update_slice_in_dim(lse, l, g * RB, axis=1))

        steps = q.shape[1] // RB
        return group(0, state) if steps == 1 else lax.fori_loop(0, steps, group, state)

    def _grads(self, acc, q, kb, vb, aux, lse, dout, delta, tabs, e, src, diag=None):
        """Adds the gradients of the local queries against chunk ``kb, vb`` into ``acc = (dq,
        dk, dv)`` (float32; dk, dv: the chunk's), ``rows`` query blocks at a time."""
        RB, B = self.rows * self.block_size, self.block_size
        # Only the transpose of the (linear) gather is used: XLA drops its float32 forward.
        scatter = lambda idx: jax.vjp(
            lambda k, v: tuple(gather_key_blocks(x, idx, self.plan.kvmap, B) for x in (k, v)),
            kb.astype(_F32), vb.astype(_F32))[1]

        def group(g, acc):
            dq, dk, dv = acc
            rows = lambda x: lax.dynamic_slice_in_dim(x, g * RB, RB, axis=1)
            flat = lambda x: rows(x).reshape(-1, B, *x.shape[2:])

            def call(idx, qr, kr, vr, view, mask, blocks):
                return idx, self.core.backward(
                    qr, kr, vr, view=view, mask=mask, scale=self.scale, lse=flat(lse),
                    dout=flat(dout), delta=flat(delta), block_sizes=blocks, grad_dtype=_F32)

            parts = self._group(call, rows(q), kb, vb, aux, tabs, e, src, g, diag)
            dq_g = rows(dq)
            for idx, (gq, gk, gv) in parts:
                dq_g = dq_g + gq.reshape(dq_g.shape)
                if idx is not None:  # the gathered blocks' gradients go back to their rows
                    sk, sv = scatter(idx)((gk, gv))
                    dk, dv = dk + sk, dv + sv
                else:  # the diagonal blocks are the rows' own, read in place
                    put = lambda a, x: lax.dynamic_update_slice_in_dim(
                        a, rows(a) + x.reshape(rows(a).shape), g * RB, axis=1)
                    dk, dv = put(dk, gk), put(dv, gv)
            return lax.dynamic_update_slice_in_dim(dq, dq_g, g * RB, axis=1), dk, dv

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
        b, m, h, d = q.shape
        state = (varying_like(jnp.zeros((b, m, h, d), _F32), q, k, v),
                 varying_like(jnp.full((b, m, h), -jnp.inf, _F32), q, k, v))
        state = self._own_only(
            lambda s: self._fold(s, q, k, v, aux, p.own, me, me, p.diag), state)
        for st in p.streams:
            def transfer(carry, first, st=st):
                kb, vb, s = carry
                return (*(lax.ppermute(x, self.axis_name, st.perm) for x in (kb, vb)), s)

            def step(carry, src):
                kb, vb, s = carry
                s = lax.cond(src >= 0, lambda s: self._fold(s, q, kb, vb, aux, p.pairs,
                                                            self._slot(src), src),
                             lambda s: s, s)
                return kb, vb, s

            _, _, state = stream_loop(st, me, step, (k, v, state), transfer)
        return state[0], state[1], None

    def backward(self, q, k, v, aux, res, lse, dout, dlse, delta, acc):
        del res, dlse
        p, me = self.plan, lax.axis_index(self.axis_name)
        if acc is None:
            acc = tuple(varying_like(jnp.zeros(x.shape, _F32), q, k, v, dout) for x in (q, k, v))
        dq, dk, dv = acc

        def visit(acc, kb, vb, src):
            return lax.cond(src >= 0, lambda a: self._grads(
                a, q, kb, vb, aux, lse, dout, delta, p.pairs, self._slot(src), src),
                lambda a: a, acc)

        zeros = lambda x: varying_like(jnp.zeros(x.shape, _F32), x, dq)
        dq, dk_t, dv_t = backward_streams(p.streams, self.axis_name, me, visit, k, v, dq, zeros)
        # The own chunk last, straight into the returned accumulators.
        return self._own_only(lambda a: self._grads(a, q, k, v, aux, lse, dout, delta, p.own,
                                                    me, me, p.diag),
                              (dq, dk + dk_t, dv + dv_t))


def _rows_per_step(nq: int, b: int, A: int, bs: int, U: int, d: int, itemsize: int) -> int:
    """Query blocks per step: the largest divisor of ``nq`` whose gathered K/V and their
    float32 gradients fit :data:`_ROW_BUDGET_BYTES` (at least one)."""
    per_row = 2 * b * A * bs * U * d * (itemsize + 4)
    target = max(1, _ROW_BUDGET_BYTES // max(per_row, 1))
    return max(r for r in range(1, min(nq, target) + 1) if nq % r == 0)


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
) -> jax.Array:
    """Block-sparse attention on a sequence sharded over mesh axis ``axis_name`` (per-device).

    Call inside ``jax.shard_map`` (default checks or ``check_vma=False``) with the sequence
    axis of ``q, k, v`` sharded over ``axis_name`` (``P`` devices, contiguous layout). The
    result is the local shard of :func:`dilax.block_sparse_attention` on the gathered inputs
    (forward and backward); each device holds ``O(n / P)`` of the data and receives only the
    K/V chunks of devices whose key blocks its queries attend.

    Args:
      q: local shard ``(b, n/P, h, d)``; device ``i`` holds positions ``[i n/P, (i+1) n/P)``.
      k, v: local shards ``(b, n/P, hk, d)``, ``h % hk == 0``.
      pattern: the :class:`dilax.patterns.BlockSparsePattern` of the *full* sequence
        (``n / B`` blocks, 1 or ``h`` heads); ``n/P`` must be a multiple of
        ``pattern.block_size``.
      axis_name: the mesh axis (a str) the sequence is split over.
      is_causal, scale: as in :func:`dilax.block_sparse_attention`.
      query_seq_lengths, key_value_seq_lengths: optional int ``(b,)`` valid lengths in GLOBAL
        positions (the same on every device of ``axis_name``), as in
        :func:`dilax.block_sparse_attention`.

    Returns:
      The local shard of the output, ``(b, n/P, h, d)`` in ``q.dtype``.

    Raises:
      TypeError: ``axis_name`` is not a str, ``pattern`` is not a ``BlockSparsePattern``,
        dtypes or ``is_causal`` as in :func:`dilax.block_sparse_attention`.
      ValueError: ``axis_name`` not bound by an enclosing ``shard_map``, ``n/P`` not a
        multiple of ``pattern.block_size``, a pattern that does not fit ``n = P * n/P``, and
        every input error of :func:`dilax.block_sparse_attention`.
    """
    q, k, v = V.check_qkv(q, k, v)
    is_causal = V.check_bool(is_causal, "is_causal")
    scale = V.check_scale(scale, q.shape[3])
    if not isinstance(axis_name, str):
        raise TypeError(f"axis_name must be a mesh axis name (str), got {axis_name!r}")
    P = axis_size(axis_name, "ring_block_sparse_attention", "sharded_block_sparse_attention")
    b, n_l, h, d = q.shape
    if not isinstance(pattern, BlockSparsePattern):
        check_pattern(pattern, q)  # raises the TypeError
    _check_shard(pattern, n_l)
    check_pattern(pattern, jax.ShapeDtypeStruct((b, n_l * P, h, d), q.dtype))
    q_len = V.check_seq_lengths(query_seq_lengths, "query_seq_lengths", b, n_l * P)
    kv_len = V.check_seq_lengths(key_value_seq_lengths, "key_value_seq_lengths", b, n_l * P)
    return ring_block_sparse_core(q, k, v, pattern, is_causal, scale, axis_name, q_len, kv_len)


def _check_shard(pattern: BlockSparsePattern, n_l: int) -> None:
    if n_l % pattern.block_size != 0:
        raise ValueError(
            f"each device's sequence shard (n/P = {n_l}) must be a multiple of the pattern's "
            f"block_size {pattern.block_size} for ring block-sparse attention"
        )


def ring_block_sparse_core(q, k, v, pattern: BlockSparsePattern, is_causal: bool, scale: float,
                           axis_name: str, query_seq_lengths=None, key_value_seq_lengths=None,
                           *, core: Core = XLA) -> jax.Array:
    """:func:`ring_block_sparse_attention` on validated arguments (inside ``shard_map``):
    the :class:`BlockSparseRing` of ``pattern`` run by :func:`attend_branches`, every hop on
    ``core``. Lengths: global, int32 ``(b,)`` or None."""
    P = int(lax.axis_size(axis_name))
    b, m, h, d = q.shape
    hk = k.shape[2]
    plan = plan_ring(pattern, P, h, hk, is_causal)
    bs = pattern.block_size
    rows = _rows_per_step(m // bs, b, plan.max_blocks, bs, plan.U, d, q.dtype.itemsize)
    result = plan_branch(m, h, hk, m, 1, tuple(range(h)), (0,) * h)  # the shard as it is
    op = BlockSparseRing(plan, result, bs, axis_name, float(scale), rows, default_block_k(bs),
                         core)
    aux = None
    if query_seq_lengths is not None or key_value_seq_lengths is not None:
        aux = (query_seq_lengths, key_value_seq_lengths)
    out, _ = attend_branches(q, k, v, (op,), "mixture", out_dtype=q.dtype, aux=aux)
    return out


def check_sharded_block_sparse(q: jax.Array, pattern: BlockSparsePattern,
                               sp: SequenceParallel) -> None:
    """The mesh rules of a sequence-parallel block-sparse call on validated ``q`` and
    ``pattern`` (global view): ``n`` and the batch divide over the mesh, shards are whole
    pattern blocks, contiguous layout."""
    check_sequence_parallel(sp, None, layouts=("contiguous",))
    P = check_sharded_shape(q, sp.mesh, sp.seq_axis, sp.batch_axis)
    _check_shard(pattern, q.shape[1] // P)


def sharded_block_sparse(q, k, v, pattern: BlockSparsePattern, is_causal: bool, scale: float,
                         sp: SequenceParallel, query_seq_lengths=None,
                         key_value_seq_lengths=None) -> jax.Array:
    """The shard_map of :func:`ring_block_sparse_core` over ``sp.mesh`` (validated arguments;
    lengths int32 ``(b,)`` or None), compiled once per static configuration."""
    if q.shape[0] == 0:  # nothing to shard: an empty result (and empty gradients)
        return V.empty_batch(q, v)
    return _sharded_jit(q, k, v, query_seq_lengths, key_value_seq_lengths, pattern=pattern,
                        is_causal=bool(is_causal), scale=float(scale), sp=sp)


@functools.partial(jax.jit, static_argnames=("pattern", "is_causal", "scale", "sp"))
def _sharded_jit(q, k, v, q_len, kv_len, *, pattern, is_causal, scale, sp):
    body = lambda q, k, v, q_len=None, kv_len=None: ring_block_sparse_core(  # noqa: E731
        q, k, v, pattern, is_causal, scale, sp.seq_axis, q_len, kv_len)
    return shard_sequence(body, sp.mesh, sp.seq_axis, sp.batch_axis, q, k, v, q_len, kv_len)


def sharded_block_sparse_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    pattern: BlockSparsePattern,
    *,
    mesh: Mesh,
    seq_axis: str = "sp",
    batch_axis: str | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
) -> jax.Array:
    """Sequence-parallel block-sparse attention over ``mesh`` (global view; builds the shard_map).

    An alias of ``dilax.block_sparse_attention(q, k, v, pattern, ...,
    sequence_parallel=dilax.SequenceParallel(mesh, seq_axis, batch_axis))``. Runs
    :func:`ring_block_sparse_attention` on every device of ``mesh`` (contiguous layout);
    the result equals :func:`dilax.block_sparse_attention` on the same inputs, forward and
    backward, while each device holds ``O(n / P)`` of the data.

    Args:
      q: ``(b, n, h, d)``; k, v: ``(b, n, hk, d)`` with ``h % hk == 0``, natural position
        order.
      pattern: the :class:`dilax.patterns.BlockSparsePattern` of the full sequence.
      mesh: a ``jax.sharding.Mesh``; the sequence is split over ``seq_axis`` (``P`` devices;
        ``n % P == 0`` and ``(n / P) % pattern.block_size == 0``) and, optionally, the batch
        over ``batch_axis``.
      is_causal, scale, query_seq_lengths, key_value_seq_lengths: as in
        :func:`dilax.block_sparse_attention` (lengths sharded over ``batch_axis``).

    Returns:
      ``(b, n, h, d)`` in ``q.dtype``, sharded like ``q``; equal to
      ``block_sparse_attention(q, k, v, pattern, ...)``.

    Raises:
      TypeError: ``mesh`` is not a ``Mesh``; ``pattern`` or dtypes as in
        :func:`dilax.block_sparse_attention`.
      ValueError: ``seq_axis``/``batch_axis`` not mesh axes or equal, ``n % P != 0``,
        ``n / P`` not a multiple of ``pattern.block_size``, batch not divisible by the
        ``batch_axis`` size, a pattern that does not fit ``n``, and every input error of
        :func:`dilax.block_sparse_attention`.
    """
    sp = SequenceParallel(mesh, seq_axis, batch_axis)
    q, k, v = V.check_qkv(q, k, v)
    pattern = check_pattern(pattern, q)
    is_causal = V.check_bool(is_causal, "is_causal")
    scale = V.check_scale(scale, q.shape[3])
    b, n = q.shape[:2]
    q_len = V.check_seq_lengths(query_seq_lengths, "query_seq_lengths", b, n)
    kv_len = V.check_seq_lengths(key_value_seq_lengths, "key_value_seq_lengths", b, n)
    check_sharded_block_sparse(q, pattern, sp)
    return sharded_block_sparse(q, k, v, pattern, is_causal, scale, sp, q_len, kv_len)
