"""``python -m benchmarks``: speed, memory, max-seq and scaling of dilax vs dense (and torch).

Every figure that a speed or memory target refers to comes from here, measured in one run:
throughput is reported next to an fp32 matmul's GFLOP/s timed interleaved with each row, and
dilax next to the same-run PyTorch implementation of the grouped algorithm (``--compare-torch``).
Results (``<command>.{json,md}`` and ``*.png`` plots) go to a new git-ignored folder
``benchmarks/runs/<date>-<time>-<command>/``; ``--out benchmarks/results`` updates the
committed ones.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import dilax
from benchmarks import common
from benchmarks.report import write_outputs
from dilax.layout import attended_pairs
from dilax.memory import format_bytes, memory_report

FWD_FLOPS_PER_PAIR = 4  # x head_dim: QK^T and PV, 2 FLOPs per multiply-add
# fwd+bwd: forward 4d plus backward 10d (recompute QK^T, dV, dP, dS K, dS^T Q) = 3.5x forward,
# the FlashAttention-2 convention.
FWD_BWD_FLOPS_PER_PAIR = 14

DEFAULT_ROWS = ("dense", "mixture", "grouped")
EXTRA_ROWS = ("mixture-padded", "mixture-window")  # opt-in: --rows mixture,mixture-padded


def _progress(total: int, desc: str, quiet: bool):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # progress bars are a dev extra
        tqdm = None
    if tqdm is None or quiet:
        class _Null:
            def update(self, *_):
                pass

            def set_postfix_str(self, *_):
                pass

            def close(self):
                pass

        return _Null()
    return tqdm(total=total, desc=desc, unit="run", leave=False, file=sys.stderr)


def _config(args) -> dict[str, Any]:
    return dict(
        batch=args.batch, heads=args.heads, kv_heads=args.kv_heads or args.heads,
        head_dim=args.head_dim, dtype=args.dtype, segment_lengths=args.segment_lengths,
        dilation_rates=args.dilation_rates, causal=args.causal,
        implementation=args.implementation, local_window=args.local_window,
    )


def _make_row_fn(row: str, cfg: dict[str, Any]) -> Callable[..., jax.Array]:
    ws, rs = tuple(cfg["segment_lengths"]), tuple(cfg["dilation_rates"])
    causal, impl = cfg["causal"], cfg["implementation"]
    if row == "dense":
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal)
    if row in ("mixture", "grouped"):
        return lambda q, k, v: dilax.dilated_attention(
            q, k, v, ws, rs, is_causal=causal, mode=row, implementation=impl
        )
    if row == "mixture-padded":  # every row's second half padded (queries and keys)
        def padded(q, k, v):
            half = jnp.full((q.shape[0],), q.shape[1] // 2, jnp.int32)
            return dilax.dilated_attention(q, k, v, ws, rs, is_causal=causal,
                                           implementation=impl, query_seq_lengths=half,
                                           key_value_seq_lengths=half)
        return padded
    if row == "mixture-window":
        return lambda q, k, v: dilax.dilated_attention(
            q, k, v, ws, rs, is_causal=causal, implementation=impl,
            local_window=cfg["local_window"])
    raise ValueError(f"unknown row {row!r}; choose from {DEFAULT_ROWS + EXTRA_ROWS}")


def _pairs(row: str, n: int, cfg: dict[str, Any]) -> int:
    h = cfg["heads"]
    if row == "dense":
        return h * (n * (n + 1) // 2 if cfg["causal"] else n * n)
    mode = "grouped" if row in ("grouped", "torch-grouped") else "mixture"
    return attended_pairs(n, h, tuple(cfg["segment_lengths"]), tuple(cfg["dilation_rates"]),
                          mode, cfg["causal"])


def _memory_limit() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.75)
    except (ValueError, OSError, AttributeError):
        return 16 << 30


def measure_rows(rows: Sequence[str], ns: Sequence[int], cfg: dict[str, Any], *,
                 passes: Sequence[str], repeats: int, compare_torch: bool, quiet: bool,
                 run: bool = True) -> list[dict[str, Any]]:
    """Times (``run=True``) and sizes every (row, n, pass); returns result dicts."""
    dtype = jnp.dtype(cfg["dtype"])
    b, h, hk, d = cfg["batch"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    torch_mod = None
    if compare_torch:
        try:
            from benchmarks import torch_ref as torch_mod
        except (ImportError, OSError):
            print("torch is not importable: --compare-torch rows skipped "
                  "(pip install torch==2.13.0)", file=sys.stderr)
    all_rows = list(rows) + (["torch-grouped"] if torch_mod is not None else [])
    probe = common.MatmulProbe() if run else None
    bar = _progress(len(all_rows) * len(ns) * len(passes), "benchmark", quiet)
    results = []
    limit = _memory_limit()
    for n in ns:
        q, k, v = common.random_qkv(b, n, h, hk, d, dtype)
        floor = common.qkvo_bytes(b, n, h, hk, d, dtype)
        dilax_grouped_out = None
        for row in all_rows:
            for pas in passes:
                bar.set_postfix_str(f"{row} n={n} {pas}")
                rec: dict[str, Any] = dict(row=row, n=n, pass_=pas, batch=b, heads=h,
                                           kv_heads=hk, head_dim=d, dtype=str(dtype),
                                           pairs=_pairs(row, n, cfg))
                flops = rec["pairs"] * d * (FWD_FLOPS_PER_PAIR if pas == "fwd"
                                            else FWD_BWD_FLOPS_PER_PAIR)
                if row == "torch-grouped":
                    if pas == "fwd" and n % max(cfg["segment_lengths"]) != 0:
                        rec["skipped"] = "n must be a multiple of every segment length"
                        results.append(rec)
                        bar.update()
                        continue
                    fwd_t, fb_t, out_np = torch_mod.make_torch_fns(
                        np.asarray(q), np.asarray(k), np.asarray(v), cfg["segment_lengths"],
                        cfg["dilation_rates"], cfg["causal"])
                    fn = fwd_t if pas == "fwd" else fb_t
                    if run:
                        seconds, rec["matmul_gflops"] = common.time_interleaved(fn, probe,
                                                                                repeats)
                        rec.update(_timing_fields(seconds, flops, b * n))
                        if pas == "fwd" and dilax_grouped_out is not None:
                            rec["max_abs_diff_vs_dilax"] = float(
                                np.abs(out_np() - dilax_grouped_out).max())
                    results.append(rec)
                    bar.update()
                    continue
                fn = _make_row_fn(row, cfg)
                fwd, fb = common.forward_and_backward(fn, q, k, v)
                jitted = fwd if pas == "fwd" else fb
                try:
                    mem = memory_report(jitted, q, k, v)
                except Exception as e:  # noqa: BLE001 - compile failure is a result, not a crash
                    rec["skipped"] = f"compile failed: {type(e).__name__}: {str(e)[:200]}"
                    results.append(rec)
                    bar.update()
                    continue
                rec.update(memory_bytes=mem.peak_bytes, temp_bytes=mem.temp_bytes,
                           qkvo_bytes=floor, memory_over_floor=mem.peak_bytes / floor)
                if run and mem.peak_bytes > limit:
                    rec["skipped"] = (f"needs {format_bytes(mem.peak_bytes)} > "
                                      f"{format_bytes(limit)} available")
                elif run:
                    seconds, rec["matmul_gflops"] = common.time_interleaved(
                        lambda j=jitted, a=(q, k, v): j(*a), probe, repeats)
                    rec.update(_timing_fields(seconds, flops, b * n))
                    if row == "grouped" and pas == "fwd":
                        dilax_grouped_out = np.asarray(jitted(q, k, v))
                results.append(rec)
                bar.update()
    bar.close()
    _add_ratios(results)
    return results


def _timing_fields(seconds: list[float], flops: float, tokens: int) -> dict[str, float]:
    t = common.Timing.of(seconds)
    return dict(ms_median=t.median_ms, ms_min=t.min_ms, ms_max=t.max_ms,
                gflops=flops / (t.median_ms * 1e-3) / 1e9,
                tokens_per_s=tokens / (t.median_ms * 1e-3))


def _add_ratios(results: list[dict[str, Any]]) -> None:
    by_key = {(r["row"], r["n"], r["pass_"]): r for r in results}
    for r in results:
        if "gflops" in r and r.get("matmul_gflops"):
            r["pct_matmul"] = 100.0 * r["gflops"] / r["matmul_gflops"]
        torch_row = by_key.get(("torch-grouped", r["n"], r["pass_"]))
        if r["row"] == "grouped" and torch_row and "ms_median" in torch_row and "ms_median" in r:
            r["vs_torch"] = r["ms_median"] / torch_row["ms_median"]
        dense = by_key.get(("dense", r["n"], r["pass_"]))
        if r["row"] != "dense" and dense and "ms_median" in dense and "ms_median" in r:
            r["vs_dense"] = r["ms_median"] / dense["ms_median"]


# --------------------------------------------------------------------------- commands


def cmd_speed(args) -> dict[str, Any]:
    cfg = _config(args)
    passes = ["fwd", "fwd+bwd"] if args.backward else ["fwd"]
    rows = measure_rows(args.rows, args.n, cfg, passes=passes, repeats=args.repeats,
                        compare_torch=args.compare_torch, quiet=args.quiet)
    return dict(command="speed", config=cfg, rows=rows)


def cmd_memory(args) -> dict[str, Any]:
    cfg = _config(args)
    rows = measure_rows(args.rows, args.n, cfg, passes=["fwd", "fwd+bwd"], repeats=0,
                        compare_torch=False, quiet=args.quiet, run=False)
    return dict(command="memory", config=cfg, rows=rows)


def cmd_scaling(args) -> dict[str, Any]:
    cfg = _config(args)
    rows = measure_rows(["mixture", "grouped"], args.n, cfg, passes=["fwd"],
                        repeats=args.repeats, compare_torch=False, quiet=args.quiet)
    summary = {}
    for row in ("mixture", "grouped"):
        times = {r["n"]: r["ms_median"] for r in rows if r["row"] == row and "ms_median" in r}
        if len(times) >= 2:
            lo, hi = min(times), max(times)
            summary[row] = dict(n_small=lo, n_large=hi, time_ratio=times[hi] / times[lo],
                                n_ratio=hi / lo)
    return dict(command="scaling", config=cfg, rows=rows, summary=summary)


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
    cfg = _config(args)
    limit = _memory_limit()
    rows = []
    passes = ["fwd", "fwd+bwd"]
    largest = {}
    bar = _progress(len(passes) * len(args.n), "max-seq", args.quiet)
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


def cmd_demo(args) -> dict[str, Any]:
    args.rows = list(DEFAULT_ROWS)
    args.backward = True
    return dict(cmd_speed(args), command="demo")


def cmd_all(args) -> dict[str, Any]:
    out = {}
    for name, fn in (("speed", cmd_speed), ("memory", cmd_memory), ("scaling", cmd_scaling)):
        out[name] = fn(args)
        write_outputs(out[name], args.out, name)
    return out["speed"]


def cmd_block_sparse(args) -> dict[str, Any]:
    """Block-sparse rows: the same code path at several densities (time and memory)."""
    from benchmarks.block_sparse import rows as bs_rows

    n = args.n[0] if args.n else 16384
    raw = bs_rows(n=n, h=args.heads, d=args.head_dim, repeats=args.repeats,
                  is_causal=args.causal, backward_memory=True)
    rows = [dict(r, row=f"block-sparse density {r['density']:.2f}", n=r["n"], pass_="fwd",
                 ms_median=r["ms_median"], ms_min=r["ms_min"], ms_max=r["ms_max"])
            for r in raw]
    full = max(raw, key=lambda r: r["density"])
    summary = {f"time_ratio_density_{r['density']:.2f}": r["ms_median"] / full["ms_median"]
               for r in raw}
    summary.update({f"memory_fwd_bwd_MiB_density_{r['density']:.2f}":
                    round(r.get("memory_bytes_fwd_bwd", 0) / 2**20, 1) for r in raw})
    return dict(command="block-sparse", config=_config(args), rows=rows, summary=summary)


def cmd_ring(args) -> dict[str, Any]:
    """Ring rows on 8 fake host devices, or ``--plan`` (:func:`benchmarks.ring.cmd`)."""
    from benchmarks.ring import cmd

    return cmd(args, _config(args))


def cmd_decode(args) -> dict[str, Any]:
    """Decode: ms per token against the context for dilax decode, dense KV-cache attention
    and full recomputation, interleaved in one run (:mod:`benchmarks.decode`)."""
    from benchmarks import decode as D

    cfg = dict(_config(args), causal=True, mode=args.mode)
    shape = dict(b=args.batch, h=args.heads, hk=cfg["kv_heads"], d=args.head_dim,
                 dtype=args.dtype, ws=tuple(args.segment_lengths),
                 rs=tuple(args.dilation_rates), mode=args.mode)
    log = (lambda *_: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    rows, notes = D.rows(args.n, rounds=args.repeats, memory_limit=_memory_limit(), log=log,
                         **shape)
    acc = D.acceptance(**shape)
    by = {(r["row"], r["n"]): r for r in rows}
    for r in rows:
        base = by.get((D.ROW_DILAX, r["n"]))
        if base is not None and r["row"] != D.ROW_DILAX:
            r["vs_dilax"] = r["ms_median"] / base["ms_median"]
    dil = {r["n"]: r["ms_median"] for r in rows if r["row"] == D.ROW_DILAX}
    den = {r["n"]: r["ms_median"] for r in rows if r["row"] == D.ROW_DENSE}
    lo, hi = min(dil), max(dil)
    summary = {
        "acceptance: dilax step ms at n_large / n_small (same run, alternated)": round(
            acc["ratio"], 3),
        "acceptance detail": {k: (round(v, 3) if isinstance(v, float) else v)
                              for k, v in acc.items()},
        f"dilax ms/token at n={hi:,} / at n={lo:,}": round(dil[hi] / dil[lo], 3),
        f"dense ms/token at n={hi:,} / at n={lo:,}": round(den[hi] / den[lo], 3),
        "context ratio": hi // lo,
        f"dense / dilax ms/token at the largest context n={hi:,}": round(den[hi] / dil[hi], 2),
        **notes,
    }
    return dict(command="decode", config=cfg, rows=rows, summary=summary)


COMMANDS = {
    "speed": cmd_speed, "memory": cmd_memory, "scaling": cmd_scaling, "max-seq": cmd_max_seq,
    "demo": cmd_demo, "all": cmd_all, "block-sparse": cmd_block_sparse, "ring": cmd_ring,
    "decode": cmd_decode,
}

# Per-command defaults (shown by ``python -m benchmarks <command> --help``).
PRESETS = {
    "speed": dict(n=[8192, 16384, 32768]),
    "memory": dict(n=[8192, 16384, 32768, 65536]),
    "scaling": dict(n=[8192, 16384, 32768, 65536]),
    "max-seq": dict(n=[65536, 131072, 262144, 524288, 1048576, 2097152]),
    # the quick look (make demo): under a minute of measuring on 2 cores, so smaller n and
    # segment lengths scaled with them (the n = 8192 dense rows alone took minutes)
    "demo": dict(n=[2048, 4096], repeats=3, segment_lengths=[512, 1024, 2048]),
    "all": dict(n=[8192, 16384, 32768]),
    "block-sparse": dict(n=[16384], repeats=3),
    "ring": dict(n=None, repeats=3, segment_lengths=None),
    "decode": dict(n=[2**i for i in range(12, 21)], segment_lengths=[1024, 2048, 4096]),
}

HELP = {
    "speed": "time dense vs dilax rows, forward (and --backward), next to a matmul probe",
    "memory": "XLA memory_analysis of forward and forward+backward (nothing is run)",
    "scaling": "forward time of mixture and grouped as n grows",
    "max-seq": "double n until XLA's memory estimate exceeds the machine or a run fails",
    "demo": "the quick look (make demo): dense, mixture, grouped; fwd and fwd+bwd",
    "all": "speed, memory and scaling in one go",
    "block-sparse": "block-sparse attention at several densities (time and memory)",
    "ring": "ring attention on 8 fake host devices (memory per device, permute bytes)",
    "decode": "ms per generated token vs context: dilax KV-cache decode, dense KV-cache "
              "attention, full recomputation",
}

# which optional flags each command reads (the others take the values in _FIXED)
_EXTRA = {
    "speed": ("rows", "backward", "compare_torch"),
    "memory": ("rows",),
    "scaling": (),
    "max-seq": ("mode", "timeout"),
    "demo": ("compare_torch",),
    "all": ("rows", "backward", "compare_torch"),
    "block-sparse": (),
    "ring": ("timeout", "plan"),
    "decode": ("mode",),
}
_FIXED = dict(rows=list(DEFAULT_ROWS), backward=False, compare_torch=False, mode="mixture",
              timeout=1800, local_window=256)


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def _csv(values) -> str:
    return ",".join(map(str, values))


def default_out(command: str) -> str:
    """``benchmarks/runs/<date>-<time>-<command>``: a fresh, git-ignored folder per run."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return os.path.join(os.path.dirname(__file__), "runs", f"{stamp}-{command}")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every flag's help ends with its default, unless the help already states it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if "default:" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def _add_command(sub, name: str) -> None:
    preset = PRESETS[name]
    seg = preset.get("segment_lengths", [2048, 4096, 8192])
    rates = None if seg is None else [1, 2, 4]
    p = sub.add_parser(name, help=HELP[name], description=HELP[name],
                       formatter_class=_Formatter)
    p.add_argument("--n", type=_ints, default=preset["n"], metavar="N,N,...",
                   help="sequence lengths (default: "
                        f"{_csv(preset['n'] or ['16384; with --plan 2^30'])})")
    p.add_argument("--batch", type=int, default=1, help="batch size b")
    p.add_argument("--heads", type=int, default=8, help="query heads h")
    p.add_argument("--kv-heads", type=int, default=None,
                   help="GQA key/value heads (default: --heads)")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension d")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="q, k, v dtype")
    p.add_argument("--segment-lengths", type=_ints, default=seg, metavar="W,W,...",
                   help="dilated attention segment lengths (default: "
                        f"{_csv(seg) if seg else 'n/8,n/4,n/2,n; with --plan 2048*2^i up to n'})")
    p.add_argument("--dilation-rates", type=_ints, default=rates, metavar="R,R,...",
                   help="one dilation rate per segment length (default: "
                        f"{_csv(rates) if rates else '1,2,4,8; with --plan 2^i'})")
    p.add_argument("--causal", action="store_true", help="causal attention")
    p.add_argument("--implementation", default=None,
                   help="dilax implementation: xla, pallas, cudnn, reference "
                        "(default: the best available)")
    if name != "memory":
        p.add_argument("--repeats", type=int, default=preset.get("repeats", 5),
                       help="timed calls per row (after one warmup call); the median is reported")
    extra = _EXTRA[name]
    if "rows" in extra:
        p.add_argument("--rows", type=lambda s: s.split(","), default=list(DEFAULT_ROWS),
                       metavar="ROW,...", help=f"rows to measure (default: "
                       f"{_csv(DEFAULT_ROWS)}; opt-in: {_csv(EXTRA_ROWS)})")
        p.add_argument("--local-window", type=int, default=256,
                       help="W of the mixture-window row")
    if "backward" in extra:
        p.add_argument("--backward", action="store_true", help="also time forward+backward")
    if "compare_torch" in extra:
        p.add_argument("--compare-torch", action="store_true",
                       help="also time our PyTorch grouped implementation (needs torch)")
    if "mode" in extra:
        p.add_argument("--mode", default="mixture", choices=["mixture", "grouped"],
                       help="dilax mode to push to its longest n")
    if "plan" in extra:
        from benchmarks.ring_plan_cli import add_plan_flags

        add_plan_flags(p)
    if "timeout" in extra:
        p.add_argument("--timeout", type=int, default=1800,
                       help="seconds per attempt (a subprocess each)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where the JSON, Markdown table and plots go (default: a new "
                        "benchmarks/runs/<date>-<time>-<command>/; pass --out "
                        "benchmarks/results to update the committed results)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(**{k: v for k, v in _FIXED.items() if k not in extra},
                   **({"repeats": 0} if name == "memory" else {}))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__, formatter_class=_Formatter,
        epilog="`python -m benchmarks <command> --help` lists a command's flags and defaults. "
               "`python -m benchmarks gpu-compile --help`: deviceless H100/A100 compiles "
               "(needs jax[cuda12], see `make gpu-check`).")
    sub = p.add_subparsers(dest="command", required=True, metavar="command",
                           title="commands")
    for name in COMMANDS:
        _add_command(sub, name)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["gpu-compile"]:  # its own flags; compiles in child processes
        from benchmarks import gpu_compile

        return gpu_compile.main(argv[1:])
    args = build_parser().parse_args(argv)
    if len(args.segment_lengths or ()) != len(args.dilation_rates or ()):
        raise SystemExit("--segment-lengths and --dilation-rates need the same number of values")
    name = "ring-plan" if getattr(args, "plan", False) else args.command
    if args.out is None:
        args.out = default_out(name)
    t0 = time.time()
    result = COMMANDS[args.command](args)
    result["machine"] = common.machine_description()
    result["probe"] = "interleaved"
    result["wall_seconds"] = time.time() - t0
    paths = write_outputs(result, args.out, name)
    print(paths["markdown_text"])
    out = os.path.relpath(args.out) if not os.path.relpath(args.out).startswith("..") else args.out
    print(f"results in {out}/:")
    for key, path in paths.items():
        if key != "markdown_text":
            print(f"  {key + ':':10s} {os.path.relpath(path) if out != args.out else path}")
    return 0
