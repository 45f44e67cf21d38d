"""Fuzz of the dilated entry points (functional, sharded, ring) with malformed q, k, v and
configurations; machinery and rules in tests/fuzz_common.py."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fuzz_common import Case, _mesh, _sds, check_families
from fuzz_qkv import _IMPLS, CONFIG, DILATED_MUTATIONS, QKV, qkv_configs
from hypothesis import strategies as st
from jax.sharding import AxisType, Mesh, PartitionSpec

import dilax
from dilax.memory import memory_limit
from dilax.nn import DilatedAttention

# Which kwargs each entry accepts (the others are not applicable to it).
_ENTRY_KW = {
    "dilated_attention": {"scale", "mode", "is_causal", "implementation", "interpret",
                          "block_sizes"},
    "DilatedAttention": {"scale", "mode", "is_causal", "implementation", "block_sizes"},
    "attention_fn": {"scale", "mode", "is_causal", "implementation", "block_sizes"},
    "sharded_dilated_attention": {"scale", "mode", "is_causal", "block_sizes", "layout"},
    "ring_dilated_attention": {"scale", "mode", "is_causal", "block_sizes", "layout"},
}


def _call_dilated(entry: str, c: QKV, base_kw: dict):
    kw = {**base_kw, **c.kw}
    q, k, v = c.arrays()
    traced = dict(c.traced)
    ws = c.ws if "segment_lengths" not in traced else None
    rs = c.rs if "dilation_rates" not in traced else None

    def fn(q, k, v, t):
        w_ = t["segment_lengths"] if "segment_lengths" in t else ws
        r_ = t["dilation_rates"] if "dilation_rates" in t else rs
        if isinstance(w_, jax.Array):
            w_ = (w_,)
        if isinstance(r_, jax.Array):
            r_ = (r_,)
        extra = {key: t[key] for key in ("scale", "is_causal") if key in t}
        if entry == "dilated_attention":
            return dilax.dilated_attention(q, k, v, w_, r_, **kw, **extra)
        if entry == "DilatedAttention":
            mod = DilatedAttention(w_, r_, **kw, **extra)
            return mod(q, k, v)
        if entry == "attention_fn":
            return dilax.attention_fn(w_, r_, **kw, **extra)(q, k, v)
        if entry == "sharded_dilated_attention":
            return dilax.sharded_dilated_attention(q, k, v, w_, r_, mesh=_mesh(), **kw, **extra)
        spec = PartitionSpec(None, "sp")
        return jax.shard_map(
            lambda q, k, v: dilax.ring_dilated_attention(q, k, v, w_, r_, axis_name="sp", **kw,
                                                         **extra),
            mesh=_mesh(), in_specs=(spec,) * 3, out_specs=spec, check_vma=False)(q, k, v)

    def run():
        args = (q, k, v)
        if any(not isinstance(x, jax.ShapeDtypeStruct) for x in args):
            return fn(*args, {key: jnp.asarray(val) for key, val in traced.items()})
        if c.limit is not None:
            with memory_limit(c.limit):
                return jax.eval_shape(fn, *args, {key: jnp.asarray(val)
                                                  for key, val in traced.items()})
        return jax.eval_shape(fn, *args, {key: jnp.asarray(val) for key, val in traced.items()})
    return run


def _applicable(entry: str, mutation: str, kind: str) -> bool:
    kws = _ENTRY_KW[entry]
    if mutation in ("scale", "mode", "is_causal", "implementation", "interpret", "block_sizes"):
        return mutation in kws
    if mutation in ("traced_scale", "traced_causal"):
        return True
    if mutation == "v_head_dim":  # dv != d is an input on one device (test_flex_dilated.py)
        return entry == "ring_dilated_attention"
    if entry == "ring_dilated_attention":  # arrays pass through the user's shard_map first
        return kind == CONFIG or mutation in ("h%hk", "dtype_mix", "dtype_bad", "head_dim",
                                              "huge_n", "v_head_dim")
    if entry == "attention_fn":
        # attention_fn follows flax's attention_fn contract: it promotes mixed dtypes like
        # nnx.MultiHeadAttention does, and takes arrays only.
        return mutation not in ("not_array", "dtype_mix", "dtype_bad")
    return True


def dilated_cases(draw) -> Case:
    entry = draw(st.sampled_from(list(_ENTRY_KW)))
    name, kind, mutate = draw(st.sampled_from(
        [m for m in DILATED_MUTATIONS if _applicable(entry, m[0], m[1])]))
    c = draw(qkv_configs())
    base_kw = draw(st.sampled_from(_IMPLS)) if entry == "dilated_attention" else {}
    if entry in ("sharded_dilated_attention", "ring_dilated_attention") and c.n % 2:
        c.n += 1
    c, names, exc = mutate(c, draw)
    if callable(exc) and not isinstance(exc, type):  # lazily built bad argument
        build = exc
        c.kw["block_sizes"] = None
        return Case(f"dilated:{entry}:{name}", build, names, ValueError)
    if entry == "attention_fn":
        names = names + ("query", "key", "value")
    return Case(f"dilated:{entry}:{name}", _call_dilated(entry, c, base_kw), names, exc)


def ring_cases(draw) -> Case:
    """Mesh / layout / divisibility errors of the sequence-parallel entry points."""
    c = draw(qkv_configs())
    c.n = 16
    q, k, v = c.arrays()
    kind = draw(st.sampled_from(["n%P", "zigzag", "seq_axis", "batch_axis", "same_axes", "mesh",
                                 "layout", "batch%", "axis_name", "ring_layout"]))
    mesh = _mesh(draw(st.sampled_from([2, 4])))
    kw: dict[str, Any] = {}
    names: tuple[str, ...]
    if kind == "n%P":
        q = _sds((c.b, 15, c.h, c.d), c.dtype)
        k = v = _sds((c.b, 15, c.hk, c.d), c.dtype)
        names = ("seq_len", "n")
    elif kind == "zigzag":
        q = _sds((c.b, 2 * mesh.size + 2, c.h, c.d), c.dtype)
        k = v = _sds((c.b, 2 * mesh.size + 2, c.hk, c.d), c.dtype)
        kw["layout"] = "zigzag"
        names = ("layout", "seq_len")
    elif kind == "seq_axis":
        kw["seq_axis"] = draw(st.sampled_from(["x", "seq", None]))
        names = ("seq_axis",)
    elif kind == "batch_axis":
        kw["batch_axis"] = "data"
        names = ("batch_axis",)
    elif kind == "same_axes":
        kw["batch_axis"] = "sp"
        names = ("seq_axis", "batch_axis")
    elif kind == "mesh":
        mesh = draw(st.sampled_from(["sp", None, jax.devices()]))
        names = ("mesh",)
    elif kind == "layout":
        kw["layout"] = draw(st.sampled_from(["striped", None, 2]))
        names = ("layout",)
    elif kind == "batch%":
        mesh2 = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "sp"),
                     axis_types=(AxisType.Auto,) * 2)
        q = _sds((3, 16, c.h, c.d), c.dtype)
        k = v = _sds((3, 16, c.hk, c.d), c.dtype)
        mesh, kw["batch_axis"] = mesh2, "dp"
        names = ("batch_axis", "batch")
    else:  # ring_dilated_attention outside of any shard_map / bad layout inside one
        if kind == "axis_name":
            def fn():
                return jax.eval_shape(lambda q, k, v: dilax.ring_dilated_attention(
                    q, k, v, c.ws, c.rs, axis_name=draw(st.sampled_from(["sp", "x"]))), q, k, v)
            return Case(f"ring:ring_dilated_attention:{kind}", fn, ("axis_name",), ValueError)
        spec = PartitionSpec(None, "sp")
        odd = _sds((c.b, 3 * mesh.size, c.h, c.d), c.dtype)  # odd local length
        oddk = _sds((c.b, 3 * mesh.size, c.hk, c.d), c.dtype)

        def fn():
            return jax.eval_shape(jax.shard_map(
                lambda q, k, v: dilax.ring_dilated_attention(q, k, v, c.ws, c.rs,
                                                             axis_name="sp", layout="zigzag"),
                mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False),
                odd, oddk, oddk)
        return Case(f"ring:ring_dilated_attention:{kind}", fn, ("layout",), ValueError)

    def fn():
        return jax.eval_shape(lambda q, k, v: dilax.sharded_dilated_attention(
            q, k, v, c.ws, c.rs, mesh=mesh, **kw), q, k, v)
    return Case(f"ring:sharded_dilated_attention:{kind}", fn, names)


MIN_CASES = 250
FAMILIES = [("dilated", dilated_cases, 260), ("ring", ring_cases, 40)]


def test_fuzz_dilated_entry_points(capsys):
    check_families(FAMILIES, MIN_CASES, capsys)


@pytest.mark.parametrize("entry", list(_ENTRY_KW))
def test_fuzz_baselines_are_valid(entry):
    """The unmutated configurations run: the errors above come from the mutation alone."""
    c = QKV(b=1, n=16, h=4, hk=2, d=8, ws=(4, 8), rs=(1, 2))
    out = _call_dilated(entry, c, {})()
    assert out.shape == (1, 16, 4, 8)
