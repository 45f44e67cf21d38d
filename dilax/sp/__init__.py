"""Sequence parallelism: attention with the sequence axis split over the devices of a mesh.

- :mod:`dilax.sp.layout`: contiguous/zigzag layouts and chunk moves between devices.
- :mod:`dilax.sp.schedule`: the static schedule both rings share (which device's chunk each
  device holds at each hop) and the dilated geometry.
- :mod:`dilax.sp.mesh`: axis size, mesh checks and the ``shard_map`` of both rings.
- :mod:`dilax.sp.dilate`, :mod:`dilax.sp.ring_vjp`, :mod:`dilax.sp.ring_branches`,
  :mod:`dilax.sp.dilated_ring`: ring dilated attention (dilated layout, the spanning-branch
  ring with its backward ring, the branch kinds, the public functions).
- :mod:`dilax.sp.block_sparse_ring`, :mod:`dilax.sp.block_sparse_plan`: ring block-sparse
  attention (the ring; its static plans and its hops on the Pallas block-sparse kernel).
- :mod:`dilax.sp.config`: :class:`SequenceParallel`, the module option.
- :mod:`dilax.sp.plan`: the ring's cost plan (per-device memory, bytes sent, hops) on paper,
  from the ring's own geometry (``python -m benchmarks ring --plan``).
"""

from dilax.sp.block_sparse_ring import ring_block_sparse_attention, sharded_block_sparse_attention
from dilax.sp.config import SequenceParallel
from dilax.sp.dilated_ring import ring_dilated_attention, sharded_dilated_attention
from dilax.sp.layout import LAYOUTS, zigzag_permutation

__all__ = [
    "LAYOUTS",
    "SequenceParallel",
    "ring_block_sparse_attention",
    "ring_dilated_attention",
    "sharded_block_sparse_attention",
    "sharded_dilated_attention",
    "zigzag_permutation",
]
