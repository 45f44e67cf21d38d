"""Flax NNX modules for block-sparse attention (thin wrappers over the functional ops).

With ``sequence_parallel=dilax.SequenceParallel(mesh, ...)`` they run
:func:`dilax.block_sparse_attention` with the sequence split over a mesh axis (its
``sequence_parallel`` argument); parameters and results are the same.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from dilax import _validation as V
from dilax import registry
from dilax.block_sparse.api import block_sparse_attention
from dilax.nn._heads import (
    check_dropout_and_gain,
    check_heads,
    init_projections,
    init_sinks,
    output_projection,
    project_qkv,
    sink_logits,
)
from dilax.patterns import BlockSparsePattern
from dilax.sp import SequenceParallel
from dilax.sp.config import check_sequence_parallel


def _check_pattern_type(pattern) -> BlockSparsePattern:
    if not isinstance(pattern, BlockSparsePattern):
        raise TypeError(
            "pattern must be a dilax.patterns.BlockSparsePattern (e.g. "
            f"dilax.patterns.local_window(...)), got {type(pattern).__name__}"
        )
    return pattern


def _attend(q, k, v, pattern, sp: SequenceParallel | None, *, is_causal, scale=None,
            implementation=None, segment_ids=None, **flex):
    return block_sparse_attention(q, k, v, pattern, is_causal=is_causal, scale=scale,
                                  implementation=implementation, sequence_parallel=sp,
                                  segment_ids=segment_ids, **flex)


class BlockSparseAttention(nnx.Module):
    """Parameter-free block-sparse attention over ``(b, n, h, d)`` q and ``(b, n, hk, d)`` k, v.

    Args:
      pattern: a :class:`dilax.patterns.BlockSparsePattern` (static) with ``ceil(n / B)``
        blocks and 1 or ``h`` heads.
      is_causal: default causal flag (overridable per call).
      implementation: ``None``, ``"xla"``, ``"pallas"`` or ``"reference"`` (see
        :func:`dilax.block_sparse_attention`).
      sequence_parallel: a :class:`dilax.SequenceParallel` (mesh and axes,
        ``layout="contiguous"``) to run as ring block-sparse attention over the devices
        (``dilax.block_sparse_attention(..., sequence_parallel=)``; ``implementation`` None,
        ``"xla"`` or ``"pallas"`` runs its hops); None: one device.
      score_mod, mask_mod, logits_soft_cap: static FlexAttention options forwarded to every
        call (:func:`dilax.block_sparse_attention`'s; row positions, XLA core; not with
        ``sequence_parallel`` yet).

    ``__call__(q, k, v, *, sinks=None)`` returns ``(b, n, h, d)`` in ``q.dtype``; ``sinks``:
    float ``(h,)`` sink logits.

    Raises:
      TypeError: ``pattern`` is not a ``BlockSparsePattern``; non-bool ``is_causal``;
        ``sequence_parallel`` not a ``SequenceParallel``.
      ValueError: unknown ``implementation``, or one that serves no ring hop
        (``"reference"``) with ``sequence_parallel``; a zigzag
        ``sequence_parallel.layout``; at call time, the errors of
        :func:`dilax.block_sparse_attention` (shapes, pattern that does not fit ``n``) or
        ``dilax.block_sparse_attention(..., sequence_parallel=)`` (mesh divisibility).
    """

    def __init__(self, pattern: BlockSparsePattern, *, is_causal: bool = False,
                 implementation: str | None = None,
                 sequence_parallel: SequenceParallel | None = None,
                 score_mod: Callable | None = None, mask_mod: Callable | None = None,
                 logits_soft_cap: float | None = None):
        self.score_mod, self.mask_mod, self.logits_soft_cap = V.check_flex_options(
            score_mod, mask_mod, logits_soft_cap)
        self.pattern = _check_pattern_type(pattern)
        self.is_causal = V.check_bool(is_causal, "is_causal")
        self.implementation = registry.check_name(implementation, "block_sparse")
        self.sequence_parallel = check_sequence_parallel(
            sequence_parallel, self.implementation, layouts=("contiguous",),
            block_size=self.pattern.block_size)

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, *,
                 is_causal: bool | None = None, scale: float | None = None,
                 segment_ids: jax.Array | None = None,
                 sinks: jax.Array | None = None) -> jax.Array:
        """Returns ``(b, n, h, d)`` (see :func:`dilax.block_sparse_attention`; optional
        ``segment_ids (b, n)``: packed documents, the pattern AND same document; ``sinks``
        float ``(h,)``)."""
        return _attend(q, k, v, self.pattern, self.sequence_parallel,
                       is_causal=self.is_causal if is_causal is None else is_causal,
                       scale=scale, implementation=self.implementation,
                       segment_ids=segment_ids, score_mod=self.score_mod,
                       mask_mod=self.mask_mod, logits_soft_cap=self.logits_soft_cap,
                       sinks=sinks)


class BlockSparseMultiheadAttention(nnx.Module):
    """Multi-head block-sparse attention with the MAGNETO sub-LayerNorm.

    Same conventions as ``MultiheadDilatedAttention`` of dilated-attention-pytorch, with a
    block-sparse ``pattern`` instead of segment lengths and dilation rates: q/k/v projections,
    block-sparse attention, an optional LayerNorm on the attention output (``layer_norm``,
    MAGNETO), and the output projection. q and k projections use Xavier-normal init, v and out
    projections Xavier-normal with gain ``gamma_init``; biases start at 0.

    Args:
      embed_dim: model width; must be divisible by ``num_heads``.
      num_heads: query heads ``h``; ``head_dim = embed_dim // num_heads``.
      pattern: block-sparse pattern with 1 or ``num_heads`` heads.
      num_kv_heads: key/value heads (GQA/MQA), default ``num_heads``; must divide it.
      dropout: dropout rate applied to the attention output (before the sub-LayerNorm). The
        exact blockwise core has no attention-probability dropout.
      use_bias: biases in the four projections.
      layer_norm, layer_norm_eps: the MAGNETO sub-LayerNorm before the output projection.
      gamma_init: Xavier gain of the v and out projections.
      sequence_parallel: as in :class:`BlockSparseAttention` (ring block-sparse attention
        over a mesh; projections are left to XLA's sharding propagation under ``jit``).
      dtype, param_dtype: computation and parameter dtypes.
      score_mod, mask_mod, logits_soft_cap: as in :class:`BlockSparseAttention`.
      learnable_sinks: one learnable sink logit per query head, ``self.sinks``, an
        ``nnx.Param`` ``(num_heads,)`` initialized to 0 (as
        :class:`dilax.nn.MultiheadDilatedAttention`'s).
      rngs: ``nnx.Rngs`` (``params``; ``dropout`` when ``dropout > 0``).

    ``__call__(query (b, n, embed_dim), key=None, value=None)`` returns ``(b, n, embed_dim)``.

    Raises:
      ValueError: non-positive sizes, ``embed_dim % num_heads != 0``,
        ``num_heads % num_kv_heads != 0``, a pattern with neither 1 nor ``num_heads`` heads,
        ``dropout`` outside ``[0, 1)``, a zigzag ``sequence_parallel.layout``.
      TypeError: ``pattern`` is not a ``BlockSparsePattern``; non-int sizes;
        ``sequence_parallel`` not a ``SequenceParallel``.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        pattern: BlockSparsePattern,
        *,
        num_kv_heads: int | None = None,
        dropout: float = 0.0,
        use_bias: bool = True,
        layer_norm: bool = True,
        layer_norm_eps: float = 1e-5,
        gamma_init: float = 1.0,
        sequence_parallel: SequenceParallel | None = None,
        dtype=None,
        param_dtype=jnp.float32,
        score_mod: Callable | None = None,
        mask_mod: Callable | None = None,
        logits_soft_cap: float | None = None,
        learnable_sinks: bool = False,
        rngs: nnx.Rngs,
    ):
        embed_dim, num_heads, num_kv_heads = check_heads(embed_dim, num_heads, num_kv_heads)
        pattern = _check_pattern_type(pattern)
        if pattern.num_heads not in (1, num_heads):
            raise ValueError(
                f"pattern has {pattern.num_heads} heads; it must have 1 (shared) or num_heads "
                f"({num_heads})"
            )
        dropout, gain = check_dropout_and_gain(dropout, gamma_init)
        self.sequence_parallel = check_sequence_parallel(sequence_parallel, None,
                                                         layouts=("contiguous",))
        self.pattern = pattern
        self.score_mod, self.mask_mod, self.logits_soft_cap = V.check_flex_options(
            score_mod, mask_mod, logits_soft_cap)
        finish = init_projections(self, embed_dim, num_heads, num_kv_heads, gain,
                                  use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                                  rngs=rngs)
        finish(layer_norm, layer_norm_eps)
        self.dropout = nnx.Dropout(float(dropout), rngs=rngs) if dropout > 0 else None
        self.sinks = init_sinks(learnable_sinks, num_heads, param_dtype)

    def __call__(
        self,
        query: jax.Array,
        key: jax.Array | None = None,
        value: jax.Array | None = None,
        *,
        is_causal: bool = False,
        deterministic: bool | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """``query``, ``key``, ``value``: ``(b, n, embed_dim)`` (key defaults to query, value to
        key); optional ``segment_ids (b, n)`` (packed documents). Returns
        ``(b, n, embed_dim)``."""
        q, k, v = project_qkv(self, query, key, value)
        x = _attend(q, k, v, self.pattern, self.sequence_parallel, is_causal=is_causal,
                    segment_ids=segment_ids, score_mod=self.score_mod, mask_mod=self.mask_mod,
                    logits_soft_cap=self.logits_soft_cap, sinks=sink_logits(self))
        x = x.reshape(query.shape)
        if self.dropout is not None:
            x = self.dropout(x, deterministic=deterministic)
        return output_projection(self, x)
