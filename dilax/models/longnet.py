"""LongNet (Ding et al. 2023) in Flax NNX: MAGNETO transformer layers over dilated attention.

The stacks (:class:`LongNet`), the language model (:class:`LongNetLM`) and its decoding state
(:class:`LongNetCache`). The layers and their MAGNETO gains are in :mod:`dilax.models.layers`,
the rotary positions in :mod:`dilax.models.positions` (both re-exported here).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
from flax import nnx

from dilax import _validation as V
from dilax.attention_mask import check_segment_ids, document_positions
from dilax.dilated.decode import KVCache
from dilax.models.config import (
    DEFAULT_DILATION_RATES,
    PAPER_SEGMENT_LENGTHS,
    Branches,
    LongNetConfig,
    LongNetOptions,
    resolve_config,
)
from dilax.models.layers import (
    DilatedTransformerDecoderLayer,
    DilatedTransformerEncoderLayer,
    magneto_gammas,
    norm_layer,
)
from dilax.models.positions import XPOS, check_positions, rotary_qk, xpos
from dilax.models.tokens import check_token_ids
from dilax.nn._heads import linear_factory

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["DEFAULT_DILATION_RATES", "PAPER_SEGMENT_LENGTHS", "XPOS",
           "DilatedTransformerDecoderLayer", "DilatedTransformerEncoderLayer", "LongNet",
           "LongNetCache", "LongNetConfig", "LongNetLM", "LongNetOptions", "magneto_gammas",
           "rotary_qk", "xpos"]




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

    ``__call__(x (b, n, d_model), *, is_causal=True, seq_lengths=None, positions=None,
    segment_ids=None) -> (b, n, d_model)``; ``seq_lengths``: optional int ``(b,)`` valid
    tokens per row (padding at the end): every attention uses it as query and key-value
    lengths (as in :func:`dilax.dilated_attention`), so the valid prefix equals the unpadded
    sequence's result; rows past it are finite values to be ignored (mask them out of the
    loss). ``positions``: optional int ``(b, n)`` token positions for the self-attentions'
    rotary code (``config.position_scheme``; default ``0 .. n - 1``). ``segment_ids``:
    optional int ``(b, n)``, packed documents (docs/semantics.md, "Packed documents"): a
    maximal run of equal ids is a document, no attention crosses documents and the positions
    restart at 0 at each (:func:`dilax.document_positions`, unless ``positions``
    are given), so every document's rows equal the model applied to that document alone.
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
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        is_causal = V.check_bool(is_causal, "is_causal")
        tgt = x
        extra = {} if seq_lengths is None else dict(seq_lengths=seq_lengths)
        if segment_ids is not None:  # positions restart at each document unless given
            extra["segment_ids"] = check_segment_ids(segment_ids, *x.shape[:2])
            if positions is None:
                positions = document_positions(extra["segment_ids"])
        if positions is not None:
            extra["positions"] = check_positions(positions, *x.shape[:2])
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

    def decode(self, x: jax.Array, caches: tuple,
               positions: jax.Array | None = None) -> tuple[jax.Array, tuple]:
        """The next ``t`` positions ``x (b, t, d_model)`` of the causal model
        (``is_causal=True``) with the caches of :meth:`init_cache`: returns the rows of
        ``self(x_all)`` at those positions and the updated caches (inference: no dropout).
        ``positions`` (int ``(b, t)``) default to the cache lengths plus ``0 .. t - 1``."""
        n_enc = len(self.encoder)
        enc, dec = list(caches[:n_enc]), list(caches[n_enc:])
        tgt = x
        for i, layer in enumerate(self.encoder):
            x, enc[i] = layer.decode(x, enc[i], positions)
        if len(self.decoder) == 0:
            return x, tuple(enc)
        memory = x if n_enc else None
        for i, layer in enumerate(self.decoder):
            tgt, dec[i] = layer.decode(tgt, dec[i], memory, positions)
        return tgt, tuple(enc) + tuple(dec)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LongNetCache:
    """Decoding state of a :class:`LongNetLM` (a pytree): the KV caches of every attention
    (:meth:`LongNet.init_cache`); the positions of the next tokens are the cache lengths."""

    layers: tuple

    def _caches(self) -> list[KVCache]:
        return jax.tree.leaves(self.layers, is_leaf=lambda x: isinstance(x, KVCache))

    @property
    def lengths(self) -> jax.Array:
        """``(b,)`` int32: positions written per row."""
        return self._caches()[0].lengths

    @property
    def max_len(self) -> int:
        """Positions the cache holds."""
        return self._caches()[0].max_len

    def with_lengths(self, lengths: jax.Array) -> LongNetCache:
        """Every layer's cache with ``lengths`` (see :meth:`dilax.KVCache.with_lengths`)."""
        layers = jax.tree.map(lambda c: c.with_lengths(lengths) if isinstance(c, KVCache)
                              else c, self.layers, is_leaf=lambda x: isinstance(x, KVCache))
        return dataclasses.replace(self, layers=layers)


