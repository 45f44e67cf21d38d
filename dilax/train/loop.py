"""The training loop: :func:`train` and what it returns."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dilax.data import load_corpus
from dilax.models import LongNetLM
from dilax.train.checkpoints import check_before_run, resume, save_checkpoint
from dilax.train.config import (
    CharTokenizer,
    ModelConfig,
    TrainConfig,
    check_text_length,
    eval_batches,
    read_text_file,
    split_corpus,
    train_batch,
    unigram_entropy,
    validate,
)
from dilax.train.packing import (
    PackedRows,
    documents_sha256,
    pack_documents,
    packed_batch,
    packed_eval_batches,
    read_documents,
    split_documents,
)
from dilax.train.sampling import sample
from dilax.train.steps import (
    count_params,
    eval_positions,
    eval_step,
    make_model,
    make_optimizer,
    train_step,
)

_clock = time.perf_counter  # one name for the loop's timings (tests substitute a fake clock)


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
    interrupted: int | None = None  # the signal (SIGINT, SIGTERM) that stopped the run early
    checkpoint: str | None = None  # the last checkpoint written, if any
    # eval loss per position (n,) after the last step (None when eval_every == 0 or the run
    # was interrupted)
    position_losses: np.ndarray | None = None

    @property
    def final_eval_loss(self) -> float | None:
        return self.eval_losses[max(self.eval_losses)] if self.eval_losses else None


# --no-progress: a plain progress line at most this often (and after the first step)
PLAIN_EVERY_S = 10.0


class _Progress:
    """tqdm progress bar, or plain periodic lines where tqdm is not installed/disabled: one
    line after the first (compiling) step and then one every :data:`PLAIN_EVERY_S` seconds
    (step, loss, tokens/s, time left), so a run without a bar is never silent for long."""

    def __init__(self, total: int, initial: int, enabled: bool, log: Callable[[str], None],
                 clock: Callable[[], float] | None = None):
        self.log, self.bar, self.total, self.initial = log, None, total, initial
        self.clock = clock or _clock
        self.t0 = self.last = self.clock()
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
            return
        now = self.clock()
        if step != self.initial + 1 and now - self.last < PLAIN_EVERY_S and step != self.total:
            return
        self.last = now
        done = step - self.initial
        left = (now - self.t0) / done * (self.total - step) if done else 0.0
        extra = "".join(f", {k} {v}" for k, v in postfix.items())
        self.log(f"step {step}/{self.total} ({100 * step / max(self.total, 1):.0f}%){extra}, "
                 f"{now - self.t0:.0f} s elapsed, ~{left:.0f} s left")

    def write(self, msg: str) -> None:
        (self.bar.write if self.bar is not None else self.log)(msg)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _StopRequest:
    """SIGINT (Ctrl-C) and SIGTERM while training: the first asks the loop to stop after the
    current step (it then checkpoints); the second quits at once without saving, through the
    signal's default action (``hard=True``, the CLI) or a ``KeyboardInterrupt``.

    Signal handlers can only be set from the main thread; elsewhere this does nothing.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, enabled: bool, hard: bool):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.hard = hard
        self.signum: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> _StopRequest:
        if self.enabled:
            self._previous = {s: signal.getsignal(s) for s in self.SIGNALS}
            for s in self.SIGNALS:
                signal.signal(s, self._first)
        return self

    def _first(self, signum, frame) -> None:
        self.signum = signum
        for s in self.SIGNALS:
            signal.signal(s, self._hard_second if self.hard else self._second)
        print(f"\n{signal.Signals(signum).name}: finishing the current step, then saving a "
              "checkpoint (interrupt again to quit at once without saving; the last complete "
              "checkpoint stays usable)",
              file=sys.stderr, flush=True)

    def _second(self, signum, frame) -> None:
        raise KeyboardInterrupt

    @staticmethod
    def _hard_second(signum, frame) -> None:
        # say what is left behind, then die by the signal's default action (exit status)
        print(f"\n{signal.Signals(signum).name} again: quitting at once; a save in progress "
              "stays unfinished (<step>.orbax-checkpoint-tmp, which --resume names and removes)"
              " and the last complete checkpoint is kept", file=sys.stderr, flush=True)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


@dataclasses.dataclass
class _Run:
    """What one invocation trains: the model and optimizer, the data, steps ``start+1..end``."""

    cfg: TrainConfig
    model_cfg: ModelConfig
    model: LongNetLM
    optimizer: nnx.Optimizer
    train_data: np.ndarray | PackedRows  # the token stream, or packed rows (--pack)
    evals: list  # batches (x, y), or (x, y, segment_ids, lengths) packed
    start: int
    end: int
    data_sha256: str | None = None


