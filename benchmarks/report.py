"""Writes benchmark results as JSON, a Markdown table and PNG plots."""

from __future__ import annotations

import json
import os
from typing import Any

from dilax.memory import format_bytes


def _fmt(x: Any, spec: str = ".1f") -> str:
    return "—" if x is None else format(x, spec)


def markdown(result: dict[str, Any]) -> str:
    if result["command"] == "ring-plan":
        from benchmarks.ring_plan_cli import markdown as plan_markdown

        return plan_markdown(result)
    if result["command"] in ("quality", "quality-estimate"):
        from benchmarks.quality_report import markdown as quality_markdown

        return quality_markdown(result)
    cfg = result.get("config", {})
    m = result.get("machine", {})
    lines = [
        f"### `{result['command']}` — {m.get('date', '')}, {m.get('cpu', '')} "
        f"({m.get('cores', '?')} cores, {m.get('backend', '')}, jax {m.get('jax', '')})",
        "",
        f"b={cfg.get('batch')}, h={cfg.get('heads')}, hk={cfg.get('kv_heads')}, "
        f"d={cfg.get('head_dim')}, {cfg.get('dtype')}, segment_lengths="
        f"{tuple(cfg.get('segment_lengths', ()))}, dilation_rates="
        f"{tuple(cfg.get('dilation_rates', ()))}, causal={cfg.get('causal')}",
        "",
    ]
    rows = result.get("rows", [])
    if result["command"] == "decode":
        lines += ["| row | context n | ms per token, median (min–max) | tokens/s | × dilax |",
                  "|---|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r['row']} | {r['n']:,} | {r['ms_median']:.2f} "
                         f"({r['ms_min']:.2f}–{r['ms_max']:.2f}) | {r['tokens_per_s']:,.1f} | "
                         f"{_fmt(r.get('vs_dilax'), '.1f')} |")
    elif result["command"] == "max-seq":
        lines += ["| row | n | pass | status | memory (XLA) | seconds |",
                  "|---|---:|---|---|---:|---:|"]
        for r in rows:
            mem = format_bytes(r["memory_bytes"]) if "memory_bytes" in r else "—"
            lines.append(f"| {r['row']} | {r['n']:,} | {r['pass_']} | {r.get('status', '')} | "
                         f"{mem} | {_fmt(r.get('seconds'))} |")
    else:
        lines += _row_table(rows)
    packed = [r for r in rows if "time_vs_unpacked" in r or "memory_vs_unpacked" in r]
    if packed:  # the mixture-packed row against the mixture row of the same n and pass
        lines += ["", "Packed vs unpacked (mixture-packed / mixture, same n and pass): "
                  + "; ".join(
            f"n={r['n']:,} {r['pass_']}: time {_fmt(r.get('time_vs_unpacked'), '.2f')}x, "
            f"memory {_fmt(r.get('memory_vs_unpacked'), '.2f')}x" for r in packed)]
    summary = result.get("summary")
    if summary:
        lines += ["", "Summary: `" + json.dumps(summary) + "`"]
    mm = [r["matmul_gflops"] for r in rows if r.get("matmul_gflops")]
    if mm:
        how = ("timed interleaved with its calls, best call" if result.get("probe") ==
               "interleaved"
               else "taken beside it")  # results from before the interleaved probe
        lines += ["", f"Same-run fp32 2048² matmul: {min(mm):.0f}–{max(mm):.0f} GFLOP/s "
                  f"(% matmul compares each row with the probe {how}). "
                  "FLOPs: 4·d per attended (query, key) pair forward, 14·d forward+backward."]
    return "\n".join(lines) + "\n"


def _time(r: dict[str, Any]) -> str:
    if "ms_median" not in r:
        return "—"
    t = f"{r['ms_median']:.1f}"
    if "ms_min" in r and "ms_max" in r:
        t += f" ({r['ms_min']:.1f}–{r['ms_max']:.1f})"
    return t


# (header, alignment, cell, what it means): the columns of the speed/memory/scaling/demo
# tables; a column no row has a value for is left out (a memory-only run shows no timings)
_COLUMNS = (
    ("median ms (min–max)", "---:", _time, "wall time of one call, median of the timed calls"),
    ("GFLOP/s", "---:", lambda r: _fmt(r.get("gflops")),
     "attended pairs × FLOPs per pair / median time"),
    ("% matmul", "---:", lambda r: _fmt(r.get("pct_matmul"), ".0f"),
     "GFLOP/s as a share of the same-run fp32 matmul probe"),
    ("vs dense", "---:", lambda r: _fmt(r.get("vs_dense"), ".2f"),
     "time / the dense row's time at the same n and pass"),
    ("vs torch", "---:", lambda r: _fmt(r.get("vs_torch"), ".2f"),
     "time / our PyTorch grouped implementation's time (--compare-torch)"),
    ("peak memory", "---:",
     lambda r: format_bytes(r["memory_bytes"]) if "memory_bytes" in r else "—",
     "XLA's compiled peak (memory_analysis: temp + arguments + output - aliased)"),
    ("× qkvo", "---:", lambda r: _fmt(r.get("memory_over_floor"), ".2f"),
     "peak memory / the bytes of q, k, v and the output (the floor any call needs)"),
    ("tokens/s", "---:", lambda r: _fmt(r.get("tokens_per_s"), ",.0f"),
     "b·n / median time"),
)


