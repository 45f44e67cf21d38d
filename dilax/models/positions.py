"""XPOS (Sun et al. 2022, "A length-extrapolatable transformer"): the rotary position code
with an exponential scale that :class:`dilax.models.LongNetLM` adds to its token embeddings;
:func:`xpos`, its module form :class:`XPOS`, and the static tables a KV-cache decode reads
positions from."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dilax import _validation as V


def _xpos_tables(n: int, d: int, offset: int, downscale: bool, scale_base: float):
    """Static ``(n, d)`` float32 ``cos * scale`` and ``sin * scale`` tables of :func:`xpos`."""
    total = n + offset
    lo = (-total) // 2  # positions centred on 0: lo .. lo + total - 1
    pos = np.arange(lo, lo + total, dtype=np.float64)[:, None]
    zeta = (np.arange(0, d, 2, dtype=np.float64) + 0.4 * d) / (1.4 * d)  # (d/2,) in (0, 1)
    scale = zeta[None, :] ** (pos / scale_base)
    inv_freq = 10000.0 ** (-np.arange(d // 2, dtype=np.float64) / (d // 2))
    angle = np.arange(total, dtype=np.float64)[:, None] * inv_freq[None, :]
    scale, angle = scale[-n:], angle[-n:]
    if downscale:
        scale = 1.0 / scale
    cos = np.repeat(np.cos(angle) * scale, 2, axis=-1)
    sin = np.repeat(np.sin(angle) * scale, 2, axis=-1)
    return cos.astype(np.float32), sin.astype(np.float32)


def xpos(
    x: jax.Array, *, offset: int = 0, downscale: bool = False, scale_base: float = 512.0
) -> jax.Array:
    """XPOS (Sun et al. 2022, "A length-extrapolatable transformer") rotary position code.

    Rotates each pair ``(x[2i], x[2i+1])`` at position ``p`` by the angle
    ``p / 10000^(2i/d)`` and scales it by ``zeta_i^(p'/scale_base)``, with
    ``zeta_i = (2i + 0.4 d) / (1.4 d)`` and ``p'`` the position centred on 0 (the torchscale
    convention). ``downscale=True`` uses ``1 / zeta^...`` (for keys).

    Args:
      x: ``(..., n, d)`` with ``d`` even.
    Returns:
      ``(..., n, d)`` in ``x.dtype``.
    """
    n, d = x.shape[-2], x.shape[-1]
    if d % 2:
        raise ValueError(f"xpos needs an even feature dimension, got x.shape {x.shape}")
    offset = V.static_int(offset, "offset")
    cos, sin = _xpos_tables(n, d, offset, bool(downscale), float(scale_base))
    return _rotate(x, jnp.asarray(cos), jnp.asarray(sin))


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """``x * cos + rotate_pairs(x) * sin`` (the XPOS arithmetic, tables broadcast to ``x``)."""
    pairs = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)
    cos, sin = (jnp.broadcast_to(t.astype(x.dtype), x.shape) for t in (cos, sin))  # rank "raise"
    return (x * cos + rotated * sin).astype(x.dtype)


class XPOS(nnx.Module):
    """Parameter-free module form of :func:`xpos` (``(b, n, d)`` in and out)."""

    def __init__(self, scale_base: float = 512.0):
        self.scale_base = float(scale_base)

    def __call__(self, x: jax.Array, *, offset: int = 0, downscale: bool = False) -> jax.Array:
        return xpos(x, offset=offset, downscale=downscale, scale_base=self.scale_base)