def _evaluate(run: _Run) -> float:
    total = sum(eval_step(run.model, *map(jnp.asarray, batch)) for batch in run.evals)
    return float(total) / len(run.evals)


@dataclasses.dataclass
class _Steps:
    """What :func:`_run_steps` returns."""

    losses: dict[int, float]
    eval_losses: dict[int, float]
    tokens_per_s: float
    elapsed_s: float
    last_step: int
    interrupted: int | None
    checkpoint: str | None


def _run_steps(run: _Run, progress: bool, log: Callable[[str], None],
               stop: _StopRequest) -> _Steps:
    """Trains steps ``run.start + 1 .. run.end``, evaluating every ``eval_every`` steps and
    checkpointing every ``checkpoint_every`` steps (both also at ``end``); evaluates first
    at step 0 on a fresh run. A signal (``stop``) ends the loop after the current step, which
    is then checkpointed. The throughput counts the time of this run's steps after the first
    (compiling) one: evaluations and checkpoints are left out, as in the progress bar."""
    cfg, start, end = run.cfg, run.start, run.end
    losses: dict[int, float] = {}
    eval_losses: dict[int, float] = {}
    if start == 0 and cfg.eval_every > 0:
        eval_losses[0] = _evaluate(run)
    base_key = jax.random.key(cfg.seed)
    bar = _Progress(cfg.steps, start, progress, log)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    t0 = _clock()
    timed, step_s = 0, 0.0  # steps timed (all but the first) and their seconds
    step, saved, saved_step = start, None, None
    extra = {"data_sha256": run.data_sha256} if run.data_sha256 else None
    try:
        for step in range(start + 1, end + 1):
            t_step = _clock()
            if isinstance(run.train_data, PackedRows):  # (x, y, segment_ids, lengths)
                batch = packed_batch(run.train_data, cfg.seed, step, cfg.batch_size)
            else:
                batch = train_batch(run.train_data, cfg.seed, step, cfg.batch_size, cfg.seq_len)
            x, y, *packed = map(jnp.asarray, batch)
            loss = train_step(run.model, run.optimizer, x, y, jax.random.fold_in(base_key, step),
                              *packed)
            losses[step] = float(loss)
            if step > start + 1:  # the first step includes compilation
                timed, step_s = timed + 1, step_s + (_clock() - t_step)
            rate = timed * tokens_per_step / step_s if timed else float("nan")
            bar.update(step, loss=f"{losses[step]:.4f}", tok_s=f"{rate:,.0f}")
            if stop.signum is not None:
                break
            if cfg.eval_every > 0 and (step % cfg.eval_every == 0 or step == end):
                eval_losses[step] = _evaluate(run)
                bar.write(f"step {step}: train loss {losses[step]:.4f}, eval loss "
                          f"{eval_losses[step]:.4f} nats/char")
            if cfg.checkpoint_dir and (step % cfg.checkpoint_every == 0 or step == end):
                saved = str(save_checkpoint(cfg.checkpoint_dir, step, run.model, run.optimizer,
                                            run.model_cfg, cfg, cfg.keep_checkpoints, extra))
                saved_step = step
                bar.write(f"checkpoint saved: step {step} ({saved})")
            if stop.signum is not None:  # arrived during eval or the checkpoint
                break
        if (stop.signum is not None and cfg.checkpoint_dir and step > start
                and saved_step != step):
            saved = str(save_checkpoint(cfg.checkpoint_dir, step, run.model, run.optimizer,
                                        run.model_cfg, cfg, cfg.keep_checkpoints, extra))
            bar.write(f"checkpoint saved: step {step} ({saved})")
    finally:
        bar.close()
    elapsed = _clock() - t0
    tps = timed * tokens_per_step / step_s if timed else float("nan")
    return _Steps(losses, eval_losses, tps, elapsed, step, stop.signum, saved)


def position_losses(model: LongNetLM, evals: list) -> np.ndarray:
    """Eval loss per position ``(n,)``, averaged over the eval batches."""
    return np.mean([np.asarray(eval_positions(model, jnp.asarray(x), jnp.asarray(y)))
                     for x, y in evals], axis=0)


def boundary_report(losses: np.ndarray, segment_lengths: tuple[int, ...]) -> dict[str, float]:
    """Mean eval loss at segment starts (positions ``p > 0`` with ``p % min(w) == 0``: there
    no dilated branch sees the preceding tokens) and elsewhere (other ``p > 0``; position 0
    has no context at all and is left out of both)."""
    w = min(segment_lengths)
    pos = np.arange(len(losses))
    starts = (pos > 0) & (pos % w == 0)
    rest = (pos > 0) & ~starts
    at = float(losses[starts].mean()) if starts.any() else float("nan")
    other = float(losses[rest].mean()) if rest.any() else float("nan")
    return dict(segment_starts=at, elsewhere=other, ratio=at / other)


