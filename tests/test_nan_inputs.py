"""What each core does with a NaN in q, k or v (docs/semantics.md, "Numerics"; issue 30):
a NaN query or key, or a NaN value without a causal mask, reaches exactly the queries that
attend it; under a causal mask the blockwise cores (xla, pallas) also reach the earlier queries
whose block tile holds it, the reference does not; padded keys reach nothing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dilax
from dilax import dilated_counts

N, H, D = 64, 2, 8
CORES = {"reference": dict(implementation="reference"), "xla": dict(implementation="xla"),
         "pallas": dict(implementation="pallas", interpret=True)}


def _qkv():
    ks = jax.random.split(jax.random.PRNGKey(3), 3)
    return [jax.random.normal(x, (1, N, H, D)) for x in ks]


def _poisoned(which: str, pos: int, ws, rs, causal: bool, core: str, **kw) -> np.ndarray:
    """``(N, H)`` bool: the outputs that are not finite with a NaN at ``which[pos]``."""
    q, k, v = _qkv()
    x = dict(q=q, k=k, v=v)
    x[which] = x[which].at[0, pos].set(jnp.nan)
    out = dilax.dilated_attention(x["q"], x["k"], x["v"], ws, rs, is_causal=causal,
                                  **CORES[core], **kw)
    return ~np.isfinite(np.asarray(out)[0]).all(-1)


def _attending(pos: int, ws, rs, causal: bool) -> np.ndarray:
    """``(N, H)`` bool: the queries that attend key ``pos`` (SPEC's count matrix)."""
    return np.asarray(dilated_counts(N, H, ws, rs, "mixture", causal))[:, :, pos].T > 0


@pytest.mark.parametrize("core", sorted(CORES))
def test_the_issue_case_nan_in_v10_causal_one_segment(core):
    got = _poisoned("v", 10, (N,), (1,), True, core)
    rows = np.flatnonzero(got.any(-1))
    if core == "reference":  # exactly the queries that attend it
        np.testing.assert_array_equal(got, _attending(10, (N,), (1,), True))
        assert rows.tolist() == list(range(10, N))
    else:  # blockwise: the whole tile, default blocks cover the segment
        assert rows.tolist() == list(range(N)) and got.all()


@pytest.mark.parametrize("core", sorted(CORES))
def test_nan_query_key_and_non_causal_value_reach_exactly_the_attending_queries(core):
    ws, rs = (16, 32), (1, 2)
    np.testing.assert_array_equal(_poisoned("k", 10, ws, rs, True, core),
                                  _attending(10, ws, rs, True))
    np.testing.assert_array_equal(_poisoned("v", 10, ws, rs, False, core),
                                  _attending(10, ws, rs, False))
    only_row = np.zeros((N, H), bool)
    only_row[10] = True
    np.testing.assert_array_equal(_poisoned("q", 10, ws, rs, True, core), only_row)


def test_causal_nan_value_reaches_the_tiles_that_hold_it_and_no_other_segment():
    ws, rs = (16, 32), (1, 2)
    got, attending = (_poisoned("v", 10, ws, rs, True, "xla"), _attending(10, ws, rs, True))
    assert (got >= attending).all()  # every attending query, and more:
    # the queries before it in its segments (of the branches that read it), never beyond
    assert np.flatnonzero(got.any(-1)).max() < 32 and got[:10].any()
    # with 16 x 16 blocks only the query blocks from the key's block on compute its tile
    blocks = _poisoned("v", 40, (N,), (1,), True, "xla", block_sizes=dilax.BlockSizes(16, 16))
    assert np.flatnonzero(blocks.any(-1)).tolist() == list(range(32, N)) and blocks[32:].all()


@pytest.mark.parametrize("core", sorted(CORES))
def test_nan_in_a_padded_key_reaches_nothing(core):
    for causal in (False, True):
        got = _poisoned("v", 60, (N,), (1,), causal, core,
                        key_value_seq_lengths=jnp.array([50]))
        assert not got.any()


def test_an_infinite_value_acts_like_nan_blockwise_and_reaches_every_query_on_the_reference():
    ws, rs = (16, 32), (1, 2)
    q, k, v = _qkv()
    inf = v.at[0, 10].set(jnp.inf)
    out = {c: np.asarray(dilax.dilated_attention(q, k, inf, ws, rs, is_causal=True,
                                                 **CORES[c]))[0] for c in ("reference", "xla")}
    np.testing.assert_array_equal(~np.isfinite(out["xla"]).all(-1),
                                  _poisoned("v", 10, ws, rs, True, "xla"))
    assert not np.isfinite(out["reference"]).any(-1).any()


def test_dense_reference_keeps_the_reference_rule_for_a_causal_nan_value():
    """dot_product_attention's dense reference shares the dilated one's softmax
    (dilax.reference.dense_attention): a NaN value reaches exactly the queries that attend it."""
    q, k, v = _qkv()
    out = dilax.dot_product_attention(q, k, v.at[0, 10].set(jnp.nan), is_causal=True,
                                      implementation="reference")
    got = ~np.isfinite(np.asarray(out)[0]).all(-1)
    np.testing.assert_array_equal(got, _attending(10, (N,), (1,), True))
