"""Trace-time argument checks shared by every public op.

Every check raises ``ValueError`` (``TypeError`` for dtypes and non-static config) with a
message that names the argument and the rule it broke (docs/semantics.md, "Errors").
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

MODES = ("mixture", "grouped")
FLOAT_DTYPES = tuple(jnp.dtype(t) for t in ("float32", "bfloat16", "float16", "float64"))


def _is_traced(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def static_int(value: Any, name: str) -> int:
    """Returns ``value`` as a Python int, or raises if it is not a static integer."""
    if _is_traced(value):
        raise TypeError(
            f"{name} must be a static Python int, got a traced value; mark it static "
            "(e.g. jax.jit(..., static_argnames=...)) instead of passing it as an array"
        )
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Integral, np.integer)):
        if isinstance(value, (jax.Array, np.ndarray)) and np.ndim(value) == 0 and np.issubdtype(
            np.asarray(value).dtype, np.integer
        ):
            return int(value)
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def static_int_tuple(values: Any, name: str) -> tuple[int, ...]:
    """Returns a tuple of Python ints; accepts an int, list, tuple or 1-D numpy array."""
    if _is_traced(values):
        raise TypeError(
            f"{name} must be static Python ints, got a traced array; pass a tuple of ints"
        )
    if isinstance(values, (numbers.Integral, np.integer)) and not isinstance(values, bool):
        return (int(values),)
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    return tuple(static_int(v, f"{name}[{i}]") for i, v in enumerate(values))


def check_branches(
    segment_lengths: Any, dilation_rates: Any
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Validates a dilated configuration: same length >= 1, positive, ``w % r == 0``."""
    ws = static_int_tuple(segment_lengths, "segment_lengths")
    rs = static_int_tuple(dilation_rates, "dilation_rates")
    if len(ws) == 0:
        raise ValueError("segment_lengths must hold at least one branch, got an empty sequence")
    if len(ws) != len(rs):
        raise ValueError(
            "segment_lengths and dilation_rates must have the same length, got "
            f"{len(ws)} segment_lengths {ws} and {len(rs)} dilation_rates {rs}"
        )
    for i, (w, r) in enumerate(zip(ws, rs)):
        if w <= 0:
            raise ValueError(f"segment_lengths[{i}] must be positive, got {w}")
        if r <= 0:
            raise ValueError(f"dilation_rates[{i}] must be positive, got {r}")
        if w % r != 0:
            raise ValueError(
                f"segment_lengths[{i}]={w} must be divisible by dilation_rates[{i}]={r} "
                "(each segment holds w / r dilated positions)"
            )
    return ws, rs


