"""The quality benchmark's outputs: the Markdown tables (laid out like the LongNet paper's
Table 2) and the plots; the command is :mod:`benchmarks.quality`."""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from typing import Any

import numpy as np

from benchmarks.quality_setup import (
    BYTE_VOCAB,
    POSITION_BUCKETS,
    PROBE_VALUES,
    Arm,
    model_config,
    pairs_of,
    structural_reach,
)

# ----------------------------------------------------------------------------- outputs


def _spread(values: list[float]) -> dict[str, float]:
    return dict(mean=float(np.mean(values)), min=float(min(values)), max=float(max(values)),
                std=float(np.std(values, ddof=1)) if len(values) > 1 else 0.0)


def summarize(s: dict[str, Any], arms: list[Arm], lm: list[dict], probes: list[Arm],
              pr: list[dict]) -> dict[str, Any]:
    from benchmarks.rows import FWD_BWD_FLOPS_PER_PAIR

    short, long_ = s["short"], s["short"] * s["factor"]
    head_dim = s["d_model"] // s["num_heads"]
    tokens = s["steps"] * s["batch"] * long_
    mcfg = model_config(s, arms[0], BYTE_VOCAB)
    # matmul FLOPs outside attention per token (fwd+bwd = 3x fwd): q,k,v,out projections,
    # the FFN, the LM head
    dense_per_token = 6 * (s["num_layers"] * (4 * s["d_model"] ** 2 + 2 * s["d_model"]
                                              * s["dim_feedforward"]) + s["d_model"] * 256)
    rows = []
    for arm in arms:
        recs = [r for r in lm if r["arm"] == arm.name]
        pairs_row = pairs_of(arm.train_len, s["num_heads"], arm.model_fields())
        pairs_token = pairs_row / arm.train_len
        attn = FWD_BWD_FLOPS_PER_PAIR * head_dim * pairs_token * s["num_layers"] * tokens
        row = dict(arm=arm.name, train_len=arm.train_len, flags=arm.flags,
                   config={k: v for k, v in arm.model_fields().items()},
                   attended_pairs_per_row=pairs_row, attended_pairs_per_token=pairs_token,
                   attention_train_flops=attn, other_train_flops=dense_per_token * tokens,
                   seeds=len(recs))
        if recs:
            row["bpb"] = {n: _spread([r["bpb"][n] for r in recs]) for n in recs[0]["bpb"]}
            # paired by seed (same seed: the same training windows for every arm)
            base = {r["seed"]: r for r in lm if r["arm"] == arms[0].name}
            paired = [r for r in recs if r["seed"] in base]
            if arm is not arms[0] and paired:
                row["bpb_minus_first"] = {
                    n: _spread([r["bpb"][n] - base[r["seed"]]["bpb"][n] for r in paired])
                    for n in recs[0]["bpb"]}
            row["position_bpb"] = np.mean([r["position_bpb"] for r in recs], axis=0).tolist()
            row["curve"] = np.mean([r["curve"] for r in recs], axis=0).tolist()
            row["step_s"] = statistics.median(r["step_s"] for r in recs if r["step_s"])
            row["per_seed"] = [dict(seed=r["seed"], bpb=r["bpb"], step_s=r["step_s"])
                               for r in recs]
        rows.append(row)
    prows = []
    for arm in probes:
        recs = [r for r in pr if r["arm"] == arm.name]
        row = dict(arm=arm.name, config=arm.model_fields(), seeds=len(recs))
        if recs:
            row["buckets"] = recs[0]["buckets"]
            row["accuracy"] = [_spread(list(v)) for v in zip(*[r["accuracy"] for r in recs])]
            row["final_loss"] = _spread([r["final_loss"] for r in recs])
            row["step_s"] = statistics.median(r["step_s"] for r in recs if r["step_s"])
            row["per_seed"] = [dict(seed=r["seed"], accuracy=r["accuracy"],
                                    final_loss=r["final_loss"]) for r in recs]
            row["reach"] = structural_reach(long_, s["num_heads"], s["num_layers"],
                                            arm.model_fields(), row["buckets"])
            if all("accuracy_2x" in r for r in recs):  # at twice the training length
                row["buckets_2x"] = recs[0]["buckets_2x"]
                row["accuracy_2x"] = [_spread(list(v))
                                      for v in zip(*[r["accuracy_2x"] for r in recs])]
                row["reach_2x"] = structural_reach(2 * long_, s["num_heads"],
                                                   s["num_layers"], arm.model_fields(),
                                                   row["buckets_2x"])
                per = max(1, s["probe_eval"] // len(row["buckets_2x"])) * len(recs)
                row["reach_ends"] = _reach_end(row["buckets_2x"], row["accuracy_2x"], per)
        prows.append(row)
    del mcfg
    return dict(rows=rows, probe=prows, training_tokens_per_arm=tokens,
                eval_lengths=[short, long_])



def _reach_end(buckets: list[tuple[int, int]], acc: list[dict[str, float]], queries: int,
               z: float = 3.0) -> int | None:
    """The upper end of the run of distance buckets, from the shortest, whose pooled accuracy
    over ``queries`` held-out queries per bucket lies ``z`` binomial standard deviations or
    more above chance (``1 / PROBE_VALUES``); None when the first bucket does not."""
    p0 = 1.0 / PROBE_VALUES
    bar = p0 + z * math.sqrt(p0 * (1.0 - p0) / max(queries, 1))
    end = None
    for (_, hi), a in zip(buckets, acc):
        if a["mean"] < bar:
            break
        end = hi - 1
    return end


def _pm(sp: dict[str, float] | None, spec: str = ".3f") -> str:
    if not sp:
        return "—"
    if sp["max"] == sp["min"]:
        return format(sp["mean"], spec)
    return f"{sp['mean']:{spec}} ({sp['min']:{spec}}–{sp['max']:{spec}})"


def _eng(x: float) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if x >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f}"


