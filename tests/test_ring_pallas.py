"""The dilated ring on the Pallas flash kernels: ``dilated_attention(...,
implementation="pallas", interpret=True, sequence_parallel=...)`` on 4 host devices against the
float64 oracle, forward and dq/dk/dv (SPEC.md, "Ring"), the local window included.

Every core call of these programs is a kernel: the local branches, the ring hops (traced
query/key offsets, the ring's key bounds as ``kv_len``, rows of another segment masked by
``lse = +inf`` in the backward), the halo exchange's calls and the local window (its band
and neighbour rows). The traced program is checked for that (``pallas_call`` present, no
``dot_general`` outside the kernels) before it is compiled. The Pallas interpreter makes
these programs slow to compile: two tiny ones.

The full-attention program runs in the strict interpreter (:data:`STRICT`, out-of-bounds
reads raise; :func:`_strict_cores` swaps it in for dilax's ``interpret=True``). The causal one
cannot: inside ``shard_map`` the strict (TPU) interpreter models one multi-device kernel
launch, with a ``threading.Barrier`` over all devices of the mesh axes at the start and end
of every ``pallas_call``, so every device must run the same kernel calls; the causal ring
skips hops per device (``lax.cond`` on the hop's predicate, :mod:`dilax.sp.ring_vjp`), and
the devices that ran a kernel wait in its barrier while the others wait in the next
``ppermute``: XLA aborts with "Termination timeout for `collective permute RendezvousKey...`
of 40 seconds exceeded ... Expected 4 threads to join the rendezvous, but only 2 of them
arrived on time". Without causality, in the geometry below, every device runs the same hops
(the skipped segment candidate is skipped on all of them), so the barriers pair up.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as Ps
from ring_oracle import assert_matches
from ring_oracle import dilated as dilated_oracle
from test_pallas import STRICT
from test_ring import _FAST
from test_ring import _inputs as ring_inputs

import dilax
from dilax import AttentionMask, DilatedSettings, registry
from dilax.core import PallasCore
from dilax.dilated.ring import ring_cores

P, N = 4, 64  # n/P = 16 positions per device


@pytest.fixture(autouse=True, scope="module")
def _four_devices():
    assert jax.device_count() >= P, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"


@pytest.fixture
def _strict_cores(monkeypatch):
    """The Pallas cores dilax builds for ``interpret=True`` run in :data:`STRICT` (dilax's
    ``interpret`` is a bool); asserts that the program under test built them."""
    built, core_for = [], dilax.core.core_for

    def strict(name, *, interpret=False):
        if name != "pallas" or not interpret:
            return core_for(name, interpret=interpret)
        built.append(name)
        return PallasCore(interpret=STRICT)

    monkeypatch.setattr(dilax.core, "core_for", strict)
    yield
    assert built


def _sp(layout="contiguous"):
    mesh = jax.make_mesh((P,), ("sp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:P])
    return dilax.SequenceParallel(mesh, seq_axis="sp", layout=layout)


def _calls(jaxpr) -> tuple[int, int]:
    """``(pallas_call, dot_general outside the kernels)`` in ``jaxpr`` and its sub-jaxprs
    (loop bodies, cond branches, custom_vjp calls)."""
    kernels = dots = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            kernels += 1
            continue
        dots += eqn.primitive.name == "dot_general"
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
                if hasattr(sub, "eqns"):
                    k, d = _calls(sub)
                    kernels, dots = kernels + k, dots + d
    return kernels, dots


def _value_and_grads(fn, *args, kernels_only=False):
    """``fn(q, k, v, *rest)`` and the gradients of ``sum(out * g)`` w.r.t. q, k, v, one
    compiled program; ``kernels_only``: assert first that every attention is a kernel."""

    def run(q, k, v, g, *rest):
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, *rest), q, k, v)
        return out, vjp(g)

    traced = jax.jit(run).trace(*args)
    if kernels_only:
        kernels, dots = _calls(traced.jaxpr.jaxpr)
        assert kernels > 0 and dots == 0, (kernels, dots)
    return traced.lower().compile(compiler_options=_FAST)(*args)


def _check(ws, rs, is_causal, q_len=None, kv_len=None, window=None, heads=(4, 2), seed=0):
    b = 1 if q_len is None else len(q_len)
    q, k, v, g = ring_inputs(b, N, *heads, 8, seed=seed)  # (query heads, kv heads)
    sp = _sp()
    ring = lambda q, k, v, *lengths: dilax.dilated_attention(  # noqa: E731
        q, k, v, ws, rs, is_causal=is_causal, local_window=window, implementation="pallas",
        interpret=True, sequence_parallel=sp,
        **dict(zip(("query_seq_lengths", "key_value_seq_lengths"), lengths)))
    lengths = () if q_len is None else (q_len, kv_len)
    out, grads = _value_and_grads(ring, q, k, v, g, *lengths, kernels_only=True)
    assert_matches(out, grads, dilated_oracle(q, k, v, g, ws, rs, is_causal, q_len, kv_len,
                                              window))
    return out


def test_causal_with_lengths_and_window():
    """Causal, valid lengths; on n/P = 16: w = 8 is local, w = 12 a halo branch and w = 24
    (r = 2) a ring branch with two segment candidates per chunk (its backward reads the
    queries in place), and the local window W = 5 (each chunk gets 5 rows from its left
    neighbour)."""
    q_len, kv_len = np.array([64, 41], np.int32), np.array([50, 64], np.int32)
    out = _check((8, 12, 24), (1, 1, 2), True, q_len, kv_len, window=5, seed=3)
    assert np.all(np.asarray(out)[1, 41:] == 0)  # rows past the query length


def test_full_attention_and_window_strict(_strict_cores):
    """Not causal (the ring runs both ways): w = 32 (r = 2) a ring branch with one segment
    per chunk and the local window W = 3 (rows from both sides), in the strict interpreter.
    It pays per kernel call and program, so the local and halo branches are in the causal
    program, and 2 query heads share one kv head (GQA 4/2 there)."""
    _check((32,), (2,), False, window=3, heads=(2, 1), seed=4)


def test_cores_follow_the_registry_and_kernels_refuse_check_vma(monkeypatch):
    """``implementation=None``: XLA on CPU (the default programs), the kernels with
    ``interpret=True`` and on GPU, the local window included (the flash kernels take the
    band). Inside a user's ``shard_map`` with ``check_vma=True`` the kernels raise (their
    outputs carry no device-varying type)."""
    settings = DilatedSettings((8, 32), (1, 2), local_window=4)
    names = lambda s: tuple(c.name for c in ring_cores(s, AttentionMask(), "float32", 8))  # noqa: E731
    assert names(settings) == ("xla", "xla", "xla")
    assert names(dataclasses.replace(settings, interpret=True)) == ("pallas",) * 3
    assert names(dataclasses.replace(settings, implementation="pallas")) == ("pallas",) * 3
    monkeypatch.setattr(registry, "current_platform", lambda: "gpu")
    assert names(settings) == ("pallas",) * 3
    q, k, v, _ = ring_inputs(1, N, 4, 2, 8)
    pallas = dataclasses.replace(settings, local_window=None, implementation="pallas",
                                 interpret=True)
    fn = jax.shard_map(functools.partial(dilax.ring_dilated_attention, axis_name="sp",
                                         settings=pallas),
                       mesh=_sp().mesh, in_specs=(Ps(None, "sp"),) * 3, out_specs=Ps(None, "sp"))
    with pytest.raises(ValueError, match=r"check_vma=False"):
        jax.eval_shape(fn, q, k, v)
