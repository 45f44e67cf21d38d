"""``python -m benchmarks flex``: what FlexAttention's options cost on the XLA core.

One run, batch 1, ``h = 8``, ``d = 64``, causal, float32, forward and forward+backward
(gradients of ``<out, ct>`` with respect to ``q, k, v``), every program compiled first and
warmed up once; times are medians of ``--repeats`` calls taken round by round, every row of a
group once per round, so that a group's rows see the same machine. Reported as ratios:

(a) ``dot_product_attention(is_causal=True)`` with ``logits_soft_cap=50`` and with an ALiBi
    ``score_mod`` (:func:`dilax.flex.alibi`) against the same call plain; the same for
    ``flex_attention`` with a causal ``block_mask`` (its plain causal call). Target <= 1.15.
(b) packed documents through ``mask_mod`` (``and_masks(document_mask(ids), causal_mask)``)
    with a :func:`dilax.create_block_mask` block mask against the built-in ``segment_ids``
    path of ``dot_product_attention``. Target <= 1.15. The block mask is built once
    (outside the timed call, as PyTorch builds it); a row that builds it inside every call
    and ``create_block_mask``'s own time are reported beside.
(c) the built-in paths (plain causal, ``segment_ids``) of this checkout against a base
    revision (default ``e791419``, before the flex work): each side in its own worker process
    (:mod:`benchmarks.flex_ab`), timed call by call alternately (base, new, new, base, ...),
    the ratio of the medians with the spread of the per-round ratios; and their
    ``memory_analysis`` bytes. Target: time ratio <= 1.03, memory equal.

``--quick``: n = 2048 (the test's size). Results: ``flex.{json,md}`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax

import dilax
from benchmarks import common
from benchmarks.flex_ab import BUILTIN, call_seconds, inputs, programs
from dilax.flex import alibi, and_masks, causal_mask, create_block_mask, document_mask

ROOT = Path(__file__).resolve().parent.parent
BASE = "e791419"
CAP = 50.0
TARGET_MODS, TARGET_AB = 1.15, 1.03
PASSES = ("fwd", "fwd+bwd")


def _doc_mask(ids):
    return and_masks(document_mask(ids), causal_mask)


def _dpa(q, k, v, **kw):
    return dilax.dot_product_attention(q, k, v, is_causal=True, **kw)


def groups(block_size: tuple[int, int]) -> dict[str, dict[str, tuple]]:
    """``{group: {row: (fn, argument names)}}``; a group's first row is its baseline."""
    def bm_docs(q, k, v, ids):  # the block mask built inside the call
        bm = create_block_mask(_doc_mask(ids), 1, None, q.shape[1], k.shape[1],
                               block_size=block_size)
        return dilax.dot_product_attention(q, k, v, mask_mod=_doc_mask(ids), block_mask=bm)

    qkv = ("q", "k", "v")
    return {
        "dot_product_attention, causal": {
            "plain causal": (BUILTIN["plain causal"][0], qkv),
            f"logits_soft_cap={CAP:g}": (lambda q, k, v: _dpa(q, k, v, logits_soft_cap=CAP),
                                         qkv),
            "ALiBi score_mod": (lambda q, k, v, s: _dpa(q, k, v, score_mod=alibi(s)),
                                (*qkv, "slopes")),
        },
        "flex_attention, causal block_mask": {
            "plain causal": (lambda q, k, v, bm: dilax.flex_attention(q, k, v, block_mask=bm),
                             (*qkv, "causal_bm")),
            f"logits_soft_cap={CAP:g}": (
                lambda q, k, v, bm: dilax.flex_attention(q, k, v, block_mask=bm,
                                                         logits_soft_cap=CAP),
                (*qkv, "causal_bm")),
            "ALiBi score_mod": (
                lambda q, k, v, bm, s: dilax.flex_attention(q, k, v, block_mask=bm,
                                                            score_mod=alibi(s)),
                (*qkv, "causal_bm", "slopes")),
        },
        "documents, causal": {
            "dot_product_attention segment_ids": (BUILTIN["segment_ids causal"][0],
                                                  (*qkv, "segment_ids")),
            "dot_product_attention mask_mod + block_mask": (
                lambda q, k, v, ids, bm: dilax.dot_product_attention(
                    q, k, v, mask_mod=_doc_mask(ids), block_mask=bm),
                (*qkv, "segment_ids", "docs_bm")),
            "flex_attention mask_mod + block_mask": (
                lambda q, k, v, ids, bm: dilax.flex_attention(
                    q, k, v, mask_mod=_doc_mask(ids), block_mask=bm),
                (*qkv, "segment_ids", "docs_bm")),
            "dot_product_attention mask_mod + create_block_mask in the call": (
                bm_docs, (*qkv, "segment_ids")),
        },
    }


