"""The static schedule of a ring: which device's chunk each device holds at each hop.

Both sequence-parallel rings (dilated and block-sparse) move K/V chunks between the devices of
a mesh axis with ``lax.ppermute`` while every device folds the visiting chunk into its queries'
online-softmax state. Which chunks a device needs is static: a boolean ``needs[i, j]`` (device
``i`` needs the chunk of device ``j``, ``i != j``), from the dilated geometry
(:func:`ring_streams`) or from the block mask (``dilax.sp.block_sparse_ring``).
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


def _groups(needs: np.ndarray) -> list[list[int]]:
    """Connected components of the symmetric ``needs`` graph (union-find), members ascending."""
    P = needs.shape[0]
    sym = needs | needs.T
    comp = list(range(P))

    def find(a):
        while comp[a] != a:
            comp[a] = comp[comp[a]]
            a = comp[a]
        return a

    for i in range(P):
        for j in range(P):
            if sym[i, j]:
                comp[find(i)] = find(j)
    groups: dict[int, list[int]] = {}
    for i in range(P):
        groups.setdefault(find(i), []).append(i)
    return list(groups.values())


def _shift_lengths(needs: np.ndarray) -> tuple[int, int]:
    """Fewest hops ``(A, B)`` of a right and a left cyclic shift covering every needed pair
    (the smallest ``A`` among ties)."""
    P = needs.shape[0]
    offsets = {int((j - i) % P) for i in range(P) for j in range(P) if needs[i, j]}
    best = None
    for A in range(P):
        B = max([d for d in offsets if d < P - A], default=0)
        if best is None or A + B < best[0] + best[1]:
            best = (A, B)
    return best


def _group_ring_stream(needs: np.ndarray, groups: list[list[int]], steps: int) -> Stream:
    P = needs.shape[0]
    members = {i: g for g in groups for i in g}
    perm, ret, src = [], [], []
    for g in groups:
        if len(g) > 1:
            perm += [(g[p], g[(p + 1) % len(g)]) for p in range(len(g))]
            ret += [(g[p], g[(p - steps) % len(g)]) for p in range(len(g))]
    for s in range(1, steps + 1):
        row = []
        for i in range(P):
            g = members[i]
            j = g[(g.index(i) - s) % len(g)]
            row.append(j if s < len(g) and needs[i, j] else -1)
        src.append(tuple(row))
    return Stream(tuple(perm), tuple(src), tuple(ret))


def _shift_streams(needs: np.ndarray, A: int, B: int) -> tuple[Stream, ...]:
    P = needs.shape[0]
    streams = []
    if A:
        src = tuple(
            tuple((i - s) % P if needs[i, (i - s) % P] else -1 for i in range(P))
            for s in range(1, A + 1)
        )
        streams.append(Stream(tuple((i, (i + 1) % P) for i in range(P)), src,
                              tuple((i, (i - A) % P) for i in range(P))))
    if B:
        # Offsets the right shift already brings (s >= P - A) are not visited twice.
        src = tuple(
            tuple(
                (i + s) % P if needs[i, (i + s) % P] and not s >= P - A else -1
                for i in range(P)
            )
            for s in range(1, B + 1)
        )
        streams.append(Stream(tuple((i, (i - 1) % P) for i in range(P)), src,
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
    P, C = geo.P, geo.C

    def needed(i, j):
        return any(geo.pair_needed(vblock(P, C, i, c), vblock(P, C, j, cp), is_causal)
                   for c in range(C) for cp in range(C))

    return plan_streams(needs_matrix(P, needed))
