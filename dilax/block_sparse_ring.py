"""Sequence-parallel block-sparse attention: K/V blocks travel around a ring of devices.

The sequence axis is split over the ``P`` devices of a mesh axis, device ``r`` holding the
``n / P`` consecutive positions ``[r n/P, (r+1) n/P)`` of q, k and v (docs/semantics.md, "Ring
attention"). At
ring step ``s`` device ``r`` holds the K/V chunk of device ``(r - s) mod P`` (``lax.ppermute``
to the right neighbour between steps) and folds the active key blocks of that chunk into its
queries' softmax state: the same gather + :func:`dilax.core.attention_core` as the
single-device path, merged with :func:`dilax.core.merge_attention_states`.

What is skipped: the pattern is static, so for every (device, chunk offset) the tables of
active key blocks are known at trace time. K/V travel in two directions: a right-going stream
brings device ``r`` the chunk of ``r - s`` at step ``s`` and a left-going stream the chunk of
``r + s``; the plan picks how far each stream goes so that every needed chunk offset is covered
with the fewest ``ppermute`` steps (a local window needs one step each way, whatever ``P``).
Offsets no device needs are never computed, and a device with no active block at a step that
others need skips its compute with ``lax.cond``. With ``is_causal`` device ``r`` needs chunks
``r, r-1, ..., 0`` only (the diagonal blocks live in its own chunk); the layout is the plain
contiguous one (no zigzag), so causal work is unbalanced across devices.

Per-device memory is O(n / P): one K/V chunk in flight plus the gathered active blocks of the
local query blocks. The backward pass is JAX's transpose of the ring (ppermute in reverse).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from dilax import _validation as V
from dilax.block_sparse import _head_layout, check_pattern, sparse_attention_tables
from dilax.core import merge_attention_states
from dilax.patterns import BlockSparsePattern, mask_tables


@dataclasses.dataclass(frozen=True, eq=False)
class _RingStep:
    idx: np.ndarray  # (P, Ui, nq_l, A) int32, local key-block indices in the visiting chunk
    kv_len: np.ndarray  # (P, Ui, nq_l) int32
    diag_len: np.ndarray | None  # (P, Ui, nq_l) int32 (step 0, causal) or None
    gather: bool  # any gathered key at this step
    active: np.ndarray  # (P,) bool: device has any work at this step


@dataclasses.dataclass(frozen=True, eq=False)
class _RingPlan:
    U: int
    G: int
    kvmap: tuple[int, ...]
    steps: dict[int, _RingStep]  # by chunk offset delta = (r - src) mod P; only needed ones
    right: int  # steps of the right-going stream (covers offsets 1..right)
    left: int  # steps of the left-going stream (covers offsets P-left..P-1)


@functools.lru_cache(maxsize=64)
def plan_ring(pattern: BlockSparsePattern, num_devices: int, h: int, hk: int,
              is_causal: bool) -> _RingPlan:
    """Static per-(device, step) tables of ``pattern`` on a ring of ``num_devices``."""
    U, G, kvmap, m = _head_layout(pattern.block_mask, h, hk)
    P = num_devices
    nq_l = pattern.num_q_blocks // P
    rows = np.arange(nq_l)
    steps = {}
    for s in range(P):
        subs, diags = [], []
        for r in range(P):
            src = (r - s) % P
            sub = m[:, r * nq_l:(r + 1) * nq_l, src * nq_l:(src + 1) * nq_l]
            if is_causal and src > r:
                sub = np.zeros_like(sub)
            if is_causal and s == 0:
                diags.append(sub[:, rows, rows] * pattern.block_size)
                sub = sub & (rows[None, :] < rows[:, None])[None]
            subs.append(sub)
        idx, cnt = mask_tables(np.stack(subs))  # (P, Ui, nq_l, A), (P, Ui, nq_l)
        kv_len = (cnt * pattern.block_size).astype(np.int32)
        diag_len = np.stack(diags).astype(np.int32) if diags else None
        active = kv_len.reshape(P, -1).any(axis=1)
        if diag_len is not None:
            active = active | diag_len.reshape(P, -1).any(axis=1)
        if active.any():
            steps[s] = _RingStep(idx, kv_len, diag_len, bool(kv_len.any()), active)
    needed = [delta for delta in steps if delta > 0]
    best = None
    for t in range(P):  # right stream covers offsets <= t, left stream the others
        right = max([delta for delta in needed if delta <= t], default=0)
        left = max([P - delta for delta in needed if delta > t], default=0)
        key = (right + left, max(right, left))
        if best is None or key < best[0]:
            best = (key, right, left)
    return _RingPlan(U, G, kvmap, steps, best[1], best[2])


def _axis_size(axis_name: str) -> int:
    try:
        return int(lax.axis_size(axis_name))
    except NameError as e:
        raise ValueError(
            f"axis_name={axis_name!r} is not a bound mesh axis: call "
            "ring_block_sparse_attention inside jax.shard_map over that axis (or use "
            "sharded_block_sparse_attention)"
        ) from e


def ring_block_sparse_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    pattern: BlockSparsePattern,
    *,
    axis_name: str,
    is_causal: bool = False,
    scale: float | None = None,
) -> jax.Array:
    """Block-sparse attention with the sequence sharded over ``axis_name`` (inside shard_map).

    Args:
      q: local ``(b, n/P, h, d)`` shard; k, v: local ``(b, n/P, hk, d)`` shards; device ``r``
        of the axis holds positions ``[r n/P, (r+1) n/P)``.
      pattern: the pattern of the *full* sequence (``n / B`` blocks; ``n/P`` must be a
        multiple of ``pattern.block_size``).
      axis_name: the mesh axis the sequence is split over.
      is_causal, scale: as in :func:`dilax.block_sparse_attention`.

    Returns:
      the local ``(b, n/P, h, d)`` shard of ``block_sparse_attention(q, k, v, pattern, ...)``.
    """
    q, k, v = V.check_qkv(q, k, v)
    is_causal = V.check_bool(is_causal, "is_causal")
    scale = V.check_scale(scale, q.shape[3])
    if not isinstance(axis_name, str):
        raise TypeError(f"axis_name must be a mesh axis name (str), got {axis_name!r}")
    P = _axis_size(axis_name)
    b, n_l, h, d = q.shape
    if not isinstance(pattern, BlockSparsePattern):
        check_pattern(pattern, q)  # raises the TypeError
    bs = pattern.block_size
    if n_l % bs != 0:
        raise ValueError(
            f"each device's sequence shard (n/P = {n_l}) must be a multiple of the pattern's "
            f"block_size {bs} for ring block-sparse attention"
        )
    check_pattern(pattern, jax.ShapeDtypeStruct((b, n_l * P, h, d), q.dtype))
    plan = plan_ring(pattern, P, h, k.shape[2], is_causal)
    r = lax.axis_index(axis_name)
    to_right = [(i, (i + 1) % P) for i in range(P)]
    to_left = [(i, (i - 1) % P) for i in range(P)]
    fn = functools.partial(sparse_attention_tables, block_size=bs, U=plan.U, G=plan.G,
                           kvmap=plan.kvmap, scale=scale)

    def fold(state, delta, kc, vc):
        step = plan.steps.get(delta)
        if step is None:
            return state
        idx = jnp.asarray(step.idx)[r][None] if step.gather else None
        kv_len = jnp.asarray(step.kv_len)[r][None] if step.gather else None
        diag = None if step.diag_len is None else jnp.asarray(step.diag_len)[r][None]

        def compute(q, kc, vc):
            return fn(q, kc, vc, idx, kv_len, diag)

        def skip(q, kc, vc):
            zero = 0.0 * q.astype(jnp.float32)
            return zero, jnp.full(q.shape[:3], -jnp.inf, jnp.float32) + zero[..., 0]

        if step.active.all():
            o_s, l_s = compute(q, kc, vc)
        else:
            o_s, l_s = lax.cond(jnp.asarray(step.active)[r], compute, skip, q, kc, vc)
        return merge_attention_states(*state, o_s, l_s)

    zero = 0.0 * q.astype(jnp.float32)  # carries q's device-varying type
    state = (zero, jnp.full((b, n_l, h), -jnp.inf, jnp.float32) + zero[..., 0])
    state = fold(state, 0, k, v)
    kr, vr, kl, vl = k, v, k, v
    for s in range(1, max(plan.right, plan.left) + 1):
        if s <= plan.right:
            kr, vr = lax.ppermute((kr, vr), axis_name, to_right)
            state = fold(state, s, kr, vr)
        if s <= plan.left:
            kl, vl = lax.ppermute((kl, vl), axis_name, to_left)
            state = fold(state, P - s, kl, vl)
    out = state[0]
    return out.astype(q.dtype)


def sharded_block_sparse_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    pattern: BlockSparsePattern,
    *,
    mesh: Mesh,
    seq_axis: str = "sp",
    batch_axis: str | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> jax.Array:
    """:func:`ring_block_sparse_attention` from outside: builds the ``jax.shard_map``.

    Args:
      q, k, v: global ``(b, n, h, d)`` / ``(b, n, hk, d)`` arrays.
      pattern: pattern of the full sequence.
      mesh: a ``jax.sharding.Mesh``; the sequence is split over ``seq_axis`` (``n`` must be
        divisible by its size ``P``, and ``n / P`` by ``pattern.block_size``), the batch
        optionally over ``batch_axis``.
    Returns:
      ``(b, n, h, d)``, equal to :func:`dilax.block_sparse_attention` on the same inputs.
    """
    q, k, v = V.check_qkv(q, k, v)
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    for name, axis in (("seq_axis", seq_axis), ("batch_axis", batch_axis)):
        if axis is not None and axis not in mesh.axis_names:
            raise ValueError(f"{name}={axis!r} is not an axis of the mesh {mesh.axis_names}")
    if seq_axis is None:
        raise ValueError("seq_axis must name a mesh axis, got None")
    P = mesh.shape[seq_axis]
    b, n = q.shape[:2]
    if n % P != 0:
        raise ValueError(
            f"seq_len n={n} must be divisible by the size {P} of mesh axis {seq_axis!r}"
        )
    if batch_axis is not None and b % mesh.shape[batch_axis] != 0:
        raise ValueError(
            f"batch size {b} must be divisible by the size {mesh.shape[batch_axis]} of mesh "
            f"axis {batch_axis!r}"
        )
    check_pattern(pattern, q)
    spec = PartitionSpec(batch_axis, seq_axis, None, None)
    fn = functools.partial(ring_block_sparse_attention, pattern=pattern, axis_name=seq_axis,
                           is_causal=is_causal, scale=scale)
    # check_vma=False: dilax.core builds its loop carries unvarying (see module docstring).
    return jax.shard_map(fn, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec,
                         check_vma=False)(q, k, v)
