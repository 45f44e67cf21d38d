"""Fuzz of block-sparse attention and the pattern constructors with malformed input;
machinery and rules in tests/fuzz_common.py."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from fuzz_common import HUGE_N, Case, check_families
from fuzz_qkv import _IMPLS, DILATED_MUTATIONS, qkv_configs
from hypothesis import strategies as st

import dilax
from dilax import patterns
from dilax.memory import memory_limit
from dilax.nn import BlockSparseAttention

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
         "qkv", "qkv", "scale", "is_causal", "implementation", "pallas_block", "huge_n",
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
    elif kind == "pallas_block":  # a block size the Triton tiles cannot cut (registry rule)
        c.n = 12
        pattern = patterns.local_window(c.n, 6, 6)
        kw = {"implementation": "pallas", "interpret": True}
        names = ("block_size", "pattern.block_size")
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
    if entry == "content_adaptive_attention" and kind == "pallas_block":
        kind = "top_k"
    if entry == "content_adaptive_attention":
        kw.pop("implementation", None)
        kw.pop("interpret", None)
    if entry == "BlockSparseAttention":
        kw.pop("interpret", None)
        if kw.get("implementation") == "pallas":
            kw.pop("implementation")
        if kind == "pallas_block":
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


MIN_CASES = 130
FAMILIES = [("block_sparse", block_sparse_cases, 90), ("patterns", pattern_cases, 90)]


def test_fuzz_block_sparse_and_patterns(capsys):
    check_families(FAMILIES, MIN_CASES, capsys)
