"""The readable definition of the fused kernels (torch only, no triton).

``rms_norm_reference`` is exactly what ``megatron_subq.norm.LocalNorm`` computes for RMSNorm:
normalise in fp32 (or the input's wider dtype), scale by the weight (``weight + 1`` with
zero-centred gamma), cast back to the input's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       zero_centered_gamma: bool = False) -> torch.Tensor:
    """``y = x / sqrt(mean(x^2) + eps) * w`` over the last dimension, in
    ``promote_types(x.dtype, float32)``, returned in ``x.dtype``; ``w = weight (+ 1)``."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    w = weight.to(dtype)
    if zero_centered_gamma:
        w = w + 1.0
    y = F.rms_norm(x.to(dtype), (x.shape[-1],), w, eps)
    return y.to(x.dtype)


def rope_reference(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """megatron's unfused non-interleaved RoPE (``_apply_rotary_pos_emb_bshd``, mscale 1):
    ``x * cos(f) + rotate_half(x) * sin(f)`` on the first ``r = freqs.shape[-1]`` features,
    the rest passed through; cos/sin cast to x's dtype."""
    rot = freqs.shape[-1]
    t, t_pass = x[..., :rot], x[..., rot:]
    x1, x2 = torch.chunk(t, 2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    t = t * torch.cos(freqs).to(x.dtype) + rotated * torch.sin(freqs).to(x.dtype)
    return torch.cat((t, t_pass), dim=-1)
