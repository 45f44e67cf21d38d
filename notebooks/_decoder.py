"""The cells of ``decoder.ipynb`` (your own Flax NNX decoder on dilax: packed documents,
rotary positions, KV-cache generation), as ``(kind, text)`` pairs that ``notebooks/_build.py``
writes and executes."""

DECODER = [
    ("md", """
# Your own decoder on dilax: packed documents, rotary positions, KV cache

`dilax.attention_fn` plugs dilated attention into flax's `nnx.MultiHeadAttention`, and that
module has no place for packed documents (`segment_ids`) or rotary positions. When you want
those, write the attention block yourself: your projections, dilax's public pieces in between.
This notebook builds a small decoder-only language model that way, on a CPU in seconds:

| piece | dilax API |
|---|---|
| rotary positions on q and k | `dilax.models.rotary_qk(q, k, positions, scheme="rope")` |
| positions restarting at every packed document | `dilax.document_positions(segment_ids)` |
| causal attention, packed documents | `dilax.nn.DilatedAttention(...)(q, k, v, segment_ids=ids)` |
| one KV cache per layer | `dilax.KVCache.init(batch, max_len, num_kv_heads, head_dim)` |
| a cached step (prefill chunk or one token) | `DilatedAttention.decode(q, k, v, cache)` |

It then checks the two promises that make such a model correct: a packed row equals each
document run alone (docs/semantics.md, "Packed documents"), and a cached generation step gives
the logits of the full causal forward at that position.
"""),
    ("code", """
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import dilax
from dilax.models import rotary_qk
from dilax.nn import DilatedAttention
"""),
    ("md", """
## 1. A tiny corpus, packed

A few short strings, one character per token (id 0 is padding). They are packed greedily into
rows of `N` tokens; `segment_ids` numbers the documents of a row (a document is a maximal run
of equal ids) and the padding at the end of a row is one more run, with id 0, that the loss
leaves out. `dilax.document_positions` gives every token its index inside its own document:
the positions the rotary code uses.
"""),
    ("code", """
corpus = [
    "the cat sat on the mat.",
    "a dog ran in the park.",
    "the sun is hot.",
    "we like to read books at night.",
    "the bird sang a song in the tree.",
    "ships sail on the sea.",
]
chars = sorted(set("".join(corpus)))
vocab = ["<pad>"] + chars
encode = lambda s: [vocab.index(c) for c in s]
decode_text = lambda ids: "".join(vocab[i] for i in ids if i > 0)
V = len(vocab)

N = 48  # tokens per packed row
rows, segs, placed = [[]], [[]], []  # placed: (row, start, length) of every document
for doc_id, text in enumerate(corpus, start=1):
    ids = encode(text)
    if len(rows[-1]) + len(ids) > N:
        rows.append([]), segs.append([])
    placed.append((len(rows) - 1, len(rows[-1]), len(ids)))
    rows[-1] += ids
    segs[-1] += [doc_id] * len(ids)
tokens = np.zeros((len(rows), N), np.int32)
segment_ids = np.zeros((len(rows), N), np.int32)  # 0: the padding run
for r, (row, seg) in enumerate(zip(rows, segs)):
    tokens[r, :len(row)], segment_ids[r, :len(seg)] = row, seg
tokens, segment_ids = jnp.asarray(tokens), jnp.asarray(segment_ids)

print(f"{len(corpus)} documents, vocabulary {V}, packed into {tokens.shape} tokens")
print("segment_ids[0]       ", segment_ids[0].tolist())
print("document_positions[0]", dilax.document_positions(segment_ids)[0].tolist())
"""),
    ("md", """
## 2. The model

Each layer owns its projections (`nnx.Linear`), applies rotary positions to the projected
heads with `dilax.models.rotary_qk`, and calls a parameter-free `dilax.nn.DilatedAttention`
(causal, `segment_ids=` for packed rows). Grouped-query attention is just fewer key/value heads
(`h % hk == 0`). `decode` is the same layer for the next `t` positions of a sequence, with that
layer's `dilax.KVCache`: the positions continue from `cache.lengths`.

The segments `(16, 32)` with rates `(1, 2)` are shorter than the rows and than most
documents: a document longer than 16 tokens spans several segments of the first branch (the
longest, 33 tokens, also two of the second). A query attends only keys of its own segment (in
document positions), so the longest segment is the model's context.
"""),
    ("code", """
SEGMENTS, RATES = (16, 32), (1, 2)


class Layer(nnx.Module):
    def __init__(self, dim, heads, kv_heads, *, rngs):
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1 = nnx.RMSNorm(dim, rngs=rngs)
        self.q = nnx.Linear(dim, heads * self.head_dim, use_bias=False, rngs=rngs)
        self.k = nnx.Linear(dim, kv_heads * self.head_dim, use_bias=False, rngs=rngs)
        self.v = nnx.Linear(dim, kv_heads * self.head_dim, use_bias=False, rngs=rngs)
        self.o = nnx.Linear(heads * self.head_dim, dim, use_bias=False, rngs=rngs)
        self.attention = DilatedAttention(SEGMENTS, RATES, is_causal=True)
        self.norm2 = nnx.RMSNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

    def qkv(self, x, positions):
        b, n, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).reshape(b, n, self.heads, self.head_dim)
        k = self.k(h).reshape(b, n, self.kv_heads, self.head_dim)
        v = self.v(h).reshape(b, n, self.kv_heads, self.head_dim)
        q, k = rotary_qk(q, k, positions, scheme="rope")
        return q, k, v

    def finish(self, x, attended):
        x = x + self.o(attended.reshape(x.shape[:2] + (-1,)))
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))

    def __call__(self, x, positions, segment_ids=None):
        q, k, v = self.qkv(x, positions)
        return self.finish(x, self.attention(q, k, v, segment_ids=segment_ids))

    def decode(self, x, positions, cache):
        q, k, v = self.qkv(x, positions)
        attended, cache = self.attention.decode(q, k, v, cache)
        return self.finish(x, attended), cache


class Decoder(nnx.Module):
    def __init__(self, vocab_size, dim=32, depth=2, heads=4, kv_heads=2, *, rngs):
        self.embed = nnx.Embed(vocab_size, dim, rngs=rngs)
        self.layers = nnx.List([Layer(dim, heads, kv_heads, rngs=rngs) for _ in range(depth)])
        self.norm = nnx.RMSNorm(dim, rngs=rngs)

    def __call__(self, tokens, segment_ids=None):
        \"\"\"tokens (b, n) -> logits (b, n, vocab); packed rows with segment_ids (b, n).\"\"\"
        if segment_ids is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        else:
            positions = dilax.document_positions(segment_ids)  # 0 at every document start
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, positions, segment_ids)
        return self.embed.attend(self.norm(x))

    def init_cache(self, batch, max_len):
        \"\"\"One empty dilax.KVCache per layer.\"\"\"
        return [dilax.KVCache.init(batch, max_len, layer.kv_heads, layer.head_dim)
                for layer in self.layers]

    def decode(self, tokens, caches):
        \"\"\"The next t tokens (b, t) of every row -> (logits (b, t, vocab), caches).\"\"\"
        t = tokens.shape[1]
        positions = caches[0].lengths[:, None] + jnp.arange(t)[None]
        x = self.embed(tokens)
        new = []
        for layer, cache in zip(self.layers, caches):
            x, cache = layer.decode(x, positions, cache)
            new.append(cache)
        return self.embed.attend(self.norm(x)), new


model = Decoder(V, rngs=nnx.Rngs(0))
params = nnx.state(model, nnx.Param)
print("parameters:", sum(x.size for x in jax.tree.leaves(params)))
"""),
    ("md", """
## 3. A few training steps on the packed rows

The target of position `p` is the token at `p + 1` when both are in the same document (never
the first token of the next document, never padding).
"""),
    ("code", """
targets = jnp.roll(tokens, -1, axis=1)
weights = ((segment_ids == jnp.roll(segment_ids, -1, axis=1)) & (segment_ids > 0))
weights = weights.at[:, -1].set(False).astype(jnp.float32)


def loss_fn(model, tokens, segment_ids, targets, weights):
    logits = model(tokens, segment_ids)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return (losses * weights).sum() / weights.sum()


optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


@nnx.jit
def train_step(model, optimizer, tokens, segment_ids, targets, weights):
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, segment_ids, targets, weights)
    optimizer.update(model, grads)
    return loss


for step in range(100):
    loss = train_step(model, optimizer, tokens, segment_ids, targets, weights)
    if step % 20 == 0 or step == 99:
        print(f"step {step:2d}  loss {float(loss):.3f}")
"""),
    ("md", """
## 4. A packed row equals each document run alone

The rule of docs/semantics.md, "Packed documents": every document of a packed row is computed
as a sequence of its own (its own dilated segments and offsets, causal inside it, rotary
positions from 0), so its logits equal the model applied to that document alone, wherever it
sits in the row.
"""),
    ("code", """
forward = nnx.jit(lambda model, tokens, segment_ids: model(tokens, segment_ids))
packed_logits = forward(model, tokens, segment_ids)

# Each document alone, at the start of a row of its own (one batch, one compiled program): the
# model is causal, so what follows a document in its row (padding) cannot change its logits.
alone_rows = jnp.zeros((len(placed), tokens.shape[1]), tokens.dtype)
for i, (row, start, length) in enumerate(placed):
    alone_rows = alone_rows.at[i, :length].set(tokens[row, start:start + length])
alone = forward(model, alone_rows, None)
worst = max(float(jnp.abs(packed_logits[row, start:start + length] - alone[i, :length]).max())
            for i, (row, start, length) in enumerate(placed))
scale = float(jnp.abs(packed_logits).max())
print(f"max |packed - alone| over {len(placed)} documents: {worst:.2e} "
      f"(logits up to {scale:.1f}: {worst / scale:.1e} of their scale)")
assert worst < 1e-5 * max(1.0, scale), worst  # float32: reordered sums, a few ulps

# Without segment_ids the same row is one long sequence: documents see each other.
unpacked = forward(model, tokens, None)
print(f"max |packed - one sequence|: {float(jnp.abs(packed_logits - unpacked).max()):.2e}"
      " (not zero: segment_ids matter)")
"""),
    ("md", """
## 5. Generation with one KV cache per layer

A prompt is prefilled in one `decode` call (a chunk of `t` positions), then every new token is
one cached step: per branch a step reads at most `w / r` keys, whatever the length so far. A
new document starts with empty caches. Each step's logits are checked against the full causal
forward over everything fed so far, at the same positions.
"""),
    ("code", """
decode_step = nnx.jit(lambda model, tokens, caches: model.decode(tokens, caches))

prompt = encode("the bird")
caches = model.init_cache(batch=1, max_len=40)
logits, caches = decode_step(model, jnp.asarray([prompt]), caches)  # prefill: (1, t, V)
fed, step_logits = list(prompt), [logits[0]]
for _ in range(24):
    nxt = int(jnp.argmax(logits[0, -1]))
    fed.append(nxt)
    logits, caches = decode_step(model, jnp.asarray([[nxt]]), caches)  # one token
    step_logits.append(logits[0])
step_logits = jnp.concatenate(step_logits)  # the logits of positions 0 .. len(fed) - 1

print("prompt   :", repr(decode_text(prompt)))
print("generated:", repr(decode_text(fed)))
print("cache lengths:", [int(c.lengths[0]) for c in caches])

full = forward(model, jnp.asarray([fed]), None)[0]
diff_last = float(jnp.abs(step_logits[-1] - full[-1]).max())
diff_all = float(jnp.abs(step_logits - full).max())
print(f"last cached step vs full forward, last position: max |diff| = {diff_last:.2e}")
print(f"every cached position vs full forward:          max |diff| = {diff_all:.2e}")
assert diff_all < 1e-5 * max(1.0, float(jnp.abs(full).max())), diff_all
"""),
]
