"""The branch kinds of ring dilated attention (:mod:`dilax.dilated.ring`), each a
:class:`dilax.branch.runner.BranchOp` on the local shard, and :func:`branch_op`, which picks one
per branch statically (:func:`branch_kind`):

* :class:`_LocalBranch` -- every segment lies inside one chunk of the shard: the single-device
  core folded over the chunks, no communication.
* :class:`_SpanningBranch` -- segments span several devices: the ring
  (:mod:`dilax.sp.ring_vjp`) or, for short unaligned segments, the halo exchange
  (:func:`_halo_branch`).
* :class:`WindowBranch` -- the local window ``|p - t| <= W``: each chunk receives ``W``
  boundary rows from the devices holding its neighbouring chunks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dilax.branch.plan import BranchPlan, slot_view
from dilax.branch.plan import plan_branch as _plan_branch
from dilax.branch.runner import CoreBranch
from dilax.core import (
    XLA,
    BlockSizes,
    Core,
    KeyBounds,
    Mask,
    PairArrays,
    attention,
    identity_view,
    static_take,
)
from dilax.core.arrays import dynamic_slice_in_dim, dynamic_update_slice_in_dim, varying_like
from dilax.dilated.ring_dilate import dilate, undilate, valid_rows
from dilax.sp.layout import lookup, vblock, vshift
from dilax.sp.ring_vjp import (
    RING_BACKWARD_BLOCKS,
    RING_BLOCKS,
    RingConfig,
    ring_backward,
    ring_backward_in_place,
    ring_forward,
)
from dilax.sp.schedule import Geometry, geometry, ring_streams

_F32 = jnp.float32


def _halo_branch(qd, kd, vd, geo: Geometry, n_u, axis_name, scale, is_causal, block_sizes,
                 core: Core = XLA):
    """Segments shorter than a chunk but not aligned with it: each device takes the
    ``L - 1`` dilated rows on either side of its chunks from its neighbours, cuts
    segment-aligned windows and runs ``core`` on them. ``(out f32, lse)`` per dilated row."""
    b, C, R, U, G, d = qd.shape
    dv = vd.shape[-1]  # the values' head dim (may differ from d)
    L, Lm1 = geo.L, geo.L - 1
    idx = lax.axis_index(axis_name)
    F = [lookup(t, idx) for t in geo.table(geo.F[:-1])]
    cnt = [lookup(t, idx) for t in geo.table(geo.cnt)]
    s_w = max(((geo.F[v] % L) + geo.cnt[v] - 1) // L + 1 for v in range(geo.V) if geo.cnt[v])
    size = max(Lm1 + s_w * L, 2 * Lm1 + R)

    def tails(x):
        if geo.regular:
            return x[:, :, R - Lm1:]
        return jnp.stack([dynamic_slice_in_dim(x[:, c], cnt[c] - Lm1, Lm1, axis=1)
                          for c in range(C)], axis=1)

    def window(x, left, right, c):
        parts = [x[:, c], jnp.zeros((b, size - Lm1 - R, *x.shape[3:]), x.dtype)]
        if Lm1:
            parts.insert(0, left[:, c] if left is not None else
                         jnp.zeros((b, Lm1, *x.shape[3:]), x.dtype))
        buf = jnp.concatenate(parts, axis=1)
        if right is not None:
            buf = dynamic_update_slice_in_dim(buf, right[:, c], Lm1 + cnt[c], axis=1)
        return dynamic_slice_in_dim(buf, Lm1 - F[c] % L, s_w * L, axis=1)

    halos = {}
    for name, x in (("k", kd), ("v", vd)):
        if Lm1:
            halos[name] = (vshift(tails(x), 1, geo.P, C, axis_name),
                           vshift(x[:, :, :Lm1], -1, geo.P, C, axis_name))
        else:
            halos[name] = (None, None)
    qw = jnp.stack([window(qd, None, None, c) for c in range(C)], axis=1)
    kw = jnp.stack([window(kd, *halos["k"], c) for c in range(C)], axis=1)
    vw = jnp.stack([window(vd, *halos["v"], c) for c in range(C)], axis=1)
    seg_start = jnp.stack([(F[c] // L + jnp.arange(s_w)) * L for c in range(C)])  # (C, s_w)
    n_u = jnp.broadcast_to(n_u, (b, U))  # (U,) or, with valid key lengths, (b, U)
    kv_len = jnp.clip(n_u[:, None, None, :] - seg_start[None, :, :, None], 0, L)
    kv_len = kv_len.reshape(b * C * s_w, U)
    out, lse = attention(qw.reshape(b * C * s_w, L, U * G, d), kw.reshape(b * C * s_w, L, U, d),
                         vw.reshape(b * C * s_w, L, U, dv), view=identity_view(U, G),
                         scale=scale, mask=Mask(KeyBounds(kv_len, 0, 0, bool(is_causal))),
                         core=core, block_sizes=block_sizes)
    out = out.reshape(b, C, s_w * L, U, G, dv)
    lse = lse.reshape(b, C, s_w * L, U, G)
    out = jnp.stack([dynamic_slice_in_dim(out[:, c], F[c] % L, R, axis=1)
                     for c in range(C)], axis=1)
    lse = jnp.stack([dynamic_slice_in_dim(lse[:, c], F[c] % L, R, axis=1)
                     for c in range(C)], axis=1)
    return out, lse


@dataclasses.dataclass(frozen=True)
class _SpanningBranch:
    """A branch whose segments span several devices, as a :class:`dilax.branch.runner.BranchOp`:
    the ring (:mod:`dilax.sp.ring_vjp`) or, for short unaligned segments, the halo exchange
    (:func:`_halo_branch`). Results in the dilated layout of ``result_plan``."""

    plan: BranchPlan
    geo: Geometry
    n_u: tuple[int, ...]
    axis_name: Hashable
    scale: float
    is_causal: bool
    block_sizes: BlockSizes | None
    ring: RingConfig | None  # None: the halo exchange
    core: Core = XLA  # the halo exchange's core (the ring's: ``ring.core``)

    def _dilate(self, q, k, v):
        b, d, plan, geo = q.shape[0], q.shape[-1], self.plan, self.geo
        qd = dilate(q, plan, plan.q_heads, plan.q_slots, geo, self.axis_name)
        return (qd.reshape(b, geo.C, geo.R, len(plan.kv_heads), plan.q_per_kv, d),
                dilate(k, plan, plan.kv_heads, plan.kv_slots, geo, self.axis_name),
                dilate(v, plan, plan.kv_heads, plan.kv_slots, geo, self.axis_name))

    @property
    def result_plan(self) -> BranchPlan:
        plan, geo = self.plan, self.geo
        if geo.regular:
            # Chunk row t of head j is local position c*mc + slot_j + r*t: the single-device
            # dilated layout with C segments of mc, merged without expanding per branch.
            return dataclasses.replace(plan, w=geo.mc, num_segments=geo.C)
        heads = tuple(sorted(plan.q_heads))
        return dataclasses.replace(plan, w=geo.C * geo.mc, r=1, num_segments=1, q_heads=heads,
                                   q_slots=(0,) * len(heads))

    def _post(self, x, fill, combine):
        """Ring layout ``(b, C, R, U, G, ...)`` -> the layout of ``result_plan``."""
        plan, geo = self.plan, self.geo
        b, C, R = x.shape[:3]
        Hq = len(plan.q_heads)
        tail = x.shape[5:]
        if geo.regular:
            order = tuple(sorted(range(Hq), key=plan.q_heads.__getitem__))
            return static_take(x.reshape(b * C, R, Hq, *tail), order, axis=2)
        valid = valid_rows(geo, plan.kv_slots, self.axis_name)[None, :, :, :, None]
        x = jnp.where(valid.reshape(valid.shape + (1,) * len(tail)), x, fill)
        return undilate(x.reshape(b, C, R, Hq, *tail), plan, geo, self.axis_name, fill,
                        combine)

    def _post_out(self, out):
        return self._post(out.astype(_F32), 0.0, jnp.add)

    def _post_lse(self, lse):
        return self._post(lse, -jnp.inf, jnp.maximum)

    def _valid_rows(self, aux):
        """``None``, or with valid key lengths ``L (b,)`` (global, ``aux[0]``) the valid
        dilated rows ``(b, U)`` of each virtual kv head: ``ceil((L - o) / r)`` for slot ``o``
        (a prefix, as positions grow with the row), at most the ragged bound ``n_u``."""
        if aux is None:
            return None
        slots = jnp.asarray(np.asarray(self.plan.kv_slots, np.int32))
        rows = jnp.clip(-(-(aux[0][:, None] - slots[None]) // self.plan.r), 0, None)
        return jnp.minimum(rows, jnp.asarray(self.n_u, jnp.int32)[None])

    def _raw(self, q, k, v, aux):
        n_u = self._valid_rows(aux)
        if self.ring is not None:
            return ring_forward(self.ring, q, k, v, n_u)
        if n_u is None:
            n_u = jnp.asarray(self.n_u, jnp.int32)
        return _halo_branch(*self._dilate(q, k, v), self.geo, n_u, self.axis_name, self.scale,
                            self.is_causal, self.block_sizes, self.core)

    @property
    def _in_place(self) -> bool:
        """Whether the ring's backward reads this shard's queries in place (regular geometry,
        one chunk per device: the ring rows are the single-device dilated layout)."""
        return self.ring is not None and self.geo.regular and self.geo.C == 1

    def forward(self, q, k, v, aux):
        out, lse = self._raw(q, k, v, aux)
        # The ring's backward in the ring layout needs its own lse: keep it (rows x heads).
        keep = self.ring is not None and not self._in_place
        return self._post_out(out), self._post_lse(lse), lse if keep else None

    def backward(self, q, k, v, aux, res, lse, dout, dlse, delta, acc):
        if self._in_place:  # dout, lse, delta are already in the layout the core reads
            return ring_backward_in_place(self.ring, q, k, v, lse, dout, delta,
                                          self._valid_rows(aux), acc, self.result_plan)
        if self.ring is None:  # the halo branch: differentiate its forward (recomputed)
            _, vjp = jax.vjp(lambda q, k, v: self.forward(q, k, v, aux)[:2], q, k, v)
            grads = vjp((dout, dlse))
        else:
            # dout and delta back to the ring layout: the transposes of the (linear) output
            # layout map and of the lse map (a gather of each row's one valid source).
            lse_raw = res
            zeros = varying_like(jnp.zeros(lse_raw.shape + dout.shape[-1:], _F32), q, k, v)
            dout_raw = jax.vjp(self._post_out, zeros)[1](dout)[0]
            delta_raw = jax.vjp(self._post_lse, lse_raw)[1](delta)[0]
            grads = ring_backward(self.ring, q, k, v, lse_raw, dout_raw, delta_raw,
                                  self._valid_rows(aux))
        grads = tuple(g.astype(_F32) for g in grads)
        return grads if acc is None else tuple(a + g for a, g in zip(acc, grads, strict=True))


@dataclasses.dataclass(frozen=True)
class _LocalBranch:
    """A local branch: ``op`` (a :class:`~dilax.branch.runner.CoreBranch` folded over the chunks)
    with the chunks' own key lengths, ``aux[1]`` (``(b * C,)`` in chunk coordinates)."""

    op: CoreBranch

    @property
    def result_plan(self) -> BranchPlan:
        return self.op.result_plan

    @staticmethod
    def _aux(aux):
        return None if aux is None else (None, aux[1])

    def forward(self, q, k, v, aux):
        return self.op.forward(q, k, v, self._aux(aux))

    def backward(self, q, k, v, aux, res, lse, dout, dlse, delta, acc):
        return self.op.backward(q, k, v, self._aux(aux), res, lse, dout, dlse, delta, acc)


