"""The configurations ``python -m benchmarks gpu-compile`` compiles: the GPU targets (public
figures of an H100 and an A100) and :func:`cases`, a covering list of (op, dtype, shape,
implementation) cases, each with its expected outcome (``ok`` or ``refused``), plus the
kernel-level :func:`report_cases` for the resource report.

Nothing here imports jax at module level: ``python -m tools.gpu.compile`` sets its
environment (``JAX_PLATFORMS=cpu``, ...) after its imports, before jax starts, so every case
builds its program lazily."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

# --------------------------------------------------------------------------------------------
# Targets (public figures: NVIDIA H100 / A100 datasheets, FlashAttention-3 paper for MUFU)
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Target:
    key: str
    name: str
    spec: str  # file in tools/gpu/targets
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
    over the sequence). ``no_xla_matmul``: the compiled program is attention on Pallas
    kernels only, so it must call at least one kernel and contain no XLA matmul (see
    ``tools.gpu.hlo.program_counts``); the run fails otherwise. Left ``None``, it is derived:
    true for every ``ok`` case of an attention op (:data:`ATTENTION_OPS`) whose name says
    ``pallas``, and for the kernel-level programs (``flash``, ``reference``, ``report:``
    cases); a whole model step (``train``: its projections are XLA matmuls) is reported,
    never required."""

    name: str
    op: str
    build: Callable[[], tuple[Callable, Any]]
    expect: str = "ok"
    why: str = ""
    targets: tuple[str, ...] = ("h100", "a100")
    report: dict | None = None
    devices: int = 1
    no_xla_matmul: bool | None = None

    def __post_init__(self):
        if self.no_xla_matmul is None:
            self.no_xla_matmul = self.expect == "ok" and (
                self.op in ("flash", "reference") or self.name.startswith("report: ")
                or (self.op in ATTENTION_OPS and "pallas" in self.name.lower()))


# Ops whose cases compile an attention program and nothing else (see Case.no_xla_matmul).
ATTENTION_OPS = ("dilated", "block_sparse", "ring", "decode", "flash", "reference", "flex")


def _sds(shape, dtype):
    import jax

    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def loss_grad(f, argnums=(0, 1, 2)):
    """fwd+bwd: the gradient of ``sum(f(...))`` (float32) in ``argnums``."""
    import jax
    import jax.numpy as jnp

    return jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums)


def _qkv(b, n, h, hk, d, dtype):
    return (_sds((b, n, h, d), dtype), _sds((b, n, hk, d), dtype), _sds((b, n, hk, d), dtype))


def _dilated(impl, *, n=8192, h=8, hk=8, d=64, dtype="bfloat16", causal=False, grad=True,
             mode="mixture", ws=(2048, 4096), rs=(1, 2), window=None, padded=False):
    def build():
        import dilax

        def f(q, k, v, *lengths):  # padded: traced query/key lengths and a key-padding mask
            pad = dict(zip(("query_seq_lengths", "key_value_seq_lengths", "key_padding_mask"),
                           lengths))
            return dilax.dilated_attention(q, k, v, ws, rs, is_causal=causal, mode=mode,
                                           implementation=impl, local_window=window, **pad)

        extra = (_sds((1,), "int32"), _sds((1,), "int32"), _sds((1, n), "bool")) if padded \
            else ()
        return (loss_grad(f) if grad else f), (*_qkv(1, n, h, hk, d, dtype), *extra)

    return build


def _block_sparse(impl, *, n=8192, h=8, hk=8, d=64, dtype="bfloat16", causal=False, grad=True,
                  block=64, window=None, per_head=False, lengths=False):
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

        def f(q, k, v, *lens):  # lengths: traced (b,) int32 arguments of the program
            kw = dict(zip(("query_seq_lengths", "key_value_seq_lengths"), lens))
            return dilax.block_sparse_attention(q, k, v, pattern, is_causal=causal,
                                                implementation=impl, **kw)

        b = 2 if lengths else 1
        lens = (_sds((b,), "int32"),) * 2 if lengths else ()
        return (loss_grad(f) if grad else f), (*_qkv(b, n, h, hk, d, dtype), *lens)

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
        return (loss_grad(f) if grad else f), args

    return build


