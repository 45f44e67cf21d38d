"""Building blocks shared by the flash and block-sparse kernels.

In-kernel pieces (masked dots, the online-softmax key loop, the dq and dk/dv loops, the loop
over a kv head's query heads) and the host-side helpers around every ``pallas_call``
(padding, the backward's ``lse``/``delta`` rows, layout checks).
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.config import MIN_BLOCK, next_power_of_2
from pallas_kernels.platform import require_platform

_F32 = jnp.float32
_NEG_INF = float("-inf")
_POS_INF = float("inf")


def _dot(a, b, contract_a: int, contract_b: int):
    """2-D matmul contracting ``a``'s axis ``contract_a`` with ``b``'s, float32 accumulation.

    No explicit precision: float32 inputs follow JAX's default matmul precision
    (``jax.default_matmul_precision``), i.e. TF32 tensor-core dots on GPU unless the user asks
    for ``"highest"`` (IEEE float32 on the FMA units, several times slower, and register
    spills at large tiles), exactly like the XLA core. bf16/fp16 are unaffected."""
    return lax.dot_general(
        a, b, (((contract_a,), (contract_b,)), ((), ())), preferred_element_type=_F32,
    )


NEEDS_GPU = ("the Pallas kernels compile Triton code for a GPU: pass interpret=True to run "
             "them in the Pallas interpreter, or use implementation='xla' (dilax's blockwise "
             "XLA core, any platform)")


def gpu_only(x, interpret):
    """``x``, checked at lowering to target a GPU unless the kernels are interpreted."""
    return x if interpret else require_platform(x, NEEDS_GPU)


def arange_i32(n: int):
    return jnp.arange(n, dtype=jnp.int32)


def cdiv_nonneg(a, b: int):
    """``ceil(a / b)`` for traced ``a >= 0`` (``lax.div`` truncates, which is safe for Triton)."""
    return lax.div(a + (b - 1), jnp.int32(b))


def floordiv_clamped(a, b: int):
    """``max(a, 0) // b`` for traced ints."""
    return lax.div(jnp.maximum(a, 0), jnp.int32(b))


def key_mask(q_pos, k_idx, kv_len, k_offset, is_causal: bool, window=None, k_valid=None):
    """``(bq, bk)`` visibility of keys ``k_idx`` (local indices) for queries at global ``q_pos``.

    ``window``: static ``(left, right)`` band ``-left <= (k_offset + t) - p <= right`` or
    ``None``; ``k_valid``: ``(bk,)`` bool per-key validity or ``None``."""
    mask = (k_idx < kv_len)[None, :]
    if k_valid is not None:
        mask = mask & k_valid[None, :]
    if window is not None:  # causality is the band's right edge at 0
        left, right = window[0], min(window[1], 0) if is_causal else window[1]
        if left + right < 0:  # an empty band
            return mask & jnp.zeros((q_pos.shape[0], 1), bool)
        # -left <= t - p <= right as one unsigned compare (fewer registers per element)
        shifted = (k_offset + left + k_idx)[None, :] - q_pos[:, None]
        return mask & (shifted.astype(jnp.uint32) <= jnp.uint32(left + right))
    if is_causal:
        mask = mask & ((k_offset + k_idx)[None, :] <= q_pos[:, None])
    return mask


def _keys_ok(k_idx, kv_len, kv_valid_ref, start, block_k):
    """``(bk,)`` validity of the key tile at ``start``: below ``kv_len`` and, with a per-key
    table (int8 ``(Lk_pad,)``), set there; also the tile's ``k_valid`` (or ``None``)."""
    if kv_valid_ref is None:
        return k_idx < kv_len, None
    k_valid = kv_valid_ref[pl.ds(start, block_k)] != 0
    return (k_idx < kv_len) & k_valid, k_valid


