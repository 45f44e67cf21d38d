"""Pallas kernels for the GPU hot path of dilax (Triton lowering; ``interpret=True`` on CPU).

Each kernel sits beside its XLA reference, in the style of ``jax.experimental.pallas.ops``:

* :func:`flash_attention` (reference :func:`dilax.core.attention_core`): forward + backward,
  LSE, causal block skipping, GQA through the index map.
* :func:`block_sparse_flash_attention` (reference :func:`block_sparse_reference`): driven by
  compact per-query-block tables of active key blocks.
* :func:`dilated_attention_pallas`: :func:`dilax.dilated_attention` on the flash kernel.
* :class:`KernelConfig` / :func:`default_config`: static tiles, warps, stages;
  ``pallas_kernels.autotune.autotune`` picks one on the running device.

Nothing GPU-only is imported at module import time.
"""

from pallas_kernels.block_sparse import (
    block_sparse_flash_attention,
    block_sparse_reference,
    tables_from_block_mask,
    transpose_block_tables,
)
from pallas_kernels.config import KernelConfig, default_config
from pallas_kernels.dilated import dilated_attention_pallas
from pallas_kernels.flash_attention import flash_attention, flash_attention_reference

__all__ = [
    "KernelConfig",
    "block_sparse_flash_attention",
    "block_sparse_reference",
    "default_config",
    "dilated_attention_pallas",
    "flash_attention",
    "flash_attention_reference",
    "tables_from_block_mask",
    "transpose_block_tables",
]
