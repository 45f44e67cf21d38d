"""The cells of ``quickstart.ipynb`` (dilax quick start), as ``(kind, text)`` pairs that
``notebooks/_build.py`` writes and executes."""

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
m = 300  # any n works, not only multiples of the segment lengths
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
