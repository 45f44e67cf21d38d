"""The ring regime of a dilated branch: segments that span several devices.

Each device dilates its own K/V first (keeps the ``1/r`` of its rows that the head's offset
selects, :mod:`dilax.dilated.ring_dilate`), then those dilated chunks travel between the
devices that share segments (:mod:`dilax.sp.schedule` streams) with ``lax.ppermute`` while every
device folds them into the float32 online-softmax state of its queries with
the ring's core (``RingConfig.core``, chosen by :mod:`dilax.registry` for a ``"ring_hop"``:
the XLA core's ``forward``/``backward`` or the Pallas flash kernels, each hop's traced
query/key offsets and the ring's key bounds as its mask) and
:func:`dilax.core.merge_attention_states`. Chunks
entirely in the future (causal) or in another segment are skipped with ``lax.cond``.
Communication per device is ``O(w / r)`` rows per branch, independent of ``n``.

The backward pass (:func:`ring_backward`, called from the one custom_vjp of all branches,
:func:`dilax.branch.runner.attend_branches`) is a second ring that sends K, V and the dK, dV
accumulators, so it also keeps ``O(n / P)`` memory per device. The hops run in a
``lax.fori_loop`` whose body sends the next chunk while it computes the current one: one chunk
in use and one in flight per device. Every pair's gradients are added by the core into the
running float32 dQ and travelling dK, dV in place (no per-pair gradient buffers), and the own
chunk is visited last, straight into the returned dK, dV. With a regular geometry and one
chunk per device (:func:`ring_backward_in_place`) the queries are not even copied: the core
reads them (and adds dQ) in place through a :class:`~dilax.core.view.SplitView`, as the
single-device branches do; only K and V, which travel, are dilated copies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dilax.branch.plan import BranchPlan, slot_layout, slot_view, unslot
from dilax.core import (
    XLA,
    BlockSizes,
    Core,
    KeyBounds,
    Mask,
    identity_view,
    merge_attention_states,
)
from dilax.core.arrays import dynamic_slice_in_dim, dynamic_update_slice_in_dim, varying_like
from dilax.core.view import SplitView
from dilax.sp.layout import lookup
from dilax.sp.schedule import Geometry, Stream

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class RingConfig:
    """Static configuration of one spanning branch on the ring (hashable: a custom_vjp
    non-differentiable argument)."""

    axis_name: Hashable
    geo: Geometry
    n_u: tuple[int, ...]  # dilated length of each virtual kv head's offset
    streams: tuple[Stream, ...]
    scale: float
    is_causal: bool
    block_sizes: BlockSizes | None  # forward (block_q, block_k) and backward (.backward)
    dilate: Callable  # local shards (q, k, v) -> dilated chunks (qd, kd, vd)
    core: Core = XLA  # runs every hop (forward and backward)

    @property
    def single_segment(self) -> bool:
        """Every chunk lies inside one segment (aligned case): one candidate, no key shift."""
        return all(s is None or s[0] == s[1] for s in map(self.geo.segments, range(self.geo.V)))


def _shift_rows(x, lo):
    """Rows ``[lo, lo + R)`` of ``x: (b, R, ...)`` (zeros past the end)."""
    R = x.shape[1]
    widths = [(0, 0), (0, R)] + [(0, 0)] * (x.ndim - 2)
    return dynamic_slice_in_dim(jnp.pad(x, widths), lo, R, axis=1)


def _unshift_rows(x, lo):
    """Inverse of :func:`_shift_rows` for gradients: row ``t`` goes back to ``lo + t``."""
    R = x.shape[1]
    buf = jnp.zeros((x.shape[0], 2 * R, *x.shape[2:]), x.dtype)
    return dynamic_update_slice_in_dim(buf, x, lo, axis=1)[:, :R]


def _candidates(cfg: RingConfig, Fq, cq, Fk, ck, ok, R, n_u=None):
    """Per candidate segment of the ``R`` query rows starting at dilated index ``Fq`` (``cq`` of
    them valid): (key shift or None, kv_len (U,) or (b, U), run?, row mask). ``n_u``: valid
    dilated rows per virtual kv head, ``(b, U)`` with valid key lengths, default ``cfg.n_u``."""
    L = cfg.geo.L
    n_u = jnp.asarray(cfg.n_u, jnp.int32) if n_u is None else n_u
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


def _pair_forward(cfg: RingConfig, q, k, v, Fq, cq, Fk, ck, ok, n_u=None):
    """Attention of one query chunk ``q: (b, R, U, G, d)`` to one key chunk ``k (b, R, U, d)``,
    ``v (b, R, U, dv)``: (out f32 ``(b, R, U, G, dv)``, lse)."""
    b, R, U, G, d = q.shape
    o_shape = q.shape[:-1] + v.shape[-1:]  # the values' head dim (dv may differ from d)
    results = []
    for lo, kv_len, pred, rows in _candidates(cfg, Fq, cq, Fk, ck, ok, R, n_u):
        ks = k if lo is None else _shift_rows(k, lo)
        vs = v if lo is None else _shift_rows(v, lo)
        k_off = Fk if lo is None else Fk + lo
        kv_len_b = jnp.broadcast_to(kv_len, (b, U))

        def run(ops, kv_len_b=kv_len_b, k_off=k_off):
            qq, kk, vv = ops
            o, lse = cfg.core.forward(qq.reshape(b, R, U * G, d), kk, vv,
                                      view=identity_view(U, G),
                                      mask=Mask(KeyBounds(kv_len_b, Fq, k_off, cfg.is_causal)),
                                      scale=cfg.scale, block_sizes=cfg.block_sizes,
                                      out_dtype=_F32)
            return o.reshape(o_shape), lse.reshape(q.shape[:-1])

        def skip(ops):
            return (varying_like(jnp.zeros(o_shape, _F32), *ops),
                    varying_like(jnp.full(ops[0].shape[:-1], -jnp.inf, _F32), *ops))

        results.append((lax.cond(pred, run, skip, (q, ks, vs)), rows))
    (out, lse), _ = results[0]
    for (o, lse_c), rows in results[1:]:
        sel = rows[None, :, None, None]
        out = jnp.where(sel[..., None], o, out)
        lse = jnp.where(sel, lse_c, lse)
    return out, lse


def _pair_backward(cfg: RingConfig, view, q, k, v, lse, dout, delta, Fq, cq, Fk, ck, ok, acc,
                   n_u=None):
    """Adds the gradients of one (query chunk, key chunk) pair into ``acc = (dq, dk, dv)``
    (float32, the shapes of ``q, k, v``) and returns it. ``q`` (and ``dq``) are read through
    ``view`` (the core's flat heads ``(b, R, U * G, d)``, or the shard's slot layout), ``dout,
    lse, delta`` in its output layout; ``k, v (b, R, U, d)``. The core adds into ``acc`` in
    place (no gradient buffers of the pair's own; with shifted keys only the chunk-sized dK,
    dV of the shift); a skipped pair returns it as is."""
    b, R, U = k.shape[:3]
    for lo, kv_len, pred, rows in _candidates(cfg, Fq, cq, Fk, ck, ok, R, n_u):
        ks = k if lo is None else _shift_rows(k, lo)
        vs = v if lo is None else _shift_rows(v, lo)
        k_off = Fk if lo is None else Fk + lo
        # Rows of another segment: lse = +inf makes their probabilities exactly 0.
        lse_c = lse if rows is None else jnp.where(rows[None, :, None], lse, jnp.inf)
        kv_len_b = jnp.broadcast_to(kv_len, (b, U))

        def grads(ops, kv_len_b=kv_len_b, k_off=k_off):
            qq, kk, vv, ll, do, dd, *into = ops
            return cfg.core.backward(qq, kk, vv, view=view,
                                     mask=Mask(KeyBounds(kv_len_b, Fq, k_off, cfg.is_causal)),
                                     scale=cfg.scale, lse=ll, dout=do, delta=dd,
                                     block_sizes=cfg.block_sizes, grad_dtype=_F32,
                                     acc=tuple(into))

        if lo is None:
            into = acc
        else:  # the shifted keys' gradients are shifted back before they are added
            into = (acc[0],) + tuple(varying_like(jnp.zeros(x.shape, _F32), x, acc[0])
                                     for x in (ks, vs))
        out = lax.cond(pred, grads, lambda ops: tuple(ops[6:]),
                       (q, ks, vs, lse_c, dout, delta, *into))
        acc = out if lo is None else (out[0], acc[1] + _unshift_rows(out[1], lo),
                                      acc[2] + _unshift_rows(out[2], lo))
    return acc


_ROW_CHUNK = 256
# Block pair of the spanning branches: per-device memory is the point of the ring, so the score
# tiles stay small next to a shard (a few % slower on CPU than default_block_sizes' tiles).
RING_BLOCKS = BlockSizes(128, 128, 128, 128)
# The backward ring's (query, key) blocks: next to its score tiles it holds K/V in use and in
# flight, the travelling dK/dV and dO, so its tiles are smaller (1.6 MiB less per device at
# n = 16384, P = 8; ``python -m benchmarks ring``).
RING_BACKWARD_BLOCKS = (64, 64)


def row_chunk(R: int) -> int:
    """Query rows per folding step: the partial result of one hop is ``(rows, U, G, d)``
    float32 and is merged into the state in place, so it stays small next to the shard."""
    if R <= _ROW_CHUNK:
        return R
    best = max(c for c in range(1, _ROW_CHUNK + 1) if R % c == 0)
    return best if best >= _ROW_CHUNK // 4 else R


def _fold_pair(cfg: RingConfig, q, k, v, Fq, cq, Fk, ck, ok, state, n_u=None):
    """Merges the attention of queries ``q: (b, R, U, G, d)`` to one key chunk into ``state``
    (float32 ``out``, ``lse``), a chunk of query rows at a time."""
    out, lse = state
    R = q.shape[1]
    rc = row_chunk(R)
    if rc == R:
        return merge_attention_states(out, lse, *_pair_forward(cfg, q, k, v, Fq, cq, Fk, ck, ok,
                                                                    n_u))

    def body(i, carry):
        out, lse = carry
        s = i * rc
        rows = lambda x: dynamic_slice_in_dim(x, s, rc, axis=1)
        o, l = _pair_forward(cfg, rows(q), k, v, Fq + s, jnp.clip(cq - s, 0, rc), Fk, ck, ok,
                             n_u)
        o, l = merge_attention_states(rows(out), rows(lse), o, l)
        return (dynamic_update_slice_in_dim(out, o, s, axis=1),
                dynamic_update_slice_in_dim(lse, l, s, axis=1))

    return lax.fori_loop(0, R // rc, body, (out, lse))


def _tables(cfg: RingConfig):
    """Per-chunk dilated starts and counts (static tables), this device's index, and its
    query chunks' starts ``Fq`` and counts ``cq``."""
    geo = cfg.geo
    F_t, cnt_t = geo.table(geo.F[:-1]), geo.table(geo.cnt)
    idx = lax.axis_index(cfg.axis_name)
    return (F_t, cnt_t, idx, [lookup(F_t[c], idx) for c in range(geo.C)],
            [lookup(cnt_t[c], idx) for c in range(geo.C)])


