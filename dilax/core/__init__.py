"""The one attention core: blockwise, online softmax, float32 statistics, returns LSE.

Dilated, block-sparse and ring attention all reduce to calls of one :class:`Core`
(:mod:`dilax.core.interface`) plus :func:`merge_attention_states`:

* :mod:`~dilax.core.blocks`: :class:`BlockSizes`, the tile config of every implementation;
* :mod:`~dilax.core.mask`: :class:`Mask`, the general form: :class:`KeyBounds` (each
  row's key interval: causality, window, lengths, offsets, ranges), :class:`PairArrays`
  (key padding, dense bias / mask), the mods and a :class:`RowLayout`;
* :mod:`~dilax.core.mods`: :class:`~dilax.core.mods.Mods`, the score/mask mods hook
  (FlexAttention's ``score_mod``/``mask_mod``, soft-cap, block tables) on each block;
* :mod:`~dilax.core.pairwise`: dense ``(B, N, T, S)`` biases and masks, read by block;
* :mod:`~dilax.core.view`: :class:`SlotView`, which rows/slots/heads a call reads;
* :mod:`~dilax.core.xla`: the blockwise XLA forward and backward;
* :mod:`~dilax.core.interface`: :class:`XlaCore`, :class:`PallasCore`, :class:`CudnnCore`,
  :func:`core_for`, and :func:`attention`, one differentiable call;
* :mod:`~dilax.core.merge` and :mod:`~dilax.core.ordering`: merging partial softmax results,
  ordering work in XLA's schedule.
"""

from dilax.core.blocks import BlockSizes, default_block_sizes
from dilax.core.interface import (
    XLA,
    Core,
    CudnnCore,
    PallasCore,
    XlaCore,
    attention,
    attention_core,
    core_for,
    output_delta,
    pallas_config,
)
from dilax.core.mask import KeyBounds, Mask, PairArrays, RowLayout
from dilax.core.merge import merge_attention_states
from dilax.core.ordering import fence_after, when
from dilax.core.view import SlotView, identity_view, static_take

__all__ = [
    "XLA",
    "BlockSizes",
    "Core",
    "CudnnCore",
    "KeyBounds",
    "Mask",
    "PairArrays",
    "PallasCore",
    "RowLayout",
    "SlotView",
    "XlaCore",
    "attention",
    "attention_core",
    "core_for",
    "default_block_sizes",
    "fence_after",
    "identity_view",
    "merge_attention_states",
    "output_delta",
    "pallas_config",
    "static_take",
    "when",
]
