"""The :class:`BlockSparsePattern` value type and its cached derived arrays (masks, tables).

Constructors live in :mod:`dilax.patterns.constructors`; see :mod:`dilax.patterns`.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Any

import numpy as np

from dilax import _validation as V
from dilax.core.arrays import cdiv


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
        if len(self.packed_mask) != cdiv(size, 8):
            raise ValueError(
                f"BlockSparsePattern.packed_mask holds {len(self.packed_mask)} bytes, expected "
                f"{cdiv(size, 8)} for a ({self.num_heads}, {self.num_q_blocks}, "
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
        if cdiv(n, self.block_size) != self.num_q_blocks or self.num_q_blocks != self.num_k_blocks:
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
        fq = cdiv(mask.shape[0], max_blocks)
        fk = cdiv(mask.shape[1], max_blocks)
        if fq > 1 or fk > 1:
            rows, cols = cdiv(mask.shape[0], fq), cdiv(mask.shape[1], fk)
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
          The matplotlib ``Figure``: a new pyplot figure (the current one, so
          ``plt.savefig(...)`` and ``plt.show()`` work; close it with ``plt.close(fig)``), or
          ``ax``'s figure.
        """
        import matplotlib.pyplot as plt  # lazy: matplotlib is an extra

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
            # constrained layout: the axis labels and the title fit inside the figure
            fig = plt.figure(figsize=(3.2 * len(heads), 3.4), layout="constrained")
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
    # Lazy: importing pallas_kernels loads Pallas, which ``import dilax`` does not need.
    from pallas_kernels.tables import tables_from_block_mask

    indices, counts = tables_from_block_mask(mask)
    return _readonly(indices), _readonly(counts)


@functools.lru_cache(maxsize=256)
def _tables(pattern: BlockSparsePattern, is_causal: bool) -> tuple[np.ndarray, np.ndarray]:
    return mask_tables(pattern.causal_mask() if is_causal else pattern.block_mask)


def positive_int(value: Any, name: str) -> int:
    """``value`` as a static int, ``ValueError`` naming ``name`` unless it is positive."""
    value = V.static_int(value, name)
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return value


def from_mask(block_mask: Any, block_size: int) -> BlockSparsePattern:
    """Pattern from a boolean block mask.

    Args:
      block_mask: array-like of bools (or 0/1), shape ``(nq, nk)`` (shared by all heads) or
        ``(H, nq, nk)`` (``H`` must then equal the number of query heads ``h``, or be 1).
      block_size: tokens per block.
    """
    block_size = positive_int(block_size, "block_size")
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
