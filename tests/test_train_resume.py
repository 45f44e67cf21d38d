"""Kill -9 a training run after a checkpoint, resume it, lose nothing (issue #9)."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np

from dilax import train as T
from dilax.data import load_corpus

REPO = Path(__file__).resolve().parents[1]
TEXT = load_corpus()
# Each step writes a checkpoint; the run ends at step 12 (--stop-after): 9 steps after the
# kill point, so the run cannot end before the SIGKILL lands, and 9 steps to resume. The model
# and the hyperparameters (--steps 80 included: the schedule is part of the compiled step) are
# those of tests/test_train.py: one compiled train step for both (and the session's cache).
STEPS = 12
FLAGS = ["--d-model", "32", "--num-heads", "2", "--num-layers", "1", "--dim-feedforward", "64",
         "--segment-lengths", "16,32", "--dilation-rates", "1,2", "--steps", "80",
         "--stop-after", str(STEPS), "--batch-size", "8", "--seq-len", "32", "--lr", "1e-2",
         "--warmup", "10", "--eval-every", "0", "--checkpoint-every", "1",
         "--keep-checkpoints", "2", "--sample-tokens", "0", "--no-progress"]
KILL_AFTER = 3  # SIGKILL once the log shows the checkpoint of this step


def _bits(tree):
    return [np.atleast_1d(np.asarray(x)).view(np.uint8) for x in jax.tree.leaves(tree)]


def _kill_after_checkpoint(ckpt: Path) -> list[int]:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "dilax.train", *FLAGS, "--checkpoint-dir",
                             str(ckpt)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=REPO)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if f"checkpoint saved: step {KILL_AFTER} " in line:
                proc.send_signal(signal.SIGKILL)
                break
        else:
            raise AssertionError("run ended before its checkpoint at step "
                                 f"{KILL_AFTER}:\n{''.join(lines[-20:])}")
        lines += proc.stdout.readlines()  # whatever it logged before it died
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return [int(s) for s in re.findall(r"checkpoint saved: step (\d+)", "".join(lines))]


def test_killed_run_resumes_without_losing_a_completed_step(tmp_path):
    ckpt = tmp_path / "killed"
    logged = _kill_after_checkpoint(ckpt)
    assert logged and logged[-1] >= KILL_AFTER
    tcfg, mcfg = T.configs_from_argv(FLAGS + ["--checkpoint-dir", str(ckpt), "--resume"], TEXT)
    # from here on one checkpoint, the last (~0.2 s a save; checkpoint_every is not part of
    # the trajectory): the one compared below
    tcfg = dataclasses.replace(tcfg, checkpoint_every=STEPS)
    resumed = T.train(tcfg, mcfg, text=TEXT, progress=False, log=lambda s: None)
    # every step whose checkpoint was reported is kept: the run goes on after the last one
    assert resumed.start_step >= logged[-1]
    assert sorted(resumed.losses) == list(range(resumed.start_step + 1, STEPS + 1))
    full = T.train(dataclasses.replace(tcfg, checkpoint_dir=str(tmp_path / "full"),
                                       resume=False), mcfg, text=TEXT, progress=False,
                   log=lambda s: None)
    assert {s: full.losses[s] for s in resumed.losses} == resumed.losses
    for a, b in zip(_bits(T.state_tree(resumed.model, resumed.optimizer)),
                    _bits(T.state_tree(full.model, full.optimizer)), strict=True):
        np.testing.assert_array_equal(a, b)
    meta = [T.read_checkpoint_meta(d)[1] for d in (ckpt, tmp_path / "full")]
    assert meta[0]["step"] == meta[1]["step"] == STEPS
    assert meta[0]["checksum"] == meta[1]["checksum"]


def test_resume_with_another_config_is_refused(tmp_path, capsys):
    d = str(tmp_path / "run")
    assert T.main(FLAGS + ["--checkpoint-dir", d, "--stop-after", "2"]) == 0
    capsys.readouterr()
    changed_model = [x if x != "32" else "48" for x in FLAGS[:2]] + FLAGS[2:]
    assert T.main(changed_model + ["--checkpoint-dir", d, "--resume"]) == 2
    assert "--d-model 48 conflicts with the checkpoint's model config" in capsys.readouterr().err
    changed_lr = FLAGS + ["--lr", "3e-3", "--checkpoint-dir", d, "--resume"]
    assert T.main(changed_lr) == 2
    err = capsys.readouterr().err
    assert "different training config (--lr" in err and "--allow-config-change" in err
    # another trajectory flag, allowed: --seed changes the batches, not the compiled step
    changed_seed = FLAGS + ["--seed", "1", "--checkpoint-dir", d, "--resume"]
    assert T.main(changed_seed) == 2
    assert "different training config (--seed" in capsys.readouterr().err
    assert T.main(changed_seed + ["--allow-config-change", "--stop-after", "3"]) == 0
    out = capsys.readouterr().out
    assert "warning: training config differs" in out and "'seed': (0, 1)" in out, out
