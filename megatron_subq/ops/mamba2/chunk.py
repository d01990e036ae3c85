"""Mamba-2's SSD as a chunked scan in plain PyTorch (the state-space dual form).

The sequence is cut into chunks of Q tokens (the last one zero-padded: a padded token has
dt = 0, so it neither decays nor feeds the state). With a_t = dt_t * A and its running sum
``acum`` inside each chunk, for tokens i >= j of one chunk and head h of group g:

    y_i  = sum_{j<=i} exp(acum_i - acum_j) (C_i . B_j) dt_j x_j    (intra-chunk, quadratic)
         + exp(acum_i) C_i S_in                                    (S_in: the state entering)
         + D x_i
    S_out = exp(acum_Q) S_in + sum_j exp(acum_Q - acum_j) dt_j x_j (outer) B_j

so the chunks' own states are computed in parallel and only the Q-fold shorter chain of
``S_out`` is sequential. The same math as ``ssd_naive``, in float32 (float64 for float64 inputs);
autograd differentiates it. Memory: the intra-chunk factors are [B, T/Q, Q, Q, H].
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .checks import check_chunk_size, check_ssd_inputs
from .naive import accumulation_dtype, discretize_dt, skip_term

DEFAULT_CHUNK_SIZE = 128  # megatron's MambaMixer default (mamba_ssm's kernels take it too)


def ssd_chunk(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
              C: torch.Tensor, D: Optional[torch.Tensor] = None,
              dt_bias: Optional[torch.Tensor] = None, *, chunk_size: int = DEFAULT_CHUNK_SIZE,
              initial_state: Optional[torch.Tensor] = None
              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan, chunked; same contract as ``ssd_naive``.

    x: [B, T, H, P]; dt: [B, T, H] (raw, before bias and softplus); A: [H]; B, C: [B, T, G, N]
    with H % G == 0 (head h reads group h // (H/G)); D: [H] or [H, P] or None; dt_bias: [H] or
    None; initial_state: [B, H, P, N] or None (zeros); any T (the last chunk is padded).
    Returns ``(y [B, T, H, P] in x's dtype, final state [B, H, P, N] in the accumulation
    dtype)``.
    """
    batch, T, H, P, G, N = check_ssd_inputs("ssd_chunk", x, dt, A, B, C, D, dt_bias,
                                            initial_state)
    Q = check_chunk_size("ssd_chunk", chunk_size)
    R = H // G                                                   # heads per group
    acc = accumulation_dtype(x.dtype)
    xf = x.to(acc)
    dtf = discretize_dt(dt, dt_bias, acc)                        # [B, T, H]
    a = dtf * A.to(acc)                                          # log-decay per token, <= 0
    Bf, Cf = B.to(acc), C.to(acc)
    nc = max(1, -(-T // Q))
    pad = nc * Q - T
    if pad:  # dt = a = 0 on padded tokens: decay 1, no input
        xp, dtp, ap = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
                       for t in (xf, dtf, a))
        Bp, Cp = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (Bf, Cf))
    else:
        xp, dtp, ap, Bp, Cp = xf, dtf, a, Bf, Cf
    # chunks, heads as (group, head in group): x [b, c, Q, G, R, P], dt/a [b, c, Q, G, R]
    xc = xp.reshape(batch, nc, Q, G, R, P)
    dtc = dtp.reshape(batch, nc, Q, G, R)
    ac = ap.reshape(batch, nc, Q, G, R)
    Bc = Bp.reshape(batch, nc, Q, G, N)
    Cc = Cp.reshape(batch, nc, Q, G, N)
    acum = ac.cumsum(dim=2)                                      # [b, c, Q, G, R]
    xdt = xc * dtc[..., None]                                    # dt_j x_j

    # intra-chunk: L[i, j] = exp(acum_i - acum_j) for j <= i, else 0 (masked before exp)
    causal = torch.ones(Q, Q, dtype=torch.bool, device=x.device).tril()
    seg = acum[:, :, :, None] - acum[:, :, None, :]              # [b, c, Qi, Qj, G, R]
    L = torch.exp(seg.masked_fill(~causal[:, :, None, None], float("-inf")))
    CB = torch.einsum("bcign,bcjgn->bcijg", Cc, Bc)              # [b, c, Qi, Qj, G]
    y = torch.einsum("bcijg,bcijgr,bcjgrp->bcigrp", CB, L, xdt)

    # each chunk's own contribution to the state at its end, and its total decay
    to_end = torch.exp(acum[:, :, -1:] - acum)                   # [b, c, Q, G, R]
    S_chunk = torch.einsum("bcjgn,bcjgr,bcjgrp->bcgrpn", Bc, to_end, xdt)
    chunk_decay = torch.exp(acum[:, :, -1])                      # [b, c, G, R]

    # inter-chunk: pass the state along the chunks (sequential over T/Q chunks)
    S = (torch.zeros(batch, G, R, P, N, dtype=acc, device=x.device) if initial_state is None
         else initial_state.to(acc).reshape(batch, G, R, P, N))
    entering = []
    for c in range(nc):
        entering.append(S)
        S = chunk_decay[:, c, :, :, None, None] * S + S_chunk[:, c]
    S_in = torch.stack(entering, dim=1)                          # [b, c, G, R, P, N]
    y = y + torch.einsum("bcign,bcgrpn,bcigr->bcigrp", Cc, S_in, torch.exp(acum))

    y = y.reshape(batch, nc * Q, H, P)[:, :T]
    y = y + skip_term(D, xf)
    return y.to(x.dtype), S.reshape(batch, H, P, N)
