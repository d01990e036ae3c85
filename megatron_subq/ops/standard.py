"""Standard causal softmax attention (the Transformer++ baseline), ``[B, T, H, D]``.

There is no Triton kernel of our own: ``scaled_dot_product_attention`` already dispatches to
cuDNN / FlashAttention on GPUs, which is the baseline every variant is measured against.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from .dispatch import IMPLS, check_prefill, check_qkv, repeat_kv


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


def _cache_backends():
    """standard_prefill's SDPA backends: those enabled now (``--subq-sdpa-backend``, torch's
    ``enable_*_sdp``) but cuDNN, which plans per key length while a cache grows every step; cuDNN
    alone when it is the only one enabled (the user's explicit choice)."""
    cuda = torch.backends.cuda
    enabled = [b for b, on in ((SDPBackend.FLASH_ATTENTION, cuda.flash_sdp_enabled()),
                               (SDPBackend.EFFICIENT_ATTENTION, cuda.mem_efficient_sdp_enabled()),
                               (SDPBackend.MATH, cuda.math_sdp_enabled())) if on]
    return enabled or [SDPBackend.CUDNN_ATTENTION]


def standard_prefill(q, k_cache, v_cache, start: Optional[int] = None,
                     scale: Optional[float] = None, impl: Optional[str] = None):
    """The queries of positions ``[start, start + C)`` over a key/value cache (decoding).

    q: [B, C, H, D]; k_cache, v_cache: [B, L, H_kv, D] holding positions ``[0, start + C)``
    (this chunk's included; entries past ``start + C`` are not read). ``start`` defaults to
    L - C. Returns [B, C, H, D]: rows ``[start, start + C)`` of causal ``standard_attention``
    over the first ``start + C`` tokens (query i sees keys <= i: causal aligned bottom-right).
    """
    start = check_prefill("standard_prefill", q, k_cache, v_cache, start)
    C = q.shape[1]
    if impl not in (None,) + IMPLS:
        raise ValueError(f"standard_prefill: impl={impl!r} is not one of {(None,) + IMPLS}")
    end = start + C
    k, v = k_cache[:, :end], v_cache[:, :end]
    H, D = q.shape[2], q.shape[3]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if impl == "reference":
        acc = torch.promote_types(q.dtype, torch.float32)
        qf, kf, vf = (x.to(acc) for x in (q, repeat_kv(k, H), repeat_kv(v, H)))
        scores = torch.einsum("bihd,bjhd->bhij", qf, kf) * scale
        if C > 1:  # causal, aligned bottom-right (a decode step sees every cached key)
            mask = torch.ones(C, end, dtype=torch.bool, device=q.device).tril(diagonal=start)
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.einsum("bhij,bjhd->bihd", scores.softmax(dim=-1), vf).to(q.dtype)
    # SDPA's own GQA (query head h reads KV head h // (H / H_kv), repeat_kv's order) on the
    # cache's [B, L, H_kv, D] buffers seen as [B, H_kv, L, D]: K and V are neither repeated nor
    # copied. A decode step (C = 1) sees every cached key: no mask, and on CUDA flash decoding
    # (the KV head's query heads packed, the keys split over the SMs). A later chunk is causal
    # aligned bottom-right, as a CausalBias that flash takes without a materialised [C, L] mask.
    # cuDNN's backend is left out: it builds an execution plan per new key length (40-50 ms each
    # on an H200), and a cache's length changes every step; flash decoding needs no plan.
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    mask = causal_lower_right(C, end) if C > 1 and start > 0 else None
    with sdpa_kernel(_cache_backends()):
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask,
                                             is_causal=C > 1 and start == 0, scale=scale,
                                             enable_gqa=H != k.shape[2])
    return out.transpose(1, 2)  # [B, C, H, Dv]: v may be narrower than q, k (sas)


def _sdpa(q, k, v, causal: bool = True, scale: Optional[float] = None):
    H = q.shape[2]
    # SDPA wants [B, H, T, D]; expand k/v heads explicitly (enable_gqa is not taken by every backend).
    qt = q.transpose(1, 2)
    kt = repeat_kv(k, H).transpose(1, 2)
    vt = repeat_kv(v, H).transpose(1, 2)
    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale)
    return out.transpose(1, 2)