def _row_table(rows: list[dict[str, Any]]) -> list[str]:
    """The rows' table, with only the columns some row has a value for, and a legend."""
    measured = [r for r in rows if "skipped" not in r]
    cols = [c for c in _COLUMNS if any(c[2](r) != "—" for r in measured)] or list(_COLUMNS)
    lines = ["| row | n | pass | " + " | ".join(c[0] for c in cols) + " |",
             "|---|---:|---|" + "|".join(c[1] for c in cols) + "|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['row']} | {r['n']:,} | {r['pass_']} | skipped: {r['skipped']} |"
                         + " |" * (len(cols) - 1))
            continue
        lines.append(f"| {r['row']} | {r['n']:,} | {r['pass_']} | "
                     + " | ".join(c[2](r) for c in cols) + " |")
    return lines + ["", "Columns: " + "; ".join(f"{c[0]}: {c[3]}" for c in cols) + "."]


def config_title(result: dict[str, Any]) -> str:
    """The configuration and machine of a result in two short lines, for a plot's title (a
    PNG shown alone must say what it measured)."""
    if result.get("command") in ("quality", "quality-estimate"):
        from benchmarks.quality_report import config_title as quality_title

        return quality_title(result)
    cfg, m = result.get("config", {}), result.get("machine", {})
    shape = (f"b={cfg.get('batch')} h={cfg.get('heads')} hk={cfg.get('kv_heads')} "
             f"d={cfg.get('head_dim')} {cfg.get('dtype')}")
    branches = (f"w={tuple(cfg.get('segment_lengths', ()))} "
                f"r={tuple(cfg.get('dilation_rates', ()))}")
    # the window belongs to the rows that use it (mixture-window), not to the whole command
    windowed = any("window" in str(r.get("row", "")) for r in result.get("rows", []))
    extra = [x for x in ("causal" if cfg.get("causal") else "non-causal", cfg.get("mode"),
                         windowed and cfg.get("local_window") is not None
                         and f"local window {cfg.get('local_window')}") if x]
    machine = (f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, {m.get('backend', '?')}, "
               f"jax {m.get('jax', '?')}, {str(m.get('date', ''))[:10]}")
    return f"{shape}, {branches}, {', '.join(extra)}\n{machine}"


def plots(result: dict[str, Any], out_dir: str, name: str) -> list[str]:
    if result.get("command") in ("quality", "quality-estimate"):
        from benchmarks.quality_report import plots as quality_plots

        return quality_plots(result, out_dir, name)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    rows = [r for r in result.get("rows", []) if "n" in r]
    paths = []
    for key, ylabel, fname in (("ms_median", "time (ms)", f"{name}_time.png"),
                               ("memory_bytes", "peak memory (MiB)", f"{name}_memory.png")):
        series: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for r in rows:
            if key in r:
                val = r[key] / 2**20 if key == "memory_bytes" else r[key]
                series.setdefault((r["row"], r["pass_"]), []).append((r["n"], val))
        series = {k: v for k, v in series.items() if len(v) >= 2}
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for (row, pas), pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    label=row if pas == "decode" else f"{row} {pas}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length n" if result.get("command") == "decode"
                      else "sequence length n")
        ax.set_ylabel(ylabel)
        what = (f"dilax {name}: {ylabel} vs n" if name != "decode"
                else "one decode step (ms per token) vs context")
        title = f"{what}\n{config_title(result)}"
        ax.set_title(title, fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out_dir, fname)
        fig.savefig(path, dpi=110, metadata={"Title": title})  # the title, also as text
        plt.close(fig)
        paths.append(path)
    return paths


def write_outputs(result: dict[str, Any], out_dir: str, name: str) -> dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, f"{name}.json")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    text = markdown(result)
    md_path = os.path.join(out_dir, f"{name}.md")
    with open(md_path, "w") as f:
        f.write(text)
    out = {"json": json_path, "markdown": md_path, "markdown_text": text}
    for i, p in enumerate(plots(result, out_dir, name)):
        out[f"plot{i}"] = p
    return out
