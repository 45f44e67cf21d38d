"""Dilated (LongNet) attention: the two modes of docs/semantics.md on one attention core.

Each branch ``(w, r)`` is one core call over all of its segments and heads, read in place
through the slot layout (:mod:`dilax.branch.plan`); the branches run through the one branch runner
(:func:`dilax.branch.runner.attend_branches`, one custom_vjp with the merge fused in) and are
merged in float32 with their log-sum-exp weights
(mixture) or scaled by ``1/G`` (grouped) (:func:`dilax.branch.runner.combine_branches`).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from dilax import _validation as V
from dilax.attention_mask import AttentionMask, document_bounds, take_attention_mask
from dilax.batch_dims import fold_batch_dims
from dilax.branch.plan import dilated_branches, window_plan
from dilax.branch.runner import CoreBranch, attend_branches
from dilax.core import XLA, BlockSizes, Core
from dilax.dilated.documents import DocumentBranch
from dilax.dilated.flex import dilated_flex
from dilax.dilated.ring import check_sharded, sharded_dilated
from dilax.dilated.ring_documents import sharded_documents
from dilax.dilated.settings import DilatedSettings, check_dilated_request, settings_from_keywords
from dilax.flex.api import FlexMods, core_mods, prepare_mods
from dilax.flex.block_mask import BlockMask
from dilax.reference import dilated_attention_reference
from dilax.registry import CoreRequest, branch_cores, choose, resolve, resolve_implementation
from dilax.sp.config import SequenceParallel, check_sequence_parallel


def dilated_attention_core(q, k, v, mask: AttentionMask, settings: DilatedSettings,
                           core: Core = XLA, return_lse=False):
    """Dilated attention on validated arguments with the attention core ``core``.

    ``mask``: its ``query_seq_lengths``, ``key_value_seq_lengths`` (``None`` or int ``(b,)``
    in ``[0, n]``) and ``key_padding_mask`` (``None`` or bool ``(b, n)``, True = valid key;
    then ``key_value_seq_lengths`` is one past the last valid key, so that trailing padding
    blocks are skipped). ``settings.local_window`` (mixture only) adds one more branch, the
    band ``|p - t| <= local_window``, merged into the same softmax.

    Returns ``out (b, n, h, dv)`` and, with ``return_lse``, ``lse (b, n, h)`` float32."""
    n, h = q.shape[1], q.shape[2]
    scale, is_causal = settings.scale_for(q.shape[3]), settings.is_causal
    block_sizes, mode = settings.block_sizes, settings.mode
    plans = tuple(dilated_branches(n, h, k.shape[2], settings.segment_lengths,
                                   settings.dilation_rates, mode))
    if settings.local_window is not None:
        plans += (window_plan(n, h, k.shape[2], settings.local_window),)
    documents = mask.segment_ids is not None
    dv = {} if v.shape[-1] == q.shape[-1] else dict(value_head_dim=v.shape[-1])
    cores = branch_cores(core, plans, dtype=q.dtype, head_dim=q.shape[-1], is_causal=is_causal,
                         key_padding=mask.key_padding_mask is not None,
                         lengths=mask.query_seq_lengths is not None
                         or mask.key_value_seq_lengths is not None, documents=documents, **dv)
    lengths = (mask.query_seq_lengths, mask.key_value_seq_lengths, mask.key_padding_mask)
    if documents:  # packed rows: each branch on its documents' own positions
        ops = tuple(DocumentBranch(p, n, h, k.shape[2], float(scale), bool(is_causal),
                                   block_sizes, c) for p, c in zip(plans, cores))
        aux = lengths + document_bounds(mask.segment_ids)
    else:
        ops = tuple(CoreBranch(p, float(scale), bool(is_causal), block_sizes, c)
                    for p, c in zip(plans, cores))
        # no lengths: exactly the program without them
        aux = None if all(x is None for x in lengths) else lengths
    out, lse = attend_branches(q, k, v, ops, mode, out_dtype=q.dtype, aux=aux)
    return (out, lse) if return_lse else out


def dilated_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_lengths: tuple[int, ...] | list[int] | int | None = None,
    dilation_rates: tuple[int, ...] | list[int] | int | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    mode: str = "mixture",
    implementation: str | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window: int | None = None,
    key_padding_mask: jax.Array | None = None,
    settings: DilatedSettings | None = None,
    attention_mask: AttentionMask | None = None,
    sequence_parallel: SequenceParallel | None = None,
    segment_ids: jax.Array | None = None,
    mask: AttentionMask | None = None,
    score_mod: Callable | None = None,
    mask_mod: Callable | None = None,
    block_mask: BlockMask | None = None,
    sinks: jax.Array | None = None,
    logits_soft_cap: float | None = None,
) -> jax.Array:
    """Dilated attention (LongNet), exactly as specified in docs/semantics.md.

    Args:
      q: ``(b, n, h, d)`` queries; any number of leading batch dimensions,
        ``(batch..., n, h, d)`` (rank 3 included), with per-row arguments shaped to match
        (:func:`dilax.batch_dims.fold_batch_dims`).
      k, v: ``(b, n, hk, d)`` keys and values, ``h % hk == 0`` (GQA/MQA without repeating
        K/V); ``v`` may have its own head dim ``(b, n, hk, dv)`` (then the XLA core runs;
        with ``sequence_parallel`` too).
      segment_lengths: ``(w_0, ...)``, one per branch; any ``n >= 1`` is allowed (the last
        segment is shorter when ``n % w != 0``; ``w > n`` means one segment).
      dilation_rates: ``(r_0, ...)``, same length, ``w_i % r_i == 0``.
      is_causal: restrict query ``p`` to keys ``t <= p`` (within its segment).
      scale: logit scale, default ``1 / sqrt(d)``.
      mode: ``"mixture"`` (every head runs every branch with offset ``j % r``, branches merged
        with their softmax mass, LongNet Eq. 10) or ``"grouped"`` (dilated-attention-pytorch
        after its fix ff80502, not the released 0.2.0 -- docs/migration.md: head groups, one
        branch each, output divided by the number of branches).
      implementation: ``None`` (the best core per branch, :mod:`dilax.registry`: ``"pallas"``
        on GPU, ``"xla"`` elsewhere and for what the kernels have no mask for), ``"xla"``
        (blockwise core), ``"pallas"`` (Pallas flash kernel per branch), ``"cudnn"``
        (``jax.nn.dot_product_attention`` per branch, CUDA only) or ``"reference"``
        (explicit mask; small ``n`` only). An explicit name that cannot serve a branch
        raises ``ValueError`` with the reason; it never runs another core.
      block_sizes: optional :class:`dilax.core.BlockSizes` for the blockwise core.
      interpret: run the Pallas kernels in the interpreter (CPU testing); with
        ``implementation=None`` the branches the kernels serve then run on them.
      query_seq_lengths: optional int ``(b,)``: in batch row ``i`` query rows
        ``p >= query_seq_lengths[i]`` output 0 with zero gradient (query blocks wholly past
        it are not computed).
      key_value_seq_lengths: optional int ``(b,)``: in batch row ``i`` keys
        ``t >= key_value_seq_lengths[i]`` get no weight (key blocks wholly past it are not
        read). Positions keep their index, so a padded row equals the unpadded sequence on its
        valid prefix. Static values outside ``[0, n]`` raise ``ValueError``; traced values are
        clipped to ``[0, n]``. ``None`` (default) compiles exactly the program without lengths.
      local_window: optional int ``W >= 0`` (``mode="mixture"`` only): one more branch in
        which query ``p`` attends keys ``|p - t| <= W`` (``t <= p`` when causal), merged into
        the same softmax. It gives every query its immediate neighbours, which no dilated
        branch does at segment starts; cost ``O(n * W)`` (XLA and Pallas visit only the blocks
        that meet the band). cuDNN has no band mask: ``implementation=None`` runs this branch
        on the best core that has (:mod:`dilax.registry`), an explicit ``"cudnn"`` raises.
      key_padding_mask: optional bool ``(b, n)``, True where a key is valid: an arbitrary
        per-key validity (``flax.nnx.make_attention_mask`` style padding), combined with
        ``key_value_seq_lengths``. Key blocks past the last valid key are skipped; runs on the
        XLA core or the Pallas kernels (cuDNN has no per-key mask).
      settings: a :class:`dilax.DilatedSettings` holding the whole configuration (then
        ``segment_lengths`` ... ``local_window`` must be left out).
      attention_mask: a :class:`dilax.AttentionMask` (then ``query_seq_lengths``,
        ``key_value_seq_lengths`` and ``key_padding_mask`` must be left out); its
        ``is_causal`` or ``is_causal`` here makes the call causal.
      segment_ids: optional int ``(b, n)``: packed documents. A document is a maximal run of
        equal ids in a row and is computed as a sequence of its own: segments, offsets,
        causality and the local window apply to its own positions ``p - start``, and no query
        attends a key of another document, so its rows equal the op on the document alone
        (docs/semantics.md, "Packed documents"). Runs on the XLA core (the kernels have no
        per-row key ranges) and costs the documents' own attended pairs, never ``n x n``.
      sequence_parallel: a :class:`dilax.SequenceParallel`: run as ring attention with the
        sequence split over ``sequence_parallel.mesh`` (each hop on the core the registry
        picks, as for the branches: Pallas on GPU; no ``key_padding_mask``;
        ``n`` divisible by the ``seq_axis`` size, ``local_window`` at most ``n/P``, see
        :func:`dilax.ring_dilated_attention`). Same result, forward and backward.
      mask: the deprecated spelling of ``attention_mask`` (warns). ``mask=`` means a dense
        boolean array in jax.nn and Flax (:func:`dilax.dot_product_attention`'s ``mask``).
      score_mod, mask_mod, logits_soft_cap, sinks: FlexAttention's options
        (docs/semantics.md, "Custom scores and masks"), as in :func:`dilax.flex_attention`:
        per attended pair ``s = scale q.k``, ``s = cap tanh(s / cap)``,
        ``s = score_mod(s, b, h, q_idx, kv_idx)``, pairs with ``mask_mod(b, h, q_idx,
        kv_idx)`` False removed, then the dilated rule (mixture: one softmax over the union,
        a pair counted once per branch that allows it; grouped: each group's own softmax).
        ``q_idx``, ``kv_idx`` are positions of the row (never indices of a dilated view or
        segment), ``h`` the query head, ``b`` the batch row (of the flattened batch with
        several leading batch dims). ``sinks`` float ``(h,)``: one extra logit per head in
        the (single) softmax denominator, differentiable. The mods may close over arrays;
        gradients reach the closed-over float ones. They run on the XLA core
        (``implementation=None`` picks it; an explicit ``"pallas"``, ``"cudnn"`` or
        ``"reference"`` raises with the registry's reason), each branch one core call, the
        branches merged outside the fused runner (their outputs are kept for the backward).
        With ``segment_ids`` the mods still see row positions (the documents' segments and
        offsets are on document positions). With ``sequence_parallel``: the document
        ring on the XLA core (``layout="contiguous"``), ``q_idx``/``kv_idx`` global row
        positions, closed-over arrays replicated on every device.
      block_mask: a :class:`dilax.flex.BlockMask` for ``(b or 1, h or 1, n, n)``: used as
        the source of its ``mask_mod`` only (when ``mask_mod`` is None); its block tables
        are not used, the branches skip blocks by their own geometry. The result equals the
        ``mask_mod`` applied pair by pair.

    Returns:
      ``(b, n, h, dv)`` in ``q.dtype``. Queries selected by no branch (or past their row's
      query length, or without a valid key) get 0.

    Raises:
      ValueError / TypeError at trace time for malformed inputs (see docs/semantics.md, "Errors").
    """
    settings = settings_from_keywords(
        settings, segment_lengths, dilation_rates, is_causal=is_causal, scale=scale, mode=mode,
        implementation=implementation, block_sizes=block_sizes, interpret=interpret,
        local_window=local_window)
    if sequence_parallel is not None:
        check_sequence_parallel(sequence_parallel, settings.implementation,
                                interpret=settings.interpret, dilated=True)
    q, k, v, rows, unfold = fold_batch_dims(
        q, k, v, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, key_padding_mask=key_padding_mask,
        segment_ids=segment_ids,
        mask=take_attention_mask(attention_mask, mask, "dilated_attention"))
    q, k, v, mask, settings = check_dilated_request(
        q, k, v, settings, empty_batch=sequence_parallel is None,
        value_head_dim=True, **rows)
    (b, n, h, d), dv = q.shape, v.shape[-1]
    flex = prepare_mods("dilated_attention", b, h, n, n, score_mod=score_mod,
                        mask_mod=mask_mod, block_mask=block_mask, sinks=sinks,
                        logits_soft_cap=logits_soft_cap)
    if sequence_parallel is not None:
        check_sharded(q, k.shape[2], mask, settings, sequence_parallel, dv)
        if mask_mod is None and block_mask is not None:
            mask_mod = block_mask.mask_mod
        mods = dict(score_mod=score_mod, mask_mod=mask_mod, sinks=sinks,
                    logits_soft_cap=logits_soft_cap)  # FlexAttention's: the document ring
        if mask.segment_ids is not None or flex is not None:
            return unfold(sharded_documents(q, k, v, mask, settings, sequence_parallel, **mods))
        return unfold(sharded_dilated(q, k, v, mask, settings, sequence_parallel))
    if flex is not None:  # the registry refuses the cores without the mods hook, by name
        choose(settings.implementation, CoreRequest(
            "dilated_branch", q.dtype, d, settings.is_causal, interpret=settings.interpret,
            value_head_dim=dv, **flex.request_flags))
    return unfold(dilated_validated(q, k, v, mask, settings, flex))


def dilated_validated(q, k, v, mask: AttentionMask, settings: DilatedSettings,
                      flex: FlexMods | None = None) -> jax.Array:
    """:func:`dilated_attention` (one device) on arguments :func:`check_dilated_request`
    returned: the memory check, then the compiled program of ``settings`` (with the
    FlexAttention options ``flex``, :func:`dilax.flex.api.prepare_mods`, when given)."""
    key_valid = mask.key_padding_mask
    if key_valid is not None:  # one past the last valid key: trailing blocks are skipped
        n, kv_len = q.shape[1], mask.key_value_seq_lengths
        last = jnp.max(jnp.where(key_valid, jnp.arange(1, n + 1), 0), axis=1).astype(jnp.int32)
        mask = dataclasses.replace(
            mask, key_value_seq_lengths=last if kv_len is None else jnp.minimum(kv_len, last))
    dense = resolve_implementation(settings.implementation,
                                   interpret=settings.interpret) == "reference"
    V.check_memory(q, k, num_branches=settings.num_branches, dense=dense,
                   op="dilated_attention")
    if q.shape[0] == 0:  # the blockwise cores need a row; the result is empty anyway
        return V.empty_batch(q, v)
    if flex is not None:
        return _dilated_flex_jit(q, k, v, mask, settings, core_mods(flex), flex.sinks,
                                 tuple(sorted(flex.request_flags.items())))
    return _dilated_jit(q, k, v, mask, settings)


@functools.partial(jax.jit, static_argnames=("settings", "flags"))
def _dilated_flex_jit(q, k, v, mask: AttentionMask, settings: DilatedSettings, mods, sinks,
                      flags):
    core = resolve(settings.implementation, interpret=settings.interpret)
    return dilated_flex(q, k, v, mask, settings, core, mods, sinks, dict(flags))[0]


# One compiled program per static configuration: eager calls then give bitwise the same
# result as calls under jax.jit (op-by-op dispatch would fuse, and round, differently).
@functools.partial(jax.jit, static_argnames=("settings",))
def _dilated_jit(q, k, v, mask: AttentionMask, settings: DilatedSettings):
    core = resolve(settings.implementation, interpret=settings.interpret)
    if core is None:
        return dilated_attention_reference(
            q, k, v, settings.segment_lengths, settings.dilation_rates,
            is_causal=settings.is_causal, scale=settings.scale_for(q.shape[3]),
            mode=settings.mode, query_seq_lengths=mask.query_seq_lengths,
            key_value_seq_lengths=mask.key_value_seq_lengths,
            local_window=settings.local_window, key_padding_mask=mask.key_padding_mask,
            segment_ids=mask.segment_ids)
    return dilated_attention_core(q, k, v, mask, settings, core)


def sharded_dilated_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_lengths: tuple[int, ...] | list[int] | int | None = None,
    dilation_rates: tuple[int, ...] | list[int] | int | None = None,
    *,
    mesh: Mesh,
    seq_axis: str = "sp",
    batch_axis: str | None = None,
    is_causal: bool = False,
    mode: str = "mixture",
    scale: float | None = None,
    layout: str = "contiguous",
    block_sizes: BlockSizes | None = None,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window: int | None = None,
    settings: DilatedSettings | None = None,
    mask: AttentionMask | None = None,
) -> jax.Array:
    """Sequence-parallel dilated attention over ``mesh`` (global view; builds the shard_map).

    An alias of ``dilax.dilated_attention(q, k, v, ..., sequence_parallel=
    dilax.SequenceParallel(mesh, seq_axis, batch_axis, layout))``, the one way to call it.

    Args:
      q: ``(b, n, h, d)``; k, v: ``(b, n, hk, d)`` in natural position order.
      mesh: a ``jax.sharding.Mesh``; the sequence is sharded over ``seq_axis`` (``P`` devices,
        ``n % P == 0``) and, optionally, the batch over ``batch_axis``.
      layout: ``"contiguous"`` or ``"zigzag"``. With ``"zigzag"`` the shards are permuted to the
        zigzag layout with point-to-point transfers inside the shard_map (``n % 2P == 0``) and
        the output is permuted back, so the caller always sees natural order.
      query_seq_lengths, key_value_seq_lengths: optional int ``(b,)`` valid lengths (sharded
        over ``batch_axis`` with the batch); local_window: optional ``W <= n/P`` (``n/(2P)``
        with zigzag).
      settings, mask: as in :func:`dilax.dilated_attention`.
      Other arguments: as in :func:`dilax.dilated_attention`.

    Returns:
      ``(b, n, h, d)`` in ``q.dtype``, sharded like ``q``; equal to
      ``dilated_attention(q, k, v, ...)``.

    Raises:
      TypeError: ``mesh`` is not a ``Mesh``; dtypes or non-static config as in
        :func:`dilax.dilated_attention`.
      ValueError: ``seq_axis``/``batch_axis`` not mesh axes or equal, ``n % P != 0``,
        ``layout="zigzag"`` with ``n % 2P != 0``, batch not divisible by the ``batch_axis``
        size, ``local_window`` longer than a local chunk, and every input error of
        :func:`dilax.dilated_attention`.
    """
    warnings.warn("dilax.sharded_dilated_attention is deprecated: use dilax.dilated_attention(..., "
                  "sequence_parallel=dilax.SequenceParallel(mesh, seq_axis))",
                  DeprecationWarning, stacklevel=2)
    return dilated_attention(
        q, k, v, segment_lengths, dilation_rates, is_causal=is_causal, mode=mode, scale=scale,
        block_sizes=block_sizes, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, local_window=local_window,
        settings=settings, attention_mask=mask,
        sequence_parallel=SequenceParallel(mesh, seq_axis, batch_axis, layout))
