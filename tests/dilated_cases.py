"""Dilated-attention cases shared by every implementation's tests (XLA, Pallas, ...).

Usage from a test module::

    from dilated_cases import CASES, case_id, implementation, run_case

    @pytest.fixture(params=["xla", "pallas-interpret"])
    def dilated_impl(request):
        return implementation(request.param)

    @pytest.mark.parametrize("case", CASES, ids=case_id)
    def test_dilated_matches_reference(case, dilated_impl):
        run_case(case, dilated_impl)

``run_case`` checks the output and the gradients w.r.t. q, k, v against the mask-based
reference of SPEC.md (``dilax.reference``), fp32 to 1e-5 and half precision to 2e-2.
Shapes stay tiny: the Pallas interpreter on CPU compiles every kernel of every branch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import dilax
from dilax.reference import dilated_attention_reference

FP32_TOL = 1e-5
HALF_TOL = 2e-2  # |a - b| <= 2e-2 * max(1, |b|) for bfloat16 / float16
# Tests compile far more than they run (the Pallas interpreter especially): skip LLVM's
# expensive passes, ~40% less CPU per case. Numerics are unaffected at these tolerances.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


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
    # n = 1
    DilatedCase(1, 1, 2, 1, 16, (4, 2), (2, 1), "mixture", True),
    # head_dim 128 (one case: interpret mode is slow)
    DilatedCase(1, 32, 2, 1, 128, (16, 32), (1, 2), "mixture", True),
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


def make_qkv(case: DilatedCase, seed: int = 0):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    dtype = jnp.dtype(case.dtype)
    q = jax.random.normal(k1, (case.b, case.n, case.h, case.d), jnp.float32).astype(dtype)
    k = jax.random.normal(k2, (case.b, case.n, case.hk, case.d), jnp.float32).astype(dtype)
    v = jax.random.normal(k3, (case.b, case.n, case.hk, case.d), jnp.float32).astype(dtype)
    return q, k, v


def _loss_and_grad(fn):
    def loss(q, k, v):
        out = fn(q, k, v)
        # A fixed non-linear read-out so every output element gets its own cotangent.
        return jnp.sum(jnp.sin(out.astype(jnp.float32) * 1.3)), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True),
                   compiler_options=FAST_COMPILE)


def assert_close(actual, expected, dtype, what: str) -> None:
    actual = np.asarray(actual, np.float32)
    expected = np.asarray(expected, np.float32)
    assert not np.isnan(actual).any(), f"{what}: NaN"
    tol = FP32_TOL if jnp.dtype(dtype) == jnp.float32 else HALF_TOL
    np.testing.assert_allclose(actual, expected, atol=tol, rtol=tol, err_msg=what)


def run_case(case: DilatedCase | tuple, fn: DilatedFn, seed: int = 0) -> None:
    """Checks ``fn`` on ``case``: output and d{q,k,v} against the mask-based reference.

    The reference runs in float32 on the same (possibly half-precision) inputs.
    """
    case = DilatedCase(*case)
    q, k, v = make_qkv(case, seed)
    scale = 1.0 / float(np.sqrt(case.d))
    (_, out), grads = _loss_and_grad(
        lambda q, k, v: fn(q, k, v, case.ws, case.rs, is_causal=case.causal, mode=case.mode)
    )(q, k, v)
    (_, ref), ref_grads = _loss_and_grad(
        lambda q, k, v: dilated_attention_reference(
            q, k, v, case.ws, case.rs, is_causal=case.causal, scale=scale, mode=case.mode)
    )(*(x.astype(jnp.float32) for x in (q, k, v)))
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, ref, case.dtype, "out")
    for name, g, g_ref in zip("qkv", grads, ref_grads, strict=True):
        assert g.dtype == q.dtype
        assert_close(g, g_ref, case.dtype, f"d{name}")
