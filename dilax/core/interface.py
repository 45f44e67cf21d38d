"""The one door into the attention core: a typed implementation object per backend.

Every attention of dilax (dilated branches, block-sparse rows, ring hops) reduces to calls of
one :class:`Core`'s ``forward`` and ``backward`` on inputs read through a
:class:`~dilax.core.view.SlotView` with a :class:`~dilax.core.mask.Mask`:

* ``forward(q, k, v, *, view, mask, scale, block_sizes, out_dtype) -> (out, lse)``;
* ``backward(q, k, v, *, view, mask, scale, block_sizes, lse, dout, delta, grad_dtype, acc)
  -> (dq, dk, dv)``, recomputing from the saved log-sum-exp.

:func:`attention` ties the two into one differentiable call (one ``custom_vjp``); callers that
run several calls under one hand-written backward (the dilated branches, the ring) call
``forward``/``backward`` directly. The implementation is resolved once, by name, with
:func:`core_for`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar, Protocol

import jax
import jax.numpy as jnp
from jax import lax

from dilax.core import pairwise, xla
from dilax.core.arrays import output_delta, varying_axes  # delta: rowsum(dO * O) - dlse, float32
from dilax.core.blocks import BlockSizes, default_block_sizes
from dilax.core.mask import KeyBounds, Mask
from dilax.core.mods import Mods, check_view, grad_result
from dilax.core.ordering import when
from dilax.core.view import SlotView, identity_view

_F32 = jnp.float32


class Core(Protocol):
    """What every core implementation provides (see the module docstring)."""

    name: ClassVar[str]

    def forward(self, q, k, v, *, view: SlotView, mask: Mask, scale: float,
                block_sizes: BlockSizes | None = None, out_dtype=None): ...

    def backward(self, q, k, v, *, view: SlotView, mask: Mask, scale: float, lse, dout, delta,
                 block_sizes: BlockSizes | None = None, grad_dtype=None, acc=None): ...


def sum_invariant_axes(primals, grads):
    """Under ``shard_map``, an input that is invariant over a mesh axis (e.g. replicated K/V)
    gets the sum of the per-device cotangents: the transpose of its implicit broadcast."""
    out = []
    for primal, grad in zip(primals, grads):
        extra = tuple(a for a in varying_axes(grad) if a not in varying_axes(primal))
        out.append(lax.psum(grad, extra) if extra else grad)
    return tuple(out)


def _add_into(acc, grads):
    """``grads`` as float32, added into ``acc`` when given (a backward's ``acc`` contract)."""
    grads = tuple(g.astype(_F32) for g in grads)
    if acc is None:
        return grads
    return tuple(a.astype(_F32) + g for a, g in zip(acc, grads))


@dataclasses.dataclass(frozen=True)
class XlaCore:
    """The blockwise XLA core (:mod:`dilax.core.xla`): any backend, reads views in place."""

    name: ClassVar[str] = "xla"

    @staticmethod
    def _resolve(q, k, view, mask, block_sizes):
        B, Lq, Lk = q.shape[0], q.shape[1], k.shape[1]
        if block_sizes is None:
            bounds = mask.bounds
            window = None if bounds.window is None else max(0, *pairwise.band(bounds.window))
            mods = mask.mods
            scored = mods is not None and (mods.score is not None or mods.soft_cap is not None)
            block_sizes = default_block_sizes(Lq, Lk, len(view.q_index), bool(bounds.is_causal),
                                              window, scored)
        return mask.resolve(B, len(view.kv_index), Lk, Lq), block_sizes.clipped(Lq, Lk)

    def forward(self, q, k, v, *, view, mask, scale, block_sizes=None, out_dtype=None):
        mask, blocks = self._resolve(q, k, view, mask, block_sizes)
        return xla.forward(q, k, v, view=view, mask=mask, scale=float(scale),
                           block_sizes=blocks, out_dtype=out_dtype)

    def backward(self, q, k, v, *, view, mask, scale, lse, dout, delta, block_sizes=None,
                 grad_dtype=None, acc=None):
        mask, blocks = self._resolve(q, k, view, mask, block_sizes)
        return xla.backward(q, k, v, view=view, mask=mask, scale=float(scale),
                            block_sizes=blocks, lse=lse, dout=dout, delta=delta,
                            grad_dtype=grad_dtype, acc=acc)


def pallas_config(block_sizes: BlockSizes | None, len_q: int, len_k: int, head_dim: int,
                  dtype, *, masked: bool = False):
    """The Pallas kernels' launch config for ``block_sizes``: ``None`` gives the kernels'
    per-shape defaults (``masked``: for calls with a band, per-key or query-length mask); a
    :class:`BlockSizes` keeps its forward tiles (powers of two, as Triton requires) with
    default warps and stages."""
    from pallas_kernels.config import KernelConfig, default_config  # lazy: optional kernels

    if block_sizes is None:
        return default_config(len_q, len_k, head_dim, dtype, masked=masked)
    try:
        return KernelConfig(block_q=block_sizes.block_q, block_k=block_sizes.block_k)
    except ValueError as e:
        raise ValueError(
            f"block_sizes={block_sizes} cannot drive the Pallas kernels: block_q and block_k "
            "must be powers of two (Triton tiles)") from e


def _drop_invalid_rows(out, lse, view, mask, len_q):
    """``out = 0``, ``lse = -inf`` on query rows at or past the bounds' ``q_len`` (output layout):
    for kernels without a query-length mask. The backward then recomputes ``p = 0`` on those
    rows from ``lse = -inf``, so their gradient is exactly 0 too."""
    if mask.bounds.q_len is None:
        return out, lse
    B, U = out.shape[0], len(view.kv_index)
    q_len = mask.resolve(B, U, len_q, len_q).bounds.q_len
    valid = lax.iota(jnp.int32, out.shape[1])[None, :, None] < q_len[:, None, :]  # (B, L, U)
    valid = view.ungather_out(
        jnp.broadcast_to(valid[..., None], (*valid.shape, view.q_per_kv)))
    return (jnp.where(valid[..., None], out, jnp.zeros((), out.dtype)),
            jnp.where(valid, lse, -jnp.inf))


def _refuse_masks(name: str, mask: Mask, *, band_and_keys: bool = False,
                  mods: bool = False) -> None:
    """A kernel core given a mask it has no form for raises (:mod:`dilax.registry` keeps such
    calls away from it; reaching here is a caller's bug, never a reason to run another core).
    ``band_and_keys``: the kernel takes ``window`` and ``kv_valid``; ``mods``: FlexAttention
    mods at the call's own positions and heads (no position maps, no head list). No
    registry lookup here: the registry builds cores, so the core does not import it."""
    missing = [what for what, given in (
        ("a band mask (local_window)", mask.bounds.window is not None and not band_and_keys),
        ("a per-key mask (key padding)", mask.kv_valid is not None and not band_and_keys),
        ("bias or (B, N, T, S) boolean mask", mask.bias is not None or mask.allowed is not None),
        ("per-row key ranges (segment_ids)", mask.bounds.key_range is not None),
        ("score_mod / mask_mod / soft-cap (dilax.flex_attention)", mask.mods is not None and (
            not mods or any(x is not None for x in (
                mask.mods.q_pos, mask.mods.kv_pos, mask.mods.batch, mask.mods.heads)))),
    ) if given]
    if missing:
        raise ValueError(f"implementation={name!r}: the kernel has no {' or '.join(missing)} "
                         "(dilax.registry decides which core runs which call; use "
                         "implementation=None or 'xla')")


@dataclasses.dataclass(frozen=True)
class PallasCore:
    """The Pallas flash kernels (:mod:`pallas_kernels.flash_attention`) on gathered inputs.

    ``interpret``: run the kernels in the Pallas interpreter (CPU tests). Every part of the
    :class:`Mask` but a dense bias / mask is the kernels' own: key and query lengths, offsets,
    causality, the band ``window`` (only the tiles that meet it are visited) and the per-key
    ``kv_valid``, and FlexAttention mods (:class:`dilax.core.mods.Mods` on an identity view:
    cap, ``score_mod`` and ``mask_mod`` traced into the kernels, :mod:`pallas_kernels.mods`;
    a block mask's tables steer each kernel whose tiles divide its blocks, else every tile
    the other masks leave is visited, ``mask_mod`` on each). A dense bias or mask raises
    (:mod:`dilax.registry` never sends one here)."""

    interpret: bool = False
    name: ClassVar[str] = "pallas"

    def _args(self, q, k, view, mask, block_sizes):
        _refuse_masks(self.name, mask, band_and_keys=True, mods=True)
        B, Lq, Lk, d = q.shape[0], q.shape[1], k.shape[1], q.shape[-1]
        mods, tables = None, {}
        if (m := mask.mods) is not None:
            from pallas_kernels.mods import kernel_mods  # lazy: optional kernels

            check_view(view)
            mods = kernel_mods(m.score, m.score_consts, m.mask, m.mask_consts, m.soft_cap)
            if m.kv_blocks is not None and m.table_block is not None:  # a block mask's
                tables = dict(block_tables=(m.kv_blocks, m.q_blocks, m.table_block))
        U = len(view.kv_index)
        mask = mask.resolve(B, U, Lk, Lq)
        bounds = mask.bounds
        kv_len = bounds.kv_len if bounds.kv_len is not None else jnp.full((B, U), Lk, jnp.int32)
        q_len = None if bounds.q_len is None else jnp.maximum(bounds.q_len, 0)
        masked = bounds.window is not None or q_len is not None or mask.kv_valid is not None or (
            mods is not None)
        return dict(kv_len=jnp.maximum(kv_len, 0),
                    offsets=jnp.stack([bounds.q_offset, bounds.k_offset]),
                    is_causal=bounds.is_causal, interpret=self.interpret,
                    config=pallas_config(block_sizes, Lq, Lk, d, q.dtype, masked=masked),
                    window=bounds.window, q_len=q_len, kv_valid=mask.kv_valid,
                    **({} if mods is None else dict(mods=mods, **tables)))

    def forward(self, q, k, v, *, view, mask, scale, block_sizes=None, out_dtype=None):
        from pallas_kernels.flash_attention import flash_forward

        out, lse = flash_forward(view.gather_q(q), view.gather_kv(k), view.gather_kv(v),
                                 scale=float(scale), **self._args(q, k, view, mask, block_sizes))
        out, lse = view.ungather_out(out), view.ungather_out(lse)
        return out.astype(out_dtype or q.dtype), lse

    def backward(self, q, k, v, *, view, mask, scale, lse, dout, delta, block_sizes=None,
                 grad_dtype=None, acc=None):
        from pallas_kernels.flash_attention import flash_backward

        out_view = view.output_view()
        dq, dk, dv, *dc = flash_backward(
            view.gather_q(q), view.gather_kv(k), view.gather_kv(v), lse=out_view.gather_q(lse),
            dout=out_view.gather_q(dout), delta=out_view.gather_q(delta), scale=float(scale),
            **self._args(q, k, view, mask, block_sizes))
        grads = _add_into(acc, (view.ungather_q(dq), view.ungather_kv(dk), view.ungather_kv(dv)))
        grads = tuple(g.astype(grad_dtype or x.dtype) for g, x in zip(grads, (q, k, v)))
        if mask.mods is None:
            return grads
        return grads + grad_result(dc[0] if dc else [], mask.mods)


@dataclasses.dataclass(frozen=True)
class CudnnCore:
    """``jax.nn.dot_product_attention(implementation="cudnn")`` forward (CUDA only).

    cuDNN returns the log-sum-exp only as a non-differentiable residual, so the backward pass
    is the blockwise XLA one, recomputed from that log-sum-exp: exact also when the lse
    carries a cotangent (the mixture merge of dilated branches). Offsets are not supported
    (cuDNN's causal mask is aligned at 0). Per-head key lengths are served by folding the kv
    heads into the batch; query lengths are applied to the result (as for Pallas); a local
    ``window`` or a per-key ``kv_valid`` raises (:mod:`dilax.registry` never sends one)."""

    name: ClassVar[str] = "cudnn"

    def forward(self, q, k, v, *, view, mask, scale, block_sizes=None, out_dtype=None):
        del block_sizes
        _refuse_masks(self.name, mask)
        offsets = (mask.bounds.q_offset, mask.bounds.k_offset)
        if not all(isinstance(o, int) and o == 0 for o in offsets):
            raise ValueError("implementation='cudnn' supports no query/key offsets; "
                             "use implementation='xla' or 'pallas'")
        from dilax.core.platform import require_cudnn  # lazy: kernels are optional

        qg, kg, vg = view.gather_q(require_cudnn(q)), view.gather_kv(k), view.gather_kv(v)
        B, L, U, G, d = qg.shape
        mask = mask.resolve(B, U, k.shape[1])
        dpa = functools.partial(jax.nn.dot_product_attention, scale=float(scale),
                                is_causal=mask.bounds.is_causal, implementation="cudnn",
                                return_residual=True)
        try:
            if mask.bounds.kv_len is None:
                out, lse = dpa(qg.reshape(B, L, U * G, d), kg, vg)
            else:  # one key length per (batch row, kv head): fold the kv heads into the batch
                fold = lambda x: jnp.moveaxis(x, 2, 1).reshape(B * U, L, -1, d)
                out, lse = dpa(fold(qg), fold(kg), fold(vg),
                               key_value_seq_lengths=mask.bounds.kv_len.reshape(B * U))
                out = jnp.moveaxis(out.reshape(B, U, L, G, d), 1, 2)
                lse = jnp.moveaxis(lse.reshape(B, U, L, G), 1, 2)
        except NotImplementedError as e:  # jax's cuDNN shape/dtype rules, as a ValueError
            raise ValueError(f"implementation='cudnn' does not support q {q.dtype} "
                             f"head_dim={d}: {e} (use 'pallas' or 'xla')") from e
        out = view.ungather_out(out.reshape(B, L, U, G, d))
        lse = view.ungather_out(lse.reshape(B, L, U, G).astype(_F32))
        out, lse = _drop_invalid_rows(out, lse, view, mask, L)
        return out.astype(out_dtype or q.dtype), lse

    def backward(self, q, k, v, **kw):
        return XlaCore().backward(q, k, v, **kw)


XLA = XlaCore()
_NO_MASK = Mask()


def core_for(implementation: str, *, interpret: bool = False) -> Core:
    """The :class:`Core` of a resolved implementation name (``"xla"``, ``"pallas"``,
    ``"cudnn"``); see :func:`dilax.registry.resolve_implementation`."""
    if implementation == "xla":
        return XLA
    if implementation == "pallas":
        return PallasCore(interpret=bool(interpret))
    if implementation == "cudnn":
        return CudnnCore()
    raise ValueError(f"no attention core for implementation={implementation!r}")


@dataclasses.dataclass(frozen=True)
class _Call:
    core: Core
    view: SlotView
    scale: float
    block_sizes: BlockSizes | None
    out_dtype: object


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q, k, v, mask, fence, call: _Call):
    return _attention_fwd(q, k, v, mask, fence, call)[0]


