"""FlexAttention mods traced inside the Pallas kernels: ``logits_soft_cap``,
``score_mod(score, b, h, q_idx, kv_idx)`` and ``mask_mod(b, h, q_idx, kv_idx)``.

A mod arrives as the jaxpr it was traced to at scalars (``dilax.core.mods.trace_mod``: an
object with a ``.jaxpr`` whose ``constvars`` are the arrays it closes over). The kernels
evaluate that scalar jaxpr on tiles (:func:`eval_mod`): positions come in as ``(bq, 1)`` and
``(1, bk)`` int32 tiles, ``b`` and ``h`` as scalars, so every elementwise primitive simply
broadcasts, and a read of a closed-over array ``x[i, j]`` (a ``dynamic_slice`` of size 1, as
jax traces scalar indexing) becomes a load of that array's kernel operand at the (clamped,
as ``dynamic_slice`` clamps) index tiles -- a gather from global memory, never a copy per
program. Closed-over arrays are kernel inputs passed whole to every program, padded to
power-of-two shapes (Triton blocks); bool ones as int8.

Backward: the modded logits are recomputed per tile and ``jax.vjp`` of the tile function
gives ``d(score)/d(raw)`` times the cotangent and the cotangents of every value read from a
closed-over float array; those are scattered (one-hot sums) into a per-program partial
gradient vector, written out by the dq kernel and summed outside it (no atomics).

A mod that uses a closed-over array otherwise than by scalar indexing (a reduction over
it, a slice of several elements) has no tile form: :func:`mod_problem` says so before a
kernel is chosen, and the XLA core serves it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Literal

_F32 = jnp.float32
_I32 = jnp.int32
_SUB = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr",
        "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
        "remat": "jaxpr", "checkpoint": "jaxpr"}
_SHAPE_ONLY = ("squeeze", "reshape", "broadcast_in_dim", "expand_dims")
# Float closed-over elements whose gradient the dq kernel sums: each program writes a partial
# of this many float32 (programs x width x 4 bytes in all) and scatters a tile into it with
# one masked sum per element read at varying indices (per-head or scalar reads: one).
MAX_GRAD_ELEMENTS = 1024


def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


@dataclasses.dataclass(frozen=True)
class KernelMods:
    """The static part of the mods of a kernel call (hashable: a ``functools.partial``
    argument of the kernels): the traced ``score`` / ``mask`` (objects with ``.jaxpr``, or
    None), the soft ``cap`` and the original shapes and dtypes of the closed-over arrays."""

    score: Any = None
    mask: Any = None
    cap: float | None = None
    score_avals: tuple = ()
    mask_avals: tuple = ()

    @property
    def grad_slots(self) -> tuple[tuple[int, int, int], ...]:
        """``(const index, offset, size)`` of each float score const in the gradient vector."""
        out, off = [], 0
        for i, (shape, dtype) in enumerate(self.score_avals):
            if _is_float(dtype):
                size = math.prod(shape)
                out.append((i, off, size))
                off += size
        return tuple(out)

    @property
    def grad_width(self) -> int:
        """Padded length of a program's gradient vector (0: no float const)."""
        total = sum(size for _, _, size in self.grad_slots)
        return 0 if total == 0 else max(16, _pow2(total))

    @property
    def has_score(self) -> bool:
        return self.score is not None or self.cap is not None


def kernel_mods(score=None, score_consts=(), mask=None, mask_consts=(), cap=None):
    """``(KernelMods, operands)``: the static mods and their closed-over arrays as kernel
    operands (power-of-two shapes, bool as int8, 0-d as ``(1,)``), score ones first."""
    avals = lambda cs: tuple((tuple(jnp.shape(c)), jnp.result_type(c)) for c in cs)  # noqa: E731
    km = KernelMods(score, mask, cap, avals(score_consts), avals(mask_consts))
    return km, [operand(c) for c in (*score_consts, *mask_consts)]


def operand(c):
    """An array as a kernel operand passed whole: power-of-two shape, bool as int8, 0-d as
    ``(1,)``."""
    c = jnp.asarray(c)
    if c.dtype == jnp.bool_:  # Triton loads no i1 tiles
        c = c.astype(jnp.int8)
    c = c.reshape(c.shape or (1,))
    return jnp.pad(c, [(0, _pow2(n) - n) for n in c.shape])


