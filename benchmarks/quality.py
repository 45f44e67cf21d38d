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
import statistics
import sys
import sysconfig
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

# ----------------------------------------------------------------------------- sizes

# --quick: tiny models, a few minutes on 2 CPU cores
QUICK = dict(d_model=64, num_heads=4, num_layers=2, dim_feedforward=128, short=64, factor=4,
             batch=4, steps=100, lr=1e-2, warmup=10, eval_windows=16, probe_steps=100,
             probe_batch=8, probe_eval=128, probe_pairs=1, probe_queries=16, probe_lr=3e-3,
             local_window=16, seeds=2)
# the default: about two hours on this 2-core CPU for 2 seeds (docs/quality.md: estimated
# with --estimate from timed steps)
DEFAULT = dict(d_model=128, num_heads=4, num_layers=2, dim_feedforward=512, short=128,
               factor=4, batch=4, steps=2000, lr=2e-3, warmup=100, eval_windows=64,
               probe_steps=2400, probe_batch=4, probe_eval=512, probe_pairs=1,
               probe_queries=32, probe_lr=3e-3, local_window=32, seeds=2)
SIZE_FLAGS = tuple(DEFAULT)

HELD_OUT_BELOW = 26  # first SHA-1 byte of the relative path < 26: held out (26/256 ~ 10 %)
POSITION_BUCKETS = 16
PROBE_FILLER, PROBE_KEYS, PROBE_VALUES = 32, 16, 16  # probe vocabulary: 64 tokens
FILLER_USED = 32
# bytes as a ModelConfig vocabulary: only its length matters to the model
BYTE_VOCAB = "".join(chr(i) for i in range(256))
PROBE_VOCAB = "".join(chr(0x100 + i) for i in range(PROBE_FILLER + PROBE_KEYS + PROBE_VALUES))


# ----------------------------------------------------------------------------- data


def stdlib_files(root: str | None = None) -> list[tuple[str, Path]]:
    """``(relative path, path)`` of the stdlib's ``.py`` files, sorted by relative path."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    out = []
    for p in base.rglob("*.py"):
        rel = p.relative_to(base).as_posix()
        if "site-packages" in rel.split("/") or not p.is_file():
            continue
        out.append((rel, p))
    return sorted(out)


def is_held_out(rel: str) -> bool:
    """The stable split: SHA-1 of the relative path, first byte below ``HELD_OUT_BELOW``."""
    return hashlib.sha1(rel.encode()).digest()[0] < HELD_OUT_BELOW


def load_corpus(root: str | None = None, max_bytes: int | None = None
                ) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """``(train bytes, held-out bytes, description)``: the files of each split concatenated in
    path order with a blank line between them (``max_bytes``: stop adding files to a split
    once it holds that many bytes)."""
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    sizes = {False: 0, True: 0}
    counts = {False: 0, True: 0}
    for rel, p in stdlib_files(root):
        held = is_held_out(rel)
        if max_bytes is not None and sizes[held] >= max_bytes:
            continue
        try:
            raw = p.read_bytes()
        except OSError:
            continue
        parts[held].append(raw + b"\n\n")
        sizes[held] += len(raw) + 2
        counts[held] += 1
    train = np.frombuffer(b"".join(parts[False]), np.uint8).astype(np.int32)
    held = np.frombuffer(b"".join(parts[True]), np.uint8).astype(np.int32)
    desc = dict(source=str(root or sysconfig.get_paths()["stdlib"]),
                files_train=counts[False], files_held_out=counts[True],
                bytes_train=int(train.size), bytes_held_out=int(held.size),
                split=f"sha1(relative path)[0] < {HELD_OUT_BELOW}: held out",
                rows="files concatenated in path order (blank line between), random windows "
                     "(training) / evenly spaced windows (evaluation) cut from the stream")
    return train, held, desc


def train_windows(data: np.ndarray, seed: int, step: int, batch: int, n: int) -> np.ndarray:
    """``(batch, n + 1)`` random windows of ``data``, a pure function of ``(seed, step)``."""
    starts = np.random.default_rng([seed, step, 40]).integers(0, len(data) - n - 1, batch)
    return np.stack([data[s:s + n + 1] for s in starts])


def eval_windows(data: np.ndarray, count: int, n: int) -> np.ndarray:
    """``(count, n + 1)`` evenly spaced windows of the held-out ``data``."""
    starts = np.linspace(0, len(data) - n - 2, count).astype(np.int64)
    return np.stack([data[s:s + n + 1] for s in starts])


def cut_rows(windows: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``(b, L + 1)`` windows -> inputs and targets ``(b * L / n, n)``: the same tokens and
    targets cut into rows of ``n`` (the context restarts at every row)."""
    x, y = windows[:, :-1], windows[:, 1:]
    return x.reshape(-1, n), y.reshape(-1, n)