def chunk_starts(P: int, C: int, mc: int, axis_name) -> list[jax.Array]:
    """Global position of the first row of each local chunk of ``mc`` rows."""
    idx = lax.axis_index(axis_name)
    return [lookup([vblock(P, C, i, c) * mc for i in range(P)], idx) for c in range(C)]


@dataclasses.dataclass(frozen=True)
class WindowBranch:
    """The local-window branch ``|p - t| <= W`` on the ring (docs: "Local window branch"):
    each chunk receives the ``W`` rows before it (and after it, when not causal) from the
    devices holding its neighbouring chunks (one ``ppermute`` each), then one call of ``core``
    per device with the band mask. ``O(m W)`` work and ``O(W)`` rows sent per device. Backward:
    the VJP of this forward (recomputed; the transfers transpose to the reverse ones).
    ``aux``: ``None`` or ``(kv_len (b,) global, ...)``."""

    plan: BranchPlan  # window_plan of one chunk
    P: int
    C: int
    n: int
    axis_name: Hashable
    scale: float
    is_causal: bool
    block_sizes: BlockSizes | None
    core: Core = XLA

    @property
    def result_plan(self) -> BranchPlan:
        return dataclasses.replace(self.plan, num_segments=self.C)

    def _run(self, q, k, v, aux):
        b, m, h, d = q.shape
        C, P, W = self.C, self.P, self.plan.window
        mc = m // C

        def halo(x):
            xc = x.reshape(b, C, mc, *x.shape[2:])
            parts = [xc]
            if W:
                parts.insert(0, vshift(xc[:, :, mc - W:], 1, P, C, self.axis_name))
                if not self.is_causal:
                    parts.append(vshift(xc[:, :, :W], -1, P, C, self.axis_name))
            buf = jnp.concatenate(parts, axis=2)
            return buf.reshape(b * C, buf.shape[2], *x.shape[2:])

        kb, vb = halo(k), halo(v)
        lk = kb.shape[1]
        # Buffer row t of chunk c is global key position start_c - W + t: valid iff in
        # [0, kv_len) (the halo of the first chunk lies before the sequence).
        starts = jnp.stack(chunk_starts(P, C, mc, self.axis_name)) - W  # (C,)
        limit = (jnp.full((b,), self.n, jnp.int32) if aux is None else aux[0])  # (b,)
        pos = starts[:, None] + jnp.arange(lk)[None]  # (C, lk)
        valid = (pos[None] >= 0) & (pos[None] < limit[:, None, None])  # (b, C, lk)
        kv_len = jnp.clip(limit[:, None] - starts[None], 0, lk).reshape(b * C, 1)
        mask = Mask(KeyBounds(kv_len, W, 0, self.is_causal, window=W),
                    PairArrays(kv_valid=valid.reshape(b * C, 1, lk)))
        qf = q.reshape(b * C, mc, h, d)
        return attention(qf, kb, vb, view=slot_view(self.plan, h, k.shape[2]),
                         scale=self.scale, mask=mask, core=self.core,
                         block_sizes=self.block_sizes, out_dtype=_F32)

    def forward(self, q, k, v, aux):
        out, lse = self._run(q, k, v, aux)
        return out, lse, None

    def backward(self, q, k, v, aux, res, lse, dout, dlse, delta, acc):
        del res, lse, delta
        _, vjp = jax.vjp(lambda q, k, v: self._run(q, k, v, aux), q, k, v)
        grads = tuple(g.astype(_F32) for g in vjp((dout, dlse)))
        return grads if acc is None else tuple(a + g for a, g in zip(acc, grads, strict=True))


