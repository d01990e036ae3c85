"""Input checks shared by the ops (``megatron_subq.ops``) and the kernels, and the interpreter
switch: the bottom of the stack, importing neither triton nor anything of ``megatron_subq``.

The ops check their arguments here once per call and hand the kernels what they need; a kernel
called directly (tests, benchmarks) uses the same checks for what its wrapper documents.
"""

from __future__ import annotations

import os

import torch


def triton_interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (Triton's CPU interpreter; read on every call)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_runs_on(t: torch.Tensor) -> bool:
    """Whether a Triton kernel can take ``t``: a CUDA tensor, or any tensor under the
    interpreter (the CPU tests). Callers fall back to PyTorch where it is False."""
    return t.is_cuda or triton_interpreting()


def check_qkv(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              same_qk_dim: bool = True) -> tuple[int, int, int, int, int]:
    """Check the ``[B, T, H, D]`` layout shared by every op, with GQA (k/v may have fewer heads).

    Returns ``(B, T, H, H_kv, D)``.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{op}: {name} must have shape [B, T, H, D], got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{op}: {name} must be a floating-point tensor, got {t.dtype}")
    B, T, H, D = q.shape
    if k.shape[:2] != (B, T) or v.shape[:2] != (B, T):
        raise ValueError(f"{op}: q, k, v must share [B, T]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"{op}: k and v must have the same number of heads, got {k.shape[2]} "
                         f"and {v.shape[2]}")
    H_kv = k.shape[2]
    if H % H_kv != 0:
        raise ValueError(f"{op}: the query head count ({H}) must be a multiple of the key/value "
                         f"head count ({H_kv}) for GQA")
    if same_qk_dim and k.shape[3] != D:
        raise ValueError(f"{op}: q and k must have the same head dim, got {D} and {k.shape[3]}")
    if len({q.device, k.device, v.device}) != 1:
        raise ValueError(f"{op}: q, k, v must be on one device, got {q.device}, {k.device}, "
                         f"{v.device}")
    if len({q.dtype, k.dtype, v.dtype}) != 1:
        raise ValueError(f"{op}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    return B, T, H, H_kv, D


def check_cu_seqlens(op: str, cu_seqlens, q: torch.Tensor) -> list:
    """Packed sequences: ``cu_seqlens`` = [0, end_1, ..., T] (int32/int64, non-decreasing), with
    the sequences packed along T and B = 1. Returns the boundaries as a list (one host sync)."""
    B, T = q.shape[:2]
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 \
            or cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.numel() < 2:
        raise ValueError(f"{op}: cu_seqlens must be a 1-D int32/int64 tensor [0, end_1, ..., T] "
                         "with at least 2 entries")
    if B != 1:
        raise ValueError(f"{op}: cu_seqlens needs the sequences packed along T with B = 1, "
                         f"got B = {B}")
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != T or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"{op}: cu_seqlens must start at 0, end at T={T} and never decrease, "
                         f"got {bounds}")
    return bounds
