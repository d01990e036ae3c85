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

import dataclasses
import functools
import json
import math
import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton

from ..checks import triton_interpreting
from ..common import check_int32_offsets
from .kernels import (gate_bwd_kernel, mix_bwd_kernel, mix_fwd_kernel, search_topk_group_kernel,
                      search_topk_kernel,
                      sort_pairs_kernel, span_bwd_dkdv_kernel,
                      span_bwd_kernel, span_fwd_kernel, window_bwd_dkdv_kernel, window_bwd_kernel,
                      window_fwd_kernel)
from .plan import SuperlinearPlan, superlinear_plan, superlinear_plan_range


@dataclass(frozen=True)
class LaunchConfig:
    """Tiles per kind of kernel (no autotuning: it must also run under TRITON_INTERPRET=1).

    block_m x block_n: the query-centric attention kernels (window and span forward, their dq
    backward), rows (queries or pairs) x keys per step. kv_m x span_kv_n / window_kv_n: the
    key-centric dK/dV kernels, rows per tile x the program's key block. rows: the per-row
    kernels (search + top-k, mixture, gate backward, pair sorting). fwd_n: keys per step of
    the forward kernels (window and span forward; block_m rows). search_anchors: the grouped
    search's candidate anchors per step (``search_topk_group_kernel``)."""
    block_m: int
    block_n: int
    kv_m: int
    span_kv_n: int
    window_kv_n: int
    rows: int
    num_warps: int
    fwd_n: int
    search_anchors: int = 64  # the grouped search's candidate anchors per step


def launch_config(head_dim: int, block_m: Optional[int] = None, block_n: Optional[int] = None,
                  dtype: Optional[torch.dtype] = None) -> LaunchConfig:
    """The fixed launch configuration. A caller's block_m / block_n set every kernel's tiles
    (the tests' ragged-tile cases). Else: 16 in the interpreter (it runs programs in numpy);
    on a GPU, 16-bit inputs take each kernel's best tiles of the fifth session's H100 A/B
    (2026-11-22, B = 1, H = 16, d = 128, T = 32K, per-kernel CUDA time, docs/benchmarks.md):
    the query-centric kernels 128 x 32 (span forward 3.72 → 2.21 ms, span dq 4.01 → 2.34,
    window forward 1.43 → 0.97, window dq 2.57 → 1.42, against 64 x 64), the span dK/dV kernel
    64 pairs x 32 keys (7.36 → 5.94), the window dK/dV kernel 64 and then the per-row kernels
    64 too (the search took 2.67 ms at 64 rows, 4.00 at 128); fp32 (for checking) keeps 64
    everywhere, whose tiles fit shared memory. The forward kernels take 64 keys per step since
    the seventh session's A/B (2026-11-23, H100, chunked prefill at 64K, 32 query / 2 KV heads:
    span forward 11.05 → 9.93 ms, window forward 3.67 → 3.56 ms against 32), and the per-row
    kernels 32 rows (same day, training at 64K, 16 heads: fwd+bwd 57.52 → 54.84 ms, the
    forward 16.16 → 14.91; 16 rows: 55.97, the search slower, the gate's backward faster)."""
    bd = max(16, triton.next_power_of_2(head_dim))
    warps = 4 if bd <= 64 else 8
    if block_m or block_n or triton_interpreting():
        m = block_m or (16 if triton_interpreting() else 64)
        n = block_n or (16 if triton_interpreting() else 64)
        anchors = 16 if triton_interpreting() else 64
        return LaunchConfig(m, n, m, n, n, m, warps, fwd_n=n, search_anchors=anchors)
    if dtype == torch.float32:
        return LaunchConfig(64, 64, 64, 64, 64, 64, warps, fwd_n=64)
    return LaunchConfig(block_m=128, block_n=32, kv_m=64, span_kv_n=32, window_kv_n=64,
                        rows=32, num_warps=warps, fwd_n=64)


LAUNCH_ENV = "MEGATRON_SUBQ_SUPERLINEAR_LAUNCH"  # JSON overrides of the options below


