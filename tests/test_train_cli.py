"""The training and sampling CLIs as a person uses them (issue 19): ``--data`` with a
non-ASCII text, Ctrl-C during training, ``--resume`` from the checkpoint alone, and
``python -m dilax.sample``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dilax import sample as S
from dilax import train as T

REPO = Path(__file__).resolve().parents[1]
# The training guide's example (docs/training.md, whose block is not run again by
# tests/test_readme.py): its text (Latin with diacritics, Cyrillic,
# Japanese), its model and its training flags, so that the eval step, the train step of its
# schedule (--steps 30, the resume below) and the sampling program (its prompt and --tokens)
# are the guide's: compiled once in a test session (the persistent compilation cache of
# tests/conftest.py).
README_LINE = "Ünïcödé: Привет, мир! 日本語のテキスト. Straße {i}."
README_STEPS = 30
MODEL = ["--d-model", "32", "--num-heads", "2", "--num-layers", "1", "--dim-feedforward", "64",
         "--segment-lengths", "16,32,64", "--dilation-rates", "1,2,4"]
RUN = ["--batch-size", "4", "--seq-len", "64", "--eval-every", "1", "--eval-batches", "1",
       "--checkpoint-every", "1000", "--sample-tokens", "0", "--no-progress"]


def _text(lines: int = 300) -> str:
    """The training guide's ``my.txt``: ``echo "<README_LINE>"`` for ``i`` in ``$(seq 300)``."""
    return "".join(README_LINE.format(i=i) + "\n" for i in range(1, lines + 1))


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """A ``python -m dilax.train --data <non-ASCII text>`` run stopped by SIGINT once it has
    evaluated step 2: ``(data file, checkpoint dir, its output, its exit status)``."""
    d = tmp_path_factory.mktemp("cli")
    data = d / "my text.txt"
    data.write_text(_text(), encoding="utf-8")
    ckpt = d / "ckpt"
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dilax.train", "--data", str(data), "--checkpoint-dir",
         str(ckpt), "--steps", "500", *MODEL, *RUN], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env=env, cwd=d)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("step 2:"):
                proc.send_signal(signal.SIGINT)
                break
        lines += proc.stdout.readlines()
        proc.wait(timeout=120)
    finally:
        proc.kill()
    return data, ckpt, "".join(lines), proc.returncode


def test_sigint_saves_a_checkpoint_and_exits_130_without_traceback(interrupted):
    _, ckpt, out, rc = interrupted
    assert rc == 130, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    step = T.read_checkpoint_meta(ckpt)[0]
    assert step >= 2  # the step running when the signal came was finished, then saved
    assert f"SIGINT: stopped after step {step} of 500; checkpoint saved in {ckpt / str(step)}" \
        in out, out
    assert f"resume with: python -m dilax.train --resume --checkpoint-dir {ckpt}" in out


