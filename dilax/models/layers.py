"""MAGNETO transformer layers over dilated attention, and their init gains.

Layer layout (MAGNETO, Wang et al. 2022, "sub-LN"): every block is pre-LayerNorm *and* has a
second LayerNorm inside the block (before the attention output projection, before the second
FFN matrix); residual stream unnormalized. Initialization: Xavier-normal, with the MAGNETO gain
``gamma`` (:func:`magneto_gammas`) on ``v_proj``, ``out_proj`` and both FFN matrices; biases
zero.

The attention is :class:`dilax.nn.MultiheadDilatedAttention` (and so
:func:`dilax.dilated_attention`); no attention math lives here. The self-attentions apply the
config's ``position_scheme`` to their queries and keys (:func:`dilax.models.rotary_qk`); the
cross-attention reads the encoder output, which already carries positions, and applies none
(as in torchscale).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from dilax import _validation as V
from dilax.attention_mask import document_positions
from dilax.dilated.decode import KVCache
from dilax.dilated.settings import warn_uncovered_offsets
from dilax.models.config import Branches, LongNetConfig, LongNetOptions, resolve_config
from dilax.models.positions import check_positions, check_xpos_length, rotary_qk
from dilax.nn._heads import (
    layer_norm,
    linear_factory,
    output_projection,
    project_qkv,
    sink_logits,
)
from dilax.nn.attention import MultiheadDilatedAttention

if TYPE_CHECKING:
    from typing_extensions import Unpack


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


# Layers built without a config: the width of torch.nn.TransformerEncoderLayer's FFN (and
# dilated-attention-pytorch's layers); the models default to the paper's 3072.
_LAYER_DEFAULTS = LongNetConfig(dim_feedforward=2048)


def norm_layer(cfg: LongNetConfig, rngs: nnx.Rngs, width: int | None = None) -> nnx.LayerNorm:
    return layer_norm(cfg.d_model if width is None else width, cfg.layer_norm_eps,
                      dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)


def _dropout(cfg: LongNetConfig, rngs: nnx.Rngs) -> nnx.Dropout:
    return nnx.Dropout(cfg.dropout, rngs=rngs if cfg.keep_rngs and cfg.dropout > 0 else None)


class _SelfAttention(MultiheadDilatedAttention):
    """:class:`~dilax.nn.MultiheadDilatedAttention` (same parameters, same state paths) with
    the config's rotary positions on the projected queries and keys."""

    def _rotary(self, q, k, positions, window: int, name: str):
        # the XPOS centre cancels in q.k; the middle of the window keeps the scales in range
        centre = window // 2
        if self.position_scheme == "xpos":
            check_xpos_length(window, self.xpos_scale_base, name)
        return rotary_qk(q, k, positions, scheme=self.position_scheme,
                         scale_base=self.xpos_scale_base, theta=self.rope_theta, centre=centre)

    def __call__(self, query: jax.Array, *, positions: jax.Array | None = None,
                 is_causal: bool = False, deterministic: bool | None = None,
                 rngs: nnx.Rngs | None = None, query_seq_lengths: jax.Array | None = None,
                 key_value_seq_lengths: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """``query (b, n, E)``, ``positions`` int ``(b, n)`` (default ``0 .. n - 1``, or with
        ``segment_ids (b, n)`` the position inside each document: restarting at 0)."""
        if positions is None and segment_ids is not None:
            positions = document_positions(segment_ids)
        q, k, v = project_qkv(self, query, None, None)
        q, k = self._rotary(q, k, positions, query.shape[1], "sequence length")
        if self.block_sparse is not None:  # LongNetConfig.block_sparse
            from dilax.block_sparse.api import block_sparse_attention
            from dilax.patterns import local_strided

            pattern = local_strided(query.shape[1], *self.block_sparse)
            x = block_sparse_attention(q, k, v, pattern, is_causal=is_causal,
                                       query_seq_lengths=query_seq_lengths,
                                       key_value_seq_lengths=key_value_seq_lengths,
                                       segment_ids=segment_ids, sinks=sink_logits(self),
                                       logits_soft_cap=self.attention.logits_soft_cap)
        else:
            x = self.attention(q, k, v, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
                               key_value_seq_lengths=key_value_seq_lengths,
                               segment_ids=segment_ids, sinks=sink_logits(self))
        x = x.reshape(query.shape)
        return output_projection(self, self.dropout(x, deterministic=deterministic, rngs=rngs))

    def decode(self, query: jax.Array, cache: KVCache,
               positions: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """The next ``t`` positions ``query (b, t, E)``: ``positions`` default to
        ``cache.lengths[:, None] + arange(t)``; the cache holds the rotated keys."""
        if self.block_sparse is not None:
            raise NotImplementedError("KV-cache decoding of a block_sparse model (LongNetConfig."
                                      "block_sparse) is not implemented; run it on the whole "
                                      "window instead")
        if self.sinks is not None:
            raise NotImplementedError("KV-cache decoding with attention_sinks is not "
                                      "implemented yet")
        b, t = query.shape[:2]
        if positions is None:
            positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)
        positions = check_positions(positions, b, t)
        q, k, v = project_qkv(self, query, None, None)
        q, k = self._rotary(q, k, positions, cache.max_len, "the cache's max_len")
        out, cache = self.attention.decode(q, k, v, cache)
        return output_projection(self, out.reshape(query.shape)), cache


def _attention(cfg: LongNetConfig, gamma_init: float, *, layer_norm: bool,
               rngs: nnx.Rngs, self_attention: bool = False) -> MultiheadDilatedAttention:
    """The multi-head dilated attention of a layer of ``cfg`` (a self-attention: with the
    config's positions)."""
    if cfg.block_sparse is None or not self_attention:  # once per configuration (cached)
        warn_uncovered_offsets(cfg.num_heads, cfg.segment_lengths, cfg.dilation_rates, cfg.mode)
    attn = (_SelfAttention if self_attention else MultiheadDilatedAttention)(
        cfg.d_model, cfg.num_heads, cfg.segment_lengths, cfg.dilation_rates,
        num_kv_heads=cfg.num_kv_heads, dropout=cfg.dropout, use_bias=cfg.use_bias,
        layer_norm=layer_norm, layer_norm_eps=cfg.layer_norm_eps, gamma_init=gamma_init,
        mode=cfg.mode, implementation=cfg.implementation, block_sizes=cfg.block_sizes,
        sequence_parallel=cfg.sequence_parallel, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
        keep_rngs=cfg.keep_rngs, local_window=cfg.local_window,
        logits_soft_cap=cfg.logits_soft_cap, learnable_sinks=cfg.attention_sinks, rngs=rngs,
    )
    if self_attention:  # static settings of the rotary code
        attn.position_scheme = cfg.position_scheme
        attn.xpos_scale_base = cfg.xpos_scale_base
        attn.rope_theta = cfg.rope_theta
        attn.block_sparse = cfg.block_sparse
    return attn


class _FeedForward(nnx.Module):
    """MAGNETO FFN: ``linear2(LN(dropout(act(linear1(x)))))``."""

    def __init__(self, cfg: LongNetConfig, gamma_init: float, *, rngs: nnx.Rngs):
        linear = linear_factory(use_bias=cfg.use_bias, dtype=cfg.dtype,
                                param_dtype=cfg.param_dtype, rngs=rngs)
        self.activation = cfg.activation
        self.linear1 = linear(cfg.d_model, cfg.dim_feedforward, gamma_init)
        self.dropout = _dropout(cfg, rngs)
        self.norm = norm_layer(cfg, rngs, cfg.dim_feedforward)
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
        self.norm1 = norm_layer(cfg, rngs)
        self.self_attn = _attention(cfg, gamma_init, layer_norm=True, rngs=rngs,
                                    self_attention=True)

    def _init_feed_forward(self, rngs: nnx.Rngs) -> None:
        # gamma_init as validated by the self-attention
        self.ffn = _FeedForward(self.config, self.self_attn.gamma_init, rngs=rngs)
        self.dropout = _dropout(self.config, rngs)

    def _residual(self, x: jax.Array, y: jax.Array, kw: dict) -> jax.Array:
        return x + self.dropout(y, **kw)

    def _self_attention_block(self, x: jax.Array, is_causal: bool, kw: dict,
                              seq_lengths: jax.Array | None = None,
                              positions: jax.Array | None = None,
                              segment_ids: jax.Array | None = None) -> jax.Array:
        y = self.self_attn(self.norm1(x), positions=positions, is_causal=is_causal,
                           query_seq_lengths=seq_lengths, key_value_seq_lengths=seq_lengths,
                           segment_ids=segment_ids, **kw)
        return self._residual(x, y, kw)

    def _feed_forward_block(self, x: jax.Array, norm: nnx.LayerNorm, kw: dict) -> jax.Array:
        return self._residual(x, self.ffn(norm(x), **kw), kw)

    # KV-cache decoding (inference: no dropout)
    _DECODE = dict(deterministic=True, rngs=None)

    def _self_attention_decode(self, x: jax.Array, cache: KVCache,
                               positions: jax.Array | None = None):
        y, cache = self.self_attn.decode(self.norm1(x), cache, positions)
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
        ``param_dtype``, ``keep_rngs``, ``local_window``, ``position_scheme``,
        ``xpos_scale_base``, ``rope_theta``.

    ``__call__(x (b, n, d_model), *, is_causal=False, seq_lengths=None, positions=None,
    segment_ids=None) -> (b, n, d_model)``; ``seq_lengths``: optional int ``(b,)`` valid
    tokens per row (padding): the attention's query and key-value lengths; ``positions``:
    optional int ``(b, n)`` position of every token for the self-attention's rotary code
    (default ``0 .. n - 1``, or the position inside the document with ``segment_ids``);
    ``segment_ids``: optional int ``(b, n)``, packed documents (a maximal run of equal ids is
    a document: attention never crosses documents, positions restart at each).
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
        self.norm2 = norm_layer(cfg, rngs)
        self._init_feed_forward(rngs)

    def __call__(
        self,
        x: jax.Array,
        *,
        is_causal: bool = False,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | None = None,
        seq_lengths: jax.Array | None = None,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        kw = dict(deterministic=deterministic, rngs=rngs)
        x = self._self_attention_block(x, is_causal, kw, seq_lengths, positions, segment_ids)
        return self._feed_forward_block(x, self.norm2, kw)

    def decode(self, x: jax.Array, cache: KVCache,
               positions: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """The next ``t`` positions ``x (b, t, d_model)`` of a causal pass, with the
        self-attention's KV cache: ``(y (b, t, d_model), cache)``; ``positions`` (int
        ``(b, t)``) default to ``cache.lengths[:, None] + arange(t)``."""
        x, cache = self._self_attention_decode(x, cache, positions)
        return self._feed_forward_block(x, self.norm2, self._DECODE), cache


class DilatedTransformerDecoderLayer(_Layer):
    """MAGNETO decoder layer with dilated self- and cross-attention.

    ``x = x + dropout(self_attn(LN(x)))``; ``x = x + dropout(cross_attn(LN(x), memory))``;
    ``x = x + dropout(ffn(LN(x)))``. The self-attention has the sub-LayerNorm, the
    cross-attention does not (as in MAGNETO). ``memory`` must have the same sequence length as
    ``x`` (dilated attention pairs query and key positions). With ``cross_attention=False`` the
    layer has no cross-attention block (decoder-only models).

    Other arguments as in :class:`DilatedTransformerEncoderLayer`.

    ``__call__(x, memory=None, *, is_causal=False, memory_is_causal=False, seq_lengths=None,
    positions=None, segment_ids=None) -> (b, n, d_model)``; ``seq_lengths``: optional int
    ``(b,)`` valid tokens per row of ``x`` and ``memory`` (padding); ``positions``: as in the
    encoder layer (the self-attention only); ``segment_ids``: as in the encoder layer, for the
    rows of ``x`` and ``memory`` (the cross-attention does not cross documents either).
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
            self.norm2 = norm_layer(cfg, rngs)
            self.cross_attn = _attention(cfg, self.self_attn.gamma_init, layer_norm=False,
                                         rngs=rngs)
        else:
            self.norm2 = nnx.data(None)
            self.cross_attn = nnx.data(None)
        self.norm3 = norm_layer(cfg, rngs)
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
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        kw = dict(deterministic=deterministic, rngs=rngs)
        x = self._self_attention_block(x, is_causal, kw, seq_lengths, positions, segment_ids)
        if self.cross_attn is not None:
            if memory is None:
                raise ValueError("memory must be given to a decoder layer with cross_attention")
            y = self.cross_attn(self.norm2(x), memory, is_causal=memory_is_causal,
                                query_seq_lengths=seq_lengths,
                                key_value_seq_lengths=seq_lengths, segment_ids=segment_ids,
                                **kw)
            x = self._residual(x, y, kw)
        elif memory is not None:
            raise ValueError("memory was given to a decoder layer built with "
                             "cross_attention=False")
        return self._feed_forward_block(x, self.norm3, kw)

    def decode(self, x: jax.Array, cache: tuple, memory: jax.Array | None = None,
               positions: jax.Array | None = None):
        """The next ``t`` positions of a causal pass (``is_causal=memory_is_causal=True``):
        ``x (b, t, d_model)`` and, with cross-attention, the encoder output ``memory`` at the
        same positions. ``cache = (self_attention_cache, cross_attention_cache or None)``;
        ``positions`` as in the encoder layer's ``decode``.
        Returns ``(y (b, t, d_model), cache)``."""
        self_cache, cross_cache = cache
        x, self_cache = self._self_attention_decode(x, self_cache, positions)
        if self.cross_attn is not None:
            if memory is None:
                raise ValueError("memory must be given to a decoder layer with cross_attention")
            y, cross_cache = self.cross_attn.decode(self.norm2(x), cross_cache, memory)
            x = x + y
        return self._feed_forward_block(x, self.norm3, self._DECODE), (self_cache, cross_cache)
