"""Fuzz every public entry point with malformed input (issue #9).

Each generated case is one valid configuration with exactly one thing broken, together with
the argument it breaks. A case passes only if the call raises ``ValueError``/``TypeError``
whose message names that argument; an internal error (XLA, shape, ``AttributeError``...), a
message that does not name the argument, or a silent result is an *unclear* case. Arrays are
``jax.ShapeDtypeStruct`` under ``jax.eval_shape``: every check happens at trace time and
nothing is allocated, which is also how "huge n" must fail (from the shapes alone).

``test_fuzz_all_entry_points`` runs every family with a fixed number of hypothesis examples
(derandomized) and asserts the total number of cases tried (>= 500) and 0 unclear ones.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, Mesh, PartitionSpec

import dilax
from dilax import patterns
from dilax import train as T
from dilax.memory import memory_limit
from dilax.models import LongNetLM
from dilax.nn import (
    BlockSparseAttention,
    BlockSparseMultiheadAttention,
    DilatedAttention,
    MultiheadDilatedAttention,
)

HUGE_N = 2**31  # 512 GiB per (1, n, 8, 64) float32 tensor: must fail from the shapes alone


@dataclasses.dataclass
class Case:
    label: str  # entry point / mutation
    fn: Callable[[], Any]
    names: tuple[str, ...]  # the message must name one of these
    exc: type = Exception  # ValueError or TypeError; Exception: either


@dataclasses.dataclass
class Tally:
    tried: Counter = dataclasses.field(default_factory=Counter)
    unclear: list = dataclasses.field(default_factory=list)

    def run(self, case: Case) -> None:
        family = case.label.split(":")[0]
        self.tried[family] += 1
        try:
            case.fn()
        except (ValueError, TypeError) as e:
            msg = str(e)
            if not any(_names(n, msg) for n in case.names):
                self.unclear.append((case.label, f"{type(e).__name__} not naming "
                                     f"{case.names}: {msg[:300]}"))
            elif case.exc is not Exception and not isinstance(e, case.exc):
                self.unclear.append((case.label, f"expected {case.exc.__name__}, got "
                                     f"{type(e).__name__}: {msg[:200]}"))
        except Exception as e:  # noqa: BLE001 - this is what the fuzz looks for
            self.unclear.append((case.label, f"internal {type(e).__name__}: {str(e)[:300]}"))
        else:
            self.unclear.append((case.label, "no error (silent result)"))


def _names(name: str, msg: str) -> bool:
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", msg) is not None


SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


def _sds(shape, dtype="float32"):
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def _mesh(p: int = 2) -> Mesh:
    return Mesh(np.array(jax.devices()[:p]), ("sp",), axis_types=(AxisType.Auto,))


# ----------------------------------------------------------------------------- q, k, v


@dataclasses.dataclass
class QKV:
    """A valid configuration; mutations change one thing."""

    b: int
    n: int
    h: int
    hk: int
    d: int
    ws: Any
    rs: Any
    dtype: str = "float32"
    q: Any = None  # explicit shapes/dtypes (None: from the fields)
    k: Any = None
    v: Any = None
    kw: dict = dataclasses.field(default_factory=dict)
    traced: dict = dataclasses.field(default_factory=dict)  # kwargs passed as jit arguments
    limit: Any = None  # memory_limit override

    def arrays(self):
        q = self.q if self.q is not None else _sds((self.b, self.n, self.h, self.d), self.dtype)
        k = self.k if self.k is not None else _sds((self.b, self.n, self.hk, self.d), self.dtype)
        v = self.v if self.v is not None else k
        return q, k, v


@st.composite
def qkv_configs(draw):
    hk = draw(st.sampled_from([1, 2]))
    h = hk * draw(st.sampled_from([1, 2]))
    G = draw(st.sampled_from([1, 2]))
    ws = tuple(draw(st.sampled_from([4, 8])) * (i + 1) for i in range(G))
    rs = tuple(draw(st.sampled_from([1, 2, 4])) for _ in range(G))
    return QKV(b=draw(st.sampled_from([1, 2])), n=draw(st.sampled_from([8, 16, 24])), h=h, hk=hk,
               d=draw(st.sampled_from([4, 8])), ws=ws, rs=rs,
               dtype=draw(st.sampled_from(["float32", "bfloat16"])))


def _shape(c: QKV, which: str) -> tuple[int, ...]:
    return (c.b, c.n, c.h if which == "q" else c.hk, c.d)


def _set(c: QKV, which: str, shape=None, dtype=None):
    shape = _shape(c, which) if shape is None else shape
    arr = _sds(shape, c.dtype if dtype is None else dtype)
    if which == "k" and c.v is None:
        c.v = _sds(_shape(c, "k"), c.dtype)
    setattr(c, which, arr)
    return c


def _other_dtype(c):
    return "float16" if c.dtype != "float16" else "float32"


# Each mutation: (name, applies_to(entry) -> bool, fn(QKV, draw) -> (QKV, names, exc))
ARRAY, CONFIG, RING_ONLY = "array", "config", "ring"


def _m_rank(which):
    def f(c, draw):
        shape = list(_shape(c, which))
        if draw(st.booleans()):
            shape.pop(draw(st.integers(0, 3)))
        else:
            shape.insert(draw(st.integers(0, 4)), draw(st.sampled_from([1, 2])))
        return _set(c, which, tuple(shape)), (which,), ValueError
    return f


def _m_layout_q(c, draw):  # q given as (b, h, n, d), k/v as (b, n, hk, d)
    return _set(c, "q", (c.b, c.h, c.n, c.d)), ("q",), ValueError


def _m_layout_kv(c, draw):  # k and v as (b, hk, n, d)
    shape = (c.b, c.hk, c.n, c.d)
    c.k = c.v = _sds(shape, c.dtype)
    return c, ("k", "q"), ValueError


def _m_layout_k(c, draw):  # only k transposed
    c.v = _sds(_shape(c, "k"), c.dtype)
    c.k = _sds((c.b, c.hk, c.n, c.d), c.dtype)
    return c, ("k", "v"), ValueError


def _m_axis(which, axis):
    def f(c, draw):
        shape = list(_shape(c, which))
        shape[axis] = shape[axis] + draw(st.sampled_from([1, 3]))
        if which == "k":
            c.v = _sds(shape, c.dtype)  # k and v agree, differ from q
        return _set(c, which, tuple(shape)), ("k", "q", "v"), ValueError
    return f


def _m_v_head_dim(c, draw):
    shape = list(_shape(c, "k"))
    shape[3] += draw(st.sampled_from([1, 4]))
    c.v = _sds(shape, c.dtype)
    return c, ("v",), ValueError


def _m_zero(c, draw):
    which = draw(st.sampled_from(["q", "k"]))
    axis = draw(st.integers(0, 3))
    shape = list(_shape(c, which))
    shape[axis] = 0
    if which == "k":
        c.v = _sds(shape, c.dtype)
    return _set(c, which, tuple(shape)), (which, "q", "k", "seq_len"), ValueError


def _m_heads_ratio(c, draw):  # h % hk != 0
    hk = draw(st.sampled_from([2, 3]))
    h = hk * draw(st.integers(1, 2)) + 1
    c.h, c.hk = h, hk
    c.ws = (4,)
    c.rs = (1,)
    return c, ("hk", "k"), ValueError


def _m_dtype_mix(c, draw):
    which = draw(st.sampled_from(["k", "v"]))
    if which == "k":
        c.v = _sds(_shape(c, "k"), c.dtype)
    return _set(c, which, dtype=_other_dtype(c)), (which,), TypeError


def _m_dtype_bad(c, draw):
    which = draw(st.sampled_from(["q", "k", "v"]))
    dtype = draw(st.sampled_from(["int32", "bool", "float8_e4m3fn", "complex64", "uint8"]))
    c.q, c.k, c.v = c.arrays()
    return _set(c, which, dtype=dtype), (which,), TypeError


def _m_not_array(c, draw):
    which = draw(st.sampled_from(["q", "k", "v"]))
    c.q, c.k, c.v = c.arrays()
    setattr(c, which, draw(st.sampled_from(["query", None, {"a": 1}, object()])))
    return c, (which,), TypeError


def _m_huge(c, draw):
    if draw(st.booleans()):
        c.b, c.n, c.h, c.hk, c.d = 1, HUGE_N, 8, draw(st.sampled_from([1, 8])), 64
        c.dtype = "float32"
    else:  # a modest call (8 MiB per tensor) under a small limit (as on a small GPU)
        c.b, c.n, c.h, c.hk, c.d = 1, 4096, 8, draw(st.sampled_from([1, 8])), 64
        c.dtype = "float32"
        c.limit = "1MiB"
    c.ws, c.rs = (2048,), (1,)
    return c, ("q", "seq_len"), ValueError


def _m_branches(c, draw):
    kind = draw(st.sampled_from(["len", "empty", "w%r", "w<=0", "r<=0", "float", "str", "none",
                                 "bool", "nested"]))
    G = len(c.ws)
    if kind == "len":
        c.rs = tuple(c.rs) + (1,)
        names = ("segment_lengths", "dilation_rates")
    elif kind == "empty":
        c.ws, c.rs = (), ()
        names = ("segment_lengths",)
    elif kind == "w%r":
        c.ws, c.rs = (6,) * G, (4,) * G
        names = ("segment_lengths[0]", "dilation_rates[0]")
    elif kind == "w<=0":
        c.ws = (draw(st.sampled_from([0, -4])),) + tuple(c.ws[1:])
        names = ("segment_lengths[0]",)
    elif kind == "r<=0":
        c.rs = (draw(st.sampled_from([0, -2])),) + tuple(c.rs[1:])
        names = ("dilation_rates[0]",)
    elif kind == "float":
        c.ws = (8.0,) + tuple(c.ws[1:])
        names = ("segment_lengths[0]",)
    elif kind == "str":
        c.rs = "1,2"
        names = ("dilation_rates",)
    elif kind == "none":
        c.ws = None
        names = ("segment_lengths",)
    elif kind == "bool":
        c.rs = (True,) * G
        names = ("dilation_rates[0]",)
    else:
        c.ws = ((8, 8),) * G
        names = ("segment_lengths[0]",)
    return c, names, Exception


def _m_grouped_few_heads(c, draw):
    G = draw(st.integers(2, 4))
    c.h, c.hk = 1, 1
    c.ws, c.rs = tuple(4 * (i + 1) for i in range(G)), (1,) * G
    c.kw["mode"] = "grouped"
    return c, ("mode", "segment_lengths"), ValueError


def _m_kwarg(name, values, names=None, exc=Exception):
    def f(c, draw):
        c.kw[name] = draw(st.sampled_from(values))
        return c, names or (name,), exc
    return f


def _m_traced(name, value, names=None):
    def f(c, draw):
        c.traced[name] = value
        return c, names or (name,), TypeError
    return f


def _m_block_sizes(c, draw):
    v = draw(st.sampled_from(["big", (64, 64), 128]))
    c.kw["block_sizes"] = v
    return c, ("block_sizes",), TypeError


def _m_block_sizes_value(c, draw):
    def build():
        return dilax.BlockSizes(block_q=draw(st.sampled_from([0, -8])))
    return c, ("block_q", "BlockSizes.block_q"), build  # built lazily inside the call


DILATED_MUTATIONS = [
    ("rank_q", ARRAY, _m_rank("q")), ("rank_k", ARRAY, _m_rank("k")),
    ("rank_v", ARRAY, _m_rank("v")), ("layout_q", ARRAY, _m_layout_q),
    ("layout_kv", ARRAY, _m_layout_kv), ("layout_k", ARRAY, _m_layout_k),
    ("batch", ARRAY, _m_axis("k", 0)), ("seq_len", ARRAY, _m_axis("k", 1)),
    ("head_dim", ARRAY, _m_axis("k", 3)), ("v_head_dim", ARRAY, _m_v_head_dim),
    ("zero_size", ARRAY, _m_zero), ("h%hk", ARRAY, _m_heads_ratio),
    ("dtype_mix", ARRAY, _m_dtype_mix), ("dtype_bad", ARRAY, _m_dtype_bad),
    ("not_array", ARRAY, _m_not_array), ("huge_n", ARRAY, _m_huge),
    ("branches", CONFIG, _m_branches), ("grouped_h<G", CONFIG, _m_grouped_few_heads),
    ("scale", CONFIG, _m_kwarg("scale", [-1.0, 0.0, float("nan"), float("inf"), "1", 1j])),
    ("mode", CONFIG, _m_kwarg("mode", ["sum", None, 3, "Mixture"])),
    ("is_causal", CONFIG, _m_kwarg("is_causal", ["yes", 1, None, 0.0])),
    ("implementation", CONFIG, _m_kwarg("implementation", ["cuda", 3, "XLA", "triton"])),
    ("interpret", CONFIG, _m_kwarg("interpret", ["no", 1])),
    ("block_sizes", CONFIG, _m_block_sizes),
    ("traced_w", CONFIG, _m_traced("segment_lengths", 8, ("segment_lengths",))),
    ("traced_r", CONFIG, _m_traced("dilation_rates", 1, ("dilation_rates",))),
    ("traced_scale", CONFIG, _m_traced("scale", 0.5)),
    ("traced_causal", CONFIG, _m_traced("is_causal", True)),
]

# Which kwargs each entry accepts (the others are not applicable to it).
_ENTRY_KW = {
    "dilated_attention": {"scale", "mode", "is_causal", "implementation", "interpret",
                          "block_sizes"},
    "DilatedAttention": {"scale", "mode", "is_causal", "implementation", "block_sizes"},
    "attention_fn": {"scale", "mode", "is_causal", "implementation", "block_sizes"},
    "sharded_dilated_attention": {"scale", "mode", "is_causal", "block_sizes", "layout"},
    "ring_dilated_attention": {"scale", "mode", "is_causal", "block_sizes", "layout"},
}
_IMPLS = [{}, {"implementation": "reference"}, {"implementation": "pallas", "interpret": True}]


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


# ----------------------------------------------------------------------------- block-sparse


def block_sparse_cases(draw) -> Case:
    c = draw(qkv_configs())
    bs = draw(st.sampled_from([4, 8]))
    c.n = bs * draw(st.integers(1, 3))
    pattern = patterns.local_window(c.n, bs, bs)
    impl = draw(st.sampled_from(_IMPLS))
    entry = draw(st.sampled_from(["block_sparse_attention", "BlockSparseAttention",
                                  "content_adaptive_attention"]))
    kind = draw(st.sampled_from(
        ["pattern_type", "pattern_blocks", "pattern_heads", "pattern_block_size", "qkv",
         "qkv", "qkv", "scale", "is_causal", "implementation", "pallas_partial", "huge_n",
         "traced_causal", "top_k", "block_size"]))
    kw: dict[str, Any] = dict(impl)
    names: tuple[str, ...] = ("pattern",)
    limit = None
    if kind == "pattern_type":
        pattern = draw(st.sampled_from([None, "local", np.ones((2, 2), bool), (4, 4)]))
    elif kind == "pattern_blocks":  # block mask of the wrong shape for n
        nb = c.n // bs + draw(st.sampled_from([1, 2]))
        pattern = patterns.from_mask(np.ones((nb, draw(st.sampled_from([nb, nb - 1]))), bool),
                                     bs)
    elif kind == "pattern_heads":
        pattern = patterns.from_mask(np.ones((c.h + 1, c.n // bs, c.n // bs), bool), bs)
    elif kind == "pattern_block_size":  # same number of blocks, block size does not cover n
        pattern = patterns.from_mask(np.ones((c.n // bs, c.n // bs), bool), bs // 2)
    elif kind == "qkv":
        name, _, mutate = draw(st.sampled_from(
            [m for m in DILATED_MUTATIONS[:15] if m[0] not in ("h%hk",)]))
        c, names, _ = mutate(c, draw)
        if name in ("seq_len", "layout_q", "layout_kv", "layout_k", "zero_size"):
            pass
    elif kind == "scale":
        kw["scale"] = draw(st.sampled_from([-1.0, 0.0, float("nan"), "big"]))
        names = ("scale",)
    elif kind == "is_causal":
        kw["is_causal"] = draw(st.sampled_from(["no", 2, None]))
        names = ("is_causal",)
    elif kind == "implementation":
        kw["implementation"] = draw(st.sampled_from(["cudnn", "fast", 0]))
        kw.pop("interpret", None)
        names = ("implementation",)
    elif kind == "pallas_partial":
        c.n = bs * 2 + 1
        pattern = patterns.local_window(c.n, bs, bs)
        kw = {"implementation": "pallas", "interpret": True}
        names = ("seq_len", "block_size", "pattern.block_size")
    elif kind == "huge_n":
        c.b, c.n, c.h, c.hk, c.d, c.dtype = 1, HUGE_N, 8, 8, 64, "float32"
        bs = 2**22
        pattern = patterns.local_window(c.n, bs, bs)
        names = ("q", "seq_len")
    elif kind == "traced_causal":
        kw["is_causal"] = "__traced__"
        names = ("is_causal",)
    elif kind in ("top_k", "block_size"):
        entry = "content_adaptive_attention"
    if entry == "content_adaptive_attention" and kind == "pallas_partial":
        kind = "top_k"
    if entry == "content_adaptive_attention":
        kw.pop("implementation", None)
        kw.pop("interpret", None)
    if entry == "BlockSparseAttention":
        kw.pop("interpret", None)
        if kw.get("implementation") == "pallas":
            kw.pop("implementation")
        if kind == "pallas_partial":
            kind, names = "pattern_type", ("pattern",)
            pattern = "local"
    top_k, block_size = 1, bs
    if kind == "top_k":
        top_k = draw(st.sampled_from([0, -1, -(-c.n // bs) + 1, 1.5, "2", None]))
        names = ("top_k",)
    elif kind == "block_size":
        block_size = draw(st.sampled_from([0, -4, 2.0, None, "8"]))
        names = ("block_size",)
    if entry == "content_adaptive_attention" and kind.startswith("pattern"):
        kind, names = "block_size", ("block_size",)
        block_size = 0
    q, k, v = c.arrays()
    traced_causal = kw.get("is_causal") == "__traced__"
    if traced_causal:
        kw.pop("is_causal")

    def fn(q, k, v, flag):
        extra = {"is_causal": flag} if traced_causal else {}
        if entry == "block_sparse_attention":
            return dilax.block_sparse_attention(q, k, v, pattern, **kw, **extra)
        if entry == "BlockSparseAttention":
            call_kw = {key: kw[key] for key in ("scale", "is_causal") if key in kw}
            ctor_kw = {key: kw[key] for key in ("implementation",) if key in kw}
            return BlockSparseAttention(pattern, **ctor_kw)(q, k, v, **call_kw, **extra)
        ca_kw = {key: kw[key] for key in ("scale", "is_causal") if key in kw}
        return dilax.content_adaptive_attention(q, k, v, block_size, top_k, **ca_kw, **extra)

    def run():
        if any(not isinstance(x, jax.ShapeDtypeStruct) for x in (q, k, v)):
            return fn(q, k, v, jnp.asarray(True))
        if limit is not None:
            with memory_limit(limit):
                return jax.eval_shape(fn, q, k, v, jnp.asarray(True))
        return jax.eval_shape(fn, q, k, v, jnp.asarray(True))
    return Case(f"block_sparse:{entry}:{kind}", run, names)


# ----------------------------------------------------------------------------- patterns


def pattern_cases(draw) -> Case:
    n = draw(st.sampled_from([16, 33, 64]))
    bs = draw(st.sampled_from([4, 8]))
    bad_int = st.sampled_from([0, -3, 2.5, "8", None, True])
    kind = draw(st.sampled_from(
        ["n", "block_size", "window", "rates", "global", "levels", "density", "seed",
         "num_heads", "from_mask", "segments", "combine", "to_text", "expanded", "huge",
         "traced", "ctor"]))
    if kind == "n":
        v = draw(bad_int)
        fn = draw(st.sampled_from([lambda: patterns.local_window(v, bs, 4),
                                   lambda: patterns.dilated(v, bs, (1, 2)),
                                   lambda: patterns.random(v, bs, 0.5),
                                   lambda: patterns.hierarchical(v, ((4, 1),))]))
        return Case(f"patterns:{kind}", fn, ("n",))
    if kind == "block_size":
        v = draw(bad_int)
        fn = draw(st.sampled_from([lambda: patterns.local_window(n, v, 4),
                                   lambda: patterns.global_local(n, v, 4, 4),
                                   lambda: patterns.from_mask(np.ones((2, 2)), v),
                                   lambda: patterns.dilated_segments(n, v, (8,), (1,))]))
        return Case(f"patterns:{kind}", fn, ("block_size",))
    if kind == "window":
        v = draw(st.sampled_from([-1, 1.5, "4", None]))
        return Case(f"patterns:{kind}", lambda: patterns.local_window(n, bs, v), ("window",))
    if kind == "rates":
        v = draw(st.sampled_from([(), (0,), (-1, 2), (1.5,), "12", None]))
        return Case(f"patterns:{kind}", lambda: patterns.dilated(n, bs, v),
                    ("dilation_rates", "dilation_rates[0]"))
    if kind == "global":
        v = draw(st.sampled_from([n + 1, -1, 0.5]))
        return Case(f"patterns:{kind}", lambda: patterns.global_local(n, bs, v, 4),
                    ("global_tokens",))
    if kind == "levels":
        v = draw(st.sampled_from([(), [(4,)], [(4, 1), (6, 1)], [(4, 1), (4, 1)], "44",
                                  [(0, 1)], [(4, -1)], None, [(4, 1, 1)]]))
        return Case(f"patterns:{kind}", lambda: patterns.hierarchical(n, v),
                    ("levels", "levels[0]", "levels[1]", "levels[0][0]", "levels[0][1]",
                     "levels[1][0]"))
    if kind == "density":
        v = draw(st.sampled_from([-0.1, 1.5, float("nan"), "0.5", None]))
        return Case(f"patterns:{kind}", lambda: patterns.random(n, bs, v), ("density",))
    if kind == "seed":
        v = draw(st.sampled_from([-1, 0.5, "s"]))
        return Case(f"patterns:{kind}", lambda: patterns.random(n, bs, 0.5, v), ("seed",))
    if kind == "num_heads":
        v = draw(st.sampled_from([0, -2, 1.0]))
        fn = draw(st.sampled_from([lambda: patterns.random(n, bs, 0.5, num_heads=v),
                                   lambda: patterns.dilated_segments(n, bs, (8,), (1,),
                                                                     num_heads=v)]))
        return Case(f"patterns:{kind}", fn, ("num_heads",))
    if kind == "from_mask":
        v = draw(st.sampled_from([np.ones(4, bool), np.ones((1, 1, 2, 2), bool),
                                  np.full((2, 2), 2), np.zeros((0, 2), bool), "mask",
                                  np.array([["a", "b"]]), None, np.full((2, 2), 0.5)]))
        return Case(f"patterns:{kind}", lambda: patterns.from_mask(v, bs), ("block_mask",))
    if kind == "segments":
        ws, rs, mode, nh = draw(st.sampled_from([((8,), (3,), "mixture", None),
                                                 ((8, 16), (1,), "mixture", None),
                                                 ((8, 16), (1, 2), "grouped", 1),
                                                 ((8,), (1,), "sum", 2)]))
        return Case(f"patterns:{kind}", lambda: patterns.dilated_segments(
            n, bs, ws, rs, num_heads=nh, mode=mode),
            ("segment_lengths", "segment_lengths[0]", "mode", "dilation_rates"))
    if kind == "combine":
        a = patterns.local_window(n, bs, 4)
        b = draw(st.sampled_from([patterns.local_window(n, bs * 2, 4),
                                  patterns.local_window(n + 4 * bs, bs, 4),
                                  patterns.random(n, bs, 0.5, num_heads=2)]))
        if b.num_heads == 2:
            a = patterns.random(n, bs, 0.5, num_heads=3)
        op = draw(st.sampled_from(["|", "&"]))
        return Case(f"patterns:{kind}", (lambda: a | b) if op == "|" else (lambda: a & b),
                    ("block_size", "blocks", "heads", "num_heads"))
    if kind == "to_text":
        a = patterns.local_window(n, bs, 4)
        head, mb = draw(st.sampled_from([(1, 8), (-1, 8), (0, 0), ("0", 8), (0, -2)]))
        return Case(f"patterns:{kind}", lambda: a.to_text(head=head, max_blocks=mb),
                    ("head", "max_blocks"))
    if kind == "expanded":
        a = patterns.local_window(n, bs, 4)
        m = draw(st.sampled_from([n + 4 * bs, 1, 0, "n"]))
        return Case(f"patterns:{kind}", lambda: a.expanded_mask(m), ("n",))
    if kind == "huge":
        big = draw(st.sampled_from([2**40, 2**34]))
        fn = draw(st.sampled_from([lambda: patterns.local_window(big, 1, 4),
                                   lambda: patterns.dilated(big, 2, (1, 2)),
                                   lambda: patterns.random(big, 4, 0.1),
                                   lambda: patterns.global_local(big, 2, 4, 4),
                                   lambda: patterns.hierarchical(big, ((2, 1), (4, 1))),
                                   lambda: patterns.dilated_segments(big, 2, (8,), (1,))]))
        return Case(f"patterns:{kind}", fn, ("n", "block_size"), ValueError)
    if kind == "traced":
        which = draw(st.sampled_from(["n", "block_size", "window"]))

        def fn():
            def f(x):
                args = {"n": n, "block_size": bs, "window": 4, which: x}
                return patterns.local_window(**args).block_mask
            return jax.jit(f)(jnp.asarray(4))
        return Case(f"patterns:{kind}", fn, (which,), TypeError)
    field = draw(st.sampled_from(["block_size", "num_heads", "num_q_blocks", "packed_mask"]))
    args = dict(block_size=4, num_heads=1, num_q_blocks=2, num_k_blocks=2, packed_mask=b"\xff")
    args[field] = draw(st.sampled_from([0, -1, 1.5])) if field != "packed_mask" else draw(
        st.sampled_from([b"", "ff", b"\xff\xff"]))
    return Case(f"patterns:{kind}", lambda: patterns.BlockSparsePattern(**args),
                (f"BlockSparsePattern.{field}",))


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
         "mesh_type", "seq_axis", "mesh_not_ring", "bs_cudnn", "bad_kwarg", "bad_ws", "mode",
         "backend", "bs_ring", "is_causal"]))
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


# ----------------------------------------------------------------------------- the run

FAMILIES: list[tuple[str, Callable, int]] = [
    ("dilated", dilated_cases, 260),
    ("ring", ring_cases, 40),
    ("block_sparse", block_sparse_cases, 90),
    ("patterns", pattern_cases, 90),
    ("modules", module_cases, 60),
    ("factory", factory_cases, 50),
    ("cli", cli_cases, 80),
]
MIN_CASES = 500


def run_family(tally: Tally, make: Callable, examples: int) -> None:
    @settings(max_examples=examples, **SETTINGS)
    @given(st.data())
    def inner(data):
        tally.run(make(data.draw))

    inner()


def test_fuzz_all_entry_points(capsys):
    tally = Tally()
    for _, make, examples in FAMILIES:
        run_family(tally, make, examples)
    total = sum(tally.tried.values())
    with capsys.disabled():
        print(f"\nfuzz: {total} malformed inputs tried ({dict(tally.tried)}), "
              f"{len(tally.unclear)} unclear")
    problems = "\n".join(f"{label}: {why}" for label, why in sorted(set(tally.unclear))[:40])
    assert not tally.unclear, f"{len(tally.unclear)} unclear cases:\n{problems}"
    assert total >= MIN_CASES


@pytest.mark.parametrize("entry", list(_ENTRY_KW))
def test_fuzz_baselines_are_valid(entry):
    """The unmutated configurations run: the errors above come from the mutation alone."""
    c = QKV(b=1, n=16, h=4, hk=2, d=8, ws=(4, 8), rs=(1, 2))
    out = _call_dilated(entry, c, {})()
    assert out.shape == (1, 16, 4, 8)


@pytest.mark.parametrize("option,value", [("dropout", None), ("gamma_init", "x")])
def test_mha_float_options_named(option, value):
    with pytest.raises((TypeError, ValueError), match=option):
        MultiheadDilatedAttention(16, 4, (8,), (1,), rngs=nnx.Rngs(0), **{option: value})
