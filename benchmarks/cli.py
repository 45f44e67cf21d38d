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
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks import common
from benchmarks.common import default_out, memory_limit
from benchmarks.max_seq import cmd_max_seq
from benchmarks.report import write_outputs
from benchmarks.rows import (  # noqa: F401 - the FLOP constants re-exported (they lived here)
    DEFAULT_ROWS,
    EXTRA_ROWS,
    FWD_BWD_FLOPS_PER_PAIR,
    FWD_FLOPS_PER_PAIR,
    config_of,
    measure_rows,
)
from dilax import compile_cache

# --------------------------------------------------------------------------- commands


def cmd_speed(args) -> dict[str, Any]:
    cfg = config_of(args)
    passes = ["fwd", "fwd+bwd"] if args.backward else ["fwd"]
    rows = measure_rows(args.rows, args.n, cfg, passes=passes, repeats=args.repeats,
                        compare_torch=args.compare_torch, quiet=args.quiet)
    return dict(command="speed", config=cfg, rows=rows)


def cmd_memory(args) -> dict[str, Any]:
    cfg = config_of(args)
    rows = measure_rows(args.rows, args.n, cfg, passes=["fwd", "fwd+bwd"], repeats=0,
                        compare_torch=False, quiet=args.quiet, run=False)
    return dict(command="memory", config=cfg, rows=rows)


def cmd_scaling(args) -> dict[str, Any]:
    cfg = config_of(args)
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
    return dict(command="block-sparse", config=config_of(args), rows=rows, summary=summary)


def cmd_ring(args) -> dict[str, Any]:
    """Ring rows on 8 fake host devices, or ``--plan`` (:func:`benchmarks.ring.cmd`)."""
    from benchmarks.ring import cmd

    return cmd(args, config_of(args))


def cmd_decode(args) -> dict[str, Any]:
    """Decode: ms per token against the context for dilax decode, dense KV-cache attention
    and full recomputation, interleaved in one run (:mod:`benchmarks.decode`)."""
    from benchmarks import decode as D

    cfg = dict(config_of(args), causal=True, mode=args.mode)
    shape = dict(b=args.batch, h=args.heads, hk=cfg["kv_heads"], d=args.head_dim,
                 dtype=args.dtype, ws=tuple(args.segment_lengths),
                 rs=tuple(args.dilation_rates), mode=args.mode)
    log = (lambda *_: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    rows, notes = D.rows(args.n, rounds=args.repeats, memory_limit=memory_limit(), log=log,
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
               "(needs jax[cuda12], see `make gpu-check`). `python -m benchmarks gpu --help`: "
               "checks and timings on the GPU at hand (benchmarks/gpu.py). "
               "`python -m benchmarks quality --help`: does dilated attention learn long "
               "context? Small LMs that differ only in attention (docs/quality.md). "
               "`python -m benchmarks flex --help`: what score_mod, mask_mod, block masks and "
               "the soft-cap cost next to the built-in paths (benchmarks/flex.py). Every "
               "command but gpu-compile uses the persistent compilation cache "
               "(dilax.compile_cache: ~/.cache/dilax/jax); --no-compile-cache after the command "
               "turns it off (compile time is never part of a measured time).")
    sub = p.add_subparsers(dest="command", required=True, metavar="command",
                           title="commands")
    for name in COMMANDS:
        _add_command(sub, name)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["gpu-compile"]:  # its own flags; compiles in child processes
        from tools.gpu import compile as gpu_compile

        return gpu_compile.main(argv[1:])
    off = "--no-compile-cache" in argv  # every other command: compiled programs kept
    argv = [a for a in argv if a != "--no-compile-cache"]
    compile_cache.enable(off=off)
    if argv[:1] == ["gpu"]:  # its own flags (benchmarks/gpu.py)
        from benchmarks import gpu

        return gpu.main(argv[1:])
    if argv[:1] == ["flex"]:  # its own flags (benchmarks/flex.py)
        from benchmarks import flex

        return flex.main(argv[1:])
    if argv[:1] == ["quality"]:  # its own flags (benchmarks/quality.py)
        from benchmarks import quality

        return quality.main(argv[1:])
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