def probe_batch(seed: int, step: int, batch: int, n: int, pairs: int, queries: int = 1,
                distances: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray,
                                                                np.ndarray]:
    """Key-value recall: ``(x (b, n), target (b, n), distance (b, n))``.

    Filler tokens (``0 .. 31``) with ``pairs`` key-value pairs ``(k, v)`` (keys ``32 .. 47``,
    distinct within a row; values ``48 .. 63``): the key at ``p - 1``, its value at ``p``.
    Later in the row the first pair's key appears again ``queries`` times, as a query: the
    target at a query position is that pair's value (the value itself is never repeated, so
    it must be read from position ``p``), and ``distance`` is the query position minus ``p``.
    ``target`` and ``distance`` are -1 at the other positions. ``distances`` (one per row)
    places one query per row at that distance (the evaluation set spreads them evenly);
    otherwise ``p`` is uniform and the queries uniform after it.
    """
    rng = np.random.default_rng([seed, step, 41])
    x = rng.integers(0, FILLER_USED, (batch, n))
    target = np.full((batch, n), -1, np.int64)
    dist = np.full((batch, n), -1, np.int64)
    for i in range(batch):
        keys = rng.choice(PROBE_KEYS, pairs, replace=False) + PROBE_FILLER
        vals = rng.integers(0, PROBE_VALUES, pairs) + PROBE_FILLER + PROBE_KEYS
        if distances is not None:
            d = int(distances[i])
            vpos = int(rng.integers(1, n - d))
            qpos = [vpos + d]
        else:
            vpos = int(rng.integers(1, n - 1))
            after = np.arange(vpos + 1, n)
            qpos = sorted(rng.choice(after, min(queries, len(after)), replace=False).tolist())
        taken = {vpos - 1, vpos, *qpos}
        x[i, vpos - 1], x[i, vpos] = keys[0], vals[0]
        for k, v in zip(keys[1:], vals[1:]):  # distractor pairs elsewhere
            for _ in range(100):
                p = int(rng.integers(1, n))
                if not taken & {p - 1, p}:
                    taken |= {p - 1, p}
                    x[i, p - 1], x[i, p] = k, v
                    break
        for q in qpos:
            x[i, q], target[i, q], dist[i, q] = keys[0], vals[0], q - vpos
    return x.astype(np.int32), target.astype(np.int32), dist


# ----------------------------------------------------------------------------- arms


@dataclasses.dataclass(frozen=True)
class Arm:
    """One model of the comparison: its name, training length and ``ModelConfig`` fields."""

    name: str
    train_len: int
    fields: tuple[tuple[str, Any], ...]  # ModelConfig fields besides the shared sizes
    flags: str  # the python -m dilax.train flags of its attention

    def model_fields(self) -> dict[str, Any]:
        return dict(self.fields)


