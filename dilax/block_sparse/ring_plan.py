"""Static plans of the block-sparse ring (:mod:`dilax.block_sparse.ring`) and its hops on
the Pallas block-sparse kernel.

:func:`plan_ring`: which device needs which chunk, the schedule, and the key-block tables of
every (device, chunk) pair in the virtual-head form the XLA core's gathered calls read.

:class:`KernelHops`: the same pairs as tables of the table-driven block-sparse kernel
(:mod:`pallas_kernels.block_sparse`), one per query head or shared, stacked over entries and
picked per hop by a traced entry index. A hop is then ONE kernel call per direction on the
visiting chunk read in place (no gather, no scatter of gradients): the own chunk with the
causal diagonal (``is_causal``, offsets 0: queries and keys of one chunk share positions),
every other chunk without (with ``is_causal`` only chunks before the device's own are
visited, all of whose keys precede its queries). Valid lengths become chunk-local.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
from jax import lax

from dilax import registry
from dilax.block_sparse.tables import head_layout
from dilax.core import Core, KeyBounds, Mask, identity_view
from dilax.core.block_sparse import BlockSparsePallasCore
from dilax.patterns import BlockSparsePattern, mask_tables
from dilax.sp.schedule import Stream, needs_matrix, plan_streams

_F32 = jnp.float32


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


def _chunk_mask(m: np.ndarray, i: int, j: int, nq_l: int, is_causal: bool) -> np.ndarray:
    """``(H, nq_l, nq_l)``: query blocks of device ``i`` x key blocks of device ``j``."""
    s = m[:, i * nq_l:(i + 1) * nq_l, j * nq_l:(j + 1) * nq_l]
    return np.zeros_like(s) if is_causal and j > i else s


@functools.lru_cache(maxsize=64)
def plan_ring(pattern: BlockSparsePattern, num_devices: int, h: int, hk: int,
              is_causal: bool) -> RingPlan:
    """Static per-(device, chunk) tables of ``pattern`` on a ring of ``num_devices``."""
    U, G, kvmap, m = head_layout(pattern.block_mask, h, hk)
    P = num_devices
    nq_l = pattern.num_q_blocks // P
    rows = np.arange(nq_l)
    sub = lambda i, j: _chunk_mask(m, i, j, nq_l, is_causal)  # noqa: E731
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


def hop_request(dtype, head_dim: int, is_causal: bool, lengths: bool, block_size: int,
                interpret=False, documents: bool = False, flags=(),
                value_head_dim: int | None = None) -> registry.CoreRequest:
    """The registry request of the block-sparse ring's hops (``"ring_hop"`` with the
    pattern's ``block_size``: the block-sparse kernel's rules, :mod:`dilax.registry`);
    ``flags``: the items of :attr:`dilax.flex.api.FlexMods.request_flags` (mods, sinks);
    ``value_head_dim``: ``dv`` (``v (b, n, hk, dv)``), when known."""
    return registry.CoreRequest("ring_hop", dtype, head_dim, bool(is_causal),
                                has_lengths=bool(lengths), interpret=bool(interpret),
                                block_size=int(block_size), has_documents=bool(documents),
                                value_head_dim=value_head_dim, **dict(flags))


def hop_core(implementation: str | None, interpret: bool, q, pattern: BlockSparsePattern,
             is_causal: bool, lengths: bool, documents: bool = False, flags=(),
             value_head_dim: int | None = None) -> Core:
    """The core of the ring's hops for ``q (b, n/P, h, d)``: :func:`hop_request` to
    :func:`dilax.registry.select` (``ValueError`` with the registry's reason where an explicit
    ``implementation`` cannot serve them; packed documents (``documents``), mods (``flags``)
    and values with their own head dim (``value_head_dim != d``) run on the XLA core only)."""
    request = hop_request(q.dtype, q.shape[-1], is_causal, lengths, pattern.block_size,
                          interpret, documents, flags, value_head_dim)
    return registry.select(implementation, request)


# -- the hops on the Pallas block-sparse kernel ----------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class _HopCore(BlockSparsePallasCore):
    """:class:`BlockSparsePallasCore` on one hop's prepared (traced) tables
    ``(kv_idx, kv_cnt, q_idx, q_cnt)`` instead of its pattern's."""

    hop_tables: tuple = ()

    def _tables(self, n, h, is_causal):
        del n, h, is_causal
        return self.hop_tables


