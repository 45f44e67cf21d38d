"""Dilated-attention cases and checks shared by the implementations' tests (the Pallas
kernels run ``CASES`` in tests/test_pallas.py; tests/test_dilated.py, the XLA path, uses the
helpers on its own edge cases and sweeps).

Usage from a test module::

    from dilated_cases import CASES, case_id, implementation, run_case

    @pytest.mark.parametrize("case", CASES, ids=case_id)
    def test_dilated_matches_reference(case):
        run_case(case, implementation("pallas-interpret"))

``run_case`` checks the output and the gradients w.r.t. q, k, v against the mask-based
reference of SPEC.md (the float64 oracle over ``dilax.reference.dilated_counts``,
``tests/oracle.py``), to ``tests/tolerance.py``'s FP32 / HALF relative to the magnitude of each
compared array. Shapes stay tiny: the Pallas interpreter on CPU compiles every kernel of every
branch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from oracle import dilated as dilated_oracle
from tolerance import assert_scaled_close, tol_for

import dilax


class DilatedCase(NamedTuple):
    b: int
    n: int
    h: int
    hk: int
    d: int
    ws: tuple[int, ...]
    rs: tuple[int, ...]
    mode: str
    causal: bool
    dtype: str = "float32"


CASES = [
    # n not a multiple of any w, GQA, two branches
    DilatedCase(2, 37, 4, 2, 16, (8, 16), (1, 2), "mixture", False),
    # r does not divide n, offsets j % r over more heads than r
    DilatedCase(1, 50, 6, 3, 16, (6, 12, 24), (1, 2, 3), "mixture", True),
    # grouped: uneven groups (3, 2) on one kv head (MQA): uneven GQA split in the plan
    DilatedCase(1, 40, 5, 1, 16, (8, 16), (2, 4), "grouped", False),
    DilatedCase(1, 48, 4, 4, 32, (16, 32), (1, 4), "grouped", True),
    # w > n: the whole sequence is one segment
    DilatedCase(2, 19, 3, 3, 16, (64, 4), (4, 2), "mixture", True),
    # n = 1, head_dim 128 (one case: interpret mode is slow; n = 1 keeps it cheap to run)
    DilatedCase(1, 1, 2, 1, 128, (4, 2), (2, 1), "mixture", True),
    # half precision
    DilatedCase(1, 48, 4, 2, 64, (8, 16), (1, 2), "mixture", True, "bfloat16"),
]


def case_id(case: DilatedCase) -> str:
    ws = "-".join(map(str, case.ws))
    rs = "-".join(map(str, case.rs))
    return (f"{case.mode}-{'causal' if case.causal else 'full'}-b{case.b}n{case.n}h{case.h}"
            f"hk{case.hk}d{case.d}-w{ws}-r{rs}-{case.dtype}")


DilatedFn = Callable[..., jax.Array]
"""``fn(q, k, v, segment_lengths, dilation_rates, *, is_causal, mode) -> (b, n, h, d)``."""


def implementation(name: str) -> DilatedFn:
    """The dilated callable of an implementation name: ``"reference"``, ``"xla"`` or
    ``"pallas-interpret"`` (the Pallas kernels run by the interpreter, CPU)."""
    if name in ("reference", "xla"):
        return functools.partial(dilax.dilated_attention, implementation=name)
    if name == "pallas-interpret":
        return functools.partial(dilax.dilated_attention, implementation="pallas",
                                 interpret=True)
    raise ValueError(f"unknown implementation {name!r}")


def make_inputs(case: DilatedCase, seed: int = 0):
    """q, k, v and an output cotangent (so every output element gets its own), in case.dtype."""
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(seed), 4)
    dtype = jnp.dtype(case.dtype)
    q = jax.random.normal(k1, (case.b, case.n, case.h, case.d), jnp.float32).astype(dtype)
    k = jax.random.normal(k2, (case.b, case.n, case.hk, case.d), jnp.float32).astype(dtype)
    v = jax.random.normal(k3, (case.b, case.n, case.hk, case.d), jnp.float32).astype(dtype)
    dout = jax.random.normal(k4, q.shape, jnp.float32).astype(dtype)
    return q, k, v, dout


def jit_vjp(fn):
    """``jit((q, k, v, dout) -> (fn(q, k, v), (dq, dk, dv)))``."""

    def run(q, k, v, dout):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(dout)

    return jax.jit(run)


def assert_matches_oracle(out, grads, ref, dtype) -> None:
    """Output and d{q,k,v} against an ``oracle.Result``, each to ``tol_for(dtype)`` relative
    to its own magnitude (``assert_scaled_close``)."""
    tol = tol_for(dtype)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), ref[:1] + ref[2:],
                               strict=True):
        assert got.dtype == jnp.dtype(dtype), name
        assert_scaled_close(got, want, tol, err_msg=name)


def run_case(case: DilatedCase | tuple, fn: DilatedFn, seed: int = 0) -> None:
    """Checks ``fn`` on ``case``: output and d{q,k,v} against the float64 oracle of the
    mask-based reference (on the same, possibly half-precision, inputs)."""
    case = DilatedCase(*case)
    q, k, v, dout = make_inputs(case, seed)
    out, grads = jit_vjp(
        lambda q, k, v: fn(q, k, v, case.ws, case.rs, is_causal=case.causal, mode=case.mode)
    )(q, k, v, dout)
    assert out.shape == q.shape
    ref = dilated_oracle(q, k, v, case.ws, case.rs, case.mode, case.causal, dout=dout)
    assert_matches_oracle(out, grads, ref, case.dtype)
