"""Flax NNX modules over the functional ops (thin wrappers; no attention math here)."""

from dilax.nn.attention import DilatedAttention, MultiheadDilatedAttention, xavier_normal

__all__ = ["DilatedAttention", "MultiheadDilatedAttention", "xavier_normal"]
