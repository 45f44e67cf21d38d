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

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

from dilax import _validation as V
from pallas_kernels.tables import tables_from_block_mask

__all__ = [
    "BlockSparsePattern",
    "dilated",
    "dilated_segments",
    "from_mask",
    "global_local",
    "hierarchical",
    "local_window",
    "random",
]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _readonly(x: np.ndarray) -> np.ndarray:
    x.setflags(write=False)
    return x


@dataclasses.dataclass(frozen=True)
class BlockSparsePattern:
    """Immutable block mask ``(num_heads, num_q_blocks, num_k_blocks)`` with block size.

    Build it with the constructors of :mod:`dilax.patterns` (or :func:`from_mask`). The mask
    is stored bit-packed in ``packed_mask`` so the object is hashable and cheap to compare.

    Attributes:
      block_size: tokens per block ``B`` (query and key blocks alike).
      num_heads: ``H_pat``: 1 (shared by all heads) or the number of query heads ``h``.
      num_q_blocks, num_k_blocks: block counts ``ceil(n / B)``.
      packed_mask: ``np.packbits`` of the C-ordered boolean mask.
    """

    block_size: int
    num_heads: int
    num_q_blocks: int
    num_k_blocks: int
    packed_mask: bytes = dataclasses.field(repr=False)

    def __post_init__(self):
        for name in ("block_size", "num_heads", "num_q_blocks", "num_k_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (numbers.Integral, np.integer)):
                raise TypeError(f"BlockSparsePattern.{name} must be an int, got {value!r}")
            if value <= 0:
                raise ValueError(f"BlockSparsePattern.{name} must be positive, got {value}")
            object.__setattr__(self, name, int(value))
        if not isinstance(self.packed_mask, bytes):
            raise TypeError("BlockSparsePattern.packed_mask must be bytes (np.packbits output)")
        size = self.num_heads * self.num_q_blocks * self.num_k_blocks
        if len(self.packed_mask) != _cdiv(size, 8):
            raise ValueError(
                f"BlockSparsePattern.packed_mask holds {len(self.packed_mask)} bytes, expected "
                f"{_cdiv(size, 8)} for a ({self.num_heads}, {self.num_q_blocks}, "
                f"{self.num_k_blocks}) mask"
            )

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_array(cls, block_mask: Any, block_size: int) -> BlockSparsePattern:
        """Pattern from a boolean ``(nq, nk)`` or ``(H, nq, nk)`` array (see :func:`from_mask`)."""
        return from_mask(block_mask, block_size)

    # -- views ----------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int, int]:
        """``(num_heads, num_q_blocks, num_k_blocks)``."""
        return (self.num_heads, self.num_q_blocks, self.num_k_blocks)

    @property
    def block_mask(self) -> np.ndarray:
        """Read-only boolean mask ``(num_heads, num_q_blocks, num_k_blocks)``."""
        return _unpack(self)

    @property
    def seq_len(self) -> int:
        """``num_q_blocks * block_size``: the largest sequence length this pattern fits."""
        return self.num_q_blocks * self.block_size

    def causal_mask(self) -> np.ndarray:
        """Read-only block mask after the causal cut (key blocks ``j > i`` removed)."""
        return _causal_block_mask(self)

    def num_active_blocks(self, is_causal: bool = False) -> int:
        """Number of True blocks over all heads (after the causal cut if ``is_causal``)."""
        mask = self.causal_mask() if is_causal else self.block_mask
        return int(mask.sum())

    @property
    def density(self) -> float:
        """Fraction of True blocks, ``active / (H_pat * nq * nk)`` (no causal cut)."""
        return self.num_active_blocks(False) / float(np.prod(self.shape))

    @property
    def causal_density(self) -> float:
        """Fraction of True blocks after the causal cut, over all ``H_pat * nq * nk`` blocks.

        This is the fraction of dense (non-causal) block work a causal call does: a full mask
        has ``causal_density = (nq + 1) / (2 nq)``.
        """
        return self.num_active_blocks(True) / float(np.prod(self.shape))

    @property
    def sparsity(self) -> float:
        """``1 - density``."""
        return 1.0 - self.density

    def tables(self, is_causal: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Compact per-query-block tables of active key blocks.

        Returns:
          ``kv_block_indices``: int32 ``(H_pat, nq, max_active)``: the active key blocks of each
          query block in ascending order; slots at and beyond the count repeat the last valid
          index (0 when the row has none). ``max_active = max(1, max count)``.
          ``kv_block_counts``: int32 ``(H_pat, nq)``: number of active key blocks.
          With ``is_causal`` the key blocks entirely in the future of the query block
          (``j > i``) are removed first. Both arrays are read-only numpy arrays.
        """
        return _tables(self, V.check_bool(is_causal, "is_causal"))

    def expanded_mask(self, n: int | None = None, is_causal: bool = False) -> np.ndarray:
        """Token-level boolean mask ``(H_pat, n, n)`` (small ``n`` only; tests, plots)."""
        n = self.seq_len if n is None else V.static_int(n, "n")
        if _cdiv(n, self.block_size) != self.num_q_blocks or self.num_q_blocks != self.num_k_blocks:
            raise ValueError(
                f"n={n} does not fit pattern with {self.num_q_blocks}x{self.num_k_blocks} blocks "
                f"of size {self.block_size} (needs ceil(n / block_size) == num blocks)"
            )
        blocks = np.arange(n) // self.block_size
        mask = self.block_mask[:, blocks][:, :, blocks]
        if is_causal:
            mask = mask & np.tril(np.ones((n, n), bool))[None]
        return mask

    # -- combination ----------------------------------------------------------------------
    def _combine(self, other: Any, op, sym: str) -> BlockSparsePattern:
        if not isinstance(other, BlockSparsePattern):
            return NotImplemented
        if self.block_size != other.block_size:
            raise ValueError(
                f"cannot combine patterns with block_size {self.block_size} and "
                f"{other.block_size} with '{sym}'"
            )
        if (self.num_q_blocks, self.num_k_blocks) != (other.num_q_blocks, other.num_k_blocks):
            raise ValueError(
                f"cannot combine patterns of {self.num_q_blocks}x{self.num_k_blocks} and "
                f"{other.num_q_blocks}x{other.num_k_blocks} blocks with '{sym}'"
            )
        if self.num_heads != other.num_heads and 1 not in (self.num_heads, other.num_heads):
            raise ValueError(
                f"cannot combine patterns with {self.num_heads} and {other.num_heads} heads with "
                f"'{sym}' (head counts must match, or one pattern must be shared: num_heads=1)"
            )
        return from_mask(op(self.block_mask, other.block_mask), self.block_size)

    def __or__(self, other: BlockSparsePattern) -> BlockSparsePattern:
        return self._combine(other, np.logical_or, "|")

    def __and__(self, other: BlockSparsePattern) -> BlockSparsePattern:
        return self._combine(other, np.logical_and, "&")

    # -- visualisation --------------------------------------------------------------------
    def to_text(self, head: int = 0, is_causal: bool = False, max_blocks: int = 64) -> str:
        """Text picture of one head's block mask: ``#`` active, ``.`` inactive.

        Rows are query blocks, columns key blocks. Masks wider than ``max_blocks`` are shown
        OR-pooled (a character is ``#`` if any block it stands for is active).
        """
        head = V.static_int(head, "head")
        if not 0 <= head < self.num_heads:
            raise ValueError(f"head must be in [0, {self.num_heads}), got {head}")
        max_blocks = V.static_int(max_blocks, "max_blocks")
        if max_blocks <= 0:
            raise ValueError(f"max_blocks must be positive, got {max_blocks}")
        mask = (self.causal_mask() if is_causal else self.block_mask)[head]
        fq = _cdiv(mask.shape[0], max_blocks)
        fk = _cdiv(mask.shape[1], max_blocks)
        if fq > 1 or fk > 1:
            rows, cols = _cdiv(mask.shape[0], fq), _cdiv(mask.shape[1], fk)
            padded = np.zeros((rows * fq, cols * fk), bool)
            padded[: mask.shape[0], : mask.shape[1]] = mask
            mask = padded.reshape(rows, fq, cols, fk).any(axis=(1, 3))
        title = (
            f"{self!r}, head {head}{', causal' if is_causal else ''}"
            + (f", 1 char = {fq}x{fk} blocks" if fq > 1 or fk > 1 else "")
        )
        lines = ["".join("#" if x else "." for x in row) for row in mask]
        return "\n".join([title, *lines])

    def show(self, head: int = 0, is_causal: bool = False, max_blocks: int = 64) -> None:
        """Prints :meth:`to_text`."""
        print(self.to_text(head=head, is_causal=is_causal, max_blocks=max_blocks))

    def plot(self, path: str | None = None, *, head: int | None = None, is_causal: bool = False,
             ax: Any = None):
        """Draws the block mask with matplotlib (imported lazily).

        Args:
          path: if given, the figure is saved there (PNG by extension).
          head: the head to draw; default all heads side by side (at most 8).
          is_causal: draw the mask after the causal cut.
          ax: an existing matplotlib ``Axes`` to draw one head into.
        Returns:
          The matplotlib ``Figure``.
        """
        from matplotlib.figure import Figure  # lazy: matplotlib is a dev extra

        mask = self.causal_mask() if is_causal else self.block_mask
        heads = range(min(self.num_heads, 8)) if head is None else [V.static_int(head, "head")]
        for hd in heads:
            if not 0 <= hd < self.num_heads:
                raise ValueError(f"head must be in [0, {self.num_heads}), got {hd}")
        if ax is not None:
            heads = heads[:1]
            axes = [ax]
            fig = ax.figure
        else:
            fig = Figure(figsize=(3.2 * len(heads), 3.4))
            axes = fig.subplots(1, len(heads), squeeze=False)[0]
        for a, hd in zip(axes, heads, strict=False):
            a.imshow(mask[hd], cmap="Greys", vmin=0, vmax=1, interpolation="nearest")
            a.set_title(f"head {hd}: density {mask[hd].mean():.3f}", fontsize=9)
            a.set_xlabel("key block")
            a.set_ylabel("query block")
        fig.suptitle(f"block size {self.block_size}{', causal' if is_causal else ''}",
                     fontsize=10)
        if path is not None:
            fig.savefig(path, dpi=100)
        return fig

    def __repr__(self) -> str:
        return (
            f"BlockSparsePattern(block_size={self.block_size}, num_heads={self.num_heads}, "
            f"blocks={self.num_q_blocks}x{self.num_k_blocks}, density={self.density:.4f})"
        )


# -- cached derived arrays (keyed by the hashable pattern) --------------------------------


@functools.lru_cache(maxsize=256)
def _unpack(pattern: BlockSparsePattern) -> np.ndarray:
    size = pattern.num_heads * pattern.num_q_blocks * pattern.num_k_blocks
    bits = np.unpackbits(np.frombuffer(pattern.packed_mask, np.uint8), count=size)
    return _readonly(bits.astype(bool).reshape(pattern.shape))


@functools.lru_cache(maxsize=256)
def _causal_block_mask(pattern: BlockSparsePattern) -> np.ndarray:
    nq, nk = pattern.num_q_blocks, pattern.num_k_blocks
    keep = np.arange(nk)[None, :] <= np.arange(nq)[:, None]
    return _readonly(pattern.block_mask & keep[None])


def mask_tables(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Tables of a boolean ``(..., nq, nk)`` mask in :meth:`BlockSparsePattern.tables` format
    (:func:`pallas_kernels.tables.tables_from_block_mask`), read-only."""
    indices, counts = tables_from_block_mask(mask)
    return _readonly(indices), _readonly(counts)


@functools.lru_cache(maxsize=256)
def _tables(pattern: BlockSparsePattern, is_causal: bool) -> tuple[np.ndarray, np.ndarray]:
    return mask_tables(pattern.causal_mask() if is_causal else pattern.block_mask)


# -- validation helpers -------------------------------------------------------------------


def _positive(value: Any, name: str) -> int:
    value = V.static_int(value, name)
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return value


def _non_negative(value: Any, name: str) -> int:
    value = V.static_int(value, name)
    if value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value}")
    return value


def _num_blocks(n: Any, block_size: Any, num_heads: int = 1) -> tuple[int, int, int]:
    n = _positive(n, "n")
    block_size = _positive(block_size, "block_size")
    nb = _cdiv(n, block_size)
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
    nb = _cdiv(n, block_size)
    first = np.arange(nb) * block_size
    last = np.minimum(first + block_size, n) - 1
    return first, last


# -- constructors -------------------------------------------------------------------------


def from_mask(block_mask: Any, block_size: int) -> BlockSparsePattern:
    """Pattern from a boolean block mask.

    Args:
      block_mask: array-like of bools (or 0/1), shape ``(nq, nk)`` (shared by all heads) or
        ``(H, nq, nk)`` (``H`` must then equal the number of query heads ``h``, or be 1).
      block_size: tokens per block.
    """
    block_size = _positive(block_size, "block_size")
    if isinstance(block_mask, BlockSparsePattern):
        raise TypeError("block_mask must be an array, got a BlockSparsePattern")
    try:
        arr = np.asarray(block_mask)
    except Exception as e:  # noqa: BLE001 - re-raised with the argument's name
        raise TypeError(f"block_mask must be array-like, got {type(block_mask).__name__}") from e
    if arr.dtype != bool:
        if not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
            raise TypeError(f"block_mask must hold bools or 0/1 values, got dtype {arr.dtype}")
        if not np.all((arr == 0) | (arr == 1)):
            raise ValueError("block_mask must hold only bools or 0/1 values")
        arr = arr.astype(bool)
    if arr.ndim == 2:
        arr = arr[None]
    if arr.ndim != 3:
        raise ValueError(
            f"block_mask must have shape (nq, nk) or (heads, nq, nk), got {tuple(arr.shape)}"
        )
    if min(arr.shape) <= 0:
        raise ValueError(f"block_mask must be non-empty in every axis, got {tuple(arr.shape)}")
    arr = np.ascontiguousarray(arr)
    return BlockSparsePattern(block_size, arr.shape[0], arr.shape[1], arr.shape[2],
                              np.packbits(arr.reshape(-1)).tobytes())


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
    g = _cdiv(global_tokens, block_size)
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
    n = _positive(n, "n")
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
        s = _positive(level[0], f"levels[{i}][0] (block_size)")
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
    nb = _cdiv(n, block_size)
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
    num_heads = _positive(num_heads, "num_heads")
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
        num_heads = _positive(num_heads, "num_heads")
        _check_mask_fits(nb, num_heads, n, block_size)
        mode = V.check_mode(mode, num_heads, len(ws))
        if mode == "mixture":
            head_branches = [
                [(w, r, j % r) for w, r in zip(ws, rs, strict=True)] for j in range(num_heads)
            ]
        else:
            from dilax.reference import group_sizes

            head_branches = []
            for i, size in enumerate(group_sizes(num_heads, len(ws))):
                head_branches += [[(ws[i], rs[i], i % rs[i])]] * size
    mask = np.zeros((len(head_branches), nb, nb), bool)
    for hd, branches in enumerate(head_branches):
        for w, r, o in branches:
            for start in range(0, n, w):
                pos = np.arange(start + o, min(start + w, n), r)
                if pos.size:
                    blk = np.unique(pos // block_size)
                    mask[hd][np.ix_(blk, blk)] = True
    return from_mask(mask, block_size)
