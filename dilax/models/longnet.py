"""LongNet (Ding et al. 2023) in Flax NNX: MAGNETO transformer layers over dilated attention.

Layer layout (MAGNETO, Wang et al. 2022, "sub-LN"): every block is pre-LayerNorm *and* has a
second LayerNorm inside the block (before the attention output projection, before the second
FFN matrix); residual stream unnormalized. Initialization: Xavier-normal, with the MAGNETO gain
``gamma`` on ``v_proj``, ``out_proj`` and both FFN matrices; biases zero.

The attention is :class:`dilax.nn.MultiheadDilatedAttention` (and so
:func:`dilax.dilated_attention`); no attention math lives here.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dilax import _validation as V
from dilax.decode import KVCache
from dilax.models.config import (
    DEFAULT_DILATION_RATES,
    PAPER_SEGMENT_LENGTHS,
    Branches,
    LongNetConfig,
    LongNetOptions,
    resolve_config,
)
from dilax.nn._heads import layer_norm, linear_factory
from dilax.nn.attention import MultiheadDilatedAttention

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["DEFAULT_DILATION_RATES", "PAPER_SEGMENT_LENGTHS", "XPOS",
           "DilatedTransformerDecoderLayer", "DilatedTransformerEncoderLayer", "LongNet",
           "LongNetCache", "LongNetConfig", "LongNetLM", "LongNetOptions", "magneto_gammas", "xpos"]


def magneto_gammas(
    num_encoder_layers: int, num_decoder_layers: int
) -> tuple[float | None, float | None]:
    """MAGNETO init gains ``(encoder_gamma, decoder_gamma)`` (MAGNETO paper, Fig. 2).

    Encoder-decoder (N, M layers): ``sqrt(log(3M) log(2N) / 3)`` and ``sqrt(log 3M)``.
    Encoder-only: ``sqrt(log 2N)``. Decoder-only: ``sqrt(log 2M)``. The gain of an absent stack
    is ``None``.
    """
    n, m = num_encoder_layers, num_decoder_layers
    if n > 0 and m > 0:
        return math.sqrt(math.log(3 * m) * math.log(2 * n) / 3), math.sqrt(math.log(3 * m))
    if n > 0:
        return math.sqrt(math.log(2 * n)), None
    return None, math.sqrt(math.log(2 * m))


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
    return (x * cos.astype(x.dtype) + rotated * sin.astype(x.dtype)).astype(x.dtype)


class XPOS(nnx.Module):
    """Parameter-free module form of :func:`xpos` (``(b, n, d)`` in and out)."""

    def __init__(self, scale_base: float = 512.0):
        self.scale_base = float(scale_base)

    def __call__(self, x: jax.Array, *, offset: int = 0, downscale: bool = False) -> jax.Array:
        return xpos(x, offset=offset, downscale=downscale, scale_base=self.scale_base)


# Layers built without a config: the width of torch.nn.TransformerEncoderLayer's FFN (and
# dilated-attention-pytorch's layers); the models default to the paper's 3072.
_LAYER_DEFAULTS = LongNetConfig(dim_feedforward=2048)


def _norm(cfg: LongNetConfig, rngs: nnx.Rngs, width: int | None = None) -> nnx.LayerNorm:
    return layer_norm(cfg.d_model if width is None else width, cfg.layer_norm_eps,
                      dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)


def _dropout(cfg: LongNetConfig, rngs: nnx.Rngs) -> nnx.Dropout:
    return nnx.Dropout(cfg.dropout, rngs=rngs if cfg.keep_rngs and cfg.dropout > 0 else None)


def _attention(cfg: LongNetConfig, gamma_init: float, *, layer_norm: bool,
               rngs: nnx.Rngs) -> MultiheadDilatedAttention:
    """The multi-head dilated attention of a layer of ``cfg``."""
    return MultiheadDilatedAttention(
        cfg.d_model, cfg.num_heads, cfg.segment_lengths, cfg.dilation_rates,
        num_kv_heads=cfg.num_kv_heads, dropout=cfg.dropout, use_bias=cfg.use_bias,
        layer_norm=layer_norm, layer_norm_eps=cfg.layer_norm_eps, gamma_init=gamma_init,
        mode=cfg.mode, implementation=cfg.implementation, block_sizes=cfg.block_sizes,
        sequence_parallel=cfg.sequence_parallel, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
        keep_rngs=cfg.keep_rngs, local_window=cfg.local_window, rngs=rngs,
    )


class _FeedForward(nnx.Module):
    """MAGNETO FFN: ``linear2(LN(dropout(act(linear1(x)))))``."""

    def __init__(self, cfg: LongNetConfig, gamma_init: float, *, rngs: nnx.Rngs):
        linear = linear_factory(use_bias=cfg.use_bias, dtype=cfg.dtype,
                                param_dtype=cfg.param_dtype, rngs=rngs)
        self.activation = cfg.activation
        self.linear1 = linear(cfg.d_model, cfg.dim_feedforward, gamma_init)
        self.dropout = _dropout(cfg, rngs)
        self.norm = _norm(cfg, rngs, cfg.dim_feedforward)
        self.linear2 = linear(cfg.dim_feedforward, cfg.d_model, gamma_init)

    def __call__(self, x, *, deterministic, rngs):
        x = self.dropout(self.activation(self.linear1(x)), deterministic=deterministic, rngs=rngs)
        return self.linear2(self.norm(x))


class _Layer(nnx.Module):
    """What the encoder and decoder layers share: the pre-LN self-attention block (``norm1``,
    ``self_attn``) first, the pre-LN feed-forward block (``ffn``) and the dropout last."""

    def _init_self_attention(self, cfg: LongNetConfig, gamma_init: float,
                             rngs: nnx.Rngs) -> None:
        self.config = cfg
        self.norm1 = _norm(cfg, rngs)
        self.self_attn = _attention(cfg, gamma_init, layer_norm=True, rngs=rngs)

    def _init_feed_forward(self, rngs: nnx.Rngs) -> None:
        # gamma_init as validated by the self-attention
        self.ffn = _FeedForward(self.config, self.self_attn.gamma_init, rngs=rngs)
        self.dropout = _dropout(self.config, rngs)

    def _residual(self, x: jax.Array, y: jax.Array, kw: dict) -> jax.Array:
        return x + self.dropout(y, **kw)

    def _self_attention_block(self, x: jax.Array, is_causal: bool, kw: dict,
                              seq_lengths: jax.Array | None = None) -> jax.Array:
        y = self.self_attn(self.norm1(x), is_causal=is_causal, query_seq_lengths=seq_lengths,
                           key_value_seq_lengths=seq_lengths, **kw)
        return self._residual(x, y, kw)

    def _feed_forward_block(self, x: jax.Array, norm: nnx.LayerNorm, kw: dict) -> jax.Array:
        return self._residual(x, self.ffn(norm(x), **kw), kw)

    # KV-cache decoding (inference: no dropout)
    _DECODE = dict(deterministic=True, rngs=None)

    def _self_attention_decode(self, x: jax.Array, cache: KVCache):
        y, cache = self.self_attn.decode(self.norm1(x), cache)
        return x + y, cache


class DilatedTransformerEncoderLayer(_Layer):
    """MAGNETO encoder layer with dilated self-attention.

    ``x = x + dropout(self_attn(LN(x)))``; ``x = x + dropout(ffn(LN(x)))``, where ``self_attn``
    is :class:`~dilax.nn.MultiheadDilatedAttention` with its sub-LayerNorm and ``ffn`` is
    ``linear2(LN(dropout(activation(linear1(x)))))``.

    Args:
      d_model, num_heads, segment_lengths, dilation_rates, dim_feedforward: width, heads,
        dilated branches, FFN hidden width; ``None``: those of ``config`` (without a config:
        the :class:`LongNetConfig` defaults, but ``dim_feedforward`` 2048).
      gamma_init: MAGNETO gain on ``v_proj``, ``out_proj``, ``linear1`` and ``linear2``.
      config: a :class:`LongNetConfig`; the settings given as arguments replace its fields.
      rngs: for parameter initialization (and dropout, see ``keep_rngs``).
      **options: the keyword fields of :class:`LongNetConfig` (:class:`LongNetOptions`):
        ``num_kv_heads``, ``dropout``, ``activation``, ``layer_norm_eps``, ``mode``,
        ``use_bias``, ``implementation``, ``block_sizes``, ``sequence_parallel``, ``dtype``,
        ``param_dtype``, ``keep_rngs``.

    ``__call__(x (b, n, d_model), *, is_causal=False, seq_lengths=None) -> (b, n, d_model)``;
    ``seq_lengths``: optional int ``(b,)`` valid tokens per row (padding): the attention's
    query and key-value lengths.
    """

    def __init__(
        self,
        d_model: int | None = None,
        num_heads: int | None = None,
        segment_lengths: Branches | None = None,
        dilation_rates: Branches | None = None,
        *,
        dim_feedforward: int | None = None,
        gamma_init: float = 1.0,
        config: LongNetConfig | None = None,
        rngs: nnx.Rngs,
        **options: Unpack[LongNetOptions],
    ):
        cfg = resolve_config(
            "DilatedTransformerEncoderLayer", config, options, base=_LAYER_DEFAULTS,
            d_model=d_model, num_heads=num_heads, dim_feedforward=dim_feedforward,
            segment_lengths=segment_lengths, dilation_rates=dilation_rates)
        self._init_self_attention(cfg, gamma_init, rngs)
        self.norm2 = _norm(cfg, rngs)
        self._init_feed_forward(rngs)

    def __call__(
        self,
        x: jax.Array,
        *,
        is_causal: bool = False,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | None = None,
        seq_lengths: jax.Array | None = None,
    ) -> jax.Array:
        kw = dict(deterministic=deterministic, rngs=rngs)
        x = self._self_attention_block(x, is_causal, kw, seq_lengths)
        return self._feed_forward_block(x, self.norm2, kw)

    def decode(self, x: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """The next ``t`` positions ``x (b, t, d_model)`` of a causal pass, with the
        self-attention's KV cache: ``(y (b, t, d_model), cache)``."""
        x, cache = self._self_attention_decode(x, cache)
        return self._feed_forward_block(x, self.norm2, self._DECODE), cache


