"""Tile sizes of the attention core: one static, hashable config for every implementation."""

from __future__ import annotations

import dataclasses

_SCORE_BUDGET = 1 << 21  # causal: floats in one (heads, rows, block) score tile, 8 MiB
_FWD_TILE = 1 << 22  # non-causal forward score tile (heads, block_q, block_k): 16 MiB
_FWD_HEADS = 4  # non-causal forward: query heads per step
_BWD_TILE = 1 << 20  # non-causal backward tile: s, p, dp and ds are live at once
_SCORED_BWD = (512, 128)  # causal backward (query, key) blocks when a mod changes the scores


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Block sizes of the blockwise core (static, hashable).

    The forward visits key blocks of ``block_k`` for a row of ``block_q`` queries; the backward
    visits query blocks of ``block_q_dkv`` for a column of ``block_k_dkv`` keys. On CPU the
    iterated block should be short and the row/column long, so that every step is a few
    million multiply-adds that XLA spreads over all cores.

    Fields: ``block_q`` (forward query rows per step), ``block_k`` (forward keys per step),
    ``block_q_dkv`` / ``block_k_dkv`` (backward query / key block; ``None``: ``block_k`` /
    ``block_q``), ``heads_per_step`` (query heads of one forward step; ``None``: all heads; a
    kv head's query heads always stay together). All positive ints; blocks larger than the
    sequence are clipped to it. Use :func:`default_block_sizes` for the per-shape defaults.
    The Pallas kernels take the same object (tiles must then be powers of two; see
    :func:`dilax.core.pallas_config`).
    """

    block_q: int = 1024
    block_k: int = 256
    block_q_dkv: int | None = None  # default: block_k
    block_k_dkv: int | None = None  # default: block_q
    heads_per_step: int | None = None  # default: all heads

    def __post_init__(self):
        for name in ("block_q", "block_k", "block_q_dkv", "block_k_dkv", "heads_per_step"):
            value = getattr(self, name)
            if value is None and name not in ("block_q", "block_k"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"BlockSizes.{name} must be a positive int, got {value!r}")

    @property
    def backward(self) -> tuple[int, int]:
        """``(block_q_dkv, block_k_dkv)``."""
        bq = self.block_q_dkv if self.block_q_dkv is not None else self.block_k
        bk = self.block_k_dkv if self.block_k_dkv is not None else self.block_q
        return bq, bk

    def clipped(self, len_q: int, len_k: int) -> BlockSizes:
        """Every block clipped to the sequence it tiles; the backward blocks made explicit."""
        bq_dkv, bk_dkv = self.backward
        return BlockSizes(min(self.block_q, len_q), min(self.block_k, len_k),
                          min(bq_dkv, len_q), min(bk_dkv, len_k), self.heads_per_step)


def _pow2_at_most(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def _clamp(x: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, x))


def default_block_sizes(len_q: int, len_k: int, num_heads: int, is_causal: bool,
                        window: int | None = None, scored: bool = False) -> BlockSizes:
    """Per-shape defaults tuned on a 2-core x86 CPU (AVX-512) with ``python -m benchmarks
    speed`` and per-tile sweeps at segment length 2048.

    Non-causal: the forward takes up to 4 query heads at a time, 2048 query rows against 512
    keys (1024 for one head): large per-head products amortize the loop and let XLA split
    each step over the cores, and splitting the heads keeps the tile (~16 MiB) from growing
    with the head count. The backward iterates 128-query blocks against a column of up to
    2048 keys, ~4 MiB per tile over all heads because four tiles are live at once.
    Causal: 256 against up to 512 so that blocks entirely in the future are skipped at a fine
    grain, all heads per step. A local ``window`` (the band ``|p - t| <= window``) gets square
    tiles of about the window, so that the blocks outside the band are skipped.
    ``scored``: the scores are modified per element (a soft-cap or ``score_mod``,
    :mod:`dilax.core.mods`): the backward keeps the modded logits (or their derivative) live
    beside s, p, dp and ds, and at the plain tiles that spills the working set out of cache
    (soft-cap backward at n = 16384 on a 2-core EPYC: 1.21x plain); its causal blocks are
    512 queries x 128 keys then, the same tile turned so that each key column is narrow
    (1.03x plain; smaller tiles use less CPU time but leave a core idle).
    """
    h = max(1, num_heads)
    if window is not None:
        # A band |p - t| <= W: square tiles of about W (128 .. 1024), so a query block meets
        # only ~3 key blocks and the work stays within ~2x of the n (2W + 1) pairs.
        t = _clamp(_pow2_at_most(max(window, 1)), 128, 1024)
        return BlockSizes(min(t, len_q), min(t, len_k), min(t, len_q), min(t, len_k), None)
    if is_causal:
        short = 256
        long = max(short, min(512, _pow2_at_most(_SCORE_BUDGET // (h * short))))
        bq, bk, bq_dkv, bk_dkv, per_step = long, short, short, long, None
        if scored:
            bq_dkv, bk_dkv = _SCORED_BWD
    else:
        per_step = min(h, _FWD_HEADS)
        bk = 1024 if per_step == 1 else 512
        bq = _clamp(_pow2_at_most(_FWD_TILE // (per_step * bk)), 256, 2048)
        bq_dkv = 128
        bk_dkv = _clamp(_pow2_at_most(_BWD_TILE // (h * bq_dkv)), 256, 2048)
        per_step = per_step if per_step < h else None
    return BlockSizes(min(bq, len_q), min(bk, len_k), min(bq_dkv, len_q), min(bk_dkv, len_k),
                      per_step)
