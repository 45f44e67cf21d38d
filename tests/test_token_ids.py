"""Token ids outside ``[0, num_tokens)`` (issue 30): concrete ids raise naming the id, its
position and the vocabulary size; traced ids are clipped, and never poison other positions."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dilax.models import LongNetConfig, LongNetLM, check_token_ids, generate

V = 50


@pytest.fixture(scope="module")
def lm():
    return LongNetLM(V, config=LongNetConfig(32, 2, 64, (4, 8), (1, 2)), num_encoder_layers=0,
                     num_decoder_layers=2, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("bad, where", [(60, (0, 2)), (-2, (0, 1)), (V, (1, 3))])
def test_eager_call_names_the_id_its_position_and_the_vocabulary(lm, bad, where):
    tokens = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    tokens[where] = bad
    msg = f"token id {bad} at position {where} is outside the vocabulary [0, {V})"
    with pytest.raises(ValueError, match=re.escape(msg)):
        lm(jnp.asarray(tokens))


def test_generate_refuses_bad_prompt_ids_but_not_padding(lm):
    with pytest.raises(ValueError, match=re.escape(
            "token id 120 at position (0, 0) is outside the vocabulary [0, 50) "
            "(num_tokens=50); 14 bad id(s)")):
        generate(lm, jnp.full((2, 7), 120), 5)
    with pytest.raises(ValueError, match=r"token id -1 at position \(1, 2\)"):
        generate(lm, jnp.array([[1, 2, 3], [4, 5, -1]]), 2)
    # right padding past prompt_lengths is never a prompt token: anything goes there
    padded = generate(lm, jnp.array([[1, 2, -7], [4, 5, 99]]), 3, prompt_lengths=[2, 2])
    clean = generate(lm, jnp.array([[1, 2, 0], [4, 5, 0]]), 3, prompt_lengths=[2, 2])
    np.testing.assert_array_equal(np.asarray(padded), np.asarray(clean))


def test_generate_refuses_a_window_that_cannot_fit(lm):
    with pytest.raises(ValueError, match=r"p \+ max_new_tokens = 2 \+ 2147483647 positions "
                                         r"do not fit a KV cache \(at most 2147483647\)"):
        generate(lm, jnp.array([[1, 2]]), 2**31 - 1)


def test_jitted_bad_ids_are_clipped_and_poison_no_other_position(lm):
    call = nnx.jit(lambda m, t: m(t))
    j = 5  # the bad id's position
    rows = np.tile(np.array([3, 1, 4, 1, 5, 9, 2, 6]), (4, 1))
    rows[0, j], rows[1, j], rows[2, j], rows[3, j] = 60, -3, V - 1, 0
    out = np.asarray(call(lm, jnp.asarray(rows)))
    assert np.isfinite(out).all()
    ref = rows.copy()
    ref[:, j] = 7  # the same rows with a valid (different) id there
    ref_out = np.asarray(call(lm, jnp.asarray(ref)))
    # causal: positions before the bad id do not see it, so they are exactly unchanged
    np.testing.assert_array_equal(out[:, :j], ref_out[:, :j])
    # the documented behaviour: 60 reads as num_tokens - 1, -3 as 0
    np.testing.assert_array_equal(out[0], out[2])
    np.testing.assert_array_equal(out[1], out[3])


def test_traced_ids_are_clipped_and_bad_shapes_refused():
    tokens = jnp.array([[3, 70, -1]])
    np.testing.assert_array_equal(
        np.asarray(nnx.jit(lambda t: check_token_ids(t, V))(tokens)), [[3, V - 1, 0]])
    with pytest.raises(ValueError, match=r"integer array of shape \(batch, seq_len\)"):
        check_token_ids(jnp.ones((2, 3)), V)
