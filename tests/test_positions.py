"""Positions inside attention (issue 26): the rotary code on queries and keys, and what it buys
a causal LongNetLM: the logits at position t depend on the tokens <= t only, so a prefix's
forward gives the same rows as the full window's, on one device and sequence-parallel.

(Generation: tests/test_decode.py; old checkpoints: tests/test_train.py.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from tolerance import FP32, assert_scaled_close

import dilax
from dilax.models import LongNetConfig, LongNetLM, rotary_qk

VOCAB, N = 29, 32
WS, RS = (4, 8, 16), (1, 2, 4)  # N = 32 crosses the segment starts of every branch


def rotary_reference(x, positions, scheme, *, sign=1, centre=0, scale_base=512.0,
                     theta=10000.0):
    """float64 NumPy: feature pair ``(x[2i], x[2i+1])`` as the complex number ``a + ib``
    times ``exp(i p / theta^(2i/d))`` and, for XPOS, ``zeta_i^(sign (p - centre)/scale_base)``
    (``sign=+1`` queries, ``-1`` keys). ``x (b, n, h, d)``, ``positions (b, n)``."""
    x = np.asarray(x, np.float64)
    d = x.shape[-1]
    j = np.arange(d // 2)
    pos = np.asarray(positions, np.float64)[:, :, None, None]
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * pos / theta ** (j / (d // 2)))
    if scheme == "xpos":
        zeta = (2 * j + 0.4 * d) / (1.4 * d)
        z = z * zeta ** (sign * (pos - centre) / scale_base)
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


@pytest.mark.parametrize("scheme", ["xpos", "rope"])
def test_rotary_qk_matches_the_complex_reference_and_is_relative(scheme):
    rng = np.random.default_rng(0)
    b, n, h, hk, d = 2, 12, 4, 2, 8
    q, k = rng.standard_normal((b, n, h, d)), rng.standard_normal((b, n, hk, d))
    # positions as a packed batch has them: restarting per document
    pos = np.stack([np.arange(n), np.r_[np.arange(5), np.arange(n - 5)]]).astype(np.int32)
    f = jax.jit(rotary_qk, static_argnames=("scheme", "centre"))
    rq, rk = f(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32), jnp.asarray(pos),
               scheme=scheme, centre=n // 2)
    assert rq.dtype == rk.dtype == jnp.float32
    assert_scaled_close(rq, rotary_reference(q, pos, scheme, centre=n // 2))
    assert_scaled_close(rk, rotary_reference(k, pos, scheme, sign=-1, centre=n // 2))
    # the centre cancels in q.k; shifting every position changes nothing either (relative)
    dots = np.einsum("bmhd,bthd->bhmt", np.asarray(rq)[:, :, :hk], np.asarray(rk))
    ref = np.einsum("bmhd,bthd->bhmt", rotary_reference(q, pos + 1000, scheme)[:, :, :hk],
                    rotary_reference(k, pos + 1000, scheme, sign=-1))
    assert_scaled_close(dots, ref)
    # default positions: 0 .. n - 1
    default = f(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32), None,
                scheme=scheme, centre=0)
    assert_scaled_close(default[0], rotary_reference(q, np.broadcast_to(np.arange(n), (b, n)),
                                                     scheme))
    with pytest.raises(ValueError, match=r"positions must be an integer array of shape"):
        rotary_qk(jnp.zeros((b, n, h, d)), jnp.zeros((b, n, hk, d)), jnp.zeros((b, n)))


def _lm(num_encoder_layers, local_window, sequence_parallel=None):
    cfg = LongNetConfig(16, 2, 32, WS, RS, local_window=local_window,
                        sequence_parallel=sequence_parallel)
    return LongNetLM(VOCAB, config=cfg, num_encoder_layers=num_encoder_layers,
                     num_decoder_layers=1, rngs=nnx.Rngs(0))


def _logit_scale(logits) -> float:
    return float(np.abs(np.asarray(logits)).max())


# decoder-only with and without the local window, and encoder-decoder without it (the window
# branch is the same attention code in encoder and decoder layers: encoder-decoder with the
# window would add no code path to these)
CASES = [(0, None), (0, 3), (1, None)]


def _mesh(P=4):
    return jax.make_mesh((P,), ("sp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:P])


@pytest.mark.parametrize("num_encoder_layers,local_window", CASES)
def test_prefix_forward_rows_equal_the_full_forward(num_encoder_layers, local_window):
    """Acceptance 1, one device (XLA implementation) and sequence-parallel (ring attention over
    4 devices): rows of ``lm(tokens[:, :m])`` are those of ``lm(tokens)``, fp32, within 1e-5
    of the logit scale (one device: a prefix ending mid-segment; the ring: its prefix forward
    against the one-device full window, so the ring also equals the one-device model; one
    test per case, so the one-device forward of the full window compiles once for both
    checks; the ring's geometries are tested in test_ring.py)."""
    lm = _lm(num_encoder_layers, local_window)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, N), 0, VOCAB)
    forward = nnx.jit(lambda m, t: m(t))
    full = np.asarray(forward(lm, tokens))
    prefix = np.asarray(forward(lm, tokens[:, :13]))
    scale = _logit_scale(full)
    assert_scaled_close(prefix, full[:, :13], FP32, scale=scale)
    if (num_encoder_layers, local_window) == (0, 3):
        # explicit positions: 0 .. n - 1 is the default; a shift of every position is not
        # seen (the code is relative); positions restarting mid-row start a new context
        with_pos = nnx.jit(lambda m, t, p: m(t, positions=p))
        pos = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (2, N))
        assert_scaled_close(with_pos(lm, tokens, pos), full, FP32, scale=scale)
        assert_scaled_close(with_pos(lm, tokens, pos + 77), full, FP32, scale=scale)
        restarted = np.asarray(with_pos(lm, tokens, pos.at[:, 20:].add(-20)))
        assert_scaled_close(restarted[:, :20], full[:, :20], FP32, scale=scale)
        assert np.abs(restarted[:, 20:] - full[:, 20:]).max() > 1e-3 * scale
    # the ring's forward of a 16-token prefix (shards of 4: the branches w = 8 and 16 cross
    # shards) is the one-device forward's rows, for decoder-only with the window and for
    # encoder-decoder without it (decoder-only without the window adds no ring code path;
    # LongNetLM's ring is also tested in test_sequence_parallel.py)
    if (num_encoder_layers, local_window) not in ((0, 3), (1, None)):
        return
    ring = _lm(num_encoder_layers, local_window, dilax.SequenceParallel(_mesh()))
    ring_prefix = np.asarray(forward(ring, tokens[:, :16]))
    # depth 2: the ring merges the branches' partial softmax results in another order
    assert_scaled_close(ring_prefix, full[:, :16], FP32, depth=2, scale=scale)


