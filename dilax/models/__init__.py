"""LongNet models built from :mod:`dilax.nn`."""

from dilax.models.longnet import (
    DEFAULT_DILATION_RATES,
    PAPER_SEGMENT_LENGTHS,
    XPOS,
    DilatedTransformerDecoderLayer,
    DilatedTransformerEncoderLayer,
    LongNet,
    LongNetLM,
    magneto_gammas,
    xpos,
)

__all__ = [
    "DEFAULT_DILATION_RATES",
    "PAPER_SEGMENT_LENGTHS",
    "XPOS",
    "DilatedTransformerDecoderLayer",
    "DilatedTransformerEncoderLayer",
    "LongNet",
    "LongNetLM",
    "magneto_gammas",
    "xpos",
]
