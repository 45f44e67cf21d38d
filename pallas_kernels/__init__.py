"""Pallas kernels for the GPU hot path of dilax (Triton lowering; ``interpret=True`` on CPU).

The kernels sit below the library: this package imports nothing of ``dilax`` (dilax adapts
them to its core interface, :class:`dilax.core.PallasCore`). Each kernel sits beside its
dense XLA reference, in the style of ``jax.experimental.pallas.ops``:

* :func:`flash_attention` (reference :func:`flash_attention_reference`): forward + backward,
  LSE, causal block skipping, GQA through the index map; :func:`flash_forward` and
  :func:`flash_backward` are its two passes on their own.
* :func:`block_sparse_flash_attention` (reference :func:`block_sparse_reference`): driven by
  compact per-query-block tables of active key blocks (:mod:`pallas_kernels.tables`).
* :func:`decode_attention` (reference :func:`decode_reference`): a KV-cache decode step,
  split-K over each query's gathered branch windows (:class:`DecodeBranch`).
* :class:`KernelConfig` / :func:`default_config`: static tiles, warps, stages;
  ``pallas_kernels.autotune.autotune`` picks one on the running device.

Nothing GPU-only is imported at module import time.
"""

from pallas_kernels.block_sparse import block_sparse_flash_attention, block_sparse_reference
from pallas_kernels.config import KernelConfig, default_config
from pallas_kernels.decode import DecodeBranch, DecodeConfig, decode_attention, decode_reference
from pallas_kernels.flash_attention import (
    flash_attention,
    flash_attention_reference,
    flash_backward,
    flash_forward,
)
from pallas_kernels.tables import (
    block_mask_from_tables,
    tables_from_block_mask,
    transpose_block_tables,
)

__all__ = [
    "DecodeBranch",
    "DecodeConfig",
    "KernelConfig",
    "block_mask_from_tables",
    "block_sparse_flash_attention",
    "block_sparse_reference",
    "decode_attention",
    "decode_reference",
    "default_config",
    "flash_attention",
    "flash_attention_reference",
    "flash_backward",
    "flash_forward",
    "tables_from_block_mask",
    "transpose_block_tables",
]
