"""Mamba-2's SSD recurrence, token by token: the readable definition the chunked scan is tested
against.

Per batch row and head h (group g(h) = h // (H/G) supplies B and C), with the state
S[h] in R^{P x N} (``[B, H, P, N]`` for the batch):

    dt_t  = softplus(dt_raw_t + dt_bias)          (dt_limit (0, inf): no clamp, no floor)
    dA_t  = exp(dt_t * A)                         (A = -exp(A_log) < 0, so 0 < dA_t <= 1)
    S_t   = dA_t * S_{t-1} + dt_t * x_t (outer) B_t
    y_t   = S_t C_t + D * x_t

Everything is accumulated in float32 (float64 for float64 inputs); y comes back in x's dtype and
the final state in the accumulation dtype.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .checks import check_ssd_inputs


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def discretize_dt(dt: torch.Tensor, dt_bias: Optional[torch.Tensor], acc: torch.dtype):
    """dt = softplus(dt_raw + dt_bias) in ``acc`` (Mamba-2's step size, dt_limit (0, inf))."""
    dt = dt.to(acc)
    if dt_bias is not None:
        dt = dt + dt_bias.to(acc)
    return F.softplus(dt)


def skip_term(D: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """D * x for D of shape [H] or [H, P] (x: [..., H, P]); 0 without D."""
    if D is None:
        return torch.zeros((), dtype=x.dtype, device=x.device)
    D = D.to(x.dtype)
    return (D[:, None] if D.dim() == 1 else D) * x


def ssd_naive(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
              C: torch.Tensor, D: Optional[torch.Tensor] = None,
              dt_bias: Optional[torch.Tensor] = None, *,
              initial_state: Optional[torch.Tensor] = None
              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The SSD recurrence, one token at a time (the definition; O(T) sequential steps).

    x: [B, T, H, P]; dt: [B, T, H] (raw, before bias and softplus); A: [H]; B, C: [B, T, G, N]
    with H % G == 0; D: [H] or [H, P] or None; dt_bias: [H] or None; initial_state:
    [B, H, P, N] or None (zeros). Returns ``(y [B, T, H, P] in x's dtype, final state
    [B, H, P, N])``.
    """
    batch, T, H, P, G, N = check_ssd_inputs("ssd_naive", x, dt, A, B, C, D, dt_bias,
                                            initial_state)
    acc = accumulation_dtype(x.dtype)
    xf = x.to(acc)
    dtf = discretize_dt(dt, dt_bias, acc)                       # [B, T, H]
    Af = A.to(acc)
    Bh = B.to(acc).repeat_interleave(H // G, dim=2)              # [B, T, H, N], group h // (H/G)
    Ch = C.to(acc).repeat_interleave(H // G, dim=2)
    S = (torch.zeros(batch, H, P, N, dtype=acc, device=x.device) if initial_state is None
         else initial_state.to(acc))
    ys = []
    for t in range(T):
        dA = torch.exp(dtf[:, t] * Af)                          # [B, H]
        S = (dA[:, :, None, None] * S
             + (dtf[:, t, :, None] * xf[:, t])[..., None] * Bh[:, t, :, None, :])
        ys.append(torch.einsum("bhpn,bhn->bhp", S, Ch[:, t]))
    y = torch.stack(ys, dim=1) if T else xf.new_zeros(batch, 0, H, P)
    y = y + skip_term(D, xf)
    return y.to(x.dtype), S
