"""dilax.models: LongNet layers and models, XPOS, init, parameter count (issue 4, 1, 3, 6)."""

from __future__ import annotations

import dataclasses
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from oracle import attention as oracle_attention
from test_positions import rotary_reference
from tolerance import FP32, assert_scaled_close, assert_trees_close

from dilax.models import (
    PAPER_SEGMENT_LENGTHS,
    DilatedTransformerDecoderLayer,
    DilatedTransformerEncoderLayer,
    LongNet,
    LongNetConfig,
    LongNetLM,
    LongNetOptions,
    magneto_gammas,
    xpos,
)
from dilax.reference import dilated_counts

WS, RS = (4, 16), (1, 4)
# Layer wiring is checked with the dense SPEC oracle (implementation="reference"), which
# compiles much faster on CPU; the XLA path runs in the end-to-end LM tests below and in
# tests/test_train.py.
REF = "reference"


def _build(ctor, seed: int = 1):
    """Abstract init (no initializer runs), then N(0, 0.5) parameters drawn with NumPy."""
    module = nnx.eval_shape(ctor)
    rng = np.random.default_rng(seed)
    nnx.update(module, jax.tree.map(
        lambda x: jnp.asarray(0.5 * rng.standard_normal(x.shape), x.dtype),
        nnx.state(module, nnx.Param)))
    return module


