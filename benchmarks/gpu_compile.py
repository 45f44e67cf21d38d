"""Deviceless XLA:GPU compiles: every public op of dilax compiled for an H100 and an A100.

No GPU is needed. With ``jax[cuda12]`` installed (the same jax version), XLA:GPU compiles
ahead of time for a device described by a ``GpuTargetConfigProto`` (our own spec files from
NVIDIA's public figures, ``benchmarks/gpu_targets/*.txtpb``)::

    topo = jax.experimental.topologies.get_topology_desc(
        platform="cuda", topology="1x1x1", target_config=<spec text>)
    jax.jit(f).lower(*<ShapeDtypeStructs placed on topo's mesh>).compile()

in a process with ``JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``. This runs XLA's
real GPU pipeline: the Pallas Triton lowering, Triton, LLVM and ptxas (a kernel that needs
more shared memory than the target has fails here, as it would on the GPU).

Two things come out of one run (``python -m benchmarks gpu-compile``, or ``make gpu-check``):

* **the check**: a covering list of configurations (:func:`cases`), each with its expected
  outcome: ``ok`` (must compile) or ``refused`` (the op itself must raise ``ValueError``
  naming the rule, never leave it to the compiler). Any other outcome fails the run (exit 1).
* **the resource report** of every Pallas kernel (dilax's and jax's reference Triton
  attention, compiled in the same run): from XLA's dump (``xla_dump_to``) the launch grid,
  threads and shared memory of each kernel (``*.thunk_sequence.txt``), and its PTX, which
  ``ptxas -v`` (from the ``nvidia-cuda-nvcc`` wheel) compiles again for registers, spills
  and stack; the tensor-core instruction family is read from the PTX (``wgmma`` on sm_90,
  ``mma.sync`` on sm_80). Plus an **estimated** fraction of peak, :func:`roofline`.

Written to ``benchmarks/results/gpu-compile.{md,json}`` (``--out`` elsewhere). Each target
runs in its own process (two at a time), since a process compiles for one topology at a time
and the environment must be set before jax starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
SPEC_DIR = os.path.join(HERE, "gpu_targets")
ENV = {"JAX_PLATFORMS": "cpu", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}


# --------------------------------------------------------------------------------------------
# Targets (public figures: NVIDIA H100 / A100 datasheets, FlashAttention-3 paper for MUFU)
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Target:
    key: str
    name: str
    spec: str  # file in benchmarks/gpu_targets
    sm: str  # ptxas --gpu-name
    tensor_family: str  # the tensor-core instruction family Triton emits there
    sms: int
    smem_per_sm: int  # bytes usable by blocks
    clock_ghz: float
    hbm_bytes_per_s: float
    peak_tflops: dict  # dense tensor-core TFLOP/s per input type ("float32" = TF32)
    fp32_fma_tflops: float  # no tensor cores
    mufu_per_clk_per_sm: int = 16  # exp2 & co (special-function units)

    @property
    def exp_per_s(self) -> float:
        return self.mufu_per_clk_per_sm * self.sms * self.clock_ghz * 1e9


TARGETS = {
    "h100": Target("h100", "H100 SXM5 80GB (sm_90)", "h100_sxm.txtpb", "sm_90a", "wgmma",
                   sms=132, smem_per_sm=233472, clock_ghz=1.83, hbm_bytes_per_s=3.35e12,
                   peak_tflops={"bfloat16": 989.4, "float16": 989.4, "float32": 494.7},
                   fp32_fma_tflops=66.9),
    "a100": Target("a100", "A100 SXM4 80GB (sm_80)", "a100_sxm_80.txtpb", "sm_80", "mma.sync",
                   sms=108, smem_per_sm=167936, clock_ghz=1.41, hbm_bytes_per_s=2.039e12,
                   peak_tflops={"bfloat16": 312.0, "float16": 312.0, "float32": 156.0},
                   fp32_fma_tflops=19.5),
}


# --------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    """One configuration to compile.

    ``build()`` returns ``(fn, args)`` where ``args`` is a pytree of
    ``jax.ShapeDtypeStruct`` without sharding (placed on the target's mesh when compiled).
    ``expect``: ``"ok"`` or ``"refused"`` (the op raises ``ValueError`` at trace/lowering,
    ``why`` says which rule). ``report``: dump the kernels for the resource report, with the
    ``model`` dict that :func:`roofline` needs. ``devices``: 1, or 8 for the ring (sharded
    over the sequence)."""

    name: str
    op: str
    build: Callable[[], tuple[Callable, Any]]
    expect: str = "ok"
    why: str = ""
    targets: tuple[str, ...] = ("h100", "a100")
    report: dict | None = None
    devices: int = 1


def _sds(shape, dtype):
    import jax

    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _loss_grad(f, argnums=(0, 1, 2)):
    """fwd+bwd: the gradient of ``sum(f(...))`` (float32) in ``argnums``."""
    import jax
    import jax.numpy as jnp

    return jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums)


def _qkv(b, n, h, hk, d, dtype):
    return (_sds((b, n, h, d), dtype), _sds((b, n, hk, d), dtype), _sds((b, n, hk, d), dtype))


def _dilated(impl, *, n=8192, h=8, hk=8, d=64, dtype="bfloat16", causal=False, grad=True,
             mode="mixture", ws=(2048, 4096), rs=(1, 2)):
    def build():
        import dilax

        def f(q, k, v):
            return dilax.dilated_attention(q, k, v, ws, rs, is_causal=causal, mode=mode,
                                           implementation=impl)

        return (_loss_grad(f) if grad else f), _qkv(1, n, h, hk, d, dtype)

    return build


def _block_sparse(impl, *, n=8192, h=8, hk=8, d=64, dtype="bfloat16", causal=False, grad=True,
                  block=64, window=None, per_head=False):
    def build():
        import numpy as np

        import dilax
        from dilax import patterns

        w = block if window is None else window
        pattern = patterns.local_window(n, block, w)
        if per_head:  # a different window per head: per-head tables
            nb = -(-n // block)
            masks = [patterns.local_window(n, block, w * (1 + j % 2)).block_mask for j in
                     range(h)]
            pattern = patterns.from_mask(np.stack(masks).reshape(h, nb, nb), block)

        def f(q, k, v):
            return dilax.block_sparse_attention(q, k, v, pattern, is_causal=causal,
                                                implementation=impl)

        return (_loss_grad(f) if grad else f), _qkv(1, n, h, hk, d, dtype)

    return build


def _flash(*, n=8192, h=16, d=64, dtype="bfloat16", causal=True, grad=True, offsets=False,
           ragged=False):
    """pallas_kernels.flash_attention directly (grouped layout), for the kernel report."""

    def build():
        import jax.numpy as jnp

        from pallas_kernels import flash_attention

        def f(q, k, v):
            kw = {}
            if offsets:
                kw = dict(q_offset=jnp.int32(n // 2), k_offset=jnp.int32(0))
            if ragged:
                kw["kv_len"] = jnp.full((1, h), n - 77, jnp.int32)
            return flash_attention(q, k, v, scale=d ** -0.5, is_causal=causal, **kw)[0]

        args = (_sds((1, n, h, 1, d), dtype), _sds((1, n, h, d), dtype), _sds((1, n, h, d), dtype))
        return (_loss_grad(f) if grad else f), args

    return build


def _reference_mha(*, n=8192, h=16, d=64, dtype="bfloat16", causal=True):
    """jax's reference Triton attention (jax.experimental.pallas.ops.gpu.attention), fwd+bwd
    with its Triton backward, default block sizes."""

    def build():
        from jax.experimental.pallas.ops.gpu import attention

        def f(q, k, v):
            return attention.mha(q, k, v, None, sm_scale=d ** -0.5, causal=causal)

        return _loss_grad(f), _qkv(1, n, h, h, d, dtype)

    return build


def _ring(kind, *, n=16384, h=8, hk=2, d=64, dtype="bfloat16", grad=True):
    def build():
        import dilax
        from dilax import patterns

        def f(q, k, v, mesh):
            if kind == "dilated":
                return dilax.sharded_dilated_attention(q, k, v, (2048, 4096, 16384), (1, 2, 4),
                                                       mesh=mesh, seq_axis="sp",
                                                       is_causal=True)
            return dilax.sharded_block_sparse_attention(
                q, k, v, patterns.local_window(n, 128, 256), mesh=mesh, seq_axis="sp",
                is_causal=True)

        return f, _qkv(1, n, h, hk, d, dtype), grad

    return build


def _train_step(impl, *, n=1024, dtype="bfloat16"):
    """One LongNetLM training step (loss, grads, AdamW update), parameters float32."""

    def build():
        import jax
        import jax.numpy as jnp
        import optax
        from flax import nnx

        from dilax.models import LongNetConfig, LongNetLM

        cfg = LongNetConfig(256, 4, 1024, (512, 1024), (1, 2), num_kv_heads=2,
                            dtype=jnp.dtype(dtype), implementation=impl)
        model = nnx.eval_shape(lambda: LongNetLM(512, config=cfg, num_encoder_layers=0,
                                                 num_decoder_layers=1, rngs=nnx.Rngs(0)))
        graph, params = nnx.split(model)
        tx = optax.adamw(1e-3)
        opt_state = jax.eval_shape(tx.init, params)

        def step(params, opt_state, x, y):
            def loss(p):
                logits = nnx.merge(graph, p)(x).astype(jnp.float32)
                return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

            value, grads = jax.value_and_grad(loss)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return value, optax.apply_updates(params, updates), opt_state

        tok = _sds((2, n), jnp.int32)
        return step, (params, opt_state, tok, tok)

    return build


BF16, FP16, FP32 = "bfloat16", "float16", "float32"


def cases() -> list[Case]:
    """The covering set: every kernel, dtype, tile regime and boundary case on each target;
    the H100 acceptance grid (dilated n 8192/10000 x d 64/128 x causal, pallas and cudnn,
    fwd+bwd bf16) in full."""
    out: list[Case] = []
    # H100 acceptance grid, both explicit GPU implementations.
    for impl in ("pallas", "cudnn"):
        for n in (8192, 10000):
            for d in (64, 128):
                for causal in (False, True):
                    out.append(Case(
                        f"dilated {impl} bf16 n={n} d={d} {'causal' if causal else 'full'} "
                        "fwd+bwd", "dilated", _dilated(impl, n=n, d=d, causal=causal),
                        targets=("h100",)))
    # A100: the same kernels, one corner each (ragged n with causal, d 128).
    for impl in ("pallas", "cudnn"):
        out.append(Case(f"dilated {impl} bf16 n=10000 d=128 causal fwd+bwd", "dilated",
                        _dilated(impl, n=10000, d=128, causal=True), targets=("a100",)))
        out.append(Case(f"dilated {impl} bf16 n=8192 d=64 full fwd+bwd", "dilated",
                        _dilated(impl, n=8192, d=64), targets=("a100",)))
    # dtypes, modes, GQA/MQA, head dims, ragged n, both targets.
    out += [
        Case("dilated pallas fp16 grouped GQA 8/2 n=6000 d=64 causal fwd+bwd", "dilated",
             _dilated("pallas", n=6000, h=8, hk=2, dtype=FP16, causal=True, mode="grouped")),
        Case("dilated pallas fp32 n=4096 d=64 causal fwd+bwd (TF32 dots)", "dilated",
             _dilated("pallas", n=4096, dtype=FP32, causal=True)),
        Case("dilated pallas fp32 n=4096 d=128 fwd", "dilated",
             _dilated("pallas", n=4096, d=128, dtype=FP32, grad=False)),
        Case("dilated pallas bf16 MQA 8/1 n=4096 d=256 causal fwd+bwd", "dilated",
             _dilated("pallas", n=4096, h=8, hk=1, d=256, causal=True)),
        Case("dilated pallas bf16 n=3000 d=40 (padded head dim) fwd+bwd", "dilated",
             _dilated("pallas", n=3000, d=40, ws=(1024, 2048))),
        Case("dilated cudnn fp16 MQA 8/1 n=4096 d=128 causal fwd+bwd", "dilated",
             _dilated("cudnn", n=4096, hk=1, d=128, dtype=FP16, causal=True)),
        Case("dilated cudnn bf16 GQA 8/2 grouped n=5000 d=64 fwd+bwd", "dilated",
             _dilated("cudnn", n=5000, hk=2, mode="grouped"), targets=("h100",)),
        Case("dilated xla bf16 n=8192 d=64 causal fwd+bwd", "dilated",
             _dilated("xla", causal=True)),
        Case("dilated xla fp32 GQA 8/2 n=4096 d=128 fwd+bwd", "dilated",
             _dilated("xla", n=4096, hk=2, d=128, dtype=FP32), targets=("h100",)),
        # refused by the op (a ValueError naming the rule), never by the compiler
        Case("dilated cudnn fp32", "dilated", _dilated("cudnn", n=4096, dtype=FP32),
             expect="refused", why="cuDNN attention takes bf16/fp16"),
        Case("dilated cudnn bf16 d=256", "dilated", _dilated("cudnn", n=4096, d=256),
             expect="refused",
             why="jax's cuDNN check allows d <= 128 unless the *runtime* device is Hopper; a "
                 "deviceless compile has none"),
        Case("dilated cudnn bf16 d=60", "dilated", _dilated("cudnn", n=4096, d=60),
             expect="refused", why="cuDNN needs head_dim % 8 == 0"),
    ]
    # Block-sparse: every block size 16..512 (the kernel tile is independent of it), dtypes,
    # causal, per-head patterns, GQA; the XLA gather path.
    for block in (16, 32, 64, 128, 256, 512):
        out.append(Case(f"block-sparse pallas bf16 B={block} d=64 fwd+bwd", "block_sparse",
                        _block_sparse("pallas", block=block, n=max(4096, 8 * block))))
    out += [
        Case("block-sparse pallas bf16 B=256 d=128 causal fwd+bwd", "block_sparse",
             _block_sparse("pallas", block=256, d=128, causal=True)),
        Case("block-sparse pallas fp16 GQA 8/2 per-head B=64 causal fwd+bwd", "block_sparse",
             _block_sparse("pallas", hk=2, dtype=FP16, causal=True, per_head=True)),
        Case("block-sparse pallas fp32 B=128 d=64 fwd+bwd", "block_sparse",
             _block_sparse("pallas", block=128, dtype=FP32, n=4096)),
        Case("block-sparse xla bf16 B=128 d=64 causal fwd+bwd", "block_sparse",
             _block_sparse("xla", block=128, causal=True), targets=("h100",)),
        Case("block-sparse pallas n=1000 B=64", "block_sparse",
             _block_sparse("pallas", n=1000), expect="refused",
             why="the Pallas block-sparse kernel needs n % B == 0"),
    ]
    # Kernels directly: traced offsets, ragged kv_len.
    out += [
        Case("flash kernel bf16 d=64 causal, traced q/k offsets, ragged kv_len fwd+bwd", "flash",
             _flash(n=4096, h=4, offsets=True, ragged=True)),
        Case("LongNetLM train step (1 layer, GQA) pallas bf16", "train", _train_step("pallas")),
        Case("LongNetLM train step (1 layer, GQA) cudnn bf16", "train", _train_step("cudnn"),
             targets=("h100",)),
        Case("ring dilated on 8 GPUs (P=8) bf16 GQA causal fwd+bwd", "ring", _ring("dilated"),
             targets=("h100",), devices=8),
        Case("ring block-sparse on 8 GPUs (P=8) bf16 GQA causal fwd+bwd", "ring",
             _ring("block_sparse"), targets=("h100",), devices=8),
    ]
    out += report_cases()
    return out


REPORT_N, REPORT_H = 8192, 16


def report_cases() -> list[Case]:
    """Kernel-level compiles for the resource report, at n=8192, 16 heads, batch 1."""
    out = []
    for dtype, ds in ((BF16, (64, 128, 256)), (FP16, (64, 128)), (FP32, (64, 128))):
        for d in ds:
            model = dict(kernel="flash", n=REPORT_N, h=REPORT_H, d=d, dtype=dtype, causal=True)
            out.append(Case(f"report: dilax flash {dtype} d={d} causal fwd+bwd", "flash",
                            _flash(n=REPORT_N, h=REPORT_H, d=d, dtype=dtype), report=model))
    for d in (64, 128):
        model = dict(kernel="reference", n=REPORT_N, h=REPORT_H, d=d, dtype=BF16, causal=True)
        out.append(Case(f"report: jax reference mha bf16 d={d} causal fwd+bwd", "reference",
                        _reference_mha(n=REPORT_N, h=REPORT_H, d=d), report=model))
    # The kernel tile is capped at the block size: B=64 (tile = block) and B=256 (sub-tiled).
    for block, d in ((64, 64), (256, 64), (256, 128)):
        model = dict(kernel="block_sparse", n=REPORT_N, h=REPORT_H, d=d, dtype=BF16,
                     causal=False, block=block, window=block)
        out.append(Case(f"report: dilax block-sparse bf16 B={block} d={d} fwd+bwd",
                        "block_sparse",
                        _block_sparse("pallas", n=REPORT_N, h=REPORT_H, hk=REPORT_H, d=d,
                                      block=block),
                        report=model))
    return out


# --------------------------------------------------------------------------------------------
# Compiling one target (runs in a child process with ENV set before jax starts)
# --------------------------------------------------------------------------------------------


def _ptxas() -> str | None:
    try:
        import nvidia.cuda_nvcc as nvcc  # the pip wheel jax[cuda12] installs

        path = os.path.join(list(nvcc.__path__)[0], "bin", "ptxas")
        if os.path.exists(path):
            return path
    except ImportError:
        pass
    return shutil.which("ptxas")


_THUNK = re.compile(r"kCustomKernel.*?\]\s+(\S+)\s+grid:\s*\[([\d, ]+)\]\s+threads:\s*"
                    r"\[([\d, ]+)\]\s+shared_memory:\s*(\d+)\s+bytes")
_PTXAS_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes "
                          r"spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


def kernel_resources(dump_dir: str, target: Target, ptxas: str | None) -> list[dict]:
    """The Pallas kernels of one compiled program (XLA's dump in ``dump_dir``)."""
    launches = {}
    for path in glob.glob(os.path.join(dump_dir, "*.thunk_sequence.txt")):
        with open(path) as f:
            for line in f:
                m = _THUNK.search(line)
                if m:
                    launches[m.group(1)] = dict(
                        grid=[int(x) for x in m.group(2).split(",")],
                        threads=int(m.group(3).split(",")[0]),
                        shared_memory=int(m.group(4)))
    out, seen = [], set()
    for path in sorted(glob.glob(os.path.join(dump_dir, "*.ptx"))):
        with open(path) as f:
            ptx = f.read()
        m = re.search(r"\.entry\s+(\w+)", ptx)
        if not m or m.group(1) not in launches or m.group(1) in seen:
            continue  # not a launched kernel, or the same kernel in another module's dump
        name = m.group(1)
        seen.add(name)
        if not (name.startswith("dilax_") or name.startswith("mha")):
            continue  # XLA's own fusions
        row = dict(kernel=name, **launches[name],
                   wgmma=len(re.findall(r"\bwgmma\.mma_async", ptx)),
                   mma_sync=len(re.findall(r"\bmma\.sync", ptx)))
        row["tensor_cores"] = ("wgmma" if row["wgmma"] else "mma.sync" if row["mma_sync"]
                               else "none (FMA)")
        if ptxas:
            proc = subprocess.run([ptxas, "-v", "-O3", f"--gpu-name={target.sm}", path, "-o",
                                   os.devnull], capture_output=True, text=True)
            text = proc.stdout + proc.stderr
            regs, stack = _PTXAS_REGS.search(text), _PTXAS_STACK.search(text)
            if regs and stack:
                row.update(registers=int(regs.group(1)), stack=int(stack.group(1)),
                           spill_stores=int(stack.group(2)), spill_loads=int(stack.group(3)))
            else:
                row["ptxas_error"] = text.strip()[-300:]
        out.append(row)
    return out


def _place(tree, sharding):
    import jax

    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                        tree)


def work_items(targets: list[str], only: str | None = None) -> list[tuple[str, int]]:
    """``(target, case index)`` pairs to compile, in a fixed order."""
    all_cases = cases()
    return [(key, i) for key in targets for i, c in enumerate(all_cases)
            if key in c.targets and (not only or only in c.name)]


def compile_items(items: list[tuple[str, int]]) -> list[dict]:
    """Compiles ``items`` (see :func:`work_items`) in this process; one result row each."""
    import jax
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    all_cases = cases()
    topos: dict[tuple[str, int], Any] = {}

    def mesh_of(key: str, devices: int, axis: str) -> Mesh:
        if (key, devices) not in topos:
            with open(os.path.join(SPEC_DIR, TARGETS[key].spec)) as f:
                spec = f.read()
            topos[key, devices] = topologies.get_topology_desc(
                platform="cuda", topology=f"1x1x{devices}", target_config=spec)
        return Mesh(np.array(topos[key, devices].devices[:devices]), (axis,))

    ptxas = _ptxas()
    results = []
    for key, index in items:
        case, target = all_cases[index], TARGETS[key]
        row = dict(target=key, name=case.name, op=case.op, expect=case.expect, why=case.why)
        t0 = time.time()
        dump = tempfile.mkdtemp(prefix="dilax-gpu-") if case.report else None
        try:
            built = case.build()
            if case.devices > 1:  # sharded over the sequence of a multi-GPU topology
                mesh = mesh_of(key, case.devices, "sp")
                f, args, grad = built
                fn = (lambda *a, f=f, mesh=mesh: f(*a, mesh))
                fn = _loss_grad(fn) if grad else fn
                args = _place(args, NamedSharding(mesh, P(None, "sp")))
            else:
                fn, args = built
                args = _place(args, NamedSharding(mesh_of(key, 1, "x"), P()))
            opts = {"xla_dump_to": dump} if dump else {}
            jax.jit(fn).lower(*args).compile(compiler_options=opts)
            row["outcome"] = "ok"
        except ValueError as e:
            row["outcome"], row["error"] = "refused", f"ValueError: {e}"
        except Exception as e:  # noqa: BLE001 - the compiler's or jax's failure, reported
            row["outcome"] = "error"
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
            row["traceback"] = traceback.format_exc()[-3000:]
        row["seconds"] = round(time.time() - t0, 2)
        row["passed"] = row["outcome"] == case.expect
        if dump:
            if row["outcome"] == "ok":
                row["kernels"] = kernel_resources(dump, target, ptxas)
                for k in row["kernels"]:
                    k["estimate"] = roofline(case.report, k, target)
                row["model"] = case.report
            shutil.rmtree(dump, ignore_errors=True)
        results.append(row)
        status = "PASS" if row["passed"] else "FAIL"
        print(f"[{key}] {status} {row['outcome']:8s} {row['seconds']:6.1f}s  {case.name}"
              + ("" if row["passed"] else f"\n    {row.get('error', '')[:600]}"), flush=True)
    return results


# --------------------------------------------------------------------------------------------
# Roofline estimate
# --------------------------------------------------------------------------------------------


def _kernel_kind(name: str) -> str | None:
    """``fwd``, ``dq``, ``dkdv`` (dilax), ``bwd_ref`` (jax's fused backward); ``None`` for
    small elementwise kernels (jax's backward preprocessing)."""
    for tag in ("dkdv", "dq", "fwd"):
        if name.startswith("dilax_") and name.endswith(tag):
            return tag
    return {"mha_forward": "fwd", "mha_backward": "bwd_ref"}.get(name)


def roofline(model: dict, k: dict, target: Target) -> dict:
    """An **estimate** of a kernel's fraction of the tensor-core peak, from what was compiled.

    Per kernel, for ``H = h`` heads (batch 1), ``n`` queries and keys, head dim ``d``,
    element size ``s`` bytes, ``pairs`` = the (query, key) pairs the kernel visits (``n^2``;
    ``n^2 / 2`` causal; block-sparse: ``n * (2w/B + 1) * B`` for a window of ``w`` tokens),
    from the compiled launch (grid, registers, shared memory, tensor-core instructions):

    * matmul FLOPs ``F = c_mm * d * pairs * H`` with ``c_mm`` = 4 (forward: QK^T, PV),
      6 (dq: QK^T, dO V^T, dS K), 8 (dk/dv: QK^T, P^T dO, dO V^T, dS^T Q), 14 for jax's
      reference backward, which does dq and dk/dv in one kernel (its 7 tensors: r = 5);
    * HBM bytes ``B = H * s * d * (r + 2) * n``: ``r`` row tensors read or written once (2
      forward: Q, O; 3 dq: Q, dO, dQ; 4 dk/dv: K, V, dK, dV) plus the streamed operand pair
      (K, V forward and dq; Q, dO for dk/dv) read once from HBM: one head's pair
      (``2 n d s`` = 2-4 MiB here) stays in L2 (50 / 40 MiB) while the programs of that head
      re-read it, so re-reads cost L2, not HBM, bandwidth;
    * exponentials ``E = pairs * H`` (one ``exp`` per visited score);
    * ``t = max(F / peak_tc, B / BW, E / MUFU) / wave``, where ``peak_tc`` is the dense
      tensor-core peak of the dtype (TF32 for fp32) when the PTX has tensor-core
      instructions, else the FP32 FMA peak; ``MUFU`` = 16 special-function ops / clock / SM;
      ``wave`` = programs / (full waves * concurrent programs), concurrency from registers,
      shared memory and threads per SM;
    * **estimated fraction of peak** ``= F / (t * peak_tc)``.

    It ignores latency, pipelining depth, softmax ALU work other than ``exp``, and the
    mma.sync-on-Hopper issue limit: an upper bound to compare kernels, not a measurement.
    """
    n, h, d = model["n"], model["h"], model["d"]
    s = {"bfloat16": 2, "float16": 2, "float32": 4}[model["dtype"]]
    if model["kernel"] == "block_sparse":
        B, w = model["block"], model["window"]
        pairs = n * B * min(n // B, 2 * -(-w // B) + 1)
    else:
        pairs = n * n / (2 if model["causal"] else 1)
    kind = _kernel_kind(k["kernel"])
    if kind is None:
        return {}
    c_mm, rows = {"fwd": (4, 2), "dq": (6, 3), "dkdv": (8, 4), "bwd_ref": (14, 5)}[kind]
    programs = math.prod(k["grid"])
    flops = c_mm * d * pairs * h
    bytes_ = h * s * d * (rows + 2) * n
    exps = pairs * h
    tc = k.get("tensor_cores", "none (FMA)") != "none (FMA)"
    peak = (target.peak_tflops[model["dtype"]] if tc else target.fp32_fma_tflops) * 1e12
    regs = k.get("registers") or 255
    threads = k["threads"]
    per_sm = min(65536 // max(1, regs * threads),
                 target.smem_per_sm // max(1, k["shared_memory"]) if k["shared_memory"] else 32,
                 2048 // threads, 32)
    per_sm = max(per_sm, 0)
    if per_sm == 0:
        return dict(fraction_of_peak=0.0, note="does not fit one SM")
    concurrent = per_sm * target.sms
    waves = -(-programs // concurrent)
    wave = programs / (waves * concurrent)
    t_tc, t_mem, t_exp = flops / peak, bytes_ / target.hbm_bytes_per_s, exps / target.exp_per_s
    t = max(t_tc, t_mem, t_exp) / wave
    bound = {t_tc: "tensor", t_mem: "memory", t_exp: "exp"}[max(t_tc, t_mem, t_exp)]
    return dict(fraction_of_peak=round(flops / (t * peak), 3), bound=bound,
                programs_per_sm=per_sm, wave_efficiency=round(wave, 3),
                intensity=round(flops / bytes_, 1))


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def markdown(result: dict) -> str:
    lines = [
        "# Deviceless GPU compiles (`python -m benchmarks gpu-compile`)",
        "",
        f"{result['date']}, jax {result['jax']}, {result['wall_seconds']:.0f} s wall for "
        f"{sum(len(t['cases']) for t in result['targets'])} compiles on "
        f"{result['cores']} cores. Targets: " + "; ".join(
            f"{t['target_name']} (`benchmarks/gpu_targets/{TARGETS[t['target']].spec}`)"
            for t in result["targets"]) + ". Status: **"
        + ("all passed" if result["passed"] else "FAILED") + "**.",
        "",
        "XLA:GPU compiles each program ahead of time for the target (Pallas Triton lowering, "
        "Triton, LLVM, ptxas) in a CPU-only process; nothing runs. `ok` = compiled; "
        "`refused` = the op raised `ValueError` naming the rule (expected for unsupported "
        "configurations). Registers/spills: `ptxas -v -O3` on the kernel's PTX from XLA's dump; "
        "shared memory, grid, threads: XLA's launch (thunk sequence).",
        "",
        "Per target: " + "; ".join(
            f"{t['target']}: {sum(c['outcome'] == 'ok' for c in t['cases'])} compiled, "
            f"{sum(c['outcome'] == 'refused' for c in t['cases'])} refused (as expected: "
            f"{sum(c['outcome'] == 'refused' and c['passed'] for c in t['cases'])}), "
            f"{sum(not c['passed'] for c in t['cases'])} failed" for t in result["targets"])
        + f"; CPU time {result.get('cpu_seconds', 0):.0f} s (user+sys of the compiling "
        "processes).",
        "",
        "## Kernel resources",
        "",
        "| target | program | kernel | grid | threads | shared mem (KiB) | registers | spills "
        "(st/ld B) | tensor cores | est. fraction of peak† | bound |",
        "|---|---|---|---|---:|---:|---:|---:|---|---:|---|",
    ]
    for t in result["targets"]:
        for c in t["cases"]:
            for k in c.get("kernels", []):
                est = k.get("estimate", {})
                lines.append(
                    f"| {t['target']} | {c['name'].removeprefix('report: ')} | `{k['kernel']}` | "
                    f"{'x'.join(map(str, k['grid']))} | {k['threads']} | "
                    f"{k['shared_memory'] / 1024:.0f} | {k.get('registers', '?')} | "
                    f"{k.get('spill_stores', '?')}/{k.get('spill_loads', '?')} | "
                    f"{k['tensor_cores']} | "
                    + (f"{est['fraction_of_peak']:.2f}" if est else "—") + " | "
                    f"{est.get('bound', '')} |")
    lines += ["", "† **Estimate**, not a measurement (no GPU ran): "
              + " ".join(roofline.__doc__.split("\n\n", 1)[1].split()), ""]
    lines += ["## Configurations", "",
              "| target | configuration | expected | outcome | compile s | note |",
              "|---|---|---|---|---:|---|"]
    for t in result["targets"]:
        for c in t["cases"]:
            if c["name"].startswith("report: "):
                continue
            note = c.get("why", "") if c["outcome"] == c["expect"] else c.get("error", "")
            if c["outcome"] == "refused" and c.get("error"):
                note = (note + ": " if note else "") + c["error"].split("\n")[0][:160]
            mark = "" if c["passed"] else " **FAIL**"
            lines.append(f"| {t['target']} | {c['name']} | {c['expect']} | "
                         f"{c['outcome']}{mark} | {c['seconds']:.1f} | "
                         f"{note.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def run(targets: list[str], out_dir: str, only: str | None = None, jobs: int = 2) -> int:
    """Compiles every case of ``targets`` in ``jobs`` child processes (the (target, case)
    pairs dealt round-robin), writes ``gpu-compile.{json,md}`` to ``out_dir``; returns 0 when
    every case had its expected outcome."""
    import jax

    t0 = time.time()
    env = dict(os.environ, **ENV)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(HERE)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    items = work_items(targets, only)
    jobs = max(1, min(jobs, len(items)))
    tmp = tempfile.mkdtemp(prefix="dilax-gpu-compile-")
    children = []
    for shard in range(jobs):
        path = os.path.join(tmp, f"shard{shard}.json")
        cmd = [sys.executable, "-m", "benchmarks.gpu_compile", "--child", f"{shard}/{jobs}",
               "--targets", ",".join(targets), "--json", path]
        if only:
            cmd += ["--only", only]
        children.append((subprocess.Popen(cmd, env=env), path))
    rows, passed = [], True
    for proc, path in children:
        proc.wait()
        if proc.returncode != 0 or not os.path.exists(path):
            print(f"gpu-compile: a child process failed (exit {proc.returncode})",
                  file=sys.stderr)
            passed = False
            continue
        with open(path) as f:
            rows += json.load(f)
    shutil.rmtree(tmp, ignore_errors=True)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    order = {item: i for i, item in enumerate(items)}
    names = {c.name: i for i, c in enumerate(cases())}
    rows.sort(key=lambda r: order.get((r["target"], names.get(r["name"], -1)), 0))
    passed &= len(rows) == len(items) and all(r["passed"] for r in rows)
    result = dict(command="gpu-compile", date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  jax=jax.__version__, cores=os.cpu_count(), jobs=jobs, passed=passed,
                  wall_seconds=round(time.time() - t0, 1), ptxas=_ptxas() is not None,
                  cpu_seconds=round(usage.ru_utime + usage.ru_stime, 1),
                  targets=[dict(target=key, target_name=TARGETS[key].name,
                                cases=[r for r in rows if r["target"] == key])
                           for key in targets])
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "gpu-compile.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out_dir, "gpu-compile.md"), "w") as f:
        f.write(markdown(result))
    print(f"\ngpu-compile: {len(rows)} compiles in {result['wall_seconds']:.0f} s; wrote "
          f"{out_dir}/gpu-compile.{{md,json}}")
    for r in rows:
        if not r["passed"]:
            print(f"  FAILED [{r['target']}] {r['name']}: {r['outcome']} (expected "
                  f"{r['expect']})")
    return 0 if passed else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks gpu-compile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", default="h100,a100", help="comma-separated: h100,a100")
    p.add_argument("--only", default=None, help="only cases whose name contains this")
    p.add_argument("--jobs", type=int, default=2, help="compiling processes")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    targets = [t for t in args.targets.split(",") if t]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise SystemExit(f"unknown targets {unknown}; choose from {sorted(TARGETS)}")
    if args.child:
        shard, num = (int(x) for x in args.child.split("/"))
        items = work_items(targets, args.only)[shard::num]
        with open(args.json, "w") as f:
            json.dump(compile_items(items), f, indent=1)
        return 0
    return run(targets, args.out, args.only, args.jobs)


if __name__ == "__main__":
    if "jax" not in sys.modules:
        for name, value in ENV.items():
            os.environ.setdefault(name, value)
    sys.exit(main())
