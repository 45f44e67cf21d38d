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
      layout: ``"contiguous"`` or ``"zigzag"`` (see :func:`dilax.sharded_dilated_attention`).

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
                            interpret: bool = False):
    """A ``sequence_parallel`` option: None, or a :class:`SequenceParallel` with one of
    ``layouts``, ``implementation`` None or ``"xla"`` and no ``interpret`` (the rings run the
    XLA core)."""
    if sequence_parallel is None:
        return None
    if not isinstance(sequence_parallel, SequenceParallel):
        raise TypeError("sequence_parallel must be a dilax.SequenceParallel or None, got "
                        f"{type(sequence_parallel).__name__}")
    hop = registry.CoreRequest("ring_hop")  # the registry says which cores run a ring hop
    if implementation is not None and registry.supports(implementation, hop) is not None:
        served = " or ".join(map(repr, registry.served_by(hop)))
        raise ValueError(f"sequence_parallel runs its ring hops on {served}: implementation "
                         f"must be None or {served}, got {implementation!r} "
                         f"({registry.supports(implementation, hop)})")
    if interpret:
        raise ValueError("sequence_parallel runs the XLA core on every device: interpret=True "
                         "(the Pallas interpreter) does not apply")
    if sequence_parallel.layout not in layouts:
        raise ValueError(f"sequence_parallel.layout must be one of {layouts} here, got "
                         f"{sequence_parallel.layout!r}")
    return sequence_parallel
