"""Dilated (LongNet) attention: the two modes of docs/semantics.md on top of the blockwise core.

A branch ``(w, r)`` is computed segment-major with reshapes only: the padded sequence is viewed
as ``(b, S, w/r, r, h, d)`` (segment, dilated index, offset slot, head), each head takes the
slot of its offset with static slices, and all segments of all heads that share the branch go
through *one* :func:`dilax.core.attention_core` call with the segments folded into the batch.
Branch outputs come back in the same view (zeros at unselected positions, ``lse = -inf``) and
are merged in float32 with their log-sum-exp weights (mixture) or scaled by ``1/G`` (grouped).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dilax import _validation as V
from dilax.backend import resolve_implementation
from dilax.core import (
    BlockSizes,
    SlotView,
    attention_core,
    attention_view,
    fence_after,
    output_delta,
    static_take,
    view_backward,
    view_forward,
    when,
)
from dilax.reference import dilated_attention_reference, group_sizes


@dataclasses.dataclass(frozen=True)
class BranchPlan:
    """Static layout of one core call: which heads, which offsets, how they pair with K/V.

    Virtual kv head ``u`` reads kv head ``kv_heads[u]`` at slot ``kv_slots[u]``; it serves the
    ``q_per_kv`` query heads ``q_heads[u*q_per_kv:(u+1)*q_per_kv]`` (all at that same slot).
    """

    w: int  # effective segment length (w capped at round_up(n, r))
    r: int
    num_segments: int
    q_heads: tuple[int, ...]
    q_slots: tuple[int, ...]
    kv_heads: tuple[int, ...]
    kv_slots: tuple[int, ...]
    q_per_kv: int
    kv_len: tuple[tuple[int, ...], ...]  # (S, U) valid dilated keys per segment and kv head

    @property
    def seg_len(self) -> int:
        return self.w // self.r


@functools.lru_cache(maxsize=512)
def plan_branch(
    n: int, num_heads: int, num_kv_heads: int, w: int, r: int, heads: tuple[int, ...],
    offsets: tuple[int, ...],
) -> BranchPlan:
    """Builds the :class:`BranchPlan` of branch ``(w, r)`` for ``heads`` at ``offsets``."""
    w_eff = min(w, -(-n // r) * r)  # w > n: one segment covering the whole sequence
    num_segments = -(-n // w_eff)
    per_kv = num_heads // num_kv_heads
    # Pair query heads by (kv head, slot); sorting by slot first gives strided runs for slices.
    pairs: OrderedDict[tuple[int, int], list[int]] = OrderedDict()
    for j, o in sorted(zip(heads, offsets), key=lambda t: (t[1], t[0] // per_kv, t[0])):
        pairs.setdefault((o, j // per_kv), []).append(j)
    sizes = {len(v) for v in pairs.values()}
    if len(sizes) == 1:
        q_per_kv = sizes.pop()
        groups = list(pairs.items())
    else:  # uneven GQA split: one virtual kv head per query head (K/V slices of n/r rows)
        q_per_kv = 1
        groups = [((o, j // per_kv), [j]) for (o, _), js in pairs.items() for j in js]
    q_heads = tuple(j for _, js in groups for j in js)
    slot_of = dict(zip(heads, offsets))
    q_slots = tuple(slot_of[j] for j in q_heads)
    kv_slots = tuple(o for (o, _), _ in groups)
    kv_heads = tuple(c for (_, c), _ in groups)
    m = w_eff // r
    kv_len = tuple(
        tuple(int(np.clip(-(-(n - s * w_eff - o) // r), 0, m)) for o in kv_slots)
        for s in range(num_segments)
    )
    return BranchPlan(w_eff, r, num_segments, q_heads, q_slots, kv_heads, kv_slots, q_per_kv,
                      kv_len)


def _split_slots(x: jax.Array, plan: BranchPlan, heads: tuple[int, ...], slots: tuple[int, ...],
                 n: int) -> jax.Array:
    """``(b, n, H, d)`` -> ``(b*S, w/r, len(heads), d)``: head ``heads[i]`` at ``slots[i]``."""
    b, _, H, d = x.shape
    S, w, r = plan.num_segments, plan.w, plan.r
    x = jnp.pad(x, ((0, 0), (0, S * w - n), (0, 0), (0, 0))) if S * w != n else x
    x = x.reshape(b, S, w // r, r * H, d)  # flat index slot * H + head
    x = static_take(x, tuple(o * H + j for j, o in zip(heads, slots)), axis=3)
    return x.reshape(b * S, w // r, len(heads), d)


def _expand_slots(y: jax.Array, plan: BranchPlan, n: int, fill) -> jax.Array:
    """Dilated ``(b*S, w/r, H', ...)`` (heads ascending) -> full ``(b, n, H', ...)``.

    Head ``plan.q_heads[i]``'s row ``t`` of segment ``s`` lands at ``s*w + slot + r*t``; the
    other positions get ``fill``. Pure reshape/broadcast/select: XLA fuses it into consumers.
    """
    S, w, r = plan.num_segments, plan.w, plan.r
    b = y.shape[0] // S
    heads = sorted(plan.q_heads)
    slot_of = dict(zip(plan.q_heads, plan.q_slots))
    tail = y.shape[3:]
    y = y.reshape(b, S, w // r, 1, len(heads), *tail)
    slots = np.array([slot_of[j] for j in heads])
    onehot = (np.arange(r)[:, None] == slots[None, :]).reshape(
        (1, 1, 1, r, len(heads)) + (1,) * len(tail))
    full = jnp.where(onehot, y, jnp.asarray(fill, y.dtype)).reshape(b, S * w, len(heads), *tail)
    return full[:, :n] if S * w != n else full


def _merge_slots(y: jax.Array, plan: BranchPlan, heads: tuple[int, ...], b: int, n: int,
                 fill) -> jax.Array:
    """Inverse of :func:`_split_slots`: ``(b*S, w/r, len(heads), ...)`` in ``heads`` order ->
    full ``(b, n, H', ...)`` with heads ascending and ``fill`` at unselected positions."""
    order = tuple(sorted(range(len(heads)), key=heads.__getitem__))
    y = static_take(y, order, axis=2)
    return _expand_slots(y, plan, n, fill).reshape(b, -1, *y.shape[2:])[:, :n]


def _slot_layout(x: jax.Array, plan: BranchPlan) -> jax.Array:
    """``(b, n, H, d)`` -> ``(b*S, w/r, r, H, d)``: a reshape (plus zero padding of the tail).

    With ``r = 1`` the slot axis is dropped: ``(b*S, w, H, d)`` (see :class:`SlotView`)."""
    b, n, H, d = x.shape
    S, w, r = plan.num_segments, plan.w, plan.r
    if S * w != n:
        x = jnp.pad(x, ((0, 0), (0, S * w - n), (0, 0), (0, 0)))
    if r == 1:
        return x.reshape(b * S, w, H, d)
    return x.reshape(b * S, w // r, r, H, d)


def slot_view(plan: BranchPlan, num_heads: int, num_kv_heads: int) -> SlotView:
    """The :class:`dilax.core.SlotView` that reads ``plan``'s heads at their offsets."""
    return SlotView(
        plan.r, num_heads, num_kv_heads,
        tuple(o * num_heads + j for j, o in zip(plan.q_heads, plan.q_slots)),
        tuple(o * num_kv_heads + c for c, o in zip(plan.kv_heads, plan.kv_slots)),
    )


def _plan_kv_len(plan: BranchPlan, b: int):
    if all(length == plan.seg_len for row in plan.kv_len for length in row):
        return None  # every segment full: no key mask at all
    return jnp.tile(jnp.asarray(np.array(plan.kv_len, np.int32)), (b, 1))  # (b*S, U)


def _unslot(x: jax.Array, plan: BranchPlan, n: int) -> jax.Array:
    """Inverse of :func:`_slot_layout`: ``(b*S, w/r, [r,] H, d)`` -> ``(b, n, H, d)``."""
    b = x.shape[0] // plan.num_segments
    return x.reshape(b, plan.num_segments * plan.w, *x.shape[-2:])[:, :n]


@dataclasses.dataclass(frozen=True)
class _Branches:
    """Static configuration of :func:`_xla_branches`."""

    plans: tuple[BranchPlan, ...]
    scale: float
    is_causal: bool
    block_sizes: BlockSizes | None


def _branch_io(q, k, v, plan, scale, is_causal, block_sizes):
    """Slot-layout inputs, :class:`SlotView` and core keyword arguments of one branch."""
    view = slot_view(plan, q.shape[2], k.shape[2])
    kw = dict(scale=scale, is_causal=is_causal, kv_len=_plan_kv_len(plan, q.shape[0]),
              block_sizes=block_sizes)
    return (_slot_layout(q, plan), _slot_layout(k, plan), _slot_layout(v, plan)), view, kw


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _xla_branches(q, k, v, cfg: _Branches):
    """All branches with the blockwise core, in the dilated layout (``outs``, ``lses`` tuples).

    One ``custom_vjp`` over every branch: the backward adds each branch's float32 dq, dk, dv
    into one float32 accumulator and rounds once, and every branch (forward and backward) is
    fenced behind the previous one (:func:`dilax.core.when`), so only one branch's working
    set and gradients exist at a time."""
    return _xla_branches_fwd(q, k, v, cfg)[0]


def _xla_branches_fwd(q, k, v, cfg: _Branches):
    outs, lses = [], []
    for plan in cfg.plans:
        def run(q, k, v, plan=plan):
            ops, view, kw = _branch_io(q, k, v, plan, cfg.scale, cfg.is_causal, cfg.block_sizes)
            # float32 branch outputs: merged (or divided by G) before one final rounding.
            return view_forward(*ops, view, out_dtype=jnp.float32, **kw)

        out, lse = when(fence_after(lses[-1]) if lses else None, run, (q, k, v))
        outs.append(out)
        lses.append(lse)
    outs, lses = tuple(outs), tuple(lses)
    return (outs, lses), (q, k, v, outs, lses)


def _xla_branches_bwd(cfg: _Branches, res, cts):
    q, k, v, outs, lses = res
    n = q.shape[1]
    # The outputs are only needed through rowsum(dO * O): reduce them first, so they can go.
    deltas = [output_delta(o, do, dl) for o, do, dl in zip(outs, *cts)]
    grads = ()
    for plan, delta, lse, dout in zip(cfg.plans, deltas, lses, cts[0]):
        def run(q, k, v, delta, lse, dout, *acc, plan=plan):
            ops, view, kw = _branch_io(q, k, v, plan, cfg.scale, cfg.is_causal, cfg.block_sizes)
            acc = tuple(_slot_layout(a, plan) for a in acc) or None
            g = view_backward(*ops, view, delta, lse, dout, grad_dtype=jnp.float32, acc=acc,
                              **kw)
            return tuple(_unslot(x, plan, n) for x in g)

        # Each branch adds into the float32 gradients of the ones before it, in place. The
        # first waits for the deltas: unfenced, its zero-initialized accumulators (constants)
        # would be scheduled -- and held -- during the forward.
        fence = fence_after(grads[0] if grads else deltas[-1])
        grads = when(fence, run, (q, k, v, delta, lse, dout) + grads)
    return tuple(g.astype(x.dtype) for g, x in zip(grads, (q, k, v)))


_xla_branches.defvjp(_xla_branches_fwd, _xla_branches_bwd)


def _run_branch(q, k, v, plan: BranchPlan, scale, is_causal, block_sizes,
                attention_fn=attention_core, fence=None):
    """One branch for ``plan.q_heads``, in the dilated layout: ``out (b*S, w/r, H', d)`` and
    ``lse (b*S, w/r, H')``, heads ascending (:func:`_expand_slots` gives full positions).

    With the default core the dilated rows are read in place through a
    :class:`dilax.core.SlotView` (reshape only, no copies). Any other ``attention_fn`` with the
    signature of :func:`dilax.core.attention_core` (e.g. a Pallas kernel) gets gathered
    ``(b*S, w/r, U, G, d)`` inputs instead. ``fence``: run the branch only once this boolean is
    known (:func:`dilax.core.fence_after`; ordering only)."""
    b, n, h, d = q.shape
    if attention_fn is attention_core:
        io, view, kw = _branch_io(q, k, v, plan, scale, is_causal, block_sizes)
        # float32 branch outputs: merged (or divided by G) before one final rounding.
        return attention_view(*io, view, out_dtype=jnp.float32, fence=fence, **kw)
    kv_len = _plan_kv_len(plan, b)
    U, G = len(plan.kv_heads), plan.q_per_kv
    qd = _split_slots(q, plan, plan.q_heads, plan.q_slots, n).reshape(-1, plan.seg_len, U, G, d)
    kd = _split_slots(k, plan, plan.kv_heads, plan.kv_slots, n)
    vd = _split_slots(v, plan, plan.kv_heads, plan.kv_slots, n)
    out, lse = attention_fn(qd, kd, vd, scale=scale, is_causal=is_causal, kv_len=kv_len,
                            block_sizes=block_sizes)
    order = tuple(sorted(range(len(plan.q_heads)), key=plan.q_heads.__getitem__))
    out = static_take(out.reshape(-1, plan.seg_len, U * G, d), order, axis=2)
    lse = static_take(lse.reshape(-1, plan.seg_len, U * G), order, axis=2)
    return out, lse


def dilated_branches(
    n: int, num_heads: int, num_kv_heads: int, segment_lengths: tuple[int, ...],
    dilation_rates: tuple[int, ...], mode: str,
) -> list[BranchPlan]:
    """The static core calls of a configuration (one per branch, per group in grouped mode)."""
    plans = []
    if mode == "mixture":
        heads = tuple(range(num_heads))
        for w, r in zip(segment_lengths, dilation_rates):
            plans.append(plan_branch(n, num_heads, num_kv_heads, w, r, heads,
                                     tuple(j % r for j in heads)))
    else:
        start = 0
        for i, (size, w, r) in enumerate(
            zip(group_sizes(num_heads, len(segment_lengths)), segment_lengths, dilation_rates)
        ):
            heads = tuple(range(start, start + size))
            plans.append(plan_branch(n, num_heads, num_kv_heads, w, r, heads, (i % r,) * size))
            start += size
    return plans


def attended_pairs(
    n: int, num_heads: int, segment_lengths: tuple[int, ...], dilation_rates: tuple[int, ...],
    mode: str = "mixture", is_causal: bool = False,
) -> int:
    """Number of (head, query, key) score entries a configuration computes, summed over branches.

    This is ``C.sum()`` of the reference count matrix, in closed form (no ``n x n`` array), and
    the FLOP count of the attention is ``4 * d`` per pair forward.
    """
    total = 0
    for plan in dilated_branches(n, num_heads, num_heads, tuple(segment_lengths),
                                 tuple(dilation_rates), mode):
        c = np.asarray(plan.kv_len, np.int64)  # selected positions per (segment, head)
        total += int((c * (c + 1) // 2).sum() if is_causal else (c * c).sum())
    return total


def merge_branches(outs, lses, plans, n: int):
    """Mixture merge of dilated-layout branch results into full ``(b, n, h, d)`` float32 and
    ``lse (b, n, h)``: ``out = sum_i alpha_i o_i`` with ``alpha_i = softmax_i(lse_i)`` over the
    branches that selected the position (LongNet Eq. 10), 0 where none did. One fused pass
    over the outputs: no per-branch full-size intermediates, forward or backward."""
    return _merge(tuple(outs), tuple(lses), tuple(plans), n)


def _gather(x: jax.Array, plan: BranchPlan, n: int) -> jax.Array:
    """Full ``(b, n, H, ...)`` -> ``plan``'s dilated layout ``(b*S, w/r, H', ...)``, heads
    ascending (the layout of the branch outputs)."""
    heads = tuple(sorted(plan.q_heads))
    slot_of = dict(zip(plan.q_heads, plan.q_slots))
    tail = x.shape[3:]
    x = x.reshape(*x.shape[:3], -1)
    y = _split_slots(x, plan, heads, tuple(slot_of[j] for j in heads), n)
    return y.reshape(*y.shape[:3], *tail)


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
        tot = _gather(total_safe, p, n)  # 0 on the padding rows past n: weight 0 there
        a = jnp.where((l == -jnp.inf) | (tot == 0), 0.0,
                      jnp.exp(l - _gather(m_safe, p, n)) / jnp.where(tot == 0, 1.0, tot))
        gp = _gather(g, p, n)
        alphas.append(a)
        dots.append(jnp.sum(gp * o.astype(jnp.float32), axis=-1))
    g_out = sum(_expand_slots(a * s, p, n, 0.0) for a, s, p in zip(alphas, dots, plans))
    d_outs, d_lses = [], []
    for a, s, o, p in zip(alphas, dots, outs, plans):
        d_outs.append((a[..., None] * _gather(g, p, n)).astype(o.dtype))
        d_lses.append(a * (s - _gather(g_out, p, n) + _gather(g_lse, p, n)))
    return tuple(d_outs), tuple(d_lses)


_merge.defvjp(_merge_fwd, _merge_bwd)


def _merge_forward(outs, lses, plans, n, stats=False):
    lse_full = jnp.stack([_expand_slots(l, p, n, -jnp.inf) for l, p in zip(lses, plans)])
    m = jnp.max(lse_full, axis=0)
    m_safe = lax.stop_gradient(jnp.where(m == -jnp.inf, 0.0, m))
    e = jnp.exp(lse_full - m_safe)
    total = jnp.sum(e, axis=0)
    has_branch = total > 0
    total_safe = jnp.where(has_branch, total, 1.0)
    alpha = e / total_safe
    out = sum(alpha[i][..., None] * _expand_slots(o.astype(jnp.float32), p, n, 0.0)
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
        [_expand_slots(o.astype(jnp.float32), p, n, 0.0) for o, p in zip(outs, plans)],
        axis=2) / len(plans)
    lse = jnp.concatenate([_expand_slots(l, p, n, -jnp.inf) for l, p in zip(lses, plans)],
                          axis=2)
    return out, lse


def dilated_attention_xla(q, k, v, segment_lengths, dilation_rates, *, is_causal, scale, mode,
                          block_sizes=None, return_lse=False, attention_fn=attention_core):
    """XLA path. Arguments must be validated (see :func:`dilated_attention`).

    ``attention_fn``: the per-branch core, :func:`dilax.core.attention_core` by default; any
    function with its calling convention (e.g. ``pallas_kernels.flash_attention``) works.
    Returns ``out (b, n, h, d)`` and, with ``return_lse``, ``lse (b, n, h)`` float32."""
    b, n, h, d = q.shape
    plans = dilated_branches(n, h, k.shape[2], segment_lengths, dilation_rates, mode)
    if attention_fn is attention_core:
        outs, lses = _xla_branches(q, k, v, _Branches(tuple(plans), float(scale),
                                                      bool(is_causal), block_sizes))
    else:
        results = [_run_branch(q, k, v, plan, scale, is_causal, block_sizes, attention_fn)
                   for plan in plans]
        outs, lses = [r[0] for r in results], [r[1] for r in results]
    out, lse = combine_branches(outs, lses, plans, n, mode)
    out = out.astype(q.dtype)
    return (out, lse) if return_lse else out


def dilated_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_lengths: tuple[int, ...] | list[int] | int,
    dilation_rates: tuple[int, ...] | list[int] | int,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    mode: str = "mixture",
    implementation: str | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Dilated attention (LongNet), exactly as specified in docs/semantics.md.

    Args:
      q: ``(b, n, h, d)`` queries.
      k, v: ``(b, n, hk, d)`` keys and values, ``h % hk == 0`` (GQA/MQA without repeating K/V).
      segment_lengths: ``(w_0, ...)``, one per branch; any ``n >= 1`` is allowed (the last
        segment is shorter when ``n % w != 0``; ``w > n`` means one segment).
      dilation_rates: ``(r_0, ...)``, same length, ``w_i % r_i == 0``.
      is_causal: restrict query ``p`` to keys ``t <= p`` (within its segment).
      scale: logit scale, default ``1 / sqrt(d)``.
      mode: ``"mixture"`` (every head runs every branch with offset ``j % r``, branches merged
        with their softmax mass, LongNet Eq. 10) or ``"grouped"`` (dilated-attention-pytorch:
        head groups, one branch each, output divided by the number of branches).
      implementation: ``None`` (best for the backend: ``"pallas"`` on GPU, ``"xla"``
        elsewhere), ``"xla"`` (blockwise core), ``"pallas"`` (Pallas flash kernel per branch),
        ``"cudnn"`` (``jax.nn.dot_product_attention`` per branch, CUDA only) or
        ``"reference"`` (explicit mask; small ``n`` only).
      block_sizes: optional :class:`dilax.core.BlockSizes` for the blockwise core.
      interpret: run the Pallas kernels in the interpreter (CPU testing); implies
        ``implementation="pallas"`` when ``implementation`` is None.

    Returns:
      ``(b, n, h, d)`` in ``q.dtype``. Queries selected by no branch get 0.

    Raises:
      ValueError / TypeError at trace time for malformed inputs (see docs/semantics.md, "Errors").
    """
    q, k, v = V.check_qkv(q, k, v)
    ws, rs, mode, is_causal, scale, block_sizes = V.check_dilated_call(
        q, segment_lengths, dilation_rates, mode, is_causal, scale, block_sizes)
    interpret = V.check_bool(interpret, "interpret")
    implementation = resolve_implementation(implementation, interpret=interpret)
    V.check_memory(q, k, num_branches=len(ws), dense=implementation == "reference",
                   op="dilated_attention")
    return _dilated_jit(q, k, v, ws, rs, is_causal, scale, mode, implementation, block_sizes,
                        interpret)


# One compiled program per static configuration: eager calls then give bitwise the same
# result as calls under jax.jit (op-by-op dispatch would fuse, and round, differently).
@functools.partial(jax.jit, static_argnums=tuple(range(3, 11)))
def _dilated_jit(q, k, v, ws, rs, is_causal, scale, mode, implementation, block_sizes,
                 interpret):
    if implementation == "reference":
        return dilated_attention_reference(q, k, v, ws, rs, is_causal=is_causal, scale=scale,
                                           mode=mode)
    attention_fn = attention_core
    if implementation == "pallas":
        from pallas_kernels.flash_attention import flash_attention  # lazy: optional kernels

        attention_fn = functools.partial(flash_attention, interpret=interpret)
    elif implementation == "cudnn":
        attention_fn = _cudnn_attention
    return dilated_attention_xla(q, k, v, ws, rs, is_causal=is_causal, scale=scale, mode=mode,
                                 block_sizes=block_sizes, attention_fn=attention_fn)


def _cudnn_attention(q, k, v, *, scale, is_causal, kv_len, block_sizes=None):
    """Core calling convention on top of ``jax.nn.dot_product_attention(implementation="cudnn")``.

    cuDNN takes one key length per batch row, so a ragged last segment is only supported when
    it is the same for every head (always true without dilation). Unverified on hardware here.
    """
    del block_sizes
    B, L, Hk, G, d = q.shape
    lengths = None
    if kv_len is not None:
        lens = np.asarray(kv_len)
        if (lens != lens[:, :1]).any():
            raise ValueError("implementation='cudnn' needs the same valid key length for every "
                             "head; use n divisible by every segment length, or 'xla'/'pallas'")
        lengths = jnp.asarray(lens[:, 0], jnp.int32)
    out, lse = jax.nn.dot_product_attention(
        q.reshape(B, L, Hk * G, d), k, v, scale=scale, is_causal=is_causal,
        key_value_seq_lengths=lengths, implementation="cudnn", return_residual=True)
    lse = jnp.moveaxis(lse, 1, 2) if lse.shape[1] == Hk * G else lse  # (B, L, H)
    return out.reshape(B, L, Hk, G, d), lse.reshape(B, L, Hk, G).astype(jnp.float32)
