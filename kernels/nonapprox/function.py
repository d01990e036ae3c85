"""``NonapproxChunkFunction``: the Triton kernels of ``chunk.py`` as one autograd Function.

Layout ``[B, T, H, D]`` (k, v: ``[B, T, H_kv, D]``, GQA); the math and conventions are those of
``megatron_subq.ops.nonapprox`` (SiLU applied to q here; tests compare against it). Gradients
flow to q, k and v; an initial state is an input without gradient and the final state an output
without gradient (for prefill/decode, not for training through states).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from ..checks import triton_interpreting
from ..common import check_chunk_kernel_inputs, check_int32_offsets
from .chunk import (
    nonapprox_bwd_grad_kernel,
    nonapprox_bwd_scan_kernel,
    nonapprox_bwd_summary_kernel,
    nonapprox_fwd_out_kernel,
    nonapprox_fwd_scan_kernel,
    nonapprox_fwd_summary_kernel,
)
from .state import NonapproxState, check_state

# tokens per chunk: the [BT, BT] weight block times [BT, D] values is one MMA tile. 32 above
# D = 64 keeps the backward's [BT, D] tiles in registers (at 64 ptxas spills ~600 B per thread)
CHUNK_SMALL_D, CHUNK_LARGE_D = 64, 32
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class LaunchConfig:
    """nonapprox's fixed launch configuration (no autotuning: it must also run under
    TRITON_INTERPRET=1): BT tokens per chunk, BD the padded head dim, NT the chunk count,
    BV_sum / BV_out / BV_scan the V block of the summary, output and scan kernels, NB chunks per
    step of the scans, PREC the dots' precision (ignored for 16-bit operands), DOT_F32 the dots
    on fp32 copies (bf16 under the interpreter only), warps per kernel."""
    BT: int
    BD: int
    NT: int
    BV_sum: int
    BV_out: int
    BV_scan: int
    NB: int
    PREC: str
    DOT_F32: bool
    warps: int


def launch_config(D: int, T: int, dtype: torch.dtype) -> LaunchConfig:
    """The launch config for head dim D, T tokens in ``dtype`` (no environment overrides)."""
    BD = max(16, triton.next_power_of_2(D))
    BT = CHUNK_SMALL_D if BD <= 64 else CHUNK_LARGE_D
    NT = triton.cdiv(T, BT)
    return LaunchConfig(
        BT=BT, BD=BD, NT=NT,
        BV_sum=min(64, BD),  # summary: the weighted sum of v, a V-block at a time
        BV_out=min(128, BD),
        BV_scan=min(32, BD),
        NB=min(32, max(16, triton.next_power_of_2(NT))),  # chunks per step of the scans
        PREC="ieee" if dtype == torch.float32 else "tf32",  # ignored for 16-bit operands
        DOT_F32=dtype == torch.bfloat16 and triton_interpreting(),
        warps=4 if BD <= 64 else 8,
    )


class NonapproxChunkFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, max0, den0, num0, output_final_state: bool):
        q, k, v = (x.contiguous() for x in (q, k, v))
        B, T, H, D = q.shape
        H_kv = k.shape[2]
        G = H // H_kv
        cfg = launch_config(D, T, q.dtype)
        NT = cfg.NT
        scale = 1.0 / math.sqrt(D)
        f32 = dict(dtype=torch.float32, device=q.device)
        s = torch.empty(B, H, T, **f32)
        cmax, cden = torch.empty(B, H, NT, **f32), torch.empty(B, H, NT, **f32)
        cnum = torch.empty(B, H, NT, D, **f32)
        nonapprox_fwd_summary_kernel[(NT, B * H)](
            q_ptr=q, k_ptr=k, v_ptr=v, s_ptr=s, cmax_ptr=cmax, cden_ptr=cden, cnum_ptr=cnum, T=T,
            H=H, HKV=H_kv, G=G, D=D, NT=NT, scale=scale, BT=cfg.BT, BD=cfg.BD, BV=cfg.BV_sum,
            num_warps=cfg.warps)

        imax, iden, inum = torch.empty_like(cmax), torch.empty_like(cden), torch.empty_like(cnum)
        has_state = max0 is not None
        if output_final_state:
            fmax, fden = torch.empty(B, H, **f32), torch.empty(B, H, **f32)
            fnum = torch.empty(B, H, D, **f32)
        else:  # unwritten (STORE_FINAL=False): any fp32 pointer will do, no allocation
            fmax, fden, fnum = cmax, cden, cnum
        nonapprox_fwd_scan_kernel[(triton.cdiv(D, cfg.BV_scan), B * H)](
            cmax_ptr=cmax, cden_ptr=cden, cnum_ptr=cnum, max0_ptr=max0 if has_state else fmax,
            den0_ptr=den0 if has_state else fden, num0_ptr=num0 if has_state else fnum,
            imax_ptr=imax, iden_ptr=iden, inum_ptr=inum, fmax_ptr=fmax, fden_ptr=fden,
            fnum_ptr=fnum, D=D, NT=NT, NB=cfg.NB, BV=cfg.BV_scan, HAS_STATE=has_state,
            STORE_FINAL=bool(output_final_state), num_warps=4)

        o = torch.empty_like(q)
        lse = torch.empty(B, H, T, **f32)
        nonapprox_fwd_out_kernel[(triton.cdiv(D, cfg.BV_out), NT, B * H)](
            v_ptr=v, s_ptr=s, imax_ptr=imax, iden_ptr=iden, inum_ptr=inum, o_ptr=o, lse_ptr=lse,
            T=T, H=H, HKV=H_kv, G=G, D=D, NT=NT, BT=cfg.BT, BV=cfg.BV_out, PREC=cfg.PREC,
            DOT_F32=cfg.DOT_F32, num_warps=cfg.warps)
        ctx.save_for_backward(q, k, v, o, s, lse)
        ctx.cfg = cfg
        if not output_final_state:
            return o, None, None, None
        ctx.mark_non_differentiable(fmax, fden, fnum)
        return o, fmax, fden, fnum

    @staticmethod
    def backward(ctx, d_o, _dmax, _dden, _dnum):
        q, k, v, o, s, lse = ctx.saved_tensors
        cfg = ctx.cfg
        B, T, H, D = q.shape
        H_kv = k.shape[2]
        G = H // H_kv
        NT = cfg.NT
        d_o = d_o.contiguous()
        f32 = dict(dtype=torch.float32, device=q.device)
        delta = torch.empty(B, H, T, **f32)
        cdo, cdelta = torch.empty(B, H, NT, D, **f32), torch.empty(B, H, NT, **f32)
        nonapprox_bwd_summary_kernel[(NT, B * H)](
            do_ptr=d_o, o_ptr=o, lse_ptr=lse, delta_ptr=delta, cdo_ptr=cdo, cdelta_ptr=cdelta, T=T,
            H=H, D=D, NT=NT, BT=cfg.BT, BD=cfg.BD, num_warps=cfg.warps)
        ado, adelta = torch.empty_like(cdo), torch.empty_like(cdelta)
        nonapprox_bwd_scan_kernel[(triton.cdiv(D, cfg.BV_scan), B * H)](
            lse_ptr=lse, cdo_ptr=cdo, cdelta_ptr=cdelta, ado_ptr=ado, adelta_ptr=adelta, T=T, D=D,
            NT=NT, BT=cfg.BT, NB=cfg.NB, BV=cfg.BV_scan, num_warps=4)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        nonapprox_bwd_grad_kernel[(NT, B * H_kv)](
            q_ptr=q, k_ptr=k, v_ptr=v, do_ptr=d_o, s_ptr=s, lse_ptr=lse, delta_ptr=delta,
            ado_ptr=ado, adelta_ptr=adelta, dq_ptr=dq, dk_ptr=dk, dv_ptr=dv, T=T, H=H, HKV=H_kv,
            G=G, D=D, NT=NT, scale=1.0 / math.sqrt(D), BT=cfg.BT, BD=cfg.BD, PREC=cfg.PREC,
            DOT_F32=cfg.DOT_F32, num_warps=cfg.warps)
        return dq, dk, dv, None, None, None, None


def nonapprox_attention_kernel(q, k, v, state=None, output_final_state: bool = False):
    """Causal nonapprox attention through the Triton kernels (what ``ops.nonapprox_attention``
    dispatches to). q: [B, T, H, D] raw query projection; k, v: [B, T, H_kv, D].

    ``state``: a ``NonapproxState`` to continue from (not modified; any float dtype, used in
    fp32). Returns o ``[B, T, H, D]`` in q.dtype, or ``(o, NonapproxState)`` after the T tokens
    when ``output_final_state`` — in the given state's dtype, else fp32, as the reference does.
    """
    op = "nonapprox_attention_kernel"
    B, T, H, H_kv, D = check_chunk_kernel_inputs(op, q, k, v, SUPPORTED_DTYPES)
    check_int32_offsets(op, q=q.numel(), k=k.numel())
    max0 = den0 = num0 = None
    if state is not None:
        check_state(op, state, B, H, D)
        max0, den0, num0 = (t.detach().to(torch.float32).contiguous()
                            for t in (state.max, state.den, state.num))
    o, fmax, fden, fnum = NonapproxChunkFunction.apply(q, k, v, max0, den0, num0,
                                                       bool(output_final_state))
    if not output_final_state:
        return o
    dtype = state.num.dtype if state is not None else torch.float32
    length = (state.length if state is not None else 0) + T
    return o, NonapproxState(fnum.to(dtype), fden.to(dtype), fmax.to(dtype), length)
