"""Mamba-2's gated RMSNorm over groups (mamba_ssm's ``RMSNormGated``, what megatron's mixer
applies to the scan output before ``out_proj``)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .naive import accumulation_dtype


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, z: Optional[torch.Tensor] = None, *,
                   group_size: Optional[int] = None, eps: float = 1e-5,
                   norm_before_gate: bool = False) -> torch.Tensor:
    """RMSNorm of x over groups of ``group_size`` channels of its last dim, times ``weight``,
    gated by silu(z): ``norm(x * silu(z)) * weight`` (``norm_before_gate=False``, Mamba-2's
    and megatron's choice) or ``norm(x) * weight * silu(z)``.

    x, z: [..., C]; weight: [C]; group_size divides C (None: one group). Computed in float32
    (float64 for float64 inputs), returned in x's dtype.
    """
    channels = x.shape[-1]
    group_size = channels if group_size is None else group_size
    if group_size < 1 or channels % group_size:
        raise ValueError(f"gated_rms_norm: group_size={group_size} must divide the last dim "
                         f"{channels}")
    if tuple(weight.shape) != (channels,):
        raise ValueError(f"gated_rms_norm: weight has shape {tuple(weight.shape)}; expected "
                         f"[{channels}]")
    if z is not None and z.shape != x.shape:
        raise ValueError(f"gated_rms_norm: z has shape {tuple(z.shape)}; expected x's "
                         f"{tuple(x.shape)}")
    acc = accumulation_dtype(x.dtype)
    h = x.to(acc)
    if z is not None and not norm_before_gate:
        h = h * F.silu(z.to(acc))
    g = h.reshape(*h.shape[:-1], channels // group_size, group_size)
    g = g * torch.rsqrt(g.square().mean(dim=-1, keepdim=True) + eps)
    out = g.reshape(h.shape) * weight.to(acc)
    if z is not None and norm_before_gate:
        out = out * F.silu(z.to(acc))
    return out.to(x.dtype)
