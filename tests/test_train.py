"""dilax.train: tiny training run, Orbax checkpoints, bit-exact resume (issue 4, 4-5)."""

from __future__ import annotations

import dataclasses
import math
import re
import shutil
from collections import Counter
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from dilax import train as T
from dilax.data import load_corpus

TEXT = load_corpus()
VOCAB = T.CharTokenizer.from_text(TEXT).vocab
TINY_MODEL = T.ModelConfig(vocab=VOCAB, d_model=32, num_heads=2, num_layers=1,
                           dim_feedforward=64, segment_lengths=(16, 32), dilation_rates=(1, 2))
# Every run here uses these hyperparameters (short runs stop early with stop_after), so that
# they all share one compiled train step: the optimizer schedule is part of its static graph.
# tests/test_train_resume.py, tests/test_train_interrupts.py and notebooks/train_longnet.ipynb
# train this model with these hyperparameters too: the same programs, compiled once per
# session (the persistent compilation cache of tests/conftest.py).
SHORT = T.TrainConfig(steps=80, batch_size=8, seq_len=32, lr=1e-2, warmup=10, eval_every=3,
                      eval_batches=2, checkpoint_every=3, sample_tokens=0, stop_after=6)


def _run(cfg: T.TrainConfig, model_cfg: T.ModelConfig = TINY_MODEL) -> T.TrainResult:
    return T.train(cfg, model_cfg, text=TEXT, progress=False, log=lambda s: None)


def _bits(tree) -> list[np.ndarray]:
    """Leaves as raw bytes, so comparisons are bit-exact (NaN-safe, -0.0 != 0.0)."""
    return [np.atleast_1d(np.asarray(x)).view(np.uint8) for x in jax.tree.leaves(tree)]


