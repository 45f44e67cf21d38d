"""Measurements read off compiled programs (optimized HLO text).

Not part of the library: the benchmarks and tests use it to check how many bytes the ring
attentions send between devices (:func:`collective_permute_bytes`) and which kernels and XLA
matmuls a compiled GPU program runs (:func:`program_counts`).
"""

from __future__ import annotations

import collections
import functools
import re

import numpy as np

_DTYPE_BYTES = {"f64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1,
                "pred": 1, "s64": 8, "u64": 8}


def computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
    """The computations of an HLO module's text: ``{name: instruction lines}`` and the name
    of the ``ENTRY`` computation (``None`` if there is none)."""
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
    return comps, entry


def collective_permute_bytes(hlo_text: str) -> int:
    """Bytes one device sends with collective-permutes when it runs a compiled program.

    Parses the (optimized) HLO text of ``jax.jit(...).lower(...).compile().as_text()``: every
    ``collective-permute`` (or ``-start``) counts its result size, multiplied by the known trip
    counts of the ``while`` loops around it (the larger branch of a ``conditional``).
    """
    comps, entry = computations(hlo_text)

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


# Kernel calls and XLA matmuls of a compiled GPU program
# --------------------------------------------------------------------------------------------

# Custom-call targets: Pallas kernels (Triton; Mosaic GPU), cuDNN's fused attention, and the
# library GEMMs XLA calls for a dot it does not fuse (cuBLAS, cuBLASLt, cuDNN convolutions).
PALLAS_TARGETS = ("__gpu$xla.gpu.triton", "mosaic_gpu")
CUDNN_ATTENTION_PREFIX = "__cudnn$fmha"
GEMM_TARGET_PREFIXES = ("__cublas$gemm", "__cublas$lt$matmul", "__cudnn$conv")
MATMUL_OPCODES = ("dot", "convolution", "ragged-dot", "scaled-dot")

_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*")
_CALLEE = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)"
                     r"=%?([\w.\-]+)")
_CALLEE_LIST = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")


def _instruction(line: str) -> tuple[str, str] | None:
    """``(opcode, attributes)`` of one HLO instruction line, ``None`` for other lines. The
    attributes stop before ``metadata``/``backend_config``: a Pallas call's backend_config
    holds the kernel's serialized Triton IR, whose bytes (``tt.dot`` & co) are not HLO."""
    m = _NAME.match(line)
    if not m:
        return None
    rest = line[m.end():]
    if rest.startswith("("):  # a tuple-shaped result: skip the balanced parentheses
        depth, end = 0, len(rest)
        for pos, ch in enumerate(rest):
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                end = pos + 1
                break
        rest = rest[end:]
    else:
        rest = rest.partition(" ")[2]
    op = re.match(r"\s*([\w\-]+)\(", rest)
    if not op:
        return None
    return op.group(1), re.split(r", (?:metadata|backend_config)=", rest, maxsplit=1)[0]


def program_counts(hlo_text: str) -> dict:
    """Kernel calls and XLA matmuls of a compiled XLA:GPU program (its optimized HLO text,
    ``jax.jit(f).lower(...).compile().as_text()``).

    Counts call sites in the program text, from ``ENTRY`` through every computation it calls
    (fusion bodies, loop bodies and conditions, every branch of a conditional), each site once
    (a loop body is not multiplied by its trip count):

    * ``kernel_calls``: Pallas kernel custom-calls (Triton ``__gpu$xla.gpu.triton``, Mosaic
      GPU); ``kernel_names``: how many of each kernel (the Triton call's ``name``);
    * ``cudnn_calls``: cuDNN fused-attention custom-calls (``__cudnn$fmha*``), per target in
      ``cudnn_targets``;
    * ``xla_matmuls``: matmuls XLA emits itself: every ``dot``/``convolution`` instruction,
      whether it stands alone or sits in a fusion (XLA's Triton GEMM fusions, cuDNN GEMM
      fusions, loop fusions), plus cuBLAS/cuBLASLt GEMM and cuDNN convolution custom-calls;
      ``matmul_ops`` says which. A Pallas kernel's own ``tl.dot`` lives in its serialized IR,
      not in HLO, and is not counted.
    """
    comps, entry = computations(hlo_text)

    @functools.cache
    def count(comp: str) -> collections.Counter:
        total: collections.Counter = collections.Counter()
        for line in comps.get(comp, ()):
            parsed = _instruction(line)
            if parsed is None:
                continue
            opcode, attrs = parsed
            if opcode in MATMUL_OPCODES:
                total["matmul:" + opcode] += 1
            elif opcode == "custom-call":
                target = re.search(r'custom_call_target="([^"]*)"', attrs)
                target = target.group(1) if target else ""
                if target in PALLAS_TARGETS:
                    name = re.search(r'\bname\s*=\s*"([^"]+)"', line)
                    total["kernel:" + (name.group(1) if name else target)] += 1
                elif target.startswith(CUDNN_ATTENTION_PREFIX):
                    total["cudnn:" + target] += 1
                elif target.startswith(GEMM_TARGET_PREFIXES):
                    total["matmul:" + target] += 1
            callees = _CALLEE.findall(attrs)
            for group in _CALLEE_LIST.findall(attrs):
                callees += re.findall(r"%?([\w.\-]+)", group)
            for callee in callees:
                total += count(callee)
        return total

    c = count(entry) if entry else collections.Counter()

    def part(prefix: str) -> dict[str, int]:
        return {k.removeprefix(prefix): v for k, v in sorted(c.items()) if k.startswith(prefix)}

    kernels, cudnn, matmuls = part("kernel:"), part("cudnn:"), part("matmul:")
    return dict(kernel_calls=sum(kernels.values()), cudnn_calls=sum(cudnn.values()),
                xla_matmuls=sum(matmuls.values()), kernel_names=kernels, cudnn_targets=cudnn,
                matmul_ops=matmuls)