def _stats(times: list[tuple[float, float]]) -> dict[str, Any]:
    """Wall-time statistics of ``(wall, cpu)`` seconds per call, and the CPU times."""
    ms = [1e3 * w for w, _ in times]
    cpu = [1e3 * c for _, c in times]
    return dict(ms_median=statistics.median(ms), ms_min=min(ms), ms_max=max(ms), ms=ms,
                cpu_ms_median=statistics.median(cpu), cpu_ms=cpu)


def ratio_of(new: dict, base: dict) -> dict[str, float]:
    """``new / base`` of the wall-time medians, the min and max of the per-round ratios (call
    ``i`` of ``new`` over call ``i`` of ``base``, taken in the same round), and the ratio of
    the CPU-time medians."""
    per = [a / b for a, b in zip(new["ms"], base["ms"], strict=True)]
    return dict(ratio=new["ms_median"] / base["ms_median"], ratio_min=min(per),
                ratio_max=max(per), cpu_ratio=new["cpu_ms_median"] / base["cpu_ms_median"])


def measure_groups(x: dict, repeats: int, block_size, log,
                   warmup: int = 1) -> tuple[list[dict], dict]:
    """(a) and (b): every group's rows, interleaved round by round per pass."""
    t0 = time.perf_counter()
    x = dict(x, causal_bm=create_block_mask(causal_mask, None, None, x["n"], x["n"],
                                            block_size=block_size))
    docs_fn = jax.jit(lambda ids: create_block_mask(_doc_mask(ids), 1, None, x["n"], x["n"],
                                                    block_size=block_size))
    x["docs_bm"] = jax.block_until_ready(docs_fn(x["segment_ids"]))
    extra = dict(create_block_mask_ms=_stats([call_seconds(docs_fn, (x["segment_ids"],))
                                              for _ in range(3)]),
                 docs_bm_density=float(x["docs_bm"].density()),
                 causal_bm_density=float(x["causal_bm"].density()))
    rows = []
    for group, members in groups(block_size).items():
        progs = {}
        for row, (fn, names) in members.items():
            args = tuple(x[a] for a in names)
            for pas, (c, mem) in programs(fn, args, x["ct"]).items():
                for _ in range(warmup):
                    call_seconds(c, args)
                progs[row, pas] = (c, args, mem)
            log(f"  compiled {group}: {row}")
        for pas in PASSES:
            times: dict[str, list] = {row: [] for row in members}
            for _ in range(repeats):
                for row in members:
                    c, args, _ = progs[row, pas]
                    times[row].append(call_seconds(c, args))
            base = None
            for row in members:
                rec = dict(group=group, row=row, pass_=pas, n=x["n"], **_stats(times[row]),
                           memory=progs[row, pas][2])
                if base is None:
                    base = rec
                else:
                    rec.update(vs=base["row"], **ratio_of(rec, base))
                rows.append(rec)
                log(f"  {group} | {row} | {pas}: {rec['ms_median']:.1f} ms"
                    + (f" ({rec['ratio']:.3f}x)" if "ratio" in rec else ""))
    extra["seconds"] = time.perf_counter() - t0
    return rows, extra


