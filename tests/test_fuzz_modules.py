"""Fuzz of the Flax modules, the factory and the training CLI with malformed input;
machinery and rules in tests/fuzz_common.py."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest
from flax import nnx
from fuzz_common import HUGE_N, Case, _mesh, _sds, check_families
from hypothesis import strategies as st

import dilax
from dilax import patterns
from dilax import train as T
from dilax.models import LongNetLM
from dilax.nn import (
    BlockSparseAttention,
    BlockSparseMultiheadAttention,
    MultiheadDilatedAttention,
)

# ----------------------------------------------------------------------------- modules, factory


def module_cases(draw) -> Case:
    rngs = nnx.Rngs(0)
    pattern = patterns.local_window(16, 4, 4)
    kind = draw(st.sampled_from(
        ["mha_embed", "mha_heads", "mha_kv", "mha_dropout", "mha_gamma", "mha_ws", "mha_call",
         "bsmha_heads", "bsmha_pattern", "bsmha_dropout", "bsmha_call", "bsa_ctor",
         "lm_tokens", "lm_d_model", "lm_call", "lm_ff", "mha_huge"]))
    E, H = 16, 4
    if kind == "mha_embed":
        v = draw(st.sampled_from([0, -16, 18, 16.0, "16"]))
        return Case(f"modules:{kind}", lambda: MultiheadDilatedAttention(
            v, H, (8,), (1,), rngs=rngs), ("embed_dim",))
    if kind == "mha_heads":
        v = draw(st.sampled_from([0, 3, -4, 2.0]))
        return Case(f"modules:{kind}", lambda: MultiheadDilatedAttention(
            E, v, (8,), (1,), rngs=rngs), ("num_heads",))
    if kind == "mha_kv":
        v = draw(st.sampled_from([0, 3, 8, "2"]))
        cls = draw(st.sampled_from([MultiheadDilatedAttention, "bs"]))
        if cls == "bs":
            return Case(f"modules:{kind}", lambda: BlockSparseMultiheadAttention(
                E, H, pattern, num_kv_heads=v, rngs=rngs), ("num_kv_heads",))
        return Case(f"modules:{kind}", lambda: MultiheadDilatedAttention(
            E, H, (8,), (1,), num_kv_heads=v, rngs=rngs), ("num_kv_heads",))
    if kind in ("mha_dropout", "bsmha_dropout"):
        # (None and "x" for MultiheadDilatedAttention: see test_mha_float_options_named)
        v = draw(st.sampled_from([-0.1, 1.0, 2, float("nan")]))
        if kind == "bsmha_dropout":
            return Case(f"modules:{kind}", lambda: BlockSparseMultiheadAttention(
                E, H, pattern, dropout=v, rngs=rngs), ("dropout",))
        return Case(f"modules:{kind}", lambda: MultiheadDilatedAttention(
            E, H, (8,), (1,), dropout=v, rngs=rngs), ("dropout",))
    if kind == "mha_gamma":
        v = draw(st.sampled_from([0.0, -1.0, float("nan")]))
        return Case(f"modules:{kind}", lambda: MultiheadDilatedAttention(
            E, H, (8,), (1,), gamma_init=v, rngs=rngs), ("gamma_init",))
    if kind == "mha_ws":
        ws, rs, mode = draw(st.sampled_from([((8,), (3,), "mixture"), ((8, 4), (1,), "mixture"),
                                             ((4, 8, 16, 32, 64), (1,) * 5, "grouped"),
                                             ((8,), (1,), "both")]))
        def build_and_call():  # grouped h < G is known at the first call
            mod = MultiheadDilatedAttention(E, H, ws, rs, mode=mode, rngs=rngs)
            return jax.eval_shape(lambda x: mod(x), _sds((1, 16, E)))
        return Case(f"modules:{kind}", build_and_call,
            ("segment_lengths", "segment_lengths[0]", "mode", "dilation_rates"))
    if kind in ("mha_call", "bsmha_call", "mha_huge"):
        which = draw(st.sampled_from(["query", "key", "value"]))
        shape = draw(st.sampled_from([(2, 16, E + 1), (16, E), (2, 16, E, 1), (2, 15, E)]))
        if kind == "bsmha_call":
            mod = BlockSparseMultiheadAttention(E, H, pattern, rngs=rngs)
        else:
            mod = MultiheadDilatedAttention(E, H, (8,), (1,), rngs=rngs)
        good = _sds((2, 16, E))
        names: tuple[str, ...] = (which,)
        if kind == "mha_huge":
            which, names = "query", ("q", "seq_len")
            shape = (1, HUGE_N, E)
            good = _sds(shape)
        elif shape == (2, 15, E):
            if which == "query":
                which = "key"
            names = ("key", "value", "q", "k", "v", "seq_len")
        args = {"query": good, "key": good, "value": good, which: _sds(shape)}
        return Case(f"modules:{kind}", lambda: jax.eval_shape(
            lambda a, b, c: mod(a, b, c), args["query"], args["key"], args["value"]), names)
    if kind == "bsmha_heads":
        bad = patterns.random(16, 4, 0.5, num_heads=3)
        return Case(f"modules:{kind}", lambda: BlockSparseMultiheadAttention(
            E, H, bad, rngs=rngs), ("pattern",))
    if kind == "bsmha_pattern":
        v = draw(st.sampled_from([None, "local", np.ones((4, 4), bool)]))
        return Case(f"modules:{kind}", lambda: BlockSparseMultiheadAttention(
            E, H, v, rngs=rngs), ("pattern",))
    if kind == "bsa_ctor":
        which, v = draw(st.sampled_from([("pattern", None), ("implementation", "cudnn"),
                                         ("implementation", 2), ("is_causal", "yes")]))
        args = {"pattern": pattern, which: v}
        return Case(f"modules:{kind}", lambda: BlockSparseAttention(
            args.pop("pattern"), **args), (which,))
    if kind == "lm_tokens":
        v = draw(st.sampled_from([0, -5, 3.5]))
        return Case(f"modules:{kind}", lambda: LongNetLM(v, 16, 2, 0, 1, 32, (8,), (1,),
                                                         rngs=rngs), ("num_tokens",))
    if kind == "lm_d_model":
        v = draw(st.sampled_from([15, 0, 6]))
        return Case(f"modules:{kind}", lambda: LongNetLM(10, v, 4, 0, 1, 32, (8,), (1,),
                                                         rngs=rngs), ("d_model", "embed_dim"))
    if kind == "lm_ff":
        v = draw(st.sampled_from([0, -1]))
        return Case(f"modules:{kind}", lambda: LongNetLM(10, 16, 2, 0, 1, v, (8,), (1,),
                                                         rngs=rngs), ("dim_feedforward",))
    lm = LongNetLM(10, 16, 2, 0, 1, 32, (8,), (1,), rngs=rngs)
    v = draw(st.sampled_from([_sds((2, 16), "float32"), _sds((16,), "int32"),
                              _sds((1, 2, 16), "int32")]))
    return Case(f"modules:{kind}", lambda: jax.eval_shape(lambda t: lm(t), v), ("tokens",))


def factory_cases(draw) -> Case:
    mesh = _mesh()
    pattern = patterns.local_window(16, 4, 4)
    kind = draw(st.sampled_from(
        ["kind", "implementation", "half_config", "both", "nothing", "multihead", "ring_mesh",
         "mesh_type", "sequence_parallel_type", "seq_axis", "mesh_not_ring", "bs_cudnn",
         "bad_kwarg", "bad_ws", "mode", "backend", "bs_ring", "is_causal"]))
    kw: dict[str, Any]
    if kind == "kind":
        kw = dict(kind=draw(st.sampled_from(["dense", None, 3])), segment_lengths=(8,),
                  dilation_rates=(1,))
        names = ("kind",)
    elif kind == "implementation":
        kw = dict(segment_lengths=(8,), dilation_rates=(1,),
                  implementation=draw(st.sampled_from(["gpu", 1])))
        names = ("implementation",)
    elif kind == "half_config":
        kw = draw(st.sampled_from([dict(segment_lengths=(8,)), dict(dilation_rates=(1,))]))
        names = ("segment_lengths", "dilation_rates")
    elif kind == "both":
        kw = dict(segment_lengths=(8,), dilation_rates=(1,), pattern=pattern)
        names = ("pattern", "segment_lengths")
    elif kind == "nothing":
        kw = dict(kind=draw(st.sampled_from(["auto", "dilated", "block_sparse", "ring"])))
        names = ("segment_lengths", "pattern", "mesh")
    elif kind == "multihead":
        kw = dict(segment_lengths=(8,), dilation_rates=(1,), **draw(st.sampled_from(
            [dict(embed_dim=16), dict(num_heads=4), dict(embed_dim=16, num_heads=4)])))
        names = ("embed_dim", "num_heads", "rngs")
    elif kind == "ring_mesh":
        kw = dict(kind="ring", segment_lengths=(8,), dilation_rates=(1,))
        names = ("mesh",)
    elif kind == "mesh_type":
        kw = dict(segment_lengths=(8,), dilation_rates=(1,),
                  mesh=draw(st.sampled_from(["sp", jax.devices(), 2])))
        names = ("mesh",)
    elif kind == "sequence_parallel_type":
        kw = dict(segment_lengths=(8,), dilation_rates=(1,),
                  sequence_parallel=draw(st.sampled_from([mesh, "sp", 2])))
        names = ("sequence_parallel",)
    elif kind == "seq_axis":
        kw = dict(segment_lengths=(8,), dilation_rates=(1,), mesh=mesh,
                  seq_axis=draw(st.sampled_from(["x", None, 0])))
        names = ("seq_axis",)
    elif kind == "mesh_not_ring":
        kw = dict(kind=draw(st.sampled_from(["dilated", "block_sparse"])), mesh=mesh,
                  segment_lengths=(8,), dilation_rates=(1,))
        if kw["kind"] == "block_sparse":
            kw = dict(kind="block_sparse", pattern=pattern, mesh=mesh)
        names = ("mesh",)
    elif kind == "bs_cudnn":
        kw = dict(pattern=pattern, implementation="cudnn")
        names = ("implementation",)
    elif kind == "bad_kwarg":
        kw = dict(segment_lengths=(8,), dilation_rates=(1,), foo=1)
        names = ("foo",)
    elif kind == "bad_ws":
        kw = dict(segment_lengths=(8,), dilation_rates=(3,),
                  kind=draw(st.sampled_from(["auto", "ring"])))
        if kw["kind"] == "ring":
            kw["mesh"] = mesh
        names = ("segment_lengths[0]",)
    elif kind == "mode":
        kw = dict(segment_lengths=(8,), dilation_rates=(1,), mode="avg",
                  kind=draw(st.sampled_from(["auto", "ring"])))
        if kw["kind"] == "ring":
            kw["mesh"] = mesh
        names = ("mode",)
    elif kind == "backend":
        kw = dict(segment_lengths=(8,), dilation_rates=(1,),
                  backend=draw(st.sampled_from(["quantum", 3, "GPU0"])))
        names = ("backend",)
    elif kind == "bs_ring":  # the block-sparse ring, without the mesh it shards over
        kw = dict(kind="ring", pattern=pattern)
        names = ("mesh",)
    else:
        kw = dict(segment_lengths=(8,), dilation_rates=(1,), is_causal="yes",
                  kind=draw(st.sampled_from(["auto", "ring"])))
        if kw["kind"] == "ring":
            kw["mesh"] = mesh
        names = ("is_causal",)
    return Case(f"factory:{kind}", lambda: dilax.create_attention(**kw), names)


# ----------------------------------------------------------------------------- training CLI

_CLI_BASE = ["--d-model", "32", "--num-heads", "2", "--num-layers", "1", "--dim-feedforward",
             "64", "--segment-lengths", "16,32", "--dilation-rates", "1,2", "--steps", "10",
             "--batch-size", "4", "--seq-len", "32", "--no-progress"]

_CLI_BAD = {
    "--steps": ["0", "-5", "ten", "1.5"],
    "--batch-size": ["0", "-1", "x", "100000000000"],
    "--seq-len": ["0", "-32", "10000000", "s"],
    "--lr": ["0", "-1e-3", "nan", "inf", "fast"],
    "--warmup": ["-1", "w"],
    "--weight-decay": ["-0.1", "nan"],
    "--clip-norm": ["0", "-1", "nan"],
    "--eval-every": ["-1"],
    "--eval-batches": ["0", "-2"],
    "--checkpoint-every": ["0", "-3"],
    "--keep-checkpoints": ["0", "-1"],
    "--stop-after": ["0", "11", "-1"],
    "--sample-tokens": ["-1"],
    "--temperature": ["-0.5", "nan"],
    "--prompt": ["", "\u20ac\u20ac"],
    "--d-model": ["0", "-32", "31", "30.5"],
    "--num-heads": ["0", "-2", "3", "64"],
    "--num-kv-heads": ["0", "-1", "3"],
    "--num-layers": ["0", "-1"],
    "--dim-feedforward": ["0", "-64"],
    "--segment-lengths": ["", "a,b", "16", "0,32", "-16,32", "12,33", "16,32,64"],
    "--dilation-rates": ["", "1", "0,2", "3,2", "1,-2", "x"],
    "--mode": ["sum", ""],
    "--dropout": ["-0.1", "1.0", "1.5", "nan"],
    "--dtype": ["float64", "int8"],
    "--unknown-flag": ["1"],
}


def cli_cases(draw) -> Case:
    flag = draw(st.sampled_from(sorted(_CLI_BAD) + ["--resume", "--grouped-heads"]))
    if flag == "--resume":
        argv, names = _CLI_BASE + ["--resume"], ("--resume", "--checkpoint-dir")
    elif flag == "--grouped-heads":  # grouped mode needs num_heads >= number of branches
        argv = _CLI_BASE + ["--mode", "grouped", "--segment-lengths", "8,16,32",
                            "--dilation-rates", "1,2,4"]
        names = ("--mode", "--num-heads", "--segment-lengths")
    else:
        value = draw(st.sampled_from(_CLI_BAD[flag]))
        argv = _CLI_BASE + [f"{flag}={value}"]
        names = (flag,)
        if flag == "--stop-after":
            names = ("--stop-after", "--steps")
        if flag in ("--segment-lengths", "--dilation-rates"):
            names = ("--segment-lengths", "--dilation-rates")
        if flag in ("--num-heads", "--d-model") and value not in ("0", "-2", "-32"):
            names = ("--d-model", "--num-heads")
        if flag == "--num-kv-heads":
            names = ("--num-kv-heads", "--num-heads")
    return Case(f"cli:{flag}", lambda: T.configs_from_argv(argv), names, ValueError)


MIN_CASES = 120
FAMILIES = [("modules", module_cases, 60), ("factory", factory_cases, 50),
            ("cli", cli_cases, 80)]


def test_fuzz_modules_factory_cli(capsys):
    check_families(FAMILIES, MIN_CASES, capsys)


@pytest.mark.parametrize("option,value", [("dropout", None), ("gamma_init", "x")])
def test_mha_float_options_named(option, value):
    with pytest.raises((TypeError, ValueError), match=option):
        MultiheadDilatedAttention(16, 4, (8,), (1,), rngs=nnx.Rngs(0), **{option: value})
