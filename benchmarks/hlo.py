"""Measurements read off compiled programs (optimized HLO text).

Not part of the library: the benchmarks and tests use it to check how many bytes the ring
attentions send between devices.
"""

from __future__ import annotations

import functools
import re

import numpy as np

_DTYPE_BYTES = {"f64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1,
                "pred": 1, "s64": 8, "u64": 8}


def collective_permute_bytes(hlo_text: str) -> int:
    """Bytes one device sends with collective-permutes when it runs a compiled program.

    Parses the (optimized) HLO text of ``jax.jit(...).lower(...).compile().as_text()``: every
    ``collective-permute`` (or ``-start``) counts its result size, multiplied by the known trip
    counts of the ``while`` loops around it (the larger branch of a ``conditional``).
    """
    comps: dict[str, list[str]] = {}
    entry, name = None, None
    for line in hlo_text.splitlines():
        m = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if m and not line.startswith(" "):
            name = m.group(2)
            comps[name] = []
            if m.group(1):
                entry = name
        elif line.startswith("}"):
            name = None
        elif name is not None:
            comps[name].append(line)

    @functools.cache
    def cost(comp: str) -> int:
        total = 0
        for line in comps.get(comp, ()):
            if re.search(r"collective-permute(-start)?\(", line):
                m = re.search(r"=\s*\(?\s*(\w+)\[([\d,]*)\]", line)
                dims = [int(x) for x in m.group(2).split(",") if x]
                total += int(np.prod(dims, dtype=np.int64)) * _DTYPE_BYTES.get(m.group(1), 4)
            elif " while(" in line:
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                body = re.search(r"body=%?([\w.\-]+)", line).group(1)
                cond = re.search(r"condition=%?([\w.\-]+)", line).group(1)
                total += int(trip.group(1) if trip else 1) * cost(body) + cost(cond)
            elif " conditional(" in line:
                branches = re.search(r"branch_computations=\{([^}]*)\}", line)
                names = re.findall(r"%?([\w.\-]+)", branches.group(1)) if branches else []
                total += max((cost(b) for b in names), default=0)
            else:
                for callee in re.findall(r"(?:to_apply|calls)=%?([\w.\-]+)", line):
                    total += cost(callee)
        return total

    return cost(entry) if entry else 0
