"""Valid q, k, v configurations and their one-thing-broken mutations, shared by the fuzz
tests of the dilated and block-sparse entry points (rules in tests/fuzz_common.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

from fuzz_common import HUGE_N, _sds
from hypothesis import strategies as st

import dilax

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

_IMPLS = [{}, {"implementation": "reference"}, {"implementation": "pallas", "interpret": True}]
