"""Sampling text from a trained character LM (with :func:`dilax.models.generate`)."""

from __future__ import annotations

import jax
import numpy as np

from dilax.models import LongNetLM, generate
from dilax.train.config import CharTokenizer


def sample(model: LongNetLM, tok: CharTokenizer, prompt: str, num_tokens: int, seq_len: int,
           temperature: float, key: jax.Array) -> str:
    """Samples ``num_tokens`` characters after ``prompt`` in windows of ``seq_len`` (the
    training length), with a KV cache (:func:`dilax.models.generate`).

    Every window is a ``seq_len`` window as in training (XPOS positions included): the model
    sees the window's tokens so far, exactly as if it ran on it right-padded to ``seq_len``
    (causal: the padding never matters). The first window holds the last ``seq_len - 1``
    characters of the prompt; when it is full, the next one starts from the last
    ``seq_len // 2`` characters, so every token sees at least that much context.
    ``temperature <= 0`` is greedy; window ``i`` samples with ``fold_in(key, i)``.
    """
    ids = list(tok.encode(prompt))
    if not ids:
        raise ValueError("prompt must not be empty")
    target = len(ids) + num_tokens
    keep, window = max(1, seq_len - 1), 0
    while len(ids) < target:
        ctx = ids[-keep:]
        new = min(target - len(ids), seq_len - len(ctx))
        # pad the prompt so that the cache window (prompt + new) is exactly seq_len long
        padded = np.zeros((1, seq_len - new), np.int32)
        padded[0, : len(ctx)] = ctx
        out = generate(model, padded, new, temperature=max(float(temperature), 0.0),
                       key=jax.random.fold_in(key, window), prompt_lengths=[len(ctx)])
        ids += np.asarray(out)[0, len(ctx): len(ctx) + new].tolist()
        keep, window = max(1, seq_len // 2), window + 1
    return tok.decode(ids)
