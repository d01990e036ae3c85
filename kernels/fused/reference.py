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
