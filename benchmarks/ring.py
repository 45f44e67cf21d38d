"""Ring (sequence-parallel) dilated attention: per-device memory, communication and time vs P.

Runs on whatever devices jax sees; on a CPU-only machine use fake host devices, e.g.::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.ring

``rows()`` must be called from a process whose ``XLA_FLAGS`` already provide the devices
(XLA reads the flag once, at start-up); ring sizes larger than the device count are skipped
with a warning. On fake host devices the timings measure the single CPU, not a cluster: they
show the overhead of the decomposition, not a speed-up.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from dilax import SequenceParallel, dilated_attention
from tools.gpu.hlo import collective_permute_bytes


def _memory(compiled) -> int:
    m = compiled.memory_analysis()
    return int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
               - m.alias_size_in_bytes)


def rows(
    n: int = 16384,
    h: int = 8,
    d: int = 64,
    devices: tuple[int, ...] = (1, 2, 4, 8),
    *,
    hk: int | None = None,
    segment_lengths: tuple[int, ...] | None = None,
    dilation_rates: tuple[int, ...] | None = None,
    is_causal: bool = True,
    batch: int = 1,
    repeats: int = 3,
    dtype=jnp.float32,
) -> list[dict]:
    """One row per ring size P: forward time, per-device memory (forward and training step) and
    bytes sent per device.

    P=1 is the single-device ``dilated_attention`` (no mesh; ``impl`` says which ran).
    Defaults: the LongNet-style configuration ``w = n/8, n/4, n/2, n`` with
    ``r = 1, 2, 4, 8`` and GQA ``hk = h / 4``. Keys: name ("ring"), P, n, ms_median,
    memory_bytes_per_device, permute_bytes_per_device, impl, h, hk, d, segment_lengths,
    dilation_rates, is_causal, device.
    """
    hk = hk or max(1, h // 4)
    if segment_lengths is None:
        segment_lengths = tuple(max(1, n // s) for s in (8, 4, 2, 1))
        dilation_rates = (1, 2, 4, 8)
    ws, rs = tuple(segment_lengths), tuple(dilation_rates)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    shapes = [(batch, n, h, d), (batch, n, hk, d), (batch, n, hk, d)]
    inputs = [jax.random.normal(key, s, dtype) for key, s in zip(keys, shapes, strict=True)]
    available = jax.device_count()
    out = []
    for P in devices:
        if P > available:
            warnings.warn(f"benchmarks.ring: skipping P={P}, only {available} devices (set "
                          f"XLA_FLAGS=--xla_force_host_platform_device_count={P})", stacklevel=2)
            continue
        if n % P:
            warnings.warn(f"benchmarks.ring: skipping P={P}, n={n} not divisible", stacklevel=2)
            continue
        if P == 1:
            fn = jax.jit(lambda q, k, v: dilated_attention(q, k, v, ws, rs, is_causal=is_causal))
            args = inputs
        else:
            mesh = jax.make_mesh((P,), ("sp",), axis_types=(AxisType.Auto,),
                                 devices=jax.devices()[:P])
            sharding = NamedSharding(mesh, PartitionSpec(None, "sp"))
            fn = jax.jit(lambda q, k, v, mesh=mesh: dilated_attention(
                q, k, v, ws, rs, is_causal=is_causal,
                sequence_parallel=SequenceParallel(mesh, "sp")), in_shardings=(sharding,) * 3)
            args = [jax.device_put(x, sharding) for x in inputs]
        compiled = fn.lower(*args).compile()
        # Training step (gradients of a scalar w.r.t. q, k, v): compiled for memory only.
        grad_fn = jax.jit(jax.grad(lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v)), argnums=(0, 1, 2)),
                          **({} if P == 1 else dict(in_shardings=(sharding,) * 3)))
        train_bytes = _memory(grad_fn.lower(*args).compile())
        jax.block_until_ready(compiled(*args))  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times.append((time.perf_counter() - t0) * 1e3)
        out.append(dict(
            name="ring", P=P, n=n,
            impl="dilated_attention(sequence_parallel=)" if P > 1 else "dilated_attention",
            ms_median=statistics.median(times),
            memory_bytes_per_device=_memory(compiled),
            train_step_memory_bytes_per_device=train_bytes,
            permute_bytes_per_device=collective_permute_bytes(compiled.as_text()),
            h=h, hk=hk, d=d, segment_lengths=ws, dilation_rates=rs, is_causal=is_causal,
            device=jax.devices()[0].platform,
        ))
    return out


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--h", type=int, default=8)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()
    print(f"{'name':>14} {'P':>3} {'n':>7} {'ms':>9} {'MiB/device':>11} {'train MiB':>10} "
          f"{'permute MiB':>12}")
    for row in rows(n=args.n, h=args.h, d=args.d, devices=tuple(args.devices)):
        print(f"{row['name']:>14} {row['P']:>3} {row['n']:>7} {row['ms_median']:>9.1f} "
              f"{row['memory_bytes_per_device'] / 2**20:>11.2f} "
              f"{row['train_step_memory_bytes_per_device'] / 2**20:>10.2f} "
              f"{row['permute_bytes_per_device'] / 2**20:>12.2f}")


if __name__ == "__main__":
    main()


_RING_CHILD = r"""
import json, sys
from benchmarks.ring import rows
cfg = json.loads(sys.argv[1])
print("JSON" + json.dumps(rows(n=cfg["n"], h=cfg["h"], d=cfg["d"], repeats=cfg["repeats"]),
                          default=str))