# A loop over tiles is given as segments ``(num_steps, block_index, masked)``: ``num_steps``
# (traced int) tiles at ``block_index(step)`` (in tile units), visited in order. Only tiles
# that straddle ``kv_len``, the causal diagonal or a band edge (and every tile under a per-key
# mask) need the element mask; the callers put the others in ``masked=False`` segments, whose
# body has no mask, no ``where`` on K/V. ``masked=WHOLE``: masked, but wholly inside the
# ``mask_mod`` (a block mask's full block), so the mod's mask is skipped.
WHOLE = "whole"


def _run_segments(segments, body_of, carry):
    for num_steps, block_index, masked in segments:
        body = body_of(block_index, masked)
        carry = lax.fori_loop(0, num_steps, body, carry)
    return carry


def _mods_at(mods, s, q_pos, k_idx, k_offset):
    """Forward: the modded logits and the ``mask_mod`` (or None) of tile ``s`` (``mods``: a
    :class:`pallas_kernels.mods.BoundMods`)."""
    qp, kp = q_pos[:, None], (k_offset + k_idx)[None, :]
    return mods.scores(s, qp, kp), mods.allowed(qp, kp)


def _visible(q_pos, k_idx, kv_len, k_offset, is_causal, window, k_valid, allowed):
    vis = key_mask(q_pos, k_idx, kv_len, k_offset, is_causal, window, k_valid)
    return vis if allowed is None else vis & allowed


def online_softmax(q, q_pos, k_ref, v_ref, *, segments, kv_len, k_offset, scale, is_causal,
                   block_k, window=None, kv_valid_ref=None, mods=None):
    """Forward key loop over the key tiles of ``segments``.

    ``window`` and ``kv_valid_ref`` (optional): the band and the per-key table of
    :func:`key_mask`, applied on the masked segments; ``mods`` (optional): FlexAttention mods
    (:class:`pallas_kernels.mods.BoundMods`; with a ``mask_mod`` every segment must be
    masked). Returns ``(out (bq, dp) float32,
    lse (bq,) float32)`` with ``out = 0, lse = -inf`` for rows without a visible key.
    """
    block_q, dp = q.shape

    def body_of(block_index, masked):
        def body(step, carry):
            m, denom, acc = carry
            start = pl.multiple_of(block_index(step) * block_k, block_k)
            k = k_ref[pl.ds(start, block_k), :]
            v = v_ref[pl.ds(start, block_k), :]
            s = _dot(q, k, 1, 1) * scale
            allowed = None
            if masked or mods is not None:
                k_idx = start + arange_i32(block_k)
            if mods is not None:
                s, allowed = _mods_at(mods, s, q_pos, k_idx, k_offset)
                allowed = None if masked is WHOLE else allowed
            if masked:
                ok, k_valid = _keys_ok(k_idx, kv_len, kv_valid_ref, start, block_k)
                s = jnp.where(_visible(q_pos, k_idx, kv_len, k_offset, is_causal, window,
                                       k_valid, allowed), s, _NEG_INF)
                # Zero invalid keys so NaN/inf there can never leak through 0 * x.
                v = jnp.where(ok[:, None], v, jnp.zeros((), v.dtype))
            return online_softmax_step(m, denom, acc, s, v)

        return body

    init = (
        jnp.full((block_q,), _NEG_INF, _F32),
        jnp.zeros((block_q,), _F32),
        jnp.zeros((block_q, dp), _F32),
    )
    m, denom, acc = _run_segments(segments, body_of, init)
    has_key = denom > 0.0
    denom_safe = jnp.where(has_key, denom, 1.0)
    out = acc / denom_safe[:, None]
    lse = jnp.where(has_key, m + jnp.log(denom_safe), _NEG_INF)
    return out, lse


