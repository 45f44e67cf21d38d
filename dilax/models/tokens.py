"""Token ids: the one check of :class:`dilax.models.LongNetLM` and :func:`dilax.models.generate`.

Concrete ids (eager calls, ``generate``'s prompt, the CLIs) outside ``[0, num_tokens)`` raise a
``ValueError`` naming the first bad id, its position and the vocabulary size. Traced ids (under
``jax.jit``) cannot be checked: they are clipped to ``[0, num_tokens - 1]``, so a bad id reads
as the nearest valid one (negative: token 0; too large: token ``num_tokens - 1``). That is
deterministic and keeps every output finite: without it the embedding lookup fills NaN, which
the attention spreads to other positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["check_token_ids"]


def check_token_ids(tokens: jax.Array, num_tokens: int,
                    lengths: jax.Array | None = None) -> jax.Array:
    """Checks ``tokens (b, n)`` int against a vocabulary of ``num_tokens``; returns them
    clipped to ``[0, num_tokens - 1]`` (a no-op on valid ids; the traced case, see the module).

    ``lengths``: optional ``(b,)``: only ``tokens[i, :lengths[i]]`` are checked (right padding
    may hold anything; it is clipped like the rest).

    Raises:
      ValueError: ``tokens`` not an integer ``(batch, seq_len)`` array, or a concrete id
        outside ``[0, num_tokens)``: ``"token id 60 at position (0, 2) is outside the
        vocabulary [0, 50) (num_tokens=50)"``.
    """
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be an integer array of shape (batch, seq_len), got "
                         f"{tokens.dtype}{tuple(tokens.shape)}")
    if not isinstance(tokens, jax.core.Tracer) and not isinstance(lengths, jax.core.Tracer):
        ids = np.asarray(tokens)
        bad = (ids < 0) | (ids >= num_tokens)
        if lengths is not None:
            bad &= np.arange(ids.shape[1])[None, :] < np.asarray(lengths).reshape(-1, 1)
        if bad.any():
            i, j = (int(x) for x in np.argwhere(bad)[0])
            raise ValueError(
                f"token id {int(ids[i, j])} at position ({i}, {j}) is outside the vocabulary "
                f"[0, {num_tokens}) (num_tokens={num_tokens}); {int(bad.sum())} bad id(s) in "
                f"tokens of shape {ids.shape}")
    return jnp.clip(tokens, 0, num_tokens - 1)
