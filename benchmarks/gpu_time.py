"""The timed sections of ``python -m benchmarks gpu``: attention forward and forward+backward
of dilax and of jax's own kernels, and decode steps, under a time budget.

Effective TFLOP/s count the attended (query, key) pairs: ``4 * d`` FLOPs per pair forward,
``14 * d`` forward+backward (:mod:`benchmarks.rows`), so a causal row is charged half the
dense pairs and a dilated row only the pairs its branches compute.
"""

from __future__ import annotations

import functools
import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import dilax
from benchmarks import common
from benchmarks.rows import FWD_BWD_FLOPS_PER_PAIR, FWD_FLOPS_PER_PAIR
from dilax.branch.plan import attended_pairs
from tools.gpu.check import REFUSALS

PEAK_TFLOPS = 989.4  # H100 SXM5, dense bf16/fp16 tensor cores (no sparsity)
JAX_ROWS = ("jax-cudnn", "jax-mha", "jax-mgpu")
DILAX_ROWS = ("dense", "dilated")
ROW_GROUPS = JAX_ROWS + DILAX_ROWS + ("decode",)
# the dilated workload (mixture): LongNet-style branches, doubling w and r
DILATED_WS, DILATED_RS = (4096, 8192, 16384), (1, 2, 4)
DILATED_WS_TINY, DILATED_RS_TINY = (32, 64), (1, 2)


class Budget:
    """The run's time budget: each measurement asks first, with its estimated seconds."""

    def __init__(self, seconds: float, log: Callable[[str], None]):
        self.seconds, self.log = float(seconds), log
        self.start = time.monotonic()
        self.check_seconds: dict[str, float] = {}  # per implementation, the largest check
        self.skipped = 0

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.start)

    def allows(self, estimate: float, reserve: float = 0.0) -> bool:
        """Whether ``estimate`` seconds fit, keeping ``reserve`` seconds for later sections."""
        ok = self.left() - reserve >= estimate
        self.skipped += not ok
        return ok

    def note(self, what: str, estimate: float | None = None) -> str:
        est = "" if estimate is None else f"~{estimate:.0f} s needed, "
        return (f"time budget: {what} skipped ({est}{max(0.0, self.left()):.0f} s left of "
                f"--budget {self.seconds:.0f} s)")

    def check_estimate(self, impl: str) -> float:
        """Seconds of one check of ``impl``: its largest so far (a refusal costs a trace)."""
        return self.check_seconds.get(impl, 2.0)

    def check_seen(self, impl: str, seconds: float | None) -> None:
        if seconds:
            self.check_seconds[impl] = max(self.check_seconds.get(impl, 0.0), float(seconds))


def pairs_of(row: str, n: int, b: int, h: int, causal: bool, ws, rs) -> int:
    if row == "dilated":
        return b * attended_pairs(n, h, tuple(ws), tuple(rs), "mixture", causal)
    return b * h * (n * (n + 1) // 2 if causal else n * n)


def _jax_row(row: str, causal: bool, interpret: bool, d: int) -> Callable:
    """``f(q, k, v)`` of one of jax's kernels; raises a refusal where it cannot run here."""
    backend = jax.default_backend()
    if row == "jax-cudnn":
        if backend != "gpu":
            raise ValueError(f"jax's cuDNN attention needs a CUDA GPU (backend {backend!r})")
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                            implementation="cudnn")
    if row == "jax-mha":
        if backend != "gpu" and not interpret:
            raise ValueError(f"jax's Pallas Triton attention needs a GPU (backend {backend!r}; "
                             "--interpret runs it in the interpreter)")
        with warnings.catch_warnings():  # deprecated in favour of tokamax from jax 0.11.1
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu import attention
        return functools.partial(attention.mha, segment_ids=None, sm_scale=1 / math.sqrt(d),
                                 causal=causal, interpret=interpret and backend != "gpu")
    if row == "jax-mgpu":
        if backend != "gpu":
            raise ValueError("jax's Mosaic GPU attention needs a Hopper GPU and has no "
                             f"interpreter here (backend {backend!r})")
        try:
            from jax.experimental.pallas.ops.gpu import attention_mgpu as mgpu
        except Exception as e:  # noqa: BLE001 - any import failure means "not available"
            raise NotImplementedError(f"attention_mgpu does not import: {e}") from None
        config = mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2,
                                   causal=causal, block_q_dkv=64, block_kv_dkv=64,
                                   block_q_dq=64, block_kv_dq=64)
        return lambda q, k, v: mgpu.attention(q, k, v, config)
    raise ValueError(f"unknown row {row!r}")


