"""FlexAttention for JAX: your own scores and masks on the blockwise core (docs/semantics.md,
"Custom scores and masks (FlexAttention semantics)").

:func:`flex_attention` runs one :func:`dilax.core.attention` call on the XLA core with a
:class:`dilax.core.mods.Mods` hook: the mods are traced once at scalars (their closed-over
arrays become operands, so gradients reach them), applied to each block's float32 scaled
logits, and recomputed per block in the backward. A :class:`~dilax.flex.block_mask.BlockMask`
makes the key loop visit only its partial and full blocks. ``sinks`` are applied to the
core's result from its log-sum-exp (the core's backward takes the lse cotangent).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dilax import registry
from dilax.core import XLA, BlockSizes, Mask, attention, identity_view
from dilax.core.mods import ModFn, Mods, trace_mod
from dilax.flex.block_mask import BlockMask

_F32 = jnp.float32
_FLOATS = tuple(jnp.dtype(t) for t in ("float32", "bfloat16", "float16", "float64"))


def _check_arrays(query, key, value):
    names = ("query", "key", "value")
    arrays = tuple(jnp.asarray(x) for x in (query, key, value))
    for name, x in zip(names, arrays):
        if x.ndim != 4:
            raise ValueError(f"flex_attention: {name} must be rank 4 (b, n, h, d) like "
                             f"jax.nn.dot_product_attention, got shape {x.shape}")
        if x.dtype not in _FLOATS:
            raise TypeError(f"flex_attention: {name} must be floating, got {x.dtype}")
    q, k, v = arrays
    if len({q.dtype, k.dtype, v.dtype}) != 1:
        raise TypeError(f"flex_attention: query, key, value must share one dtype, got "
                        f"{q.dtype}, {k.dtype}, {v.dtype}")
    (b, _, h, d), (bk, s, hk, dk) = q.shape, k.shape
    if bk != b or v.shape[0] != b:
        raise ValueError(f"flex_attention: batch mismatch: query {q.shape}, key {k.shape}, "
                         f"value {v.shape}")
    if dk != d:
        raise ValueError(f"flex_attention: key head dim {dk} != query head dim {d}")
    if v.shape[1:3] != (s, hk):
        raise ValueError(f"flex_attention: value must be (b, s, hk, dv) with key's s={s} and "
                         f"hk={hk}, got {v.shape}")
    if hk == 0 or h % hk:
        raise ValueError(f"flex_attention: query heads h={h} must be a multiple of the key "
                         f"heads hk={hk} (GQA)")
    return q, k, v


def _check_block_mask(block_mask, b, h, n, s, op="flex_attention"):
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"{op}: block_mask must be a dilax.flex.BlockMask "
                        f"(dilax.create_block_mask), got {type(block_mask).__name__}")
    Bm, Hm, Q_LEN, KV_LEN = block_mask.shape
    if (Q_LEN, KV_LEN) != (n, s) or Bm not in (1, b) or Hm not in (1, h):
        raise ValueError(f"{op}: block_mask of shape (B, H, Q_LEN, KV_LEN)="
                         f"{block_mask.shape} does not fit query/key (b={b}, h={h}, n={n}, "
                         f"s={s}): it needs Q_LEN == n, KV_LEN == s, B in (1, b), H in (1, h)")


class FlexMods(NamedTuple):
    """Checked FlexAttention options of one call (:func:`prepare_mods`), ready for
    :func:`flex_core`: the mods traced (:func:`dilax.core.mods.trace_mod`), the cap a static
    float, ``sinks`` a float ``(h,)`` array, the block mask's tables."""

    score: ModFn | None = None
    score_consts: tuple = ()
    mask: ModFn | None = None
    mask_consts: tuple = ()
    cap: float | None = None
    sinks: jax.Array | None = None
    block_mask: BlockMask | None = None

    @property
    def request_flags(self) -> dict:
        """The :class:`dilax.registry.CoreRequest` fields these options set."""
        return dict(has_score_mod=self.score is not None or self.cap is not None,
                    has_mask_mod=self.mask is not None, has_sinks=self.sinks is not None)


