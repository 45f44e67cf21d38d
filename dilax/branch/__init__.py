"""Branches: several attention-core calls merged into one softmax (the dilated op's engine,
shared by its ring and the block-sparse ring).

- :mod:`dilax.branch.plan`: the static slot plan of a branch (which rows, heads and offsets a
  core call reads, in place).
- :mod:`dilax.branch.runner`: :func:`attend_branches`, the branches' core calls and their merge
  in one ``custom_vjp``.
"""