def stream_loop(st: Stream, idx, step, carry, transfer):
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


def _ring_forward(qd, kd, vd, cfg: RingConfig, n_u=None):
    C = cfg.geo.C
    F_t, cnt_t, idx, Fq, cq = _tables(cfg)

    def visit(state, kb, vb, src):
        ok = src >= 0
        j = jnp.maximum(src, 0)
        state = list(state)
        for cp in range(C):
            Fk, ck = lookup(F_t[cp], j), lookup(cnt_t[cp], j)
            for c in range(C):
                state[c] = _fold_pair(cfg, qd[:, c], kb[:, cp], vb[:, cp], Fq[c], cq[c], Fk, ck,
                                      ok, state[c], n_u)
        return tuple(state)

    b, _, R, U, G, _ = qd.shape
    state = ((varying_like(jnp.zeros((b, R, U, G, vd.shape[-1]), _F32), qd, kd),
              varying_like(jnp.full((b, R, U, G), -jnp.inf, _F32), qd, kd)),) * C
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


def _ring_backward(cfg: RingConfig, kd, vd, qside, n_u=None):
    """The backward ring over the dilated K/V chunks ``kd (b, C, R, U, d)``, ``vd (b, C, R, U,
    dv)``. ``qside =
    (view, qs, ls, dos, des, dq)``: per local chunk (tuples of ``C``) the queries, lse, dout,
    delta and the float32 dq accumulator, read through ``view`` (:func:`_pair_backward`).
    Returns the tuples ``(dq, dk, dv)``, dk and dv float32 ``(b, R, U, d or dv)`` per chunk."""
    C = cfg.geo.C
    F_t, cnt_t, idx, Fq, cq = _tables(cfg)
    view, qs, ls, dos, des, dq = qside

    def visit(acc, kb, vb, src):
        """Adds the gradients of this device's queries to the visiting block ``kb, vb``
        (tuples of ``C`` chunks) into ``acc = (dq, dk, dv)`` (tuples of ``C`` chunks)."""
        ok = src >= 0
        j = jnp.maximum(src, 0)
        dq, dk, dv = (list(a) for a in acc)
        for cp in range(C):
            Fk, ck = lookup(F_t[cp], j), lookup(cnt_t[cp], j)
            for c in range(C):
                # One pass over all query rows: row chunks (as in the forward) would need
                # extra dK/dV accumulators, which cost more than the per-hop dQ they save.
                dq[c], dk[cp], dv[cp] = _pair_backward(
                    cfg, view, qs[c], kb[cp], vb[cp], ls[c], dos[c], des[c], Fq[c], cq[c], Fk,
                    ck, ok, (dq[c], dk[cp], dv[cp]), n_u)
        return tuple(dq), tuple(dk), tuple(dv)

    kc, vc = tuple(kd[:, c] for c in range(C)), tuple(vd[:, c] for c in range(C))
    zeros = lambda x: tuple(varying_like(jnp.zeros(y.shape, _F32), y, dq[0]) for y in x)
    dq, dk, dv = backward_streams(cfg.streams, cfg.axis_name, idx, visit, kc, vc, dq, zeros)
    # The own block last: its gradients go straight into the returned accumulators, which
    # are not held next to the travelling ones.
    return visit((dq, dk, dv), kc, vc, idx)


