"""What a training run is: the model and training configs (and their checks), the character
tokenizer and the data batches (pure functions of ``(seed, step)``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dilax import _validation as V


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
    local_window: int | None = None  # a local-window branch |p - t| <= W (mixture mode)
    # rotary positions inside attention (dilax.models.LongNetConfig.position_scheme)
    position_scheme: str = "xpos"
    # "dilated" (the branches above), "dense" (one branch (seq_len, 1): dense causal
    # attention over the training window) or "block-sparse" (block_sparse below)
    attention: str = "dilated"
    # (block_size, window, stride) of dilax.patterns.local_strided (LongNetConfig.block_sparse)
    block_sparse: tuple[int, int, int] | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v
                for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ModelConfig:
        """From a checkpoint's ``model_config``.

        Raises:
          ValueError: the config has no ``position_scheme``: it was saved before issue 26 by a
            model that added XPOS to its token embeddings ("xpos_embedding"), which this
            version does not implement (its weights would be silently reinterpreted).
        """
        d = dict(d)
        if "position_scheme" not in d:
            raise ValueError(LEGACY_CHECKPOINT)
        d = {**MODEL_FIELDS_ADDED, **d}
        for k in ("segment_lengths", "dilation_rates"):
            d[k] = tuple(d[k])
        if d["block_sparse"] is not None:
            d["block_sparse"] = tuple(d["block_sparse"])
        return cls(**d)


# Model fields added after checkpoints were first written, with the value an older
# checkpoint (which lacks them) stands for.
MODEL_FIELDS_ADDED: dict[str, Any] = {"attention": "dilated", "block_sparse": None}
ATTENTION_CHOICES = ("dilated", "dense", "block-sparse")
# --attention block-sparse without --sparse-pattern: 16-token blocks, a 64-token local window,
# every 4th block
DEFAULT_SPARSE_PATTERN = (16, 64, 4)


# --pack: a line that is exactly this separates two documents of a --data file
DEFAULT_DOC_SEPARATOR = "<|endoftext|>"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """How to train (the CLI flags of the "training" group, same names with dashes).

    ``steps`` is the length of the whole run (it sets the learning-rate schedule);
    ``stop_after`` ends this invocation early, as if interrupted, after checkpointing;
    ``resume`` continues from the latest checkpoint in ``checkpoint_dir``. ``eval_every=0``
    disables evaluation, ``sample_tokens=0`` the final sample. ``data`` is the path of the
    UTF-8 training text (``None``: the shipped corpus); it is recorded in the checkpoint, so a
    resume reads the same file. ``pack``: train on packed documents (:mod:`dilax.train.packing`:
    ``data`` a directory of documents or a file split on ``doc_separator`` lines).
    """

    data: str | None = None
    pack: bool = False
    doc_separator: str = DEFAULT_DOC_SEPARATOR
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

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TrainConfig:
        """From a checkpoint's ``train_config``; fields this version does not know are
        dropped, missing ones take their defaults."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


LEGACY_CHECKPOINT = (
    "the checkpoint's model config has no position_scheme: it was written before issue 26 "
    "by a LongNetLM that added XPOS to its token embeddings, centred on the window "
    "(position scheme 'xpos_embedding'), so its logits depended on the window length. This "
    "version puts the positions inside attention ('xpos' or 'rope') and cannot load that "
    "model without changing what it computes: train a new one (python -m dilax.train)")

# Model fields that change neither the parameters nor the function computed: they may differ
# from a checkpoint's freely (``remat`` only trades memory for recomputation).
MODEL_FREE_FIELDS = ("remat",)
# Model fields that change training but not the parameters: they may differ from a
# checkpoint's with ``--allow-config-change``.
MODEL_TRAINING_FIELDS = ("dropout", "dtype")


