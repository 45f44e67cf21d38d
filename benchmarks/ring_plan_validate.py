"""Checks the ring plan's model (:mod:`benchmarks.ring_plan`) against compiled programs.

Compiles the forward and the training step (grad of ``sum(out)`` w.r.t. q, k, v, as
:mod:`benchmarks.ring` does) of ``sharded_dilated_attention`` on 8..64 fake host devices (one
child process with ``--xla_force_host_platform_device_count``; nothing is run) and compares
``memory_analysis`` (temp + argument + output - alias) and the collective-permute bytes of
the optimized HLO with the model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from benchmarks import ring_plan as RP

_CHILD = r"""
import json, sys
import jax, jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec
from benchmarks.hlo import collective_permute_bytes
from dilax import sharded_dilated_attention
for case in json.loads(sys.argv[1]):
    P, n = case["P"], case["n"]
    ws, rs = tuple(case["ws"]), tuple(case["rs"])
    mesh = jax.make_mesh((P,), ("sp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:P])
    sh = NamedSharding(mesh, PartitionSpec(None, "sp"))
    dt = jnp.dtype(case["dtype"])
    f = lambda q, k, v: sharded_dilated_attention(q, k, v, ws, rs, mesh=mesh, is_causal=True)
    if case["train"]:
        f = jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v).astype(jnp.float32)),
                     argnums=(0, 1, 2))
    b, h, hk, d = case["b"], case["h"], case["hk"], case["d"]
    spec = [jax.ShapeDtypeStruct((b, n, x, d), dt, sharding=sh) for x in (h, hk, hk)]
    c = jax.jit(f, in_shardings=(sh,) * 3).lower(*spec).compile()
    ma = c.memory_analysis()
    total = (ma.temp_size_in_bytes + ma.argument_size_in_bytes + ma.output_size_in_bytes
             - ma.alias_size_in_bytes)
    print("JSON" + json.dumps(dict(case, compiled_bytes=int(total),
                                   compiled_sent=collective_permute_bytes(c.as_text()))),
          flush=True)
"""


def cases(devices=(8, 16, 32, 64), dtypes=("float32", "bfloat16")) -> list[dict[str, Any]]:
    """The ring benchmark's family (``w = n/8 .. n``, ``r = 1 .. 8``, ``n/P = 2048`` up to 16
    devices, 1024 above) and the 1B family scaled down (``w_i = (n/P)/8 2^i``, ``r_i = 2^i``,
    up to ``w = n``: local and spanning branches, 2 rows per device in the sparsest), forward
    and training step."""
    out = []
    for P in devices:
        m = 2048 if P <= 16 else 1024
        n = P * m
        fams = [("ring", tuple(n // x for x in (8, 4, 2, 1)), (1, 2, 4, 8)),
                ("1B-scaled", *RP.longnet_config(n, m // 8))]
        for fam, ws, rs in fams:
            for dt in dtypes:
                for train in (False, True):
                    out.append(dict(family=fam, P=P, n=n, ws=list(ws), rs=list(rs), dtype=dt,
                                    train=train, b=1, h=8, hk=2, d=64))
    return out


def compile_cases(todo: list[dict[str, Any]], timeout: int = 3600) -> list[dict[str, Any]]:
    env = dict(os.environ)
    count = max(c["P"] for c in todo)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={count}").strip()
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(todo)], capture_output=True,
                          text=True, env=env, timeout=timeout)
    done = [json.loads(x[4:]) for x in proc.stdout.splitlines() if x.startswith("JSON")]
    if proc.returncode != 0:
        raise SystemExit(f"ring --plan validation failed:\n{proc.stderr[-2000:]}")
    return done


def compare(done: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for c in done:
        cfg = RP.Config(c["n"], c["P"], tuple(c["ws"]), tuple(c["rs"]), c["b"], c["h"],
                        c["hk"], c["d"], 2 if c["dtype"] == "bfloat16" else 4, True)
        mem = RP.memory(cfg, c["train"])
        sent = RP.communication(cfg, c["train"])["bytes_sent"]
        rows.append(dict(c, model_bytes=mem["bytes"], model_phase=mem["phase"],
                         model_sent=sent,
                         memory_error=mem["bytes"] / c["compiled_bytes"] - 1,
                         sent_error=(sent / c["compiled_sent"] - 1) if c["compiled_sent"]
                         else float(sent != 0)))
    return rows


def validate(devices=(8, 16, 32, 64), dtypes=("float32", "bfloat16")) -> list[dict[str, Any]]:
    return compare(compile_cases(cases(devices, dtypes)))


if __name__ == "__main__":
    P = [int(x) for x in sys.argv[1].split(",")] if len(sys.argv) > 1 else [8]
    dts = sys.argv[2].split(",") if len(sys.argv) > 2 else ["float32"]
    for r in validate(tuple(P), tuple(dts)):
        kind = "train" if r["train"] else "fwd"
        print(f"{r['family']:10s} P={r['P']:3d} {r['dtype']:9s} {kind:5s}"
              f" compiled {r['compiled_bytes'] / 2**20:8.2f} MiB model "
              f"{r['model_bytes'] / 2**20:8.2f} MiB err {100 * r['memory_error']:+6.1f}% "
              f"sent {r['compiled_sent']} vs {r['model_sent']} ({r['model_phase']})", flush=True)
