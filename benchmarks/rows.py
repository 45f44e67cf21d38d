"""The measured rows of ``speed``/``memory``/``scaling``: one function per row, its attended
pairs and FLOPs, and :func:`measure_rows`, which times and sizes every (row, n, pass) next to a
matmul probe and adds the ratios (vs dense, vs torch, % of matmul)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import dilax
from benchmarks import common
from benchmarks.common import memory_limit, progress
from dilax.branch.plan import attended_pairs
from dilax.memory import format_bytes, memory_report

FWD_FLOPS_PER_PAIR = 4  # x head_dim: QK^T and PV, 2 FLOPs per multiply-add
# fwd+bwd: forward 4d plus backward 10d (recompute QK^T, dV, dP, dS K, dS^T Q) = 3.5x forward,
# the FlashAttention-2 convention.
FWD_BWD_FLOPS_PER_PAIR = 14

DEFAULT_ROWS = ("dense", "mixture", "grouped")
# opt-in: --rows mixture,mixture-packed
EXTRA_ROWS = ("mixture-padded", "mixture-window", "mixture-packed")
# mixture-packed: documents of log-uniform lengths in this range, drawn once per n (fixed seed)
PACKED_DOC_LENGTHS = (256, 8192)
PACKED_SEED = 0


def packed_document_lengths(n: int, lo: int = PACKED_DOC_LENGTHS[0],
                            hi: int = PACKED_DOC_LENGTHS[1], seed: int = PACKED_SEED
                            ) -> np.ndarray:
    """Lengths of the documents of the ``mixture-packed`` row at ``n``: log-uniform integers
    in ``[lo, hi]`` drawn from ``default_rng([seed, n])`` until they cover ``n``; the last one
    is cut to fit (so it may be shorter than ``lo``). Sums to ``n``."""
    rng = np.random.default_rng([seed, n])
    lengths, total = [], 0
    while total < n:
        length = int(round(float(np.exp(rng.uniform(np.log(lo), np.log(hi))))))
        length = min(length, n - total)
        lengths.append(length)
        total += length
    return np.asarray(lengths, np.int64)


def packed_segment_ids(batch: int, n: int) -> jax.Array:
    """int32 ``(batch, n)``: document ids of :func:`packed_document_lengths` (the same packing
    in every row)."""
    lengths = packed_document_lengths(n)
    ids = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)
    return jnp.asarray(np.broadcast_to(ids, (batch, n)))


def config_of(args) -> dict[str, Any]:
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
    if row == "mixture-packed":  # the same n as packed documents of mixed lengths
        def packed(q, k, v):
            # ids as a training step has them, computed at run time: a constant would have
            # XLA fold the document tables into the program (slow compiles, untimed work)
            zero = (q[0, 0, 0, 0] * 0).astype(jnp.int32)  # x * 0 is not folded for floats
            ids = packed_segment_ids(q.shape[0], q.shape[1]) + zero
            return dilax.dilated_attention(q, k, v, ws, rs, is_causal=causal,
                                           implementation=impl, segment_ids=ids)
        return packed
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
    ws, rs = tuple(cfg["segment_lengths"]), tuple(cfg["dilation_rates"])
    if row == "mixture-packed":  # each document's own pairs
        return sum(attended_pairs(int(m), h, ws, rs, mode, cfg["causal"])
                   for m in packed_document_lengths(n))
    return attended_pairs(n, h, ws, rs, mode, cfg["causal"])


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
    bar = progress(len(all_rows) * len(ns) * len(passes), "benchmark", quiet)
    results = []
    limit = memory_limit()
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
        flat = by_key.get(("mixture", r["n"], r["pass_"]))
        if r["row"] == "mixture-packed" and flat:  # packed vs unpacked, same n and pass
            if "ms_median" in flat and "ms_median" in r:
                r["time_vs_unpacked"] = r["ms_median"] / flat["ms_median"]
            if flat.get("memory_bytes") and r.get("memory_bytes"):
                r["memory_vs_unpacked"] = r["memory_bytes"] / flat["memory_bytes"]
        dense = by_key.get(("dense", r["n"], r["pass_"]))
        if r["row"] != "dense" and dense and "ms_median" in dense and "ms_median" in r:
            r["vs_dense"] = r["ms_median"] / dense["ms_median"]
