"""Any number of leading batch dimensions on the functional ops, as flax writes its shapes.

``q (batch..., n, h, d)``, ``k, v (batch..., n, hk, d)``: rank 3 (no batch dimension, what
``jax.vmap`` over the batch hands in) and rank > 4 (several) are folded into the rank-4
``(b, n, h, d)`` layout every op computes in, and the result is unfolded again. Per-row
arguments (valid lengths ``(batch...,)``, key padding ``(batch..., n)``) fold with them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

Unfold = Callable[[Any], Any]


def _identity(x: Any) -> Any:
    return x


def fold_batch_dims(q: Any, k: Any, v: Any, **per_row: Any
                    ) -> tuple[Any, Any, Any, dict[str, Any], Unfold]:
    """``(q, k, v, per_row, unfold)`` with ``q, k, v`` of rank 4 and ``per_row`` arrays of
    leading shape ``(b,)``; ``unfold(out)`` restores the callers' batch dimensions.

    Inputs already of rank 4, or whose ranks differ or are below 3, pass unchanged (the op's
    own checks then name what is wrong). An :class:`dilax.AttentionMask` in ``per_row`` has
    its array fields folded.

    Raises:
      ValueError: ``k`` or ``v`` with other leading dimensions than ``q``, or a per-row array
        whose leading dimensions are not those of ``q``.
    """
    ranks = {getattr(x, "ndim", None) for x in (q, k, v)}
    rank = ranks.pop() if len(ranks) == 1 else None
    if rank is None or rank == 4 or rank < 3:
        return q, k, v, per_row, _identity
    batch = tuple(q.shape[:-3])
    for name, x in (("k", k), ("v", v)):
        if tuple(x.shape[:-3]) != batch:
            raise ValueError(f"q, k and v must have the same leading batch dimensions, got q "
                             f"{tuple(q.shape)} and {name} {tuple(x.shape)}")
    size = math.prod(batch)

    def fold(x, name):
        if x is None:
            return None
        x = jnp.asarray(x)
        if tuple(x.shape[:len(batch)]) != batch:
            raise ValueError(f"{name} must have the leading batch dimensions {batch} of q "
                             f"{tuple(q.shape)}, got shape {tuple(x.shape)}")
        return x.reshape((size, *x.shape[len(batch):]))

    def fold_value(name, x):
        if dataclasses.is_dataclass(x):  # an AttentionMask: fold its array fields
            arrays = {f.name: fold(getattr(x, f.name), f"{name}.{f.name}")
                      for f in dataclasses.fields(x) if not f.metadata.get("static")}
            return dataclasses.replace(x, **arrays)
        return fold(x, name)

    folded = {name: fold_value(name, x) for name, x in per_row.items()}
    qkv = tuple(x.reshape((size, *x.shape[len(batch):])) for x in (q, k, v))

    def unfold(out):
        return out.reshape((*batch, *out.shape[1:]))

    return (*qkv, folded, unfold)
