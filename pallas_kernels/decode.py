"""Decode attention over gathered windows (split-K) as a Pallas kernel, beside its reference.

A decode step writes ``t`` new positions into a KV cache ``(b, L, hk, d)`` and attends, for
each new query at position ``p``, only the keys its branches give it (:class:`DecodeBranch`):

* a dilated branch ``(w, r)``: the keys of ``p``'s segment in ``p``'s offset class,
  ``s + p % r + r * j`` for ``j = 0 .. (p % w) // r`` (``s = (p // w) * w``), at most
  ``w / r`` keys -- a strided run of cache rows;
* the local window ``W``: keys ``max(p - W, 0) .. p``.

Each query head runs a branch only when the branch covers it and selects ``p`` for it
(``p % r`` equals the head's offset); the union of all branches' keys is one softmax, which
is exactly the log-sum-exp merge of the per-branch softmaxes (mixture mode), and a head that
only one branch covers (grouped mode) gets that branch's softmax.

:func:`decode_attention` runs one program per ``(query row, kv head, split)``: the program
keeps the ``G`` query heads of its kv head resident (zero rows up to 16, the smallest Triton
``dot``), walks split ``s`` of every branch's window in tiles of ``block_k`` cache rows with
an online softmax (float32 statistics), and writes a normalized partial ``(out, lse)``. A
tile is one strided slice ``pl.ds(row, block_k, r)`` (the window's keys are an arithmetic
progression; the strict interpreter refuses gathers); one that would run past the cache
moves back by whole strides, and lanes outside the window are masked, so every read is
inside the cache. A cache shorter than ``r * block_k`` rows (tiny caches only) is walked in
unit steps with every ``r``-th row kept. The splits are merged by their log-sum-exp
(elementwise XLA, no matmul). Splitting the window (split-K, "flash decoding") keeps the GPU
busy when ``b * t * hk`` programs alone would not. :func:`decode_reference` is the same
computation with gathers and a dense softmax in plain ``jax.numpy``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import arange_i32, cdiv_nonneg, gpu_only, online_softmax_step
from pallas_kernels.config import MIN_BLOCK, KernelConfig, next_power_of_2, triton_compiler_params
from pallas_kernels.mods import BoundMods

__all__ = ["DecodeBranch", "DecodeConfig", "decode_attention", "decode_reference",
           "default_decode_config"]

_F32 = jnp.float32
_NEG_INF = float("-inf")
# Programs to aim for when choosing the split count: a few per SM of an H100 (132 SMs).
_TARGET_PROGRAMS = 512


@dataclasses.dataclass(frozen=True)
class DecodeBranch:
    """One branch of a decode step (static, hashable).

    ``segment``: ``w`` of a dilated branch, ``None`` for the local window. ``stride``: ``r``
    (1 for the local window). ``window``: the most keys one query reads (``w // r``, or
    ``W + 1``). ``heads``: the query heads ``[lo, hi)`` that run the branch. ``offset``:
    the offset of those heads (a head selects positions ``p % r == offset``); ``None``:
    head ``j`` has offset ``j % r`` (mixture mode)."""

    segment: int | None
    stride: int
    window: int
    heads: tuple[int, int]
    offset: int | None = None

    def keys(self, p):
        """``(start, count)`` int32 of position(s) ``p``: keys ``start + stride * j``,
        ``j < count`` (works in and outside a kernel)."""
        if self.segment is None:
            return jnp.maximum(p - (self.window - 1), 0), jnp.minimum(p, self.window - 1) + 1
        w, r = jnp.int32(self.segment), jnp.int32(self.stride)
        in_seg = lax.rem(p, w)
        start = p - in_seg + (lax.rem(p, r) if self.stride > 1 else 0)
        return start, lax.div(in_seg, r) + 1

    def selects(self, p, head):
        """bool: head(s) ``head`` run this branch for query position(s) ``p``."""
        lo, hi = self.heads
        sel = (head >= lo) & (head < hi)
        if self.segment is None or self.stride == 1:
            return sel
        r = jnp.int32(self.stride)
        offset = lax.rem(head, r) if self.offset is None else jnp.int32(self.offset)
        return sel & (lax.rem(p, r) == offset)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of :func:`decode_attention`: ``block_k`` gathered keys per tile (a
    power of two >= 16), ``num_splits`` (``None``: enough splits for about
    ``_TARGET_PROGRAMS`` programs), ``num_warps``, ``num_stages``."""

    block_k: int = 64
    num_splits: int | None = None
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        KernelConfig(block_k=self.block_k, num_warps=self.num_warps,
                     num_stages=self.num_stages)  # the same rules as the flash tiles
        if self.block_k < MIN_BLOCK:
            raise ValueError(f"DecodeConfig.block_k must be >= {MIN_BLOCK}, got {self.block_k}")
        if self.num_splits is not None and (isinstance(self.num_splits, bool) or not isinstance(
                self.num_splits, int) or self.num_splits < 1):
            raise ValueError(f"DecodeConfig.num_splits must be None or a positive int, got "
                             f"{self.num_splits!r}")


