"""Sampling text from a trained character LM."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dilax.models import LongNetLM
from dilax.train.config import CharTokenizer


@nnx.jit
def _next_logits(model: LongNetLM, window: jax.Array, index: jax.Array) -> jax.Array:
    return model(window, deterministic=True)[0, index].astype(jnp.float32)


def pick_token(logits: jax.Array, temperature: float, key: jax.Array,
               top_k: int | None = None) -> int:
    """The next id from float32 ``logits (vocab,)``: argmax at ``temperature <= 0``, else a
    draw from ``softmax(logits / temperature)`` restricted to the ``top_k`` largest logits
    (all of them when ``top_k`` is ``None``)."""
    if temperature <= 0:
        return int(jnp.argmax(logits))
    if top_k is not None and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][-1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return int(jax.random.categorical(key, logits / temperature))


def sample(model: LongNetLM, tok: CharTokenizer, prompt: str, num_tokens: int, seq_len: int,
           temperature: float, key: jax.Array, top_k: int | None = None) -> str:
    """Samples ``num_tokens`` characters after ``prompt`` with a sliding ``seq_len`` window.

    The window is right-padded while shorter than ``seq_len``; the model is causal, so the
    padding never affects the logits that are read. ``top_k``: see :func:`pick_token`.
    """
    ids = list(tok.encode(prompt))
    if not ids:
        raise ValueError("prompt must not be empty")
    for i in range(num_tokens):
        ctx = ids[-seq_len:]
        window = np.zeros((1, seq_len), np.int32)
        window[0, : len(ctx)] = ctx
        logits = _next_logits(model, jnp.asarray(window), jnp.asarray(len(ctx) - 1))
        ids.append(pick_token(logits, temperature, jax.random.fold_in(key, i), top_k))
    return tok.decode(ids)


def sample_text(loaded, prompt: str, num_tokens: int, *, temperature: float = 0.8,
                top_k: int | None = None, seed: int = 0) -> str:
    """``prompt`` and ``num_tokens`` sampled characters from a checkpoint's model.

    Args:
      loaded: what :func:`dilax.train.load_model` returns (model, tokenizer, configs).
      prompt: non-empty; every character must be in the model's vocabulary.
      num_tokens: characters to generate (>= 0).
      temperature: softmax temperature; ``<= 0`` is greedy (argmax).
      top_k: sample among the ``top_k`` most likely characters only (``None``: all).
      seed: the random key; the same seed gives the same text.

    Raises:
      ValueError: naming the argument (empty prompt, characters outside the vocabulary, a
        negative ``num_tokens`` or a ``top_k`` < 1).
    """
    if not prompt:
        raise ValueError("prompt must not be empty")
    missing = sorted(set(prompt) - set(loaded.tokenizer.vocab))
    if missing:
        raise ValueError(f"prompt has characters the model was not trained on: {missing}")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)
                              or top_k < 1):
        raise ValueError(f"top_k must be an int >= 1 or None, got {top_k!r}")
    return sample(loaded.model, loaded.tokenizer, prompt, num_tokens,
                  loaded.train_config.seq_len, temperature, jax.random.key(seed), top_k)