def _x(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _p(module):
    return nnx.to_pure_dict(nnx.state(module, nnx.Param))


# ----------------------------------------------------------------------------- references
# Float64 NumPy (nothing to compile): parameters and inputs as float64 arrays, attention by the
# oracle of tests/oracle.py.


def _f64(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def _gelu(x):  # jax.nn.gelu's default (tanh) form
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


_ACTIVATIONS = {jax.nn.relu: lambda x: np.maximum(x, 0.0), jax.nn.gelu: _gelu}


def ln(x, p, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * p["scale"] + p[
        "bias"]


def lin(x, p):
    return x @ p["kernel"] + p["bias"]


def mhda(p, xq, xkv, h, is_causal, layer_norm, scheme="none"):
    b, n, e = xq.shape
    d = e // h
    q, k, v = (lin(x, p[name]).reshape(b, n, h, d)
               for x, name in ((xq, "q_proj"), (xkv, "k_proj"), (xkv, "v_proj")))
    if scheme != "none":  # positions 0 .. n - 1 on the self-attention's queries and keys
        pos = np.broadcast_to(np.arange(n), (b, n))
        q = rotary_reference(q, pos, scheme)
        k = rotary_reference(k, pos, scheme, sign=-1)
    a = oracle_attention(q, k, v, dilated_counts(n, h, WS, RS, "mixture", is_causal),
                         1 / math.sqrt(d)).out.reshape(b, n, e)
    return lin(ln(a, p["norm"]) if layer_norm else a, p["out_proj"])


def ffn(p, x, act):
    return lin(ln(_ACTIVATIONS[act](lin(x, p["linear1"])), p["norm"]), p["linear2"])


def encoder_layer(p, x, h, is_causal, act=jax.nn.relu, scheme="xpos"):
    p, x = _f64(p), np.asarray(x, np.float64)
    x = x + mhda(p["self_attn"], ln(x, p["norm1"]), ln(x, p["norm1"]), h, is_causal, True,
                 scheme)
    return x + ffn(p["ffn"], ln(x, p["norm2"]), act)


def decoder_layer(p, x, mem, h, is_causal, mem_causal, scheme="xpos"):
    p, x = _f64(p), np.asarray(x, np.float64)
    x = x + mhda(p["self_attn"], ln(x, p["norm1"]), ln(x, p["norm1"]), h, is_causal, True,
                 scheme)
    if mem is not None:  # MAGNETO: no sub-LayerNorm in the cross-attention
        mem = np.asarray(mem, np.float64)
        x = x + mhda(p["cross_attn"], ln(x, p["norm2"]), mem, h, mem_causal, False)
    return x + ffn(p["ffn"], ln(x, p["norm3"]), jax.nn.relu)


# ----------------------------------------------------------------------------- layers


def test_encoder_and_decoder_layers_match_hand_written_composition():
    """Every position scheme (XPOS by default, RoPE, none) on the self-attention only."""
    kw = dict(dim_feedforward=32, implementation=REF)
    enc = _build(lambda: DilatedTransformerEncoderLayer(16, 4, WS, RS, activation=jax.nn.gelu,
                                                        rngs=nnx.Rngs(0), **kw))
    dec = _build(lambda: DilatedTransformerDecoderLayer(16, 4, WS, RS, rngs=nnx.Rngs(0),
                                                        position_scheme="rope", **kw))
    dec_only = _build(lambda: DilatedTransformerDecoderLayer(
        16, 4, WS, RS, cross_attention=False, position_scheme="none", rngs=nnx.Rngs(0), **kw))
    x, mem = _x(0, (2, 16, 16)), _x(1, (2, 16, 16))

    @nnx.jit
    def run(enc, dec, dec_only, x, mem):
        return (enc(x, is_causal=True), dec(x, mem, is_causal=True, memory_is_causal=False),
                dec_only(x, is_causal=False))

    y_enc, y_dec, y_dec_only = run(enc, dec, dec_only, x, mem)
    assert_scaled_close(y_enc, encoder_layer(_p(enc), x, 4, True, jax.nn.gelu))
    assert_scaled_close(y_dec, decoder_layer(_p(dec), x, mem, 4, True, False, "rope"))
    assert_scaled_close(y_dec_only, decoder_layer(_p(dec_only), x, None, 4, False, False,
                                                  "none"))
    assert "cross_attn" not in _p(dec_only)
    with pytest.raises(ValueError, match="memory must be given"):
        dec(x)
    with pytest.raises(ValueError, match="cross_attention=False"):
        dec_only(x, mem)


def test_longnet_stacks_match_their_layers():
    """Encoder-decoder (decoder attends the final encoder output), decoder-only and
    encoder-only stacks, all causal."""
    kw = dict(dim_feedforward=32, implementation=REF)
    encdec = _build(lambda: LongNet(16, 4, 2, 2, segment_lengths=WS, dilation_rates=RS,
                                    rngs=nnx.Rngs(0), **kw))
    dec_only = _build(lambda: LongNet(16, 4, 0, 2, segment_lengths=WS, dilation_rates=RS,
                                      rngs=nnx.Rngs(0), **kw))
    enc_only = _build(lambda: LongNet(16, 4, 2, 0, segment_lengths=WS, dilation_rates=RS,
                                      rngs=nnx.Rngs(0), **kw))
    x = _x(0, (2, 16, 16))
    y1, y2, y3 = nnx.jit(lambda a, b, c, x: (a(x), b(x), c(x)))(encdec, dec_only, enc_only, x)

    p = _p(encdec)
    mem = encoder_layer(p["encoder"][1], encoder_layer(p["encoder"][0], x, 4, True), 4, True)
    tgt = x
    for i in range(2):
        tgt = decoder_layer(p["decoder"][i], tgt, mem, 4, True, True)
    assert_scaled_close(y1, tgt, depth=4)  # 2 encoder + 2 decoder layers
    p = _p(dec_only)
    ref = decoder_layer(p["decoder"][1], decoder_layer(p["decoder"][0], x, None, 4, True, True),
                        None, 4, True, True)
    assert_scaled_close(y2, ref, depth=2)
    p = _p(enc_only)
    ref = encoder_layer(p["encoder"][1], encoder_layer(p["encoder"][0], x, 4, True), 4, True)
    assert_scaled_close(y3, ref, depth=2)


# ----------------------------------------------------------------------------- XPOS


def test_xpos_matches_a_per_position_loop_and_is_relative():
    n, d = 12, 8
    x = np.random.default_rng(0).standard_normal((2, n, d))
    u = np.broadcast_to(x[0, 0], (1, n, d))

    @jax.jit  # one program: the values, and the dot products of a repeated vector
    def run(x, u):
        return xpos(x), jnp.einsum("bmd,btd->mt", xpos(u), xpos(u, downscale=True))

    out, dots = (np.asarray(a) for a in run(jnp.asarray(x, jnp.float32),
                                            jnp.asarray(u, jnp.float32)))
    lo = -(n // 2) if n % 2 == 0 else -(n // 2) - 1
    ref = np.zeros_like(x)
    for i in range(n):
        for j in range(d // 2):
            theta = i / 10000 ** (j / (d // 2))
            zeta = (2 * j + 0.4 * d) / (1.4 * d)
            s = zeta ** ((lo + i) / 512)
            a, b = x[:, i, 2 * j], x[:, i, 2 * j + 1]
            ref[:, i, 2 * j] = s * (a * math.cos(theta) - b * math.sin(theta))
            ref[:, i, 2 * j + 1] = s * (b * math.cos(theta) + a * math.sin(theta))
    assert_scaled_close(out, ref)
    # XPOS's point: <xpos(q)_m, xpos(k, downscale)_t> depends only on m - t
    assert_scaled_close(dots[1:, 1:], dots[:-1, :-1])
    with pytest.raises(ValueError, match="even"):
        xpos(jnp.zeros((1, 4, 3)))


# ----------------------------------------------------------------------------- LM end to end


def test_longnet_lm_is_causal():
    """Default (XLA) implementation, encoder-decoder: a token never influences earlier logits
    (the encoder, the decoder and the cross-attention to the encoder output are all causal)."""
    lm = _build(lambda: LongNetLM(40, 16, 4, 1, 1, 32, WS, RS, rngs=nnx.Rngs(0)))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 40, (2, 16)), jnp.int32)
    changed = np.asarray(tokens).copy()
    changed[:, 9] = (changed[:, 9] + 1) % 40
    forward = nnx.jit(lambda lm, t: lm(t))  # one program (one model call), run twice
    a, b = forward(lm, tokens), forward(lm, jnp.asarray(changed))
    assert a.shape == (2, 16, 40) and a.dtype == jnp.float32
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_array_equal(a[:, :9], b[:, :9])
    assert np.abs(a[:, 9:] - b[:, 9:]).max() > 1e-3


def test_remat_same_values_and_gradients_and_every_parameter_gets_one():
    plain = _build(lambda: LongNetLM(40, 16, 4, 1, 1, 32, WS, RS, implementation=REF,
                                     rngs=nnx.Rngs(0)))
    remat = _build(lambda: LongNetLM(40, 16, 4, 1, 1, 32, WS, RS, implementation=REF,
                                     remat=True, rngs=nnx.Rngs(0)))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 40, (2, 16)), jnp.int32)
    loss = lambda lm: jnp.mean(lm(tokens) ** 2)
    step = nnx.value_and_grad(loss)
    # both models' values and gradients in one program
    (v1, g1), (v2, g2) = nnx.jit(lambda a, b: (step(a), step(b)))(plain, remat)
    # Rematerialization recomputes the same ops: a few ulps of reordering between the two
    # programs, 10x tighter than FP32 for the loss.
    assert_scaled_close(v2, v1, FP32 / 10)
    assert_trees_close(nnx.to_pure_dict(g2), nnx.to_pure_dict(g1))
    # gradients reach every parameter of the encoder-decoder LM
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(g1))[0]
    assert len(flat) == len(jax.tree.leaves(nnx.state(plain, nnx.Param)))
    for path, g in flat:
        assert np.abs(np.asarray(g)).max() > 0, f"no gradient reaches {jax.tree_util.keystr(path)}"
    # the rematerialized model really checkpoints each layer (and the plain one does not)
    graphdef, state = nnx.split(remat)
    jaxpr = str(jax.make_jaxpr(lambda s: loss(nnx.merge(graphdef, s)))(state))
    assert jaxpr.count("remat2[") == 2  # one jax.checkpoint per layer
    graphdef, state = nnx.split(plain)
    jaxpr = str(jax.make_jaxpr(lambda s: loss(nnx.merge(graphdef, s)))(state))
    assert "remat2[" not in jaxpr


def test_bfloat16_compute_with_float32_params():
    lm16 = _build(lambda: LongNetLM(40, 32, 4, 0, 2, 64, WS, RS, dtype=jnp.bfloat16,
                                    rngs=nnx.Rngs(0)))
    lm32 = _build(lambda: LongNetLM(40, 32, 4, 0, 2, 64, WS, RS, implementation=REF,
                                    rngs=nnx.Rngs(0)))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(lm16, nnx.Param)))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 40, (2, 16)), jnp.int32)
    y16, y32 = nnx.jit(lambda a, b, t: (a(t), b(t)))(lm16, lm32, tokens)
    assert y16.dtype == jnp.bfloat16 and y32.dtype == jnp.float32
    y16, y32 = np.asarray(y16).astype(np.float32), np.asarray(y32)
    rel = float(np.abs(y16 - y32).max() / np.abs(y32).max())
    assert rel < 3e-2, rel


