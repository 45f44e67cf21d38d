"""Train a small character-level LongNet LM: ``python -m dilax.train``.

The command line: the argument parser (flags named after the :class:`TrainConfig` and
:class:`ModelConfig` fields), its translation into configs, and :func:`main`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

import numpy as np

from dilax.data import load_corpus
from dilax.train.checkpoints import CheckpointError
from dilax.train.config import CharTokenizer, ModelConfig, TrainConfig, split_corpus, validate
from dilax.train.loop import train


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
    g.add_argument("--local-window", type=int, default=m.local_window,
                   help="add a local-window branch: every query also attends the W tokens "
                        "before it (mixture mode); fixes the loss spike at segment starts")
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
    validate(tcfg, mcfg, len(train_data), len(val_data))
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
