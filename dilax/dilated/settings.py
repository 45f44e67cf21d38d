"""``DilatedSettings``: the static configuration of a dilated call, as one hashable value.

Built (and validated) once where a call enters dilax; the internals and their ``jax.jit``
helpers take it whole (``static_argnames=("settings",)``) instead of re-listing its fields.
:func:`check_dilated_request` is the one place where the shapes of ``q, k, v`` are checked
against it and the :class:`dilax.AttentionMask` is built or checked.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import jax
import numpy as np

from dilax import _validation as V
from dilax import registry
from dilax.attention_mask import AttentionMask, check_attention_mask
from dilax.core import BlockSizes

__all__ = ["DilatedSettings", "check_dilated_request", "warn_uncovered_offsets"]


@dataclasses.dataclass(frozen=True)
class DilatedSettings:
    """Static configuration of dilated attention (frozen, hashable; validated when built).

    Fields (as the keywords of :func:`dilax.dilated_attention`): ``segment_lengths``,
    ``dilation_rates`` (int or sequence; stored as int tuples, same length, ``w % r == 0``),
    ``mode`` (``"mixture"`` | ``"grouped"``), ``is_causal``, ``scale`` (``None``: ``1 /
    sqrt(d)`` of the call), ``local_window`` (``None`` or ``W >= 0``, mixture only),
    ``block_sizes`` (:class:`dilax.BlockSizes` or ``None``), ``implementation`` (``None``,
    ``"xla"``, ``"pallas"``, ``"cudnn"``, ``"reference"``), ``interpret``.

    Example::

      s = dilax.DilatedSettings((512, 1024), (1, 2), is_causal=True)
      y = dilax.dilated_attention(q, k, v, settings=s)

    Raises:
      ValueError / TypeError: the messages of :func:`dilax.dilated_attention` for the same
        keyword (docs/semantics.md, "Errors"). Rules that need the shapes (``mode="grouped"``
        needs ``num_heads >= len(segment_lengths)``) are checked at the call.
    """

    segment_lengths: tuple[int, ...]
    dilation_rates: tuple[int, ...]
    mode: str = "mixture"
    is_causal: bool = False
    scale: float | None = None
    local_window: int | None = None
    block_sizes: BlockSizes | None = None
    implementation: str | None = None
    interpret: bool = False

    def __post_init__(self):
        ws, rs = V.check_branches(self.segment_lengths, self.dilation_rates)
        mode = V.check_mode_name(self.mode)
        fields = dict(
            segment_lengths=ws, dilation_rates=rs, mode=mode,
            is_causal=V.check_bool(self.is_causal, "is_causal"),
            scale=None if self.scale is None else V.check_scale(self.scale, 1),
            block_sizes=V.check_block_sizes(self.block_sizes),
            local_window=V.check_local_window(self.local_window, mode),
            implementation=registry.check_name(self.implementation),
            interpret=V.check_bool(self.interpret, "interpret"),
        )
        for name, value in fields.items():  # normalized in place: the value is built once
            object.__setattr__(self, name, value)

    @property
    def num_branches(self) -> int:
        """Dilated branches plus the local-window branch, if any."""
        return len(self.segment_lengths) + (self.local_window is not None)

    def scale_for(self, head_dim: int) -> float:
        """The logit scale of a call with ``head_dim``: ``scale`` or ``1 / sqrt(head_dim)``."""
        return 1.0 / float(np.sqrt(head_dim)) if self.scale is None else self.scale

    def replace(self, **changes: Any) -> DilatedSettings:
        """A copy with ``changes`` (validated again, like any new value)."""
        return dataclasses.replace(self, **changes)

    def causal(self) -> DilatedSettings:
        """This value with ``is_causal=True`` (no re-validation: nothing else changes)."""
        if self.is_causal:
            return self
        out = object.__new__(DilatedSettings)
        for f in dataclasses.fields(self):
            object.__setattr__(out, f.name, getattr(self, f.name))
        object.__setattr__(out, "is_causal", True)
        return out


@functools.lru_cache(maxsize=256)
def warn_uncovered_offsets(num_heads: int, segment_lengths: tuple[int, ...],
                           dilation_rates: tuple[int, ...], mode: str) -> tuple[int, ...]:
    """Warns (``UserWarning``, once per configuration: the result is cached) when a mixture
    branch has fewer heads than its dilation rate.

    In ``mode="mixture"`` head ``j`` of branch ``(w, r)`` takes the positions ``p`` with
    ``p % r == j % r``; with ``num_heads < r`` the offsets ``num_heads .. r - 1`` get no head,
    so that branch neither reads those positions as keys nor writes them as queries (they are
    left to the other branches). Returns the indices of the branches that leave offsets out.
    Called where a configuration meets its head count: :func:`check_dilated_request` (at trace
    time under ``jax.jit``) and when a :mod:`dilax.models` layer builds its attention.
    """
    if mode != "mixture":
        return ()
    short = []
    for i, (w, r) in enumerate(zip(segment_lengths, dilation_rates)):
        if num_heads < r:
            short.append(i)
            missing = list(range(num_heads, r))
            shown = (", ".join(map(str, missing)) if len(missing) <= 8 else
                     f"{missing[0]}, {missing[1]}, ..., {missing[-1]}")
            warnings.warn(
                f"dilated attention, mode='mixture': branch {i} (segment_length={w}, "
                f"dilation_rate={r}) has only num_heads={num_heads} < {r} heads, so the "
                f"offsets {{{shown}}} get no head: the positions p with p % {r} in "
                f"{{{shown}}} are left out of this branch (neither attended as keys nor "
                f"attending as queries). Use at least {r} heads (or a rate <= num_heads).",
                UserWarning, stacklevel=3)
    return tuple(short)


_MASK_KEYWORDS = ("query_seq_lengths", "key_value_seq_lengths", "key_padding_mask",
                  "segment_ids")


def check_dilated_request(q: Any, k: Any, v: Any, settings: DilatedSettings,
                          mask: AttentionMask | None = None, *, num_shards: int = 1,
                          empty_batch: bool = False, value_head_dim: bool = False,
                          **mask_keywords: Any
                          ) -> tuple[jax.Array, jax.Array, jax.Array, AttentionMask,
                                     DilatedSettings]:
    """The one validation of a dilated call: ``q, k, v`` (layout, GQA, dtypes), the shape
    rules of ``settings`` and the mask, built from ``mask_keywords``
    (``query_seq_lengths``, ``key_value_seq_lengths``, ``key_padding_mask``) or given as
    ``mask`` (then the keywords must be ``None``). ``num_shards``: ``P`` when ``q`` is one
    of ``P`` sequence shards (the mask's lengths are global positions, ``<= P n/P``).
    ``empty_batch``: accept ``b = 0`` (the single-device op returns an empty result);
    ``value_head_dim``: accept ``v (b, n, hk, dv)`` with ``dv != d``.

    Returns ``(q, k, v, mask, settings)`` with ``mask.is_causal == settings.is_causal`` (the
    causal flag of either)."""
    if not isinstance(settings, DilatedSettings):
        raise TypeError(f"settings must be a dilax.DilatedSettings, got "
                        f"{type(settings).__name__}")
    q, k, v = V.check_qkv(q, k, v, empty_batch=empty_batch, value_head_dim=value_head_dim)
    V.check_mode(settings.mode, q.shape[2], len(settings.segment_lengths))
    warn_uncovered_offsets(q.shape[2], settings.segment_lengths, settings.dilation_rates,
                           settings.mode)
    seq_len = num_shards * q.shape[1]
    if mask is None:
        mask = AttentionMask.build(q, is_causal=settings.is_causal, seq_len=seq_len,
                                   **mask_keywords)
    else:
        mask = check_attention_mask(mask, "dilated attention", **{
            name: mask_keywords.get(name) for name in _MASK_KEYWORDS}).check_fits(
                q, seq_len=seq_len)
    if mask.is_causal:
        settings = settings.causal()
    elif settings.is_causal:
        mask = mask.causal()
    return q, k, v, mask, settings


def settings_from_keywords(settings: DilatedSettings | None, segment_lengths: Any,
                           dilation_rates: Any, **keywords: Any) -> DilatedSettings:
    """``settings``, or a new value from the public keywords; not both (``TypeError``).

    ``keywords`` hold the public functions' configuration keywords with their defaults
    (``mode``, ``is_causal``, ...): with ``settings`` given they must keep their defaults."""
    if settings is None:
        if segment_lengths is None or dilation_rates is None:
            raise TypeError("segment_lengths and dilation_rates are required (or pass "
                            "settings=dilax.DilatedSettings(...))")
        return DilatedSettings(segment_lengths, dilation_rates, **keywords)
    defaults = {f.name: f.default for f in dataclasses.fields(DilatedSettings)}
    changed = sorted(name for name, value in keywords.items() if value != defaults[name])
    if segment_lengths is not None or dilation_rates is not None or changed:
        extra = (["segment_lengths/dilation_rates"] if segment_lengths is not None
                 or dilation_rates is not None else []) + changed
        raise TypeError(f"settings= holds the whole configuration; got settings= and {extra}")
    if not isinstance(settings, DilatedSettings):
        raise TypeError(f"settings must be a dilax.DilatedSettings, got "
                        f"{type(settings).__name__}")
    return settings
