"""Ring (sequence-parallel) dilated attention with ``jax.shard_map``.

The sequence axis of ``q, k, v`` is split over the ``P`` devices of a mesh axis. Each branch
``(w, r)`` of the configuration is computed in one of three ways, chosen statically:

* **local** -- every segment lies inside one device's shard (``(n/P) % w == 0``): the
  single-device path (:func:`dilax.branches.attend_branches`) runs on the shard, no communication.
* **halo** -- segments are shorter than a shard but not aligned with shard boundaries: after
  dilation each device receives the ``w/r - 1`` dilated rows on either side from its neighbours,
  cuts a segment-aligned window and runs the local path on it.
* **ring** -- segments span several devices: dilated K/V chunks travel between the devices
  that share segments (:mod:`dilax.sp.ring_vjp`, scheduled by :mod:`dilax.sp.schedule`), with
  a second ring for the backward pass. Communication per device is ``O(w / r)`` rows per
  branch, independent of ``n``.

Valid lengths (global positions) bound the keys of every branch: the local branches get each
chunk's own lengths, the spanning ones a per-batch-row count of valid dilated rows; query
rows past their length are zeroed after the merge (cotangent 0: no gradient from them). The
local window (``local_window=W``) is one more branch: each chunk receives ``W`` boundary rows
from the devices holding its neighbouring chunks (:class:`_WindowBranch`).

Branches are merged exactly like the single-device function (log-sum-exp weights in
``mode="mixture"``, ``1/G`` in ``mode="grouped"``), so the result equals
:func:`dilax.dilated_attention` on the gathered inputs, forward and backward
(docs/semantics.md, "Ring attention").

Layouts (:mod:`dilax.sp.layout`). ``layout="contiguous"``: device ``i`` holds positions
``[i n/P, (i+1) n/P)``. ``layout="zigzag"`` (causal load balance): the sequence is cut into
``2P`` chunks of ``n/(2P)`` positions and device ``i`` holds chunk ``i`` followed by chunk
``2P-1-i``; see :func:`dilax.sp.zigzag_permutation`. :func:`sharded_dilated_attention`
converts to and from it for you.

Inside your own ``jax.shard_map``: shard_map's default checks (``check_vma=True``) hold, every
loop carry and ``cond`` of the core and the ring is typed as device-varying.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Hashable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

from dilax import _validation as V
from dilax.branches import CoreBranch, attend_branches
from dilax.core import BlockSizes, Mask, attention, attention_core, static_take
from dilax.layout import BranchPlan, dilated_branches, slot_view, window_plan
from dilax.layout import plan_branch as _plan_branch
from dilax.sp.dilate import dilate, undilate, valid_rows
from dilax.sp.layout import check_layout, lookup, relayout, vblock, vshift
from dilax.sp.mesh import axis_size, check_mesh, check_sharded_shape, shard_sequence
from dilax.sp.ring_vjp import (
    RING_BACKWARD_BLOCKS,
    RING_BLOCKS,
    RingConfig,
    _varying_like,
    ring_backward,
    ring_backward_in_place,
    ring_forward,
)
from dilax.sp.schedule import Geometry, geometry, ring_streams

_F32 = jnp.float32


def _halo_branch(qd, kd, vd, geo: Geometry, n_u, axis_name, scale, is_causal, block_sizes):
    """Segments shorter than a chunk but not aligned with it: each device takes the
    ``L - 1`` dilated rows on either side of its chunks from its neighbours, cuts
    segment-aligned windows and runs the core on them. ``(out f32, lse)`` per dilated row."""
    b, C, R, U, G, d = qd.shape
    L, Lm1 = geo.L, geo.L - 1
    idx = lax.axis_index(axis_name)
    F = [lookup(t, idx) for t in geo.table(geo.F[:-1])]
    cnt = [lookup(t, idx) for t in geo.table(geo.cnt)]
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


@dataclasses.dataclass(frozen=True)
class _SpanningBranch:
    """A branch whose segments span several devices, as a :class:`dilax.branches.BranchOp`:
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
        return _halo_branch(*self._dilate(q, k, v), self.geo, n_u,
                            self.axis_name, self.scale, self.is_causal, self.block_sizes)

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
            zeros = _varying_like(jnp.zeros(lse_raw.shape + dout.shape[-1:], _F32), q, k, v)
            dout_raw = jax.vjp(self._post_out, zeros)[1](dout)[0]
            delta_raw = jax.vjp(self._post_lse, lse_raw)[1](delta)[0]
            grads = ring_backward(self.ring, q, k, v, lse_raw, dout_raw, delta_raw,
                                  self._valid_rows(aux))
        grads = tuple(g.astype(_F32) for g in grads)
        return grads if acc is None else tuple(a + g for a, g in zip(acc, grads, strict=True))


