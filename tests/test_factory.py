"""create_attention: selection logic (backend faked), every kind it returns, and its errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tolerance import assert_scaled_close

import dilax
from dilax import patterns
from dilax.factory import RingDilatedAttention

Q = jax.random.normal(jax.random.PRNGKey(0), (1, 32, 4, 8))
KV = jax.random.normal(jax.random.PRNGKey(1), (1, 32, 2, 8))


def test_auto_picks_xla_on_cpu_and_pallas_on_gpu():
    cpu = dilax.create_attention(segment_lengths=(8, 16), dilation_rates=(1, 2))
    assert cpu.choice.kind == "dilated" and cpu.choice.implementation == "xla"
    assert "backend 'cpu'" in repr(cpu)
    gpu = dilax.create_attention(segment_lengths=(8, 16), dilation_rates=(1, 2), backend="gpu")
    assert gpu.choice.implementation == "pallas"
    assert gpu.inner.implementation == "pallas"
    sparse = dilax.create_attention(pattern=patterns.local_window(32, 16, 16), backend="gpu")
    assert sparse.choice.kind == "block_sparse" and sparse.choice.implementation == "pallas"
    # a block below the smallest Triton tile: the registry's rule, recorded in the choice
    small = dilax.create_attention(pattern=patterns.local_window(32, 8, 16), backend="gpu")
    assert small.choice.implementation == "xla" and "block_size >= 16" in small.choice.reason


def test_dilated_kind_computes_the_functional_op():
    attn = dilax.create_attention("dilated", segment_lengths=(8, 16), dilation_rates=(1, 2),
                                  is_causal=True)
    expected = dilax.dilated_attention(Q, KV, KV, (8, 16), (1, 2), is_causal=True,
                                       implementation="reference")
    assert_scaled_close(attn(Q, KV, KV), expected)


def test_block_sparse_kind_computes_the_functional_op():
    pattern = patterns.local_window(32, 8, 16)
    attn = dilax.create_attention(pattern=pattern)
    expected = dilax.block_sparse_attention(Q, KV, KV, pattern, implementation="reference")
    assert_scaled_close(attn(Q, KV, KV), expected)


def test_multihead_kinds_build_projection_modules():
    attn = dilax.create_attention(segment_lengths=(8, 16), dilation_rates=(1, 2), embed_dim=32,
                                  num_heads=4, rngs=nnx.Rngs(0), layer_norm=False)
    assert isinstance(attn.inner, dilax.nn.MultiheadDilatedAttention) and attn.choice.multihead
    x = jax.random.normal(jax.random.PRNGKey(2), (1, 32, 32))
    expected = attn.inner(x)
    np.testing.assert_array_equal(attn(x), expected)  # the wrapper calls the module
    sparse = dilax.create_attention(pattern=patterns.local_window(32, 8, 16), embed_dim=32,
                                    num_heads=4, rngs=nnx.Rngs(0))
    assert isinstance(sparse.inner, dilax.nn.BlockSparseMultiheadAttention)


def test_ring_kind_on_a_one_device_mesh_equals_single_device():
    mesh = jax.make_mesh((1,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
    sp = dilax.SequenceParallel(mesh)
    attn = dilax.create_attention(segment_lengths=(8, 16), dilation_rates=(1, 2),
                                  sequence_parallel=sp)
    assert attn.choice.kind == "ring" and "mesh axis 'sp'" in attn.choice.reason
    assert isinstance(attn.inner, dilax.nn.DilatedAttention)
    assert attn.inner.sequence_parallel == sp
    expected = dilax.dilated_attention(Q, KV, KV, (8, 16), (1, 2), implementation="reference")
    assert_scaled_close(attn(Q, KV, KV), expected)
    # the old doors still work and warn, naming the one door: create_attention(mesh=) and the
    # factory's ring class build the same module
    with pytest.warns(DeprecationWarning, match="pass sequence_parallel=dilax.SequenceParallel"):
        old = dilax.create_attention(segment_lengths=(8, 16), dilation_rates=(1, 2), mesh=mesh)
    assert old.inner.sequence_parallel == sp and old.choice == attn.choice
    with pytest.warns(DeprecationWarning, match=r"use dilax.nn.DilatedAttention\(\.\.\., "
                      "sequence_parallel="):
        ring = RingDilatedAttention((8, 16), (1, 2), mesh=mesh)
    assert ring.sequence_parallel == sp
    with pytest.raises(TypeError, match="give the mesh once, as sequence_parallel="):
        dilax.create_attention(segment_lengths=(8,), dilation_rates=(1,), mesh=mesh,
                               sequence_parallel=sp)


def test_ring_kind_with_a_pattern_runs_the_block_sparse_ring():
    mesh = jax.make_mesh((1,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
    pattern = patterns.local_window(32, 8, 8)
    attn = dilax.create_attention("ring", pattern=pattern, is_causal=True,
                                  sequence_parallel=dilax.SequenceParallel(mesh))
    assert attn.choice.kind == "ring" and attn.choice.implementation == "xla"
    assert isinstance(attn.inner, dilax.nn.BlockSparseAttention)
    assert attn.inner.sequence_parallel == dilax.SequenceParallel(mesh)
    expected = dilax.block_sparse_attention(Q, KV, KV, pattern, is_causal=True,
                                            implementation="reference")
    np.testing.assert_allclose(np.asarray(attn(Q, KV, KV)), np.asarray(expected), atol=1e-5)


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(kind="sparse"), "kind must be one of"),
    (dict(), "needs segment_lengths + dilation_rates or a pattern"),
    (dict(segment_lengths=(8,)), "must be given together"),
    (dict(segment_lengths=(8,), dilation_rates=(1,), pattern=patterns.local_window(32, 8, 8)),
     "not both"),
    (dict(kind="ring", segment_lengths=(8,), dilation_rates=(1,)), "needs sequence_parallel="),
    (dict(kind="ring", pattern=patterns.local_window(32, 8, 8)), "needs sequence_parallel="),
    (dict(kind="ring"), "needs segment_lengths and dilation_rates, or a pattern"),
    (dict(kind="block_sparse", pattern=patterns.local_window(32, 8, 8),
          sequence_parallel=dilax.SequenceParallel(jax.make_mesh(
              (1,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,)))),
     "does not take sequence_parallel"),
    (dict(kind="block_sparse"), "needs a pattern"),
    (dict(segment_lengths=(8,), dilation_rates=(1,), implementation="triton"),
     "implementation must be one of"),
    (dict(segment_lengths=(8,), dilation_rates=(1,), embed_dim=32), "needs embed_dim, num_heads"),
    (dict(pattern=patterns.local_window(32, 8, 8), implementation="cudnn"), "cuDNN has no"),
    # dilax.registry: an explicit implementation that cannot serve a branch names the reason
    (dict(segment_lengths=(8,), dilation_rates=(1,), local_window=2, implementation="cudnn"),
     "has no band mask (local_window); use implementation=None to run that branch on 'xla'"),
    (dict(pattern=patterns.local_window(32, 16, 16), embed_dim=32, num_heads=4,
          rngs=nnx.Rngs(0), implementation="pallas"),
     "the multi-head block-sparse module runs implementation=None (here 'xla')"),
])
def test_impossible_combinations_list_the_valid_ones(kwargs, fragment):
    with pytest.raises(ValueError) as info:
        dilax.create_attention(**kwargs)
    assert fragment in str(info.value)


def test_describe_reports_backend_and_kernels(capsys):
    assert dilax.describe() is None  # prints once; a REPL has nothing more to echo
    text = capsys.readouterr().out
    assert "backend: cpu" in text and "pallas" in text and "xla" in text


def test_pallas_off_gpu_needs_interpret():
    with pytest.raises(ValueError, match="interpret=True"):
        dilax.dilated_attention(Q, KV, KV, (8,), (1,), implementation="pallas")
    out = dilax.dilated_attention(Q, KV, KV, (8, 16), (1, 2), interpret=True, is_causal=True)
    ref = dilax.dilated_attention(Q, KV, KV, (8, 16), (1, 2), implementation="reference",
                                  is_causal=True)
    assert_scaled_close(out, ref)
    assert jnp.isfinite(out).all()
