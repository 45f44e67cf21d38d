"""Explicit GPU implementations follow the compile target, not the runtime backend.

``implementation="pallas"`` / ``"cudnn"`` trace on any backend; lowering the program for a
platform the kernels do not support raises a ``ValueError`` that says what to do instead
(``interpret=True``, ``implementation="xla"``). The GPU side (that the same programs compile
for CUDA targets) is ``make gpu-check`` (benchmarks/gpu_compile.py), which needs jax's CUDA
plugin; this CPU suite checks the refusal side only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dilax
from dilax import patterns
from dilax.backend import cuda_plugin_available, resolve_implementation
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
    text = dilax.backend.kernels_available()
    assert "make gpu-check" in text["pallas"] and "CUDA" in text["cudnn"]
