"""Decode benchmark: milliseconds per generated token against the context length.

Three ways to get the attention output of one new token at context ``n`` (b, h, d, dtype and
branches from the CLI), all measured in the same run, interleaved round by round (the machine
is shared, so only same-run medians are compared):

* ``dilax decode``: :func:`dilax.dilated_attention_decode`, ``t = 1``, jitted with the cache
  donated (updated in place). Reads at most ``w / r`` keys per branch: flat in ``n``.
* ``dense KV cache``: the same cache update, then ``jax.nn.dot_product_attention`` of the new
  query over the ``n`` cached keys (``key_value_seq_lengths``): linear in ``n``.
* ``full recomputation``: causal :func:`dilax.dilated_attention` over all ``n`` positions (what
  sampling without a cache does for every token): linear in ``n``; it stops at the first
  context where one token takes longer than ``full_limit_ms``.

``acceptance`` times the dilax step at two contexts (default 8,192 and 262,144) alternately and
reports the ratio of the medians.

    python -m benchmarks decode
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import dilax
from dilax import KVCache

ROW_DILAX = "dilax decode"
ROW_DENSE = "dense KV cache"
ROW_FULL = "full recomputation"


def _block(x):
    return jax.block_until_ready(x)


@functools.cache
def _dilax_step(ws, rs, mode):
    return jax.jit(functools.partial(dilax.dilated_attention_decode, segment_lengths=ws,
                                     dilation_rates=rs, mode=mode), donate_argnums=3)


@functools.cache
def _dense_step():
    def step(q, k, v, cache: KVCache):
        rows = jnp.arange(q.shape[0])[:, None]
        pos = cache.lengths[:, None]
        kc = cache.k.at[rows, pos].set(k, mode="drop")
        vc = cache.v.at[rows, pos].set(v, mode="drop")
        out = jax.nn.dot_product_attention(q, kc, vc, key_value_seq_lengths=cache.lengths + 1)
        return out, KVCache(kc, vc, cache.lengths + 1)

    return jax.jit(step, donate_argnums=3)


class _Holder:
    """The one cache of a context, passed (donated) from step to step of every variant."""

    def __init__(self, cache: KVCache):
        self.cache = cache


class _Stepper:
    """One decode variant at one context: steps the shared cache and times the calls."""

    def __init__(self, step, holder: _Holder, token):
        self.step, self.holder, self.token = step, holder, token
        self.times: list[float] = []
        self.call()  # compile + warm up

    def call(self) -> float:
        t0 = time.perf_counter()
        out, self.holder.cache = self.step(*self.token, self.holder.cache)
        _block(out)
        return time.perf_counter() - t0

    def measure(self, calls: int) -> None:
        self.times += [self.call() for _ in range(calls)]


def _cache_at(b, n, hk, d, dtype, slack):
    cache = KVCache.init(b, n + slack, hk, d, dtype)
    return cache.with_lengths(jnp.full((b,), n - 1, jnp.int32))


def _token(b, h, hk, d, dtype, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(k1, (b, 1, h, d), dtype), jax.random.normal(k2, (b, 1, hk, d), dtype),
            jax.random.normal(k3, (b, 1, hk, d), dtype))


def _stats(times: list[float]) -> dict[str, float]:
    ms = [1e3 * t for t in times]
    med = statistics.median(ms)
    return dict(ms_median=med, ms_min=min(ms), ms_max=max(ms), tokens_per_s=1e3 / med,
                calls=len(ms))


def rows(ns, *, b=1, h=8, hk=8, d=64, dtype="float32", ws=(1024, 2048, 4096), rs=(1, 2, 4),
         mode="mixture", rounds=5, calls=3, full_limit_ms=1000.0, memory_limit=None,
         log=print) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Times the three variants at every context in ``ns``; returns ``(rows, notes)``."""
    dtype = jnp.dtype(dtype)
    ws, rs = tuple(ws), tuple(rs)
    token = _token(b, h, hk, d, dtype)
    slack = 2 * rounds * calls + 8  # every call writes one position
    item = np.dtype(dtype).itemsize
    out, notes = [], {}
    full_on = True
    for n in sorted(ns):
        cache_bytes = 2 * b * (n + slack) * hk * d * item
        if memory_limit is not None and 2 * cache_bytes > memory_limit:
            notes[f"n={n}"] = f"skipped: the cache needs {cache_bytes / 2**30:.1f} GiB"
            log(f"n={n}: skipped (memory)")
            continue
        holder = _Holder(_cache_at(b, n, hk, d, dtype, slack))
        variants = {ROW_DILAX: _Stepper(_dilax_step(ws, rs, mode), holder, token),
                    ROW_DENSE: _Stepper(_dense_step(), holder, token)}
        full = None
        if full_on:
            qkv = tuple(jax.random.normal(jax.random.PRNGKey(i), (b, n, hh, d), dtype)
                        for i, hh in enumerate((h, hk, hk)))
            fn = jax.jit(functools.partial(dilax.dilated_attention, segment_lengths=ws,
                                           dilation_rates=rs, mode=mode, is_causal=True))
            _block(fn(*qkv))
            full = lambda fn=fn, qkv=qkv: _block(fn(*qkv))
            variants[ROW_FULL] = None
        full_times: list[float] = []
        for _ in range(rounds):  # interleaved: every variant once per round
            variants[ROW_DILAX].measure(calls)
            variants[ROW_DENSE].measure(calls)
            if full is not None:
                t0 = time.perf_counter()
                full()
                full_times.append(time.perf_counter() - t0)
        for name in (ROW_DILAX, ROW_DENSE):
            out.append(dict(row=name, n=n, pass_="decode", **_stats(variants[name].times)))
        if full is not None:
            rec = dict(row=ROW_FULL, n=n, pass_="decode", **_stats(full_times))
            out.append(rec)
            if rec["ms_median"] > full_limit_ms:
                full_on = False
                notes["full recomputation"] = (
                    f"stopped after n={n}: {rec['ms_median']:.0f} ms per token > "
                    f"{full_limit_ms:.0f} ms (it grows linearly with n)")
        log("  ".join(f"{r['row']} n={n}: {r['ms_median']:.2f} ms" for r in out if r["n"] == n))
        del variants, full, holder
    return out, notes


def acceptance(n_small=8192, n_large=262144, *, b=1, h=8, hk=8, d=64, dtype="float32",
               ws=(1024, 2048, 4096), rs=(1, 2, 4), mode="mixture", rounds=10,
               calls=5) -> dict[str, Any]:
    """One jitted dilax decode step at ``n_small`` and ``n_large``, timed alternately."""
    dtype = jnp.dtype(dtype)
    token = _token(b, h, hk, d, dtype)
    slack = rounds * calls + 8
    steppers = {n: _Stepper(_dilax_step(tuple(ws), tuple(rs), mode),
                            _Holder(_cache_at(b, n, hk, d, dtype, slack)), token)
                for n in (n_small, n_large)}
    for _ in range(rounds):
        for s in steppers.values():
            s.measure(calls)
    small, large = (_stats(steppers[n].times) for n in (n_small, n_large))
    return dict(n_small=n_small, n_large=n_large, ms_small=small["ms_median"],
                ms_large=large["ms_median"], ratio=large["ms_median"] / small["ms_median"],
                calls_each=small["calls"])