class DilatedTransformerDecoderLayer(_Layer):
    """MAGNETO decoder layer with dilated self- and cross-attention.

    ``x = x + dropout(self_attn(LN(x)))``; ``x = x + dropout(cross_attn(LN(x), memory))``;
    ``x = x + dropout(ffn(LN(x)))``. The self-attention has the sub-LayerNorm, the
    cross-attention does not (as in MAGNETO). ``memory`` must have the same sequence length as
    ``x`` (dilated attention pairs query and key positions). With ``cross_attention=False`` the
    layer has no cross-attention block (decoder-only models).

    Other arguments as in :class:`DilatedTransformerEncoderLayer`.

    ``__call__(x, memory=None, *, is_causal=False, memory_is_causal=False, seq_lengths=None)
    -> (b, n, d_model)``; ``seq_lengths``: optional int ``(b,)`` valid tokens per row of ``x``
    and ``memory`` (padding).
    """

    def __init__(
        self,
        d_model: int | None = None,
        num_heads: int | None = None,
        segment_lengths: Branches | None = None,
        dilation_rates: Branches | None = None,
        *,
        dim_feedforward: int | None = None,
        gamma_init: float = 1.0,
        cross_attention: bool = True,
        config: LongNetConfig | None = None,
        rngs: nnx.Rngs,
        **options: Unpack[LongNetOptions],
    ):
        cfg = resolve_config(
            "DilatedTransformerDecoderLayer", config, options, base=_LAYER_DEFAULTS,
            d_model=d_model, num_heads=num_heads, dim_feedforward=dim_feedforward,
            segment_lengths=segment_lengths, dilation_rates=dilation_rates)
        self.cross_attention = V.check_bool(cross_attention, "cross_attention")
        self._init_self_attention(cfg, gamma_init, rngs)
        if self.cross_attention:
            self.norm2 = _norm(cfg, rngs)
            self.cross_attn = _attention(cfg, self.self_attn.gamma_init, layer_norm=False,
                                         rngs=rngs)
        else:
            self.norm2 = nnx.data(None)
            self.cross_attn = nnx.data(None)
        self.norm3 = _norm(cfg, rngs)
        self._init_feed_forward(rngs)

    def __call__(
        self,
        x: jax.Array,
        memory: jax.Array | None = None,
        *,
        is_causal: bool = False,
        memory_is_causal: bool = False,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | None = None,
        seq_lengths: jax.Array | None = None,
    ) -> jax.Array:
        kw = dict(deterministic=deterministic, rngs=rngs)
        x = self._self_attention_block(x, is_causal, kw, seq_lengths)
        if self.cross_attn is not None:
            if memory is None:
                raise ValueError("memory must be given to a decoder layer with cross_attention")
            y = self.cross_attn(self.norm2(x), memory, is_causal=memory_is_causal,
                                query_seq_lengths=seq_lengths,
                                key_value_seq_lengths=seq_lengths, **kw)
            x = self._residual(x, y, kw)
        elif memory is not None:
            raise ValueError("memory was given to a decoder layer built with "
                             "cross_attention=False")
        return self._feed_forward_block(x, self.norm3, kw)

    def decode(self, x: jax.Array, cache: tuple, memory: jax.Array | None = None):
        """The next ``t`` positions of a causal pass (``is_causal=memory_is_causal=True``):
        ``x (b, t, d_model)`` and, with cross-attention, the encoder output ``memory`` at the
        same positions. ``cache = (self_attention_cache, cross_attention_cache or None)``.
        Returns ``(y (b, t, d_model), cache)``."""
        self_cache, cross_cache = cache
        x, self_cache = self._self_attention_decode(x, self_cache)
        if self.cross_attn is not None:
            if memory is None:
                raise ValueError("memory must be given to a decoder layer with cross_attention")
            y, cross_cache = self.cross_attn.decode(self.norm2(x), cross_cache, memory)
            x = x + y
        return self._feed_forward_block(x, self.norm3, self._DECODE), (self_cache, cross_cache)


