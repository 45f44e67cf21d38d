"""What every multi-head module shares: head-count checks, Xavier-normal projections, and the
``(b, n, E) -> (b, n, heads, head_dim)`` projection of query, key and value."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from dilax import _validation as V


def xavier_normal(gain: float = 1.0) -> nnx.Initializer:
    """Xavier/Glorot *normal* (not truncated) init: ``std = gain * sqrt(2 / (fan_in + fan_out))``.

    Same distribution as ``torch.nn.init.xavier_normal_(w, gain)``, for ``(fan_in, fan_out)``
    kernels (``nnx.Linear`` layout).
    """
    gain = float(gain)
    if not gain > 0:
        raise ValueError(f"gain must be positive, got {gain}")
    return jax.nn.initializers.variance_scaling(gain**2, "fan_avg", "normal")


def check_heads(embed_dim, num_heads, num_kv_heads) -> tuple[int, int, int]:
    """Validated ``(embed_dim, num_heads, num_kv_heads)``; ``num_kv_heads=None`` means
    ``num_heads``. Positive ints with ``embed_dim % num_heads == 0`` and
    ``num_heads % num_kv_heads == 0``."""
    embed_dim = V.static_int(embed_dim, "embed_dim")
    num_heads = V.static_int(num_heads, "num_heads")
    num_kv_heads = (num_heads if num_kv_heads is None
                    else V.static_int(num_kv_heads, "num_kv_heads"))
    if embed_dim <= 0 or num_heads <= 0 or num_kv_heads <= 0:
        raise ValueError(
            "embed_dim, num_heads and num_kv_heads must be positive, got "
            f"embed_dim={embed_dim}, num_heads={num_heads}, num_kv_heads={num_kv_heads}"
        )
    if embed_dim % num_heads != 0:
        raise ValueError(
            f"embed_dim must be divisible by num_heads (embed_dim % num_heads == 0), got "
            f"embed_dim={embed_dim}, num_heads={num_heads}"
        )
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads must be divisible by num_kv_heads (num_heads % num_kv_heads == 0), "
            f"got num_heads={num_heads}, num_kv_heads={num_kv_heads}"
        )
    return embed_dim, num_heads, num_kv_heads


def check_dropout(dropout) -> float:
    """Validated dropout rate: a static real in ``[0, 1)``."""
    dropout = V.check_real(dropout, "dropout")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    return dropout


def check_dropout_and_gain(dropout, gamma_init) -> tuple[float, float]:
    """Validated ``(dropout, gamma_init)``: a real in ``[0, 1)`` and a positive real."""
    dropout = check_dropout(dropout)
    gain = V.check_real(gamma_init, "gamma_init")
    if not gain > 0:
        raise ValueError(f"gamma_init must be positive, got {gamma_init}")
    return dropout, gain


def linear_factory(*, use_bias: bool, dtype, param_dtype, rngs: nnx.Rngs
                   ) -> Callable[[int, int, float], nnx.Linear]:
    """``linear(n_in, n_out, gain)``: an ``nnx.Linear`` with Xavier-normal(``gain``) kernel and
    zero bias, as in dilated-attention-pytorch / torchscale."""
    def linear(n_in: int, n_out: int, gain: float) -> nnx.Linear:
        return nnx.Linear(n_in, n_out, use_bias=use_bias, kernel_init=xavier_normal(gain),
                          bias_init=nnx.initializers.zeros_init(), dtype=dtype,
                          param_dtype=param_dtype, rngs=rngs)

    return linear


def layer_norm(width: int, eps: float, *, dtype, param_dtype, rngs: nnx.Rngs) -> nnx.LayerNorm:
    """``nnx.LayerNorm(width)`` with the given epsilon and dtypes (the models' only norm)."""
    return nnx.LayerNorm(width, epsilon=eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)


def init_projections(module, embed_dim: int, num_heads: int, num_kv_heads: int, gain: float, *,
                     use_bias: bool, dtype, param_dtype, rngs: nnx.Rngs
                     ) -> Callable[[bool, float], None]:
    """Sets ``module.embed_dim``, ``num_heads``, ``num_kv_heads``, ``head_dim`` and
    ``gamma_init`` and creates ``q_proj``/``k_proj`` (gain 1) and ``v_proj`` (gain ``gain``),
    for already validated sizes (:func:`check_heads`, :func:`check_dropout_and_gain`).

    Returns ``finish(layer_norm, layer_norm_eps)``, which creates ``module.norm`` (the MAGNETO
    sub-LayerNorm, or None) and ``module.out_proj`` (gain ``gain``). It is a second call so
    that a module can create what lies between (attention, dropout) in its own order: the
    order in which layers draw initialization keys decides the initial parameters.
    """
    module.embed_dim = embed_dim
    module.num_heads = num_heads
    module.num_kv_heads = num_kv_heads
    module.head_dim = embed_dim // num_heads
    module.gamma_init = gain
    kv_dim = num_kv_heads * module.head_dim
    linear = linear_factory(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    module.q_proj = linear(embed_dim, embed_dim, 1.0)
    module.k_proj = linear(embed_dim, kv_dim, 1.0)
    module.v_proj = linear(embed_dim, kv_dim, gain)

    def finish(with_norm: bool, layer_norm_eps: float) -> None:
        module.norm = (layer_norm(embed_dim, layer_norm_eps, dtype=dtype,
                                  param_dtype=param_dtype, rngs=rngs)
                       if with_norm else nnx.data(None))
        module.out_proj = linear(embed_dim, embed_dim, gain)

    return finish


def output_projection(module, x: jax.Array) -> jax.Array:
    """``module.out_proj(module.norm(x))`` of the (dropped-out) attention output
    ``x (b, n, E)``; the norm is skipped when the module has none."""
    if module.norm is not None:
        x = module.norm(x)
    return module.out_proj(x)


def project_qkv(module, query: jax.Array, key: jax.Array | None, value: jax.Array | None):
    """``module.{q,k,v}_proj`` of ``query (b, n, E)``, ``key`` (default: ``query``) and
    ``value`` (default: ``key``), split into heads: ``q (b, n, h, Dh)``, ``k, v (b, m, hk, Dh)``.
    """
    if key is None:
        if value is not None:
            raise ValueError("key must be given when value is given")
        key = query
    if value is None:
        value = key
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim != 3 or x.shape[-1] != module.embed_dim:
            raise ValueError(
                f"{name} must have shape (batch, seq_len, embed_dim={module.embed_dim}), got "
                f"{tuple(x.shape)}"
            )
    heads = lambda x, h: x.reshape(*x.shape[:2], h, module.head_dim)
    return (heads(module.q_proj(query), module.num_heads),
            heads(module.k_proj(key), module.num_kv_heads),
            heads(module.v_proj(value), module.num_kv_heads))


def init_sinks(learnable_sinks, num_heads: int, param_dtype):
    """``nnx.Param`` zeros ``(num_heads,)``: one learnable sink logit per query head (a zero
    logit: one more unit of mass in every softmax denominator at initialization), or
    ``nnx.data(None)`` when ``learnable_sinks`` is False."""
    if not V.check_bool(learnable_sinks, "learnable_sinks"):
        return nnx.data(None)
    return nnx.Param(jnp.zeros((num_heads,), param_dtype))


def sink_logits(module) -> jax.Array | None:
    """The module's learnable sinks ``(h,)`` (:func:`init_sinks`) or None."""
    return None if module.sinks is None else module.sinks[...]
