"""Static views of the core's inputs: which rows, slots and heads one call reads.

A :class:`SlotView` lets the core read dilated rows in place (reshape only, no gathered
copies); kernels that cannot read through a view get gathered ``(B, L, U, G, d)`` inputs from
:meth:`SlotView.gather_q` / :meth:`SlotView.gather_kv` instead.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


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


    # Whole-array forms, for kernels that take gathered ``(B, L, U, G, d)`` inputs.

    def _rows_flat(self, x, heads):
        """``(B, L, [R,] heads, ...)`` -> ``(B, L, R * heads, ...)``."""
        return x if self.num_slots == 1 else x.reshape(
            *x.shape[:2], self.num_slots * heads, *x.shape[4:])

    def gather_q(self, x):
        """``(B, L, [R,] H, ...)`` -> ``(B, L, U, G, ...)``: the queries the view reads."""
        y = static_take(self._rows_flat(x, self.num_heads), self.q_index, axis=2)
        return y.reshape(*y.shape[:2], len(self.kv_index), self.q_per_kv, *y.shape[3:])

    def gather_kv(self, x):
        """``(B, L, [R,] Hk, ...)`` -> ``(B, L, U, ...)``."""
        return static_take(self._rows_flat(x, self.num_kv_heads), self.kv_index, axis=2)

    def ungather_out(self, y):
        """``(B, L, U, G, ...)`` -> ``(B, L, H_out, ...)``: heads ascending (output layout)."""
        y = y.reshape(*y.shape[:2], len(self.q_index), *y.shape[4:])
        return static_take(y, self._out_order, axis=2)

    def ungather_q(self, y):
        """``(B, L, U, G, ...)`` -> ``(B, L, [R,] H, ...)`` over all heads (0 where unread)."""
        B, L = y.shape[:2]
        y = _scatter_static(y.reshape(B * L, len(self.q_index), *y.shape[4:]), self.q_index,
                            self.num_slots * self.num_heads)
        return y.reshape(B, L, *self._slot_heads(self.num_heads), *y.shape[2:])

    def ungather_kv(self, y):
        """``(B, L, U, ...)`` -> ``(B, L, [R,] Hk, ...)``; repeated reads are summed."""
        B, L = y.shape[:2]
        y = _scatter_static(y.reshape(B * L, *y.shape[2:]), self.kv_index,
                            self.num_slots * self.num_kv_heads)
        return y.reshape(B, L, *self._slot_heads(self.num_kv_heads), *y.shape[2:])

    def _slot_heads(self, heads):
        return (heads,) if self.num_slots == 1 else (self.num_slots, heads)


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


@dataclasses.dataclass(frozen=True)
class SplitView:
    """Queries (and dq, the output layout) read through ``q``, keys and values (and dk, dv)
    through ``kv``: e.g. a shard's queries in place through a :class:`SlotView` against
    gathered key chunks (``identity_view``). Both views have the same virtual heads
    (``len(kv_index)`` and ``q_per_kv``). The XLA core's backward reads inputs through it."""

    q: SlotView
    kv: SlotView

    def __post_init__(self):
        if (len(self.q.kv_index), self.q.q_per_kv) != (len(self.kv.kv_index), self.kv.q_per_kv):
            raise ValueError("SplitView: q and kv views must have the same virtual heads")

    @property
    def kv_index(self) -> tuple[int, ...]:
        return self.kv.kv_index

    @property
    def q_per_kv(self) -> int:
        return self.q.q_per_kv

    def select_q(self, x):
        return self.q.select_q(x)

    def expand_rows_q(self, x):
        return self.q.expand_rows_q(x)

    def output_view(self) -> SlotView:
        return self.q.output_view()

    def select_kv(self, x):
        return self.kv.select_kv(x)

    def expand_kv(self, x):
        return self.kv.expand_kv(x)

    # Whole-array forms (kernel cores): queries through ``q``, keys and values through ``kv``.

    def gather_q(self, x):
        return self.q.gather_q(x)

    def ungather_q(self, y):
        return self.q.ungather_q(y)

    def gather_kv(self, x):
        return self.kv.gather_kv(x)

    def ungather_kv(self, y):
        return self.kv.ungather_kv(y)


def identity_view(num_kv_heads: int, q_per_kv: int) -> SlotView:
    h = num_kv_heads * q_per_kv
    return SlotView(1, h, num_kv_heads, tuple(range(h)), tuple(range(num_kv_heads)))


