"""Positions of the LongNet models: rotary codes applied to queries and keys inside every
self-attention (:func:`rotary_qk`: XPOS, Sun et al. 2022, "A length-extrapolatable
transformer", as torchscale applies it, or plain RoPE), at the token index from 0.

Also :func:`xpos` and its module form :class:`XPOS`: the torchscale XPOS function on one
array (positions centred on the array), kept as a building block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dilax import _validation as V

# "xpos_embedding" is no scheme of this version: it names what LongNetLM did before issue 26
# (XPOS added to the token embeddings, centred on the window), so old checkpoints are refused
# by name rather than reinterpreted.
POSITION_SCHEMES: tuple[str, ...] = ("xpos", "rope", "none")
LEGACY_POSITION_SCHEME = "xpos_embedding"


def check_position_scheme(scheme: str) -> str:
    """``scheme`` if it is one of :data:`POSITION_SCHEMES`, else ``ValueError``."""
    if not isinstance(scheme, str):
        raise TypeError(f"position_scheme must be a str, one of {POSITION_SCHEMES}, got "
                        f"{scheme!r}")
    if scheme == LEGACY_POSITION_SCHEME:
        raise ValueError(
            "position_scheme 'xpos_embedding' (XPOS added to the token embeddings, centred on "
            "the window: what LongNetLM did before issue 26) is not supported: a causal "
            "model's logits depended on the window length; use 'xpos' or 'rope' (positions "
            "inside attention) and retrain")
    if scheme not in POSITION_SCHEMES:
        raise ValueError(f"position_scheme must be one of {POSITION_SCHEMES}, got {scheme!r}")
    return scheme


# XPOS scales pair i by zeta_i^(+-(p - c)/scale_base), zeta_0 = 0.4/1.4: past |x| = 80 in
# exp(x) the float32 (and bfloat16) scales overflow or vanish and q.k turns to inf * 0.
_XPOS_MAX_EXPONENT = 80.0


def xpos_max_length(scale_base: float) -> int:
    """The longest window (positions ``0 .. n - 1``, centred) whose XPOS scales stay in
    float32 range: ``2 * 80 * scale_base / ln(3.5)`` (65,391 at the default 512)."""
    return int(2 * _XPOS_MAX_EXPONENT * scale_base / np.log(3.5))


def check_xpos_length(n: int, scale_base: float, name: str = "sequence length") -> None:
    """``ValueError`` when a window of ``n`` positions is past :func:`xpos_max_length`."""
    limit = xpos_max_length(scale_base)
    if n > limit:
        raise ValueError(
            f"{name} {n} is too long for position_scheme 'xpos' with xpos_scale_base="
            f"{scale_base:g}: its scales leave the float32 range past {limit:,} positions; "
            f"use xpos_scale_base >= {int(np.ceil(n * np.log(3.5) / 160))} or "
            "position_scheme 'rope'")


def default_positions(batch: int, n: int) -> jax.Array:
    """``(batch, n)`` int32: the token index ``0 .. n - 1`` of every row."""
    return jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (batch, n))


def check_positions(positions: jax.Array | None, batch: int, n: int,
                    name: str = "positions") -> jax.Array:
    """``positions`` as int32 ``(batch, n)`` (default :func:`default_positions`); a
    ``ValueError`` naming ``name`` for another shape or a non-integer dtype."""
    if positions is None:
        return default_positions(batch, n)
    positions = jnp.asarray(positions)
    if positions.shape != (batch, n) or not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array of shape (batch, seq_len) = "
                         f"({batch}, {n}), got {positions.dtype}{tuple(positions.shape)}")
    return positions.astype(jnp.int32)


def rotary_qk(
    q: jax.Array,
    k: jax.Array,
    positions: jax.Array | None = None,
    *,
    scheme: str = "xpos",
    scale_base: float = 512.0,
    theta: float = 10000.0,
    centre: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """Rotary positions on queries and keys at the same positions (self-attention).

    Every feature pair ``(x[2i], x[2i+1])`` of a head at position ``p`` is rotated by the angle
    ``p / theta^(2i/d)`` (RoPE), so ``<q_m, k_t>`` depends on ``m - t`` only. ``"xpos"``
    also scales query pairs by ``zeta_i^((p - c)/scale_base)`` and key pairs by its inverse,
    ``zeta_i = (2i + 0.4 d) / (1.4 d)``: ``<q_m, k_t>`` gets the factor
    ``zeta_i^((m - t)/scale_base)``, which decays with the distance of a causal key (as in
    torchscale). The centre ``c`` cancels in ``q.k``; it only keeps the two scales in float
    range (``|p - c| ln(3.5) / scale_base`` below ~80: callers pass the middle of the window).
    ``"none"`` returns ``q`` and ``k`` unchanged.

    Args:
      q: ``(b, n, h, d)``; k: ``(b, n, hk, d)``, ``d`` even.
      positions: int ``(b, n)`` position of every row's tokens (default ``0 .. n - 1``; a
        packed batch may restart them per document).
      scheme: ``"xpos"``, ``"rope"`` or ``"none"``.
      scale_base: XPOS scale base (torchscale: 512). theta: the rotary base (10000).
      centre: static int ``c`` (XPOS only).
    Returns:
      ``(q, k)`` rotated, in their dtypes (computed in float32).
    """
    scheme = check_position_scheme(scheme)
    if scheme == "none":
        return q, k
    b, n, _, d = q.shape
    if k.shape[:2] != (b, n) or k.shape[-1] != d or q.ndim != 4 or k.ndim != 4:
        raise ValueError(f"rotary_qk needs q (b, n, h, d) and k (b, n, hk, d) at the same "
                         f"positions, got {tuple(q.shape)} and {tuple(k.shape)}")
    if d % 2:
        raise ValueError(f"rotary positions need an even head dimension, got {d}")
    pos = check_positions(positions, b, n)
    inv_freq = theta ** (-np.arange(d // 2, dtype=np.float64) / (d // 2))
    angle = pos.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)[None, None]
    cos, sin = jnp.cos(angle), jnp.sin(angle)  # (b, n, d/2)
    if scheme == "rope":
        return _rotate_heads(q, cos, sin), _rotate_heads(k, cos, sin)
    zeta = (np.arange(0, d, 2, dtype=np.float64) + 0.4 * d) / (1.4 * d)
    # integer difference first: exact, whatever the size of the positions
    expo = ((pos - V.static_int(centre, "centre")).astype(jnp.float32)[..., None]
            * jnp.asarray(np.log(zeta) / float(scale_base), jnp.float32)[None, None])
    up, down = jnp.exp(expo), jnp.exp(-expo)
    return (_rotate_heads(q, cos * up, sin * up), _rotate_heads(k, cos * down, sin * down))


def _rotate_heads(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """:func:`_rotate` of ``x (b, n, h, d)`` in float32 with ``(b, n, d/2)`` tables."""
    cos = jnp.repeat(cos, 2, axis=-1)[:, :, None, :]
    sin = jnp.repeat(sin, 2, axis=-1)[:, :, None, :]
    return _rotate(x.astype(jnp.float32), cos, sin).astype(x.dtype)


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
