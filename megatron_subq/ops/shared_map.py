"""Causal softmax attention with one attention map shared by the whole batch.

``rnd_emb_qk`` and ``fixed_seq_qk`` (deconstructing-attention paper, §3.4) take Q and K from a
fixed input that is the same for every sample, so the map ``A = softmax(q kᵀ/√d)`` is computed
once and applied to every sample's values: ``o_b = A v_b``. q and k have batch 1, v has batch B.

The map is materialised once per head (``[H, T, T]``, the paper's Table 7 term ``2L²h``) instead
of B times; the B products ``A v_b`` are one batched matmul per key/value head, with the batch
folded into the value features (GQA: the query heads of a group share that group's values).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .dispatch import IMPLS, check_qkv
from .standard import standard_attention_reference

_OP = "shared_map_attention"


class _SoftmaxTo(torch.autograd.Function):
    """softmax over the last dim in fp32, returned (and saved for backward) in ``dtype``.

    Autograd's own softmax would keep its fp32 output *and* the half-precision copy the next GEMM
    saves (6 bytes per map entry); this keeps only the copy (2 bytes, the paper's ``2L²h``) and
    runs the backward in fp32 from it, as megatron's fused softmax does.
    """

    @staticmethod
    def forward(ctx, scores: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        probs = scores.float().softmax(dim=-1).to(dtype)
        ctx.save_for_backward(probs)
        ctx.scores_dtype = scores.dtype
        return probs

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (probs,) = ctx.saved_tensors
        p, g = probs.float(), grad.float()
        return (p * (g - (g * p).sum(dim=-1, keepdim=True))).to(ctx.scores_dtype), None


def shared_map_scores(q: torch.Tensor, k: torch.Tensor, causal: bool = True,
                      scale: Optional[float] = None, dtype: Optional[torch.dtype] = None
                      ) -> torch.Tensor:
    """The shared map: q ``[1, T, H, D]``, k ``[1, T, H_kv, D]`` -> ``[H, T, T]`` in ``dtype``
    (default q's), scores and softmax computed in fp32."""
    H, H_kv, D = q.shape[2], k.shape[2], q.shape[3]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    group = H // H_kv
    qf = q[0].float().transpose(0, 1)                                  # [H, T, D]
    kf = k[0].float().transpose(0, 1).repeat_interleave(group, dim=0)  # [H, T, D]
    scores = torch.bmm(qf, kf.transpose(1, 2)) * scale                  # [H, T, T]
    if causal:
        T = q.shape[1]
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return _SoftmaxTo.apply(scores, q.dtype if dtype is None else dtype)


def shared_map_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                         scale: Optional[float] = None, impl: Optional[str] = None) -> torch.Tensor:
    """``o_b = softmax(q kᵀ · scale) v_b`` for every sample b, with one map for all of them.

    q: ``[1, T, H, D]``; k: ``[1, T, H_kv, D]``; v: ``[B, T, H_kv, D]`` (H % H_kv == 0)
    -> ``[B, T, H, D]`` in v's dtype. Scale 1/√D unless given. ``impl="reference"`` is the
    definition (standard attention with q, k repeated over the batch, B maps);
    ``"kernel"``/None the shared form (one map, one batched GEMM) — plain cuBLAS work, so there
    is no Triton kernel of its own.
    """
    if not isinstance(v, torch.Tensor) or v.dim() != 4:
        raise ValueError(f"{_OP}: v must have shape [B, T, H_kv, D], got "
                         f"{tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}")
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[0] != 1:
            raise ValueError(f"{_OP}: {name} must have shape [1, T, H, D] (one map for the whole "
                             f"batch), got {tuple(t.shape) if isinstance(t, torch.Tensor) else t}")
    if impl not in (None,) + IMPLS:
        raise ValueError(f"{_OP}: impl={impl!r} is not one of {(None,) + IMPLS}")
    # the shared layout check, on v's first sample so that q, k and v agree on [B, T]
    B = v.shape[0]
    _, T, H, H_kv, D = check_qkv(_OP, q, k, v[:1])
    if impl == "reference":
        expand = (B, -1, -1, -1)
        return standard_attention_reference(q.expand(expand), k.expand(expand), v,
                                            causal=causal, scale=scale)
    group = H // H_kv
    attn = shared_map_scores(q, k, causal=causal, scale=scale, dtype=v.dtype)  # [H, T, T]
    # [H, T, T] -> [H_kv, G*T, T]; v -> [H_kv, T, B*D]: one bmm covers every sample of a group
    attn = attn.reshape(H_kv, group * T, T)
    vf = v.permute(2, 1, 0, 3).reshape(H_kv, T, B * D)
    out = torch.bmm(attn, vf)                                     # [H_kv, G*T, B*D]
    out = out.view(H_kv, group, T, B, D).permute(3, 2, 0, 1, 4)  # [B, T, H_kv, G, D]
    return out.reshape(B, T, H, D)
