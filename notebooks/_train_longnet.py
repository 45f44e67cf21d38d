"""The cells of ``train_longnet.ipynb`` (a tiny LongNet language model), as ``(kind, text)`` pairs
that ``notebooks/_build.py`` writes and executes.

The model, the hyperparameters and the sample's windows (a 16-character prompt, seq_len 32) are
those of ``tests/test_train.py``: in the test suite the notebook's programs are then compiled
once for both (the session's persistent compilation cache, ``tests/conftest.py``)."""

TRAIN = [
    ("md", """
# Training a tiny LongNet language model

`python -m dilax.train` trains a character-level `dilax.models.LongNetLM` (decoder-only,
dilated causal self-attention) on a UTF-8 text of yours (`--data`) or the fables corpus shipped
with dilax, with Orbax checkpoints and exact resume. Here we use its Python API,
`dilax.train.train`, at a tiny scale (well under a minute on a CPU): train 50 of 80 steps and
"stop", resume to step 80 from the checkpoint, plot the loss curve, and sample text from the
checkpoint.
"""),
    ("code", """
%matplotlib inline
import dataclasses
import shutil
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt

from dilax import train as T
from dilax.data import load_corpus

text = load_corpus()
tok = T.CharTokenizer.from_text(text)
print(f"{len(text):,} characters, vocabulary of {len(tok.vocab)}")

model_cfg = T.ModelConfig(vocab=tok.vocab, d_model=32, num_heads=2, num_layers=1,
                          dim_feedforward=64, segment_lengths=(16, 32), dilation_rates=(1, 2))
ckpt_dir = Path(tempfile.mkdtemp(prefix="dilax-train-")) / "checkpoints"
train_cfg = T.TrainConfig(steps=80, batch_size=8, seq_len=32, lr=1e-2, warmup=10,
                          eval_every=10, eval_batches=2, checkpoint_dir=str(ckpt_dir),
                          checkpoint_every=50, stop_after=50, sample_tokens=0)
"""),
    ("md", """
## Train 50 of 80 steps

`stop_after=50` stops as if the run were interrupted (the checkpoint of step 50 is written).
"""),
    ("code", """
first = T.train(train_cfg, model_cfg, text=text, progress=False)
print("checkpoints:", sorted(p.name for p in ckpt_dir.iterdir()))
"""),
    ("md", """
## Resume to step 80

`resume=True` restores parameters, optimizer state and the step; batches and dropout keys are
pure functions of `(seed, step)`, so the resumed run continues exactly where the first stopped.
"""),
    ("code", """
second = T.train(dataclasses.replace(train_cfg, resume=True, stop_after=None),
                 model_cfg, text=text, progress=False)
assert second.start_step == 50 and second.last_step == 80
losses = {**first.losses, **second.losses}
evals = {**first.eval_losses, **second.eval_losses}

fig, ax = plt.subplots(figsize=(6, 3.6))
ax.plot(list(losses), list(losses.values()), label="train loss")
ax.plot(list(evals), list(evals.values()), "o-", label="eval loss")
ax.axhline(first.unigram_entropy, ls="--", c="gray", label="unigram entropy")
ax.axvline(50, ls=":", c="k", label="resumed here")
ax.set_xlabel("step")
ax.set_ylabel("nats / character")
ax.legend(fontsize=8)
plt.show()
assert evals[80] < first.unigram_entropy  # it learned more than character frequencies
"""),
    ("md", """
## Load the model from the checkpoint and sample

`load_model` restores only the model (no optimizer is built, the optimizer state is not read),
with the tokenizer and configs saved in the checkpoint, and checks a SHA-256 of the model.
`sample_text` continues a prompt (`temperature`, `top_k`, `seed`).
"""),
    ("code", """
m = T.load_model(ckpt_dir)
print("restored step", m.step, "- vocabulary of", len(m.tokenizer.vocab))
print(T.sample_text(m, "Once upon a time", 112, temperature=0.6, top_k=10, seed=0))
"""),
    ("md", """
## The same from the command line

```bash
python -m dilax.train --data my.txt --steps 300 --checkpoint-dir ckpt   # your own UTF-8 text
# Ctrl-C finishes the current step, saves a checkpoint and prints how to resume:
python -m dilax.train --resume --checkpoint-dir ckpt --steps 600        # model, data, settings
python -m dilax.sample --checkpoint-dir ckpt --prompt "Once upon" --tokens 200 --top-k 10
```

Without `--data` it trains on the fables corpus; without `--checkpoint-dir` the checkpoints go
to a new `checkpoints/<date>-<time>/`. `--resume` takes the model, the tokenizer, the data file
and the training settings from the checkpoint: pass only what changes. All flags, with their
defaults (what `python -m dilax.train --help` prints):
"""),
    ("code", """
T.build_parser().print_help()
shutil.rmtree(ckpt_dir.parent)  # the temporary checkpoints of this notebook
"""),
]
