"""Interrupted saves and the end-of-run summary of the training CLI (issue 30): a second Ctrl-C
during a save leaves the last complete checkpoint usable and the resume says what it found;
``--stop-after`` prints the resume command; the throughput counts this run's steps only."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dilax import train as T
from dilax.data import load_corpus
from dilax.train import checkpoints as C
from dilax.train import loop as L

REPO = Path(__file__).resolve().parents[1]
TEXT = load_corpus()
# The model and the hyperparameters (--steps 80 included: the schedule is part of the compiled
# step) of tests/test_train.py: one compiled train step for every run here and there (and the
# session's compilation cache); runs end early with --stop-after.
FLAGS = ["--d-model", "32", "--num-heads", "2", "--num-layers", "1", "--dim-feedforward", "64",
         "--segment-lengths", "16,32", "--dilation-rates", "1,2", "--steps", "80",
         "--batch-size", "8", "--seq-len", "32", "--lr", "1e-2", "--warmup", "10",
         "--eval-every", "0", "--checkpoint-every", "1", "--keep-checkpoints", "2",
         "--sample-tokens", "0", "--no-progress"]
HOLD_STEP = 5
# The CLI with two holds, so that each signal lands where the test means it to: train step
# HOLD_STEP waits (before it runs) until the first SIGINT has been handled (the CLI's handler
# then sets SIGINT back to its default action), and after that, Orbax's final rename
# (tmp dir -> <step>) of a save waits forever: the second SIGINT comes during the save.
_HELD = f"""
import asyncio, signal, sys, time
from orbax.checkpoint._src.path import atomicity as A
import dilax.train.loop as L
hard = lambda: getattr(signal.getsignal(signal.SIGINT), "__name__", "") == "_hard_second"
finalize, step, calls = A.AtomicRenameTemporaryPath.finalize, L.train_step, [0]
async def held_save(self):
    if hard() and self.get_final().name.isdigit():  # the step's directory
        print(f"SAVE IN PROGRESS {{self.get().name}}", flush=True)
        await asyncio.sleep(600)
    await finalize(self)
def held_step(*a, **k):
    calls[0] += 1
    if calls[0] == {HOLD_STEP}:
        print("IN STEP {HOLD_STEP}", flush=True)
        while not hard():
            time.sleep(0.01)
    return step(*a, **k)
A.AtomicRenameTemporaryPath.finalize, L.train_step = held_save, held_step
from dilax.train.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _two_sigints(ckpt: Path) -> tuple[str, int]:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-c", _HELD, *FLAGS,
                             "--checkpoint-dir", str(ckpt)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    lines, deadline = [], time.monotonic() + 240
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(f"IN STEP {HOLD_STEP}"):
                proc.send_signal(signal.SIGINT)  # first: finish the step, then save
            if line.startswith("SAVE IN PROGRESS"):
                proc.send_signal(signal.SIGINT)  # second, during that save: quit at once
                break
            assert time.monotonic() < deadline, "".join(lines[-20:])
        lines += proc.stdout.readlines()
        proc.wait(timeout=60)
    finally:
        proc.kill()
    return "".join(lines), proc.returncode


def test_second_sigint_during_a_save_keeps_the_last_complete_checkpoint(tmp_path, capsys):
    ckpt = tmp_path / "run"
    out, rc = _two_sigints(ckpt)
    assert rc == -signal.SIGINT, out  # killed by the second one, at once
    assert "the last complete checkpoint stays usable" in out, out
    assert "SIGINT again: quitting at once; a save in progress stays unfinished" in out, out
    saved = [int(s) for s in re.findall(r"checkpoint saved: step (\d+)", out)]
    held = re.search(r"SAVE IN PROGRESS (\S+)", out)[1]
    unfinished = C.unfinished_saves(ckpt)
    assert [p.name for p in unfinished] == [held], out
    step = int(held.split(".")[0])
    assert step == HOLD_STEP and saved[-1] == HOLD_STEP - 1, out
    assert T.read_checkpoint_meta(ckpt)[0] == saved[-1]  # the previous one is intact

    # --resume says what it found and removes the unfinished save
    rc = T.main([*FLAGS, "--stop-after", str(step + 1), "--checkpoint-dir", str(ckpt),
                 "--resume"])
    log = capsys.readouterr().out
    assert rc == 0, log
    assert (f"{held}/ is an unfinished save (of step {step}, interrupted before it completed), "
            f"removed; resumed from {ckpt / str(saved[-1])} (step {saved[-1]})") in log, log
    assert "complete checkpoints: steps [" in log
    assert C.unfinished_saves(ckpt) == []
    assert T.read_checkpoint_meta(ckpt)[0] == step + 1


def test_no_checkpoint_found_names_the_unfinished_save(tmp_path):
    (tmp_path / "117.orbax-checkpoint-tmp-1732512345").mkdir()
    with pytest.raises(C.CheckpointError, match=re.escape(
            f"no checkpoint found in {tmp_path} (117.orbax-checkpoint-tmp-1732512345/ is an "
            "unfinished save (of step 117, interrupted before it completed), ignored)")):
        T.read_checkpoint_meta(tmp_path)


def test_stop_after_prints_the_resume_command_and_resumed_throughput_counts_its_steps(
        tmp_path, monkeypatch, capsys):
    ckpt = tmp_path / "run"
    rc = T.main([*FLAGS, "--stop-after", "2", "--checkpoint-dir", str(ckpt)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert (f"--stop-after 2: stopped after step 2 of 80; checkpoint saved in {ckpt / '2'}\n"
            f"resume with: python -m dilax.train --resume --checkpoint-dir {ckpt}") in out, out

    # A fake clock: each train step takes 1 s, each checkpoint 1000 s. The summary's rate is
    # that of the steps after the first (compiling) one of this run: 3 steps of 8 x 32 tokens
    # in 3 s (it was: every step of the run, over all the time since its first step).
    now = [0.0]
    monkeypatch.setattr(L, "_clock", lambda: now[0])

    def ticking(fn, seconds):
        def run(*a, **k):
            now[0] += seconds
            return fn(*a, **k)
        return run

    monkeypatch.setattr(L, "train_step", ticking(L.train_step, 1.0))
    monkeypatch.setattr(L, "save_checkpoint", ticking(L.save_checkpoint, 1000.0))
    rc = T.main([*FLAGS, "--stop-after", "6", "--checkpoint-dir", str(ckpt), "--resume"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"4 steps in {4 + 4000:.1f} s, {3 * 8 * 32 / 3:,.0f} tokens/s after compilation" \
        in out, out
