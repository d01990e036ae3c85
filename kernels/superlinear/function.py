"""Superlinear attention on Triton kernels: search + top-k, span attention merged with the window,
the gate; forward and backward for q, q_s, k, v (GQA).

The op splits into four parts:

1. **Search** (``search_topk_kernel`` per head, or ``search_topk_group_kernel`` per GQA group
   of ``GROUP_SEARCH_MIN`` or more heads; no gradient): the kept anchors ``sel_t [B, T, H, k]``
   (-1 where a query has fewer candidates than k) and their scores.
2. **Gate** (O(T*k*D)): the kept scores ``q_s(i) . k(t)`` are the search kernel's
   (``KeptScoresFunction``, backward ``gate_bwd_kernel``; launch option gate_kernel, else
   recomputed in torch from gathered keys), ``gate = softmax`` over the kept slots (a query
   without any anchor gets the one-hot gate of slot 0, whose span is empty: pure window
   attention). This is the only path to q_s, as in the definition.
3. **Span attention**: per (query, slot) pair the attention over span u window,
   ``A [B*H, T, k, D]``. The window part is computed once per query (``window_fwd_kernel``:
   output o_w, lse_w); the span part per pair over the span keys outside the window
   (``span_fwd_kernel``: o_s, lse_s); the union is merged by log-sum-exp:
   ``A = (e^{lse_s} o_s + e^{lse_w} o_w) / (e^{lse_s} + e^{lse_w})``.
4. **Mixture** ``out = sum_slot gate_slot A_slot``. By default parts 3-4 are one autograd
   Function (``SuperlinearMixFunction``): the span kernel's epilogue merges, ``mix_fwd_kernel``
   mixes in one pass. With the launch option fused_mix off, ``SuperlinearSpanFunction`` returns
   A and torch mixes.

Backward of 3-4, with ``lse = logaddexp(lse_s, lse_w)`` per pair and ``Delta = rowsum(dA * A)``:
the mixture gives ``dA_slot = gate_slot dO`` and ``dgate_slot = dO . A_slot`` (``mix_bwd_kernel``,
which also writes every per-row factor below). The span part is an ordinary flash backward per
pair (``span_bwd_kernel`` for dq, ``span_bwd_dkdv_kernel`` key-centric for dk, dv; P = e^{s -
lse}); the window keys are shared by the k pairs of a query, and since P_window,slot = P_w *
c_slot with ``c_slot = e^{lse_w - lse_slot}``, their k backward passes collapse into one window
backward (``window_bwd_kernel``, ``window_bwd_dkdv_kernel``) with ``dO_w = sum_slot c_slot dA_slot
= gamma dO`` (gamma = sum_slot c_slot gate_slot) and ``Delta_w = sum_slot c_slot Delta_slot``. So
the backward kernels read the model's dO [B, T, H, D] times a per-row coefficient, never a
materialised dA. dk, dv are float32 sums, written once per key block (or, with the dkdv options
off, atomic adds from the query-centric kernels).

Pairs are bucketed by key footprint: per head, a stable sort of the span start (ties keep query
order), so a tile of BLOCK_M consecutive pairs reads one contiguous run of key blocks.

Chunked prefill (``superlinear_prefill_kernel``, forward only) runs parts 1-4 on a chunk of
queries at positions [start, start + C) against the keys [0, start + C): the search and window
kernels take the query offset, the span kernel indexes query rows and key positions separately.
The decode step has its own kernels (``decode.py``).
"""


from __future__ import annotations

from typing import Optional

import torch
import triton

from ..checks import triton_interpreting
from ..common import check_int32_offsets
from .kernels import mix_bwd_kernel, mix_fwd_kernel
from .launch import LaunchConfig, launch_options, tiles
from .plan import device_plan, device_plan_range
from .search import search_topk, topk_gate
from .span import span_attention_forward, span_bounds, span_window_backward


