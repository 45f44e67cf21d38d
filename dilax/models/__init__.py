"""LongNet models built from :mod:`dilax.nn`."""

from dilax.models.config import (
    DEFAULT_DILATION_RATES,
    PAPER_SEGMENT_LENGTHS,
    LongNetConfig,
    LongNetOptions,
)
from dilax.models.longnet import (
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
    "LongNetConfig",
    "LongNetLM",
    "LongNetOptions",
    "magneto_gammas",
    "xpos",
]
