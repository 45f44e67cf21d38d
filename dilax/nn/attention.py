"""Flax NNX attention modules: thin wrappers over :func:`dilax.dilated_attention`.

- :class:`DilatedAttention`: parameter-free, ``(b, n, h, d)`` q/k/v in, ``(b, n, h, d)`` out.
- :class:`MultiheadDilatedAttention`: q/k/v/out projections around it, with the MAGNETO
  sub-LayerNorm before the output projection and MAGNETO/Xavier initialization, as in
  dilated-attention-pytorch's ``MultiheadDilatedAttention``; GQA through ``num_kv_heads``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dilax import _validation as V
from dilax.attention_mask import AttentionMask, take_attention_mask
from dilax.core import BlockSizes
from dilax.dilated.api import dilated_attention
from dilax.dilated.decode import KVCache, dilated_attention_decode
from dilax.dilated.settings import DilatedSettings, settings_from_keywords
from dilax.nn._heads import (
    check_dropout_and_gain,
    check_heads,
    init_projections,
    init_sinks,
    output_projection,
    project_qkv,
    sink_logits,
    xavier_normal,
)
from dilax.sp import SequenceParallel
from dilax.sp.config import check_sequence_parallel

__all__ = ["DilatedAttention", "MultiheadDilatedAttention", "xavier_normal"]

Dtype = Any


class DilatedAttention(nnx.Module):
    """Parameter-free dilated attention over projected heads.

    Args:
      segment_lengths, dilation_rates: the branches ``(w_i, r_i)``, ``w_i % r_i == 0``.
      mode: ``"mixture"`` (LongNet Eq. 10, default) or ``"grouped"``
        (dilated-attention-pytorch after its fix ff80502, not the released 0.2.0;
        docs/migration.md).
      is_causal: default causal flag; ``__call__(..., is_causal=...)`` overrides it.
      scale: logit scale, default ``1 / sqrt(d)``.
      implementation, block_sizes: forwarded to :func:`dilax.dilated_attention`.
      sequence_parallel: a :class:`dilax.SequenceParallel` (mesh and axes) to run as ring
        attention over the devices (:func:`dilax.dilated_attention` with
        ``sequence_parallel``; ``implementation`` None, ``"xla"`` or ``"pallas"``, the
        cores that serve a ring hop); None: one device.
      local_window: optional ``W >= 0`` (``mode="mixture"``): one more branch attending the
        keys ``|p - t| <= W`` (see :func:`dilax.dilated_attention`); with
        ``sequence_parallel`` at most the local chunk length ``n/P`` (``n/(2P)`` zigzag).
      settings: a :class:`dilax.DilatedSettings` instead of the configuration keywords
        (``segment_lengths`` ... ``local_window`` then left out).
      score_mod, mask_mod, logits_soft_cap: static FlexAttention options, forwarded to every
        call of :func:`dilax.dilated_attention` (docs/semantics.md, "Custom scores and
        masks"): ``score_mod(score, b, h, q_idx, kv_idx)``, ``mask_mod(b, h, q_idx,
        kv_idx)`` on row positions, the soft-cap ``cap tanh(s / cap)`` first. They run on the
        XLA core; not with ``sequence_parallel`` or :meth:`decode` yet.

    ``__call__(q, k, v, *, is_causal=None, query_seq_lengths=None,
    key_value_seq_lengths=None, attention_mask=None, segment_ids=None, sinks=None,
    block_mask=None)`` takes ``q (b, n, h, d)``, ``k (b, n, hk, d)``, ``v (b, n, hk, dv)``
    with ``h % hk == 0`` and optional int ``(b,)`` valid lengths
    (padding, as in :func:`dilax.dilated_attention`) or a :class:`dilax.AttentionMask`, and
    optional int ``segment_ids (b, n)`` (packed documents: each maximal run of equal ids is
    computed as a sequence of its own, see :func:`dilax.dilated_attention`), ``sinks``: float
    ``(h,)`` sink logits (:func:`dilax.dilated_attention`'s), ``block_mask``: a
    :class:`dilax.flex.BlockMask` whose ``mask_mod`` is used when the module has none;
    returns ``(b, n, h, dv)`` in ``q.dtype``.
    """

    def __init__(
        self,
        segment_lengths: tuple[int, ...] | list[int] | int | None = None,
        dilation_rates: tuple[int, ...] | list[int] | int | None = None,
        *,
        mode: str = "mixture",
        is_causal: bool = False,
        scale: float | None = None,
        implementation: str | None = None,
        block_sizes: BlockSizes | None = None,
        sequence_parallel: SequenceParallel | None = None,
        local_window: int | None = None,
        settings: DilatedSettings | None = None,
        score_mod: Callable | None = None,
        mask_mod: Callable | None = None,
        logits_soft_cap: float | None = None,
    ):
        self.score_mod, self.mask_mod, self.logits_soft_cap = V.check_flex_options(
            score_mod, mask_mod, logits_soft_cap)
        settings = settings_from_keywords(
            settings, segment_lengths, dilation_rates, mode=mode, is_causal=is_causal,
            scale=scale, implementation=implementation, block_sizes=block_sizes,
            local_window=local_window)
        self.sequence_parallel: SequenceParallel | None = check_sequence_parallel(
            sequence_parallel, settings.implementation, interpret=settings.interpret,
            dilated=True)
        self.settings: DilatedSettings = settings
        self.local_window: int | None = settings.local_window
        self.segment_lengths: tuple[int, ...] = settings.segment_lengths
        self.dilation_rates: tuple[int, ...] = settings.dilation_rates
        self.mode: str = settings.mode
        self.is_causal: bool = settings.is_causal
        self.scale: float | None = settings.scale
        self.implementation: str | None = settings.implementation
        self.block_sizes: BlockSizes | None = settings.block_sizes

    def __call__(
        self, q: jax.Array, k: jax.Array, v: jax.Array, *, is_causal: bool | None = None,
        query_seq_lengths: jax.Array | None = None,
        key_value_seq_lengths: jax.Array | None = None,
        attention_mask: AttentionMask | None = None,
        segment_ids: jax.Array | None = None,
        mask: AttentionMask | None = None,
        sinks: jax.Array | None = None,
        block_mask: Any = None,
    ) -> jax.Array:
        attention_mask = take_attention_mask(attention_mask, mask, "DilatedAttention")
        settings = self.settings
        if is_causal is not None and V.check_bool(is_causal, "is_causal") != settings.is_causal:
            settings = settings.replace(is_causal=is_causal)
        return dilated_attention(
            q, k, v, settings=settings, query_seq_lengths=query_seq_lengths,
            key_value_seq_lengths=key_value_seq_lengths, attention_mask=attention_mask,
            sequence_parallel=self.sequence_parallel, segment_ids=segment_ids,
            score_mod=self.score_mod, mask_mod=self.mask_mod, block_mask=block_mask,
            sinks=sinks, logits_soft_cap=self.logits_soft_cap)

    @property
    def has_flex_options(self) -> bool:
        """Whether a score_mod, mask_mod or soft-cap is set."""
        return (self.score_mod, self.mask_mod, self.logits_soft_cap) != (None,) * 3

    # --- KV-cache decoding -------------------------------------------------------------

    def decode(self, q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache,
               sinks: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """Causal attention of the next ``t`` positions with a KV cache
        (:func:`dilax.dilated_attention_decode` with this module's configuration).

        ``q (b, t, h, d)``, ``k, v (b, t, hk, d)`` -> ``(out (b, t, h, d), cache)``. Runs on
        the core the registry picks for a decode step whatever ``implementation`` is (the
        Pallas decode kernel on GPU, XLA elsewhere; a step reads at most ``w / r`` keys per
        branch); not with ``sequence_parallel``."""
        if self.sequence_parallel is not None:
            raise ValueError("KV-cache decoding runs on one device; this DilatedAttention "
                             "has sequence_parallel set")
        flex = dict(score_mod=self.score_mod, mask_mod=self.mask_mod, sinks=sinks,
                    logits_soft_cap=self.logits_soft_cap)  # mixture mode, XLA (decode's rule)
        return dilated_attention_decode(
            q, k, v, cache, self.segment_lengths, self.dilation_rates, mode=self.mode,
            scale=self.scale, local_window=self.local_window,
            **{n: x for n, x in flex.items() if x is not None})


class MultiheadDilatedAttention(nnx.Module):
    """Multi-head dilated attention with MAGNETO sub-LayerNorm.

    ``y = out_proj(LN(dropout(dilated_attention(q_proj(x_q), k_proj(x_k), v_proj(x_v)))))``
    with heads split as ``(b, n, embed_dim) -> (b, n, h, embed_dim / h)``.

    Args:
      embed_dim: model width ``E``; ``E % num_heads == 0``.
      num_heads: query heads ``h``.
      segment_lengths, dilation_rates: dilated configuration (see :class:`DilatedAttention`).
      num_kv_heads: key/value heads ``hk`` (GQA/MQA); default ``num_heads``;
        ``num_heads % num_kv_heads == 0``. ``k_proj``/``v_proj`` map ``E -> hk * E / h``.
      dropout: dropout rate on the attention output (before the sub-LayerNorm). The blockwise
        core never materializes attention weights, so there is no attention-weight dropout.
      use_bias: biases on the four projections (initialized to zero).
      layer_norm: MAGNETO sub-LayerNorm before ``out_proj`` (the MAGNETO decoder's
        cross-attention has none: pass ``False``).
      layer_norm_eps: LayerNorm epsilon.
      gamma_init: Xavier-normal gain of ``v_proj`` and ``out_proj`` (``q_proj``/``k_proj`` use
        gain 1), MAGNETO's depth-dependent gamma.
      mode, scale, implementation, block_sizes, sequence_parallel, local_window, settings: as
        in :class:`DilatedAttention`.
      score_mod, mask_mod, logits_soft_cap: as in :class:`DilatedAttention`.
      learnable_sinks: one learnable sink logit per query head, ``self.sinks``, an
        ``nnx.Param`` ``(num_heads,)`` in ``param_dtype`` initialized to 0 (one extra logit
        with no value in every softmax denominator, :func:`dilax.dilated_attention`'s
        ``sinks``), in :meth:`decode` too.
      dtype: compute dtype (``None``: from inputs and params); param_dtype: parameter dtype.
      keep_rngs: keep a forked ``dropout`` stream of ``rngs`` for dropout (only if
        ``dropout > 0``); with ``False`` pass ``rngs`` at call time.
      rngs: for parameter initialization.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        segment_lengths: tuple[int, ...] | list[int] | int | None = None,
        dilation_rates: tuple[int, ...] | list[int] | int | None = None,
        *,
        num_kv_heads: int | None = None,
        dropout: float = 0.0,
        use_bias: bool = True,
        layer_norm: bool = True,
        layer_norm_eps: float = 1e-5,
        gamma_init: float = 1.0,
        mode: str = "mixture",
        scale: float | None = None,
        implementation: str | None = None,
        block_sizes: BlockSizes | None = None,
        sequence_parallel: SequenceParallel | None = None,
        local_window: int | None = None,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        keep_rngs: bool = True,
        settings: DilatedSettings | None = None,
        score_mod: Callable | None = None,
        mask_mod: Callable | None = None,
        logits_soft_cap: float | None = None,
        learnable_sinks: bool = False,
        rngs: nnx.Rngs,
    ):
        embed_dim, num_heads, num_kv_heads = check_heads(embed_dim, num_heads, num_kv_heads)
        dropout, gain = check_dropout_and_gain(dropout, gamma_init)
        finish = init_projections(self, embed_dim, num_heads, num_kv_heads, gain,
                                  use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                                  rngs=rngs)
        self.attention = DilatedAttention(segment_lengths, dilation_rates, mode=mode, scale=scale,
                                          implementation=implementation, block_sizes=block_sizes,
                                          sequence_parallel=sequence_parallel,
                                          local_window=local_window, settings=settings,
                                          score_mod=score_mod, mask_mod=mask_mod,
                                          logits_soft_cap=logits_soft_cap)
        self.sinks = init_sinks(learnable_sinks, num_heads, param_dtype)
        self.dropout = nnx.Dropout(dropout, rngs=rngs if keep_rngs and dropout > 0 else None)
        finish(layer_norm, layer_norm_eps)

    def __call__(
        self,
        query: jax.Array,
        key: jax.Array | None = None,
        value: jax.Array | None = None,
        *,
        is_causal: bool = False,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | None = None,
        query_seq_lengths: jax.Array | None = None,
        key_value_seq_lengths: jax.Array | None = None,
        attention_mask: AttentionMask | None = None,
        segment_ids: jax.Array | None = None,
        mask: AttentionMask | None = None,
    ) -> jax.Array:
        """``query (b, n, E)``, ``key``/``value (b, n, E)`` (default: ``query``, and ``value``
        defaults to ``key``) -> ``(b, n, E)``. ``query_seq_lengths``,
        ``key_value_seq_lengths``: optional int ``(b,)`` (padding; see
        :func:`dilax.dilated_attention`): the attention output is 0 on query rows past their
        length (the output projection's bias still applies there). ``attention_mask``: a
        :class:`dilax.AttentionMask` instead of the lengths (``mask=``: its deprecated
        spelling; in Flax ``mask=`` is a dense boolean array). ``segment_ids``: optional int
        ``(b, n)``, packed documents (no query attends a key of another document; see
        :func:`dilax.dilated_attention`)."""
        q, k, v = project_qkv(self, query, key, value)
        # False (the default) leaves the flag of the module's settings as it is
        causal = None if is_causal is False else is_causal
        x = self.attention(q, k, v, is_causal=causal, query_seq_lengths=query_seq_lengths,
                           key_value_seq_lengths=key_value_seq_lengths,
                           attention_mask=take_attention_mask(
                               attention_mask, mask, "MultiheadDilatedAttention"),
                           segment_ids=segment_ids,
                           sinks=sink_logits(self)).reshape(query.shape)
        return output_projection(self, self.dropout(x, deterministic=deterministic, rngs=rngs))

    # --- KV-cache decoding -------------------------------------------------------------

    def init_cache(self, batch: int, max_len: int, dtype: Dtype | None = None) -> KVCache:
        """An empty :class:`dilax.KVCache` for :meth:`decode`: ``(batch, max_len,
        num_kv_heads, head_dim)`` in ``dtype`` (default: the dtype of the projected keys,
        i.e. the compute ``dtype`` or else ``param_dtype``)."""
        if dtype is None:
            dtype = self.k_proj.dtype if self.k_proj.dtype is not None \
                else self.k_proj.param_dtype
        return KVCache.init(batch, max_len, self.num_kv_heads, self.head_dim, dtype)

    def decode(
        self,
        query: jax.Array,
        cache: KVCache,
        key: jax.Array | None = None,
        value: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """Causal attention of the next ``t`` positions with a KV cache (inference: no
        dropout).

        ``query (b, t, E)`` (and ``key``/``value (b, t, E)`` at the same positions, default
        ``query``) -> ``(y (b, t, E), cache)``: ``y`` equals the rows of
        ``self(query_all, key_all, value_all, is_causal=True)`` at those positions, where
        ``*_all`` is everything written to ``cache`` so far. See
        :func:`dilax.dilated_attention_decode` (cost, in-place update under ``jax.jit``)."""
        q, k, v = project_qkv(self, query, key, value)
        out, cache = self.attention.decode(q, k, v, cache, sinks=sink_logits(self))
        return output_projection(self, out.reshape(query.shape)), cache
