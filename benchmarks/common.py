"""Timing, FLOP and memory helpers (and the progress bar) shared by every benchmark command."""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dilax.memory import memory_report

MATMUL_N = 2048


def machine_description() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "jax": jax.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
    }


def block(x):
    return jax.block_until_ready(x)


def time_fn(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
    """Wall-clock seconds of ``repeats`` calls after ``warmup`` calls (results blocked on)."""
    for _ in range(warmup):
        block(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        block(fn())
        times.append(time.perf_counter() - t0)
    return times


class MatmulProbe:
    """Same-run fp32 matmul throughput, the yardstick for % of machine peak.

    The machine is noisy (other processes, frequency scaling), so the probe is not taken once
    but interleaved with each row's timed calls (:func:`time_interleaved`): the row and its
    probe see the same machine, and "% matmul" cannot exceed 100 because the probe happened to
    run at a busier moment than the row.
    """

    def __init__(self, n: int = MATMUL_N, dtype=jnp.float32):
        self.n = n
        self.a = jax.random.normal(jax.random.PRNGKey(1), (n, n), dtype)
        self.fn = jax.jit(lambda a: a @ a)
        block(self.fn(self.a))

    @property
    def flops(self) -> float:
        return 2 * self.n**3

    def call(self):
        return self.fn(self.a)

    def gflops(self, repeats: int = 5) -> float:
        t = statistics.median(time_fn(self.call, repeats, warmup=1))
        return self.flops / t / 1e9


# calls at least this long need no warmup run (time_interleaved)
LONG_CALL_S = 1.0


def time_interleaved(fn: Callable[[], Any], probe: MatmulProbe, repeats: int,
                     warmup: int = 1) -> tuple[list[float], float]:
    """``(seconds of each of fn's repeats, the probe's GFLOP/s)``.

    One probe call is timed before each call of ``fn`` and one after the last (after
    ``warmup`` calls of both), so the probe samples the same stretch of time as ``fn``. The
    probe's figure is its best call: a busy moment can then only lower a row's "% matmul",
    never raise it above what the machine's matmul does. A warmup call that takes at least
    :data:`LONG_CALL_S` (``fn`` is compiled beforehand) counts as the first timed call.
    """
    times, probe_times = [], []
    for _ in range(warmup):
        block(probe.call())
        t1 = time.perf_counter()
        block(fn())
        if time.perf_counter() - t1 >= LONG_CALL_S:
            # A call this long (compiled before) gains nothing from a warmup run: count it,
            # with the probe timed just before it.
            times.append(time.perf_counter() - t1)
            t0 = time.perf_counter()
            block(probe.call())
            probe_times.append(time.perf_counter() - t0)
    for _ in range(repeats - len(times)):
        t0 = time.perf_counter()
        block(probe.call())
        t1 = time.perf_counter()
        block(fn())
        times.append(time.perf_counter() - t1)
        probe_times.append(t1 - t0)
    t0 = time.perf_counter()
    block(probe.call())
    probe_times.append(time.perf_counter() - t0)
    return times, probe.flops / min(probe_times) / 1e9


@dataclasses.dataclass
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float

    @classmethod
    def of(cls, seconds: list[float]) -> Timing:
        return cls(1e3 * statistics.median(seconds), 1e3 * min(seconds), 1e3 * max(seconds))


def forward_and_backward(fn: Callable[..., jax.Array], *args):
    """``jit``-ed forward and forward+backward (gradients w.r.t. every argument)."""
    fwd = jax.jit(fn)
    ct = jax.random.normal(jax.random.PRNGKey(7), jax.eval_shape(fn, *args).shape, args[0].dtype)

    def loss(*a):
        return jnp.vdot(fn(*a).astype(jnp.float32), ct.astype(jnp.float32))

    bwd = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))
    return fwd, bwd


def peak_bytes(jitted, *args) -> int:
    return memory_report(jitted, *args).peak_bytes


def random_qkv(b: int, n: int, h: int, hk: int, d: int, dtype) -> tuple[jax.Array, ...]:
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(k1, (b, n, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(k2, (b, n, hk, d), jnp.float32).astype(dtype)
    v = jax.random.normal(k3, (b, n, hk, d), jnp.float32).astype(dtype)
    return q, k, v


def qkvo_bytes(b: int, n: int, h: int, hk: int, d: int, dtype) -> int:
    """Bytes of q, k, v and the output: the floor no attention can go below."""
    item = np.dtype(jnp.dtype(dtype)).itemsize
    return item * b * n * d * (2 * h + 2 * hk)


def progress(total: int, desc: str, quiet: bool):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # progress bars are a dev extra
        tqdm = None
    if tqdm is None or quiet:
        class _Null:
            def update(self, *_):
                pass

            def set_postfix_str(self, *_):
                pass

            def close(self):
                pass

        return _Null()
    return tqdm(total=total, desc=desc, unit="run", leave=False, file=sys.stderr)


def memory_limit() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.75)
    except (ValueError, OSError, AttributeError):
        return 16 << 30


def default_out(command: str) -> str:
    """``benchmarks/runs/<date>-<time>-<command>``: a fresh, git-ignored folder per run."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return os.path.join(os.path.dirname(__file__), "runs", f"{stamp}-{command}")
