"""``NonapproxChunkFunction``: the Triton kernels of ``chunk.py`` as one autograd Function.

Layout ``[B, T, H, D]`` (k, v: ``[B, T, H_kv, D]``, GQA); the math and conventions are those of
``megatron_subq.ops.nonapprox`` (SiLU applied to q here; tests compare against it). Gradients
flow to q, k and v, and through the states: the initial state (max, den, num; fp32) gets its
exact gradient and the final state's gradient flows back into q, k, v and the initial state
(context parallelism's state passing trains through them). Without a state and without a
gradient on the final state the backward does exactly what it did before (no extra work).

The states' gradients (``backward``): with ``Z_i = e^{max0} den0 + Σ_{j≤i} e^{s_j} = e^{lse_i}``,
``o_i = (e^{max0} num0 + Σ_{j≤i} e^{s_j} v_j) / Z_i``, so
``dnum0 = Σ_i e^{max0 − lse_i} dO_i``, ``dden0 = −Σ_i e^{max0 − lse_i} δ_i`` and
``dmax0 = num0·dnum0 + den0·dden0`` — chunk 0's backward summary and the reverse scan's sum
after it, rescaled (every weight ≤ 1/den0). The final state (max_T, den_T, num_T) weighs token j
by e^{s_j − max_T}: its (dnum_T, −dden_T) enter the reverse scan as a term after the last token
(``nonapprox_bwd_scan_kernel``: HAS_FINAL). max_T itself is a maximum: what the loss sees of it
beyond the rescaling of den_T and num_T, ``dmax_T − num_T·dnum_T − den_T·dden_T``, goes to the
score that is the maximum (max0 if it is the larger), as autograd of the reference's running
maximum gives.
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
        """max0, den0 [B, H], num0 [B, H, D]: the initial state (fp32) or Nones; their
        gradients are returned when asked for. The final state's outputs are differentiable."""
        ctx.set_materialize_grads(False)  # unused outputs: None, not zeros (no extra work)
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
        final = (fmax, fden, fnum) if output_final_state else (None, None, None)
        ctx.save_for_backward(q, k, v, o, s, lse, max0, den0, num0, *final)
        ctx.cfg = cfg
        if not output_final_state:
            return o, None, None, None
        return o, fmax, fden, fnum

    @staticmethod
    def backward(ctx, d_o, d_max, d_den, d_num):
        q, k, v, o, s, lse, max0, den0, num0, fmax, fden, fnum = ctx.saved_tensors
        cfg = ctx.cfg
        B, T, H, D = q.shape
        H_kv = k.shape[2]
        G = H // H_kv
        NT = cfg.NT
        has_final = not (d_max is None and d_den is None and d_num is None)
        want_state = max0 is not None and any(ctx.needs_input_grad[3:6])
        d_o = torch.zeros_like(q) if d_o is None else d_o.contiguous()
        f32 = dict(dtype=torch.float32, device=q.device)
        delta = torch.empty(B, H, T, **f32)
        cdo, cdelta = torch.empty(B, H, NT, D, **f32), torch.empty(B, H, NT, **f32)
        nonapprox_bwd_summary_kernel[(NT, B * H)](
            do_ptr=d_o, o_ptr=o, lse_ptr=lse, delta_ptr=delta, cdo_ptr=cdo, cdelta_ptr=cdelta, T=T,
            H=H, D=D, NT=NT, BT=cfg.BT, BD=cfg.BD, num_warps=cfg.warps)
        ado, adelta = torch.empty_like(cdo), torch.empty_like(cdelta)
        g_num = g_den = None
        if has_final:  # None: unused by the loss
            g_num = torch.zeros_like(fnum) if d_num is None else d_num.float().contiguous()
            g_den = torch.zeros_like(fden) if d_den is None else d_den.float()
            neg_den = (-g_den).contiguous()
        nonapprox_bwd_scan_kernel[(triton.cdiv(D, cfg.BV_scan), B * H)](
            lse_ptr=lse, cdo_ptr=cdo, cdelta_ptr=cdelta, ado_ptr=ado, adelta_ptr=adelta,
            fmax_ptr=fmax if has_final else lse, gdo_ptr=g_num if has_final else cdo,
            gdelta_ptr=neg_den if has_final else cdelta, T=T, D=D, NT=NT, BT=cfg.BT, NB=cfg.NB,
            BV=cfg.BV_scan, HAS_FINAL=has_final, num_warps=4)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        nonapprox_bwd_grad_kernel[(NT, B * H_kv)](
            q_ptr=q, k_ptr=k, v_ptr=v, do_ptr=d_o, s_ptr=s, lse_ptr=lse, delta_ptr=delta,
            ado_ptr=ado, adelta_ptr=adelta, dq_ptr=dq, dk_ptr=dk, dv_ptr=dv, T=T, H=H, HKV=H_kv,
            G=G, D=D, NT=NT, scale=1.0 / math.sqrt(D), BT=cfg.BT, BD=cfg.BD, PREC=cfg.PREC,
            DOT_F32=cfg.DOT_F32, num_warps=cfg.warps)
        # the final max's own gradient (beyond rescaling den_T, num_T): to the maximum score
        g_top = None
        if has_final:
            g_top = -((fnum * g_num).sum(-1) + fden * g_den)
            if d_max is not None:
                g_top = g_top + d_max.float()
            top, at = s.max(dim=-1)  # [B, H]
            to_state = (max0 >= top) if max0 is not None else torch.zeros_like(top,
                                                                              dtype=torch.bool)
            _add_score_grad(dq, dk, q, k, at, torch.where(to_state, 0.0, g_top), G)
        dmax0 = dden0 = dnum0 = None
        if want_state:
            w0 = torch.exp(max0 - lse[..., 0])  # [B, H]: chunk 0's summary is relative to lse_0
            w1 = torch.exp(max0 - lse[..., min(cfg.BT, T) - 1])  # the scan's A_0: to R_0
            dnum0 = w0[..., None] * cdo[:, :, 0] + w1[..., None] * ado[:, :, 0]
            dden0 = -(w0 * cdelta[:, :, 0] + w1 * adelta[:, :, 0])
            dmax0 = (num0 * dnum0).sum(-1) + den0 * dden0
            if g_top is not None:
                dmax0 = dmax0 + torch.where(to_state, g_top, 0.0)
        return dq, dk, dv, dmax0, dden0, dnum0, None


