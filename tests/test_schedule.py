"""The vectorized ring schedule (dilax.sp.schedule) equals the original per-pair Python
planner (kept here as the reference) and is fast at P = 1024."""


import numpy as np
import pytest

from dilax.sp.layout import vblock
from dilax.sp.schedule import Stream, geometry, needs_matrix, plan_streams, ring_streams


def _old_groups(needs):
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
    groups = {}
    for i in range(P):
        groups.setdefault(find(i), []).append(i)
    return list(groups.values())


def _old_plan(needs):
    """The planner before vectorization (same rules, per-pair loops)."""
    needs = np.asarray(needs, bool)
    P = needs.shape[0]
    if not needs.any():
        return ()
    groups = _old_groups(needs)
    steps = max(len(g) for g in groups) - 1
    offsets = {int((j - i) % P) for i in range(P) for j in range(P) if needs[i, j]}
    best = None
    for A in range(P):
        B = max([d for d in offsets if d < P - A], default=0)
        if best is None or A + B < best[0] + best[1]:
            best = (A, B)
    A, B = best
    if steps <= A + B:
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
        return (Stream(tuple(perm), tuple(src), tuple(ret)),)
    out = []
    if A:
        src = tuple(tuple((i - s) % P if needs[i, (i - s) % P] else -1 for i in range(P))
                    for s in range(1, A + 1))
        out.append(Stream(tuple((i, (i + 1) % P) for i in range(P)), src,
                          tuple((i, (i - A) % P) for i in range(P))))
    if B:
        src = tuple(tuple((i + s) % P if needs[i, (i + s) % P] and not s >= P - A else -1
                          for i in range(P)) for s in range(1, B + 1))
        out.append(Stream(tuple((i, (i - 1) % P) for i in range(P)), src,
                          tuple((i, (i + B) % P) for i in range(P))))
    return tuple(out)


def _old_ring_needs(geo, is_causal):
    P, C = geo.P, geo.C
    return needs_matrix(P, lambda i, j: any(
        geo.pair_needed(vblock(P, C, i, c), vblock(P, C, j, cp), is_causal)
        for c in range(C) for cp in range(C)))


# (n, P, C, w, r): the geometries of tests/test_ring.py and friends, regular and irregular,
# contiguous (C=1) and zigzag (C=2).
GEOMETRIES = [(256, 2, 1, 128, 2), (256, 4, 1, 256, 4), (512, 8, 1, 512, 8),
              (256, 4, 2, 128, 2), (384, 4, 2, 384, 3), (320, 4, 1, 160, 3),
              (512, 8, 2, 256, 1), (1024, 8, 1, 512, 5), (480, 8, 2, 480, 7),
              (2048, 16, 1, 1024, 2), (4096, 32, 2, 2048, 4)]


@pytest.mark.parametrize("n,P,C,w,r", GEOMETRIES)
@pytest.mark.parametrize("is_causal", [False, True])
def test_ring_streams_equal_old_planner(n, P, C, w, r, is_causal):
    geo = geometry(n, P, C, w, r)
    needs = _old_ring_needs(geo, is_causal)
    assert ring_streams(geo, is_causal) == _old_plan(needs)
    assert plan_streams(needs) == _old_plan(needs)


@pytest.mark.parametrize("seed", range(12))
def test_plan_streams_equal_old_planner_random(seed):
    """Arbitrary needs (block-sparse masks): groups, shifts and their tie-breaking."""
    rng = np.random.default_rng(seed)
    P = int(rng.integers(2, 13))
    needs = rng.random((P, P)) < rng.choice([0.05, 0.2, 0.5])
    if seed % 3 == 0:  # banded: shift streams win
        d = (np.arange(P)[None] - np.arange(P)[:, None]) % P
        needs = (d == 1) | (d == P - 2)
    np.fill_diagonal(needs, False)
    assert plan_streams(needs) == _old_plan(needs)


def test_ring_streams_at_p1024():
    # ring_needs is vectorized (O(V^2) numpy): the schedule of P = 1024 devices builds here
    geo = geometry(2**30, 1024, 1, 2**30, 2**19)
    (st,) = ring_streams(geo, True)
    assert st.hops == 1023 and len(st.perm) == 1024
    assert st.src[0][5] == 4 and st.src[0][0] == -1  # causal: device 0 needs nobody
