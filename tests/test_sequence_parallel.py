"""Sequence-parallel modules and models (``sequence_parallel=dilax.SequenceParallel(...)``).

The same parameters run once on one device (the dilated modules there on the dense mask-based
reference attention) and once as ring attention over a 2-, 4- or 8-device mesh (8 host CPU
devices come from tests/conftest.py), both in one program; outputs and gradients must agree.
The attention modules without parameters are checked against the float64 oracle instead
(NumPy: only the ring is compiled). The ring itself is checked against the mask-based
reference in test_ring.py; here the point is that the option reaches every attention of a
module/model and changes nothing but placement.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AxisType
from oracle import dilated as dilated_oracle
from ring_oracle import assert_matches
from ring_oracle import block_sparse as block_sparse_oracle
from tolerance import FP32, assert_scaled_close, assert_trees_close

import dilax
from dilax import patterns
from dilax.models import LongNetLM
from dilax.nn import (
    BlockSparseAttention,
    BlockSparseMultiheadAttention,
    DilatedAttention,
    MultiheadDilatedAttention,
)

# fp32 (tests/tolerance.py), the depth of the model: the ring merges the same partial softmax
# results in another order than one device.


def _mesh(P=4, names=("sp",)):
    return jax.make_mesh((P,), names, axis_types=(AxisType.Auto,), devices=jax.devices()[:P])


def _outs_and_grads(one, ring, x, loss):
    """Outputs and parameter gradients of ``loss`` for both modules, from ONE jitted program
    (the two parameter trees are independent, so the summed loss gives each its own)."""
    (g1, p1), (gr, pr) = nnx.split(one, nnx.Param), nnx.split(ring, nnx.Param)

    def f(p1, pr):
        out_1, out_r = nnx.merge(g1, p1)(x), nnx.merge(gr, pr)(x)
        return loss(out_1) + loss(out_r), (out_1, out_r)

    (_, (out_1, out_r)), (grads_1, grads_r) = jax.jit(
        jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(p1, pr)
    return out_1, grads_1, out_r, grads_r


def test_longnet_lm_sequence_parallel_equals_one_device():
    """Decoder-only LM, causal: its attention runs as a ring, same logits and gradients.

    One layer is compiled (each layer is the same code, unrolled by a Python loop, so a second
    one would only double the compile); that the option reaches every layer's attention is
    checked on a two-layer model built abstractly (nnx.eval_shape: nothing runs). Two shards
    of 32 positions: branch (16, 1) stays within a shard, branch (64, 2) crosses them (the
    ring's hops over 4 and 8 devices run in the other tests here and in test_ring.py)."""
    sp = dilax.SequenceParallel(_mesh(2))
    cfg = dict(num_tokens=17, d_model=32, num_heads=4, num_encoder_layers=0,
               num_decoder_layers=1, dim_feedforward=64, segment_lengths=(16, 64),
               dilation_rates=(1, 2))
    two = nnx.eval_shape(lambda: LongNetLM(**(cfg | dict(num_decoder_layers=2)),
                                           sequence_parallel=sp, rngs=nnx.Rngs(0)))
    attns = [m for _, m in nnx.iter_graph(two) if isinstance(m, DilatedAttention)]
    assert len(attns) == 2 and all(a.sequence_parallel == sp for a in attns)
    one = LongNetLM(**cfg, implementation="reference", rngs=nnx.Rngs(0))  # dense mask oracle
    ring = LongNetLM(**cfg, sequence_parallel=sp, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.PRNGKey(3), (1, 64), 0, 17)
    targets = jnp.roll(tokens, -1, axis=1)

    def loss(logits):
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    logits_1, grads_1, logits_r, grads_r = _outs_and_grads(one, ring, tokens, loss)
    assert_scaled_close(logits_r, logits_1)
    assert_trees_close(grads_r, grads_1)


def test_factory_ring_multihead_and_batch_axis():
    """A mesh: create_attention builds the multi-head module (GQA) on the ring; same output
    and parameter gradients as the module on one device (both in one program). Then a batch
    axis: DilatedAttention with the batch over "dp" and the sequence over "sp"."""
    sp = dilax.SequenceParallel(_mesh())
    cfg = dict(segment_lengths=(8, 64), dilation_rates=(1, 4), num_kv_heads=2)
    attn = dilax.create_attention(**cfg, sequence_parallel=sp, embed_dim=32, num_heads=4,
                                  rngs=nnx.Rngs(0))
    assert attn.choice.kind == "ring" and attn.choice.multihead
    assert isinstance(attn.inner, MultiheadDilatedAttention)
    ring_attns = [m for _, m in nnx.iter_graph(attn) if isinstance(m, DilatedAttention)]
    assert ring_attns and all(a.sequence_parallel == sp for a in ring_attns)
    # one device: the dense mask-based reference attention (quick to compile, independent)
    one = MultiheadDilatedAttention(32, 4, **cfg, implementation="reference", rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 64, 32))
    g = jax.random.normal(jax.random.PRNGKey(2), (2, 64, 32))
    out_1, grads_1, out_r, grads_r = _outs_and_grads(one, attn, x, lambda y: jnp.vdot(y, g))
    assert_scaled_close(out_r, out_1)
    assert_trees_close(grads_r["inner"], grads_1)  # the factory wraps the module
    mesh2d = jax.make_mesh((2, 4), ("dp", "sp"), axis_types=(AxisType.Auto,) * 2)
    # batch over "dp", sequence over "sp"
    both = DilatedAttention((8, 32), (1, 2), is_causal=True,
                            sequence_parallel=dilax.SequenceParallel(mesh2d, "sp", "dp"))
    q = jax.random.normal(jax.random.PRNGKey(5), (2, 32, 4, 8))
    kv = jax.random.normal(jax.random.PRNGKey(6), (2, 32, 2, 8))
    ref = dilated_oracle(q, kv, kv, (8, 32), (1, 2), "mixture", True).out  # NumPy: no compile
    assert_scaled_close(nnx.jit(lambda m, q, kv: m(q, kv, kv))(both, q, kv), ref)


