"""Choosing between a variant's PyTorch reference and its Triton kernel, and argument checks.

Every op in ``megatron_subq.ops`` takes ``impl="reference" | "kernel" | None``. ``None`` means:
the kernel when one is registered and the tensors live on a CUDA device, otherwise the reference.
The Triton interpreter (``TRITON_INTERPRET=1``) runs kernels on CPU tensors, so ``impl="kernel"``
is allowed on the CPU too — that is how CI tests kernels.
"""

from __future__ import annotations

import os
import warnings
from typing import Callable, Optional, Sequence

import torch

IMPLS = ("reference", "kernel")


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def choose_impl(op: str, impl: Optional[str], tensors: Sequence[torch.Tensor],
                kernel: Optional[Callable]) -> str:
    """Resolve ``impl`` for ``op``; raise a ValueError that names the argument when it is wrong."""
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"{op}: impl={impl!r} is not one of {IMPLS + (None,)}")
    if impl == "reference":
        return "reference"
    on_cuda = all(t.is_cuda for t in tensors)
    if impl == "kernel":
        if kernel is None:
            raise ValueError(f"{op}: impl='kernel' asked for, but no kernel is available for this op "
                             "(is triton installed?); use impl='reference' or impl=None")
        if not on_cuda and not triton_interpreting():
            raise ValueError(f"{op}: impl='kernel' needs CUDA tensors (or TRITON_INTERPRET=1 for "
                             "the CPU interpreter); got tensors on "
                             f"{sorted({str(t.device) for t in tensors})}")
        return "kernel"
    if on_cuda and kernel is None:
        _warn_reference_on_cuda(op)
    return "kernel" if (kernel is not None and on_cuda) else "reference"


_WARNED_OPS: set = set()


def _warn_reference_on_cuda(op: str) -> None:
    """Say once per op that CUDA inputs run the slow PyTorch reference: a missing kernel package
    or unverified sizes would otherwise only show as a 10x slower training step."""
    if op in _WARNED_OPS:
        return
    _WARNED_OPS.add(op)
    warnings.warn(f"{op}: no Triton kernel for these CUDA inputs (triton or megatron_subq.kernels "
                  "not importable, or sizes outside the kernel's GPU-verified ones); running the "
                  "PyTorch reference", RuntimeWarning, stacklevel=3)


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


def repeat_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[B, T, H_kv, D] -> [B, T, n_heads, D] by repeating each key/value head (GQA)."""
    h_kv = x.shape[2]
    if h_kv == n_heads:
        return x
    return x.repeat_interleave(n_heads // h_kv, dim=2)


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