def _flex(mod: str, *, n=4096, h=8, hk=2, d=64, dtype="bfloat16", dense=False):
    """dilax.flex_attention on the Pallas kernels, fwd+bwd, causal, GQA, with one mod:
    ``"softcap"`` (logits_soft_cap=30), ``"alibi"`` (learnable slopes: their gradient too)
    or ``"documents"`` (a document mask_mod over traced ids (b, n), and-ed with causal;
    ``"documents+blocks"``: with its BlockMask of 128-blocks built in the program, which
    steers the kernels' loops). ``dense``: the same through
    ``dilax.dot_product_attention(..., is_causal=True, implementation="pallas")`` (the
    jax.nn drop-in; ``"softcap"`` or ``"alibi"``)."""

    def build():
        import dilax
        from dilax import flex

        def attend(q, k, v, extra):
            if dense:  # the drop-in's own causality, the mod on top
                kw = (dict(logits_soft_cap=30.0) if mod == "softcap" else
                      dict(score_mod=flex.alibi(extra)))
                return dilax.dot_product_attention(q, k, v, is_causal=True,
                                                   implementation="pallas", **kw)
            kw = dict(mask_mod=flex.causal_mask)
            if mod == "softcap":
                kw["logits_soft_cap"] = 30.0
            elif mod == "alibi":
                kw["score_mod"] = flex.alibi(extra)
            else:
                kw["mask_mod"] = flex.and_masks(flex.document_mask(extra), flex.causal_mask)
            if mod == "documents+blocks":
                kw["block_mask"] = dilax.create_block_mask(kw.pop("mask_mod"), 1, None, n, n)
            return dilax.flex_attention(q, k, v, implementation="pallas", **kw)

        extra = (_sds((h,), "float32") if mod == "alibi" else _sds((1, n), "int32"))
        argnums = (0, 1, 2, 3) if mod == "alibi" else (0, 1, 2)
        return loss_grad(attend, argnums), (*_qkv(1, n, h, hk, d, dtype), extra)

    return build


def _reference_mha(*, n=8192, h=16, d=64, dtype="bfloat16", causal=True):
    """jax's reference Triton attention (jax.experimental.pallas.ops.gpu.attention), fwd+bwd
    with its Triton backward, default block sizes."""

    def build():
        from jax.experimental.pallas.ops.gpu import attention

        def f(q, k, v):
            return attention.mha(q, k, v, None, sm_scale=d ** -0.5, causal=causal)

        return loss_grad(f), _qkv(1, n, h, h, d, dtype)

    return build


def _ring(kind, *, n=16384, h=8, hk=2, d=64, dtype="bfloat16", grad=True, impl=None):
    def build():
        import dilax
        from dilax import patterns

        def f(q, k, v, mesh):
            if kind == "dilated" and impl is not None:  # an explicit core for its calls
                return dilax.dilated_attention(
                    q, k, v, (2048, 4096, 16384), (1, 2, 4), is_causal=True,
                    implementation=impl, sequence_parallel=dilax.SequenceParallel(mesh, "sp"))
            sp = dilax.SequenceParallel(mesh, "sp")
            if kind == "dilated":
                return dilax.dilated_attention(q, k, v, (2048, 4096, 16384), (1, 2, 4),
                                               is_causal=True, sequence_parallel=sp)
            return dilax.block_sparse_attention(
                q, k, v, patterns.local_window(n, 128, 256), is_causal=True,
                implementation=impl, sequence_parallel=sp)

        return f, _qkv(1, n, h, hk, d, dtype), grad

    return build


def _decode_step(impl, *, b=1, max_len=32768, h=32, hk=8, d=128, dtype="bfloat16", window=None):
    """One decode step (t = 1) of every row against a KV cache of ``max_len`` positions."""

    def build():
        import jax
        import jax.numpy as jnp

        import dilax

        def f(q, k, v, cache):
            return dilax.dilated_attention_decode(q, k, v, cache, (2048, 8192, 32768),
                                                  (1, 4, 16), implementation=impl,
                                                  local_window=window)

        q, k, v = _qkv(b, 1, h, hk, d, dtype)
        cache = jax.eval_shape(lambda: dilax.KVCache.init(b, max_len, hk, d, jnp.dtype(dtype)))
        return f, (q, k, v, cache)

    return build


def _decode_kernel_mods(*, b=8, max_len=32768, h=32, hk=8, d=128, dtype="bfloat16"):
    """pallas_kernels.decode_attention directly with FlexAttention mods (soft-cap 30, ALiBi
    slopes, a document mask_mod over ids (b, max_len)): dilated branches + a local window."""

    def build():
        from dilax import flex
        from dilax.core.mods import trace_mod
        from pallas_kernels.decode import DecodeBranch, decode_attention
        from pallas_kernels.mods import kernel_mods

        branches = (DecodeBranch(8192, 4, 2048, (0, h)), DecodeBranch(None, 1, 129, (0, h)))

        def f(q, k, v, pos, slopes, ids):
            score, sc = trace_mod(flex.alibi(slopes), "score_mod")
            mask, mc = trace_mod(flex.document_mask(ids), "mask_mod")
            return decode_attention(q, k, v, pos, branches=branches, scale=d ** -0.5,
                                    mods=kernel_mods(score, sc, mask, mc, 30.0))[0]

        args = (_sds((b, 1, h, d), dtype), _sds((b, max_len, hk, d), dtype),
                _sds((b, max_len, hk, d), dtype), _sds((b, 1), "int32"), _sds((h,), "float32"),
                _sds((b, max_len), "int32"))
        return f, args

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