def markdown(result: dict[str, Any]) -> str:
    if result["command"] == "quality-estimate":
        e = result["estimate"]
        lines = [f"### `quality --estimate`: {e['total_s'] / 60:.0f} min for sizes "
                 f"`{json.dumps(result['sizes'])}`", "",
                 "| run | compile s | step s | one run s |", "|---|---:|---:|---:|"]
        lines += [f"| {k} | {v['compile_s']:.1f} | {v['step_s']:.3f} | {v['run_s']:.0f} |"
                  for k, v in e["parts"].items()]
        return "\n".join(lines) + "\n"
    s, m = result["sizes"], result.get("machine", {})
    short, long_ = result["eval_lengths"]
    seeds = s["seeds"]
    first = result["rows"][0]["arm"] if result["rows"] else "—"
    command = ("quality " + " ".join(result["argv"]) if "argv" in result
               else f"quality{' --quick' if result.get('quick') else ''}")
    lines = [
        f"### `{command.strip()}` — {m.get('date', '')}, "
        f"{m.get('cpu', '')} ({m.get('cores', '?')} cores, {m.get('backend', '')}, jax "
        f"{m.get('jax', '')}); {result.get('wall_seconds', 0) / 60:.1f} min"
        + (f" ({result['runs_cached_before']} of "
           f"{(len(result['rows']) + len(result['probe'])) * seeds} runs read from the cache, "
           "trained by an earlier invocation)" if result.get("runs_cached_before") else ""),
        "",
        f"Byte-level LMs on the Python {sys.version_info.major}.{sys.version_info.minor} "
        f"standard library ({result['data']['files_train']} train / "
        f"{result['data']['files_held_out']} held-out files, split by a hash of the path); "
        f"d_model={s['d_model']}, heads={s['num_heads']}, layers={s['num_layers']}, "
        f"ffn={s['dim_feedforward']}; {s['steps']} steps of {s['batch']} x {long_} tokens "
        f"({result['training_tokens_per_arm']:,} training tokens per arm), AdamW lr "
        f"{s['lr']}; {seeds} seed(s): mean (min–max).",
        "",
        "Bits per byte on held-out code (lower is better), laid out like the LongNet "
        "paper's Table 2:",
        "",
        f"| model | train length | eval {short} | eval {long_} | eval {long_} − {first}, "
        f"paired by seed | attended pairs / token | attention train FLOPs | other train "
        f"FLOPs |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        b = r.get("bpb", {})
        d = r.get("bpb_minus_first", {}).get(str(long_))
        lines.append(f"| {r['arm']} | {r['train_len']} | {_pm(b.get(str(short)))} | "
                     f"{_pm(b.get(str(long_)))}{' ¹' if r['arm'] == 'dense' else ''} | "
                     f"{_pm(d, '+.3f') if d else '—'} | "
                     f"{r['attended_pairs_per_token']:.1f} | "
                     f"{_eng(r['attention_train_flops'])} | {_eng(r['other_train_flops'])} |")
    lines += ["", f"¹ beyond its training length: blockwise, blocks of {short} "
              "(every query attends the earlier tokens of its own block). Attended pairs: "
              "causal (head, query, key) entries per token and layer in the arm's training "
              "rows; attention FLOPs = 14 · head_dim per pair (forward + backward) · layers · "
              "tokens. The sparse arm's window and stride are chosen to match LongNet's pairs. "
              f"Paired: the mean (min–max) over seeds of the arm's bits per byte minus "
              f"{first}'s with the same seed (the same training windows), negative = better.",
              ""]
    lines += [f"Bits per byte by position in the {long_}-token window "
              f"({POSITION_BUCKETS} buckets of {long_ // POSITION_BUCKETS}):", "",
              "| model | " + " | ".join(f"{i * long_ // POSITION_BUCKETS}–" for i in
                                       range(POSITION_BUCKETS)) + " |",
              "|---|" + "---:|" * POSITION_BUCKETS]
    for r in result["rows"]:
        if "position_bpb" in r:
            lines.append(f"| {r['arm']} | " + " | ".join(f"{v:.2f}" for v in r["position_bpb"])
                         + " |")
    probe = [r for r in result["probe"] if "accuracy" in r]
    if probe:
        buckets = probe[0]["buckets"]
        lines += ["", f"Key-value recall probe (length {long_}; {s['probe_steps']} steps of "
                  f"{s['probe_batch']} rows with {s['probe_queries']} queries each, lr "
                  f"{s['probe_lr']}; {s['probe_pairs']} pair(s) per row): accuracy by the "
                  f"distance from the query back to the value, {s['probe_eval']} held-out "
                  f"queries (chance {1 / PROBE_VALUES:.3f}):", "",
                  "| probe arm | " + " | ".join(f"d {lo}–{hi - 1}" for lo, hi in buckets)
                  + " | final train loss |",
                  "|---|" + "---:|" * (len(buckets) + 1)]
        for r in probe:
            lines.append(f"| {r['arm']} | " + " | ".join(_pm(a, ".2f") for a in r["accuracy"])
                         + f" | {_pm(r['final_loss'], '.2f')} |")
        reach = [r for r in probe if "reach" in r]
        lines += [] if not reach else [
                  "", "Structural reach: the fraction of (value, query) pairs at each distance "
                  f"that a {s['num_layers']}-layer model of the arm's attention pattern can "
                  "connect at all (some position must read both the key and the value, and "
                  "the query must read that position; a necessary condition, "
                  "benchmarks.quality_setup.structural_reach):", "",
                  "| probe arm | " + " | ".join(f"d {lo}–{hi - 1}" for lo, hi in buckets)
                  + " |", "|---|" + "---:|" * len(buckets)]
        for r in reach:
            lines.append(f"| {r['arm']} | " + " | ".join(f"{a:.2f}" for a in r["reach"])
                         + " |")
        lines += _beyond_lines(probe, long_)
    lines += ["", "Reproduce an arm by hand: `python -m dilax.train --data FILE "
              f"--d-model {s['d_model']} --num-heads {s['num_heads']} --num-layers "
              f"{s['num_layers']} --dim-feedforward {s['dim_feedforward']} ARM-FLAGS` with:", ""]
    for r in result["rows"]:
        lines.append(f"- {r['arm']}: `{r['flags']}`")
    return "\n".join(lines) + "\n"


def _beyond_lines(probe: list[dict[str, Any]], long_: int) -> list[str]:
    """The probe at twice the training length: accuracy and structural reach by distance,
    and where each arm's reach ends."""
    probe = [r for r in probe if "accuracy_2x" in r]
    if not probe:
        return []
    buckets = probe[0]["buckets_2x"]
    lines = ["", f"The same probe models evaluated at {2 * long_} tokens, twice their training "
             "length (the segments keep their lengths; the rows hold more of them): accuracy "
             "/ structural reach by distance, and the last distance up to which the mean "
             "accuracy stays 3 binomial standard deviations or more above chance (all seeds' "
             "queries pooled), from the shortest distances on:", "",
             "| probe arm | " + " | ".join(f"d {lo}–{hi - 1}" for lo, hi in buckets)
             + " | reach ends at |", "|---|" + "---:|" * (len(buckets) + 1)]
    for r in probe:
        end = r.get("reach_ends")
        lines.append(f"| {r['arm']} | " + " | ".join(
            f"{a['mean']:.2f} / {c:.2f}" for a, c in zip(r["accuracy_2x"], r["reach_2x"]))
            + f" | {'—' if end is None else f'd = {end}'} |")
    return lines


def config_title(result: dict[str, Any]) -> str:
    """Sizes and machine in two short lines, for a plot's title (and its PNG metadata)."""
    s, m = result.get("sizes", {}), result.get("machine", {})
    long_ = s.get("short", 0) * s.get("factor", 0)
    sizes = (f"d={s.get('d_model')} h={s.get('num_heads')} layers={s.get('num_layers')} "
             f"ffn={s.get('dim_feedforward')}, L_s={s.get('short')} L={long_}, "
             f"{s.get('steps')} steps x {s.get('batch')}, probe {s.get('probe_steps')} x "
             f"{s.get('probe_batch')}, {s.get('seeds')} seed(s)")
    machine = (f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, {m.get('backend', '?')}, "
               f"jax {m.get('jax', '?')}, {str(m.get('date', ''))[:10]}")
    return f"{sizes}\n{machine}"


def plots(result: dict[str, Any], out_dir: str, name: str) -> list[str]:
    if result["command"] != "quality":
        return []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    short, long_ = result["eval_lengths"]
    sub = config_title(result)
    paths = []

    def save(fig, ax, title, fname):
        title = f"{title}\n{sub}"
        ax.set_title(title, fontsize=8)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out_dir, fname)
        fig.savefig(path, dpi=100, metadata={"Title": title})
        plt.close(fig)
        paths.append(path)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for r in result["rows"]:
        if "curve" in r:
            c = np.asarray(r["curve"])
            ax.plot(c[:, 0], c[:, 1], label=f"{r['arm']} (train {r['train_len']})")
    ax.set_xlabel("step (same tokens per step for every arm)")
    ax.set_ylabel("training loss (bits per byte)")
    save(fig, ax, "quality: training curves", f"{name}_curves.png")

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    width = long_ // POSITION_BUCKETS
    centres = np.arange(POSITION_BUCKETS) * width + width / 2
    for r in result["rows"]:
        if "position_bpb" in r:
            ax.plot(centres, r["position_bpb"], marker="o", label=r["arm"])
    for x in range(short, long_, short):
        ax.axvline(x, color="grey", lw=0.5, ls="--")
    ax.set_xlabel(f"position in the {long_}-token held-out window (dashed: multiples of "
                  f"{short})")
    ax.set_ylabel("bits per byte")
    save(fig, ax, "quality: loss vs position", f"{name}_positions.png")

    probe = [r for r in result["probe"] if "accuracy" in r]
    if probe:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        mids = [(lo + hi - 1) / 2 for lo, hi in probe[0]["buckets"]]
        for r in probe:
            ax.plot(mids, [a["mean"] for a in r["accuracy"]], marker="o", label=r["arm"])
        ax.axhline(1 / PROBE_VALUES, color="grey", ls=":", label="chance")
        ax.axvline(short, color="grey", lw=0.5, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("distance from the query back to the value (dashed: the short length)")
        ax.set_ylabel("recall accuracy")
        ax.set_ylim(-0.02, 1.02)
        save(fig, ax, "quality: key-value recall vs distance", f"{name}_probe.png")
    return paths
