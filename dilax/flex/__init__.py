"""FlexAttention for JAX: your own scores and masks (docs/semantics.md, "Custom scores and
masks (FlexAttention semantics)").

- :mod:`dilax.flex.api`: :func:`flex_attention`, the op (XLA core; ``score_mod``,
  ``mask_mod``, ``block_mask``, ``sinks``, ``logits_soft_cap``, ``dv != d``, GQA).
- :mod:`dilax.flex.block_mask`: :func:`create_block_mask` and :class:`BlockMask`, a
  ``mask_mod`` classified per block pair (empty / partial / full), built once.
- :mod:`dilax.flex.mods`: built-in masks (:func:`causal_mask`, :func:`sliding_window`,
  :func:`document_mask`, :func:`prefix_lm_mask`, :func:`chunked_mask`), combinators
  (:func:`and_masks`, :func:`or_masks`) and scores (:func:`soft_cap`, :func:`alibi`,
  :func:`relative_bias`).
"""

from dilax.flex.api import flex_attention
from dilax.flex.block_mask import BlockMask, create_block_mask
from dilax.flex.mods import (
    alibi,
    and_masks,
    causal_mask,
    chunked_mask,
    document_mask,
    or_masks,
    prefix_lm_mask,
    relative_bias,
    sliding_window,
    soft_cap,
)

__all__ = [
    "BlockMask",
    "alibi",
    "and_masks",
    "causal_mask",
    "chunked_mask",
    "create_block_mask",
    "document_mask",
    "flex_attention",
    "or_masks",
    "prefix_lm_mask",
    "relative_bias",
    "sliding_window",
    "soft_cap",
]
