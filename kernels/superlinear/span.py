"""Superlinear's span and window attention: per (query, kept anchor) pair, softmax attention over
the pair's span keys outside the window merged with the window by log-sum-exp, forward
(``span_attention_forward``) and backward (``span_window_backward``).

Pairs are bucketed by key footprint: per head, a stable sort of the span start (ties keep query
order), so a tile of BLOCK_M consecutive pairs reads one contiguous run of key blocks; the
key-centric dK/dV kernel visits, per key block, the tiles ``span_tile_ranges`` gives it.
"""

from __future__ import annotations

import torch
import triton

from .kernels import (sort_pairs_kernel, span_bwd_dkdv_kernel, span_bwd_kernel, span_fwd_kernel,
                      window_bwd_dkdv_kernel, window_bwd_kernel, window_fwd_kernel)
from .launch import LaunchConfig, attention_args


def span_bounds(sel_t: torch.Tensor, back: torch.Tensor, fwd: torch.Tensor, window: int,
                start: int = 0):
    """[lo, hi] of every pair's span keys outside the window ([B, H, T, k] int32; a slot without
    anchor gets lo = T, hi = -1: empty). Queries sit at positions [start, start + T); back and
    fwd are indexed by query row."""
    T = sel_t.shape[2]
    pos = torch.arange(start, start + T, device=sel_t.device)[:, None]
    t = sel_t.long()
    win_lo = (pos - window + 1).clamp(min=0) if window > 0 else pos + 1
    lo = (t - back[:, None]).clamp(min=0)
    hi = torch.minimum(torch.minimum(t + fwd[:, None], pos), win_lo - 1)
    valid = t >= 0
    lo = torch.where(valid, lo, start + T)
    hi = torch.where(valid, hi, -1)
    return lo.to(torch.int32), hi.to(torch.int32)


def span_attention_forward(q, k, v, lo, hi, window: int, cfg: LaunchConfig, start: int = 0,
                           fused_merge: bool = False, a_dtype: torch.dtype = torch.float32):
    """Per (query, slot) pair: softmax attention over the pair's span keys (outside the window)
    merged with the window by log-sum-exp. q: [B, T, H, D] at positions [start, start + T); k, v:
    [B, TK, H_kv, D], exactly the keys [0, start + T) (loads past TK are masked); lo, hi:
    [B, H, T, k]. Returns (A [B*H, T, k, D] float32, the pair order, lo/hi flat, lse [B*H, T, k],
    lse_w [B*H, T], o_w [B*H, T, D]). ``fused_merge`` (the launch option): the merge runs in the
    span kernel's epilogue, else in torch passes over the [B*H, T, k, D] fp32 tensors.
    ``a_dtype``: A's dtype with ``fused_merge`` (float32 for training: the gate's gradient
    reads A; the forward-only prefill stores it in the inputs' dtype, half the bytes)."""
    B, T, H, D = q.shape
    TK, H_kv = k.shape[1], k.shape[2]
    topk = lo.shape[-1]
    P = T * topk
    scale, block_d, prec, strides = attention_args(q, k)
    dev = q.device

    if window == 0:  # no window: its output and lse stay 0 and -inf
        o_w = torch.zeros(B * H, T, D, dtype=torch.float32, device=dev)
        lse_w = torch.full((B * H, T), float("-inf"), dtype=torch.float32, device=dev)
    else:  # the window kernel writes every row
        o_w = torch.empty(B * H, T, D, dtype=torch.float32, device=dev)
        lse_w = torch.empty(B * H, T, dtype=torch.float32, device=dev)
        window_fwd_kernel[(triton.cdiv(T, cfg.block_m), B * H)](
            Q=q, K=k, V=v, O=o_w, LSE=lse_w, T=T, Q0=start, TK=TK, H=H, GROUP=H // H_kv, D=D,
            W=window, scale=scale, **strides, BLOCK_M=cfg.block_m, BLOCK_N=cfg.fwd_n,
            BLOCK_D=block_d, PRECISION=prec, num_warps=cfg.num_warps)

    lo_f, hi_f = lo.reshape(B * H, P).contiguous(), hi.reshape(B * H, P).contiguous()
    order = torch.sort(lo_f, dim=1, stable=True).indices.to(torch.int32).contiguous()
    o_s = torch.empty(B * H, P, D, dtype=a_dtype if fused_merge else torch.float32, device=dev)
    lse_s = torch.empty(B * H, P, dtype=torch.float32, device=dev)
    # the span kernel's key bound is TK (its pairs index query rows, lo/hi are key positions)
    span_fwd_kernel[(triton.cdiv(P, cfg.block_m), B * H)](
        Q=q, K=k, V=v, ORDER=order, LO=lo_f, HI=hi_f, O=o_s, LSE=lse_s, O_W=o_w, LSE_W=lse_w, T=TK,
        P=P, H=H, GROUP=H // H_kv, D=D, scale=scale, **strides, TOPK=topk, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.fwd_n, BLOCK_D=block_d, PRECISION=prec, MERGE=fused_merge,
        num_warps=cfg.num_warps)
    if fused_merge:  # o_s, lse_s already hold the merged output and lse
        return (o_s.view(B * H, T, topk, D), order, lo_f, hi_f, lse_s.view(B * H, T, topk),
                lse_w, o_w)

    # merge span and window by log-sum-exp (a pair with neither gets A = 0)
    o_s = o_s.view(B * H, T, topk, D)
    lse_s = lse_s.view(B * H, T, topk)
    lse = torch.logaddexp(lse_s, lse_w[..., None])
    finite = torch.isfinite(lse)
    lse_safe = torch.where(finite, lse, 0.0)
    w_s = torch.where(finite, torch.exp(lse_s - lse_safe), 0.0)
    w_w = torch.where(finite, torch.exp(lse_w[..., None] - lse_safe), 0.0)
    a = w_s[..., None] * o_s + w_w[..., None] * o_w[:, :, None, :]  # [B*H, T, k, D]
    return a, order, lo_f, hi_f, lse, lse_w, o_w