def branch_op(plan: BranchPlan, P, C, m, h, hk, axis_name, scale, is_causal, block_sizes,
              core: Core = XLA, hop_core: Core = XLA):
    """Branch ``plan`` on local shards of ``m`` positions as a
    :class:`dilax.branch.runner.BranchOp`: a :class:`~dilax.branch.runner.CoreBranch` of
    ``core`` over the ``C`` chunks of the shard when every segment lies inside one chunk, else a
    spanning branch whose hops (ring or halo) run on ``hop_core``. The XLA core gets the ring's
    small default tiles (:data:`RING_BLOCKS`, :func:`ring_blocks`); a kernel core ``block_sizes`` as
    given (``None``: the kernels' per-shape defaults)."""
    n = P * m
    geo = geometry(n, P, C, plan.w, plan.r)
    kind = branch_kind(P, C, m, plan.w, plan.r)
    if kind == "local":
        loc = _plan_branch(geo.mc, h, hk, plan.w, plan.r, plan.q_heads, plan.q_slots)
        blocks = (block_sizes or RING_BLOCKS) if core.name == "xla" else block_sizes
        return _LocalBranch(CoreBranch(loc, scale, is_causal, blocks, core, fold=C))
    n_u = tuple(-(-(n - o) // plan.r) for o in plan.kv_slots)
    cfg = None
    if kind == "ring":
        blocks = ring_blocks(geo, block_sizes) if hop_core.name == "xla" else block_sizes
        cfg = RingConfig(axis_name, geo, n_u, ring_streams(geo, is_causal), scale, is_causal,
                         blocks, None, hop_core)
    op = _SpanningBranch(plan, geo, n_u, axis_name, scale, is_causal, block_sizes, cfg,
                         hop_core)
    if cfg is not None:
        op = dataclasses.replace(op, ring=dataclasses.replace(cfg, dilate=op._dilate))
    return op


def is_local(plan: BranchPlan, P: int, C: int, m: int) -> bool:
    """Whether every segment of ``plan`` lies inside one chunk of ``m / C`` local positions
    (then the branch needs no communication)."""
    return branch_kind(P, C, m, plan.w, plan.r) == "local"


def branch_kind(P: int, C: int, m: int, w: int, r: int) -> str:
    """How :func:`branch_op` runs branch ``(w, r)`` (effective ``w``) on ``P`` shards of ``m``
    positions in ``C`` chunks each: ``"local"`` (every segment inside one chunk: no
    communication), ``"ring"`` (the K/V chunks travel, :mod:`dilax.sp.ring_vjp`) or ``"halo"``
    (segments shorter than a chunk but unaligned with it: :func:`_halo_branch`)."""
    geo = geometry(P * m, P, C, w, r)
    if geo.V == 1 or geo.mc % w == 0:
        return "local"
    return "ring" if geo.L > min(geo.cnt) + 1 else "halo"


def ring_blocks(geo: Geometry, block_sizes: BlockSizes | None) -> BlockSizes:
    """The core's blocks on a ring branch: ``block_sizes`` (default :data:`RING_BLOCKS`, with
    :data:`RING_BACKWARD_BLOCKS` backward), each at most the ``R`` dilated rows of a chunk."""
    bs = block_sizes or RING_BLOCKS
    bwd = bs.backward if block_sizes else RING_BACKWARD_BLOCKS
    return BlockSizes(*(min(x, geo.R) for x in (bs.block_q, bs.block_k, *bwd)))