def _backward_logits(s, mods, grads, masked, q_pos, k_idx, kv_len, k_offset, is_causal,
                     window, k_valid):
    """A backward tile's recomputed logits ``(s, pull, vis)``: the mods' scores and their
    vjp ``pull`` (None without mods), then the tile's mask ``vis`` (None unless ``masked``;
    ``masked is WHOLE``: inside the mask_mod, which is then not evaluated)."""
    pull = allowed = vis = None
    if mods is not None:
        qp, kp = q_pos[:, None], (k_offset + k_idx)[None, :]
        s, pull = mods.scores_vjp(s, qp, kp, grads)
        allowed = None if masked is WHOLE else mods.allowed(qp, kp)
    if masked:
        vis = _visible(q_pos, k_idx, kv_len, k_offset, is_causal, window, k_valid, allowed)
        s = jnp.where(vis, s, _NEG_INF)
    return s, pull, vis


def dq_loop(q, do, lse, delta, q_pos, k_ref, v_ref, *, segments, kv_len, k_offset, scale,
            is_causal, block_k, window=None, kv_valid_ref=None, mods=None):
    """dq of one query tile: ``sum_j ds_j @ k_j * scale`` over the key tiles of ``segments``
    (``window``, ``kv_valid_ref``, ``mods``: as in :func:`online_softmax`); with mods whose
    score consts take gradients, ``(dq, partial)``: also the tile row's partial gradient of
    those consts (:meth:`pallas_kernels.mods.BoundMods.scores_vjp`).

    ``lse`` must be ``+inf`` (not ``-inf``) on rows without a key so that ``p = 0`` there."""
    block_q, dp = q.shape
    grads = mods is not None and mods.km.grad_width > 0

    def body_of(block_index, masked):
        def body(step, carry):
            dq, dc = carry if grads else (carry, None)
            start = pl.multiple_of(block_index(step) * block_k, block_k)
            k = k_ref[pl.ds(start, block_k), :]
            v = v_ref[pl.ds(start, block_k), :]
            if masked:
                k_idx = start + arange_i32(block_k)
                ok, k_valid = _keys_ok(k_idx, kv_len, kv_valid_ref, start, block_k)
                k = jnp.where(ok[:, None], k, jnp.zeros((), k.dtype))
                v = jnp.where(ok[:, None], v, jnp.zeros((), v.dtype))
            if not masked:
                k_idx = None if mods is None else start + arange_i32(block_k)
                k_valid = None
            s, pull, vis = _backward_logits(_dot(q, k, 1, 1) * scale, mods, grads, masked, q_pos,
                                            k_idx, kv_len, k_offset, is_causal, window, k_valid)
            p = jnp.exp(s - lse[:, None])
            ds = p * (_dot(do, v, 1, 1) - delta[:, None])
            if mods is not None:  # chain rule through the score mod; masked pairs get none
                ds, part = pull(jnp.where(vis, ds, 0.0) if masked else ds)
            dq = dq + _dot(ds.astype(k.dtype), k, 1, 0)
            return (dq, dc + part) if grads else dq

        return body

    init = jnp.zeros((block_q, dp), _F32)
    if grads:
        dq, dc = _run_segments(segments, body_of, (init, jnp.zeros((mods.km.grad_width,), _F32)))
        return dq * scale, dc
    return _run_segments(segments, body_of, init) * scale


