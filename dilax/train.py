"""Train a small character-level LongNet LM: ``python -m dilax.train``.

Decoder-only :class:`dilax.models.LongNetLM` on the shipped corpus (``dilax/data/fables.txt``),
optax AdamW with linear warmup + cosine decay and global-norm clipping, an ``nnx.jit`` train
step that donates the model and optimizer state, eval loss, Orbax checkpoints (``--resume``)
and a sampled continuation at the end. Losses are in nats per character.

Determinism: the batch of step ``s`` is drawn from ``numpy.random.default_rng([seed, s])`` and
the dropout key is ``fold_in(key(seed), s)``, so a run's only state is (parameters, optimizer
state, step). A checkpoint stores exactly that, and stopping at step ``k`` and resuming
reproduces the uninterrupted loss curve bit for bit (same machine and software).

Checkpoint layout (``--checkpoint-dir DIR``): ``DIR/<step>/state`` (Orbax arrays: model and
optimizer) and ``DIR/<step>/meta`` (JSON: model and training config, step, and a SHA-256 of the
state used to detect corruption). Resuming refuses a checkpoint whose model config differs.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dilax.data import load_corpus
from dilax.models import LongNetLM

CHECKPOINT_FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, corrupt, or from another model configuration."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything that determines the parameters and the forward computation."""

    vocab: str
    d_model: int = 128
    num_heads: int = 4
    num_kv_heads: int | None = None
    num_layers: int = 2
    dim_feedforward: int = 512
    segment_lengths: tuple[int, ...] = (32, 64, 128)
    dilation_rates: tuple[int, ...] = (1, 2, 4)
    mode: str = "mixture"
    dropout: float = 0.0
    dtype: str = "float32"
    remat: bool = False

    def to_json(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v
                for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        for k in ("segment_lengths", "dilation_rates"):
            d[k] = tuple(d[k])
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """How to train (the CLI flags of the "training" group, same names with dashes).

    ``steps`` is the length of the whole run (it sets the learning-rate schedule);
    ``stop_after`` ends this invocation early, as if interrupted, after checkpointing;
    ``resume`` continues from the latest checkpoint in ``checkpoint_dir``. ``eval_every=0``
    disables evaluation, ``sample_tokens=0`` the final sample.
    """

    steps: int = 500
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 6e-3
    warmup: int = 50
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    seed: int = 0
    eval_every: int = 100
    eval_batches: int = 8
    checkpoint_dir: str | None = None
    checkpoint_every: int = 250
    keep_checkpoints: int = 3
    resume: bool = False
    allow_config_change: bool = False
    stop_after: int | None = None
    sample_tokens: int = 300
    temperature: float = 0.6
    prompt: str = "Once upon a time there was"


@dataclasses.dataclass
class TrainResult:
    """What :func:`train` returns; losses are nats per character."""

    losses: dict[int, float]  # step (1-based) -> train loss of that step, steps run here only
    eval_losses: dict[int, float]  # step -> eval loss (step 0: before training)
    unigram_entropy: float
    start_step: int
    last_step: int
    tokens_per_s: float
    elapsed_s: float
    sample: str | None
    num_params: int
    model: LongNetLM
    optimizer: nnx.Optimizer

    @property
    def final_eval_loss(self) -> float | None:
        return self.eval_losses[max(self.eval_losses)] if self.eval_losses else None


# ----------------------------------------------------------------------------- data


class CharTokenizer:
    """Characters <-> ids, ids in the sorted order of ``vocab``."""

    def __init__(self, vocab: str):
        self.vocab = vocab
        self._index = {c: i for i, c in enumerate(vocab)}

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls("".join(sorted(set(text))))

    def encode(self, text: str) -> np.ndarray:
        missing = sorted(set(text) - set(self._index))
        if missing:
            raise ValueError(f"text has characters outside the vocabulary: {missing}")
        return np.fromiter((self._index[c] for c in text), np.int32, len(text))

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return "".join(self.vocab[int(i)] for i in ids)


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy of the token frequencies, in nats: the loss of the best context-free model."""
    p = np.bincount(tokens).astype(np.float64)
    p = p[p > 0] / p.sum()
    return float(-(p * np.log(p)).sum())


def split_corpus(tokens: np.ndarray, val_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """``(train, eval)``: the first ``1 - val_fraction`` of the tokens, and the rest."""
    cut = int(len(tokens) * (1.0 - val_fraction))
    return tokens[:cut], tokens[cut:]


def train_batch(data: np.ndarray, seed: int, step: int, batch_size: int, seq_len: int):
    """Batch of step ``step``: a pure function of ``(seed, step)`` (no hidden RNG state)."""
    starts = np.random.default_rng([seed, step]).integers(0, len(data) - seq_len, batch_size)
    return _windows(data, starts, seq_len)


def eval_batches(data: np.ndarray, num_batches: int, batch_size: int, seq_len: int):
    """Fixed, evenly spaced windows of the held-out split."""
    starts = np.linspace(0, len(data) - seq_len - 1, num_batches * batch_size).astype(np.int64)
    return [_windows(data, s, seq_len) for s in starts.reshape(num_batches, batch_size)]


def _windows(data, starts, seq_len):
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    w = data[idx]
    return w[:, :-1], w[:, 1:]


# ----------------------------------------------------------------------------- model / steps


def make_model(cfg: ModelConfig, seed: int) -> LongNetLM:
    """Decoder-only LongNetLM of ``cfg`` (no RNG state kept: dropout keys come per step)."""
    return LongNetLM(
        len(cfg.vocab), cfg.d_model, cfg.num_heads, 0, cfg.num_layers, cfg.dim_feedforward,
        cfg.segment_lengths, cfg.dilation_rates, num_kv_heads=cfg.num_kv_heads,
        dropout=cfg.dropout, mode=cfg.mode, remat=cfg.remat, dtype=jnp.dtype(cfg.dtype),
        param_dtype=jnp.float32, keep_rngs=False, rngs=nnx.Rngs(params=seed),
    )


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
            deterministic: bool) -> jax.Array:
    """Mean next-character cross-entropy (nats), logits in float32."""
    logits = model(x, deterministic=deterministic, rngs=rngs).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


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
def _next_logits(model: LongNetLM, window: jax.Array, index: jax.Array) -> jax.Array:
    return model(window, deterministic=True)[0, index].astype(jnp.float32)


def sample(model: LongNetLM, tok: CharTokenizer, prompt: str, num_tokens: int, seq_len: int,
           temperature: float, key: jax.Array) -> str:
    """Samples ``num_tokens`` characters after ``prompt`` with a sliding ``seq_len`` window.

    The window is right-padded while shorter than ``seq_len``; the model is causal, so the
    padding never affects the logits that are read.
    """
    ids = list(tok.encode(prompt))
    if not ids:
        raise ValueError("prompt must not be empty")
    for i in range(num_tokens):
        ctx = ids[-seq_len:]
        window = np.zeros((1, seq_len), np.int32)
        window[0, : len(ctx)] = ctx
        logits = _next_logits(model, jnp.asarray(window), jnp.asarray(len(ctx) - 1))
        if temperature <= 0:
            nxt = int(jnp.argmax(logits))
        else:
            nxt = int(jax.random.categorical(jax.random.fold_in(key, i), logits / temperature))
        ids.append(nxt)
    return tok.decode(ids)


# ----------------------------------------------------------------------------- checkpoints


def _state_tree(model: nnx.Module, optimizer: nnx.Optimizer) -> dict[str, Any]:
    return {"model": nnx.to_pure_dict(nnx.state(model)),
            "optimizer": nnx.to_pure_dict(nnx.state(optimizer))}


def state_checksum(tree: Any) -> str:
    """SHA-256 over every leaf's path, dtype, shape and bytes."""
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        a = np.asarray(leaf)
        h.update(f"{jax.tree_util.keystr(path)}|{a.dtype}|{a.shape}|".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _manager(directory: str | Path, keep: int = 3, create: bool = True):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(
        Path(directory).absolute(),
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=create),
    )


def save_checkpoint(directory: str | Path, step: int, model: nnx.Module,
                    optimizer: nnx.Optimizer, model_cfg: ModelConfig, train_cfg: TrainConfig,
                    keep: int = 3) -> Path:
    """Writes ``directory/<step>`` (state + JSON meta) and waits until it is on disk."""
    import orbax.checkpoint as ocp

    tree = _state_tree(model, optimizer)
    meta = {
        "format": CHECKPOINT_FORMAT, "step": int(step), "model_config": model_cfg.to_json(),
        "train_config": dataclasses.asdict(train_cfg), "checksum": state_checksum(tree),
    }
    mngr = _manager(directory, keep)
    try:
        mngr.save(int(step), args=ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                                     meta=ocp.args.JsonSave(meta)), force=True)
        mngr.wait_until_finished()
    finally:
        mngr.close()
    return Path(directory).absolute() / str(int(step))


