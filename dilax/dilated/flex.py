"""Dilated attention with FlexAttention's options (docs/semantics.md, "Custom scores and
masks (FlexAttention semantics), every op"): ``score_mod``, ``mask_mod``, ``logits_soft_cap``
and ``sinks`` on every branch.

Each branch is one differentiable core call (:func:`dilax.core.attention`) reading the slot
layout in place, as the fused runner's branches do, with the mods hook
(:class:`dilax.core.mods.Mods`) told the branch's geometry: the row position of every dilated
row per virtual kv head (``q_pos``/``kv_pos``, ``s*w + slot + r*i``), the batch row of every
segment (``batch``) and the query head of every virtual query head (``heads``). So a mod sees
``q_idx``/``kv_idx`` as positions of the full row and ``h`` as the real query head, never
indices of a dilated view. The branches are merged with plain jax operations
(:func:`dilax.branch.runner.combine_branches`; autodiff differentiates the merge and the core
calls' VJPs reach the closed-over float arrays), then ``sinks`` enter the one softmax through
the merged log-sum-exp (:func:`dilax.flex.api.with_sinks`): once per head and query, also in
the mixture. Packed documents (``segment_ids``): each branch is
:meth:`dilax.dilated.documents.DocumentBranch.attend`, whose rows are row positions already.
Calls without these options never come here (their programs are unchanged).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dilax.attention_mask import AttentionMask, document_bounds
from dilax.branch.plan import BranchPlan, branch_io, dilated_branches, window_plan
from dilax.branch.runner import combine_branches
from dilax.core import attention
from dilax.core.mods import Mods
from dilax.dilated.documents import DocumentBranch
from dilax.dilated.settings import DilatedSettings
from dilax.flex.api import with_sinks
from dilax.registry import branch_cores

_F32 = jnp.float32
_I32 = jnp.int32


def branch_mods(mods: Mods, plan: BranchPlan, b: int) -> Mods:
    """``mods`` for ``plan``'s core call on ``b`` batch rows (``b * S`` segment rows): row
    ``i`` of virtual kv head ``u`` in segment row ``i_b * S + s`` is position
    ``s * w + kv_slots[u] + r * i`` of batch row ``i_b`` (its query heads share the slot)."""
    S, w, r = plan.num_segments, plan.w, plan.r
    seg = jnp.arange(b * S, dtype=_I32)
    slots = jnp.asarray(np.asarray(plan.kv_slots, np.int32))
    pos = ((seg % S)[:, None, None] * w + slots[None, :, None]
           + r * jnp.arange(w // r, dtype=_I32)[None, None, :])  # (b*S, U, w/r)
    return dataclasses.replace(mods, q_pos=pos, kv_pos=pos, batch=seg // S,
                               heads=tuple(plan.q_heads))


def dilated_flex(q, k, v, mask: AttentionMask, settings: DilatedSettings, core,
                 mods: Mods | None, sinks, flags: dict) -> tuple[jax.Array, jax.Array]:
    """``(out (b, n, h, dv) in q.dtype, lse (b, n, h) float32)`` of validated arguments with
    the core mods ``mods`` (or None: sinks only) and ``sinks (h,)`` (or None). ``core``: the
    resolved implementation (:func:`dilax.registry.resolve`); ``flags``: the
    :class:`dilax.registry.CoreRequest` fields of the options (the registry picks each
    branch's core: the XLA core, the one with the mods hook)."""
    b, n, h = q.shape[:3]
    hk = k.shape[2]
    scale, is_causal = settings.scale_for(q.shape[3]), settings.is_causal
    plans = tuple(dilated_branches(n, h, hk, settings.segment_lengths,
                                   settings.dilation_rates, settings.mode))
    if settings.local_window is not None:
        plans += (window_plan(n, h, hk, settings.local_window),)
    lengths = (mask.query_seq_lengths, mask.key_value_seq_lengths, mask.key_padding_mask)
    documents = mask.segment_ids is not None
    cores = branch_cores(core, plans, dtype=q.dtype, head_dim=q.shape[-1], is_causal=is_causal,
                         key_padding=lengths[2] is not None,
                         lengths=lengths[0] is not None or lengths[1] is not None,
                         documents=documents, **dict(flags, value_head_dim=v.shape[-1]))
    outs, lses = [], []
    if documents:  # each branch on its documents' own positions; the mods on row positions
        aux = lengths + document_bounds(mask.segment_ids)
        ops = tuple(DocumentBranch(p, n, h, hk, float(scale), bool(is_causal),
                                   settings.block_sizes, c) for p, c in zip(plans, cores))
        for op in ops:
            out, lse = op.attend(q, k, v, aux, mods)
            outs.append(out)
            lses.append(lse)
        plans = tuple(op.result_plan for op in ops)
    else:
        lengths = None if all(x is None for x in lengths) else lengths
        for plan, c in zip(plans, cores, strict=True):
            ios, view, spec = branch_io(q, k, v, plan, is_causal, lengths)
            if mods is not None:
                spec = dataclasses.replace(spec, mods=branch_mods(mods, plan, b))
            out, lse = attention(*ios, view=view, scale=float(scale), mask=spec, core=c,
                                 block_sizes=settings.block_sizes, out_dtype=_F32)
            outs.append(out)
            lses.append(lse)
    out, lse = combine_branches(outs, lses, plans, n, settings.mode)
    if sinks is not None:  # one sink logit per head in the (merged) denominator
        return with_sinks(out, lse, sinks, q.dtype)
    return out.astype(q.dtype), lse
