"""Writes the notebooks of this directory from the cell lists below, executed.

Edit the cells here, then run ``python notebooks/_build.py`` (it executes every notebook in a
fresh kernel, a minute or two, and writes it with its outputs and plots, so a code host shows
them); commit the script and the ``.ipynb`` files together. ``--no-execute`` writes them
without outputs. ``tests/test_notebooks.py`` checks that the committed cells equal what this
script writes (so the two never drift apart) and re-executes every notebook.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent


def _cell(kind: str, text: str):
    text = text.strip("\n")
    return new_markdown_cell(text) if kind == "md" else new_code_cell(text)


def notebook(cells: list[tuple[str, str]]) -> nbformat.NotebookNode:
    nb = new_notebook(cells=[_cell(kind, text) for kind, text in cells])
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    for i, cell in enumerate(nb.cells):  # stable ids: rebuilding gives identical files
        cell["id"] = f"cell-{i:02d}"
    return nb


# --------------------------------------------------------------------------------- quickstart

QUICKSTART = [
    ("md", """
# dilax quick start

This notebook walks through the pieces a new user needs, on a CPU in well under a minute:

1. the functional op `dilax.dilated_attention` (shapes, dtypes, GQA, causal, gradients);
2. the Flax NNX modules and the `create_attention` factory;
3. a picture of every dilation configuration: which keys each query sees;
4. block-sparse patterns;
5. memory versus sequence length, from XLA's own buffer assignment.

The exact definition of what is computed is in [`docs/semantics.md`](../docs/semantics.md).
"""),
    ("code", """
%matplotlib inline
import functools

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from flax import nnx

import dilax

dilax.describe();
"""),
    ("md", """
## 1. The functional op

Inputs use the layout of `jax.nn.dot_product_attention`: `q` is `(b, n, h, d)`, `k` and `v` are
`(b, n, hk, d)` with `h % hk == 0` (grouped-query attention without repeating K/V). A
configuration is a list of branches: `segment_lengths[i]` positions per segment, of which every
`dilation_rates[i]`-th takes part.
"""),
    ("code", """
b, n, h, hk, d = 1, 2048, 4, 2, 32
kq, kk, kv = jax.random.split(jax.random.key(0), 3)
q = jax.random.normal(kq, (b, n, h, d))
k = jax.random.normal(kk, (b, n, hk, d))
v = jax.random.normal(kv, (b, n, hk, d))

segment_lengths, dilation_rates = (256, 512, 1024), (1, 2, 4)
# Configuration arguments are static: close over them (or use functools.partial) under jit.
attend = jax.jit(lambda q, k, v: dilax.dilated_attention(q, k, v, segment_lengths,
                                                         dilation_rates, is_causal=True))
out = attend(q, k, v)
print("out", out.shape, out.dtype)

# bf16 inputs: float32 softmax statistics inside, bf16 output
bf16 = lambda x: x.astype(jnp.bfloat16)
out_bf16 = attend(bf16(q), bf16(k), bf16(v))
print("bf16 out", out_bf16.dtype, "max |bf16 - fp32| =",
      float(jnp.abs(out_bf16.astype(jnp.float32) - out).max()))
"""),
    ("md", """
Every fast path is tested against `implementation="reference"`, which builds the explicit
`n x n` mask from the rules (small `n` only). The same comparison here, on a short sequence:
"""),
    ("code", """
m = 600  # any n works, not only multiples of the segment lengths
qs, ks, vs = q[:, :m], k[:, :m], v[:, :m]
for mode in ("mixture", "grouped"):
    cfg = dict(segment_lengths=(64, 128, 256), dilation_rates=(1, 2, 4), mode=mode,
               is_causal=True)
    fast = jax.jit(functools.partial(dilax.dilated_attention, **cfg))(qs, ks, vs)
    ref = dilax.dilated_attention(qs, ks, vs, **cfg, implementation="reference")
    print(f"{mode:8s} max |xla - reference| = {float(jnp.abs(fast - ref).max()):.2e}")
"""),
    ("code", """
# Gradients, jit, vmap: it is an ordinary JAX function.
loss = lambda q, k, v: dilax.dilated_attention(q, k, v, segment_lengths, dilation_rates).sum()
dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
print("dq", dq.shape, "dk", dk.shape, "dv", dv.shape)

# Malformed configurations fail while tracing, naming the argument and the rule:
try:
    dilax.dilated_attention(q, k, v, (500, 1024), (3, 2))