def launch_options() -> dict:
    """Kernel choices beyond the block sizes: each was off until GPU-tested and measured; all
    three are on since the H100 A/B of docs/benchmarks.md (2026-11-22, B = 1, H = 16, d = 128,
    fwd+bwd: 35.5 → 19.7 ms at T = 16K, 235.7 → 149.9 ms at 64K with all three; each alone
    also wins). Off, the kernels take the query-centric backward with atomic dK, dV adds and
    the gate's einsums (kept: the tests compare both paths).

    * window_dkdv: the window's dK, dV from ``window_bwd_dkdv_kernel`` (key-centric, each key
      block's sums in registers, written once) instead of atomic adds from the query-centric
      ``window_bwd_kernel`` (which then computes dq only). The window backward took 37.8 ms
      of the 195 ms fwd+bwd at T = 64K (H100, docs/benchmarks.md), 13× its forward.
    * span_dkdv: the same for the span part (``span_bwd_dkdv_kernel``: per key block, the
      sorted pair tiles that reach it, see ``span_tile_ranges``); ``span_bwd_kernel`` then
      computes dq only. The span backward took 99 ms at T = 64K, 10× its forward.
    * elementwise_mix: the gate's scores (q_s · k of the kept anchors) and the gated mixture
      Σ_slot gate · A_slot as broadcast products and sums (memory-bound passes) instead of
      ``torch.einsum``, which runs them as about 10⁶ tiny fp32 cuBLAS matrix products
      (≈ 13 ms of fp32 GEMM and ≈ 6 ms of GEMV kernels at T = 64K, H100 profile).

    Four more, on since the fifth session's H100 A/B (2026-11-22, same shapes, fwd+bwd at
    16K / 32K / 64K: 17.9 / 41.0 / 98.9 ms with none of them; fused_merge + fused_mix 15.1 /
    35.5 / 87.6; + gate_kernel 13.8 / 33.2 / 83.2; + sorted_pairs 13.3 / 31.5 / 77.9), each
    GPU-tested first; off, each falls back to the torch form (kept: the tests compare both):

    * fused_mix: the gated mixture and its backward in Triton (``SuperlinearMixFunction``:
      ``mix_fwd_kernel``, ``mix_bwd_kernel``); the backward kernels then read dO [B, T, H, D]
      with a per-row coefficient instead of the per-pair dA [B*H, T, k, D] float32 and the
      window's dO_w, which took about eight torch passes over such tensors.
    * fused_merge: the log-sum-exp merge of span and window outputs in ``span_fwd_kernel``'s
      epilogue (MERGE) instead of about eight torch passes over [B·H, T, k, d] fp32 tensors
      (1 GB each at 64K, 16 heads).
    * gate_kernel: the gate's kept scores are the search kernel's (``KeptScoresFunction``),
      their backward ``gate_bwd_kernel``, instead of gathering the kept keys into a
      [B, T, H, k, D] float32 tensor (and scatter-adding its gradient back).
    * sorted_pairs: the span dK/dV kernel reads q, dA and the pairs' statistics from copies in
      the sorted pair order (``sort_pairs_kernel``, one pass each) instead of gathering them
      through the order at every key-block visit (9.7 → 7.5 ms at 32K).

    One more, on by default for GQA groups of ``GROUP_SEARCH_MIN`` or more heads:

    * group_search: the search of a KV head's query heads in one program per position
      (``search_topk_group_kernel``): each candidate key row is loaded once per group instead
      of once per head, and the scores are tensor-core products; for groups of
      ``group_search_min`` (default ``GROUP_SEARCH_MIN``) or more query heads.

    Any field of ``LaunchConfig`` (``block_m``, ``kv_m``, ``num_warps``…; unset) overrides
    ``launch_config``'s tiles, for A/B runs. ``$MEGATRON_SUBQ_SUPERLINEAR_LAUNCH`` (JSON)
    overrides them, read once per op call (and handed to the backward)."""
    options = dict(window_dkdv=True, span_dkdv=True, elementwise_mix=True, fused_merge=True,
                   fused_mix=True, gate_kernel=True, sorted_pairs=True, group_search=True,
                   group_search_min=GROUP_SEARCH_MIN)
    overrides = os.environ.get(LAUNCH_ENV)
    if overrides:
        options.update(json.loads(overrides))
    return options