class _Const:
    """A closed-over array inside :func:`eval_mod`: its operand (a kernel ref or an array),
    original shape and dtype, and its position among the score consts (None: no gradient)."""

    def __init__(self, ref, shape, dtype, slot):
        self.ref, self.shape, self.dtype, self.slot = ref, shape, dtype, slot

    def read(self, idx, hook):
        idx = [jnp.clip(jnp.asarray(i, _I32), 0, max(n - 1, 0))
               for i, n in zip(idx, self.shape or (1,))]
        tile = jnp.broadcast_shapes(*(jnp.shape(i) for i in idx))
        idx = [jnp.broadcast_to(i, tile) for i in idx]
        value = self.ref[tuple(idx)]
        value = value != 0 if self.dtype == jnp.bool_ else value.astype(self.dtype)
        if hook is None or self.slot is None:
            return value
        flat = idx[0]
        for i, n in zip(idx[1:], self.shape[1:]):
            flat = flat * n + i
        return hook(self.slot, flat, value)


def eval_mod(jaxpr, consts, args, hook=None):
    """Evaluates a mod's scalar ``jaxpr`` on broadcastable tiles ``args``; ``consts``: the
    :class:`_Const` of each constvar. ``hook(slot, flat_index, value) -> value`` sees every
    value read from a float score const (the backward's gradient sites).

    Raises:
      TypeError: the mod uses a closed-over array otherwise than by scalar indexing.
    """
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, Literal) else env[v]  # noqa: E731
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name == "dynamic_slice" and isinstance(ins[0], _Const):
            if any(s != 1 for s in eqn.params["slice_sizes"]):
                raise TypeError("a mod may read its closed-over arrays one element at a time "
                                "(x[i, j]), not slices, inside a Pallas kernel")
            outs = [ins[0].read(ins[1:], hook)]
        elif any(isinstance(x, _Const) for x in ins):
            c = next(x for x in ins if isinstance(x, _Const))
            if c.shape != () or name in _SUB:
                raise TypeError(f"a mod may use its closed-over arrays only by scalar indexing "
                                f"(x[i, j]) inside a Pallas kernel, got {name} on an array of "
                                f"shape {c.shape}")
            ins = [x.read((0,), hook) if isinstance(x, _Const) else x for x in ins]
            outs = _bind(eqn, ins, hook)
        else:
            outs = _bind(eqn, ins, hook)
        env.update(zip(eqn.outvars, outs))
    return read(jaxpr.outvars[0])


def _bind(eqn, ins, hook):
    name = eqn.primitive.name
    if name in _SUB:
        sub = eqn.params[_SUB[name]]
        sub_jaxpr = getattr(sub, "jaxpr", sub)
        sub_consts = [jnp.asarray(c) for c in getattr(sub, "consts", ())]
        if any(jnp.ndim(c) for c in sub_consts):
            raise TypeError(f"a mod's {name} closes over an array: no tile form")
        return [eval_mod(sub_jaxpr, sub_consts, ins, hook)]
    if any(v.aval.shape not in ((), (1,), (1, 1)) for v in (*eqn.invars, *eqn.outvars)):
        raise TypeError(f"a mod's {name} works on arrays: a Pallas kernel evaluates mods "
                        "elementwise on scalars only")
    if name in _SHAPE_ONLY:  # scalar <-> size-1 shapes: tiles are broadcastable already
        return [ins[0]]
    ins = jnp.broadcast_arrays(*ins) if len(ins) > 1 else ins
    out = eqn.primitive.bind(*ins, **eqn.params)
    return out if eqn.primitive.multiple_results else [out]