except ValueError as e:
    print("ValueError:", e)
"""),
    ("md", """
## 2. Modules

`dilax.nn.DilatedAttention` is a parameter-free module over projected heads;
`dilax.nn.MultiheadDilatedAttention` adds the q/k/v/out projections and the MAGNETO
sub-LayerNorm (as in dilated-attention-pytorch). `dilax.create_attention` picks the module and
says why; `dilax.attention_fn` plugs dilated attention into `flax.nnx.MultiHeadAttention`.
"""),
    ("code", """
from dilax.nn import DilatedAttention, MultiheadDilatedAttention

attn = DilatedAttention(segment_lengths, dilation_rates, is_causal=True)
print("DilatedAttention:", jax.jit(attn)(q, k, v).shape)

mha = MultiheadDilatedAttention(embed_dim=128, num_heads=4, num_kv_heads=2,
                                segment_lengths=segment_lengths, dilation_rates=dilation_rates,
                                rngs=nnx.Rngs(0))
x = jax.random.normal(jax.random.key(1), (b, n, 128))
call = nnx.jit(lambda module, x: module(x, is_causal=True))  # modules go through nnx.jit
print("MultiheadDilatedAttention:", call(mha, x).shape)

choice = dilax.create_attention(segment_lengths=segment_lengths, dilation_rates=dilation_rates)
print(choice.choice)

flax_mha = nnx.MultiHeadAttention(num_heads=4, in_features=128, num_kv_heads=2, decode=False,
                                  attention_fn=dilax.attention_fn(segment_lengths,
                                                                  dilation_rates),
                                  rngs=nnx.Rngs(0))
print("nnx.MultiHeadAttention + dilax.attention_fn:", call(flax_mha, x).shape)
"""),
    ("md", """
## 3. Which keys does a query see?

`dilax.dilated_counts(n, h, segment_lengths, dilation_rates, mode, is_causal)` returns the
`(h, n, n)` matrix `C[j, p, t]`: in how many branches query `p` of head `j` may attend key `t`
(0 = never). In **mixture** mode each head runs every branch, with offset `j % r` — so the
heads together cover every position. In **grouped** mode each group of heads runs one branch.
Darker = counted in more branches.
"""),
    ("code", """
def show_counts(n, h, ws, rs, mode, is_causal, heads=4):
    c = dilax.dilated_counts(n, h, ws, rs, mode, is_causal)
    fig, axes = plt.subplots(1, heads, figsize=(2.6 * heads, 2.9))
    for j, ax in enumerate(axes):
        ax.imshow(c[j], cmap="Blues", vmin=0, vmax=len(ws), interpolation="nearest")
        ax.set_title(f"head {j}", fontsize=9)
        ax.set_xlabel("key t", fontsize=8)
        ax.set_ylabel("query p", fontsize=8)
        ax.tick_params(labelsize=7)
    causal = ", causal" if is_causal else ""
    fig.suptitle(f"{mode}: segment_lengths={ws}, dilation_rates={rs}{causal}", fontsize=10)
    fig.tight_layout()
    plt.show()
    return c

configs = [
    ((8,), (1,), "mixture", False),             # plain block-diagonal local attention
    ((8, 16, 32), (1, 2, 4), "mixture", False),  # LongNet: every head runs every branch
    ((8, 16, 32), (1, 2, 4), "mixture", True),
    ((8, 16, 32), (1, 2, 4), "grouped", False),  # one branch per head group
]
for ws, rs, mode, causal in configs:
    counts = show_counts(32, 4, ws, rs, mode, causal)
"""),
    ("code", """
# The same as text: the keys query p = 21 sees, per head (mixture, non-causal).
c = dilax.dilated_counts(32, 4, (8, 16, 32), (1, 2, 4), "mixture", False)
for j in range(4):
    keys = np.flatnonzero(c[j, 21])
    print(f"head {j}: {len(keys):2d} keys", keys.tolist())
"""),
    ("md", """
## 4. Block-sparse patterns

`dilax.patterns` builds immutable, hashable block masks (block size `B`): query `p` attends key
`t` iff block `(p // B, t // B)` is on. `show()` prints one as text, `plot()` draws it.
`dilax.block_sparse_attention(q, k, v, pattern)` computes exactly that mask with one softmax.
"""),
    ("code", """
from dilax import patterns as P