def _existing_steps(directory: str | Path) -> list[int]:
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())


def read_checkpoint_meta(directory: str | Path, step: int | None = None) -> tuple[int, dict]:
    """Returns ``(step, meta)`` of the latest (or given) checkpoint in ``directory``."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    if not directory.is_dir():
        raise CheckpointError(f"no checkpoint found: checkpoint directory {directory} "
                              "does not exist")
    mngr = _manager(directory, create=False)
    try:
        steps = sorted(mngr.all_steps())
        if not steps:
            raise CheckpointError(f"no checkpoint found in {directory}")
        step = steps[-1] if step is None else int(step)
        if step not in steps:
            raise CheckpointError(f"no checkpoint for step {step} in {directory} "
                                  f"(available: {steps})")
        try:
            meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        except Exception as e:
            raise CheckpointError(f"checkpoint {directory / str(step)} is corrupt or "
                                  f"incomplete: cannot read its meta JSON ({e})") from e
    finally:
        mngr.close()
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"checkpoint {directory / str(step)} has an unknown format "
                              f"(meta: {str(meta)[:200]})")
    return step, meta


def _check_model_config(meta: dict, model_cfg: ModelConfig, where: str | Path) -> None:
    saved, now = meta.get("model_config") or {}, model_cfg.to_json()
    if saved != now:
        diff = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
        raise CheckpointError(
            f"checkpoint {where} was written for a different model config; differing fields: "
            f"{diff} (checkpoint: { {k: saved.get(k) for k in diff} }, now: "
            f"{ {k: now.get(k) for k in diff} }). Use the same model flags or another "
            "--checkpoint-dir."
        )


_TRAJECTORY_FIELDS = ("steps", "batch_size", "seq_len", "lr", "warmup", "weight_decay",
                      "clip_norm", "seed")


def _check_train_config_unchanged(meta: dict, cfg: TrainConfig) -> None:
    saved = meta.get("train_config") or {}
    changed = {k: (saved.get(k), getattr(cfg, k)) for k in _TRAJECTORY_FIELDS
               if k in saved and saved[k] != getattr(cfg, k)}
    if changed and not cfg.allow_config_change:
        flags = ", ".join(f"--{k.replace('_', '-')}" for k in changed)
        raise CheckpointError(
            f"checkpoint in {Path(cfg.checkpoint_dir).absolute()} was written with a different "
            f"training config ({flags}; checkpoint vs now: {changed}); resuming would not "
            "reproduce the interrupted run. Use the same flags, or pass --allow-config-change "
            "to continue anyway")


def restore_checkpoint(directory: str | Path, model: nnx.Module, optimizer: nnx.Optimizer,
                       model_cfg: ModelConfig, step: int | None = None) -> tuple[int, dict]:
    """Restores the latest (or given) checkpoint into ``model`` and ``optimizer`` in place.

    Raises:
      CheckpointError: no checkpoint, unreadable or corrupt files (checksum mismatch), or a
        checkpoint written for another model configuration.
    """
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    step, meta = read_checkpoint_meta(directory, step)
    _check_model_config(meta, model_cfg, directory / str(step))
    # Restore to host (NumPy) and put back with jnp.asarray: the arrays are then placed like
    # freshly initialized ones (uncommitted), so an already compiled train step is reused.
    target = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), _state_tree(model, optimizer))
    mngr = _manager(directory, create=False)
    try:
        tree = mngr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target))).state
    except Exception as e:
        raise CheckpointError(f"checkpoint {directory / str(step)} is corrupt or incomplete: "
                              f"cannot read its state ({type(e).__name__}: {e})") from e
    finally:
        mngr.close()
    if state_checksum(tree) != meta.get("checksum"):
        raise CheckpointError(f"checkpoint {directory / str(step)} is corrupt: the state's "
                              "SHA-256 does not match the one recorded when it was saved")
    for obj, key in ((model, "model"), (optimizer, "optimizer")):
        state = nnx.state(obj)
        nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, tree[key]))
        nnx.update(obj, state)
    return step, meta


# ----------------------------------------------------------------------------- training loop


class _Progress:
    """tqdm progress bar, or plain periodic lines where tqdm is not installed/disabled."""

    def __init__(self, total: int, initial: int, enabled: bool, log: Callable[[str], None]):
        self.log, self.bar = log, None
        if enabled:
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, step: int, **postfix: str) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(postfix, refresh=False)

    def write(self, msg: str) -> None:
        (self.bar.write if self.bar is not None else self.log)(msg)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _flag(name: str) -> str:
    return f"{name} (--{name.replace('_', '-')})"


def _check_number(cfg: Any, name: str, *, low: float, strict: bool, integer: bool) -> None:
    value = getattr(cfg, name)
    kind = "an int" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float) if not integer else int):
        raise TypeError(f"{_flag(name)} must be {kind}, got {value!r}")
    if not math.isfinite(value) or (value <= low if strict else value < low):
        rule = f"> {low:g}" if strict else f">= {low:g}"
        raise ValueError(f"{_flag(name)} must be finite and {rule}, got {value}")


# (name, lower bound, strictly greater, int)
_TRAIN_RULES = (
    ("steps", 0, True, True), ("batch_size", 0, True, True), ("seq_len", 0, True, True),
    ("lr", 0.0, True, False), ("warmup", 0, False, True), ("weight_decay", 0.0, False, False),
    ("clip_norm", 0.0, True, False), ("eval_every", 0, False, True),
    ("eval_batches", 0, True, True), ("checkpoint_every", 0, True, True),
    ("keep_checkpoints", 0, True, True), ("sample_tokens", 0, False, True),
    ("temperature", 0.0, False, False),
)
_MODEL_RULES = (
    ("d_model", 0, True, True), ("num_heads", 0, True, True), ("num_layers", 0, True, True),
    ("dim_feedforward", 0, True, True), ("dropout", 0.0, False, False),
)


def check_model_config(model_cfg: ModelConfig) -> None:
    """Raises ``ValueError``/``TypeError`` naming the flag of the first invalid field."""
    from dilax import _validation as V

    for name, low, strict, integer in _MODEL_RULES:
        _check_number(model_cfg, name, low=low, strict=strict, integer=integer)
    m = model_cfg
    if m.d_model % 2:
        raise ValueError(f"{_flag('d_model')} must be even (XPOS rotates feature pairs), "
                         f"got {m.d_model}")
    if m.d_model % m.num_heads:
        raise ValueError(f"{_flag('d_model')}={m.d_model} must be divisible by "
                         f"{_flag('num_heads')}={m.num_heads}")
    if m.num_kv_heads is not None:
        _check_number(m, "num_kv_heads", low=0, strict=True, integer=True)
        if m.num_heads % m.num_kv_heads:
            raise ValueError(f"{_flag('num_heads')}={m.num_heads} must be divisible by "
                             f"{_flag('num_kv_heads')}={m.num_kv_heads}")
    if not m.dropout < 1.0:
        raise ValueError(f"{_flag('dropout')} must be in [0, 1), got {m.dropout}")
    if m.dtype not in ("float32", "bfloat16"):
        raise ValueError(f"{_flag('dtype')} must be float32 or bfloat16, got {m.dtype!r}")
    try:
        ws, _ = V.check_branches(m.segment_lengths, m.dilation_rates)
        V.check_mode(m.mode, m.num_heads, len(ws))
    except (ValueError, TypeError) as e:
        raise type(e)(f"invalid model flags (--segment-lengths, --dilation-rates, --mode, "
                      f"--num-heads): {e}") from None


def _activation_bytes(cfg: TrainConfig, m: ModelConfig) -> int:
    """A lower bound on one train step's activations: per layer and token the attention
    inputs/outputs and the feed-forward hidden layer, plus the logits (float32)."""
    per_token = m.num_layers * (6 * m.d_model + m.dim_feedforward) + 2 * len(m.vocab)
    return 4 * cfg.batch_size * cfg.seq_len * per_token


def check_train_config(cfg: TrainConfig, model_cfg: ModelConfig, n_train: int,
                       n_val: int) -> None:
    """Validates the training flags against each other, the corpus and the machine.

    Raises ``ValueError``/``TypeError`` naming the flag; nothing is built or read.
    """
    from dilax import memory

    for name, low, strict, integer in _TRAIN_RULES:
        _check_number(cfg, name, low=low, strict=strict, integer=integer)
    if cfg.seq_len + 1 >= min(n_train, n_val):
        raise ValueError(f"{_flag('seq_len')}={cfg.seq_len} is too long for the corpus splits "
                         f"({n_train} train, {n_val} eval characters)")
    if cfg.resume and not cfg.checkpoint_dir:
        raise ValueError("--resume needs --checkpoint-dir")
    if cfg.stop_after is not None and (
        isinstance(cfg.stop_after, bool) or not isinstance(cfg.stop_after, int)
        or not 0 < cfg.stop_after <= cfg.steps
    ):
        raise ValueError(f"{_flag('stop_after')} must be in [1, --steps={cfg.steps}], "
                         f"got {cfg.stop_after}")
    if cfg.sample_tokens > 0:
        if not cfg.prompt:
            raise ValueError(f"{_flag('prompt')} must not be empty (or pass --sample-tokens 0)")
        missing = sorted(set(cfg.prompt) - set(model_cfg.vocab))
        if missing:
            raise ValueError(f"{_flag('prompt')} has characters outside the corpus "
                             f"vocabulary: {missing}")
    memory.check_fits(
        _activation_bytes(cfg, model_cfg),
        f"a train step with {_flag('batch_size')}={cfg.batch_size} and "
        f"{_flag('seq_len')}={cfg.seq_len}",
        hint="use a smaller --batch-size or --seq-len (or --remat)")


def _validate(cfg: TrainConfig, model_cfg: ModelConfig, n_train: int, n_val: int) -> None:
    check_model_config(model_cfg)
    check_train_config(cfg, model_cfg, n_train, n_val)


def train(cfg: TrainConfig, model_cfg: ModelConfig | None = None, *, text: str | None = None,
          progress: bool = True, log: Callable[[str], None] = print) -> TrainResult:
    """Trains (or resumes) a character LM; see the module docstring.

    Args:
      cfg: the training configuration.
      model_cfg: the model; default ``ModelConfig(vocab=<characters of the corpus>)``.
      text: the corpus; default the shipped one (:func:`dilax.data.load_corpus`).
      progress: show a tqdm progress bar (plain log lines otherwise).
      log: where messages go (default ``print``).

    Returns:
      :class:`TrainResult` with the per-step losses of this invocation, eval losses, the
      trained model and optimizer, and the sample (when the run reached ``cfg.steps``).

    Raises:
      ValueError: non-positive sizes, ``seq_len`` too long for the corpus, ``resume`` without
        ``checkpoint_dir``, ``stop_after`` outside ``[1, steps]``, ``model_cfg.vocab`` that is
        not the corpus's.
      CheckpointError: ``resume`` with a missing, corrupt or other-config checkpoint, or a
        fresh run into a ``checkpoint_dir`` that already holds checkpoints.
    """
    text = load_corpus() if text is None else text
    tok = CharTokenizer.from_text(text)
    model_cfg = ModelConfig(vocab=tok.vocab) if model_cfg is None else model_cfg
    if model_cfg.vocab != tok.vocab:
        raise ValueError("model_cfg.vocab does not match the corpus characters")
    tokens = tok.encode(text)
    train_data, val_data = split_corpus(tokens)
    _validate(cfg, model_cfg, len(train_data), len(val_data))
    entropy = unigram_entropy(tokens)

    if cfg.resume:  # fail fast, before building anything: missing, unreadable, other config
        _, meta = read_checkpoint_meta(cfg.checkpoint_dir)
        _check_model_config(meta, model_cfg, cfg.checkpoint_dir)
        _check_train_config_unchanged(meta, cfg)
    if cfg.checkpoint_dir and not cfg.resume:
        existing = _existing_steps(cfg.checkpoint_dir)
        if existing:
            raise CheckpointError(
                f"{Path(cfg.checkpoint_dir).absolute()} already holds checkpoints (steps "
                f"{existing}); pass --resume to continue that run or use another "
                "--checkpoint-dir")
    model = make_model(model_cfg, cfg.seed)
    optimizer = make_optimizer(model, cfg)
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    start = 0
    if cfg.resume:
        start, meta = restore_checkpoint(cfg.checkpoint_dir, model, optimizer, model_cfg)
        if int(optimizer.step[...]) != start:
            raise CheckpointError(f"checkpoint step {start} disagrees with the optimizer step "
                                  f"{int(optimizer.step[...])} stored in it")
        changed = {k: (v, getattr(cfg, k)) for k, v in meta["train_config"].items()
                   if k in ("steps", "batch_size", "seq_len", "lr", "warmup", "weight_decay",
                            "clip_norm", "seed") and getattr(cfg, k) != v}
        if changed and not cfg.allow_config_change:
            raise CheckpointError(
                f"checkpoint {Path(cfg.checkpoint_dir).absolute() / str(start)} was written "
                f"with a different training config; differing fields (checkpoint, now): "
                f"{changed}. Resuming would not reproduce the interrupted run: use the same "
                "flags, or pass --allow-config-change to continue anyway")
        if changed:
            log(f"warning: training config differs from the checkpoint's {changed}; the run "
                "will not reproduce an uninterrupted one")
        log(f"resumed from {Path(cfg.checkpoint_dir).absolute() / str(start)} (step {start})")
    log(f"LongNetLM: {num_params:,} parameters; corpus {len(tokens):,} characters, vocabulary "
        f"{len(tok.vocab)}; unigram entropy {entropy:.4f} nats/char "
        f"({entropy / math.log(2):.4f} bits/char)")

    evals = eval_batches(val_data, cfg.eval_batches, cfg.batch_size, cfg.seq_len)

    def evaluate() -> float:
        total = sum(eval_step(model, jnp.asarray(x), jnp.asarray(y)) for x, y in evals)
        return float(total) / len(evals)

    losses: dict[int, float] = {}
    eval_losses: dict[int, float] = {}
    if start == 0 and cfg.eval_every > 0:
        eval_losses[0] = evaluate()
    end = cfg.steps if cfg.stop_after is None else min(cfg.steps, cfg.stop_after)
    base_key = jax.random.key(cfg.seed)
    bar = _Progress(cfg.steps, start, progress, log)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    t0 = time.perf_counter()
    t_first = None
    try:
        for step in range(start + 1, end + 1):
            x, y = train_batch(train_data, cfg.seed, step, cfg.batch_size, cfg.seq_len)
            loss = train_step(model, optimizer, jnp.asarray(x), jnp.asarray(y),
                              jax.random.fold_in(base_key, step))
            losses[step] = float(loss)
            now = time.perf_counter()
            if t_first is None:
                t_first = now  # the first step includes compilation
            done = step - start - 1
            rate = done * tokens_per_step / (now - t_first) if done else float("nan")
            bar.update(step, loss=f"{losses[step]:.4f}", tok_s=f"{rate:,.0f}")
            if cfg.eval_every > 0 and (step % cfg.eval_every == 0 or step == end):
                eval_losses[step] = evaluate()
                bar.write(f"step {step}: train loss {losses[step]:.4f}, eval loss "
                          f"{eval_losses[step]:.4f} nats/char")
            if cfg.checkpoint_dir and (step % cfg.checkpoint_every == 0 or step == end):
                path = save_checkpoint(cfg.checkpoint_dir, step, model, optimizer, model_cfg,
                                       cfg, cfg.keep_checkpoints)
                bar.write(f"checkpoint saved: step {step} ({path})")
    finally:
        bar.close()
    elapsed = time.perf_counter() - t0
    run = end - start
    tps = ((run - 1) * tokens_per_step / (time.perf_counter() - t_first)
           if run > 1 and t_first is not None else float("nan"))
    text_out = None
    if cfg.sample_tokens > 0 and end == cfg.steps:
        text_out = sample(model, tok, cfg.prompt, cfg.sample_tokens, cfg.seq_len,
                          cfg.temperature, jax.random.fold_in(base_key, 0))  # step 0 never trains
    result = TrainResult(losses, eval_losses, entropy, start, end, tps, elapsed, text_out,
                         num_params, model, optimizer)
    if result.final_eval_loss is not None:
        fe = result.final_eval_loss
        log(f"final eval loss {fe:.4f} nats/char ({fe / math.log(2):.4f} bits/char) vs unigram "
            f"entropy {entropy:.4f} nats/char ({entropy / math.log(2):.4f} bits/char)")
    log(f"{run} steps in {elapsed:.1f} s, {tps:,.0f} tokens/s after compilation")
    if text_out is not None:
        log("sample:\n" + text_out)
    return result


# ----------------------------------------------------------------------------- CLI


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(v) for v in s.split(",") if v.strip())


class _Parser(argparse.ArgumentParser):
    """Raises ``ValueError`` (naming the flag) instead of exiting; :func:`main` reports it."""

    def error(self, message: str):
        raise ValueError(message)


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m dilax.train`` argument parser (defaults from the config classes)."""
    t, m = TrainConfig(), ModelConfig(vocab="")
    p = _Parser(prog="python -m dilax.train", description=__doc__.split("\n")[0])
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=t.steps)
    g.add_argument("--batch-size", type=int, default=t.batch_size)
    g.add_argument("--seq-len", type=int, default=t.seq_len)
    g.add_argument("--lr", type=float, default=t.lr, help="peak learning rate")
    g.add_argument("--warmup", type=int, default=t.warmup, help="linear warmup steps")
    g.add_argument("--weight-decay", type=float, default=t.weight_decay)
    g.add_argument("--clip-norm", type=float, default=t.clip_norm)
    g.add_argument("--seed", type=int, default=t.seed)
    g.add_argument("--eval-every", type=int, default=t.eval_every, help="0: never")
    g.add_argument("--eval-batches", type=int, default=t.eval_batches)
    g.add_argument("--checkpoint-dir", default=t.checkpoint_dir)
    g.add_argument("--checkpoint-every", type=int, default=t.checkpoint_every)
    g.add_argument("--keep-checkpoints", type=int, default=t.keep_checkpoints)
    g.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --checkpoint-dir")
    g.add_argument("--allow-config-change", action="store_true",
                   help="with --resume: continue even if training flags differ from the "
                        "checkpoint's (the run then differs from an uninterrupted one)")
    g.add_argument("--stop-after", type=int, default=None,
                   help="stop after this step (checkpointed), as if interrupted")
    g.add_argument("--sample-tokens", type=int, default=t.sample_tokens)
    g.add_argument("--temperature", type=float, default=t.temperature)
    g.add_argument("--prompt", default=t.prompt)
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g = p.add_argument_group("model")
    g.add_argument("--d-model", type=int, default=m.d_model)
    g.add_argument("--num-heads", type=int, default=m.num_heads)
    g.add_argument("--num-kv-heads", type=int, default=m.num_kv_heads)
    g.add_argument("--num-layers", type=int, default=m.num_layers)
    g.add_argument("--dim-feedforward", type=int, default=m.dim_feedforward)
    g.add_argument("--segment-lengths", type=_ints, default=m.segment_lengths,
                   help="comma separated, e.g. 32,64,128")
    g.add_argument("--dilation-rates", type=_ints, default=m.dilation_rates)
    g.add_argument("--mode", choices=("mixture", "grouped"), default=m.mode)
    g.add_argument("--dropout", type=float, default=m.dropout)
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default=m.dtype)
    g.add_argument("--remat", action="store_true", help="activation checkpointing per layer")
    return p