# ----------------------------------------------------------------------------- init


def test_layer_init_statistics_and_magneto_gains():
    def std_ratio(w, fan_in, fan_out, gain):
        return float(np.std(np.asarray(w))) / (gain * math.sqrt(2 / (fan_in + fan_out)))

    e, f, gain = 512, 1024, 1.7
    layer = DilatedTransformerEncoderLayer(e, 8, WS, RS, dim_feedforward=f, gamma_init=gain,
                                           rngs=nnx.Rngs(0))
    for w, fi, fo, g in ((layer.ffn.linear1.kernel, e, f, gain),
                         (layer.ffn.linear2.kernel, f, e, gain),
                         (layer.self_attn.q_proj.kernel, e, e, 1.0),
                         (layer.self_attn.v_proj.kernel, e, e, gain),
                         (layer.self_attn.out_proj.kernel, e, e, gain)):
        assert abs(std_ratio(w[...], fi, fo, g) - 1) < 0.05
    for lin_ in (layer.ffn.linear1, layer.ffn.linear2):
        np.testing.assert_array_equal(lin_.bias[...], 0.0)
    # MAGNETO gains (MAGNETO paper, Fig. 2), and LongNet hands them to its layers
    enc, dec = magneto_gammas(12, 12)
    assert enc == pytest.approx(math.sqrt(math.log(36) * math.log(24) / 3))
    assert dec == pytest.approx(math.sqrt(math.log(36)))
    assert magneto_gammas(0, 6)[1] == pytest.approx(math.sqrt(math.log(12)))
    assert magneto_gammas(6, 0)[0] == pytest.approx(math.sqrt(math.log(12)))
    net = nnx.eval_shape(lambda: LongNet(64, 4, 2, 3, 128, WS, RS, rngs=nnx.Rngs(0)))
    g_enc, g_dec = magneto_gammas(2, 3)
    assert net.encoder[1].self_attn.gamma_init == pytest.approx(g_enc)
    assert net.decoder[2].cross_attn.gamma_init == pytest.approx(g_dec)