@dataclasses.dataclass(frozen=True)
class BoundMods:
    """:class:`KernelMods` with one program's operands, batch row ``b`` and query head ``h``
    (in-kernel; scalars or broadcastable tiles, e.g. the decode kernel's ``(G, 1)`` heads;
    :meth:`at_head` for the dk/dv loop over a kv head's query heads)."""

    km: KernelMods
    refs: tuple
    b: Any
    h: Any

    def at_head(self, h):
        return dataclasses.replace(self, h=h)

    def _consts(self, avals, offset, with_slots):
        return [_Const(r, shape, dtype, i if with_slots and _is_float(dtype) else None)
                for i, (r, (shape, dtype)) in enumerate(
                    zip(self.refs[offset:offset + len(avals)], avals))]

    def _score(self, s, q, kv, hook=None):
        if self.km.cap is not None:
            s = self.km.cap * jnp.tanh(s / self.km.cap)
        if self.km.score is not None:
            consts = self._consts(self.km.score_avals, 0, hook is not None)
            shape = jnp.shape(s)
            s = jnp.broadcast_to(eval_mod(self.km.score.jaxpr, consts,
                                          (s, self.b, self.h, q, kv), hook), shape)
        return s.astype(_F32)

    def allowed(self, q, kv):
        """The ``mask_mod``'s bool tile at positions ``q`` and ``kv`` (e.g. ``(bq, 1)`` and
        ``(1, bk)``: ``(bq, bk)``, broadcast with ``b`` and ``h``), or None without one."""
        if self.km.mask is None:
            return None
        consts = self._consts(self.km.mask_avals, len(self.km.score_avals), False)
        ok = eval_mod(self.km.mask.jaxpr, consts, (self.b, self.h, q, kv))
        shapes = (jnp.shape(x) for x in (self.b, self.h, q, kv))
        return jnp.broadcast_to(ok, jnp.broadcast_shapes(*shapes))

    def scores(self, s, q, kv):
        """Forward: the modded float32 logits of raw scaled ``s (bq, bk)``."""
        return self._score(s, q, kv) if self.km.has_score else s

    def scores_vjp(self, s, q, kv, with_consts: bool):
        """Backward: ``(modded s, pull)``; ``pull(ds) -> (ds_raw, partial)``: the cotangent
        of the raw logits and (``with_consts``) this tile's ``(grad_width,)`` float32 partial
        gradient of the float score consts (else None)."""
        if not self.km.has_score:
            return s, lambda ds: (ds, None)
        if not with_consts or self.km.grad_width == 0:
            s_mod, pull = jax.vjp(lambda s: self._score(s, q, kv), s)
            return s_mod, lambda ds: (pull(ds)[0], None)
        sites = []  # (slot, flat index, value) of every read of a float const

        def collect(slot, flat, value):
            sites.append((slot, flat, value))
            return value

        self._score(s, q, kv, collect)  # the reads; the vjp below starts from their values

        def f(s, vals):
            it = iter(vals)
            return self._score(s, q, kv, lambda slot, flat, value: next(it))

        s_mod, pull = jax.vjp(f, s, [v for _, _, v in sites])

        def pull_all(ds):
            ds_raw, dvals = pull(ds)
            return ds_raw, self._scatter([(sl, fl) for sl, fl, _ in sites], dvals)

        return s_mod, pull_all

    def _scatter(self, sites, dvals):
        width = self.km.grad_width
        offsets = {i: off for i, off, _ in self.km.grad_slots}
        sizes = {i: size for i, _, size in self.km.grad_slots}
        lanes = lax.iota(_I32, width)
        acc = jnp.zeros((width,), _F32)
        for (slot, flat), g in zip(sites, dvals):
            g = g.astype(_F32)
            if jnp.ndim(g) == 0 or jnp.ndim(flat) == 0:  # one element of the const per tile
                acc += jnp.where(lanes == offsets[slot] + flat, jnp.sum(g), 0.0)
                continue
            flat, g = jnp.broadcast_arrays(flat, g)

            def one(j, acc, flat=flat, g=g, off=offsets[slot]):
                total = jnp.sum(jnp.where(flat == j, g, 0.0))
                return acc + jnp.where(lanes == off + j, total, 0.0)

            acc = lax.fori_loop(0, sizes[slot], one, acc)
        return acc


def mod_problem(score=None, score_consts=(), mask=None, mask_consts=()) -> str | None:
    """Why these traced mods have no tile form in the Pallas kernels (None: they have one),
    found by evaluating them abstractly on tiles."""
    km, ops = kernel_mods(score, score_consts, mask, mask_consts)
    total = sum(size for _, _, size in km.grad_slots)
    if total > MAX_GRAD_ELEMENTS:
        return (f"the Pallas kernels sum the gradient of a score_mod's closed-over float "
                f"arrays per program: at most {MAX_GRAD_ELEMENTS} elements, got {total}")

    q, kv = jnp.zeros((16, 1), _I32), jnp.zeros((1, 16), _I32)

    def run_score(*ops):
        bound = BoundMods(km, ops, jnp.int32(0), jnp.int32(0))
        s, pull = bound.scores_vjp(jnp.zeros((16, 16), _F32), q, kv, True)
        return s, pull(jnp.zeros((16, 16), _F32))

    def run_mask(*ops):
        return BoundMods(km, ops, jnp.int32(0), jnp.int32(0)).allowed(q, kv)

    for name, run in (("score_mod", run_score), ("mask_mod", run_mask)):
        try:
            jax.eval_shape(run, *ops)
        except TypeError as e:
            return f"{name}: {e}"
    return None