@dataclasses.dataclass(frozen=True)
class _LocalBranch:
    """A local branch: ``op`` (a :class:`~dilax.branches.CoreBranch` folded over the chunks)
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


def _chunk_starts(P: int, C: int, mc: int, axis_name) -> list[jax.Array]:
    """Global position of the first row of each local chunk of ``mc`` rows."""
    idx = lax.axis_index(axis_name)
    return [lookup([vblock(P, C, i, c) * mc for i in range(P)], idx) for c in range(C)]


@dataclasses.dataclass(frozen=True)
class _WindowBranch:
    """The local-window branch ``|p - t| <= W`` on the ring (docs: "Local window branch"):
    each chunk receives the ``W`` rows before it (and after it, when not causal) from the
    devices holding its neighbouring chunks (one ``ppermute`` each), then one core call per
    device with the band mask. ``O(m W)`` work and ``O(W)`` rows sent per device. Backward:
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
        starts = jnp.stack(_chunk_starts(P, C, mc, self.axis_name)) - W  # (C,)
        limit = (jnp.full((b,), self.n, jnp.int32) if aux is None else aux[0])  # (b,)
        pos = starts[:, None] + jnp.arange(lk)[None]  # (C, lk)
        valid = (pos[None] >= 0) & (pos[None] < limit[:, None, None])  # (b, C, lk)
        kv_len = jnp.clip(limit[:, None] - starts[None], 0, lk).reshape(b * C, 1)
        mask = Mask(kv_len, W, 0, self.is_causal, window=W,
                    kv_valid=valid.reshape(b * C, 1, lk))
        qf = q.reshape(b * C, mc, h, d)
        return attention(qf, kb, vb, view=slot_view(self.plan, h, k.shape[2]),
                         scale=self.scale, mask=mask, block_sizes=self.block_sizes,
                         out_dtype=_F32)

    def forward(self, q, k, v, aux):
        out, lse = self._run(q, k, v, aux)
        return out, lse, None

    def backward(self, q, k, v, aux, res, lse, dout, dlse, delta, acc):
        del res, lse, delta
        _, vjp = jax.vjp(lambda q, k, v: self._run(q, k, v, aux), q, k, v)
        grads = tuple(g.astype(_F32) for g in vjp((dout, dlse)))
        return grads if acc is None else tuple(a + g for a, g in zip(acc, grads, strict=True))


