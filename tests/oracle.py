"""Float64 NumPy oracle of the SPEC's mask-based attention, forward and backward.

``attention`` is dense softmax attention with multiplicity weights ``C >= 0`` (``C = 0``: masked),
the definition ``dilax.reference.masked_attention`` implements in jax; ``dilated`` feeds it the
SPEC's count matrix ``dilax.reference.dilated_counts``. Being NumPy, it compiles nothing (the
jax reference compiles one program per configuration), and being float64 its own rounding error
is negligible next to a float32 implementation's, so a test's tolerance budgets for the
implementation alone (``tests/tolerance.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from dilax.reference import dilated_counts


class Result(NamedTuple):
    out: np.ndarray  # (b, n, h, d)
    lse: np.ndarray  # (b, n, h): log sum_t C e^s, -inf where a query attends no key
    dq: np.ndarray | None = None
    dk: np.ndarray | None = None
    dv: np.ndarray | None = None


def f64(x) -> np.ndarray:
    """Any array (jax, NumPy, bfloat16 ...) as float64 NumPy."""
    return np.asarray(np.asarray(x).astype(np.float32), np.float64)


def attention(q, k, v, weights, scale: float, dout=None, dlse=None) -> Result:
    """``out = sum_t C e^s v / sum_t C e^s`` (0 where no key), and with ``dout`` (and
    optionally ``dlse``, the cotangent of ``lse``) the gradients w.r.t. q, k, v.

    q: ``(b, n, h, d)``; k, v: ``(b, m, hk, d)``, query head ``j`` reads kv head
    ``j // (h // hk)``; weights: broadcastable to ``(b, h, n, m)``.
    """
    q, k, v = f64(q), f64(k), f64(v)
    b, n, h, _ = q.shape
    hk = k.shape[2]
    kr, vr = np.repeat(k, h // hk, axis=2), np.repeat(v, h // hk, axis=2)
    w = np.broadcast_to(np.asarray(weights, np.float64), (b, h, n, k.shape[1]))
    s = np.einsum("bqhd,bkhd->bhqk", q, kr) * scale
    allowed = w > 0
    s = np.where(allowed, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        e = np.where(allowed, w * np.exp(s - m), 0.0)
        den = e.sum(-1, keepdims=True)
        lse = np.where(den > 0, np.log(den) + m, -np.inf)[..., 0].transpose(0, 2, 1)
    p = e / np.where(den > 0, den, 1.0)
    out = np.einsum("bhqk,bkhd->bqhd", p, vr)
    if dout is None:
        return Result(out, lse)
    g = f64(dout)
    dvr = np.einsum("bhqk,bqhd->bkhd", p, g)
    dp = np.einsum("bqhd,bkhd->bhqk", g, vr)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True))
    if dlse is not None:
        ds += p * f64(dlse).transpose(0, 2, 1)[..., None]
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kr) * scale
    dkr = np.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    fold = lambda x: x.reshape(*x.shape[:2], hk, h // hk, x.shape[-1]).sum(3)  # noqa: E731
    return Result(out, lse, dq, fold(dkr), fold(dvr))


def dilated(q, k, v, segment_lengths, dilation_rates, mode: str = "mixture",
            is_causal: bool = False, scale: float | None = None, dout=None) -> Result:
    """Dilated attention of SPEC.md: ``attention`` with the count matrix ``C`` of the
    configuration (grouped mode: divided by the number of branches G)."""
    n, h, d = np.shape(q)[1:]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    counts = dilated_counts(n, h, segment_lengths, dilation_rates, mode, is_causal)
    if mode != "grouped":
        return attention(q, k, v, counts, scale, dout)
    G = len(segment_lengths)
    r = attention(q, k, v, counts, scale, None if dout is None else f64(dout) / G)
    return r._replace(out=r.out / G)
