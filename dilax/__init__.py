"""dilax: long-context attention for JAX/Flax.

Dilated (LongNet) attention, ring attention across devices and block-sparse attention, all
built on one blockwise online-softmax core. Semantics: docs/semantics.md (SPEC.md).
"""

from dilax.core import BlockSizes, attention_core, merge_attention_states
from dilax.dilated import dilated_attention
from dilax.reference import dilated_counts
from dilax.ring import ring_dilated_attention, sharded_dilated_attention

__version__ = "0.1.0"

__all__ = [
    "BlockSizes",
    "attention_core",
    "dilated_attention",
    "dilated_counts",
    "merge_attention_states",
    "ring_dilated_attention",
    "sharded_dilated_attention",
]