def check_mode_name(mode: Any) -> str:
    """``"mixture"`` or ``"grouped"`` (no shape rules; see :func:`check_mode`)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return mode


def check_mode(mode: Any, num_heads: int, num_branches: int) -> str:
    check_mode_name(mode)
    if mode == "grouped" and num_heads < num_branches:
        raise ValueError(
            f"mode='grouped' splits the heads into one group per branch and needs "
            f"num_heads >= len(segment_lengths), got {num_heads} heads for {num_branches} branches"
        )
    return mode


def check_float_array(x: Any, name: str) -> jax.Array:
    if _is_traced(x) or isinstance(x, jax.Array):
        arr = x
    else:
        try:
            arr = jnp.asarray(x)
        except Exception as e:  # noqa: BLE001 - re-raised with the argument's name
            raise TypeError(f"{name} must be an array, got {type(x).__name__}") from e
    if not jnp.issubdtype(arr.dtype, jnp.floating):
        raise TypeError(f"{name} must have a floating dtype (float32, bfloat16, float16), "
                        f"got {arr.dtype}")
    if jnp.dtype(arr.dtype) not in FLOAT_DTYPES:
        raise TypeError(f"{name} must have dtype float32, bfloat16 or float16 (float64 with "
                        f"jax_enable_x64), got {arr.dtype}")
    return arr


def empty_batch(q: jax.Array, v: jax.Array) -> jax.Array:
    """The result of attention over an empty batch (``b = 0``): zeros ``(0, n, h, d_v)`` in
    ``q.dtype``, as :func:`jax.nn.dot_product_attention` returns (gradients: empty too)."""
    return jnp.zeros(q.shape[:3] + v.shape[3:], q.dtype)


def check_qkv(q: Any, k: Any, v: Any, *, empty_batch: bool = False,
              value_head_dim: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Checks the ``(b, n, h, d)`` / ``(b, n, hk, d)`` layout, GQA divisibility and dtypes;
    ``b = 0`` only with ``empty_batch`` (ops that return :func:`empty_batch` for it);
    ``value_head_dim``: ``v`` may have its own head dim ``(b, n, hk, dv)``."""
    q = check_float_array(q, "q")
    k = check_float_array(k, "k")
    v = check_float_array(v, "v")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(
                f"{name} must have rank 4 with layout (batch, seq_len, heads, head_dim), "
                f"got shape {tuple(x.shape)}"
            )
    if value_head_dim and (k.shape[:3] != v.shape[:3] or v.shape[3] <= 0):
        raise ValueError(f"v must be (b, n, hk, dv) with k's b, n, hk and dv >= 1, got k "
                         f"{k.shape} and v {v.shape}")
    if not value_head_dim and k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {k.shape} and v {v.shape}")
    b, n, h, d = q.shape
    bk, nk, hk, dk = k.shape
    if bk != b:
        raise ValueError(f"q and k must have the same batch size, got {b} and {bk}")
    if nk != n:
        raise ValueError(
            f"q and k must have the same seq_len (axis 1 of (b, n, h, d)), got {n} and {nk}"
        )
    if dk != d:
        raise ValueError(f"q and k must have the same head_dim, got {d} and {dk}")
    if min(h, hk, d) <= 0 or b < (0 if empty_batch else 1):
        raise ValueError(
            f"batch{' (>= 0 here)' if empty_batch else ''}, heads and head_dim must be "
            f"positive, got q {q.shape}, k {k.shape}"
        )
    if n <= 0:
        raise ValueError(f"seq_len must be >= 1, got q {q.shape}")
    if h % hk != 0:
        raise ValueError(
            f"the number of query heads must be a multiple of the number of key/value heads "
            f"(h % hk == 0 for GQA/MQA), got h={h} (axis 2 of q) and hk={hk} (axis 2 of k, v)"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k and v must have the same dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}"
        )
    return q, k, v


def check_scale(scale: Any, head_dim: int) -> float:
    if scale is None:
        return 1.0 / float(np.sqrt(head_dim))
    if _is_traced(scale):
        raise TypeError("scale must be a static Python float (or None), got a traced value")
    if isinstance(scale, bool) or not isinstance(scale, (numbers.Real, np.floating, np.integer)):
        if isinstance(scale, (jax.Array, np.ndarray)) and np.ndim(scale) == 0:
            scale = float(scale)
        else:
            raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    scale = float(scale)
    if not np.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite positive float, got {scale}")
    return scale


def check_real(value: Any, name: str) -> float:
    """A static real number (not a bool) as a Python float."""
    if _is_traced(value):
        raise TypeError(f"{name} must be a static Python float, got a traced value")
    is_scalar_array = (isinstance(value, (np.ndarray, np.generic, jax.Array))
                       and np.ndim(value) == 0 and np.issubdtype(np.asarray(value).dtype,
                                                                 np.number))
    if isinstance(value, bool) or not (isinstance(value, numbers.Real) or is_scalar_array):
        raise TypeError(f"{name} must be a float, got {value!r}")
    return float(value)


def check_block_sizes(block_sizes: Any) -> Any:
    from dilax.core.blocks import BlockSizes  # lazy: core is heavier than the checks

    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"block_sizes must be a dilax.BlockSizes, got {type(block_sizes).__name__}")
    return block_sizes


def check_dilated_call(q: jax.Array, segment_lengths: Any, dilation_rates: Any, mode: Any,
                       is_causal: Any, scale: Any, block_sizes: Any):
    """The static configuration of a dilated call on validated ``q``: returns
    ``(ws, rs, mode, is_causal, scale, block_sizes)`` normalized."""
    ws, rs = check_branches(segment_lengths, dilation_rates)
    return (ws, rs, check_mode(mode, q.shape[2], len(ws)), check_bool(is_causal, "is_causal"),
            check_scale(scale, q.shape[3]), check_block_sizes(block_sizes))


