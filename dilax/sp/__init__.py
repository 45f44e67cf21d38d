"""What the two rings share: attention with the sequence axis split over a mesh axis.

The rings themselves belong to their ops: :func:`dilax.ring_dilated_attention`
(:mod:`dilax.dilated.ring`) and :func:`dilax.ring_block_sparse_attention`
(:mod:`dilax.block_sparse.ring`); ``dilated_attention(..., sequence_parallel=)`` and
``block_sparse_attention(..., sequence_parallel=)`` run them over a whole mesh.

- :mod:`dilax.sp.config`: :class:`SequenceParallel`, the mesh and axis an op runs over.
- :mod:`dilax.sp.layout`: contiguous/zigzag device layouts and chunk moves between devices.
- :mod:`dilax.sp.schedule`: the static schedule both rings share (which device's chunk each
  device holds at each hop) and the dilated geometry.
- :mod:`dilax.sp.mesh`: axis size, mesh checks and the ``shard_map`` of both rings.
- :mod:`dilax.sp.ring_vjp`: the spanning-branch ring with its backward ring.
"""

from dilax.sp.config import SequenceParallel
from dilax.sp.layout import LAYOUTS, zigzag_permutation

__all__ = ["LAYOUTS", "SequenceParallel", "zigzag_permutation"]

# Names that lived here before the rings moved to their ops: kept working, with a warning.
_MOVED = {"ring_dilated_attention": "dilax.dilated.ring",
          "sharded_dilated_attention": "dilax.dilated.api",
          "ring_block_sparse_attention": "dilax.block_sparse.ring",
          "sharded_block_sparse_attention": "dilax.block_sparse.api"}


def __getattr__(name: str):
    if name not in _MOVED:
        raise AttributeError(f"module 'dilax.sp' has no attribute {name!r}")
    import importlib
    import warnings

    warnings.warn(f"dilax.sp.{name} moved: use dilax.{name.replace('sharded_', 'ring_')} "
                  "(per device, in your own shard_map) or the op's sequence_parallel=",
                  DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(_MOVED[name]), name)