def _tiles(head_dim: int, block_m: Optional[int], block_n: Optional[int], dtype,
           options: dict) -> LaunchConfig:
    """The launch config of ``launch_config``, with any of its fields (``block_m``,
    ``kv_m``, ``num_warps``…) overridden by the launch options of the same name (A/B runs)."""
    cfg = launch_config(head_dim, block_m, block_n, dtype)
    return dataclasses.replace(cfg, **{f.name: options[f.name]
                                       for f in dataclasses.fields(cfg) if f.name in options})


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # ignored for 16-bit operands


def _attention_args(q, k):
    """What every attention kernel launch takes from q [B, T, H, D] and k: the softmax scale,
    the padded head dim, the dot precision, and q's and k's (b, t, h) strides (v shares k's)."""
    D = q.shape[-1]
    return (1.0 / math.sqrt(D), max(16, triton.next_power_of_2(D)), _precision(q.dtype),
            (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2)))


# GQA groups of at least this many query heads take the grouped search (one load of each key
# row per group, tensor-core scores). Its cost goes with its programs, one per position and KV
# head: on an H100 (2026-11-23, docs/benchmarks.md) it took 2.0 ms where the per-head kernel took
# 16.1 at 32 query / 2 KV heads (prefill, 64K), but 15.4 ms against 8.2 without GQA (16 heads,
# training, 64K; launch option group_search_min 1). Groups of 4 have a quarter of the latter's
# programs; 2 would be about even.
GROUP_SEARCH_MIN = 4


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
    args = (q_s, k, offsets, sel_t, sel_s, T, start, offsets.numel(), H, group, D,
            q_s.stride(0), q_s.stride(1), q_s.stride(2), k.stride(0), k.stride(1), k.stride(2))
    block_d = max(16, triton.next_power_of_2(D))
    topk_pad = max(2, triton.next_power_of_2(topk))
    if grouped and group >= min_group:
        search_topk_group_kernel[(T, B * H_kv)](
            *args, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_A=cfg.search_anchors,
            BLOCK_D=block_d, TOPK=topk, TOPK_PAD=topk_pad, PRECISION=_precision(q_s.dtype),
            num_warps=4)
    else:
        search_topk_kernel[(triton.cdiv(T, cfg.rows), B * H)](
            *args, BLOCK_M=cfg.rows, BLOCK_D=block_d, TOPK=topk, TOPK_PAD=topk_pad,
            num_warps=cfg.num_warps)
    return sel_t, sel_s


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
    scale, block_d, prec, strides = _attention_args(q, k)
    dev = q.device

    if window == 0:  # no window: its output and lse stay 0 and -inf
        o_w = torch.zeros(B * H, T, D, dtype=torch.float32, device=dev)
        lse_w = torch.full((B * H, T), float("-inf"), dtype=torch.float32, device=dev)
    else:  # the window kernel writes every row
        o_w = torch.empty(B * H, T, D, dtype=torch.float32, device=dev)
        lse_w = torch.empty(B * H, T, dtype=torch.float32, device=dev)
        window_fwd_kernel[(triton.cdiv(T, cfg.block_m), B * H)](
            q, k, v, o_w, lse_w, T, start, TK, H, H // H_kv, D, window, scale, *strides,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.fwd_n, BLOCK_D=block_d, PRECISION=prec,
            num_warps=cfg.num_warps)

    lo_f, hi_f = lo.reshape(B * H, P).contiguous(), hi.reshape(B * H, P).contiguous()
    order = torch.sort(lo_f, dim=1, stable=True).indices.to(torch.int32).contiguous()
    o_s = torch.empty(B * H, P, D, dtype=a_dtype if fused_merge else torch.float32, device=dev)
    lse_s = torch.empty(B * H, P, dtype=torch.float32, device=dev)
    # the span kernel's key bound is TK (its pairs index query rows, lo/hi are key positions)
    span_fwd_kernel[(triton.cdiv(P, cfg.block_m), B * H)](
        q, k, v, order, lo_f, hi_f, o_s, lse_s, o_w, lse_w, TK, P, H, H // H_kv, D, scale,
        *strides, TOPK=topk, BLOCK_M=cfg.block_m, BLOCK_N=cfg.fwd_n, BLOCK_D=block_d,
        PRECISION=prec, MERGE=fused_merge, num_warps=cfg.num_warps)
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