# ----------------------------------------------------------------------------- checks


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
    for name, low, strict, integer in _MODEL_RULES:
        _check_number(model_cfg, name, low=low, strict=strict, integer=integer)
    m = model_cfg
    if m.d_model % m.num_heads:
        raise ValueError(f"{_flag('d_model')}={m.d_model} must be divisible by "
                         f"{_flag('num_heads')}={m.num_heads}")
    if m.position_scheme not in ("xpos", "rope"):
        raise ValueError(f"{_flag('position_scheme')} must be xpos or rope, got "
                         f"{m.position_scheme!r}")
    if (m.d_model // m.num_heads) % 2:
        raise ValueError(f"{_flag('d_model')} / {_flag('num_heads')} = "
                         f"{m.d_model // m.num_heads} must be even (the rotary positions "
                         "rotate feature pairs of every head)")
    if m.num_kv_heads is not None:
        _check_number(m, "num_kv_heads", low=0, strict=True, integer=True)
        if m.num_heads % m.num_kv_heads:
            raise ValueError(f"{_flag('num_heads')}={m.num_heads} must be divisible by "
                             f"{_flag('num_kv_heads')}={m.num_kv_heads}")
    if not m.dropout < 1.0:
        raise ValueError(f"{_flag('dropout')} must be in [0, 1), got {m.dropout}")
    if m.local_window is not None:
        _check_number(m, "local_window", low=0, strict=False, integer=True)
        if m.mode != "mixture":
            raise ValueError(f"{_flag('local_window')} needs --mode mixture, got {m.mode!r}")
    _check_attention(m)
    if m.dtype not in ("float32", "bfloat16"):
        raise ValueError(f"{_flag('dtype')} must be float32 or bfloat16, got {m.dtype!r}")
    try:
        ws, _ = V.check_branches(m.segment_lengths, m.dilation_rates)
        V.check_mode(m.mode, m.num_heads, len(ws))
    except (ValueError, TypeError) as e:
        raise type(e)(f"invalid model flags (--segment-lengths, --dilation-rates, --mode, "
                      f"--num-heads): {e}") from None


def _check_attention(m: ModelConfig) -> None:
    """``attention`` and the fields it fixes (``--attention``, ``--sparse-pattern``)."""
    from dilax.models.config import check_block_sparse

    if m.attention not in ATTENTION_CHOICES:
        raise ValueError(f"{_flag('attention')} must be one of {', '.join(ATTENTION_CHOICES)}, "
                         f"got {m.attention!r}")
    if m.attention == "block-sparse":
        if m.block_sparse is None:
            raise ValueError(f"--attention block-sparse needs {_flag('block_sparse')} "
                             "(--sparse-pattern BLOCK,WINDOW,STRIDE)")
        try:
            check_block_sparse(m.block_sparse)
        except (ValueError, TypeError) as e:
            raise type(e)(f"--sparse-pattern: {e}") from None
        if m.local_window is not None:
            raise ValueError("--local-window is a branch of dilated attention; it does not "
                             "apply to --attention block-sparse")
    elif m.block_sparse is not None:
        raise ValueError(f"--sparse-pattern needs --attention block-sparse, got --attention "
                         f"{m.attention}")
    if m.attention == "dense" and (len(m.segment_lengths) != 1 or m.dilation_rates != (1,)
                                   or m.local_window is not None):
        raise ValueError(f"--attention dense is one branch (seq_len, rate 1) without a local "
                         f"window, got --segment-lengths {m.segment_lengths}, --dilation-rates "
                         f"{m.dilation_rates}, --local-window {m.local_window}")


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
    if not isinstance(cfg.pack, bool):
        raise TypeError(f"{_flag('pack')} must be a bool, got {cfg.pack!r}")
    if cfg.pack and (not isinstance(cfg.doc_separator, str) or not cfg.doc_separator
                     or any(c in cfg.doc_separator for c in "\r\n")):
        raise ValueError(f"{_flag('doc_separator')} must be a non-empty line without line "
                         f"breaks, got {cfg.doc_separator!r}")
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


def validate(cfg: TrainConfig, model_cfg: ModelConfig, n_train: int, n_val: int) -> None:
    """:func:`check_model_config`, then :func:`check_train_config`."""
    check_model_config(model_cfg)
    check_train_config(cfg, model_cfg, n_train, n_val)


# ----------------------------------------------------------------------------- data


def read_text_file(path: str | Path, flag: str = "--data") -> str:
    """The UTF-8 text of ``path`` (a leading byte-order mark dropped).

    Raises:
      ValueError: naming ``flag`` when the file is missing, not a regular file, empty, or not
        UTF-8 text (a NUL byte or an invalid UTF-8 sequence: a binary file).
    """
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{flag} {path}: no such file")
    if not p.is_file():
        raise ValueError(f"{flag} {path}: not a regular file")
    raw = p.read_bytes()
    if not raw:
        raise ValueError(f"{flag} {path}: the file is empty")
    if b"\0" in raw[:1 << 20]:
        raise ValueError(f"{flag} {path}: a binary file (it contains NUL bytes); "
                         "expected UTF-8 text")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag} {path}: not UTF-8 text (invalid byte 0x{raw[e.start]:02x} "
                         f"at offset {e.start}; a binary file or another encoding); convert "
                         "it with e.g. `iconv -t UTF-8`") from None
    text = text.removeprefix("\ufeff")
    if not text.strip():
        raise ValueError(f"{flag} {path}: the file holds only whitespace")
    return text


def check_text_length(text: str, seq_len: int, where: str) -> None:
    """Raises ``ValueError`` naming ``where`` (e.g. ``--data my.txt``) when ``text`` is too
    short to hold a training and an evaluation window of ``seq_len + 1`` characters."""
    def fits(n: int) -> bool:
        cut = int(n * 0.9)  # split_corpus's cut
        return seq_len + 1 < min(cut, n - cut)

    if not fits(len(text)):
        need = max(1, math.floor((seq_len + 2) / 0.1) - 20)
        while not fits(need):
            need += 1
        raise ValueError(f"{where} is too short: {len(text):,} characters, but --seq-len "
                         f"{seq_len} needs at least {need:,} (the last 10% is held out for "
                         "evaluation and each split must hold a window of seq_len + 1); use a "
                         "longer text or a smaller --seq-len")


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
