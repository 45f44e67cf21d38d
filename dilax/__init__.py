"""dilax: long-context attention for JAX/Flax.

Dilated (LongNet) attention, ring attention across devices and block-sparse attention, all
built on one blockwise online-softmax core. Semantics: docs/semantics.md.
Modules live in :mod:`dilax.nn`, models in :mod:`dilax.models`, training in :mod:`dilax.train`.
``import dilax`` does not import Flax: those subpackages and :func:`create_attention`, which
build Flax modules, are imported on first use (``dilax.nn.MultiheadDilatedAttention`` works
after a plain ``import dilax``).
"""

from dilax import flex, memory, patterns
from dilax._version import __version__  # noqa: F401 - dilax.__version__
from dilax.attention_mask import AttentionMask, document_positions
from dilax.block_sparse.api import block_sparse_attention
from dilax.block_sparse.content_adaptive import content_adaptive_attention
from dilax.block_sparse.ring import ring_block_sparse_attention
from dilax.core import BlockSizes, attention_core, merge_attention_states
from dilax.dilated.api import dilated_attention
from dilax.dilated.decode import KVCache, dilated_attention_decode
from dilax.dilated.ring import ring_dilated_attention
from dilax.dilated.settings import DilatedSettings
from dilax.dropin.attention_fn import attention_fn
from dilax.dropin.dot_product import dot_product_attention
from dilax.flex import create_block_mask, flex_attention
from dilax.registry import describe
from dilax.semantics import dilated_counts
from dilax.sp.config import SequenceParallel

# Submodules that import Flax (or are rarely needed): attributes of dilax on first access.
_LAZY_SUBMODULES = ("compile_cache", "data", "factory", "models", "nn", "sample", "train")


# Old doors, kept working: each warns and names its replacement (one door per op).
_DEPRECATED = {
    "sharded_dilated_attention": ("dilax.dilated.api", "dilated_attention(..., "
                                  "sequence_parallel=dilax.SequenceParallel(mesh, axis))"),
    "sharded_block_sparse_attention": ("dilax.block_sparse.api", "block_sparse_attention(..., "
                                       "sequence_parallel=dilax.SequenceParallel(mesh, axis))"),
}


def _deprecated(name: str):
    import importlib
    import warnings

    module, replacement = _DEPRECATED[name]
    warnings.warn(f"dilax.{name} is deprecated: use dilax.{replacement}", DeprecationWarning,
                  stacklevel=3)
    return getattr(importlib.import_module(module), name)


def __getattr__(name: str):
    # PEP 562: dilax.create_attention (and `from dilax import create_attention`) import the
    # factory, and with it flax.nnx and dilax.nn, only when first asked for.
    if name == "create_attention":
        from dilax.factory import create_attention

        globals()[name] = create_attention
        return create_attention
    if name in _DEPRECATED:
        return _deprecated(name)
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f"dilax.{name}")  # also sets globals()[name]
    raise AttributeError(f"module 'dilax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | {"create_attention", *_LAZY_SUBMODULES})


__all__ = [
    "AttentionMask",
    "BlockSizes",
    "DilatedSettings",
    "KVCache",
    "SequenceParallel",
    "attention_core",
    "attention_fn",
    "block_sparse_attention",
    "content_adaptive_attention",
    "create_attention",
    "create_block_mask",
    "describe",
    "dilated_attention",
    "dilated_attention_decode",
    "dilated_counts",
    "document_positions",
    "dot_product_attention",
    "flex",
    "flex_attention",
    "memory",
    "merge_attention_states",
    "patterns",
    "ring_block_sparse_attention",
    "ring_dilated_attention",
]