def test_xpos_windows_past_the_float32_range_are_refused_by_name():
    """XPOS's scales zeta^(+-(p - c)/scale_base) leave float32 past 65,391 positions at
    scale_base 512 (q.k would be inf * 0): a ValueError at trace time, with the fix; a larger
    scale_base or RoPE take the same window (traced only, nothing runs)."""
    def trace(call=lambda lm: lm(jnp.zeros((1, 65536), jnp.int32)), **options):
        return nnx.eval_shape(lambda: call(LongNetLM(VOCAB, 16, 2, 0, 1, 32, (16,), (1,),
                                                     rngs=nnx.Rngs(0), **options)))

    with pytest.raises(ValueError, match=r"sequence length 65536 is too long for "
                                         r"position_scheme 'xpos' with xpos_scale_base=512.*"
                                         r"65,391 positions; use xpos_scale_base >= 514 or "
                                         r"position_scheme 'rope'"):
        trace()
    assert trace(xpos_scale_base=514.0).shape == (1, 65536, VOCAB)
    assert trace(position_scheme="rope").shape == (1, 65536, VOCAB)
    with pytest.raises(ValueError, match=r"the cache's max_len 65536 is too long"):
        trace(lambda lm: lm.decode(jnp.zeros((1, 1), jnp.int32), lm.init_cache(1, 65536)))
