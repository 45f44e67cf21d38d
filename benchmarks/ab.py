"""Same-run A/B: one benchmark command on a base revision and on the working tree.

``python -m benchmarks.ab --base REV [--rounds 2] -- speed --n 16384,32768 --backward``

Checks ``REV`` out into a temporary git worktree, then runs ``python -m benchmarks <args>``
alternately in the base checkout and in this one (``--rounds`` times each, every run in a
fresh process, base first), so both sides see the same machine state. For every
``(row, n, pass)`` it reports the fastest median time of each side and their ratio, and the
compiled memory (``memory_analysis``, deterministic) of each side. Results go to
``<out>/ab-<command>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(checkout: Path, args: Sequence[str], out: Path) -> list[dict]:
    """One benchmark run in ``checkout``; its result rows."""
    cmd = [sys.executable, "-m", "benchmarks", *args, "--out", str(out), "--quiet"]
    env = dict(os.environ, PYTHONPATH=str(checkout))
    subprocess.run(cmd, cwd=checkout, env=env, check=True)
    return json.loads((out / f"{args[0]}.json").read_text())["rows"]


def _key(row: dict) -> tuple:
    return (row.get("row"), row.get("n"), row.get("pass_"), row.get("P"))


def _merge(runs: list[list[dict]]) -> dict[tuple, dict]:
    """Per key: the fastest median over the runs, and the (deterministic) memory."""
    best: dict[tuple, dict] = {}
    for rows in runs:
        for row in rows:
            k = _key(row)
            ms = row.get("ms_median")
            if k not in best or (ms is not None and ms < best[k].get("ms_median", float("inf"))):
                best[k] = row
    return best


def _ratio(new, old):
    return None if not new or not old else new / old


def compare(base_rows: dict, new_rows: dict) -> list[dict]:
    table = []
    for k in sorted(new_rows, key=lambda k: (str(k[0]), k[1] or 0, str(k[2]), k[3] or 0)):
        old, new = base_rows.get(k, {}), new_rows[k]
        table.append(dict(
            row=k[0], n=k[1], pass_=k[2], P=k[3],
            ms_base=old.get("ms_median"), ms_new=new.get("ms_median"),
            time_ratio=_ratio(new.get("ms_median"), old.get("ms_median")),
            mem_base=old.get("memory_bytes"), mem_new=new.get("memory_bytes"),
            mem_ratio=_ratio(new.get("memory_bytes"), old.get("memory_bytes")),
            train_mem_base=old.get("train_step_memory_bytes_per_device"),
            train_mem_new=new.get("train_step_memory_bytes_per_device"),
        ))
    return table


def _fmt(x, scale=1.0, digits=1):
    return "–" if x is None else f"{x / scale:.{digits}f}"


def markdown(table: list[dict], base: str, args: Sequence[str], rounds: int) -> str:
    mib = 2**20
    lines = [f"# A/B: `python -m benchmarks {' '.join(args)}`", "",
             f"Base `{base}` against the working tree, {rounds} alternating round(s) each; "
             "time is the fastest median per side, memory is `memory_analysis`.", "",
             "| row | n | pass | ms base | ms new | time new/base | MiB base | MiB new | "
             "mem new/base | train MiB base | train MiB new |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in table:
        lines.append(
            f"| {r['row']} | {r['n']} | {r['pass_']} | {_fmt(r['ms_base'])} | "
            f"{_fmt(r['ms_new'])} | {_fmt(r['time_ratio'], digits=3)} | "
            f"{_fmt(r['mem_base'], mib)} | {_fmt(r['mem_new'], mib)} | "
            f"{_fmt(r['mem_ratio'], digits=3)} | {_fmt(r['train_mem_base'], mib)} | "
            f"{_fmt(r['train_mem_new'], mib)} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="git revision to compare against")
    p.add_argument("--rounds", type=int, default=2, help="alternating runs per side")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"),
                   help="where ab-<command>.{json,md} go")
    p.add_argument("args", nargs=argparse.REMAINDER,
                   help="after --: the benchmark command and its flags")
    ns = p.parse_args(argv)
    args = [a for a in ns.args if a != "--"]
    if not args:
        p.error("give the benchmark command after --, e.g. -- speed --n 16384")
    with tempfile.TemporaryDirectory() as tmp:
        base_dir = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base_dir), ns.base],
                       cwd=ROOT, check=True, capture_output=True)
        try:
            runs: dict[str, list] = {"base": [], "new": []}
            for i in range(ns.rounds):
                for side, checkout in (("base", base_dir), ("new", ROOT)):
                    print(f"round {i + 1}/{ns.rounds}: {side}", file=sys.stderr, flush=True)
                    out = Path(tmp) / f"{side}{i}"
                    runs[side].append(_run(checkout, args, out))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_dir)], cwd=ROOT,
                           check=False, capture_output=True)
    table = compare(_merge(runs["base"]), _merge(runs["new"]))
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"ab-{args[0]}.json").write_text(json.dumps(
        dict(base=ns.base, args=args, rounds=ns.rounds, rows=table), indent=1))
    text = markdown(table, ns.base, args, ns.rounds)
    (out / f"ab-{args[0]}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