def dkdv_loop(carry, g, k, v, k_idx, kv_len, q_ref, do_ref, lse_ref, delta_ref, *, segments,
              q_offset, k_offset, scale, is_causal, block_q, window=None, k_valid=None,
              mods=None):
    """Accumulates ``(dk, dv)`` of one key tile over query head ``g``'s query tiles of
    ``segments`` (``window``, ``k_valid (bk,)``: as in :func:`key_mask`).

    ``q_ref, do_ref``: ``(Lq_pad, G, dp)``; ``lse_ref, delta_ref``: ``(G, Lq_pad)``; ``k, v``
    are the (already kv_len-zeroed) key tile. ``dk`` is returned unscaled. ``mods``: as in
    :func:`online_softmax`, at query head ``g``'s head already.
    """

    def body_of(block_index, masked):
        def body(step, carry):
            dk, dv = carry
            start = pl.multiple_of(block_index(step) * block_q, block_q)
            q = q_ref[pl.ds(start, block_q), g, :]
            do = do_ref[pl.ds(start, block_q), g, :]
            lse = lse_ref[g, pl.ds(start, block_q)]
            delta = delta_ref[g, pl.ds(start, block_q)]
            q_pos = q_offset + start + arange_i32(block_q) if masked or mods is not None else None
            s, pull, vis = _backward_logits(_dot(q, k, 1, 1) * scale, mods, False, masked, q_pos,
                                            k_idx, kv_len, k_offset, is_causal, window, k_valid)
            p = jnp.exp(s - lse[:, None])
            dv = dv + _dot(p.astype(do.dtype), do, 0, 0)
            ds = p * (_dot(do, v, 1, 1) - delta[:, None])
            if mods is not None:  # chain rule through the score mod
                ds = pull(jnp.where(vis, ds, 0.0) if masked else ds)[0]
            dk = dk + _dot(ds.astype(q.dtype), q, 0, 0)
            return dk, dv

        return body

    return _run_segments(segments, body_of, carry)


def band(window) -> tuple[int, int] | None:
    """A static band as ``(left, right)``: ``W -> (W, W)`` (``|t - p| <= W``), a pair as is
    (``-left <= t - p <= right``), ``None`` as is."""
    if window is None:
        return None
    pair = tuple(window) if isinstance(window, (tuple, list)) else (window, window)
    try:
        if len(pair) != 2 or any(isinstance(w, bool) for w in pair):
            raise TypeError
        return tuple(operator.index(w) for w in pair)
    except TypeError:
        raise TypeError(f"window must be an int or a (left, right) pair of ints, got "
                        f"{window!r}") from None


def mask_tables(q_len, kv_valid, len_pad: int, table_spec, key_spec):
    """The optional tables (``q_len``, ``kv_valid``) as kernel operands with their specs and
    static flags: each is passed only when given, so unmasked calls compile as before."""
    args, specs = [], []
    if q_len is not None:
        args.append(q_len)
        specs.append(table_spec)
    if kv_valid is not None:  # int8: Triton loads no i1 tiles
        args.append(pad_to(kv_valid.astype(jnp.int8), {2: len_pad}))
        specs.append(key_spec)
    return args, specs, dict(has_q_len=q_len is not None, has_kv_valid=kv_valid is not None)


def for_each_group(num_groups: int, fn, carry):
    """``fn(g, carry)`` for ``g`` in ``range(num_groups)`` (no loop when there is one)."""
    if num_groups == 1:
        return fn(0, carry)
    return lax.fori_loop(0, num_groups, fn, carry)


def pad_to(x, sizes: dict[int, int], value=0):
    """Pads axes of ``x`` at the end to the given sizes (no-op when already there)."""
    widths = [(0, 0)] * x.ndim
    changed = False
    for axis, size in sizes.items():
        extra = size - x.shape[axis]
        if extra:
            widths[axis] = (0, extra)
            changed = True
    return jnp.pad(x, widths, constant_values=value) if changed else x


def padded_head_dim(d: int) -> int:
    return max(MIN_BLOCK, next_power_of_2(d))


def output_delta(out, dout, dlse):
    """``delta = rowsum(dO * O) - dlse`` (float32): the lse cotangent enters ``ds`` like
    ``-delta``, and it is all the backward kernels need of ``out``."""
    return jnp.sum(dout.astype(_F32) * out.astype(_F32), axis=-1) - dlse.astype(_F32)