class _Worker:
    """One :mod:`benchmarks.flex_ab` worker process on ``checkout`` (started here, ready
    after :meth:`ready`: both sides compile at once)."""

    def __init__(self, checkout: Path, n: int, warmup: int, rows: list[str]):
        env = dict(os.environ, PYTHONPATH=str(checkout))
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("flex_ab.py")), str(n), str(warmup),
             *rows],
            cwd=checkout, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ready(self) -> _Worker:
        hello = json.loads(self.proc.stdout.readline())
        self.dilax = hello["dilax"]
        self.memory = {(r, p): m for r, p, m in hello["memory"]}
        return self

    def seconds(self, row: str, pas: str) -> tuple[float, float]:
        self.proc.stdin.write(json.dumps({"row": row, "pass": pas}) + "\n")
        self.proc.stdin.flush()
        got = json.loads(self.proc.stdout.readline())
        return got["seconds"], got["cpu"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def measure_ab(n: int, base: str, base_tree: str | None, rounds: int, log,
               rows: tuple[str, ...] = tuple(BUILTIN), warmup: int = 1) -> list[dict]:
    """(c): the built-in ``rows`` of ``base`` and of this checkout, alternately call by
    call."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(base_tree) if base_tree else Path(tmp) / "base"
        if not base_tree:
            subprocess.run(["git", "worktree", "add", "--detach", str(tree), base], cwd=ROOT,
                           check=True, capture_output=True)
        try:
            sides = {"base": _Worker(tree, n, warmup, rows),
                     "new": _Worker(ROOT, n, warmup, rows)}
            sides = {name: w.ready() for name, w in sides.items()}
            log(f"  workers ready: base {sides['base'].dilax}, new {sides['new'].dilax}")
            times = {(s, r, p): [] for s in sides for r in rows for p in PASSES}
            for i in range(rounds):
                order = ("base", "new") if i % 2 == 0 else ("new", "base")  # ABBA
                for row in rows:
                    for pas in PASSES:
                        for side in order:
                            times[side, row, pas].append(sides[side].seconds(row, pas))
            for w in sides.values():
                w.close()
        finally:
            if not base_tree:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                               check=False, capture_output=True)
    out = []
    for row in rows:
        for pas in PASSES:
            b, nw = _stats(times["base", row, pas]), _stats(times["new", row, pas])
            mb, mn = sides["base"].memory[row, pas], sides["new"].memory[row, pas]
            hb, hn = mb.pop("hlo"), mn.pop("hlo")
            out.append(dict(row=row, pass_=pas, n=n, base=b, new=nw, **ratio_of(nw, b),
                            memory_base=mb, memory_new=mn, memory_equal=mb == mn,
                            hlo_base=hb, hlo_new=hn, same_hlo=hb == hn,
                            dilax_base=sides["base"].dilax, dilax_new=sides["new"].dilax))
            log(f"  A/B {row} | {pas}: base {b['ms_median']:.1f} ms, new "
                f"{nw['ms_median']:.1f} ms, {out[-1]['ratio']:.3f}x, memory equal "
                f"{mb == mn}, same HLO {hb == hn}")
    return out


def summary(rows: list[dict], ab: list[dict]) -> dict[str, Any]:
    """Each ratio against its target (``ok``), read off the rows."""
    out = {}
    for r in rows:
        if "ratio" in r and "in the call" not in r["row"]:
            out[f"{r['group']}: {r['row']} / {r['vs']}, {r['pass_']}"] = dict(
                ratio=round(r["ratio"], 3), cpu_ratio=round(r["cpu_ratio"], 3),
                target=TARGET_MODS, ok=r["ratio"] <= TARGET_MODS)
    for r in ab:
        out[f"A/B new / base: {r['row']}, {r['pass_']}"] = dict(
            ratio=round(r["ratio"], 3), cpu_ratio=round(r["cpu_ratio"], 3), target=TARGET_AB,
            ok=r["ratio"] <= TARGET_AB,
            memory_equal=r["memory_equal"], same_hlo=r["same_hlo"])
    return out


def _load() -> dict[str, Any]:
    found = subprocess.run(["pgrep", "-f", "benchmarks quality"], capture_output=True,
                           text=True).stdout.split()
    return dict(loadavg=[round(x, 2) for x in os.getloadavg()],
                other_benchmark_running=[p for p in found if int(p) != os.getpid()] != [])


def markdown(result: dict[str, Any]) -> str:
    cfg, m = result["config"], result["machine"]
    lines = [f"### `flex` — {m.get('date', '')}, {result['platform']}", "",
             f"b=1, n={cfg['n']:,}, h={cfg['h']}, d={cfg['d']}, float32, causal; "
             f"{cfg['docs']} packed documents; block_mask block_size={tuple(cfg['block_size'])}"
             f"; median of {cfg['repeats']} calls per row (interleaved round by round, after "
             f"the compile and {cfg['warmup']} warm-up call(s)). Load average before / after: "
             f"{result['load_before']['loadavg']}"
             f" / {result['load_after']['loadavg']}"
             + (" (another benchmark was running)"
                if result["load_before"]["other_benchmark_running"]
                or result["load_after"]["other_benchmark_running"] else "") + ".", "",
             "| group | row | pass | median ms (min–max) | ratio (per-round min–max) | "
             "CPU-time ratio | temp MiB |", "|---|---|---|---:|---:|---:|---:|"]
    mib = 2**20
    for r in result["rows"]:
        ratio = (f"{r['ratio']:.3f} ({r['ratio_min']:.3f}–{r['ratio_max']:.3f})"
                 if "ratio" in r else "baseline")
        cpu = f"{r['cpu_ratio']:.3f}" if "ratio" in r else "—"
        lines.append(f"| {r['group']} | {r['row']} | {r['pass_']} | {r['ms_median']:.1f} "
                     f"({r['ms_min']:.1f}–{r['ms_max']:.1f}) | {ratio} | {cpu} | "
                     f"{r['memory']['temp'] / mib:.1f} |")
    e = result["extra"]
    lines += ["", f"`create_block_mask` of the documents mask alone (jitted): "
              f"{e['create_block_mask_ms']['ms_median']:.1f} ms; block densities: causal "
              f"{e['causal_bm_density']:.3f}, documents {e['docs_bm_density']:.3f}."]
    if result["ab"]:
        lines += ["", f"A/B of the built-in paths: base `{cfg['base']}` vs this checkout, "
                  f"{cfg['rounds']} rounds, one worker process per side, calls alternated "
                  "(ABBA).", "",
                  "| row | pass | base ms | new ms | new/base (per-round min–max) | CPU-time "
                  "new/base | memory base = new (temp, arg, out MiB) | same HLO |",
                  "|---|---|---:|---:|---:|---:|---|---|"]
        for r in result["ab"]:
            mb = r["memory_base"]
            mem = ", ".join(f"{mb[k] / mib:.1f}" for k in ("temp", "argument", "output"))
            lines.append(f"| {r['row']} | {r['pass_']} | {r['base']['ms_median']:.1f} | "
                         f"{r['new']['ms_median']:.1f} | {r['ratio']:.3f} "
                         f"({r['ratio_min']:.3f}–{r['ratio_max']:.3f}) | {r['cpu_ratio']:.3f} | "
                         f"{'yes' if r['memory_equal'] else 'NO'} ({mem}) | "
                         f"{'yes' if r['same_hlo'] else 'no'} |")
    lines += ["", "Targets: " + "; ".join(
        f"{k}: {v['ratio']:.3f} {'<=' if v['ok'] else '>'} {v['target']}"
        + ("" if v.get("memory_equal", True) else " (memory differs)")
        for k, v in result["summary"].items()) + "."]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks flex", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=None, help="sequence length (default 16384)")
    p.add_argument("--quick", action="store_true", help="n = 2048 (default with --n unset)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per row (default 3)")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed calls per program after its compile (default 1; 0 where a "
                        "call takes seconds: the compile is separate, .lower().compile())")
    p.add_argument("--rounds", type=int, default=4,
                   help="A/B calls per side and row (default 4)")
    p.add_argument("--block-size", type=int, nargs=2, default=[512, 256],
                   metavar=("BQ", "BK"), help="create_block_mask block_size (default 512 256:"
                   " the XLA core's causal forward tiles at h = 8)")
    p.add_argument("--base", default=BASE, help=f"git revision of the A/B (default {BASE})")
    p.add_argument("--base-tree", default=None,
                   help="an existing checkout to use as the base instead of --base")
    p.add_argument("--no-ab", action="store_true", help="skip the A/B (c)")
    p.add_argument("--ab-rows", default=",".join(BUILTIN), metavar="ROW,...",
                   help=f"the built-in rows of the A/B (default: {','.join(BUILTIN)})")
    p.add_argument("--out", default=None, help="output folder (default benchmarks/runs/...)")
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    n = args.n or (2048 if args.quick else 16384)
    out = Path(args.out or common.default_out("flex"))
    log = (lambda *_: None) if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    load_before, t0 = _load(), time.time()
    x = dict(inputs(n), n=n)
    block_size = tuple(args.block_size)
    rows, extra = measure_groups(x, args.repeats, block_size, log, args.warmup)
    ab = [] if args.no_ab else measure_ab(
        n, args.base, args.base_tree, args.rounds, log, args.ab_rows.split(","), args.warmup)
    machine = common.machine_description()
    result = dict(
        command="flex", machine=machine,
        platform=f"XLA core on {jax.default_backend()} ({machine['cpu']}, "
                 f"{machine['cores']} cores), jax {jax.__version__}",
        config=dict(n=n, h=x["q"].shape[2], d=x["q"].shape[3], docs=int(
            x["segment_ids"].max()) + 1, repeats=args.repeats, rounds=args.rounds,
            block_size=list(block_size), warmup=args.warmup, base=args.base,
            base_tree=args.base_tree,            quick=args.quick),
        rows=rows, ab=ab, extra=extra, summary=summary(rows, ab), load_before=load_before,
        load_after=_load(), wall_seconds=time.time() - t0)
    out.mkdir(parents=True, exist_ok=True)
    (out / "flex.json").write_text(json.dumps(result, indent=1, default=str))
    text = markdown(result)
    (out / "flex.md").write_text(text)
    print(text)
    print(f"results in {out}/: flex.json, flex.md")
    return 0
