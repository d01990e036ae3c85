"""The causal depthwise conv1d (+ SiLU) that Mamba-2 runs over [x | B | C] before the scan, over
a whole sequence and for one decode token. Channels-last ``[B, T, C]``; the conv state is
megatron's ``[B, C, W]``: the last W inputs, oldest first."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .checks import check_activation, check_conv_inputs
from .naive import accumulation_dtype


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                  initial_state: Optional[torch.Tensor] = None,
                  activation: Optional[str] = "silu") -> Tuple[torch.Tensor, torch.Tensor]:
    """y_t = act(bias + sum_{k<W} weight[:, k] * x_{t-W+1+k}) per channel, with x before the
    sequence taken from ``initial_state`` (zeros without one).

    x: [B, T, C]; weight: [C, W]; bias: [C] or None; initial_state: [B, C, W] or None (its last
    W-1 columns are the W-1 inputs before x). Returns ``(y [B, T, C] in x's dtype, final state
    [B, C, W]: the last W inputs, for ``causal_conv1d_step``)``. Computed in float32 (float64
    for float64 inputs), as mamba's CUDA conv accumulates.
    """
    batch, channels, width = check_conv_inputs("causal_conv1d", x, weight, bias, initial_state)
    check_activation("causal_conv1d", activation)
    xt = x.transpose(1, 2)                                       # [B, C, T]
    if initial_state is None:
        left = xt.new_zeros(batch, channels, width - 1)
        state_dtype = x.dtype
    else:
        left = initial_state[..., 1:].to(x.dtype)
        state_dtype = initial_state.dtype
    full = torch.cat([left, xt], dim=-1)                         # [B, C, W-1+T]
    acc = accumulation_dtype(x.dtype)
    y = F.conv1d(full.to(acc), weight.to(acc)[:, None, :],
                 None if bias is None else bias.to(acc), groups=channels)
    if activation == "silu":
        y = F.silu(y)
    pad = max(0, width - full.shape[-1])
    final_state = F.pad(full[..., -width:], (pad, 0)).to(state_dtype)
    return y.to(x.dtype).transpose(1, 2), final_state


def causal_conv1d_step(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                       bias: Optional[torch.Tensor] = None, activation: Optional[str] = "silu"
                       ) -> Tuple[torch.Tensor, torch.Tensor]:
    """One token of the causal depthwise conv.

    x: [B, C]; conv_state: [B, C, W], the last W inputs, oldest first (megatron's layout; the
    oldest column is dropped before use, so the step reads the last W-1 inputs and x); weight:
    [C, W]; bias: [C] or None. Returns ``(y [B, C] in x's dtype, new state [B, C, W] = the
    state shifted left with x appended)``. Computed in float32 (float64 for float64 inputs).
    """
    check_conv_inputs("causal_conv1d_step", x, weight, bias, conv_state, token_dim=False)
    check_activation("causal_conv1d_step", activation)
    new_state = torch.cat([conv_state[..., 1:], x.to(conv_state.dtype)[..., None]], dim=-1)
    acc = accumulation_dtype(x.dtype)
    y = (new_state.to(acc) * weight.to(acc)).sum(-1)
    if bias is not None:
        y = y + bias.to(acc)
    if activation == "silu":
        y = F.silu(y)
    return y.to(x.dtype), new_state