n_bs, B = 2048, 64  # n_bs = n
pats = {
    "local_window": P.local_window(n_bs, B, window=128),
    "dilated": P.dilated(n_bs, B, (1, 4)) & P.local_window(n_bs, B, window=512),
    "global_local": P.global_local(n_bs, B, global_tokens=64, window=128),
    "hierarchical": P.hierarchical(n_bs, ((64, 1), (256, 2), (1024, 1))),
    "random": P.random(n_bs, B, density=0.1, seed=0),
    "dilated_segments": P.dilated_segments(n_bs, B, (256, 512, 1024), (1, 2, 4)),
}
pats["local_window"].show()
fig, axes = plt.subplots(1, len(pats), figsize=(2.6 * len(pats), 2.9))
for ax, (name, pat) in zip(axes, pats.items()):
    pat.plot(ax=ax, head=0)
    ax.set_title(f"{name}\\ndensity {pat.density:.2f}", fontsize=8)
fig.tight_layout()
plt.show()

out_bs = jax.jit(lambda q, k, v: dilax.block_sparse_attention(q, k, v, pats["global_local"],
                                                            is_causal=True))(q, k, v)
print("block-sparse out", out_bs.shape)
"""),
    ("md", """
## 5. Memory versus sequence length

`dilax.memory.memory_report(fn, *args)` compiles `fn` and reads XLA's buffer assignment: exact
for the compiled program, and it allocates nothing when the arguments are
`jax.ShapeDtypeStruct`s. Dense attention grows like `n²`; dilated attention like `n`.
"""),
    ("code", """
from dilax.memory import format_bytes, memory_report

h_m, d_m = 4, 64
rows = {
    "dense (jax.nn.dot_product_attention)":
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
    "dilax mixture, segment_lengths (512, 1024, 2048)": lambda q, k, v: dilax.dilated_attention(
        q, k, v, (512, 1024, 2048), (1, 2, 4), is_causal=True),
}
ns = [1024, 4096, 16384, 65536]
peak = {name: {} for name in rows}
for name, fn in rows.items():
    for n_m in ns:
        if name.startswith("dense") and n_m > 2**14:
            continue  # dense at 65536 would need 4 x 16 GiB of scores
        s = jax.ShapeDtypeStruct((1, n_m, h_m, d_m), jnp.float32)
        peak[name][n_m] = memory_report(fn, s, s, s).peak_bytes

for name, byn in peak.items():
    print(f"{name}:\\n   ", "  ".join(f"{n_m}: {format_bytes(p)}" for n_m, p in byn.items()))

fig, ax = plt.subplots(figsize=(6, 4))
for name, byn in peak.items():
    ax.plot(list(byn), [p / 2**20 for p in byn.values()], marker="o", label=name)
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("sequence length n")
ax.set_ylabel("peak memory (MiB, XLA)")
ax.set_title(f"forward, b=1, h={h_m}, d={d_m}, float32")
ax.grid(True, which="both", alpha=0.3)
ax.legend(fontsize=8)
plt.show()
"""),
]

# ------------------------------------------------------------------------------ long context

LONG_CONTEXT = [
    ("md", """
# Long context on a CPU: 262,144 tokens, then ring attention on 8 devices

Dilated attention costs `n * w / r` (query, key) pairs per branch and head — linear in `n` — and
dilax never materializes anything `n x n`, so a quarter-million-token sequence fits in a few
hundred MiB on a laptop CPU. The second half splits a sequence over 8 devices with
`dilax.sharded_dilated_attention` and checks it against the single-device op.

The notebook kernel is a fresh process, so the first cell asks XLA for 8 host (CPU) devices
*before* jax is imported. On a machine with 8 accelerators, leave the flag out.
"""),
    ("code", """
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import functools
import time

import jax
import jax.numpy as jnp

import dilax
from dilax.memory import format_bytes, memory_report

print(jax.device_count(), "devices:", jax.devices())
"""),
    ("md", """
## 262,144 tokens on one device

Causal, 2 query heads sharing 1 key/value head (MQA), head dimension 32, three branches.
`memory_report` compiles the function and reads XLA's buffer assignment before anything runs.
"""),
    ("code", """
n, b, h, hk, d = 262_144, 1, 2, 1, 32
segment_lengths, dilation_rates = (512, 1024, 2048), (1, 2, 4)

attend = jax.jit(functools.partial(dilax.dilated_attention, segment_lengths=segment_lengths,
                                   dilation_rates=dilation_rates, is_causal=True))
