from dilax.nn.block_sparse import BlockSparseAttention, BlockSparseMultiheadAttention  # noqa: F401
