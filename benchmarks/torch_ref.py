"""Our own PyTorch implementation of the grouped dilated algorithm, for same-run comparison.

It follows dilated-attention-pytorch's ``DilatedAttention.forward``: for head group ``i`` take
every ``r``-th row (offset ``i % r``) of each segment, run
``torch.nn.functional.scaled_dot_product_attention`` on all segments at once, add the result
into a zero tensor and divide by the number of groups. torch is optional: importing this module
without torch raises ImportError, and the CLI reports the row as unavailable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dilax.semantics import group_sizes


def dilated_attention_grouped_torch(q, k, v, segment_lengths, dilation_rates, is_causal=False):
    """``q, k, v: (b, n, h, d)`` torch tensors, ``n`` a multiple of every segment length."""
    b, n, h, d = q.shape
    num_groups = len(segment_lengths)
    out = torch.zeros_like(q)
    start = 0
    for i, (g, w, r) in enumerate(zip(group_sizes(h, num_groups), segment_lengths,
                                      dilation_rates)):
        offset, heads = i % r, slice(start, start + g)
        segs = n // w

        def dilate(x, offset=offset, heads=heads, w=w, r=r, segs=segs, g=g):
            x = x.view(b, segs, w, h, d)[:, :, offset::r, heads]  # (b, S, w/r, g, d)
            return x.reshape(b * segs, w // r, g, d).transpose(1, 2)  # (b*S, g, w/r, d)

        x = F.scaled_dot_product_attention(dilate(q), dilate(k), dilate(v), is_causal=is_causal)
        x = x.transpose(1, 2).reshape(b, segs, w // r, g, d)
        out.view(b, segs, w, h, d)[:, :, offset::r, heads] += x
        start += g
    return out / num_groups


def make_torch_fns(q_np, k_np, v_np, segment_lengths, dilation_rates, is_causal):
    """Returns ``(forward, forward_backward, output_numpy)`` callables on CPU float32 tensors."""
    q, k, v = (torch.from_numpy(x.copy()) for x in (q_np, k_np, v_np))

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
