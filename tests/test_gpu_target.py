"""Explicit GPU implementations follow the compile target, not the runtime backend.

``implementation="pallas"`` / ``"cudnn"`` trace on any backend; lowering the program for a
platform the kernels do not support raises a ``ValueError`` that says what to do instead
(``interpret=True``, ``implementation="xla"``). The GPU side (that the same programs compile
for CUDA targets) is ``make gpu-check`` (tools/gpu/compile.py), which needs jax's CUDA
plugin; this CPU suite checks the refusal side, and the counter that check runs on each
compiled program's HLO (kernel calls, XLA matmuls) on canned HLO text.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dilax
from dilax import patterns
from dilax.registry import cuda_plugin_available, resolve_implementation
from pallas_kernels.platform import require_platform

X = jnp.ones((1, 32, 2, 16), jnp.float32)


def test_explicit_gpu_implementations_resolve_on_cpu():
    assert jax.default_backend() == "cpu"
    assert resolve_implementation("pallas") == "pallas"
    assert resolve_implementation("cudnn") == "cudnn"
    assert resolve_implementation(None) == "xla"  # None/"auto" follow the runtime backend
    with pytest.raises(ValueError, match="implementation must be one of"):
        resolve_implementation("triton")


@pytest.mark.parametrize("op", ["dilated", "block_sparse"])
def test_pallas_traces_on_cpu_and_refuses_at_lowering(op):
    if op == "dilated":
        fn = lambda q: dilax.dilated_attention(q, q, q, (16,), (1,), implementation="pallas")
    else:
        pattern = patterns.local_window(32, 16, 16)
        fn = lambda q: dilax.block_sparse_attention(q, q, q, pattern, implementation="pallas")
    traced = jax.jit(fn).trace(X)  # tracing is target-independent
    assert traced.out_info.shape == X.shape
    with pytest.raises(ValueError, match=r"interpret=True.*implementation='xla'.*'cpu'"):
        traced.lower()
    with pytest.raises(ValueError, match="interpret=True"):  # eager calls lower too
        fn(X)


def test_cudnn_refuses_off_cuda_naming_the_alternatives():
    fn = lambda q: dilax.dilated_attention(q, q, q, (16,), (1,), implementation="cudnn")
    x = X.astype(jnp.bfloat16)
    if cuda_plugin_available():  # traces; refused when lowered for the CPU
        with pytest.raises(ValueError, match=r"'xla'.*interpret=True.*'cpu'"):
            jax.jit(fn).lower(x)
    else:  # jax's cuDNN attention needs the CUDA plugin already to trace
        with pytest.raises(ValueError, match=r"'xla'.*interpret=True.*jax\[cuda12\]"):
            jax.jit(fn).trace(x)


def test_require_platform_is_identity_under_transforms():
    """The guard is a no-op value-wise (jvp, vmap, grad); only lowering for a platform
    outside the allowed ones raises, with the given message."""
    f = lambda x: jnp.sin(require_platform(x, "needs a GPU"))
    x = jnp.arange(3.0)
    for fn in (jax.grad(lambda x: f(x).sum()), jax.vmap(f)):
        with pytest.raises(ValueError, match="needs a GPU.*lowered for 'cpu'"):
            fn(x)
    jaxpr = jax.make_jaxpr(jax.vmap(jax.grad(lambda x: f(x))))(x)
    assert "dilax_require_platform" in str(jaxpr)
    with pytest.raises(ValueError, match="subset"):
        require_platform(x, "m", platforms=("tpu",))
    np.testing.assert_array_equal(jax.eval_shape(f, x).shape, (3,))


def test_factory_auto_on_gpu_picks_per_configuration_and_says_why():
    from flax import nnx

    kw = dict(segment_lengths=(16,), dilation_rates=(1,), backend="gpu")
    mh = dict(embed_dim=64, num_heads=4, rngs=nnx.Rngs(0))
    cases = [
        (dict(kw, **mh, dtype=jnp.bfloat16), "cudnn", "cuDNN's fused forward"),
        (dict(kw, **mh, dtype=jnp.float32), "pallas", "bf16/fp16 only"),
        (dict(kw, embed_dim=80, num_heads=4, rngs=nnx.Rngs(0), dtype=jnp.float16), "pallas",
         "head_dim % 8"),
        (kw, "pallas", "pass dtype and head_dim"),
        (dict(pattern=patterns.local_window(32, 16, 16), backend="gpu"), "pallas",
         "cuDNN has no such attention"),
    ]
    for kwargs, impl, why in cases:
        choice = dilax.create_attention(**kwargs).choice
        assert choice.implementation == impl and why in choice.reason, choice
    text = dilax.registry.kernels_available()
    assert "make gpu-check" in text["pallas"] and "CUDA" in text["cudnn"]


# A canned optimized-HLO module (the forms XLA:GPU prints): one gemm-fusion computation called
# from a loop body, a conditional branch and the entry (three XLA matmuls), a cuBLASLt GEMM
# custom-call (a fourth), two Pallas Triton calls whose serialized kernel IR mentions dots and
# HLO-looking text (not matmuls of the program), and a cuDNN fused-attention call.
CANNED_HLO = "\n".join([
    "HloModule canned, is_scheduled=true",
    "",
    "%gemm (p0: f32[8,4], p1: f32[4,8]) -> f32[8,8] {",
    "  %p0 = f32[8,4]{1,0} parameter(0)",
    "  %p1 = f32[4,8]{1,0} parameter(1)",
    "  ROOT %dot.1 = f32[8,8]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, "
    'rhs_contracting_dims={0}, metadata={op_name="jit(f)/dot_general"}',
    "}",
    "",
    "%body (t: (s32[], f32[8,4], f32[4,8])) -> (s32[], f32[8,4], f32[4,8]) {",
    "  %t = (s32[], f32[8,4]{1,0}, f32[4,8]{1,0}) parameter(0)",
    "  %a = f32[8,4]{1,0} get-tuple-element(%t), index=1",
    "  %b = f32[4,8]{1,0} get-tuple-element(%t), index=2",
    "  %gemm_fusion = f32[8,8]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm, "
    'metadata={op_name="jit(f)/while/body/dot_general"}, backend_config='
    '{"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}',
    "  ROOT %r = (s32[], f32[8,4]{1,0}, f32[4,8]{1,0}) tuple(%i, %a, %b)",
    "}",
    "",
    "%cond (t.1: (s32[], f32[8,4], f32[4,8])) -> pred[] {",
    "  %t.1 = (s32[], f32[8,4]{1,0}, f32[4,8]{1,0}) parameter(0)",
    "  ROOT %lt = pred[] compare(%i.1, %n), direction=LT",
    "}",
    "",
    "%branch_dot (x: f32[8,4], y: f32[4,8]) -> f32[8,8] {",
    "  ROOT %f.2 = f32[8,8]{1,0} fusion(%x, %y), kind=kCustom, calls=%gemm",
    "}",
    "",
    "%branch_zero (x.1: f32[8,4], y.1: f32[4,8]) -> f32[8,8] {",
    "  ROOT %z = f32[8,8]{1,0} broadcast(%c0), dimensions={}",
    "}",
    "",
    "ENTRY %main.9 (a.1: f32[8,4], b.1: f32[4,8], q: bf16[1,64,2,16]) -> f32[8,8] {",
    "  %k1 = (bf16[1,64,2,16]{3,2,1,0}, f32[1,2,64]{2,1,0}) custom-call(%q, %q, %q), "
    'custom_call_target="__gpu$xla.gpu.triton", api_version=API_VERSION_TYPED_FFI, '
    'metadata={op_name="jit(f)/dilax_flash_fwd/pallas_call"}, backend_config={debug = false, '
    r'grid_x = 1 : i32, ir = "ML\EFR\00tt.dot\00%d = f32[2]{0} dot(%a, %b), calls=%gemm", '
    'name = "dilax_flash_fwd", num_warps = 4 : i32}',
    "  %k2 = bf16[1,64,2,16]{3,2,1,0} custom-call(%q, %k1), "
    'custom_call_target="__gpu$xla.gpu.triton", backend_config={grid_x = 1 : i32, '
    'ir = "tt.dot", name = "dilax_flash_dq", num_warps = 4 : i32}',
    "  %fmha = (bf16[1,2,64,16]{3,2,1,0}, u8[0]{0}) custom-call(%q, %q, %q), "
    'custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config":{}}',
    "  %lt.1 = (f32[8,8]{1,0}, s8[4194304]{0}) custom-call(%a.1, %b.1), "
    'custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{}}',
    "  %w = (s32[], f32[8,4]{1,0}, f32[4,8]{1,0}) while(%init), condition=%cond, body=%body, "
    'backend_config={"known_trip_count":{"n":"7"}}',
    "  %c = f32[8,8]{1,0} conditional(%p, %a.1, %b.1), true_computation=%branch_dot, "
    "false_computation=%branch_zero",
    "  ROOT %g = f32[8,8]{1,0} fusion(%a.1, %b.1), kind=kCustom, calls=%gemm",
    "}",
    ""])


def test_program_counts_on_canned_hlo():
    from tools.gpu.hlo import program_counts

    counts = program_counts(CANNED_HLO)
    # a shared computation counts once per call site; a loop body once (not by trip count)
    assert counts == dict(
        kernel_calls=2, cudnn_calls=1, xla_matmuls=4,
        kernel_names={"dilax_flash_dq": 1, "dilax_flash_fwd": 1},
        cudnn_targets={"__cudnn$fmhaSoftmax": 1},
        matmul_ops={"__cublas$lt$matmul": 1, "dot": 3})
    # the entry alone: Pallas calls only, their IR's "dot" text never counts
    pallas_only = "\n".join(line for line in CANNED_HLO.splitlines()
                            if not any(s in line for s in ("%fmha", "%lt.1", "%w ", "%c ",
                                                           "ROOT %g")))
    assert program_counts(pallas_only)["xla_matmuls"] == 0
    assert program_counts(pallas_only)["kernel_calls"] == 2


def test_pallas_attention_cases_require_no_xla_matmul():
    from tools.gpu.cases import cases
    from tools.gpu.compile import program_problem
    from tools.gpu.report import _count_cells, _zero_matmul_summary

    by_name = {c.name: c for c in cases()}
    # every Pallas attention program is checked; XLA/cuDNN attention and the model step not
    assert by_name["padded + windowed dilated, implementation='pallas', fwd+bwd, bf16 GQA "
                   "8/2 causal"].no_xla_matmul
    assert by_name["decode step pallas bf16 b=64 d=128 GQA 32/8 max_len=32768"].no_xla_matmul
    assert all(c.no_xla_matmul for c in cases() if c.op == "ring" and "pallas" in c.name)
    assert not any(c.no_xla_matmul for c in cases()
                   if c.op == "train" or c.expect != "ok" or " xla " in c.name)
    ok = dict(no_xla_matmul=True, kernel_calls=3, xla_matmuls=0, matmul_ops={}, cudnn_calls=0)
    assert program_problem(ok) is None
    assert "2 XLA matmuls" in program_problem(dict(ok, xla_matmuls=2, matmul_ops={"dot": 2}))
    assert "0 kernel calls" in program_problem(dict(ok, kernel_calls=0))
    assert program_problem(dict(ok, no_xla_matmul=False, kernel_calls=0, xla_matmuls=5)) is None
    assert _count_cells(ok) == ("3 Pallas", "0 (must be 0)")
    assert _count_cells(dict(ok, xla_matmuls=2, cudnn_calls=1)) == ("3 Pallas + 1 cuDNN",
                                                                      "**2** (must be 0)")
    assert _count_cells(dict(outcome="refused")) == ("—", "—")
    rows = [ok, dict(ok, xla_matmuls=1), dict(ok, no_xla_matmul=False), dict(outcome="error")]
    assert _zero_matmul_summary(rows) == "1 of 2 Pallas attention programs with 0 XLA matmuls"


def test_no_spill_rule_for_half_precision_kernels_up_to_head_dim_128():
    """Issue 29: a dilax kernel of a bf16/fp16 program at d <= 128 must not spill; fp32,
    d > 128 and jax's own kernels are reported only. The whole Pallas attention programs the
    acceptance lists carry a report (their kernels' resources)."""
    from tools.gpu.cases import cases
    from tools.gpu.compile import spill_problem

    clean = dict(kernel="dilax_flash_fwd", spill_stores=0, spill_loads=0)
    spilled = dict(kernel="dilax_flash_dkdv", spill_stores=40, spill_loads=36)
    bf16 = dict(kernel="resources", d=128, dtype="bfloat16")
    assert spill_problem(bf16, [clean]) is None
    assert "dilax_flash_dkdv (40/36 B)" in spill_problem(bf16, [clean, spilled])
    assert spill_problem(dict(bf16, dtype="float32"), [spilled]) is None
    assert spill_problem(dict(bf16, d=256), [spilled]) is None
    assert spill_problem(bf16, [dict(spilled, kernel="mha_forward")]) is None
    assert spill_problem(None, [spilled]) is None
    by_name = {c.name: c for c in cases()}
    for name in ("padded + windowed dilated, implementation='pallas', fwd+bwd, bf16 GQA 8/2 "
                 "causal", "ring dilated on 8 GPUs, fwd+bwd, implementation='pallas' (P=8) bf16 "
                 "GQA causal", "ring block-sparse pallas on 8 GPUs, fwd+bwd (P=8) bf16 GQA "
                 "causal d=128", "decode step pallas bf16 b=64 d=128 GQA 32/8 max_len=32768",
                 "block-sparse pallas bf16 with lengths GQA 8/2 B=64 d=128 causal fwd+bwd"):
        assert by_name[name].report is not None, name
