"""Where each chunk of a sequence-sharded array lives, and moving chunks between devices.

The sequence of ``n`` positions is cut into ``V = P C`` chunks ("virtual blocks") of
``n / V`` positions; device ``i`` of the ``P`` devices of a mesh axis holds ``C`` of them.

* ``layout="contiguous"`` (``C = 1``): device ``i`` holds chunk ``i``, positions
  ``[i n/P, (i+1) n/P)``.
* ``layout="zigzag"`` (``C = 2``, causal load balance): device ``i`` holds chunk ``i`` followed
  by chunk ``2P - 1 - i`` of ``n / (2P)`` positions (see :func:`zigzag_permutation`).

Everything here moves whole chunks with ``lax.ppermute`` (point-to-point); nothing gathers
the sequence.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def vblock(P: int, C: int, i: int, c: int) -> int:
    """Virtual block held as chunk ``c`` of device ``i`` (C=1 contiguous, C=2 zigzag)."""
    if C == 1:
        return i
    return i if c == 0 else 2 * P - 1 - i


def owner(P: int, C: int, v: int) -> tuple[int, int]:
    """``(device, chunk)`` holding virtual block ``v``; the inverse of :func:`vblock`."""
    if C == 1:
        return v, 0
    return (v, 0) if v < P else (2 * P - 1 - v, 1)


def zigzag_permutation(n: int, num_devices: int) -> np.ndarray:
    """Positions in zigzag order: ``x[:, perm]`` is the layout ``layout="zigzag"`` expects.

    The sequence is cut into ``2 P`` chunks; device ``i`` holds chunk ``i`` then chunk
    ``2P - 1 - i``. Undo with ``np.argsort(perm)``. Requires ``n % (2 P) == 0``.
    """
    n, P = int(n), int(num_devices)
    if P <= 0 or n % (2 * P):
        raise ValueError(f"zigzag layout needs seq_len % (2 * num_devices) == 0, got n={n}, P={P}")
    mc = n // (2 * P)
    order = [vblock(P, 2, i, c) for i in range(P) for c in range(2)]
    return np.concatenate([np.arange(v * mc, (v + 1) * mc) for v in order])


def lookup(table, idx) -> jax.Array:
    """``table[idx]`` for a static int table and a traced device index."""
    return jnp.asarray(np.asarray(table, np.int32))[idx]


def gather_chunks(x: jax.Array, src_of: Callable, P: int, C: int, axis_name, fill=0.0):
    """``x: (b, C, ...)`` -> ``y`` with ``y[:, c]`` on device ``i`` = chunk ``c'`` of device ``j``
    where ``(j, c') = src_of(i, c)``, or ``fill`` where ``src_of`` gives None.

    One ``lax.ppermute`` per (source chunk, target chunk) pair; nothing else moves.
    """
    idx = lax.axis_index(axis_name)
    outs = []
    for c in range(C):
        srcs = [src_of(i, c) for i in range(P)]
        src_chunk = [s[1] if s is not None else -1 for s in srcs]
        y = None
        for cs in range(C):
            pairs = [(s[0], i) for i, s in enumerate(srcs) if s is not None and s[1] == cs]
            if not pairs:
                continue
            recv = lax.ppermute(x[:, cs], axis_name, pairs)
            if y is None and fill == 0 and C == 1:
                y = recv  # ppermute already leaves zeros where nothing arrives
                continue
            if y is None:
                y = jnp.full_like(recv, fill)
            y = jnp.where(lookup(src_chunk, idx) == cs, recv, y)
        outs.append(jnp.full_like(x[:, 0], fill) if y is None else y)
    return jnp.stack(outs, axis=1)


def vshift(x: jax.Array, k: int, P: int, C: int, axis_name, fill=0.0) -> jax.Array:
    """Chunk of virtual block ``v - k`` for every local chunk ``v`` (``fill`` outside 0..V-1)."""

    def src_of(i, c):
        u = vblock(P, C, i, c) - k
        return owner(P, C, u) if 0 <= u < P * C else None

    return gather_chunks(x, src_of, P, C, axis_name, fill)


def relayout(x: jax.Array, P: int, axis_name, to_zigzag: bool) -> jax.Array:
    """Local shard ``(b, m, ...)`` contiguous <-> zigzag, with ppermutes only."""
    b, m = x.shape[:2]
    xc = x.reshape(b, 2, m // 2, *x.shape[2:])

    def src_of(i, c):
        if to_zigzag:
            v = vblock(P, 2, i, c)
            return v // 2, v % 2
        return owner(P, 2, 2 * i + c)

    return gather_chunks(xc, src_of, P, 2, axis_name).reshape(x.shape)
