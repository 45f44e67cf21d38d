"""The quality benchmark's sizes, data (the Python standard library as bytes, the key-value
recall probe) and arms (attention configurations matched on attended pairs); the command is
:mod:`benchmarks.quality`."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import sysconfig
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


def structural_reach(n: int, heads: int, layers: int, fields: dict[str, Any],
                     buckets: list[tuple[int, int]]) -> list[float]:
    """Per distance bucket ``[lo, hi)``: the fraction of (value ``p``, query ``q = p + d``)
    pairs of a row of ``n`` that a causal model of ``layers`` layers with this dilated
    configuration can connect at all (a necessary condition for the recall probe).

    The key sits at ``p - 1`` and the value at ``p``: some position ``x`` must hold both
    (within ``l`` layers it has read from both, any head, residual included), and the query
    must read ``x`` in the remaining ``layers - l`` layers (``1 <= l < layers``). A dilated
    branch of rate ``r >= 2`` alone never meets this: its positions only exchange across
    multiples of ``r``, so ``p - 1`` and ``p`` never reach one position.
    """
    from dilax.semantics import dilated_counts

    fields = dict(fields)
    counts = dilated_counts(n, heads, tuple(fields["segment_lengths"]),
                            tuple(fields["dilation_rates"]), "mixture", True,
                            fields.get("local_window"))
    step = (counts.any(0) | np.eye(n, dtype=bool)).astype(np.float32)  # reads [x, t]
    power = [np.eye(n, dtype=np.float32)]
    for _ in range(layers):
        power.append(np.minimum(power[-1] @ step, 1.0))  # reach within l layers
    ok = np.zeros((n, n), bool)  # ok[q, p]
    for lay in range(1, layers):
        both = np.zeros((n, n), np.float32)  # both[x, p]: x has read p - 1 and p
        both[:, 1:] = power[lay][:, :-1] * power[lay][:, 1:]
        ok |= (power[layers - lay] @ both) > 0
    out = []
    for lo, hi in buckets:
        hits = [np.diagonal(ok, -d)[1:] for d in range(lo, min(hi, n - 1))]
        hits = np.concatenate([h for h in hits if h.size]) if hits else np.zeros(0)
        out.append(float(hits.mean()) if hits.size else float("nan"))
    return out


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
