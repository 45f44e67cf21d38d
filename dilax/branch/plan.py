"""Static layout of dilated branches: plans, the slot (segment-major) layout and views.

A branch ``(w, r)`` is computed segment-major with reshapes only: the padded sequence is viewed
as ``(b, S, w/r, r, h, d)`` (segment, dilated index, offset slot, head), each head takes the
slot of its offset, and all segments of all heads that share the branch go through one core
call with the segments folded into the batch. Branch results live in the *dilated layout*
``(b*S, w/r, H', ...)`` (heads ascending); :func:`expand_slots` puts them back at their
positions. Shared by the single-device op (:mod:`dilax.branch.runner`) and the ring
(:mod:`dilax.sp`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict

import jax
import jax.numpy as jnp
import numpy as np

from dilax.core import KeyBounds, Mask, PairArrays, SlotView, static_take
from dilax.semantics import branch_heads, effective_segment_length


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
    # The local-window branch (:func:`window_plan`): one segment, r = 1, keys |p - t| <= window.
    window: int | None = None

    @property
    def seg_len(self) -> int:
        return self.w // self.r


@functools.lru_cache(maxsize=512)
def plan_branch(
    n: int, num_heads: int, num_kv_heads: int, w: int, r: int, heads: tuple[int, ...],
    offsets: tuple[int, ...],
) -> BranchPlan:
    """Builds the :class:`BranchPlan` of branch ``(w, r)`` for ``heads`` at ``offsets``."""
    w_eff = effective_segment_length(n, w, r)
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


@functools.lru_cache(maxsize=64)
def window_plan(n: int, num_heads: int, num_kv_heads: int, window: int) -> BranchPlan:
    """The local-window branch ``|p - t| <= window`` (docs: "Local window branch") as a plan:
    the whole sequence as one segment, ``r = 1``, every head; its :class:`~dilax.core.Mask`
    carries the band, so the core reads only the key blocks that meet it (O(n * window))."""
    heads = tuple(range(num_heads))
    plan = plan_branch(n, num_heads, num_kv_heads, n, 1, heads, (0,) * num_heads)
    return dataclasses.replace(plan, window=int(window))


def split_slots(x: jax.Array, plan: BranchPlan, heads: tuple[int, ...], slots: tuple[int, ...],
                 n: int) -> jax.Array:
    """``(b, n, H, d)`` -> ``(b*S, w/r, len(heads), d)``: head ``heads[i]`` at ``slots[i]``."""
    b, _, H, d = x.shape
    S, w, r = plan.num_segments, plan.w, plan.r
    x = jnp.pad(x, ((0, 0), (0, S * w - n), (0, 0), (0, 0))) if S * w != n else x
    x = x.reshape(b, S, w // r, r * H, d)  # flat index slot * H + head
    x = static_take(x, tuple(o * H + j for j, o in zip(heads, slots)), axis=3)
    return x.reshape(b * S, w // r, len(heads), d)


def expand_slots(y: jax.Array, plan: BranchPlan, n: int, fill) -> jax.Array:
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


def merge_slots(y: jax.Array, plan: BranchPlan, heads: tuple[int, ...], b: int, n: int,
                 fill) -> jax.Array:
    """Inverse of :func:`split_slots`: ``(b*S, w/r, len(heads), ...)`` in ``heads`` order ->
    full ``(b, n, H', ...)`` with heads ascending and ``fill`` at unselected positions."""
    order = tuple(sorted(range(len(heads)), key=heads.__getitem__))
    y = static_take(y, order, axis=2)
    return expand_slots(y, plan, n, fill).reshape(b, -1, *y.shape[2:])[:, :n]


def slot_layout(x: jax.Array, plan: BranchPlan) -> jax.Array:
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


def plan_kv_len(plan: BranchPlan, b: int):
    if all(length == plan.seg_len for row in plan.kv_len for length in row):
        return None  # every segment full: no key mask at all
    return jnp.tile(jnp.asarray(np.array(plan.kv_len, np.int32)), (b, 1))  # (b*S, U)


def unslot(x: jax.Array, plan: BranchPlan, n: int) -> jax.Array:
    """Inverse of :func:`slot_layout`: ``(b*S, w/r, [r,] H, d)`` -> ``(b, n, H, d)``."""
    b = x.shape[0] // plan.num_segments
    return x.reshape(b, plan.num_segments * plan.w, *x.shape[-2:])[:, :n]


def dilated_branches(
    n: int, num_heads: int, num_kv_heads: int, segment_lengths: tuple[int, ...],
    dilation_rates: tuple[int, ...], mode: str,
) -> list[BranchPlan]:
    """The static core calls of a configuration (one per branch, per group in grouped mode)."""
    return [plan_branch(n, num_heads, num_kv_heads, br.w, br.r, br.heads, br.offsets)
            for br in branch_heads(num_heads, segment_lengths, dilation_rates, mode)]


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


def gather_dilated(x: jax.Array, plan: BranchPlan, n: int) -> jax.Array:
    """Full ``(b, n, H, ...)`` -> ``plan``'s dilated layout ``(b*S, w/r, H', ...)``, heads
    ascending (the layout of the branch outputs)."""
    heads = tuple(sorted(plan.q_heads))
    slot_of = dict(zip(plan.q_heads, plan.q_slots))
    tail = x.shape[3:]
    x = x.reshape(*x.shape[:3], -1)
    y = split_slots(x, plan, heads, tuple(slot_of[j] for j in heads), n)
    return y.reshape(*y.shape[:3], *tail)




def dilated_lengths(lengths: jax.Array, plan: BranchPlan, first: jax.Array | int = 0
                    ) -> jax.Array:
    """Valid lengths ``(b,)`` of the full sequence -> ``(b*S, U)`` valid dilated rows of each
    segment and virtual kv head of ``plan``.

    Row ``t`` of segment ``s`` at slot ``o`` is position ``first + s*w + o + r*t``; it is valid
    iff that position is ``< lengths[i]``, so the valid rows are a prefix of
    ``clip(ceil((lengths - first - s*w - o) / r), 0, w/r)`` rows (``first``: the global
    position of the sequence's index 0, e.g. a ring shard's start)."""
    S, w, r = plan.num_segments, plan.w, plan.r
    start = (np.arange(S)[:, None] * w + np.asarray(plan.kv_slots)[None, :]).astype(np.int32)
    rest = jnp.asarray(lengths, jnp.int32)[:, None, None] - first - start[None]  # (b, S, U)
    rows = jnp.clip(-(-rest // r), 0, plan.seg_len)
    return rows.reshape(-1, len(plan.kv_slots))


def dilated_key_valid(key_valid: jax.Array, plan: BranchPlan) -> jax.Array:
    """Per-key validity ``(b, n)`` bool -> ``(b*S, U, w/r)``: the keys of each segment and
    virtual kv head of ``plan`` (positions past ``n`` are invalid)."""
    b, n = key_valid.shape
    S, w, r = plan.num_segments, plan.w, plan.r
    x = jnp.pad(key_valid, ((0, 0), (0, S * w - n))) if S * w != n else key_valid
    x = static_take(x.reshape(b * S, w // r, r), plan.kv_slots, axis=2)
    return jnp.swapaxes(x, 1, 2)


def branch_io(q: jax.Array, k: jax.Array, v: jax.Array, plan: BranchPlan, is_causal: bool,
              lengths: tuple[jax.Array | None, ...] | None = None):
    """One branch's core call: slot-layout ``(q, k, v)``, its :class:`SlotView` and
    :class:`~dilax.core.Mask` (ragged segments' key lengths, causality, the plan's window).

    ``lengths``: optional ``(q_len, kv_len[, key_valid])``: ``None`` or int ``(b,)`` valid
    lengths of the full sequence (already in ``[0, n]``), and ``None`` or a bool ``(b, n)``
    per-key validity; ``None`` builds exactly the mask without them."""
    view = slot_view(plan, q.shape[2], k.shape[2])
    q_len, kv_len, key_valid = (tuple(lengths) + (None,) * 3)[:3] if lengths else (None,) * 3
    mask = Mask(KeyBounds(
        kv_len=(plan_kv_len(plan, q.shape[0]) if kv_len is None
                else dilated_lengths(kv_len, plan)),  # <= the ragged tail's bound (lengths <= n)
        is_causal=is_causal,
        q_len=None if q_len is None else dilated_lengths(q_len, plan),
        window=plan.window),
        None if key_valid is None else PairArrays(kv_valid=dilated_key_valid(key_valid, plan)))
    return (slot_layout(q, plan), slot_layout(k, plan), slot_layout(v, plan)), view, mask
