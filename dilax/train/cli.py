"""Train a small character-level LongNet LM: ``python -m dilax.train``.

The command line: the argument parser (flags named after the :class:`TrainConfig` and
:class:`ModelConfig` fields), its translation into configs (on ``--resume``: the checkpoint's
configs, with the flags passed as overrides where allowed), and :func:`main`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dilax import compile_cache
from dilax.data import load_corpus
from dilax.train.checkpoints import CheckpointError, read_checkpoint_meta
from dilax.train.config import (
    ATTENTION_CHOICES,
    DEFAULT_SPARSE_PATTERN,
    LEGACY_CHECKPOINT,
    MODEL_FREE_FIELDS,
    MODEL_TRAINING_FIELDS,
    CharTokenizer,
    ModelConfig,
    TrainConfig,
    check_text_length,
    read_text_file,
    split_corpus,
    validate,
)
from dilax.train.loop import train
from dilax.train.packing import check_doc_separator, read_documents

EPILOG = """\
examples:
  python -m dilax.train --data my.txt --steps 300          # train on your own UTF-8 text
  python -m dilax.train --resume --checkpoint-dir DIR --steps 1000   # continue (or extend) a run
  python -m dilax.sample --checkpoint-dir DIR --prompt "Once" --tokens 200   # sample from it

