"""Deviceless XLA:GPU compiles: every public op of dilax compiled for an H100 and an A100.

No GPU is needed. With ``jax[cuda12]`` installed (the same jax version), XLA:GPU compiles
ahead of time for a device described by a ``GpuTargetConfigProto`` (our own spec files from
NVIDIA's public figures, ``tools/gpu/targets/*.txtpb``)::

    topo = jax.experimental.topologies.get_topology_desc(
        platform="cuda", topology="1x1x1", target_config=<spec text>)
    jax.jit(f).lower(*<ShapeDtypeStructs placed on topo's mesh>).compile()

in a process with ``JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``. This runs XLA's
real GPU pipeline: the Pallas Triton lowering, Triton, LLVM and ptxas (a kernel that needs
more shared memory than the target has fails here, as it would on the GPU).

Two things come out of one run (``python -m benchmarks gpu-compile``, or ``make gpu-check``):

* **the check**: a covering list of configurations (:func:`cases`), each with its expected
  outcome: ``ok`` (must compile) or ``refused`` (the op itself must raise ``ValueError``
  naming the rule, never leave it to the compiler). Any other outcome fails the run (exit 1).
* **the program check**: in the optimized HLO of every compiled program, its kernel calls
  (Pallas, cuDNN fused attention) and its XLA matmuls (``dot``s, fused or not, and cuBLAS
  GEMMs), :func:`tools.gpu.hlo.program_counts`. A case marked ``no_xla_matmul`` (every
  Pallas attention program) fails unless it calls a kernel and has no XLA matmul at all.
* **the resource report** of every Pallas kernel (dilax's and jax's reference Triton
  attention, compiled in the same run): from XLA's dump (``xla_dump_to``) the launch grid,
  threads and shared memory of each kernel (``*.thunk_sequence.txt``), and its PTX, which
  ``ptxas -v`` (from the ``nvidia-cuda-nvcc`` wheel) compiles again for registers, spills
  and stack; the tensor-core instruction family is read from the PTX (``wgmma`` on sm_90,
  ``mma.sync`` on sm_80). Plus an **estimated** fraction of peak, :func:`roofline`.

Written to ``benchmarks/results/gpu-compile.{md,json}`` (``--out`` elsewhere). Each target
runs in its own process (two at a time), since a process compiles for one topology at a time
and the environment must be set before jax starts.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

from tools.gpu.cases import (  # noqa: F401 - Target, Case, report_cases re-exported
    TARGETS,
    Case,
    Target,
    cases,
    loss_grad,
    report_cases,
)
from tools.gpu.hlo import program_counts
from tools.gpu.report import kernel_resources, markdown, ptxas_path, roofline

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SPEC_DIR = os.path.join(HERE, "targets")
ENV = {"JAX_PLATFORMS": "cpu", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}


# --------------------------------------------------------------------------------------------
# Compiling one target (runs in a child process with ENV set before jax starts)
# --------------------------------------------------------------------------------------------


def _place(tree, sharding):
    import jax

    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                        tree)


def work_items(targets: list[str], only: str | None = None) -> list[tuple[str, int]]:
    """``(target, case index)`` pairs to compile, in a fixed order."""
    all_cases = cases()
    return [(key, i) for key in targets for i, c in enumerate(all_cases)
            if key in c.targets and (not only or only in c.name)]


def program_problem(row: dict) -> str | None:
    """Why a compiled program fails its case's expectation on kernel calls and XLA matmuls
    (``row``: :func:`tools.gpu.hlo.program_counts` plus the case's ``no_xla_matmul``);
    ``None`` when it meets it. A Pallas attention program must call a kernel and have no
    XLA matmul: one would be attention (or part of it) left to XLA."""
    if row.get("no_xla_matmul") and (row["xla_matmuls"] or not row["kernel_calls"]):
        return (f"a Pallas attention program with {row['kernel_calls']} kernel calls and "
                f"{row['xla_matmuls']} XLA matmuls {row['matmul_ops']} (required: at least "
                "one kernel call, no XLA matmul)")
    return None


def spill_problem(model: dict | None, kernels: list[dict]) -> str | None:
    """Why a reported program's dilax kernels fail the no-spill rule (bf16/fp16 at head dim
    <= 128: a spill there is a tile or register budget to fix, issue 29); ``None`` when they
    meet it or the rule does not apply (fp32, d > 128, jax's own kernels)."""
    if not model or model["dtype"] not in ("bfloat16", "float16") or model["d"] > 128:
        return None
    spilled = [f"{k['kernel']} ({k.get('spill_stores')}/{k.get('spill_loads')} B)"
               for k in kernels if k["kernel"].startswith("dilax_")
               and (k.get("spill_stores") or k.get("spill_loads"))]
    if spilled:
        return ("register spills in " + ", ".join(spilled) + " (required: none in bf16/fp16 "
                "at head dim <= 128)")
    return None


def compile_items(items: list[tuple[str, int]]) -> list[dict]:
    """Compiles ``items`` (see :func:`work_items`) in this process; one result row each."""
    import jax
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    all_cases = cases()
    topos: dict[tuple[str, int], Any] = {}

    def mesh_of(key: str, devices: int, axis: str) -> Mesh:
        if (key, devices) not in topos:
            with open(os.path.join(SPEC_DIR, TARGETS[key].spec)) as f:
                spec = f.read()
            topos[key, devices] = topologies.get_topology_desc(
                platform="cuda", topology=f"1x1x{devices}", target_config=spec)
        return Mesh(np.array(topos[key, devices].devices[:devices]), (axis,))

    ptxas = ptxas_path()
    results = []
    for key, index in items:
        case, target = all_cases[index], TARGETS[key]
        row = dict(target=key, name=case.name, op=case.op, expect=case.expect, why=case.why)
        t0 = time.time()
        dump = tempfile.mkdtemp(prefix="dilax-gpu-") if case.report else None
        try:
            built = case.build()
            if case.devices > 1:  # sharded over the sequence of a multi-GPU topology
                mesh = mesh_of(key, case.devices, "sp")
                f, args, grad = built
                fn = (lambda *a, f=f, mesh=mesh: f(*a, mesh))
                fn = loss_grad(fn) if grad else fn
                args = _place(args, NamedSharding(mesh, P(None, "sp")))
            else:
                fn, args = built
                args = _place(args, NamedSharding(mesh_of(key, 1, "x"), P()))
            opts = {"xla_dump_to": dump} if dump else {}
            compiled = jax.jit(fn).lower(*args).compile(compiler_options=opts)
            row["outcome"] = "ok"
            row.update(program_counts(compiled.as_text()))
        except ValueError as e:
            row["outcome"], row["error"] = "refused", f"ValueError: {e}"
        except Exception as e:  # noqa: BLE001 - the compiler's or jax's failure, reported
            row["outcome"] = "error"
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
            row["traceback"] = traceback.format_exc()[-3000:]
        row["seconds"] = round(time.time() - t0, 2)
        row["no_xla_matmul"] = case.no_xla_matmul
        row["passed"] = row["outcome"] == case.expect
        problem = program_problem(row) if row["outcome"] == "ok" else None
        if problem:
            row["passed"], row["error"] = False, problem
        if dump:
            if row["outcome"] == "ok":
                row["kernels"] = kernel_resources(dump, target, ptxas)
                for k in row["kernels"]:
                    k["estimate"] = roofline(case.report, k, target)
                row["model"] = case.report
                problem = spill_problem(case.report, row["kernels"])
                if problem:
                    row["passed"], row["error"] = False, problem
            shutil.rmtree(dump, ignore_errors=True)
        results.append(row)
        status = "PASS" if row["passed"] else "FAIL"
        counts = (f"  [{row['kernel_calls']} kernel + {row['cudnn_calls']} cuDNN calls, "
                  f"{row['xla_matmuls']} XLA matmuls]" if row["outcome"] == "ok" else "")
        print(f"[{key}] {status} {row['outcome']:8s} {row['seconds']:6.1f}s  {case.name}"
              + counts
              + ("" if row["passed"] else f"\n    {row.get('error', '')[:600]}"), flush=True)
    return results



def run(targets: list[str], out_dir: str, only: str | None = None, jobs: int = 2) -> int:
    """Compiles every case of ``targets`` in ``jobs`` child processes (the (target, case)
    pairs dealt round-robin), writes ``gpu-compile.{json,md}`` to ``out_dir``; returns 0 when
    every case had its expected outcome."""
    import jax

    t0 = time.time()
    env = dict(os.environ, **ENV)
    env["PYTHONPATH"] = os.pathsep.join(
        [REPO] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    items = work_items(targets, only)
    jobs = max(1, min(jobs, len(items)))
    tmp = tempfile.mkdtemp(prefix="dilax-gpu-compile-")
    children = []
    for shard in range(jobs):
        path = os.path.join(tmp, f"shard{shard}.json")
        cmd = [sys.executable, "-m", "tools.gpu.compile", "--child", f"{shard}/{jobs}",
               "--targets", ",".join(targets), "--json", path]
        if only:
            cmd += ["--only", only]
        children.append((subprocess.Popen(cmd, env=env), path))
    rows, passed = [], True
    for proc, path in children:
        proc.wait()
        if proc.returncode != 0 or not os.path.exists(path):
            print(f"gpu-compile: a child process failed (exit {proc.returncode})",
                  file=sys.stderr)
            passed = False
            continue
        with open(path) as f:
            rows += json.load(f)
    shutil.rmtree(tmp, ignore_errors=True)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    order = {item: i for i, item in enumerate(items)}
    names = {c.name: i for i, c in enumerate(cases())}
    rows.sort(key=lambda r: order.get((r["target"], names.get(r["name"], -1)), 0))
    passed &= len(rows) == len(items) and all(r["passed"] for r in rows)
    result = dict(command="gpu-compile", date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  jax=jax.__version__, cores=os.cpu_count(), jobs=jobs, passed=passed,
                  wall_seconds=round(time.time() - t0, 1), ptxas=ptxas_path() is not None,
                  cpu_seconds=round(usage.ru_utime + usage.ru_stime, 1),
                  targets=[dict(target=key, target_name=TARGETS[key].name,
                                cases=[r for r in rows if r["target"] == key])
                           for key in targets])
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "gpu-compile.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out_dir, "gpu-compile.md"), "w") as f:
        f.write(markdown(result))
    print(f"\ngpu-compile: {len(rows)} compiles in {result['wall_seconds']:.0f} s; wrote "
          f"{out_dir}/gpu-compile.{{md,json}}")
    for r in rows:
        if not r["passed"]:
            print(f"  FAILED [{r['target']}] {r['name']}: {r['outcome']} (expected "
                  f"{r['expect']})" + (f": {r['error']}" if r["outcome"] == r["expect"] else ""))
    return 0 if passed else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks gpu-compile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", default="h100,a100", help="comma-separated: h100,a100")
    p.add_argument("--only", default=None, help="only cases whose name contains this")
    p.add_argument("--jobs", type=int, default=2, help="compiling processes")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    targets = [t for t in args.targets.split(",") if t]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise SystemExit(f"unknown targets {unknown}; choose from {sorted(TARGETS)}")
    if args.child:
        shard, num = (int(x) for x in args.child.split("/"))
        items = work_items(targets, args.only)[shard::num]
        with open(args.json, "w") as f:
            json.dump(compile_items(items), f, indent=1)
        return 0
    return run(targets, args.out, args.only, args.jobs)


if __name__ == "__main__":
    if "jax" not in sys.modules:
        for name, value in ENV.items():
            os.environ.setdefault(name, value)
    sys.exit(main())
