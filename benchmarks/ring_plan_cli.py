"""``python -m benchmarks ring --plan``: the plan table (:mod:`benchmarks.ring_model`) and its
validation against compiled programs (:mod:`benchmarks.ring_plan_validate`), as the CLI's
result dict and Markdown."""

from __future__ import annotations

import time
from typing import Any

from benchmarks import ring_plan as RP

PLAN_N = 2**30
PLAN_DEVICES = (64, 128, 256, 512, 1024)

SEEDS_CLAIM = (
    "The seeds' claim: DarcStar-Solutions-Tech/dilated-attention-pytorch, "
    "`doc/billion-token-benchmark-results-2024.md`: \"1,073,741,824 tokens processed "
    "successfully\", ring size 262,144, chunk size 4,096, \"Memory/Device 0.03GB\", "
    "\"tested up to 262,144 device simulation\" (hardware: one GTX 1080, float16; success "
    "criterion: a completed forward pass). LongNet (Ding et al. 2023) claims \"scaling "
    "sequence length to more than 1 billion tokens\". Below: what dilax's ring "
    "holds and sends per device, from its static schedule (forward and training step; the "
    "planner is O(P^2) numpy, so ring sizes up to a few thousand).")


def add_plan_flags(p) -> None:
    """The ``ring`` command's ``--plan`` flags."""
    p.add_argument("--plan", action="store_true",
                   help="no measurement: per-device memory, bytes sent and hops from the "
                        "static schedule for --n (default 2^30) on --devices, LongNet "
                        "branches w = 2048 2^i, r = 2^i unless --segment-lengths/"
                        "--dilation-rates; results ring-plan.{json,md}")
    p.add_argument("--devices", type=lambda t: [int(x) for x in t.split(",") if x],
                   default=None, metavar="P,P,...",
                   help="ring sizes of the plan (default: 64,128,256,512,1024)")
    p.add_argument("--no-validate", dest="validate", action="store_false",
                   help="skip the plan's validation against compiled programs on 8-64 fake "
                        "host devices (minutes)")


