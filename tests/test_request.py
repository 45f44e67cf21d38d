"""The request values of a dilated call (issue 25): ``DilatedSettings``, ``AttentionMask`` and
``sequence_parallel=`` on the ops.

- ``DilatedSettings`` is a frozen, hashable value, validated once where it is built, with the
  messages of :func:`dilax.dilated_attention`'s keywords; ``AttentionMask`` is a pytree built
  (validated) once at the boundary and combinable with ``&``.
- Each public path validates once: the entry checks (``check_qkv``, ``check_branches``) run
  exactly once per call, counted with monkeypatch, also on the sequence-parallel paths (which
  used to validate again inside ``shard_map``).
- ``sequence_parallel=SequenceParallel(...)`` equals the float64 oracle, forward and
  gradients, and is the very program of the old ``sharded_*`` names (bitwise).
  8 host CPU devices come from tests/conftest.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import ring_oracle
from jax.sharding import AxisType
from oracle import attention as oracle_attention
from oracle import dilated as dilated_oracle
from ring_oracle import assert_matches
from tolerance import FP32, assert_scaled_close

import dilax
from dilax import AttentionMask, DilatedSettings, SequenceParallel
from dilax import _validation as V
from dilax.reference import dilated_counts

CFG = dict(segment_lengths=(8, 64), dilation_rates=(1, 4))


def _mesh(P=4):
    return jax.make_mesh((P,), ("sp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:P])


def _qkv(b=2, n=64, h=4, hk=2, d=8, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(ks[0], (b, n, h, d))
    k = jax.random.normal(ks[1], (b, n, hk, d))
    v = jax.random.normal(ks[2], (b, n, hk, d))
    g = jax.random.normal(ks[3], (b, n, h, d))
    return q, k, v, g


# -- DilatedSettings -----------------------------------------------------------------------


def test_settings_are_normalized_frozen_and_hashable():
    a = DilatedSettings([8, 64], np.array([1, 4]), is_causal=True, scale=np.float32(0.5))
    b = DilatedSettings((8, 64), (1, 4), is_causal=True, scale=0.5)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a.segment_lengths == (8, 64) and type(a.scale) is float
    assert DilatedSettings(16, 2).segment_lengths == (16,)
    with pytest.raises(AttributeError):
        a.mode = "grouped"
    assert a.replace(mode="grouped").mode == "grouped" and a.mode == "mixture"
    assert a.scale_for(16) == 0.5 and b.replace(scale=None).scale_for(16) == 0.25


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(segment_lengths=(8, 16), dilation_rates=(3, 1)), ValueError,
     r"segment_lengths\[0\]=8 must be divisible by dilation_rates\[0\]=3"),
    (dict(segment_lengths=(), dilation_rates=()), ValueError, "at least one branch"),
    (dict(segment_lengths=(8,), dilation_rates=(1,), mode="dense"), ValueError,
     "mode must be one of"),
    (dict(segment_lengths=(8,), dilation_rates=(1,), scale=-1.0), ValueError,
     "scale must be a finite positive float"),
    (dict(segment_lengths=(8,), dilation_rates=(1,), mode="grouped", local_window=2),
     ValueError, "local_window is a branch of the mixture"),
    (dict(segment_lengths=(8,), dilation_rates=(1,), implementation="fast"), ValueError,
     "implementation must be one of"),
    (dict(segment_lengths=(8,), dilation_rates=(1,), is_causal=1), TypeError,
     "is_causal must be a bool"),
    (dict(segment_lengths=(8,), dilation_rates=(1,), block_sizes=(4, 4)), TypeError,
     "block_sizes must be a dilax.BlockSizes"),
])
def test_settings_errors_are_the_keyword_errors(kwargs, error, match):
    q, k, v, _ = _qkv(n=16)
    with pytest.raises(error, match=match):
        DilatedSettings(**kwargs)
    with pytest.raises(error, match=match):  # the keyword path raises the same
        dilax.dilated_attention(q, k, v, **kwargs)


def test_settings_and_keywords_are_exclusive():
    q, k, v, _ = _qkv(n=16)
    s = DilatedSettings((8,), (1,))
    with pytest.raises(TypeError, match="settings= holds the whole configuration"):
        dilax.dilated_attention(q, k, v, (8,), (1,), settings=s)
    with pytest.raises(TypeError, match=r"\['mode'\]"):
        dilax.dilated_attention(q, k, v, settings=s, mode="grouped")
    with pytest.raises(TypeError, match="segment_lengths and dilation_rates are required"):
        dilax.dilated_attention(q, k, v)
    with pytest.raises(TypeError, match="settings must be a dilax.DilatedSettings"):
        dilax.dilated_attention(q, k, v, settings=dict(segment_lengths=(8,)))
    with pytest.raises(ValueError, match="needs num_heads >= len"):  # shape rule at the call
        dilax.dilated_attention(q, k, v, settings=DilatedSettings((4,) * 5, (1,) * 5,
                                                                  mode="grouped"))


# -- AttentionMask -------------------------------------------------------------------------


def test_mask_is_a_pytree_built_once_and_combinable():
    q = jnp.zeros((2, 16, 4, 8))
    m = AttentionMask.build(q, is_causal=True, query_seq_lengths=[10, 16],
                            key_padding_mask=np.arange(16)[None].repeat(2, 0) < 12)
    leaves, tree = jax.tree_util.tree_flatten(m)
    assert len(leaves) == 2 and leaves[0].dtype == jnp.int32
    back = jax.tree_util.tree_unflatten(tree, leaves)
    assert back.is_causal and back.key_value_seq_lengths is None
    other = AttentionMask.build(q, query_seq_lengths=[12, 8], key_value_seq_lengths=[5, 16])
    both = m & other
    np.testing.assert_array_equal(both.query_seq_lengths, [10, 8])
    np.testing.assert_array_equal(both.key_value_seq_lengths, [5, 16])
    assert both.is_causal and both.key_padding_mask is m.key_padding_mask
    with pytest.raises(ValueError, match=r"query_seq_lengths must lie in \[0, n=16\]"):
        AttentionMask.build(q, query_seq_lengths=[17, 3])
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(b, n\)"):
        AttentionMask.build(q, key_padding_mask=np.ones((2, 8), bool))
    with pytest.raises(ValueError, match=r"segment_ids must have shape \(b, n\)"):
        AttentionMask.build(q, segment_ids=jnp.zeros((2, 8), jnp.int32))
    with pytest.raises(TypeError, match="segment_ids must be an integer array"):
        AttentionMask.build(q, segment_ids=jnp.zeros((2, 16), jnp.float32))
    # documents of both masks: a document ends where either's does
    ids = lambda cut: np.broadcast_to(np.arange(16) >= cut, (2, 16)).astype(np.int32)  # noqa: E731
    c = AttentionMask.build(q, segment_ids=ids(5)) & AttentionMask.build(q, segment_ids=ids(9))
    np.testing.assert_array_equal(c.segment_ids[0], np.searchsorted([5, 9], np.arange(16),
                                                                    side="right"))


def test_mask_value_equals_keywords_and_reference():
    """``attention_mask=`` (an ``&`` of two masks) gives the program of the keywords (bitwise)
    and the values of the float64 oracle of the mask-based definition."""
    q, k, v, _ = _qkv(n=32)
    s = DilatedSettings((8, 32), (1, 2))
    kpm = jnp.asarray(np.arange(32)[None].repeat(2, 0) % 5 != 3)
    mask = (AttentionMask.build(q, query_seq_lengths=[20, 32])
            & AttentionMask.build(q, is_causal=True, key_padding_mask=kpm))
    got = dilax.dilated_attention(q, k, v, settings=s, attention_mask=mask)
    kw = dilax.dilated_attention(q, k, v, (8, 32), (1, 2), is_causal=True,
                                 query_seq_lengths=jnp.array([20, 32]), key_padding_mask=kpm)
    np.testing.assert_array_equal(got, kw)
    # the oracle: the configuration's counts, rows past the query length and the padded keys
    # get no weight
    weights = (dilated_counts(32, 4, (8, 32), (1, 2), "mixture", True)[None]
               * (np.arange(32)[None] < np.array([[20], [32]]))[:, None, :, None]
               * np.asarray(kpm)[:, None, None, :])
    assert_scaled_close(got, oracle_attention(q, k, v, weights, 8 ** -0.5).out, FP32)
    # mask= is the deprecated spelling of attention_mask= (the same program); a dense boolean
    # array there (jax.nn's and Flax's mask=) is refused by name
    with pytest.warns(DeprecationWarning, match="pass it as attention_mask="):
        old = dilax.dilated_attention(q, k, v, settings=s, mask=mask)
    np.testing.assert_array_equal(old, got)
    with pytest.raises(TypeError, match="pass a dilax.AttentionMask as attention_mask="):
        dilax.dilated_attention(q, k, v, settings=s, mask=np.ones((2, 1, 32, 32), bool))
    with pytest.raises(TypeError, match="give the AttentionMask once"):
        dilax.dilated_attention(q, k, v, settings=s, mask=mask, attention_mask=mask)
    with pytest.raises(TypeError, match="either as attention_mask= or as keywords"):
        dilax.dilated_attention(q, k, v, settings=s, attention_mask=mask, key_padding_mask=kpm)
    with pytest.raises(ValueError, match=r"mask.query_seq_lengths must have shape \(b,\)"):
        dilax.dilated_attention(q[:1], k[:1], v[:1], settings=s, attention_mask=mask)


# -- validated once ------------------------------------------------------------------------


def _count(monkeypatch, name):
    calls = []
    real = getattr(V, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(V, name, counted)
    return calls


def test_each_public_path_validates_once(monkeypatch):
    """Following ``q`` from each public dilated path enters the checks once: ``check_qkv``
    (the arrays) and ``check_branches`` (the settings) run once per call, on the sharded path
    too (it used to validate again inside ``shard_map``)."""
    q, k, v, _ = _qkv()
    sp = SequenceParallel(_mesh(), seq_axis="sp", layout="zigzag")
    lengths = dict(query_seq_lengths=jnp.array([40, 64]), key_value_seq_lengths=[50, 64])
    calls = {
        "dilated_attention": lambda: dilax.dilated_attention(q, k, v, **CFG, **lengths),
        "sequence_parallel=": lambda: dilax.dilated_attention(
            q, k, v, **CFG, **lengths, local_window=4, sequence_parallel=sp),
        "sharded_dilated_attention": lambda: dilax.sharded_dilated_attention(
            q, k, v, **CFG, **lengths, mesh=sp.mesh, layout="zigzag", local_window=4),
    }
    for label, call in calls.items():
        qkv, branches = _count(monkeypatch, "check_qkv"), _count(monkeypatch, "check_branches")
        jax.eval_shape(call)  # validation runs while tracing; nothing needs compiling
        assert (len(qkv), len(branches)) == (1, 1), label
        monkeypatch.undo()


# -- sequence_parallel= --------------------------------------------------------------------


def _vjp_program(f):
    """``jit((q, k, v, g) -> (f(q, k, v), dq, dk, dv))``, cotangent ``g``."""
    def run(q, k, v, g):
        out, vjp = jax.vjp(f, q, k, v)
        return (out, *vjp(g))
    return jax.jit(run)


def assert_same_program(a, b, *args):
    """Two jitted functions lower to the same StableHLO (then XLA compiles them to the same
    executable and their results are bitwise equal): one compile instead of two."""
    text = a.lower(*args).as_text()
    assert "collective_permute" in text or "all_to_all" in text or "ppermute" in text
    assert text == b.lower(*args).as_text()


# Both cases lower the forward-and-gradient program of both entries (no compile) and compare
# them. Values: grouped/contiguous compiles that program and checks output and gradients;
# mixture/zigzag compiles the forward only (a zigzag causal backward is ~3x the compile of the
# contiguous one), its gradients being those of the alias, which test_ring.py's
# test_zigzag_layout checks (mixture, causal, zigzag, 4 devices) against the oracle.
# Two devices: the entries' programs (the point here) and both kinds of branch (one within a
# shard, one across them); the ring's hops over 4 and 8 devices run in test_ring.py and below.
@pytest.mark.parametrize("mode, layout, grads", [("mixture", "zigzag", False),
                                                 ("grouped", "contiguous", True)])
def test_sequence_parallel_equals_oracle_and_alias(mode, layout, grads):
    """``dilated_attention(..., sequence_parallel=...)`` lowers to the very program of
    ``sharded_dilated_attention``, forward and gradients (so bitwise the same results), and
    equals the float64 oracle (fp32 tolerance; the single-device op is checked against the
    same oracle in test_dilated.py, so no second program is compiled here)."""
    q, k, v, g = _qkv()
    sp = SequenceParallel(_mesh(2), layout=layout)
    settings = DilatedSettings(**CFG, mode=mode, is_causal=True)
    f_ring = lambda q, k, v: dilax.dilated_attention(  # noqa: E731
        q, k, v, settings=settings, sequence_parallel=sp)
    ring = _vjp_program(f_ring)
    alias = _vjp_program(lambda q, k, v: dilax.sharded_dilated_attention(
        q, k, v, **CFG, mode=mode, is_causal=True, mesh=sp.mesh, layout=layout))
    assert_same_program(ring, alias, q, k, v, g)  # so bitwise the same results
    ref = dilated_oracle(q, k, v, CFG["segment_lengths"], CFG["dilation_rates"], mode, True,
                         dout=g)
    if grads:
        out, *grads = ring(q, k, v, g)
        assert_matches(out, grads, ref)
    else:
        assert_scaled_close(jax.jit(f_ring)(q, k, v), ref.out, FP32)


def test_sequence_parallel_with_lengths_and_window_equals_oracle():
    """Valid lengths (a mask value) and the local window on 8 devices: forward and gradients
    equal the float64 oracle; the lengths are traced, so a second set runs on the same
    compiled program."""
    q, k, v, g = _qkv(seed=1)
    settings = DilatedSettings(**CFG, local_window=5)
    sp = SequenceParallel(_mesh(8))

    @jax.jit
    def run(q, k, v, g, mask):  # the mask is a pytree: its lengths are traced
        out, vjp = jax.vjp(lambda q, k, v: dilax.dilated_attention(
            q, k, v, settings=settings, attention_mask=mask, sequence_parallel=sp), q, k, v)
        return out, vjp(g)

    for q_len, kv_len in (([37, 64], [50, 20]), ([64, 5], [0, 64])):
        mask = AttentionMask.build(q, query_seq_lengths=q_len, key_value_seq_lengths=kv_len)
        out, grads = run(q, k, v, g, mask)
        assert_matches(out, grads, ring_oracle.dilated(
            q, k, v, g, CFG["segment_lengths"], CFG["dilation_rates"], False,
            np.asarray(q_len), np.asarray(kv_len), window=5), err_msg=f"{q_len} {kv_len}")


def test_sequence_parallel_errors():
    q, k, v, _ = _qkv()
    sp = SequenceParallel(_mesh())
    with pytest.raises(ValueError, match="implementation must be None or 'xla'"):
        dilax.dilated_attention(q, k, v, **CFG, implementation="reference", sequence_parallel=sp)
    with pytest.raises(ValueError, match="cuDNN's fused attention takes no query/key"):
        dilax.dilated_attention(q, k, v, **CFG, implementation="cudnn", local_window=4,
                                sequence_parallel=sp)
    with pytest.raises(ValueError, match="key_padding_mask is not supported with sequence"):
        dilax.dilated_attention(q, k, v, **CFG, key_padding_mask=jnp.ones((2, 64), bool),
                                sequence_parallel=sp)
    with pytest.raises(ValueError, match="seq_len n=62 must be divisible by the size 4 .*pad q, "
                       "k, v to n=64 and pass query_seq_lengths=key_value_seq_lengths=62"):
        dilax.dilated_attention(q[:, :62], k[:, :62], v[:, :62], **CFG, sequence_parallel=sp)
    with pytest.raises(ValueError, match="local_window=17 must be at most the local chunk"):
        dilax.dilated_attention(q, k, v, **CFG, local_window=17, sequence_parallel=sp)


def test_block_sparse_sequence_parallel_equals_oracle_and_alias():
    """``block_sparse_attention(..., sequence_parallel=...)``: forward and gradients equal the
    float64 oracle of the pattern's token mask (fp32), and bitwise the program of
    ``sharded_block_sparse_attention``."""
    q, k, v, g = _qkv(seed=2)
    pattern = dilax.patterns.local_window(64, 8, 8)
    sp = SequenceParallel(_mesh())
    ring = _vjp_program(lambda q, k, v: dilax.block_sparse_attention(
        q, k, v, pattern, is_causal=True, sequence_parallel=sp))
    alias = _vjp_program(lambda q, k, v: dilax.sharded_block_sparse_attention(
        q, k, v, pattern, is_causal=True, mesh=sp.mesh))
    assert_same_program(ring, alias, q, k, v, g)  # so bitwise the same results
    out, *grads = ring(q, k, v, g)
    assert_matches(out, grads, ring_oracle.block_sparse(q, k, v, g, pattern, True))


def test_block_sparse_sequence_parallel_validates_once_and_errors(monkeypatch):
    q, k, v, _ = _qkv()
    pattern = dilax.patterns.local_window(64, 8, 8)
    sp = SequenceParallel(_mesh())
    calls = _count(monkeypatch, "check_qkv")
    jax.eval_shape(lambda: dilax.block_sparse_attention(q, k, v, pattern, sequence_parallel=sp))
    assert len(calls) == 1
    with pytest.raises(ValueError, match=r"query_seq_lengths must lie in \[0, n=64\]"):
        dilax.block_sparse_attention(q, k, v, pattern, sequence_parallel=sp,
                                     query_seq_lengths=[3, 65])
    with pytest.raises(ValueError, match="implementation must be None or 'xla'"):
        dilax.block_sparse_attention(q, k, v, pattern, sequence_parallel=sp,
                                     implementation="pallas")
    # the ring's hops on the Pallas kernel (interpreter): validated once as well
    before = len(calls)
    jax.eval_shape(lambda: dilax.block_sparse_attention(q, k, v, pattern, sequence_parallel=sp,
                                                        implementation="pallas", interpret=True))
    assert len(calls) == before + 1
    with pytest.raises(ValueError, match=r"layout must be one of \('contiguous',\)"):
        dilax.block_sparse_attention(q, k, v, pattern, sequence_parallel=SequenceParallel(
            sp.mesh, layout="zigzag"))
    with pytest.raises(ValueError, match=r"\(n/P = 8\) must be a multiple of the pattern's"):
        dilax.block_sparse_attention(q, k, v, dilax.patterns.local_window(64, 16, 8),
                                     sequence_parallel=SequenceParallel(_mesh(8)))


def test_modules_take_settings_and_mask_values():
    """``DilatedAttention(settings=...)`` / ``MultiheadDilatedAttention(settings=...)`` with
    ``mask=`` run the functional op's program (bitwise) and equal the keyword modules."""
    from flax import nnx

    from dilax.nn import DilatedAttention, MultiheadDilatedAttention

    q, k, v, _ = _qkv(n=32, seed=3)
    s = DilatedSettings((8, 32), (1, 2), is_causal=True)
    mask = AttentionMask.build(q, query_seq_lengths=[30, 17])
    want = dilax.dilated_attention(q, k, v, settings=s, attention_mask=mask)
    np.testing.assert_array_equal(
        DilatedAttention(settings=s)(q, k, v, attention_mask=mask), want)
    with pytest.raises(TypeError, match="settings= holds the whole configuration"):
        DilatedAttention((8,), (1,), settings=s)
    x = jax.random.normal(jax.random.PRNGKey(4), (2, 32, 16))
    by_value = MultiheadDilatedAttention(16, 4, settings=s, rngs=nnx.Rngs(0))
    by_keywords = MultiheadDilatedAttention(16, 4, (8, 32), (1, 2), rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(
        by_value(x, attention_mask=mask),
        by_keywords(x, is_causal=True, query_seq_lengths=jnp.array([30, 17])))
