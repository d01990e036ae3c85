"""Rotary position embedding (megatron's non-interleaved "rotate half") in one Triton kernel per
direction: cos/sin computed in registers from megatron's ``freqs``, every head of one token in
one program, the input read through its strides (megatron's query/key are views into the fused
QKV projection's output).

The math is ``reference.rope_reference`` (megatron's ``_apply_rotary_pos_emb_bshd``): with
``r = freqs.shape[-1]`` rotated features, halves ``x1 = x[..., :r/2]``, ``x2 = x[..., r/2:r]``,
and ``c_i = cos(f_i)``, ``s_i = sin(f_i)`` of the two halves of ``freqs`` (equal in megatron's
RoPE: ``cat(f, f)``),

    y1 = x1 c1 - x2 s1,   y2 = x2 c2 + x1 s2,   y[..., r:] = x[..., r:]
    dx1 = dy1 c1 + dy2 s2, dx2 = dy2 c2 - dy1 s1 (the transposed rotation)

computed in fp32 and cast to x's dtype (megatron's unfused path casts cos/sin to x's dtype and
multiplies there; both are equal in fp32). Unfused, each of q and k costs cos, sin, two casts,
the half rotation (a negation and a concatenation), two products, a sum and a concatenation
with the pass-through part, forward and again backward.

Launch configuration: fixed (``RoPELaunchConfig``): one program per (token, batch row), the
heads and feature pairs of that row in one block.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ..common import check_int32_offsets


@dataclasses.dataclass(frozen=True)
class RoPELaunchConfig:
    block_h: int  # heads per program (all of them): next power of two
    block_r: int  # feature pairs: next power of two of r/2
    block_p: int  # pass-through features (d - r), 0 when none
    num_warps: int


def rope_launch_config(heads: int, dim: int, rot_dim: int) -> RoPELaunchConfig:
    block_h = triton.next_power_of_2(heads)
    block_r = triton.next_power_of_2(max(rot_dim // 2, 1))
    block_p = triton.next_power_of_2(dim - rot_dim) if dim > rot_dim else 0
    work = block_h * block_r
    num_warps = 1 if work <= 512 else 4 if work <= 4096 else 8
    return RoPELaunchConfig(block_h=block_h, block_r=block_r, block_p=block_p,
                            num_warps=num_warps)


@triton.jit
def _rope_kernel(X, F, Y, n_heads, half,
                 sx_s, sx_b, sx_h, sf_s, sf_b, sy_s, sy_b, sy_h,
                 BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_P: tl.constexpr, n_pass):
    s = tl.program_id(0)
    b = tl.program_id(1)
    heads = tl.arange(0, BLOCK_H)[:, None]
    pairs = tl.arange(0, BLOCK_R)[None, :]
    mask = (heads < n_heads) & (pairs < half)
    f_row = F + s * sf_s + b * sf_b
    f1 = tl.load(f_row + pairs, mask=pairs < half, other=0.0).to(tl.float32)
    f2 = tl.load(f_row + half + pairs, mask=pairs < half, other=0.0).to(tl.float32)
    c1, s1 = tl.cos(f1), tl.sin(f1)
    c2, s2 = tl.cos(f2), tl.sin(f2)
    x_row = X + s * sx_s + b * sx_b + heads * sx_h
    y_row = Y + s * sy_s + b * sy_b + heads * sy_h
    x1 = tl.load(x_row + pairs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + half + pairs, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(y_row + pairs, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(y_row + half + pairs, y2.to(Y.dtype.element_ty), mask=mask)
    if BLOCK_P > 0:  # features beyond the rotated ones pass through
        cols = tl.arange(0, BLOCK_P)[None, :]
        pmask = (heads < n_heads) & (cols < n_pass)
        xp = tl.load(x_row + 2 * half + cols, mask=pmask, other=0.0)
        tl.store(y_row + 2 * half + cols, xp, mask=pmask)


def _launch(x: torch.Tensor, freqs: torch.Tensor, backward: bool) -> torch.Tensor:
    S, B, H, D = x.shape
    rot = freqs.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    f = freqs.reshape(freqs.shape[0], freqs.shape[1], rot)
    if f.stride(-1) != 1:
        f = f.contiguous()
    y = torch.empty((S, B, H, D), dtype=x.dtype, device=x.device)
    cfg = rope_launch_config(H, D, rot)
    if y.numel():
        _rope_kernel[(S, B)](
            X=x, F=f, Y=y, n_heads=H, half=rot // 2,
            sx_s=x.stride(0), sx_b=x.stride(1), sx_h=x.stride(2),
            sf_s=f.stride(0), sf_b=f.stride(1) if f.shape[1] > 1 else 0,
            sy_s=y.stride(0), sy_b=y.stride(1), sy_h=y.stride(2),
            BACKWARD=backward, BLOCK_H=cfg.block_h, BLOCK_R=cfg.block_r, BLOCK_P=cfg.block_p,
            n_pass=D - rot, num_warps=cfg.num_warps)
    return y


class RoPEFunction(torch.autograd.Function):
    """``y = rope(x, freqs)``: x ``[s, b, h, d]`` (any strides but the last), freqs
    ``[s, 1 or b, 1, r]`` (fp32, no gradient), ``r <= d`` even."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, freqs: torch.Tensor):
        ctx.save_for_backward(freqs)
        return _launch(x, freqs, backward=False)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (freqs,) = ctx.saved_tensors
        return _launch(dy, freqs, backward=True), None


def rope_kernel(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """The fused RoPE (``RoPEFunction``); checks the shapes once."""
    if x.dim() != 4 or freqs.dim() != 4:
        raise ValueError(f"x of shape {tuple(x.shape)} and freqs of shape {tuple(freqs.shape)} "
                         "are invalid: allowed x [s, b, h, d] and freqs [s, 1 or b, 1, r]")
    rot = freqs.shape[-1]
    if (rot % 2 or rot > x.shape[-1] or freqs.shape[0] != x.shape[0]
            or freqs.shape[1] not in (1, x.shape[1]) or freqs.shape[2] != 1):
        raise ValueError(f"freqs of shape {tuple(freqs.shape)} is invalid for x of shape "
                         f"{tuple(x.shape)}: allowed [s, 1 or b, 1, r] with r even and <= d")
    span = 1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride()))  # elements x's view spans
    check_int32_offsets("rope", x=span, y=x.numel())
    return RoPEFunction.apply(x, freqs)
