"""``attention_fn`` adapter: dilated attention inside ``flax.nnx.MultiHeadAttention``.

``nnx.MultiHeadAttention`` projects its inputs to ``(..., n, h, d)`` queries and
``(..., n, hk, d)`` keys/values (``num_kv_heads`` gives GQA) and then calls
``attention_fn(query, key, value, mask=..., dropout_rng=..., dropout_rate=...,
broadcast_dropout=..., deterministic=..., dtype=..., precision=..., module=..., is_causal=...)``.
:func:`attention_fn` builds such a function from a dilated configuration; the attention itself
is :func:`dilax.dilated_attention`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from dilax import _validation as V
from dilax.dilated.api import dilated_attention
from dilax.dilated.settings import DilatedSettings
from dilax.reference import masked_softmax
from dilax.semantics import dilated_counts

_FLEX_OPTIONS = ("score_mod", "mask_mod", "logits_soft_cap", "sinks")
_OPTIONS = ("mode", "is_causal", "scale", "implementation", "block_sizes") + _FLEX_OPTIONS

# Where to go for what flax's MultiHeadAttention has no place for (issue 39): every refusal of
# packed documents (a segment mask, segment_ids=) or of an unknown option ends with it.
OWN_MODULE_ROUTE = (
    "attention_fn plugs into flax's MultiHeadAttention, which has no packed documents or "
    "rotary positions; for packed documents use dilax.nn.DilatedAttention(segment_lengths, "
    "dilation_rates, is_causal=True)(q, k, v, segment_ids=...) in your own module, with "
    "rotary positions from dilax.models.rotary_qk(q, k, dilax.document_positions("
    "segment_ids)) (see notebooks/decoder.ipynb)"
)

_DECODE_MESSAGE = (
    "dilax.attention_fn got {q} query position(s) against {k} keys. Keys of another length "
    "than the queries are flax's KV cache (decode=True), which is served for one query "
    "position with flax's decode mask (..., 1, 1, max_len) (the query's position is the last "
    "key the mask admits); got mask {mask}. For chunked decoding use dilax's own cache: "
    "dilax.nn.MultiheadDilatedAttention.init_cache(batch, max_len) and .decode(x, cache)."
)


def attention_fn(
    segment_lengths: tuple[int, ...] | list[int] | int,
    dilation_rates: tuple[int, ...] | list[int] | int,
    **options: Any,
) -> Callable[..., jax.Array]:
    """Returns a dilated ``attention_fn`` for ``flax.nnx.MultiHeadAttention``.

    Example::

      mha = nnx.MultiHeadAttention(
          num_heads=8, in_features=512, num_kv_heads=2, decode=False, rngs=nnx.Rngs(0),
          attention_fn=dilax.attention_fn((512, 1024), (1, 2), mode="mixture"))
      y = mha(x, is_causal=True)  # x: (b, n, 512)

    Args:
      segment_lengths, dilation_rates: the dilated configuration (see
        :func:`dilax.dilated_attention`).
      **options: ``mode`` ("mixture" | "grouped"), ``is_causal`` (default ``False``; the
        effective flag is this one OR the ``is_causal`` the module passes at call time),
        ``scale``, ``implementation``, ``block_sizes`` and FlexAttention's ``score_mod``,
        ``mask_mod``, ``logits_soft_cap``, ``sinks`` (a fixed float ``(h,)`` array: flax's
        module owns the parameters; for learnable sinks use
        :class:`dilax.nn.MultiheadDilatedAttention` ``(learnable_sinks=True)``) — forwarded to
        :func:`dilax.dilated_attention` (docs/semantics.md, "Custom scores and masks"; the
        mods see positions of the row, and ``b`` the flattened batch row).

    The returned function takes ``query (..., n, h, d)``, ``key``/``value (..., n, hk, d)``
    (any number of leading batch axes, including none) and returns ``(..., n, h, d)`` in the
    dtype of ``query`` (float32 softmax statistics inside for bf16/fp16).
    It accepts every keyword ``nnx.MultiHeadAttention`` passes. A key-padding ``mask`` of shape
    ``(..., 1, 1, n)`` (True = valid key; e.g.
    ``nnx.make_attention_mask(jnp.ones((b, 1)), key_valid)`` with ``key_valid (b, n)``) is
    applied exactly, for any pattern of valid keys, traced or not (it becomes the per-key
    validity of :func:`dilax.dilated_attention`'s ``key_padding_mask``; key blocks past the
    last valid key are skipped). It refuses, with a ``ValueError``, what dilated attention
    cannot honour: any other ``mask`` (one that depends on the query) or a ``bias``,
    attention-weight dropout (``dropout_rate > 0`` with ``deterministic=False``) and keys of
    another length than the queries outside flax's decode step.
    ``decode=True`` (flax's KV cache, in ``nnx.MultiHeadAttention`` and linen's
    ``nn.MultiHeadDotProductAttention``) is exact: flax passes one query, the whole cache and
    the mask ``arange(max_len) <= cur_index`` (with the caller's key mask), so the query's
    position is the last key the mask admits (read traced, per row); the step returns that row
    of causal dilated attention over the cache (:func:`decode_step`; it costs a forward over
    the rows up to the position -- :meth:`dilax.nn.MultiheadDilatedAttention.decode` reads
    only ``w / r`` keys per branch). ``sow_weights=True`` (``module`` given) stores the
    attention weights ``(..., h, n, n)`` in the dtype of ``query`` as flax does
    (``nnx.Intermediate`` / linen ``intermediates``, name ``attention_weights``): they are
    materialized for inspection only, O(n^2) memory (:func:`dilated_weights`).
    ``precision`` is accepted and has no effect: the core always keeps logits and softmax
    statistics in float32.

    Packed documents (``segment_ids``) and rotary positions have no place in flax's
    ``MultiHeadAttention``: write your own module around :class:`dilax.nn.DilatedAttention`
    (``segment_ids=``), :func:`dilax.models.rotary_qk` and :func:`dilax.document_positions`,
    as ``notebooks/decoder.ipynb`` does (a segment mask or ``segment_ids=`` given here is
    refused with that route).

    Raises:
      TypeError: an unknown option (at construction) or keyword (at call time, e.g.
        ``segment_ids=``).
      ValueError / TypeError: an invalid configuration (at construction) or invalid inputs
        (at trace time).
    """
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(
            f"attention_fn got unknown option(s) {unknown}; valid options are "
            f"{list(_OPTIONS)}. {OWN_MODULE_ROUTE}"
        )
    flex = {name: options.pop(name) for name in _FLEX_OPTIONS if name in options}
    V.check_flex_options(flex.get("score_mod"), flex.get("mask_mod"),
                       flex.get("logits_soft_cap"))
    settings = DilatedSettings(segment_lengths, dilation_rates, **options)
    causal_settings = settings.causal()  # the module may ask for causal at call time

    def dilated_attention_fn(
        query: jax.Array,
        key: jax.Array,
        value: jax.Array,
        bias: jax.Array | None = None,
        mask: jax.Array | None = None,
        broadcast_dropout: bool = True,
        dropout_rng: jax.Array | None = None,
        dropout_rate: float = 0.0,
        deterministic: bool = False,
        dtype: Any = None,
        precision: Any = None,
        module: Any = None,
        promote_dtype: Any = None,
        is_causal: bool = False,
        **unknown: Any,
    ) -> jax.Array:
        del broadcast_dropout, dropout_rng, precision  # see the docstring
        if unknown:  # e.g. segment_ids=, which flax's modules never pass
            raise TypeError(
                f"the attention function of dilax.attention_fn got unexpected keyword(s) "
                f"{sorted(unknown)}; it takes what flax's MultiHeadAttention passes. "
                f"{OWN_MODULE_ROUTE}")
        decode = (getattr(query, "ndim", 0) >= 3 and getattr(key, "ndim", 0) == query.ndim
                  and key.shape[-3] != query.shape[-3])
        if decode and (query.shape[-3] != 1 or mask is None):
            raise ValueError(_DECODE_MESSAGE.format(
                q=query.shape[-3], k=key.shape[-3],
                mask=None if mask is None else tuple(jnp.shape(mask))))
        if mask is not None and (jnp.ndim(mask) < 3 or tuple(jnp.shape(mask)[-3:-1]) != (1, 1)):
            raise ValueError(
                "dilax.attention_fn supports only a key-padding `mask` of shape (..., 1, 1, n) "
                "(True = valid key), e.g. nnx.make_attention_mask(jnp.ones((b, 1)), key_valid) "
                f"with key_valid (b, n); got a mask of shape {jnp.shape(mask)}. Dilated attention "
                "has a fixed sparsity pattern: use is_causal=True for causal masking, pass "
                "padding as such a key mask (or call dilax.dilated_attention with "
                "query_seq_lengths / key_value_seq_lengths), and leave other masks out. A mask "
                f"of packed documents (segment mask) is no key-padding mask: {OWN_MODULE_ROUTE}"
            )
        if bias is not None:
            raise ValueError("dilax.attention_fn does not support an attention `bias`")
        if float(dropout_rate) > 0.0 and not deterministic:
            raise ValueError(
                f"dilax.attention_fn does not support attention-weight dropout (dropout_rate="
                f"{dropout_rate}, deterministic=False): the blockwise core never materializes "
                "the weights; use dropout_rate=0.0 or deterministic=True"
            )
        if query.ndim < 3 or key.ndim != query.ndim or value.ndim != query.ndim:
            raise ValueError(
                "query, key and value must have layout (..., seq_len, heads, head_dim) with the "
                f"same rank, got query {query.shape}, key {key.shape}, value {value.shape}"
            )
        if promote_dtype is not None:
            query, key, value = promote_dtype((query, key, value), dtype=dtype)
        else:
            dt = dtype if dtype is not None else jnp.result_type(query, key, value)
            query, key, value = (x.astype(dt) for x in (query, key, value))
        batch = query.shape[:-3]
        if batch != key.shape[:-3] or batch != value.shape[:-3]:
            raise ValueError(
                f"query, key and value must have the same batch axes, got query {query.shape}, "
                f"key {key.shape}, value {value.shape}"
            )
        flat = math.prod(batch)
        q, k, v = (x.reshape((flat,) + x.shape[-3:]) for x in (query, key, value))
        key_valid = None
        if mask is not None:
            n = key.shape[-3]
            if jnp.shape(mask)[-1] != n:
                raise ValueError(f"the key-padding mask's last axis must be the key length "
                                 f"{n}, got a mask of shape {jnp.shape(mask)}")
            try:
                key_valid = jnp.broadcast_to(jnp.asarray(mask)[..., 0, 0, :], batch + (n,))
            except ValueError:
                raise ValueError(f"the key-padding mask of shape {jnp.shape(mask)} does not "
                                 f"broadcast to the batch axes {batch}") from None
            key_valid = key_valid.reshape(flat, n).astype(bool)
        now = causal_settings if V.check_bool(is_causal, "is_causal") else settings
        if module is not None and flex:
            raise ValueError("dilax.attention_fn: sow_weights=True is not supported with "
                             f"{sorted(flex)} (the weights are materialized without them)")
        if decode:  # flax's KV cache: the query sits at the last key its mask admits
            out, weights = decode_step(q, k, v, key_valid, settings,
                                       with_weights=module is not None, **flex)
        else:
            out = dilated_attention(q, k, v, settings=now, key_padding_mask=key_valid, **flex)
            weights = None if module is None else dilated_weights(q, k, key_valid, now)
        if module is not None:
            sow_weights(module, weights.reshape(batch + weights.shape[1:]).astype(query.dtype))
        return out.reshape(batch + out.shape[1:])

    return dilated_attention_fn


def decode_step(q: jax.Array, k: jax.Array, v: jax.Array, key_valid: jax.Array,
                settings: DilatedSettings, with_weights: bool = False, **flex: Any
                ) -> tuple[jax.Array, jax.Array | None]:
    """One step of flax's ``decode=True``: ``q (B, 1, h, d)`` against the whole cache
    ``k, v (B, S, hk, d)`` with the decode mask ``key_valid (B, S)`` (``arange(S) <=
    cur_index``, and the caller's mask). Each row's query position ``p`` is the last key the
    mask admits (traced); the result is row ``p`` of causal :func:`dilax.dilated_attention`
    over the cache with that key mask -- exactly the row a causal forward over the whole
    sequence gives. A row whose mask admits no key gets 0. The caller's mask must admit the
    query's own key (padding before it, as left padding, is fine).

    Cost: the rows ``<= p`` of a forward over the cache (``O(p w)``; query blocks past ``p``
    are skipped). ``dilax.nn.MultiheadDilatedAttention.decode`` reads ``O(w / r)`` keys per
    branch and step. ``flex``: FlexAttention's options of :func:`dilax.dilated_attention`
    (the mods see the query at its position ``p``). Returns ``(out (B, 1, h, d), weights
    (B, h, 1, S) float32 or None)``."""
    B, S = k.shape[:2]
    pos = jnp.max(jnp.where(key_valid, jnp.arange(S, dtype=jnp.int32)[None], -1), axis=1)
    p = jnp.maximum(pos, 0)
    rows = jnp.arange(B)
    q_full = jnp.zeros((B, S) + q.shape[2:], q.dtype).at[rows, p].set(q[:, 0])
    settings = settings.causal()
    out = dilated_attention(q_full, k, v, settings=settings, key_padding_mask=key_valid,
                            query_seq_lengths=p + 1, **flex)[rows, p][:, None]
    weights = None
    if with_weights:
        weights = dilated_weights(q_full, k, key_valid, settings)
        weights = weights[rows, :, p][:, :, None]
    return out, weights


def dilated_weights(q: jax.Array, k: jax.Array, key_valid: jax.Array | None,
                    settings: DilatedSettings) -> jax.Array:
    """The attention weights ``P (b, h, n, n)`` float32 of :func:`dilax.dilated_attention`
    on ``q (b, n, h, d)``, ``k (b, n, hk, d)``: ``out = sum_t P[., p, t] v_t`` (mixture: the
    branch multiplicities ``C`` of the SPEC weight ``e^s``; grouped: divided by the number of
    branches). Materialized only for inspection (``sow_weights=True``): O(n^2) memory; the
    softmax is :func:`dilax.reference.masked_softmax`."""
    n, h, d = q.shape[1:]
    ws, rs, mode = settings.segment_lengths, settings.dilation_rates, settings.mode
    counts = jnp.asarray(dilated_counts(n, h, ws, rs, mode, settings.is_causal,
                                        settings.local_window))[None]  # (1, h, n, n)
    if key_valid is not None:
        counts = jnp.where(key_valid[:, None, None, :], counts, 0.0)
    p, _ = masked_softmax(q, k, counts, settings.scale_for(d))
    return p / len(ws) if mode == "grouped" else p


def sow_weights(module: Any, weights: jax.Array) -> None:
    """Stores ``weights`` as flax's attention functions do: ``nnx.Intermediate``
    ``attention_weights`` on an nnx module, collection ``intermediates`` on a linen one."""
    from flax import linen, nnx

    if isinstance(module, linen.Module):
        module.sow("intermediates", "attention_weights", weights)
    else:
        module.sow(nnx.Intermediate, "attention_weights", weights)