"""


def cmd(args, base_config: dict[str, Any]) -> dict[str, Any]:
    """``python -m benchmarks ring``: :func:`rows` on 8 fake host devices (a subprocess sets
    XLA_FLAGS before jax starts), as the CLI's result dict; ``--plan``: the model at scale
    (:mod:`benchmarks.ring_plan_cli`). ``base_config``: the CLI's common configuration."""
    if args.plan:
        from benchmarks.ring_plan_cli import cmd_plan

        return cmd_plan(args)
    n = args.n[0] if args.n else 16384
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        " --xla_force_host_platform_device_count=8").strip()
    proc = subprocess.run(
        [sys.executable, "-c", _RING_CHILD,
         json.dumps(dict(n=n, h=args.heads, d=args.head_dim, repeats=args.repeats))],
        capture_output=True, text=True, env=env, timeout=args.timeout)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("JSON")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"ring benchmark failed:\n{proc.stderr[-2000:]}")
    raw = json.loads(lines[-1][4:])
    rows = [dict(r, row=f"ring P={r['P']}", pass_="fwd",
                 memory_bytes=r["memory_bytes_per_device"]) for r in raw]
    # The training step (gradients w.r.t. q, k, v) per device: compiled for memory only.
    rows += [dict(row=f"ring P={r['P']}", n=r["n"], P=r["P"], pass_="fwd+bwd (memory only)",
                  memory_bytes=r["train_step_memory_bytes_per_device"]) for r in raw]
    base = next((r for r in raw if r["P"] == 1), None)
    summary = {}
    if base:
        for key, label in (("memory_bytes_per_device", "forward"),
                           ("train_step_memory_bytes_per_device", "training step")):
            summary.update({f"P={r['P']}: {label} memory per device / (single / P)":
                            round(r[key] / (base[key] / r["P"]), 3) for r in raw})
        summary["permute bytes per device"] = {f"P={r['P']}": r["permute_bytes_per_device"]
                                               for r in raw}
    first = raw[0]  # the ring's own configuration (LongNet-style w = n/8 .. n, GQA)
    config = dict(base_config, kv_heads=first["hk"], segment_lengths=first["segment_lengths"],
                  dilation_rates=first["dilation_rates"], causal=first["is_causal"])
    return dict(command="ring", config=config, rows=rows, summary=summary)
