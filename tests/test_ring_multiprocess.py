"""Ring attention across 2 processes x 4 CPU devices (jax.distributed + gloo collectives).

The test launches two worker processes on localhost (this file, run as a script) that call
``jax.distributed.initialize`` and compute ``sharded_dilated_attention`` with the sequence split
over all 8 devices of both processes. Each worker checks its addressable output shards and the
gradient shards against the float64 NumPy oracle (``tests/oracle.py``) on the full inputs.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 150


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_single_process():
    port = _free_port()
    env = dict(os.environ)
    from conftest import xla_flags  # here: this file also runs as the workers' script

    env["XLA_FLAGS"] = xla_flags(4)  # 4 host devices per process, the session's compile flags
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("JAX_PLATFORMS", None)
    procs = [
        subprocess.Popen([sys.executable, __file__, str(pid), str(port)], env=env, cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for pid in range(2)
    ]
    deadline = time.monotonic() + TIMEOUT_S
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for pid, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"worker {pid} failed:\n{out[-4000:]}"
        assert f"worker {pid} ok" in out, out[-4000:]


def _worker(pid: int, port: int) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=pid, initialization_timeout=60)
    import numpy as np
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as Ps
    from oracle import dilated as dilated_oracle  # this file's folder is the script's path[0]
    from tolerance import assert_scaled_close

    from dilax import sharded_dilated_attention

    assert jax.process_count() == 2 and jax.device_count() == 8, jax.devices()
    b, n, h, hk, d = 1, 128, 4, 2, 8
    ws, rs = (16, 128), (1, 4)
    rng = np.random.default_rng(0)  # same inputs in both processes
    q, k, v = (rng.standard_normal((b, n, hh, d), dtype=np.float32) for hh in (h, hk, hk))
    g = rng.standard_normal((b, n, h, d), dtype=np.float32)

    mesh = jax.make_mesh((8,), ("sp",), axis_types=(AxisType.Auto,))  # all devices, 2 hosts
    sharding = NamedSharding(mesh, Ps(None, "sp"))
    put = lambda x: jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    def value_and_grads(fn):
        """out and the gradient of sum(out * g) w.r.t. q, k, v: one compiled program."""

        def run(q, k, v, g):
            out, vjp = jax.vjp(fn, q, k, v)
            return out, vjp(g)

        return jax.jit(run)

    ring = lambda q, k, v: sharded_dilated_attention(q, k, v, ws, rs, mesh=mesh, is_causal=True)
    out, grads = value_and_grads(ring)(put(q), put(k), put(v), put(g))

    # NumPy, float64: nothing to compile next to the ring
    oracle = dilated_oracle(q, k, v, ws, rs, "mixture", True, dout=g)
    ref, ref_grads = oracle.out, (oracle.dq, oracle.dk, oracle.dv)

    for got, want in [(out, ref), *zip(grads, ref_grads, strict=True)]:
        assert len(got.addressable_shards) == 4
        for shard in got.addressable_shards:
            assert_scaled_close(shard.data, want[shard.index])
    print(f"worker {pid} ok", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]))
