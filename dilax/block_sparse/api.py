"""Block-sparse attention on top of the blockwise core (docs/semantics.md, "Block-sparse
attention").

XLA path, per query block ``i`` (one *row*): the active key blocks of the row are gathered
from the compact tables into a contiguous ``(count * B)`` key sequence and
:func:`dilax.core.attention_core` runs over it with ``kv_len = count * B`` per row and head,
so the core's key loop stops after the row's own active blocks. Work is proportional to the
number of active blocks; the gathered K/V is ``max_active`` blocks per row (processed a few
rows at a time, see :mod:`dilax.block_sparse.tables`), never ``n x n``.

Causal (exact and cheap): the key blocks strictly before the query block (``j < i``) are fully
visible, so they go through one non-causal core call; the diagonal block (``j == i``) goes
through a second, causal core call on the *un-gathered* ``(b * nq, B)`` view of K/V (a
reshape), with ``kv_len = B`` where the diagonal is active and 0 elsewhere. The two partial
softmax states are merged exactly with their log-sum-exp (:func:`merge_attention_states`).
Blocks entirely in the future are dropped from the tables.

Heads: query head ``j`` reads kv head ``j // (h // hk)``. A shared pattern (``H_pat = 1``)
gathers per kv head (GQA without repeating K/V). A per-head pattern that is identical inside
each GQA group also gathers per kv head; otherwise every query head gathers its own blocks
from its kv head.

Pallas path (``implementation="pallas"``): one :func:`dilax.core.attention` call with
:class:`~dilax.core.block_sparse.BlockSparsePallasCore`, the table-driven kernel of
:mod:`pallas_kernels.block_sparse` behind the core interface; valid lengths are applied inside
the kernel. What it can serve is :mod:`dilax.registry`'s block-sparse rules.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from dilax import _validation as V
from dilax import registry
from dilax.attention_mask import (
    AttentionMask,
    check_segment_ids,
    document_bounds,
    unpack_attention_mask,
)
from dilax.batch_dims import fold_batch_dims
from dilax.block_sparse.ring_sharded import check_sharded_block_sparse, sharded_block_sparse
from dilax.block_sparse.tables import check_pattern, head_layout, sparse_attention_tables
from dilax.core import KeyBounds, Mask, attention, identity_view
from dilax.core.arrays import cdiv
from dilax.core.block_sparse import BlockSparsePallasCore
from dilax.flex.api import core_mods, prepare_mods, with_sinks
from dilax.patterns import BlockSparsePattern, mask_tables
from dilax.reference import length_mask, masked_attention
from dilax.sp.config import SequenceParallel, check_sequence_parallel

# -- static plans -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class _Plan:
    """How one pattern maps onto ``U`` virtual kv heads of ``G`` query heads each.

    Virtual kv head ``u`` reads kv head ``kvmap[u]`` and serves query heads ``u*G .. u*G+G-1``.
    Tables have a leading batch axis of 1 and a head axis of 1 (shared) or ``U``.
    """

    U: int
    G: int
    kvmap: tuple[int, ...]
    idx: np.ndarray  # (1, Ui, nq, A) int32: non-causal: all active; causal: j < i only
    kv_len: np.ndarray  # (1, Ui, nq) int32 keys of the gathered call (partial block excluded)
    diag_len: np.ndarray | None  # (1, Ui, nq) int32 causal diagonal kv_len (B or 0), or None


def _plan_from_mask(mask: np.ndarray, n: int, bs: int, h: int, hk: int, is_causal: bool) -> _Plan:
    U, G, kvmap, m = head_layout(mask, h, hk)
    nq = m.shape[1]
    pad = nq * bs - n
    if is_causal:
        rows = np.arange(nq)
        off = m & (rows[None, :] < rows[:, None])[None]
        idx, cnt = mask_tables(off)
        kv_len = cnt * bs  # blocks j < i never include the partial last block
        diag_len = (m[:, rows, rows] * bs).astype(np.int32)
    else:
        idx, cnt = mask_tables(m)
        last = np.take_along_axis(idx, np.maximum(cnt - 1, 0)[..., None], axis=-1)[..., 0]
        kv_len = cnt * bs - pad * ((cnt > 0) & (last == nq - 1))
        diag_len = None
    as_batch = lambda x: None if x is None else x[None].astype(np.int32)
    return _Plan(U, G, kvmap, as_batch(idx), as_batch(kv_len), as_batch(diag_len))


@functools.lru_cache(maxsize=128)
def plan_pattern(pattern: BlockSparsePattern, n: int, h: int, hk: int, is_causal: bool) -> _Plan:
    """Static tables of ``pattern`` for ``(n, h, hk, is_causal)`` (cached)."""
    return _plan_from_mask(pattern.block_mask, n, pattern.block_size, h, hk, is_causal)



def pad_seq(x: jax.Array, size: int) -> jax.Array:
    extra = size - x.shape[1]
    return x if extra == 0 else jnp.pad(x, ((0, 0), (0, extra), (0, 0), (0, 0)))


def table_lengths(idx, kv_len, diag_len, block_size: int, nq: int,
                  query_seq_lengths=None, key_value_seq_lengths=None):
    """Valid lengths ``(b,)`` of the sequence -> the tables' per-row lengths.

    The active blocks of a row are gathered in ascending order, so the valid keys of the
    gathered sequence are a prefix: ``kv_len`` becomes the number of gathered keys before
    ``key_value_seq_lengths`` (slots past the row's count excluded); the causal diagonal's
    ``diag_len`` is capped the same way, and ``q_len (b, 1, nq)`` counts each query block's
    valid rows. Returns ``(kv_len, diag_len, q_len)`` (each None where not needed)."""
    bs = block_size
    first = jnp.arange(nq, dtype=jnp.int32) * bs  # (nq,) first position of each block
    q_len = None
    if query_seq_lengths is not None:
        q_len = jnp.clip(query_seq_lengths[:, None, None] - first[None, None], 0, bs)  # (b, 1, nq)
    if key_value_seq_lengths is None:
        return kv_len, diag_len, q_len
    L = key_value_seq_lengths[:, None, None]
    if idx is not None:
        idx = jnp.asarray(idx, jnp.int32)
        slot = jnp.arange(idx.shape[-1], dtype=jnp.int32)[None, None, None] * bs
        used = slot < jnp.asarray(kv_len, jnp.int32)[..., None]  # slots before the count
        valid = jnp.where(used, jnp.clip(L[..., None] - idx * bs, 0, bs), 0).sum(-1)
        kv_len = jnp.minimum(jnp.asarray(kv_len, jnp.int32), valid.astype(jnp.int32))
    if diag_len is not None:
        diag_len = jnp.minimum(jnp.asarray(diag_len, jnp.int32),
                               jnp.clip(L - first[None, None], 0, bs))
    return kv_len, diag_len, q_len


def attend_tables(q, k, v, idx, kv_len, diag_len, *, block_size: int, U: int, G: int,
                  kvmap: tuple[int, ...], scale: float, block_k: int | None = None,
                  query_seq_lengths=None, key_value_seq_lengths=None, segment_ids=None,
                  mods=None, sinks=None):
    """:func:`sparse_attention_tables` on unpadded ``(b, n, ., d)`` inputs.

    Pads the sequence to whole blocks, runs the tables, crops. Optional valid lengths
    ``(b,)`` (:func:`table_lengths`), packed documents ``segment_ids (b, n)``, score / mask
    ``mods`` (:class:`dilax.core.mods.Mods`, at row positions) and ``sinks (h,)``. Returns
    ``out (b, n, h, d)`` in ``q.dtype`` and ``lse (b, n, h)`` float32.
    """
    n = q.shape[1]
    size = cdiv(n, block_size) * block_size
    kv_len, diag_len, q_len = table_lengths(idx, kv_len, diag_len, block_size,
                                            size // block_size, query_seq_lengths,
                                            key_value_seq_lengths)
    out, lse = sparse_attention_tables(
        pad_seq(q, size), pad_seq(k, size), pad_seq(v, size), idx, kv_len, diag_len,
        block_size=block_size, U=U, G=G, kvmap=kvmap, scale=scale, block_k=block_k,
        q_len=q_len, doc=None if segment_ids is None else tuple(
            jnp.pad(x, ((0, 0), (0, size - n)), constant_values=n)
            for x in document_bounds(segment_ids)), mods=mods,
    )
    out, lse = out[:, :n], lse[:, :n]
    if sinks is not None:  # one more logit per head in the denominator
        return with_sinks(out, lse, sinks, q.dtype)
    return out.astype(q.dtype), lse


def block_sparse_attention_xla(q, k, v, pattern: BlockSparsePattern, *, is_causal: bool,
                               scale: float, block_k: int | None = None,
                               return_lse: bool = False, query_seq_lengths=None,
                               key_value_seq_lengths=None, segment_ids=None, mods=None,
                               sinks=None):
    """XLA path. Arguments must be validated (see :func:`block_sparse_attention`); ``mods``:
    a :class:`dilax.core.mods.Mods` without positions, ``sinks (h,)``."""
    b, n, h, d = q.shape
    plan = plan_pattern(pattern, n, h, k.shape[2], is_causal)
    use_gather = bool(np.any(plan.kv_len > 0))
    use_diag = plan.diag_len is not None and bool(np.any(plan.diag_len > 0))
    if not (use_gather or use_diag):  # nothing attended anywhere
        out = jnp.zeros((b, n, h, v.shape[-1]), q.dtype)
        return (out, jnp.full((b, n, h), -jnp.inf, jnp.float32)) if return_lse else out
    out, lse = attend_tables(
        q, k, v, plan.idx if use_gather else None, plan.kv_len if use_gather else None,
        plan.diag_len if use_diag else None, block_size=pattern.block_size, U=plan.U,
        G=plan.G, kvmap=plan.kvmap, scale=scale, block_k=block_k,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        segment_ids=segment_ids, mods=mods, sinks=sinks,
    )
    return (out, lse) if return_lse else out


def block_sparse_attention_reference(q, k, v, pattern: BlockSparsePattern, *, is_causal: bool,
                                     scale: float, query_seq_lengths=None,
                                     key_value_seq_lengths=None,
                                     segment_ids=None) -> jax.Array:
    """Dense attention with the expanded token mask (small ``n`` only; the test oracle)."""
    n = q.shape[1]
    mask = jnp.asarray(pattern.expanded_mask(n, is_causal).astype(np.float32))
    valid = length_mask(n, query_seq_lengths, key_value_seq_lengths)
    if valid is not None:
        mask = mask[None] * valid
    if segment_ids is not None:  # AND same document (a document is a run of equal ids)
        start, _ = document_bounds(segment_ids)
        same = (start[:, :, None] == start[:, None, :])[:, None].astype(jnp.float32)
        mask = (mask if mask.ndim == 4 else mask[None]) * same
    return masked_attention(q, k, v, mask, scale)


def block_sparse_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    pattern: BlockSparsePattern,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    implementation: str | None = None,
    interpret: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    sequence_parallel: SequenceParallel | None = None,
    segment_ids: jax.Array | None = None,
    attention_mask: AttentionMask | None = None,
    score_mod: Callable | None = None,
    mask_mod: Callable | None = None,
    sinks: jax.Array | None = None,
    logits_soft_cap: float | None = None,
) -> jax.Array:
    """Exact block-sparse attention (docs/semantics.md, "Block-sparse attention").

    Query ``p`` of head ``j`` attends key ``t`` iff ``pattern.block_mask[j or 0, p // B, t // B]``
    and, when ``is_causal``, ``t <= p``; one softmax over all attended keys.

    Args:
      q: ``(b, n, h, d)`` queries (any number of leading batch dimensions, rank 3 included,
        as :func:`dilax.dilated_attention`).
      k, v: ``(b, n, hk, d)``, ``h % hk == 0`` (GQA/MQA without repeating K/V); ``v`` may
        have its own head dim ``(b, n, hk, dv)`` (out ``(b, n, h, dv)``; XLA path and the
        reference, and the ring's XLA hops with ``sequence_parallel``).
      pattern: a :class:`dilax.patterns.BlockSparsePattern` with ``ceil(n / B)`` query and
        key blocks and 1 or ``h`` heads. If ``n % B != 0`` the last block is partial (its
        missing keys never receive weight).
      is_causal: additionally restrict query ``p`` to keys ``t <= p``.
      scale: logit scale, default ``1 / sqrt(d)``.
      implementation: ``None``/``"xla"`` (gathers only the active key blocks; time and memory
        follow the number of active blocks), ``"pallas"`` (the table-driven Pallas kernel,
        valid lengths included; needs ``pattern.block_size`` a power of two, >= 16 on GPU)
        or ``"reference"`` (dense, explicit mask). ``None`` picks ``"pallas"`` on GPU where
        it serves the call and ``"xla"`` otherwise (:mod:`dilax.registry` says why).
      interpret: run the Pallas kernel in the interpreter (CPU testing).
      query_seq_lengths, key_value_seq_lengths: optional int ``(b,)`` valid lengths
        (padding), as in :func:`dilax.dilated_attention`: keys ``t >= kv_len[i]`` get no
        weight, query rows ``p >= q_len[i]`` output 0 with zero gradient; static values
        outside ``[0, n]`` raise, traced ones are clipped. Both the XLA path and the Pallas
        kernel skip key blocks past the length.
      segment_ids: optional int ``(b, n)``: packed documents (a document is a maximal run of
        equal ids). The pattern is on row positions AND same document: query ``p`` attends
        key ``t`` iff the pattern allows it and both lie in one document. XLA core (the
        gathered keys of a row are in position order, so a document's keys are one run of
        them) and the reference; with ``sequence_parallel`` too (documents may cross shard
        boundaries; the ring's hops on the XLA core).
      attention_mask: a :class:`dilax.AttentionMask` instead of ``is_causal`` / the lengths /
        ``segment_ids`` (its ``is_causal`` or ``is_causal`` here makes the call causal). Its
        ``key_padding_mask`` is refused (``ValueError``): pass ``key_value_seq_lengths``.
      sequence_parallel: a :class:`dilax.SequenceParallel` (``layout="contiguous"``): run as
        ring block-sparse attention with the sequence split over ``sequence_parallel.mesh``
        (``n / P`` a multiple of ``pattern.block_size``; see
        :func:`dilax.ring_block_sparse_attention`). Same result, forward and backward.
        Its hops run on the core ``implementation`` names (``"pallas"``: the block-sparse
        kernel on each visiting chunk, same rules as on one device; ``"reference"`` has no
        ring form) or, with None, the one the registry picks (Pallas on GPU where it serves).
      score_mod, mask_mod, sinks, logits_soft_cap: FlexAttention's options, as
        :func:`dilax.flex_attention` (docs/semantics.md, "Custom scores and masks"): per
        attended pair the soft-cap, then ``score_mod(s, b, h, q_idx, kv_idx)``; a pair is
        kept iff the pattern (and causality, lengths, documents) AND ``mask_mod`` allow it;
        ``sinks (h,)`` add one logit per head to the denominator. ``q_idx``, ``kv_idx`` are
        row positions, never indices of gathered blocks. XLA path only (``None`` /
        ``"xla"``; ``"pallas"`` and ``"reference"`` refuse them with :mod:`dilax.registry`'s
        reason). With ``sequence_parallel`` too: the ring's hops on the XLA core, ``q_idx``,
        ``kv_idx`` global positions, the closed-over arrays and ``sinks`` replicated on every
        device (their gradients summed over the devices).

    Returns:
      ``(b, n, h, d)`` in ``q.dtype``. Queries with no attended key get 0 (and 0 gradient).

    Raises:
      TypeError: ``pattern`` is not a ``BlockSparsePattern``; non-float or mixed dtypes of
        q, k, v; non-bool ``is_causal``.
      ValueError: q, k, v not rank 4 or with mismatched ``b``, ``n``, ``d``; ``h % hk != 0``;
        a pattern whose block counts are not ``ceil(n / B)`` or whose heads are neither 1 nor
        ``h``; an unknown ``implementation``; ``"pallas"`` where :mod:`dilax.registry` says
        the kernel cannot serve the call (a block size that is not a power of two, or
        below 16 on GPU; a dtype other than bf16/fp16/fp32 on GPU; off GPU without
        ``interpret=True``; the message names the reason); a non-positive ``scale``.
    """
    if attention_mask is not None:
        is_causal, query_seq_lengths, key_value_seq_lengths, segment_ids = unpack_attention_mask(
            attention_mask, "block_sparse_attention", is_causal,
            query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
            segment_ids=segment_ids)
    q, k, v, rows, unfold = fold_batch_dims(q, k, v, query_seq_lengths=query_seq_lengths,
                                            key_value_seq_lengths=key_value_seq_lengths,
                                            segment_ids=segment_ids)
    query_seq_lengths, key_value_seq_lengths, segment_ids = rows.values()
    q, k, v = V.check_qkv(q, k, v, empty_batch=True, value_head_dim=True)
    pattern = check_pattern(pattern, q)
    is_causal = V.check_bool(is_causal, "is_causal")
    scale = V.check_scale(scale, q.shape[3])
    interpret = V.check_bool(interpret, "interpret")
    b, n = q.shape[:2]
    q_len = V.check_seq_lengths(query_seq_lengths, "query_seq_lengths", b, n)
    kv_len = V.check_seq_lengths(key_value_seq_lengths, "key_value_seq_lengths", b, n)
    segment_ids = check_segment_ids(segment_ids, b, n)
    flex = prepare_mods("block_sparse_attention", b, q.shape[2], n, n, score_mod=score_mod,
                        mask_mod=mask_mod, sinks=sinks, logits_soft_cap=logits_soft_cap)
    if sequence_parallel is not None:
        check_sequence_parallel(sequence_parallel, implementation, interpret=interpret,
                                block_size=pattern.block_size)
        check_sharded_block_sparse(q, pattern, sequence_parallel)
        return unfold(sharded_block_sparse(q, k, v, pattern, is_causal, scale,
                                           sequence_parallel, q_len, kv_len, implementation,
                                           interpret, segment_ids, flex))
    request = registry.CoreRequest(
        "block_sparse", q.dtype, q.shape[3], is_causal,
        has_lengths=q_len is not None or kv_len is not None, interpret=interpret,
        block_size=pattern.block_size, has_documents=segment_ids is not None,
        value_head_dim=v.shape[-1], **({} if flex is None else flex.request_flags))
    # a name the op offers (the registry's rules: "cudnn" refused with its reason), then one
    # that serves this call
    implementation, _ = registry.choose(registry.check_name(implementation, "block_sparse"),
                                        request)
    V.check_memory(q, k, dense=implementation == "reference", op="block_sparse_attention")
    if b == 0:  # the blockwise cores need a row; the result is empty anyway
        return unfold(V.empty_batch(q, v))
    extra = () if flex is None else (core_mods(flex), flex.sinks)
    return unfold(_block_sparse_dispatch(q, k, v, q_len, kv_len, pattern, is_causal, scale,
                                         implementation, interpret, segment_ids, *extra))


# One compiled program per static configuration: an eager call runs exactly the program a
# jitted caller gets, so results are bitwise identical with and without jax.jit.
@functools.partial(jax.jit, static_argnums=(5, 6, 7, 8, 9))
def _block_sparse_dispatch(q, k, v, q_len, kv_len, pattern, is_causal, scale, implementation,
                           interpret, segment_ids=None, mods=None, sinks=None):
    lengths = dict(query_seq_lengths=q_len, key_value_seq_lengths=kv_len,
                   **({} if segment_ids is None else dict(segment_ids=segment_ids)))
    if implementation == "reference":
        return block_sparse_attention_reference(q, k, v, pattern, is_causal=is_causal,
                                                scale=scale, **lengths)
    if implementation == "pallas":
        return _block_sparse_pallas(q, k, v, q_len, kv_len, pattern, is_causal, scale,
                                    interpret)
    return block_sparse_attention_xla(q, k, v, pattern, is_causal=is_causal, scale=scale,
                                      mods=mods, sinks=sinks, **lengths)


def _block_sparse_pallas(q, k, v, q_len, kv_len, pattern, is_causal, scale, interpret):
    """The Pallas kernel through the core interface: one :func:`dilax.core.attention` call
    with :class:`~dilax.core.block_sparse.BlockSparsePallasCore` (lengths in the kernel)."""
    h, hk = q.shape[2], k.shape[2]
    per_row = lambda x: None if x is None else x[:, None]  # (b,) -> (b, 1): every kv head
    mask = Mask(KeyBounds(per_row(kv_len), 0, 0, is_causal, per_row(q_len)))
    out, _ = attention(q, k, v, view=identity_view(hk, h // hk), scale=scale, mask=mask,
                       core=BlockSparsePallasCore(pattern, interpret))
    return out


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
    implementation: str | None = None,
    interpret: bool = False,
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
      implementation, interpret: the core of the ring's hops, as in
        :func:`ring_block_sparse_attention`.

    Returns:
      ``(b, n, h, d)`` in ``q.dtype``, sharded like ``q``; equal to
      ``block_sparse_attention(q, k, v, pattern, ...)``.

    Raises:
      TypeError: ``mesh`` is not a ``Mesh``; ``pattern`` or dtypes as in
        :func:`dilax.block_sparse_attention`.
      ValueError: ``seq_axis``/``batch_axis`` not mesh axes or equal, ``n % P != 0``,
        ``n / P`` not a multiple of ``pattern.block_size``, batch not divisible by the
        ``batch_axis`` size, a pattern that does not fit ``n``, an ``implementation`` that
        cannot serve the ring's hops, and every input error of
        :func:`dilax.block_sparse_attention`.
    """
    warnings.warn("dilax.sharded_block_sparse_attention is deprecated: use "
                  "dilax.block_sparse_attention(..., "
                  "sequence_parallel=dilax.SequenceParallel(mesh, seq_axis))",
                  DeprecationWarning, stacklevel=2)
    return block_sparse_attention(
        q, k, v, pattern, is_causal=is_causal, scale=scale, implementation=implementation,
        interpret=interpret, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        sequence_parallel=SequenceParallel(mesh, seq_axis, batch_axis))
