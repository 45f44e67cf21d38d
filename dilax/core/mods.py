"""Elementwise score and mask functions on the XLA core's blocks (FlexAttention's
``score_mod`` / ``mask_mod``), forward and backward.

A mod is traced once at scalar arguments into a jaxpr (:func:`trace_mod`): every array it
closes over, traced ones included, becomes an explicit operand (``consts``), so the core
can differentiate into them and no tracer is ever captured by the core's ``custom_vjp``.
The jaxpr is a static, hashable :class:`ModFn` (equal when its text is): calls with the same
mods share one compiled program whatever arrays they close over. The core evaluates it on a
``(U, G, bq, bk)`` block with nested ``vmap`` (as PyTorch does), with the block's global
positions, its batch row and its query heads; the backward recomputes the modded logits per
block and takes ``d(score)/d(raw)`` and the cotangents of the closed-over float arrays with
:func:`jax.vjp` of the block's mod (:func:`scores_vjp`), accumulated across blocks.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import ClosedJaxpr, Literal, jaxpr_as_fun

from dilax.core.arrays import varying_axes, varying_like

_F32 = jnp.float32
_I32 = jnp.int32


class ModFn:
    """A mod traced at scalars: ``fn(*args, *consts)`` evaluates its jaxpr (static; equal and
    hashed by the jaxpr's text)."""

    def __init__(self, jaxpr, name: str):
        self.jaxpr, self.name, self._text = jaxpr, name, f"{name}:{jaxpr}"

    def __eq__(self, other):
        return isinstance(other, ModFn) and other._text == self._text

    def __hash__(self):
        return hash(self._text)

    def __call__(self, consts, *args):
        if varying_axes(*consts, *args):  # under shard_map: operands typed alike, eqn by eqn
            return _eval_varying(self.jaxpr, consts, args)[0]
        return jaxpr_as_fun(ClosedJaxpr(self.jaxpr, list(consts)))(*args)[0]


_INLINED = ("pjit", "jit", "closed_call", "custom_jvp_call")  # calls whose jaxpr is inlined


def _eval_varying(jaxpr, consts, args):
    """``jaxpr`` evaluated under ``shard_map(check_vma=True)``: the mod was traced outside,
    so its equations mix device-varying operands (positions, rows) with invariant ones
    (closed-over arrays, literals); each equation's operands are cast to the union of their
    varying axes first (nested jit / custom_jvp jaxprs inlined, so the same holds inside)."""
    env = {}

    def read(v):
        return jnp.asarray(v.val, v.aval.dtype) if isinstance(v, Literal) else env[v]  # x64-safe

    # the dtypes the mod was traced at (under jax_enable_x64 index arrays may come as int64)
    env.update((v, jnp.asarray(x, v.aval.dtype)) for v, x in zip(jaxpr.constvars, consts))
    env.update((v, jnp.asarray(x, v.aval.dtype)) for v, x in zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        axes = varying_axes(*ins)
        ins = [varying_like(x, *ins) if axes else x for x in ins]
        inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        if eqn.primitive.name in _INLINED and isinstance(inner, ClosedJaxpr):
            outs = _eval_varying(inner.jaxpr, inner.consts, ins)
        else:
            outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
            outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def trace_mod(fn, kind: str):
    """``(ModFn, consts)`` of ``fn``: ``kind`` ``"score_mod"`` (``fn(score, b, h, q_idx,
    kv_idx) -> float score``) or ``"mask_mod"`` (``fn(b, h, q_idx, kv_idx) -> bool``), traced
    at float32 / int32 scalars.

    Raises:
      TypeError: ``fn`` is not callable, or returns other than one scalar of the right dtype.
    """
    if not callable(fn):
        raise TypeError(f"{kind} must be callable, got {type(fn).__name__}")
    args = [jax.ShapeDtypeStruct((), _I32)] * 4
    if kind == "score_mod":
        args = [jax.ShapeDtypeStruct((), _F32)] + args
    closed = jax.make_jaxpr(fn)(*args)
    outs = closed.out_avals
    want = "a floating score" if kind == "score_mod" else "a bool"
    ok = len(outs) == 1 and outs[0].shape == () and (
        jnp.issubdtype(outs[0].dtype, jnp.floating) if kind == "score_mod"
        else outs[0].dtype == jnp.bool_)
    if not ok:
        got = ", ".join(f"{a.dtype}{list(a.shape)}" for a in outs)
        raise TypeError(f"{kind} must return {want} per element (it is called elementwise, "
                        f"on scalars, like PyTorch's FlexAttention), got {got}")
    return ModFn(closed.jaxpr, kind), tuple(closed.consts)


def _static(**kw):
    return dataclasses.field(metadata=dict(static=True), **kw)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mods:
    """The core's mods hook (a pytree; the functions and the cap static).

    Fields:
      score_consts, mask_consts: the arrays ``score`` / ``mask`` close over (:func:`trace_mod`).
      kv_blocks: ``None`` (every key block, ``mask`` on each) or ``(full_idx, full_cnt,
        part_idx, part_cnt)``: per batch row (1 or ``B``) and query block, the key blocks seen
        whole (no ``mask``) and in part (``mask`` applied), ``(Bt, nq, A)`` and ``(Bt, nq)``
        int32, ascending; blocks in neither are never visited. Block size = the core's.
      q_blocks: the same per key block ``(Bt, nk, A)`` / ``(Bt, nk)`` (the backward's).
      score: ``ModFn`` of ``score_mod`` or None; mask: of ``mask_mod`` or None.
      soft_cap: static float or None: ``s = cap * tanh(s / cap)`` before ``score``.

      q_pos, kv_pos, batch: optional int32 maps from the call to the mods' arguments (e.g. a
        call over gathered key blocks, :func:`dilax.block_sparse_attention`): ``q_pos (B, Lq)``
        and ``kv_pos (B, 1 or U, Lk)`` (per virtual kv head) give the position of call
        position ``p = q_offset + row`` (``k_offset + key``) of batch row ``i``:
        ``q_pos[i, p]`` (``q_pos`` may also be ``(B, 1 or U, Lq)``, per virtual kv head: the
        rows of the dilated ring); ``batch (B,)`` the mods' ``b`` of batch row ``i``.
        Positions beyond the arrays (padding) are clamped.
      heads: static tuple or None: the mods' ``h`` of the call's virtual query head
        ``i = u * G + g`` is ``heads[i]`` (a slot view's, e.g. a dilated branch,
        :mod:`dilax.dilated.flex`, or a ring's branch heads); then any view is accepted.
        None: ``h = i``.

      table_block: static ``(q_block, kv_block)`` of the tables when they are not the
        core's blocks (the Pallas kernels read them with their own tiles when these divide
        them).

    Without them positions are ``q_offset + row`` and ``k_offset + key`` of the call, heads
    the query heads of an identity view, ``b`` the call's batch row.
    """

    score_consts: tuple = ()
    mask_consts: tuple = ()
    kv_blocks: tuple | None = None
    q_blocks: tuple | None = None
    score: ModFn | None = _static(default=None)
    mask: ModFn | None = _static(default=None)
    soft_cap: float | None = _static(default=None)
    q_pos: jax.Array | None = None
    kv_pos: jax.Array | None = None
    batch: jax.Array | None = None
    table_block: tuple[int, int] | None = _static(default=None)
    heads: tuple | None = _static(default=None)

    def cotangent(self, grads) -> Mods:
        """The ``custom_vjp`` cotangent: ``grads`` for the float ``score_consts``, None else."""
        blank = jax.tree.map(lambda _: None, dataclasses.replace(self, score_consts=()))
        it = iter(grads)
        return dataclasses.replace(blank, score_consts=tuple(
            next(it) if _diff(c) else None for c in self.score_consts))


def _diff(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def check_view(view, mods: Mods | None = None) -> None:
    if mods is not None and mods.heads is not None:  # heads and positions given per head
        return
    heads = tuple(range(len(getattr(view, "q_index", ()))))
    if getattr(view, "num_slots", None) != 1 or view.q_index != heads:
        raise ValueError("score_mod / mask_mod need an identity view "
                         "(dilax.core.identity_view): h is the query head")


def on_block(fn, consts, b, h, q, kv, s=None):
    """``fn`` over the block: ``h (H,)``, ``q (bq,)`` or per head ``(H, bq)``, ``kv (bk,)``
    or per head ``(H, bk)`` -> ``(H, bq, bk)``."""
    per_head = 0 if jnp.ndim(kv) == 2 else None
    per_head_q = 0 if jnp.ndim(q) == 2 else None
    if s is None:
        f = lambda h, q, kv: fn(consts, b, h, q, kv)  # noqa: E731
        ax = ((None, None, 0), (None, 0, None), (0, per_head_q, per_head))
        args = (h, q, kv)
    else:
        f = lambda s, h, q, kv: fn(consts, s, b, h, q, kv)  # noqa: E731
        ax = ((0, None, None, 0), (0, None, 0, None), (0, 0, per_head_q, per_head))
        args = (s, h, q, kv)
    for a in ax:
        f = jax.vmap(f, in_axes=a)
    return f(*args)


def _per_head(rows, idx, u0, U, G):
    """``rows (1 or U_all, L)`` at ``idx``: ``(len(idx),)`` or per query head ``(U*G, ..)``."""
    x = jnp.take(rows, idx, axis=1, mode="clip")
    return x[0] if rows.shape[0] == 1 else jnp.repeat(x[u0:u0 + U], G, axis=0)


def _positions(mods, b, u0, U, G, q_pos, k0, bk, k_offset):
    h = u0 * G + lax.iota(_I32, U * G)
    if mods.heads is not None:  # the call's heads reordered (e.g. a ring's branch heads)
        h = jnp.take(jnp.asarray(mods.heads, _I32), h)
    q, kv = q_pos.astype(_I32), k_offset + k0 + lax.iota(_I32, bk)
    if mods.q_pos is not None and mods.q_pos.ndim == 3:  # per virtual kv head
        q = _per_head(mods.q_pos[b], q, u0, U, G)
    elif mods.q_pos is not None:  # the call's positions mapped (clamped past the arrays)
        q = jnp.take(mods.q_pos[b], q, mode="clip")
    if mods.kv_pos is not None:
        kv = _per_head(mods.kv_pos[b], kv, u0, U, G)
    b = b if mods.batch is None else mods.batch[b]
    return jnp.asarray(b, _I32), h, q, kv


def _score_fn(mods, b, h, q, kv, shape):
    def f(s, consts):
        s = s.reshape(len(h), q.shape[-1], kv.shape[-1])
        if mods.soft_cap is not None:
            cap = jnp.asarray(mods.soft_cap, _F32)
            s = cap * jnp.tanh(s / cap)
        if mods.score is not None:
            s = on_block(mods.score, consts, b, h, q, kv, s).astype(_F32)
        return s.reshape(shape)
    return f


def _masked(mods, mask, pos, U, G, apply_mask):
    if mods.mask is None or not apply_mask:
        return mask
    b, h, q, kv = pos
    allowed = on_block(mods.mask, mods.mask_consts, b, h, q, kv).reshape(U, G, q.shape[-1], -1)
    return allowed if mask is None else mask & allowed


def scores(mods, s, mask, b, u0, U, G, q_pos, k0, bk, k_offset, apply_mask=True):
    """Forward: ``(s, mask)`` of a ``(U, G, bq, bk)`` (or flat ``(U, G*bq, bk)``) float32
    block with the cap and ``score`` applied and ``mask`` and-ed in (unless ``apply_mask`` is
    False: a block wholly inside the mask)."""
    pos = _positions(mods, b, u0, U, G, q_pos, k0, bk, k_offset)
    if mods.score is not None or mods.soft_cap is not None:
        s = _score_fn(mods, *pos, s.shape)(s, mods.score_consts)
    return s, _masked(mods, mask, pos, U, G, apply_mask)


def scores_vjp(mods, s, mask, b, U, G, q_pos, k0, bk, k_offset, apply_mask=True):
    """Backward: ``(s, mask, vjp)``; ``vjp(ds) -> (ds_raw, d_consts)`` (float32 cotangents of
    the float ``score_consts``, in order)."""
    pos = _positions(mods, b, 0, U, G, q_pos, k0, bk, k_offset)
    mask = _masked(mods, mask, pos, U, G, apply_mask)
    if mods.score is None and mods.soft_cap is None:
        return s, mask, lambda ds: (ds, ())
    consts = mods.score_consts
    # under shard_map: the consts typed varying outside the vjp, whose transpose would
    # otherwise psum inside the core's loops (each device's share is summed once, at the end)
    diff = tuple(varying_like(c, s) for c in consts if _diff(c))
    f = _score_fn(mods, *pos, s.shape)

    def g(s, diff):
        it = iter(diff)
        return f(s, tuple(next(it) if _diff(c) else c for c in consts))

    s, pull = jax.vjp(g, s, diff)

    def vjp(ds):
        if mask is not None:  # masked pairs get no cotangent, whatever the mod's slope
            ds = jnp.where(mask, ds, jnp.zeros((), ds.dtype))
        ds_raw, dc = pull(ds)
        return ds_raw, tuple(x.astype(_F32) for x in dc)

    return s, mask, vjp


def grad_init(mods) -> list:
    """Float32 zero accumulators of the float ``score_consts`` (``[]`` without)."""
    if mods is None or (mods.score is None and mods.soft_cap is None):
        return []
    return [jnp.zeros(jnp.shape(c), _F32) for c in mods.score_consts if _diff(c)]


def grad_result(dc, mods) -> tuple:
    """The accumulated cotangents in the consts' dtypes."""
    diff = [c for c in (() if mods is None else mods.score_consts) if _diff(c)]
    return tuple(g.astype(jnp.result_type(c)) for g, c in zip(dc, diff))


def column_split(mods, block_k: int) -> int:
    """How many backward key columns of ``block_k`` make one key block of the tables (1
    without ``table_block``: the tables are in the core's blocks)."""
    if mods.table_block is None or mods.table_block[1] == block_k:
        return 1
    if mods.table_block[1] % block_k:
        raise ValueError(f"the backward key block {block_k} must divide the block tables' key "
                         f"block {mods.table_block[1]}")
    return mods.table_block[1] // block_k


def table_loops(tables, b, i):
    """``((starts, count, apply_mask), ...)`` of block ``i`` of batch row ``b`` from
    ``(full_idx, full_cnt, part_idx, part_cnt)``: whole blocks first, then partial ones."""
    full_idx, full_cnt, part_idx, part_cnt = tables
    bt = b if full_idx.shape[0] > 1 else 0
    return ((full_idx[bt, i], full_cnt[bt, i], False), (part_idx[bt, i], part_cnt[bt, i], True))
