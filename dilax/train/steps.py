"""The model, the optimizer and the compiled steps: loss, train step, eval step."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dilax.models import LongNetLM
from dilax.train.config import ModelConfig, TrainConfig


def make_model(cfg: ModelConfig, seed: int) -> LongNetLM:
    """Decoder-only LongNetLM of ``cfg`` (no RNG state kept: dropout keys come per step)."""
    return LongNetLM(
        len(cfg.vocab), cfg.d_model, cfg.num_heads, 0, cfg.num_layers, cfg.dim_feedforward,
        cfg.segment_lengths, cfg.dilation_rates, num_kv_heads=cfg.num_kv_heads,
        dropout=cfg.dropout, mode=cfg.mode, remat=cfg.remat, dtype=jnp.dtype(cfg.dtype),
        param_dtype=jnp.float32, keep_rngs=False, position_scheme=cfg.position_scheme,
        rngs=nnx.Rngs(params=seed),
        **({} if cfg.local_window is None else dict(local_window=cfg.local_window)),
    )


def count_params(model: nnx.Module) -> int:
    """Number of scalars in the model's ``nnx.Param`` leaves."""
    return sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


@functools.lru_cache(maxsize=16)
def make_tx(steps: int, lr: float, warmup: int, weight_decay: float,
            clip_norm: float) -> optax.GradientTransformation:
    """AdamW (decay on matrices only) with warmup + cosine decay, global-norm clipping.

    Cached: the same hyperparameters give the same object, so the optimizer's static graph and
    therefore the compiled train step are reused across runs in one process.
    """
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=lr, warmup_steps=max(warmup, 1),
        decay_steps=max(steps, warmup + 1), end_value=lr * 0.1,
    )
    return optax.chain(
        optax.clip_by_global_norm(clip_norm),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay,
                    mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)),
    )


def make_optimizer(model: LongNetLM, cfg: TrainConfig) -> nnx.Optimizer:
    """``nnx.Optimizer`` over the model's ``nnx.Param`` with :func:`make_tx` of ``cfg``."""
    tx = make_tx(cfg.steps, cfg.lr, cfg.warmup, cfg.weight_decay, cfg.clip_norm)
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


def lm_loss(model: LongNetLM, x: jax.Array, y: jax.Array, rngs: nnx.Rngs | None,
            deterministic: bool, lengths: jax.Array | None = None) -> jax.Array:
    """Mean next-character cross-entropy (nats), logits in float32.

    ``lengths``: optional int ``(b,)`` valid tokens per row of a padded batch: the model gets
    them as ``seq_lengths`` and the mean runs over the valid positions only."""
    if lengths is None:
        logits = model(x, deterministic=deterministic, rngs=rngs).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    logits = model(x, deterministic=deterministic, rngs=rngs,
                   seq_lengths=lengths).astype(jnp.float32)
    valid = jnp.arange(x.shape[1])[None, :] < lengths[:, None]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return jnp.sum(jnp.where(valid, losses, 0.0)) / jnp.maximum(jnp.sum(valid), 1)


@nnx.jit(donate_argnums=(0, 1))
def train_step(model: LongNetLM, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array,
               dropout_key: jax.Array) -> jax.Array:
    """One update on int32 ``x, y (b, n)``; returns the loss. Donates model and optimizer."""
    loss, grads = nnx.value_and_grad(lm_loss)(model, x, y, nnx.Rngs(dropout=dropout_key), False)
    optimizer.update(model, grads)
    return loss


@nnx.jit
def eval_step(model: LongNetLM, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean loss on ``x, y (b, n)`` without dropout."""
    return lm_loss(model, x, y, None, True)


@nnx.jit
def eval_positions(model: LongNetLM, x: jax.Array, y: jax.Array) -> jax.Array:
    """Loss per position ``(n,)`` (mean over the batch) on ``x, y (b, n)`` without dropout."""
    logits = model(x, deterministic=True).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(axis=0)
