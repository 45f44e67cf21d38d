"""The table-driven Pallas block-sparse kernel as a :class:`~dilax.core.Core`.

:func:`dilax.block_sparse_attention` with ``implementation="pallas"`` runs one
:func:`dilax.core.attention` call with this core, so the block-sparse kernel sits behind the
same ``forward``/``backward`` interface (and the same ``custom_vjp``) as every other core.
The core is bound to its pattern (a static, hashable value); the :class:`~dilax.core.Mask`
carries causality and the valid lengths ``q_len``/``kv_len`` ``(B, Hk)`` (offsets 0), which
the kernels apply themselves (key blocks past ``kv_len`` are not visited; rows past ``q_len`` get
``out = 0``, ``lse = -inf`` and zero gradient). What the kernel cannot serve (a band, a
per-key mask, a bias, offsets, another head view) raises: :mod:`dilax.registry` decides which
core runs a block-sparse request (``supports("pallas", CoreRequest("block_sparse", ...))``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar

import jax.numpy as jnp

from dilax.core.interface import pallas_config
from dilax.core.view import identity_view

if TYPE_CHECKING:
    from dilax.patterns import BlockSparsePattern

_F32 = jnp.float32


def _nonzero(offset) -> bool:
    """A static non-zero offset (under ``jit`` the core's custom VJP may see the offsets as
    tracers: positions start at 0 here, as :func:`dilax.block_sparse_attention` passes)."""
    return isinstance(offset, int) and offset != 0


@dataclasses.dataclass(frozen=True)
class BlockSparsePallasCore:
    """:mod:`pallas_kernels.block_sparse` for ``pattern`` on ``q (B, n, h, d)``,
    ``k, v (B, n, hk, d)`` read through the identity view (query head ``j`` reads kv head
    ``j // (h // hk)``); ``interpret``: the Pallas interpreter (CPU tests)."""

    pattern: BlockSparsePattern
    interpret: bool = False
    name: ClassVar[str] = "pallas"

    def _args(self, q, k, view, mask, block_sizes):
        B, n, h, d = q.shape
        hk = k.shape[2]
        if view != identity_view(hk, h // hk):
            raise ValueError("the Pallas block-sparse core reads the identity head view only")
        bounds = mask.bounds
        if (bounds.window is not None or mask.arrays is not None or mask.mods is not None
                or _nonzero(bounds.q_offset) or _nonzero(bounds.k_offset)):
            raise ValueError("implementation='pallas': the block-sparse kernel takes causality "
                             "and valid lengths only (no band, per-key mask, bias, mods or "
                             "offsets; "
                             "dilax.registry decides which core runs which call)")
        bs = self.pattern.block_size
        tables = self._tables(n, h, bounds.is_causal)
        lengths = None
        if bounds.q_len is not None or bounds.kv_len is not None:
            m = mask.resolve(B, hk, n, n).bounds
            full = jnp.full((B, hk), n, jnp.int32)
            lengths = jnp.clip(jnp.stack([full if m.q_len is None else m.q_len,
                                          full if m.kv_len is None else m.kv_len], -1), 0, n)
        return tables, dict(lengths=lengths, block_size=bs, is_causal=bool(bounds.is_causal),
                            config=pallas_config(block_sizes, n, n, d, q.dtype),
                            interpret=self.interpret)

    def _tables(self, n: int, h: int, is_causal: bool):
        """The kernels' tables of ``pattern`` (a subclass may give prepared ones: the
        block-sparse ring's hops, :mod:`dilax.block_sparse.ring_plan`)."""
        from pallas_kernels.block_sparse import sparse_tables  # lazy: optional kernels

        return sparse_tables(*self.pattern.tables(is_causal), n=n,
                             block_size=self.pattern.block_size, num_heads=h,
                             is_causal=is_causal)

    def forward(self, q, k, v, *, view, mask, scale, block_sizes=None, out_dtype=None):
        """``out (B, n, h, d)`` (``out_dtype``, default ``q.dtype``), ``lse (B, n, h)``."""
        from pallas_kernels.block_sparse import sparse_forward

        B, n, h, d = q.shape
        hk = k.shape[2]
        tables, kw = self._args(q, k, view, mask, block_sizes)
        out, lse = sparse_forward(q.reshape(B, n, hk, h // hk, d), k, v, tables,
                                  scale=float(scale), **kw)
        return out.reshape(B, n, h, d).astype(out_dtype or q.dtype), lse.reshape(B, n, h)

    def backward(self, q, k, v, *, view, mask, scale, lse, dout, delta, block_sizes=None,
                 grad_dtype=None, acc=None):
        """``(dq, dk, dv)`` recomputed from ``lse``; ``delta = rowsum(dO * O) - dlse``."""
        from pallas_kernels.block_sparse import sparse_backward

        B, n, h, d = q.shape
        hk = k.shape[2]
        tables, kw = self._args(q, k, view, mask, block_sizes)
        group = lambda x: x.reshape(B, n, hk, h // hk, *x.shape[3:])
        dq, dk, dv = sparse_backward(group(q), k, v, tables, lse=group(lse), dout=group(dout),
                                     delta=group(delta), scale=float(scale), **kw)
        grads = (dq.reshape(q.shape), dk, dv)
        if acc is not None:  # the backward's acc contract: add into float32 accumulators
            grads = tuple(a.astype(_F32) + g.astype(_F32) for a, g in zip(acc, grads))
        return tuple(g.astype(grad_dtype or x.dtype) for g, x in zip(grads, (q, k, v)))