def span_tile_ranges(order, lo, hi, T: int, block_m: int, block_n: int,
                     presorted: bool = False):
    """For ``span_bwd_dkdv_kernel``: per (b*h, key block of ``block_n``), the range [first, end)
    of pair tiles (``block_m`` consecutive pairs of the sorted ``order``) that may reach it.
    lo, hi [B*H, P]: the pairs' span bounds in their natural order (gathered through ``order``
    here) or, with ``presorted``, already in the sorted order (``_sorted_pairs``' copies, so
    the launch option sorted_pairs gathers them once).

    The pairs are sorted by span start, so the tiles' first starts grow: the tiles starting after
    the block end form a suffix (``end``). Their span ends do not grow, but their running
    maximum does: the tiles before the first whose running maximum reaches the block start
    cannot reach it (``first``). Tiles in between that miss it are masked out by the kernel.
    Device ops only (no host sync). Returns two int32 tensors [B*H, cdiv(T, block_n)]."""
    BH, P = order.shape
    n_tiles = triton.cdiv(P, block_m)
    if not presorted:
        idx = order.long()
        lo, hi = lo.gather(1, idx), hi.gather(1, idx)
    hi_sorted = torch.nn.functional.pad(hi, (0, n_tiles * block_m - P), value=-1)
    tile_lo = lo[:, ::block_m].contiguous()  # [BH, n_tiles], non-decreasing
    tile_hi = torch.cummax(hi_sorted.view(BH, n_tiles, block_m).amax(-1), dim=1).values
    starts = torch.arange(0, T, block_n, device=order.device, dtype=torch.int32)
    starts = starts.expand(BH, -1).contiguous()
    first = torch.searchsorted(tile_hi.contiguous(), starts)  # first tile with max end >= n0
    end = torch.searchsorted(tile_lo, starts + (block_n - 1), right=True)  # start <= block end
    return first.to(torch.int32).contiguous(), end.to(torch.int32).contiguous()