def default_decode_config(dtype) -> DecodeConfig:
    """64-key tiles (32 for float32: twice the bytes per key), 4 warps, 2 stages."""
    return DecodeConfig(block_k=32 if jnp.dtype(dtype).itemsize >= 4 else 64)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Walk(NamedTuple):
    """How the kernel reads one branch's window (static): tiles of ``block`` cache rows
    ``step`` apart, lane ``u`` of the window at row ``start + step * u``, a key every
    ``every`` lanes; ``lanes``: the lanes of a full window."""

    step: int
    every: int
    block: int
    lanes: int


def _walk(br: DecodeBranch, max_len: int, block_k: int) -> _Walk:
    r = br.stride
    if max_len >= r * block_k:  # a strided tile fits the cache at every phase (GPU caches)
        return _Walk(r, 1, block_k, br.window)
    # a cache shorter than r tiles (tests, tiny caches): unit steps, a key every r rows
    block = min(block_k, 1 << (max_len.bit_length() - 1))
    return _Walk(1, r, block, (br.window - 1) * r + 1)


def _num_splits(config: DecodeConfig, programs: int, walks) -> int:
    tiles = max(_cdiv(w.lanes, w.block) for w in walks)
    if config.num_splits is not None:
        return min(config.num_splits, tiles)
    return max(1, min(tiles, _cdiv(_TARGET_PROGRAMS, max(programs, 1))))


def _dot(a, b, contract_a: int, contract_b: int):
    """2-D matmul with float32 accumulation (default precision, as the flash kernels)."""
    return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())),
                           preferred_element_type=_F32)


def _decode_kernel(pos_ref, q_ref, k_ref, v_ref, *refs, branches, walks, chunks, scale, groups,
                   max_len, t, mods=None):
    *mod_refs, o_ref, lse_ref = refs
    c, s = pl.program_id(1), pl.program_id(2)
    p = pos_ref[0]
    q = q_ref[...]  # (Gp, d): the query heads of kv head c at position p
    rows = arange_i32(q.shape[0])
    head = c * groups + rows
    if mods is not None:  # b: the query's batch row; h: (Gp, 1) heads; kv_idx: cache rows
        mods = BoundMods(mods, tuple(mod_refs), lax.div(pl.program_id(0), jnp.int32(t)),
                         head[:, None])
    m = jnp.full((q.shape[0],), _NEG_INF, _F32)
    denom = jnp.zeros((q.shape[0],), _F32)
    acc = jnp.zeros(q.shape, _F32)
    for br, walk, chunk in zip(branches, walks, chunks):
        start, count = br.keys(p)
        lanes = (count - 1) * walk.every + 1  # lanes up to the window's last key
        sel = br.selects(p, head) & (rows < groups)
        first = s * chunk  # this split's part of the window: lanes [first, first + chunk)
        n_tiles = cdiv_nonneg(jnp.clip(lanes - first, 0, chunk), walk.block)
        # the last tile start that keeps a whole strided tile inside the cache
        last = max_len - 1 - walk.step * (walk.block - 1)

        def body(i, carry, walk=walk, start=start, lanes=lanes, sel=sel, first=first,
                 last=last):
            m, denom, acc = carry
            lane0 = first + i * walk.block
            row0 = start + walk.step * lane0
            # a tile that would run past the cache moves back by whole steps (its lanes
            # before lane0 are masked): every read is a strided slice inside the cache
            back = cdiv_nonneg(jnp.maximum(row0 - last, 0), walk.step)
            lane = lane0 - back + arange_i32(walk.block)
            valid = (lane >= lane0) & (lane < lanes)
            if walk.every > 1:  # a unit-step walk of a dilated branch: every r-th row
                valid &= lax.rem(lane, jnp.int32(walk.every)) == 0
            tile = pl.ds(row0 - back * walk.step, walk.block, walk.step)
            k = k_ref[tile, :]
            v = jnp.where(valid[:, None], v_ref[tile, :], jnp.zeros((), v_ref.dtype))
            logits = _dot(q, k, 1, 1) * scale
            ok = sel[:, None] & valid[None, :]
            if mods is not None:  # positions: the query's p, the tile's cache rows
                kv = (row0 - back * walk.step + walk.step * arange_i32(walk.block))[None, :]
                logits = mods.scores(logits, p, kv)
                allowed = mods.allowed(p, kv)
                ok = ok if allowed is None else ok & allowed
            logits = jnp.where(ok, logits, _NEG_INF)
            return online_softmax_step(m, denom, acc, logits, v)

        m, denom, acc = lax.fori_loop(0, n_tiles, body, (m, denom, acc))
    has_key = denom > 0.0
    denom_safe = jnp.where(has_key, denom, 1.0)
    o_ref[...] = acc / denom_safe[:, None]
    lse_ref[...] = jnp.where(has_key, m + jnp.log(denom_safe), _NEG_INF)