def test_sample_from_the_interrupted_checkpoint(interrupted, capsys):
    data, ckpt, _, _ = interrupted
    text = data.read_text(encoding="utf-8")
    loaded = T.load_model(ckpt)  # the model only: no optimizer is built
    assert loaded.tokenizer.vocab == "".join(sorted(set(text)))  # the tokenizer was saved
    assert loaded.train_config.data == str(data)
    # greedy sampling == a step-by-step argmax of the model's logits at the last prompt
    # position (written out here: the window, its padding, the position read, the decoding).
    # Same shapes as the sampler: an untrained model's near-ties make argmax sensitive to
    # rounding, so the reference must compute the logits the same way. The README's prompt
    # and length: its compiled sampler (temperature and top_k are traced values).
    forward = nnx.jit(lambda m, x: m(x, deterministic=True))
    prompt, n, seq_len = "Привет", 40, loaded.train_config.seq_len
    ids = list(loaded.tokenizer.encode(prompt))
    for _ in range(n):
        window = np.zeros((1, seq_len), np.int32)
        window[0, :len(ids)] = ids
        ids.append(int(jnp.argmax(forward(loaded.model, jnp.asarray(window))[0, len(ids) - 1])))
    expected = loaded.tokenizer.decode(ids)
    assert T.sample_text(loaded, prompt, n, temperature=0.0) == expected
    # the CLI prints the same; seeded top-k sampling is reproducible and stays in the vocab
    assert S.main(["--checkpoint-dir", str(ckpt), "--prompt", prompt, "--tokens", str(n),
                   "--temperature", "0"]) == 0
    assert capsys.readouterr().out == expected + "\n"
    flags = ["--checkpoint-dir", str(ckpt), "--prompt", "Привет", "--tokens", "40",
             "--top-k", "3", "--seed", "7"]  # the README's prompt and length, another top-k
    assert S.main(flags) == 0 and S.main(flags) == 0
    out = capsys.readouterr().out  # the text may hold newlines: compare the two halves
    first, second = out[:len(out) // 2], out[len(out) // 2:]
    assert first == second and first.startswith("Привет") and len(first) == 6 + 40 + 1
    assert set(first) <= set(loaded.tokenizer.vocab)
    # a character the model never saw is refused, naming the flag
    assert S.main(["--checkpoint-dir", str(ckpt), "--prompt", "Zeta"]) == 2
    assert "--prompt has characters the model was not trained on: ['Z']" \
        in capsys.readouterr().err


def test_top_k_draws_only_among_the_k_largest_logits():
    from dilax.models.generate import pick_tokens

    logits = jnp.tile(jnp.asarray([[0.0, 3.0, 1.0, 2.9, -1.0]]), (64, 1))
    drawn = pick_tokens(logits, jax.random.key(0), 1.0, 2)  # 64 rows, 64 independent draws
    assert set(np.asarray(drawn).tolist()) == {1, 3}
    assert set(np.asarray(pick_tokens(logits, jax.random.key(0), 0.0, 2)).tolist()) == {1}


def test_resume_with_only_checkpoint_dir_and_steps_continues_the_same_model(interrupted,
                                                                           capsys, tmp_path):
    data, ckpt, _, _ = interrupted
    import shutil

    d = tmp_path / "copy"
    shutil.copytree(ckpt, d)  # the other tests read the original
    step, meta = T.read_checkpoint_meta(d)
    tcfg, mcfg = T.configs_from_argv(["--resume", "--checkpoint-dir", str(d), "--steps",
                                      str(README_STEPS)])
    assert mcfg == T.ModelConfig.from_json(meta["model_config"])  # model + tokenizer
    assert tcfg.data == str(data) and tcfg.seq_len == 64 and tcfg.batch_size == 4
    before = T.load_model(d).model
    # (--eval-every 0 and --stop-after, flags that do not change the trajectory: one compile
    # less, and two steps of the README's schedule)
    assert step + 2 <= README_STEPS
    assert T.main(["--resume", "--checkpoint-dir", str(d), "--steps", str(README_STEPS),
                   "--stop-after", str(step + 2), "--eval-every", "0"]) == 0
    out = capsys.readouterr().out
    assert f"resumed from {d / str(step)} (step {step})" in out
    assert f"--steps {README_STEPS} (the checkpoint's run had 500)" in out
    after = T.load_model(d)
    assert after.step == step + 2
    # the same parameters trained on: the update from the restored ones is a small step
    pb, pa = (jax.tree.leaves(nnx.state(m, nnx.Param)) for m in (before, after.model))
    deltas = [float(jnp.abs(a - b).max()) for a, b in zip(pa, pb, strict=True)]
    assert 0 < max(deltas) < 0.1, deltas
    # a model flag that contradicts the checkpoint is refused, naming it
    assert T.main(["--resume", "--checkpoint-dir", str(d), "--steps", "99", "--num-heads",
                   "4"]) == 2
    assert "--num-heads 4 conflicts with the checkpoint's model config (num_heads=2" in (
        capsys.readouterr().err)
    # nothing left to train: say how to sample instead of printing "0 steps ... nan tokens/s"
    assert T.main(["--resume", "--checkpoint-dir", str(d), "--steps", str(step + 2)]) == 2
    assert "nothing left to train" in capsys.readouterr().err


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    (b"", "the file is empty"),
    (b"\x7fELF\x02\x01\x01\x00\x00\x00" * 300, "a binary file (it contains NUL bytes)"),
    ("café ".encode("latin-1") * 400, "not UTF-8 text (invalid byte 0xe9 at offset 3"),
    ("ünïcode ".encode() * 40, "is too short: 320 characters, but --seq-len 32 needs at least"),
])
def test_bad_data_files_are_refused_naming_data(tmp_path, content, message):
    path = tmp_path / "f.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=r"^--data .*f\.txt:? " + ".*" + _re(message)):
        T.configs_from_argv(["--data", str(path), "--seq-len", "32", *MODEL])


def _re(s: str) -> str:
    import re

    return re.escape(s)


def test_compile_cache_is_on_by_default_in_the_cli_and_can_be_turned_off(monkeypatch):
    """Issue 39: every new shape cost 10-30 s of compile and a second run paid it again. The
    CLIs point JAX's persistent compilation cache at $JAX_COMPILATION_CACHE_DIR or
    $XDG_CACHE_HOME/dilax/jax; --no-compile-cache or DILAX_NO_COMPILE_CACHE=1 leave it off."""
    import jax

    from dilax import compile_cache
    from dilax.train.cli import build_parser

    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/somewhere")
    assert compile_cache.default_dir() == "/somewhere/dilax/jax"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/the/users/dir")
    assert compile_cache.default_dir() == "/the/users/dir"
    assert compile_cache.enable(off=True) is None
    monkeypatch.setenv("DILAX_NO_COMPILE_CACHE", "1")
    assert compile_cache.enable() is None
    # on: the session's own cache directory (tests/conftest.py), so nothing else is touched
    session_dir = jax.config.jax_compilation_cache_dir
    monkeypatch.setenv("DILAX_NO_COMPILE_CACHE", "0")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", session_dir)
    assert compile_cache.enable() == session_dir == jax.config.jax_compilation_cache_dir
    assert build_parser().parse_args(["--no-compile-cache"]).no_compile_cache
