"""Block-sparse benchmark rows: forward time and compiled memory versus pattern density.

Every density runs the SAME code path (``dilax.block_sparse_attention``, XLA implementation)
on a :func:`dilax.patterns.random` pattern with that density (density 1.0 is the full mask),
so the ratio ``time(density) / time(1.0)`` shows how cost follows the active blocks.

    python -m benchmarks.block_sparse --n 16384
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from dilax import patterns
from dilax.block_sparse.api import block_sparse_attention

DEFAULT_BLOCK_SIZE = 256  # best of 64/128/256 on the 2-core CPU (n = 8192 trial)


def _memory_bytes(compiled) -> int | None:
    """temp + argument + output - alias bytes of a compiled program (None if unavailable)."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return int(stats.temp_size_in_bytes + stats.argument_size_in_bytes
               + stats.output_size_in_bytes - stats.alias_size_in_bytes)


def rows(
    n: int = 16384,
    h: int = 8,
    d: int = 64,
    densities: tuple[float, ...] = (0.1, 0.25, 0.5, 1.0),
    repeats: int = 3,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    batch: int = 1,
    is_causal: bool = False,
    seed: int = 0,
    dtype=jnp.float32,
    backward_memory: bool = False,
) -> list[dict]:
    """Times the jitted forward of block-sparse attention at each density.

    Returns one dict per density with keys ``name, density, n, ms_median, ms_min, ms_max,
    memory_bytes`` (plus ``block_size``, ``active_blocks``, ``max_active``, ``h``, ``d``, and
    ``memory_bytes_fwd_bwd`` of the compiled ``jax.grad`` program when ``backward_memory``).
    ``density`` is the pattern's measured density (random patterns round to whole blocks).
    """
    key = jax.random.PRNGKey(seed)
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (batch, n, h, d), dtype)
    k = jax.random.normal(kk, (batch, n, h, d), dtype)
    v = jax.random.normal(kv, (batch, n, h, d), dtype)
    out = []
    for density in densities:
        pattern = patterns.random(n, block_size, density, seed)
        fn = jax.jit(functools.partial(block_sparse_attention, pattern=pattern,
                                       is_causal=is_causal))
        compiled = fn.lower(q, k, v).compile()
        memory = _memory_bytes(compiled)
        grad_memory = None
        if backward_memory:
            loss = lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32))
            grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            grad_memory = _memory_bytes(grad.lower(q, k, v).compile())
        compiled(q, k, v).block_until_ready()  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            compiled(q, k, v).block_until_ready()
            times.append((time.perf_counter() - t0) * 1e3)
        out.append({
            "name": "block_sparse_xla" + ("_causal" if is_causal else ""),
            "density": pattern.causal_density if is_causal else pattern.density,
            "n": n,
            "ms_median": float(np.median(times)),
            "ms_min": float(np.min(times)),
            "ms_max": float(np.max(times)),
            "memory_bytes": memory,
            "block_size": block_size,
            "active_blocks": pattern.num_active_blocks(is_causal),
            "max_active": int(pattern.tables(is_causal)[0].shape[-1]),
            "h": h,
            "d": d,
            **({"memory_bytes_fwd_bwd": grad_memory} if backward_memory else {}),
        })
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--h", type=int, default=8)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--densities", type=float, nargs="+", default=[0.1, 0.25, 0.5, 1.0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--backward-memory", action="store_true",
                        help="also compile jax.grad and report its memory")
    args = parser.parse_args(argv)
    result = rows(args.n, args.h, args.d, tuple(args.densities), args.repeats,
                  block_size=args.block_size, is_causal=args.causal,
                  backward_memory=args.backward_memory)
    full = [r for r in result if r["density"] == 1.0]
    for r in result:
        ratio = f"{r['ms_median'] / full[0]['ms_median']:.3f}" if full else "-"
        mem = r["memory_bytes"] / 2**20 if r["memory_bytes"] is not None else float("nan")
        print(f"{r['name']:>18} n={r['n']} B={r['block_size']} density={r['density']:.3f} "
              f"median={r['ms_median']:.1f} ms (min {r['ms_min']:.1f}, max {r['ms_max']:.1f}) "
              f"ratio_to_dense={ratio} memory={mem:.1f} MiB"
              + (f" fwd+bwd memory={r['memory_bytes_fwd_bwd'] / 2**20:.1f} MiB"
                 if r.get("memory_bytes_fwd_bwd") else ""))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
