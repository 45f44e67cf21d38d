"""``python -m benchmarks gpu``: dilax measured on the GPU at hand, in one command.

Installs nothing and needs nothing beyond dilax and the machine's jax (``pip install
--no-deps -e .``); sized for at most 8 minutes on one H100 (``--budget``). Three sections:

1. **check** (:mod:`tools.gpu.check`): every implementation (``pallas``, ``cudnn``,
   ``xla``) of every attention path -- dilated, causal + GQA, valid lengths, local window,
   block-sparse, a decode step, the ring over all local devices -- forward and gradients in
   bf16, fp16 and fp32, against the reference; refusals recorded with their reason.
2. **time** (:mod:`benchmarks.gpu_time`): forward and forward+backward of dilax (dense: one
   branch ``w = n``; dilated: LongNet branches) per implementation, beside
   ``jax.nn.dot_product_attention(implementation="cudnn")``, jax's Pallas Triton ``mha`` and
   its Mosaic GPU Hopper kernel (``attention_mgpu``, where it imports); effective TFLOP/s
   and % of the H100's 989.4 TFLOP/s bf16 dense peak.
3. **decode**: ms per generated token of ``dilax.dilated_attention_decode``.

Writes ``gpu.json``, ``gpu.md`` and PNG plots to ``--out`` (default
``benchmarks/runs/<date>-<time>-gpu/``); exit status 1 when a check fails. ``--interpret``
runs the same sections on a CPU at tiny sizes with the Pallas interpreter (the test suite
runs it, so the command cannot rot); ``--quick`` is a short GPU run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from tools.gpu.check import CASES, IMPLS

DEFAULT_N = (8192, 16384, 32768, 65536, 131072)
DEFAULT_DECODE_N = (8192, 32768, 131072)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.replace(" ", "").split(",") if x]


def _names(allowed):
    def parse(text: str) -> list[str]:
        names = [x for x in text.replace(" ", "").split(",") if x]
        bad = [x for x in names if x not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(allowed)}")
        return names
    return parse


def build_parser() -> argparse.ArgumentParser:
    from benchmarks.gpu_time import ROW_GROUPS

    p = argparse.ArgumentParser(prog="python -m benchmarks gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--n", type=_ints, default=None, metavar="N,...",
        help=f"timed sequence lengths (default {','.join(map(str, DEFAULT_N))})")
    add("--head-dims", type=_ints, default=None, metavar="D,...",
        help="timed head dims (default 64,128); the checks run the first at every dtype "
             "and the others in the first dtype")
    add("--dtypes", type=_names(("bfloat16", "float16", "float32")), default=None,
        help="checked dtypes (default bfloat16,float16,float32)")
    add("--time-dtype", default=None, choices=["bfloat16", "float16", "float32"],
        help="dtype of the timed rows (default bfloat16; float32 with --interpret)")
    add("--impls", type=_names(IMPLS), default=list(IMPLS),
        help="dilax implementations to check and time (default pallas,cudnn,xla)")
    add("--checks", type=_names(tuple(CASES)), default=list(CASES),
        help=f"check cases ('' for none; default {','.join(CASES)})")
    add("--rows", type=_names(ROW_GROUPS), default=list(ROW_GROUPS),
        help=f"timed row groups ('' for none; default {','.join(ROW_GROUPS)})")
    add("--passes", type=_names(("fwd", "fwd+bwd")), default=["fwd", "fwd+bwd"],
        help="timed passes (default fwd,fwd+bwd)")
    add("--no-causal", dest="causal", action="store_false", help="time non-causal attention")
    add("--repeats", type=int, default=None, help="timed calls per row (default 3)")
    add("--decode-n", type=_ints, default=None, metavar="N,...",
        help=f"decode contexts (default {','.join(map(str, DEFAULT_DECODE_N))})")
    add("--decode-batch", type=_ints, default=None, metavar="B,...",
        help="decode batch sizes (default 1,16)")
    add("--budget", type=float, default=None,
        help="seconds for the whole run (default 420, under 8 minutes with start-up; 240 "
             "with --quick, 900 with --interpret); a measurement whose estimate does not fit "
             "is skipped with a note")
    add("--interpret", action="store_true",
        help="CPU: Pallas interpreter, tiny sizes, float32 (what the test suite runs)")
    add("--quick", action="store_true",
        help="a short GPU run: n 8K and 32K, d 128, bf16 and fp32 checks, 2 repeats")
    add("--out", default=None, metavar="DIR",
        help="output folder (default: a new benchmarks/runs/<date>-<time>-gpu/)")
    add("--quiet", action="store_true", help="no progress bar, no notes on stderr")
    return p


def resolve(args) -> argparse.Namespace:
    """Fills the defaults that depend on ``--interpret`` / ``--quick``."""
    tiny, quick = args.interpret, args.quick
    pick = lambda value, tiny_v, quick_v, full_v: (value if value is not None else  # noqa: E731
                                                  tiny_v if tiny else quick_v if quick
                                                  else full_v)
    args.n = pick(args.n, [128], [8192, 32768], list(DEFAULT_N))
    args.head_dims = pick(args.head_dims, [16], [128], [64, 128])
    args.dtypes = pick(args.dtypes, ["float32"], ["bfloat16", "float32"],
                       ["bfloat16", "float16", "float32"])
    args.time_dtype = pick(args.time_dtype, "float32", "bfloat16", "bfloat16")
    args.repeats = pick(args.repeats, 1, 2, 3)
    args.decode_n = pick(args.decode_n, [64], [8192, 131072], list(DEFAULT_DECODE_N))
    args.decode_batch = pick(args.decode_batch, [1], [1], [1, 16])
    args.budget = pick(args.budget, 900.0, 240.0, 420.0)
    return args


def run(args) -> dict[str, Any]:
    """The three sections; returns the result dict (``checks``, ``rows``, ``decode``...)."""
    import jax

    from benchmarks import common
    from benchmarks.gpu_time import (
        DILATED_RS,
        DILATED_RS_TINY,
        DILATED_WS,
        DILATED_WS_TINY,
        PEAK_TFLOPS,
        Budget,
        decode_rows,
        time_rows,
    )
    from tools.gpu.check import run_checks, summary

    log = (lambda _: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    budget = Budget(args.budget, log)
    check_dims = args.head_dims[:1] if args.interpret else [64] + [
        d for d in args.head_dims if d != 64]
    configs = [(dt, check_dims[0]) for dt in args.dtypes]
    configs += [(args.dtypes[0], d) for d in check_dims[1:]] if args.dtypes else []
    time_groups = [g for g in args.rows if g != "decode"]
    decode_on = "decode" in args.rows
    n_time = len(args.n) * len(args.head_dims) * len(args.passes) * (
        sum(g.startswith("jax") for g in time_groups)
        + len(args.impls) * sum(not g.startswith("jax") for g in time_groups))
    total = (len(configs) * len(args.checks) * len(args.impls) + n_time
             + decode_on * len(args.decode_n) * len(args.decode_batch) * len(args.impls))
    bar = common.progress(total, "gpu", args.quiet)
    if jax.device_count() < 2 and any(c.startswith("ring") for c in args.checks):
        log(f"ring checks skipped: {jax.device_count()} device (a mesh of all local devices "
            "needs 2 or more)")
    t0 = time.time()
    # the checks come first (numerics before speed) but leave 40% of the budget to the timed
    # sections, and the attention timings leave 10% to decode
    decode_reserve = 0.1 * args.budget if decode_on else 0.0
    time_reserve = 0.4 * args.budget if (time_groups or decode_on) else 0.0
    checks = run_checks(configs, args.checks, args.impls, interpret=args.interpret,
                        budget=budget, log=log, bar=bar, reserve=time_reserve)
    check_s = time.time() - t0
    rows = time_rows(args.n, args.head_dims, time_groups, args.impls, dtype=args.time_dtype,
                     causal=args.causal, repeats=args.repeats, interpret=args.interpret,
                     budget=budget, bar=bar, passes=args.passes, reserve=decode_reserve)
    dec = (decode_rows(args.decode_n, args.decode_batch, args.impls, dtype=args.time_dtype,
                       repeats=args.repeats, interpret=args.interpret, budget=budget, bar=bar)
           if decode_on else [])
    bar.close()
    dev = jax.devices()[0]
    return dict(
        command="gpu", checks=checks, check_summary=summary(checks), rows=rows, decode=dec,
        config=dict(batch=1, heads="2" if args.interpret else "2048/d",
                    kv_heads="2" if args.interpret else "2048/d",
                    segment_lengths=list(DILATED_WS_TINY if args.interpret else DILATED_WS),
                    dilation_rates=list(DILATED_RS_TINY if args.interpret else DILATED_RS),
                    head_dim="/".join(map(str, args.head_dims)), dtype=args.time_dtype,
                    causal=args.causal, interpret=args.interpret, quick=args.quick,
                    repeats=args.repeats, budget_s=args.budget, impls=args.impls,
                    check_configs=[list(c) for c in configs], peak_tflops=PEAK_TFLOPS),
        device=dict(kind=getattr(dev, "device_kind", str(dev)), platform=dev.platform,
                    count=jax.device_count()),
        section_seconds=dict(check=round(check_s, 1), time_and_decode=round(
            time.time() - t0 - check_s, 1)),
        budget_skips=budget.skipped)


def main(argv: list[str] | None = None) -> int:
    import jax

    from benchmarks import common

    args = resolve(build_parser().parse_args(argv))
    out_dir = args.out or common.default_out("gpu")
    t0 = time.time()
    platforms = jax.config.jax_platforms
    try:
        if args.interpret:  # a CPU run even on a GPU machine (unless jax already started)
            jax.config.update("jax_platforms", "cpu")
        result = run(args)
    finally:
        jax.config.update("jax_platforms", platforms)
    result["machine"] = common.machine_description()
    result["wall_seconds"] = round(time.time() - t0, 1)
    paths = write_outputs(result, out_dir)
    if not args.quiet:
        print(paths.pop("markdown_text"))
    print(f"results in {out_dir}/: " + ", ".join(os.path.basename(p) for k, p in paths.items()
                                                  if k != "markdown_text"))
    return 0 if result["check_summary"]["passed"] else 1


# --------------------------------------------------------------------------------------------
# Outputs: gpu.json, gpu.md, gpu_time.png (ms vs n, report.plots) and gpu_tflops.png
# --------------------------------------------------------------------------------------------


def _err(r: dict) -> str:
    if "max_error" not in r:
        return ""
    return f"{r['max_error']:.2e} ({r['tolerance']:.0e})"


def _fmt(x: Any, spec: str = ".1f") -> str:
    return "—" if x is None else format(x, spec)


def markdown(result: dict[str, Any]) -> str:
    m, dev, cfg = result.get("machine", {}), result.get("device", {}), result.get("config", {})
    s = result["check_summary"]
    lines = [
        f"### `gpu` — {m.get('date', '')}, {dev.get('count')} x {dev.get('kind')} "
        f"({dev.get('platform')}), jax {m.get('jax', '')}, {result.get('wall_seconds')} s "
        f"(budget {cfg.get('budget_s')} s{', interpret' if cfg.get('interpret') else ''})",
        "",
        f"**Checks** vs `implementation=\"reference\"` (float64, on the device, on the same "
        f"rounded inputs); error = max|x - ref| / max(1, max|ref|) over out, dq, dk, "
        f"dv: {s['counts']}, {'PASSED' if s['passed'] else 'FAILED'}.",
        "",
    ]
    if result["checks"]:
        lines += ["| case | impl | dtype | d | n | status | max error (tol) | out | dq | dk | dv "
                  "| reason |", "|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in result["checks"]:
        e = r.get("errors", {})
        lines.append(
            f"| {r['case']} | {r['implementation']} | {r['dtype']} | {r['head_dim']} | "
            f"{r['n']} | {r['status']} | {_err(r)} | "
            + " | ".join(_fmt(e.get(k), ".1e") if k in e else "" for k in
                         ("out", "dq", "dk", "dv"))
            + f" | {r.get('reason', '').replace('|', '/')[:160]} |")
    lines += ["", f"**Attention** ({cfg.get('dtype')}, b=1, h=hk={cfg.get('heads')}, "
              f"dilated: w={tuple(cfg.get('segment_lengths', ()))}, "
              f"r={tuple(cfg.get('dilation_rates', ()))}, mixture, "
              f"{'causal' if cfg.get('causal') else 'non-causal'}): effective TFLOP/s = "
              "attended pairs x 4·d (fwd) or 14·d (fwd+bwd) / time; % of the "
              f"{cfg.get('peak_tflops')} TFLOP/s H100 bf16 dense peak.", "",
              "| kernel | d | n | pass | ms median (min–max) | TFLOP/s | % peak | compile s "
              "| status |", "|---|---:|---:|---|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        t = (f"{r['ms_median']:.2f} ({r['ms_min']:.2f}–{r['ms_max']:.2f})"
             if "ms_median" in r else "")
        status = _status(r)
        lines.append(f"| {r['kernel']} | {r['head_dim']} | {r['n']:,} | {r['pass_']} | {t} | "
                     f"{_fmt(r.get('tflops'), '.1f')} | {_fmt(r.get('pct_peak'), '.1f')} | "
                     f"{_fmt(r.get('compile_s'), '.1f')} | {status} |")
    if result.get("decode"):
        lines += ["", "**Decode**: one `dilated_attention_decode` step (t = 1, cache donated).",
                  "", "| impl | b | context n | ms per step (a token per row), median "
                  "(min–max) | tokens/s | status |", "|---|---:|---:|---:|---:|---|"]
        for r in result["decode"]:
            t = (f"{r['ms_median']:.3f} ({r['ms_min']:.3f}–{r['ms_max']:.3f})"
                 if "ms_median" in r else "")
            status = _status(r)
            lines.append(f"| {r['implementation']} | {r['batch']} | {r['n']:,} | {t} | "
                         f"{_fmt(r.get('tokens_per_s'), ',.0f')} | {status} |")
    return "\n".join(lines) + "\n"


def tflops_plot(result: dict[str, Any], out_dir: str) -> str | None:
    """``gpu_tflops.png``: effective TFLOP/s vs n, one panel per pass."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for r in result["rows"]:
        if "tflops" in r:
            series.setdefault((r["pass_"], r["row"]), []).append((r["n"], r["tflops"]))
    if not series:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), sharey=True)
    for ax, pas in zip(axes, ("fwd", "fwd+bwd")):
        for (p, row), pts in sorted(series.items()):
            if p == pas:
                pts.sort()
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=row)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length n")
        ax.set_title(pas, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    axes[0].set_ylabel("effective TFLOP/s")
    cfg, dev, m = result["config"], result["device"], result.get("machine", {})
    peak = cfg["peak_tflops"]
    axes[1].secondary_yaxis("right", functions=(lambda t: 100 * t / peak,
                                                lambda p: p * peak / 100)).set_ylabel(
        f"% of {peak} TFLOP/s (H100 bf16 dense)")
    title = (f"dilax vs jax attention, {cfg['dtype']}, "
             f"{'causal' if cfg['causal'] else 'non-causal'}, b=1, h=hk={cfg['heads']}; "
             f"{dev['count']} x {dev['kind']}, jax {m.get('jax', '?')}, "
             f"{str(m.get('date', ''))[:10]}")
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    path = os.path.join(out_dir, "gpu_tflops.png")
    fig.savefig(path, dpi=110, metadata={"Title": title})
    plt.close(fig)
    return path


def write_outputs(result: dict[str, Any], out_dir: str) -> dict[str, str]:
    import json

    from benchmarks.report import plots

    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, "gpu.json"), "markdown": os.path.join(out_dir,
                                                                                  "gpu.md")}
    with open(paths["json"], "w") as f:
        json.dump(result, f, indent=1, default=str)
    text = markdown(result)
    with open(paths["markdown"], "w") as f:
        f.write(text)
    for i, p in enumerate(plots(result, out_dir, "gpu") + [tflops_plot(result, out_dir)]):
        if p:
            paths[f"plot{i}"] = p
    paths["markdown_text"] = text
    return paths


def _status(row) -> str:
    """A table cell: ``ok``, or the status with its reason (pipes escaped, cut at 160)."""
    if row["status"] == "ok":
        return "ok"
    return f"{row['status']}: {row.get('reason', '').replace('|', '/')[:160]}"
