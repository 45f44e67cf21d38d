"""``python -m benchmarks quality``: does dilated attention learn long context? (issue 40)

The LongNet paper's Table 2 (language modelling: dense Transformer, sparse Transformer and
LongNet, trained at several lengths and evaluated at several lengths), reproduced in small on
a CPU. Small byte-level LMs (:class:`dilax.models.LongNetLM`, built through
:func:`dilax.train.steps.make_model` from a :class:`dilax.train.ModelConfig`, so every arm is
a ``python -m dilax.train --attention ...`` run) are trained at equal training tokens and
steps, with the same width, depth and optimizer; they differ only in attention:

- ``dense``: dense causal attention, trained at the short length ``L_s`` (one branch
  ``(L_s, 1)``). At the long length it runs blockwise: the same branch cuts the window into
  blocks of ``L_s``, every query attends the earlier tokens of its own block only.
- ``sparse``: a Sparse-Transformer-style fixed pattern at the long length ``L``: local window
  plus every ``stride``-th block (:func:`dilax.patterns.local_strided`), its window and
  stride chosen so that its causal attended pairs are the closest to LongNet's.
- ``longnet``: dilated attention at ``L``, mixture mode, XPOS: segment lengths
  ``L_s, 2 L_s, ..., L`` with rates ``1, 2, ..., L / L_s`` (the paper's geometric shape:
  ``w / r = L_s`` in every branch).
- ``longnet+window``: the same plus a local window branch (``local_window``).

Data: the ``.py`` files of this Python's standard library (``sysconfig.get_paths()["stdlib"]``,
``site-packages`` left out), as bytes; a file is held out iff the first byte of the SHA-1 of
its path relative to the stdlib is below 26 (about 10 %), so the split is the same on every
machine with the same Python. Each split is the files concatenated in path order (one blank
line between files) and training windows are drawn at random from it (files are cut or joined
to fill the long rows). Vocabulary: the 256 byte values; the loss is bits per byte.

Evaluation: bits per byte on fixed, evenly spaced held-out windows at the long length, and the
same tokens cut into rows of the short length; the loss by position bucket at the long length;
and a synthetic key-value recall probe (:func:`probe_batch`) trained per arm of the probe
(LongNet's branches together and each branch alone, same steps and sizes), whose accuracy is
reported against the distance between the query and the value it must recall.

Per-run results are cached in ``<out>/<name>-cache/`` as soon as a run finishes: Ctrl-C keeps them
and a rerun with the same flags skips them.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.quality_report import summarize
from benchmarks.quality_setup import (
    BYTE_VOCAB,
    DEFAULT,
    LM_ARMS,
    POSITION_BUCKETS,
    PROBE_KEYS,
    PROBE_VALUES,
    PROBE_VOCAB,
    QUICK,
    SIZE_FLAGS,
    Arm,
    cut_rows,
    eval_windows,
    load_corpus,
    longnet_branches,
    make_arms,
    model_config,
    probe_arms,
    probe_batch,
    select_arms,
    train_windows,
)

# ----------------------------------------------------------------------------- runs


def _jitted():
    """The compiled functions (built lazily: importing this module does not import jax)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    @nnx.jit
    def token_losses(model, x, y):
        logits = model(x, deterministic=True).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y)

    def probe_loss(model, x, t):  # mean over the query positions (t >= 0)
        logits = model(x, deterministic=True).astype(jnp.float32)
        keep = t >= 0
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(t, 0))
        return jnp.sum(jnp.where(keep, losses, 0.0)) / jnp.maximum(keep.sum(), 1)

    @nnx.jit(donate_argnums=(0, 1))
    def probe_step(model, optimizer, x, t):
        loss, grads = nnx.value_and_grad(probe_loss)(model, x, t)
        optimizer.update(model, grads)
        return loss

    @nnx.jit
    def probe_predict(model, x):
        return jnp.argmax(model(x, deterministic=True), axis=-1)

    return dict(token_losses=token_losses, probe_step=probe_step, probe_predict=probe_predict,
                jax=jax, jnp=jnp)


_FNS: dict[str, Any] = {}


def fns() -> dict[str, Any]:
    if not _FNS:
        _FNS.update(_jitted())
    return _FNS