def test_factory_block_sparse_ring_multihead_equals_one_device():
    """A pattern and a mesh: create_attention builds the block-sparse multi-head module on the
    block-sparse ring (4 devices, 32 positions each); same output and parameter gradients.

    No projection biases: the gradient of k_proj's bias is exactly 0 (softmax ignores a
    constant added to all logits of a query), so its computed value is rounding noise of a
    sum over all b * n positions (~1e-5 here, next to gradients of ~100) and has no magnitude
    of its own to scale a tolerance with."""
    mesh = _mesh()
    pattern = patterns.local_window(128, 16, 40) | patterns.global_local(128, 16, 16, 0)
    attn = dilax.create_attention(pattern=pattern, sequence_parallel=dilax.SequenceParallel(mesh),
                                  embed_dim=32, num_heads=4, num_kv_heads=2, use_bias=False,
                                  rngs=nnx.Rngs(0))
    assert attn.choice.kind == "ring" and "block-sparse ring" in attn.choice.reason
    assert isinstance(attn.inner, BlockSparseMultiheadAttention)
    assert attn.inner.sequence_parallel == dilax.SequenceParallel(mesh)
    one = BlockSparseMultiheadAttention(32, 4, pattern, num_kv_heads=2, use_bias=False,
                                        rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(7), (2, 128, 32))
    g = jax.random.normal(jax.random.PRNGKey(8), (2, 128, 32))
    loss = lambda y: jnp.vdot(y, g)
    out_1, grads_1, out_r, grads_r = _outs_and_grads(one, attn, x, loss)
    assert_scaled_close(out_r, out_1, FP32)
    assert_trees_close(grads_r["inner"], grads_1)  # the factory wraps the module


def test_block_sparse_module_ring_batch_axis_forward_and_gradient():
    """BlockSparseAttention(sequence_parallel=...) on a 2 x 4 mesh (batch over "dp"), causal,
    per-head pattern, GQA: output and q/k/v gradients equal the float64 oracle of the
    pattern's token mask (NumPy: the ring is the only compiled program)."""
    mesh2d = jax.make_mesh((2, 4), ("dp", "sp"), axis_types=(AxisType.Auto,) * 2)
    pattern = patterns.random(128, 8, 0.4, seed=2, num_heads=4)
    attn = BlockSparseAttention(pattern, is_causal=True,
                                sequence_parallel=dilax.SequenceParallel(mesh2d, "sp", "dp"))
    ks = jax.random.split(jax.random.PRNGKey(9), 4)
    q = jax.random.normal(ks[0], (2, 128, 4, 8))
    k = jax.random.normal(ks[1], (2, 128, 2, 8))
    v = jax.random.normal(ks[2], (2, 128, 2, 8))
    g = jax.random.normal(ks[3], (2, 128, 4, 8))

    def run(q, k, v):
        out, vjp = jax.vjp(attn, q, k, v)
        return out, vjp(g)

    out, grads = jax.jit(run)(q, k, v)
    assert_matches(out, grads, block_sparse_oracle(q, k, v, g, pattern, True))


@pytest.mark.parametrize("make, exc, fragment", [
    (lambda: dilax.SequenceParallel("mesh"), TypeError, "mesh must be a jax.sharding.Mesh"),
    (lambda: dilax.SequenceParallel(_mesh(), seq_axis="x"), ValueError,
     "seq_axis='x' is not an axis of the mesh"),
    (lambda: dilax.SequenceParallel(_mesh(), batch_axis="sp"), ValueError,
     "seq_axis and batch_axis must differ"),
    (lambda: dilax.SequenceParallel(_mesh(), layout="spiral"), ValueError, "layout must be one"),
    (lambda: DilatedAttention((8,), (1,), implementation="cudnn",
                              sequence_parallel=dilax.SequenceParallel(_mesh())),
     ValueError, "implementation must be None or 'xla' or 'pallas'"),
    (lambda: DilatedAttention((8,), (1,), sequence_parallel=_mesh()), TypeError,
     "sequence_parallel must be a dilax.SequenceParallel"),
    (lambda: BlockSparseAttention(patterns.local_window(64, 8, 8), sequence_parallel=(
        dilax.SequenceParallel(_mesh(), layout="zigzag"))), ValueError,
     "sequence_parallel.layout must be one of ('contiguous',)"),
    (lambda: BlockSparseAttention(patterns.local_window(64, 8, 8), implementation="reference",
                                  sequence_parallel=dilax.SequenceParallel(_mesh())),
     ValueError, "implementation must be None or 'xla', got 'reference'"),
    (lambda: BlockSparseMultiheadAttention(16, 2, patterns.local_window(64, 8, 8),
                                           sequence_parallel=_mesh(), rngs=nnx.Rngs(0)),
     TypeError, "sequence_parallel must be a dilax.SequenceParallel"),
])
def test_sequence_parallel_errors(make, exc, fragment):
    with pytest.raises(exc, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        make()
