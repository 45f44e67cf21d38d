"""The block-sparse attention op: a block pattern, its tables, content-adaptive selection and
its ring.

- :mod:`dilax.block_sparse.api`: :func:`block_sparse_attention`, the op (``sequence_parallel=``
  runs it as a ring over a mesh).
- :mod:`dilax.block_sparse.tables`: the compact per-query-block key tables a pattern compiles
  to (patterns themselves: :mod:`dilax.patterns`).
- :mod:`dilax.block_sparse.content_adaptive`: top-k key blocks chosen from the content.
- :mod:`dilax.block_sparse.ring`: :func:`ring_block_sparse_attention`, the per-device op for a
  user's own ``shard_map``; :mod:`dilax.block_sparse.ring_plan` is its static hop plan.
"""