def _assert_same_bits(a, b) -> None:
    la, lb = _bits(a), _bits(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(x, y)


def _state(result: T.TrainResult):
    return T.state_tree(result.model, result.optimizer)


# ----------------------------------------------------------------------------- data


def test_corpus_entropy_tokenizer_and_batches():
    counts = Counter(TEXT)
    expected = -sum(c / len(TEXT) * math.log(c / len(TEXT)) for c in counts.values())
    tok = T.CharTokenizer.from_text(TEXT)
    ids = tok.encode(TEXT)
    assert T.unigram_entropy(ids) == pytest.approx(expected, rel=1e-12)
    assert tok.decode(ids[:500]) == TEXT[:500]
    assert 100_000 < len(TEXT) < 500_000  # "a few hundred KB"
    x, y = T.train_batch(ids, 3, 17, 4, 32)
    x2, y2 = T.train_batch(ids, 3, 17, 4, 32)
    np.testing.assert_array_equal(x, x2)  # a pure function of (seed, step)
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # targets are the next characters
    assert not np.array_equal(x, T.train_batch(ids, 3, 18, 4, 32)[0])
    assert tok.decode(np.concatenate([x[0], y[0, -1:]])) in TEXT


# ----------------------------------------------------------------------------- training


def test_tiny_training_run_loss_drops():
    # a 16-character prompt and 32 characters: two windows of seq_len 32 (16 + 16 new), both
    # the same compiled program (tests/test_train_interrupts.py, notebooks/train_longnet.ipynb)
    cfg = dataclasses.replace(SHORT, stop_after=None, eval_every=80, eval_batches=4,
                              sample_tokens=32, prompt="Once upon a time")
    r = _run(cfg)
    first, last = r.eval_losses[0], r.eval_losses[80]
    print(f"tiny run: eval loss {first:.3f} -> {last:.3f} nats/char, unigram entropy "
          f"{r.unigram_entropy:.3f}")
    assert first > math.log(len(VOCAB)) - 0.5  # starts near uniform
    assert last < first - 1.0
    assert last < r.unigram_entropy  # it learned more than character frequencies
    assert np.mean([r.losses[s] for s in range(71, 81)]) < np.mean(
        [r.losses[s] for s in range(1, 11)]) - 1.0
    assert r.sample.startswith("Once upon a time") and len(r.sample) == 16 + 32
    assert set(r.sample) <= set(VOCAB)


# ----------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, T.TrainResult]:
    """A 6-step run that checkpointed at step 6, and its in-memory result."""
    d = tmp_path_factory.mktemp("ckpt") / "run"
    r = _run(dataclasses.replace(SHORT, eval_every=0, checkpoint_dir=str(d), checkpoint_every=6))
    return d, r


def test_checkpoint_round_trip_is_bit_exact(trained, tmp_path):
    run_dir, r = trained
    path = T.save_checkpoint(tmp_path, 6, r.model, r.optimizer, TINY_MODEL, SHORT)
    assert path == tmp_path.absolute() / "6"
    for d in (tmp_path, run_dir):  # saved here, and saved by the training loop
        model = T.make_model(TINY_MODEL, seed=123)  # another init: restore must overwrite all
        opt = T.make_optimizer(model, SHORT)
        step, meta = T.restore_checkpoint(d, model, opt, TINY_MODEL)
        assert step == 6 and meta["model_config"] == TINY_MODEL.to_json()
        assert int(opt.step[...]) == 6
        _assert_same_bits(T.state_tree(model, opt), _state(r))


def test_resume_reproduces_the_uninterrupted_run_bit_exactly(tmp_path):
    full = _run(dataclasses.replace(SHORT, checkpoint_dir=str(tmp_path / "a")))  # steps 1-6
    first = _run(dataclasses.replace(SHORT, checkpoint_dir=str(tmp_path / "b"), stop_after=3))
    assert first.last_step == 3 and sorted(first.losses) == [1, 2, 3]
    assert sorted(p.name for p in (tmp_path / "b").iterdir() if p.name.isdigit()) == ["3"]
    second = _run(dataclasses.replace(SHORT, checkpoint_dir=str(tmp_path / "b"), resume=True))
    assert second.start_step == 3 and sorted(second.losses) == [4, 5, 6]
    # the loss curve, eval losses and the final state are identical, bit for bit
    assert {**first.losses, **second.losses} == full.losses
    assert {**first.eval_losses, **second.eval_losses} == full.eval_losses
    _assert_same_bits(_state(second), _state(full))
    # and so is the final checkpoint on disk
    ma, mb = T.read_checkpoint_meta(tmp_path / "a")[1], T.read_checkpoint_meta(tmp_path / "b")[1]
    assert ma["step"] == mb["step"] == 6 and ma["checksum"] == mb["checksum"]


def test_missing_checkpoint_is_a_clear_error(tmp_path, capsys):
    cfg = dataclasses.replace(SHORT, checkpoint_dir=str(tmp_path / "nowhere"), resume=True)
    with pytest.raises(T.CheckpointError, match="no checkpoint found.*does not exist"):
        _run(cfg)
    (tmp_path / "empty").mkdir()
    with pytest.raises(T.CheckpointError, match="no checkpoint found in .*empty"):
        _run(dataclasses.replace(cfg, checkpoint_dir=str(tmp_path / "empty")))
    rc = T.main(["--resume", "--checkpoint-dir", str(tmp_path / "nowhere"), "--no-progress"])
    assert rc == 2
    assert "error: no checkpoint found" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--resume needs --checkpoint-dir"):
        _run(dataclasses.replace(SHORT, resume=True))


def _corrupt_copy(src: Path, dst: Path, what: str) -> Path:
    shutil.copytree(src, dst)
    step = dst / "6"
    if what == "array data":
        files = [p for p in (step / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
        assert files
        for p in files:  # flip bytes in the middle of every data file
            b = bytearray(p.read_bytes())
            for i in range(len(b) // 3, len(b) // 3 + 16):
                b[i] ^= 0xFF
            p.write_bytes(bytes(b))
    elif what == "truncated state":
        for p in (step / "state").rglob("*"):
            if p.is_file():
                p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2])
    elif what == "missing meta":
        shutil.rmtree(step / "meta")
    elif what == "bad checksum":
        meta_file = next(p for p in (step / "meta").rglob("*") if p.is_file() and
                         p.name != "commit_success.txt")
        meta_file.write_text(meta_file.read_text().replace('"checksum": "', '"checksum": "0'))
    return dst


# Orbax's async reader may leave an "Event loop is closed" message behind after the failed read
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("what", ["array data", "truncated state", "missing meta",
                                  "bad checksum"])
def test_corrupt_checkpoint_is_a_clear_error(trained, tmp_path, what):
    d = _corrupt_copy(trained[0], tmp_path / "c", what)
    model = T.make_model(TINY_MODEL, seed=0)
    opt = T.make_optimizer(model, SHORT)
    with pytest.raises(T.CheckpointError, match=r"corrupt"):
        T.restore_checkpoint(d, model, opt, TINY_MODEL)


def test_checkpoint_of_another_model_config_is_refused(trained):
    other = dataclasses.replace(TINY_MODEL, d_model=48, dilation_rates=(1, 4))
    model, opt = nnx.eval_shape(lambda: (m := T.make_model(other, 0), T.make_optimizer(m, SHORT)))
    with pytest.raises(T.CheckpointError,
                       match=r"different model config.*\['d_model', 'dilation_rates'\]"):
        T.restore_checkpoint(trained[0], model, opt, other)


def test_position_scheme_is_saved_and_old_checkpoints_are_refused_by_name(
        trained, tmp_path, monkeypatch, capsys):
    """Issue 26: the scheme is in the saved config and the model loads with it; a checkpoint
    without one (XPOS added to the embeddings, before issue 26) is refused, naming it, by
    every reader, never loaded as the current model."""
    r = trained[1]
    rope = dataclasses.replace(TINY_MODEL, position_scheme="rope")
    T.save_checkpoint(tmp_path / "rope", 6, r.model, r.optimizer, rope, SHORT)
    loaded = T.load_model(tmp_path / "rope")
    assert loaded.model_config == rope and loaded.model.config.position_scheme == "rope"
    assert TINY_MODEL.to_json()["position_scheme"] == "xpos"

    to_json = T.ModelConfig.to_json
    monkeypatch.setattr(T.ModelConfig, "to_json", lambda self: {
        k: v for k, v in to_json(self).items() if k != "position_scheme"})
    T.save_checkpoint(tmp_path / "old", 6, r.model, r.optimizer, TINY_MODEL, SHORT)
    monkeypatch.undo()
    legacy = r"no position_scheme.*'xpos_embedding'.*train a new one"
    with pytest.raises(T.CheckpointError, match=legacy):
        T.load_model(tmp_path / "old")
    model = T.make_model(TINY_MODEL, seed=0)
    with pytest.raises(T.CheckpointError, match=legacy):
        T.restore_checkpoint(tmp_path / "old", model, T.make_optimizer(model, SHORT),
                             TINY_MODEL)
    with pytest.raises(ValueError, match=legacy):
        T.ModelConfig.from_json(T.read_checkpoint_meta(tmp_path / "old")[1]["model_config"])
    assert T.main(["--resume", "--checkpoint-dir", str(tmp_path / "old")]) == 2
    assert re.search(legacy, capsys.readouterr().err)


def test_cli_trains_and_resumes(tmp_path, capsys):
    flags = ["--d-model", "32", "--num-heads", "2", "--num-layers", "1", "--dim-feedforward",
             "64", "--segment-lengths", "16,32", "--dilation-rates", "1,2", "--steps", "80",
             "--batch-size", "8", "--seq-len", "32", "--lr", "1e-2", "--warmup", "10",
             "--eval-every", "3", "--eval-batches", "2", "--checkpoint-every", "3",
             "--sample-tokens", "0", "--no-progress", "--checkpoint-dir", str(tmp_path)]
    assert T.main(flags + ["--stop-after", "3"]) == 0
    assert T.main(flags + ["--resume", "--stop-after", "6"]) == 0
    out = capsys.readouterr().out
    assert "unigram entropy" in out and "final eval loss" in out and "resumed from" in out
    # a changed model flag is refused, naming it
    assert T.main([f if f != "32" else "64" for f in flags[:2]] + flags[2:] + ["--resume"]) == 2
    assert "--d-model 64 conflicts with the checkpoint's model config (d_model=32" in (
        capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["3", "6"]
    # a fresh run does not silently mix its checkpoints into another run's directory
    assert T.main(flags + ["--stop-after", "3"]) == 2
    assert "already holds checkpoints" in capsys.readouterr().err


def test_train_state_has_no_rng_keys():
    """The only run state is parameters + optimizer state (+ the step): batches and dropout
    keys are derived from (seed, step), which is what makes resume exact."""
    model = nnx.eval_shape(lambda: T.make_model(dataclasses.replace(TINY_MODEL, dropout=0.1), 0))
    assert not jax.tree.leaves(nnx.state(model, nnx.RngState))


def test_no_progress_prints_plain_lines_between_evaluations():
    """Issue 39: ``--no-progress`` printed nothing between evaluations (60 s of silence). The
    plain progress lines come after the first (compiling) step, then at most every
    PLAIN_EVERY_S seconds, and at the last step, with the time left from the rate so far."""
    import dilax.train.loop as L

    now = [0.0]
    lines: list[str] = []
    bar = L._Progress(100, 0, False, lines.append, clock=lambda: now[0])
    for step in range(1, 101):
        now[0] = step * 1.0  # one second per step
        bar.update(step, loss="1.0000")
    assert [int(re.match(r"step (\d+)/100", x).group(1)) for x in lines] == [
        1, 11, 21, 31, 41, 51, 61, 71, 81, 91, 100]
    assert lines[1] == "step 11/100 (11%), loss 1.0000, 11 s elapsed, ~89 s left"
