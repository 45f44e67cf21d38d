"""The one branch runner of dilated attention, and the merge of branch results.

:func:`run_branches` computes several branches ``(w, r)`` with one :class:`dilax.core.Core`
under one ``custom_vjp``: the backward adds each branch's float32 dq, dk, dv into one float32
accumulator and rounds once, and every branch (forward and backward) is fenced behind the
previous one (:func:`dilax.core.when`), so only one branch's working set and gradients exist
at a time. The single-device op (:mod:`dilax.dilated`) and the ring's local branches
(:mod:`dilax.sp`) both run their branches through it. :func:`combine_branches` merges the
dilated-layout results (mixture: LongNet Eq. 10; grouped: head groups side by side).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from dilax.core import XLA, BlockSizes, Core, fence_after, output_delta, when
from dilax.core.interface import sum_invariant_axes
from dilax.layout import BranchPlan, branch_io, expand_slots, gather_dilated, slot_layout, unslot


@dataclasses.dataclass(frozen=True)
class Branches:
    """Static configuration of :func:`run_branches` (hashable)."""

    plans: tuple[BranchPlan, ...]
    scale: float
    is_causal: bool
    block_sizes: BlockSizes | None = None
    core: Core = XLA


def run_branches(q: jax.Array, k: jax.Array, v: jax.Array, branches: Branches, fence=None,
                 lengths: tuple[jax.Array | None, jax.Array | None] | None = None):
    """All ``branches.plans`` on ``q (b, n, h, d)``, ``k, v (b, n, hk, d)``.

    ``lengths``: optional ``(query_seq_lengths, key_value_seq_lengths)``, each ``None`` or int
    ``(b,)`` in ``[0, n]`` (:func:`dilax.layout.branch_io`): keys past a row's length get no
    weight and query rows past it get ``out = 0``, ``lse = -inf`` in every branch.

    Returns ``(outs, lses)``: tuples with one float32 ``(b*S, w/r, H', d)`` and one
    ``(b*S, w/r, H')`` per plan, in the dilated layout (heads ascending;
    :func:`dilax.layout.expand_slots` gives full positions). ``fence``: start only once this
    boolean is known (:func:`dilax.core.fence_after`; ordering only)."""
    if lengths is not None and all(x is None for x in lengths):
        lengths = None
    return _run(q, k, v, fence, lengths, branches)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _run(q, k, v, fence, lengths, cfg: Branches):
    return _run_fwd(q, k, v, fence, lengths, cfg)[0]


def _run_fwd(q, k, v, fence, lengths, cfg: Branches):
    outs, lses = [], []
    for plan in cfg.plans:
        def run(q, k, v, plan=plan):
            ops, view, mask = branch_io(q, k, v, plan, cfg.is_causal, lengths)
            # float32 branch outputs: merged (or divided by G) before one final rounding.
            return cfg.core.forward(*ops, view=view, mask=mask, scale=cfg.scale,
                                    block_sizes=cfg.block_sizes, out_dtype=jnp.float32)

        out, lse = when(fence_after(lses[-1]) if lses else fence, run, (q, k, v))
        outs.append(out)
        lses.append(lse)
    outs, lses = tuple(outs), tuple(lses)
    return (outs, lses), (q, k, v, lengths, outs, lses)


def _run_bwd(cfg: Branches, res, cts):
    q, k, v, lengths, outs, lses = res
    n = q.shape[1]
    # The outputs are only needed through rowsum(dO * O): reduce them first, so they can go.
    deltas = [output_delta(o, do, dl) for o, do, dl in zip(outs, *cts)]
    grads = ()
    for plan, delta, lse, dout in zip(cfg.plans, deltas, lses, cts[0]):
        def run(q, k, v, delta, lse, dout, *acc, plan=plan):
            ops, view, mask = branch_io(q, k, v, plan, cfg.is_causal, lengths)
            acc = tuple(slot_layout(a, plan) for a in acc) or None
            g = cfg.core.backward(*ops, view=view, mask=mask, scale=cfg.scale, lse=lse,
                                  dout=dout, delta=delta, block_sizes=cfg.block_sizes,
                                  grad_dtype=jnp.float32, acc=acc)
            return tuple(unslot(x, plan, n) for x in g)

        # Each branch adds into the float32 gradients of the ones before it, in place. The
        # first waits for the deltas: unfenced, its zero-initialized accumulators (constants)
        # would be scheduled -- and held -- during the forward.
        grads = when(fence_after(grads[0] if grads else deltas[-1]), run,
                     (q, k, v, delta, lse, dout) + grads)
    grads = tuple(g.astype(x.dtype) for g, x in zip(grads, (q, k, v)))
    return (*sum_invariant_axes((q, k, v), grads), None, None)


_run.defvjp(_run_fwd, _run_bwd)


def merge_branches(outs, lses, plans, n: int):
    """Mixture merge of dilated-layout branch results into full ``(b, n, h, d)`` float32 and
    ``lse (b, n, h)``: ``out = sum_i alpha_i o_i`` with ``alpha_i = softmax_i(lse_i)`` over the
    branches that selected the position (LongNet Eq. 10), 0 where none did. One fused pass
    over the outputs: no per-branch full-size intermediates, forward or backward."""
    return _merge(tuple(outs), tuple(lses), tuple(plans), n)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _merge(outs, lses, plans, n):
    return _merge_forward(outs, lses, plans, n)


def _merge_fwd(outs, lses, plans, n):
    out, lse, m_safe, total_safe = _merge_forward(outs, lses, plans, n, stats=True)
    return (out, lse), (outs, lses, m_safe, total_safe)


def _merge_bwd(plans, n, res, cts):
    # d o_i = alpha_i g;  d lse_i = alpha_i (<g, o_i> - <g, out> + g_lse), and
    # <g, out> = sum_i alpha_i <g, o_i>: everything in the branches' own layouts. alpha_i is
    # recomputed exactly as in the forward, e^{lse_i - m} / total: e^{lse_i - lse} would lose
    # ulp(lse) of relative precision (1e-3 at |logits| ~ 1e4).
    outs, lses, m_safe, total_safe = res
    g, g_lse = cts
    alphas, dots = [], []
    for o, l, p in zip(outs, lses, plans):
        tot = gather_dilated(total_safe, p, n)  # 0 on the padding rows past n: weight 0 there
        a = jnp.where((l == -jnp.inf) | (tot == 0), 0.0,
                      jnp.exp(l - gather_dilated(m_safe, p, n)) / jnp.where(tot == 0, 1.0, tot))
        gp = gather_dilated(g, p, n)
        alphas.append(a)
        dots.append(jnp.sum(gp * o.astype(jnp.float32), axis=-1))
    g_out = sum(expand_slots(a * s, p, n, 0.0) for a, s, p in zip(alphas, dots, plans))
    d_outs, d_lses = [], []
    for a, s, o, p in zip(alphas, dots, outs, plans):
        d_outs.append((a[..., None] * gather_dilated(g, p, n)).astype(o.dtype))
        d_lses.append(a * (s - gather_dilated(g_out, p, n) + gather_dilated(g_lse, p, n)))
    return tuple(d_outs), tuple(d_lses)


_merge.defvjp(_merge_fwd, _merge_bwd)


def _merge_forward(outs, lses, plans, n, stats=False):
    lse_full = jnp.stack([expand_slots(l, p, n, -jnp.inf) for l, p in zip(lses, plans)])
    m = jnp.max(lse_full, axis=0)
    m_safe = lax.stop_gradient(jnp.where(m == -jnp.inf, 0.0, m))
    e = jnp.exp(lse_full - m_safe)
    total = jnp.sum(e, axis=0)
    has_branch = total > 0
    total_safe = jnp.where(has_branch, total, 1.0)
    alpha = e / total_safe
    out = sum(alpha[i][..., None] * expand_slots(o.astype(jnp.float32), p, n, 0.0)
              for i, (o, p) in enumerate(zip(outs, plans)))
    lse = jnp.where(has_branch, m_safe + jnp.log(total_safe), -jnp.inf)
    return (out, lse, m_safe, total_safe) if stats else (out, lse)


def combine_branches(outs, lses, plans, n: int, mode: str):
    """Dilated-layout branch results -> full ``out (b, n, h, d)`` float32, ``lse (b, n, h)``.

    ``mode="mixture"``: :func:`merge_branches`; ``mode="grouped"``: the head groups side by
    side, divided by the number of branches (each group's lse as is)."""
    if mode == "mixture":
        return merge_branches(outs, lses, plans, n)
    out = jnp.concatenate(
        [expand_slots(o.astype(jnp.float32), p, n, 0.0) for o, p in zip(outs, plans)],
        axis=2) / len(plans)
    lse = jnp.concatenate([expand_slots(l, p, n, -jnp.inf) for l, p in zip(lses, plans)],
                          axis=2)
    return out, lse
