"""One decode step of Mamba-2's SSD: the state update and output for one token."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .checks import check_ssd_inputs
from .naive import accumulation_dtype, discretize_dt, skip_term


def ssd_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
             B: torch.Tensor, C: torch.Tensor, D: Optional[torch.Tensor] = None,
             dt_bias: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """One token of the SSD recurrence (``ssd_naive``'s loop body).

    state: [B, H, P, N]; x: [B, H, P]; dt: [B, H] (raw); A: [H]; B, C: [B, G, N]; D: [H] or
    [H, P] or None; dt_bias: [H] or None. Returns ``(y [B, H, P] in x's dtype, new state
    [B, H, P, N] in state's dtype)``; the caller keeps or copies the new state (functional, so
    autograd sees it).
    """
    batch, _, H, P, G, N = check_ssd_inputs("ssd_step", x, dt, A, B, C, D, dt_bias, state,
                                            token_dim=False)
    acc = accumulation_dtype(torch.promote_types(x.dtype, state.dtype))
    xf = x.to(acc)
    dtf = discretize_dt(dt, dt_bias, acc)                       # [B, H]
    Bh = B.to(acc).repeat_interleave(H // G, dim=1)              # [B, H, N]
    Ch = C.to(acc).repeat_interleave(H // G, dim=1)
    dA = torch.exp(dtf * A.to(acc))
    S = dA[:, :, None, None] * state.to(acc) + (dtf[:, :, None] * xf)[..., None] * Bh[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", S, Ch) + skip_term(D, xf)
    return y.to(x.dtype), S.to(state.dtype)
