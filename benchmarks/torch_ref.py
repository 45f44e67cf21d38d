"""Our own PyTorch implementations of dilated-attention-pytorch's grouped algorithm, for
same-run comparison (``--compare-torch``) and for the migration guide (docs/migration.md).

Two versions of the package's ``DilatedAttention.forward`` (``q, k, v: (b, n, h, d)``), written
from their description, not copied:

- :func:`dilated_attention_grouped_torch`: the package *after* the fork commit that fixed it
  (DarcStar-Solutions-Tech/dilated-attention-pytorch ff80502, 2025-06-25; unreleased, the fork
  still calls itself 0.2.0). Heads are split into one contiguous group per branch (sizes
  ``h // G``, the first ``h % G`` one larger); for group ``i`` take every ``r``-th row
  (offset ``i % r``) of each segment, run ``torch.nn.functional.scaled_dot_product_attention``
  on all segments at once, add the result into a zero tensor and divide by the number of
  groups. This is dilax's ``mode="grouped"``.
- :func:`dilated_attention_v020_torch`: the released 0.2.0 (PyPI; fkodom/dilated-attention-pytorch
  tag 0.2.0 = f06f7d9). It differs in two places: each group's attention output is divided by
  its own sum over all segments and rows (``x / x.sum(dim=(1, 2), keepdim=True)``, per batch
  row, head and channel) before it is added, and group ``i`` takes the heads
  ``i * g_i .. (i + 1) * g_i`` (``g_i`` its own size), which overlap and leave heads out when
  ``h % G != 0``. ``per_group_sum=False`` removes only the first difference.

:class:`MultiheadDilatedAttentionTorch` is the package's ``MultiheadDilatedAttention`` around
either (same parameter names, so a state dict of the package loads into it).

torch is optional: importing this module without torch raises ImportError, and the CLI reports
the row as unavailable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dilax.semantics import group_sizes


def _contiguous_heads(h, num_groups):
    """``(start, stop)`` per group: consecutive ranges of the group sizes (the fixed package)."""
    ranges, start = [], 0
    for g in group_sizes(h, num_groups):
        ranges.append((start, start + g))
        start += g
    return ranges


def _v020_heads(h, num_groups):
    """``(start, stop)`` per group as 0.2.0 slices them: ``i * g .. (i + 1) * g``."""
    return [(i * g, (i + 1) * g) for i, g in enumerate(group_sizes(h, num_groups))]


def _dilate(x, w, offset, r, lo, hi):
    """``(b, n, h, d)`` -> ``(b * n/w, hi - lo, m, d)``: rows ``offset::r`` of every segment of
    ``w`` rows, heads ``lo:hi``, segments folded into the batch (``m`` rows per segment)."""
    b, n, h, d = x.shape
    x = x.reshape(b, n // w, w, h, d)[:, :, offset::r, lo:hi]  # (b, S, m, g, d)
    return x.reshape(b * (n // w), x.shape[2], hi - lo, d).transpose(1, 2)


def _grouped(q, k, v, segment_lengths, dilation_rates, is_causal, head_ranges, per_group_sum):
    b, n, h, d = q.shape
    for w in segment_lengths:
        if n % w:
            raise ValueError(f"the package needs n a multiple of every segment length: "
                             f"n={n}, segment length {w}")
    num_groups = len(segment_lengths)
    out = torch.zeros_like(q)
    for i, ((lo, hi), w, r) in enumerate(zip(head_ranges, segment_lengths, dilation_rates)):
        offset, g, segs = i % r, hi - lo, n // w
        m = len(range(offset, w, r))  # selected rows per segment
        qd, kd, vd = (_dilate(x, w, offset, r, lo, hi) for x in (q, k, v))
        x = F.scaled_dot_product_attention(qd, kd, vd, is_causal=is_causal)
        x = x.transpose(1, 2).reshape(b, segs, m, g, d)
        if per_group_sum:  # 0.2.0: normalized by its sum over segments and rows
            x = x / x.sum(dim=(1, 2), keepdim=True)
        out.view(b, segs, w, h, d)[:, :, offset::r, lo:hi] += x
    return out / num_groups


def dilated_attention_grouped_torch(q, k, v, segment_lengths, dilation_rates, is_causal=False):
    """The package after its fix (= dilax ``mode="grouped"``). ``q, k, v: (b, n, h, d)``
    torch tensors, ``n`` a multiple of every segment length."""
    return _grouped(q, k, v, segment_lengths, dilation_rates, is_causal,
                    _contiguous_heads(q.shape[2], len(segment_lengths)), per_group_sum=False)


def dilated_attention_v020_torch(q, k, v, segment_lengths, dilation_rates, is_causal=False, *,
                                 per_group_sum=True):
    """The released dilated-attention-pytorch 0.2.0. ``per_group_sum=False``: the same without
    the per-group ``x / x.sum(dim=(1, 2))`` (its head ranges kept)."""
    return _grouped(q, k, v, segment_lengths, dilation_rates, is_causal,
                    _v020_heads(q.shape[2], len(segment_lengths)), per_group_sum)


class MultiheadDilatedAttentionTorch(torch.nn.Module):
    """The package's ``MultiheadDilatedAttention``, with its parameter names (``q_proj``,
    ``k_proj``, ``v_proj``, ``norm``, ``out_proj``: a state dict of the package loads into it)
    and its argument order (``dilation_rates`` before ``segment_lengths``).

    ``forward(query, key, value, is_causal=False)`` with ``(b, n, embed_dim)`` inputs returns
    ``(y, None)``: ``y = out_proj(norm(attention(q_proj(query), k_proj(key), v_proj(value))))``
    with the heads split as ``(b, n, h, embed_dim / h)``, the MAGNETO sub-LayerNorm only when
    ``layer_norm``. The attention is :func:`dilated_attention_grouped_torch` (the fixed
    package), or :func:`dilated_attention_v020_torch` with ``v020=True``. Initialization:
    Xavier-normal weights (gain ``gamma_init`` on ``v_proj`` and ``out_proj``), zero biases.
    No dropout (0.2.0 does not apply its attention dropout either).
    """

    def __init__(self, embed_dim, num_heads, dilation_rates, segment_lengths, bias=True,
                 layer_norm=True, layer_norm_eps=1e-5, gamma_init=1.0, v020=False):
        super().__init__()
        self.num_heads = num_heads
        self.segment_lengths, self.dilation_rates = list(segment_lengths), list(dilation_rates)
        self.attend = dilated_attention_v020_torch if v020 else dilated_attention_grouped_torch
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (
            torch.nn.Linear(embed_dim, embed_dim, bias=bias) for _ in range(4))
        self.norm = torch.nn.LayerNorm(embed_dim, eps=layer_norm_eps) if layer_norm else None
        for layer, gain in ((self.q_proj, 1.0), (self.k_proj, 1.0), (self.v_proj, gamma_init),
                            (self.out_proj, gamma_init)):
            torch.nn.init.xavier_normal_(layer.weight, gain=gain)
            if layer.bias is not None:
                torch.nn.init.zeros_(layer.bias)

    def forward(self, query, key, value, is_causal=False):
        b, n, e = query.shape
        q, k, v = (proj(x).reshape(b, n, self.num_heads, e // self.num_heads)
                   for proj, x in ((self.q_proj, query), (self.k_proj, key),
                                   (self.v_proj, value)))
        x = self.attend(q, k, v, self.segment_lengths, self.dilation_rates, is_causal)
        x = x.reshape(b, n, e)
        if self.norm is not None:
            x = self.norm(x)
        return self.out_proj(x), None


def make_torch_fns(q_np, k_np, v_np, segment_lengths, dilation_rates, is_causal):
    """Returns ``(forward, forward_backward, output_numpy)`` callables on CPU float32 tensors.
    ``k_np``/``v_np`` may have fewer heads than ``q_np`` (GQA): they are repeated to ``h``
    (query head ``j`` reads key/value head ``j // (h // hk)``), which the package needs."""
    q, k, v = (torch.from_numpy(x.copy()) for x in (q_np, k_np, v_np))
    k, v = (x.repeat_interleave(q.shape[2] // x.shape[2], dim=2) for x in (k, v))

    def forward():
        with torch.inference_mode():
            return dilated_attention_grouped_torch(q, k, v, segment_lengths, dilation_rates,
                                                   is_causal)

    qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))
    ct = torch.randn_like(q)

    def forward_backward():
        for x in (qg, kg, vg):
            x.grad = None
        out = dilated_attention_grouped_torch(qg, kg, vg, segment_lengths, dilation_rates,
                                              is_causal)
        out.backward(ct)
        return qg.grad

    return forward, forward_backward, lambda: forward().numpy()