def _merge_splits(out, lse):
    """Log-sum-exp merge over axis 0 of normalized partials ``out (S, ...)``, ``lse (S, ...)``."""
    if out.shape[0] == 1:
        return out[0], lse[0]
    top = jnp.max(lse, axis=0)
    top = jnp.where(top == _NEG_INF, 0.0, top)
    weight = jnp.exp(lse - top[None])  # 0 for an empty split
    denom = jnp.sum(weight, axis=0)
    has_key = denom > 0.0
    denom_safe = jnp.where(has_key, denom, 1.0)
    out = jnp.sum(weight[..., None] * out, axis=0) / denom_safe[..., None]
    return out, jnp.where(has_key, top + jnp.log(denom_safe), _NEG_INF)


def _check(q, k_cache, v_cache, positions, branches):
    if q.ndim != 4 or k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"decode_attention: q must be (b, t, h, d) and k_cache, v_cache "
                         f"(b, L, hk, d), got {q.shape}, {k_cache.shape}, {v_cache.shape}")
    b, t, h, d = q.shape
    if k_cache.shape[0] != b or k_cache.shape[3] != d or h % k_cache.shape[2]:
        raise ValueError(f"decode_attention: k_cache {k_cache.shape} does not fit q {q.shape} "
                         f"(same batch and head_dim, h % hk == 0)")
    if tuple(positions.shape) != (b, t):
        raise ValueError(f"decode_attention: positions must be (b, t) = ({b}, {t}), got "
                         f"{tuple(positions.shape)}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(f"decode_attention: q, k_cache and v_cache must have one dtype, got "
                        f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if d < MIN_BLOCK or d > 256 or d != next_power_of_2(d):
        raise ValueError(f"decode_attention: head_dim must be a power of two in "
                         f"[{MIN_BLOCK}, 256] (cache rows are read whole, not padded), got {d}")
    if not branches or not all(isinstance(br, DecodeBranch) for br in branches):
        raise TypeError("decode_attention: branches must be a non-empty tuple of DecodeBranch")


def decode_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    positions: jax.Array,
    *,
    branches: tuple[DecodeBranch, ...],
    scale: float,
    config: DecodeConfig | None = None,
    interpret=False,
    debug: bool = False,
    mods=None,
) -> tuple[jax.Array, jax.Array]:
    """Attention of ``t`` new queries per row over their branches' windows of a KV cache
    (reference: :func:`decode_reference`).

    Args:
      q: ``(b, t, h, d)``; ``d`` a power of two in ``[16, 256]``.
      k_cache, v_cache: ``(b, L, hk, d)``, ``h % hk == 0`` (query head ``j`` reads kv head
        ``j // (h // hk)``), dtype of ``q`` (bf16, fp16 or fp32).
      positions: int ``(b, t)``, the position of each query (its keys are already written).
        Keys past ``L`` are not read (callers zero the outputs of such positions).
      branches: static :class:`DecodeBranch` es; one softmax over the union of their keys.
      scale: logit scale. config: :class:`DecodeConfig` or ``None`` (default).
      interpret: run in the Pallas interpreter (``True`` or ``pltpu.InterpretParams``).
      mods: FlexAttention mods ``(KernelMods, operands)`` of
        :func:`pallas_kernels.mods.kernel_mods` or None: the cap, ``score_mod`` and
        ``mask_mod`` on each scaled logit at ``q_idx`` = the query's position, ``kv_idx`` =
        the cache row, ``b`` its batch row, ``h`` its query head (forward only).

    Returns:
      ``out (b, t, h, d)`` float32 and ``lse (b, t, h)`` float32; a head with no key in any
      branch gets ``out = 0``, ``lse = -inf``.
    """
    _check(q, k_cache, v_cache, positions, branches)
    config = default_decode_config(q.dtype) if config is None else config
    b, t, h, d = q.shape
    L, hk = k_cache.shape[1], k_cache.shape[2]
    G = h // hk
    gp = max(MIN_BLOCK, next_power_of_2(G))
    if L < MIN_BLOCK:  # a tile is at least MIN_BLOCK rows: pad a tiny cache (masked rows)
        pad = ((0, 0), (0, MIN_BLOCK - L), (0, 0), (0, 0))
        k_cache, v_cache, L = jnp.pad(k_cache, pad), jnp.pad(v_cache, pad), MIN_BLOCK
    walks = tuple(_walk(br, L, config.block_k) for br in branches)
    S = _num_splits(config, b * t * hk, walks)
    # split s of a branch: window lanes [s * chunk, (s + 1) * chunk), whole tiles
    chunks = tuple(_cdiv(_cdiv(w.lanes, w.block), S) * w.block for w in walks)
    qg = q.reshape(b * t, hk, G, d)
    if gp != G:  # zero rows up to the smallest dot (masked in the kernel)
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - G), (0, 0)))
    qg = gpu_only(qg, interpret)
    pos = jnp.asarray(positions, jnp.int32).reshape(b * t, 1)
    row = lambda i: lax.div(i, jnp.int32(t))  # noqa: E731  (query row i -> batch row)
    kv_spec = pl.BlockSpec((None, L, None, d), lambda i, c, s: (row(i), 0, c, 0))
    operands = [] if mods is None else mods[1]  # the mods' arrays, whole to every program
    whole = [pl.BlockSpec(x.shape, functools.partial(lambda n, *_: (0,) * n, x.ndim))
             for x in operands]
    out, lse = pl.pallas_call(
        functools.partial(_decode_kernel, branches=tuple(branches), walks=walks,
                          chunks=chunks, scale=float(scale), groups=G, max_len=L, t=t,
                          **({} if mods is None else dict(mods=mods[0]))),
        grid=(b * t, hk, S),
        in_specs=[pl.BlockSpec((None, 1), lambda i, c, s: (i, 0)),
                  pl.BlockSpec((None, None, gp, d), lambda i, c, s: (i, c, 0, 0)),
                  kv_spec, kv_spec, *whole],
        out_specs=[pl.BlockSpec((None, None, None, gp, d), lambda i, c, s: (s, i, c, 0, 0)),
                   pl.BlockSpec((None, None, None, gp), lambda i, c, s: (s, i, c, 0))],
        out_shape=[jax.ShapeDtypeStruct((S, b * t, hk, gp, d), _F32),
                   jax.ShapeDtypeStruct((S, b * t, hk, gp), _F32)],
        compiler_params=triton_compiler_params(
            KernelConfig(num_warps=config.num_warps, num_stages=config.num_stages), d,
            interpret),
        interpret=interpret,
        debug=debug,
        name="dilax_decode",
    )(pos, qg, k_cache, v_cache, *operands)
    out, lse = _merge_splits(out, lse)
    return (out[:, :, :G].reshape(b, t, h, d), lse[:, :, :G].reshape(b, t, h))


