"""One way to compare floating-point results in the tests, valid on any x86 CPU.

Summation order differs between CPUs (AMD EPYC and Intel Xeon pick different XLA:CPU
kernels), so a result computed twice in float32 agrees only to a few ulps *of the magnitudes
that were summed*, not of the element compared. An element near 0 in an output of magnitude
~18 carries rounding error of order ``eps * 18``. Hence the absolute part of every tolerance
scales with the largest magnitude of the expected array (and with the depth of the
computation, e.g. the number of stacked layers):

    |actual - expected| <= tol * (|expected| + depth * max(1, max|expected|))

``tol_for(dtype)`` picks FP32 or HALF; ``assert_trees_close`` compares pytrees (gradients of
parameters) with one scale for the whole tree. Where the expected values are simple to get in
float64 (``tests/oracle.py``), the oracle's own rounding drops out of the budget.
"""

from __future__ import annotations

import numpy as np

FP32 = 1e-5  # float32: ~100 ulps of headroom for reordered sums of a few hundred terms
HALF = 2e-2  # bfloat16 / float16: ~5 ulps of bf16 at the output's scale


def tol_for(dtype) -> float:
    """``FP32`` for float32 (and float64) results, ``HALF`` for bfloat16 / float16."""
    return FP32 if np.dtype(dtype).itemsize >= 4 else HALF


def _scale(expected: np.ndarray) -> float:
    return max(1.0, float(np.max(np.abs(expected), initial=0.0)))


def assert_scaled_close(actual, expected, tol: float = FP32, *, depth: int = 1,
                        scale: float | None = None, err_msg: str = "") -> None:
    """``np.testing.assert_allclose`` with ``rtol=tol`` and ``atol = tol * depth * scale``,
    where ``scale = max(1, max|expected|)`` unless given; see the module docstring for why."""
    expected = np.asarray(expected, np.float64)
    actual = np.asarray(actual, np.float64)
    if scale is None:
        scale = _scale(expected)
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * depth * scale,
                               err_msg=err_msg)


def assert_trees_close(actual, expected, tol: float = FP32, *, depth: int = 1,
                       err_msg: str = "") -> None:
    """``assert_scaled_close`` leaf by leaf (same tree structure, at least one leaf), with one
    scale for the whole tree: ``max(1, max|expected|)`` over all its leaves.

    For gradient trees: rounding in a backward pass is set by the magnitudes that flow
    through it, which every parameter shares. A gradient that is 0 up to rounding (a key
    projection's bias: softmax ignores a per-query constant) holds rounding noise of the
    other gradients' scale, not of its own.
    """
    import jax

    leaves_a, tree_a = jax.tree.flatten(actual)
    with_paths, tree_b = jax.tree_util.tree_flatten_with_path(expected)
    assert tree_a == tree_b and leaves_a, (tree_a, tree_b)
    scale = max(_scale(np.asarray(b, np.float64)) for _, b in with_paths)
    for a, (path, b) in zip(leaves_a, with_paths, strict=True):
        assert_scaled_close(a, b, tol, depth=depth, scale=scale,
                            err_msg=f"{err_msg} {jax.tree_util.keystr(path)}".strip())
