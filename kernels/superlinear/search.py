"""Superlinear's search and gate: the kept anchors of every query (top-k of the search scores
over its candidate anchors, no gradient) and the gate, a softmax over the kept scores that is the
only path from the loss to q_s.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton

from .kernels import gate_bwd_kernel, search_topk_group_kernel, search_topk_kernel
from .launch import GROUP_SEARCH_MIN, LaunchConfig, precision


def search_topk(q_s: torch.Tensor, k: torch.Tensor, offsets: torch.Tensor, topk: int,
                cfg: LaunchConfig, start: int = 0, grouped: bool = True,
                min_group: int = GROUP_SEARCH_MIN):
    """Kept anchors [B, H, T, topk] (int32, -1 = none) and their scores (float32, -inf) of the
    T queries of q_s at positions [start, start + T) (k holds at least the keys up to there).
    ``grouped`` (launch option ``group_search``): GQA groups of ``min_group`` (launch option
    ``group_search_min``) or more heads run ``search_topk_group_kernel``, else
    ``search_topk_kernel`` runs per head."""
    B, T, H, D = q_s.shape
    H_kv = k.shape[2]
    group = H // H_kv
    sel_t = torch.empty(B, H, T, topk, dtype=torch.int32, device=q_s.device)
    sel_s = torch.empty(B, H, T, topk, dtype=torch.float32, device=q_s.device)
    args = dict(QS=q_s, K=k, OFF=offsets, SEL_T=sel_t, SEL_S=sel_s, T=T, Q0=start,
                A=offsets.numel(), H=H, GROUP=group, D=D, s_qb=q_s.stride(0), s_qt=q_s.stride(1),
                s_qh=q_s.stride(2), s_kb=k.stride(0), s_kt=k.stride(1), s_kh=k.stride(2))
    block_d = max(16, triton.next_power_of_2(D))
    topk_pad = max(2, triton.next_power_of_2(topk))
    if grouped and group >= min_group:
        search_topk_group_kernel[(T, B * H_kv)](
            **args, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_A=cfg.search_anchors,
            BLOCK_D=block_d, TOPK=topk, TOPK_PAD=topk_pad, PRECISION=precision(q_s.dtype),
            num_warps=4)
    else:
        search_topk_kernel[(triton.cdiv(T, cfg.rows), B * H)](
            **args, BLOCK_M=cfg.rows, BLOCK_D=block_d, TOPK=topk, TOPK_PAD=topk_pad,
            num_warps=cfg.num_warps)
    return sel_t, sel_s


class KeptScoresFunction(torch.autograd.Function):
    """(q_s, k, kept anchors sel_t [B, H, T, k], their scores sel_s from the search kernel) ->
    the scores [B, T, H, k] float32, differentiable in q_s and k (launch option gate_kernel):
    the forward reuses the search's scores, the backward is ``gate_bwd_kernel``."""

    @staticmethod
    def forward(ctx, q_s, k, sel_t, sel_s, cfg: LaunchConfig):
        ctx.save_for_backward(q_s, k, sel_t)
        ctx.cfg = cfg
        return sel_s.transpose(1, 2).contiguous()

    @staticmethod
    def backward(ctx, d_scores):
        q_s, k, sel_t = ctx.saved_tensors
        B, T, H, D = q_s.shape
        TK, H_kv = k.shape[1], k.shape[2]
        d_scores = d_scores.float().contiguous()
        dq_s = torch.empty(B, T, H, D, dtype=torch.float32, device=q_s.device)
        dk = torch.zeros(B, TK, H_kv, D, dtype=torch.float32, device=q_s.device)
        gate_bwd_kernel[(triton.cdiv(T, ctx.cfg.rows), B * H)](
            QS=q_s, K=k, SEL_T=sel_t, DS=d_scores, DQS=dq_s, DK=dk, T=T, TK=TK, H=H,
            GROUP=H // H_kv, D=D, s_qb=q_s.stride(0), s_qt=q_s.stride(1), s_qh=q_s.stride(2),
            s_kb=k.stride(0), s_kt=k.stride(1), s_kh=k.stride(2), TOPK=sel_t.shape[-1],
            BLOCK_M=ctx.cfg.rows, BLOCK_D=max(16, triton.next_power_of_2(D)),
            num_warps=ctx.cfg.num_warps)
        return dq_s.to(q_s.dtype), dk.to(k.dtype), None, None, None


def topk_gate(q_s, k, sel_t, elementwise: bool, sel_s=None, cfg: Optional[LaunchConfig] = None):
    """The gate [B, T, H, k] (float32), differentiable in q_s and k: the kept scores (the search
    kernel's ``sel_s`` through ``KeptScoresFunction`` if given, else recomputed from gathered
    keys), softmax over the kept slots; a query without any anchor gets the one-hot gate of slot
    0, whose span is empty (pure window attention)."""
    B, T, H, D = q_s.shape
    topk = sel_t.shape[-1]
    group = H // k.shape[2]
    valid = (sel_t >= 0).transpose(1, 2)  # [B, T, H, k]
    if sel_s is not None:
        return _softmax_gate(KeptScoresFunction.apply(q_s, k, sel_t, sel_s, cfg), valid)
    t_idx = sel_t.transpose(1, 2).clamp(min=0).long()  # [B, T, H, k]
    kv_head = (torch.arange(H, device=q_s.device) // group)[None, None, :, None]
    rows = t_idx * k.shape[2] + kv_head  # rows of k viewed as [B, TK*H_kv, D]
    # gathered from a float32 copy: the gather's backward scatter-adds every query's term into
    # its anchor keys' rows, which in bf16 would round at each add (and in whatever order the
    # atomics land: a CUDA-graph replay would then differ from eager)
    k_sel = k.float().reshape(B, -1, D).gather(1, rows.reshape(B, -1, 1).expand(-1, -1, D))
    k_sel = k_sel.reshape(B, T, H, topk, D)
    if elementwise:
        scores = (q_s.float().unsqueeze(-2) * k_sel).sum(-1)
    else:
        scores = torch.einsum("bthd,bthkd->bthk", q_s.float(), k_sel)
    return _softmax_gate(scores, valid)


def _softmax_gate(scores, valid):
    """softmax of the kept scores [B, T, H, k] over the valid slots; one-hot slot 0 for a query
    without any."""
    gate = torch.softmax(scores.masked_fill(~valid, torch.finfo(torch.float32).min), -1) * valid
    no_anchor = ~valid.any(-1, keepdim=True)
    slot0 = torch.zeros_like(gate)
    slot0[..., 0] = 1.0
    return torch.where(no_anchor, slot0, gate)
