"""The one attention core: blockwise, online softmax, float32 statistics, returns LSE.

Dilated, block-sparse and ring attention all reduce to calls of :func:`attention_core` plus
:func:`merge_attention_states`. The core never materializes a (query, key) matrix larger than
one ``(block_q, block_k)`` pair per head, in the forward or in the backward pass: the backward
is a ``jax.custom_vjp`` that recomputes each block from the saved log-sum-exp (the
FlashAttention-2 recipe, written for XLA).

Layout: queries are grouped by their key/value head, ``q: (B, Lq, Hk, G, d)``, with
``k, v: (B, Lk, Hk, d)``; query head ``(c, g)`` reads kv head ``c``. GQA/MQA therefore never
repeats K/V in memory.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Block sizes of the blockwise core (static, hashable).

    The forward visits key blocks of ``block_k`` for a row of ``block_q`` queries; the backward
    visits query blocks of ``block_q_dkv`` for a column of ``block_k_dkv`` keys. On CPU the
    iterated block should be short and the row/column long, so that every step is a few
    million multiply-adds that XLA spreads over all cores.

    Fields: ``block_q`` (forward query rows per step), ``block_k`` (forward keys per step),
    ``block_q_dkv`` / ``block_k_dkv`` (backward query / key block; ``None``: ``block_k`` /
    ``block_q``), ``heads_per_step`` (query heads of one forward step; ``None``: all heads; a
    kv head's query heads always stay together). All positive ints; blocks larger than the
    sequence are clipped to it. Use :func:`default_block_sizes` for the per-shape defaults.
    """

    block_q: int = 1024
    block_k: int = 256
    block_q_dkv: int | None = None  # default: block_k
    block_k_dkv: int | None = None  # default: block_q
    heads_per_step: int | None = None  # default: all heads

    def __post_init__(self):
        for name in ("block_q", "block_k", "block_q_dkv", "block_k_dkv", "heads_per_step"):
            value = getattr(self, name)
            if value is None and name != "block_q" and name != "block_k":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"BlockSizes.{name} must be a positive int, got {value!r}")

    @property
    def backward(self) -> tuple[int, int]:
        """``(block_q_dkv, block_k_dkv)``."""
        bq = self.block_q_dkv if self.block_q_dkv is not None else self.block_k
        bk = self.block_k_dkv if self.block_k_dkv is not None else self.block_q
        return bq, bk


_SCORE_BUDGET = 1 << 21  # causal: floats in one (heads, rows, block) score tile, 8 MiB
_FWD_TILE = 1 << 22  # non-causal forward score tile (heads, block_q, block_k): 16 MiB
_FWD_HEADS = 4  # non-causal forward: query heads per step
_BWD_TILE = 1 << 20  # non-causal backward tile: s, p, dp and ds are live at once


def _pow2_at_most(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def _clamp(x: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, x))


