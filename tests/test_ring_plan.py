"""The ring plan (benchmarks.ring_plan): its schedule counts and memory model against one
tiny compiled program, and its closed forms at n = 2^30."""

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from benchmarks import ring_plan as RP
from benchmarks.ring_plan_validate import live_peak
from dilax import sharded_dilated_attention
from tools.gpu.hlo import collective_permute_bytes


def test_plan_at_one_billion_tokens_closed_form():
    """LongNet branches at n = 2^30 on P = 1024: branch (w, r) spans w / m devices of one
    causal group ring (w/m - 1 hops), each hop sends K and V of R = m / r rows."""
    n, P = 2**30, 1024
    ws, rs = RP.longnet_config(n)
    cfg = RP.Config(n, P, ws, rs, s=2)
    m = n // P
    brs = RP.branches(cfg)
    assert [br.kind for br in brs] == ["ring"] * 10 + ["local"] * 10
    for br in brs[:10]:
        assert br.hops == (br.w // m - 1,)
        assert RP.sent_forward(cfg, br) == (br.w // m - 1) * 2 * (m // br.r) * 8 * 64 * 2
    comm = RP.communication(cfg, False)
    assert comm["hops"] == sum(2**i - 1 for i in range(1, 11))
    mem = RP.memory(cfg, True)
    assert mem["live"] == sum(mem["terms"].values())


def test_model_matches_compiled_tiny(tmp_path):
    """One training step (forward and backward in one program) with a local and a looped
    ring branch on P = 4 devices: bytes sent exactly (the ring's K/V, then K/V and dK/dV);
    the model's live bytes within 10 % of the compiled program's (XLA's
    buffer assignment), its total (with the packing allowance) within 15 % of
    memory_analysis."""
    P, n = 4, 1536
    ws, rs = (128, 1536), (1, 4)
    cfg = RP.Config(n, P, ws, rs)
    assert [br.kind for br in RP.branches(cfg)] == ["ring", "local"]
    assert [br.hops for br in RP.branches(cfg) if br.kind == "ring"] == [(3,)]
    mesh = jax.make_mesh((P,), ("sp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:P])
    sh = NamedSharding(mesh, PartitionSpec(None, "sp"))
    f = jax.grad(lambda q, k, v: jnp.sum(sharded_dilated_attention(
        q, k, v, ws, rs, mesh=mesh, is_causal=True)), argnums=(0, 1, 2))
    spec = [jax.ShapeDtypeStruct((1, n, x, 64), jnp.float32, sharding=sh) for x in (8, 2, 2)]
    compiled = jax.jit(f, in_shardings=(sh,) * 3).lower(*spec).compile(compiler_options=dict(
        xla_dump_to=str(tmp_path), xla_dump_hlo_as_text=True, xla_dump_hlo_pass_re="NONE"))
    ma = compiled.memory_analysis()
    got = (ma.temp_size_in_bytes + ma.argument_size_in_bytes + ma.output_size_in_bytes
           - ma.alias_size_in_bytes)
    assert RP.communication(cfg, True)["bytes_sent"] == collective_permute_bytes(
        compiled.as_text())
    model = RP.memory(cfg, True)
    live = live_peak(str(tmp_path))
    assert abs(model["live"] / live - 1) <= 0.10, (model, live)
    assert abs(model["bytes"] / got - 1) <= 0.15, (model, got)


def test_halo_bytes_match_compiled():
    """A halo branch (segments shorter than a shard, not aligned with it): bytes sent by the
    training step (the forward's sends, recomputed, and their transposes)."""
    P, n, ws, rs = 4, 1536, (256,), (2,)
    cfg = RP.Config(n, P, ws, rs)
    assert [br.kind for br in RP.branches(cfg)] == ["halo"]
    mesh = jax.make_mesh((P,), ("sp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:P])
    sh = NamedSharding(mesh, PartitionSpec(None, "sp"))
    f = jax.grad(lambda q, k, v: jnp.sum(sharded_dilated_attention(
        q, k, v, ws, rs, mesh=mesh, is_causal=True)), argnums=(0, 1, 2))
    spec = [jax.ShapeDtypeStruct((1, n, x, 64), jnp.float32, sharding=sh) for x in (8, 2, 2)]
    text = jax.jit(f, in_shardings=(sh,) * 3).lower(*spec).compile().as_text()
    assert RP.communication(cfg, False)["bytes_sent"] * 3 == collective_permute_bytes(text)
    assert RP.communication(cfg, True)["bytes_sent"] == collective_permute_bytes(text)


def test_committed_plan_markdown_is_its_json():
    import json
    import pathlib

    from benchmarks.report import markdown

    results = pathlib.Path(__file__).parent.parent / "benchmarks" / "results"
    result = json.loads((results / "ring-plan.json").read_text())
    assert markdown(result) == (results / "ring-plan.md").read_text()
    assert result["config"]["n"] == 2**30 and len(result["validation"]) == 24
    assert all(v["compiled_sent"] == v["model_sent"] for v in result["validation"])


def test_plan_branches_are_the_ring_ops():
    """The plan's branches are the ops the ring builds (dilax.dilated.ring_branches.branch_op on the
    plans of dilax.branch.plan.dilated_branches): same kind, same streams, same blocks."""
    from dilax.branch.plan import dilated_branches
    from dilax.dilated.ring_branches import branch_op

    for n, P, ws, rs in [(1536, 4, (128, 1536), (1, 4)), (1536, 4, (256,), (2,)),
                         (4096, 8, (256, 1024, 4096), (1, 4, 16))]:
        for causal in (True, False):
            cfg = RP.Config(n, P, ws, rs, causal=causal)
            got = {}
            for plan in dilated_branches(n, cfg.h, cfg.hk, ws, rs, "mixture"):
                op = branch_op(plan, P, 1, cfg.m, cfg.h, cfg.hk, "sp", 1.0, causal, None)
                ring = getattr(op, "ring", "local")
                kind = ring if ring in ("local", None) else "ring"
                got[(plan.w, plan.r)] = (
                    {None: "halo"}.get(kind, kind),
                    tuple(s.hops for s in ring.streams) if kind == "ring" else (),
                    ring.block_sizes if kind == "ring" else None)
            for br in RP.branches(cfg):
                assert got[(br.w, br.r)] == (br.kind, br.hops,
                                             br.blocks if br.kind == "ring" else None)
