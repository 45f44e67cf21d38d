"""``dilax.dot_product_attention``: a drop-in for ``jax.nn.dot_product_attention``.

The same arguments, shapes, dtype rules, results and errors as jax's function; without
dilation settings it is dense attention computed by dilax's blockwise core (``O(n)`` memory:
the ``bias`` and ``mask`` operands are read one block at a time, :mod:`dilax.core.pairwise`),
with ``segment_lengths`` / ``dilation_rates`` it is :func:`dilax.dilated_attention`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dilax import _validation as V
from dilax import registry
from dilax.attention_mask import check_segment_ids, document_bounds
from dilax.core import Core, KeyBounds, Mask, PairArrays, attention, identity_view
from dilax.dilated.settings import DilatedSettings
from dilax.flex.api import FlexMods, choose_core, flex_core, prepare_mods
from dilax.flex.block_mask import BlockMask
from dilax.reference import dense_attention


def _ensure_4d(x: jax.Array) -> jax.Array:
    """Leading unit dims up to rank 4, as jax does (``(T, N, H) -> (1, T, N, H)``)."""
    return x.reshape((1,) * (4 - x.ndim) + x.shape) if x.ndim < 4 else x


def _check(t, shape, dtype, name: str) -> None:
    """jax's shape/dtype rule for one operand (``-1``: any size), with jax's messages."""
    if t is None:
        return
    if t.ndim != len(shape):
        raise ValueError(f"{name} ndim should be {len(shape)}, but got {t.ndim}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} dtype should be {dtype}, but got {t.dtype}")
    for i, size in enumerate(shape):
        if size != -1 and t.shape[i] != size:
            raise ValueError(f"{name} shape should be {list(shape)}: but got {t.shape}")


def _check_pairwise(t, full, name: str) -> None:
    """``bias`` / ``mask`` must broadcast to ``(B, N, T, S)``: each dim 1 or full."""
    if t is not None and any(n not in (1, f) for n, f in zip(t.shape, full)):
        raise ValueError(f"{name} of shape {t.shape} must be broadcastable to (B, N, T, S) = "
                         f"{full}: each dim 1 or the full size")


def _implementation(implementation: Any) -> str | None:
    """A name the registry offers for dense attention (:func:`dilax.registry.check_name`
    with ``op="dense"``); any other raises with jax's message for the names it rejects."""
    try:
        return registry.check_name(implementation, "dense")
    except ValueError:
        raise ValueError(f"Unsupported implementation option: {implementation}; "
                         f"dilax.dot_product_attention serves "
                         f"{(None,) + registry.offered('dense')}") from None


