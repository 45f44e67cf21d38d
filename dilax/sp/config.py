"""``SequenceParallel``: the static module option that runs attention over a device mesh."""

from __future__ import annotations

import dataclasses

from jax.sharding import Mesh

from dilax import registry
from dilax.sp.layout import check_layout
from dilax.sp.mesh import check_mesh


@dataclasses.dataclass(frozen=True)
class SequenceParallel:
    """Where and how to run attention sequence-parallel (static, hashable module config).

    Give it to :func:`dilax.dilated_attention` or :func:`dilax.block_sparse_attention`
    (``layout="contiguous"`` only) as ``sequence_parallel=...``: the op then runs as ring
    attention over ``mesh``, validated once outside the ``shard_map``. Given to
    :class:`dilax.nn.DilatedAttention`, :class:`dilax.nn.MultiheadDilatedAttention`, the
    block-sparse modules or the LongNet models, every attention of the module runs that way.
    The projections and feed-forward layers are left to XLA's sharding propagation under
    ``jit``.

    Args:
      mesh: the device mesh.
      seq_axis: mesh axis the sequence is split over (``n`` must be divisible by its size).
      batch_axis: optional mesh axis the batch is split over.
      layout: ``"contiguous"`` or ``"zigzag"`` (see :func:`dilax.ring_dilated_attention`).

    Raises:
      TypeError: ``mesh`` is not a ``jax.sharding.Mesh``.
      ValueError: ``seq_axis``/``batch_axis`` not axes of the mesh, or equal; unknown
        ``layout``.
    """

    mesh: Mesh
    seq_axis: str = "sp"
    batch_axis: str | None = None
    layout: str = "contiguous"

    def __post_init__(self):
        check_mesh(self.mesh, self.seq_axis, self.batch_axis)
        check_layout(self.layout)


def check_sequence_parallel(sequence_parallel, implementation,
                            layouts: tuple[str, ...] = ("contiguous", "zigzag"),
                            interpret: bool = False, dilated: bool = False,
                            block_size: int | None = None):
    """A ``sequence_parallel`` option: None, or a :class:`SequenceParallel` with one of
    ``layouts`` and an ``implementation`` that serves the ring's hops.

    Both rings (``dilated``: the dilated one, else the block-sparse one) run their hops on
    the core :mod:`dilax.registry` picks for a ``"ring_hop"`` request (``implementation``
    None or a core that serves one; ``interpret`` runs the Pallas kernels in the
    interpreter; ``block_size``: the block-sparse ring's pattern block size, when known);
    what depends on the call (dtype, head dim) is checked when it is known."""
    if sequence_parallel is None:
        return None
    if not isinstance(sequence_parallel, SequenceParallel):
        raise TypeError("sequence_parallel must be a dilax.SequenceParallel or None, got "
                        f"{type(sequence_parallel).__name__}")
    registry.check_ring_hops(implementation, interpret, dilated, block_size)
    if sequence_parallel.layout not in layouts:
        raise ValueError(f"sequence_parallel.layout must be one of {layouts} here, got "
                         f"{sequence_parallel.layout!r}")
    return sequence_parallel
