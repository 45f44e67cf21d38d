"""The one branch runner of dilated attention, with the merge of branch results fused in.

:func:`attend_branches` computes several branches and merges them under ONE ``custom_vjp``.
A branch is any object with the :class:`BranchOp` methods: :class:`CoreBranch` (one core call
on the local sequence; the single-device op and the ring's local branches) or the ring's
spanning branches (:mod:`dilax.dilated.ring`). Forward: every branch fenced behind the
previous one (:func:`dilax.core.when`), so only one branch's working set exists at a time,
then one fused merge (mixture: LongNet Eq. 10; grouped: head groups side by side). Backward:
the merge's backward is fused with the branches' -- each branch's cotangents
``dO_i = alpha_i g`` and ``delta_i = rowsum(dO_i O_i) - dlse_i`` are formed only when that
branch runs, from row statistics reduced first (so the branch outputs can go) -- and every
branch adds its float32 dq, dk, dv into one float32 accumulator in place, rounded once.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax import lax

from dilax.branch.plan import (
    BranchPlan,
    branch_io,
    expand_slots,
    gather_dilated,
    slot_layout,
    unslot,
)
from dilax.core import XLA, BlockSizes, Core, fence_after, merge_attention_states, when
from dilax.core.interface import sum_invariant_axes

_F32 = jnp.float32


class BranchOp(Protocol):
    """One branch of :func:`attend_branches` (a hashable, static object).

    ``result_plan``: the dilated layout of its results (:func:`combine_branches`).
    ``forward(q, k, v, aux) -> (out f32, lse, res)`` in that layout (``res``: extra
    residuals; ``aux``: the non-differentiable arrays given to :func:`attend_branches`, e.g.
    valid lengths, or None).
    ``backward(q, k, v, aux, res, lse, dout, dlse, delta, acc) -> (dq, dk, dv)`` float32,
    added into ``acc`` (float32 ``(dq, dk, dv)`` of the inputs' shapes, or None). A branch
    with score mods (the last entry of ``aux``, a :class:`dilax.core.mods.Mods`) returns and
    takes ``(dq, dk, dv, *d_consts)``: the float32 cotangents of its float consts."""

    result_plan: BranchPlan

    def forward(self, q, k, v, aux): ...

    def backward(self, q, k, v, aux, res, lse, dout, dlse, delta, acc): ...


@dataclasses.dataclass(frozen=True)
class CoreBranch:
    """Branch ``plan`` as one call of ``core`` on ``q (b, n, h, d)``, ``k, v (b, n, hk, d)``.

    ``fold``: the sequence is ``fold`` independent pieces of ``n / fold`` (the ring's local
    branches: the chunks of a shard); ``plan`` is the plan of one piece. ``aux``: ``None`` or
    the valid lengths ``(q_len, kv_len, key_valid)`` of :func:`dilax.branch.plan.branch_io`; with
    ``fold > 1`` those of the pieces, ``(b * fold,)`` in piece coordinates (piece ``c`` of
    batch row ``i`` is row ``i * fold + c``)."""

    plan: BranchPlan
    scale: float
    is_causal: bool
    block_sizes: BlockSizes | None = None
    core: Core = XLA
    fold: int = 1

    @property
    def result_plan(self) -> BranchPlan:
        if self.fold == 1:
            return self.plan
        return dataclasses.replace(self.plan, num_segments=self.fold * self.plan.num_segments)

    def _io(self, q, k, v, aux):
        fold = lambda x: x.reshape(x.shape[0] * self.fold, x.shape[1] // self.fold,
                                   *x.shape[2:])
        return branch_io(fold(q), fold(k), fold(v), self.plan, self.is_causal, aux)

    def forward(self, q, k, v, aux):
        ops, view, mask = self._io(q, k, v, aux)
        # float32 branch outputs: merged (or divided by G) before one final rounding.
        out, lse = self.core.forward(*ops, view=view, mask=mask, scale=self.scale,
                                     block_sizes=self.block_sizes, out_dtype=_F32)
        return out, lse, None

    def backward(self, q, k, v, aux, res, lse, dout, dlse, delta, acc):
        del res, dlse
        ops, view, mask = self._io(q, k, v, aux)
        m = q.shape[1] // self.fold
        if acc is not None:
            acc = tuple(slot_layout(a.reshape(a.shape[0] * self.fold, m, *a.shape[2:]),
                                    self.plan) for a in acc)
        g = self.core.backward(*ops, view=view, mask=mask, scale=self.scale, lse=lse,
                               dout=dout, delta=delta, block_sizes=self.block_sizes,
                               grad_dtype=_F32, acc=acc)
        return tuple(unslot(x, self.plan, m).reshape(y.shape)
                     for x, y in zip(g, (q, k, v), strict=True))


@dataclasses.dataclass(frozen=True)
class _Attend:
    ops: tuple
    n: int
    mode: str
    out_dtype: Any

    @property
    def plans(self):
        return tuple(op.result_plan for op in self.ops)


def attend_branches(q: jax.Array, k: jax.Array, v: jax.Array, ops, mode: str, *,
                    out_dtype=None, fence=None, aux=None) -> tuple[jax.Array, jax.Array]:
    """All branches ``ops`` (:class:`BranchOp`) on ``q (b, n, h, d)``, ``k, v (b, n, hk, d)``,
    merged: ``out (b, n, h, d)`` in ``out_dtype`` (default float32) and ``lse (b, n, h)``
    float32 (see :func:`combine_branches`). ``fence``: start only once this boolean is known
    (:func:`dilax.core.fence_after`; ordering only). ``aux``: non-differentiable arrays every
    branch receives (e.g. valid lengths, :class:`CoreBranch`); ``None`` when there are none."""
    cfg = _Attend(tuple(ops), q.shape[1], mode, jnp.dtype(out_dtype or _F32))
    return _attend(q, k, v, fence, aux, cfg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attend(q, k, v, fence, aux, cfg: _Attend):
    if cfg.mode == "mixture" and all(getattr(op, "merge_online", False) for op in cfg.ops):
        return _attend_online(q, k, v, fence, aux, cfg)
    return _attend_fwd(q, k, v, fence, aux, cfg)[0]


def _attend_online(q, k, v, fence, aux, cfg: _Attend):
    """The mixture merge (:func:`merge_branches`) as the branches run, for ops that ask for
    it (``merge_online``: full-length results, e.g. packed documents): without a backward
    nothing is kept, so one float32 ``(out, lse)`` state, merged with each branch's result
    (:func:`merge_attention_states`), replaces every branch output at once."""
    n = cfg.n

    def branch(q, k, v, aux, op, p):
        out, lse, _ = op.forward(q, k, v, aux)
        return expand_slots(out.astype(_F32), p, n, 0.0), expand_slots(lse, p, n, -jnp.inf)

    def step(q, k, v, aux, out, lse, op, p):  # the merged state, updated in place
        return merge_attention_states(out, lse, *branch(q, k, v, aux, op, p))

    (op0, *ops), (p0, *plans) = cfg.ops, cfg.plans
    state = when(fence, functools.partial(branch, op=op0, p=p0), (q, k, v, aux))
    for op, p in zip(ops, plans, strict=True):
        state = when(fence_after(state[1]), functools.partial(step, op=op, p=p),
                     (q, k, v, aux), carry=state)
    out, lse = state
    return out.astype(cfg.out_dtype), lse


def _attend_fwd(q, k, v, fence, aux, cfg: _Attend):
    outs, lses, extras = [], [], []
    for op in cfg.ops:
        out, lse, res = when(fence_after(lses[-1]) if lses else fence,
                             lambda q, k, v, aux, op=op: op.forward(q, k, v, aux),
                             (q, k, v, aux))
        outs.append(out)
        lses.append(lse)
        extras.append(res)
    outs, lses = tuple(outs), tuple(lses)
    if cfg.mode == "mixture":
        out, lse, m_safe, total_safe = _merge_forward(outs, lses, cfg.plans, cfg.n, stats=True)
        stats = (m_safe, total_safe)
    else:
        out, lse = combine_branches(outs, lses, cfg.plans, cfg.n, cfg.mode)
        stats = None
    return (out.astype(cfg.out_dtype), lse), (q, k, v, aux, outs, lses, tuple(extras), stats)


def _alpha(lse, plan, n, stats):
    """Mixture weight of a branch's rows, recomputed exactly as in the forward:
    ``e^{lse_i - m} / total`` (``e^{lse_i - lse}`` would lose ulp(lse) of relative precision,
    1e-3 at ``|logits| ~ 1e4``)."""
    m_safe, total_safe = stats
    tot = gather_dilated(total_safe, plan, n)  # 0 on the padding rows past n: weight 0 there
    return jnp.where((lse == -jnp.inf) | (tot == 0), 0.0,
                     jnp.exp(lse - gather_dilated(m_safe, plan, n))
                     / jnp.where(tot == 0, 1.0, tot))


def _attend_bwd(cfg: _Attend, res, cts):
    q, k, v, aux, outs, lses, extras, stats = res
    g, g_lse = cts
    n, mixture, nb = cfg.n, cfg.mode == "mixture", len(cfg.ops)
    # Pass 1, row statistics only: s_i = <g, o_i> per branch row (and the mixture weights), so
    # the branch outputs die before any branch's backward allocates.
    def row_stats(g, outs, lses, stats):
        alphas, dots = [], []
        for o, lse, p in zip(outs, lses, cfg.plans, strict=True):
            dots.append(jnp.sum(gather_dilated(g, p, n).astype(_F32) * o, axis=-1))
            alphas.append(_alpha(lse, p, n, stats) if mixture else None)
        # <g, out> = sum_i alpha_i s_i, in the full layout (mixture)
        g_out = (sum(expand_slots(a * s, p, n, 0.0) for a, s, p in zip(alphas, dots, cfg.plans))
                 if mixture else None)
        return alphas, dots, g_out

    # Fenced behind the forward's last result: a constant cotangent (the gradient of a sum)
    # makes the dilated copies of g operand-free, which XLA's scheduler would otherwise
    # materialize at the very start, live through the whole forward.
    alphas, dots, g_out = when(fence_after(lses[-1]), row_stats, (g, outs, lses, stats))

    # Pass 2, one branch at a time: d o_i = alpha_i g, d lse_i = alpha_i (s_i - <g, out> +
    # g_lse) (grouped: g / G and g_lse), delta_i = rowsum(d o_i o_i) - d lse_i.
    acc = ()
    for op, p, lse, extra, a, s in zip(cfg.ops, cfg.plans, lses, extras, alphas, dots,
                                       strict=True):
        def run(q, k, v, aux, g, g_lse, g_out, lse, extra, a, s, *acc, op=op, p=p):
            gp = gather_dilated(g, p, n).astype(_F32)
            gl = gather_dilated(g_lse, p, n)
            if mixture:
                dout = a[..., None] * gp
                dlse = a * (s - gather_dilated(g_out, p, n) + gl)
                delta = a * s - dlse
            else:
                dout = gp / nb
                dlse = gl
                delta = s / nb - dlse
            return op.backward(q, k, v, aux, extra, lse, dout, dlse, delta, acc or None)

        # Each branch waits for the previous one's accumulators (the first for the row
        # statistics): unfenced, zero-initialized accumulators (constants) would be scheduled
        # -- and held -- during the forward. The accumulators are the cond's carry, updated
        # in place (as operands they were copied: two sets of float32 gradients).
        fence = fence_after(acc[0] if acc else (g_out if mixture else dots[-1]))
        acc = tuple(when(fence, run, (q, k, v, aux, g, g_lse, g_out, lse, extra, a, s),
                         carry=acc))
    grads = tuple(x.astype(y.dtype) for x, y in zip(acc[:3], (q, k, v), strict=True))
    return (*sum_invariant_axes((q, k, v), grads), None, _aux_cotangent(aux, acc[3:]))


def _aux_cotangent(aux, extra):
    """None, or with score mods in ``aux`` (a :class:`dilax.core.mods.Mods` entry, whose
    branches add their float32 ``d(consts)`` after ``(dq, dk, dv)``) their cotangent, summed
    over the mesh axes the consts are invariant over (replicated arrays: every device's
    share)."""
    if not extra:
        return None
    diff = [c for c in aux[-1].score_consts if jnp.issubdtype(jnp.result_type(c), jnp.inexact)]
    extra = sum_invariant_axes(diff, [g.astype(c.dtype) for g, c in zip(extra, diff)])
    blank = jax.tree.map(lambda _: None, aux[:-1])
    return (*blank, aux[-1].cotangent(extra))


_attend.defvjp(_attend_fwd, _attend_bwd)


def merge_branches(outs, lses, plans, n: int):
    """Mixture merge of dilated-layout branch results into full ``(b, n, h, d)`` float32 and
    ``lse (b, n, h)``: ``out = sum_i alpha_i o_i`` with ``alpha_i = softmax_i(lse_i)`` over the
    branches that selected the position (LongNet Eq. 10), 0 where none did. One fused pass
    over the outputs (differentiate through :func:`attend_branches`, whose backward is
    fused with the branches')."""
    return _merge_forward(tuple(outs), tuple(lses), tuple(plans), n)


def _merge_forward(outs, lses, plans, n, stats=False):
    lse_full = jnp.stack([expand_slots(l, p, n, -jnp.inf) for l, p in zip(lses, plans)])
    m = jnp.max(lse_full, axis=0)
    m_safe = lax.stop_gradient(jnp.where(m == -jnp.inf, 0.0, m))
    e = jnp.exp(lse_full - m_safe[None])  # explicit ranks: works under rank promotion "raise"
    total = jnp.sum(e, axis=0)
    has_branch = total > 0
    total_safe = jnp.where(has_branch, total, 1.0)
    alpha = e / total_safe[None]
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
    # groups in head order, whatever order the branches ran in
    order = sorted(range(len(plans)), key=lambda i: min(plans[i].q_heads))
    out = jnp.concatenate(
        [expand_slots(outs[i].astype(jnp.float32), plans[i], n, 0.0) for i in order],
        axis=2) / len(plans)
    lse = jnp.concatenate([expand_slots(lses[i], plans[i], n, -jnp.inf) for i in order],
                          axis=2)
    return out, lse
