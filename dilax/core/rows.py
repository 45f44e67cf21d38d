"""Row-gathered reads and writes of the blockwise XLA core (:class:`~dilax.core.RowLayout`
``rows``): a sequence whose row ``i`` of virtual kv head ``u`` is position ``rows[b, u, i]``
of the inputs. The core then reads each block's rows where they lie (one gather of the
block, no gathered copy of the inputs) and adds gradients into the inputs' own layout (one
scatter-add per block). Packed documents use it: a branch's document-dilated sequence
(:mod:`dilax.dilated.documents`) is a different selection of positions for every offset."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dilax.core.arrays import dynamic_slice


def heads_of(index, num_heads: int, groups: int | None = None) -> np.ndarray:
    """The heads a view's flat ``slot * H + head`` indices read, ``(U,)`` or ``(U, G)``."""
    heads = np.asarray(index, np.int32) % num_heads
    return heads if groups is None else heads.reshape(-1, groups)


def flat_index(rows: jax.Array, b, length: int, heads: np.ndarray, num_heads: int):
    """Flat row indices into ``x.reshape(-1, d)`` of ``x (B, length, num_heads, d)`` for
    ``rows (U, L)`` of batch row ``b``: ``(U, G, L)`` for ``heads (U, G)``, ``(U, L)`` for
    ``heads (U,)``."""
    base = (b * length + rows) * num_heads
    if heads.ndim == 2:
        return base[:, None, :] + jnp.asarray(heads)[:, :, None]
    return base + jnp.asarray(heads)[:, None]


def read(src: jax.Array, index: jax.Array, dtype) -> jax.Array:
    """``src (N, d)`` (or its bits, :func:`dilax.core.xla._as_bits`) at ``index``, as
    ``dtype``: ``index.shape + (d,)``."""
    x = jnp.take(src, index, axis=0, mode="clip")
    return x if x.dtype == dtype else lax.bitcast_convert_type(x, dtype)


def add(acc: jax.Array, index: jax.Array, values: jax.Array) -> jax.Array:
    """``acc (B, L, H, d)`` with ``values`` (``index.shape + (d,)``) added at ``index``."""
    flat = acc.reshape(-1, acc.shape[-1])
    return flat.at[index].add(values.astype(acc.dtype), mode="drop").reshape(acc.shape)


@dataclasses.dataclass(frozen=True)
class RowReader:
    """The block reads and gradient writes of one row-gathered core call: ``q_rows``,
    ``k_rows`` ``(B, U, L)`` padded to whole blocks, the inputs flat ``(B * n * H, d)`` (half
    types as their bits), their dtypes, ``n`` and the heads of each virtual head."""

    q_rows: jax.Array
    k_rows: jax.Array
    src: tuple
    dtypes: tuple
    n: int
    q_heads: np.ndarray  # (U, G)
    kv_heads: np.ndarray  # (U,)

    @staticmethod
    def _block(rows, b, start, size, u0, u1):
        at = tuple(jnp.asarray(i, jnp.int32) for i in (b, u0, start))
        return dynamic_slice(rows, at, (1, u1 - u0, size))[0]

    def read_q(self, b, start, size, u0, u1):
        """``(U, G, size, d)``: the query rows ``start ..`` of virtual heads ``u0 .. u1``."""
        idx = flat_index(self._block(self.q_rows, b, start, size, u0, u1), b, self.n,
                         self.q_heads[u0:u1], self._num_q_heads)
        return read(self.src[0], idx, self.dtypes[0])

    @property
    def _num_q_heads(self) -> int:
        return self.src[0].shape[0] // (self.q_rows.shape[0] * self.n)

    @property
    def _num_kv_heads(self) -> int:
        return self.src[1].shape[0] // (self.k_rows.shape[0] * self.n)

    def read_kv(self, b, start, size, u0, u1):
        """``(U, size, d)`` keys and values of rows ``start ..`` of virtual heads ``u0 .. u1``."""
        idx = flat_index(self._block(self.k_rows, b, start, size, u0, u1), b, self.n,
                         self.kv_heads[u0:u1], self._num_kv_heads)
        return read(self.src[1], idx, self.dtypes[1]), read(self.src[2], idx, self.dtypes[2])

    def add_q(self, dq, b, start, size, values):
        """``dq (B, L, H, d)`` with ``values (U, G, size, d)`` added at their rows."""
        idx = flat_index(self._block(self.q_rows, b, start, size, 0, len(self.kv_heads)), b,
                         dq.shape[1], self.q_heads, dq.shape[2])
        return add(dq, idx, values)

    def add_kv(self, dk, dv, b, start, size, dk_b, dv_b):
        """``dk, dv (B, L, Hk, d)`` with ``dk_b, dv_b (U, size, d)`` added at their rows."""
        idx = flat_index(self._block(self.k_rows, b, start, size, 0, len(self.kv_heads)), b,
                         dk.shape[1], self.kv_heads, dk.shape[2])
        return add(dk, idx, dk_b), add(dv, idx, dv_b)