def _add_score_grad(dq, dk, q, k, at, g, G: int):
    """Add the gradient ``g`` [B, H] of the score s_j (j = ``at`` [B, H], per query head) to dq
    and dk (dk at the head's key/value head, summed over the GQA group in fp32): s = SiLU(q)·k
    / √D. One row of q and k per head is read, no GQA-repeated copy of k."""
    B, T, H, D = q.shape
    b = torch.arange(B, device=q.device)[:, None].expand(B, H)
    h = torch.arange(H, device=q.device)[None, :].expand(B, H)
    qj, kj = q[b, at, h].float(), k[b, at, h // G].float()  # [B, H, D]
    sig = torch.sigmoid(qj)
    gs = (g / math.sqrt(D))[..., None]
    dq.index_put_((b, at, h), (gs * kj * sig * (1.0 + qj * (1.0 - sig))).to(dq.dtype),
                  accumulate=True)
    # a GQA group's heads may hit the same key row: summed in fp32, then added to dk once
    acc = dk if dk.dtype == torch.float32 else torch.zeros(dk.shape, dtype=torch.float32,
                                                            device=dk.device)
    acc.index_put_((b, at, h // G), gs * qj * sig, accumulate=True)
    if acc is not dk:
        dk += acc.to(dk.dtype)


def nonapprox_attention_kernel(q, k, v, state=None, output_final_state: bool = False):
    """Causal nonapprox attention through the Triton kernels (what ``ops.nonapprox_attention``
    dispatches to). q: [B, T, H, D] raw query projection; k, v: [B, T, H_kv, D].

    ``state``: a ``NonapproxState`` to continue from (not modified; any float dtype, used in
    fp32). Returns o ``[B, T, H, D]`` in q.dtype, or ``(o, NonapproxState)`` after the T tokens
    when ``output_final_state`` — in the given state's dtype, else fp32, as the reference does.
    Autograd runs through the state both ways: ``state``'s tensors get their gradient (through
    the fp32 copy) and the returned state's tensors are differentiable (context parallelism's
    state passing).
    """
    op = "nonapprox_attention_kernel"
    B, T, H, H_kv, D = check_chunk_kernel_inputs(op, q, k, v, SUPPORTED_DTYPES)
    check_int32_offsets(op, q=q.numel(), k=k.numel())
    max0 = den0 = num0 = None
    if state is not None:
        check_state(op, state, B, H, D)
        max0, den0, num0 = (t.to(torch.float32).contiguous()
                            for t in (state.max, state.den, state.num))
    o, fmax, fden, fnum = NonapproxChunkFunction.apply(q, k, v, max0, den0, num0,
                                                       bool(output_final_state))
    if not output_final_state:
        return o
    dtype = state.num.dtype if state is not None else torch.float32
    length = (state.length if state is not None else 0) + T
    return o, NonapproxState(fnum.to(dtype), fden.to(dtype), fmax.to(dtype), length)
