"""Dilated (LongNet) attention with the Pallas flash kernel as the per-branch core.

Reuses :mod:`dilax.dilated` unchanged: the static branch plans, the segment-major layout
(reshapes and static strided slices only, no gathers) and the float32 LSE merge of branches.
Only the core call differs: :func:`pallas_kernels.flash_attention` instead of
:func:`dilax.core.attention_core`, through the ``attention_fn`` hook of
:func:`dilax.dilated.dilated_attention_xla`. Each branch is one kernel launch over all of its
segments (folded into the batch) and heads; ragged last segments are masked with ``kv_len``.
"""

from __future__ import annotations

import functools

import jax

from dilax import _validation as V
from dilax.core import BlockSizes
from dilax.dilated import dilated_attention_xla
from pallas_kernels.config import KernelConfig
from pallas_kernels.flash_attention import flash_attention

__all__ = ["dilated_attention_pallas"]


def dilated_attention_pallas(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_lengths: tuple[int, ...] | list[int] | int,
    dilation_rates: tuple[int, ...] | list[int] | int,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    mode: str = "mixture",
    block_sizes: KernelConfig | BlockSizes | None = None,
    interpret: bool = False,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """:func:`dilax.dilated_attention` computed with the Pallas flash-attention kernel.

    Args:
      q: ``(b, n, h, d)``; k, v: ``(b, n, hk, d)`` with ``h % hk == 0``.
      segment_lengths, dilation_rates, is_causal, scale, mode: as in
        :func:`dilax.dilated_attention` (docs/semantics.md).
      block_sizes: kernel tiles/warps/stages (:class:`KernelConfig`), a
        :class:`dilax.BlockSizes`, or ``None`` for per-shape defaults.
      interpret: run the kernels with the Pallas interpreter (CPU).
      return_lse: also return the merged log-sum-exp ``(b, n, h)`` float32.

    Returns:
      ``(b, n, h, d)`` in ``q.dtype`` (and the LSE when ``return_lse``).
    """
    q, k, v = V.check_qkv(q, k, v)
    ws, rs = V.check_branches(segment_lengths, dilation_rates)
    mode = V.check_mode(mode, q.shape[2], len(ws))
    is_causal = V.check_bool(is_causal, "is_causal")
    interpret = V.check_bool(interpret, "interpret")
    scale = V.check_scale(scale, q.shape[3])
    if block_sizes is not None and not isinstance(block_sizes, (KernelConfig, BlockSizes)):
        raise TypeError(
            "block_sizes must be a pallas_kernels.KernelConfig, a dilax.BlockSizes or None, "
            f"got {type(block_sizes).__name__}"
        )
    core = functools.partial(flash_attention, interpret=interpret)
    return dilated_attention_xla(q, k, v, ws, rs, is_causal=is_causal, scale=scale, mode=mode,
                                 block_sizes=block_sizes, return_lse=return_lse,
                                 attention_fn=core)