Ctrl-C (or SIGTERM) finishes the current step, saves a checkpoint and prints how to resume;
a second Ctrl-C quits at once (a save it cuts short is discarded on --resume, which continues
from the last complete checkpoint). --resume takes the model, the tokenizer, the data file and the
training settings from the checkpoint: pass only what you want to change (--steps to train
longer; model flags cannot change, training flags need --allow-config-change).
"""


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(v) for v in s.split(",") if v.strip())


class _Parser(argparse.ArgumentParser):
    """Raises ``ValueError`` (naming the flag) instead of exiting; :func:`main` reports it."""

    def error(self, message: str):
        raise ValueError(message)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter,
                    argparse.RawDescriptionHelpFormatter):
    """Every flag's help ends with its default, unless the help already states it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if "default:" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m dilax.train`` argument parser (defaults from the config classes)."""
    t, m = TrainConfig(), ModelConfig(vocab="")
    p = _Parser(prog="python -m dilax.train",
                description="Train a small character-level LongNet language model.",
                epilog=EPILOG, formatter_class=HelpFormatter)
    g = p.add_argument_group("data and checkpoints")
    g.add_argument("--data", default=None, metavar="FILE",
                   help="UTF-8 text file to train on (with --pack also a directory: one "
                        "document per file); the character vocabulary (the tokenizer) "
                        "is built from it and saved in the checkpoint (default: the shipped "
                        "corpus, dilax/data/fables.txt)")
    g.add_argument("--pack", action="store_true",
                   help="train on packed documents: the files of the --data directory (sorted "
                        "by name), or the --data file split on --doc-separator lines, packed "
                        "greedily in order into --seq-len rows (a document that does not fit "
                        "in a row's rest starts the next row; one longer than a row is cut "
                        "into --seq-len pieces); every document is computed as if alone "
                        "(attention and rotary positions restart), no target crosses "
                        "documents")
    g.add_argument("--doc-separator", default=t.doc_separator, metavar="LINE",
                   help="with --pack and a --data file: a line that is exactly LINE ends a "
                        "document (the line is dropped)")
    g.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="where checkpoints go (default: checkpoints/<date>-<time>, a new "
                        "folder per run)")
    g.add_argument("--checkpoint-every", type=int, default=t.checkpoint_every,
                   help="save a checkpoint every this many steps (and at the end)")
    g.add_argument("--keep-checkpoints", type=int, default=t.keep_checkpoints,
                   help="how many of the latest checkpoints to keep")
    g.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --checkpoint-dir, with its "
                        "model, tokenizer, data file and training settings")
    g.add_argument("--allow-config-change", action="store_true",
                   help="with --resume: allow training flags (and --dropout, --dtype, another "
                        "--data) that differ from the checkpoint's; the run then differs from "
                        "an uninterrupted one")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=t.steps,
                   help="length of the whole run in steps (sets the learning-rate schedule)")
    g.add_argument("--batch-size", type=int, default=t.batch_size,
                   help="sequences per step")
    g.add_argument("--seq-len", type=int, default=t.seq_len,
                   help="characters per training sequence (the context length)")
    g.add_argument("--lr", type=float, default=t.lr, help="peak learning rate (AdamW)")
    g.add_argument("--warmup", type=int, default=t.warmup,
                   help="linear warmup steps, then cosine decay to lr/10")
    g.add_argument("--weight-decay", type=float, default=t.weight_decay,
                   help="AdamW weight decay (matrices only)")
    g.add_argument("--clip-norm", type=float, default=t.clip_norm,
                   help="clip gradients to this global norm")
    g.add_argument("--seed", type=int, default=t.seed,
                   help="seed of the initialization, the batches and dropout")
    g.add_argument("--eval-every", type=int, default=t.eval_every,
                   help="evaluate the held-out loss every this many steps (0: never)")
    g.add_argument("--eval-batches", type=int, default=t.eval_batches,
                   help="batches of the held-out last 10%% of the text per evaluation")
    g.add_argument("--stop-after", type=int, default=None,
                   help="stop after this step (checkpointed), as if interrupted "
                        "(default: run to --steps)")
    g.add_argument("--no-compile-cache", action="store_true",
                   help="do not use the persistent compilation cache (default: on, in "
                        "$JAX_COMPILATION_CACHE_DIR or ~/.cache/dilax/jax; a second run of the "
                        "same command then compiles nothing; dilax.compile_cache)")
    g.add_argument("--no-progress", action="store_true",
                   help="plain progress lines (after the first step, then every 10 s: step, "
                        "loss, tokens/s, time left) instead of a progress bar")
    g = p.add_argument_group("sample printed at the end")
    g.add_argument("--sample-tokens", type=int, default=t.sample_tokens,
                   help="characters to sample after training (0: no sample)")
    g.add_argument("--temperature", type=float, default=t.temperature,
                   help="sampling temperature (0: greedy)")
    g.add_argument("--prompt", default=None,
                   help="text the sample starts from (default: "
                        f"{t.prompt!r}; with --data, the text's first characters)")
    g = p.add_argument_group("model (fixed once trained: --resume takes it from the checkpoint)")
    g.add_argument("--d-model", type=int, default=m.d_model, help="model width")
    g.add_argument("--num-heads", type=int, default=m.num_heads, help="attention heads")
    g.add_argument("--num-kv-heads", type=int, default=m.num_kv_heads,
                   help="key/value heads for grouped-query attention (default: --num-heads)")
    g.add_argument("--num-layers", type=int, default=m.num_layers, help="decoder layers")
    g.add_argument("--dim-feedforward", type=int, default=m.dim_feedforward,
                   help="hidden width of the feed-forward block")
    g.add_argument("--segment-lengths", type=_ints, default=m.segment_lengths,
                   help="dilated attention segment lengths, comma separated, e.g. 32,64,128 "
                        f"(default: {','.join(map(str, m.segment_lengths))})")
    g.add_argument("--dilation-rates", type=_ints, default=m.dilation_rates,
                   help="one dilation rate per segment length, comma separated (default: "
                        f"{','.join(map(str, m.dilation_rates))})")
    g.add_argument("--mode", choices=("mixture", "grouped"), default=m.mode,
                   help="mixture: every head attends through every branch; grouped: heads "
                        "split among the branches")
    g.add_argument("--dropout", type=float, default=m.dropout, help="dropout rate")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default=m.dtype,
                   help="compute dtype (parameters stay float32)")
    g.add_argument("--remat", action="store_true",
                   help="activation checkpointing per layer (less memory, more compute)")
    g.add_argument("--local-window", type=int, default=m.local_window, metavar="W",
                   help="add a local-window branch: every query also attends the W tokens "
                        "before it (mixture mode); removes the loss spike at segment starts "
                        "(default: none)")
    g.add_argument("--position-scheme", choices=("xpos", "rope"), default=m.position_scheme,
                   help="rotary positions on the queries and keys of every attention: XPOS "
                        "(as in torchscale's LongNet) or plain RoPE")
    g.add_argument("--attention", choices=ATTENTION_CHOICES, default=m.attention,
                   help="dilated: the --segment-lengths/--dilation-rates branches; dense: dense "
                        "causal attention over the --seq-len window (one branch (seq_len, 1)); "
                        "block-sparse: local + strided blocks (--sparse-pattern). The arms of "
                        "python -m benchmarks quality")
    g.add_argument("--sparse-pattern", type=_ints, default=None, metavar="B,W,S",
                   help="with --attention block-sparse: block size B, local window W (tokens) "
                        "and stride S (blocks) of dilax.patterns.local_strided (default: "
                        f"{','.join(map(str, DEFAULT_SPARSE_PATTERN))})")
    return p