def backward_rows(lse, delta, len_pad: int, q_len=None):
    """``(lse, delta)`` rows for the backward kernels, laid out ``(B, Hk, G, len_pad)``.

    ``lse`` is ``+inf`` on rows without a key, on padding and on rows at or past ``q_len``
    (int ``(B, Hk)``, optional), so recomputed ``p`` is 0 there (zero gradient).
    """
    empty = lse == _NEG_INF
    if q_len is not None:
        rows = jnp.arange(lse.shape[1], dtype=jnp.int32)[None, :, None, None]
        empty = empty | (rows >= q_len[:, None, :, None])
    # p = 0 on these rows; keep a NaN dlse out of 0 * x
    delta = jnp.where(empty, 0.0, delta.astype(_F32))
    lse = jnp.where(empty, _POS_INF, lse)
    delta = pad_to(delta.transpose(0, 2, 3, 1), {3: len_pad})
    lse = pad_to(lse.transpose(0, 2, 3, 1), {3: len_pad}, value=_POS_INF)
    return lse, delta


def check_grouped_qkv(q, k, v, name: str = "flash_attention"):
    """Shape/dtype rules of the grouped layout ``q (B, Lq, Hk, G, d)``, ``k, v (B, Lk, Hk, d)``."""
    if q.ndim != 5 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"{name}: q must be (B, Lq, Hk, G, d) and k, v (B, Lk, Hk, d), got q {q.shape}, "
            f"k {k.shape}, v {v.shape}"
        )
    if k.shape != v.shape:
        raise ValueError(f"{name}: k and v must have the same shape, got {k.shape} and {v.shape}")
    B, _, Hk, _, d = q.shape
    if k.shape[0] != B or k.shape[2] != Hk or k.shape[3] != d:
        raise ValueError(
            f"{name}: k must be (B, Lk, Hk, d) matching q (B, Lq, Hk, G, d) = {q.shape}, "
            f"got {k.shape}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"{name}: q, k and v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise TypeError(f"{name}: q, k, v must have a floating dtype, got {q.dtype}")


def dkdv_call(kernel, *, grid, table_specs, len_pad: int, groups: int, dp: int, block_k: int,
              kv_shape, k_dtype, v_dtype, compiler_params, interpret: bool, debug: bool,
              name: str):
    """The dk/dv ``pallas_call`` on grid ``(key block j, batch b, kv head c)``.

    Each program reads its tables (``table_specs``), all ``len_pad`` (padded) query rows of
    kv head ``c``'s ``groups`` query heads with their ``dout`` and ``(lse, delta)`` rows, and
    key/value block ``j``; it writes dk and dv of that block (``kv_shape``). Call the result
    with ``(*tables, q, k, v, dout, lse_rows, delta_rows)``."""
    q_full = pl.BlockSpec((None, len_pad, None, groups, dp), lambda j, b, c: (b, 0, c, 0, 0))
    rows_full = pl.BlockSpec((None, None, groups, len_pad), lambda j, b, c: (b, c, 0, 0))
    k_spec = pl.BlockSpec((None, block_k, None, dp), lambda j, b, c: (b, j, c, 0))
    return pl.pallas_call(
        kernel, grid=grid,
        in_specs=[*table_specs, q_full, k_spec, k_spec, q_full, rows_full, rows_full],
        out_specs=[k_spec, k_spec],
        out_shape=[jax.ShapeDtypeStruct(kv_shape, k_dtype),
                   jax.ShapeDtypeStruct(kv_shape, v_dtype)],
        compiler_params=compiler_params, interpret=interpret, debug=debug, name=name)


def online_softmax_step(m, denom, acc, s, v):
    """One key tile folded into the float32 online-softmax state ``(m, denom, acc)`` of a
    query tile: logits ``s (bq, bk)`` (``-inf`` = masked), values ``v (bk, d)``."""
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
    p = jnp.exp(s - m_safe[:, None])
    corr = jnp.exp(m - m_safe)
    denom = denom * corr + jnp.sum(p, axis=1)
    return m_new, denom, acc * corr[:, None] + _dot(p.astype(v.dtype), v, 1, 0)
