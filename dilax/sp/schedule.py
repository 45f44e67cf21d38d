"""The static schedule of a ring: which device's chunk each device holds at each hop.

Both sequence-parallel rings (dilated and block-sparse) move K/V chunks between the devices of
a mesh axis with ``lax.ppermute`` while every device folds the visiting chunk into its queries'
online-softmax state. Which chunks a device needs is static: a boolean ``needs[i, j]`` (device
``i`` needs the chunk of device ``j``, ``i != j``), from the dilated geometry
(:func:`ring_streams`) or from the block mask (``dilax.block_sparse.ring``).
:func:`plan_streams` turns it into the fewest hops of one of two kinds:

* cyclic rings inside the groups of devices that need each other's chunks (connected
  components of the symmetric ``needs`` graph): ``max |group| - 1`` hops;
* two cyclic shifts over all devices, one right (device ``i`` receives from ``i - 1``, so at
  hop ``s`` it holds the chunk of ``i - s``) for ``A`` hops and one left (from ``i + 1``) for
  ``B`` hops, covering every needed pair; ``A + B`` hops.

A :class:`Stream` lists, per hop, the device whose chunk each device then holds (``-1``: a
chunk it does not need; that device skips its compute).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import numpy as np

from dilax.sp.layout import vblock


@dataclasses.dataclass(frozen=True)
class Stream:
    """One direction of chunk travel: ``hops`` ppermutes with ``perm``; ``src[s][i]`` is the
    device whose chunk device ``i`` holds after hop ``s + 1`` (-1: nothing to do with it);
    ``ret`` sends travelling accumulators (dK/dV) back to their owners at the end."""

    perm: tuple[tuple[int, int], ...]
    src: tuple[tuple[int, ...], ...]
    ret: tuple[tuple[int, int], ...]

    @property
    def hops(self) -> int:
        return len(self.src)


def needs_matrix(P: int, needed: Callable[[int, int], bool]) -> np.ndarray:
    """``(P, P)`` bool: ``needed(i, j)`` for every pair of distinct devices (False on the
    diagonal: a device always has its own chunk)."""
    needs = np.zeros((P, P), bool)
    for i in range(P):
        for j in range(P):
            if i != j:
                needs[i, j] = needed(i, j)
    return needs


def _rows(a: np.ndarray) -> tuple[tuple[int, ...], ...]:
    return tuple(map(tuple, a.tolist()))


def _labels(needs: np.ndarray) -> np.ndarray:
    """Per device, the smallest device of its connected component of the symmetric ``needs``
    graph (label propagation with pointer jumping, vectorized: O(P^2) per round)."""
    P = needs.shape[0]
    sym = needs | needs.T
    label = np.arange(P)
    while True:
        nxt = np.minimum(label, np.where(sym, label[None, :], P).min(axis=1))
        nxt = nxt[nxt]
        if np.array_equal(nxt, label):
            return label
        label = nxt


def _groups(needs: np.ndarray) -> list[list[int]]:
    """Connected components of the symmetric ``needs`` graph, ordered by their smallest
    member, members ascending."""
    label = _labels(needs)
    return [np.flatnonzero(label == g).tolist() for g in np.unique(label)]


def _shift_lengths(needs: np.ndarray) -> tuple[int, int]:
    """Fewest hops ``(A, B)`` of a right and a left cyclic shift covering every needed pair
    (the smallest ``A`` among ties)."""
    P = needs.shape[0]
    i, j = np.nonzero(needs)
    has = np.zeros(P, bool)
    has[(j - i) % P] = True
    # B(A) = largest needed offset d < P - A (0 if none): a running max over offsets.
    top = np.maximum.accumulate(np.where(has, np.arange(P), 0))
    A = np.arange(P)
    total = A + top[P - 1 - A]
    a = int(np.argmin(total))  # first minimum: the smallest A among ties
    return a, int(top[P - 1 - a])


def _group_ring_stream(needs: np.ndarray, groups: list[list[int]], steps: int) -> Stream:
    P = needs.shape[0]
    order = np.concatenate([np.asarray(g) for g in groups])  # devices group by group
    start, size, pos = np.zeros(P, int), np.zeros(P, int), np.zeros(P, int)
    at = 0
    perm, ret = [], []
    for g in groups:
        start[g], size[g], pos[g] = at, len(g), np.arange(len(g))
        at += len(g)
        if len(g) > 1:
            perm += [(g[p], g[(p + 1) % len(g)]) for p in range(len(g))]
            ret += [(g[p], g[(p - steps) % len(g)]) for p in range(len(g))]
    s = np.arange(1, steps + 1)[:, None]
    dev = np.arange(P)[None, :]
    j = order[start[None] + (pos[None] - s) % size[None]]  # (steps, P)
    ok = (s < size[None]) & needs[dev, j]
    return Stream(tuple(perm), _rows(np.where(ok, j, -1)), tuple(ret))


def _shift_streams(needs: np.ndarray, A: int, B: int) -> tuple[Stream, ...]:
    P = needs.shape[0]
    dev = np.arange(P)[None, :]
    streams = []
    if A:
        s = np.arange(1, A + 1)[:, None]
        j = (dev - s) % P
        streams.append(Stream(tuple((i, (i + 1) % P) for i in range(P)),
                              _rows(np.where(needs[dev, j], j, -1)),
                              tuple((i, (i - A) % P) for i in range(P))))
    if B:
        # Offsets the right shift already brings (s >= P - A) are not visited twice.
        s = np.arange(1, B + 1)[:, None]
        j = (dev + s) % P
        ok = needs[dev, j] & ~(s >= P - A)
        streams.append(Stream(tuple((i, (i - 1) % P) for i in range(P)),
                              _rows(np.where(ok, j, -1)),
                              tuple((i, (i + B) % P) for i in range(P))))
    return tuple(streams)


def plan_streams(needs: np.ndarray) -> tuple[Stream, ...]:
    """Cheapest of (a) cyclic rings inside groups of devices that share chunks and (b) two
    cyclic shifts (right ``A`` hops, left ``B`` hops) covering every needed device pair.

    Returns () when no device needs another's chunk; otherwise one stream (a) or the right
    and/or left stream (b), in that order.
    """
    needs = np.asarray(needs, bool)
    if not needs.any():
        return ()
    groups = _groups(needs)
    steps_a = max(len(g) for g in groups) - 1
    A, B = _shift_lengths(needs)
    if steps_a <= A + B:
        return (_group_ring_stream(needs, groups, steps_a),)
    return _shift_streams(needs, A, B)


# --------------------------------------------------------------------------------------------
# Dilated geometry: which dilated rows each chunk owns, and which chunk pairs attend.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Geometry:
    """One dilated branch ``(w, r)`` on ``V = P C`` chunks of ``n / V`` positions.

    In the dilated sequence ``t -> o + r t`` of a head offset ``o``, chunk ``v`` owns the
    dilated indices ``[F_v, F_{v+1})`` with ``F_v = floor(v n/V / r)``, the same for all heads.
    """

    n: int
    P: int
    C: int
    r: int
    L: int  # dilated segment length w_eff / r
    F: tuple[int, ...]  # V + 1 dilated chunk starts; F[V] = ceil(n / r)

    @property
    def V(self) -> int:
        return self.P * self.C

    @property
    def mc(self) -> int:
        return self.n // self.V

    @property
    def cnt(self) -> tuple[int, ...]:
        return tuple(self.F[v + 1] - self.F[v] for v in range(self.V))

    @property
    def R(self) -> int:
        return max(self.cnt)

    @property
    def regular(self) -> bool:
        return self.mc % self.r == 0

    def table(self, values) -> tuple[tuple[int, ...], ...]:
        """Per-(chunk, device) table of a per-virtual-block quantity."""
        return tuple(
            tuple(int(values[vblock(self.P, self.C, i, c)]) for i in range(self.P))
            for c in range(self.C)
        )

    def segments(self, v: int) -> tuple[int, int] | None:
        if self.cnt[v] == 0:
            return None
        return self.F[v] // self.L, (self.F[v] + self.cnt[v] - 1) // self.L

    def pair_needed(self, v: int, u: int, is_causal: bool) -> bool:
        """Do queries of block ``v`` attend any key of block ``u``?"""
        if is_causal and u > v:
            return False
        sv, su = self.segments(v), self.segments(u)
        if sv is None or su is None:
            return False
        return max(sv[0], su[0]) <= min(sv[1], su[1])


@functools.lru_cache(maxsize=256)
def geometry(n: int, P: int, C: int, w: int, r: int) -> Geometry:
    V_ = P * C
    mc = n // V_
    F = tuple((v * mc) // r for v in range(V_)) + (-(-n // r),)
    return Geometry(n, P, C, r, w // r, F)


@functools.lru_cache(maxsize=256)
def ring_streams(geo: Geometry, is_causal: bool) -> tuple[Stream, ...]:
    """The streams of a dilated branch: device ``i`` needs device ``j`` when a query chunk of
    ``i`` attends a key chunk of ``j``."""
    return plan_streams(ring_needs(geo, is_causal))


def ring_needs(geo: Geometry, is_causal: bool) -> np.ndarray:
    """``(P, P)`` bool ``needs`` of a dilated branch: :meth:`Geometry.pair_needed` for every
    pair of chunks, vectorized (``O(V^2)`` numpy, V = P C)."""
    P, C = geo.P, geo.C
    F = np.asarray(geo.F, np.int64)
    cnt = F[1:] - F[:-1]
    first, last = F[:-1] // geo.L, (F[:-1] + cnt - 1) // geo.L
    pair = ((np.maximum(first[:, None], first[None]) <= np.minimum(last[:, None], last[None]))
            & (cnt[:, None] > 0) & (cnt[None] > 0))
    if is_causal:
        pair &= np.tri(geo.V, dtype=bool)  # key block u <= query block v
    blocks = np.asarray([[vblock(P, C, i, c) for c in range(C)] for i in range(P)])
    needs = np.zeros((P, P), bool)
    for c in range(C):
        for cp in range(C):
            needs |= pair[blocks[:, c][:, None], blocks[:, cp][None, :]]
    np.fill_diagonal(needs, False)
    return needs