def longnet_branches(short: int, factor: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """LongNet's geometric branches from ``short`` to ``short * factor``: ``w_i = short 2^i``,
    ``r_i = 2^i`` (``w / r = short`` in every branch)."""
    k = int(round(math.log2(factor)))
    if 2 ** k != factor or k < 1:
        raise ValueError(f"--factor must be a power of two >= 2, got {factor}")
    return tuple(short * 2 ** i for i in range(k + 1)), tuple(2 ** i for i in range(k + 1))


def pairs_of(n: int, heads: int, fields: dict[str, Any]) -> int:
    """Causal (head, query, key) pairs one row of length ``n`` attends (per layer)."""
    from dilax.branch.plan import attended_pairs

    if fields.get("block_sparse") is not None:
        from dilax.patterns import local_strided

        block = fields["block_sparse"][0]
        mask = local_strided(n, *fields["block_sparse"]).block_mask[0]
        if n % block:  # a partial last block: count the token mask
            pat = local_strided(n, *fields["block_sparse"])
            return heads * int(pat.expanded_mask(n, is_causal=True).sum())
        # whole blocks: an active block below the diagonal counts B^2 pairs, a diagonal one
        # its causal half B (B + 1) / 2 (no n x n mask: this runs at GPU lengths too)
        below = int(np.tril(mask, -1).sum())
        diagonal = int(np.diag(mask).sum())
        return heads * (below * block * block + diagonal * block * (block + 1) // 2)
    total = attended_pairs(n, heads, fields["segment_lengths"], fields["dilation_rates"],
                           fields.get("mode", "mixture"), is_causal=True)
    w = fields.get("local_window")
    if w is not None:  # the window branch: min(p, W) + 1 keys per query
        total += heads * int(np.minimum(np.arange(n), w).sum() + n)
    return total


def match_sparse(n: int, heads: int, target: int, block: int) -> tuple[int, int, int]:
    """``(block, window, stride)`` of :func:`dilax.patterns.local_strided` at length ``n``
    whose causal pairs are the closest to ``target`` (window a multiple of the block, at
    least one block; stride from 2 blocks; ties: the wider window)."""
    nb = n // block
    best = None
    for wb in range(1, nb):
        for stride in range(2, nb + 1):
            spec = (block, wb * block, stride)
            gap = abs(pairs_of(n, heads, dict(block_sparse=spec)) - target)
            key = (gap, -wb)
            if best is None or key < best[0]:
                best = (key, spec)
    return best[1]


def make_arms(s: dict[str, Any]) -> list[Arm]:
    short, long_ = s["short"], s["short"] * s["factor"]
    ws, rs = longnet_branches(short, s["factor"])
    longnet = dict(segment_lengths=ws, dilation_rates=rs, mode="mixture")
    target = pairs_of(long_, s["num_heads"], longnet)
    spec = match_sparse(long_, s["num_heads"], target, max(8, short // 4))
    csv = ",".join
    return [
        Arm("dense", short, (("segment_lengths", (short,)), ("dilation_rates", (1,)),
                             ("attention", "dense")),
            f"--attention dense --seq-len {short}"),
        Arm("sparse", long_, (("segment_lengths", (long_,)), ("dilation_rates", (1,)),
                              ("attention", "block-sparse"), ("block_sparse", spec)),
            f"--attention block-sparse --sparse-pattern {csv(map(str, spec))} "
            f"--seq-len {long_}"),
        Arm("longnet", long_, tuple(longnet.items()),
            f"--segment-lengths {csv(map(str, ws))} --dilation-rates {csv(map(str, rs))} "
            f"--seq-len {long_}"),
        Arm("longnet+window", long_,
            (*longnet.items(), ("local_window", s["local_window"])),
            f"--segment-lengths {csv(map(str, ws))} --dilation-rates {csv(map(str, rs))} "
            f"--local-window {s['local_window']} --seq-len {long_}"),
    ]


def probe_arms(s: dict[str, Any]) -> list[Arm]:
    """LongNet's branches together, then each branch alone (all at the long length)."""
    long_ = s["short"] * s["factor"]
    ws, rs = longnet_branches(s["short"], s["factor"])
    arms = [Arm("longnet", long_, (("segment_lengths", ws), ("dilation_rates", rs)), "")]
    for w, r in zip(ws, rs):
        arms.append(Arm(f"branch w={w} r={r}", long_,
                        (("segment_lengths", (w,)), ("dilation_rates", (r,))), ""))
    return arms


LM_ARMS = ("dense", "sparse", "longnet", "longnet+window")


def select_arms(arms: list[Arm], probes: list[Arm], names: str | None,
                probe: str | None) -> tuple[list[Arm], list[Arm]]:
    """``--arms`` (comma-separated names, default all) and ``--probe-arms`` (``all``:
    LongNet and each branch alone; ``longnet``; ``none``)."""
    if names:
        wanted = [x.strip() for x in names.split(",") if x.strip()]
        unknown = sorted(set(wanted) - set(LM_ARMS))
        if unknown or not wanted:
            raise SystemExit(f"--arms: unknown {unknown}; choose from {', '.join(LM_ARMS)}")
        arms = [a for a in arms if a.name in wanted]
    probe = probe or "all"
    if probe not in ("all", "longnet", "none"):
        raise SystemExit(f"--probe-arms must be all, longnet or none, got {probe!r}")
    probes = {"all": probes, "longnet": probes[:1], "none": []}[probe]
    return arms, probes


def model_config(s: dict[str, Any], arm: Arm, vocab: str):
    from dilax.train.config import ModelConfig

    return ModelConfig(vocab=vocab, d_model=s["d_model"], num_heads=s["num_heads"],
                       num_layers=s["num_layers"], dim_feedforward=s["dim_feedforward"],
                       **arm.model_fields())


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


def distance_buckets(s: dict[str, Any]) -> list[tuple[int, int]]:
    """``[lo, hi)`` distance buckets: quarters and halves of ``L_s``, then doublings to ``L``."""
    short, long_ = s["short"], s["short"] * s["factor"]
    edges = [1, short // 4, short // 2, short]
    while edges[-1] < long_:
        edges.append(edges[-1] * 2)
    edges[-1] = long_ - 1  # distances run to n - 2
    return [(a, b) for a, b in zip(edges[:-1], edges[1:]) if b > a]


def run_probe(s: dict[str, Any], arm: Arm, seed: int, tick=lambda step: None
              ) -> dict[str, Any]:
    """Trains one probe arm with one seed on key-value recall; accuracy by distance."""
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
    buckets = distance_buckets(s)
    per = max(1, s["probe_eval"] // len(buckets))
    dist = np.concatenate([np.linspace(lo, hi - 1, per).astype(np.int64) for lo, hi in buckets])
    x, t, d = probe_batch(10_000 + seed, 0, len(dist), n, s["probe_pairs"], 1, dist)
    pred = np.concatenate([np.asarray(f["probe_predict"](model, jnp.asarray(x[i:i + 32])))
                           for i in range(0, len(x), 32)])
    q = d >= 0  # one query per row
    pred, t, d = pred[q], t[q], d[q]
    acc = [float(np.mean(pred[(d >= lo) & (d < hi)] == t[(d >= lo) & (d < hi)]))
           for lo, hi in buckets]
    tail = max(1, len(losses) // 10)
    return dict(arm=arm.name, seed=seed, buckets=buckets, accuracy=acc,
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
        prows.append(row)
    del mcfg
    return dict(rows=rows, probe=prows, training_tokens_per_arm=tokens,
                eval_lengths=[short, long_])


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
                    probe=("key-value recall: filler, key k and value v at distance d from "
                           "the end, the query k as the last token; the answer is v "
                           f"({PROBE_VALUES} values: chance {1 / PROBE_VALUES:.3f}); "
                           f"{s['probe_pairs']} pair(s) per row (the rest distractors)"),
                ))


# ----------------------------------------------------------------------------- outputs


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
        f"{m.get('jax', '')}); {result.get('wall_seconds', 0) / 60:.1f} min",
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
    lines += ["", "Reproduce an arm by hand: `python -m dilax.train --data FILE "
              f"--d-model {s['d_model']} --num-heads {s['num_heads']} --num-layers "
              f"{s['num_layers']} --dim-feedforward {s['dim_feedforward']} ARM-FLAGS` with:", ""]
    for r in result["rows"]:
        lines.append(f"- {r['arm']}: `{r['flags']}`")
    return "\n".join(lines) + "\n"


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