_UNSET = object()


def _parse(argv: Sequence[str] | None) -> tuple[argparse.Namespace, set[str]]:
    """``(args, names of the flags given on the command line)``."""
    parser = build_parser()
    probe = argparse.Namespace(**{a.dest: _UNSET for a in parser._actions if a.dest != "help"})
    args = parser.parse_args(argv, probe)
    given = {k for k, v in vars(args).items() if v is not _UNSET}
    for a in parser._actions:  # what was not given takes its default
        if getattr(args, a.dest, None) is _UNSET:
            setattr(args, a.dest, a.default)
    return args, given


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _attention_args(args: argparse.Namespace, given: set[str]) -> None:
    """``--attention`` fills in the fields it fixes (in place): ``dense`` and ``block-sparse``
    run one branch ``(seq_len, 1)`` (block-sparse does not use it), ``block-sparse`` its
    ``--sparse-pattern`` (default :data:`DEFAULT_SPARSE_PATTERN`).

    Raises:
      ValueError: a flag that ``--attention`` fixes or excludes was given with it.
    """
    attention = args.attention
    if attention not in ("dense", "block-sparse"):
        if "sparse_pattern" in given:
            raise ValueError(f"--sparse-pattern needs --attention block-sparse, got --attention "
                             f"{attention}")
        return
    clash = sorted(_flag(k) for k in ("segment_lengths", "dilation_rates", "local_window",
                                      "mode") if k in given)
    if clash:
        raise ValueError(f"--attention {attention} does not take {', '.join(clash)}: "
                         + ("it attends every earlier position of the --seq-len window"
                            if attention == "dense" else "its pattern is --sparse-pattern"))
    args.segment_lengths, args.dilation_rates = (args.seq_len,), (1,)
    if attention == "block-sparse":
        spec = args.sparse_pattern if "sparse_pattern" in given else DEFAULT_SPARSE_PATTERN
        args.sparse_pattern = tuple(spec)
    elif "sparse_pattern" in given:
        raise ValueError("--sparse-pattern needs --attention block-sparse, got --attention dense")


def configs_from_args(args: argparse.Namespace, vocab: str) -> tuple[TrainConfig, ModelConfig]:
    """Parsed CLI arguments -> ``(TrainConfig, ModelConfig)`` (a fresh run)."""
    values = dict(vars(args), block_sparse=getattr(args, "sparse_pattern", None),
                  prompt=TrainConfig.prompt if args.prompt is None else args.prompt)
    tcfg = TrainConfig(**{f.name: values[f.name] for f in dataclasses.fields(TrainConfig)})
    mcfg = ModelConfig(vocab=vocab, **{f.name: values[f.name]
                                       for f in dataclasses.fields(ModelConfig)
                                       if f.name != "vocab"})
    return tcfg, mcfg


def _default_prompt(text: str) -> str:
    """The text's first characters (up to 24, the first line): a prompt in its alphabet."""
    first = next((line.strip() for line in text.splitlines() if line.strip()), text)
    return first[:24]


def _resumed_configs(args: argparse.Namespace, given: set[str]
                     ) -> tuple[TrainConfig, ModelConfig]:
    """The checkpoint's configs with the given flags applied; a model flag that differs from
    the checkpoint's is refused (``ValueError`` naming it) unless it is free to change."""
    step, meta = read_checkpoint_meta(args.checkpoint_dir)
    where = Path(args.checkpoint_dir).absolute() / str(step)
    if "position_scheme" not in meta["model_config"]:
        raise CheckpointError(f"checkpoint {where}: {LEGACY_CHECKPOINT}")
    saved_model = ModelConfig.from_json(meta["model_config"])
    saved_train = TrainConfig.from_json(meta.get("train_config") or {})
    model_over = {}
    for f in dataclasses.fields(ModelConfig):
        if f.name == "vocab" or f.name not in given:
            continue
        value, saved = getattr(args, f.name), getattr(saved_model, f.name)
        if value == saved:
            continue
        if f.name in MODEL_FREE_FIELDS or (f.name in MODEL_TRAINING_FIELDS
                                           and args.allow_config_change):
            model_over[f.name] = value
            continue
        hint = (" (or pass --allow-config-change)" if f.name in MODEL_TRAINING_FIELDS else "")
        raise ValueError(
            f"{_flag(f.name)} {_fmt(value)} conflicts with the checkpoint's model config "
            f"({f.name}={_fmt(saved)} in {where}): --resume takes the model from the "
            f"checkpoint, so leave {_flag(f.name)} out{hint}, or start a new run with "
            "another --checkpoint-dir")
    train_over = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
                  if f.name in given}
    # never inherited: this invocation's own
    train_over.update(checkpoint_dir=args.checkpoint_dir, resume=True,
                      allow_config_change=args.allow_config_change, stop_after=args.stop_after)
    return (dataclasses.replace(saved_train, **train_over),
            dataclasses.replace(saved_model, **model_over))