def _attention_fwd(q, k, v, mask, fence, call: _Call):
    fwd = lambda q, k, v, mask: call.core.forward(
        q, k, v, view=call.view, mask=mask, scale=call.scale, block_sizes=call.block_sizes,
        out_dtype=call.out_dtype)
    out, lse = when(fence, fwd, (q, k, v, mask))
    return (out, lse), (q, k, v, mask, fence, out, lse)


def _attention_bwd(call: _Call, res, cotangents):
    q, k, v, mask, fence, out, lse = res
    dout, dlse = cotangents

    def bwd(q, k, v, mask, lse, dout, delta):
        return call.core.backward(q, k, v, view=call.view, mask=mask, scale=call.scale,
                                  block_sizes=call.block_sizes, lse=lse, dout=dout,
                                  delta=delta)

    grads = when(fence, bwd, (q, k, v, mask, lse, dout, output_delta(out, dout, dlse)))
    dmask = None
    if mask.bias is not None or mask.mods is not None:
        # the core returned d(bias) and the mods' d(consts) too; other leaves: no cotangent
        dmask = jax.tree.map(lambda _: None, dataclasses.replace(mask, mods=None))
        extra = grads[3:]
        if mask.bias is not None:
            dmask = dataclasses.replace(dmask, arrays=dataclasses.replace(
                dmask.arrays, bias=extra[0]))
            extra = extra[1:]
        if mask.mods is not None:
            dmask = dataclasses.replace(dmask, mods=mask.mods.cotangent(extra))
    return (*sum_invariant_axes((q, k, v), grads[:3]), dmask, None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, view: SlotView, scale: float,
              mask: Mask = _NO_MASK, core: Core = XLA, block_sizes: BlockSizes | None = None,
              out_dtype=None, fence=None) -> tuple[jax.Array, jax.Array]:
    """One differentiable core call: ``core.forward`` with ``core.backward`` as its VJP.

    ``q (B, Lq, [R,] H, d)`` and ``k, v (B, Lk, [R,] Hk, d)`` are read through ``view``;
    returns ``out (B, Lq, H_out, d)`` (``out_dtype``, default ``q.dtype``) and
    ``lse (B, Lq, H_out)`` float32 for the view's heads, ascending. A query with no visible
    key gets ``out = 0``, ``lse = -inf`` (zero gradient, never NaN). ``fence``: run forward
    and backward only once this boolean is known (:func:`dilax.core.fence_after`).
    """
    call = _Call(core, view, float(scale), block_sizes,
                 None if out_dtype is None else jnp.dtype(out_dtype))
    return _attention(q, k, v, mask, fence, call)


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
    q_len: jax.Array | None = None,
    key_range: tuple[jax.Array, jax.Array] | None = None,
    query_range: tuple[jax.Array, jax.Array] | None = None,
    mods: Mods | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Blockwise exact attention in the grouped layout, returning ``(out, lse)``.

    :func:`attention` with the XLA core and no view, for callers holding plain arrays.

    Args:
      q: ``(B, Lq, Hk, G, d)`` queries grouped by kv head (query head ``(c, g)`` reads kv
        head ``c``).
      k, v: ``(B, Lk, Hk, d)`` (``v`` may have its own head dim ``dv``: out ``(..., dv)``).
      scale: logit scale (static float).
      is_causal: key ``t`` is visible to query ``p`` iff ``k_offset + t <= q_offset + p``.
      kv_len: int, broadcastable to ``(B, Hk)``; keys at index ``>= kv_len`` are masked.
        ``None`` (default) means all ``Lk`` keys are valid and skips the mask entirely.
      q_offset, k_offset: global positions of index 0 (int scalars, may be traced).
      block_sizes: static block sizes; default :func:`dilax.core.default_block_sizes`.
      q_len: int, broadcastable to ``(B, Hk)``, or None: query rows at index ``>= q_len``
        see no key (``out = 0``, ``lse = -inf``).
      key_range, query_range: per-row key ranges ``(lo, hi)`` ``(B, Hk, Lq)`` and the
        queries' superset ranges per key ``(B, Hk, Lk)`` (:class:`Mask`), or None.
      mods: a :class:`dilax.core.mods.Mods` (score / mask mods, soft-cap), or None.

    Returns:
      ``out: (B, Lq, Hk, G, d)`` in ``q.dtype`` and ``lse: (B, Lq, Hk, G)`` float32. A query
      with no visible key gets ``out = 0`` and ``lse = -inf`` (zero gradient, never NaN).
    """
    B, Lq, Hk, G, d = q.shape
    out, lse = attention(q.reshape(B, Lq, Hk * G, d), k, v, view=identity_view(Hk, G),
                         scale=scale, mask=Mask(KeyBounds(
                             kv_len, q_offset, k_offset, bool(is_causal), q_len,
                             key_range=key_range, query_range=query_range), mods=mods),
                         block_sizes=block_sizes)
    return out.reshape(B, Lq, Hk, G, v.shape[-1]), lse.reshape(B, Lq, Hk, G)  # dv: v's
