"""LongNet (Ding et al. 2023) in Flax NNX: MAGNETO transformer layers over dilated attention.

Layer layout (MAGNETO, Wang et al. 2022, "sub-LN"): every block is pre-LayerNorm *and* has a
second LayerNorm inside the block (before the attention output projection, before the second
FFN matrix); residual stream unnormalized. Initialization: Xavier-normal, with the MAGNETO gain
``gamma`` on ``v_proj``, ``out_proj`` and both FFN matrices; biases zero.

The attention is :class:`dilax.nn.MultiheadDilatedAttention` (and so
:func:`dilax.dilated_attention`); no attention math lives here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dilax import _validation as V
from dilax.core import BlockSizes
from dilax.nn._heads import check_dropout, linear_factory
from dilax.nn.attention import MultiheadDilatedAttention
from dilax.sp import SequenceParallel

Dtype = Any

# LongNet paper, Sec. 4.1: segment lengths {2048, ..., 32768}. The paper's dilation rates are
# (1, 2, 4, 6, 12), but 16384 % 6 and 32768 % 12 are not 0, which the semantics ("w % r == 0")
# rejects; we use the powers of two (1, 2, 4, 8, 16), which also keep w / r = 2048 dilated
# positions per segment in every branch.
PAPER_SEGMENT_LENGTHS: tuple[int, ...] = (2048, 4096, 8192, 16384, 32768)
DEFAULT_DILATION_RATES: tuple[int, ...] = (1, 2, 4, 8, 16)


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
    pairs = x.reshape(*x.shape[:-1], d // 2, 2)
    rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)
    return (x * jnp.asarray(cos, x.dtype) + rotated * jnp.asarray(sin, x.dtype)).astype(x.dtype)


class XPOS(nnx.Module):
    """Parameter-free module form of :func:`xpos` (``(b, n, d)`` in and out)."""

    def __init__(self, scale_base: float = 512.0):
        self.scale_base = float(scale_base)

    def __call__(self, x: jax.Array, *, offset: int = 0, downscale: bool = False) -> jax.Array:
        return xpos(x, offset=offset, downscale=downscale, scale_base=self.scale_base)


class _FeedForward(nnx.Module):
    """MAGNETO FFN: ``linear2(LN(dropout(act(linear1(x)))))``."""

    def __init__(self, d_model, dim_feedforward, *, activation, dropout, layer_norm_eps,
                 gamma_init, use_bias, dtype, param_dtype, keep_rngs, rngs):
        linear = linear_factory(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                                rngs=rngs)
        self.activation = activation
        self.linear1 = linear(d_model, dim_feedforward, gamma_init)
        self.dropout = nnx.Dropout(dropout, rngs=rngs if keep_rngs and dropout > 0 else None)
        self.norm = nnx.LayerNorm(dim_feedforward, epsilon=layer_norm_eps, dtype=dtype,
                                  param_dtype=param_dtype, rngs=rngs)
        self.linear2 = linear(dim_feedforward, d_model, gamma_init)

    def __call__(self, x, *, deterministic, rngs):
        x = self.dropout(self.activation(self.linear1(x)), deterministic=deterministic, rngs=rngs)
        return self.linear2(self.norm(x))


class DilatedTransformerEncoderLayer(nnx.Module):
    """MAGNETO encoder layer with dilated self-attention.

    ``x = x + dropout(self_attn(LN(x)))``; ``x = x + dropout(ffn(LN(x)))``, where ``self_attn``
    is :class:`~dilax.nn.MultiheadDilatedAttention` with its sub-LayerNorm and ``ffn`` is
    ``linear2(LN(dropout(activation(linear1(x)))))``.

    Args:
      d_model, num_heads, segment_lengths, dilation_rates: width, heads, dilated branches.
      dim_feedforward: FFN hidden width.
      num_kv_heads: GQA key/value heads (default ``num_heads``).
      dropout: residual-branch, FFN-hidden and attention-output dropout rate.
      activation: FFN nonlinearity (default ReLU, as in LongNet/MAGNETO).
      layer_norm_eps: LayerNorm epsilon.
      gamma_init: MAGNETO gain on ``v_proj``, ``out_proj``, ``linear1`` and ``linear2``.
      mode, use_bias, implementation, block_sizes, sequence_parallel, dtype, param_dtype,
        keep_rngs, rngs: as in :class:`~dilax.nn.MultiheadDilatedAttention`
        (``sequence_parallel``: run attention as ring attention over a mesh).

    ``__call__(x (b, n, d_model), *, is_causal=False) -> (b, n, d_model)``.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        segment_lengths: tuple[int, ...] | list[int],
        dilation_rates: tuple[int, ...] | list[int],
        *,
        dim_feedforward: int = 2048,
        num_kv_heads: int | None = None,
        dropout: float = 0.0,
        activation: Callable[[jax.Array], jax.Array] = jax.nn.relu,
        layer_norm_eps: float = 1e-5,
        gamma_init: float = 1.0,
        mode: str = "mixture",
        use_bias: bool = True,
        implementation: str | None = None,
        block_sizes: BlockSizes | None = None,
        sequence_parallel: SequenceParallel | None = None,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        keep_rngs: bool = True,
        rngs: nnx.Rngs,
    ):
        dropout = check_dropout(dropout)
        dim_feedforward = V.static_int(dim_feedforward, "dim_feedforward")
        if dim_feedforward <= 0:
            raise ValueError(f"dim_feedforward must be positive, got {dim_feedforward}")
        common = dict(layer_norm_eps=layer_norm_eps, dtype=dtype, param_dtype=param_dtype,
                      keep_rngs=keep_rngs, rngs=rngs)
        self.norm1 = nnx.LayerNorm(d_model, epsilon=layer_norm_eps, dtype=dtype,
                                   param_dtype=param_dtype, rngs=rngs)
        self.self_attn = MultiheadDilatedAttention(
            d_model, num_heads, segment_lengths, dilation_rates, num_kv_heads=num_kv_heads,
            dropout=dropout, use_bias=use_bias, layer_norm=True, gamma_init=gamma_init, mode=mode,
            implementation=implementation, block_sizes=block_sizes,
            sequence_parallel=sequence_parallel, **common,
        )
        self.norm2 = nnx.LayerNorm(d_model, epsilon=layer_norm_eps, dtype=dtype,
                                   param_dtype=param_dtype, rngs=rngs)
        self.ffn = _FeedForward(d_model, dim_feedforward, activation=activation, dropout=dropout,
                                gamma_init=gamma_init, use_bias=use_bias, **common)
        self.dropout = nnx.Dropout(dropout, rngs=rngs if keep_rngs and dropout > 0 else None)

    def __call__(
        self,
        x: jax.Array,
        *,
        is_causal: bool = False,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | None = None,
    ) -> jax.Array:
        kw = dict(deterministic=deterministic, rngs=rngs)
        x = x + self.dropout(self.self_attn(self.norm1(x), is_causal=is_causal, **kw), **kw)
        return x + self.dropout(self.ffn(self.norm2(x), **kw), **kw)


