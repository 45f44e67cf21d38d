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
from dilax.dilated import dilated_attention
from dilax.settings import DilatedSettings

_OPTIONS = ("mode", "is_causal", "scale", "implementation", "block_sizes")

_DECODE_MESSAGE = (
    "dilax.attention_fn got {q} query position(s) against {k} keys, which is what "
    "nnx.MultiHeadAttention(decode=True) passes: its whole KV cache with a dense mask, and not "
    "the position of the query. Dilated attention cannot be computed exactly from that (the "
    "position would have to be guessed from a mask that may hold the caller's own masking "
    "too), so attention_fn does not support decode=True. Decode with dilax's own cache "
    "instead: dilax.nn.MultiheadDilatedAttention.init_cache(batch, max_len) and "
    ".decode(x, cache) (dilax.KVCache, dilax.dilated_attention_decode), or "
    "dilax.models.generate for a LongNetLM; a step there reads at most w/r keys per branch."
)


def check_options(
    segment_lengths: Any, dilation_rates: Any, *, mode: Any = "mixture", is_causal: Any = False,
    scale: Any = None, implementation: Any = None, block_sizes: Any = None,
) -> dict[str, Any]:
    """Validates a static dilated configuration (everything but the shapes) and returns it
    normalized, as a dict of the :class:`dilax.DilatedSettings` fields it names."""
    s = DilatedSettings(segment_lengths, dilation_rates, mode=mode, is_causal=is_causal,
                        scale=scale, implementation=implementation, block_sizes=block_sizes)
    return {name: getattr(s, name) for name in ("segment_lengths", "dilation_rates")
            + _OPTIONS}


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
        ``scale``, ``implementation``, ``block_sizes`` — forwarded to
        :func:`dilax.dilated_attention`.

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
    attention-weight dropout (``dropout_rate > 0`` with ``deterministic=False``), sowing
    attention weights (``module`` given, i.e. ``sow_weights=True``) and keys of another length
    than the queries. ``decode=True`` (flax's KV cache) is refused with a message that says
    why and points to :meth:`dilax.nn.MultiheadDilatedAttention.decode`: flax passes the whole
    cache and a dense mask but not the query's position, so the result could not be exact.
    ``precision`` is accepted and has no effect: the core always keeps logits and softmax
    statistics in float32.

    Raises:
      TypeError: an unknown option.
      ValueError / TypeError: an invalid configuration (at construction) or invalid inputs
        (at trace time).
    """
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(
            f"attention_fn got unknown option(s) {unknown}; valid options are {list(_OPTIONS)}"
        )
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
    ) -> jax.Array:
        del broadcast_dropout, dropout_rng, precision  # see the docstring
        if (getattr(query, "ndim", 0) >= 3 and getattr(key, "ndim", 0) == query.ndim
                and key.shape[-3] != query.shape[-3]):
            raise ValueError(_DECODE_MESSAGE.format(q=query.shape[-3], k=key.shape[-3]))
        if mask is not None and (jnp.ndim(mask) < 3 or tuple(jnp.shape(mask)[-3:-1]) != (1, 1)):
            raise ValueError(
                "dilax.attention_fn supports only a key-padding `mask` of shape (..., 1, 1, n) "
                "(True = valid key), e.g. nnx.make_attention_mask(jnp.ones((b, 1)), key_valid) "
                f"with key_valid (b, n); got a mask of shape {jnp.shape(mask)}. Dilated attention "
                "has a fixed sparsity pattern: use is_causal=True for causal masking, pass "
                "padding as such a key mask (or call dilax.dilated_attention with "
                "query_seq_lengths / key_value_seq_lengths), and leave other masks out"
            )
        if bias is not None:
            raise ValueError("dilax.attention_fn does not support an attention `bias`")
        if float(dropout_rate) > 0.0 and not deterministic:
            raise ValueError(
                f"dilax.attention_fn does not support attention-weight dropout (dropout_rate="
                f"{dropout_rate}, deterministic=False): the blockwise core never materializes "
                "the weights; use dropout_rate=0.0 or deterministic=True"
            )
        if module is not None:
            raise ValueError(
                "dilax.attention_fn cannot sow attention weights (sow_weights=True): the "
                "blockwise core never materializes them"
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
        out = dilated_attention(
            q, k, v, settings=causal_settings if V.check_bool(is_causal, "is_causal")
            else settings, key_padding_mask=key_valid)
        return out.reshape(batch + out.shape[1:])

    return dilated_attention_fn