def _branch_op(plan: BranchPlan, P, C, m, h, hk, axis_name, scale, is_causal, block_sizes):
    """Branch ``plan`` on local shards of ``m`` positions as a
    :class:`dilax.branches.BranchOp`: a :class:`~dilax.branches.CoreBranch` over the ``C``
    chunks of the shard when every segment lies inside one chunk, else a spanning branch."""
    n = P * m
    geo = geometry(n, P, C, plan.w, plan.r)
    bs = block_sizes or RING_BLOCKS
    if _is_local(plan, P, C, m):
        loc = _plan_branch(geo.mc, h, hk, plan.w, plan.r, plan.q_heads, plan.q_slots)
        return _LocalBranch(CoreBranch(loc, scale, is_causal, bs, fold=C))
    n_u = tuple(-(-(n - o) // plan.r) for o in plan.kv_slots)
    cfg = None
    if geo.L > min(geo.cnt) + 1:
        bwd = bs.backward if block_sizes else RING_BACKWARD_BLOCKS
        blocks = BlockSizes(*(min(x, geo.R) for x in (bs.block_q, bs.block_k, *bwd)))
        cfg = RingConfig(axis_name, geo, n_u, ring_streams(geo, is_causal), scale, is_causal,
                         blocks, None)
    op = _SpanningBranch(plan, geo, n_u, axis_name, scale, is_causal, block_sizes, cfg)
    if cfg is not None:
        op = dataclasses.replace(op, ring=dataclasses.replace(cfg, dilate=op._dilate))
    return op


def _is_local(plan: BranchPlan, P: int, C: int, m: int) -> bool:
    """Whether every segment of ``plan`` lies inside one chunk of ``m / C`` local positions
    (then the branch needs no communication)."""
    geo = geometry(P * m, P, C, plan.w, plan.r)
    return geo.V == 1 or geo.mc % plan.w == 0


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
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window: int | None = None,
) -> jax.Array:
    """Dilated attention on a sequence sharded over mesh axis ``axis_name`` (per-device view).

    Call inside ``jax.shard_map`` (default checks or ``check_vma=False``) with the sequence
    axis of ``q, k, v`` sharded over ``axis_name``. The result equals
    :func:`dilax.dilated_attention` on the gathered inputs (forward and backward), while each
    device holds only ``O(n / P)`` of the data and sends ``O(w / r)`` rows per spanning
    branch.

    Args:
      q: local shard ``(b, n/P, h, d)``.
      k, v: local shards ``(b, n/P, hk, d)``, ``h % hk == 0``.
      segment_lengths, dilation_rates, is_causal, mode, scale, block_sizes: as in
        :func:`dilax.dilated_attention` (segments refer to global positions).
      axis_name: the mesh axis the sequence is sharded over (size ``P``).
      layout: ``"contiguous"`` (device ``i`` holds positions ``[i n/P, (i+1) n/P)``) or
        ``"zigzag"`` (device ``i`` holds chunks ``i`` and ``2P-1-i`` of ``n/(2P)`` positions,
        see :func:`zigzag_permutation`; balances causal work). The output has the same layout.
      query_seq_lengths, key_value_seq_lengths: optional int ``(b,)`` valid lengths in GLOBAL
        positions (the same on every device of ``axis_name``), as in
        :func:`dilax.dilated_attention`: query rows past them output 0 with zero gradient,
        keys past them get no weight (key blocks past them are skipped).
      local_window: optional int ``W`` (``mode="mixture"``), as in
        :func:`dilax.dilated_attention`; each device receives ``W`` boundary rows from its
        neighbours. Needs ``W <= n/P`` (``n/(2P)`` with ``layout="zigzag"``).

    Returns:
      The local shard of the output, ``(b, n/P, h, d)`` in ``q.dtype``.

    Raises:
      ValueError: ``axis_name`` not bound by an enclosing ``shard_map``, a bad ``layout``,
        ``layout="zigzag"`` with an odd local length, ``local_window`` longer than a local
        chunk, and every input error of
        :func:`dilax.dilated_attention`. TypeError: as there (dtypes, non-static config).
    """
    q, k, v = V.check_qkv(q, k, v)
    ws, rs, mode, is_causal, scale, block_sizes = V.check_dilated_call(
        q, segment_lengths, dilation_rates, mode, is_causal, scale, block_sizes)
    layout = check_layout(layout)
    V.check_memory(q, k, num_branches=len(ws), op="ring_dilated_attention (per device)")
    P = axis_size(axis_name, "ring_dilated_attention", "sharded_dilated_attention")
    b, m, h, d = q.shape
    C = 2 if layout == "zigzag" and P > 1 else 1
    if m % C:
        raise ValueError(
            f"layout='zigzag' splits each shard into two chunks and needs an even local "
            f"seq_len, got n/P={m} on mesh axis {axis_name!r}"
        )
    n = P * m
    window = V.check_local_window(local_window, mode)
    if window is not None and window > m // C:
        raise ValueError(
            f"local_window={window} must be at most the local chunk length "
            f"{m // C} (n/P{'/2 with layout=zigzag' if C == 2 else ''}) on the ring"
        )
    q_len = V.check_seq_lengths(query_seq_lengths, "query_seq_lengths", b, n)
    kv_len = V.check_seq_lengths(key_value_seq_lengths, "key_value_seq_lengths", b, n)
    plans = dilated_branches(n, h, k.shape[2], ws, rs, mode)
    # Spanning branches first, sparsest (largest r, smallest dilated copies) first, local ones
    # last, each fenced behind the previous one (attend_branches): only finished (dilated, so
    # small) branch outputs are live next to the branch being computed, whatever the XLA
    # scheduler prefers. All branches and the merge are one custom_vjp, whose backward adds
    # every branch's float32 gradients into one accumulator.
    order = sorted(plans, key=lambda p: (_is_local(p, P, C, m), -p.r))
    ops = tuple(_branch_op(p, P, C, m, h, k.shape[2], axis_name, scale, is_causal, block_sizes)
                for p in order)
    if window is not None:
        ops += (_WindowBranch(window_plan(m // C, h, k.shape[2], window), P, C, n, axis_name,
                              scale, is_causal, block_sizes or RING_BLOCKS),)
    starts = _chunk_starts(P, C, m // C, axis_name) if (q_len, kv_len) != (None, None) else None
    aux = None
    if kv_len is not None:
        # global lengths (spanning and window branches) and each chunk's own (local ones)
        local = jnp.stack([jnp.clip(kv_len - s0, 0, m // C) for s0 in starts], axis=1)
        aux = (kv_len, local.reshape(b * C))
    out, _ = attend_branches(q, k, v, ops, mode, out_dtype=q.dtype, aux=aux)
    if q_len is not None:
        # Rows past q_len: 0, and (cotangent 0) no gradient from them.
        pos = jnp.concatenate([s0 + jnp.arange(m // C) for s0 in starts])  # (m,)
        out = jnp.where((pos[None] < q_len[:, None])[..., None, None], out, 0)
    return out


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
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window: int | None = None,
) -> jax.Array:
    """Sequence-parallel dilated attention over ``mesh`` (global view; builds the shard_map).

    Args:
      q: ``(b, n, h, d)``; k, v: ``(b, n, hk, d)`` in natural position order.
      mesh: a ``jax.sharding.Mesh``; the sequence is sharded over ``seq_axis`` (``P`` devices,
        ``n % P == 0``) and, optionally, the batch over ``batch_axis``.
      layout: ``"contiguous"`` or ``"zigzag"``. With ``"zigzag"`` the shards are permuted to the
        zigzag layout with point-to-point transfers inside the shard_map (``n % 2P == 0``) and
        the output is permuted back, so the caller always sees natural order.
      query_seq_lengths, key_value_seq_lengths: optional int ``(b,)`` valid lengths (sharded
        over ``batch_axis`` with the batch); local_window: optional ``W <= n/P`` (``n/(2P)``
        with zigzag).
      Other arguments: as in :func:`dilax.dilated_attention`.

    Returns:
      ``(b, n, h, d)`` in ``q.dtype``, sharded like ``q``; equal to
      ``dilated_attention(q, k, v, ...)``.

    Raises:
      TypeError: ``mesh`` is not a ``Mesh``; dtypes or non-static config as in
        :func:`dilax.dilated_attention`.
      ValueError: ``seq_axis``/``batch_axis`` not mesh axes or equal, ``n % P != 0``,
        ``layout="zigzag"`` with ``n % 2P != 0``, batch not divisible by the ``batch_axis``
        size, ``local_window`` longer than a local chunk, and every input error of
        :func:`dilax.dilated_attention`.
    """
    q, k, v = V.check_qkv(q, k, v)
    layout = check_layout(layout)
    check_mesh(mesh, seq_axis, batch_axis)
    P = check_sharded_shape(q, mesh, seq_axis, batch_axis)
    n = q.shape[1]
    if layout == "zigzag" and P > 1 and n % (2 * P):
        raise ValueError(
            f"layout='zigzag' needs seq_len n={n} divisible by 2 * {P} (twice the size of mesh "
            f"axis {seq_axis!r})"
        )
    ws, rs, mode, is_causal, scale, block_sizes = V.check_dilated_call(
        q, segment_lengths, dilation_rates, mode, is_causal, scale, block_sizes)
    window = V.check_local_window(local_window, mode)
    b = q.shape[0]
    q_len = V.check_seq_lengths(query_seq_lengths, "query_seq_lengths", b, n)
    kv_len = V.check_seq_lengths(key_value_seq_lengths, "key_value_seq_lengths", b, n)
    mc = n // P // (2 if layout == "zigzag" and P > 1 else 1)
    if window is not None and window > mc:
        raise ValueError(f"local_window={window} must be at most the local chunk length {mc} "
                         f"(n/P{'/2 with layout=zigzag' if mc != n // P else ''}) on the ring")
    return _sharded_jit(q, k, v, q_len, kv_len, ws, rs, mesh, seq_axis, batch_axis, is_causal,
                        mode, scale, layout, block_sizes, window)


# One compiled program per static configuration (cached across eager calls, and bitwise the
# same result as a call under the caller's jax.jit).
@functools.partial(jax.jit, static_argnums=tuple(range(5, 16)))
def _sharded_jit(q, k, v, q_len, kv_len, segment_lengths, dilation_rates, mesh, seq_axis,
                 batch_axis, is_causal, mode, scale, layout, block_sizes, window):
    P = mesh.shape[seq_axis]
    zigzag = layout == "zigzag" and P > 1

    def body(q, k, v, q_len=None, kv_len=None):
        if zigzag:
            q, k, v = (relayout(x, P, seq_axis, True) for x in (q, k, v))
        out = ring_dilated_attention(
            q, k, v, segment_lengths, dilation_rates, axis_name=seq_axis, is_causal=is_causal,
            mode=mode, scale=scale, layout=layout, block_sizes=block_sizes,
            query_seq_lengths=q_len, key_value_seq_lengths=kv_len, local_window=window,
        )
        return relayout(out, P, seq_axis, False) if zigzag else out

    return shard_sequence(body, mesh, seq_axis, batch_axis, q, k, v, q_len, kv_len)
