"""Ring (sequence-parallel) block-sparse attention equals the float64 oracle of the
pattern's token mask with valid lengths (``tests/ring_oracle.py``), forward and gradients,
on 8 CPU devices (4 on the sequence axis of the 2 x 4 mesh): through the alias, the public
op with ``sequence_parallel=`` and the per-device op inside a user's ``jax.shard_map``
with its default checks (``check_vma=True``).

The 8 host devices need ``XLA_FLAGS`` before jax is imported, so unless this pytest process
already has >= 8 devices the cases run once in a subprocess (this file run as a script) that
reports max errors as JSON; the tests below assert on that report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

if __name__ == "__main__":  # worker: must set the device count before importing jax
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ring_oracle import block_sparse as block_sparse_oracle
from tolerance import FP32

from dilax import SequenceParallel, ring_block_sparse_attention, sharded_block_sparse_attention
from dilax import patterns as P
from dilax.block_sparse.api import block_sparse_attention
from dilax.block_sparse.ring import plan_ring

N, BSZ, D = 128, 8, 8


def _mask_with_empty_rows():
    # Random per head within 3 blocks of the diagonal: device r needs chunks r, r-1, r-2.
    near = P.local_window(N, BSZ, 2 * BSZ + 1).block_mask
    mask = np.array(P.random(N, BSZ, 0.6, seed=7, num_heads=4).block_mask) & near
    mask[2] = False  # empty head
    mask[0, 5] = False  # empty query block
    mask[:, :2, :2] = False  # device 0 has no work at all (not even on its own chunk)
    return P.from_mask(mask, BSZ)


CASES = {
    # name: (pattern, h, hk, causal, mesh shape, batch, entry, valid lengths (q, kv) or None)
    "local_window_gqa": (P.local_window(N, BSZ, 10), 4, 2, False, (8,), 2, "alias", None),
    "per_head_empty_rows_causal": (_mask_with_empty_rows(), 4, 2, True, (8,), 2,
                                   "user_shard_map", ([128, 45], [101, 70])),
    "dilated_global_mha_batch_sharded": (
        P.dilated(N, BSZ, (5,)) | P.global_local(N, BSZ, 8, 0), 2, 2, True, (2, 4), 2,
        "sequence_parallel", ([77, 128], [128, 30])),
}


def _ring(entry, pattern, mesh, batch_axis, causal):
    """The ring through ``entry``: ``fn(q, k, v, q_len, kv_len)``."""
    if entry == "alias":
        return lambda q, k, v, ql, kl: sharded_block_sparse_attention(
            q, k, v, pattern, mesh=mesh, seq_axis="sp", batch_axis=batch_axis, is_causal=causal,
            query_seq_lengths=ql, key_value_seq_lengths=kl)
    if entry == "sequence_parallel":
        sp = SequenceParallel(mesh, seq_axis="sp", batch_axis=batch_axis)
        return lambda q, k, v, ql, kl: block_sparse_attention(
            q, k, v, pattern, is_causal=causal, query_seq_lengths=ql, key_value_seq_lengths=kl,
            sequence_parallel=sp)
    spec = jax.sharding.PartitionSpec(None, "sp")  # a user's shard_map, default checks
    return jax.shard_map(
        lambda q, k, v, ql, kl: ring_block_sparse_attention(
            q, k, v, pattern, axis_name="sp", is_causal=causal, query_seq_lengths=ql,
            key_value_seq_lengths=kl),
        mesh=mesh, in_specs=(spec,) * 3 + (jax.sharding.PartitionSpec(),) * 2, out_specs=spec)


def _run_case(name):
    pattern, h, hk, causal, mesh_shape, b, entry, lengths = CASES[name]
    auto = (jax.sharding.AxisType.Auto,) * len(mesh_shape)
    if len(mesh_shape) == 1:
        mesh = jax.make_mesh(mesh_shape, ("sp",), axis_types=auto)
        batch_axis = None
    else:
        mesh = jax.make_mesh(mesh_shape, ("dp", "sp"), axis_types=auto)
        batch_axis = "dp"
    ks = jax.random.split(jax.random.PRNGKey(len(name)), 4)
    q = jax.random.normal(ks[0], (b, N, h, D))
    k = jax.random.normal(ks[1], (b, N, hk, D))
    v = jax.random.normal(ks[2], (b, N, hk, D))
    cot = jax.random.normal(ks[3], (b, N, h, D))
    ql, kl = (None, None) if lengths is None else (jnp.asarray(x, jnp.int32) for x in lengths)

    @jax.jit
    def ring(q, k, v, cot, ql, kl):
        fn = _ring(entry, pattern, mesh, batch_axis, causal)
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, ql, kl), q, k, v)
        return (out, *vjp(cot))

    # The float64 oracle of the pattern's token mask and the valid lengths (NumPy, nothing to
    # compile): the only compiled program is the ring's.
    ref = block_sparse_oracle(q, k, v, cot, pattern, causal, *(
        (None, None) if lengths is None else (np.asarray(x) for x in lengths)))
    compiled = ring.lower(q, k, v, cot, ql, kl).compile()
    got = compiled(q, k, v, cot, ql, kl)
    errors = {  # max |a - b| in units of max(1, max|b|), as in tests/tolerance.py
        f"{key} vs oracle": float(np.max(np.abs(np.asarray(a, np.float64) - b_))
                                  / max(1.0, float(np.max(np.abs(b_)))))
        for key, a, b_ in zip(("out", "dq", "dk", "dv"), got, (ref.out, ref.dq, ref.dk, ref.dv),
                              strict=True)
    }
    finite = all(bool(jnp.isfinite(x).all()) for x in got)
    nd = mesh.shape["sp"]
    plan = plan_ring(pattern, nd, h, hk, causal)
    hlo = compiled.as_text()
    permutes = hlo.count("collective-permute-start") or hlo.count("collective-permute(")
    # Per stream: hops, and the chunk offsets (i - j) mod P it brings device i (from device j).
    streams = [[st.hops, sorted({(i - j) % nd for row in st.src for i, j in enumerate(row)
                                 if j >= 0})] for st in plan.streams]
    steps = {int((i - j) % nd) for i, j in np.argwhere(plan.needs)}
    steps |= {0} if plan.own_active.any() else set()
    return {"errors": errors, "finite": finite, "streams": streams, "steps": sorted(steps),
            "permutes": permutes, "all_gather": "all-gather" in hlo}


def _worker_errors():
    mesh = jax.make_mesh((8,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
    out = {}
    for key, n in (("n_not_divisible", 100), ("shard_not_block_multiple", 160)):
        x = jnp.zeros((1, n, 2, D))
        try:
            sharded_block_sparse_attention(x, x, x, P.local_window(n, 8, 0), mesh=mesh)
            out[key] = "no error"
        except ValueError as e:
            out[key] = str(e)
    return out


def _report():
    report = {name: _run_case(name) for name in CASES}
    report["errors"] = _worker_errors()
    return report


@pytest.fixture(scope="module")
def report():
    if jax.device_count() >= 8:
        return _report()
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env,
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(CASES))
def test_ring_equals_oracle_forward_and_gradient(report, name):
    case = report[name]
    assert case["finite"]
    for key, err in case["errors"].items():
        assert err <= FP32, (name, key, err)
    assert not case["all_gather"]


def test_ring_skips_steps_and_permutes_only_as_far_as_needed(report):
    lw = report["local_window_gqa"]
    # A local window needs the neighbours only: one step each way (right: the chunk of i - 1,
    # left: of i + 1), not P - 1 = 7 steps.
    assert lw["steps"] == [0, 1, 7] and lw["streams"] == [[1, [1]], [1, [7]]]
    # (k, v) x (right, left): forward, again in the backward ring, and (dk, dv) back to their
    # owners after their one hop; a one-way ring would need 7 hops of each.
    assert 0 < lw["permutes"] <= 3 * 2 * 2, lw["permutes"]
    causal = report["per_head_empty_rows_causal"]
    assert causal["steps"] == [0, 1, 2] and causal["streams"] == [[2, [1, 2]]]
    assert report["dilated_global_mha_batch_sharded"]["streams"] == [[3, [1, 2, 3]]]


def test_ring_errors(report):
    errors = report["errors"]
    assert "divisible by the size 8" in errors["n_not_divisible"]
    assert "(n/P = 20) must be a multiple of the pattern's block_size 8" in errors[
        "shard_not_block_multiple"]


def test_ring_errors_in_process():
    mesh = jax.make_mesh((1,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jnp.zeros((1, 60, 2, D))
    with pytest.raises(ValueError, match="not an axis of the mesh"):
        sharded_block_sparse_attention(x, x, x, P.local_window(60, 8, 0), mesh=mesh,
                                       seq_axis="seq")
    with pytest.raises(ValueError, match="multiple of the pattern's block_size 8"):
        sharded_block_sparse_attention(x, x, x, P.local_window(60, 8, 0), mesh=mesh)


def test_empty_batch_equals_one_device():
    """b = 0 on the ring: the single-device op's empty result (no shard to run)."""
    mesh = jax.make_mesh((4,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:4])
    x = jnp.zeros((0, 64, 2, D))
    pattern = P.local_window(64, 8, 8)
    got = block_sparse_attention(x, x, x, pattern, sequence_parallel=SequenceParallel(mesh))
    np.testing.assert_array_equal(got, block_sparse_attention(x, x, x, pattern))
    assert got.shape == (0, 64, 2, D)


if __name__ == "__main__":
    print(json.dumps(_report()))