def decode_reference(q, k_cache, v_cache, positions, *, branches: tuple[DecodeBranch, ...],
                     scale: float) -> tuple[jax.Array, jax.Array]:
    """:func:`decode_attention` in plain ``jax.numpy``: every branch's window gathered
    (``(b, t, window)`` rows), one masked softmax over their concatenation; float32 logits
    at full matmul precision."""
    b, t, h, d = q.shape
    L, hk = k_cache.shape[1], k_cache.shape[2]
    pos = jnp.asarray(positions, jnp.int32)
    head = jnp.arange(h, dtype=jnp.int32)[None, None]  # (1, 1, h)
    logits, values = [], []
    for br in branches:
        start, count = br.keys(pos)
        j = jnp.arange(br.window, dtype=jnp.int32)[None, None]  # (1, 1, m): no rank promotion
        idx = jnp.minimum(start[..., None] + br.stride * j, L - 1)  # (b, t, m)
        rows = jnp.arange(b)[:, None, None]
        kw = jnp.repeat(k_cache[rows, idx], h // hk, axis=3)  # (b, t, m, h, d)
        vw = jnp.repeat(v_cache[rows, idx], h // hk, axis=3)
        s = jnp.einsum("bthd,btmhd->bthm", q, kw, preferred_element_type=_F32,
                       precision=lax.Precision.HIGHEST) * scale
        ok = (j < count[..., None])[:, :, None, :] & br.selects(pos[..., None], head)[..., None]
        logits.append(jnp.where(ok, s, _NEG_INF))
        values.append(vw.astype(_F32))
    s = jnp.concatenate(logits, axis=-1)
    lse = jax.nn.logsumexp(s, axis=-1)
    finite = jnp.isfinite(lse)
    prob = jnp.where(finite[..., None], jnp.exp(s - jnp.where(finite, lse, 0.0)[..., None]), 0.0)
    out = jnp.einsum("bthm,btmhd->bthd", prob, jnp.concatenate(values, axis=2),
                     precision=lax.Precision.HIGHEST)
    return out, jnp.where(finite, lse, _NEG_INF)
