"""Autotuning of kernel launch configurations on the device the process runs on.

:func:`autotune` times each candidate config (after warm-up, blocking on the result) and keeps
the fastest. Winners are cached in-process, keyed by the tuning key, the backend and device
kind, and the shapes/dtypes of the arguments, and optionally in a JSON file so later processes
skip the search. A cached winner is returned without building or timing anything.

Example (GPU)::

    from pallas_kernels import KernelConfig, flash_attention
    from pallas_kernels.autotune import autotune, flash_candidates

    def factory(cfg):
        return jax.jit(lambda q, k, v: flash_attention(q, k, v, scale=0.125, block_sizes=cfg))

    best = autotune(factory, flash_candidates(), q, k, v, key="flash_fwd",
                    cache_file="~/.cache/dilax_autotune.json")

Candidates that fail to compile or run (e.g. a tile that exceeds shared memory) are skipped;
if every candidate fails the errors are raised together.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import numpy as np

from pallas_kernels.config import KernelConfig

__all__ = ["autotune", "cache_key", "clear_cache", "flash_candidates", "TIMINGS"]

C = TypeVar("C")

_CACHE: dict[str, Any] = {}
TIMINGS: dict[str, dict[str, float]] = {}
"""Median seconds per candidate (by ``repr``) of every search run in this process."""


def _signature(args: Sequence[Any]) -> str:
    parts = []
    for leaf in jax.tree_util.tree_leaves(args):
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            parts.append(f"{np.dtype(leaf.dtype).name}{list(leaf.shape)}")
        else:
            parts.append(repr(leaf))
    return ",".join(parts)


def cache_key(key: str, *args: Any) -> str:
    """The cache key of ``key`` for ``args`` on the default device."""
    device = jax.devices()[0]
    return f"{key}|{jax.default_backend()}|{device.device_kind}|{_signature(args)}"


def clear_cache() -> None:
    """Forgets the in-process winners (JSON cache files are left alone)."""
    _CACHE.clear()
    TIMINGS.clear()


def _load_file(path: str) -> dict[str, str]:
    try:
        with open(path) as f:
            data = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _store_file(path: str, full_key: str, winner_repr: str) -> None:
    data = _load_file(path)
    data[full_key] = winner_repr
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)  # atomic: concurrent readers see the old or the new file


def _time(fn: Callable[..., Any], args: Sequence[Any], warmup: int, iters: int) -> float:
    for _ in range(max(1, warmup)):
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(max(1, iters)):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def autotune(
    fn_factory: Callable[[C], Callable[..., Any]],
    candidates: Sequence[C],
    *args: Any,
    key: str | None = None,
    cache_file: str | os.PathLike | None = None,
    warmup: int = 1,
    iters: int = 5,
) -> C:
    """Returns the fastest of ``candidates`` for ``fn_factory(candidate)(*args)``.

    Args:
      fn_factory: builds the function to time from one candidate (usually a jitted closure).
      candidates: hashable configs with a stable ``repr`` (e.g. :class:`KernelConfig`).
      *args: the arguments to time with; their shapes/dtypes are part of the cache key.
      key: name of the tuned operation (default: ``fn_factory``'s qualified name).
      cache_file: optional JSON file holding ``{cache key: repr(winner)}``; read before
        searching, updated (atomically) after.
      warmup, iters: untimed calls (compilation), then timed calls (median is used).

    Returns:
      One element of ``candidates``. A winner already cached (in-process or in
      ``cache_file``) for the same key, device and argument shapes is returned without
      calling ``fn_factory``.
    """
    candidates = list(candidates)
    if not candidates:
        raise ValueError("autotune needs at least one candidate, got an empty sequence")
    if key is None:
        key = getattr(fn_factory, "__qualname__", None) or repr(fn_factory)
    full_key = cache_key(key, *args)
    by_repr = {repr(c): c for c in candidates}

    cached = _CACHE.get(full_key)
    if cached is not None and repr(cached) in by_repr:
        return by_repr[repr(cached)]
    path = os.path.expanduser(os.fspath(cache_file)) if cache_file is not None else None
    if path is not None:
        stored = _load_file(path).get(full_key)
        if stored in by_repr:
            _CACHE[full_key] = by_repr[stored]
            return by_repr[stored]

    timings: dict[str, float] = {}
    errors: list[str] = []
    for candidate in candidates:
        try:
            timings[repr(candidate)] = _time(fn_factory(candidate), args, warmup, iters)
        except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
            errors.append(f"{candidate!r}: {type(e).__name__}: {e}")
    if not timings:
        raise RuntimeError("autotune: every candidate failed:\n" + "\n".join(errors))
    TIMINGS[full_key] = timings
    winner = by_repr[min(timings, key=timings.get)]
    _CACHE[full_key] = winner
    if path is not None:
        _store_file(path, full_key, repr(winner))
    return winner


def flash_candidates(head_dim: int = 64) -> list[KernelConfig]:
    """A small search space for :func:`pallas_kernels.flash_attention` on Hopper-class GPUs."""
    out = []
    for bq, bk in ((64, 32), (64, 64), (128, 32), (128, 64), (128, 128)):
        if head_dim > 64 and bq * bk > 128 * 64:
            continue
        for warps in (4, 8):
            for stages in (2, 3):
                out.append(KernelConfig(block_q=bq, block_k=bk, block_q_dkv=64,
                                        block_k_dkv=min(bk, 64), block_q_dq=64,
                                        block_k_dq=min(bk, 64), num_warps=warps,
                                        num_stages=stages))
    return out