def span_window_backward(saved, up, up_strides, coef, delta, win_up, win_strides, win_coef,
                         delta_w, window: int, cfg: LaunchConfig, options: dict):
    """dq [B, T, H, D] (q's dtype), dk, dv (float32) of the span and window attention, given
    each pair's upstream gradient dA (rows of ``up`` at ``up_strides`` = (b, t, h, slot), times
    ``coef`` per pair if not None) and the window's effective dO (``win_up`` likewise, times
    ``win_coef`` per query); ``delta`` [B*H, T, k] and ``delta_w`` [B*H, T] are their D terms."""
    q, k, v, order, lo_f, hi_f, lse, lse_w = saved
    B, T, H, D = q.shape
    H_kv = k.shape[2]
    topk = lse.shape[-1]
    P = T * topk
    scale, block_d, prec, strides = attention_args(q, k)
    dev = q.device
    dk = torch.zeros(B, T, H_kv, D, dtype=torch.float32, device=dev)
    dv = torch.zeros_like(dk)
    no_coef = lse  # any float32 tensor: not read without HAS_COEF
    coef_arg = no_coef if coef is None else coef
    win_coef_arg = no_coef if win_coef is None else win_coef
    # the key-centric kernels' fp32 tiles (a test dtype) overflow a GPU's shared memory at
    # Triton's default 3 stages (the window's with its coefficient, the span's sorted form)
    dkdv_stages = 2 if q.dtype == torch.float32 else 3

    dq_pairs = torch.empty(B * H, P, D, dtype=torch.float32, device=dev)
    span_bwd_kernel[(triton.cdiv(P, cfg.block_m), B * H)](
        Q=q, K=k, V=v, ORDER=order, LO=lo_f, HI=hi_f, DA=up, COEF=coef_arg, LSE=lse, DELTA=delta,
        DQ=dq_pairs, DK=dk, DV=dv, T=T, P=P, H=H, GROUP=H // H_kv, D=D, scale=scale, **strides,
        s_ob=up_strides[0], s_ot=up_strides[1], s_oh=up_strides[2], s_os=up_strides[3], TOPK=topk,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, PRECISION=prec,
        ATOMIC_KV=not options["span_dkdv"], HAS_COEF=coef is not None, num_warps=cfg.num_warps)
    if options["span_dkdv"]:
        pairs = (q, order, lo_f, hi_f, up, coef_arg, lse, delta)
        if options["sorted_pairs"]:  # the pairs' rows in the sorted order (see the kernel)
            pairs = _sorted_pairs(q, order, lo_f, hi_f, up, up_strides, coef, lse, delta, cfg)
        # the kernel's LO, HI: with sorted_pairs the sorted copies, which the tile ranges reuse
        pair_lo, pair_hi = pairs[2], pairs[3]
        first, end = span_tile_ranges(order, pair_lo, pair_hi, T, cfg.kv_m, cfg.span_kv_n,
                                      presorted=options["sorted_pairs"])
        n_kb = first.shape[1]
        span_bwd_dkdv_kernel[(n_kb, B * H_kv)](
            Q=pairs[0], K=k, V=v, ORDER=pairs[1], LO=pairs[2], HI=pairs[3], DA=pairs[4],
            COEF=pairs[5], LSE=pairs[6], DELTA=pairs[7], TILE_FIRST=first, TILE_END=end, DK=dk,
            DV=dv, T=T, P=P, H=H, GROUP=H // H_kv, D=D, NKB=n_kb, scale=scale, **strides,
            s_ob=up_strides[0], s_ot=up_strides[1], s_oh=up_strides[2], s_os=up_strides[3],
            TOPK=topk, BLOCK_M=cfg.kv_m, BLOCK_N=cfg.span_kv_n, BLOCK_D=block_d, PRECISION=prec,
            HAS_COEF=coef is not None, SORTED=options["sorted_pairs"], num_warps=cfg.num_warps,
            num_stages=dkdv_stages)
    dq = dq_pairs.view(B * H, T, topk, D).sum(2)

    if window > 0:
        dq_w = torch.empty(B * H, T, D, dtype=torch.float32, device=dev)
        key_centric = options["window_dkdv"]
        window_bwd_kernel[(triton.cdiv(T, cfg.block_m), B * H)](
            Q=q, K=k, V=v, DO=win_up, COEF=win_coef_arg, LSE=lse_w, DELTA=delta_w, DQ=dq_w, DK=dk,
            DV=dv, T=T, H=H, GROUP=H // H_kv, D=D, W=window, scale=scale, **strides,
            s_ob=win_strides[0], s_ot=win_strides[1], s_oh=win_strides[2], BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n, BLOCK_D=block_d, PRECISION=prec, ATOMIC_KV=not key_centric,
            HAS_COEF=win_coef is not None, num_warps=cfg.num_warps)
        if key_centric:  # after the span kernel: dk, dv hold its sums, this adds the window's
            window_bwd_dkdv_kernel[(triton.cdiv(T, cfg.window_kv_n), B * H_kv)](
                Q=q, K=k, V=v, DO=win_up, COEF=win_coef_arg, LSE=lse_w, DELTA=delta_w, DK=dk, DV=dv,
                T=T, H=H, GROUP=H // H_kv, D=D, W=window, scale=scale, **strides,
                s_ob=win_strides[0], s_ot=win_strides[1], s_oh=win_strides[2], BLOCK_M=cfg.kv_m,
                BLOCK_N=cfg.window_kv_n, BLOCK_D=block_d, PRECISION=prec,
                HAS_COEF=win_coef is not None, num_warps=cfg.num_warps, num_stages=dkdv_stages)
        dq = dq + dq_w
    return dq.view(B, H, T, D).transpose(1, 2).to(q.dtype), dk, dv


