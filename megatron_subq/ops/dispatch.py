"""Choosing between a variant's PyTorch reference and its Triton kernel, and argument checks.

Every op in ``megatron_subq.ops`` takes ``impl="reference" | "kernel" | None``. ``None`` means:
the kernel when one is registered and the tensors live on a CUDA device, otherwise the reference.
The Triton interpreter (``TRITON_INTERPRET=1``) runs kernels on CPU tensors, so ``impl="kernel"``
is allowed on the CPU too — that is how CI tests kernels. The input checks every op shares
(``check_qkv``, ``check_cu_seqlens``, ``triton_interpreting``) live one layer down, in
``kernels/checks.py``, where the kernels use them too; they are re-exported here for the ops.
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional, Sequence

import torch

from ..kernels.checks import check_cu_seqlens, check_qkv, triton_interpreting  # noqa: F401

IMPLS = ("reference", "kernel")


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


def repeat_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[B, T, H_kv, D] -> [B, T, n_heads, D] by repeating each key/value head (GQA)."""
    h_kv = x.shape[2]
    if h_kv == n_heads:
        return x
    return x.repeat_interleave(n_heads // h_kv, dim=2)


def check_prefill(op: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  start: Optional[int]) -> int:
    """The checks of a prefill/decode op over a cache: q ``[B, C, H, D]`` the queries of
    positions ``[start, start + C)``, k_cache/v_cache ``[B, L, H_kv, D]`` holding at least the
    first ``start + C`` positions. Returns ``start`` (default ``L - C``); ValueError naming the
    argument otherwise."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{op}: {name} must be a [B, T, H, D] tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t)}")
    C, L = q.shape[1], k_cache.shape[1]
    start = L - C if start is None else start
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= L - C:
        raise ValueError(f"{op}: start={start!r} is invalid: allowed an integer in [0, {L - C}] "
                         f"(the cache holds {L} positions, the chunk {C} queries)")
    check_qkv(op, q, k_cache[:, start:start + C], v_cache[:, start:start + C])
    return start
