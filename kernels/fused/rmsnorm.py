"""RMSNorm in two Triton kernels: forward (one row per program) and backward (a block of rows per
program, the weight gradient summed in registers and written as one partial row per program).

The math is ``reference.rms_norm_reference``: with ``r = 1 / sqrt(mean(x^2) + eps)`` (fp32),
``x_hat = x r`` and ``w = weight`` (``weight + 1`` with zero-centred gamma), all in fp32,

    y  = x_hat w                                   (cast to x's dtype)
    dx = r (dy w - x_hat mean(dy w x_hat))         (cast to x's dtype)
    dw = sum over rows of dy x_hat                 (fp32 partials, summed, cast to weight's dtype)

The forward saves ``x`` and ``r`` (one fp32 per row), not ``y``. Unfused, the local path runs
about eight elementwise/reduction kernels forward (casts, square, mean, rsqrt, two products,
cast back) and more backward, each a full pass over the ``[tokens, hidden]`` activations; here
each direction reads x (and dy) once and writes y (dx) once.

Launch configuration: fixed, no autotuning (the interpreter cannot run it), in
``RMSNormLaunchConfig``: the whole row in one block (``BLOCK_N`` = next power of two of the
hidden size), warps by row width, and for the backward a fixed number of row programs per
device (``BWD_PROGRAMS_PER_SM`` x SMs), each looping over its rows.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from ..common import check_int32_offsets

MAX_HIDDEN = 65536  # one row in one block: beyond this the row no longer fits the registers
BWD_PROGRAMS_PER_SM = 2  # backward row programs per SM (each keeps one fp32 dw partial row)


@dataclasses.dataclass(frozen=True)
class RMSNormLaunchConfig:
    block_n: int  # the row's block: next power of two of the hidden size
    num_warps: int
    bwd_programs: int  # backward programs (each sums the weight gradient of its rows)


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def rmsnorm_launch_config(n_rows: int, n_cols: int, device: torch.device) -> RMSNormLaunchConfig:
    block_n = triton.next_power_of_2(n_cols)
    num_warps = 4 if block_n <= 2048 else 8 if block_n <= 8192 else 16
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        programs = BWD_PROGRAMS_PER_SM * _multiprocessors(index)
    else:  # the interpreter: a few programs still exercise the partial-sum path
        programs = 4
    return RMSNormLaunchConfig(block_n=block_n, num_warps=num_warps,
                               bwd_programs=max(1, min(programs, n_rows)))


@triton.jit
def _rmsnorm_fwd_kernel(X, W, Y, RSTD, n_cols, eps,
                        ZERO_CENTERED: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(X + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(RSTD + row, rstd)
    y = x * rstd * w
    tl.store(Y + row * n_cols + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rmsnorm_bwd_kernel(DY, X, W, RSTD, DX, DW_PARTIAL, n_rows, n_cols, rows_per_program,
                        ZERO_CENTERED: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for row in range(row_start, row_end):
        x = tl.load(X + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        x_hat = x * rstd
        dyw = dy * w
        c = tl.sum(dyw * x_hat, axis=0) / n_cols
        dx = (dyw - x_hat * c) * rstd
        tl.store(DX + row * n_cols + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * x_hat
    tl.store(DW_PARTIAL + pid * n_cols + cols, dw, mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


class RMSNormFunction(torch.autograd.Function):
    """``y = rms_norm(x, weight, eps)`` over the last dimension, as ``rms_norm_reference``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float,
                zero_centered_gamma: bool = False,
                launch: Optional[RMSNormLaunchConfig] = None):
        n_cols = x.shape[-1]
        x2 = _rows(x)
        n_rows = x2.shape[0]
        cfg = launch or rmsnorm_launch_config(n_rows, n_cols, x.device)
        y = torch.empty_like(x2)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        if n_rows:
            _rmsnorm_fwd_kernel[(n_rows,)](
                X=x2, W=weight, Y=y, RSTD=rstd, n_cols=n_cols, eps=eps,
                ZERO_CENTERED=bool(zero_centered_gamma), BLOCK_N=cfg.block_n,
                num_warps=cfg.num_warps)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.zero_centered_gamma = bool(zero_centered_gamma)
        ctx.cfg = cfg
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        cfg = ctx.cfg
        n_rows, n_cols = x2.shape
        dy2 = _rows(dy)
        dx = torch.empty_like(x2)
        programs = cfg.bwd_programs
        partial = torch.empty(programs, n_cols, dtype=torch.float32, device=x2.device)
        if n_rows:
            _rmsnorm_bwd_kernel[(programs,)](
                DY=dy2, X=x2, W=weight, RSTD=rstd, DX=dx, DW_PARTIAL=partial,
                n_rows=n_rows, n_cols=n_cols, rows_per_program=triton.cdiv(n_rows, programs),
                ZERO_CENTERED=ctx.zero_centered_gamma, BLOCK_N=cfg.block_n,
                num_warps=cfg.num_warps)
            dw = partial.sum(0)
        else:
            dw = torch.zeros(n_cols, dtype=torch.float32, device=x2.device)
        return dx.view(ctx.shape), dw.to(weight.dtype), None, None, None


def rms_norm_kernel(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    zero_centered_gamma: bool = False) -> torch.Tensor:
    """The fused RMSNorm (``RMSNormFunction``); checks the shapes once."""
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight of shape {tuple(weight.shape)} is invalid for an input of "
                         f"hidden size {x.shape[-1]}: allowed ({x.shape[-1]},)")
    if x.shape[-1] > MAX_HIDDEN:
        raise ValueError(f"hidden size {x.shape[-1]} is invalid for the fused RMSNorm: allowed "
                         f"<= {MAX_HIDDEN} (one row per block)")
    check_int32_offsets("rms_norm", x=x.numel())
    return RMSNormFunction.apply(x, weight.contiguous(), float(eps), bool(zero_centered_gamma))
