"""The check section of ``python -m benchmarks gpu``: every implementation of every attention
path against the reference, on the device, forward and gradients.

Each :data:`CASES` entry is one op configuration (dilated, causal + GQA, valid lengths, the
local window, block-sparse, a decode step, the dilated and block-sparse rings over all local
devices). For each dtype and head dim of the run, each implementation (``pallas``, ``cudnn``,
``xla``) is asked to run
it: a ``ValueError``/``NotImplementedError`` while tracing or lowering is the op's *refusal*
(recorded with its reason, the registry's words), anything else is an error. What runs is
compared with ``implementation="reference"`` (the mask-based dense reference of
docs/semantics.md) evaluated in float64 (``jax.enable_x64``, on the device) on the inputs
upcast from the checked dtype, so input rounding is not counted. The error of each output
(``out``, ``dq``, ``dk``, ``dv``) is ``max|x - ref| / max(1, max|ref|)``, against
:func:`tolerance`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import dilax

IMPLS = ("pallas", "cudnn", "xla")
REFUSALS = (ValueError, NotImplementedError)


def tolerance(dtype: str, backend: str) -> float:
    """The allowed scaled error of ``dtype`` results.

    bf16/fp16: 2e-2, the suite's ``tests/tolerance.HALF`` (a few ulps of bf16 at the output's
    scale; fp16 gets the same budget since its gradients pass through bf16-like softmax
    rounding of ``p``). float32: 1e-5 on a CPU (``tests/tolerance.FP32``); 5e-3 on a GPU, where
    float32 dots default to TF32 tensor-core products (10-bit mantissa: ~5e-4 per product) in
    the Pallas and XLA cores alike.
    """
    if np.dtype(dtype).itemsize < 4:
        return 2e-2
    return 1e-5 if backend == "cpu" else 5e-3


@dataclasses.dataclass(frozen=True)
class Shape:
    """The check shape: ``(b, n, h, hk, d)`` and the branches ``(ws, rs)``."""

    b: int
    n: int
    h: int
    hk: int
    d: int
    ws: tuple[int, ...]
    rs: tuple[int, ...]
    window: int
    block: int  # block-sparse block size


def check_shape(d: int, interpret: bool) -> Shape:
    if interpret:  # the Pallas interpreter: tiny, one 16-tile per block
        return Shape(b=2, n=64, h=4, hk=2, d=d, ws=(16, 32), rs=(1, 2), window=8, block=16)
    return Shape(b=2, n=1024, h=8, hk=2, d=d, ws=(256, 512), rs=(1, 2), window=128, block=64)


def _kw(fn: Callable, impl: str, interpret: bool) -> dict[str, Any]:
    """``implementation=impl`` plus ``interpret=True`` for Pallas where ``fn`` takes it."""
    kw: dict[str, Any] = dict(implementation=impl)
    if interpret and impl == "pallas" and "interpret" in inspect.signature(fn).parameters:
        kw["interpret"] = True
    return kw


def _lengths(s: Shape) -> tuple[jax.Array, jax.Array]:
    return (jnp.array([s.n, s.n * 5 // 8], jnp.int32)[: s.b],
            jnp.array([s.n * 3 // 4, s.n], jnp.int32)[: s.b])


# A case: name, what it checks, and ``build(shape, impl, interpret) -> f(q, k, v)`` (None for
# the decode and ring cases, which build their own programs).
def _dilated(causal: bool, heads_equal: bool, lengths: bool = False, window: bool = False):
    def build(s: Shape, impl: str, interpret: bool):
        def f(q, k, v):
            extra: dict[str, Any] = {}
            if lengths:
                extra["query_seq_lengths"], extra["key_value_seq_lengths"] = _lengths(s)
            if window:
                extra["local_window"] = s.window
            return dilax.dilated_attention(q, k, v, s.ws, s.rs, is_causal=causal,
                                           **extra, **_kw(dilax.dilated_attention, impl,
                                                          interpret))
        return f

    build.mha = heads_equal
    return build


def _block_sparse(s: Shape, impl: str, interpret: bool):
    from dilax import patterns

    pattern = patterns.local_window(s.n, s.block, 2 * s.block) | patterns.dilated(
        s.n, s.block, 2)
    return lambda q, k, v: dilax.block_sparse_attention(
        q, k, v, pattern, is_causal=True, **_kw(dilax.block_sparse_attention, impl, interpret))


_block_sparse.mha = False

CASES: dict[str, tuple[str, Callable | None]] = {
    "dilated": ("mixture, non-causal, h = hk", _dilated(False, True)),
    "causal-gqa": ("mixture, causal, GQA h/hk = 4", _dilated(True, False)),
    "lengths": ("causal GQA, query/key valid lengths per row",
                _dilated(True, False, lengths=True)),
    "window": ("causal GQA + local_window", _dilated(True, False, window=True)),
    "block-sparse": ("causal GQA, local window | dilated block pattern", _block_sparse),
    "decode": ("one decode step (t = 1) at context n, vs the causal reference's last row",
               None),
    "ring": ("causal GQA, sequence_parallel over a mesh of all local devices", None),
    "ring-block-sparse": ("causal GQA block-sparse (window | dilated blocks), "
                          "sequence_parallel over all local devices", None),
}


def _inputs(s: Shape, dtype, mha: bool, n: int | None = None, seed: int = 0):
    n = s.n if n is None else n
    hk = s.h if mha else s.hk
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    shapes = [(s.b, n, s.h, s.d), (s.b, n, hk, s.d), (s.b, n, hk, s.d), (s.b, n, s.h, s.d)]
    arrs = [jax.random.normal(key, shp, jnp.float32) for key, shp in zip(keys, shapes)]
    low = [a.astype(dtype) for a in arrs]
    return low, [a.astype(jnp.float32) for a in low]  # the reference sees the rounded inputs


def _with_grads(f: Callable) -> Callable:
    """``(q, k, v, g) -> (out, dq, dk, dv)``: one program for forward and backward."""
    def run(q, k, v, g):
        out, pull = jax.vjp(f, q, k, v)
        return (out, *pull(g.astype(out.dtype)))
    return run


def _errors(got, ref, names=("out", "dq", "dk", "dv")) -> dict[str, float]:
    out = {}
    for name, a, r in zip(names, got, ref):
        r = np.asarray(r, np.float64)
        a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
        out[name] = float(np.max(np.abs(a - r), initial=0.0) / max(1.0, np.max(np.abs(r),
                                                                              initial=0.0)))
    return out


def _reference(f_ref: Callable, args) -> Any:
    """``f_ref`` in float64 (as NumPy arrays: they leave the x64 context intact)."""
    with jax.enable_x64(True), jax.default_matmul_precision("highest"):
        out = jax.jit(f_ref)(*[np.asarray(a, np.float64) for a in args])
        return jax.tree.map(np.asarray, out)


def _case_programs(name: str, s: Shape, impl: str, interpret: bool, dtype):
    """``(program, args, reference program, reference args, output names)`` of one case."""
    if name == "decode":
        return _decode_programs(s, impl, dtype)
    if name in ("ring", "ring-block-sparse"):
        return _ring_programs(s, impl, interpret, dtype, block_sparse=name != "ring")
    build = CASES[name][1]
    low, ref = _inputs(s, dtype, build.mha)
    return (_with_grads(build(s, impl, interpret)), low,
            _with_grads(build(s, "reference", False)), ref, ("out", "dq", "dk", "dv"))


def _decode_programs(s: Shape, impl: str, dtype):
    """The new token at position ``n - 1`` with ``n - 1`` cached positions per row."""
    (q, k, v, _), ref = _inputs(s, dtype, False)
    n = s.n
    cache = dilax.KVCache(k.at[:, n - 1:].set(0), v.at[:, n - 1:].set(0),
                          jnp.full((s.b,), n - 1, jnp.int32))

    def step(q1, k1, v1, cache):
        return dilax.dilated_attention_decode(q1, k1, v1, cache, s.ws, s.rs,
                                              implementation=impl)[0]

    def full(q, k, v):
        return dilax.dilated_attention(q, k, v, s.ws, s.rs, is_causal=True,
                                       implementation="reference")[:, n - 1:]

    return (step, (q[:, n - 1:], k[:, n - 1:], v[:, n - 1:], cache), full, ref[:3], ("out",))


def _ring_programs(s: Shape, impl: str, interpret: bool, dtype, block_sparse: bool = False):
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    devices = jax.device_count()
    mesh = jax.make_mesh((devices,), ("sp",), axis_types=(AxisType.Auto,))
    sp = dilax.SequenceParallel(mesh, seq_axis="sp")
    unit = devices * (s.block if block_sparse else 1)  # whole blocks on every device
    n = -(-s.n // unit) * unit
    low, ref = _inputs(s, dtype, False, n=n)
    put = NamedSharding(mesh, PartitionSpec(None, "sp"))
    low = [jax.device_put(a, put) for a in low]
    op = dilax.block_sparse_attention if block_sparse else dilax.dilated_attention
    if block_sparse:
        from dilax import patterns

        pattern = patterns.local_window(n, s.block, 2 * s.block) | patterns.dilated(
            n, s.block, 2)
        args: tuple = (pattern,)
    else:
        args = (s.ws, s.rs)

    def ring(q, k, v):
        return op(q, k, v, *args, is_causal=True, sequence_parallel=sp,
                  **_kw(op, impl, interpret))

    def single(q, k, v):
        return op(q, k, v, *args, is_causal=True, implementation="reference")

    return _with_grads(ring), low, _with_grads(single), ref, ("out", "dq", "dk", "dv")


def run_checks(configs: list[tuple[str, int]], cases: list[str], impls: list[str], *,
               interpret: bool, budget, log: Callable[[str], None], bar,
               reserve: float = 0.0) -> list[dict]:
    """One result dict per (dtype, d, case, implementation): ``status`` ``"ok"`` / ``"fail"``
    (errors beyond tolerance) / ``"refused"`` (``reason``) / ``"error"`` (``reason``) /
    ``"skipped"`` (``reason``: one device for the ring, or the time budget, of which
    ``reserve`` seconds are kept for the timed sections)."""
    backend = jax.default_backend()
    rows = []
    for dtype, d in configs:
        s = check_shape(d, interpret)
        tol = tolerance(dtype, backend)
        for case in cases:
            refs: dict[str, Any] = {}
            for impl in impls:
                bar.set_postfix_str(f"check {case} {impl} {dtype} d={d}")
                row: dict[str, Any] = dict(section="check", case=case, what=CASES[case][0],
                                           implementation=impl, dtype=dtype, head_dim=d,
                                           n=s.n, tolerance=tol)
                if case.startswith("ring") and jax.device_count() < 2:
                    row.update(status="skipped", reason="the ring needs 2 or more devices; "
                               f"this process has {jax.device_count()}")
                elif not budget.allows(budget.check_estimate(impl), reserve):
                    row.update(status="skipped", reason=budget.note("check"))
                else:
                    row.update(_check_one(case, s, impl, interpret, dtype, tol, refs))
                    budget.check_seen(impl, row.get("seconds"))
                if row["status"] in ("fail", "error"):
                    log(f"check {case} {impl} {dtype} d={d}: {row['status']}: "
                        f"{row.get('reason', row.get('errors'))}")
                rows.append(row)
                bar.update()
    return rows


def _check_one(case, s, impl, interpret, dtype, tol, refs) -> dict[str, Any]:
    try:
        fn, args, ref_fn, ref_args, names = _case_programs(case, s, impl, interpret,
                                                           jnp.dtype(dtype))
        t0 = time.perf_counter()
        got = jax.block_until_ready(jax.jit(fn)(*args))
    except REFUSALS as e:
        return dict(status="refused", reason=f"{type(e).__name__}: {e}"[:600])
    except Exception as e:  # noqa: BLE001 - a compiler or runtime failure is a result
        return dict(status="error", reason=f"{type(e).__name__}: {e}"[:600])
    if "ref" not in refs:
        refs["ref"] = _reference(ref_fn, ref_args)
    seconds = time.perf_counter() - t0  # compile, run and (the first time) the reference
    got = got if isinstance(got, (tuple, list)) else (got,)
    ref = refs["ref"] if isinstance(refs["ref"], (tuple, list)) else (refs["ref"],)
    errors = _errors(got, ref, names)
    worst = max(errors.values())
    return dict(status="ok" if worst <= tol and np.isfinite(worst) else "fail",
                errors=errors, max_error=worst, seconds=round(seconds, 2))


def summary(rows: list[dict]) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    worst = functools.reduce(
        lambda acc, r: acc if acc and acc["max_error"] / acc["tolerance"] >= (
            r["max_error"] / r["tolerance"]) else r,
        [r for r in rows if "max_error" in r], None)
    return dict(counts=counts, passed=not counts.get("fail") and not counts.get("error"),
                worst=None if worst is None else dict(
                    case=worst["case"], implementation=worst["implementation"],
                    dtype=worst["dtype"], head_dim=worst["head_dim"],
                    max_error=worst["max_error"], tolerance=worst["tolerance"]))
