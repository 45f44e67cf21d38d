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


def sample(model: LongNetLM, tok: CharTokenizer, prompt: str, num_tokens: int, seq_len: int,
           temperature: float, key: jax.Array) -> str:
    """Samples ``num_tokens`` characters after ``prompt`` with a sliding ``seq_len`` window.

    The window is right-padded while shorter than ``seq_len``; the model is causal, so the
    padding never affects the logits that are read.
    """
    ids = list(tok.encode(prompt))
    if not ids:
        raise ValueError("prompt must not be empty")
    for i in range(num_tokens):
        ctx = ids[-seq_len:]
        window = np.zeros((1, seq_len), np.int32)
        window[0, : len(ctx)] = ctx
        logits = _next_logits(model, jnp.asarray(window), jnp.asarray(len(ctx) - 1))
        if temperature <= 0:
            nxt = int(jnp.argmax(logits))
        else:
            nxt = int(jax.random.categorical(jax.random.fold_in(key, i), logits / temperature))
        ids.append(nxt)
    return tok.decode(ids)