class LongNet(nnx.Module):
    """LongNet encoder–decoder (defaults: the paper's base model, Sec. 4.1).

    The encoder reads ``x``; the decoder reads ``x`` as its target and attends the encoder
    output (both causal by default, so the whole model is a valid language model, as in
    dilated-attention-pytorch). ``num_encoder_layers=0`` gives a decoder-only model (decoder
    layers without cross-attention, MAGNETO decoder-only gain), ``num_decoder_layers=0`` an
    encoder-only one. MAGNETO gains come from :func:`magneto_gammas`.

    Args:
      d_model, num_heads, dim_feedforward, segment_lengths, dilation_rates: sizes and dilated
        branches; ``None``: those of ``config`` (default :class:`LongNetConfig`: paper sizes
        768, 12, 3072, paper segment lengths, ``DEFAULT_DILATION_RATES``).
      num_encoder_layers, num_decoder_layers: stack depths (paper: 12, 12).
      remat: activation checkpointing (``nnx.remat``) around every layer.
      config: a :class:`LongNetConfig`; the settings given as arguments replace its fields.
      rngs: for parameter initialization.
      **options: the keyword fields of :class:`LongNetConfig` (``num_kv_heads``, ``dropout``,
        ``dtype`` (e.g. ``jnp.bfloat16``; ``param_dtype`` stays float32 by default), ...), as in
        :class:`DilatedTransformerEncoderLayer`.

    ``__call__(x (b, n, d_model), *, is_causal=True, seq_lengths=None) -> (b, n, d_model)``;
    ``seq_lengths``: optional int ``(b,)`` valid tokens per row (padding at the end): every
    attention uses it as query and key-value lengths (as in :func:`dilax.dilated_attention`),
    so the valid prefix equals the unpadded sequence's result; rows past it are
    finite values to be ignored (mask them out of the loss).
    """

    def __init__(
        self,
        d_model: int | None = None,
        num_heads: int | None = None,
        num_encoder_layers: int = 12,
        num_decoder_layers: int = 12,
        dim_feedforward: int | None = None,
        segment_lengths: Branches | None = None,
        dilation_rates: Branches | None = None,
        *,
        remat: bool = False,
        config: LongNetConfig | None = None,
        rngs: nnx.Rngs,
        **options: Unpack[LongNetOptions],
    ):
        cfg = resolve_config(
            "LongNet", config, options, d_model=d_model, num_heads=num_heads,
            dim_feedforward=dim_feedforward, segment_lengths=segment_lengths,
            dilation_rates=dilation_rates)
        n_enc = V.static_int(num_encoder_layers, "num_encoder_layers")
        n_dec = V.static_int(num_decoder_layers, "num_decoder_layers")
        if n_enc < 0 or n_dec < 0 or n_enc + n_dec == 0:
            raise ValueError(
                "num_encoder_layers and num_decoder_layers must be >= 0 and not both 0, got "
                f"num_encoder_layers={n_enc}, num_decoder_layers={n_dec}"
            )
        self.config = cfg
        self.remat = V.check_bool(remat, "remat")
        self.d_model = cfg.d_model
        self.encoder_gamma, self.decoder_gamma = magneto_gammas(n_enc, n_dec)
        self.encoder = nnx.List([
            DilatedTransformerEncoderLayer(gamma_init=self.encoder_gamma, config=cfg, rngs=rngs)
            for _ in range(n_enc)
        ])
        self.decoder = nnx.List([
            DilatedTransformerDecoderLayer(gamma_init=self.decoder_gamma,
                                           cross_attention=n_enc > 0, config=cfg, rngs=rngs)
            for _ in range(n_dec)
        ])

    def _layer(self, layer, x, memory, rngs, **kw):
        if memory is None:
            call = lambda layer, x, memory, rngs: layer(x, rngs=rngs, **kw)
        else:
            call = lambda layer, x, memory, rngs: layer(x, memory, rngs=rngs, **kw)
        if self.remat:
            call = nnx.remat(call)
        return call(layer, x, memory, rngs)

    def __call__(
        self,
        x: jax.Array,
        *,
        is_causal: bool = True,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | None = None,
        seq_lengths: jax.Array | None = None,
    ) -> jax.Array:
        is_causal = V.check_bool(is_causal, "is_causal")
        tgt = x
        extra = {} if seq_lengths is None else dict(seq_lengths=seq_lengths)
        for layer in self.encoder:
            x = self._layer(layer, x, None, rngs, is_causal=is_causal,
                            deterministic=deterministic, **extra)
        if len(self.decoder) == 0:
            return x
        memory = x if len(self.encoder) else None
        for layer in self.decoder:
            kw = dict(is_causal=is_causal, deterministic=deterministic, **extra)
            if memory is not None:
                kw["memory_is_causal"] = is_causal
            tgt = self._layer(layer, tgt, memory, rngs, **kw)
        return tgt

    # --- KV-cache decoding -------------------------------------------------------------

    def init_cache(self, batch: int, max_len: int, dtype=None) -> tuple:
        """Empty KV caches of every attention for :meth:`decode`: a tuple with one
        :class:`dilax.KVCache` per encoder layer, then one ``(self, cross or None)`` pair per
        decoder layer."""
        enc = tuple(layer.self_attn.init_cache(batch, max_len, dtype) for layer in self.encoder)
        dec = tuple((layer.self_attn.init_cache(batch, max_len, dtype),
                     None if layer.cross_attn is None
                     else layer.cross_attn.init_cache(batch, max_len, dtype))
                    for layer in self.decoder)
        return enc + dec

    def decode(self, x: jax.Array, caches: tuple) -> tuple[jax.Array, tuple]:
        """The next ``t`` positions ``x (b, t, d_model)`` of the causal model
        (``is_causal=True``) with the caches of :meth:`init_cache`: returns the rows of
        ``self(x_all)`` at those positions and the updated caches (inference: no dropout)."""
        n_enc = len(self.encoder)
        enc, dec = list(caches[:n_enc]), list(caches[n_enc:])
        tgt = x
        for i, layer in enumerate(self.encoder):
            x, enc[i] = layer.decode(x, enc[i])
        if len(self.decoder) == 0:
            return x, tuple(enc)
        memory = x if n_enc else None
        for i, layer in enumerate(self.decoder):
            tgt, dec[i] = layer.decode(tgt, dec[i], memory)
        return tgt, tuple(enc) + tuple(dec)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LongNetCache:
    """Decoding state of a :class:`LongNetLM` (a pytree): the KV caches of every attention
    (:meth:`LongNet.init_cache`) and the XPOS rows ``(max_len, d_model)`` of the
    ``max_len`` window, so positions come from the cache lengths."""

    layers: tuple
    xpos_cos: jax.Array
    xpos_sin: jax.Array

    @property
    def lengths(self) -> jax.Array:
        """``(b,)`` int32: positions written per row."""
        return jax.tree.leaves(self.layers, is_leaf=lambda x: isinstance(x, KVCache))[0].lengths

    @property
    def max_len(self) -> int:
        return self.xpos_cos.shape[0]

    def with_lengths(self, lengths: jax.Array) -> LongNetCache:
        """Every layer's cache with ``lengths`` (see :meth:`dilax.KVCache.with_lengths`)."""
        layers = jax.tree.map(lambda c: c.with_lengths(lengths) if isinstance(c, KVCache)
                              else c, self.layers, is_leaf=lambda x: isinstance(x, KVCache))
        return dataclasses.replace(self, layers=layers)


