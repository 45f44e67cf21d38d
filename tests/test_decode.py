"""KV-cache decoding (SPEC.md, "Decoding with a KV cache"): a chunked prefill, single steps and
another chunk equal the rows of causal dilated attention over the whole sequence so far."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracle import attention as attention_oracle
from oracle import dilated as dilated_oracle
from tolerance import FP32, assert_scaled_close

import dilax
from dilax import KVCache, dilated_attention_decode

B, N, H, HK, D = 2, 64, 4, 2, 8  # GQA: two query heads per kv head
WS, RS = (8, 16, 32), (1, 2, 4)
# Row 1 is rewound after the prefill, so the rows differ in length from then on.
# The prefill and the last chunk share t (one compile) and take both paths: per-query windows
# (branch (32, 4): 7 <= 2 segments * 4) and whole segments (the others).
PREFILL, REWIND, STEPS, CHUNK = 7, 3, 28, 7


def _inputs(seed=0):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(k1, (B, N, H, D)), jax.random.normal(k2, (B, N, HK, D)),
            jax.random.normal(k3, (B, N, HK, D)))


def _decode_all(q, k, v, **cfg):
    """Runs the schedule under jit (cache donated); returns ``[(row, start, out_rows)]``."""
    step = jax.jit(functools.partial(dilated_attention_decode, segment_lengths=WS,
                                     dilation_rates=RS, **cfg), donate_argnums=3)
    cache = KVCache.init(B, N, HK, D)
    lengths = np.zeros(B, int)
    got = []
    q, k, v = (np.asarray(x) for x in (q, k, v))  # slice on the host: no eager dispatches

    def run(t):
        nonlocal cache, lengths
        take = lambda x: np.stack([x[i, lengths[i]:lengths[i] + t] for i in range(B)])
        out, cache = step(take(q), take(k), take(v), cache)
        got.extend((i, int(lengths[i]), np.asarray(out[i])) for i in range(B))
        lengths = lengths + t

    run(PREFILL)
    lengths = np.array([PREFILL, REWIND])
    cache = cache.with_lengths(lengths)
    for _ in range(STEPS):
        run(1)
    run(CHUNK)
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)
    return got


@pytest.mark.parametrize("mode", ["mixture", "grouped"])
def test_decode_equals_causal_dilated_rows(mode):
    q, k, v = _inputs()
    # causal dilated attention over the whole sequence, by the float64 oracle
    want = dilated_oracle(q, k, v, WS, RS, mode, is_causal=True).out
    for row, start, out in _decode_all(q, k, v, mode=mode):
        assert_scaled_close(out, want[row, start:start + out.shape[0]], FP32,
                            err_msg=f"{mode} row {row} positions {start}..")


def _local_window_counts(n, h, window):
    """The count matrix of SPEC.md: every dilated branch, plus one for ``|p - t| <= W``,
    causal."""
    pos = np.arange(n)
    counts = np.zeros((h, n, n))
    for j in range(h):
        for w, r in zip(WS, RS):
            sel = pos % r == j % r
            counts[j] += (sel[:, None] & sel[None, :] & (pos[:, None] // w == pos[None, :] // w)
                          & (pos[None, :] <= pos[:, None]))
    band = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] <= window)
    return counts + band[None]


def test_decode_local_window_matches_mask_oracle(monkeypatch):
    # Tiny gather budget: chunks go through per-query windows in blocks (lax.map), as long
    # prefills do.
    monkeypatch.setattr("dilax.dilated.decode._MAX_GATHERED_ROWS", 8)
    q, k, v = _inputs(seed=1)
    window = 3
    # the rows of causal dilated attention with the same window (SPEC: decode honours
    # local_window), by the float64 oracle
    want = attention_oracle(q, k, v, _local_window_counts(N, H, window)[None],
                            1.0 / np.sqrt(D)).out
    for row, start, out in _decode_all(q, k, v, local_window=window):
        assert_scaled_close(out, want[row, start:start + out.shape[0]], FP32,
                            err_msg=f"row {row} positions {start}..")


def test_decode_step_cost_does_not_grow_with_max_len():
    """One donated step: the cache is updated in place (aliased) and the step's working memory
    is the same for a cache 16x longer (nothing proportional to max_len is built)."""
    step = jax.jit(functools.partial(dilated_attention_decode, segment_lengths=WS,
                                     dilation_rates=RS), donate_argnums=3)
    x = jnp.zeros((1, 1, H, D))
    kv = jnp.zeros((1, 1, HK, D))
    temps = []
    for max_len in (256, 4096):
        cache = jax.eval_shape(lambda m=max_len: KVCache.init(1, m, HK, D))
        mem = step.lower(x, kv, kv, cache).compile().memory_analysis()
        assert mem.alias_size_in_bytes >= 2 * max_len * HK * D * 4  # k and v in place
        temps.append(mem.temp_size_in_bytes)
    assert temps[0] == temps[1], temps


def test_decode_errors():
    q, k, v = (x[:, :2] for x in _inputs())
    cache = KVCache.init(B, 4, HK, D)
    call = functools.partial(dilated_attention_decode, segment_lengths=WS, dilation_rates=RS)
    with pytest.raises(ValueError, match="t \\(axis 1 of q\\) must be >= 1"):
        call(q[:, :0], k[:, :0], v[:, :0], cache)
    with pytest.raises(ValueError, match="max_len=1"):
        call(q, k, v, KVCache.init(B, 1, HK, D))
    with pytest.raises(ValueError, match="overflows max_len=4"):
        call(q, k, v, cache.with_lengths([3, 0]))
    with pytest.raises(TypeError, match="cache dtype"):
        call(q, k, v, KVCache.init(B, 4, HK, D, jnp.bfloat16))
    with pytest.raises(ValueError, match="num_kv_heads"):
        call(q, k, v, KVCache.init(B, 4, 1, D))
    with pytest.raises(ValueError, match="head_dim"):
        call(q, k, v, KVCache.init(B, 4, HK, 2 * D))
    with pytest.raises(ValueError, match="grouped"):
        call(q, k, v, cache, mode="grouped", local_window=2)
    with pytest.raises(ValueError, match="query_seq_lengths must lie in"):
        call(q, k, v, cache, query_seq_lengths=np.array([3, 0]))


def test_decode_query_seq_lengths_pad_a_chunk():
    """A padded chunk: row i brings only its first q_len[i] positions. Valid rows equal the
    causal op over the row's own sequence, padded rows are 0, and each row
    advances by its own count (the next chunk continues right after it)."""
    q, k, v = _inputs(seed=2)
    t, q_len = 7, np.array([7, 3])
    step = jax.jit(functools.partial(dilated_attention_decode, segment_lengths=WS,
                                     dilation_rates=RS), donate_argnums=3)
    cache = KVCache.init(B, N, HK, D)
    out1, cache = step(q[:, :t], k[:, :t], v[:, :t], cache, query_seq_lengths=q_len)
    np.testing.assert_array_equal(np.asarray(cache.lengths), q_len)
    take = lambda x: np.stack([np.asarray(x)[i, q_len[i]:q_len[i] + t] for i in range(B)])
    out2, cache = step(take(q), take(k), take(v), cache, query_seq_lengths=np.array([t, t]))
    want = dilated_oracle(q, k, v, WS, RS, is_causal=True).out  # the causal op, float64
    for i in range(B):
        assert_scaled_close(out1[i, :q_len[i]], want[i, :q_len[i]], FP32)
        np.testing.assert_array_equal(np.asarray(out1[i, q_len[i]:]), 0.0)
        assert_scaled_close(out2[i], want[i, q_len[i]:q_len[i] + t], FP32)


# --- models: LongNetLM.decode and generate -----------------------------------------------

VOCAB, PROMPT, NEW = 32, 5, 12  # 17 positions: crosses the segment boundaries 4, 8 and 16


def _lm(num_encoder_layers, implementation=None):
    from flax import nnx

    from dilax.models import LongNetConfig, LongNetLM

    # a local window too: the cache path honours every branch of the configuration
    cfg = LongNetConfig(16, 2, 32, (4, 8), (1, 2), num_kv_heads=1, local_window=3,
                        implementation=implementation)
    return LongNetLM(VOCAB, config=cfg, num_encoder_layers=num_encoder_layers,
                     num_decoder_layers=1, rngs=nnx.Rngs(0))


def _reference(model, num_encoder_layers):
    """The same parameters, every attention the dense mask-based reference (an oracle)."""
    from flax import nnx

    abstract = nnx.eval_shape(lambda: _lm(num_encoder_layers, "reference"))
    return nnx.merge(nnx.graphdef(abstract), nnx.state(model))


def test_longnet_lm_decode_equals_full_logits():
    """Token by token: the logits of the model's full forward at every position (computed
    with the reference attention). Encoder-decoder, so every cache kind (encoder, decoder
    self- and cross-attention) is used; chunks through the model (the prefill) are checked
    by the generate test below."""
    from flax import nnx

    model = _lm(1)
    n = PROMPT + NEW
    toks = jax.random.randint(jax.random.PRNGKey(1), (B, n), 0, VOCAB)
    want = np.asarray(nnx.jit(lambda m, t: m(t))(_reference(model, 1), toks))
    decode = nnx.jit(lambda m, t, c: m.decode(t, c))
    cache = model.init_cache(B, n)
    got = []
    for i in range(n):
        logits, cache = decode(model, toks[:, i:i + 1], cache)
        got.append(np.asarray(logits))
    assert_scaled_close(np.concatenate(got, axis=1), want, FP32, depth=2)


def test_generate_greedy_equals_full_recomputation():
    """Acceptance (issue 26): greedy generate gives the tokens of the greedy loop that
    recomputes the growing prefix of every row (its prompt and the tokens so far; padding after
    it, which a causal model does not see) with the mask-based reference implementation,
    across the segment starts 4, 8, 12; rows of different prompt lengths; fewer new tokens
    give a prefix of the same tokens. And top_k=1 sampling is greedy too."""
    from flax import nnx

    from dilax.models import generate

    model = _lm(0)
    prompt = np.asarray(jax.random.randint(jax.random.PRNGKey(2), (B, PROMPT), 0, VOCAB))
    lengths = np.array([PROMPT, PROMPT - 2])
    got = np.asarray(generate(model, prompt, NEW, prompt_lengths=lengths))

    ref = _reference(model, 0)
    # One program for every prefix: the prefix padded to PROMPT + NEW positions with token 0;
    # the model is causal, so the logits at the prefix's last position see nothing after it
    # (tests/test_positions.py checks that prefix rows equal the full window's).
    forward = nnx.jit(lambda m, tokens: m(tokens))
    for row in range(B):
        seq = list(prompt[row, :lengths[row]])
        for _ in range(NEW):
            padded = np.zeros((1, PROMPT + NEW), np.int32)
            padded[0, :len(seq)] = seq
            logits = np.asarray(forward(ref, jnp.asarray(padded)))
            seq.append(int(logits[0, len(seq) - 1].argmax()))
        np.testing.assert_array_equal(got[row, :len(seq)], seq)
        np.testing.assert_array_equal(got[row, len(seq):], 0)
    shorter = np.asarray(generate(model, prompt, NEW - 5, prompt_lengths=lengths))
    for row in range(B):
        end = lengths[row] + NEW - 5
        np.testing.assert_array_equal(shorter[row, :end], got[row, :end])
    sampled = generate(model, prompt, NEW, prompt_lengths=lengths, temperature=0.7, top_k=1,
                       key=jax.random.PRNGKey(0))
    np.testing.assert_array_equal(np.asarray(sampled), got)


def test_attention_fn_cache_without_decode_mask_says_why_and_where_to_go():
    """flax's decode=True works (tests/test_attention_fn_flax.py); a query against keys of
    another length without flax's decode mask (its position) is refused."""
    q = jnp.ones((1, 2, 2, 8))
    with pytest.raises(ValueError, match=r"decode=True.*MultiheadDilatedAttention\.init_cache"):
        kv = jnp.ones((1, 8, 2, 8))
        dilax.attention_fn(WS, RS, is_causal=True)(q, kv, kv)
