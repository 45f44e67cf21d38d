"""The semantics of a dilated configuration (docs/semantics.md), in plain Python and NumPy.

The bottom layer of dilax: which heads run which branch ``(w, r)`` with which offset, and the
explicit count matrix ``C`` they define. The layout planner (:mod:`dilax.branch.plan`), decoding
(:mod:`dilax.dilated.decode`), the block-sparse pattern constructors (:mod:`dilax.patterns`) and the
mask-based reference (:mod:`dilax.reference`) all read it here. Imports nothing of dilax.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

__all__ = [
    "BranchHeads",
    "branch_heads",
    "branch_mask",
    "dilated_counts",
    "effective_segment_length",
    "group_sizes",
    "window_mask",
]


def group_sizes(num_heads: int, num_groups: int) -> tuple[int, ...]:
    """Grouped mode head split: ``h // G`` each, the first ``h % G`` groups one more."""
    base, extra = divmod(num_heads, num_groups)
    return tuple(base + (1 if i < extra else 0) for i in range(num_groups))


def effective_segment_length(n: int, w: int, r: int) -> int:
    """The segment length branch ``(w, r)`` has on ``n`` positions: ``w``, or when ``w`` exceeds
    ``n`` one segment covering the whole sequence (``n`` rounded up to a multiple of ``r``)."""
    return min(w, -(-n // r) * r)


@dataclasses.dataclass(frozen=True)
class BranchHeads:
    """One branch ``(w, r)`` of a configuration: the query heads that run it and, per head,
    the offset ``o`` of the rows it selects (positions ``p % r == o`` of each segment)."""

    w: int
    r: int
    heads: tuple[int, ...]
    offsets: tuple[int, ...]


def branch_heads(num_heads: int, segment_lengths, dilation_rates,
                 mode: str) -> tuple[BranchHeads, ...]:
    """The branches of a configuration in order, with their heads and offsets.

    ``"mixture"``: every branch covers all heads, head ``j`` with offset ``j % r``.
    ``"grouped"``: branch ``i`` covers the ``i``-th group of :func:`group_sizes` heads, all
    with offset ``i % r``.
    """
    if mode == "mixture":
        heads = tuple(range(num_heads))
        return tuple(BranchHeads(w, r, heads, tuple(j % r for j in heads))
                     for w, r in zip(segment_lengths, dilation_rates))
    out, start = [], 0
    for i, (size, w, r) in enumerate(
        zip(group_sizes(num_heads, len(segment_lengths)), segment_lengths, dilation_rates)
    ):
        out.append(BranchHeads(w, r, tuple(range(start, start + size)), (i % r,) * size))
        start += size
    return tuple(out)


def branch_mask(n: int, w: int, r: int, offset: int, is_causal: bool) -> np.ndarray:
    """Boolean ``(n, n)`` mask of one branch ``(w, r)`` with offset ``offset``
    (docs/semantics.md)."""
    pos = np.arange(n)
    sel = pos % r == offset
    same_segment = (pos[:, None] // w) == (pos[None, :] // w)
    mask = sel[:, None] & sel[None, :] & same_segment
    if is_causal:
        mask &= pos[None, :] <= pos[:, None]
    return mask


def window_mask(n: int, window: int, is_causal: bool) -> np.ndarray:
    """Boolean ``(n, n)`` mask of the local window branch: ``|p - t| <= window`` (and
    ``t <= p`` when causal)."""
    pos = np.arange(n)
    mask = np.abs(pos[:, None] - pos[None, :]) <= window
    if is_causal:
        mask &= pos[None, :] <= pos[:, None]
    return mask


@functools.lru_cache(maxsize=64)
def _dilated_counts_cached(n, num_heads, segment_lengths, dilation_rates, mode, is_causal,
                           local_window=None):
    counts = np.zeros((num_heads, n, n), np.float32)
    for br in branch_heads(num_heads, segment_lengths, dilation_rates, mode):
        for j, o in zip(br.heads, br.offsets):
            counts[j] += branch_mask(n, br.w, br.r, o, is_causal)
    if mode == "mixture" and local_window is not None:
        counts += window_mask(n, local_window, is_causal)[None]
    counts.setflags(write=False)
    return counts


def dilated_counts(
    n: int,
    num_heads: int,
    segment_lengths: tuple[int, ...],
    dilation_rates: tuple[int, ...],
    mode: str = "mixture",
    is_causal: bool = False,
    local_window: int | None = None,
) -> np.ndarray:
    """``C[j, p, t]``: number of branches in which query ``p`` of head ``j`` may attend ``t``
    (the local window, when given, is one more branch: ``+1`` where ``|p - t| <= W``).

    Returns a read-only float32 array of shape ``(h, n, n)``.
    """
    return _dilated_counts_cached(
        int(n), int(num_heads), tuple(segment_lengths), tuple(dilation_rates), mode,
        bool(is_causal), None if local_window is None else int(local_window),
    )