# ----------------------------------------------------------------------------- parameter count


def closed_form_longnet(d, h, n_enc, n_dec, ff, hk=None):
    """Parameters of LongNet, counted by hand (biases on, LayerNorm scale + bias)."""
    hk = hk or h
    kv = hk * (d // h)
    attn = 2 * (d * d + d) + 2 * (d * kv + kv)  # q, out: d -> d; k, v: d -> kv
    norm = lambda width: 2 * width
    ffn = (d * ff + ff) + norm(ff) + (ff * d + d)
    enc = norm(d) + attn + norm(d) + norm(d) + ffn  # norm1, self_attn(+sub-LN), norm2, ffn
    dec_cross = norm(d) + attn + norm(d) + norm(d) + attn + norm(d) + ffn
    dec_self = norm(d) + attn + norm(d) + norm(d) + ffn
    return n_enc * enc + n_dec * (dec_cross if n_enc else dec_self)


def _count(module) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(module, nnx.Param)))


def test_parameter_count_of_longnet_paper_defaults():
    # LongNet builds its 12 + 12 layers as identical copies (one constructor call per layer,
    # same config; only the MAGNETO gain value differs), so the paper-size count is the
    # per-layer count times the default depths: one encoder and one decoder layer are built
    # abstractly instead of all 24 (a whole multi-layer stack equals the closed form at small
    # sizes: `stack` below).
    defaults = inspect.signature(LongNet.__init__).parameters
    n_enc = defaults["num_encoder_layers"].default
    n_dec = defaults["num_decoder_layers"].default
    assert (n_enc, n_dec) == (12, 12)
    one = nnx.eval_shape(lambda: LongNet(num_encoder_layers=1, num_decoder_layers=1,
                                         rngs=nnx.Rngs(0)))  # abstract: nothing allocated
    assert one.config == LongNetConfig()  # the paper defaults, as LongNet() uses
    assert one.decoder[0].cross_attn is not None  # encoder-decoder, as with 12 + 12 layers
    count = n_enc * _count(one.encoder[0]) + n_dec * _count(one.decoder[0])
    assert _count(one) == _count(one.encoder[0]) + _count(one.decoder[0])
    print(f"LongNet() paper defaults (d_model 768, 12 heads, 12+12 layers, ffn 3072, "
          f"segment_lengths {PAPER_SEGMENT_LENGTHS}): {count:,} parameters")
    assert count == closed_form_longnet(768, 12, 12, 12, 3072) == 198_660_096
    stack = nnx.eval_shape(lambda: LongNet(32, 4, 3, 2, 48, WS, RS, rngs=nnx.Rngs(0)))
    assert _count(stack) == closed_form_longnet(32, 4, 3, 2, 48)
    # decoder-only with GQA, and the LM (embedding, final norm, head) around it
    small = nnx.eval_shape(lambda: LongNet(32, 4, 0, 2, 48, WS, RS, num_kv_heads=2,
                                           rngs=nnx.Rngs(0)))
    assert _count(small) == closed_form_longnet(32, 4, 0, 2, 48, hk=2)
    lm = nnx.eval_shape(lambda: LongNetLM(1000, 32, 4, 1, 1, 48, WS, RS, rngs=nnx.Rngs(0)))
    assert _count(lm) == (closed_form_longnet(32, 4, 1, 1, 48) + 1000 * 32 + 2 * 32
                          + (32 * 1000 + 1000))


