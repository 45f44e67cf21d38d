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
        **({} if cfg.block_sparse is None else dict(block_sparse=tuple(cfg.block_sparse))),
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
            deterministic: bool, lengths: jax.Array | None = None,
            segment_ids: jax.Array | None = None) -> jax.Array:
    """Mean next-character cross-entropy (nats), logits in float32.

    ``x, y (b, n)``: ``y[:, t]`` is the target of ``x[:, t]``.
    ``lengths``: optional int ``(b,)`` valid tokens per row of a padded batch: the model gets
    them as ``seq_lengths`` and the mean runs over the valid positions only.
    ``segment_ids``: optional int ``(b, n)``, documents packed in the rows (a maximal run of
    equal ids is a document; :class:`dilax.models.LongNetLM` computes each as if alone). Then
    ``y`` is ``x`` shifted left by one inside the row, and a target counts only where it is
    the next token of the same document: the target at the last token of every document is
    dropped, and the row's end (and, with ``lengths``, its valid end) ends a document too.
    The loss is the mean over the targets kept, so on a packed batch it is the token-weighted
    mean of the documents' own losses."""
    kw = {}
    if lengths is not None:
        kw["seq_lengths"] = lengths
    if segment_ids is not None:
        kw["segment_ids"] = segment_ids
    logits = model(x, deterministic=deterministic, rngs=rngs, **kw).astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    if not kw:
        return losses.mean()
    pos = jnp.arange(x.shape[1])[None, :]
    keep = jnp.ones(x.shape, bool)
    if segment_ids is not None:  # the next token is in the row and in the same document
        ids = jnp.asarray(segment_ids)
        same = ids[:, 1:] == ids[:, :-1]
        keep = jnp.concatenate([same, jnp.zeros_like(same[:, :1])], axis=1)
    if lengths is not None:
        # without documents the target of the last valid token counts (it is given in y);
        # with them the next token must be valid too
        last = lengths[:, None] - (0 if segment_ids is None else 1)
        keep = keep & (pos < last)
    return jnp.sum(jnp.where(keep, losses, 0.0)) / jnp.maximum(jnp.sum(keep), 1)


@nnx.jit(donate_argnums=(0, 1))
def train_step(model: LongNetLM, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array,
               dropout_key: jax.Array, segment_ids: jax.Array | None = None,
               lengths: jax.Array | None = None) -> jax.Array:
    """One update on int32 ``x, y (b, n)`` (optionally packed: ``segment_ids (b, n)`` and
    valid ``lengths (b,)``, see :func:`lm_loss`); returns the loss. Donates model and
    optimizer."""
    loss, grads = nnx.value_and_grad(lm_loss)(model, x, y, nnx.Rngs(dropout=dropout_key), False,
                                              lengths, segment_ids)
    optimizer.update(model, grads)
    return loss


@nnx.jit
def eval_step(model: LongNetLM, x: jax.Array, y: jax.Array,
              segment_ids: jax.Array | None = None,
              lengths: jax.Array | None = None) -> jax.Array:
    """Mean loss on ``x, y (b, n)`` without dropout (``segment_ids``, ``lengths``: as in
    :func:`train_step`)."""
    return lm_loss(model, x, y, None, True, lengths, segment_ids)


@nnx.jit
def eval_positions(model: LongNetLM, x: jax.Array, y: jax.Array) -> jax.Array:
    """Loss per position ``(n,)`` (mean over the batch) on ``x, y (b, n)`` without dropout."""
    logits = model(x, deterministic=True).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(axis=0)
