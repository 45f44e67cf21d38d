"""Sequence-parallel block-sparse attention: K/V chunks travel between the devices that need them.

The sequence axis is split over the ``P`` devices of a mesh axis, device ``i`` holding the
``n / P`` consecutive positions ``[i n/P, (i+1) n/P)`` of q, k and v (docs/semantics.md, "Ring
attention"). Which device needs which other device's K/V chunk is read off the static block
mask; :func:`dilax.sp.schedule.plan_streams` (the same planner as the dilated ring) turns it
into the fewest ``lax.ppermute`` hops: cyclic rings inside groups of devices that share
blocks, or a right and a left cyclic shift (a local window needs one hop each way, whatever
``P``). At each hop every device folds the active key blocks of the visiting chunk into its
queries' softmax state: the same gather + :func:`dilax.core.attention_core` as the
single-device path, merged with :func:`dilax.core.merge_attention_states`. A device that has
no active block in the visiting chunk skips its compute with ``lax.cond``; a hop where no
device has work computes nothing. With ``is_causal`` device ``i`` needs chunks ``j <= i``
only (the diagonal blocks live in its own chunk); the layout is the plain contiguous one (no
zigzag), so causal work is unbalanced across devices.

Per-device memory is O(n / P): one K/V chunk in flight per stream plus the gathered active
blocks of the local query blocks. The backward pass is JAX's transpose of the forward
(ppermutes in reverse).

Validation happens once, at the public entry (:func:`dilax.block_sparse_attention` with
``sequence_parallel=``, or the aliases below); :func:`sharded_block_sparse` and
:func:`ring_block_sparse_core` take validated arguments.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

from dilax import _validation as V
from dilax.block_sparse_tables import check_pattern, head_layout, sparse_attention_tables
from dilax.core import merge_attention_states
from dilax.patterns import BlockSparsePattern, mask_tables
from dilax.sp.config import SequenceParallel, check_sequence_parallel
from dilax.sp.mesh import axis_size, check_sharded_shape, shard_sequence
from dilax.sp.schedule import Stream, needs_matrix, plan_streams


@dataclasses.dataclass(frozen=True, eq=False)
class _HopTables:
    """What every device computes at one hop (tables stacked over the ``P`` devices)."""

    idx: np.ndarray  # (P, Ui, nq_l, A) int32, local key-block indices in the visiting chunk
    kv_len: np.ndarray  # (P, Ui, nq_l) int32
    diag_len: np.ndarray | None  # (P, Ui, nq_l) int32 (own chunk, causal) or None
    gather: bool  # any gathered key at this hop
    active: np.ndarray  # (P,) bool: device has any work at this hop


@dataclasses.dataclass(frozen=True, eq=False)
class RingPlan:
    """Static plan of a pattern on ``P`` devices: the schedule and the tables of every hop.

    ``needs[i, j]``: device ``i`` attends some key block of device ``j``'s chunk (``i != j``).
    ``own``: tables of hop 0 (every device's own chunk); ``hops[s][t]``: tables of hop
    ``t + 1`` of ``streams[s]``. None where no device has work.
    """

    U: int
    G: int
    kvmap: tuple[int, ...]
    needs: np.ndarray
    streams: tuple[Stream, ...]
    own: _HopTables | None
    hops: tuple[tuple[_HopTables | None, ...], ...]


@functools.lru_cache(maxsize=64)
def plan_ring(pattern: BlockSparsePattern, num_devices: int, h: int, hk: int,
              is_causal: bool) -> RingPlan:
    """Static per-(hop, device) tables of ``pattern`` on a ring of ``num_devices``."""
    U, G, kvmap, m = head_layout(pattern.block_mask, h, hk)
    P = num_devices
    nq_l = pattern.num_q_blocks // P
    rows = np.arange(nq_l)
    bs = pattern.block_size

    def sub(i, j):  # (Ui, nq_l, nq_l): query blocks of device i x key blocks of device j
        s = m[:, i * nq_l:(i + 1) * nq_l, j * nq_l:(j + 1) * nq_l]
        return np.zeros_like(s) if is_causal and j > i else s

    def tables(src, own=False) -> _HopTables | None:  # src[i]: device i's chunk (-1: unneeded)
        subs = [sub(i, j) if j >= 0 else np.zeros_like(sub(i, i)) for i, j in enumerate(src)]
        diag_len = None
        if is_causal and own:
            diag_len = np.stack([s[:, rows, rows] * bs for s in subs]).astype(np.int32)
            subs = [s & (rows[None, :] < rows[:, None])[None] for s in subs]
        idx, cnt = mask_tables(np.stack(subs))  # (P, Ui, nq_l, A), (P, Ui, nq_l)
        kv_len = (cnt * bs).astype(np.int32)
        active = kv_len.reshape(P, -1).any(axis=1)
        if diag_len is not None:
            active = active | diag_len.reshape(P, -1).any(axis=1)
        if not active.any():
            return None
        return _HopTables(idx, kv_len, diag_len, bool(kv_len.any()), active)

    needs = needs_matrix(P, lambda i, j: bool(sub(i, j).any()))
    streams = plan_streams(needs)
    hops = tuple(tuple(tables(src) for src in st.src) for st in streams)
    return RingPlan(U, G, kvmap, needs, streams, tables(range(P), own=True), hops)


def _run_plan(q, k, v, plan: RingPlan, axis_name: str, fn) -> jax.Array:
    """Folds the own chunk, then every hop of ``plan.streams``, into the float32 softmax state
    of the local queries with ``fn`` (the table-driven gather + core); the float32 output."""
    b, n_l, h, _ = q.shape
    r = lax.axis_index(axis_name)

    def fold(state, step: _HopTables | None, kc, vc):
        if step is None:
            return state
        idx = jnp.asarray(step.idx)[r][None] if step.gather else None
        kv_len = jnp.asarray(step.kv_len)[r][None] if step.gather else None
        diag = None if step.diag_len is None else jnp.asarray(step.diag_len)[r][None]

        def compute(q, kc, vc):
            return fn(q, kc, vc, idx, kv_len, diag)

        def skip(q, kc, vc):
            zero = 0.0 * q.astype(jnp.float32)
            return zero, jnp.full(q.shape[:3], -jnp.inf, jnp.float32) + zero[..., 0]

        if step.active.all():
            o_s, l_s = compute(q, kc, vc)
        else:
            o_s, l_s = lax.cond(jnp.asarray(step.active)[r], compute, skip, q, kc, vc)
        return merge_attention_states(*state, o_s, l_s)

    zero = 0.0 * q.astype(jnp.float32)  # carries q's device-varying type
    state = (zero, jnp.full((b, n_l, h), -jnp.inf, jnp.float32) + zero[..., 0])
    state = fold(state, plan.own, k, v)
    # The streams advance together: one hop of each per round, in plan order.
    held = [(k, v)] * len(plan.streams)
    for s in range(max((st.hops for st in plan.streams), default=0)):
        for si, st in enumerate(plan.streams):
            if s < st.hops:
                held[si] = lax.ppermute(held[si], axis_name, st.perm)
                state = fold(state, plan.hops[si][s], *held[si])
    return state[0]


def ring_block_sparse_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    pattern: BlockSparsePattern,
    *,
    axis_name: str,
    is_causal: bool = False,
    scale: float | None = None,
) -> jax.Array:
    """Block-sparse attention on a sequence sharded over mesh axis ``axis_name`` (per-device).

    Call inside ``jax.shard_map(..., check_vma=False)`` with the sequence axis of ``q, k, v``
    sharded over ``axis_name`` (``P`` devices, contiguous layout). The result is the local
    shard of :func:`dilax.block_sparse_attention` on the gathered inputs (forward and
    backward); each device holds ``O(n / P)`` of the data and receives only the K/V chunks of
    devices whose key blocks its queries attend.

    Args:
      q: local shard ``(b, n/P, h, d)``; device ``i`` holds positions ``[i n/P, (i+1) n/P)``.
      k, v: local shards ``(b, n/P, hk, d)``, ``h % hk == 0``.
      pattern: the :class:`dilax.patterns.BlockSparsePattern` of the *full* sequence
        (``n / B`` blocks, 1 or ``h`` heads); ``n/P`` must be a multiple of
        ``pattern.block_size``.
      axis_name: the mesh axis (a str) the sequence is split over.
      is_causal, scale: as in :func:`dilax.block_sparse_attention`.

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
    return ring_block_sparse_core(q, k, v, pattern, is_causal, scale, axis_name)


def _check_shard(pattern: BlockSparsePattern, n_l: int) -> None:
    if n_l % pattern.block_size != 0:
        raise ValueError(
            f"each device's sequence shard (n/P = {n_l}) must be a multiple of the pattern's "
            f"block_size {pattern.block_size} for ring block-sparse attention"
        )


def ring_block_sparse_core(q, k, v, pattern: BlockSparsePattern, is_causal: bool, scale: float,
                           axis_name: str) -> jax.Array:
    """:func:`ring_block_sparse_attention` on validated arguments (inside ``shard_map``)."""
    P = int(lax.axis_size(axis_name))
    plan = plan_ring(pattern, P, q.shape[2], k.shape[2], is_causal)
    fn = functools.partial(sparse_attention_tables, block_size=pattern.block_size, U=plan.U,
                           G=plan.G, kvmap=plan.kvmap, scale=scale)
    out = _run_plan(q, k, v, plan, axis_name, fn)
    return out.astype(q.dtype)


def check_sharded_block_sparse(q: jax.Array, pattern: BlockSparsePattern,
                               sp: SequenceParallel) -> None:
    """The mesh rules of a sequence-parallel block-sparse call on validated ``q`` and
    ``pattern`` (global view): ``n`` and the batch divide over the mesh, shards are whole
    pattern blocks, contiguous layout."""
    check_sequence_parallel(sp, None, layouts=("contiguous",))
    P = check_sharded_shape(q, sp.mesh, sp.seq_axis, sp.batch_axis)
    _check_shard(pattern, q.shape[1] // P)


def sharded_block_sparse(q, k, v, pattern: BlockSparsePattern, is_causal: bool, scale: float,
                         sp: SequenceParallel) -> jax.Array:
    """The sequence-parallel program on validated arguments: the shard_map of
    :func:`ring_block_sparse_core` over ``sp.mesh``."""
    fn = functools.partial(ring_block_sparse_core, pattern=pattern, is_causal=is_causal,
                           scale=scale, axis_name=sp.seq_axis)
    return shard_sequence(fn, sp.mesh, sp.seq_axis, sp.batch_axis, q, k, v)


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
      is_causal, scale: as in :func:`dilax.block_sparse_attention`.

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
    check_sharded_block_sparse(q, pattern, sp)
    return sharded_block_sparse(q, k, v, pattern, is_causal, scale, sp)
