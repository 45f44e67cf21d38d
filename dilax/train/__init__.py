"""Train a small character-level LongNet LM: ``python -m dilax.train``.

Decoder-only :class:`dilax.models.LongNetLM` on a UTF-8 text (``--data FILE``, default the
shipped corpus ``dilax/data/fables.txt``; its characters are the tokenizer's vocabulary),
optax AdamW with linear warmup + cosine decay and global-norm clipping, an ``nnx.jit`` train
step that donates the model and optimizer state, eval loss, Orbax checkpoints (``--resume``)
and a sampled continuation at the end. Losses are in nats per character.

Determinism: the batch of step ``s`` is drawn from ``numpy.random.default_rng([seed, s])`` and
the dropout key is ``fold_in(key(seed), s)``, so a run's only state is (parameters, optimizer
state, step). A checkpoint stores exactly that, and stopping at step ``k`` and resuming
reproduces the uninterrupted loss curve bit for bit (same machine and software).

Checkpoint layout (``--checkpoint-dir DIR``): ``DIR/<step>/state`` (Orbax arrays: model and
optimizer) and ``DIR/<step>/meta`` (JSON: model config with the vocabulary, training config
with the data path, step, the data's SHA-256, and SHA-256s of the state and of the model used
to detect corruption). ``--resume`` takes the model, the tokenizer, the data file and the
training settings from the checkpoint; flags passed with it override, except model flags
(refused, naming the flag) and trajectory flags (``--allow-config-change``). Ctrl-C / SIGTERM
finish the current step, checkpoint it and exit (130 / 143); a second Ctrl-C quits at once.

Sampling: ``python -m dilax.sample --checkpoint-dir DIR --prompt TEXT`` or, from Python,
``sample_text(load_model(DIR), prompt, n)``: only the model is restored, no optimizer.

Modules: ``config`` (the configs and their checks, the character tokenizer, the data batches),
``steps`` (model, optimizer, loss, train and eval steps), ``checkpoints`` (Orbax save/restore,
the resume checks, :func:`load_model`), ``sampling``, ``loop`` (:func:`train`) and ``cli``
(:func:`main`).
"""

from dilax.train.checkpoints import (
    CHECKPOINT_FORMAT,
    CheckpointError,
    LoadedModel,
    load_model,
    read_checkpoint_meta,
    restore_checkpoint,
    save_checkpoint,
    state_checksum,
    state_tree,
)
from dilax.train.cli import build_parser, configs_from_args, configs_from_argv, main
from dilax.train.config import (
    CharTokenizer,
    ModelConfig,
    TrainConfig,
    check_model_config,
    check_train_config,
    eval_batches,
    read_text_file,
    split_corpus,
    train_batch,
    unigram_entropy,
)
from dilax.train.loop import TrainResult, train
from dilax.train.sampling import sample, sample_text
from dilax.train.steps import eval_step, lm_loss, make_model, make_optimizer, make_tx, train_step

__all__ = [
    "CHECKPOINT_FORMAT",
    "CharTokenizer",
    "CheckpointError",
    "LoadedModel",
    "ModelConfig",
    "TrainConfig",
    "TrainResult",
    "build_parser",
    "check_model_config",
    "check_train_config",
    "configs_from_args",
    "configs_from_argv",
    "eval_batches",
    "eval_step",
    "lm_loss",
    "load_model",
    "main",
    "make_model",
    "make_optimizer",
    "make_tx",
    "read_checkpoint_meta",
    "read_text_file",
    "restore_checkpoint",
    "sample",
    "sample_text",
    "save_checkpoint",
    "split_corpus",
    "state_checksum",
    "state_tree",
    "train",
    "train_batch",
    "train_step",
    "unigram_entropy",
]