def check_bool(value: Any, name: str) -> bool:
    if _is_traced(value):
        raise TypeError(f"{name} must be a static Python bool, got a traced value")
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def check_memory(q: Any, k: Any, *, num_branches: int = 1, dense: bool = False,
                 op: str = "attention") -> None:
    """Fails fast, from the shapes alone, when a call cannot fit in memory.

    Compares :func:`dilax.memory.attention_bytes` (a lower bound: q, k, v, the output and the
    log-sum-exp; with ``dense`` the ``n x n`` logits of a reference path) with
    :func:`dilax.memory.available_bytes`. Shapes are the ones this call sees, so inside
    ``shard_map`` the per-device shapes are checked.
    """
    from dilax import memory  # lazy: memory imports nothing of dilax, keep it that way

    need = memory.attention_bytes(q.shape, k.shape, q.dtype, num_branches=num_branches,
                                  dense=dense)
    memory.check_fits(
        need,
        f"{op} on q of shape {tuple(q.shape)} {q.dtype} (seq_len n={q.shape[1]}"
        + (", dense n x n reference" if dense else "") + ")",
        hint="use a shorter seq_len or a smaller batch, shard the sequence over devices "
             "(dilax.dilated_attention(..., sequence_parallel=dilax.SequenceParallel(mesh)))"
             + (", or implementation='xla'" if dense else ""),
    )


def check_seq_lengths(lengths: Any, name: str, batch: int, n: int) -> jax.Array | None:
    """``query_seq_lengths`` / ``key_value_seq_lengths``: ``None`` or an int array ``(b,)``.

    Static (concrete) values must lie in ``[0, n]`` (``ValueError`` otherwise); traced values
    cannot be checked and are clipped to ``[0, n]``. Returns int32 ``(b,)`` or ``None``.
    """
    if lengths is None:
        return None
    if isinstance(lengths, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int array of shape (b,), got {lengths!r}")
    try:
        arr = lengths if _is_traced(lengths) else np.asarray(lengths)
    except Exception as e:  # pragma: no cover - odd objects
        raise TypeError(f"{name} must be an int array of shape (b,), got {lengths!r}") from e
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must have an integer dtype, got {arr.dtype}")
    if tuple(arr.shape) != (batch,):
        raise ValueError(f"{name} must have shape (b,) = ({batch},), got {tuple(arr.shape)}")
    if _is_traced(lengths):
        return jnp.clip(lengths.astype(jnp.int32), 0, n)  # documented: traced -> clipped
    if arr.size and (arr.min() < 0 or arr.max() > n):
        raise ValueError(f"{name} must lie in [0, n={n}], got {arr.tolist()}")
    return jnp.asarray(arr, jnp.int32)


def check_local_window(local_window: Any, mode: str) -> int | None:
    """``local_window``: ``None`` or a static int ``>= 0``; only with ``mode="mixture"``."""
    if local_window is None:
        return None
    w = static_int(local_window, "local_window")
    if w < 0:
        raise ValueError(f"local_window must be >= 0 (or None), got {w}")
    if mode != "mixture":
        raise ValueError(f"local_window is a branch of the mixture: it needs mode='mixture', "
                         f"got mode={mode!r}")
    return w


def check_key_padding_mask(mask: Any, batch: int, n: int) -> jax.Array | None:
    """``key_padding_mask``: ``None`` or a bool array ``(b, n)`` (True = valid key)."""
    if mask is None:
        return None
    arr = mask if _is_traced(mask) or isinstance(mask, jax.Array) else np.asarray(mask)
    if arr.dtype != np.bool_:
        raise TypeError(f"key_padding_mask must be a bool array (True = valid key), got dtype "
                        f"{arr.dtype}")
    if tuple(arr.shape) != (batch, n):
        raise ValueError(f"key_padding_mask must have shape (b, n) = ({batch}, {n}), got "
                         f"{tuple(arr.shape)}")
    return jnp.asarray(arr)


def check_flex_options(score_mod, mask_mod, logits_soft_cap) -> tuple:
    """Validated static FlexAttention options of a module: ``score_mod`` / ``mask_mod``
    callables or None, ``logits_soft_cap`` a finite float ``> 0`` or None."""
    for name, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be callable or None, got {type(fn).__name__}")
    if logits_soft_cap is not None:
        logits_soft_cap = check_real(logits_soft_cap, "logits_soft_cap")
        if not (math.isfinite(logits_soft_cap) and logits_soft_cap > 0):
            raise ValueError(f"logits_soft_cap must be a finite float > 0, got "
                             f"{logits_soft_cap}")
    return score_mod, mask_mod, logits_soft_cap
