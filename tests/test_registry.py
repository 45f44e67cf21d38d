"""The implementation registry (dilax/registry.py): one contract for every core.

* ``test_every_serving_core_matches_the_oracle``: every implementation the registry says
  serves a case (``xla``, ``pallas`` run by the interpreter, ``reference``; cuDNN compiles for
  CUDA only) runs it, forward and gradients, against the float64 oracle (tests/oracle.py).
  The parametrization is read from the registry, so a core that starts serving a case is
  tested on it without editing this file.
* ``test_unsupported_explicit_request_raises_its_reason``: every explicit implementation the
  registry refuses for a case raises a ``ValueError`` that names the registry's reason (no
  silent fallback to another core).
* the ``implementation=None`` tests: the per-branch choice is reported and is what runs.

One shape for every case (data varies, static configuration rarely), so compiles stay few.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from oracle import attention as oracle_attention
from tolerance import FP32, assert_scaled_close

import dilax
from dilax import patterns, registry
from dilax.branch.plan import dilated_branches, window_plan
from dilax.core import PallasCore, XlaCore
from dilax.nn import DilatedAttention
from dilax.reference import dilated_counts

B, N, H, HK, D = 2, 16, 4, 2, 8
WS, RS = (4, 8), (1, 2)
WINDOW = 2
BLOCK = 4
Q_LEN = np.array([16, 11])
KV_LEN = np.array([13, 16])
KEY_VALID = np.array([[True] * 16, [True, False] * 8])


@dataclasses.dataclass(frozen=True)
class Case:
    """One op configuration; ``requests`` are the core calls it makes (per branch)."""

    name: str
    op: str  # "dilated" or "block_sparse"
    causal: bool = False
    lengths: bool = False
    window: int | None = None
    key_padding: bool = False

    def requests(self, **kw) -> list[registry.CoreRequest]:
        common = dict(dtype="float32", head_dim=D, is_causal=self.causal,
                      has_lengths=self.lengths, has_key_padding=self.key_padding, **kw)
        if self.op == "block_sparse":
            return [registry.CoreRequest("block_sparse", **common)]
        out = [registry.CoreRequest("dilated_branch", **common)]
        if self.window is not None:
            out.append(registry.CoreRequest("window", **common))
        return out

    def allowed(self) -> tuple[str, ...]:
        return registry.offered("block_sparse") if self.op == "block_sparse" else \
            registry.IMPLEMENTATIONS

    def serving(self) -> tuple[str, ...]:
        """What runs here: the CPU with the Pallas interpreter."""
        served = [set(registry.served_by(r)) for r in self.requests(platform="cpu",
                                                                   interpret=True)]
        return tuple(i for i in self.allowed() if all(i in s for s in served))

    def refused(self) -> list[tuple[str, str]]:
        """``(implementation, reason)`` an explicit request raises with (the compile
        platform is checked at lowering, so it is not part of the request here)."""
        out = []
        for impl in self.allowed():
            reasons = [registry.supports(impl, r) for r in self.requests(interpret=True)]
            reasons = [r for r in reasons if r is not None]
            if reasons:
                out.append((impl, reasons[0]))
        return out

    def call(self, impl: str | None):
        kw = dict(is_causal=self.causal, implementation=impl, interpret=True)

        def fn(q, k, v, q_len, kv_len, key_valid):
            lengths = dict(query_seq_lengths=q_len, key_value_seq_lengths=kv_len) \
                if self.lengths else {}
            if self.op == "block_sparse":
                return dilax.block_sparse_attention(q, k, v, PATTERN, **kw, **lengths)
            extra = dict(local_window=self.window)
            if self.key_padding:
                extra["key_padding_mask"] = key_valid
            return dilax.dilated_attention(q, k, v, WS, RS, **kw, **lengths, **extra)

        return fn

    def weights(self) -> np.ndarray:
        """The oracle's count matrix ``(b, h, n, n)`` (SPEC: branch counts, or the pattern,
        times the validity of each (query, key) pair)."""
        if self.op == "block_sparse":
            c = PATTERN.expanded_mask(N, self.causal).astype(np.float64)
        else:
            c = np.asarray(dilated_counts(N, H, WS, RS, "mixture", self.causal, self.window),
                           np.float64)
        c = np.broadcast_to(c, (B, H, N, N)).copy()
        pos = np.arange(N)
        if self.lengths:
            c *= (pos[None, :, None] < Q_LEN[:, None, None])[:, None]
            c *= (pos[None, None, :] < KV_LEN[:, None, None])[:, None]
        if self.key_padding:
            c *= KEY_VALID[:, None, None, :]
        return c


PATTERN = patterns.from_mask(np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0],
                                       [1, 0, 1, 1]], bool), BLOCK)
# (Causal with lengths alone is no case of its own: the case with the window runs the dilated
# branches causal with lengths too, plus key padding and the window branch; the kernels'
# lengths-only variant runs in tests/test_lengths.py, test_lengths_and_window_match_reference.)
CASES = [
    Case("dilated", "dilated"),
    Case("dilated-window-lengths-key-padding", "dilated", causal=True, lengths=True,
         window=WINDOW, key_padding=True),
    Case("block-sparse-causal", "block_sparse", causal=True),
    Case("block-sparse-lengths", "block_sparse", lengths=True),
]
SERVED = [(c, impl) for c in CASES for impl in c.serving()]
REFUSED = [(c, impl, why) for c in CASES for impl, why in c.refused()]


def _inputs(seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    return (jax.random.normal(ks[0], (B, N, H, D)), jax.random.normal(ks[1], (B, N, HK, D)),
            jax.random.normal(ks[2], (B, N, HK, D)), jax.random.normal(ks[3], (B, N, H, D)))


def _aux():
    return jnp.asarray(Q_LEN), jnp.asarray(KV_LEN), jnp.asarray(KEY_VALID)


def test_the_cases_cover_every_core_and_a_refusal_of_each_kernel():
    ran = {impl for _, impl in SERVED}
    assert ran == {"reference", "xla", "pallas"}  # cuDNN: CUDA targets only (make gpu-check)
    # the kernels now serve every case here (bands, key padding, lengths); their refusals
    # are in the explicit-request tests below and tests/test_documents.py (segment_ids)
    assert {impl for _, impl, _ in REFUSED} == {"cudnn"}


@pytest.mark.parametrize("case,impl", SERVED, ids=[f"{c.name}-{i}" for c, i in SERVED])
def test_every_serving_core_matches_the_oracle(case, impl):
    q, k, v, cot = _inputs()
    fn = case.call(impl)

    @jax.jit
    def run(q, k, v, cot, *aux):
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, *aux), q, k, v)
        return out, vjp(cot)

    out, grads = run(q, k, v, cot, *_aux())
    ref = oracle_attention(q, k, v, case.weights(), 1 / np.sqrt(D), cot)
    assert_scaled_close(out, ref.out, FP32, err_msg="out")
    for name, got, want in zip(("dq", "dk", "dv"), grads, (ref.dq, ref.dk, ref.dv)):
        assert_scaled_close(got, want, FP32, depth=4, err_msg=name)  # deeper sums: 4x
    assert all(np.all(np.isfinite(x)) for x in (out, *grads))


@pytest.mark.parametrize("case,impl,why", REFUSED,
                         ids=[f"{c.name}-{i}" for c, i, _ in REFUSED])
def test_unsupported_explicit_request_raises_its_reason(case, impl, why):
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match=re.escape(why)) as info:
        jax.eval_shape(case.call(impl), q, k, v, *_aux())  # refused at trace, nothing runs
    assert f"implementation={impl!r}" in str(info.value)


def test_decode_and_rings_raise_for_kernels_the_registry_does_not_list():
    q = jnp.zeros((1, 1, H, D))
    kv = jnp.zeros((1, 1, HK, D))
    cache = dilax.KVCache.init(1, N, HK, D)
    # the Pallas decode kernel reads cache rows whole: head_dim 8 is not one it serves
    why = registry.supports("pallas", registry.CoreRequest("decode", head_dim=D))
    with pytest.raises(ValueError, match=re.escape(why)):
        dilax.dilated_attention_decode(q, kv, kv, cache, WS, RS, implementation="pallas")
    mesh = jax.make_mesh((1,), ("sp",), axis_types=(AxisType.Auto,))
    why = registry.supports("cudnn", registry.CoreRequest("ring_hop"))
    with pytest.raises(ValueError, match=re.escape(why)):
        DilatedAttention(WS, RS, implementation="cudnn",
                                  sequence_parallel=dilax.SequenceParallel(mesh))
    with pytest.raises(ValueError, match=re.escape(why)):
        dilax.create_attention("ring", segment_lengths=WS, dilation_rates=RS,
                               sequence_parallel=dilax.SequenceParallel(mesh),
                               implementation="cudnn")
    # the block-sparse ring's hops: the block-sparse kernel's rules (block size >= 16 on GPU)
    why = registry.supports("pallas", registry.CoreRequest("ring_hop", block_size=4))
    with pytest.raises(ValueError, match=re.escape(why)):
        dilax.create_attention("ring", pattern=patterns.local_window(N, 4, BLOCK),
                               sequence_parallel=dilax.SequenceParallel(mesh),
                               implementation="pallas")
    assert registry.served_by(registry.CoreRequest("decode")) == ("xla", "pallas")
    # the dilated ring's hops: the flash kernel with the hop's offsets (tests/test_ring_pallas)
    assert registry.served_by(registry.CoreRequest("ring_hop")) == ("xla", "pallas")
    assert "offsets" in registry.supports("cudnn", registry.CoreRequest("ring_hop"))


def test_none_chooses_per_branch_and_create_attention_reports_it():
    plans = (*dilated_branches(N, H, HK, WS, RS, "mixture"), window_plan(N, H, HK, WINDOW))
    kw = dict(dtype=jnp.float32, head_dim=D, is_causal=True)
    # GPU: the kernels for every branch, the band, key padding and lengths included (#29)
    cores = registry.branch_cores(registry.Auto(False, "gpu"), plans, **kw, key_padding=True,
                                  lengths=True)
    assert [type(c) for c in cores] == [PallasCore, PallasCore, PallasCore]
    # CPU: the interpreter only when asked for (interpret=True), as before the registry
    assert all(c.name == "xla" for c in registry.branch_cores(registry.Auto(False, "cpu"),
                                                              plans, **kw))
    cores = registry.branch_cores(registry.Auto(True, "cpu"), plans, **kw, key_padding=True)
    assert all(c.name == "pallas" for c in cores)
    # requests that differ get their own core each, with the reason
    cores, why = registry.choose_branch_cores(None, [
        registry.CoreRequest("dilated_branch", platform="gpu"),
        registry.CoreRequest("window", platform="cpu")])
    assert [type(c) for c in cores] == [PallasCore, XlaCore] and "GPU targets" in why[1]
    attn = dilax.create_attention(segment_lengths=WS, dilation_rates=RS, local_window=WINDOW,
                                  backend="gpu")
    assert attn.choice.implementation == "pallas"
    assert [(b, i) for b, i, _ in attn.choice.branches] == [
        ("dilated branches", "pallas"), ("local-window branch", "pallas")]
    assert "local-window branch: 'pallas'" in str(attn.choice)
    cpu = dilax.create_attention(segment_lengths=WS, dilation_rates=RS, local_window=WINDOW)
    assert cpu.choice.implementation == "xla" and cpu.inner.implementation == "xla"


def test_issue_25_pallas_with_window_and_lengths_runs_wholly_on_the_kernels():
    """The measured case of issues 25/29: implementation='pallas' + local_window + lengths
    ran the window branch on the XLA loops. Now every branch is a kernel call (the values:
    the contract test above, case dilated-window-lengths-key-padding)."""
    q, k, v, _ = _inputs()
    q_len, kv_len, key_valid = _aux()
    kw = dict(is_causal=True, local_window=WINDOW, query_seq_lengths=q_len,
              key_value_seq_lengths=kv_len, key_padding_mask=key_valid, interpret=True)
    for impl in ("pallas", None):
        loss = lambda q, k, v: dilax.dilated_attention(  # noqa: E731
            q, k, v, WS, RS, implementation=impl, **kw).sum()  # noqa: B023
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
        # forward, dq and dk/dv kernels per branch (2 dilated + the window), no XLA matmul
        assert _outside_kernels(jaxpr.jaxpr) == {"pallas_call": 9}


def _outside_kernels(jaxpr, counts=None) -> dict[str, int]:
    """Kernel calls and matmuls of a jaxpr, sub-jaxprs included, kernels' bodies not."""
    counts = {} if counts is None else counts
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("pallas_call", "dot_general"):
            counts[eqn.primitive.name] = counts.get(eqn.primitive.name, 0) + 1
            continue
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            _outside_kernels(sub, counts)
    return counts
