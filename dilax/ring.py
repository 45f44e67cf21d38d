"""Ring (sequence-parallel) dilated attention with ``jax.shard_map``.

The sequence axis of ``q, k, v`` is split over the ``P`` devices of a mesh axis. Each branch
``(w, r)`` of the configuration is computed in one of three ways, chosen statically:

* **local** -- every segment lies inside one device's shard (``(n/P) % w == 0``): the
  single-device path (:func:`dilax.branches.run_branches`) runs on the shard, no communication.
* **halo** -- segments are shorter than a shard but not aligned with shard boundaries: after
  dilation each device receives the ``w/r - 1`` dilated rows on either side from its neighbours,
  cuts a segment-aligned window and runs the local path on it.
* **ring** -- segments span several devices. Each device dilates its own K/V first (keeps the
  ``1/r`` of its rows that the head's offset selects), then those dilated blocks travel around
  the devices that share segments with ``lax.ppermute`` while every device folds them into the
  float32 online-softmax state of its queries with :func:`dilax.core.attention_core` and
  :func:`dilax.core.merge_attention_states`. Blocks entirely in the future (causal) or in
  another segment are skipped with ``lax.cond``. Communication per device is ``O(w / r)`` rows
  per branch, independent of ``n``. The backward pass is a ``jax.custom_vjp`` with a second ring
  that sends K, V and the dK, dV accumulators, so it also keeps ``O(n / P)`` memory per device.
  The hops run in a ``lax.fori_loop`` whose body sends the next block while it computes the
  current one: one block in use and one in flight per device. Which devices exchange blocks
  is planned statically: cyclic rings inside groups of devices that share segments (the
  aligned case: ``w / (n/P)`` devices, ``w / (n/P) - 1`` hops), or two cyclic shifts (left and
  right) when segments straddle shard boundaries, whichever needs fewer hops.

Branches are merged exactly like the single-device function (log-sum-exp weights in
``mode="mixture"``, ``1/G`` in ``mode="grouped"``), so the result equals
:func:`dilax.dilated_attention` on the gathered inputs, forward and backward
(docs/semantics.md, "Ring attention").

Layouts. ``layout="contiguous"``: device ``i`` holds positions ``[i n/P, (i+1) n/P)``.
``layout="zigzag"`` (causal load balance): the sequence is cut into ``2P`` chunks of ``n/(2P)``
positions and device ``i`` holds chunk ``i`` followed by chunk ``2P-1-i``; see
:func:`zigzag_permutation`. :func:`sharded_dilated_attention` converts to and from it for you.

Dilated bookkeeping. In every branch the selected positions of head offset ``o`` form a dilated
sequence ``t -> o + r t``. Each chunk ``v`` of ``n/(PC)`` positions owns the dilated indices
``[F_v, F_{v+1})`` with ``F_v = floor(v n/(PC) / r)``, the same for all heads. When
``r`` divides the chunk length this is just the chunk's own selected rows; otherwise a few
boundary rows are fetched from the left neighbour and the outputs sent back (a halo of ``< r``
positions), which keeps every other step uniform across heads.

Inside your own ``jax.shard_map``: pass ``check_vma=False`` (the blockwise core's loop carries
are not yet typed per device; :func:`sharded_dilated_attention` does this for you).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Hashable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from dilax import _validation as V
from dilax.branches import Branches, combine_branches, run_branches
from dilax.core import (
    XLA,
    BlockSizes,
    Mask,
    attention_core,
    fence_after,
    identity_view,
    merge_attention_states,
    output_delta,
    static_take,
    when,
)
from dilax.layout import BranchPlan, dilated_branches, merge_slots, split_slots
from dilax.layout import plan_branch as _plan_branch

LAYOUTS = ("contiguous", "zigzag")
_F32 = jnp.float32


# --------------------------------------------------------------------------------------------
# Layouts: which chunk of the sequence ("virtual block" v) lives where.
# --------------------------------------------------------------------------------------------


def _vblock(P: int, C: int, i: int, c: int) -> int:
    """Virtual block held as chunk ``c`` of device ``i`` (C=1 contiguous, C=2 zigzag)."""
    if C == 1:
        return i
    return i if c == 0 else 2 * P - 1 - i


def _owner(P: int, C: int, v: int) -> tuple[int, int]:
    if C == 1:
        return v, 0
    return (v, 0) if v < P else (2 * P - 1 - v, 1)


def zigzag_permutation(n: int, num_devices: int) -> np.ndarray:
    """Positions in zigzag order: ``x[:, perm]`` is the layout ``layout="zigzag"`` expects.

    The sequence is cut into ``2 P`` chunks; device ``i`` holds chunk ``i`` then chunk
    ``2P - 1 - i``. Undo with ``np.argsort(perm)``. Requires ``n % (2 P) == 0``.
    """
    n, P = int(n), int(num_devices)
    if P <= 0 or n % (2 * P):
        raise ValueError(f"zigzag layout needs seq_len % (2 * num_devices) == 0, got n={n}, P={P}")
    mc = n // (2 * P)
    order = [_vblock(P, 2, i, c) for i in range(P) for c in range(2)]
    return np.concatenate([np.arange(v * mc, (v + 1) * mc) for v in order])


def _varying_like(x: jax.Array, *refs: jax.Array) -> jax.Array:
    """``x`` typed as varying over the mesh axes the ``refs`` vary over.

    Under ``shard_map(check_vma=True)`` a freshly created constant (zeros, -inf) is not
    per-device; loop carries and ``lax.cond`` branches must agree on the type.
    """
    try:
        have = jax.typeof(x).mat.varying
        want = frozenset().union(*(jax.typeof(r).mat.varying for r in refs))
    except AttributeError:  # outside shard_map, or a jax without varying-axis types
        return x
    missing = tuple(sorted(want - have, key=str))
    return lax.pcast(x, missing, to="varying") if missing else x


def _lookup(table, idx) -> jax.Array:
    """``table[idx]`` for a static int table and a traced device index."""
    return jnp.asarray(np.asarray(table, np.int32))[idx]


def _gather_chunks(x: jax.Array, src_of: Callable, P: int, C: int, axis_name, fill=0.0):
    """``x: (b, C, ...)`` -> ``y`` with ``y[:, c]`` on device ``i`` = chunk ``c'`` of device ``j``
    where ``(j, c') = src_of(i, c)``, or ``fill`` where ``src_of`` gives None.

    One ``lax.ppermute`` per (source chunk, target chunk) pair; nothing else moves.
    """
    idx = lax.axis_index(axis_name)
    outs = []
    for c in range(C):
        srcs = [src_of(i, c) for i in range(P)]
        src_chunk = [s[1] if s is not None else -1 for s in srcs]
        y = None
        for cs in range(C):
            pairs = [(s[0], i) for i, s in enumerate(srcs) if s is not None and s[1] == cs]
            if not pairs:
                continue
            recv = lax.ppermute(x[:, cs], axis_name, pairs)
            if y is None and fill == 0 and C == 1:
                y = recv  # ppermute already leaves zeros where nothing arrives
                continue
            if y is None:
                y = jnp.full_like(recv, fill)
            y = jnp.where(_lookup(src_chunk, idx) == cs, recv, y)
        outs.append(jnp.full_like(x[:, 0], fill) if y is None else y)
    return jnp.stack(outs, axis=1)


def _vshift(x: jax.Array, k: int, P: int, C: int, axis_name, fill=0.0) -> jax.Array:
    """Chunk of virtual block ``v - k`` for every local chunk ``v`` (``fill`` outside 0..V-1)."""

    def src_of(i, c):
        u = _vblock(P, C, i, c) - k
        return _owner(P, C, u) if 0 <= u < P * C else None

    return _gather_chunks(x, src_of, P, C, axis_name, fill)


def _relayout(x: jax.Array, P: int, axis_name, to_zigzag: bool) -> jax.Array:
    """Local shard ``(b, m, ...)`` contiguous <-> zigzag, with ppermutes only."""
    b, m = x.shape[:2]
    xc = x.reshape(b, 2, m // 2, *x.shape[2:])

    def src_of(i, c):
        if to_zigzag:
            v = _vblock(P, 2, i, c)
            return v // 2, v % 2
        return _owner(P, 2, 2 * i + c)

    return _gather_chunks(xc, src_of, P, 2, axis_name).reshape(x.shape)


# --------------------------------------------------------------------------------------------
# Static geometry of one branch on the device layout.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Geometry:
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
            tuple(int(values[_vblock(self.P, self.C, i, c)]) for i in range(self.P))
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
def _geometry(n: int, P: int, C: int, w: int, r: int) -> _Geometry:
    V_ = P * C
    mc = n // V_
    F = tuple((v * mc) // r for v in range(V_)) + (-(-n // r),)
    return _Geometry(n, P, C, r, w // r, F)


@dataclasses.dataclass(frozen=True)
class _Stream:
    """One direction of block travel: ``steps`` ppermutes with ``perm``; ``src[s][i]`` is the
    device whose block device ``i`` holds after step ``s + 1`` (-1: nothing to do with it);
    ``ret`` sends the travelling dK/dV accumulators back to their owners at the end."""

    perm: tuple[tuple[int, int], ...]
    src: tuple[tuple[int, ...], ...]
    ret: tuple[tuple[int, int], ...]


@functools.lru_cache(maxsize=256)
def _schedule(geo: _Geometry, is_causal: bool) -> tuple[_Stream, ...]:
    """Cheapest of (a) cyclic rings inside groups of devices that share segments and (b) two
    cyclic shifts (left A steps, right B steps) covering every device pair that is needed."""
    P, C = geo.P, geo.C
    needs = np.zeros((P, P), bool)
    for i in range(P):
        for j in range(P):
            if i != j:
                needs[i, j] = any(
                    geo.pair_needed(_vblock(P, C, i, c), _vblock(P, C, j, cp), is_causal)
                    for c in range(C)
                    for cp in range(C)
                )
    if not needs.any():
        return ()
    # (a) connected components of the symmetric "needs" graph, ring inside each.
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
    members = {i: g for g in groups.values() for i in g}
    steps_a = max(len(g) for g in groups.values()) - 1
    # (b) bidirectional cyclic shifts.
    offsets = {int((j - i) % P) for i in range(P) for j in range(P) if needs[i, j]}
    best = None
    for A in range(P):
        B = max([d for d in offsets if d < P - A], default=0)
        if best is None or A + B < best[0] + best[1]:
            best = (A, B)
    A, B = best
    if steps_a <= A + B:
        perm, ret, src = [], [], []
        for g in groups.values():
            if len(g) > 1:
                perm += [(g[p], g[(p + 1) % len(g)]) for p in range(len(g))]
                ret += [(g[p], g[(p - steps_a) % len(g)]) for p in range(len(g))]
        for s in range(1, steps_a + 1):
            row = []
            for i in range(P):
                g = members[i]
                j = g[(g.index(i) - s) % len(g)]
                row.append(j if s < len(g) and needs[i, j] else -1)
            src.append(tuple(row))
        return (_Stream(tuple(perm), tuple(src), tuple(ret)),)
    streams = []
    if A:
        src = tuple(
            tuple((i - s) % P if needs[i, (i - s) % P] else -1 for i in range(P))
            for s in range(1, A + 1)
        )
        streams.append(_Stream(tuple((i, (i + 1) % P) for i in range(P)), src,
                               tuple((i, (i - A) % P) for i in range(P))))
    if B:
        src = tuple(
            tuple(
                (i + s) % P if needs[i, (i + s) % P] and not s >= P - A else -1
                for i in range(P)
            )
            for s in range(1, B + 1)
        )
        streams.append(_Stream(tuple((i, (i - 1) % P) for i in range(P)), src,
                               tuple((i, (i + B) % P) for i in range(P))))
    return tuple(streams)


# --------------------------------------------------------------------------------------------
# Dilation of the local shard into the uniform dilated layout and back.
# --------------------------------------------------------------------------------------------


def _ctx_rows(geo: _Geometry) -> int:
    """Rows of left context (positions before the chunk) the irregular dilation touches."""
    return geo.r if geo.r <= geo.mc else -(-geo.r // geo.mc) * geo.mc


def _chunk_phase(geo: _Geometry, idx) -> list[jax.Array]:
    """Per local chunk: ``c_v = v mc - r F_v`` (positions of the chunk before ``r F_v``)."""
    phase = [geo.mc * v - geo.r * geo.F[v] for v in range(geo.V)]
    return [_lookup(t, idx) for t in geo.table(phase)]


def _dilate(x: jax.Array, plan: BranchPlan, heads, slots, geo: _Geometry, axis_name):
    """Local shard ``(b, m, H, d)`` -> dilated chunks ``(b, C, R, len(heads), d)``.

    Row ``t`` of chunk ``v`` holds dilated index ``F_v + t`` of each head's offset.
    """
    b, m, H, d = x.shape
    C, mc, r, R = geo.C, geo.mc, geo.r, geo.R
    xc = x.reshape(b, C, mc, H, d)
    loc = dataclasses.replace(plan, w=R * r, num_segments=1)
    if geo.regular:
        xs = xc.reshape(b * C, mc, H, d)
    else:
        idx = lax.axis_index(axis_name)
        lc = _ctx_rows(geo)
        if lc <= mc:
            ctx = _vshift(xc[:, :, mc - lc:], 1, geo.P, C, axis_name)
        else:
            ctx = jnp.concatenate(
                [_vshift(xc, kk, geo.P, C, axis_name) for kk in range(lc // mc, 0, -1)], axis=2
            )
        pad = jnp.zeros((b, C, max(mc, R * r), H, d), x.dtype)
        ext = jnp.concatenate([ctx, xc, pad], axis=2)  # row e <-> position v*mc - lc + e
        phase = _chunk_phase(geo, idx)
        xs = jnp.stack(
            [lax.dynamic_slice_in_dim(ext[:, c], lc - phase[c], R * r, axis=1) for c in range(C)],
            axis=1,
        ).reshape(b * C, R * r, H, d)
    return split_slots(xs, loc, heads, slots, R * r).reshape(b, C, R, len(heads), d)


def _undilate(y: jax.Array, plan: BranchPlan, geo: _Geometry, axis_name, fill, combine):
    """Dilated query-head results ``(b, C, R, Hq, ...)`` (rows already masked to ``fill`` where
    not owned) -> local shard ``(b, m, Hq, ...)`` with heads ascending, ``fill`` elsewhere."""
    b, C, R = y.shape[:3]
    tail = y.shape[3:]
    mc, r = geo.mc, geo.r
    loc = dataclasses.replace(plan, w=R * r, num_segments=1)
    z = merge_slots(y.reshape(b * C, R, *tail), loc, plan.q_heads, b * C, R * r, fill)
    z = z.reshape(b, C, R * r, *tail)
    if geo.regular:
        return z.reshape(b, C * mc, *tail)
    idx = lax.axis_index(axis_name)
    lc = _ctx_rows(geo)
    phase = _chunk_phase(geo, idx)
    size = lc + max(mc, R * r)
    base = jnp.full((b, size, *tail), fill, z.dtype)
    buf = jnp.stack(
        [lax.dynamic_update_slice_in_dim(base, z[:, c], lc - phase[c], axis=1) for c in range(C)],
        axis=1,
    )  # row e <-> position v*mc - lc + e
    own = buf[:, :, lc: lc + mc]
    if lc <= mc:
        recv = _vshift(buf[:, :, :lc], -1, geo.P, C, axis_name, fill)
        widths = [(0, 0), (0, 0), (mc - lc, 0)] + [(0, 0)] * len(tail)
        return combine(own, jnp.pad(recv, widths, constant_values=fill)).reshape(b, C * mc, *tail)
    for kk in range(1, lc // mc + 1):
        part = buf[:, :, lc - kk * mc: lc - (kk - 1) * mc]
        own = combine(own, _vshift(part, -kk, geo.P, C, axis_name, fill))
    return own.reshape(b, C * mc, *tail)


def _valid_rows(geo: _Geometry, kv_slots, axis_name) -> jax.Array:
    """``(C, R, U)`` bool: dilated row owned by the chunk and inside the sequence for head u."""
    idx = lax.axis_index(axis_name)
    t = jnp.arange(geo.R)
    n_u = jnp.asarray([-(-(geo.n - o) // geo.r) for o in kv_slots], jnp.int32)
    rows = []
    for F_t, cnt_t in zip(geo.table(geo.F[:-1]), geo.table(geo.cnt), strict=True):
        F, cnt = _lookup(F_t, idx), _lookup(cnt_t, idx)
        rows.append((t < cnt)[:, None] & ((F + t)[:, None] < n_u[None, :]))
    return jnp.stack(rows)


# --------------------------------------------------------------------------------------------
# Halo regime: segments shorter than a chunk but not aligned with it.
# --------------------------------------------------------------------------------------------


def _halo_branch(qd, kd, vd, geo: _Geometry, n_u, axis_name, scale, is_causal, block_sizes):
    b, C, R, U, G, d = qd.shape
    L, Lm1 = geo.L, geo.L - 1
    idx = lax.axis_index(axis_name)
    F = [_lookup(t, idx) for t in geo.table(geo.F[:-1])]
    cnt = [_lookup(t, idx) for t in geo.table(geo.cnt)]
    s_w = max(((geo.F[v] % L) + geo.cnt[v] - 1) // L + 1 for v in range(geo.V) if geo.cnt[v])
    size = max(Lm1 + s_w * L, 2 * Lm1 + R)

    def tails(x):
        if geo.regular:
            return x[:, :, R - Lm1:]
        return jnp.stack([lax.dynamic_slice_in_dim(x[:, c], cnt[c] - Lm1, Lm1, axis=1)
                          for c in range(C)], axis=1)

    def window(x, left, right, c):
        parts = [x[:, c], jnp.zeros((b, size - Lm1 - R, *x.shape[3:]), x.dtype)]
        if Lm1:
            parts.insert(0, left[:, c] if left is not None else
                         jnp.zeros((b, Lm1, *x.shape[3:]), x.dtype))
        buf = jnp.concatenate(parts, axis=1)
        if right is not None:
            buf = lax.dynamic_update_slice_in_dim(buf, right[:, c], Lm1 + cnt[c], axis=1)
        return lax.dynamic_slice_in_dim(buf, Lm1 - F[c] % L, s_w * L, axis=1)

    halos = {}
    for name, x in (("k", kd), ("v", vd)):
        if Lm1:
            halos[name] = (_vshift(tails(x), 1, geo.P, C, axis_name),
                           _vshift(x[:, :, :Lm1], -1, geo.P, C, axis_name))
        else:
            halos[name] = (None, None)
    qw = jnp.stack([window(qd, None, None, c) for c in range(C)], axis=1)
    kw = jnp.stack([window(kd, *halos["k"], c) for c in range(C)], axis=1)
    vw = jnp.stack([window(vd, *halos["v"], c) for c in range(C)], axis=1)
    seg_start = jnp.stack([(F[c] // L + jnp.arange(s_w)) * L for c in range(C)])  # (C, s_w)
    kv_len = jnp.clip(n_u[None, None, :] - seg_start[..., None], 0, L)  # (C, s_w, U)
    kv_len = jnp.broadcast_to(kv_len[None], (b, C, s_w, U)).reshape(b * C * s_w, U)
    out, lse = attention_core(
        qw.reshape(b * C * s_w, L, U, G, d),
        kw.reshape(b * C * s_w, L, U, d),
        vw.reshape(b * C * s_w, L, U, d),
        scale=scale, is_causal=is_causal, kv_len=kv_len, block_sizes=block_sizes,
    )
    out = out.reshape(b, C, s_w * L, U, G, d)
    lse = lse.reshape(b, C, s_w * L, U, G)
    out = jnp.stack([lax.dynamic_slice_in_dim(out[:, c], F[c] % L, R, axis=1)
                     for c in range(C)], axis=1)
    lse = jnp.stack([lax.dynamic_slice_in_dim(lse[:, c], F[c] % L, R, axis=1)
                     for c in range(C)], axis=1)
    return out, lse


# --------------------------------------------------------------------------------------------
# Ring regime: segments spanning several devices; custom_vjp with a backward ring.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _RingConfig:
    axis_name: Hashable
    geo: _Geometry
    n_u: tuple[int, ...]  # dilated length of each virtual kv head's offset
    streams: tuple[_Stream, ...]
    scale: float
    is_causal: bool
    block_sizes: BlockSizes  # forward (block_q, block_k) and backward (.backward) blocks
    dilate: Callable  # local shards (q, k, v) -> dilated chunks (qd, kd, vd)

    @property
    def single_segment(self) -> bool:
        """Every chunk lies inside one segment (aligned case): one candidate, no key shift."""
        return all(s is None or s[0] == s[1] for s in map(self.geo.segments, range(self.geo.V)))


def _shift_rows(x, lo):
    """Rows ``[lo, lo + R)`` of ``x: (b, R, ...)`` (zeros past the end)."""
    R = x.shape[1]
    widths = [(0, 0), (0, R)] + [(0, 0)] * (x.ndim - 2)
    return lax.dynamic_slice_in_dim(jnp.pad(x, widths), lo, R, axis=1)


def _unshift_rows(x, lo):
    """Inverse of :func:`_shift_rows` for gradients: row ``t`` goes back to ``lo + t``."""
    R = x.shape[1]
    buf = jnp.zeros((x.shape[0], 2 * R, *x.shape[2:]), x.dtype)
    return lax.dynamic_update_slice_in_dim(buf, x, lo, axis=1)[:, :R]


def _candidates(cfg: _RingConfig, Fq, cq, Fk, ck, ok, R):
    """Per candidate segment of the ``R`` query rows starting at dilated index ``Fq`` (``cq`` of
    them valid): (key shift or None, kv_len (U,), run?, row mask)."""
    L = cfg.geo.L
    n_u = jnp.asarray(cfg.n_u, jnp.int32)
    if cfg.single_segment:
        kv_len = jnp.clip(jnp.minimum(ck, n_u - Fk), 0, None)
        pred = ok & (Fk // L == Fq // L) & (cq > 0) & (jnp.max(kv_len) > 0)
        if cfg.is_causal:
            pred = pred & (Fk <= Fq + cq - 1)
        return [(None, kv_len, pred, None)]
    t = jnp.arange(R)
    cands = []
    for j in range(2):
        s = Fq // L + j
        lo = jnp.clip(s * L - Fk, 0, ck)
        hi = jnp.clip((s + 1) * L - Fk, 0, ck)
        kv_len = jnp.clip(jnp.minimum(hi, n_u - Fk) - lo, 0, None)
        qlo = jnp.clip(s * L - Fq, 0, cq)
        qhi = jnp.clip((s + 1) * L - Fq, 0, cq)
        pred = ok & (qhi > qlo) & (jnp.max(kv_len) > 0)
        if cfg.is_causal:
            pred = pred & (Fk + lo <= Fq + qhi - 1)
        cands.append((lo, kv_len, pred, (t >= qlo) & (t < qhi)))
    return cands


def _pair_forward(cfg: _RingConfig, q, k, v, Fq, cq, Fk, ck, ok):
    """Attention of one query chunk ``q: (b, R, U, G, d)`` to one key chunk: (out f32, lse)."""
    b, R, U, G, d = q.shape
    results = []
    for lo, kv_len, pred, rows in _candidates(cfg, Fq, cq, Fk, ck, ok, R):
        ks = k if lo is None else _shift_rows(k, lo)
        vs = v if lo is None else _shift_rows(v, lo)
        k_off = Fk if lo is None else Fk + lo
        kv_len_b = jnp.broadcast_to(kv_len, (b, U))

        def run(ops, kv_len_b=kv_len_b, k_off=k_off):
            o, lse = attention_core(*ops, scale=cfg.scale, is_causal=cfg.is_causal,
                                    kv_len=kv_len_b, q_offset=Fq, k_offset=k_off,
                                    block_sizes=cfg.block_sizes)
            return o.astype(_F32), lse

        def skip(ops):
            return (_varying_like(jnp.zeros(ops[0].shape, _F32), *ops),
                    _varying_like(jnp.full(ops[0].shape[:-1], -jnp.inf, _F32), *ops))

        results.append((lax.cond(pred, run, skip, (q, ks, vs)), rows))
    (out, lse), _ = results[0]
    for (o, lse_c), rows in results[1:]:
        sel = rows[None, :, None, None]
        out = jnp.where(sel[..., None], o, out)
        lse = jnp.where(sel, lse_c, lse)
    return out, lse


def _pair_backward(cfg: _RingConfig, q, k, v, out, lse, dout, dlse, Fq, cq, Fk, ck, ok):
    """Gradient contributions of one (query chunk, key chunk) pair, float32."""
    b, R, U, G, d = q.shape
    dq = jnp.zeros(q.shape, _F32)
    dk = jnp.zeros(k.shape, _F32)
    dv = jnp.zeros(v.shape, _F32)
    for lo, kv_len, pred, rows in _candidates(cfg, Fq, cq, Fk, ck, ok, R):
        ks = k if lo is None else _shift_rows(k, lo)
        vs = v if lo is None else _shift_rows(v, lo)
        k_off = Fk if lo is None else Fk + lo
        # Rows of another segment: lse = +inf makes their probabilities exactly 0.
        lse_c = lse if rows is None else jnp.where(rows[None, :, None, None], lse, jnp.inf)
        kv_len_b = jnp.broadcast_to(kv_len, (b, U))

        def run(ops, kv_len_b=kv_len_b, k_off=k_off):
            qq, kk, vv, oo, ll, do, dl = ops
            flat = lambda x: x.reshape(b, R, U * G, *x.shape[4:])
            g = XLA.backward(flat(qq), kk, vv, view=identity_view(U, G),
                             mask=Mask(kv_len_b, Fq, k_off, cfg.is_causal), scale=cfg.scale,
                             lse=flat(ll), dout=flat(do), delta=flat(output_delta(oo, do, dl)),
                             block_sizes=cfg.block_sizes, grad_dtype=_F32)
            return g[0].reshape(q.shape), g[1], g[2]

        def skip(ops):
            return tuple(_varying_like(jnp.zeros(x.shape, _F32), *ops) for x in ops[:3])

        gq, gk, gv = lax.cond(pred, run, skip, (q, ks, vs, out, lse_c, dout, dlse))
        dq = dq + gq
        dk = dk + (gk if lo is None else _unshift_rows(gk, lo))
        dv = dv + (gv if lo is None else _unshift_rows(gv, lo))
    return dq, dk, dv


_ROW_CHUNK = 256
# Block pair of the spanning branches: per-device memory is the point of the ring, so the score
# tile stays small next to a shard (a few % slower on CPU than default_block_sizes' tiles).
_RING_BLOCKS = BlockSizes(128, 128, 128, 128)


def _row_chunk(R: int) -> int:
    """Query rows per folding step: the partial result of one hop is ``(rows, U, G, d)``
    float32 and is merged into the state in place, so it stays small next to the shard."""
    if R <= _ROW_CHUNK:
        return R
    best = max(c for c in range(1, _ROW_CHUNK + 1) if R % c == 0)
    return best if best >= _ROW_CHUNK // 4 else R


def _fold_pair(cfg: _RingConfig, q, k, v, Fq, cq, Fk, ck, ok, state):
    """Merges the attention of queries ``q: (b, R, U, G, d)`` to one key chunk into ``state``
    (float32 ``out``, ``lse``), a chunk of query rows at a time."""
    out, lse = state
    R = q.shape[1]
    rc = _row_chunk(R)
    if rc == R:
        return merge_attention_states(out, lse, *_pair_forward(cfg, q, k, v, Fq, cq, Fk, ck, ok))

    def body(i, carry):
        out, lse = carry
        s = i * rc
        rows = lambda x: lax.dynamic_slice_in_dim(x, s, rc, axis=1)
        o, l = _pair_forward(cfg, rows(q), k, v, Fq + s, jnp.clip(cq - s, 0, rc), Fk, ck, ok)
        o, l = merge_attention_states(rows(out), rows(lse), o, l)
        return (lax.dynamic_update_slice_in_dim(out, o, s, axis=1),
                lax.dynamic_update_slice_in_dim(lse, l, s, axis=1))

    return lax.fori_loop(0, R // rc, body, (out, lse))


def _tables(cfg: _RingConfig):
    """Per-chunk dilated starts and counts (static tables), this device's index, and its
    query chunks' starts ``Fq`` and counts ``cq``."""
    geo = cfg.geo
    F_t, cnt_t = geo.table(geo.F[:-1]), geo.table(geo.cnt)
    idx = lax.axis_index(cfg.axis_name)
    return (F_t, cnt_t, idx, [_lookup(F_t[c], idx) for c in range(geo.C)],
            [_lookup(cnt_t[c], idx) for c in range(geo.C)])


def _stream_loop(st: _Stream, idx, step, carry, transfer):
    """Runs ``step(carry, src)`` for every hop of stream ``st``, moving ``transfer(carry)`` one
    hop between steps. A ``fori_loop`` keeps one block in use and one in flight per device."""
    src = jnp.asarray(np.asarray(st.src, np.int32))  # (steps, P)
    hops = len(st.src)
    carry = transfer(carry, True)

    def body(s, carry):
        return transfer(step(carry, src[s, idx]), False)

    if hops > 1:
        carry = lax.fori_loop(0, hops - 1, body, carry)
    return step(carry, src[hops - 1, idx])


def _ring_forward(qd, kd, vd, cfg: _RingConfig):
    C = cfg.geo.C
    F_t, cnt_t, idx, Fq, cq = _tables(cfg)

    def visit(state, kb, vb, src):
        ok = src >= 0
        j = jnp.maximum(src, 0)
        state = list(state)
        for cp in range(C):
            Fk, ck = _lookup(F_t[cp], j), _lookup(cnt_t[cp], j)
            for c in range(C):
                state[c] = _fold_pair(cfg, qd[:, c], kb[:, cp], vb[:, cp], Fq[c], cq[c], Fk, ck,
                                      ok, state[c])
        return tuple(state)

    b, _, R, U, G, d = qd.shape
    state = ((_varying_like(jnp.zeros((b, R, U, G, d), _F32), qd, kd),
              _varying_like(jnp.full((b, R, U, G), -jnp.inf, _F32), qd, kd)),) * C
    if not cfg.streams:
        return _stack_state(visit(state, kd, vd, idx))
    # Every transfer sits inside a loop body next to the compute it overlaps with (iteration s
    # sends the block of hop s + 1 while it computes hop s), so the scheduler cannot hoist the
    # transfers of later hops ahead of time: each device holds one block in use and one in
    # flight. Hop 0 is the own block (visited by the first stream only).
    for si, st in enumerate(cfg.streams):
        own = np.arange(cfg.geo.P) if si == 0 else np.full(cfg.geo.P, -1)
        src = jnp.asarray(np.concatenate([own[None], np.asarray(st.src)]).astype(np.int32))

        def body(s, carry, st=st, src=src):
            kb, vb, state = carry
            nxt = [lax.ppermute(x, cfg.axis_name, st.perm) for x in (kb, vb)]
            return (*nxt, visit(state, kb, vb, src[s, idx]))

        kb, vb, state = lax.fori_loop(0, len(st.src), body, (kd, vd, state))
        state = visit(state, kb, vb, src[len(st.src), idx])
    return _stack_state(state)


def _stack_state(state):
    return jnp.stack([s[0] for s in state], axis=1), jnp.stack([s[1] for s in state], axis=1)


def _ring_backward(cfg: _RingConfig, res, cts):
    qd, kd, vd, out, lse = res
    dout, dlse = cts
    C = cfg.geo.C
    F_t, cnt_t, idx, Fq, cq = _tables(cfg)

    def visit(dq, kb, vb, src):
        ok = src >= 0
        j = jnp.maximum(src, 0)
        dq = list(dq)
        dks, dvs = [], []
        for cp in range(C):
            Fk, ck = _lookup(F_t[cp], j), _lookup(cnt_t[cp], j)
            dk_c = dv_c = None
            for c in range(C):
                # One pass over all query rows: row chunks (as in the forward) would need
                # extra dK/dV accumulators, which cost more than the per-hop dQ they save.
                gq, gk, gv = _pair_backward(cfg, qd[:, c], kb[:, cp], vb[:, cp], out[:, c],
                                            lse[:, c], dout[:, c], dlse[:, c], Fq[c], cq[c], Fk,
                                            ck, ok)
                dq[c] = dq[c] + gq
                dk_c = gk if dk_c is None else dk_c + gk
                dv_c = gv if dv_c is None else dv_c + gv
            dks.append(dk_c)
            dvs.append(dv_c)
        return jnp.stack(dq, axis=1), jnp.stack(dks, axis=1), jnp.stack(dvs, axis=1)

    dq0 = [_varying_like(jnp.zeros(qd.shape[:1] + qd.shape[2:], _F32), qd, kd, dout)
           for _ in range(C)]
    dq, dk, dv = visit(dq0, kd, vd, idx)
    for st in cfg.streams:
        def transfer(carry, first, st=st):
            kb, vb, dkb, dvb, dq = carry
            kb, vb = (lax.ppermute(x, cfg.axis_name, st.perm) for x in (kb, vb))
            if not first:  # dK/dV accumulators travel with the block they belong to
                dkb, dvb = (lax.ppermute(x, cfg.axis_name, st.perm) for x in (dkb, dvb))
            return kb, vb, dkb, dvb, dq

        def step(carry, src):
            kb, vb, dkb, dvb, dq = carry
            dq, gk, gv = visit(list(jnp.moveaxis(dq, 1, 0)), kb, vb, src)
            return kb, vb, dkb + gk, dvb + gv, dq

        zeros = _varying_like(jnp.zeros(kd.shape, _F32), qd, kd, dout)
        _, _, dkb, dvb, dq = _stream_loop(st, idx, step, (kd, vd, zeros, zeros, dq), transfer)
        dk = dk + lax.ppermute(dkb, cfg.axis_name, st.ret)
        dv = dv + lax.ppermute(dvb, cfg.axis_name, st.ret)
    return dq.astype(qd.dtype), dk.astype(kd.dtype), dv.astype(vd.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ring(q, k, v, fence, cfg):
    """Ring attention of the local shards ``q, k, v`` in the dilated layout of ``cfg.dilate``.

    The dilation is inside the custom_vjp: the backward pass keeps only the shards (alive
    anyway) and the branch output, and recomputes the dilated copies. ``fence``: see
    :func:`dilax.core.fence_after` (None: no ordering constraint)."""
    return when(fence, lambda q, k, v: _ring_forward(*cfg.dilate(q, k, v), cfg), (q, k, v))


def _ring_fwd(q, k, v, fence, cfg):
    out, lse = _ring(q, k, v, fence, cfg)
    return (out, lse), (q, k, v, fence, out, lse)


def _ring_bwd(cfg, res, cts):
    q, k, v, fence, out, lse = res

    def grads(q, k, v, out, lse, dout, dlse):
        (qd, kd, vd), undilate = jax.vjp(cfg.dilate, q, k, v)
        return undilate(_ring_backward(cfg, (qd, kd, vd, out, lse), (dout, dlse)))

    return (*when(fence, grads, (q, k, v, out, lse, *cts)), None)


_ring.defvjp(_ring_fwd, _ring_bwd)


_DTYPE_BYTES = {"f64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1,
                "pred": 1, "s64": 8, "u64": 8}


def collective_permute_bytes(hlo_text: str) -> int:
    """Bytes one device sends with collective-permutes when it runs a compiled program.

    Parses the (optimized) HLO text of ``jax.jit(...).lower(...).compile().as_text()``: every
    ``collective-permute`` (or ``-start``) counts its result size, multiplied by the known trip
    counts of the ``while`` loops around it. A diagnostic for tests and benchmarks.
    """
    comps: dict[str, list[str]] = {}
    entry, name = None, None
    for line in hlo_text.splitlines():
        m = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if m and not line.startswith(" "):
            name = m.group(2)
            comps[name] = []
            if m.group(1):
                entry = name
        elif line.startswith("}"):
            name = None
        elif name is not None:
            comps[name].append(line)

    @functools.cache
    def cost(comp: str) -> int:
        total = 0
        for line in comps.get(comp, ()):
            if re.search(r"collective-permute(-start)?\(", line):
                m = re.search(r"=\s*\(?\s*(\w+)\[([\d,]*)\]", line)
                dims = [int(x) for x in m.group(2).split(",") if x]
                total += int(np.prod(dims, dtype=np.int64)) * _DTYPE_BYTES.get(m.group(1), 4)
            elif " while(" in line:
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                body = re.search(r"body=%?([\w.\-]+)", line).group(1)
                cond = re.search(r"condition=%?([\w.\-]+)", line).group(1)
                total += int(trip.group(1) if trip else 1) * cost(body) + cost(cond)
            elif " conditional(" in line:
                branches = re.search(r"branch_computations=\{([^}]*)\}", line)
                names = re.findall(r"%?([\w.\-]+)", branches.group(1)) if branches else []
                total += max((cost(b) for b in names), default=0)
            else:
                for callee in re.findall(r"(?:to_apply|calls)=%?([\w.\-]+)", line):
                    total += cost(callee)
        return total

    return cost(entry) if entry else 0


# --------------------------------------------------------------------------------------------
# One branch, all branches, public API.
# --------------------------------------------------------------------------------------------


def _branch(q, k, v, plan: BranchPlan, P, C, axis_name, scale, is_causal, block_sizes,
            fence=None):
    """Branch ``plan`` on the local shard ``(b, m, ...)``, like :func:`dilax.branches.run_branches`:
    ``(out f32, lse, local_plan)`` in the dilated layout of ``local_plan`` (heads ascending),
    which :func:`dilax.branches.combine_branches` expands over the ``m`` local positions."""
    b, m, h, d = q.shape
    hk = k.shape[2]
    n = P * m
    geo = _geometry(n, P, C, plan.w, plan.r)
    if _is_local(plan, P, C, m):
        loc = _plan_branch(geo.mc, h, hk, plan.w, plan.r, plan.q_heads, plan.q_slots)
        fold = lambda x: x.reshape(b * C, geo.mc, *x.shape[2:])
        (out,), (lse,) = run_branches(fold(q), fold(k), fold(v), Branches(
            (loc,), scale, is_causal, block_sizes or _RING_BLOCKS), fence=fence)
        # The C chunks of S segments each are C*S segments of the local shard.
        return out, lse, dataclasses.replace(loc, num_segments=C * loc.num_segments)
    U, G = len(plan.kv_heads), plan.q_per_kv

    def dilate(q, k, v):
        qd = _dilate(q, plan, plan.q_heads, plan.q_slots, geo, axis_name)
        return (qd.reshape(b, C, geo.R, U, G, d),
                _dilate(k, plan, plan.kv_heads, plan.kv_slots, geo, axis_name),
                _dilate(v, plan, plan.kv_heads, plan.kv_slots, geo, axis_name))

    n_u = tuple(-(-(n - o) // plan.r) for o in plan.kv_slots)
    if geo.L <= min(geo.cnt) + 1:
        out, lse = _halo_branch(*dilate(q, k, v), geo, jnp.asarray(n_u, jnp.int32), axis_name,
                                scale, is_causal, block_sizes)
    else:
        bs = block_sizes or _RING_BLOCKS
        cfg = _RingConfig(axis_name, geo, n_u, _schedule(geo, is_causal), scale, is_causal,
                          BlockSizes(*(min(x, geo.R) for x in (bs.block_q, bs.block_k,
                                                               *bs.backward))), dilate)
        out, lse = _ring(q, k, v, fence, cfg)
    out = out.astype(_F32)
    Hq = U * G
    if geo.regular:
        # Chunk row t of head j is local position c*mc + slot_j + r*t: the single-device
        # dilated layout with C segments of mc, merged without expanding per branch.
        order = tuple(sorted(range(Hq), key=plan.q_heads.__getitem__))
        loc = dataclasses.replace(plan, w=geo.mc, num_segments=C)
        out = static_take(out.reshape(b * C, geo.R, Hq, d), order, axis=2)
        lse = static_take(lse.reshape(b * C, geo.R, Hq), order, axis=2)
        return out, lse, loc
    valid = _valid_rows(geo, plan.kv_slots, axis_name)[None, :, :, :, None]
    out = jnp.where(valid[..., None], out, 0.0)
    lse = jnp.where(valid, lse, -jnp.inf)
    out = _undilate(out.reshape(b, C, geo.R, Hq, d), plan, geo, axis_name, 0.0, jnp.add)
    lse = _undilate(lse.reshape(b, C, geo.R, Hq), plan, geo, axis_name, -jnp.inf, jnp.maximum)
    heads = tuple(sorted(plan.q_heads))
    full = dataclasses.replace(plan, w=m, r=1, num_segments=1, q_heads=heads,
                               q_slots=(0,) * len(heads))
    return out, lse, full


def _is_local(plan: BranchPlan, P: int, C: int, m: int) -> bool:
    """Whether every segment of ``plan`` lies inside one chunk of ``m / C`` local positions
    (then the branch needs no communication)."""
    geo = _geometry(P * m, P, C, plan.w, plan.r)
    return geo.V == 1 or geo.mc % plan.w == 0


def _axis_size(axis_name) -> int:
    try:
        return int(lax.axis_size(axis_name))
    except NameError as e:
        raise ValueError(
            f"axis_name={axis_name!r} is not a mesh axis bound here; call "
            "ring_dilated_attention inside jax.shard_map over a mesh with that axis (or use "
            "sharded_dilated_attention)"
        ) from e


def _check_mesh_axes(mesh, seq_axis, batch_axis) -> None:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    for name, ax in (("seq_axis", seq_axis), ("batch_axis", batch_axis)):
        if ax is not None and ax not in mesh.shape:
            raise ValueError(f"{name}={ax!r} is not an axis of the mesh {dict(mesh.shape)}")
    if seq_axis == batch_axis:
        raise ValueError(f"seq_axis and batch_axis must differ, got {seq_axis!r} for both")


def _check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


@dataclasses.dataclass(frozen=True)
class SequenceParallel:
    """Where and how to run attention sequence-parallel (static, hashable module config).

    Give it to :class:`dilax.nn.DilatedAttention`, :class:`dilax.nn.MultiheadDilatedAttention`
    or the LongNet models (``sequence_parallel=...``): their attention then runs as
    :func:`sharded_dilated_attention` over ``mesh`` (the projections and feed-forward layers
    are left to XLA's sharding propagation under ``jit``).

    Args:
      mesh: the device mesh.
      seq_axis: mesh axis the sequence is split over (``n`` must be divisible by its size).
      batch_axis: optional mesh axis the batch is split over.
      layout: ``"contiguous"`` or ``"zigzag"`` (see :func:`sharded_dilated_attention`).
    """

    mesh: Mesh
    seq_axis: str = "sp"
    batch_axis: str | None = None
    layout: str = "contiguous"

    def __post_init__(self):
        _check_mesh_axes(self.mesh, self.seq_axis, self.batch_axis)
        _check_layout(self.layout)

    def __call__(self, q, k, v, segment_lengths, dilation_rates, **kwargs) -> jax.Array:
        """:func:`sharded_dilated_attention` on this mesh; ``kwargs`` as there."""
        return sharded_dilated_attention(
            q, k, v, segment_lengths, dilation_rates, mesh=self.mesh, seq_axis=self.seq_axis,
            batch_axis=self.batch_axis, layout=self.layout, **kwargs)


def ring_dilated_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_lengths: tuple[int, ...] | list[int] | int,
    dilation_rates: tuple[int, ...] | list[int] | int,
    *,
    axis_name: Hashable,
    is_causal: bool = False,
    mode: str = "mixture",
    scale: float | None = None,
    layout: str = "contiguous",
    block_sizes: BlockSizes | None = None,
) -> jax.Array:
    """Dilated attention on a sequence sharded over mesh axis ``axis_name`` (per-device view).

    Call inside ``jax.shard_map(..., check_vma=False)`` with the sequence axis of ``q, k, v``
    sharded over ``axis_name``. The result equals :func:`dilax.dilated_attention` on the
    gathered inputs (forward and backward), while each device holds only ``O(n / P)`` of the
    data and sends ``O(w / r)`` rows per spanning branch.

    Args:
      q: local shard ``(b, n/P, h, d)``.
      k, v: local shards ``(b, n/P, hk, d)``, ``h % hk == 0``.
      segment_lengths, dilation_rates, is_causal, mode, scale, block_sizes: as in
        :func:`dilax.dilated_attention` (segments refer to global positions).
      axis_name: the mesh axis the sequence is sharded over (size ``P``).
      layout: ``"contiguous"`` (device ``i`` holds positions ``[i n/P, (i+1) n/P)``) or
        ``"zigzag"`` (device ``i`` holds chunks ``i`` and ``2P-1-i`` of ``n/(2P)`` positions,
        see :func:`zigzag_permutation`; balances causal work). The output has the same layout.

    Returns:
      The local shard of the output, ``(b, n/P, h, d)`` in ``q.dtype``.

    Raises:
      ValueError: ``axis_name`` not bound by an enclosing ``shard_map``, a bad ``layout``,
        ``layout="zigzag"`` with an odd local length, and every input error of
        :func:`dilax.dilated_attention`. TypeError: as there (dtypes, non-static config).
    """
    q, k, v = V.check_qkv(q, k, v)
    ws, rs, mode, is_causal, scale, block_sizes = V.check_dilated_call(
        q, segment_lengths, dilation_rates, mode, is_causal, scale, block_sizes)
    layout = _check_layout(layout)
    V.check_memory(q, k, num_branches=len(ws), op="ring_dilated_attention (per device)")
    P = _axis_size(axis_name)
    b, m, h, d = q.shape
    C = 2 if layout == "zigzag" and P > 1 else 1
    if m % C:
        raise ValueError(
            f"layout='zigzag' splits each shard into two chunks and needs an even local "
            f"seq_len, got n/P={m} on mesh axis {axis_name!r}"
        )
    plans = dilated_branches(P * m, h, k.shape[2], ws, rs, mode)
    # Spanning branches first, sparsest (largest r, smallest dilated copies) first, local ones
    # last, each fenced behind the previous one: only finished (dilated, so small) branch
    # outputs are live next to the branch being computed, whatever the XLA scheduler prefers.
    order = sorted(range(len(plans)), key=lambda i: (_is_local(plans[i], P, C, m), -plans[i].r))
    results: list = [None] * len(plans)
    prev = None
    for i in order:
        results[i] = _branch(q, k, v, plans[i], P, C, axis_name, scale, is_causal, block_sizes,
                             fence=None if prev is None else fence_after(prev))
        prev = results[i][1]
    outs, lses, local_plans = zip(*results)
    out, _ = combine_branches(outs, lses, local_plans, m, mode)
    return out.astype(q.dtype)


def sharded_dilated_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_lengths: tuple[int, ...] | list[int] | int,
    dilation_rates: tuple[int, ...] | list[int] | int,
    *,
    mesh: Mesh,
    seq_axis: str = "sp",
    batch_axis: str | None = None,
    is_causal: bool = False,
    mode: str = "mixture",
    scale: float | None = None,
    layout: str = "contiguous",
    block_sizes: BlockSizes | None = None,
) -> jax.Array:
    """Sequence-parallel dilated attention over ``mesh`` (global view; builds the shard_map).

    Args:
      q: ``(b, n, h, d)``; k, v: ``(b, n, hk, d)`` in natural position order.
      mesh: a ``jax.sharding.Mesh``; the sequence is sharded over ``seq_axis`` (``P`` devices,
        ``n % P == 0``) and, optionally, the batch over ``batch_axis``.
      layout: ``"contiguous"`` or ``"zigzag"``. With ``"zigzag"`` the shards are permuted to the
        zigzag layout with point-to-point transfers inside the shard_map (``n % 2P == 0``) and
        the output is permuted back, so the caller always sees natural order.
      Other arguments: as in :func:`dilax.dilated_attention`.

    Returns:
      ``(b, n, h, d)`` in ``q.dtype``, sharded like ``q``; equal to
      ``dilated_attention(q, k, v, ...)``.

    Raises:
      TypeError: ``mesh`` is not a ``Mesh``; dtypes or non-static config as in
        :func:`dilax.dilated_attention`.
      ValueError: ``seq_axis``/``batch_axis`` not mesh axes or equal, ``n % P != 0``,
        ``layout="zigzag"`` with ``n % 2P != 0``, batch not divisible by the ``batch_axis``
        size, and every input error of :func:`dilax.dilated_attention`.
    """
    q, k, v = V.check_qkv(q, k, v)
    layout = _check_layout(layout)
    _check_mesh_axes(mesh, seq_axis, batch_axis)
    b, n = q.shape[:2]
    P = mesh.shape[seq_axis]
    if n % P:
        raise ValueError(
            f"seq_len n={n} must be divisible by the size {P} of mesh axis {seq_axis!r}"
        )
    zigzag = layout == "zigzag" and P > 1
    if zigzag and n % (2 * P):
        raise ValueError(
            f"layout='zigzag' needs seq_len n={n} divisible by 2 * {P} (twice the size of mesh "
            f"axis {seq_axis!r})"
        )
    if batch_axis is not None and b % mesh.shape[batch_axis]:
        raise ValueError(
            f"batch size {b} must be divisible by the size {mesh.shape[batch_axis]} of mesh "
            f"axis {batch_axis!r}"
        )
    ws, rs, mode, is_causal, scale, block_sizes = V.check_dilated_call(
        q, segment_lengths, dilation_rates, mode, is_causal, scale, block_sizes)
    return _sharded_jit(q, k, v, ws, rs, mesh, seq_axis, batch_axis, is_causal, mode, scale,
                        layout, block_sizes)


# One compiled program per static configuration (cached across eager calls, and bitwise the
# same result as a call under the caller's jax.jit).
@functools.partial(jax.jit, static_argnums=tuple(range(3, 13)))
def _sharded_jit(q, k, v, segment_lengths, dilation_rates, mesh, seq_axis, batch_axis,
                 is_causal, mode, scale, layout, block_sizes):
    P = mesh.shape[seq_axis]
    zigzag = layout == "zigzag" and P > 1
    spec = PartitionSpec(batch_axis, seq_axis)

    def body(q, k, v):
        if zigzag:
            q, k, v = (_relayout(x, P, seq_axis, True) for x in (q, k, v))
        out = ring_dilated_attention(
            q, k, v, segment_lengths, dilation_rates, axis_name=seq_axis, is_causal=is_causal,
            mode=mode, scale=scale, layout=layout, block_sizes=block_sizes,
        )
        return _relayout(out, P, seq_axis, False) if zigzag else out

    axes = [ax for ax in (seq_axis, batch_axis) if ax is not None]
    if any(mesh.axis_types[mesh.axis_names.index(ax)] == AxisType.Explicit for ax in axes):
        # Explicit mesh axes (jax.make_mesh's default): shard_map wants the inputs' sharding
        # to match in_specs already.
        sharding = NamedSharding(mesh, spec)
        q, k, v = (jax.sharding.reshard(x, sharding) for x in (q, k, v))
    return jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec,
                         check_vma=False)(q, k, v)