def _fmt(v) -> str:
    return ",".join(map(str, v)) if isinstance(v, tuple | list) else str(v)


def _prepare(argv: Sequence[str] | None, text: str | None
             ) -> tuple[TrainConfig, ModelConfig, str | list[str], argparse.Namespace]:
    args, given = _parse(argv)
    if args.resume:
        if not args.checkpoint_dir:
            raise ValueError("--resume needs --checkpoint-dir")
        tcfg, mcfg = _resumed_configs(args, given)
    else:
        _attention_args(args, given)
        tcfg, mcfg = configs_from_args(args, vocab="")
    docs = None
    if tcfg.pack:  # a directory of documents, or a file split on separator lines
        docs = read_documents(tcfg.data, check_doc_separator(tcfg.doc_separator))
        text = "".join(docs)
    elif text is None:
        text = read_text_file(tcfg.data) if tcfg.data else load_corpus()
    where = f"--data {tcfg.data}" if tcfg.data else "the corpus"
    if tcfg.data:  # recorded in the checkpoint: a resume from another directory finds it
        tcfg = dataclasses.replace(tcfg, data=str(Path(tcfg.data).absolute()))
    if not args.resume:
        mcfg = dataclasses.replace(mcfg, vocab=CharTokenizer.from_text(text).vocab)
        if tcfg.data and "prompt" not in given:
            tcfg = dataclasses.replace(tcfg, prompt=_default_prompt(text))
    else:
        missing = sorted(set(text) - set(mcfg.vocab))
        if missing:
            raise ValueError(f"{where} has characters the checkpoint's tokenizer does not know: "
                             f"{missing[:20]}; resume with the run's own data")
    check_text_length(text, tcfg.seq_len, where)
    train_data, val_data = split_corpus(np.zeros(len(text), np.int8))
    validate(tcfg, mcfg, len(train_data), len(val_data))
    return tcfg, mcfg, text if docs is None else docs, args


def configs_from_argv(argv: Sequence[str] | None = None, text: str | None = None
                      ) -> tuple[TrainConfig, ModelConfig]:
    """Parses and validates the command line (nothing is built or trained).

    ``text`` overrides the ``--data`` file (default: that file, else the shipped corpus; with
    ``--pack`` the documents are always read from ``--data``). With
    ``--resume`` the configs start from the checkpoint's (its meta is read).

    Raises:
      ValueError / TypeError: naming the offending flag (unknown flag, bad value, flags that
        contradict each other or the checkpoint's model, a run that cannot fit in memory, a
        ``--data`` file that is missing, empty, binary or too short).
      CheckpointError: ``--resume`` and no readable checkpoint.
    """
    tcfg, mcfg, _, _ = _prepare(argv, text)
    return tcfg, mcfg


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status: 0, 2 on bad flags or a checkpoint error,
    128 + the signal number when SIGINT (130) or SIGTERM (143) stopped the run."""
    parser = build_parser()
    try:
        try:
            tcfg, mcfg, text, args = _prepare(argv, None)
        except (ValueError, TypeError) as e:
            print(f"{parser.format_usage()}{parser.prog}: error: {e}", file=sys.stderr)
            return 2
        except CheckpointError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        compile_cache.enable(off=args.no_compile_cache)
        if not tcfg.checkpoint_dir:
            tcfg = dataclasses.replace(
                tcfg, checkpoint_dir=os.path.join("checkpoints", time.strftime("%Y%m%d-%H%M%S")))
            print(f"checkpoints go to {tcfg.checkpoint_dir} (--checkpoint-dir)")
        try:
            data = dict(documents=text) if tcfg.pack else dict(text=text)
            result = train(tcfg, mcfg, progress=not args.no_progress, interrupt="exit", **data)
        except CheckpointError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    except KeyboardInterrupt:  # outside the steps (loading, compiling the sampler, ...)
        print("\ninterrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    if result.interrupted is not None:
        return 128 + result.interrupted
    if result.checkpoint:
        print(f"sample from it: python -m dilax.sample --checkpoint-dir {tcfg.checkpoint_dir} "
              "--prompt TEXT --tokens 200")
    return 0