def _span_window_backward(saved, up, up_strides, coef, delta, win_up, win_strides, win_coef,
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
    scale, block_d, prec, strides = _attention_args(q, k)
    dev = q.device
    dk = torch.zeros(B, T, H_kv, D, dtype=torch.float32, device=dev)
    dv = torch.zeros_like(dk)
    no_coef = lse  # any float32 tensor: not read without HAS_COEF
    coef_arg = no_coef if coef is None else coef
    win_coef_arg = no_coef if win_coef is None else win_coef
    # the key-centric kernels' fp32 tiles (a test dtype) overflow shared memory at Triton's
    # default 3 stages: the window's needs 263,680 B with its coefficient (H100: 232,448 B),
    # 197,376 B at 2 (local sm_90 compile); the span's sorted form 231,424 B
    dkdv_stages = 2 if q.dtype == torch.float32 else 3

    dq_pairs = torch.empty(B * H, P, D, dtype=torch.float32, device=dev)
    span_bwd_kernel[(triton.cdiv(P, cfg.block_m), B * H)](
        q, k, v, order, lo_f, hi_f, up, coef_arg, lse, delta, dq_pairs,
        dk, dv, T, P, H, H // H_kv, D, scale, *strides, *up_strides,
        TOPK=topk, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d,
        PRECISION=prec, ATOMIC_KV=not options["span_dkdv"], HAS_COEF=coef is not None,
        num_warps=cfg.num_warps)
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
            pairs[0], k, v, *pairs[1:], first, end, dk, dv, T, P, H, H // H_kv, D, n_kb,
            scale, *strides, *up_strides, TOPK=topk, BLOCK_M=cfg.kv_m, BLOCK_N=cfg.span_kv_n,
            BLOCK_D=block_d, PRECISION=prec, HAS_COEF=coef is not None,
            SORTED=options["sorted_pairs"], num_warps=cfg.num_warps, num_stages=dkdv_stages)
    dq = dq_pairs.view(B * H, T, topk, D).sum(2)

    if window > 0:
        dq_w = torch.empty(B * H, T, D, dtype=torch.float32, device=dev)
        key_centric = options["window_dkdv"]
        window_bwd_kernel[(triton.cdiv(T, cfg.block_m), B * H)](
            q, k, v, win_up, win_coef_arg, lse_w, delta_w, dq_w, dk, dv, T, H, H // H_kv, D,
            window, scale, *strides, *win_strides, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_D=block_d, PRECISION=prec, ATOMIC_KV=not key_centric,
            HAS_COEF=win_coef is not None, num_warps=cfg.num_warps)
        if key_centric:  # after the span kernel: dk, dv hold its sums, this adds the window's
            window_bwd_dkdv_kernel[(triton.cdiv(T, cfg.window_kv_n), B * H_kv)](
                q, k, v, win_up, win_coef_arg, lse_w, delta_w, dk, dv, T, H, H // H_kv, D,
                window, scale, *strides, *win_strides, BLOCK_M=cfg.kv_m,
                BLOCK_N=cfg.window_kv_n, BLOCK_D=block_d, PRECISION=prec,
                HAS_COEF=win_coef is not None, num_warps=cfg.num_warps,
                num_stages=dkdv_stages)
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
    sort_pairs_kernel[grid](q, lse, order, q_s, P, H, D, q.stride(0), q.stride(1), q.stride(2),
                            0, TOPK=P // T, BLOCK_M=cfg.rows, BLOCK_D=block_d,
                            HAS_COEF=False, num_warps=4)
    # dA in q's dtype: the kernel rounds it to that for its matrix products anyway
    da_s = torch.empty(BH, P, D, dtype=q.dtype, device=q.device)
    sort_pairs_kernel[grid](up, lse if coef is None else coef, order, da_s, P, H, D,
                            *up_strides, TOPK=P // T, BLOCK_M=cfg.rows, BLOCK_D=block_d,
                            HAS_COEF=coef is not None, num_warps=4)
    lse, delta = lse.reshape(BH, P), delta.reshape(BH, P)
    unused_coef = lse  # dA already holds the coefficient
    return (q_s, order, lo_f.gather(1, idx), hi_f.gather(1, idx), da_s, unused_coef,
            lse.gather(1, idx), delta.gather(1, idx))


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
        dq, dk, dv = _span_window_backward(
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
            a, gate, d_out, lse, lse_w, d_gate, coef, delta, gamma, delta_w, T, H, D,
            gate.stride(0), gate.stride(1), gate.stride(2),
            d_out.stride(0), d_out.stride(1), d_out.stride(2), TOPK=topk, BLOCK_M=cfg.rows,
            BLOCK_D=max(16, triton.next_power_of_2(D)), num_warps=cfg.num_warps)
        do_strides = (d_out.stride(0), d_out.stride(1), d_out.stride(2))
        dq, dk, dv = _span_window_backward(
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
        a, gate, out, T, H, D, gate.stride(0), gate.stride(1), gate.stride(2),
        out.stride(0), out.stride(1), out.stride(2), TOPK=topk, BLOCK_M=cfg.rows,
        BLOCK_D=max(16, triton.next_power_of_2(D)), num_warps=cfg.num_warps)
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
    cfg = _tiles(D, block_m, block_n, q.dtype, options)
    device_plan = _training_plan(T, search_power, span_power, backward_factor, forward_factor,
                                 sw_index, q.device)
    plan, offsets = device_plan.plan, device_plan.offsets_i32

    with torch.no_grad():
        sel_t, sel_s = search_topk(q_s, k, offsets, topk, cfg,  # [B, H, T, k]
                                   grouped=options["group_search"],
                                   min_group=options["group_search_min"])
    gate = _gate(q_s, k, sel_t, options["elementwise_mix"],
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
            q_s, k, sel_t, d_scores, dq_s, dk, T, TK, H, H // H_kv, D,
            q_s.stride(0), q_s.stride(1), q_s.stride(2), k.stride(0), k.stride(1), k.stride(2),
            TOPK=sel_t.shape[-1], BLOCK_M=ctx.cfg.rows,
            BLOCK_D=max(16, triton.next_power_of_2(D)), num_warps=ctx.cfg.num_warps)
        return dq_s.to(q_s.dtype), dk.to(k.dtype), None, None, None