def _losses(model, x: np.ndarray, y: np.ndarray, rows: int = 16) -> np.ndarray:
    """Per-token losses (nats) of ``x, y (b, n)``, ``rows`` rows per call."""
    f = fns()
    out = [np.asarray(f["token_losses"](model, f["jnp"].asarray(x[i:i + rows]),
                                        f["jnp"].asarray(y[i:i + rows])))
           for i in range(0, len(x), rows)]
    return np.concatenate(out)


def _optimizer(model, s: dict[str, Any], steps: int):
    from flax import nnx

    from dilax.train.steps import make_tx

    return nnx.Optimizer(model, make_tx(steps, s["lr"], s["warmup"], 0.1, 1.0), wrt=nnx.Param)


def run_lm(s: dict[str, Any], arm: Arm, seed: int, data: tuple[np.ndarray, np.ndarray],
           tick=lambda step: None) -> dict[str, Any]:
    """Trains one LM arm with one seed; returns its record (curve, bits per byte, positions)."""
    import warnings

    from dilax.train.steps import make_model, train_step

    f = fns()
    jax, jnp = f["jax"], f["jnp"]
    train, held = data
    long_, short = s["short"] * s["factor"], s["short"]
    mcfg = model_config(s, arm, BYTE_VOCAB)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        model = make_model(mcfg, seed)
    opt = _optimizer(model, s, s["steps"])
    curve, step_times = [], []
    every = max(1, s["steps"] // 50)
    acc = []
    for step in range(s["steps"]):
        x, y = cut_rows(train_windows(train, seed, step, s["batch"], long_), arm.train_len)
        t0 = time.perf_counter()
        loss = float(train_step(model, opt, jnp.asarray(x), jnp.asarray(y),
                                jax.random.PRNGKey(step)))
        step_times.append(time.perf_counter() - t0)
        acc.append(loss)
        if (step + 1) % every == 0 or step + 1 == s["steps"]:
            curve.append([step + 1, float(np.mean(acc)) / math.log(2)])
            acc = []
        tick(step + 1)
    t0 = time.perf_counter()
    windows = eval_windows(held, s["eval_windows"], long_)
    bpb, positions = {}, None
    for n in sorted({short, long_}):
        x, y = cut_rows(windows, n)
        losses = _losses(model, x, y)
        bpb[str(n)] = float(losses.mean() / math.log(2))
        if n == long_:
            positions = (losses.mean(axis=0) / math.log(2)).reshape(POSITION_BUCKETS, -1)
    return dict(arm=arm.name, seed=seed, train_len=arm.train_len, bpb=bpb, curve=curve,
                position_bpb=[float(v) for v in positions.mean(axis=1)],
                first_step_s=step_times[0],
                step_s=float(np.median(step_times[1:])) if len(step_times) > 1 else None,
                eval_s=time.perf_counter() - t0)


def distance_buckets(s: dict[str, Any], n: int | None = None) -> list[tuple[int, int]]:
    """``[lo, hi)`` distance buckets in a row of ``n`` (default the long length): quarters
    and halves of ``L_s``, then doublings to ``n``."""
    short, n = s["short"], n or s["short"] * s["factor"]
    edges = [1, short // 4, short // 2, short]
    while edges[-1] < n:
        edges.append(edges[-1] * 2)
    edges[-1] = n - 1  # distances run to n - 2
    return [(a, b) for a, b in zip(edges[:-1], edges[1:]) if b > a]


def _probe_accuracy(s: dict[str, Any], model, seed: int, n: int
                    ) -> tuple[list[tuple[int, int]], list[float]]:
    """Held-out recall accuracy by distance bucket in rows of ``n``, one query per row."""
    f = fns()
    buckets = distance_buckets(s, n)
    per = max(1, s["probe_eval"] // len(buckets))
    dist = np.concatenate([np.linspace(lo, hi - 1, per).astype(np.int64) for lo, hi in buckets])
    x, t, d = probe_batch(10_000 + seed, 0, len(dist), n, s["probe_pairs"], 1, dist)
    rows = max(1, 32 * s["short"] * s["factor"] // n)  # rows per call: same tokens per call
    pred = np.concatenate([np.asarray(f["probe_predict"](model, f["jnp"].asarray(x[i:i + rows])))
                           for i in range(0, len(x), rows)])
    q = d >= 0  # one query per row
    pred, t, d = pred[q], t[q], d[q]
    return buckets, [float(np.mean(pred[(d >= lo) & (d < hi)] == t[(d >= lo) & (d < hi)]))
                     for lo, hi in buckets]


def run_probe(s: dict[str, Any], arm: Arm, seed: int, tick=lambda step: None
              ) -> dict[str, Any]:
    """Trains one probe arm with one seed on key-value recall; accuracy by distance at the
    training length and at twice it (where the arm's reach must end)."""
    from dilax.train.steps import make_model

    f = fns()
    jnp = f["jnp"]
    n = arm.train_len
    model = make_model(model_config(s, arm, PROBE_VOCAB), 1000 + seed)
    opt = _optimizer(model, dict(s, lr=s["probe_lr"]), s["probe_steps"])
    losses, step_times = [], []
    for step in range(s["probe_steps"]):
        x, t, _ = probe_batch(seed, step, s["probe_batch"], n, s["probe_pairs"],
                              s["probe_queries"])
        t0 = time.perf_counter()
        losses.append(float(f["probe_step"](model, opt, jnp.asarray(x), jnp.asarray(t))))
        step_times.append(time.perf_counter() - t0)
        tick(step + 1)
    buckets, acc = _probe_accuracy(s, model, seed, n)
    buckets_2x, acc_2x = _probe_accuracy(s, model, seed, 2 * n)
    tail = max(1, len(losses) // 10)
    return dict(arm=arm.name, seed=seed, buckets=buckets, accuracy=acc,
                buckets_2x=buckets_2x, accuracy_2x=acc_2x,
                final_loss=float(np.mean(losses[-tail:])),
                first_step_s=step_times[0],
                step_s=float(np.median(step_times[1:])) if len(step_times) > 1 else None)


# ----------------------------------------------------------------------------- the command


def _fingerprint(s: dict[str, Any], kind: str, arm: Arm, seed: int) -> str:
    key = json.dumps(dict(sizes={k: s[k] for k in SIZE_FLAGS if k != "seeds"}, kind=kind,
                          arm=dataclasses.asdict(arm), seed=seed, version=1),
                     sort_keys=True, default=str)
    return hashlib.sha1(key.encode()).hexdigest()[:12]


def _cache_path(cache: str, kind: str, arm: Arm, seed: int) -> Path:
    safe = arm.name.replace(" ", "_").replace("=", "").replace("+", "_")
    return Path(cache) / f"{kind}-{safe}-seed{seed}.json"


def _load_cached(path: Path, fp: str) -> dict[str, Any] | None:
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return rec if rec.get("fingerprint") == fp else None


def _save(path: Path, rec: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rec, indent=1))
    os.replace(tmp, path)  # atomic: an interrupted save leaves no half-written record


def _sizes(args: argparse.Namespace) -> dict[str, Any]:
    base = dict(QUICK if args.quick else DEFAULT)
    for k in SIZE_FLAGS:
        v = getattr(args, k, None)
        if v is not None:
            base[k] = v
    checks = dict(d_model=1, num_heads=1, num_layers=1, dim_feedforward=1, short=8, factor=2,
                  batch=1, steps=2, eval_windows=1, probe_steps=2, probe_batch=1,
                  probe_eval=1, probe_pairs=1, probe_queries=1, seeds=1)
    for k, low in checks.items():
        if base[k] < low:
            raise SystemExit(f"--{k.replace('_', '-')} must be >= {low}, got {base[k]}")
    if base["probe_pairs"] > PROBE_KEYS:
        raise SystemExit(f"--probe-pairs must be <= {PROBE_KEYS}")
    if base["d_model"] % base["num_heads"] or (base["d_model"] // base["num_heads"]) % 2:
        raise SystemExit("--d-model / --num-heads must be an even integer (rotary positions)")
    long_ = base["short"] * base["factor"]
    if long_ % POSITION_BUCKETS or base["short"] % 8:
        raise SystemExit(f"--short must be a multiple of 8 and --short * --factor of "
                         f"{POSITION_BUCKETS}")
    try:
        longnet_branches(base["short"], base["factor"])
    except ValueError as e:
        raise SystemExit(str(e)) from None
    return base


def estimate(s: dict[str, Any], arms: list[Arm], probes: list[Arm],
             data: tuple[np.ndarray, np.ndarray], log) -> dict[str, Any]:
    """Times a few steps of every arm at these sizes (after its compile) and extrapolates
    the whole run: steps x seeds x step time, plus one compile and the evaluation per arm."""
    t = dict(s, steps=8, probe_steps=8, eval_windows=max(1, s["eval_windows"] // 8),
             probe_eval=max(8, s["probe_eval"] // 8))
    total, parts = 0.0, {}
    for arm in arms:
        r = run_lm(t, arm, 0, data)
        run = s["steps"] * r["step_s"] + r["eval_s"] * s["eval_windows"] / t["eval_windows"]
        parts[f"lm {arm.name}"] = dict(compile_s=r["first_step_s"], step_s=r["step_s"],
                                       run_s=run)
        total += r["first_step_s"] + s["seeds"] * run
        log(f"  lm {arm.name}: step {r['step_s']:.3f} s, compile {r['first_step_s']:.1f} s")
    for arm in probes:
        r = run_probe(t, arm, 0)
        run = s["probe_steps"] * r["step_s"]
        parts[f"probe {arm.name}"] = dict(compile_s=r["first_step_s"], step_s=r["step_s"],
                                          run_s=run)
        total += r["first_step_s"] + s["seeds"] * run
        log(f"  probe {arm.name}: step {r['step_s']:.3f} s, compile {r['first_step_s']:.1f} s")
    return dict(total_s=total, parts=parts)


def run(args: argparse.Namespace, log=None) -> dict[str, Any]:
    from benchmarks import common

    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    s = _sizes(args)
    arms, probes = select_arms(make_arms(s), probe_arms(s), args.arms, args.probe_arms)
    t_data = time.time()
    train, held, data_desc = load_corpus(args.stdlib, args.max_bytes)
    need = s["short"] * s["factor"] + 2
    if min(len(train), len(held)) < need * 2:
        raise SystemExit(f"the corpus splits are too small ({len(train)} train, {len(held)} "
                         f"held-out bytes) for windows of {need}")
    data_desc["seconds"] = time.time() - t_data
    if args.estimate:
        log(f"timing a few steps of every arm at {s}")
        est = estimate(s, arms, probes, (train, held), log)
        log(f"estimated wall time of the whole run ({s['seeds']} seeds): "
            f"{est['total_s'] / 60:.0f} min")
        return dict(command="quality-estimate", sizes=s, estimate=est, data=data_desc)
    jobs = ([("lm", a, seed) for seed in range(s["seeds"]) for a in arms]
            + [("probe", a, seed) for seed in range(s["seeds"]) for a in probes])
    if getattr(args, "cache", None) is None:
        args.cache = os.path.join(args.out, "quality-cache")
    bar = common.progress(len(jobs), "quality", args.quiet)
    lm, pr, skipped = [], [], 0
    try:
        for kind, arm, seed in jobs:
            fp = _fingerprint(s, kind, arm, seed)
            path = _cache_path(args.cache, kind, arm, seed)
            rec = _load_cached(path, fp)
            if rec is None:
                steps = s["steps"] if kind == "lm" else s["probe_steps"]

                def tick(step, kind=kind, arm=arm, seed=seed, steps=steps):
                    if step % 5 == 0 or step == steps:
                        bar.set_postfix_str(f"{kind} {arm.name} seed {seed}: step "
                                            f"{step}/{steps}")

                rec = (run_lm(s, arm, seed, (train, held), tick) if kind == "lm"
                       else run_probe(s, arm, seed, tick))
                rec["fingerprint"] = fp
                _save(path, rec)
            else:
                skipped += 1
            (lm if kind == "lm" else pr).append(rec)
            bar.update(1)
    except KeyboardInterrupt:
        bar.close()
        done = len(lm) + len(pr)
        log(f"\ninterrupted: {done} of {len(jobs)} runs are cached in {args.cache}; run "
            "the same command (same --out) to continue from there")
        raise
    bar.close()
    summary = summarize(s, arms, lm, probes, pr)
    return dict(command="quality", sizes=s, quick=bool(args.quick), data=data_desc,
                runs_cached_before=skipped, **summary,
                notes=dict(
                    dense_beyond_training_length=(
                        f"blockwise: the dense arm's one branch ({s['short']}, 1) cuts a "
                        f"window of {s['short'] * s['factor']} into blocks of {s['short']}; "
                        "each query attends the earlier tokens of its own block"),
                    short_length_eval=("the long windows' tokens cut into rows of the short "
                                       "length: the same targets, context restarting at each "
                                       "row"),
                    flops=("attended pairs: causal (head, query, key) entries per row and "
                           "layer (dilax.branch.plan.attended_pairs; the block-sparse mask "
                           "counted; the window branch min(p, W) + 1 per query); attention "
                           f"training FLOPs = {14} x head_dim x pairs per token x layers x "
                           "training tokens; other = 6 x matmul weights x tokens"),
                    probe=("key-value recall: filler tokens, the key k at p - 1 and its "
                           "value v at p, later the query k at p + d; the answer is v "
                           f"({PROBE_VALUES} values: chance {1 / PROBE_VALUES:.3f}); "
                           f"{s['probe_pairs']} pair(s) per row (the rest distractors)"),
                ))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks quality",
        description=__doc__.split("\n\n")[0] + " Trains small byte-level LMs that differ only "
        "in attention (dense at the short length, a fixed sparse pattern, LongNet, LongNet + "
        "local window) on the Python standard library and reports bits per byte at the short "
        "and long length, loss by position and a key-value recall probe (docs/quality.md).",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="tiny models: a few minutes on 2 CPU cores (the sizes: "
                        f"{json.dumps(QUICK)})")
    p.add_argument("--estimate", action="store_true",
                   help="time a few steps of every arm at the chosen sizes and print the "
                        "estimated wall time of the whole run (nothing is trained)")
    g = p.add_argument_group("sizes (default: the two-hour CPU run, "
                             f"{json.dumps(DEFAULT)}; raise them on a GPU)")
    for k in SIZE_FLAGS:
        kind = float if k in ("lr", "probe_lr") else int
        g.add_argument(f"--{k.replace('_', '-')}", type=kind, default=None,
                       help={"short": "short length L_s (the dense arm's training length)",
                             "factor": "long length L = factor x L_s (a power of two)",
                             "batch": "rows of length L per step (the dense arm: factor x "
                                      "as many rows of L_s: the same tokens)",
                             "seeds": "seeds per arm (spread reported)",
                             "probe_pairs": "key-value pairs per probe row (1: no "
                                            "distractors)",
                             "local_window": "W of the longnet+window arm",
                             "eval_windows": "held-out windows of length L evaluated"}.get(k))
    p.add_argument("--arms", default=None, metavar="NAME,...",
                   help=f"LM arms to run (default: all of {','.join(LM_ARMS)})")
    p.add_argument("--probe-arms", default="all", choices=("all", "longnet", "none"),
                   help="probe arms: LongNet and each of its branches alone (all), LongNet "
                        "only, or no probe")
    p.add_argument("--stdlib", default=None, metavar="DIR",
                   help="where the .py files are (default: sysconfig's stdlib)")
    p.add_argument("--max-bytes", type=int, default=None,
                   help="bytes per split at most (default: every file)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where the JSON, Markdown, plots and the per-run cache go (default: "
                        "a new benchmarks/runs/<date>-<time>-quality/; rerun with the same "
                        "--out to resume)")
    p.add_argument("--name", default=None,
                   help="file name stem of the outputs (default: quality, quality-quick with "
                        "--quick)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from benchmarks import common
    from benchmarks.report import write_outputs

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    name = args.name or ("quality-quick" if args.quick else "quality")
    if args.estimate:
        name = args.name or "quality-estimate"
    if args.out is None:
        args.out = common.default_out(name)
    args.cache = os.path.join(args.out, f"{name}-cache")  # one JSON per finished run
    t0 = time.time()
    try:
        result = run(args)
    except KeyboardInterrupt:
        return 130
    result["machine"] = common.machine_description()
    result["wall_seconds"] = time.time() - t0
    result["argv"] = [a for a in argv if a not in ("--quiet",)]
    paths = write_outputs(result, args.out, name)
    print(paths["markdown_text"])
    print(f"results in {args.out}/:")
    for key, path in paths.items():
        if key != "markdown_text":
            print(f"  {key + ':':10s} {path}")
    return 0
