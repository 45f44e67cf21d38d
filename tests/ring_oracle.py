"""Float64 NumPy oracles with valid lengths, for the ring tests (test_ring*.py, test_request.py,
test_sequence_parallel.py, test_block_sparse_ring*.py): ``tests/oracle.py``'s ``attention``
with the weights of a dilated configuration (mixture mode, the local window one more branch)
or of a block-sparse pattern, and the valid lengths of SPEC.md: keys past ``kv_len`` get no
weight, rows past ``q_len`` none at all (output 0, no gradient). NumPy: nothing to compile,
so a test compiles only the program under test.
"""

from __future__ import annotations

import numpy as np
from oracle import Result
from oracle import attention as oracle_attention
from tolerance import FP32, assert_scaled_close

from dilax.reference import dilated_counts


def _with_lengths(w, n, q_len, kv_len):
    """``w`` (broadcastable to ``(b, h, n, n)``) times the valid-length masks."""
    pos = np.arange(n)
    if q_len is not None:
        w = w * (pos[None, :] < np.asarray(q_len)[:, None])[:, None, :, None]
    if kv_len is not None:
        w = w * (pos[None, :] < np.asarray(kv_len)[:, None])[:, None, None, :]
    return w


def dilated(q, k, v, g, ws, rs, is_causal, q_len=None, kv_len=None, window=None) -> Result:
    """Dilated attention (mixture mode, default scale) with valid lengths and the local window,
    output and the gradients of ``sum(out * g)``."""
    b, n, h, d = q.shape
    w = dilated_counts(n, h, ws, rs, "mixture", is_causal, local_window=window)[None]
    return oracle_attention(q, k, v, _with_lengths(w, n, q_len, kv_len), 1 / np.sqrt(d), dout=g)


def block_sparse(q, k, v, g, pattern, is_causal, q_len=None, kv_len=None) -> Result:
    """Block-sparse attention of ``pattern`` (its expanded token mask, default scale) with valid
    lengths, output and the gradients of ``sum(out * g)``."""
    n, d = q.shape[1], q.shape[3]
    w = pattern.expanded_mask(n, is_causal)[None].astype(np.float64)  # (1, H_pat, n, n)
    return oracle_attention(q, k, v, _with_lengths(w, n, q_len, kv_len), d ** -0.5, dout=g)


def assert_matches(out, grads, ref: Result, tol: float = FP32, err_msg: str = "") -> None:
    """``out`` and ``grads = (dq, dk, dv)`` against an oracle ``Result``."""
    assert_scaled_close(out, ref.out, tol, err_msg=f"{err_msg} out".strip())
    for name, a, e in zip("qkv", grads, (ref.dq, ref.dk, ref.dv), strict=True):
        assert_scaled_close(a, e, tol, err_msg=f"{err_msg} d{name}".strip())
