"""Standard causal softmax attention (the Transformer++ baseline), ``[B, T, H, D]``.

There is no Triton kernel of our own: ``scaled_dot_product_attention`` already dispatches to
cuDNN / FlashAttention on GPUs, which is the baseline every variant is measured against.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from .dispatch import IMPLS, check_qkv, repeat_kv


def standard_attention_reference(q, k, v, causal: bool = True, scale: Optional[float] = None):
    """The O(T^2) definition, in fp32 (fp64 for fp64 inputs): softmax(q k^T * scale) v, j <= i."""
    B, T, H, H_kv, D = check_qkv("standard_attention", q, k, v)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    acc = torch.promote_types(q.dtype, torch.float32)
    qf, kf, vf = (x.to(acc) for x in (q, repeat_kv(k, H), repeat_kv(v, H)))
    scores = torch.einsum("bihd,bjhd->bhij", qf, kf) * scale
    if causal:
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.einsum("bhij,bjhd->bihd", scores.softmax(dim=-1), vf)
    return out.to(q.dtype)


def standard_attention(q, k, v, causal: bool = True, scale: Optional[float] = None,
                       impl: Optional[str] = None):
    """Causal softmax attention. q: [B, T, H, D]; k, v: [B, T, H_kv, D] with H % H_kv == 0.

    ``impl="kernel"`` or None uses torch's SDPA (cuDNN / flash on GPUs, the math backend on the
    CPU); ``"reference"`` the explicit O(T^2) form.
    """
    B, T, H, H_kv, D = check_qkv("standard_attention", q, k, v)
    if impl not in (None,) + IMPLS:
        raise ValueError(f"standard_attention: impl={impl!r} is not one of {(None,) + IMPLS}")
    if impl == "reference":
        return standard_attention_reference(q, k, v, causal=causal, scale=scale)
    return _sdpa(q, k, v, causal=causal, scale=scale)


def _sdpa(q, k, v, causal: bool = True, scale: Optional[float] = None):
    H = q.shape[2]
    # SDPA wants [B, H, T, D]; expand k/v heads explicitly (enable_gqa is not taken by every backend).
    qt = q.transpose(1, 2)
    kt = repeat_kv(k, H).transpose(1, 2)
    vt = repeat_kv(v, H).transpose(1, 2)
    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale)
    return out.transpose(1, 2)