def _dilax_row(row: str, impl: str, n: int, causal: bool, interpret: bool, ws, rs) -> Callable:
    ws, rs = ((n,), (1,)) if row == "dense" else (ws, rs)
    kw = dict(interpret=True) if interpret and impl == "pallas" else {}
    return lambda q, k, v: dilax.dilated_attention(q, k, v, ws, rs, is_causal=causal,
                                                   implementation=impl, **kw)


def _estimate(history: dict, key, n: int, repeats: int, power: int,
              default_compile: float) -> float:
    """Seconds of compile + warmup + repeats, scaled from this row's last measurement (as
    ``n ** power``; ``h * d`` is the same for every d)."""
    if key not in history:
        return default_compile
    n0, compile_s, call_s = history[key]
    return compile_s + (1 + repeats) * call_s * (n / n0) ** power


def tier(group: str, impl: str | None) -> int:
    """Measuring order: 0 the anchor pair (jax's cuDNN and dilax's dense Pallas kernel), 1 the
    other dense rows, 2 the dilated rows; the budget cuts the last tier first."""
    if group == "jax-cudnn" or (group == "dense" and impl == "pallas"):
        return 0
    return 2 if group == "dilated" else 1


def time_rows(ns, head_dims, groups, impls, *, dtype: str, causal: bool, repeats: int,
              interpret: bool, budget: Budget, bar, passes=("fwd", "fwd+bwd"),
              reserve: float = 0.0) -> list[dict[str, Any]]:
    """Forward and forward+backward of every (row, n, d), tier by tier (:func:`tier`), n
    ascending within a tier, so the budget cuts the largest sizes of the last tiers first
    (``reserve`` seconds are kept for the decode section). Shape per d: ``b = 1``,
    ``h = hk = max(1, 2048 // d)`` (hidden 2048, as FlashAttention's benchmarks), ``2`` heads
    under ``--interpret``. Rows come back in table order (row, d, n, pass)."""
    ws, rs = (DILATED_WS_TINY, DILATED_RS_TINY) if interpret else (DILATED_WS, DILATED_RS)
    specs = [(g, None) for g in groups if g in JAX_ROWS]
    specs += [(g, impl) for g in groups if g in DILAX_ROWS for impl in impls]
    history: dict = {}
    out = []
    for t in sorted({tier(*spec) for spec in specs}):
        for n in sorted(ns):
            for d in head_dims:
                h = 2 if interpret else max(1, 2048 // d)
                q, k, v = common.random_qkv(1, n, h, h, d, jnp.dtype(dtype))
                for group, impl in (spec for spec in specs if tier(*spec) == t):
                    for pas in passes:
                        out.append(_row(group, impl, n, d, h, pas, q, k, v, dtype=dtype,
                                        causal=causal, repeats=repeats, interpret=interpret,
                                        budget=budget, reserve=reserve, history=history,
                                        ws=ws, rs=rs, bar=bar))
                del q, k, v
    order = {spec: i for i, spec in enumerate(specs)}
    return sorted(out, key=lambda r: (order[r["group"], r["implementation"]], r["head_dim"],
                                      r["n"], list(passes).index(r["pass_"])))


def _row(group, impl, n, d, h, pas, q, k, v, *, dtype, causal, repeats, interpret, budget,
         reserve, history, ws, rs, bar) -> dict[str, Any]:
    """One timed (row, n, d, pass), or why not (refused, failed, skipped for the budget)."""
    name = group if impl is None else f"dilax-{group} {impl}"
    bar.set_postfix_str(f"{name} n={n} d={d} {pas}")
    pairs = pairs_of(group, n, 1, h, causal, ws, rs)
    rec: dict[str, Any] = dict(
        section="time", row=f"{name} d={d}", kernel=name, group=group, implementation=impl,
        n=n, head_dim=d, pass_=pas, batch=1, heads=h, kv_heads=h, dtype=dtype, causal=causal,
        pairs=pairs, flops=pairs * d * (FWD_FLOPS_PER_PAIR if pas == "fwd"
                                        else FWD_BWD_FLOPS_PER_PAIR))
    if group == "dilated":
        rec.update(segment_lengths=list(ws), dilation_rates=list(rs))
    key = (name, pas)
    est = _estimate(history, key, n, repeats, 1 if group == "dilated" else 2,
                    2.0 if interpret else 15.0)
    if not budget.allows(est, reserve):
        rec.update(status="skipped", reason=budget.note(f"{name} n={n} d={d} {pas}", est))
        budget.log(rec["reason"])
    else:
        rec.update(_measure(group, impl, n, d, pas, q, k, v, causal=causal,
                            interpret=interpret, repeats=repeats, ws=ws, rs=rs))
    if rec["status"] == "ok":
        history[key] = (n, rec["compile_s"], rec["ms_median"] / 1e3)
        rec["tflops"] = rec["flops"] / (rec["ms_median"] * 1e-3) / 1e12
        rec["pct_peak"] = 100 * rec["tflops"] / PEAK_TFLOPS
    elif rec["status"] == "refused" and key not in history:
        history[key] = (n, 0.5, 0.0)  # a refusal costs a trace, not a compile
    bar.update()
    return rec


def _measure(group, impl, n, d, pas, q, k, v, *, causal, interpret, repeats, ws, rs):
    try:
        fn = (_jax_row(group, causal, interpret, d) if impl is None
              else _dilax_row(group, impl, n, causal, interpret, ws, rs))
        fwd, fb = common.forward_and_backward(fn, q, k, v)
        t0 = time.perf_counter()
        compiled = (fwd if pas == "fwd" else fb).lower(q, k, v).compile()
        compile_s = time.perf_counter() - t0
    except REFUSALS as e:
        return dict(status="refused", reason=f"{type(e).__name__}: {e}"[:600])
    except Exception as e:  # noqa: BLE001 - the compiler's failure is a result, not a crash
        return dict(status="failed", reason=f"{type(e).__name__}: {e}"[:600])
    try:
        t = common.Timing.of(common.time_fn(lambda: compiled(q, k, v), repeats, warmup=1))
    except Exception as e:  # noqa: BLE001 - e.g. out of memory on the device
        return dict(status="failed", reason=f"run: {type(e).__name__}: {e}"[:600])
    return dict(status="ok", compile_s=round(compile_s, 2), ms_median=t.median_ms,
                ms_min=t.min_ms, ms_max=t.max_ms)


def decode_rows(ns, batches, impls, *, dtype: str, repeats: int, interpret: bool,
                budget: Budget, bar) -> list[dict[str, Any]]:
    """ms per generated token: one jitted :func:`dilax.dilated_attention_decode` step
    (``t = 1``, cache donated) at context ``n``, per implementation and batch size."""
    h, hk, d = (2, 1, 16) if interpret else (16, 4, 128)
    ws, rs = (DILATED_WS_TINY, DILATED_RS_TINY) if interpret else (DILATED_WS, DILATED_RS)
    out = []
    for n in sorted(ns):
        for b in batches:
            for impl in impls:
                bar.set_postfix_str(f"decode {impl} b={b} n={n}")
                rec: dict[str, Any] = dict(section="decode", row=f"decode {impl} b={b}",
                                           implementation=impl, n=n, batch=b, heads=h,
                                           kv_heads=hk, head_dim=d, dtype=dtype, pass_="decode",
                                           segment_lengths=list(ws), dilation_rates=list(rs))
                est = 2.0 if interpret else 10.0
                if not budget.allows(est):
                    rec.update(status="skipped", reason=budget.note(f"decode {impl} b={b} "
                                                                     f"n={n}", est))
                    budget.log(rec["reason"])
                else:
                    rec.update(_decode_one(n, b, h, hk, d, dtype, impl, ws, rs, repeats))
                out.append(rec)
                bar.update()
    return out


def _decode_one(n, b, h, hk, d, dtype, impl, ws, rs, repeats) -> dict[str, Any]:
    calls = max(3, 3 * repeats)
    dtype = jnp.dtype(dtype)
    keys = jax.random.split(jax.random.PRNGKey(3), 3)
    token = (jax.random.normal(keys[0], (b, 1, h, d), dtype),
             jax.random.normal(keys[1], (b, 1, hk, d), dtype),
             jax.random.normal(keys[2], (b, 1, hk, d), dtype))
    step = jax.jit(lambda q, k, v, cache: dilax.dilated_attention_decode(
        q, k, v, cache, ws, rs, implementation=impl), donate_argnums=3)
    try:
        cache = dilax.KVCache.init(b, n + calls + 2, hk, d, dtype).with_lengths(
            jnp.full((b,), n - 1, jnp.int32))
        t0 = time.perf_counter()
        o, cache = step(*token, cache)
        jax.block_until_ready(o)
        compile_s = time.perf_counter() - t0
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            o, cache = step(*token, cache)
            jax.block_until_ready(o)
            times.append(time.perf_counter() - t0)
    except REFUSALS as e:
        return dict(status="refused", reason=f"{type(e).__name__}: {e}"[:600])
    except Exception as e:  # noqa: BLE001 - a compiler or runtime failure is a result
        return dict(status="failed", reason=f"{type(e).__name__}: {e}"[:600])
    t = common.Timing.of(times)
    return dict(status="ok", compile_s=round(compile_s, 2), ms_median=t.median_ms,
                ms_min=t.min_ms, ms_max=t.max_ms, tokens_per_s=b / (t.median_ms * 1e-3))
