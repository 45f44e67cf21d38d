"""Block-sparse attention patterns: immutable, hashable block masks with compact tables.

A :class:`BlockSparsePattern` is a boolean block mask ``M`` of shape ``(H_pat, nq, nk)`` with
block size ``B`` (docs/semantics.md, "Block-sparse attention"): query ``p`` attends key ``t`` iff
``M[head, p // B, t // B]`` (and ``t <= p`` when causal). ``H_pat`` is 1 (one mask shared by
all heads) or ``h`` (one mask per query head). The pattern is static configuration: it is
hashable, compares by value, and can be closed over or passed as a static argument to
``jax.jit``.

Besides the mask, a pattern exposes compact per-query-block tables of its active key blocks
(in the spirit of splash attention's ``MaskInfo``), which both the XLA path and the Pallas
kernel consume: :meth:`BlockSparsePattern.tables`.

Constructors (all return a shared-mask pattern unless ``num_heads`` is given). Lengths that
describe *token* ranges (``window``, ``global_tokens``, segment lengths) are counted in tokens
and the pattern is their *block cover*: the smallest block mask that contains every (query,
key) pair of the token-level pattern (a block is active iff it holds at least one such pair).
With ``n % block_size != 0`` the last block is partial (``ceil(n / block_size)`` blocks).

- :func:`local_window`: ``|p - t| <= window`` (tokens).
- :func:`dilated`: block-level strides: key block ``j`` for query block ``i`` iff
  ``(i - j) % r == 0`` for some rate ``r`` (counted in blocks).
- :func:`global_local`: the first ``global_tokens`` tokens attend to and are attended by
  everything (Longformer/BigBird style), plus :func:`local_window`.
- :func:`hierarchical`: multi-resolution: dense near, one representative block per coarse
  block far away (see its docstring for ``levels``).
- :func:`local_strided`: :func:`local_window` ``|`` :func:`dilated` with one stride (a
  Sparse-Transformer-style fixed pattern).
- :func:`random`: exactly ``round(density * nq * nk)`` active blocks per head, uniform.
- :func:`from_mask`: any boolean ``(nq, nk)`` or ``(H, nq, nk)`` block mask.
- :func:`dilated_segments`: the block cover of a dilated (LongNet) configuration.
- ``a | b`` and ``a & b`` combine patterns of the same block size and block counts (a shared
  mask broadcasts against a per-head one).

Every constructor returns a :class:`BlockSparsePattern` with ``ceil(n / block_size)`` query and
key blocks and 1 head (or ``num_heads``), and checks its arguments eagerly: ``TypeError`` for a
non-int size, ``ValueError`` (naming the argument) for non-positive sizes, out-of-range values
(``density`` outside ``[0, 1]``, ``global_tokens > n``), malformed ``levels`` or an invalid
dilated configuration. Combining patterns of different block sizes or block counts raises
``ValueError``.
"""

from dilax.patterns.constructors import (
    dilated,
    dilated_segments,
    from_mask,
    global_local,
    hierarchical,
    local_strided,
    local_window,
    random,
)
from dilax.patterns.pattern import BlockSparsePattern, mask_tables

__all__ = [
    "BlockSparsePattern",
    "dilated",
    "dilated_segments",
    "from_mask",
    "global_local",
    "hierarchical",
    "local_strided",
    "local_window",
    "mask_tables",
    "random",
]
