"""The built-in paths of ``python -m benchmarks flex`` (:mod:`benchmarks.flex`), shared with
its A/B worker.

This module imports only jax, numpy and dilax's public names that existed before the flex
work (``dilax.dot_product_attention`` with ``is_causal`` and ``segment_ids``), so the same
file can run against an older checkout: ``python benchmarks/flex_ab.py`` with
``PYTHONPATH=<checkout>`` is a worker that compiles the built-in programs of that checkout,
prints their ``memory_analysis`` and then times single calls on request (one JSON line in,
one out), so that two workers (base and new) can be timed call by call, alternately.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

# the shape of every row (batch 1, causal, fp32): ``n`` and the documents vary
H, D = 8, 64
DOCS = 8  # documents packed into the sequence (random lengths, seeded)
SEED = 0


def inputs(n: int, h: int = H, d: int = D, docs: int = DOCS, seed: int = SEED) -> dict:
    """``q, k, v (1, n, h, d)`` float32, the cotangent ``ct`` of the output, ``segment_ids
    (1, n)`` int32 (``docs`` documents of random lengths, each at least ``n / (4 docs)``) and
    ALiBi ``slopes (h,)`` float32 (the geometric ones of the ALiBi paper)."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    q, k, v, ct = (jax.random.normal(kk, (1, n, h, d), jnp.float32) for kk in keys)
    rng = np.random.default_rng(seed)
    floor = max(1, n // (4 * docs))
    extra = rng.multinomial(n - floor * docs, np.full(docs, 1.0 / docs))
    ids = np.repeat(np.arange(docs, dtype=np.int32), floor + extra)[None]
    slopes = jnp.asarray([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], jnp.float32)
    return dict(q=q, k=k, v=v, ct=ct, segment_ids=jnp.asarray(ids), slopes=slopes)


def plain(q, k, v):
    """The built-in causal path: ``dot_product_attention(is_causal=True)``."""
    import dilax

    return dilax.dot_product_attention(q, k, v, is_causal=True)


def documents(q, k, v, segment_ids):
    """The built-in documents path: ``segment_ids`` and ``is_causal``."""
    import dilax

    return dilax.dot_product_attention(q, k, v, is_causal=True, segment_ids=segment_ids)


BUILTIN = {"plain causal": (plain, ("q", "k", "v")),
           "segment_ids causal": (documents, ("q", "k", "v", "segment_ids"))}


def memory(compiled) -> dict[str, int]:
    """``memory_analysis`` bytes of a compiled program (temp, argument, output, alias)."""
    m = compiled.memory_analysis()
    return dict(temp=int(m.temp_size_in_bytes), argument=int(m.argument_size_in_bytes),
                output=int(m.output_size_in_bytes), alias=int(m.alias_size_in_bytes))


def hlo_digest(compiled) -> str:
    """A digest of the optimized HLO without what moves with the source (metadata, source
    location tables, instruction numbers): equal digests are the same program."""
    text = re.sub(r", metadata=\{[^}]*\}", "", compiled.as_text())
    text = re.sub(r"(%?[A-Za-z_][\w\-]*)\.\d+", r"\1", text)
    text = re.sub(r",? ?stack_frame_id=\d+", "", text)
    keep, skip = [], False
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            skip = True
        elif skip and line.startswith(("ENTRY", "%", "HloModule")):
            skip = False
        if not skip and not line.startswith("HloModule"):
            keep.append(line)
    return hashlib.sha256("\n".join(keep).encode()).hexdigest()[:16]


def programs(fn, args: tuple, ct) -> dict[str, tuple]:
    """``{"fwd": (compiled, memory), "fwd+bwd": ...}`` of ``fn(*args)``: the forward and the
    gradient of ``<fn(*args), ct>`` with respect to ``q, k, v`` (the first three args)."""
    def loss(*a):
        return jnp.vdot(fn(*a), ct)

    out = {}
    for name, f in (("fwd", fn), ("fwd+bwd", jax.grad(loss, argnums=(0, 1, 2)))):
        c = jax.jit(f).lower(*args).compile()
        out[name] = (c, dict(memory(c), hlo=hlo_digest(c)))
    return out


def call_seconds(compiled, args: tuple) -> tuple[float, float]:
    """``(wall, cpu)`` seconds of one call (blocked on); ``cpu``: this process's CPU time
    (all its threads), less sensitive than the wall time to other processes on the machine."""
    t0, c0 = time.perf_counter(), time.process_time()
    jax.block_until_ready(compiled(*args))
    return time.perf_counter() - t0, time.process_time() - c0


def worker(n: int, warmup: int, rows: list[str]) -> None:
    """Compile the built-in ``rows`` (names of :data:`BUILTIN`) at ``n``, call each
    ``warmup`` times,
    print ``{"dilax": path, "memory": [[row, pass, bytes and HLO digest], ...]}``, then
    answer ``{"row": ..., "pass": ...}`` lines with ``{"seconds": wall, "cpu": cpu}`` (one
    call each)."""
    x = inputs(n)
    progs = {}
    for row in rows:
        fn, names = BUILTIN[row]
        args = tuple(x[a] for a in names)
        for pas, (c, mem) in programs(fn, args, x["ct"]).items():
            for _ in range(warmup):
                jax.block_until_ready(c(*args))
            progs[row, pas] = (c, args, mem)
    import dilax

    print(json.dumps({"dilax": dilax.__file__,
                      "memory": [[r, p, m] for (r, p), (_, _, m) in progs.items()]}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        c, args, _ = progs[req["row"], req["pass"]]
        print(json.dumps(dict(zip(("seconds", "cpu"), call_seconds(c, args)))), flush=True)


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:] or list(BUILTIN))
