"""Sample text from a trained checkpoint: ``python -m dilax.sample``.

Restores only the model (no optimizer) of the latest checkpoint in ``--checkpoint-dir``,
with the tokenizer and context length saved there, and prints the prompt followed by the
sampled characters. The Python API is the same two calls::

    from dilax.train import load_model, sample_text
    m = load_model("checkpoints/run")
    print(sample_text(m, "Once upon a time", 200, temperature=0.8, top_k=20, seed=0))
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

from dilax import compile_cache
from dilax.train.checkpoints import CheckpointError, load_model
from dilax.train.cli import HelpFormatter
from dilax.train.sampling import sample_text


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise ValueError(message)


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m dilax.sample`` argument parser."""
    p = _Parser(prog="python -m dilax.sample", formatter_class=HelpFormatter,
                description="Sample text from a checkpoint of python -m dilax.train.")
    p.add_argument("--checkpoint-dir", required=True, metavar="DIR",
                   help="the training run's --checkpoint-dir (default: required)")
    p.add_argument("--step", type=int, default=None,
                   help="which checkpoint (default: the latest)")
    p.add_argument("--prompt", default=None, metavar="TEXT",
                   help="text to continue (default: the run's --prompt)")
    p.add_argument("--tokens", type=int, default=200, metavar="N",
                   help="characters to sample after the prompt")
    p.add_argument("--temperature", type=float, default=0.8, metavar="T",
                   help="softmax temperature; 0: greedy (always the most likely character)")
    p.add_argument("--top-k", type=int, default=None, metavar="K",
                   help="sample among the K most likely characters only (default: all)")
    p.add_argument("--seed", type=int, default=0, metavar="S",
                   help="random seed: the same seed gives the same text")
    p.add_argument("--no-compile-cache", action="store_true",
                   help="do not use the persistent compilation cache (dilax.compile_cache)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 on bad flags or an unreadable checkpoint)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        compile_cache.enable(off=args.no_compile_cache)
        loaded = load_model(args.checkpoint_dir, args.step)
        prompt = loaded.train_config.prompt if args.prompt is None else args.prompt
        try:
            text = sample_text(loaded, prompt, args.tokens, temperature=args.temperature,
                               top_k=args.top_k, seed=args.seed)
        except ValueError as e:  # name the flags, not the Python arguments
            msg = str(e)
            for py, flag in (("prompt", "--prompt"), ("num_tokens", "--tokens"),
                             ("top_k", "--top-k")):
                if msg.startswith(py + " "):
                    msg = flag + msg[len(py):]
            raise ValueError(msg) from None
    except ValueError as e:
        print(f"{parser.format_usage()}{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
