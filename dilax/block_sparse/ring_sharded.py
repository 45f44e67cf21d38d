"""The whole-mesh door of the block-sparse ring: ``dilax.block_sparse_attention(...,
sequence_parallel=...)`` builds the ``shard_map`` of
:func:`dilax.block_sparse.ring.ring_block_sparse_core` over the mesh (global view).

FlexAttention's options travel as replicated operands: the arrays the mods close over and
``sinks`` reach every device whole, the mods see global positions, and the gradients of the
closed-over float arrays are every device's share summed (docs/semantics.md, "Custom scores
and masks").
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from dilax import _validation as V
from dilax.block_sparse.ring import check_shard, hop_core, ring_block_sparse_core
from dilax.flex.api import FlexMods, core_mods
from dilax.patterns import BlockSparsePattern
from dilax.sp.config import SequenceParallel, check_sequence_parallel
from dilax.sp.mesh import check_sharded_shape, shard_sequence


def check_sharded_block_sparse(q: jax.Array, pattern: BlockSparsePattern,
                               sp: SequenceParallel) -> None:
    """The mesh rules of a sequence-parallel block-sparse call on validated ``q`` and
    ``pattern`` (global view): ``n`` and the batch divide over the mesh, shards are whole
    pattern blocks, contiguous layout."""
    check_sequence_parallel(sp, None, layouts=("contiguous",))
    P = check_sharded_shape(q, sp.mesh, sp.seq_axis, sp.batch_axis)
    check_shard(pattern, q.shape[1] // P)


def sharded_block_sparse(q, k, v, pattern: BlockSparsePattern, is_causal: bool, scale: float,
                         sp: SequenceParallel, query_seq_lengths=None,
                         key_value_seq_lengths=None, implementation: str | None = None,
                         interpret: bool = False, segment_ids=None,
                         flex: FlexMods | None = None) -> jax.Array:
    """The shard_map of :func:`ring_block_sparse_core` over ``sp.mesh`` (validated arguments;
    lengths int32 ``(b,)`` or None, ``segment_ids`` int32 ``(b, n)`` or None, ``flex`` the
    call's prepared FlexAttention options or None) on the hop core the registry picks
    (:func:`hop_core`), compiled once per static configuration."""
    flags = () if flex is None else tuple(sorted(flex.request_flags.items()))
    core = hop_core(implementation, interpret, q, pattern, is_causal,
                    query_seq_lengths is not None or key_value_seq_lengths is not None,
                    segment_ids is not None, flags, v.shape[-1])
    if q.shape[0] == 0:  # nothing to shard: an empty result (and empty gradients)
        return V.empty_batch(q, v)
    extra = {} if flex is None else dict(mods=core_mods(flex), sinks=flex.sinks)
    return _sharded_jit(q, k, v, query_seq_lengths, key_value_seq_lengths, segment_ids,
                        pattern=pattern, is_causal=bool(is_causal), scale=float(scale), sp=sp,
                        core=core, **extra)


@functools.partial(jax.jit, static_argnames=("pattern", "is_causal", "scale", "sp", "core"))
def _sharded_jit(q, k, v, q_len, kv_len, ids, mods=None, sinks=None, *, pattern, is_causal,
                 scale, sp, core):
    replicated = tuple(x for x in (mods, sinks) if x is not None)

    def body(q, k, v, *rest):
        doc, rest = (rest[0], rest[1:]) if ids is not None else (None, rest)
        q_len, kv_len, *rep = rest
        mods_l = rep.pop(0) if mods is not None else None
        sinks_l = rep.pop(0) if sinks is not None else None
        if mods_l is not None and sp.batch_axis is not None:  # the mods' b: global rows
            b = q.shape[0]
            mods_l = dataclasses.replace(mods_l, batch=lax.axis_index(sp.batch_axis) * b
                                         + jnp.arange(b, dtype=jnp.int32))
        return ring_block_sparse_core(q, k, v, pattern, is_causal, scale, sp.seq_axis, q_len,
                                      kv_len, core=core, segment_ids=doc, mods=mods_l,
                                      sinks=sinks_l)

    # the Pallas kernel's outputs carry no device-varying type: no vma checks with it
    return shard_sequence(body, sp.mesh, sp.seq_axis, sp.batch_axis, q, k, v, q_len, kv_len,
                          per_position=() if ids is None else (ids,),
                          check_vma=core.name == "xla", replicated=replicated)
