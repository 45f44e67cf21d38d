"""The block-sparse ring on the Pallas block-sparse kernel: ``block_sparse_attention(...,
implementation="pallas", interpret=True, sequence_parallel=...)`` on 4 host devices against
the float64 oracle, forward and dq/dk/dv (SPEC.md, "Ring"; issue #29).

Every core call of these programs is a kernel: each hop is ONE block-sparse kernel call on the
visiting chunk with that hop's tables (the own chunk's causal diagonal included), forward and
backward. The traced program is checked for that (``pallas_call`` present, no ``dot_general``
outside the kernels) before it is compiled.

Interpreters: the non-causal case runs the STRICT interpreter (``tests/test_pallas.py``
``STRICT``: out-of-bounds reads raise, unwritten memory is NaN). The causal case cannot: that
interpreter (jax's TPU interpret mode) ends every ``pallas_call`` with a
``threading.Barrier`` over all devices of the enclosing ``shard_map``
(``_clean_up_shared_memory``), so a kernel call that only some devices make deadlocks the
program (XLA aborts at the next ``ppermute`` rendezvous). The ring makes exactly such calls:
it skips, with ``lax.cond``, a visiting chunk a device has no block in, and with
``is_causal`` device 0 needs no other chunk at all. The non-causal pattern below is chosen so
that every device needs every chunk (asserted), which keeps the strict interpreter's barrier
met; the causal case runs the plain interpreter (``interpret=True``) on 4 devices.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as Ps
from ring_oracle import assert_matches
from ring_oracle import block_sparse as block_sparse_oracle
from test_pallas import STRICT
from test_ring import _inputs
from test_ring_pallas import _value_and_grads

import dilax
from dilax import patterns, registry
from dilax.block_sparse.ring import hop_core, plan_ring, ring_block_sparse_core
from dilax.block_sparse.ring_plan import hop_request
from dilax.core import PallasCore

P, N, B, D = 4, 64, 8, 8  # n/P = 16 positions per device: 2 pattern blocks


@pytest.fixture(autouse=True, scope="module")
def _four_devices():
    assert jax.device_count() >= P, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"


def _sp(devices=P):
    mesh = jax.make_mesh((devices,), ("sp",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:devices])
    return dilax.SequenceParallel(mesh, seq_axis="sp")


def _check(pattern, fn, q, k, v, g, is_causal, q_len=None, kv_len=None):
    """``fn(q, k, v, *lengths)`` (all kernels, asserted on the traced program) against the
    float64 oracle of the expanded token mask AND the valid lengths."""
    lengths = () if q_len is None else (q_len, kv_len)
    out, grads = _value_and_grads(fn, q, k, v, g, *lengths, kernels_only=True)
    ref = block_sparse_oracle(q, k, v, g, pattern, is_causal, q_len, kv_len)
    assert_matches(out, grads, ref)
    return out


def test_causal_per_head_with_lengths_public_entry():
    """Causal, a per-head pattern (one head empty, one query block empty), GQA and valid
    lengths through the public entry: device 0 has no hop, the others 1-2 (lax.cond skips),
    the own chunks' diagonals are masked inside the kernel."""
    near = patterns.local_window(N, B, 2 * B + 1).block_mask
    mask = np.array(patterns.random(N, B, 0.6, seed=7, num_heads=4).block_mask) & near
    mask[2] = False  # an empty head
    mask[0, 5] = False  # an empty query block
    pattern = patterns.from_mask(mask, B)
    sp = _sp()
    q_len, kv_len = np.array([64, 41], np.int32), np.array([50, 64], np.int32)
    ring = lambda q, k, v, ql, kl: dilax.block_sparse_attention(  # noqa: E731
        q, k, v, pattern, is_causal=True, implementation="pallas", interpret=True,
        query_seq_lengths=ql, key_value_seq_lengths=kl, sequence_parallel=sp)
    q, k, v, g = _inputs(2, N, 4, 2, D, seed=3)
    out = _check(pattern, ring, q, k, v, g, True, q_len, kv_len)
    assert np.all(np.asarray(out)[1, 41:] == 0)  # rows past the query length


def test_full_strict_interpreter():
    """Not causal, a shared pattern every device needs every chunk of (so the strict
    interpreter's barrier is met, see the module docstring), GQA; the ring's core directly,
    since the public ``interpret=`` is a bool. Smaller than the causal case (2 devices, 16
    positions each, 2 query heads on 1 kv head): the strict interpreter's cost grows with the
    kernel calls (own chunk + P - 1 hops, three kernels each) and their grid programs, and the
    hops run the same code as on 4 devices."""
    pattern = patterns.random(N // 2, B, 0.5, seed=1)
    plan = plan_ring(pattern, 2, 2, 1, False)
    assert plan.needs.sum() == 2 and plan.own_active.all()
    core = PallasCore(interpret=STRICT)
    spec = Ps(None, "sp")
    ring = jax.shard_map(
        lambda q, k, v: ring_block_sparse_core(q, k, v, pattern, False, D ** -0.5, "sp",
                                               core=core),
        mesh=_sp(2).mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
    _check(pattern, ring, *_inputs(1, N // 2, 2, 1, D, seed=4), False)


def test_hops_follow_the_registry(monkeypatch):
    """``implementation=None``: XLA on CPU, the kernel with ``interpret`` and on GPU where
    the block-sparse kernel's rules hold (block size >= 16 there); an explicit ``"pallas"``
    it cannot serve raises the registry's reason (the op at the call, a module when it is
    built); the kernel inside a user's ``shard_map``
    with its default checks raises (no device-varying type on its outputs)."""
    q = jax.ShapeDtypeStruct((1, N, 4, D), jnp.float32)
    small, large = patterns.local_window(N, B, B), patterns.local_window(N, 16, 16)
    name = lambda impl, interpret, pat: hop_core(impl, interpret, q, pat, True, False).name  # noqa: E731
    assert (name(None, False, small), name(None, True, small)) == ("xla", "pallas")
    monkeypatch.setattr(registry, "current_platform", lambda: "gpu")
    assert (name(None, False, large), name(None, False, small)) == ("pallas", "xla")
    why = registry.supports("pallas", hop_request(q.dtype, D, True, False, B))
    assert "block_size >= 16" in why
    x = jnp.zeros((1, N, 4, D))
    with pytest.raises(ValueError, match=re.escape(why)):
        dilax.block_sparse_attention(x, x, x, small, implementation="pallas",
                                     sequence_parallel=_sp())
    with pytest.raises(ValueError, match=re.escape(why)):  # a module: at construction
        dilax.nn.BlockSparseAttention(small, implementation="pallas", sequence_parallel=_sp())
    with pytest.raises(ValueError, match="implementation must be None or 'xla' or 'pallas'"):
        dilax.block_sparse_attention(x, x, x, large, implementation="reference",
                                     sequence_parallel=_sp())
    spec = Ps(None, "sp")
    user = jax.shard_map(
        lambda q: dilax.ring_block_sparse_attention(q, q, q, small, axis_name="sp",
                                                    implementation="pallas", interpret=True),
        mesh=_sp().mesh, in_specs=spec, out_specs=spec)
    with pytest.raises(ValueError, match=r"check_vma=False"):
        jax.eval_shape(user, x)
