"""The ring's cost plan: per-device memory, bytes sent and hops of ring dilated attention at
scales past this machine, on paper (``python -m benchmarks ring --plan`` prints it).

Everything here is computed from shapes and the STATIC ring schedule, built from the ring's
own geometry (:func:`~dilax.dilated.ring_branches.branch_kind`,
:func:`~dilax.dilated.ring_branches.ring_blocks`, :func:`~dilax.sp.ring_vjp.row_chunk`,
:func:`~dilax.sp.schedule.ring_streams`); nothing is compiled
(:mod:`benchmarks.ring_plan_validate` checks the model against compiled programs).

Configuration: ``b, n, h, hk, d``, branches ``(w_i, r_i)``, causal, contiguous layout, P
devices, mixture mode (every branch covers all ``h`` heads). Per device ``m = n / P``. Branch
kinds as in :func:`dilax.dilated.ring_branches.branch_op`: *local* (``m % w == 0``), *halo* or
*ring*. A branch has ``R = ceil(m / r)`` dilated rows per device (modelled for ``r | m``),
``U`` virtual kv heads of ``G`` query heads (``U G = h``, :func:`dilax.branch.plan.plan_branch`).

Communication (exact, from :func:`dilax.sp.schedule.ring_streams`): a ring branch's stream of
``H`` hops sends the dilated K and V chunk ``b R U d`` (itemsize ``sw``) ``H`` times forward; the
backward ring sends K, V once, then K, V and the float32 dK, dV accumulators ``H - 1`` more
times, then dK, dV home once (``ret``). Hops = ppermute rounds. A halo branch sends
``2 (L - 1)`` dilated rows of K and V per device (``L = w / r``).

Memory per device (bytes) = (inputs + the largest phase) x (1 + PACKING). A phase is the
sum of named terms live together (each a function below), read off XLA's buffer assignment
of compiled programs (values deduplicated by buffer slot); ``s`` = input itemsize, ``sw`` =
itemsize of the work copies (``s``; 4 on XLA:CPU, which upcasts bfloat16), float32 = 4.
PACKING = 0.07 stands for the gaps XLA leaves in its allocations (memory_analysis over the
live peak: 0 to 17 % in the 24 validation programs, the most in forward programs whose peak
is a branch phase, where the output's own allocation is mostly idle; training steps 0 to 4 %).
It is one constant chosen on those programs (any of 0.055 to 0.09 puts all 24 within 10 %),
not a per-program fit. Terms marked (XLA:CPU) are buffers XLA:CPU materializes that other
backends fuse or bitcast away: the validation counts them (``Config.xla_cpu``), the plan
table does not.

forward
  inputs        q, k, v shards ``b m (h + 2 hk) d s`` (never float32 copies of whole
                shards: the core reads half-precision inputs as uint16 bits in its loops)
  results       every finished branch keeps ``out`` float32 + ``lse``: ``b R h (d + 1) 4``
  ring branch   dilated q ``b R h d sw`` (none for r = 1, a view; one more when the hops
                run in a loop, > 1 hop), K/V chunks ``b R U d sw`` x2 in flight (x4 in a
                loop: K and V in use are loop carries), the online-softmax state
                ``b R h (d + 1) 4``, a row chunk of queries and its partial output, two
                score tiles ``b h bq bk 4``; (XLA:CPU, half precision) the uint16 bits of
                the core's operands, a row chunk of q and the K/V chunks ``s`` (the core
                reads them as bits, a bitcast XLA:CPU copies)
  local branch  its result being built, two score tiles, a query and an output row block
                ``b h bq d 4``; (XLA:CPU, half precision) the bits of the whole shards
                ``b m (h + 2 hk) d s``
  merge         all results, the merged output ``b m h d s`` (its weighted sum is fused with
                the rounding to the output dtype) and the per-position statistics
training step (grad of sum(out) w.r.t. q, k, v)
  forward       as above, the results kept as residuals
  row stats     (XLA:CPU) the backward's first pass: all results, the cotangent and every
                branch's dilated cotangent in float32 ``b R h d 4`` (none for r = 1 in
                float32), made before the first of their reductions
  backward      the float32 accumulators dq, dk, dv ``b m (h + 2 hk) d 4``, the cotangent
                ``b m h d s`` (output dtype), the row statistics; per ring branch
                (:func:`dilax.sp.ring_vjp.ring_backward_in_place`: the queries are read and
                dq is added in place, every pair's dK/dV go into the travelling ones, the
                own chunk is visited last) float32 dO ``b R h d 4``, the K/V chunks in use
                (input dtype) (+ the next ones in flight, > 1 hop, ``sw``), (XLA:CPU, half
                precision) the bits of the q shard and of the chunks, or float32 copies of
                them where those and dO's stay within ``dilax.core.xla._WIDEN_LIMIT``
                (:func:`backward_reads`: the core then reads them plain), the travelling
                float32 dK/dV (sent after the pair's work), five score tiles of the ring's
                backward blocks (``RING_BACKWARD_BLOCKS``); per local branch five score
                tiles and 14 row
                blocks ``b h bq d 4`` (the cotangent's weighting fused into them; if
                upcast: float32 dO, three tiles, three blocks), (XLA:CPU) the shards' bits
                or their float32 copies (as for the ring branches);
                segments of one backward block (``w / r <= 128``): the core's loop bodies
                do not depend on the loop index and XLA hoists them, so float32 dO, seven
                tiles, five row blocks and four K/V blocks ``b U bk d 4``
  end           the gradients in the input dtype (if not float32) beside the accumulators

After a change to the ring (e.g. its backward, :mod:`dilax.sp.ring_vjp`), re-check the terms
with one command: ``python -m benchmarks ring --plan`` (validation included) or
``python -m benchmarks.ring_plan_validate 8,16,32,64 float32,bfloat16``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from dilax.branch.plan import plan_branch
from dilax.core import BlockSizes
from dilax.core.xla import backward_reads_bits
from dilax.dilated.ring_branches import branch_kind, ring_blocks
from dilax.semantics import effective_segment_length
from dilax.sp.ring_vjp import RING_BLOCKS, row_chunk
from dilax.sp.schedule import geometry, ring_streams

F32 = 4


@dataclasses.dataclass(frozen=True)
class Config:
    n: int
    P: int
    ws: tuple[int, ...]
    rs: tuple[int, ...]
    b: int = 1
    h: int = 8
    hk: int = 2
    d: int = 64
    s: int = 4  # input itemsize: 4 float32, 2 bfloat16
    causal: bool = True
    # Itemsize of the work copies (dilated q, k, v, travelling chunks, cotangent); default
    # ``s``. XLA:CPU upcasts bfloat16 work to float32 (the optimized HLO sends f32 chunks where
    # the program sends bf16), so the CPU validation models bfloat16 with 4.
    work_s: int | None = None
    # XLA:CPU materializes what the model assumes other backends fuse or bitcast away: the
    # uint16 bits of the core's half-precision operands (:func:`bits`) and the float32
    # dilated cotangents of the backward's row statistics (:func:`row_statistics_pass`).
    # The CPU validation sets it; the plan table does not.
    xla_cpu: bool = False

    @property
    def m(self) -> int:
        return self.n // self.P

    @property
    def sw(self) -> int:
        return self.work_s or self.s


@dataclasses.dataclass(frozen=True)
class Branch:
    w: int  # effective segment length
    r: int
    kind: str  # "local", "halo" or "ring"
    R: int  # dilated rows per device
    U: int
    G: int
    hops: tuple[int, ...]  # per stream (ring)
    L: int  # w / r
    # the core's blocks: a ring branch's (dilax.dilated.ring_branches.ring_blocks); local and
    # halo branches are modelled with the local branches' RING_BLOCKS
    blocks: BlockSizes = RING_BLOCKS


def longnet_config(n: int, base: int = 2048) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """LongNet-style branches ``w_i = base 2^i``, ``r_i = 2^i`` (``w_i / r_i = base``), up to
    ``w = n``."""
    k = int(math.log2(n // base))
    return tuple(base << i for i in range(k + 1)), tuple(1 << i for i in range(k + 1))


@functools.lru_cache(maxsize=4096)
def _heads(h: int, hk: int, r: int) -> tuple[int, int]:
    """``(U, G)`` of a mixture branch of rate ``r`` (depends only on the heads)."""
    p = plan_branch(r, h, hk, r, r, tuple(range(h)), tuple(j % r for j in range(h)))
    return len(p.kv_heads), p.q_per_kv


def branches(cfg: Config) -> list[Branch]:
    """The branches in execution order (spanning, largest r first, then local), each as
    :func:`dilax.dilated.ring_branches.branch_op` runs it on the contiguous layout: its kind
    (:func:`~dilax.dilated.ring_branches.branch_kind`), the streams of its ring
    (:func:`dilax.sp.schedule.ring_streams` of its :func:`~dilax.sp.schedule.geometry`) and
    the ring's blocks (:func:`~dilax.dilated.ring_branches.ring_blocks`)."""
    out = []
    for w, r in zip(cfg.ws, cfg.rs, strict=True):
        w_eff = effective_segment_length(cfg.n, w, r)
        U, G = _heads(cfg.h, cfg.hk, r)
        R = -(-cfg.m // r)
        kind = branch_kind(cfg.P, 1, cfg.m, w_eff, r)
        hops: tuple[int, ...] = ()
        blocks = RING_BLOCKS
        if kind == "ring":
            geo = geometry(cfg.n, cfg.P, 1, w_eff, r)
            hops = tuple(st.hops for st in ring_streams(geo, cfg.causal))
            blocks = ring_blocks(geo, None)
        out.append(Branch(w_eff, r, kind, R, U, G, hops, w_eff // r, blocks))
    return sorted(out, key=lambda br: (br.kind == "local", -br.r))


# ------------------------------------------------------------------ communication (exact)


def chunk_bytes(cfg: Config, br: Branch, itemsize: int) -> int:
    """One dilated K (or V) chunk ``(b, R, U, d)``."""
    return cfg.b * br.R * br.U * cfg.d * itemsize


def sent_forward(cfg: Config, br: Branch) -> int:
    if br.kind == "ring":
        return sum(br.hops) * 2 * chunk_bytes(cfg, br, cfg.sw)
    if br.kind == "halo":
        return 4 * cfg.b * (br.L - 1) * br.U * cfg.d * cfg.sw
    return 0


def sent_backward(cfg: Config, br: Branch) -> int:
    """Bytes the backward of a branch sends (the training step adds it to the forward's)."""
    if br.kind == "ring":
        kv, acc = 2 * chunk_bytes(cfg, br, cfg.sw), 2 * chunk_bytes(cfg, br, F32)
        return sum(kv + (H - 1) * (kv + acc) + acc for H in br.hops)
    if br.kind == "halo":  # the VJP of the forward: recomputed, then the transposed sends
        return 2 * sent_forward(cfg, br)
    return 0


def hops_forward(br: Branch) -> int:
    return sum(br.hops) if br.kind == "ring" else (2 if br.kind == "halo" else 0)


def hops_backward(br: Branch) -> int:
    return sum(H + 1 for H in br.hops) if br.kind == "ring" else (
        4 if br.kind == "halo" else 0)


# ------------------------------------------------------------------ memory terms (bytes)


def inputs(cfg: Config) -> int:
    return cfg.b * cfg.m * (cfg.h + 2 * cfg.hk) * cfg.d * cfg.s


def result(cfg: Config, br: Branch) -> int:
    """A finished branch: float32 out and lse in its dilated layout."""
    return cfg.b * br.R * cfg.h * (cfg.d + 1) * F32


def tiles(cfg: Config, br: Branch, count: int = 2, backward: bool = False) -> int:
    """The core's work on one block pair: ``count`` float32 score tiles ``(b, h, bq, bk)``
    (forward: scores and probabilities; backward: five, P, dP, dS and two copies; the ring
    branches' backward blocks are ``RING_BACKWARD_BLOCKS``)."""
    bq, bk = br.blocks.backward if backward else (br.blocks.block_q, br.blocks.block_k)
    return count * cfg.b * cfg.h * min(bq, br.R) * min(bk, br.R) * F32


def _looped(br: Branch) -> bool:
    """More than one hop in a stream: the hops run in a while loop, whose carries (the K/V
    chunks in use, dK/dV) and loop-invariant query slice are buffers of their own."""
    return max(br.hops, default=0) > 1


def bits(cfg: Config, q_rows: int, kv_rows: int, kv_heads: int) -> dict[str, int]:
    """XLA:CPU only (``xla_cpu``), half-precision inputs: the core reads its q, k, v operands
    as uint16 bits (:func:`dilax.core.xla._as_bits`), a bitcast that XLA:CPU materializes as
    a copy per core call: ``q_rows`` rows of all ``h`` heads, k and v of ``kv_rows`` rows of
    ``kv_heads`` heads, itemsize ``s``."""
    if not cfg.xla_cpu or cfg.s != 2:
        return {}
    return {"uint16 bits of q, k, v (XLA:CPU)":
            cfg.b * (q_rows * cfg.h + 2 * kv_rows * kv_heads) * cfg.d * cfg.s}


def backward_reads(cfg: Config, q_rows: int, kv_rows: int, kv_heads: int) -> dict[str, int]:
    """XLA:CPU only, half precision: the core's backward reads its operands as uint16 bits
    (:func:`bits`) only where float32 copies of q, dO, k and v would exceed
    ``dilax.core.xla._WIDEN_LIMIT`` bytes; below it XLA:CPU hoists float32 copies of them
    (dO's is the branch's float32 dO, a term of its own)."""
    if not cfg.xla_cpu or cfg.s != 2:
        return {}
    q, kv = cfg.b * q_rows * cfg.h * cfg.d, cfg.b * kv_rows * kv_heads * cfg.d
    if backward_reads_bits(q, kv, kv, q):
        return bits(cfg, q_rows, kv_rows, kv_heads)
    return {"float32 copies of q, k, v (XLA:CPU)": (q + 2 * kv) * F32}


def ring_forward_work(cfg: Config, br: Branch) -> dict[str, int]:
    rc = row_chunk(br.R)
    q = cfg.b * br.R * cfg.h * cfg.d * cfg.sw
    return {**bits(cfg, rc, br.R, br.U),
        "dilated q (+ loop copy)": ((br.r > 1) + _looped(br)) * q,
        "K/V chunks in flight (+ in use, looped)":
            (2 + 2 * _looped(br)) * chunk_bytes(cfg, br, cfg.sw),
        "softmax state": result(cfg, br),
        "row chunk (q rows, partial out)": 2 * cfg.b * rc * cfg.h * cfg.d * F32,
        "score tiles": tiles(cfg, br),
    }


def local_forward_work(cfg: Config, br: Branch) -> dict[str, int]:
    bq = min(br.blocks.block_q, br.R)
    return {**bits(cfg, cfg.m, cfg.m, cfg.hk),
            "result being built": result(cfg, br), "score tiles": tiles(cfg, br),
            "row blocks (q, out)": 2 * cfg.b * cfg.h * bq * cfg.d * F32}


def merge_work(cfg: Config) -> dict[str, int]:
    """The merged output (the weighted sum is fused with its rounding to a half-precision
    output, so float32 only when the output is float32) and the per-position statistics."""
    full = cfg.b * cfg.m * cfg.h
    return {"merged output": full * cfg.d * cfg.s, "merge statistics": 3 * full * F32}


def backward_base(cfg: Config, brs: list[Branch]) -> dict[str, int]:
    """Live through the whole backward: accumulators, cotangent, row statistics."""
    full = cfg.b * cfg.m * cfg.h
    return {
        "dq, dk, dv accumulators f32": cfg.b * cfg.m * (cfg.h + 2 * cfg.hk) * cfg.d * F32,
        "cotangent (output dtype)": full * cfg.d * cfg.s,
        "row statistics": 3 * full * F32 + sum(3 * cfg.b * br.R * cfg.h * F32 for br in brs),
    }


def ring_backward_work(cfg: Config, br: Branch) -> dict[str, int]:
    """:func:`dilax.sp.ring_vjp.ring_backward_in_place` (contiguous layout, ``r | m``): the
    core reads the shard's queries in place and adds every pair's gradients into the branch's
    dq accumulator and the travelling dK/dV in place; the own chunk is visited last, straight
    into the returned dK/dV (its dilated K/V are recomputed there, not held through the
    hops). The branch's float32 dO is its only query-sized buffer."""
    q_rows = cfg.b * br.R * cfg.h * cfg.d
    out = {
        "dO f32": q_rows * F32,
        # in use in the input dtype (the core's operands), in flight as sent (``sw``)
        "K/V chunks in use (+ in flight, looped)":
            2 * chunk_bytes(cfg, br, cfg.s) + 2 * _looped(br) * chunk_bytes(cfg, br, cfg.sw),
        # sent after the pair's work, so their in-flight copies miss the score tiles
        "dK/dV f32 travelling": 2 * chunk_bytes(cfg, br, F32),
        "score tiles": tiles(cfg, br, 5, backward=True),
        **backward_reads(cfg, cfg.m, br.R, br.U),  # the shard's queries, read in place
    }
    return out


def _one_block(br: Branch) -> bool:
    """A local branch whose segments are one backward block (``w / r <= 128``): the core's
    two query-block loops (causal-masked, then unmasked) have bodies that do not depend on
    the loop index, so XLA hoists them out of the loops and keeps their blocks live together
    (:func:`dilax.core.xla.backward`)."""
    return br.kind == "local" and br.L <= min(br.blocks.backward)


def local_backward_work(cfg: Config, br: Branch) -> dict[str, int]:
    """The float32 accumulators are updated in place. As the dumps show it: without upcast
    the cotangent's mixture weighting is fused into the core's blocks (no float32 dO; five
    score tiles and 14 row blocks ``b h bq d 4``); with XLA:CPU's bfloat16 upcast, float32
    dO, three score tiles and three row blocks (no float32 copies of the shards: the core
    reads half-precision inputs as uint16 bits). Segments of one
    block (:func:`_one_block`), either dtype: float32 dO, the masked pair's work (two tiles,
    q, dO and K blocks) live across the unmasked loop, which carries its hoisted scores,
    ``dP - delta``, q, dO and K blocks and computes three tiles, a dO block and the dK/dV
    block sums: seven tiles, five row blocks, four K/V blocks ``b U bk d 4``."""
    bq = min(br.blocks.backward[0], br.R)
    block = cfg.b * cfg.h * bq * cfg.d * F32
    shards = backward_reads(cfg, cfg.m, cfg.m, cfg.hk)
    if _one_block(br):
        bk = min(br.blocks.backward[1], br.R)
        return {**shards, "dO f32": cfg.b * br.R * cfg.h * cfg.d * F32,
                "score tiles": tiles(cfg, br, 7, True), "row blocks": 5 * block,
                "K/V blocks": 4 * cfg.b * br.U * bk * cfg.d * F32}
    if cfg.sw == cfg.s:
        return {**shards, "score tiles": tiles(cfg, br, 5, True), "row blocks": 14 * block}
    return {**shards, "dO f32": cfg.b * br.R * cfg.h * cfg.d * F32,
            "score tiles": tiles(cfg, br, 3, True), "row blocks": 3 * block}


def row_statistics_pass(cfg: Config, brs: list[Branch], held: int) -> dict[str, int]:
    """XLA:CPU only (``xla_cpu``): the backward's first pass (the row statistics
    ``<g, o_i>`` of :func:`dilax.branch.runner._attend_bwd`) materializes every branch's dilated
    cotangent widened to float32 ``b R h d 4`` before its reduction, all of them before the
    first reduction (none for ``r = 1`` in float32: the cotangent itself), beside the
    finished results and the cotangent."""
    full = cfg.b * cfg.m * cfg.h
    return {"finished results": held, "cotangent (output dtype)": full * cfg.d * cfg.s,
            "row statistics": backward_base(cfg, brs)["row statistics"],
            "dilated cotangents f32 (XLA:CPU)": sum(
                cfg.b * br.R * cfg.h * cfg.d * F32 for br in brs
                if br.r > 1 or cfg.s != F32)}


def _phases(cfg: Config, train: bool) -> list[tuple[str, dict[str, int]]]:
    brs = branches(cfg)
    phases = []
    held = 0
    for br in brs:
        work = (ring_forward_work if br.kind == "ring" else local_forward_work)(cfg, br)
        phases.append((f"forward w={br.w} r={br.r} ({br.kind})",
                       {"finished results": held, **work}))
        held += result(cfg, br)
    phases.append(("merge", {"finished results": held, **merge_work(cfg)}))
    if train and cfg.xla_cpu:
        phases.append(("backward row statistics", row_statistics_pass(cfg, brs, held)))
    if train:
        base = backward_base(cfg, brs)
        for br in brs:
            work = (ring_backward_work if br.kind == "ring" else local_backward_work)(cfg, br)
            phases.append((f"backward w={br.w} r={br.r} ({br.kind})", {**base, **work}))
        s_out = 0 if cfg.s == F32 else cfg.b * cfg.m * (cfg.h + 2 * cfg.hk) * cfg.d * cfg.s
        phases.append(("gradients out", {**base, "gradients in input dtype": s_out}))
    return phases


# memory_analysis (temp + argument + output) over the deduplicated live peak: 0 to 17 % in
# the 24 validation programs. One constant chosen on them (0.055 to 0.09 put all 24 within
# 10 %), not a per-program fit; see the module docstring.
PACKING = 0.07


def memory(cfg: Config, train: bool) -> dict[str, Any]:
    """Per-device bytes: ``live`` = inputs + the largest phase, ``bytes`` = live plus the
    heap-packing allowance; with the peak phase and its terms."""
    name, terms = max(_phases(cfg, train), key=lambda p: sum(p[1].values()))
    live = inputs(cfg) + sum(terms.values())
    return dict(bytes=int(round(live * (1 + PACKING))), live=live, phase=name,
                terms={"inputs": inputs(cfg), **terms})


def communication(cfg: Config, train: bool) -> dict[str, int]:
    brs = branches(cfg)
    sent = sum(sent_forward(cfg, br) for br in brs)
    hops = sum(hops_forward(br) for br in brs)
    if train:
        sent += sum(sent_backward(cfg, br) for br in brs)
        hops += sum(hops_backward(br) for br in brs)
    return dict(bytes_sent=sent, hops=hops)


def plan_rows(n: int, devices, ws, rs, *, b=1, h=8, hk=2, d=64, causal=True,
              dtypes=(("bfloat16", 2), ("float32", 4))) -> list[dict[str, Any]]:
    """One row per (P, dtype): memory (forward, training step), bytes sent, hops, and the
    per-branch schedule."""
    rows = []
    for P in devices:
        for name, s in dtypes:
            cfg = Config(n, P, tuple(ws), tuple(rs), b, h, hk, d, s, causal)
            fwd, trn = memory(cfg, False), memory(cfg, True)
            rows.append(dict(
                P=P, n=n, m=cfg.m, dtype=name,
                forward_bytes=fwd["bytes"], forward_phase=fwd["phase"],
                train_bytes=trn["bytes"], train_phase=trn["phase"],
                forward_terms=fwd["terms"], train_terms=trn["terms"],
                sent_forward=communication(cfg, False)["bytes_sent"],
                sent_train=communication(cfg, True)["bytes_sent"],
                hops_forward=communication(cfg, False)["hops"],
                hops_train=communication(cfg, True)["hops"],
                irregular=[br.r for br in branches(cfg)
                           if br.kind != "local" and cfg.m % br.r],
                branches=[dict(w=br.w, r=br.r, kind=br.kind, rows=br.R, hops=sum(br.hops),
                               sent_forward=sent_forward(cfg, br),
                               sent_backward=sent_backward(cfg, br)) for br in branches(cfg)],
            ))
    return rows


def model_text() -> str:
    """The memory model in words (this module's docstring from "Memory per device")."""
    return "Memory per device (bytes)" + __doc__.split("Memory per device (bytes)")[1].rstrip()

