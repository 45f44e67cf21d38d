"""What a deviceless GPU compile reports: each Pallas kernel's resources (launch grid,
threads, shared memory from XLA's dump; registers, spills, stack from ``ptxas -v``; the
tensor-core instruction family from the PTX), :func:`roofline`, an estimated fraction of peak,
and :func:`markdown`, the ``gpu-compile.md`` table."""

from __future__ import annotations

import glob
import math
import os
import re
import shutil
import subprocess

from tools.gpu.cases import TARGETS, Target

# --------------------------------------------------------------------------------------------
# Kernel resources (XLA's dump and ptxas)
# --------------------------------------------------------------------------------------------


def ptxas_path() -> str | None:
    try:
        import nvidia.cuda_nvcc as nvcc  # the pip wheel jax[cuda12] installs

        path = os.path.join(list(nvcc.__path__)[0], "bin", "ptxas")
        if os.path.exists(path):
            return path
    except ImportError:
        pass
    return shutil.which("ptxas")


_THUNK = re.compile(r"kCustomKernel.*?\]\s+(\S+)\s+grid:\s*\[([\d, ]+)\]\s+threads:\s*"
                    r"\[([\d, ]+)\]\s+shared_memory:\s*(\d+)\s+bytes")
_PTXAS_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes "
                          r"spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


def kernel_resources(dump_dir: str, target: Target, ptxas: str | None) -> list[dict]:
    """The Pallas kernels of one compiled program (XLA's dump in ``dump_dir``)."""
    launches = {}
    for path in glob.glob(os.path.join(dump_dir, "*.thunk_sequence.txt")):
        with open(path) as f:
            for line in f:
                m = _THUNK.search(line)
                if m:
                    launches[m.group(1)] = dict(
                        grid=[int(x) for x in m.group(2).split(",")],
                        threads=int(m.group(3).split(",")[0]),
                        shared_memory=int(m.group(4)))
    out, seen = [], set()
    for path in sorted(glob.glob(os.path.join(dump_dir, "*.ptx"))):
        with open(path) as f:
            ptx = f.read()
        m = re.search(r"\.entry\s+(\w+)", ptx)
        if not m or m.group(1) not in launches or m.group(1) in seen:
            continue  # not a launched kernel, or the same kernel in another module's dump
        name = m.group(1)
        seen.add(name)
        if not (name.startswith("dilax_") or name.startswith("mha")):
            continue  # XLA's own fusions
        row = dict(kernel=name, **launches[name],
                   wgmma=len(re.findall(r"\bwgmma\.mma_async", ptx)),
                   mma_sync=len(re.findall(r"\bmma\.sync", ptx)))
        row["tensor_cores"] = ("wgmma" if row["wgmma"] else "mma.sync" if row["mma_sync"]
                               else "none (FMA)")
        if ptxas:
            proc = subprocess.run([ptxas, "-v", "-O3", f"--gpu-name={target.sm}", path, "-o",
                                   os.devnull], capture_output=True, text=True)
            text = proc.stdout + proc.stderr
            regs, stack = _PTXAS_REGS.search(text), _PTXAS_STACK.search(text)
            if regs and stack:
                row.update(registers=int(regs.group(1)), stack=int(stack.group(1)),
                           spill_stores=int(stack.group(2)), spill_loads=int(stack.group(3)))
            else:
                row["ptxas_error"] = text.strip()[-300:]
        out.append(row)
    return out


# Roofline estimate
# --------------------------------------------------------------------------------------------


def _kernel_kind(name: str) -> str | None:
    """``fwd``, ``dq``, ``dkdv`` (dilax), ``bwd_ref`` (jax's fused backward); ``None`` for
    small elementwise kernels (jax's backward preprocessing)."""
    for tag in ("dkdv", "dq", "fwd"):
        if name.startswith("dilax_") and name.endswith(tag):
            return tag
    return {"mha_forward": "fwd", "mha_backward": "bwd_ref"}.get(name)


