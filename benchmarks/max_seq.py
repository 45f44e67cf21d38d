"""``python -m benchmarks max-seq``: doubles n until XLA's memory estimate exceeds the machine
or a run fails; each attempt compiles and runs in a child process (``_MAXSEQ_CHILD``), so an
out-of-memory kill ends that attempt, not the benchmark."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from benchmarks.common import memory_limit, progress
from benchmarks.rows import config_of
from dilax.memory import format_bytes

_MAXSEQ_CHILD = r"""
import json, sys, time, jax, jax.numpy as jnp
import dilax
from dilax.memory import memory_report
cfg = json.loads(sys.argv[1]); n = cfg["n"]
shape_q = (cfg["batch"], n, cfg["heads"], cfg["head_dim"])
shape_kv = (cfg["batch"], n, cfg["kv_heads"], cfg["head_dim"])
dt = jnp.dtype(cfg["dtype"])
f = lambda q, k, v: dilax.dilated_attention(q, k, v, tuple(cfg["segment_lengths"]),
    tuple(cfg["dilation_rates"]), is_causal=cfg["causal"], mode=cfg["mode"])
if cfg["pass"] == "fwd+bwd":
    g = lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32))
    fn = jax.jit(jax.grad(g, argnums=(0, 1, 2)))
else:
    fn = jax.jit(f)
spec = [jax.ShapeDtypeStruct(shape_q, dt), jax.ShapeDtypeStruct(shape_kv, dt),
        jax.ShapeDtypeStruct(shape_kv, dt)]
compiled = fn.lower(*spec).compile()
m = compiled.memory_analysis()
peak = (m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
        - m.alias_size_in_bytes)
print(json.dumps({"stage": "compiled", "memory_bytes": int(peak)}), flush=True)
if peak > cfg["limit"]:
    print(json.dumps({"stage": "skipped", "memory_bytes": int(peak)}), flush=True)
    sys.exit(0)
key = jax.random.PRNGKey(0)
q = jax.random.normal(key, shape_q, dt); k = jax.random.normal(key, shape_kv, dt); v = k
t0 = time.perf_counter()
out = jax.block_until_ready(compiled(q, k, v))
dt_s = time.perf_counter() - t0
finite = all(bool(jnp.isfinite(o).all()) for o in jax.tree.leaves(out))
print(json.dumps({"stage": "ran", "memory_bytes": int(peak), "seconds": dt_s,
                  "finite": finite}), flush=True)
"""


def cmd_max_seq(args) -> dict[str, Any]:
    """Doubles n until XLA's memory estimate exceeds the machine, or a run fails."""
    cfg = config_of(args)
    limit = memory_limit()
    rows = []
    passes = ["fwd", "fwd+bwd"]
    largest = {}
    bar = progress(len(passes) * len(args.n), "max-seq", args.quiet)
    for pas in passes:
        for n in sorted(args.n):
            child_cfg = dict(cfg, n=n, mode=args.mode, limit=limit, **{"pass": pas})
            rec: dict[str, Any] = dict(row=f"dilax-{args.mode}", n=n, pass_=pas)
            bar.set_postfix_str(f"{pas} n={n}")
            try:
                proc = subprocess.run(
                    [sys.executable, "-c", _MAXSEQ_CHILD, json.dumps(child_cfg)],
                    capture_output=True, text=True, timeout=args.timeout,
                )
                lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
                last = lines[-1] if lines else {}
                rec.update({k: v for k, v in last.items() if k != "stage"})
                if last.get("stage") == "ran" and last.get("finite"):
                    rec["status"] = "ok"
                    largest[pas] = n
                elif last.get("stage") == "skipped":
                    rec["status"] = f"does not fit ({format_bytes(last['memory_bytes'])})"
                else:
                    rec["status"] = f"failed (exit {proc.returncode}): {proc.stderr[-300:]}"
            except subprocess.TimeoutExpired:
                rec["status"] = f"timed out after {args.timeout} s"
            rows.append(rec)
            bar.update()
            if rec["status"] != "ok":
                bar.update(len([m for m in args.n if m > n]))
                break
    bar.close()
    return dict(command="max-seq", config=dict(cfg, mode=args.mode), rows=rows,
                summary={"largest_n": largest, "memory_limit_bytes": limit})