def cmd_plan(args) -> dict[str, Any]:
    n = args.n[0] if args.n else PLAN_N
    if args.segment_lengths is None:
        if n < 2048:
            raise SystemExit(f"--n {n}: the default LongNet branches (w = 2048 * 2^i, "
                             f"r = 2^i) need n >= 2048; give --segment-lengths and "
                             f"--dilation-rates for a shorter sequence")
        ws, rs = RP.longnet_config(n)
    else:
        ws, rs = tuple(args.segment_lengths), tuple(args.dilation_rates)
    h = args.heads
    hk = args.kv_heads or max(1, h // 4)
    devices = tuple(args.devices or PLAN_DEVICES)
    bad = [P for P in devices if n % P]
    if bad:
        raise SystemExit(f"--devices {bad}: n={n} is not divisible by them")
    t0 = time.perf_counter()
    rows = RP.plan_rows(n, devices, ws, rs, b=args.batch, h=h, hk=hk, d=args.head_dim)
    plan_seconds = time.perf_counter() - t0
    result: dict[str, Any] = dict(
        command="ring-plan", name="ring-plan",
        config=dict(n=n, batch=args.batch, heads=h, kv_heads=hk, head_dim=args.head_dim,
                    segment_lengths=list(ws), dilation_rates=list(rs), causal=True,
                    layout="contiguous", mode="mixture", devices=list(devices)),
        model=RP.model_text(), seeds_claim=SEEDS_CLAIM, rows=rows,
        plan_seconds=plan_seconds)
    if args.validate:
        from benchmarks.ring_plan_validate import validate

        val = validate()
        result["validation"] = val
        live = [abs(v["live_peak_error"]) for v in val if v.get("live_peak_error") is not None]
        result["summary"] = {
            "max |memory error|": max(abs(v["memory_error"]) for v in val),
            "max |live bytes error|": max(live, default=None),
            "max |bytes sent error|": max(abs(v["sent_error"]) for v in val),
            "cases": len(val)}
    return result


def _mib(x: float) -> str:
    return f"{x / 2**20:,.2f}"


def markdown(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [
        f"### `ring --plan` — n = {cfg['n']:,}, b={cfg['batch']}, h={cfg['heads']}, "
        f"hk={cfg['kv_heads']}, d={cfg['head_dim']}, causal, contiguous layout, mixture",
        "",
        f"Branches: w = {tuple(cfg['segment_lengths'])}, r = {tuple(cfg['dilation_rates'])} "
        f"({len(cfg['segment_lengths'])} branches). Planned in {result['plan_seconds']:.1f} s"
        + (f"; the whole command (validation included) took {result['wall_seconds']:.0f} s"
           if "wall_seconds" in result else "")
        + (f" on {m.get('cpu', '')} ({m.get('cores', '?')} cores, jax {m.get('jax', '')}), "
           f"{m.get('date', '')}" if (m := result.get("machine")) else "") + ".",
        "",
        result["seeds_claim"],
        "",
        "| P | n/P | dtype | forward / device | training step / device | peak phase (train) "
        "| sent fwd / device | sent train / device | hops fwd | hops train |",
        "|---:|---:|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['P']} | {r['m']:,} | {r['dtype']} | {RP.gib(r['forward_bytes'])} | "
            f"{RP.gib(r['train_bytes'])} | {r['train_phase']} | {RP.gib(r['sent_forward'])} | "
            f"{RP.gib(r['sent_train'])} | {r['hops_forward']} | {r['hops_train']} |")
    odd = sorted({x for r in result["rows"] for x in r.get("irregular", ())})
    if odd:
        lines += ["", f"Dilation rates {odd} do not divide n/P: their dilation halos (< r rows "
                  "per branch) are not counted in the bytes sent, and R = ceil(n/P / r)."]
    lines += ["", "Per spanning branch (bfloat16; local branches send nothing):", "",
              "| P | w | r | kind | rows / device | hops | sent fwd | sent bwd |",
              "|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in result["rows"]:
        if r["dtype"] != "bfloat16":
            continue
        local = sum(b["kind"] == "local" for b in r["branches"])
        for b in r["branches"]:
            if b["kind"] != "local":
                lines.append(f"| {r['P']} | {b['w']:,} | {b['r']:,} | {b['kind']} | "
                             f"{b['rows']:,} | {b['hops']} | {RP.gib(b['sent_forward'])} | "
                             f"{RP.gib(b['sent_backward'])} |")
        lines.append(f"| {r['P']} | | | {local} local | | 0 | 0 | 0 |")
    lines += ["", "Memory model (per device):", "", "```", result["model"], "```"]
    val = result.get("validation")
    if val:
        lines += ["", "Validation against compiled programs on fake host devices (XLA:CPU; "
                  "`memory_analysis`: temp + argument + output - alias; live: the most bytes "
                  "of distinct buffer slots live at once in XLA's buffer assignment; permute "
                  "bytes from the optimized HLO). bfloat16 on XLA:CPU is computed and sent in "
                  "float32 (the optimized HLO's collective-permutes are f32), so its model "
                  "uses sw = 4; the table above uses sw = s.", "",
                  "| family | P | n | dtype | pass | compiled MiB | model MiB | error | "
                  "live MiB | model live MiB | live error | permute compiled | permute model "
                  "| model's peak phase |",
                  "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for v in val:
            lp = v.get("compiled_live_peak")
            le = v.get("live_peak_error")
            lines.append(
                f"| {v['family']} | {v['P']} | {v['n']:,} | {v['dtype']} | "
                f"{'train' if v['train'] else 'fwd'} | {_mib(v['compiled_bytes'])} | "
                f"{_mib(v['model_bytes'])} | {100 * v['memory_error']:+.1f} % | "
                f"{_mib(lp) if lp else '—'} | {_mib(v['model_live'])} | "
                f"{'—' if le is None else f'{100 * le:+.1f} %'} | "
                f"{v['compiled_sent']:,} | {v['model_sent']:,} | {v['model_phase']} |")
        s = result["summary"]
        live = s.get("max |live bytes error|")
        lines += ["", f"{s['cases']} cases: max |memory error| "
                  f"{100 * s['max |memory error|']:.1f} %"
                  + ("" if live is None else f", max |live bytes error| {100 * live:.1f} %")
                  + f", max |bytes sent error| {100 * s['max |bytes sent error|']:.1f} %."]
        lines += _misses(val)
    return "\n".join(lines) + "\n"


def _misses(val: list[dict[str, Any]]) -> list[str]:
    """The cases outside 10 %, with the two parts of their error: the live bytes (the
    model's terms) and XLA's heap packing (memory_analysis over the live peak)."""
    out = [v for v in val if abs(v["memory_error"]) > 0.10]
    if not out:
        return ["", "Every case within 10 % of memory_analysis."]
    packs = [v["compiled_bytes"] / v["compiled_live_peak"] for v in val
             if v.get("compiled_live_peak")]
    lines = ["", f"Outside 10 % of memory_analysis ({len(out)} of {len(val)}):", ""]
    for v in out:
        pack = v["compiled_bytes"] / v["compiled_live_peak"] - 1
        lines.append(f"- {v['family']} P={v['P']} {v['dtype']} "
                     f"{'train' if v['train'] else 'fwd'}: {100 * v['memory_error']:+.1f} %; "
                     f"live bytes {100 * v['live_peak_error']:+.1f} %, the heap's packing "
                     f"{100 * pack:+.1f} % against the model's {100 * RP.PACKING:.0f} %"
                     + (": the live bytes miss, buffers the model does not name"
                        if abs(v["live_peak_error"]) > 0.10 else ": the packing") + ".")
    lines += ["", f"memory_analysis exceeds the live peak by {100 * (min(packs) - 1):.1f} to "
              f"{100 * (max(packs) - 1):.1f} % across these programs (where XLA's best-fit "
              "heap and the separate argument/output buffers leave gaps); one stated "
              "allowance cannot put both ends within 10 %, and the model does not fit a "
              "per-program one."]
    return lines