class SuperlinearSpanFunction(torch.autograd.Function):
    """(q, k, v, span lo/hi per pair, window) -> A [B, T, H, k, D] (float32): per (query, slot)
    pair, softmax attention over the pair's span keys (outside the window) and the window.
    (Launch option ``fused_mix`` off; on, ``SuperlinearMixFunction`` also takes the gate.)"""

    @staticmethod
    def forward(ctx, q, k, v, lo, hi, window: int, cfg: LaunchConfig, options: dict):
        B, T, H, D = q.shape
        topk = lo.shape[-1]
        a, order, lo_f, hi_f, lse, lse_w, _ = span_attention_forward(
            q, k, v, lo, hi, window, cfg, fused_merge=options["fused_merge"])
        ctx.save_for_backward(q, k, v, order, lo_f, hi_f, a, lse, lse_w)
        ctx.window, ctx.cfg, ctx.options = window, cfg, options
        return a.view(B, H, T, topk, D).permute(0, 2, 1, 3, 4)

    @staticmethod
    def backward(ctx, d_a):
        q, k, v, order, lo_f, hi_f, a, lse, lse_w = ctx.saved_tensors
        B, T, H, D = q.shape
        topk = a.shape[2]
        d_a = d_a.permute(0, 2, 1, 3, 4).reshape(B * H, T, topk, D).float().contiguous()
        delta = (d_a * a).sum(-1)  # [B*H, T, k]
        lse, delta = lse.contiguous(), delta.contiguous()
        do_w = delta_w = None
        if ctx.window > 0:
            finite = torch.isfinite(lse) & torch.isfinite(lse_w)[..., None]
            c = torch.where(finite, torch.exp(lse_w[..., None] - torch.where(finite, lse, 0.0)),
                            0.0)  # [B*H, T, k]
            do_w = (c[..., None] * d_a).sum(2).contiguous()
            delta_w = (c * delta).sum(2).contiguous()
        # d_a [B*H, T, k, D] read as (b, t, h, slot); do_w [B*H, T, D] as (b, t, h)
        dq, dk, dv = span_window_backward(
            (q, k, v, order, lo_f, hi_f, lse, lse_w), d_a,
            (H * T * topk * D, topk * D, T * topk * D, D), None, delta,
            do_w, (H * T * D, D, T * D), None, delta_w, ctx.window, ctx.cfg, ctx.options)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


class SuperlinearMixFunction(torch.autograd.Function):
    """(q, k, v, gate [B, T, H, k], span lo/hi per pair, window) -> the gated mixture
    sum_slot gate_slot A_slot [B, T, H, D] in q's dtype (launch option ``fused_mix``).

    The per-pair gradient is dA_slot = gate_slot dO and the window's effective dO is
    gamma dO (gamma = sum_slot c_slot gate_slot), so the backward kernels read the model's
    dO with a per-row coefficient (``mix_bwd_kernel`` computes them, and the gate's gradient
    dO . A_slot) instead of the [B*H, T, k, D] float32 dA and its broadcast passes."""

    @staticmethod
    def forward(ctx, q, k, v, gate, lo, hi, window: int, cfg: LaunchConfig, options: dict):
        gate = gate.float().contiguous()  # the layout of the mixture kernels (fwd and bwd)
        a, order, lo_f, hi_f, lse, lse_w, out = _attend_and_mix(q, k, v, gate, lo, hi, window,
                                                                cfg, options)
        ctx.save_for_backward(q, k, v, order, lo_f, hi_f, a, lse, lse_w, gate)
        ctx.window, ctx.cfg, ctx.options = window, cfg, options
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, order, lo_f, hi_f, a, lse, lse_w, gate = ctx.saved_tensors
        cfg = ctx.cfg
        B, T, H, D = q.shape
        topk = a.shape[2]
        d_out = d_out.contiguous()
        dev = q.device
        d_gate = torch.empty_like(gate)
        coef = torch.empty(B * H, T, topk, dtype=torch.float32, device=dev)
        delta = torch.empty_like(coef)
        gamma = torch.empty(B * H, T, dtype=torch.float32, device=dev)
        delta_w = torch.empty_like(gamma)
        mix_bwd_kernel[(triton.cdiv(T, cfg.rows), B * H)](
            A=a, GATE=gate, DO=d_out, LSE=lse, LSE_W=lse_w, DGATE=d_gate, COEF=coef, DELTA=delta,
            GAMMA=gamma, DELTA_W=delta_w, T=T, H=H, D=D, s_gb=gate.stride(0), s_gt=gate.stride(1),
            s_gh=gate.stride(2), s_ob=d_out.stride(0), s_ot=d_out.stride(1), s_oh=d_out.stride(2),
            TOPK=topk, BLOCK_M=cfg.rows, BLOCK_D=max(16, triton.next_power_of_2(D)),
            num_warps=cfg.num_warps)
        do_strides = (d_out.stride(0), d_out.stride(1), d_out.stride(2))
        dq, dk, dv = span_window_backward(
            (q, k, v, order, lo_f, hi_f, lse, lse_w), d_out, do_strides + (0,), coef, delta,
            d_out, do_strides, gamma, delta_w, ctx.window, cfg, ctx.options)
        return dq, dk.to(k.dtype), dv.to(v.dtype), d_gate, None, None, None, None, None


