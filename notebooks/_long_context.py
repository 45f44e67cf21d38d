"""The cells of ``long_context.ipynb`` (262,144 tokens on a CPU, then ring attention), as
``(kind, text)`` pairs that ``notebooks/_build.py`` writes and executes."""

LONG_CONTEXT = [
    ("md", """
# Long context on a CPU: 262,144 tokens, then ring attention on 8 devices

Dilated attention costs `n * w / r` (query, key) pairs per branch and head — linear in `n` — and
dilax never materializes anything `n x n`, so a quarter-million-token sequence fits in a few
hundred MiB on a laptop CPU. The second half splits a sequence over 8 devices with
`dilax.dilated_attention(..., sequence_parallel=)` and checks it against the single-device op.

The notebook kernel is a fresh process, so the first cell asks XLA for 8 host (CPU) devices
*before* jax is imported. On a machine with 8 accelerators, leave the flag out.
"""),
    ("code", """
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import functools
import time

import jax
import jax.numpy as jnp

import dilax
from dilax.memory import format_bytes, memory_report

print(jax.device_count(), "devices:", jax.devices())
"""),
    ("md", """
## 262,144 tokens on one device

Causal, 2 query heads sharing 1 key/value head (MQA), head dimension 32, three branches.
`memory_report` compiles the function and reads XLA's buffer assignment before anything runs.
"""),
    ("code", """
# DILAX_NOTEBOOK_N: a shorter sequence for the test suite's quick run (tests/test_notebooks.py)
n = int(os.environ.get("DILAX_NOTEBOOK_N", 262_144))
b, h, hk, d = 1, 2, 1, 32
segment_lengths, dilation_rates = (512, 1024, 2048), (1, 2, 4)

attend = jax.jit(functools.partial(dilax.dilated_attention, segment_lengths=segment_lengths,
                                   dilation_rates=dilation_rates, is_causal=True))
spec_q = jax.ShapeDtypeStruct((b, n, h, d), jnp.float32)
spec_kv = jax.ShapeDtypeStruct((b, n, hk, d), jnp.float32)
report = memory_report(attend, spec_q, spec_kv, spec_kv)
qkvo = 4 * (2 * b * n * h * d + 2 * b * n * hk * d)
print("forward:", report)
print(f"q, k, v and out alone: {format_bytes(qkvo)}; peak / that = {report.peak_bytes / qkvo:.2f}")
print(f"dense attention would hold the {h} x n x n float32 scores: {format_bytes(4 * h * n * n)}")

grad_fn = jax.jit(jax.grad(lambda q, k, v: attend(q, k, v).sum(), argnums=(0, 1, 2)))
print("forward + backward:", memory_report(grad_fn, spec_q, spec_kv, spec_kv))
"""),
    ("code", """
kq, kk, kv = jax.random.split(jax.random.key(0), 3)
q = jax.random.normal(kq, (b, n, h, d))
k = jax.random.normal(kk, (b, n, hk, d))
v = jax.random.normal(kv, (b, n, hk, d))

t0 = time.perf_counter()
out = attend(q, k, v).block_until_ready()
t1 = time.perf_counter()
out = attend(q, k, v).block_until_ready()
t2 = time.perf_counter()
print(f"out {out.shape} {out.dtype}; first call (with compilation) {t1 - t0:.2f} s, "
      f"second call {t2 - t1:.2f} s = {n / (t2 - t1):,.0f} tokens/s")
"""),
    ("md", """
The attention is causal, so the first 1,024 positions must equal the op on the first 1,024
tokens alone — here checked against the explicit-mask reference implementation (its `n x n`
mask keeps it to short sequences):
"""),
    ("code", """
m = 1024
ref = dilax.dilated_attention(q[:, :m], k[:, :m], v[:, :m], segment_lengths, dilation_rates,
                              is_causal=True, implementation="reference")
err = float(jnp.abs(out[:, :m] - ref).max())
print(f"max |out[:, :{m}] - reference| = {err:.2e}")
assert err < 1e-5
"""),
    ("md", """
## Ring attention on 8 devices

`dilated_attention(..., sequence_parallel=dilax.SequenceParallel(mesh, "sp"))` shards the
sequence axis over the mesh axis `"sp"`: each device holds
`n / 8` consecutive positions. Branches whose segments fit in one shard run locally; longer
ones pass dilated K/V blocks around the devices that share a segment (`lax.ppermute`). The
result equals the single-device op on the gathered arrays.
"""),
    ("code", """
from jax.sharding import AxisType

mesh = jax.make_mesh((8,), ("sp",), axis_types=(AxisType.Auto,))
n_ring = 16_384
ring_cfg = dict(segment_lengths=(1024, 16_384), dilation_rates=(1, 4), is_causal=True)
qr, kr, vr = q[:, :n_ring], k[:, :n_ring], v[:, :n_ring]

ring = jax.jit(functools.partial(dilax.dilated_attention, **ring_cfg,
                                 sequence_parallel=dilax.SequenceParallel(mesh, "sp")))
single = jax.jit(functools.partial(dilax.dilated_attention, **ring_cfg))
per_device = memory_report(ring, qr, kr, vr)  # compiles; the calls below reuse it
one_device = memory_report(single, qr, kr, vr)
out_ring = ring(qr, kr, vr)
out_single = single(qr, kr, vr)
err = float(jnp.abs(out_ring - out_single).max())
print("output sharding:", out_ring.sharding.spec,
      "- per-device shard", out_ring.addressable_shards[0].data.shape)
print(f"max |ring - single device| = {err:.2e}")
assert err < 1e-5
"""),
    ("code", """
# Per-device memory (XLA's numbers for one device's program) vs the single-device op.
print("ring, per device:", per_device)
print("single device:   ", one_device)
print(f"ratio {per_device.peak_bytes / one_device.peak_bytes:.3f} (ideal 1/8 = 0.125)")
"""),
    ("md", """
Gradients go through the ring too (a `custom_vjp` whose backward pass is a second ring), so
`jax.grad` of a sharded loss keeps `O(n / P)` memory per device; the test suite checks them
against the single-device gradients.

On a cluster the same code runs unchanged after `jax.distributed.initialize()` on every host,
with the mesh built over all devices (`jax.make_mesh((jax.device_count(),), ("sp",), ...)`);
see the README's "Sequence parallel" section.
"""),
]
