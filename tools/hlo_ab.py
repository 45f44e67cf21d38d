"""Same programs, before and after: the compiled HLO of the benchmark's programs, normalized.

``python -m tools.hlo_ab dump DIR`` compiles (CPU, 4 host devices) dilated attention forward
and gradient (fp32, bf16; causal, grouped, padded, windowed, packed), the dilated and
block-sparse rings on 4 devices, block-sparse attention and dense attention at n = 2048, and
writes each program's optimized HLO to ``DIR/<name>.hlo`` with instruction numbering and
metadata dropped. ``python -m tools.hlo_ab compare A B`` says, per program, whether two dumps
are identical once the source-location tables (file names and lines, which move with the
code) are dropped as well. Run ``dump`` in two checkouts (e.g. a ``git worktree`` of the base)
to show that a refactor changed no program.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from pathlib import Path

NAMES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def _programs():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType

    import dilax

    b, n = 1, 2048
    ws, rs = (512, 1024, 2048), (1, 2, 4)

    def grad_of(f):
        return jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) ** 2),
                        argnums=(0, 1, 2))

    half = jnp.full((b,), n // 2, jnp.int32)
    seg = jnp.asarray(np.repeat(np.arange(4), [300, 700, 548, 500])[None].astype(np.int32))
    mesh = jax.make_mesh((4,), ("sp",), axis_types=(AxisType.Auto,))
    sp = dilax.SequenceParallel(mesh, "sp")
    pat = dilax.patterns.global_local(n, 64, 64, 256)
    mixture = lambda q, k, v: dilax.dilated_attention(q, k, v, ws, rs)  # noqa: E731
    causal = lambda q, k, v: dilax.dilated_attention(q, k, v, ws, rs, is_causal=True)  # noqa: E731
    sparse = lambda q, k, v: dilax.block_sparse_attention(q, k, v, pat, is_causal=True)  # noqa: E731
    f32, bf16 = jnp.float32, jnp.bfloat16
    return {
        "mixture_fwd_float32": (mixture, f32), "mixture_grad_float32": (grad_of(mixture), f32),
        "mixture_fwd_bfloat16": (mixture, bf16), "mixture_grad_bfloat16": (grad_of(mixture), bf16),
        "causal_fwd": (causal, f32), "causal_grad": (grad_of(causal), f32),
        "grouped_grad": (grad_of(lambda q, k, v: dilax.dilated_attention(
            q, k, v, ws, rs, mode="grouped")), f32),
        "padded_grad": (grad_of(lambda q, k, v: dilax.dilated_attention(
            q, k, v, ws, rs, is_causal=True, query_seq_lengths=half,
            key_value_seq_lengths=half)), f32),
        "window_grad": (grad_of(lambda q, k, v: dilax.dilated_attention(
            q, k, v, ws, rs, is_causal=True, local_window=256)), f32),
        "packed_grad": (grad_of(lambda q, k, v: dilax.dilated_attention(
            q, k, v, ws, rs, is_causal=True, segment_ids=seg)), f32),
        "ring4_grad": (grad_of(lambda q, k, v: dilax.dilated_attention(
            q, k, v, ws, rs, is_causal=True, sequence_parallel=sp)), f32),
        "block_sparse_grad": (grad_of(sparse), f32),
        "block_sparse_fwd_bf16": (sparse, bf16),
        "bs_ring4_grad": (grad_of(lambda q, k, v: dilax.block_sparse_attention(
            q, k, v, pat, is_causal=True, sequence_parallel=sp)), f32),
        "dense_grad": (grad_of(lambda q, k, v: dilax.dot_product_attention(
            q, k, v, is_causal=True)), f32),
    }


def _normalize(text: str) -> str:
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    text = re.sub(r"(%?[A-Za-z_][\w\-]*)\.\d+", r"\1", text)
    return re.sub(r"^HloModule .*$", "HloModule", text, flags=re.M)


def dump(out: str) -> None:
    import jax

    os.makedirs(out, exist_ok=True)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    for name, (f, dtype) in _programs().items():
        q, k, v = (jax.random.normal(x, (1, 2048, 8, 64), dtype) for x in keys)
        text = _normalize(jax.jit(f).lower(q, k, v).compile().as_text())
        Path(out, f"{name}.hlo").write_text(text)
        print(name, hashlib.sha256(text.encode()).hexdigest()[:16], flush=True)


def program_body(path: Path) -> str:
    """The HLO text without its source-location tables and stack-frame ids."""
    out, skip = [], False
    for line in path.read_text().splitlines():
        if line in NAMES:
            skip = True
            continue
        if skip and line.startswith(("ENTRY", "%", "HloModule")):
            skip = False
        if not skip:
            out.append(re.sub(r",? ?stack_frame_id=\d+", "", line))
    return "\n".join(out)


def compare(a: str, b: str) -> int:
    same = differ = 0
    for f in sorted(Path(a).glob("*.hlo")):
        g = Path(b, f.name)
        if not g.exists():
            print(f"{f.stem:24s} missing in {b}")
            differ += 1
            continue
        ok = program_body(f) == program_body(g)
        same, differ = same + ok, differ + (not ok)
        print(f"{f.stem:24s} {'identical' if ok else 'DIFFERENT'}")
    print(f"{same} identical, {differ} different")
    return 0 if differ == 0 else 1


def main(argv: list[str]) -> int:
    if argv[:1] == ["dump"] and len(argv) == 2:
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
        dump(argv[1])
        return 0
    if argv[:1] == ["compare"] and len(argv) == 3:
        return compare(argv[1], argv[2])
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