class LongNetLM(nnx.Module):
    """Language model: token embedding, :class:`LongNet`, final LayerNorm, LM head.

    Positions enter inside every self-attention, on its queries and keys
    (``config.position_scheme``, default XPOS as in torchscale; :func:`rotary_qk`), at the
    token index from 0: the logits at position ``t`` of the causal model depend on the tokens
    ``<= t`` only, whatever the length of the window. Embedding init N(0, 1); the head is
    Xavier-normal with zero bias.

    Args:
      num_tokens: vocabulary size.
      d_model: width (``d_model / num_heads`` even, for the rotary code).
      xpos_scale_base: replaces ``config.xpos_scale_base`` when given (see
        :class:`LongNetConfig`).

    Everything else as in :class:`LongNet`, e.g.
    ``LongNetLM(256, config=LongNetConfig(64, 4, 128, (16, 32), (1, 2)),
    num_encoder_layers=0, num_decoder_layers=2, rngs=nnx.Rngs(0))``.

    ``__call__(tokens (b, n) int, *, is_causal=True, seq_lengths=None, positions=None,
    segment_ids=None) -> logits (b, n, num_tokens)`` in the compute dtype; ``seq_lengths``:
    optional int ``(b,)`` valid tokens per row (padding at the end, see :class:`LongNet`);
    ``positions``: optional int ``(b, n)`` position of every token (default ``0 .. n - 1``,
    with ``segment_ids`` the position inside each document); ``segment_ids``: optional int
    ``(b, n)``, documents packed in a row (see :class:`LongNet`): each document's logits equal
    those of the document alone. Decoding (:meth:`decode`) is one document per row.
    Token ids outside ``[0, num_tokens)`` raise when concrete and are clipped under ``jit``
    (:func:`dilax.models.check_token_ids`).
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
        xpos_scale_base: float | None = None,
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
        if xpos_scale_base is not None:
            cfg = cfg.replace(xpos_scale_base=xpos_scale_base)
        self.config = cfg
        self.num_tokens = num_tokens
        self.token_embedding = nnx.Embed(
            num_tokens, cfg.d_model, embedding_init=jax.nn.initializers.normal(1.0),
            dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs,
        )
        self.long_net = LongNet(num_encoder_layers=num_encoder_layers,
                                num_decoder_layers=num_decoder_layers, remat=remat,
                                config=cfg, rngs=rngs)
        self.norm = norm_layer(cfg, rngs)
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
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        tokens = check_token_ids(tokens, self.num_tokens)  # ids outside: see tokens.py
        x = self.token_embedding(tokens)
        x = self.long_net(x, is_causal=is_causal, deterministic=deterministic, rngs=rngs,
                          positions=positions, segment_ids=segment_ids,
                          **({} if seq_lengths is None else dict(seq_lengths=seq_lengths)))
        return self.out(self.norm(x))

    # --- KV-cache decoding -------------------------------------------------------------

    def init_cache(self, batch: int, max_len: int) -> LongNetCache:
        """An empty :class:`LongNetCache` for :meth:`decode` (lengths 0) holding up to
        ``max_len`` positions."""
        max_len = V.static_int(max_len, "max_len")
        if max_len <= 0:
            raise ValueError(f"max_len must be positive, got {max_len}")
        return LongNetCache(self.long_net.init_cache(batch, max_len, self.config.dtype))

    def decode(self, tokens: jax.Array, cache: LongNetCache, *,
               positions: jax.Array | None = None) -> tuple[jax.Array, LongNetCache]:
        """Logits of the next ``t`` tokens of every row with a cache (inference: no dropout).

        ``tokens (b, t)`` int are the tokens at positions ``cache.lengths[i] ..
        cache.lengths[i] + t - 1``; returns ``(logits (b, t, num_tokens), cache)``, the
        rows of ``self(all_tokens)`` at those positions. ``t > 1`` is a chunk of prefill.
        ``positions`` (int ``(b, t)``): the positions of the rotary code, default those cache
        indices (pass the ones given to ``self(..., positions=)``). Cost per token does not
        grow with the context (:func:`dilax.dilated_attention_decode`); jit it with the cache
        donated to update it in place, or use :func:`dilax.models.generate`."""
        tokens = check_token_ids(tokens, self.num_tokens)  # ids outside: see tokens.py
        if positions is not None:
            positions = check_positions(positions, *tokens.shape)
        x = self.token_embedding(tokens)
        x, layers = self.long_net.decode(x, cache.layers, positions)
        return self.out(self.norm(x)), dataclasses.replace(cache, layers=layers)
