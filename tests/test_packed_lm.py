"""Packed documents in the model and the loss (issue 28): a packed LongNetLM row equals each
document computed alone, positions restart at every document, and ``lm_loss`` on a packed
batch is the token-weighted mean of the documents' own losses."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dilax.models import LongNetConfig, LongNetLM
from dilax.train.steps import lm_loss

N, VOCAB = 16, 11
# documents of each row: shorter than, equal to and longer than the segments (4, 8), one token
DOCS = ((5, 1, 10), (3, 13))


class _Stop(Exception):
    pass


def _layout():
    """``tokens (2, N)``, ``segment_ids (2, N)``, documents ``[(row, start, length)]``."""
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (2, N), 0, VOCAB))
    ids = np.zeros((2, N), np.int32)
    docs = []
    for row, lengths in enumerate(DOCS):
        start = 0
        for i, length in enumerate(lengths):
            ids[row, start:start + length] = 7 * i + 3  # any ints: a run is a document
            docs.append((row, start, length))
            start += length
    return tokens, ids, docs


@pytest.fixture(scope="module")
def packed():
    """The logits, in one compiled program: packed, every document alone (each at the start
    of its own row, the rest padding: with ``seq_lengths`` the valid prefix equals the
    unpadded document's result) and the rows without ``segment_ids``."""
    cfg = LongNetConfig(16, 2, 32, (4, 8), (1, 2), num_kv_heads=1, implementation="xla")
    model = LongNetLM(VOCAB, config=cfg, num_encoder_layers=0, num_decoder_layers=1,
                      rngs=nnx.Rngs(0))
    tokens, ids, docs = _layout()
    rows = np.zeros((len(docs), N), np.int32)
    for i, (row, start, length) in enumerate(docs):
        rows[i, :length] = tokens[row, start:start + length]
    lengths = np.asarray([length for _, _, length in docs], np.int32)

    @nnx.jit
    def run(model, x, ids, rows, lengths):
        return dict(packed=model(x, deterministic=True, segment_ids=ids),
                    alone=model(rows, deterministic=True, seq_lengths=lengths),
                    whole=model(x, deterministic=True))

    out = run(model, jnp.asarray(tokens), jnp.asarray(ids), jnp.asarray(rows),
              jnp.asarray(lengths))
    return model, tokens, ids, docs, jax.tree.map(np.asarray, out)


def test_packed_logits_equal_each_document_alone(packed):
    _, _, _, docs, out = packed
    for i, (row, start, length) in enumerate(docs):
        np.testing.assert_allclose(out["packed"][row, start:start + length],
                                   out["alone"][i, :length], rtol=2e-5, atol=2e-5,
                                   err_msg=f"document {i}")
    # without segment_ids the documents do interact (the comparison can fail)
    assert np.abs(out["whole"][0, 6:16] - out["alone"][2, :10]).max() > 1e-3


def test_positions_restart_at_every_document(packed, monkeypatch):
    import dilax.models.layers as layers

    model, tokens, ids, _, _ = packed
    seen = []

    def spy(q, k, positions, **kw):  # the first layer's positions; no attention run
        seen.append(np.asarray(positions))
        raise _Stop

    monkeypatch.setattr(layers, "rotary_qk", spy)
    for positions in (None, np.tile(np.arange(N), (2, 1))):  # explicit positions win
        with pytest.raises(_Stop):
            model(jnp.asarray(tokens), deterministic=True, segment_ids=jnp.asarray(ids),
                  positions=positions)
    np.testing.assert_array_equal(seen[0], [list(range(5)) + [0] + list(range(10)),
                                            list(range(3)) + list(range(13))])
    np.testing.assert_array_equal(seen[1], np.tile(np.arange(N), (2, 1)))


def _expected_loss(tokens, docs, alone, valid=(N, N)):
    """Token-weighted mean of each document's own loss (float64), the documents cut at the
    rows' valid ends ``valid``."""
    total, count = 0.0, 0
    for i, (row, start, length) in enumerate(docs):
        m = min(length, valid[row] - start) - 1  # targets of the document's valid tokens
        if m <= 0:
            continue
        logits = alone[i, :m].astype(np.float64)
        top = logits.max(-1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        total -= logp[np.arange(m), tokens[row, start + 1:start + m + 1]].sum()
        count += m
    return total / count


def test_lm_loss_of_a_packed_batch_is_the_token_weighted_mean_of_document_losses(packed):
    _, tokens, ids, docs, out = packed
    # the model's packed logits (equal to each document's alone, tested above) into lm_loss
    model = lambda x, **kw: jnp.asarray(out["packed"])  # noqa: E731
    x = jnp.asarray(tokens)
    y = jnp.roll(x, -1, axis=1)  # the next token in the row; across documents: dropped
    loss = lm_loss(model, x, y, None, True, segment_ids=jnp.asarray(ids))
    np.testing.assert_allclose(loss, _expected_loss(tokens, docs, out["alone"]), rtol=1e-5)
    # valid lengths on top: a row ends at its valid end (row 1's last 4 tokens are padding:
    # its second document keeps 13 - 4 - 1 = 8 targets)
    cut = lm_loss(model, x, y, None, True, lengths=jnp.asarray([N, N - 4]),
                  segment_ids=jnp.asarray(ids))
    np.testing.assert_allclose(cut, _expected_loss(tokens, docs, out["alone"], (N, N - 4)),
                               rtol=1e-5)
