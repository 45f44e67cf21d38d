"""Checks the ring plan's model (:mod:`benchmarks.ring_model`) against compiled programs.

Compiles the forward and the training step (grad of ``sum(out)`` w.r.t. q, k, v, as
:mod:`benchmarks.ring` does) of ``dilated_attention(..., sequence_parallel=)`` on 8..64 fake
host devices (one child process with ``--xla_force_host_platform_device_count``; nothing is
run) and compares ``memory_analysis`` (temp + argument + output - alias) and the
collective-permute bytes of the optimized HLO with the model.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
from typing import Any

import numpy as np

from benchmarks import ring_plan as RP

_CHILD = r"""
import json, shutil, sys, tempfile
import jax, jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec
from tools.gpu.hlo import collective_permute_bytes
from benchmarks.ring_plan_validate import live_peak
from dilax import SequenceParallel, dilated_attention
for case in json.loads(sys.argv[1]):
    P, n = case["P"], case["n"]
    ws, rs = tuple(case["ws"]), tuple(case["rs"])
    mesh = jax.make_mesh((P,), ("sp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:P])
    sh = NamedSharding(mesh, PartitionSpec(None, "sp"))
    dt = jnp.dtype(case["dtype"])
    f = lambda q, k, v: dilated_attention(q, k, v, ws, rs, is_causal=True,
                                          sequence_parallel=SequenceParallel(mesh, "sp"))
    if case["train"]:
        f = jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v).astype(jnp.float32)),
                     argnums=(0, 1, 2))
    b, h, hk, d = case["b"], case["h"], case["hk"], case["d"]
    spec = [jax.ShapeDtypeStruct((b, n, x, d), dt, sharding=sh) for x in (h, hk, hk)]
    dump = tempfile.mkdtemp()
    c = jax.jit(f, in_shardings=(sh,) * 3).lower(*spec).compile(compiler_options=dict(
        xla_dump_to=dump, xla_dump_hlo_as_text=True, xla_dump_hlo_pass_re="NONE"))
    peak = live_peak(dump)
    shutil.rmtree(dump, ignore_errors=True)
    ma = c.memory_analysis()
    total = (ma.temp_size_in_bytes + ma.argument_size_in_bytes + ma.output_size_in_bytes
             - ma.alias_size_in_bytes)
    print("JSON" + json.dumps(dict(case, compiled_bytes=int(total),
                                   compiled_live_peak=peak,
                                   compiled_sent=collective_permute_bytes(c.as_text()))),
          flush=True)
"""


def live_peak(dump_dir: str) -> int | None:
    """The most bytes of distinct buffer slots live at once in a compiled program, from
    XLA's dumps (``*buffer-assignment.txt``: each value's allocation, offset, size;
    ``*live-range.txt``: each value's live range). Values sharing a slot (in-place updates,
    loop carries) count once; the gap to ``memory_analysis`` is the heap's packing."""
    def read(suffix):
        return open(glob.glob(os.path.join(dump_dir, f"*after_optimizations-{suffix}"))[0]).read()

    try:
        ba, lr = read("buffer-assignment.txt"), read("live-range.txt")
    except (IndexError, OSError):
        return None
    slot, alloc = {}, None
    for line in ba.splitlines():
        m = re.match(r"allocation (\d+):", line)
        if m:
            alloc = int(m.group(1))
            continue
        m = re.match(r" value: <\d+ (\S+)(?: \(phi\))? @0> \(size=(\d+),offset=(\d+)\)", line)
        if m and alloc is not None:
            slot[m.group(1)] = (alloc, int(m.group(3)), int(m.group(2)))
    body = lr.split("BufferLiveRange:")[-1].split("Live ranges at")[0]
    ranges = re.findall(r"^    (\S+):(\d+)-(\d+)$", body, re.M)
    if not ranges:
        return None
    T = max(int(e) for _, _, e in ranges) + 2
    live: dict[tuple[int, int, int], np.ndarray] = {}
    for name, start, end in ranges:
        key = slot.get(name.replace("{}", ""))
        if key is not None:
            live.setdefault(key, np.zeros(T, bool))[int(start):int(end) + 1] = True
    total = np.zeros(T, np.int64)
    for (_, _, size), mask in live.items():
        total += mask * size
    return int(total.max())


