"""Autoregressive generation with a KV cache: one prefill, then a compiled decode loop.

:func:`generate` runs ``model.decode`` (:meth:`dilax.models.LongNetLM.decode`) once over the
prompt and then once per new token inside ``lax.fori_loop``, all under one ``jax.jit`` (one
compile per prompt shape and static settings). A step costs what a step over a few
thousand positions costs, whatever the context (:func:`dilax.dilated_attention_decode`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from dilax import _validation as V
from dilax.models.tokens import check_token_ids

__all__ = ["generate"]

_MAX_WINDOW = np.iinfo(np.int32).max


def generate(
    model,
    prompt: jax.Array,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    key: jax.Array | None = None,
    prompt_lengths: jax.Array | None = None,
) -> jax.Array:
    """Continues every row of ``prompt`` by ``max_new_tokens`` tokens.

    Args:
      model: a :class:`dilax.models.LongNetLM` (anything with ``init_cache(batch, max_len)``
        and ``decode(tokens, cache) -> (logits, cache)``), causal.
      prompt: ``(b, p)`` int tokens, ``p >= 1``.
      max_new_tokens: number of tokens to generate (static int >= 0).
      temperature: ``0`` (default): greedy (argmax); ``> 0``: sample from
        ``softmax(logits / temperature)``.
      top_k: sample only among the ``top_k`` most likely tokens (``temperature > 0``; tokens
        tied with the ``top_k``-th logit are kept too). temperature and top_k are traced:
        changing them does not recompile.
      key: PRNG key, required when ``temperature > 0`` (step ``i`` uses
        ``fold_in(key, i)``).
      prompt_lengths: ``(b,)`` ints in ``[1, p]``: row ``i``'s prompt is
        ``prompt[i, :prompt_lengths[i]]`` (right padding); default ``p`` for every row.

    Returns:
      ``(b, p + max_new_tokens)`` int32: row ``i`` holds its prompt, then its
      ``max_new_tokens`` new tokens, then zeros (when its prompt is shorter than ``p``).
      The logits of every step are those of ``model(prefix)`` at its last position, the
      row's tokens so far (positions from 0; a causal model's outputs do not depend on what
      follows): greedy generation equals the greedy loop over full recomputation of the
      growing prefix, and ``max_new_tokens=k`` gives a prefix of ``max_new_tokens=k' > k``.
    """
    prompt = jnp.asarray(prompt)
    if prompt.ndim != 2 or not jnp.issubdtype(prompt.dtype, jnp.integer) or prompt.shape[1] < 1:
        raise ValueError(f"prompt must be an int array of shape (batch, p) with p >= 1, got "
                         f"{prompt.dtype}{tuple(prompt.shape)}")
    b, p = prompt.shape
    max_new_tokens = V.static_int(max_new_tokens, "max_new_tokens")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    temperature = V.check_real(temperature, "temperature")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None:
        top_k = V.static_int(top_k, "top_k")
        if not 1 <= top_k <= model.num_tokens:
            raise ValueError(f"top_k must be in [1, num_tokens={model.num_tokens}], got {top_k}")
    if temperature > 0 and key is None:
        raise ValueError("key must be given when temperature > 0 (sampling)")
    if prompt_lengths is None:
        lengths = jnp.full((b,), p, jnp.int32)
    else:
        lengths = jnp.asarray(prompt_lengths, jnp.int32)
        if lengths.shape != (b,):
            raise ValueError(f"prompt_lengths must have shape (batch,) = ({b},), got "
                             f"{lengths.shape}")
        if not isinstance(lengths, jax.core.Tracer):
            values = np.asarray(lengths)
            if values.min() < 1 or values.max() > p:
                raise ValueError(f"prompt_lengths must be in [1, p={p}], got {values.tolist()}")
    check_token_ids(prompt, model.num_tokens, lengths)  # ValueError naming a bad id
    if p + max_new_tokens > _MAX_WINDOW:  # the cache's positions are int32
        raise ValueError(f"p + max_new_tokens = {p} + {max_new_tokens} positions do not fit a "
                         f"KV cache (at most {_MAX_WINDOW}): ask for fewer new tokens")
    if key is None:
        key = jax.random.PRNGKey(0)  # unused when greedy
    graphdef, state = nnx.split(model)
    # temperature and top_k are traced: one compile serves every sampling setting
    return _generate(graphdef, state, prompt.astype(jnp.int32), lengths, key,
                     jnp.float32(temperature), jnp.int32(top_k or model.num_tokens),
                     max_new_tokens)


def pick_tokens(logits: jax.Array, key: jax.Array, temperature: jax.Array | float,
                top_k: jax.Array | int) -> jax.Array:
    """Next ids ``(b,)`` int32 from float32 ``logits (b, vocab)``.

    ``temperature <= 0``: argmax. Otherwise a draw from ``softmax(logits / temperature)``
    restricted to the logits at least as large as the ``top_k``-th largest (ties kept). Both may
    be traced (one compile for every setting)."""
    greedy = jnp.argmax(logits, axis=-1)
    kth = jnp.sort(logits, axis=-1)[:, -top_k][:, None]  # the top_k-th largest logit
    scaled = jnp.where(logits < kth, -jnp.inf,
                       logits / jnp.where(temperature > 0, temperature, 1.0))
    sampled = jax.random.categorical(key, scaled)
    return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(0, 7))
def _generate(graphdef, state, prompt, lengths, key, temperature, top_k, max_new):
    model = nnx.merge(graphdef, state)
    b, p = prompt.shape
    max_len = p + max_new
    rows = jnp.arange(b)
    out = jnp.where(jnp.arange(max_len)[None, :] < lengths[:, None],
                    jnp.pad(prompt, ((0, 0), (0, max_new))), 0)
    if max_new == 0:
        return out
    # Prefill the whole padded prompt, then rewind each row to its own length: entries past
    # it are overwritten by the decode steps before they are ever read.
    logits, cache = model.decode(prompt, model.init_cache(b, max_len))
    cache = cache.with_lengths(lengths)
    last = logits[rows, lengths - 1].astype(jnp.float32)

    def choose(logits, i):
        return pick_tokens(logits, jax.random.fold_in(key, i), temperature, top_k)

    def step(i, carry):
        cache, out, last = carry
        tok = choose(last, i)
        out = out.at[rows, lengths + i].set(tok)
        logits, cache = model.decode(tok[:, None], cache)
        return cache, out, logits[:, 0].astype(jnp.float32)

    _, out, last = lax.fori_loop(0, max_new - 1, step, (cache, out, last))
    return out.at[rows, lengths + max_new - 1].set(choose(last, max_new - 1))