def _attend_and_mix(q, k, v, gate, lo, hi, window: int, cfg: LaunchConfig, options: dict,
                    start: int = 0, a_dtype: torch.dtype = torch.float32):
    """Span and window attention (merged where fused_merge says), then the gated mixture in
    ``mix_fwd_kernel`` (launch option fused_mix). Returns the merged (A, order, lo_f, hi_f, lse,
    lse_w) of ``span_attention_forward`` and the output [B, T, H, D] in q's dtype."""
    a, order, lo_f, hi_f, lse, lse_w, _ = span_attention_forward(
        q, k, v, lo, hi, window, cfg, start=start,
        fused_merge=options["fused_merge"], a_dtype=a_dtype)
    gate = gate.float().contiguous()  # no copy when the caller passed it so
    B, T, H, topk = gate.shape
    D = a.shape[-1]
    out = torch.empty(B, T, H, D, dtype=q.dtype, device=a.device)
    mix_fwd_kernel[(triton.cdiv(T, cfg.rows), B * H)](
        A=a, GATE=gate, OUT=out, T=T, H=H, D=D, s_gb=gate.stride(0), s_gt=gate.stride(1),
        s_gh=gate.stride(2), s_ob=out.stride(0), s_ot=out.stride(1), s_oh=out.stride(2), TOPK=topk,
        BLOCK_M=cfg.rows, BLOCK_D=max(16, triton.next_power_of_2(D)), num_warps=cfg.num_warps)
    return a, order, lo_f, hi_f, lse.contiguous(), lse_w, out


def superlinear_attention_kernel(q, q_s, k, v, search_power=0.5, span_power=0.5, topk=2,
                                 backward_factor=2.0, forward_factor=0.0, sw_index=0,
                                 block_m: Optional[int] = None, block_n: Optional[int] = None):
    """``ops.superlinear_attention`` on the kernels (arguments checked by the op). Returns
    [B, T, H, D] in q's dtype."""
    out_dtype = q.dtype
    if out_dtype == torch.bfloat16 and triton_interpreting():
        # Triton's interpreter computes bf16 tl.dot wrongly: there (only) run on fp32 copies;
        # autograd casts the gradients back to bf16. GPUs run the bf16 tensor-core path.
        q, q_s, k, v = (x.float() for x in (q, q_s, k, v))
    q, q_s, k, v = (x.contiguous() for x in (q, q_s, k, v))
    B, T, H, D = q.shape
    check_int32_offsets("superlinear_attention_kernel", q=q.numel(), k=k.numel(),
                        per_anchor_outputs=B * T * H * topk * D)
    options = launch_options()  # read once per call
    cfg = tiles(D, block_m, block_n, q.dtype, options)
    on_device = device_plan(T, search_power, span_power, backward_factor, forward_factor,
                            sw_index, q.device)
    plan, offsets = on_device.plan, on_device.offsets_i32

    with torch.no_grad():
        sel_t, sel_s = search_topk(q_s, k, offsets, topk, cfg,  # [B, H, T, k]
                                   grouped=options["group_search"],
                                   min_group=options["group_search_min"])
    gate = topk_gate(q_s, k, sel_t, options["elementwise_mix"],
                     sel_s if options["gate_kernel"] else None, cfg)
    lo, hi = span_bounds(sel_t, plan.back, plan.fwd, plan.window)
    if options["fused_mix"]:
        out = SuperlinearMixFunction.apply(q, k, v, gate, lo, hi, plan.window, cfg, options)
    else:
        a = SuperlinearSpanFunction.apply(q, k, v, lo, hi, plan.window, cfg,
                                          options)  # [B, T, H, k, D]
        out = _mix(gate, a, options["elementwise_mix"])
    return out.to(out_dtype)