spec_q = jax.ShapeDtypeStruct((b, n, h, d), jnp.float32)
spec_kv = jax.ShapeDtypeStruct((b, n, hk, d), jnp.float32)
report = memory_report(attend, spec_q, spec_kv, spec_kv)
qkvo = 4 * (2 * b * n * h * d + 2 * b * n * hk * d)
print("forward:", report)
print(f"q, k, v and out alone: {format_bytes(qkvo)}; peak / that = {report.peak_bytes / qkvo:.2f}")
print(f"dense attention would hold the {h} x n x n float32 scores: {format_bytes(4 * h * n * n)}")

grad_fn = jax.jit(jax.grad(lambda q, k, v: attend(q, k, v).sum(), argnums=(0, 1, 2)))
print("forward + backward:", memory_report(grad_fn, spec_q, spec_kv, spec_kv))
"""),
    ("code", """
kq, kk, kv = jax.random.split(jax.random.key(0), 3)
q = jax.random.normal(kq, (b, n, h, d))
k = jax.random.normal(kk, (b, n, hk, d))
v = jax.random.normal(kv, (b, n, hk, d))

t0 = time.perf_counter()
out = attend(q, k, v).block_until_ready()
t1 = time.perf_counter()
out = attend(q, k, v).block_until_ready()
t2 = time.perf_counter()
print(f"out {out.shape} {out.dtype}; first call (with compilation) {t1 - t0:.2f} s, "
      f"second call {t2 - t1:.2f} s = {n / (t2 - t1):,.0f} tokens/s")
"""),
    ("md", """
Every segment of every branch lies inside the first 2,048 positions or after them, so those
positions must equal the op on the first 2,048 tokens alone — here checked against the
explicit-mask reference implementation:
"""),
    ("code", """
m = 2048
ref = dilax.dilated_attention(q[:, :m], k[:, :m], v[:, :m], segment_lengths, dilation_rates,
                              is_causal=True, implementation="reference")
err = float(jnp.abs(out[:, :m] - ref).max())
print(f"max |out[:, :{m}] - reference| = {err:.2e}")
assert err < 1e-5
"""),
    ("md", """
## Ring attention on 8 devices

`sharded_dilated_attention` shards the sequence axis over the mesh axis `"sp"`: each device holds
`n / 8` consecutive positions. Branches whose segments fit in one shard run locally; longer
ones pass dilated K/V blocks around the devices that share a segment (`lax.ppermute`). The
result equals the single-device op on the gathered arrays.
"""),
    ("code", """
from jax.sharding import AxisType

mesh = jax.make_mesh((8,), ("sp",), axis_types=(AxisType.Auto,))
n_ring = 16_384
ring_cfg = dict(segment_lengths=(1024, 16_384), dilation_rates=(1, 4), is_causal=True)
qr, kr, vr = q[:, :n_ring], k[:, :n_ring], v[:, :n_ring]

ring = jax.jit(functools.partial(dilax.sharded_dilated_attention, mesh=mesh, seq_axis="sp",
                                 **ring_cfg))
single = jax.jit(functools.partial(dilax.dilated_attention, **ring_cfg))
per_device = memory_report(ring, qr, kr, vr)  # compiles; the calls below reuse it
one_device = memory_report(single, qr, kr, vr)
out_ring = ring(qr, kr, vr)
out_single = single(qr, kr, vr)
err = float(jnp.abs(out_ring - out_single).max())
print("output sharding:", out_ring.sharding.spec,
      "- per-device shard", out_ring.addressable_shards[0].data.shape)
print(f"max |ring - single device| = {err:.2e}")
assert err < 1e-5
"""),
    ("code", """
# Per-device memory (XLA's numbers for one device's program) vs the single-device op.
print("ring, per device:", per_device)
print("single device:   ", one_device)
print(f"ratio {per_device.peak_bytes / one_device.peak_bytes:.3f} (ideal 1/8 = 0.125)")
"""),
    ("md", """
Gradients go through the ring too (a `custom_vjp` whose backward pass is a second ring), so
`jax.grad` of a sharded loss keeps `O(n / P)` memory per device; the test suite checks them
against the single-device gradients.

On a cluster the same code runs unchanged after `jax.distributed.initialize()` on every host,
with the mesh built over all devices (`jax.make_mesh((jax.device_count(),), ("sp",), ...)`);
see the README's "Sequence parallel" section.
"""),
]

# ------------------------------------------------------------------------------ train LongNet

TRAIN = [
    ("md", """