# ----------------------------------------------------------------------------- validation


def test_model_arguments_are_validated():
    with pytest.raises(ValueError, match="num_encoder_layers and num_decoder_layers"):
        LongNet(16, 4, 0, 0, 32, WS, RS, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"head dimension d_model / num_heads = 15/3 must be "
                                         "even"):
        LongNetLM(10, 15, 3, 0, 1, 32, WS, RS, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="embed_dim % num_heads"):
        nnx.eval_shape(lambda: LongNet(18, 4, 1, 1, 32, WS, RS, rngs=nnx.Rngs(0)))
    # the paper's dilation rates (1, 2, 4, 6, 12) break SPEC's w % r == 0 (16384 % 6 != 0)
    with pytest.raises(ValueError, match=r"segment_lengths\[3\]=16384 must be divisible by "
                                         r"dilation_rates\[3\]=6"):
        nnx.eval_shape(lambda: LongNet(dilation_rates=(1, 2, 4, 6, 12), rngs=nnx.Rngs(0)))
    lm = _build(lambda: LongNetLM(10, 16, 4, 0, 1, 32, WS, RS, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="tokens must be an integer array"):
        lm(jnp.zeros((2, 16)))


# ----------------------------------------------------------------------------- LongNetConfig


def test_config_and_keyword_forms_build_the_same_model():
    cfg = LongNetConfig(16, 4, 32, [4, 16], [1, 4], num_kv_heads=2, implementation=REF)
    assert cfg.segment_lengths == WS and cfg.dilation_rates == RS  # normalized: hashable
    assert hash(cfg) == hash(LongNetConfig(16, 4, 32, WS, RS, num_kv_heads=2,
                                           implementation=REF))
    by_kw = LongNetLM(40, 16, 4, 1, 1, 32, WS, RS, num_kv_heads=2, implementation=REF,
                      rngs=nnx.Rngs(0))
    by_cfg = LongNetLM(40, num_encoder_layers=1, num_decoder_layers=1, config=cfg,
                       rngs=nnx.Rngs(0))
    assert by_cfg.config == by_kw.config == cfg
    assert nnx.graphdef(by_cfg) == nnx.graphdef(by_kw)
    jax.tree.map(np.testing.assert_array_equal, _p(by_cfg), _p(by_kw))
    # every layer runs with the model's config object
    assert all(layer.config is by_cfg.config for layer in by_cfg.long_net.decoder)
    # arguments replace the fields of config
    wide = nnx.eval_shape(lambda: LongNet(32, num_encoder_layers=0, num_decoder_layers=1,
                                          config=cfg, dropout=0.1, rngs=nnx.Rngs(0)))
    assert wide.config == cfg.replace(d_model=32, dropout=0.1)
    # a layer without config keeps its own FFN default (2048), the models the paper's (3072)
    layer = nnx.eval_shape(lambda: DilatedTransformerEncoderLayer(16, 4, WS, RS,
                                                                  rngs=nnx.Rngs(0)))
    assert layer.ffn.linear1.kernel.shape == (16, 2048)
    assert LongNetConfig().dim_feedforward == 3072


def test_config_options_match_the_keyword_type():
    fields = {f.name for f in dataclasses.fields(LongNetConfig)}
    sizes = {"d_model", "num_heads", "dim_feedforward", "segment_lengths", "dilation_rates"}
    assert set(LongNetOptions.__annotations__) == fields - sizes


def test_config_is_validated_in_one_place():
    for bad, match in (
        (dict(dropout=1.0), "dropout"),
        (dict(layer_norm_eps=-1.0), "layer_norm_eps"),
        (dict(activation="relu"), "activation"),
        (dict(mode="grouped", num_heads=1, d_model=16), "grouped"),
        (dict(dim_feedforward=0), "dim_feedforward"),
        (dict(num_kv_heads=3, num_heads=4, d_model=16), "num_kv_heads"),
        (dict(use_bias=1), "use_bias"),
        (dict(segment_lengths=(4, 16), dilation_rates=(3, 4)), "divisible"),
        (dict(position_scheme="alibi"), r"position_scheme must be one of \('xpos', 'rope', "
                                        r"'none'\)"),
        (dict(position_scheme="xpos_embedding"), "'xpos_embedding' .* is not supported"),
        (dict(position_scheme=None), "position_scheme must be a str"),
        (dict(xpos_scale_base=0.0), "xpos_scale_base must be finite and > 0"),
        (dict(rope_theta=1.0), "rope_theta must be finite and > 1"),
    ):
        with pytest.raises((ValueError, TypeError), match=match):
            LongNetConfig(**{"segment_lengths": WS, "dilation_rates": RS, **bad})
    with pytest.raises(ValueError, match="dropout"):
        LongNetConfig(dropout=0.5).replace(dropout=2.0)
    with pytest.raises(TypeError, match=r"LongNet\(\) got unexpected keyword arguments "
                                        r"\['gamma_init'\]"):
        LongNet(16, 4, 1, 1, 32, WS, RS, gamma_init=2.0, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="config must be a dilax.models.LongNetConfig"):
        LongNetLM(10, config=dict(d_model=16), rngs=nnx.Rngs(0))
