"""Dilated (LongNet) attention: the two modes of docs/semantics.md on one attention core.

Each branch ``(w, r)`` is one core call over all of its segments and heads, read in place
through the slot layout (:mod:`dilax.layout`); the branches run through the one branch runner
(:func:`dilax.branches.attend_branches`, one custom_vjp with the merge fused in) and are
merged in float32 with their log-sum-exp weights
(mixture) or scaled by ``1/G`` (grouped) (:func:`dilax.branches.combine_branches`).
"""

from __future__ import annotations

import functools

import jax

from dilax import _validation as V
from dilax.backend import resolve_core
from dilax.branches import CoreBranch, attend_branches
from dilax.core import XLA, BlockSizes, Core
from dilax.layout import dilated_branches
from dilax.reference import dilated_attention_reference


def dilated_attention_core(q, k, v, segment_lengths, dilation_rates, *, is_causal, scale, mode,
                           core: Core = XLA, block_sizes=None, return_lse=False):
    """Dilated attention on validated arguments with the attention core ``core``.

    Returns ``out (b, n, h, d)`` and, with ``return_lse``, ``lse (b, n, h)`` float32."""
    n, h = q.shape[1], q.shape[2]
    plans = tuple(dilated_branches(n, h, k.shape[2], segment_lengths, dilation_rates, mode))
    ops = tuple(CoreBranch(p, float(scale), bool(is_causal), block_sizes, core) for p in plans)
    out, lse = attend_branches(q, k, v, ops, mode, out_dtype=q.dtype)
    return (out, lse) if return_lse else out


def dilated_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_lengths: tuple[int, ...] | list[int] | int,
    dilation_rates: tuple[int, ...] | list[int] | int,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    mode: str = "mixture",
    implementation: str | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Dilated attention (LongNet), exactly as specified in docs/semantics.md.

    Args:
      q: ``(b, n, h, d)`` queries.
      k, v: ``(b, n, hk, d)`` keys and values, ``h % hk == 0`` (GQA/MQA without repeating K/V).
      segment_lengths: ``(w_0, ...)``, one per branch; any ``n >= 1`` is allowed (the last
        segment is shorter when ``n % w != 0``; ``w > n`` means one segment).
      dilation_rates: ``(r_0, ...)``, same length, ``w_i % r_i == 0``.
      is_causal: restrict query ``p`` to keys ``t <= p`` (within its segment).
      scale: logit scale, default ``1 / sqrt(d)``.
      mode: ``"mixture"`` (every head runs every branch with offset ``j % r``, branches merged
        with their softmax mass, LongNet Eq. 10) or ``"grouped"`` (dilated-attention-pytorch:
        head groups, one branch each, output divided by the number of branches).
      implementation: ``None`` (best for the backend: ``"pallas"`` on GPU, ``"xla"``
        elsewhere), ``"xla"`` (blockwise core), ``"pallas"`` (Pallas flash kernel per branch),
        ``"cudnn"`` (``jax.nn.dot_product_attention`` per branch, CUDA only) or
        ``"reference"`` (explicit mask; small ``n`` only).
      block_sizes: optional :class:`dilax.core.BlockSizes` for the blockwise core.
      interpret: run the Pallas kernels in the interpreter (CPU testing); implies
        ``implementation="pallas"`` when ``implementation`` is None.

    Returns:
      ``(b, n, h, d)`` in ``q.dtype``. Queries selected by no branch get 0.

    Raises:
      ValueError / TypeError at trace time for malformed inputs (see docs/semantics.md, "Errors").
    """
    q, k, v = V.check_qkv(q, k, v)
    ws, rs, mode, is_causal, scale, block_sizes = V.check_dilated_call(
        q, segment_lengths, dilation_rates, mode, is_causal, scale, block_sizes)
    interpret = V.check_bool(interpret, "interpret")
    core = resolve_core(implementation, interpret=interpret)
    V.check_memory(q, k, num_branches=len(ws), dense=core is None, op="dilated_attention")
    return _dilated_jit(q, k, v, ws, rs, is_causal, scale, mode, core, block_sizes)


# One compiled program per static configuration: eager calls then give bitwise the same
# result as calls under jax.jit (op-by-op dispatch would fuse, and round, differently).
@functools.partial(jax.jit, static_argnums=tuple(range(3, 10)))
def _dilated_jit(q, k, v, ws, rs, is_causal, scale, mode, core, block_sizes):
    if core is None:
        return dilated_attention_reference(q, k, v, ws, rs, is_causal=is_causal, scale=scale,
                                           mode=mode)
    return dilated_attention_core(q, k, v, ws, rs, is_causal=is_causal, scale=scale, mode=mode,
                                  core=core, block_sizes=block_sizes)