class LongNetLM(nnx.Module):
    """Language model: token embedding + XPOS, :class:`LongNet`, final LayerNorm, LM head.

    As in dilated-attention-pytorch, positions enter as ``e + xpos(e)`` on the token
    embeddings ``e`` (embedding init N(0, 1)); the head is Xavier-normal with zero bias.

    Args:
      num_tokens: vocabulary size.
      d_model: width (even, for XPOS).
      xpos_scale_base: the XPOS scale base (see :func:`xpos`).
      Everything else as in :class:`LongNet`, e.g.
      ``LongNetLM(256, config=LongNetConfig(64, 4, 128, (16, 32), (1, 2)),
      num_encoder_layers=0, num_decoder_layers=2, rngs=nnx.Rngs(0))``.

    ``__call__(tokens (b, n) int, *, is_causal=True, seq_lengths=None) -> logits
    (b, n, num_tokens)`` in the compute dtype; ``seq_lengths``: optional int ``(b,)`` valid
    tokens per row (padding at the end, see :class:`LongNet`).
    """

    def __init__(
        self,
        num_tokens: int,
        d_model: int | None = None,
        num_heads: int | None = None,
        num_encoder_layers: int = 12,
        num_decoder_layers: int = 12,
        dim_feedforward: int | None = None,
        segment_lengths: Branches | None = None,
        dilation_rates: Branches | None = None,
        *,
        remat: bool = False,
        xpos_scale_base: float = 512.0,
        config: LongNetConfig | None = None,
        rngs: nnx.Rngs,
        **options: Unpack[LongNetOptions],
    ):
        num_tokens = V.static_int(num_tokens, "num_tokens")
        if num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {num_tokens}")
        cfg = resolve_config(
            "LongNetLM", config, options, d_model=d_model, num_heads=num_heads,
            dim_feedforward=dim_feedforward, segment_lengths=segment_lengths,
            dilation_rates=dilation_rates)
        if cfg.d_model % 2:
            raise ValueError(f"d_model must be even (XPOS rotates feature pairs), got "
                             f"{cfg.d_model}")
        self.config = cfg
        self.num_tokens = num_tokens
        self.token_embedding = nnx.Embed(
            num_tokens, cfg.d_model, embedding_init=jax.nn.initializers.normal(1.0),
            dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs,
        )
        self.pos_embedding = XPOS(xpos_scale_base)
        self.long_net = LongNet(num_encoder_layers=num_encoder_layers,
                                num_decoder_layers=num_decoder_layers, remat=remat,
                                config=cfg, rngs=rngs)
        self.norm = _norm(cfg, rngs)
        self.out = linear_factory(use_bias=cfg.use_bias, dtype=cfg.dtype,
                                  param_dtype=cfg.param_dtype, rngs=rngs)(
            cfg.d_model, num_tokens, 1.0)

    def __call__(
        self,
        tokens: jax.Array,
        *,
        is_causal: bool = True,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | None = None,
        seq_lengths: jax.Array | None = None,
    ) -> jax.Array:
        _check_tokens(tokens)
        x = self.token_embedding(tokens)
        x = x + self.pos_embedding(x)
        x = self.long_net(x, is_causal=is_causal, deterministic=deterministic, rngs=rngs,
                          **({} if seq_lengths is None else dict(seq_lengths=seq_lengths)))
        return self.out(self.norm(x))

    # --- KV-cache decoding -------------------------------------------------------------

    def init_cache(self, batch: int, max_len: int) -> LongNetCache:
        """An empty :class:`LongNetCache` for :meth:`decode` (lengths 0).

        Positions are those of the model applied to a ``max_len`` window: XPOS centres its
        scale on the window, so :meth:`decode` gives the logits of ``self(tokens)`` with
        ``tokens`` right-padded to ``max_len`` (causal: the padding never matters)."""
        max_len = V.static_int(max_len, "max_len")
        if max_len <= 0:
            raise ValueError(f"max_len must be positive, got {max_len}")
        cos, sin = _xpos_tables(max_len, self.config.d_model, 0, False,
                                self.pos_embedding.scale_base)
        return LongNetCache(self.long_net.init_cache(batch, max_len, self.config.dtype),
                            jnp.asarray(cos), jnp.asarray(sin))

    def decode(self, tokens: jax.Array, cache: LongNetCache) -> tuple[jax.Array, LongNetCache]:
        """Logits of the next ``t`` tokens of every row with a cache (inference: no dropout).

        ``tokens (b, t)`` int are the tokens at positions ``cache.lengths[i] ..
        cache.lengths[i] + t - 1``; returns ``(logits (b, t, num_tokens), cache)``, the
        rows of ``self(all_tokens)`` at those positions (see :meth:`init_cache`). ``t > 1``
        is a chunk of prefill. Cost per token does not grow with the context
        (:func:`dilax.dilated_attention_decode`); jit it with the cache donated to update it
        in place, or use :func:`dilax.models.generate`."""
        _check_tokens(tokens)
        pos = jnp.clip(cache.lengths[:, None] + jnp.arange(tokens.shape[1]), 0,
                       cache.max_len - 1)
        x = self.token_embedding(tokens)
        x = x + _rotate(x, cache.xpos_cos[pos], cache.xpos_sin[pos])
        x, layers = self.long_net.decode(x, cache.layers)
        return self.out(self.norm(x)), dataclasses.replace(cache, layers=layers)


def _check_tokens(tokens: jax.Array) -> None:
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(
            f"tokens must be an integer array of shape (batch, seq_len), got "
            f"{tokens.dtype}{tuple(tokens.shape)}"
        )