# Training a tiny LongNet language model

`python -m dilax.train` trains a character-level `dilax.models.LongNetLM` (decoder-only,
dilated causal self-attention) on a UTF-8 text of yours (`--data`) or the fables corpus shipped
with dilax, with Orbax checkpoints and exact resume. Here we use its Python API,
`dilax.train.train`, at a tiny scale (about 30 s on a CPU): train 30 steps and "stop", resume
to 50 steps from the checkpoint, plot the loss curve, and sample text from the checkpoint.
"""),
    ("code", """
%matplotlib inline
import dataclasses
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt

from dilax import train as T
from dilax.data import load_corpus

text = load_corpus()
tok = T.CharTokenizer.from_text(text)
print(f"{len(text):,} characters, vocabulary of {len(tok.vocab)}")

model_cfg = T.ModelConfig(vocab=tok.vocab, d_model=64, num_heads=4, num_layers=1,
                          dim_feedforward=128, segment_lengths=(16, 32, 64),
                          dilation_rates=(1, 2, 4))
ckpt_dir = Path(tempfile.mkdtemp(prefix="dilax-train-")) / "checkpoints"
train_cfg = T.TrainConfig(steps=50, batch_size=8, seq_len=64, lr=5e-3, warmup=5,
                          eval_every=10, eval_batches=2, checkpoint_dir=str(ckpt_dir),
                          checkpoint_every=30, stop_after=30, sample_tokens=0)
"""),
    ("md", """
## Train 30 of 50 steps

`stop_after=30` stops as if the run were interrupted (the checkpoint of step 30 is written).
"""),
    ("code", """
first = T.train(train_cfg, model_cfg, text=text, progress=False)
print("checkpoints:", sorted(p.name for p in ckpt_dir.iterdir()))
"""),
    ("md", """
## Resume to step 50

`resume=True` restores parameters, optimizer state and the step; batches and dropout keys are
pure functions of `(seed, step)`, so the resumed run continues exactly where the first stopped.
"""),
    ("code", """
second = T.train(dataclasses.replace(train_cfg, resume=True, stop_after=None),
                 model_cfg, text=text, progress=False)
assert second.start_step == 30 and second.last_step == 50
losses = {**first.losses, **second.losses}
evals = {**first.eval_losses, **second.eval_losses}

fig, ax = plt.subplots(figsize=(6, 3.6))
ax.plot(list(losses), list(losses.values()), label="train loss")
ax.plot(list(evals), list(evals.values()), "o-", label="eval loss")
ax.axhline(first.unigram_entropy, ls="--", c="gray", label="unigram entropy")
ax.axvline(30, ls=":", c="k", label="resumed here")
ax.set_xlabel("step")
ax.set_ylabel("nats / character")
ax.legend(fontsize=8)
plt.show()
assert evals[50] < first.unigram_entropy  # it learned more than character frequencies
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
print(T.sample_text(m, "Once upon a time", 120, temperature=0.6, top_k=10, seed=0))
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
defaults:
"""),
    ("code", """
print(subprocess.run([sys.executable, "-m", "dilax.train", "--help"], capture_output=True,
                     text=True, check=True).stdout)
shutil.rmtree(ckpt_dir.parent)  # the temporary checkpoints of this notebook
"""),
]

NOTEBOOKS = {
    "quickstart.ipynb": QUICKSTART,
    "long_context.ipynb": LONG_CONTEXT,
    "train_longnet.ipynb": TRAIN,
}


def build() -> dict[str, str]:
    """Returns ``{file name: notebook JSON text}``, without outputs."""
    return {name: nbformat.writes(notebook(cells)) + "\n" for name, cells in NOTEBOOKS.items()}


def execute(nb: nbformat.NotebookNode, timeout: int = 300) -> nbformat.NotebookNode:
    """Runs ``nb`` in a fresh ``python3`` kernel in this directory; returns it with outputs.

    No timing metadata is recorded, so re-executing changes only what the cells print.
    """
    from nbclient import NotebookClient

    NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(HERE)}}).execute()
    return nb


def main(argv: list[str] | None = None) -> int:
    run = "--no-execute" not in (sys.argv[1:] if argv is None else argv)
    for name, text in build().items():
        if run:
            nb = execute(nbformat.reads(text, as_version=4))
            text = nbformat.writes(nb) + "\n"
        (HERE / name).write_text(text)
        print("wrote", HERE / name, "(executed)" if run else "(no outputs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
