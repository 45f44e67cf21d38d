"""Flax NNX modules over the functional ops (thin wrappers; no attention math here)."""

from dilax.nn.attention import DilatedAttention, MultiheadDilatedAttention, xavier_normal
from dilax.nn.block_sparse import BlockSparseAttention, BlockSparseMultiheadAttention

__all__ = [
    "BlockSparseAttention",
    "BlockSparseMultiheadAttention",
    "DilatedAttention",
    "MultiheadDilatedAttention",
    "xavier_normal",
]