def prepare_mods(op: str, b: int, h: int, n: int, s: int, *, score_mod=None, mask_mod=None,
                 block_mask=None, sinks=None, logits_soft_cap=None) -> FlexMods | None:
    """Checks and traces the FlexAttention options of a call of ``op`` (its name starts the
    messages) on ``b`` batch rows, ``h`` query heads, ``n`` queries and ``s`` keys; None when
    none is set (the op's own path, unchanged).

    Raises:
      TypeError / ValueError naming the argument (see :func:`flex_attention`).
    """
    if (score_mod, mask_mod, block_mask, sinks, logits_soft_cap) == (None,) * 5:
        return None
    if block_mask is not None:
        _check_block_mask(block_mask, b, h, n, s, op)
        if mask_mod is None:
            mask_mod = block_mask.mask_mod
    cap = None if logits_soft_cap is None else _positive(logits_soft_cap, "logits_soft_cap",
                                                         op)
    if sinks is not None:
        sinks = jnp.asarray(sinks)
        if sinks.shape != (h,) or not jnp.issubdtype(sinks.dtype, jnp.floating):
            raise ValueError(f"{op}: sinks must be a float array (h,) = ({h},), got "
                             f"{sinks.dtype}{list(sinks.shape)}")
    score = mask = None
    score_consts = mask_consts = ()
    if score_mod is not None:
        score, score_consts = trace_mod(score_mod, "score_mod")
    if mask_mod is not None:
        mask, mask_consts = trace_mod(mask_mod, "mask_mod")
    return FlexMods(score, score_consts, mask, mask_consts, cap, sinks, block_mask)


def core_mods(mods: FlexMods | None) -> Mods | None:
    """The core's :class:`dilax.core.mods.Mods` of ``mods`` (no block tables, no positions;
    ``sinks`` are the op's, :func:`with_sinks`), or None when it sets no score, mask or cap."""
    if mods is None or (mods.score, mods.mask, mods.cap) == (None, None, None):
        return None
    return Mods(tuple(mods.score_consts), tuple(mods.mask_consts), None, None, mods.score,
                mods.mask, mods.cap)


def flex_core(q, k, v, mods: FlexMods, *, scale: float, base: Mask | None = None, core=XLA):
    """``(out (b, n, h, dv) in q.dtype, lse (b, n, h) float32)`` of the checked arrays
    ``q (b, n, h, d)``, ``k (b, s, hk, d)``, ``v (b, s, hk, dv)`` with ``mods`` on the XLA core
    (identity view; positions ``0 ..``). ``base``: the op's own :class:`dilax.core.Mask`
    (lengths, causality, band, dense bias / mask, key ranges) the mods are added to. With
    ``sinks`` the lse is the denominator's, sinks included. ``core``: the
    :class:`dilax.core.Core` that runs it (the Pallas kernels read the block tables with
    their own tiles where these divide the blocks, else visit every tile)."""
    (b, n, h, _), s, dv = q.shape, k.shape[1], v.shape[-1]
    if 0 in (b, n, s):  # nothing to compute: empty, or rows without keys (0, lse = -inf)
        out = jnp.zeros((b, n, h, dv), q.dtype)
        lse = jnp.full((b, n, h), -jnp.inf, _F32) if mods.sinks is None else jnp.broadcast_to(
            mods.sinks.astype(_F32), (b, n, h))  # the denominator holds the sink alone
        return out, lse
    bm = mods.block_mask
    blocks = None if bm is None or core.name != "xla" else bm.block_size
    mods_core = core_mods(mods)
    if bm is not None:  # the block tables: a Mods even without score, mask or cap
        mods_core = dataclasses.replace(mods_core or Mods(), kv_blocks=bm.kv_blocks,
                                        q_blocks=bm.q_blocks, table_block=bm.block_size)
    return _flex(q, k, v, mods_core, mods.sinks, base, float(scale), blocks, core)