def configs_from_args(args: argparse.Namespace, vocab: str) -> tuple[TrainConfig, ModelConfig]:
    """Parsed CLI arguments -> ``(TrainConfig, ModelConfig)``."""
    tcfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    mcfg = ModelConfig(vocab=vocab, **{f.name: getattr(args, f.name)
                                       for f in dataclasses.fields(ModelConfig)
                                       if f.name != "vocab"})
    return tcfg, mcfg


def configs_from_argv(argv: Sequence[str] | None = None, text: str | None = None
                      ) -> tuple[TrainConfig, ModelConfig]:
    """Parses and validates the command line (nothing is built or trained).

    Raises:
      ValueError / TypeError: naming the offending flag (unknown flag, bad value, flags that
        contradict each other, a run that cannot fit in memory).
    """
    args = build_parser().parse_args(argv)
    text = load_corpus() if text is None else text
    tok = CharTokenizer.from_text(text)
    tcfg, mcfg = configs_from_args(args, tok.vocab)
    train_data, val_data = split_corpus(np.zeros(len(text), np.int8))
    _validate(tcfg, mcfg, len(train_data), len(val_data))
    return tcfg, mcfg


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 on bad flags or a checkpoint error)."""
    parser = build_parser()
    text = load_corpus()
    try:
        tcfg, mcfg = configs_from_argv(argv, text)
    except (ValueError, TypeError) as e:
        print(f"{parser.format_usage()}{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    try:
        train(tcfg, mcfg, text=text, progress=not parser.parse_args(argv).no_progress)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