def backward_streams(streams, axis_name, idx, visit, kc, vc, dq, zeros):
    """The hops of a backward ring (both rings): along every stream the K/V blocks ``kc, vc``
    (pytrees) travel with their float32 dK/dV accumulators (``zeros(kc)``, ``zeros(vc)``),
    and ``visit((dq, dk, dv), kb, vb, src)`` adds this device's gradients for the visiting
    block of device ``src`` (-1: none needed) into them. Returns ``(dq, dk, dv)``, dK/dV back
    at their owners and summed over the streams; the own block is not visited."""
    dk = dv = None
    for st in streams:
        def transfer(carry, first, st=st):
            kb, vb, dkb, dvb, dq = carry
            kb, vb = (lax.ppermute(x, axis_name, st.perm) for x in (kb, vb))
            if not first:  # dK/dV accumulators travel with the block they belong to
                dkb, dvb = (lax.ppermute(x, axis_name, st.perm) for x in (dkb, dvb))
            return kb, vb, dkb, dvb, dq

        def step(carry, src):
            kb, vb, dkb, dvb, dq = carry
            dq, dkb, dvb = visit((dq, dkb, dvb), kb, vb, src)
            return kb, vb, dkb, dvb, dq

        _, _, dkb, dvb, dq = stream_loop(st, idx, step, (kc, vc, zeros(kc), zeros(vc), dq),
                                         transfer)
        dkb, dvb = (lax.ppermute(x, axis_name, st.ret) for x in (dkb, dvb))
        dk, dv = (dkb, dvb) if dk is None else (jax.tree.map(jnp.add, dk, dkb),
                                                jax.tree.map(jnp.add, dv, dvb))
    if dk is None:
        dk, dv = zeros(kc), zeros(vc)
    return dq, dk, dv