def _kernel_tables(masks: np.ndarray) -> tuple[np.ndarray, ...]:
    """``(kv_idx, kv_cnt, q_idx, q_cnt)`` of block masks ``(E, H, nq, nk)``, stacked over
    entries: the key blocks of each query block and, transposed, the query blocks of each
    key block, ascending (what the kernels read, :func:`pallas_kernels.tables.sparse_tables`
    with any causal cut already applied)."""
    from pallas_kernels.tables import tables_from_block_mask  # lazy: optional kernels

    return (*tables_from_block_mask(masks), *tables_from_block_mask(masks.swapaxes(-1, -2)))


@dataclasses.dataclass(frozen=True, eq=False)
class KernelHops:
    """The ring's hops on the Pallas block-sparse kernel (see the module docstring).

    ``own``: the kernel tables of device ``i``'s queries against its own chunk (entry ``i``,
    diagonal included); ``pairs``: of every needed pair (entry ``RingPlan.pair_slot[i, j]``),
    or None. ``interpret``: the Pallas interpreter (bool or interpreter params)."""

    pattern: BlockSparsePattern
    is_causal: bool
    own: tuple[np.ndarray, ...]
    pairs: tuple[np.ndarray, ...] | None
    interpret: object = False

    def _core(self, own: bool, e):
        tables = tuple(jnp.asarray(t)[e] for t in (self.own if own else self.pairs))
        return _HopCore(self.pattern, self.interpret, hop_tables=tables)

    def _call(self, q, kb, aux, own: bool, src, axis_name):
        """The view and mask of a hop: chunk-local valid lengths ``(b, 1)``."""
        b, m, h, _ = q.shape
        hk = kb.shape[2]
        me = lax.axis_index(axis_name)
        local = lambda L, start: None if L is None else jnp.clip(  # noqa: E731
            L - start * m, 0, m)[:, None]
        q_len, kv_len = (None, None) if aux is None else (local(aux[0], me), local(aux[1], src))
        mask = Mask(KeyBounds(kv_len, 0, 0, bool(own and self.is_causal), q_len))
        return identity_view(hk, h // hk), mask

    def attend(self, q, kb, vb, aux, own: bool, e, src, *, scale: float, axis_name):
        """``(out f32 (b, m, h, d), lse (b, m, h))`` of the local queries against chunk
        ``kb, vb`` of device ``src`` (entry ``e`` of the own or the pair tables)."""
        view, mask = self._call(q, kb, aux, own, src, axis_name)
        return self._core(own, e).forward(q, kb, vb, view=view, mask=mask, scale=scale,
                                          out_dtype=_F32)

    def grads(self, q, kb, vb, aux, own: bool, e, src, *, scale: float, axis_name, lse, dout,
              delta):
        """``(dq, dk, dv)`` float32 of the same call, recomputed from the merged ``lse``."""
        view, mask = self._call(q, kb, aux, own, src, axis_name)
        return self._core(own, e).backward(q, kb, vb, view=view, mask=mask, scale=scale,
                                           lse=lse, dout=dout, delta=delta, grad_dtype=_F32)


@functools.lru_cache(maxsize=64)
def plan_kernel_hops(pattern: BlockSparsePattern, plan: RingPlan, num_devices: int,
                     is_causal: bool, interpret=False) -> KernelHops:
    """:class:`KernelHops` of ``pattern`` on ``num_devices`` (the pairs of ``plan``)."""
    m = np.asarray(pattern.block_mask, bool)  # (1 or h, nq, nk): one table per query head
    nq_l = pattern.num_q_blocks // num_devices
    sub = lambda i, j: _chunk_mask(m, i, j, nq_l, is_causal)  # noqa: E731
    own = np.stack([sub(i, i) for i in range(num_devices)])
    if is_causal:  # the own chunk: blocks up to the diagonal (the kernel masks the diagonal)
        own = own & np.tril(np.ones((nq_l, nq_l), bool))
    pairs = np.argwhere(plan.needs)
    return KernelHops(pattern, bool(is_causal), _kernel_tables(own),
                      _kernel_tables(np.stack([sub(i, j) for i, j in pairs])) if len(pairs)
                      else None, interpret)
