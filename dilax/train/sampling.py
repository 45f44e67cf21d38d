"""Sampling text from a trained character LM (with :func:`dilax.models.generate`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dilax.models import LongNetLM, generate
from dilax.train.config import CharTokenizer


@nnx.jit
def _next_logits(model: LongNetLM, x: jax.Array, pos: jax.Array) -> jax.Array:
    return model(x, deterministic=True)[0, pos].astype(jnp.float32)


def _generate_recompute(model: LongNetLM, padded: np.ndarray, length: int, new: int,
                        temperature: float, key: jax.Array, top_k: int | None) -> list[int]:
    """``new`` tokens after ``padded[0, :length]``, each from a forward pass over the whole
    right-padded window (for models without KV-cache decoding: ``--attention
    block-sparse``); the same sampling rule as :func:`dilax.models.generate`."""
    x = np.zeros((1, padded.shape[1] + new), np.int32)
    x[0, :length] = padded[0, :length]
    out = []
    for i in range(new):
        logits = _next_logits(model, jnp.asarray(x), jnp.int32(length + i - 1))
        if temperature <= 0:
            tok = int(jnp.argmax(logits))
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = jnp.sort(logits)[-top_k]
                logits = jnp.where(logits < kth, -jnp.inf, logits)
            tok = int(jax.random.categorical(jax.random.fold_in(key, i), logits))
        x[0, length + i] = tok
        out.append(tok)
    return out


def sample(model: LongNetLM, tok: CharTokenizer, prompt: str, num_tokens: int, seq_len: int,
           temperature: float, key: jax.Array, top_k: int | None = None) -> str:
    """Samples ``num_tokens`` characters after ``prompt`` in windows of ``seq_len`` (the
    training length), with a KV cache (:func:`dilax.models.generate`; a block-sparse model,
    which has none, recomputes the window for every token).

    Every window is a ``seq_len`` window as in training (XPOS positions included): the model
    sees the window's tokens so far, exactly as if it ran on it right-padded to ``seq_len``
    (causal: the padding never matters). The first window holds the last ``seq_len - 1``
    characters of the prompt; when it is full, the next one starts from the last
    ``seq_len // 2`` characters, so every token sees at least that much context.
    ``temperature <= 0`` is greedy; ``top_k`` restricts draws to the ``top_k`` most likely
    characters (:func:`dilax.models.generate`); window ``i`` samples with ``fold_in(key, i)``.
    """
    ids = list(tok.encode(prompt))
    if not ids:
        raise ValueError("prompt must not be empty")
    if top_k is not None:
        top_k = min(top_k, model.num_tokens)  # larger means all of them
    target = len(ids) + num_tokens
    keep, window = max(1, seq_len - 1), 0
    while len(ids) < target:
        ctx = ids[-keep:]
        new = min(target - len(ids), seq_len - len(ctx))
        # pad the prompt so that the cache window (prompt + new) is exactly seq_len long
        padded = np.zeros((1, seq_len - new), np.int32)
        padded[0, : len(ctx)] = ctx
        if model.config.block_sparse is not None:  # no KV-cache decoding
            ids += _generate_recompute(model, padded, len(ctx), new,
                                       max(float(temperature), 0.0),
                                       jax.random.fold_in(key, window), top_k)
        else:
            out = generate(model, padded, new, temperature=max(float(temperature), 0.0),
                           key=jax.random.fold_in(key, window), top_k=top_k,
                           prompt_lengths=[len(ctx)])
            ids += np.asarray(out)[0, len(ctx): len(ctx) + new].tolist()
        keep, window = max(1, seq_len // 2), window + 1
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