def ring_forward(cfg: RingConfig, q, k, v, n_u=None):
    """Ring attention of the local shards ``q, k, v`` in the dilated layout of ``cfg.dilate``:
    ``out (b, C, R, U, G, dv)`` float32 and ``lse (b, C, R, U, G)``. ``n_u``: optional int
    ``(b, U)`` valid dilated rows per batch row and virtual kv head (valid key lengths),
    at most ``cfg.n_u``."""
    return _ring_forward(*cfg.dilate(q, k, v), cfg, n_u)


def ring_backward(cfg: RingConfig, q, k, v, lse, dout, delta, n_u=None):
    """Float32 gradients of the local shards from the cotangent ``dout`` of the dilated
    output and ``delta = rowsum(dout * out) - dlse`` (layout of :func:`ring_forward`). The
    dilated copies are recomputed; the dilated gradients go back through the transpose of
    the (linear) dilation, in float32."""
    # Only the transpose of this vjp is used: XLA drops its (float32) forward.
    _, undilate = jax.vjp(cfg.dilate, *(x.astype(_F32) for x in (q, k, v)))
    qd, kd, vd = cfg.dilate(q, k, v)
    b, C, R, U, G, d = qd.shape
    # The query side with the core's flat heads, carried as is through the hops.
    flat = lambda x: tuple(x[:, c].reshape(b, R, U * G, *x.shape[5:]) for c in range(C))
    dq0 = tuple(varying_like(jnp.zeros((b, R, U * G, d), _F32), qd, kd, dout)
                for _ in range(C))
    qside = (identity_view(U, G), flat(qd), flat(lse), flat(dout), flat(delta), dq0)
    dq, dk, dv = _ring_backward(cfg, kd, vd, qside, n_u)
    dq = tuple(x.reshape(b, R, U, G, d) for x in dq)
    return undilate(tuple(jnp.stack(x, axis=1) for x in (dq, dk, dv)))