def cases(devices=(8, 16, 32, 64), dtypes=("float32", "bfloat16")) -> list[dict[str, Any]]:
    """The ring benchmark's family (``w = n/8 .. n``, ``r = 1 .. 8``, ``n/P = 2048`` up to 16
    devices, 1024 above) and the 1B family scaled down (``w_i = (n/P)/8 2^i``, ``r_i = 2^i``,
    up to ``w = n``: local and spanning branches, 2 rows per device in the sparsest), forward
    and training step; the second dtype only on the smallest and the largest ring (compiles
    are slow on a shared 2-core machine)."""
    out = []
    for P in devices:
        dts = dtypes if P in (min(devices), max(devices)) else dtypes[:1]
        m = 2048 if P <= 16 else 1024
        n = P * m
        fams = [("ring", tuple(n // x for x in (8, 4, 2, 1)), (1, 2, 4, 8)),
                ("1B-scaled", *RP.longnet_config(n, m // 8))]
        for fam, ws, rs in fams:
            for dt in dts:
                for train in (False, True):
                    out.append(dict(family=fam, P=P, n=n, ws=list(ws), rs=list(rs), dtype=dt,
                                    train=train, b=1, h=8, hk=2, d=64))
    return out


def compile_cases(todo: list[dict[str, Any]], timeout: int = 3600,
                  log=None) -> list[dict[str, Any]]:
    """Compiles every case in one child process; ``log(case)`` is called as each finishes."""
    env = dict(os.environ)
    count = max(c["P"] for c in todo)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={count}").strip()
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(todo)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    done = []
    try:
        for line in proc.stdout:
            if line.startswith("JSON"):
                done.append(json.loads(line[4:]))
                if log is not None:
                    log(done[-1])
        err = proc.stderr.read()
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    if proc.returncode != 0:
        raise SystemExit(f"ring --plan validation failed:\n{err[-2000:]}")
    return done


# XLA:CPU computes (and sends) bfloat16 work in float32: see benchmarks.ring_model.Config.work_s.
CPU_WORK_ITEMSIZE = 4


def compare(done: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for c in done:
        cfg = RP.Config(c["n"], c["P"], tuple(c["ws"]), tuple(c["rs"]), c["b"], c["h"],
                        c["hk"], c["d"], 2 if c["dtype"] == "bfloat16" else 4, True,
                        work_s=CPU_WORK_ITEMSIZE, xla_cpu=True)
        mem = RP.memory(cfg, c["train"])
        sent = RP.communication(cfg, c["train"])["bytes_sent"]
        rows.append(dict(c, model_bytes=mem["bytes"], model_phase=mem["phase"],
                         model_sent=sent,
                         memory_error=mem["bytes"] / c["compiled_bytes"] - 1,
                         model_live=mem["live"],
                         live_peak_error=(mem["live"] / c["compiled_live_peak"] - 1
                                          if c.get("compiled_live_peak") else None),
                         sent_error=(sent / c["compiled_sent"] - 1) if c["compiled_sent"]
                         else float(sent != 0)))
    return rows


def validate(devices=(8, 16, 32, 64), dtypes=("float32", "bfloat16"),
             log=None) -> list[dict[str, Any]]:
    return compare(compile_cases(cases(devices, dtypes), log=log))


if __name__ == "__main__":
    P = [int(x) for x in sys.argv[1].split(",")] if len(sys.argv) > 1 else [8]
    dts = sys.argv[2].split(",") if len(sys.argv) > 2 else ["float32"]
    for r in validate(tuple(P), tuple(dts)):
        kind = "train" if r["train"] else "fwd"
        print(f"{r['family']:10s} P={r['P']:3d} {r['dtype']:9s} {kind:5s}"
              f" compiled {r['compiled_bytes'] / 2**20:8.2f} MiB model "
              f"{r['model_bytes'] / 2**20:8.2f} MiB err {100 * r['memory_error']:+6.1f}% "
              f"sent {r['compiled_sent']} vs {r['model_sent']} ({r['model_phase']})", flush=True)