def _sorted_pairs(q, order, lo_f, hi_f, up, up_strides, coef, lse, delta, cfg: LaunchConfig):
    """The arguments (Q, ORDER, LO, HI, DA, COEF, LSE, DELTA) of ``span_bwd_dkdv_kernel`` with
    SORTED: q's and dA's rows of every pair and the pairs' lo, hi, lse, D, in the sorted order
    (lo, hi also serve ``span_tile_ranges``, gathered once)."""
    B, T, H, D = q.shape
    BH, P = order.shape
    idx = order.long()
    grid = (triton.cdiv(P, cfg.rows), BH)
    block_d = max(16, triton.next_power_of_2(D))
    q_s = torch.empty(BH, P, D, dtype=q.dtype, device=q.device)
    sort_pairs_kernel[grid](
        SRC=q, COEF=lse, ORDER=order, DST=q_s, P=P, H=H, D=D, s_b=q.stride(0), s_t=q.stride(1),
        s_h=q.stride(2), s_s=0, TOPK=P // T, BLOCK_M=cfg.rows, BLOCK_D=block_d, HAS_COEF=False,
        num_warps=4)
    # dA in q's dtype: the kernel rounds it to that for its matrix products anyway
    da_s = torch.empty(BH, P, D, dtype=q.dtype, device=q.device)
    sort_pairs_kernel[grid](
        SRC=up, COEF=lse if coef is None else coef, ORDER=order, DST=da_s, P=P, H=H, D=D,
        s_b=up_strides[0], s_t=up_strides[1], s_h=up_strides[2], s_s=up_strides[3], TOPK=P // T,
        BLOCK_M=cfg.rows, BLOCK_D=block_d, HAS_COEF=coef is not None, num_warps=4)
    lse, delta = lse.reshape(BH, P), delta.reshape(BH, P)
    unused_coef = lse  # dA already holds the coefficient
    return (q_s, order, lo_f.gather(1, idx), hi_f.gather(1, idx), da_s, unused_coef,
            lse.gather(1, idx), delta.gather(1, idx))