def ring_backward_in_place(cfg: RingConfig, q, k, v, lse, dout, delta, n_u, acc,
                           rows_plan: BranchPlan):
    """:func:`ring_backward` for a regular geometry with one chunk per device, reading the
    queries in place and adding into ``acc``, as the single-device branches do: ``q (b, m,
    h, d)`` through the :class:`~dilax.core.SlotView` of ``rows_plan`` (the branch's dilated
    rows of the shard), ``lse, dout, delta`` in that plan's output layout ``(b, R, H', ...)``,
    dq added into ``acc[0]`` (float32 ``(b, m, h, d)``, or None) in place; only K and V are
    dilated copies (they travel). Returns float32 ``(dq, dk, dv)`` of the shards' shapes,
    ``acc`` added."""
    b, m, h, d = q.shape
    _, undilate = jax.vjp(lambda k, v: cfg.dilate(q, k, v)[1:],
                          *(x.astype(_F32) for x in (k, v)))
    kd, vd = cfg.dilate(q, k, v)[1:]
    U = kd.shape[3]
    view = SplitView(slot_view(rows_plan, h, k.shape[2]),
                     identity_view(U, len(rows_plan.q_heads) // U))
    if acc is None:
        acc = tuple(varying_like(jnp.zeros(x.shape, _F32), q, k, dout) for x in (q, k, v))
    dq0 = slot_layout(acc[0], rows_plan)
    dq, dk, dv = _ring_backward(cfg, kd, vd, (view, (slot_layout(q, rows_plan),), (lse,),
                                              (dout,), (delta,), (dq0,)), n_u)
    gk, gv = undilate(tuple(jnp.stack(x, axis=1) for x in (dk, dv)))
    return unslot(dq[0], rows_plan, m), acc[1] + gk, acc[2] + gv
