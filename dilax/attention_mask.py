"""``AttentionMask``: which query/key pairs may attend, as one pytree value.

Built once at the boundary of a call (:meth:`AttentionMask.build` validates shapes and
ranges), passed whole to the internals, combinable with ``&``. Its array leaves are traced
like any argument; ``is_causal`` is static (part of the tree structure).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from dilax import _validation as V

__all__ = ["AttentionMask", "check_attention_mask", "document_bounds", "document_positions",
           "take_attention_mask", "unpack_attention_mask"]


def take_attention_mask(attention_mask: Any, mask: Any, op: str) -> Any:
    """The :class:`AttentionMask` of a call to ``op``: ``attention_mask=``, or the old spelling
    ``mask=``, which still works with a ``DeprecationWarning``. In dilax as in jax.nn and Flax,
    ``mask=`` means a dense boolean array; an ``AttentionMask`` is ``attention_mask=``."""
    if mask is None:
        return attention_mask
    if not isinstance(mask, AttentionMask):
        raise TypeError(f"{op}: mask= takes no {type(mask).__name__}; pass a "
                        f"dilax.AttentionMask as attention_mask= (a dense boolean (B, N, T, S) "
                        f"mask is dilax.dot_product_attention's mask=)")
    if attention_mask is not None:
        raise TypeError(f"{op}: give the AttentionMask once, as attention_mask= (mask= is its "
                        f"deprecated spelling)")
    import warnings

    warnings.warn(f"{op}(mask=AttentionMask) is deprecated: pass it as attention_mask= (mask= "
                  f"means a dense boolean array, as in jax.nn and Flax)", DeprecationWarning,
                  stacklevel=3)
    return mask


def check_segment_ids(segment_ids: Any, batch: int, n: int) -> jax.Array | None:
    """``segment_ids``: ``None`` or an integer array ``(b, n)`` (a document is a maximal run
    of equal ids in a row; any integer values, traced allowed)."""
    if segment_ids is None:
        return None
    arr = segment_ids if isinstance(segment_ids, jax.Array) or hasattr(segment_ids, "aval") \
        else jnp.asarray(segment_ids)
    if not jnp.issubdtype(arr.dtype, jnp.integer):
        raise TypeError(f"segment_ids must be an integer array (b, n) of document ids, got "
                        f"dtype {arr.dtype}")
    if tuple(arr.shape) != (batch, n):
        raise ValueError(f"segment_ids must have shape (b, n) = ({batch}, {n}), got "
                         f"{tuple(arr.shape)}")
    return arr.astype(jnp.int32)


def document_bounds(segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(start, end)``, int32 ``(b, n)``: the first position of ``p``'s document and one past
    its last (a document is a maximal run of equal ids)."""
    ids = jnp.asarray(segment_ids)
    n = ids.shape[-1]
    pos = jnp.arange(n, dtype=jnp.int32)
    change = ids[..., 1:] != ids[..., :-1]
    first = jnp.concatenate([jnp.ones_like(change[..., :1]), change], axis=-1)
    last = jnp.concatenate([change, jnp.ones_like(change[..., :1])], axis=-1)
    start = jax.lax.cummax(jnp.where(first, pos, 0), axis=ids.ndim - 1)
    end = jax.lax.cummin(jnp.where(last, pos + 1, n), axis=ids.ndim - 1, reverse=True)
    return start.astype(jnp.int32), end.astype(jnp.int32)


def document_positions(segment_ids: jax.Array) -> jax.Array:
    """int32 ``(b, n)``: each position's index inside its document (``0`` at every start;
    the positions a model's rotary code uses for packed rows)."""
    start, _ = document_bounds(segment_ids)
    pos = jnp.arange(start.shape[-1], dtype=jnp.int32)
    return pos.reshape((1,) * (start.ndim - 1) + pos.shape) - start  # rank-promotion safe


