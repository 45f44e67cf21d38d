"""Decoding with a KV cache: dilated attention whose per-token cost does not grow with context.

In branch ``(w, r)`` the query at position ``p`` attends only the keys of its own segment that
share its offset class, ``p - r*m`` for ``m = 0 .. (p % w) // r``: at most ``w / r`` keys,
wherever ``p`` is. A decode call therefore gathers, per row and per branch, exactly those
windows from the cache (plus ``W + 1`` keys for a local window) and runs them through the one
attention core (:mod:`dilax.core`) with :class:`~dilax.core.KeyBounds` whose ``kv_len`` is the
number of keys inside the segment; branches are merged by their log-sum-exp
(:func:`dilax.core.merge_attention_states`). Nothing is proportional to the cache length.

Chunks of many new positions (prefill) would make per-query windows expensive (``t * w / r``
gathered keys), so a branch whose per-query windows would read more than the chunk's own
segments reads those segments instead -- at most ``ceil((w - 1 + t) / w)`` of them, aligned
to the segment grid of each row -- and runs them in the slot layout of
:mod:`dilax.branch.plan`, as :func:`dilax.dilated_attention` does.

With ``implementation="pallas"`` (the default on GPU) every branch runs in one split-K
kernel instead (:mod:`pallas_kernels.decode`): each query reads its branches' windows straight
from the cache, for any ``t`` (a long chunk then costs ``t`` windows, with no key reuse across
its queries), and the branches meet in one softmax, which is the log-sum-exp merge.

The cache update is a scatter of the ``t`` new rows: under ``jax.jit`` with the cache donated
it happens in place (see :func:`dilated_attention_decode`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dilax import _validation as V
from dilax import registry
from dilax.branch.plan import expand_slots, plan_branch, slot_layout, slot_view
from dilax.core import XLA, BlockSizes, KeyBounds, Mask, identity_view, merge_attention_states
from dilax.dilated.settings import DilatedSettings, settings_from_keywords
from dilax.flex.api import core_mods, prepare_mods, with_sinks
from dilax.semantics import branch_heads, effective_segment_length

__all__ = ["KVCache", "dilated_attention_decode"]

_F32 = jnp.float32
# Per-query windows gather ``rows x window`` keys at once; above this many (kv rows), the
# queries are processed in blocks so the gathered windows stay small (chunked prefill).
_MAX_GATHERED_ROWS = 1 << 14


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values of the positions seen so far (a pytree).

    Fields:
      k, v: ``(b, max_len, hk, d)``; row ``i`` holds positions ``0 .. lengths[i] - 1``
        (entries past ``lengths[i]`` are never read).
      lengths: ``(b,)`` int32, the number of positions written per row (rows may differ);
        never more than ``max_len``.
      overflow: ``(b,)`` bool, sticky: ``True`` once a call brought row ``i`` positions past
        ``max_len`` (possible only under ``jit``, where lengths are traced; concrete lengths
        raise instead). Those positions were not written (earlier entries are intact, the row's
        length stops at ``max_len``) and their outputs are 0: check it after a jitted loop.
        ``None`` (a cache built by hand) reads as all ``False``.
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array
    overflow: jax.Array | None = None

    @classmethod
    def init(cls, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
             dtype=jnp.float32) -> KVCache:
        """An empty cache: zeros ``(batch, max_len, num_kv_heads, head_dim)``, lengths 0."""
        shape = tuple(V.static_int(x, name) for x, name in (
            (batch, "batch"), (max_len, "max_len"), (num_kv_heads, "num_kv_heads"),
            (head_dim, "head_dim")))
        if min(shape[1:]) <= 0 or shape[0] < 0:  # batch 0: an empty cache (empty results)
            raise ValueError(f"batch must be >= 0 and max_len, num_kv_heads and head_dim "
                             f"positive, got {shape}")
        dtype = jnp.dtype(dtype)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                   jnp.zeros((shape[0],), jnp.int32), jnp.zeros((shape[0],), bool))

    @property
    def max_len(self) -> int:
        return self.k.shape[1]

    def with_lengths(self, lengths: jax.Array) -> KVCache:
        """The same buffers with other ``lengths`` (e.g. rewinding rows after a padded
        prefill: entries past a row's length are overwritten before they are ever read)."""
        return dataclasses.replace(self, lengths=jnp.asarray(lengths, jnp.int32))


@dataclasses.dataclass(frozen=True)
class _Branch:
    """One branch of a decode call (static): segment ``w`` (None: local window), rate or
    stride ``r``, window ``m`` keys, the heads it serves with their offsets."""

    w: int | None
    r: int
    m: int
    heads: tuple[int, ...]
    offsets: tuple[int, ...]


def _branches(h: int, settings: DilatedSettings, max_len: int) -> tuple[_Branch, ...]:
    # A segment longer than the cache is one segment: cap w as dilated_attention caps it at n
    # (same segments for every position < max_len), so no window outgrows the cache.
    rs = settings.dilation_rates
    ws = tuple(effective_segment_length(max_len, w, r)
               for w, r in zip(settings.segment_lengths, rs))
    out = [_Branch(br.w, br.r, br.w // br.r, br.heads, br.offsets)
           for br in branch_heads(h, ws, rs, settings.mode)]
    if settings.local_window is not None:
        out.append(_Branch(None, 1, settings.local_window + 1, tuple(range(h)), (0,) * h))
    return tuple(out)


def _row_gather(x, idx):
    """``x[i, idx[i, ...]]`` for ``x (b, L, ...)``, ``idx (b, ...)`` int (already in range)."""
    b = x.shape[0]
    return x[jnp.arange(b).reshape((b,) + (1,) * (idx.ndim - 1)), idx]


def _head_view(br: _Branch, h: int, hk: int):
    """The core's view of the branch's heads and the query head of each of its virtual
    heads (the mods' ``h``; None: every head, virtual head ``i`` is head ``i``)."""
    if len(br.heads) == h:
        return identity_view(hk, h // hk), None
    # A subset of heads (grouped mode): pair them with their kv heads as a branch plan does.
    plan = plan_branch(1, h, hk, 1, 1, br.heads, (0,) * len(br.heads))
    return slot_view(plan, h, hk), tuple(plan.q_heads)


def _window_branch(q, kc, vc, pos, br: _Branch, scale, mods=None):
    """Per-query windows: query ``p = pos[i, j]`` reads keys ``p - r*m``, ``m < br.m``, inside
    its segment (or the ``W + 1`` keys ``p - W .. p``). Returns float32 ``out (b, t, H', d)``
    and ``lse (b, t, H')`` for the branch's heads, ascending. ``mods``: score / mask mods
    (:class:`dilax.core.mods.Mods`, every head) at the query's and the cache slots'
    positions, or None."""
    b, t, h, d = q.shape
    hk = kc.shape[2]
    view, heads = _head_view(br, h, hk)
    tb = max(1, min(t, _MAX_GATHERED_ROWS // br.m))
    nblk = -(-t // tb)
    step = jnp.arange(br.m, dtype=jnp.int32) * br.r

    def block(qb, pb):  # (b, tb, h, d), (b, tb)
        idx = pb[..., None] - step[None, None]  # (b, tb, m): the window, nearest key first
        kw = _row_gather(kc, jnp.clip(idx, 0, kc.shape[1] - 1))
        vw = _row_gather(vc, jnp.clip(idx, 0, kc.shape[1] - 1))
        if br.w is None:  # local window: keys p - W .. p that exist
            kv_len = jnp.minimum(pb, br.m - 1) + 1
        else:  # keys of p's segment: m <= (p % w) // r
            kv_len = (pb % br.w) // br.r + 1
        B = b * qb.shape[1]
        mods_b = None if mods is None else dataclasses.replace(  # positions, not slots
            mods, q_pos=pb.reshape(B, 1), kv_pos=jnp.clip(idx, 0, None).reshape(B, 1, br.m),
            batch=jnp.repeat(jnp.arange(b, dtype=jnp.int32), qb.shape[1]), heads=heads)
        mask = Mask(KeyBounds(jnp.broadcast_to(kv_len.reshape(B, 1), (B, len(view.kv_index)))),
                    mods=mods_b)
        out, lse = XLA.forward(
            qb.reshape(B, 1, h, d), kw.reshape(B, br.m, hk, d), vw.reshape(B, br.m, hk, d),
            view=view, mask=mask, scale=scale,
            block_sizes=BlockSizes(1, min(br.m, 4096)), out_dtype=_F32)
        return out.reshape(b, -1, *out.shape[2:]), lse.reshape(b, -1, lse.shape[-1])

    if nblk == 1:
        out, lse = block(q, pos)
    else:  # long chunks: a bounded window buffer per block of queries
        pad = nblk * tb - t
        qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
        pp = jnp.pad(pos, ((0, 0), (0, pad)))
        split = lambda x: jnp.moveaxis(x.reshape(b, nblk, tb, *x.shape[2:]), 1, 0)
        out, lse = lax.map(lambda a: block(*a), (split(qp), split(pp)))
        out = jnp.moveaxis(out, 0, 1).reshape(b, nblk * tb, *out.shape[3:])[:, :t]
        lse = jnp.moveaxis(lse, 0, 1).reshape(b, nblk * tb, lse.shape[-1])[:, :t]
    return out, lse


def _segment_branch(q, kc, vc, lengths, br: _Branch, scale):
    """The chunk's own segments of branch ``(w, r)``, aligned to each row's segment grid, in
    the slot layout (causal core call). Same returns as :func:`_window_branch`."""
    b, t, h, d = q.shape
    hk = kc.shape[2]
    w, r = br.w, br.r
    nseg = -(-(w - 1 + t) // w)
    n_win = nseg * w
    plan = plan_branch(n_win, h, hk, w, r, br.heads, br.offsets)
    start = (lengths // w) * w  # (b,) first position of the window
    shift = lengths - start  # where the chunk begins inside the window
    kidx = jnp.clip(start[:, None] + jnp.arange(n_win)[None], 0, kc.shape[1] - 1)
    kw, vw = _row_gather(kc, kidx), _row_gather(vc, kidx)
    qi = jnp.arange(n_win)[None, :] - shift[:, None]
    qw = jnp.where(((qi >= 0) & (qi < t))[..., None, None],
                   _row_gather(q, jnp.clip(qi, 0, t - 1)), jnp.zeros((), q.dtype))
    # valid dilated keys of (segment s, slot o): positions s*w + o + r*i < shift + t
    valid = (shift + t)[:, None, None] - (np.arange(nseg) * w)[None, :, None] \
        - np.asarray(plan.kv_slots)[None, None, :]
    kv_len = jnp.clip(-(-valid // r), 0, w // r).reshape(b * nseg, len(plan.kv_slots))
    out, lse = XLA.forward(
        slot_layout(qw, plan), slot_layout(kw, plan), slot_layout(vw, plan),
        view=slot_view(plan, h, hk), mask=Mask(KeyBounds(kv_len, is_causal=True)), scale=scale,
        out_dtype=_F32)
    take = shift[:, None] + jnp.arange(t)[None]
    out = _row_gather(expand_slots(out, plan, n_win, 0.0), take)
    lse = _row_gather(expand_slots(lse, plan, n_win, -jnp.inf), take)
    return out, lse


def _selected(pos, br: _Branch):
    """``(b, t, H')`` bool: the branch selects query ``pos`` for each of its heads."""
    order = np.argsort(br.heads)
    offsets = np.asarray(br.offsets)[order]
    return (pos[..., None] % br.r) == offsets[None, None]


def _xla_branches(q, kc, vc, lengths, pos, branches, mode: str, scale: float, mods=None,
                  sinks=None):
    """Every branch on the XLA core, merged: ``(b, t, h, dv)`` float32. With ``mods`` every
    branch reads per-query windows; ``sinks (h,)``: one more logit per head in the merged
    denominator (grouped: in each head's own softmax, as :func:`dilax.dilated_attention`)."""
    t = q.shape[1]
    outs, lses = [], []
    for br in branches:
        if br.w is None or mods is not None or t <= -(-(br.w - 1 + t) // br.w) * br.r:
            out, lse = _window_branch(q, kc, vc, pos, br, scale, mods)
        else:
            out, lse = _segment_branch(q, kc, vc, lengths, br, scale)
        if br.w is not None:  # a query off the branch's offset class gets nothing from it
            sel = _selected(pos, br)
            out = jnp.where(sel[..., None], out, 0.0)
            lse = jnp.where(sel, lse, -jnp.inf)
        outs.append(out)
        lses.append(lse)
    if mode == "mixture":
        out, lse = outs[0], lses[0]
        for o, s in zip(outs[1:], lses[1:]):
            out, lse = merge_attention_states(out, lse, o, s)
        return out if sinks is None else with_sinks(out, lse, sinks, _F32)[0]
    # head groups side by side, each divided by the number of branches
    out = jnp.concatenate(outs, axis=2) / len(branches)
    if sinks is None:
        return out
    return with_sinks(out, jnp.concatenate(lses, axis=2), sinks, _F32)[0]


def _pallas_branches(q, kc, vc, pos, branches, mode: str, scale: float, interpret: bool):
    """Every branch in one Pallas decode kernel (:mod:`pallas_kernels.decode`): one softmax
    over the union of the branches' windows per head, which is the mixture's log-sum-exp
    merge (and, in grouped mode, where each head runs one branch, that branch's softmax)."""
    from pallas_kernels.decode import DecodeBranch, decode_attention  # lazy: no Pallas at import

    kernel_branches = tuple(
        DecodeBranch(br.w, br.r, br.m, (min(br.heads), max(br.heads) + 1),
                     None if mode == "mixture" else br.offsets[0])
        for br in branches)
    out, _ = decode_attention(q, kc, vc, pos, branches=kernel_branches, scale=scale,
                              interpret=interpret)
    return out if mode == "mixture" else out / len(branches)


@functools.partial(jax.jit, static_argnames=("settings",))
def _decode(q, k, v, cache: KVCache, new_lengths, settings: DilatedSettings, mods=None,
            sinks=None):
    b, t, h, d = q.shape
    branches = _branches(h, settings, cache.max_len)
    scale = settings.scale_for(d)
    lengths = cache.lengths.astype(jnp.int32)
    pos = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]  # (b, t) absolute positions
    rows = jnp.arange(b)[:, None]
    # Scatter of the t new rows: in place when the cache is donated. Rows that would pass
    # max_len (traced lengths) are dropped; see dilated_attention_decode.
    kc = cache.k.at[rows, pos].set(k, mode="drop")
    vc = cache.v.at[rows, pos].set(v, mode="drop")
    if settings.implementation == "pallas":
        out = _pallas_branches(q, kc, vc, pos, branches, settings.mode, scale,
                               settings.interpret)
    else:
        out = _xla_branches(q, kc, vc, lengths, pos, branches, settings.mode, scale, mods,
                            sinks)
    # Padded new positions: output 0 and the row advances by its own count. Their keys were
    # written past the new length, where they are never read (causal: no valid query of this
    # chunk attends a later position) and get overwritten by the next call.
    count = jnp.full((b,), t, jnp.int32) if new_lengths is None else new_lengths
    # Positions past max_len (traced lengths only) were dropped: output 0, flag the row.
    keep = (jnp.arange(t)[None, :] < count[:, None]) & (pos < cache.max_len)
    out = jnp.where(keep[..., None, None], out, 0.0)
    overflow = cache.overflow | (lengths + count > cache.max_len)
    return out.astype(q.dtype), KVCache(kc, vc, jnp.minimum(lengths + count, cache.max_len),
                                        overflow)


def _check_cache(cache, k: jax.Array) -> KVCache:
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a dilax.KVCache, got {type(cache).__name__}")
    b, t, hk, d = k.shape
    if cache.k.ndim != 4 or cache.k.shape != cache.v.shape:
        raise ValueError(f"cache.k and cache.v must both have shape (batch, max_len, "
                         f"num_kv_heads, head_dim), got {cache.k.shape} and {cache.v.shape}")
    cb, max_len, chk, cd = cache.k.shape
    if cb != b:
        raise ValueError(f"cache batch {cb} does not match the batch of q, k, v ({b})")
    if chk != hk:
        raise ValueError(f"cache num_kv_heads {chk} does not match k, v heads (axis 2: {hk})")
    if cd != d:
        raise ValueError(f"cache head_dim {cd} does not match the head_dim of k, v ({d})")
    if cache.k.dtype != k.dtype or cache.v.dtype != k.dtype:
        raise TypeError(f"cache dtype {cache.k.dtype} does not match the dtype of k, v "
                        f"({k.dtype}); build it with KVCache.init(..., dtype={k.dtype})")
    if jnp.shape(cache.lengths) != (b,):
        raise ValueError(f"cache.lengths must have shape (batch,) = ({b},), got "
                         f"{jnp.shape(cache.lengths)}")
    if t > max_len:
        raise ValueError(f"cannot write t={t} positions into a cache of max_len={max_len}")
    if cache.overflow is None:
        cache = dataclasses.replace(cache, overflow=jnp.zeros((b,), bool))
    if not isinstance(cache.lengths, jax.core.Tracer):
        lengths = np.asarray(cache.lengths)
        if lengths.size and (lengths.min() < 0 or lengths.max() + t > max_len):
            raise ValueError(
                f"writing t={t} positions past cache lengths {lengths.tolist()} overflows "
                f"max_len={max_len} (every row needs lengths + t <= max_len)")
    return cache


def dilated_attention_decode(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cache: KVCache,
    segment_lengths: tuple[int, ...] | list[int] | int | None = None,
    dilation_rates: tuple[int, ...] | list[int] | int | None = None,
    *,
    mode: str = "mixture",
    scale: float | None = None,
    local_window: int | None = None,
    implementation: str | None = None,
    query_seq_lengths: jax.Array | None = None,
    interpret: bool = False,
    settings: DilatedSettings | None = None,
    score_mod: Callable | None = None,
    mask_mod: Callable | None = None,
    sinks: jax.Array | None = None,
    logits_soft_cap: float | None = None,
) -> tuple[jax.Array, KVCache]:
    """Causal dilated attention of the next ``t`` positions of every row, with a KV cache.

    Writes ``k, v`` at positions ``cache.lengths[i] .. cache.lengths[i] + t - 1`` of row ``i``
    and returns, for those positions, exactly the rows of causal
    :func:`dilax.dilated_attention` (same ``mode``, branches, ``scale`` and local window) over
    the whole sequence so far. ``t = 1`` is one generated token, ``t > 1`` a chunk of prefill.

    Cost: a query reads only the keys it can attend -- per branch ``(w, r)`` at most ``w / r``
    keys of its own segment and offset class, ``W + 1`` for the local window -- gathered from
    the cache per row; nothing is proportional to ``lengths`` or ``max_len``. A chunk reads at
    most its own segments per branch (``ceil((w - 1 + t) / w)`` of ``w`` positions).

    Update in place: jit the step with the cache donated, e.g. ::

        step = jax.jit(lambda q, k, v, cache: dilax.dilated_attention_decode(
            q, k, v, cache, (1024, 2048), (1, 2)), donate_argnums=3)
        out, cache = step(q, k, v, cache)  # the old `cache` buffers are reused

    Called without jit (or without donation) the cache is copied on update.

    Args:
      q: ``(b, t, h, d)`` queries of the new positions, ``t >= 1``.
      k, v: ``(b, t, hk, d)``, ``h % hk == 0`` (GQA/MQA), dtype of ``cache``.
      cache: a :class:`KVCache` with ``num_kv_heads = hk`` and ``head_dim = d``.
      segment_lengths, dilation_rates, mode, scale: as in :func:`dilax.dilated_attention`.
      local_window: ``W >= 0`` adds the local window branch (``mode="mixture"`` only): query
        ``p`` also attends keys ``p - W .. p``.
      implementation: ``None`` (the core :mod:`dilax.registry` picks for a decode step:
        ``"pallas"`` on GPU, ``"xla"`` elsewhere), ``"xla"`` (gathered windows through the
        blockwise core) or ``"pallas"`` (:func:`pallas_kernels.decode.decode_attention`: one
        split-K kernel over every branch's gathered window, reading the cache in place;
        ``head_dim`` a power of two in ``[16, 256]``). Another name, or ``"pallas"`` for a
        head_dim it cannot serve, raises ``ValueError`` with the reason.
      query_seq_lengths: optional int ``(b,)`` in ``[0, t]``: row ``i`` brings only its first
        ``query_seq_lengths[i]`` new positions (a padded chunk); the others output 0 and the
        row's length advances by ``query_seq_lengths[i]`` instead of ``t``.
        The keys of a row are its cache (``cache.lengths``: the valid key lengths). Static
        values out of range raise; traced values are clipped to ``[0, t]``.
      interpret: run the Pallas kernel in the interpreter (CPU testing); with
        ``implementation=None`` the kernel then serves the step.
      settings: a :class:`dilax.DilatedSettings` holding the whole configuration (then
        ``segment_lengths`` ... ``implementation`` and ``interpret`` must be left out). A
        decode step is causal whatever its ``is_causal``; its ``block_sizes`` are not used.
      score_mod, mask_mod, sinks, logits_soft_cap: FlexAttention's options
        (docs/semantics.md, "Custom scores and masks"), exactly as
        :func:`dilax.dilated_attention` over the whole sequence: ``q_idx`` is the new
        token's position (``cache.lengths[i] + j``), ``kv_idx`` the cache slot's position,
        ``b`` the batch row; each branch counts a pair iff it AND ``mask_mod`` allow it;
        ``sinks (h,)`` add one logit per head to the merged denominator (``mode="grouped"``:
        to each head's own softmax, ``h`` the real query head of its group). XLA core only
        (``"pallas"`` refuses them with :mod:`dilax.registry`'s reason), either mode; every
        branch then reads per-query windows (a chunk of ``t`` costs ``t`` windows).

    Returns:
      ``(out, cache)``: ``out (b, t, h, d)`` in ``q.dtype`` and the cache with the new
      positions written and ``lengths + t`` (``+ query_seq_lengths`` when given; at most
      ``max_len``, see ``Raises``).

    Raises:
      ValueError / TypeError: ``t == 0``, ``t > max_len``, concrete ``lengths + t > max_len``,
      a cache whose batch, heads, head_dim or dtype differ from ``k``, and everything
      :func:`dilax.dilated_attention` rejects. Under ``jax.jit`` the lengths are traced and
      cannot be checked: positions past ``max_len`` are then not written, output 0, the
      row's length stops at ``max_len`` and ``cache.overflow`` flags the row.
    """
    if getattr(q, "ndim", 0) == 4 and q.shape[1] == 0:
        raise ValueError(f"t (axis 1 of q) must be >= 1 new positions, got q of shape "
                         f"{tuple(q.shape)}")
    # one settings value, validated once; the compiled step takes it whole (static)
    settings = settings_from_keywords(
        settings, segment_lengths, dilation_rates, mode=mode, scale=scale,
        local_window=local_window, implementation=implementation, interpret=interpret)
    q, k, v = V.check_qkv(q, k, v, empty_batch=True)
    V.check_mode(settings.mode, q.shape[2], len(settings.segment_lengths))
    new_lengths = V.check_seq_lengths(query_seq_lengths, "query_seq_lengths", q.shape[0],
                                      q.shape[1])
    # the registry says which core serves a decode step; an explicit one that cannot raises
    flex = prepare_mods("dilated_attention_decode", q.shape[0], q.shape[2], q.shape[1],
                        getattr(getattr(cache, "k", None), "shape", (0, 0))[1],
                        score_mod=score_mod, mask_mod=mask_mod, sinks=sinks,
                        logits_soft_cap=logits_soft_cap)
    name, _ = registry.choose(settings.implementation, registry.CoreRequest(
        "decode", q.dtype, q.shape[3], True, has_window=settings.local_window is not None,
        has_lengths=new_lengths is not None, interpret=settings.interpret,
        **({} if flex is None else flex.request_flags)))
    cache = _check_cache(cache, k)
    if q.shape[0] == 0:  # an empty batch: nothing to attend, nothing to write
        return V.empty_batch(q, v), cache
    settings = settings.causal()
    if name != settings.implementation:  # implementation=None: the step's core, resolved
        settings = settings.replace(implementation=name)
    if flex is None:
        return _decode(q, k, v, cache, new_lengths, settings)
    return _decode(q, k, v, cache, new_lengths, settings, core_mods(flex), flex.sinks)
