"""One value for the settings every LongNet layer and model shares: :class:`LongNetConfig`.

The encoder and decoder layers, :class:`~dilax.models.LongNet` and
:class:`~dilax.models.LongNetLM` all take ``config=`` and, as before, the same settings as
arguments; :func:`resolve_config` is the one place that turns those arguments into a validated
config.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, TypedDict

import jax
import jax.numpy as jnp

from dilax import _validation as V
from dilax.core import BlockSizes
from dilax.dilated.settings import DilatedSettings
from dilax.models.positions import check_position_scheme
from dilax.nn._heads import check_dropout, check_heads
from dilax.nn.attention import check_sequence_parallel
from dilax.sp import SequenceParallel

Dtype = Any
Branches = tuple[int, ...] | list[int]

# LongNet paper, Sec. 4.1: segment lengths {2048, ..., 32768}. The paper's dilation rates are
# (1, 2, 4, 6, 12), but 16384 % 6 and 32768 % 12 are not 0, which the semantics ("w % r == 0")
# rejects; we use the powers of two (1, 2, 4, 8, 16), which also keep w / r = 2048 dilated
# positions per segment in every branch.
PAPER_SEGMENT_LENGTHS: tuple[int, ...] = (2048, 4096, 8192, 16384, 32768)
DEFAULT_DILATION_RATES: tuple[int, ...] = (1, 2, 4, 8, 16)


@dataclasses.dataclass(frozen=True)
class LongNetConfig:
    """The settings shared by the LongNet layers, :class:`LongNet` and :class:`LongNetLM`.

    Frozen and hashable (modules keep it as static metadata); validated and normalized once,
    when it is built (``segment_lengths``/``dilation_rates`` become tuples of ints). Defaults:
    the LongNet paper's base model (Sec. 4.1). What is not shared stays an argument of the
    module that uses it: ``gamma_init`` and ``cross_attention`` (layers), the layer counts and
    ``remat`` (:class:`LongNet`), ``num_tokens`` (:class:`LongNetLM`).

    Fields:
      d_model: model width; ``d_model % num_heads == 0``.
      num_heads: query heads.
      dim_feedforward: FFN hidden width.
      segment_lengths, dilation_rates: the dilated branches ``(w_i, r_i)``, ``w_i % r_i == 0``
        (paper segment lengths; see ``DEFAULT_DILATION_RATES`` for the rates).
      num_kv_heads: GQA key/value heads (``None``: ``num_heads``); must divide ``num_heads``.
      dropout: residual-branch, FFN-hidden and attention-output dropout rate, in ``[0, 1)``.
      activation: FFN nonlinearity (default ReLU, as in LongNet/MAGNETO).
      layer_norm_eps: LayerNorm epsilon (``>= 0``).
      mode: ``"mixture"`` (LongNet Eq. 10) or ``"grouped"`` (dilated-attention-pytorch after
        its fix ff80502, not the released 0.2.0; docs/migration.md).
      use_bias: biases on every linear layer (initialized to zero).
      implementation, block_sizes: forwarded to :func:`dilax.dilated_attention`.
      sequence_parallel: a :class:`dilax.SequenceParallel`: every attention runs as ring
        attention over its mesh (``implementation`` must then be None or ``"xla"``).
      dtype: compute dtype (e.g. ``jnp.bfloat16``; ``None``: from inputs and parameters).
      param_dtype: parameter dtype.
      keep_rngs: keep a forked ``dropout`` stream of the constructor's ``rngs`` (only when
        ``dropout > 0``); with ``False`` pass ``rngs`` at call time.
      local_window: optional ``W >= 0`` (``mode="mixture"``): every attention gets one more
        branch over the keys ``|p - t| <= W``, so queries at segment starts see their
        immediate predecessors (see :func:`dilax.dilated_attention`).
      position_scheme: positions inside every self-attention, on its queries and keys at the
        token index from 0 (:func:`dilax.models.rotary_qk`): ``"xpos"`` (default, as in
        torchscale's LongNet), ``"rope"`` or ``"none"``; the head dimension
        ``d_model / num_heads`` must be even for the first two. The output at position ``t``
        of a causal model depends on the tokens ``<= t`` only, not on the window length.
      xpos_scale_base: the XPOS scale base (> 0; torchscale: 512). XPOS keeps its scales in
        float32 range for windows up to ``127.7 * xpos_scale_base`` positions (65,391 at 512);
        longer ones are refused at trace time (raise it, or use ``"rope"``).
      rope_theta: the rotary base of both schemes (> 1; 10000).
      block_sparse: optional ``(block_size, window, stride)``: every self-attention is
        :func:`dilax.block_sparse_attention` over :func:`dilax.patterns.local_strided`
        ``(n, block_size, window, stride)`` (built for the length ``n`` of each call) instead
        of dilated attention; ``segment_lengths``/``dilation_rates``/``local_window`` are then
        unused (keep them valid). Same parameters as the dilated model; no KV-cache decoding.
        The Sparse-Transformer-style arm of ``python -m benchmarks quality``.
      logits_soft_cap: optional float ``> 0``: every attention soft-caps its logits,
        ``cap tanh(s / cap)`` (Gemma-2 style; :func:`dilax.dilated_attention`'s
        ``logits_soft_cap``). XLA core; no KV-cache decoding.
      attention_sinks: every attention learns one sink logit per query head
        (:class:`dilax.nn.MultiheadDilatedAttention`'s ``learnable_sinks``: an ``nnx.Param``
        ``sinks (num_heads,)``, zeros at init). XLA core; no KV-cache decoding.

    Raises:
      ValueError / TypeError: naming the first invalid field.
    """

    d_model: int = 768
    num_heads: int = 12
    dim_feedforward: int = 3072
    segment_lengths: tuple[int, ...] = PAPER_SEGMENT_LENGTHS
    dilation_rates: tuple[int, ...] = DEFAULT_DILATION_RATES
    _: dataclasses.KW_ONLY
    num_kv_heads: int | None = None
    dropout: float = 0.0
    activation: Callable[[jax.Array], jax.Array] = jax.nn.relu
    layer_norm_eps: float = 1e-5
    mode: str = "mixture"
    use_bias: bool = True
    implementation: str | None = None
    block_sizes: BlockSizes | None = None
    sequence_parallel: SequenceParallel | None = None
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    keep_rngs: bool = True
    local_window: int | None = None
    position_scheme: str = "xpos"
    xpos_scale_base: float = 512.0
    rope_theta: float = 10000.0
    block_sparse: tuple[int, int, int] | None = None
    logits_soft_cap: float | None = None
    attention_sinks: bool = False

    def __post_init__(self):
        d_model, num_heads, num_kv_heads = check_heads(self.d_model, self.num_heads,
                                                       self.num_kv_heads)
        dim_feedforward = V.static_int(self.dim_feedforward, "dim_feedforward")
        if dim_feedforward <= 0:
            raise ValueError(f"dim_feedforward must be positive, got {dim_feedforward}")
        dilated = DilatedSettings(self.segment_lengths, self.dilation_rates, mode=self.mode,
                                  implementation=self.implementation,
                                  block_sizes=self.block_sizes)
        V.check_mode(self.mode, num_heads, len(dilated.segment_lengths))
        eps = V.check_real(self.layer_norm_eps, "layer_norm_eps")
        if not (math.isfinite(eps) and eps >= 0):
            raise ValueError(f"layer_norm_eps must be finite and >= 0, got {eps}")
        scheme = check_position_scheme(self.position_scheme)
        if scheme != "none" and (d_model // num_heads) % 2:
            raise ValueError(f"position_scheme {scheme!r} rotates feature pairs: the head "
                             f"dimension d_model / num_heads = {d_model}/{num_heads} must be "
                             "even")
        scale_base = V.check_real(self.xpos_scale_base, "xpos_scale_base")
        if not (math.isfinite(scale_base) and scale_base > 0):
            raise ValueError(f"xpos_scale_base must be finite and > 0, got {scale_base}")
        theta = V.check_real(self.rope_theta, "rope_theta")
        if not (math.isfinite(theta) and theta > 1):
            raise ValueError(f"rope_theta must be finite and > 1, got {theta}")
        if not callable(self.activation):
            raise TypeError(f"activation must be callable, got {self.activation!r}")
        normalized = dict(
            d_model=d_model, num_heads=num_heads,
            num_kv_heads=None if self.num_kv_heads is None else num_kv_heads,
            dim_feedforward=dim_feedforward, segment_lengths=dilated.segment_lengths,
            dilation_rates=dilated.dilation_rates, dropout=check_dropout(self.dropout),
            layer_norm_eps=eps, use_bias=V.check_bool(self.use_bias, "use_bias"),
            sequence_parallel=check_sequence_parallel(self.sequence_parallel,
                                                      self.implementation, dilated=True),
            keep_rngs=V.check_bool(self.keep_rngs, "keep_rngs"),
            local_window=V.check_local_window(self.local_window, self.mode),
            position_scheme=scheme, xpos_scale_base=scale_base, rope_theta=theta,
            block_sparse=check_block_sparse(self.block_sparse, self.sequence_parallel),
            logits_soft_cap=V.check_flex_options(None, None, self.logits_soft_cap)[2],
            attention_sinks=V.check_bool(self.attention_sinks, "attention_sinks"),
        )
        for name, value in normalized.items():
            object.__setattr__(self, name, value)

    def replace(self, **changes: Any) -> LongNetConfig:
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)


class LongNetOptions(TypedDict, total=False):
    """The keyword-only fields of :class:`LongNetConfig`: the type of the ``**options`` that
    the layers, :class:`LongNet` and :class:`LongNetLM` accept (an IDE lists them)."""

    num_kv_heads: int | None
    dropout: float
    activation: Callable[[jax.Array], jax.Array]
    layer_norm_eps: float
    mode: str
    use_bias: bool
    implementation: str | None
    block_sizes: BlockSizes | None
    sequence_parallel: SequenceParallel | None
    dtype: Dtype | None
    param_dtype: Dtype
    keep_rngs: bool
    local_window: int | None
    position_scheme: str
    xpos_scale_base: float
    rope_theta: float
    block_sparse: tuple[int, int, int] | None
    logits_soft_cap: float | None
    attention_sinks: bool


def check_block_sparse(spec: Any, sequence_parallel: Any = None) -> tuple[int, int, int] | None:
    """``LongNetConfig.block_sparse``: ``None`` or ``(block_size > 0, window >= 0,
    stride > 0)`` ints."""
    if spec is None:
        return None
    try:
        values = tuple(spec)
    except TypeError:
        values = ()
    if len(values) != 3:
        raise ValueError(f"block_sparse must be None or (block_size, window, stride), got "
                         f"{spec!r}")
    block_size, window, stride = (V.static_int(x, name) for x, name in
                                  zip(values, ("block_size", "window", "stride")))
    if block_size <= 0 or window < 0 or stride <= 0:
        raise ValueError(f"block_sparse (block_size, window, stride) needs block_size > 0, "
                         f"window >= 0, stride > 0, got {values}")
    if sequence_parallel is not None:
        raise ValueError("block_sparse with sequence_parallel is not supported by the models")
    return block_size, window, stride


_SIZES = ("d_model", "num_heads", "dim_feedforward", "segment_lengths", "dilation_rates")
_OPTIONS = tuple(f.name for f in dataclasses.fields(LongNetConfig) if f.name not in _SIZES)


def resolve_config(owner: str, config: LongNetConfig | None, options: dict[str, Any], *,
                   base: LongNetConfig | None = None, **sizes: Any) -> LongNetConfig:
    """The config a constructor runs with: ``config`` (default ``base``, else
    ``LongNetConfig()``) with the settings given as arguments replaced.

    ``sizes`` are the constructor's size arguments (``d_model``, ``num_heads``,
    ``dim_feedforward``, ``segment_lengths``, ``dilation_rates``), ``None`` where not given;
    ``options`` its ``**options`` (every key given, ``None`` included, replaces the field).
    ``owner`` names the constructor in the error for an unknown keyword.
    """
    if config is None:
        config = LongNetConfig() if base is None else base
    elif not isinstance(config, LongNetConfig):
        raise TypeError(f"config must be a dilax.models.LongNetConfig or None, got "
                        f"{type(config).__name__}")
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"{owner}() got unexpected keyword arguments {unknown}; its settings are "
                        f"the fields of LongNetConfig: {_SIZES + _OPTIONS}")
    changes = {k: v for k, v in sizes.items() if v is not None} | options
    return config.replace(**changes) if changes else config