def _gate(q_s, k, sel_t, elementwise: bool, sel_s=None, cfg: Optional[LaunchConfig] = None):
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
    # atomics land: a CUDA-graph replay then differed from eager by 3e-3 in dk on the H100)
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
    cfg = _tiles(q.shape[-1], block_m, block_n, q.dtype, options)
    plan = _device_plan(start, stop, search_power, span_power, backward_factor, forward_factor,
                        sw_index, q.device)
    sel_t, sel_s = search_topk(q_s, k, plan.offsets_i32, topk, cfg, start=start,  # [B, H, C, k]
                               grouped=options["group_search"],
                               min_group=options["group_search_min"])
    elementwise = options["elementwise_mix"]
    gate = _gate(q_s, k, sel_t, elementwise, sel_s if options["gate_kernel"] else None, cfg)
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


@dataclass(frozen=True)
class _DevicePlan:
    plan: SuperlinearPlan
    offsets_i32: torch.Tensor  # the search kernel's offset table (never empty)


def _with_offsets(plan: SuperlinearPlan, stop: int, device) -> _DevicePlan:
    offsets = plan.offsets.to(torch.int32)
    if offsets.numel() == 0:  # no query has an anchor (the window covers every prefix)
        offsets = torch.full((1,), stop, dtype=torch.int32, device=device)
    return _DevicePlan(plan, offsets)


# Plans depend on positions and knobs only, so they are built once per shape and kept on the
# device: building one costs milliseconds of host time at 64K tokens, and its host-to-device
# copies (pageable memory) can stall the host until the GPU has drained. Nothing writes to them.
@functools.lru_cache(maxsize=16)
def _training_plan(T, search_power, span_power, backward_factor, forward_factor, sw_index,
                   device) -> _DevicePlan:
    return _with_offsets(superlinear_plan(T, search_power, span_power, backward_factor,
                                          forward_factor, sw_index, device=device), T, device)


@functools.lru_cache(maxsize=64)
def _device_plan(start, stop, search_power, span_power, backward_factor, forward_factor,
                 sw_index, device) -> _DevicePlan:
    return _with_offsets(superlinear_plan_range(start, stop, search_power, span_power,
                                                backward_factor, forward_factor, sw_index,
                                                device=device), stop, device)