def roofline(model: dict, k: dict, target: Target) -> dict:
    """An **estimate** of a kernel's fraction of the tensor-core peak, from what was compiled.

    Per kernel, for ``H = h`` heads (batch 1), ``n`` queries and keys, head dim ``d``,
    element size ``s`` bytes, ``pairs`` = the (query, key) pairs the kernel visits (``n^2``;
    ``n^2 / 2`` causal; block-sparse: ``n * (2w/B + 1) * B`` for a window of ``w`` tokens),
    from the compiled launch (grid, registers, shared memory, tensor-core instructions):

    * matmul FLOPs ``F = c_mm * d * pairs * H`` with ``c_mm`` = 4 (forward: QK^T, PV),
      6 (dq: QK^T, dO V^T, dS K), 8 (dk/dv: QK^T, P^T dO, dO V^T, dS^T Q), 14 for jax's
      reference backward, which does dq and dk/dv in one kernel (its 7 tensors: r = 5);
    * HBM bytes ``B = H * s * d * (r + 2) * n``: ``r`` row tensors read or written once (2
      forward: Q, O; 3 dq: Q, dO, dQ; 4 dk/dv: K, V, dK, dV) plus the streamed operand pair
      (K, V forward and dq; Q, dO for dk/dv) read once from HBM: one head's pair
      (``2 n d s`` = 2-4 MiB here) stays in L2 (50 / 40 MiB) while the programs of that head
      re-read it, so re-reads cost L2, not HBM, bandwidth;
    * exponentials ``E = pairs * H`` (one ``exp`` per visited score);
    * ``t = max(F / peak_tc, B / BW, E / MUFU) / wave``, where ``peak_tc`` is the dense
      tensor-core peak of the dtype (TF32 for fp32) when the PTX has tensor-core
      instructions, else the FP32 FMA peak; ``MUFU`` = 16 special-function ops / clock / SM;
      ``wave`` = programs / (full waves * concurrent programs), concurrency from registers,
      shared memory and threads per SM;
    * **estimated fraction of peak** ``= F / (t * peak_tc)``.

    It ignores latency, pipelining depth, softmax ALU work other than ``exp``, and the
    mma.sync-on-Hopper issue limit: an upper bound to compare kernels, not a measurement.
    """
    if model["kernel"] == "resources":  # a whole program's kernels: resources, no estimate
        return {}
    n, h, d = model["n"], model["h"], model["d"]
    s = {"bfloat16": 2, "float16": 2, "float32": 4}[model["dtype"]]
    if model["kernel"] == "block_sparse":
        B, w = model["block"], model["window"]
        pairs = n * B * min(n // B, 2 * -(-w // B) + 1)
    else:
        pairs = n * n / (2 if model["causal"] else 1)
    kind = _kernel_kind(k["kernel"])
    if kind is None:
        return {}
    c_mm, rows = {"fwd": (4, 2), "dq": (6, 3), "dkdv": (8, 4), "bwd_ref": (14, 5)}[kind]
    programs = math.prod(k["grid"])
    flops = c_mm * d * pairs * h
    bytes_ = h * s * d * (rows + 2) * n
    exps = pairs * h
    tc = k.get("tensor_cores", "none (FMA)") != "none (FMA)"
    peak = (target.peak_tflops[model["dtype"]] if tc else target.fp32_fma_tflops) * 1e12
    regs = k.get("registers") or 255
    threads = k["threads"]
    per_sm = min(65536 // max(1, regs * threads),
                 target.smem_per_sm // max(1, k["shared_memory"]) if k["shared_memory"] else 32,
                 2048 // threads, 32)
    per_sm = max(per_sm, 0)
    if per_sm == 0:
        return dict(fraction_of_peak=0.0, note="does not fit one SM")
    concurrent = per_sm * target.sms
    waves = -(-programs // concurrent)
    wave = programs / (waves * concurrent)
    t_tc, t_mem, t_exp = flops / peak, bytes_ / target.hbm_bytes_per_s, exps / target.exp_per_s
    t = max(t_tc, t_mem, t_exp) / wave
    bound = {t_tc: "tensor", t_mem: "memory", t_exp: "exp"}[max(t_tc, t_mem, t_exp)]
    return dict(fraction_of_peak=round(flops / (t * peak), 3), bound=bound,
                programs_per_sm=per_sm, wave_efficiency=round(wave, 3),
                intensity=round(flops / bytes_, 1))



# Report
# --------------------------------------------------------------------------------------------


def markdown(result: dict) -> str:
    lines = [
        "# Deviceless GPU compiles (`python -m benchmarks gpu-compile`)",
        "",
        f"{result['date']}, jax {result['jax']}, {result['wall_seconds']:.0f} s wall for "
        f"{sum(len(t['cases']) for t in result['targets'])} compiles on "
        f"{result['cores']} cores. Targets: " + "; ".join(
            f"{t['target_name']} (`tools/gpu/targets/{TARGETS[t['target']].spec}`)"
            for t in result["targets"]) + ". Status: **"
        + ("all passed" if result["passed"] else "FAILED") + "**.",
        "",
        "XLA:GPU compiles each program ahead of time for the target (Pallas Triton lowering, "
        "Triton, LLVM, ptxas) in a CPU-only process; nothing runs. `ok` = compiled; "
        "`refused` = the op raised `ValueError` naming the rule (expected for unsupported "
        "configurations). Registers/spills: `ptxas -v -O3` on the kernel's PTX from XLA's dump; "
        "shared memory, grid, threads: XLA's launch (thunk sequence).",
        "",
        "Per target: " + "; ".join(
            f"{t['target']}: {sum(c['outcome'] == 'ok' for c in t['cases'])} compiled, "
            f"{sum(c['outcome'] == 'refused' for c in t['cases'])} refused (as expected: "
            f"{sum(c['outcome'] == 'refused' and c['passed'] for c in t['cases'])}), "
            f"{sum(not c['passed'] for c in t['cases'])} failed, "
            f"{_zero_matmul_summary(t['cases'])}" for t in result["targets"])
        + f"; CPU time {result.get('cpu_seconds', 0):.0f} s (user+sys of the compiling "
        "processes).",
        "",
        "## Kernel resources",
        "",
        "Every kernel of the `report:` programs and of the whole Pallas attention programs "
        "that carry a report (the padded + windowed dilated op, both rings on 8 GPUs). A "
        "dilax kernel of a bf16/fp16 program at head dim <= 128 must not spill registers "
        "(`tools.gpu.compile.spill_problem`: the run fails otherwise).",
        "",
        "| target | program | kernel | grid | threads | shared mem (KiB) | registers | spills "
        "(st/ld B) | tensor cores | est. fraction of peak† | bound |",
        "|---|---|---|---|---:|---:|---:|---:|---|---:|---|",
    ]
    for t in result["targets"]:
        for c in t["cases"]:
            for k in c.get("kernels", []):
                est = k.get("estimate", {})
                lines.append(
                    f"| {t['target']} | {c['name'].removeprefix('report: ')} | `{k['kernel']}` | "
                    f"{'x'.join(map(str, k['grid']))} | {k['threads']} | "
                    f"{k['shared_memory'] / 1024:.0f} | {k.get('registers', '?')} | "
                    f"{k.get('spill_stores', '?')}/{k.get('spill_loads', '?')} | "
                    f"{k['tensor_cores']} | "
                    + (f"{est['fraction_of_peak']:.2f}" if est else "—") + " | "
                    f"{est.get('bound', '')} |")
    lines += ["", "† **Estimate**, not a measurement (no GPU ran): "
              + " ".join(roofline.__doc__.split("\n\n", 1)[1].split()), ""]
    lines += ["## Configurations", "",
              "Kernel calls and XLA matmuls: call sites in the compiled program's optimized HLO "
              "(`tools.gpu.hlo.program_counts`; a loop body counted once, every branch of a "
              "conditional). Kernel calls: Pallas kernels (Triton custom-calls), and cuDNN "
              "fused-attention custom-calls. XLA matmuls: every HLO `dot`/`convolution`, alone "
              "or inside a fusion (XLA's own Triton/cuDNN GEMM fusions), and cuBLAS GEMM "
              "custom-calls; a Pallas kernel's own dots are in its Triton IR, not counted. "
              "*must be 0*: a Pallas attention program (`Case.no_xla_matmul`), which fails "
              "the run with any XLA matmul or without a kernel call; the train step's model "
              "projections are XLA matmuls by design. Kernel-level programs (`report:` rows "
              "above) are checked the same way.",
              "",
              "| target | configuration | expected | outcome | kernel calls | XLA matmuls | "
              "compile s | note |",
              "|---|---|---|---|---:|---:|---:|---|"]
    for t in result["targets"]:
        for c in t["cases"]:
            if c["name"].startswith("report: ") and c["passed"]:
                continue
            note = c.get("why", "") if c["outcome"] == c["expect"] else c.get("error", "")
            if c["outcome"] == "refused" and c.get("error"):
                note = (note + ": " if note else "") + c["error"].split("\n")[0][:160]
            elif not c["passed"] and c.get("error"):
                note = c["error"].split("\n")[0][:300]
            mark = "" if c["passed"] else " **FAIL**"
            calls, matmuls = _count_cells(c)
            lines.append(f"| {t['target']} | {c['name']} | {c['expect']} | "
                         f"{c['outcome']}{mark} | {calls} | {matmuls} | {c['seconds']:.1f} | "
                         f"{note.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def _zero_matmul_summary(rows: list[dict]) -> str:
    """How many compiled Pallas attention programs (``no_xla_matmul``) have no XLA matmul."""
    checked = [c for c in rows if c.get("no_xla_matmul") and "xla_matmuls" in c]
    clean = sum(c["xla_matmuls"] == 0 and c["kernel_calls"] > 0 for c in checked)
    return f"{clean} of {len(checked)} Pallas attention programs with 0 XLA matmuls"


def _count_cells(c: dict) -> tuple[str, str]:
    """The "kernel calls" and "XLA matmuls" cells of one configuration row."""
    if "xla_matmuls" not in c:  # refused or failed: nothing compiled
        return "—", "—"
    calls = " + ".join([f"{c['kernel_calls']} Pallas"] * bool(c["kernel_calls"])
                       + [f"{c['cudnn_calls']} cuDNN"] * bool(c["cudnn_calls"])) or "0"
    matmuls = str(c["xla_matmuls"])
    if c.get("no_xla_matmul"):
        matmuls = (matmuls if c["xla_matmuls"] == 0 else f"**{matmuls}**") + " (must be 0)"
    return calls, matmuls