def _window(local_window_size: Any) -> tuple[int, int] | None:
    if local_window_size is None:
        return None
    if isinstance(local_window_size, (tuple, list)):
        if len(local_window_size) != 2:
            raise ValueError("local_window_size must be an int or a (left, right) pair, got "
                             f"{local_window_size!r}")
        return tuple(V.static_int(w, f"local_window_size[{i}]")
                     for i, w in enumerate(local_window_size))
    w = V.static_int(local_window_size, "local_window_size")
    return (w, w)


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | None = None,
    return_residual: bool = False,
    segment_lengths: tuple[int, ...] | None = None,
    dilation_rates: tuple[int, ...] | None = None,
    mode: str = "mixture",
    settings: DilatedSettings | None = None,
    segment_ids: jax.Array | None = None,
    score_mod: Callable | None = None,
    mask_mod: Callable | None = None,
    block_mask: BlockMask | None = None,
    sinks: jax.Array | None = None,
    logits_soft_cap: float | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Scaled dot-product attention, a superset of ``jax.nn.dot_product_attention``.

    ``softmax(scale * q k^T + bias, masked) v`` per head, with jax's argument names, shapes
    (``B`` batch, ``T`` query length, ``S`` key length, ``N`` query heads, ``K`` kv heads,
    ``N % K == 0``, ``H`` head dim), dtype rules and errors. Computed by dilax's blockwise XLA
    core: ``O(T + S)`` memory beyond the operands, ``bias`` and ``mask`` read block by block.

    Args:
      query: ``(B, T, N, H)`` or ``(T, N, H)``.
      key, value: ``(B, S, K, H)`` or ``(S, K, H)``, the dtype of ``query``; ``value`` may
        have its own head dim ``(B, S, K, Hv)`` (then ``out`` is ``(B, T, N, Hv)``; XLA core).
      bias: optional, added to the scaled logits; rank <= 4, broadcastable to
        ``(B, N, T, S)`` (leading dims added as jax does). Differentiable (``dbias`` summed
        over the broadcast dims, in the bias's dtype).
      mask: optional bool, same shape rule; True = attend.
      scale: logit scale (static), default ``1 / sqrt(H)``.
      is_causal: key ``t`` visible to query ``i`` iff ``t <= i`` (aligned at index 0, as jax).
      query_seq_lengths, key_value_seq_lengths: optional int32 ``(B,)``; query rows past
        their length output 0, keys past theirs get no weight.
      local_window_size: optional int ``w`` or ``(left, right)``: query ``i`` sees keys
        ``i - left <= t <= i + right`` (jax's band; key blocks outside it are skipped).
      implementation: ``None`` / ``"xla"`` (dilax's blockwise core; with FlexAttention's
        options ``None`` is :mod:`dilax.registry`'s choice: the Pallas kernels on GPU),
        ``"pallas"`` (dilax's flash kernels; no bias, mask or segment_ids), ``"cudnn"``
        (``jax.nn.dot_product_attention`` with ``implementation="cudnn"``, as is) or
        ``"reference"`` (dense mask-based, small sizes).
      return_residual: also return the log-sum-exp of the logits ``(B, T, N)`` / ``(T, N)``
        in the key's dtype, without gradient (as jax).
      segment_lengths, dilation_rates, mode: dilation settings: given both, the call is
        :func:`dilax.dilated_attention` (``T == S``; no ``bias``, ``local_window_size`` or
        ``return_residual``; a ``mask`` only as a key-padding mask ``(B or 1, 1, 1, S)``).
      settings: the dilation settings as one :class:`dilax.DilatedSettings` value instead
        (then ``segment_lengths``, ``dilation_rates``, ``scale`` and ``implementation`` are
        left out; ``is_causal=True`` here makes the call causal).
      segment_ids: optional int ``(B, T)`` (self-attention, ``T == S``): packed documents, a
        document being a maximal run of equal ids. No query attends a key of another
        document; causality, the band and the dilation settings apply to each document's
        own positions (docs/semantics.md, "Packed documents"). Served by ``None``/``"xla"``
        (per-row key ranges: only the blocks of the query's document are read) and
        ``"reference"``.
      score_mod, mask_mod, block_mask, sinks, logits_soft_cap: FlexAttention's options, as
        :func:`dilax.flex_attention` (docs/semantics.md, "Custom scores and masks"), on top
        of the call's own rules: per pair ``s = scale q.k + bias``; the soft-cap; then
        ``score_mod(s, b, h, q_idx, kv_idx)`` (``q_idx``, ``kv_idx``: the positions ``0 ..``
        of the query and key); a pair is kept iff ``mask``, causality, the band, lengths,
        documents and ``mask_mod`` all allow it; ``sinks (N,)`` add one logit per head to the
        denominator. ``block_mask`` (:func:`dilax.create_block_mask` for ``(B or 1, N or 1,
        T, S)``; with ``segment_ids`` too) only skips blocks. On the XLA core or the Pallas
        kernels (mods traced inside them, as :func:`dilax.flex_attention`'s; ``dv == d``, no
        ``bias``, ``mask`` or ``segment_ids``); ``"cudnn"`` and ``"reference"`` refuse them
        with :mod:`dilax.registry`'s reason; not with dilation settings.

    Returns:
      ``out`` shaped like ``query``, or ``(out, lse)`` with ``return_residual``. A query that
      sees no key (fully masked) gets ``out = 0`` and ``lse = -inf``; jax's XLA path gives
      the mean of ``value`` over all keys there (its masked logits are a large finite
      negative) and ``lse`` near ``-2.4e38``.

    Raises:
      ValueError: jax's shape/dtype rules (``value``/``query`` dtype equal to ``key``'s,
        ``mask`` bool, lengths int32 ``(B,)``, ``N % K == 0``), operands not broadcastable
        to ``(B, N, T, S)``, an unknown ``implementation`` or one that cannot serve the call.
      TypeError: non-floating inputs, a traced ``scale`` or window.
    """
    output_shape = jnp.shape(query)[:-1] + jnp.shape(value)[-1:]  # (..., Hv)
    q, k, v = (_ensure_4d(jnp.asarray(x)) for x in (query, key, value))
    bias = None if bias is None else _ensure_4d(jnp.asarray(bias))
    mask = None if mask is None else _ensure_4d(jnp.asarray(mask))
    q_len = None if query_seq_lengths is None else jnp.asarray(query_seq_lengths)
    kv_len = None if key_value_seq_lengths is None else jnp.asarray(key_value_seq_lengths)
    window = _window(local_window_size)
    B, S, K, H = k.shape
    _check(v, [B, S, K, -1], k.dtype, "value")
    _check(q, [B, -1, -1, H], k.dtype, "query")
    _check(mask, [-1] * 4, np.dtype(bool), "mask")
    _check(bias, [-1] * 4, None, "bias")
    _check(q_len, [B], np.dtype("int32"), "query_seq_lengths")
    _check(kv_len, [B], np.dtype("int32"), "key_value_seq_lengths")
    T, N = q.shape[1], q.shape[2]
    if N % K != 0:
        raise ValueError(f"The number of query heads must be a multiple of key/value heads, "
                         f"but got {N} vs {K}")
    if not jnp.issubdtype(k.dtype, jnp.floating):
        raise TypeError(f"query, key and value must have a floating dtype, got {k.dtype}")
    for name, t in (("bias", bias), ("mask", mask)):
        _check_pairwise(t, (B, N, T, S), name)
    if segment_ids is not None:
        if T != S:
            raise ValueError(f"segment_ids need self-attention (T == S), got T={T}, S={S}")
        segment_ids = check_segment_ids(segment_ids, B, T)
    user_scale = scale
    scale = 1.0 / float(np.sqrt(H)) if scale is None else V.check_real(scale, "scale")
    is_causal = V.check_bool(is_causal, "is_causal")
    return_residual = V.check_bool(return_residual, "return_residual")
    implementation = _implementation(implementation)

    if settings is not None:
        if (segment_lengths, dilation_rates, user_scale, implementation) != (None,) * 4:
            raise TypeError("settings= holds the whole dilated configuration: leave "
                            "segment_lengths, dilation_rates, scale and implementation out")
        settings = settings.replace(is_causal=True) if is_causal else settings
        segment_lengths, dilation_rates = settings.segment_lengths, settings.dilation_rates
    flex = dict(score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask, sinks=sinks,
                logits_soft_cap=logits_soft_cap)
    dilated = segment_lengths is not None or dilation_rates is not None
    for name, given in flex.items():
        if given is not None and dilated:
            raise ValueError(f"dot_product_attention: {name} is not supported with dilation "
                             "settings (segment_lengths, dilation_rates) yet; use "
                             "dilax.flex_attention or call without them")
    mods = prepare_mods("dot_product_attention", B, N, T, S, **flex)
    if dilated:
        out = _dilated(q, k, v, bias, mask, q_len, kv_len, window, return_residual,
                       segment_lengths, dilation_rates, mode, is_causal, scale, implementation,
                       settings, segment_ids)
        return out.reshape(output_shape)
    request = registry.CoreRequest(
        "dense", k.dtype, H, is_causal, has_window=window is not None,
        has_lengths=q_len is not None or kv_len is not None,
        has_pairwise=bias is not None or mask is not None,
        has_documents=segment_ids is not None, value_head_dim=v.shape[-1],
        **({} if mods is None else mods.request_flags))
    name, _ = registry.choose(implementation, request)  # ValueError: what cannot serve it
    if name == "cudnn":  # jax's own cuDNN path, arguments as given
        return jax.nn.dot_product_attention(
            query, key, value, bias, mask, scale=scale, is_causal=is_causal,
            query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
            local_window_size=local_window_size, implementation="cudnn",
            return_residual=return_residual)
    if mods is not None:  # the mods on the registry's core (dilax.flex: XLA or Pallas)
        core = choose_core(implementation, request, mods)
        out, lse = _flex(q, k, v, bias, mask, q_len, kv_len, segment_ids, mods, scale=scale,
                         is_causal=is_causal, window=window, core=core)
    else:
        core = registry.core(name)  # None: the dense mask-based reference
        out, lse = _dense(q, k, v, bias, mask, q_len, kv_len, segment_ids, scale=scale,
                          is_causal=is_causal, window=window, core=core)
    out = out.reshape(output_shape)
    if not return_residual:
        return out
    return out, jax.lax.stop_gradient(lse.astype(k.dtype)).reshape(output_shape[:-1])


# One compiled program per static configuration (and no op-by-op -inf intermediates, which
# jax_debug_infs would flag).
@functools.partial(jax.jit, static_argnames=("scale", "is_causal", "window", "core"))
def _dense(q, k, v, bias, mask, q_len, kv_len, segment_ids, *, scale: float, is_causal: bool,
           window: tuple[int, int] | None, core: Core | None):
    """``(out (B, T, N, H), lse (B, T, N) float32)`` of dense attention."""
    if core is None:
        return _reference(q, k, v, bias, mask, q_len, kv_len, scale, is_causal, window,
                          segment_ids)
    N, K = q.shape[2], k.shape[2]
    spec = _spec(bias, mask, q_len, kv_len, segment_ids, is_causal, window)
    return attention(q, k, v, view=identity_view(K, N // K), scale=scale, mask=spec, core=core)


def _spec(bias, mask, q_len, kv_len, segment_ids, is_causal, window) -> Mask:
    """The core's :class:`~dilax.core.Mask` of a dense call."""
    per_row = lambda x: None if x is None else x[:, None]  # noqa: E731 - (B,) -> (B, 1)
    ranges = None
    if segment_ids is not None:  # each row's document, as a key range (both sides)
        ranges = tuple(x[:, None] for x in document_bounds(segment_ids))
    arrays = None if bias is None and mask is None else PairArrays(bias=bias, allowed=mask)
    return Mask(KeyBounds(per_row(kv_len), 0, 0, is_causal, per_row(q_len), window, ranges,
                          ranges), arrays)


def _flex(q, k, v, bias, mask, q_len, kv_len, segment_ids, mods: FlexMods, *, scale: float,
          is_causal: bool, window: tuple[int, int] | None, core: Core):
    """``(out, lse)`` of dense attention with FlexAttention's options on ``core`` (the XLA
    core, or the Pallas kernels with the mods traced inside them) through
    :func:`dilax.flex.api.flex_core`: one implementation of the mods, sinks and cap."""
    spec = _spec(bias, mask, q_len, kv_len, segment_ids, is_causal, window)
    return flex_core(q, k, v, mods, scale=scale, base=spec, core=core)


def _reference(q, k, v, bias, mask, q_len, kv_len, scale, is_causal, window,
               segment_ids=None) -> tuple[jax.Array, jax.Array]:
    """Dense mask-based attention (:func:`dilax.reference.dense_attention` on the allowed
    ``(B, N or 1, T, S)`` pairs): rows that see no key give ``out = 0``, ``lse = -inf`` (and
    zero gradient)."""
    T, S = q.shape[1], k.shape[1]
    i = jnp.arange(T)[None, None, :, None]  # rank 4 throughout: no implicit rank promotion
    t = jnp.arange(S)[None, None, None, :]
    allowed = jnp.ones((1, 1, T, S), bool)
    if mask is not None:
        allowed = allowed & mask
    if is_causal:
        allowed = allowed & (t <= i)
    if window is not None:
        allowed = allowed & (t - i <= window[1]) & (i - t <= window[0])
    if q_len is not None:
        allowed = allowed & (i < q_len[:, None, None, None])
    if kv_len is not None:
        allowed = allowed & (t < kv_len[:, None, None, None])
    if segment_ids is not None:  # documents are runs: same run <=> same count of changes
        change = jnp.cumsum(jnp.concatenate(
            [jnp.zeros_like(segment_ids[:, :1]),
             (segment_ids[:, 1:] != segment_ids[:, :-1]).astype(segment_ids.dtype)], 1), 1)
        allowed = allowed & (change[:, None, :, None] == change[:, None, None, :])
    return dense_attention(q, k, v, allowed, scale, bias)


def _dilated(q, k, v, bias, mask, q_len, kv_len, window, return_residual, segment_lengths,
             dilation_rates, mode, is_causal, scale, implementation, settings=None,
             segment_ids=None):
    """The dilated call: :func:`dilax.dilated_attention` on the 4-d operands (with
    ``settings``, a :class:`dilax.DilatedSettings`, instead of the keywords)."""
    from dilax.dilated.api import dilated_attention  # lazy: dilated imports this module's peers

    for name, given in (("bias", bias is not None), ("local_window_size", window is not None),
                        ("return_residual", return_residual)):
        if given:
            raise ValueError(f"{name} is not supported with dilation settings "
                             "(segment_lengths, dilation_rates): dilated attention has no "
                             f"dense {name}; call without dilation settings for dense attention")
    if segment_lengths is None or dilation_rates is None:
        raise ValueError("segment_lengths and dilation_rates go together: give both or neither")
    key_padding = None
    if mask is not None:
        if mask.shape[1:3] != (1, 1):
            raise ValueError(f"with dilation settings a mask must be a key-padding mask of "
                             f"shape (B or 1, 1, 1, S), got {mask.shape}")
        key_padding = jnp.broadcast_to(mask[:, 0, 0, :], (k.shape[0], k.shape[1]))
    lengths = dict(query_seq_lengths=q_len, key_value_seq_lengths=kv_len,
                   key_padding_mask=key_padding, segment_ids=segment_ids)
    if settings is not None:
        return dilated_attention(q, k, v, settings=settings, **lengths)
    return dilated_attention(q, k, v, segment_lengths, dilation_rates, is_causal=is_causal,
                             scale=scale, mode=mode, implementation=implementation, **lengths)
