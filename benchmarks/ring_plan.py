"""``python -m benchmarks ring --plan``: the ring at scales past this machine, on paper.

The model lives in :mod:`benchmarks.ring_model` (built from the ring's own geometry); this module is
what the CLI (:mod:`benchmarks.ring_plan_cli`), the validation
(:mod:`benchmarks.ring_plan_validate`) and the tests read it through, plus the report's
byte formatting.
"""

from __future__ import annotations

from benchmarks.ring_model import (
    F32,
    PACKING,
    Branch,
    Config,
    backward_base,
    backward_reads,
    bits,
    branches,
    chunk_bytes,
    communication,
    hops_backward,
    hops_forward,
    inputs,
    local_backward_work,
    local_forward_work,
    longnet_config,
    memory,
    merge_work,
    model_text,
    plan_rows,
    result,
    ring_backward_work,
    ring_forward_work,
    row_statistics_pass,
    sent_backward,
    sent_forward,
    tiles,
)

__all__ = [
    "F32", "PACKING", "Branch", "Config", "backward_base", "backward_reads", "bits", "branches",
    "chunk_bytes", "communication", "gib", "hops_backward", "hops_forward", "inputs",
    "local_backward_work", "local_forward_work", "longnet_config", "memory", "merge_work",
    "model_text", "plan_rows", "result", "ring_backward_work", "ring_forward_work",
    "row_statistics_pass", "sent_backward", "sent_forward", "tiles",
]


def gib(x: float) -> str:
    """Bytes as GiB (from 1 GiB) or MiB, two decimals."""
    return f"{x / 2**30:.2f} GiB" if x >= 2**30 else f"{x / 2**20:.2f} MiB"