def _same_runs(a: jax.Array, b: jax.Array) -> jax.Array:
    """Ids whose runs are the runs of both ``a`` and ``b`` (a document ends where either
    does)."""
    change = (a[:, 1:] != a[:, :-1]) | (b[:, 1:] != b[:, :-1])
    return jnp.concatenate([jnp.zeros_like(a[:, :1]),
                            jnp.cumsum(change, axis=1, dtype=jnp.int32)], axis=1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMask:
    """Masking of one attention call (docs/semantics.md): causal, valid lengths, key padding.

    Fields:
      query_seq_lengths: ``None`` or int32 ``(b,)``: query rows ``p >= len`` output 0.
      key_value_seq_lengths: ``None`` or int32 ``(b,)``: keys ``t >= len`` get no weight.
      key_padding_mask: ``None`` or bool ``(b, n)``, True where a key is valid.
      segment_ids: ``None`` or int32 ``(b, n)``: packed documents. A document is a maximal
        run of equal ids; each is computed as a sequence of its own (docs/semantics.md,
        "Packed documents").
      is_causal: static; keys ``t <= p`` only.

    Build it with :meth:`build` (validated, normalized); the constructor takes the fields
    as they are. ``a & b`` is the mask that allows what both allow.
    """

    query_seq_lengths: jax.Array | None = None
    key_value_seq_lengths: jax.Array | None = None
    key_padding_mask: jax.Array | None = None
    segment_ids: jax.Array | None = None
    is_causal: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @classmethod
    def build(cls, q: Any, k: Any = None, *, is_causal: bool = False,
              query_seq_lengths: Any = None, key_value_seq_lengths: Any = None,
              key_padding_mask: Any = None, segment_ids: Any = None,
              seq_len: int | None = None) -> AttentionMask:
        """A validated mask for queries ``q (b, n, h, d)`` (``k`` unused: keys share ``n``).

        ``seq_len``: the global ``n`` when ``q`` is one device's shard (lengths are global
        positions). Static lengths outside ``[0, n]`` raise ``ValueError``, traced ones are
        clipped; dtypes and shapes as in :func:`dilax.dilated_attention`.

        Raises:
          ValueError / TypeError: naming the argument and the rule.
        """
        del k
        b, n = q.shape[:2]
        ids = check_segment_ids(segment_ids, b, n)  # per position, like q
        n = n if seq_len is None else seq_len
        return cls(
            segment_ids=ids,
            query_seq_lengths=V.check_seq_lengths(query_seq_lengths, "query_seq_lengths", b, n),
            key_value_seq_lengths=V.check_seq_lengths(key_value_seq_lengths,
                                                      "key_value_seq_lengths", b, n),
            key_padding_mask=V.check_key_padding_mask(key_padding_mask, b, q.shape[1]),
            is_causal=V.check_bool(is_causal, "is_causal"),
        )

    def check_fits(self, q: Any, *, seq_len: int | None = None) -> AttentionMask:
        """This mask, checked to have the shapes of a call on ``q (b, n, h, d)`` (a mask
        built for other shapes raises ``ValueError``); values are not checked again."""
        b, n = q.shape[:2]
        ids = self.segment_ids
        if ids is not None and tuple(jnp.shape(ids)) != (b, n):
            raise ValueError(f"mask.segment_ids must have shape (b, n) = ({b}, {n}), got "
                             f"{tuple(jnp.shape(ids))}")
        for name in ("query_seq_lengths", "key_value_seq_lengths"):
            x = getattr(self, name)
            if x is not None and tuple(jnp.shape(x)) != (b,):
                raise ValueError(f"mask.{name} must have shape (b,) = ({b},), got "
                                 f"{tuple(jnp.shape(x))}")
        kpm = self.key_padding_mask
        if kpm is not None and tuple(jnp.shape(kpm)) != (b, n):
            raise ValueError(f"mask.key_padding_mask must have shape (b, n) = ({b}, {n}), got "
                             f"{tuple(jnp.shape(kpm))}")
        return self

    @property
    def has_lengths(self) -> bool:
        return self.query_seq_lengths is not None or self.key_value_seq_lengths is not None

    def causal(self) -> AttentionMask:
        """This mask with ``is_causal=True``."""
        return dataclasses.replace(self, is_causal=True)

    def __and__(self, other: AttentionMask) -> AttentionMask:
        if not isinstance(other, AttentionMask):
            return NotImplemented

        def both(a, b, op):
            return a if b is None else b if a is None else op(a, b)

        return AttentionMask(
            segment_ids=both(self.segment_ids, other.segment_ids, _same_runs),
            query_seq_lengths=both(self.query_seq_lengths, other.query_seq_lengths,
                                   jnp.minimum),
            key_value_seq_lengths=both(self.key_value_seq_lengths,
                                       other.key_value_seq_lengths, jnp.minimum),
            key_padding_mask=both(self.key_padding_mask, other.key_padding_mask,
                                  jnp.logical_and),
            is_causal=self.is_causal or other.is_causal,
        )


def check_attention_mask(mask: Any, op: str, **keywords: Any) -> AttentionMask:
    """``mask``, an :class:`AttentionMask` given as ``attention_mask=`` to ``op``; a
    ``TypeError`` when it is something else, or when ``keywords`` (the op's own keywords for
    its fields: lengths, key padding, documents) set one of them too."""
    given = sorted(name for name, x in keywords.items() if x is not None)
    if given:
        raise TypeError(f"{op}: give the mask either as attention_mask= or as keywords, got "
                        f"attention_mask= and {given}")
    if not isinstance(mask, AttentionMask):
        raise TypeError(f"{op}: attention_mask must be a dilax.AttentionMask, got "
                        f"{type(mask).__name__}")
    return mask


def unpack_attention_mask(mask: AttentionMask, op: str, is_causal: Any, **keywords: Any
                          ) -> tuple[bool, Any, Any, Any]:
    """``(is_causal, query_seq_lengths, key_value_seq_lengths, segment_ids)`` of the
    ``attention_mask`` of an op that takes these as keywords too and has no per-key mask
    (block-sparse, on one device or per device): ``is_causal`` of either; ``TypeError`` when
    ``keywords`` (the op's own length/document keywords) also hold one of its fields,
    ``ValueError`` for a ``key_padding_mask`` (refused by name, never ignored)."""
    check_attention_mask(mask, op, **keywords)
    if mask.key_padding_mask is not None:
        raise ValueError(f"key_padding_mask is not supported by {op}; pass "
                         "key_value_seq_lengths (valid lengths) or segment_ids (packed "
                         "documents) instead")
    return (bool(is_causal) or mask.is_causal, mask.query_seq_lengths,
            mask.key_value_seq_lengths, mask.segment_ids)
