"""Ring (sequence-parallel) dilated attention: per-device memory, communication and time vs P.

Runs on whatever devices jax sees; on a CPU-only machine use fake host devices, e.g.::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.ring

``rows()`` must be called from a process whose ``XLA_FLAGS`` already provide the devices
(XLA reads the flag once, at start-up); ring sizes larger than the device count are skipped
with a warning. On fake host devices the timings measure the single CPU, not a cluster: they
show the overhead of the decomposition, not a speed-up.
"""

from __future__ import annotations

import statistics
import time
import warnings

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from benchmarks.hlo import collective_permute_bytes
from dilax import dilated_attention, sharded_dilated_attention


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
            fn = jax.jit(lambda q, k, v, mesh=mesh: sharded_dilated_attention(
                q, k, v, ws, rs, mesh=mesh, is_causal=is_causal), in_shardings=(sharding,) * 3)
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
            impl="sharded_dilated_attention" if P > 1 else "dilated_attention",
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
