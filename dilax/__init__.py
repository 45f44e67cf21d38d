"""dilax: long-context attention for JAX/Flax.

Dilated (LongNet) attention, ring attention across devices and block-sparse attention, all
built on one blockwise online-softmax core. Semantics: docs/semantics.md.
Modules live in :mod:`dilax.nn`, models in :mod:`dilax.models` (import them explicitly).
``import dilax`` does not import Flax: :func:`create_attention`, which builds Flax modules, is
imported on first use.
"""

from dilax import memory, patterns
from dilax.attention_fn import attention_fn
from dilax.backend import describe
from dilax.block_sparse import block_sparse_attention
from dilax.content_adaptive import content_adaptive_attention
from dilax.core import BlockSizes, attention_core, merge_attention_states
from dilax.decode import KVCache, dilated_attention_decode
from dilax.dilated import dilated_attention
from dilax.dot_product import dot_product_attention
from dilax.reference import dilated_counts
from dilax.sp import (
    SequenceParallel,
    ring_block_sparse_attention,
    ring_dilated_attention,
    sharded_block_sparse_attention,
    sharded_dilated_attention,
)

__version__ = "0.1.0"


def __getattr__(name: str):
    # PEP 562: dilax.create_attention (and `from dilax import create_attention`) import the
    # factory, and with it flax.nnx and dilax.nn, only when first asked for.
    if name == "create_attention":
        from dilax.factory import create_attention

        globals()[name] = create_attention
        return create_attention
    raise AttributeError(f"module 'dilax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | {"create_attention"})


__all__ = [
    "BlockSizes",
    "KVCache",
    "SequenceParallel",
    "attention_core",
    "attention_fn",
    "block_sparse_attention",
    "content_adaptive_attention",
    "create_attention",
    "describe",
    "dilated_attention",
    "dilated_attention_decode",
    "dilated_counts",
    "dot_product_attention",
    "memory",
    "merge_attention_states",
    "patterns",
    "ring_block_sparse_attention",
    "ring_dilated_attention",
    "sharded_block_sparse_attention",
    "sharded_dilated_attention",
]
