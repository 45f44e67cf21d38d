"""LongNet models built from :mod:`dilax.nn`."""

from dilax.models.config import (
    DEFAULT_DILATION_RATES,
    PAPER_SEGMENT_LENGTHS,
    LongNetConfig,
    LongNetOptions,
)
from dilax.models.generate import generate
from dilax.models.longnet import (
    XPOS,
    DilatedTransformerDecoderLayer,
    DilatedTransformerEncoderLayer,
    LongNet,
    LongNetCache,
    LongNetLM,
    magneto_gammas,
    rotary_qk,
    xpos,
)
from dilax.models.tokens import check_token_ids

__all__ = [
    "DEFAULT_DILATION_RATES",
    "PAPER_SEGMENT_LENGTHS",
    "XPOS",
    "DilatedTransformerDecoderLayer",
    "DilatedTransformerEncoderLayer",
    "LongNet",
    "LongNetCache",
    "LongNetConfig",
    "LongNetLM",
    "LongNetOptions",
    "check_token_ids",
    "generate",
    "magneto_gammas",
    "rotary_qk",
    "xpos",
]
