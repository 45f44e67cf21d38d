"""Dilation of a local shard into the uniform dilated chunk layout of a branch, and back.

In every branch ``(w, r)`` the selected positions of head offset ``o`` form a dilated sequence
``t -> o + r t``. Chunk ``v`` of ``n / V`` positions owns the dilated indices ``[F_v, F_{v+1})``
(:class:`dilax.sp.schedule.Geometry`), the same for all heads. When ``r`` divides the chunk
length this is just the chunk's own selected rows; otherwise a few boundary rows are fetched
from the left neighbour and the outputs sent back (a halo of ``< r`` positions), which keeps
every other step uniform across heads.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from dilax.branch.plan import BranchPlan, merge_slots, split_slots
from dilax.core.arrays import dynamic_slice_in_dim, dynamic_update_slice_in_dim
from dilax.sp.layout import lookup, vshift
from dilax.sp.schedule import Geometry


def _ctx_rows(geo: Geometry) -> int:
    """Rows of left context (positions before the chunk) the irregular dilation touches."""
    return geo.r if geo.r <= geo.mc else -(-geo.r // geo.mc) * geo.mc


def _chunk_phase(geo: Geometry, idx) -> list[jax.Array]:
    """Per local chunk: ``c_v = v mc - r F_v`` (positions of the chunk before ``r F_v``)."""
    phase = [geo.mc * v - geo.r * geo.F[v] for v in range(geo.V)]
    return [lookup(t, idx) for t in geo.table(phase)]


def dilate(x: jax.Array, plan: BranchPlan, heads, slots, geo: Geometry, axis_name):
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
            ctx = vshift(xc[:, :, mc - lc:], 1, geo.P, C, axis_name)
        else:
            ctx = jnp.concatenate(
                [vshift(xc, kk, geo.P, C, axis_name) for kk in range(lc // mc, 0, -1)], axis=2
            )
        pad = jnp.zeros((b, C, max(mc, R * r), H, d), x.dtype)
        ext = jnp.concatenate([ctx, xc, pad], axis=2)  # row e <-> position v*mc - lc + e
        phase = _chunk_phase(geo, idx)
        xs = jnp.stack(
            [dynamic_slice_in_dim(ext[:, c], lc - phase[c], R * r, axis=1) for c in range(C)],
            axis=1,
        ).reshape(b * C, R * r, H, d)
    return split_slots(xs, loc, heads, slots, R * r).reshape(b, C, R, len(heads), d)


def undilate(y: jax.Array, plan: BranchPlan, geo: Geometry, axis_name, fill, combine):
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
        [dynamic_update_slice_in_dim(base, z[:, c], lc - phase[c], axis=1) for c in range(C)],
        axis=1,
    )  # row e <-> position v*mc - lc + e
    own = buf[:, :, lc: lc + mc]
    if lc <= mc:
        recv = vshift(buf[:, :, :lc], -1, geo.P, C, axis_name, fill)
        widths = [(0, 0), (0, 0), (mc - lc, 0)] + [(0, 0)] * len(tail)
        return combine(own, jnp.pad(recv, widths, constant_values=fill)).reshape(b, C * mc, *tail)
    for kk in range(1, lc // mc + 1):
        part = buf[:, :, lc - kk * mc: lc - (kk - 1) * mc]
        own = combine(own, vshift(part, -kk, geo.P, C, axis_name, fill))
    return own.reshape(b, C * mc, *tail)


def valid_rows(geo: Geometry, kv_slots, axis_name) -> jax.Array:
    """``(C, R, U)`` bool: dilated row owned by the chunk and inside the sequence for head u."""
    idx = lax.axis_index(axis_name)
    t = jnp.arange(geo.R)
    n_u = jnp.asarray([-(-(geo.n - o) // geo.r) for o in kv_slots], jnp.int32)
    rows = []
    for F_t, cnt_t in zip(geo.table(geo.F[:-1]), geo.table(geo.cnt), strict=True):
        F, cnt = lookup(F_t, idx), lookup(cnt_t, idx)
        rows.append((t < cnt)[:, None] & ((F + t)[:, None] < n_u[None, :]))
    return jnp.stack(rows)