def save_position_plot(path: str, curves: dict[str, np.ndarray],
                       segment_lengths: tuple[int, ...]) -> bool:
    """Per-position eval loss curves as a PNG at ``path`` (False if matplotlib is missing)."""
    try:  # a bare Figure: no pyplot, so a notebook's backend is left alone
        from matplotlib.figure import Figure
    except ImportError:
        return False
    fig = Figure(figsize=(7, 3.2), dpi=80)
    ax = fig.subplots()
    for label, losses in curves.items():
        ax.plot(np.arange(len(losses)), losses, label=label, lw=1.2)
    for p in range(min(segment_lengths), len(next(iter(curves.values()))), min(segment_lengths)):
        ax.axvline(p, color="grey", lw=0.5, ls=":")
    ax.set_xlabel("position in the window")
    ax.set_ylabel("eval loss (nats/char)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return True


def _report_positions(run: _Run, log: Callable[[str], None]) -> np.ndarray:
    import json
    import os

    losses = position_losses(run.model, run.evals)
    rep = None
    if run.model_cfg.attention == "dilated":  # dense/block-sparse have no segment starts
        rep = boundary_report(losses, run.model_cfg.segment_lengths)
        log(f"eval loss at segment starts {rep['segment_starts']:.4f}, elsewhere "
            f"{rep['elsewhere']:.4f} nats/char (ratio {rep['ratio']:.2f}; "
            + ("local window " + str(run.model_cfg.local_window) if run.model_cfg.local_window
               is not None else "no local window, see --local-window") + ")")
    if run.cfg.checkpoint_dir:
        base = os.path.join(run.cfg.checkpoint_dir, "eval_positions")
        with open(base + ".json", "w") as f:
            json.dump(dict(report=rep, losses=[float(x) for x in losses]), f)
        if save_position_plot(base + ".png", {"eval loss": losses},
                              run.model_cfg.segment_lengths):
            log(f"per-position eval loss: {base}.png")
    return losses


def _nats_and_bits(nats: float) -> str:
    return f"{nats:.4f} nats/char ({nats / math.log(2):.4f} bits/char)"


def train(cfg: TrainConfig, model_cfg: ModelConfig | None = None, *, text: str | None = None,
          progress: bool = True, log: Callable[[str], None] = print,
          interrupt: str = "stop", documents: list[str] | None = None) -> TrainResult:
    """Trains (or resumes) a character LM; see the :mod:`dilax.train` docstring.

    Args:
      cfg: the training configuration.
      model_cfg: the model; default ``ModelConfig(vocab=<characters of the corpus>)``.
      text: the corpus; default the file ``cfg.data``, else the shipped corpus
        (:func:`dilax.data.load_corpus`). Every character must be in ``model_cfg.vocab``.
      progress: show a tqdm progress bar (plain log lines otherwise).
      log: where messages go (default ``print``).
      interrupt: what SIGINT (Ctrl-C, a notebook's interrupt) and SIGTERM do during the
        steps. ``"stop"``: the first ends the run after the current step, which is
        checkpointed (with ``cfg.checkpoint_dir``), and :func:`train` returns normally with
        ``result.interrupted`` set; a second raises ``KeyboardInterrupt``. ``"exit"``: the
        same, but a second signal terminates the process at once (the CLI). ``"off"``: the
        handlers are left alone.
      documents: with ``cfg.pack``, the documents (default :func:`read_documents` of
        ``cfg.data`` and ``cfg.doc_separator``); ``text`` is then not used.

    Returns:
      :class:`TrainResult` with the per-step losses of this invocation, eval losses, the
      trained model and optimizer, and the sample (when the run reached ``cfg.steps``
      uninterrupted).

    Raises:
      ValueError: non-positive sizes, ``seq_len`` too long for the corpus, ``resume`` without
        ``checkpoint_dir``, ``stop_after`` outside ``[1, steps]``, a ``cfg.data`` file that is
        missing, empty, binary or too short, text characters outside ``model_cfg.vocab``.
      CheckpointError: ``resume`` with a missing, corrupt or other-config checkpoint, or a
        fresh run into a ``checkpoint_dir`` that already holds checkpoints.
    """
    if interrupt not in ("stop", "exit", "off"):
        raise ValueError(f"interrupt must be 'stop', 'exit' or 'off', got {interrupt!r}")
    docs = None
    if cfg.pack:  # documents packed into rows (dilax.train.packing)
        docs = (documents if documents is not None
                else read_documents(cfg.data, cfg.doc_separator))
        text = "".join(docs)
    elif text is None:
        text = read_text_file(cfg.data) if cfg.data else load_corpus()
    where = f"--data {cfg.data}" if cfg.data else "the training text"
    model_cfg = (ModelConfig(vocab=CharTokenizer.from_text(text).vocab) if model_cfg is None
                 else model_cfg)
    missing = sorted(set(text) - set(model_cfg.vocab))
    if missing:
        raise ValueError(f"{where} has characters outside the model's vocabulary "
                         f"(model_cfg.vocab, the checkpoint's tokenizer on --resume): "
                         f"{missing[:20]}")
    tok = CharTokenizer(model_cfg.vocab)
    tokens = tok.encode(text)
    check_text_length(text, cfg.seq_len, where)
    if docs is not None:
        train_docs, val_docs = split_documents([tok.encode(d) for d in docs])
        sizes = sum(map(len, train_docs)), sum(map(len, val_docs))
        data_sha256 = documents_sha256(docs)
    else:
        train_data, val_data = split_corpus(tokens)
        sizes = len(train_data), len(val_data)
        data_sha256 = hashlib.sha256(text.encode("utf-8")).hexdigest()
    validate(cfg, model_cfg, *sizes)
    entropy = unigram_entropy(tokens)
    # missing, unreadable, other config: before building
    check_before_run(cfg, model_cfg, data_sha256)

    model = make_model(model_cfg, cfg.seed)
    optimizer = make_optimizer(model, cfg)
    num_params = count_params(model)
    start = (resume(cfg, model, optimizer, model_cfg, log, data_sha256) if cfg.resume
             else 0)
    log(f"LongNetLM: {num_params:,} parameters; corpus {len(tokens):,} characters, vocabulary "
        f"{len(tok.vocab)}; unigram entropy {_nats_and_bits(entropy)}")

    end = cfg.steps if cfg.stop_after is None else min(cfg.steps, cfg.stop_after)
    if docs is not None:
        train_data = pack_documents(train_docs, cfg.seq_len)
        evals = packed_eval_batches(pack_documents(val_docs, cfg.seq_len), cfg.eval_batches,
                                    cfg.batch_size)
        log(f"packed {len(docs):,} documents into {len(train_data):,} training rows of "
            f"{cfg.seq_len} ({train_data.lengths.sum() / train_data.tokens.size:.0%} tokens, "
            "the rest padding)")
    else:
        evals = eval_batches(val_data, cfg.eval_batches, cfg.batch_size, cfg.seq_len)
    run = _Run(cfg, model_cfg, model, optimizer, train_data, evals, start, end, data_sha256)
    with _StopRequest(interrupt != "off", hard=interrupt == "exit") as stop:
        r = _run_steps(run, progress, log, stop)
    # the per-position report reads window positions: not those of packed rows
    pos_losses = (_report_positions(run, log)
                  if cfg.eval_every > 0 and r.interrupted is None and not cfg.pack else None)
    text_out = None
    if cfg.sample_tokens > 0 and r.last_step == cfg.steps and r.interrupted is None:
        text_out = sample(model, tok, cfg.prompt, cfg.sample_tokens, cfg.seq_len,
                          cfg.temperature,  # the key of step 0, which never trains
                          jax.random.fold_in(jax.random.key(cfg.seed), 0))
    result = TrainResult(r.losses, r.eval_losses, entropy, start, r.last_step, r.tokens_per_s,
                         r.elapsed_s, text_out, num_params, model, optimizer, r.interrupted,
                         r.checkpoint, pos_losses)
    if result.final_eval_loss is not None:
        what = ("final eval loss" if r.interrupted is None
                else f"last eval loss (step {max(result.eval_losses)})")
        log(f"{what} {_nats_and_bits(result.final_eval_loss)} vs unigram entropy "
            f"{_nats_and_bits(entropy)}")
    rate = (f", {r.tokens_per_s:,.0f} tokens/s after compilation"
            if math.isfinite(r.tokens_per_s) else "")
    log(f"{r.last_step - start} steps in {r.elapsed_s:.1f} s{rate}")
    if r.interrupted is not None or r.last_step < cfg.steps:  # a signal or --stop-after
        name = (signal.Signals(r.interrupted).name if r.interrupted is not None
                else f"--stop-after {cfg.stop_after}")
        if r.checkpoint:
            log(f"{name}: stopped after step {r.last_step} of {cfg.steps}; checkpoint saved in "
                f"{r.checkpoint}\nresume with: python -m dilax.train --resume --checkpoint-dir "
                f"{cfg.checkpoint_dir}")
        else:
            log(f"{name}: stopped after step {r.last_step} of {cfg.steps}; nothing saved "
                "(no checkpoint_dir)")
    if text_out is not None:
        log("sample:\n" + text_out)
    return result
