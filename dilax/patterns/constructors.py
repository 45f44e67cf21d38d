"""Constructors of :class:`~dilax.patterns.BlockSparsePattern` (local window, dilated,
global + local, hierarchical, random, dilated segments, from a mask) and their checks."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

from dilax import _validation as V
from dilax.core.arrays import cdiv
from dilax.patterns.pattern import BlockSparsePattern, from_mask, positive_int
from dilax.semantics import branch_heads

# -- validation helpers -------------------------------------------------------------------


def _non_negative(value: Any, name: str) -> int:
    value = V.static_int(value, name)
    if value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value}")
    return value


def _num_blocks(n: Any, block_size: Any, num_heads: int = 1) -> tuple[int, int, int]:
    n = positive_int(n, "n")
    block_size = positive_int(block_size, "block_size")
    nb = cdiv(n, block_size)
    _check_mask_fits(nb, num_heads, n, block_size)
    return n, block_size, nb


def _check_mask_fits(nb: int, num_heads: int, n: int, block_size: int) -> None:
    """Fails fast when the ``(heads, nb, nb)`` block mask (and a few same-size temporaries)
    cannot be built in memory: the message names ``n`` and ``block_size``."""
    from dilax import memory

    memory.check_fits(
        9 * num_heads * nb * nb,  # the bool mask plus one int64 temporary of the builders
        f"a block pattern for n={n} with block_size={block_size} ({nb} x {nb} blocks"
        f"{f', {num_heads} heads' if num_heads > 1 else ''})",
        hint="use a larger block_size (the mask has (n / block_size)^2 entries)")


def _block_extents(n: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """First and last token of every block (the last block may be partial)."""
    nb = cdiv(n, block_size)
    first = np.arange(nb) * block_size
    last = np.minimum(first + block_size, n) - 1
    return first, last


# -- constructors -------------------------------------------------------------------------


def local_window(n: int, block_size: int, window: int) -> BlockSparsePattern:
    """Block cover of the sliding window ``|p - t| <= window`` (``window`` in tokens).

    ``window=0`` keeps only the diagonal blocks. Blocks ``i`` and ``j`` are active iff the
    closest tokens of the two blocks are at most ``window`` apart, i.e.
    ``|i - j| == 0 or (|i - j| - 1) * block_size + 1 <= window``. With ``is_causal`` the
    attention keeps the left half (``p - window <= t <= p`` at block granularity).
    """
    n, block_size, nb = _num_blocks(n, block_size)
    window = _non_negative(window, "window")
    dist = np.abs(np.arange(nb)[:, None] - np.arange(nb)[None, :])
    mask = (dist == 0) | ((dist - 1) * block_size + 1 <= window)
    return from_mask(mask, block_size)


def dilated(n: int, block_size: int, dilation_rates: Sequence[int] | int) -> BlockSparsePattern:
    """Block-level strided pattern: key block ``j`` is active for query block ``i`` iff
    ``(i - j) % r == 0`` for some ``r`` in ``dilation_rates`` (rates counted in blocks).

    Rate 1 is dense; rate ``r`` alone has density about ``1/r``. Combine with ``&``
    :func:`local_window` to bound the reach, or use :func:`dilated_segments` for the block
    cover of a token-level LongNet configuration.
    """
    n, block_size, nb = _num_blocks(n, block_size)
    rates = V.static_int_tuple(dilation_rates, "dilation_rates")
    if not rates:
        raise ValueError("dilation_rates must hold at least one rate, got an empty sequence")
    for i, r in enumerate(rates):
        if r <= 0:
            raise ValueError(f"dilation_rates[{i}] must be positive, got {r}")
    diff = np.arange(nb)[:, None] - np.arange(nb)[None, :]
    mask = np.zeros((nb, nb), bool)
    for r in rates:
        mask |= diff % r == 0
    return from_mask(mask, block_size)


def local_strided(n: int, block_size: int, window: int, stride: int) -> BlockSparsePattern:
    """Sparse-Transformer-style fixed pattern: :func:`local_window` ``|p - t| <= window``
    (tokens) OR :func:`dilated` with the one rate ``stride`` (key block ``j`` for query block
    ``i`` iff ``(i - j) % stride == 0``, counted in blocks).

    Both parts depend on ``i - j`` only, so the pattern for a shorter ``n`` is the top-left
    corner of the pattern for a longer one (a model built on it runs at any length).
    """
    n, block_size, _ = _num_blocks(n, block_size)
    stride = positive_int(stride, "stride")
    return local_window(n, block_size, window) | dilated(n, block_size, (stride,))


def global_local(n: int, block_size: int, global_tokens: int, window: int) -> BlockSparsePattern:
    """Global tokens plus a sliding window (Longformer / BigBird without random blocks).

    The first ``global_tokens`` tokens are global: they attend to every key and every query
    attends to them. At block granularity the first ``ceil(global_tokens / block_size)``
    query-block rows and key-block columns are active. Every other pair follows
    :func:`local_window` with ``window`` in tokens. ``global_tokens=0`` gives the plain window.
    """
    n, block_size, nb = _num_blocks(n, block_size)
    global_tokens = _non_negative(global_tokens, "global_tokens")
    if global_tokens > n:
        raise ValueError(f"global_tokens must be <= n={n}, got {global_tokens}")
    mask = local_window(n, block_size, window).block_mask[0].copy()
    g = cdiv(global_tokens, block_size)
    mask[:g, :] = True
    mask[:, :g] = True
    return from_mask(mask, block_size)


def hierarchical(n: int, levels: Sequence[tuple[int, int]]) -> BlockSparsePattern:
    """Multi-resolution pattern: dense near the query, sparser and sparser far away.

    ``levels = ((s_0, k_0), (s_1, k_1), ...)``: level ``l`` cuts the sequence into level
    blocks of ``s_l`` tokens; ``s_0`` is the pattern's block size and each ``s_l`` is a
    multiple of ``s_{l-1}`` (strictly increasing). ``k_l >= 0`` counts level-``l`` blocks on
    each side. At level ``l`` a query block (size ``s_0``) whose level block is ``c`` attends
    the *first* ``s_0``-block (the representative) of every level block ``c'`` with
    ``|c - c'| <= k_l``. Level 0 therefore gives a local window of ``k_0`` blocks on each side;
    coarser levels add one representative block per ``s_l`` tokens out to ``k_l * s_l``
    tokens. The pattern is the union over levels.

    Example: ``hierarchical(8192, ((64, 2), (512, 2), (4096, 1)))``: 5 neighbouring 64-blocks,
    every 8th block within 2 x 512 tokens, every 64th within 4096 tokens.
    """
    n = positive_int(n, "n")
    if isinstance(levels, (str, bytes)) or not isinstance(levels, (Sequence, np.ndarray)):
        raise TypeError(f"levels must be a sequence of (block_size, num_neighbors) pairs, "
                        f"got {type(levels).__name__}")
    if len(levels) == 0:
        raise ValueError("levels must hold at least one (block_size, num_neighbors) pair")
    parsed = []
    for i, level in enumerate(levels):
        if isinstance(level, (str, bytes)) or not isinstance(level, (Sequence, np.ndarray)) or (
            len(level) != 2
        ):
            raise ValueError(f"levels[{i}] must be a (block_size, num_neighbors) pair, "
                             f"got {level!r}")
        s = positive_int(level[0], f"levels[{i}][0] (block_size)")
        k = _non_negative(level[1], f"levels[{i}][1] (num_neighbors)")
        if parsed:
            prev = parsed[-1][0]
            if s <= prev or s % prev != 0:
                raise ValueError(
                    f"levels[{i}][0]={s} must be a strictly larger multiple of the previous "
                    f"level's block size {prev}"
                )
        parsed.append((s, k))
    block_size = parsed[0][0]
    nb = cdiv(n, block_size)
    _check_mask_fits(nb, 1, n, block_size)
    blocks = np.arange(nb)
    mask = np.zeros((nb, nb), bool)
    for s, k in parsed:
        ratio = s // block_size
        coarse = blocks // ratio
        representative = blocks % ratio == 0
        near = np.abs(coarse[:, None] - coarse[None, :]) <= k
        mask |= near & representative[None, :]
    return from_mask(mask, block_size)


def random(n: int, block_size: int, density: float, seed: int = 0, *,
           num_heads: int = 1) -> BlockSparsePattern:
    """Uniformly random pattern with exactly ``round(density * nq * nk)`` active blocks per head.

    Args:
      density: in ``[0, 1]``; the fraction of active blocks (before any causal cut).
      seed: numpy ``default_rng`` seed (the pattern is deterministic given the seed).
      num_heads: 1 for a shared mask, or ``h`` for an independent mask per query head.
    """
    n, block_size, nb = _num_blocks(n, block_size)
    seed = _non_negative(seed, "seed")
    num_heads = positive_int(num_heads, "num_heads")
    _check_mask_fits(nb, num_heads, n, block_size)
    if isinstance(density, bool) or not isinstance(density, (numbers.Real, np.floating)):
        raise TypeError(f"density must be a float in [0, 1], got {density!r}")
    density = float(density)
    if not 0.0 <= density <= 1.0:
        raise ValueError(f"density must be in [0, 1], got {density}")
    total = nb * nb
    active = int(round(density * total))
    rng = np.random.default_rng(seed)
    mask = np.zeros((num_heads, total), bool)
    for hd in range(num_heads):
        mask[hd, rng.choice(total, size=active, replace=False)] = True
    return from_mask(mask.reshape(num_heads, nb, nb), block_size)


def dilated_segments(
    n: int,
    block_size: int,
    segment_lengths: Sequence[int] | int,
    dilation_rates: Sequence[int] | int,
    *,
    num_heads: int | None = None,
    mode: str = "mixture",
) -> BlockSparsePattern:
    """Block cover of a dilated (LongNet) configuration (docs/semantics.md, "One branch").

    Block ``(i, j)`` is active iff some query in block ``i`` may attend some key in block ``j``
    in some branch (non-causal; the causal cut is applied by the attention call). Note that
    block-sparse attention then attends *every* token of an active block, so its result is not
    the dilated attention itself, only restricted to the same blocks.

    Args:
      segment_lengths, dilation_rates: the configuration (validated as in
        :func:`dilax.dilated_attention`).
      num_heads: ``None``: one shared mask covering every offset ``0 <= o < r`` of every
        branch. An int ``h``: a per-head mask (head ``j`` uses its offsets of ``mode``).
      mode: ``"mixture"`` or ``"grouped"`` (only used with ``num_heads``).
    """
    n, block_size, nb = _num_blocks(n, block_size)
    ws, rs = V.check_branches(segment_lengths, dilation_rates)
    if num_heads is None:
        head_branches = [[(w, r, o) for w, r in zip(ws, rs, strict=True) for o in range(min(r, n))]]
    else:
        num_heads = positive_int(num_heads, "num_heads")
        _check_mask_fits(nb, num_heads, n, block_size)
        mode = V.check_mode(mode, num_heads, len(ws))
        head_branches = [[] for _ in range(num_heads)]
        for br in branch_heads(num_heads, ws, rs, mode):
            for j, o in zip(br.heads, br.offsets, strict=True):
                head_branches[j].append((br.w, br.r, o))
    mask = np.zeros((len(head_branches), nb, nb), bool)
    for hd, branches in enumerate(head_branches):
        for w, r, o in branches:
            for start in range(0, n, w):
                pos = np.arange(start + o, min(start + w, n), r)
                if pos.size:
                    blk = np.unique(pos // block_size)
                    mask[hd][np.ix_(blk, blk)] = True
    return from_mask(mask, block_size)
