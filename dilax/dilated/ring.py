"""Ring (sequence-parallel) dilated attention with ``jax.shard_map``.

The sequence axis of ``q, k, v`` is split over the ``P`` devices of a mesh axis. Each branch
``(w, r)`` of the configuration is computed in one of three ways, chosen statically:

* **local** -- every segment lies inside one device's shard (``(n/P) % w == 0``): the
  single-device path (:func:`dilax.branch.runner.attend_branches`) runs on the shard, no
  communication.
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
from the devices holding its neighbouring chunks (:class:`WindowBranch`).

Branches are merged exactly like the single-device function (log-sum-exp weights in
``mode="mixture"``, ``1/G`` in ``mode="grouped"``), so the result equals
:func:`dilax.dilated_attention` on the gathered inputs, forward and backward
(docs/semantics.md, "Ring attention").

Layouts (:mod:`dilax.sp.layout`). ``layout="contiguous"``: device ``i`` holds positions
``[i n/P, (i+1) n/P)``. ``layout="zigzag"`` (causal load balance): the sequence is cut into
``2P`` chunks of ``n/(2P)`` positions and device ``i`` holds chunk ``i`` followed by chunk
``2P-1-i``; see :func:`dilax.sp.zigzag_permutation`. ``dilated_attention(...,
sequence_parallel=SequenceParallel(..., layout="zigzag"))`` converts to and from it for you.

Validation happens once, at the public entry (:func:`dilax.dilated_attention` with
``sequence_parallel=``, or the aliases below); :func:`sharded_dilated` and
:func:`ring_dilated_core` take the validated ``(mask, settings)``.

Cores (:func:`ring_cores`): the local branches, the spanning branches' hops and the window
run on the cores :mod:`dilax.registry` picks for ``settings.implementation`` -- the Pallas
flash kernels on GPU (or with ``interpret=True``), each hop with its traced query/key offsets
and the ring's key bounds as ``kv_len``; the XLA core otherwise, and for the local window (a
band the kernels have no mask for).

Inside your own ``jax.shard_map``: with the XLA core shard_map's default checks
(``check_vma=True``) hold, every loop carry and ``cond`` of the core and the ring is typed as
device-varying; the Pallas kernels' outputs carry no such type, so with them call it under
``check_vma=False`` (the ``sequence_parallel=`` path does that itself).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable

import jax
import jax.numpy as jnp
from jax import lax

from dilax import _validation as V
from dilax import registry
from dilax.attention_mask import AttentionMask, take_attention_mask
from dilax.branch.plan import dilated_branches, window_plan
from dilax.branch.runner import attend_branches
from dilax.core import BlockSizes, Core
from dilax.core.arrays import varying_axes
from dilax.dilated.ring_branches import WindowBranch, branch_op, chunk_starts, is_local
from dilax.dilated.ring_documents import document_core, ring_documents_core
from dilax.dilated.settings import DilatedSettings, check_dilated_request, settings_from_keywords
from dilax.flex.api import core_mods, prepare_mods
from dilax.sp.config import SequenceParallel
from dilax.sp.layout import check_layout, relayout
from dilax.sp.mesh import axis_size, check_sharded_shape, shard_sequence
from dilax.sp.ring_vjp import RING_BLOCKS


def ring_dilated_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_lengths: tuple[int, ...] | list[int] | int | None = None,
    dilation_rates: tuple[int, ...] | list[int] | int | None = None,
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
    settings: DilatedSettings | None = None,
    attention_mask: AttentionMask | None = None,
    segment_ids: jax.Array | None = None,
    mask: AttentionMask | None = None,
    score_mod: Callable | None = None,
    mask_mod: Callable | None = None,
    sinks: jax.Array | None = None,
    logits_soft_cap: float | None = None,
) -> jax.Array:
    """Dilated attention on a sequence sharded over mesh axis ``axis_name`` (per-device view).

    Call inside ``jax.shard_map`` (default checks or ``check_vma=False``) with the sequence
    axis of ``q, k, v`` sharded over ``axis_name``. The result equals
    :func:`dilax.dilated_attention` on the gathered inputs (forward and backward), while each
    device holds only ``O(n / P)`` of the data and sends ``O(w / r)`` rows per spanning
    branch. Outside your own ``shard_map``, use ``dilax.dilated_attention(...,
    sequence_parallel=dilax.SequenceParallel(mesh, seq_axis=...))``.

    Args:
      q: local shard ``(b, n/P, h, d)``.
      k, v: local shards ``(b, n/P, hk, d)``, ``h % hk == 0``; ``v`` may have its own head
        dim ``(b, n/P, hk, dv)`` (the calls then run on the XLA core: the Pallas kernels
        refuse ``dv != d``, :mod:`dilax.registry`).
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
      segment_ids: optional int ``(b, n/P)``: packed documents, this device's shard of the
        global ``(b, n)`` document ids (sharded like ``q``); documents may cross shard
        boundaries. Each document is computed as a sequence of its own, exactly as
        :func:`dilax.dilated_attention` with ``segment_ids`` on the gathered inputs
        (docs/semantics.md, "Packed documents"): the document ring of
        :mod:`dilax.dilated.ring_documents`, on the XLA core, ``layout="contiguous"`` only.
      settings, attention_mask: a :class:`dilax.DilatedSettings` / :class:`dilax.AttentionMask`
        instead of the keywords (as in :func:`dilax.dilated_attention`; lengths are global, its
        ``segment_ids`` the local shard ``(b, n/P)``; build it with
        ``AttentionMask.build(q, ..., seq_len=n)``). Its ``key_padding_mask`` is refused
        (``ValueError``): pass ``key_value_seq_lengths``, or ``segment_ids`` for documents.
      mask: the deprecated spelling of ``attention_mask`` (warns).
        ``settings.implementation`` / ``interpret`` pick the cores (:func:`ring_cores`).
      score_mod, mask_mod, sinks, logits_soft_cap: FlexAttention's options
        (docs/semantics.md, "Custom scores and masks"): ``q_idx``, ``kv_idx`` are GLOBAL row
        positions on every device and ``b`` the local batch row; arrays the mods close over
        must hold what the mods index by global position on every device (e.g. the global
        document ids, replicated), and gradients into closed-over float arrays are summed
        over ``axis_name``. They run on the document ring
        (:mod:`dilax.dilated.ring_documents`, XLA core, ``layout="contiguous"``; the Pallas
        hops refuse them with :mod:`dilax.registry`'s reason).

    Returns:
      The local shard of the output, ``(b, n/P, h, dv)`` in ``q.dtype``.

    Raises:
      ValueError: ``axis_name`` not bound by an enclosing ``shard_map``, a bad ``layout``,
        an implementation that serves no ring hop (or, explicit, not every call; with
        ``segment_ids`` only the XLA core serves), the Pallas
        kernels under ``shard_map(check_vma=True)``, ``key_padding_mask`` (in ``attention_mask``),
        ``segment_ids`` with ``layout="zigzag"``,
        ``layout="zigzag"`` with an odd local length, ``local_window`` longer than a local
        chunk, and every input error of
        :func:`dilax.dilated_attention`. TypeError: as there (dtypes, non-static config).
    """
    settings = settings_from_keywords(
        settings, segment_lengths, dilation_rates, is_causal=is_causal, mode=mode, scale=scale,
        block_sizes=block_sizes, local_window=local_window)
    registry.check_ring_hops(settings.implementation, settings.interpret, dilated=True)
    layout = check_layout(layout)
    P = axis_size(axis_name, "ring_dilated_attention", "dilated_attention")
    mask = take_attention_mask(attention_mask, mask, "ring_dilated_attention")
    q, k, v, mask, settings = check_dilated_request(
        q, k, v, settings, mask, num_shards=P, value_head_dim=True,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        segment_ids=segment_ids)
    _check_ring(q.shape, k.shape[2], mask, settings, P, layout, q.dtype, per_device=True,
                seq_axis=axis_name)
    flex = prepare_mods("ring_dilated_attention", q.shape[0], q.shape[2], P * q.shape[1],
                        P * q.shape[1], score_mod=score_mod, mask_mod=mask_mod, sinks=sinks,
                        logits_soft_cap=logits_soft_cap)
    if mask.segment_ids is not None or flex is not None:  # the whole-mesh call's document ring
        if layout != "contiguous":
            what = "segment_ids" if flex is None else "score_mod / mask_mod / sinks / soft-cap"
            raise ValueError(f"{what} on the ring need layout='contiguous' (the document "
                             f"ring), got {layout!r}")
        flags = None if flex is None else tuple(sorted(flex.request_flags.items()))
        return ring_documents_core(q, k, v, mask.segment_ids, mask, settings,
                                   axis_name=axis_name,
                                   core=document_core(settings, q.dtype, q.shape[3], flags,
                                                      v.shape[3]),
                                   mods=core_mods(flex), sinks=flex and flex.sinks)
    cores = ring_cores(settings, mask, q.dtype, q.shape[3], v.shape[3])
    if not _vma_free(cores) and varying_axes(q, k, v):
        raise ValueError(
            "the ring's hops run the Pallas kernels here, whose outputs carry no device-varying "
            "type: call ring_dilated_attention inside jax.shard_map(..., check_vma=False), or "
            "use implementation='xla'")
    return ring_dilated_core(q, k, v, mask, settings, axis_name=axis_name, layout=layout,
                             cores=cores)


def ring_cores(settings: DilatedSettings, mask: AttentionMask, dtype, head_dim: int,
               value_head_dim: int | None = None) -> tuple[Core, Core, Core | None]:
    """The cores of the ring's calls, as :mod:`dilax.registry` picks them for
    ``settings.implementation``: the local branches' (``"dilated_branch"``), the spanning
    branches' hops (``"ring_hop"``) and the local window's (``"window"``; ``None`` without
    one). ``None`` takes the best core of each (Pallas on GPU, or with ``interpret``; XLA
    otherwise, and for ``value_head_dim`` (``dv``) != ``head_dim``, which the kernels do not
    serve); an explicit name runs every call or raises ``ValueError`` with the reason."""
    lengths = mask.query_seq_lengths is not None or mask.key_value_seq_lengths is not None
    ops = ("dilated_branch", "ring_hop") + (("window",) if settings.local_window is not None
                                            else ())
    cores, _ = registry.choose_branch_cores(settings.implementation, [registry.CoreRequest(
        op, dtype, head_dim, settings.is_causal, has_lengths=lengths,
        interpret=settings.interpret, value_head_dim=value_head_dim) for op in ops])
    return cores if len(cores) == 3 else (*cores, None)


def _vma_free(cores) -> bool:
    """Whether every core types its results as device-varying under ``shard_map`` (the XLA
    core does; the Pallas kernels' outputs are untyped, so they need ``check_vma=False``)."""
    return all(c is None or c.name == "xla" for c in cores)


def _check_ring(shape, hk: int, mask: AttentionMask, settings: DilatedSettings, P: int,
                layout: str, dtype, *, per_device: bool, seq_axis: Hashable) -> None:
    """The ring's own rules on validated arguments; ``shape``: the per-device ``(b, n/P, h,
    d)`` of q (``per_device``) or its global one; ``hk``: key/value heads."""
    if mask.key_padding_mask is not None:
        raise ValueError("key_padding_mask is not supported with sequence parallelism; pass "
                         "key_value_seq_lengths (valid lengths) instead")
    b, m, h, d = shape
    C = 2 if layout == "zigzag" and P > 1 else 1
    if per_device and m % C:
        raise ValueError(
            f"layout='zigzag' splits each shard into two chunks and needs an even local "
            f"seq_len, got n/P={m} on mesh axis {seq_axis!r}"
        )
    if not per_device:
        n = m
        if C == 2 and n % (2 * P):
            raise ValueError(
                f"layout='zigzag' needs seq_len n={n} divisible by 2 * {P} (twice the size of "
                f"mesh axis {seq_axis!r})"
            )
        m = n // P
    window = settings.local_window
    if window is not None and window > m // C:
        raise ValueError(
            f"local_window={window} must be at most the local chunk length "
            f"{m // C} (n/P{'/2 with layout=zigzag' if C == 2 else ''}) on the ring"
        )
    V.check_memory(jax.ShapeDtypeStruct((b, m, h, d), dtype), jax.ShapeDtypeStruct(
        (b, m, hk, d), dtype), num_branches=len(settings.segment_lengths),
        op="ring_dilated_attention (per device)")


def check_sharded(q: jax.Array, k_heads: int, mask: AttentionMask,
                  settings: DilatedSettings, sp: SequenceParallel,
                  value_head_dim: int | None = None) -> None:
    """The rules of a sequence-parallel call on arguments :func:`check_dilated_request`
    validated (global view): divisibility by the mesh, zigzag, window, per-device memory, an
    implementation that serves every call of the ring (:func:`ring_cores`; ``value_head_dim``:
    ``dv`` of ``v (b, n, hk, dv)``)."""
    P = check_sharded_shape(q, sp.mesh, sp.seq_axis, sp.batch_axis)
    b, n, h, d = q.shape
    if sp.batch_axis is not None:
        b //= sp.mesh.shape[sp.batch_axis]
    _check_ring((b, n, h, d), k_heads, mask, settings, P, sp.layout, q.dtype,
                per_device=False, seq_axis=sp.seq_axis)
    ring_cores(settings, mask, q.dtype, d, value_head_dim)


def ring_dilated_core(q, k, v, mask: AttentionMask, settings: DilatedSettings, *,
                      axis_name: Hashable, layout: str, cores=None) -> jax.Array:
    """:func:`ring_dilated_attention` on validated arguments (inside ``shard_map``); ``cores``:
    :func:`ring_cores` (computed when not given)."""
    P = int(lax.axis_size(axis_name))
    b, m, h, d = q.shape
    C = 2 if layout == "zigzag" and P > 1 else 1
    n = P * m
    ws, rs, mode = settings.segment_lengths, settings.dilation_rates, settings.mode
    scale, is_causal = settings.scale_for(d), settings.is_causal
    block_sizes, window = settings.block_sizes, settings.local_window
    q_len, kv_len = mask.query_seq_lengths, mask.key_value_seq_lengths
    plans = dilated_branches(n, h, k.shape[2], ws, rs, mode)
    branch_core, hop_core, window_core = cores or ring_cores(settings, mask, q.dtype, d,
                                                             v.shape[3])
    # Spanning branches first, sparsest (largest r, smallest dilated copies) first, local ones
    # last, each fenced behind the previous one (attend_branches): only finished (dilated, so
    # small) branch outputs are live next to the branch being computed, whatever the XLA
    # scheduler prefers. All branches and the merge are one custom_vjp, whose backward adds
    # every branch's float32 gradients into one accumulator.
    order = sorted(plans, key=lambda p: (is_local(p, P, C, m), -p.r))
    ops = tuple(branch_op(p, P, C, m, h, k.shape[2], axis_name, scale, is_causal, block_sizes,
                          branch_core, hop_core) for p in order)
    if window is not None:
        blocks = (block_sizes or RING_BLOCKS) if window_core.name == "xla" else block_sizes
        ops += (WindowBranch(window_plan(m // C, h, k.shape[2], window), P, C, n, axis_name,
                             scale, is_causal, blocks, window_core),)
    starts = chunk_starts(P, C, m // C, axis_name) if (q_len, kv_len) != (None, None) else None
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


def sharded_dilated(q, k, v, mask: AttentionMask, settings: DilatedSettings,
                    sp: SequenceParallel) -> jax.Array:
    """The sequence-parallel program on validated arguments (:func:`check_dilated_request`,
    :func:`check_sharded`): the shard_map of :func:`ring_dilated_core`, compiled once per
    ``(settings, sp)``."""
    return _sharded_jit(q, k, v, mask, settings, sp)


# One compiled program per static configuration (cached across eager calls, and bitwise the
# same result as a call under the caller's jax.jit).
@functools.partial(jax.jit, static_argnames=("settings", "sp"))
def _sharded_jit(q, k, v, mask, settings, sp):
    P = sp.mesh.shape[sp.seq_axis]
    zigzag = sp.layout == "zigzag" and P > 1
    cores = ring_cores(settings, mask, q.dtype, q.shape[3], v.shape[3])

    def body(q, k, v, q_len=None, kv_len=None):
        if zigzag:
            q, k, v = (relayout(x, P, sp.seq_axis, True) for x in (q, k, v))
        local = AttentionMask(query_seq_lengths=q_len, key_value_seq_lengths=kv_len,
                              is_causal=mask.is_causal)
        out = ring_dilated_core(q, k, v, local, settings, axis_name=sp.seq_axis,
                                layout=sp.layout, cores=cores)
        return relayout(out, P, sp.seq_axis, False) if zigzag else out

    return shard_sequence(body, sp.mesh, sp.seq_axis, sp.batch_axis, q, k, v,
                          mask.query_seq_lengths, mask.key_value_seq_lengths,
                          check_vma=_vma_free(cores))