def _backward_key_block(block_k: int, mods) -> int:
    """The XLA backward's key block under a block mask: 128-key columns of the tables' blocks
    when a mod is evaluated per element (its tile is one more live beside s, p, dp and ds;
    narrow columns keep them in cache, as :func:`dilax.core.default_block_sizes` does for
    ``scored`` calls), else the tables' own."""
    fns = mods is not None and (mods.score is not None or mods.mask is not None
                                or mods.soft_cap is not None)
    return 128 if fns and block_k > 128 and block_k % 128 == 0 else block_k


def with_sinks(out, lse, sinks, dtype):
    """``(out, lse)`` of a core result ``out (..., h, dv)`` float32 and ``lse (..., h)`` with
    one sink logit per head ``sinks (h,)`` added to the denominator (gradients through
    ``lse``), ``out`` in ``dtype``."""
    sink = sinks.astype(_F32).reshape((1,) * (lse.ndim - 1) + sinks.shape)  # rank-safe
    out = (out * jax.nn.sigmoid(lse - sink)[..., None]).astype(dtype)
    return out, jnp.logaddexp(lse, sink)


def flex_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    score_mod: Callable | None = None,
    mask_mod: Callable | None = None,
    block_mask: BlockMask | None = None,
    scale: float | None = None,
    sinks: jax.Array | None = None,
    logits_soft_cap: float | None = None,
    return_residual: bool = False,
    implementation: str | None = None,
    interpret: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention with your own scores and masks (PyTorch FlexAttention semantics).

    Per pair (query ``q_idx``, key ``kv_idx``) of head ``h`` in batch row ``b``:
    ``s = scale * q . k``; ``s = cap * tanh(s / cap)`` when ``logits_soft_cap``;
    ``s = score_mod(s, b, h, q_idx, kv_idx)``; pairs where ``mask_mod(b, h, q_idx, kv_idx)``
    is False are removed; then one softmax over the key axis (with ``sinks``: one extra
    logit per head, with no value, in the denominator).

    Args:
      query: ``(b, n, h, d)``; key: ``(b, s, hk, d)``; value: ``(b, s, hk, dv)``, one float
        dtype, ``h % hk == 0`` (query head ``j`` reads kv head ``j // (h // hk)``); any
        ``n``, ``s`` (positions of both start at 0).
      score_mod: ``(score, b, h, q_idx, kv_idx) -> score``, called elementwise on a float32
        scalar score and int32 scalar indices (vectorized with ``vmap``); it may close over
        arrays, traced ones included; closed-over float arrays receive gradients
        (:func:`dilax.flex.alibi`, :func:`dilax.flex.relative_bias`...).
      mask_mod: ``(b, h, q_idx, kv_idx) -> bool``, elementwise likewise
        (:func:`dilax.flex.causal_mask`, :func:`dilax.flex.document_mask`...). Default: the
        ``block_mask``'s ``mask_mod``, else every pair.
      block_mask: a :class:`dilax.flex.BlockMask` from :func:`dilax.create_block_mask` for
        ``(b or 1, h or 1, n, s)``: only its partial and full blocks are computed, the
        ``mask_mod`` only on partial ones. An optimization: the result is the same.
      scale: logit scale, default ``1 / sqrt(d)``.
      sinks: float ``(h,)`` or None: attention sinks (differentiable).
      logits_soft_cap: float ``> 0`` or None.
      return_residual: also return the log-sum-exp ``(b, n, h)`` float32 (with ``sinks``,
        of the denominator including them), as ``jax.nn.dot_product_attention``.
      implementation: ``None`` (:mod:`dilax.registry`'s choice: the Pallas kernels on GPU
        or with ``interpret``, else the XLA core), ``"xla"`` (the blockwise core) or
        ``"pallas"`` (the flash kernels with the mods traced inside them,
        :mod:`pallas_kernels.mods`; ``dv == d``; a mod must read its closed-over arrays by
        scalar indexing; a ``block_mask`` steers the kernels whose tiles divide its
        blocks); ``"cudnn"`` is refused with the registry's reason.
      interpret: run the Pallas kernels in the Pallas interpreter (any backend, e.g. CPU).

    Returns:
      ``(b, n, h, dv)`` in ``query.dtype`` (and the lse with ``return_residual``). A query
      with no key gets 0 (and zero gradient), never NaN.

    Raises:
      ValueError / TypeError naming the argument: ranks, batch/head/head-dim mismatch,
      mixed or non-float dtypes, non-callable mods or mods returning other than one float
      (``score_mod``) / bool (``mask_mod``) per element, a ``block_mask`` that does not fit,
      bad ``sinks``, ``scale`` or ``logits_soft_cap``, an implementation that cannot serve.
    """
    q, k, v = _check_arrays(query, key, value)
    (b, n, h, d), s, dv = q.shape, k.shape[1], v.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else _positive(scale, "scale")
    mods = prepare_mods("flex_attention", b, h, n, s, score_mod=score_mod, mask_mod=mask_mod,
                        block_mask=block_mask, sinks=sinks,
                        logits_soft_cap=logits_soft_cap) or FlexMods()
    request = registry.CoreRequest("flex", q.dtype, d, value_head_dim=dv,
                                   interpret=bool(interpret), **mods.request_flags)
    implementation = registry.check_name(implementation, "flex")
    core = choose_core(implementation, request, mods)
    out, lse = flex_core(q, k, v, mods, scale=scale, core=core)
    return (out, lse) if return_residual else out


def choose_core(implementation: str | None, request: registry.CoreRequest, mods: FlexMods):
    """The :class:`dilax.core.Core` that runs a call with ``mods`` (:func:`prepare_mods`):
    :func:`dilax.registry.choose` for ``request`` (op ``"flex"`` or ``"dense"``, with
    ``mods.request_flags``), then, when that is the Pallas kernels, again with the reason the
    mods have no tile form, if any (:func:`pallas_kernels.mods.mod_problem`): an explicit
    ``"pallas"`` raises it, ``None`` runs the XLA core.

    Raises:
      ValueError: ``implementation`` cannot serve the request (the registry's reason).
    """
    name, _ = registry.choose(implementation, request)
    if name == "pallas" and (problem := _kernel_problem(mods)) is not None:
        request = dataclasses.replace(request, mod_problem=problem)
        name, _ = registry.choose(implementation, request)  # explicit: ValueError, why
    return registry.core(name, request.interpret)


def _kernel_problem(mods: FlexMods) -> str | None:
    """Why the mods have no form inside the Pallas kernels (None: they have one)."""
    if mods.score is None and mods.mask is None:
        return None
    from pallas_kernels.mods import mod_problem  # lazy: the kernels are optional

    return mod_problem(mods.score, mods.score_consts, mods.mask, mods.mask_consts)


def _positive(x, name: str, op: str = "flex_attention") -> float:
    if isinstance(x, jax.core.Tracer):
        raise TypeError(f"{op}: {name} must be a static float, got a traced value")
    x = float(x)
    if not x > 0 or not math.isfinite(x):
        raise ValueError(f"{op}: {name} must be a finite float > 0, got {x}")
    return x


# One compiled program per static configuration (mods compare by their traced text: the
# Mods' functions and cap are static in its pytree).
@functools.partial(jax.jit, static_argnums=(6, 7, 8))
def _flex(q, k, v, mods, sinks, base, scale, blocks, core):
    hk, h = k.shape[2], q.shape[2]
    sizes = None if blocks is None else BlockSizes(*blocks, blocks[0], _backward_key_block(
        blocks[1], mods))
    spec = Mask(mods=mods) if base is None else dataclasses.replace(base, mods=mods)
    out, lse = attention(q, k, v, view=identity_view(hk, h // hk), scale=scale, mask=spec,
                         core=core, block_sizes=sizes, out_dtype=None if sinks is None else _F32)
    if sinks is not None:  # out * e^lse / (e^sink + e^lse), gradients through lse
        out, lse = with_sinks(out, lse, sinks, q.dtype)
    return out, lse