class DilatedTransformerDecoderLayer(nnx.Module):
    """MAGNETO decoder layer with dilated self- and cross-attention.

    ``x = x + dropout(self_attn(LN(x)))``; ``x = x + dropout(cross_attn(LN(x), memory))``;
    ``x = x + dropout(ffn(LN(x)))``. The self-attention has the sub-LayerNorm, the
    cross-attention does not (as in MAGNETO). ``memory`` must have the same sequence length as
    ``x`` (dilated attention pairs query and key positions). With ``cross_attention=False`` the
    layer has no cross-attention block (decoder-only models).

    Arguments as in :class:`DilatedTransformerEncoderLayer`.

    ``__call__(x, memory=None, *, is_causal=False, memory_is_causal=False) -> (b, n, d_model)``.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        segment_lengths: tuple[int, ...] | list[int],
        dilation_rates: tuple[int, ...] | list[int],
        *,
        dim_feedforward: int = 2048,
        num_kv_heads: int | None = None,
        dropout: float = 0.0,
        activation: Callable[[jax.Array], jax.Array] = jax.nn.relu,
        layer_norm_eps: float = 1e-5,
        gamma_init: float = 1.0,
        cross_attention: bool = True,
        mode: str = "mixture",
        use_bias: bool = True,
        implementation: str | None = None,
        block_sizes: BlockSizes | None = None,
        sequence_parallel: SequenceParallel | None = None,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        keep_rngs: bool = True,
        rngs: nnx.Rngs,
    ):
        dropout = check_dropout(dropout)
        dim_feedforward = V.static_int(dim_feedforward, "dim_feedforward")
        if dim_feedforward <= 0:
            raise ValueError(f"dim_feedforward must be positive, got {dim_feedforward}")
        self.cross_attention = V.check_bool(cross_attention, "cross_attention")
        common = dict(layer_norm_eps=layer_norm_eps, dtype=dtype, param_dtype=param_dtype,
                      keep_rngs=keep_rngs, rngs=rngs)
        attn = dict(num_kv_heads=num_kv_heads, dropout=dropout, use_bias=use_bias,
                    gamma_init=gamma_init, mode=mode, implementation=implementation,
                    block_sizes=block_sizes, sequence_parallel=sequence_parallel, **common)

        def norm():
            return nnx.LayerNorm(d_model, epsilon=layer_norm_eps, dtype=dtype,
                                 param_dtype=param_dtype, rngs=rngs)

        self.norm1 = norm()
        self.self_attn = MultiheadDilatedAttention(
            d_model, num_heads, segment_lengths, dilation_rates, layer_norm=True, **attn)
        if self.cross_attention:
            self.norm2 = norm()
            self.cross_attn = MultiheadDilatedAttention(
                d_model, num_heads, segment_lengths, dilation_rates, layer_norm=False, **attn)
        else:
            self.norm2 = nnx.data(None)
            self.cross_attn = nnx.data(None)
        self.norm3 = norm()
        self.ffn = _FeedForward(d_model, dim_feedforward, activation=activation, dropout=dropout,
                                gamma_init=gamma_init, use_bias=use_bias, **common)
        self.dropout = nnx.Dropout(dropout, rngs=rngs if keep_rngs and dropout > 0 else None)

    def __call__(
        self,
        x: jax.Array,
        memory: jax.Array | None = None,
        *,
        is_causal: bool = False,
        memory_is_causal: bool = False,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | None = None,
    ) -> jax.Array:
        kw = dict(deterministic=deterministic, rngs=rngs)
        x = x + self.dropout(self.self_attn(self.norm1(x), is_causal=is_causal, **kw), **kw)
        if self.cross_attn is not None:
            if memory is None:
                raise ValueError("memory must be given to a decoder layer with cross_attention")
            y = self.cross_attn(self.norm2(x), memory, is_causal=memory_is_causal, **kw)
            x = x + self.dropout(y, **kw)
        elif memory is not None:
            raise ValueError("memory was given to a decoder layer built with "
                             "cross_attention=False")
        return x + self.dropout(self.ffn(self.norm3(x), **kw), **kw)


class LongNet(nnx.Module):
    """LongNet encoder–decoder (defaults: the paper's base model, Sec. 4.1).

    The encoder reads ``x``; the decoder reads ``x`` as its target and attends the encoder
    output (both causal by default, so the whole model is a valid language model, as in
    dilated-attention-pytorch). ``num_encoder_layers=0`` gives a decoder-only model (decoder
    layers without cross-attention, MAGNETO decoder-only gain), ``num_decoder_layers=0`` an
    encoder-only one. MAGNETO gains come from :func:`magneto_gammas`.

    Args:
      d_model, num_heads, num_encoder_layers, num_decoder_layers, dim_feedforward: sizes
        (paper: 768, 12, 12, 12, 3072).
      segment_lengths, dilation_rates: dilated branches (paper segment lengths; see
        ``DEFAULT_DILATION_RATES`` for the rates).
      remat: activation checkpointing (``nnx.remat``) around every layer.
      dtype: compute dtype (e.g. ``jnp.bfloat16``); ``param_dtype`` stays float32 by default.
      Others: as in :class:`DilatedTransformerEncoderLayer`.

    ``__call__(x (b, n, d_model), *, is_causal=True) -> (b, n, d_model)``.
    """

    def __init__(
        self,
        d_model: int = 768,
        num_heads: int = 12,
        num_encoder_layers: int = 12,
        num_decoder_layers: int = 12,
        dim_feedforward: int = 3072,
        segment_lengths: tuple[int, ...] | list[int] = PAPER_SEGMENT_LENGTHS,
        dilation_rates: tuple[int, ...] | list[int] = DEFAULT_DILATION_RATES,
        *,
        num_kv_heads: int | None = None,
        dropout: float = 0.0,
        activation: Callable[[jax.Array], jax.Array] = jax.nn.relu,
        layer_norm_eps: float = 1e-5,
        mode: str = "mixture",
        use_bias: bool = True,
        remat: bool = False,
        implementation: str | None = None,
        block_sizes: BlockSizes | None = None,
        sequence_parallel: SequenceParallel | None = None,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        keep_rngs: bool = True,
        rngs: nnx.Rngs,
    ):
        n_enc = V.static_int(num_encoder_layers, "num_encoder_layers")
        n_dec = V.static_int(num_decoder_layers, "num_decoder_layers")
        if n_enc < 0 or n_dec < 0 or n_enc + n_dec == 0:
            raise ValueError(
                "num_encoder_layers and num_decoder_layers must be >= 0 and not both 0, got "
                f"num_encoder_layers={n_enc}, num_decoder_layers={n_dec}"
            )
        self.remat = V.check_bool(remat, "remat")
        self.d_model = V.static_int(d_model, "d_model")
        self.encoder_gamma, self.decoder_gamma = magneto_gammas(n_enc, n_dec)
        layer_kw = dict(
            dim_feedforward=dim_feedforward, num_kv_heads=num_kv_heads, dropout=dropout,
            activation=activation, layer_norm_eps=layer_norm_eps, mode=mode, use_bias=use_bias,
            implementation=implementation, block_sizes=block_sizes,
            sequence_parallel=sequence_parallel, dtype=dtype, param_dtype=param_dtype,
            keep_rngs=keep_rngs, rngs=rngs,
        )
        args = (d_model, num_heads, segment_lengths, dilation_rates)
        self.encoder = nnx.List([
            DilatedTransformerEncoderLayer(*args, gamma_init=self.encoder_gamma, **layer_kw)
            for _ in range(n_enc)
        ])
        self.decoder = nnx.List([
            DilatedTransformerDecoderLayer(*args, gamma_init=self.decoder_gamma,
                                           cross_attention=n_enc > 0, **layer_kw)
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
    ) -> jax.Array:
        is_causal = V.check_bool(is_causal, "is_causal")
        tgt = x
        for layer in self.encoder:
            x = self._layer(layer, x, None, rngs, is_causal=is_causal,
                            deterministic=deterministic)
        if len(self.decoder) == 0:
            return x
        memory = x if len(self.encoder) else None
        for layer in self.decoder:
            kw = dict(is_causal=is_causal, deterministic=deterministic)
            if memory is not None:
                kw["memory_is_causal"] = is_causal
            tgt = self._layer(layer, tgt, memory, rngs, **kw)
        return tgt


class LongNetLM(nnx.Module):
    """Language model: token embedding + XPOS, :class:`LongNet`, final LayerNorm, LM head.

    As in dilated-attention-pytorch, positions enter as ``e + xpos(e)`` on the token
    embeddings ``e`` (embedding init N(0, 1)); the head is Xavier-normal with zero bias.

    Args:
      num_tokens: vocabulary size.
      d_model: width (even, for XPOS). Everything else as in :class:`LongNet`.

    ``__call__(tokens (b, n) int, *, is_causal=True) -> logits (b, n, num_tokens)`` in the
    compute dtype.
    """

    def __init__(
        self,
        num_tokens: int,
        d_model: int = 768,
        num_heads: int = 12,
        num_encoder_layers: int = 12,
        num_decoder_layers: int = 12,
        dim_feedforward: int = 3072,
        segment_lengths: tuple[int, ...] | list[int] = PAPER_SEGMENT_LENGTHS,
        dilation_rates: tuple[int, ...] | list[int] = DEFAULT_DILATION_RATES,
        *,
        num_kv_heads: int | None = None,
        dropout: float = 0.0,
        activation: Callable[[jax.Array], jax.Array] = jax.nn.relu,
        layer_norm_eps: float = 1e-5,
        mode: str = "mixture",
        use_bias: bool = True,
        remat: bool = False,
        xpos_scale_base: float = 512.0,
        implementation: str | None = None,
        block_sizes: BlockSizes | None = None,
        sequence_parallel: SequenceParallel | None = None,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        keep_rngs: bool = True,
        rngs: nnx.Rngs,
    ):
        num_tokens = V.static_int(num_tokens, "num_tokens")
        if num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {num_tokens}")
        if V.static_int(d_model, "d_model") % 2:
            raise ValueError(f"d_model must be even (XPOS rotates feature pairs), got {d_model}")
        self.num_tokens = num_tokens
        self.token_embedding = nnx.Embed(
            num_tokens, d_model, embedding_init=jax.nn.initializers.normal(1.0), dtype=dtype,
            param_dtype=param_dtype, rngs=rngs,
        )
        self.pos_embedding = XPOS(xpos_scale_base)
        self.long_net = LongNet(
            d_model, num_heads, num_encoder_layers, num_decoder_layers, dim_feedforward,
            segment_lengths, dilation_rates, num_kv_heads=num_kv_heads, dropout=dropout,
            activation=activation, layer_norm_eps=layer_norm_eps, mode=mode, use_bias=use_bias,
            remat=remat, implementation=implementation, block_sizes=block_sizes,
            sequence_parallel=sequence_parallel, dtype=dtype, param_dtype=param_dtype,
            keep_rngs=keep_rngs, rngs=rngs,
        )
        self.norm = nnx.LayerNorm(d_model, epsilon=layer_norm_eps, dtype=dtype,
                                  param_dtype=param_dtype, rngs=rngs)
        self.out = linear_factory(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                                  rngs=rngs)(d_model, num_tokens, 1.0)

    def __call__(
        self,
        tokens: jax.Array,
        *,
        is_causal: bool = True,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | None = None,
    ) -> jax.Array:
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(
                f"tokens must be an integer array of shape (batch, seq_len), got "
                f"{tokens.dtype}{tuple(tokens.shape)}"
            )
        x = self.token_embedding(tokens)
        x = x + self.pos_embedding(x)
        x = self.long_net(x, is_causal=is_causal, deterministic=deterministic, rngs=rngs)
        return self.out(self.norm(x))