def _mix(gate, a, elementwise: bool):
    """Σ_slot gate · A_slot: gate [B, T, H, k], a [B, T, H, k, D] (any strides) -> [B, T, H, D]
    (``elementwise``: launch option elementwise_mix)."""
    if elementwise:
        return (gate.unsqueeze(-1) * a).sum(-2)
    return torch.einsum("bthk,bthkd->bthd", gate, a)


@torch.no_grad()
def superlinear_prefill_kernel(q, q_s, k_cache, v_cache, start: int, search_power=0.5,
                               span_power=0.5, topk=2, backward_factor=2.0, forward_factor=0.0,
                               sw_index=0, block_m: Optional[int] = None,
                               block_n: Optional[int] = None):
    """``ops.superlinear_prefill`` on the kernels (arguments checked by the op; forward only).

    q, q_s: [B, C, H, D] at positions [start, start + C); k_cache, v_cache: [B, L, H_kv, D] with
    the keys [0, start + C). The training kernels with a query offset: the search reads anchors
    start + row - d, the window and span kernels read keys [0, start + C) only.
    """
    out_dtype = q.dtype
    C = q.shape[1]
    stop = start + C
    k, v = k_cache[:, :stop], v_cache[:, :stop]
    if out_dtype == torch.bfloat16 and triton_interpreting():  # see superlinear_attention_kernel
        q, q_s, k, v = (x.float() for x in (q, q_s, k, v))
    q, q_s = q.contiguous(), q_s.contiguous()
    if k.stride(-1) != 1 or v.stride() != k.stride():  # the kernels share k's strides for v
        k, v = k.contiguous(), v.contiguous()
    options = launch_options()
    cfg = tiles(q.shape[-1], block_m, block_n, q.dtype, options)
    plan = device_plan_range(start, stop, search_power, span_power, backward_factor,
                             forward_factor, sw_index, q.device)
    sel_t, sel_s = search_topk(q_s, k, plan.offsets_i32, topk, cfg, start=start,  # [B, H, C, k]
                               grouped=options["group_search"],
                               min_group=options["group_search_min"])
    elementwise = options["elementwise_mix"]
    gate = topk_gate(q_s, k, sel_t, elementwise, sel_s if options["gate_kernel"] else None, cfg)
    lo, hi = span_bounds(sel_t, plan.plan.back, plan.plan.fwd, plan.plan.window, start=start)
    if options["fused_mix"]:
        out = _attend_and_mix(q, k, v, gate, lo, hi, plan.plan.window, cfg, options, start,
                              a_dtype=q.dtype)[-1]  # forward only: A in the inputs' dtype
        return out.to(out_dtype)
    a = span_attention_forward(q, k, v, lo, hi, plan.plan.window, cfg, start=start,
                               fused_merge=options["fused_merge"])[0]
    B, H, D = q.shape[0], q.shape[2], q.shape[3]
    a = a.view(B, H, C, topk, D)
    return _mix(gate, a.permute(0, 2, 1, 3, 4), elementwise).to(out_dtype)