def _resources(d: int, dtype: str) -> dict:
    """The ``report`` of a whole attention program: its kernels' registers, spills and shared
    memory (and the no-spill rule), no roofline estimate."""
    return dict(kernel="resources", d=d, dtype=dtype)


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
        # the flash kernels take the band, lengths and per-key validity: every branch is a
        # kernel call (issue 29), no XLA attention loop left in the program
        Case("dilated pallas bf16 local_window", "dilated",
             _dilated("pallas", n=4096, window=128)),
        Case("padded + windowed dilated, implementation='pallas', fwd+bwd, bf16 GQA 8/2 "
             "causal", "dilated",
             _dilated("pallas", hk=2, causal=True, window=128, padded=True),
             report=_resources(64, BF16)),
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
        # lengths inside the kernels: resources in the report (batch 2 counted as 16 heads)
        Case("block-sparse pallas bf16 with lengths GQA 8/2 B=64 d=128 causal fwd+bwd",
             "block_sparse", _block_sparse("pallas", hk=2, d=128, causal=True, lengths=True),
             report=dict(kernel="block_sparse", n=8192, h=16, d=128, dtype=BF16, causal=True,
                         block=64, window=64)),
        Case("block-sparse pallas bf16 n=1000 B=64 (partial last block) fwd+bwd",
             "block_sparse", _block_sparse("pallas", n=1000)),
        Case("block-sparse pallas B=8", "block_sparse", _block_sparse("pallas", block=8),
             expect="refused", why="the Pallas block-sparse kernel needs pattern.block_size "
                                   ">= 16 on GPU (the smallest Triton tile)"),
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
        Case("ring dilated on 8 GPUs, fwd+bwd, implementation='pallas' (P=8) bf16 GQA causal",
             "ring", _ring("dilated", impl="pallas"), targets=("h100",), devices=8,
             report=_resources(64, BF16)),
        Case("ring block-sparse pallas on 8 GPUs, fwd+bwd (P=8) bf16 GQA causal d=128",
             "ring", _ring("block_sparse", impl="pallas", d=128), targets=("h100",),
             devices=8, report=_resources(128, BF16)),
    ]
    # Decode steps on the Pallas decode kernel (split-K over the gathered windows).
    for b in (1, 64):
        for d in (128, 64):
            model = dict(kernel="decode", n=32768, h=32, d=d, dtype=BF16, causal=True)
            out.append(Case(f"decode step pallas bf16 b={b} d={d} GQA 32/8 max_len=32768",
                            "decode", _decode_step("pallas", b=b, d=d), report=model))
    out.append(Case("decode step pallas fp16 b=8 d=128 GQA 32/8 local_window=128", "decode",
                    _decode_step("pallas", b=8, dtype=FP16, window=128),
                    report=dict(kernel="decode", n=32768, h=32, d=128, dtype=FP16,
                                causal=True)))
    out.append(Case("decode kernel pallas bf16 b=8 d=128 GQA 32/8 soft-cap + ALiBi + document "
                    "mask_mod", "decode", _decode_kernel_mods(), targets=("h100",),
                    report=dict(kernel="decode", n=32768, h=32, d=128, dtype=BF16,
                                causal=True)))
    out.append(Case("decode step pallas d=96", "decode", _decode_step("pallas", d=96),
                    expect="refused", why="the Pallas decode kernel needs head_dim a power "
                                          "of two in [16, 256]"))
    # FlexAttention mods traced inside the flash kernels (pallas_kernels/mods.py)
    for mod, what in (("softcap", "logits_soft_cap"), ("alibi", "ALiBi score_mod, slopes' grad"),
                      ("documents", "document mask_mod"),
                      ("documents+blocks", "document mask_mod + BlockMask")):
        for d in (64, 128):
            out.append(Case(f"flex pallas bf16 {what} GQA 8/2 n=4096 d={d} causal fwd+bwd",
                            "flex", _flex(mod, d=d), targets=("h100",),
                            report=_resources(d, BF16)))
    # the same kernels under dot_product_attention (op "dense"), the jax.nn drop-in
    for mod, what in (("softcap", "logits_soft_cap=30"), ("alibi", "ALiBi score_mod, slopes' "
                                                                     "grad")):
        for d in (64, 128):
            out.append(Case(f"dot_product pallas bf16 {what} GQA 8/2 n=4096 d={d} causal "
                            "fwd+bwd", "flex", _flex(mod, d=d, dense=True), targets=("h100",),
                            report=_resources(d, BF16)))
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