def default_block_sizes(len_q: int, len_k: int, num_heads: int, is_causal: bool) -> BlockSizes:
    """Per-shape defaults tuned on a 2-core x86 CPU (AVX-512) with ``python -m benchmarks
    speed`` and per-tile sweeps at segment length 2048.

    Non-causal: the forward takes up to 4 query heads at a time, 2048 query rows against 512
    keys (1024 for one head): large per-head products amortize the loop and let XLA split
    each step over the cores, and splitting the heads keeps the tile (~16 MiB) from growing
    with the head count. The backward iterates 128-query blocks against a column of up to
    2048 keys, ~4 MiB per tile over all heads because four tiles are live at once.
    Causal: 256 against up to 512 so that blocks entirely in the future are skipped at a fine
    grain, all heads per step.
    """
    h = max(1, num_heads)
    if is_causal:
        short = 256
        long = max(short, min(512, _pow2_at_most(_SCORE_BUDGET // (h * short))))
        bq, bk, bq_dkv, bk_dkv, per_step = long, short, short, long, None
    else:
        per_step = min(h, _FWD_HEADS)
        bk = 1024 if per_step == 1 else 512
        bq = _clamp(_pow2_at_most(_FWD_TILE // (per_step * bk)), 256, 2048)
        bq_dkv = 128
        bk_dkv = _clamp(_pow2_at_most(_BWD_TILE // (h * bq_dkv)), 256, 2048)
        per_step = per_step if per_step < h else None
    return BlockSizes(min(bq, len_q), min(bk, len_k), min(bq_dkv, len_q), min(bk_dkv, len_k),
                      per_step)


def _cdiv(a, b):
    return (a + b - 1) // b


def _head_groups(num_kv: int, q_per_kv: int, heads_per_step: int | None):
    """Static ``(u0, u1)`` ranges of virtual kv heads processed together, as even as possible,
    each with at most ``heads_per_step`` query heads (at least one kv head)."""
    if heads_per_step is None:
        return ((0, num_kv),)
    per = max(1, heads_per_step // q_per_kv)
    count = _cdiv(num_kv, per)
    size = _cdiv(num_kv, count)
    return tuple((u, min(num_kv, u + size)) for u in range(0, num_kv, size))


def _pad_axis(x, axis, size):
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def static_take(x: jax.Array, indices: tuple[int, ...], axis: int) -> jax.Array:
    """``jnp.take`` with static indices as strided slices + one concatenate (no gather)."""
    if tuple(indices) == tuple(range(x.shape[axis])):
        return x
    pieces, i = [], 0
    while i < len(indices):
        start = indices[i]
        stride = indices[i + 1] - start if i + 1 < len(indices) else 1
        j = i + 1
        if stride > 0:
            while j < len(indices) and indices[j] - indices[j - 1] == stride:
                j += 1
        if j == i + 1:
            stride = 1
        pieces.append(lax.slice_in_dim(x, start, indices[j - 1] + 1, stride, axis))
        i = j
    return pieces[0] if len(pieces) == 1 else lax.concatenate(pieces, axis)


@dataclasses.dataclass(frozen=True)
class SlotView:
    """Static view that lets the core read dilated rows in place (no gathered copies).

    Inputs are ``q: (B, L, R, H, d)`` and ``k, v: (B, L, R, Hk, d)``: a sequence reshaped so that
    axis 2 is the position modulo the dilation rate ("slot"). Virtual query head ``(u, g)``
    reads flat index ``q_index[u * G + g] = slot * H + head`` and virtual kv head ``u`` reads
    ``kv_index[u] = slot * Hk + kv_head``. Every head appears at most once in ``q_index``; the
    output covers the heads of ``q_index`` in ascending order at their slot (zeros and
    ``lse = -inf`` at the other slots).
    """

    num_slots: int
    num_heads: int
    num_kv_heads: int
    q_index: tuple[int, ...]
    kv_index: tuple[int, ...]

    @property
    def q_per_kv(self) -> int:
        return len(self.q_index) // len(self.kv_index)

    def sub_view(self, u0: int, u1: int) -> SlotView:
        """The view of virtual kv heads ``u0 .. u1 - 1`` (and their query heads)."""
        G = self.q_per_kv
        return SlotView(self.num_slots, self.num_heads, self.num_kv_heads,
                        self.q_index[u0 * G:u1 * G], self.kv_index[u0:u1])

    def group_order(self, groups) -> tuple[int, ...]:
        """Where each of ``out_heads`` is in the concatenated ``expand_q`` outputs of the
        ``sub_view`` of each ``(u0, u1)`` in ``groups``."""
        cat = [h for u0, u1 in groups for h in self.sub_view(u0, u1).out_heads]
        return tuple(cat.index(h) for h in self.out_heads)

    @property
    def out_heads(self) -> tuple[int, ...]:
        return tuple(sorted(i % self.num_heads for i in self.q_index))

    @functools.cached_property
    def _out_order(self) -> tuple[int, ...]:
        heads = [i % self.num_heads for i in self.q_index]
        return tuple(sorted(range(len(heads)), key=heads.__getitem__))

    # With one slot the arrays carry no slot axis at all: a size-1 axis makes XLA's layout
    # assignment copy whole inputs before the loops.

    def _flat(self, x, heads):
        if self.num_slots == 1:
            return x
        return x.reshape(x.shape[0], self.num_slots * heads, *x.shape[3:])

    def _unflat(self, x, heads):
        if self.num_slots == 1:
            return x
        return x.reshape(x.shape[0], self.num_slots, heads, *x.shape[2:])

    def select_q(self, x):
        """``(bq, [R,] H, ...)`` -> ``(U, G, bq, ...)``."""
        x = static_take(self._flat(x, self.num_heads), self.q_index, axis=1)
        x = x.reshape(x.shape[0], len(self.kv_index), self.q_per_kv, *x.shape[2:])
        return jnp.moveaxis(x, 0, 2)

    def select_kv(self, x):
        """``(bk, [R,] Hk, d)`` -> ``(U, bk, d)``."""
        x = static_take(self._flat(x, self.num_kv_heads), self.kv_index, axis=1)
        return jnp.moveaxis(x, 1, 0)

    def expand_q(self, x):
        """``(U, G, bq, ...)`` -> ``(bq, H_out, ...)``: heads ascending, each on its own rows."""
        x = jnp.moveaxis(x, 2, 0)
        x = x.reshape(x.shape[0], len(self.q_index), *x.shape[3:])
        return static_take(x, self._out_order, axis=1)

    def output_view(self) -> SlotView:
        """The view that reads the ``(.., H_out, ..)`` output layout back as ``(U, G, ..)``."""
        out_heads = self.out_heads
        return SlotView(1, len(out_heads), self.num_kv_heads,
                        tuple(out_heads.index(i % self.num_heads) for i in self.q_index),
                        self.kv_index)

    def expand_kv(self, x):
        """``(U, bk, d)`` -> ``(bk, [R,] Hk, d)``; (slot, kv head) pairs that no virtual head
        reads get 0."""
        return self._unflat(_scatter_static(jnp.moveaxis(x, 0, 1), self.kv_index,
                                            self.num_slots * self.num_kv_heads),
                            self.num_kv_heads)

    def expand_rows_q(self, x):
        """``(L, U * G, d)`` -> ``(L, [R,] H, d)`` over *all* heads (0 for heads not read)."""
        return self._unflat(_scatter_static(x, self.q_index, self.num_slots * self.num_heads),
                            self.num_heads)


def _scatter_static(x, index, size):
    """``y[:, f] = sum_{i: index[i] == f} x[:, i]`` into ``size`` zero-initialized entries.

    Static indices; repeated ones (several virtual kv heads reading the same kv head at the
    same slot, as in uneven GQA splits) are summed.
    """
    if tuple(index) == tuple(range(size)):
        return x
    occurrences: dict[int, list[int]] = {}
    for i, f in enumerate(index):
        occurrences.setdefault(f, []).append(i)
    total = None
    for level in range(max(len(v) for v in occurrences.values())):
        src = {f: v[level] for f, v in occurrences.items() if len(v) > level}
        part = static_take(x, tuple(src.get(f, 0) for f in range(size)), axis=1)
        used = np.array([f in src for f in range(size)]).reshape((1, size) + (1,) * (x.ndim - 2))
        part = jnp.where(used, part, jnp.zeros((), x.dtype))
        total = part if total is None else total + part
    return total


def identity_view(num_kv_heads: int, q_per_kv: int) -> SlotView:
    h = num_kv_heads * q_per_kv
    return SlotView(1, h, num_kv_heads, tuple(range(h)), tuple(range(num_kv_heads)))


def _mask(k_start, block_k, kv_len, q_pos, k_offset, is_causal):
    """Allowed ``(U or 1, 1, bq or 1, bk)`` mask of one block pair (``kv_len`` may be None)."""
    k_idx = k_start + lax.iota(jnp.int32, block_k)
    mask = None
    if kv_len is not None:
        mask = (k_idx[None, :] < kv_len[:, None])[:, None, None, :]
    if is_causal:
        c = ((k_offset + k_idx)[None, :] <= q_pos[:, None])[None, None]
        mask = c if mask is None else mask & c
    return mask


def _zero_invalid_keys(x, k_start, kv_len):
    """Zeroes rows of ``x: (U, bk, d)`` at or beyond ``kv_len`` (NaN padding never leaks)."""
    if kv_len is None:
        return x
    valid = (k_start + lax.iota(jnp.int32, x.shape[1]))[None, :] < kv_len[:, None]
    return jnp.where(valid[..., None], x, jnp.zeros((), x.dtype))


def _varying_axes(*refs) -> tuple:
    axes = set()
    for ref in refs:
        if ref is not None:
            aval = jax.typeof(ref)
            manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
            axes |= set(manual.varying if manual is not None else getattr(aval, "vma", ()))
    return tuple(sorted(axes))


def _varying_like(axes, *xs):
    """Gives fresh loop-carry values the device-varying type ``axes`` under ``shard_map``.

    Inside ``jax.shard_map`` (with ``check_vma``), a ``fori_loop`` carry must keep its type, so
    zeros created for it have to be marked varying over the mesh axes its updates vary over.
    """
    if not axes:
        return xs
    return tuple(lax.pcast(x, axes, to="varying") for x in xs)


def _scaled(qb, scale):
    """``q * scale``: in place for float32; half types are widened first so the logits match
    a float32 computation (rounding ``q * scale`` to bf16 would shift every score)."""
    if qb.dtype == _F32:
        return qb * jnp.asarray(scale, _F32)
    return qb.astype(_F32) * jnp.asarray(scale, _F32)


def _slice_rows(x, b, start, size):
    """``x[b, start:start+size]`` for ``x: (B, L, ...)``."""
    return lax.dynamic_slice(x, (b, start) + (0,) * (x.ndim - 2), (1, size) + x.shape[2:])[0]


def _forward(q, k, v, kv_len, q_offset, k_offset, scale, is_causal, view, block_q, block_k,
             out_dtype=None, heads_per_step=None):
    B, Lq = q.shape[:2]
    Lk, d = k.shape[1], k.shape[-1]
    U, G = len(view.kv_index), view.q_per_kv
    nq, nk = _cdiv(Lq, block_q), _cdiv(Lk, block_k)
    qp = _pad_axis(q, 1, nq * block_q)
    kp = _pad_axis(k, 1, nk * block_k)
    vp = _pad_axis(v, 1, nk * block_k)
    if kv_len is None and nk * block_k != Lk:
        kv_len = jnp.full((B, U), Lk, jnp.int32)
    axes = _varying_axes(q, k, v, kv_len, q_offset, k_offset)

    groups = _head_groups(U, G, heads_per_step)

    def row(idx):
        if len(groups) == 1:
            return row_heads(idx, view, 0, U)
        # One loop per head group: per-head products stay large while the tile stays small.
        parts = [row_heads(idx, view.sub_view(u0, u1), u0, u1) for u0, u1 in groups]
        order = view.group_order(groups)
        return tuple(static_take(jnp.concatenate(x, axis=1), order, axis=1)
                     for x in zip(*parts))

    def row_heads(idx, view, u0, u1):
        U = u1 - u0
        bi, qi = idx // nq, idx % nq
        qb = view.select_q(_slice_rows(qp, bi, qi * block_q, block_q))  # (U, G, bq, d)
        qb = _scaled(qb, scale)
        kl = None if kv_len is None else kv_len[bi, u0:u1]
        q_first = q_offset + qi * block_q
        q_pos = q_first + lax.iota(jnp.int32, block_q)
        hi = nk if kl is None else jnp.minimum(nk, _cdiv(jnp.max(kl), block_k))
        if is_causal:
            last = q_first + block_q - 1 - k_offset
            hi = jnp.clip(jnp.where(last >= 0, last // block_k + 1, 0), 0, hi)
            # Key blocks entirely at or before the first query need no causal mask.
            full = jnp.clip(jnp.where(q_first - k_offset + 1 >= 0,
                                      (q_first - k_offset + 1) // block_k, 0), 0, hi)
        else:
            full = hi

        def make_body(causal_block):
            def body(j, carry):
                m, l, acc = carry
                k0 = j * block_k
                kb = view.select_kv(_slice_rows(kp, bi, k0, block_k))  # (U, bk, d)
                vb = view.select_kv(_slice_rows(vp, bi, k0, block_k))
                s = jnp.einsum("hgqd,hkd->hgqk", qb, kb, preferred_element_type=_F32)
                mask = _mask(k0, block_k, kl, q_pos, k_offset, causal_block)
                if mask is not None:
                    s = jnp.where(mask, s, -jnp.inf)
                    vb = _zero_invalid_keys(vb, k0, kl)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                p = jnp.exp(s - m_safe[..., None])
                corr = jnp.exp(m - m_safe)
                l = l * corr + jnp.sum(p, axis=-1)
                pv = jnp.einsum("hgqk,hkd->hgqd", p, vb.astype(_F32),
                                preferred_element_type=_F32)
                return m_new, l, acc * corr[..., None] + pv

            return body

        carry = _varying_like(
            axes,
            jnp.full((U, G, block_q), -jnp.inf, _F32),
            jnp.zeros((U, G, block_q), _F32),
            jnp.zeros((U, G, block_q, d), _F32),
        )
        carry = lax.fori_loop(0, full, make_body(False), carry)
        if is_causal:
            carry = lax.fori_loop(full, hi, make_body(True), carry)
        m, l, acc = carry
        has_key = l > 0
        out = acc / jnp.where(has_key, l, 1.0)[..., None]
        lse = jnp.where(has_key, m + jnp.log(jnp.where(has_key, l, 1.0)), -jnp.inf)
        return view.expand_q(out.astype(out_dtype or q.dtype)), view.expand_q(lse)

    out, lse = lax.map(row, jnp.arange(B * nq, dtype=jnp.int32))
    out = out.reshape(B, nq * block_q, *out.shape[2:])[:, :Lq]
    lse = lse.reshape(B, nq * block_q, *lse.shape[2:])[:, :Lq]
    return out, lse


def _backward(q, k, v, kv_len, q_offset, k_offset, out, lse, dout, dlse, scale, is_causal,
              view, block_q, block_k, grad_dtype=None, delta=None, acc=None):
    B, Lq = q.shape[:2]
    Lk, d = k.shape[1], k.shape[-1]
    U, G = len(view.kv_index), view.q_per_kv
    nq, nk = _cdiv(Lq, block_q), _cdiv(Lk, block_k)
    # delta = rowsum(dO * O) - dlse: the lse cotangent enters ds exactly like -delta.
    if delta is None:
        delta = output_delta(out, dout, dlse)
    lse_safe = jnp.where(lse == -jnp.inf, 0.0, lse)
    pad_q = functools.partial(_pad_axis, axis=1, size=nq * block_q)
    qp, dop, lsep, deltap = pad_q(q), pad_q(dout), pad_q(lse_safe), pad_q(delta)
    kp = _pad_axis(k, 1, nk * block_k)
    vp = _pad_axis(v, 1, nk * block_k)
    if kv_len is None and nk * block_k != Lk:
        kv_len = jnp.full((B, U), Lk, jnp.int32)
    axes = _varying_axes(q, k, v, kv_len, q_offset, k_offset, dout, dlse)
    out_view = view.output_view()  # reads dout, lse, delta (output layout) per block

    # float32 accumulators in the input layouts, padded to whole blocks; ``acc`` (gradients
    # of earlier branches) is added into in place, so a branch needs no gradient buffers of
    # its own. Heads/slots the view does not read receive zeros.
    if acc is None:
        acc = _varying_like(axes, *(jnp.zeros(x.shape, _F32) for x in (q, k, v)))
    dq0 = _pad_axis(acc[0].astype(_F32), 1, nq * block_q)
    dk0 = _pad_axis(acc[1].astype(_F32), 1, nk * block_k)
    dv0 = _pad_axis(acc[2].astype(_F32), 1, nk * block_k)

    def add_rows(x, b, start, block):
        cur = lax.dynamic_slice(x, (b, start) + (0,) * (x.ndim - 2), (1,) + block.shape)
        return lax.dynamic_update_slice(x, cur + block[None], (b, start) + (0,) * (x.ndim - 2))

    def column(carry, idx):
        dq, dk_acc, dv_acc = carry
        bi, kj = idx // nk, idx % nk
        k0 = kj * block_k
        kl = None if kv_len is None else kv_len[bi]
        kb = _zero_invalid_keys(view.select_kv(_slice_rows(kp, bi, k0, block_k)), k0, kl)
        vb = _zero_invalid_keys(view.select_kv(_slice_rows(vp, bi, k0, block_k)), k0, kl)
        hi = nq if kl is None else jnp.where(k0 < jnp.max(kl), nq, 0)
        if is_causal:
            lo = jnp.clip((k_offset + k0 - q_offset) // block_q, 0, nq)
            # Query blocks whose first query sees the whole key block need no causal mask.
            full_lo = jnp.clip(_cdiv(k_offset + k0 + block_k - 1 - q_offset, block_q), lo, nq)
        else:
            lo = full_lo = 0
        hi = jnp.maximum(hi, lo)
        full_lo = jnp.minimum(full_lo, hi)

        def make_body(causal_block):
            def body(qi, carry):
                dk, dv, dq = carry
                q0 = qi * block_q
                qb = _scaled(view.select_q(_slice_rows(qp, bi, q0, block_q)), scale)
                dob = out_view.select_q(_slice_rows(dop, bi, q0, block_q))
                lse_b = out_view.select_q(_slice_rows(lsep, bi, q0, block_q))
                del_b = out_view.select_q(_slice_rows(deltap, bi, q0, block_q))
                s = jnp.einsum("hgqd,hkd->hgqk", qb, kb, preferred_element_type=_F32)
                q_pos = q_offset + q0 + lax.iota(jnp.int32, block_q)
                mask = _mask(k0, block_k, kl, q_pos, k_offset, causal_block)
                if mask is not None:
                    s = jnp.where(mask, s, -jnp.inf)
                p = jnp.exp(s - lse_b[..., None])  # (U, G, bq, bk); masked -> 0
                dv = dv + jnp.einsum("hgqk,hgqd->hkd", p, dob.astype(_F32),
                                     preferred_element_type=_F32)
                dp = jnp.einsum("hgqd,hkd->hgqk", dob, vb, preferred_element_type=_F32)
                # ds stays float32: rounding it to bf16 before the sums over many query
                # heads (GQA/MQA) and branches costs ~1e-2 relative in dK.
                ds = p * (dp - del_b[..., None])
                dk = dk + jnp.einsum("hgqk,hgqd->hkd", ds, qb.astype(_F32),
                                     preferred_element_type=_F32)
                dq_b = jnp.einsum("hgqk,hkd->qhgd", ds, kb.astype(_F32),
                                  preferred_element_type=_F32)
                dq_b = view.expand_rows_q(dq_b.reshape(block_q, U * G, d) * scale)
                dq = add_rows(dq, bi, q0, dq_b)
                return dk, dv, dq

            return body

        carry = _varying_like(axes, jnp.zeros((U, block_k, d), _F32),
                              jnp.zeros((U, block_k, d), _F32)) + (dq,)
        if is_causal:
            carry = lax.fori_loop(lo, full_lo, make_body(True), carry)
            carry = lax.fori_loop(full_lo, hi, make_body(False), carry)
        else:
            carry = lax.fori_loop(lo, hi, make_body(False), carry)
        dk, dv, dq = carry
        dk_acc = add_rows(dk_acc, bi, k0, view.expand_kv(dk))
        dv_acc = add_rows(dv_acc, bi, k0, view.expand_kv(dv))
        return (dq, dk_acc, dv_acc), None

    (dq, dk, dv), _ = lax.scan(column, (dq0, dk0, dv0), jnp.arange(B * nk, dtype=jnp.int32))
    return (dq[:, :Lq].astype(grad_dtype or q.dtype), dk[:, :Lk].astype(grad_dtype or k.dtype),
            dv[:, :Lk].astype(grad_dtype or v.dtype))


def fence_after(x: jax.Array) -> jax.Array:
    """A boolean scalar that is always true but that XLA only knows once ``x`` exists.

    ``x0 <= inf or isnan(x0)`` cannot be constant-folded. Work run under :func:`when` with it
    is ordered after ``x``: XLA:CPU's default (concurrency-optimized) scheduler would otherwise
    start independent work -- and allocate its buffers -- as early as possible, and
    ``lax.optimization_barrier`` does not survive to its scheduler."""
    x0 = lax.stop_gradient(jnp.ravel(x)[0])
    return (x0 <= jnp.inf) | jnp.isnan(x0)


def when(fence, fn, operands: tuple):
    """``fn(*operands)``, inside a ``lax.cond`` on ``fence`` (:func:`fence_after`) if given.

    Nothing of ``fn`` can be hoisted out of the conditional, so its working buffers are
    allocated only once ``fence`` is known. Use it on primal computations only (inside a
    ``custom_vjp``): differentiating through the cond would copy its inputs as residuals."""
    if fence is None:
        return fn(*operands)
    skip = lambda ops: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                                    jax.eval_shape(lambda o: fn(*o), ops))
    return lax.cond(fence, lambda ops: fn(*ops), skip, operands)


# blocks = (block_q, block_k, block_q_dkv, block_k_dkv, out_dtype or None, heads_per_step):
# all static.
# fence: None or a boolean from fence_after (ordering only; see when()).
@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _core(q, k, v, kv_len, q_offset, k_offset, fence, scale, is_causal, view, blocks):
    fwd = lambda *a: _forward(*a, scale, is_causal, view, *blocks[:2], *blocks[4:])
    return when(fence, fwd, (q, k, v, kv_len, q_offset, k_offset))


def _core_fwd(q, k, v, kv_len, q_offset, k_offset, fence, scale, is_causal, view, blocks):
    out, lse = _core(q, k, v, kv_len, q_offset, k_offset, fence, scale, is_causal, view,
                     blocks)
    return (out, lse), (q, k, v, kv_len, q_offset, k_offset, fence, out, lse)


def _core_bwd(scale, is_causal, view, blocks, res, cotangents):
    q, k, v, kv_len, q_offset, k_offset, fence, out, lse = res
    dout, dlse = cotangents
    bwd = lambda *a: _backward(*a, scale, is_causal, view, *blocks[2:4])
    dq, dk, dv = when(fence, bwd, (q, k, v, kv_len, q_offset, k_offset, out, lse, dout, dlse))
    # Under shard_map an input that is invariant over a mesh axis (e.g. replicated K/V) gets
    # the sum of the per-device cotangents: the transpose of its implicit broadcast.
    grads = []
    for primal, grad in ((q, dq), (k, dk), (v, dv)):
        extra = tuple(a for a in _varying_axes(grad) if a not in _varying_axes(primal))
        grads.append(lax.psum(grad, extra) if extra else grad)
    return (*grads, None, None, None, None)


_core.defvjp(_core_fwd, _core_bwd)


def attention_view(q, k, v, view: SlotView, *, scale: float, is_causal: bool = False,
                   kv_len=None, q_offset=0, k_offset=0, block_sizes: BlockSizes | None = None,
                   out_dtype=None, fence=None):
    """The core on a :class:`SlotView`: ``q (B, Lq, R, H, d)``, ``k, v (B, Lk, R, Hk, d)``.

    Returns ``out (B, Lq, H_out, d)`` and ``lse (B, Lq, H_out)`` for the heads of the view
    (ascending): row ``i`` of head ``j`` is the query at row ``i`` of ``j``'s slot, i.e. the
    dilated layout. ``kv_len``: ``(B, U)`` or None. ``out_dtype`` (default ``q.dtype``): e.g.
    float32 when the caller merges partial results before rounding to a half type.
    With ``R = 1`` every array drops the slot axis: ``q (B, Lq, H, d)`` and so on.
    ``fence``: run forward and backward only after it is known (:func:`fence_after`).
    """
    kv_len, q_offset, k_offset, blocks = _view_args(q, k, view, is_causal, kv_len, q_offset,
                                                    k_offset, block_sizes, out_dtype)
    return _core(q, k, v, kv_len, q_offset, k_offset, fence, float(scale), bool(is_causal),
                 view, blocks)


def _view_args(q, k, view, is_causal, kv_len, q_offset, k_offset, block_sizes, out_dtype):
    B, Lq = q.shape[:2]
    Lk = k.shape[1]
    U = len(view.kv_index)
    if block_sizes is None:
        block_sizes = default_block_sizes(Lq, Lk, len(view.q_index), bool(is_causal))
    bq_dkv, bk_dkv = block_sizes.backward
    blocks = (min(block_sizes.block_q, Lq), min(block_sizes.block_k, Lk), min(bq_dkv, Lq),
              min(bk_dkv, Lk), None if out_dtype is None else jnp.dtype(out_dtype),
              block_sizes.heads_per_step)
    if kv_len is not None:
        kv_len = jnp.minimum(jnp.broadcast_to(jnp.asarray(kv_len, jnp.int32), (B, U)), Lk)
    return kv_len, jnp.asarray(q_offset, jnp.int32), jnp.asarray(k_offset, jnp.int32), blocks


def view_forward(q, k, v, view: SlotView, *, scale: float, is_causal: bool = False,
                 kv_len=None, block_sizes: BlockSizes | None = None, out_dtype=None):
    """:func:`attention_view`'s forward pass as a plain function (no ``custom_vjp``), for
    hand-written backward passes that call :func:`view_backward` (e.g. several branches
    accumulating their gradients in float32)."""
    kv_len, q_off, k_off, blocks = _view_args(q, k, view, is_causal, kv_len, 0, 0, block_sizes,
                                              out_dtype)
    return _forward(q, k, v, kv_len, q_off, k_off, float(scale), bool(is_causal), view,
                    *blocks[:2], *blocks[4:])


def output_delta(out, dout, dlse):
    """``rowsum(dO * O) - dlse`` (float32): all the backward pass needs of ``out``."""
    return jnp.sum(dout.astype(_F32) * out.astype(_F32), axis=-1) - dlse.astype(_F32)


def view_backward(q, k, v, view: SlotView, delta, lse, dout, *, scale: float,
                  is_causal: bool = False, kv_len=None, block_sizes: BlockSizes | None = None,
                  grad_dtype=None, acc=None):
    """Gradients ``(dq, dk, dv)`` of :func:`view_forward` in the input (slot) layouts, in
    ``grad_dtype`` (default: the input dtypes), recomputing blocks from ``lse``.
    ``delta = output_delta(out, dout, dlse)``: the output itself is not needed.
    ``acc``: optional ``(dq, dk, dv)`` in the input layouts (e.g. earlier branches'
    gradients) that the gradients are added into, in float32, without buffers of their own."""
    kv_len, q_off, k_off, blocks = _view_args(q, k, view, is_causal, kv_len, 0, 0, block_sizes,
                                              None)
    return _backward(q, k, v, kv_len, q_off, k_off, None, lse, dout, None, float(scale),
                     bool(is_causal), view, *blocks[2:4], grad_dtype, delta, acc)


def attention_core(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: float,
    is_causal: bool = False,
    kv_len: jax.Array | None = None,
    q_offset: jax.Array | int = 0,
    k_offset: jax.Array | int = 0,
    block_sizes: BlockSizes | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Blockwise exact attention returning ``(out, lse)``.

    Args:
      q: ``(B, Lq, Hk, G, d)`` queries grouped by kv head.
      k, v: ``(B, Lk, Hk, d)``.
      scale: logit scale (static float).
      is_causal: key ``t`` is visible to query ``p`` iff ``k_offset + t <= q_offset + p``.
      kv_len: int, broadcastable to ``(B, Hk)``; keys at index ``>= kv_len`` are masked.
        ``None`` (default) means all ``Lk`` keys are valid and skips the mask entirely.
      q_offset, k_offset: global positions of index 0 (int scalars, may be traced).
      block_sizes: static block sizes; default :func:`default_block_sizes`.

    Returns:
      ``out: (B, Lq, Hk, G, d)`` in ``q.dtype`` and ``lse: (B, Lq, Hk, G)`` float32. A query
      with no visible key gets ``out = 0`` and ``lse = -inf`` (zero gradient, never NaN).
    """
    B, Lq, Hk, G, d = q.shape
    view = identity_view(Hk, G)
    out, lse = attention_view(
        q.reshape(B, Lq, Hk * G, d), k, v, view, scale=scale,
        is_causal=is_causal, kv_len=kv_len, q_offset=q_offset, k_offset=k_offset,
        block_sizes=block_sizes)
    return out.reshape(B, Lq, Hk, G, d), lse.reshape(B, Lq, Hk, G)


def attention_core_bwd(q, k, v, kv_len, q_offset, k_offset, out, lse, dout, dlse, scale,
                       is_causal, block_q, block_k):
    """The core's backward pass as a function, in :func:`attention_core`'s layout.

    ``q, out, dout: (B, Lq, Hk, G, d)``, ``lse, dlse: (B, Lq, Hk, G)``, ``k, v: (B, Lk, Hk, d)``;
    ``block_q, block_k`` are the backward's (query, key) block sizes. Returns ``(dq, dk, dv)``
    in the input dtypes. Used by hand-written backward passes (ring attention) that must
    recompute one block pair at a time.
    """
    B, Lq, Hk, G, d = q.shape
    H = Hk * G
    if kv_len is not None:
        kv_len = jnp.broadcast_to(jnp.asarray(kv_len, jnp.int32), (B, Hk))
    dq, dk, dv = _backward(
        q.reshape(B, Lq, H, d), k, v, kv_len, jnp.asarray(q_offset, jnp.int32),
        jnp.asarray(k_offset, jnp.int32), out.reshape(B, Lq, H, d), lse.reshape(B, Lq, H),
        dout.reshape(B, Lq, H, d), dlse.reshape(B, Lq, H), scale, is_causal,
        identity_view(Hk, G), min(block_q, Lq), min(block_k, k.shape[1]))
    return dq.reshape(q.shape), dk, dv


def merge_attention_states(
    out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Combines two partial softmax results over disjoint key multisets.

    ``out = (e^{lse_a} out_a + e^{lse_b} out_b) / (e^{lse_a} + e^{lse_b})`` computed stably in
    float32; ``lse = logaddexp(lse_a, lse_b)``. Rows with ``lse = -inf`` on both sides stay
    ``(0, -inf)``; gradients stay finite. ``out_*``: ``(..., d)``, ``lse_*``: ``(...)``.
    """
    m = jnp.maximum(lse_a, lse_b)
    m_safe = lax.stop_gradient(jnp.where(m == -jnp.inf, 0.0, m))
    ea = jnp.exp(lse_a - m_safe)
    eb = jnp.exp(lse_b - m_safe)
    total = ea + eb
    nonzero = total > 0
    total_safe = jnp.where(nonzero, total, 1.0)
    out = (ea / total_safe)[..., None] * out_a.astype(_F32) + (eb / total_safe)[
        ..., None
    ] * out_b.astype(_F32)
    lse = jnp.where(nonzero, m_safe + jnp.log(total_safe), -jnp.inf)
    return out, lse
