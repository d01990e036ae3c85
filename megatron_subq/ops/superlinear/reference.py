"""Superlinear attention in plain PyTorch, written to be read beside the definition (the package
docstring): ``superlinear_anchors`` (one query's candidates, literally), the chunked reference
(``superlinear_attention_reference``, what ``impl="reference"`` runs; ``reference_rows`` for
prefill and decode) and the O(T^2)-mask form ``superlinear_attention_dense`` (tests).
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch
from torch.utils.checkpoint import checkpoint

from ...kernels.powers import floor_power
from ...kernels.superlinear.plan import (SuperlinearPlan, _inverse_power, anchor_offsets,
                                         ceil_power, ceil_times, superlinear_plan,
                                         superlinear_plan_range, superlinear_window)
from ..dispatch import repeat_kv
from .checks import check_inputs, check_knobs

DEFAULT_QUERY_CHUNK = 64


# ---------------------------------------------------------------------------------------------
# the candidate anchors, literally (the geometry itself: kernels/superlinear/plan.py)
# ---------------------------------------------------------------------------------------------
def superlinear_anchors(position: int, search_power: float = 0.5, sw_index: int = 0) -> List[int]:
    """The candidate anchors of query ``position``, nearest first (s = 0, 1, ...).

    Written literally from the definition: every t_s >= 0, then those inside the window dropped.
    ``superlinear_anchors(30, 0.5, 0) == [30, 27, 22, 15, 6]`` (the paper's Figure 3).
    """
    check_knobs("superlinear_anchors", search_power, 0.5, 1, 0.0, 0.0, sw_index)
    if not isinstance(position, int) or position < 0:
        raise ValueError(f"superlinear_anchors: position={position!r} is invalid: allowed an "
                         "integer >= 0")
    inv = _inverse_power(search_power)
    w = superlinear_window(search_power, sw_index)
    window_lo = max(0, position - w + 1) if w > 0 else position + 1  # empty window when w = 0
    anchors, s = [], 0
    while (t := position - floor_power(s + 1, inv) + 1) >= 0:
        if not window_lo <= t <= position:
            anchors.append(t)
        s += 1
    return anchors


# ---------------------------------------------------------------------------------------------
# the chunked PyTorch reference
# ---------------------------------------------------------------------------------------------
def _select_anchors(scores: torch.Tensor, valid: torch.Tensor, topk: int):
    """Top-k of ``scores`` [..., A] among ``valid`` candidates, ties to the lower column (nearer
    anchor). Returns (kept columns [..., k'], their scores, kept-and-valid mask), k' = min(k, A)."""
    neg = torch.finfo(scores.dtype).min
    masked = scores.masked_fill(~valid, neg)
    order = torch.sort(masked.detach(), dim=-1, descending=True, stable=True).indices
    cols = order[..., :min(topk, scores.shape[-1])]
    return cols, masked.gather(-1, cols), valid.gather(-1, cols)


def superlinear_topk_reference(q_s, k, search_power=0.5, sw_index=0, topk=2):
    """The kept anchors of the reference, [B, T, H, k'] (k' = min(topk, #offsets); -1 where a
    query has fewer candidates), for comparing kernels' selections."""
    B, T, H, D = q_s.shape
    H_kv = k.shape[2]
    offsets = torch.tensor(anchor_offsets(T, search_power, sw_index), dtype=torch.int64,
                           device=q_s.device)
    anchor = torch.arange(T, device=q_s.device)[:, None] - offsets[None, :]  # [T, A]
    k_anchor = k.float()[:, anchor.clamp(min=0)]  # [B, T, A, H_kv, D]
    q_s_grouped = q_s.float().reshape(B, T, H_kv, H // H_kv, D)
    scores = torch.einsum("btkgd,btakd->btkga", q_s_grouped, k_anchor).reshape(B, T, H, -1)
    cols, _, kept = _select_anchors(scores, (anchor >= 0)[None, :, None, :].expand_as(scores),
                                    topk)
    return torch.where(kept, torch.arange(T, device=q_s.device)[:, None, None] - offsets[cols], -1)


def _chunk_forward(q, q_s, k, v, i0: int, plan: SuperlinearPlan, topk: int, scale: float):
    """Output of queries [i0, i0 + C) in the compute dtype (q's). q, q_s: [B, C, H, D] (this
    chunk); k, v: [B, T, H_kv, D] (at least the keys [0, i0 + C); any dtype: only the gathered
    rows are cast, so a decode step touches O(sqrt(T)) of a long cache). Returns [B, C, H, D]."""
    B, C, H, D = q.shape
    T, H_kv = k.shape[1], k.shape[2]
    group = H // H_kv
    dev = q.device
    neg = torch.finfo(q.dtype).min
    pos = torch.arange(i0, i0 + C, device=dev)  # [C] query positions

    # -- span search: scores at the candidate anchors (a fixed stride pattern i - d) ------------
    anchor = pos[:, None] - plan.offsets[None, :]  # [C, A]
    anchor_valid = anchor >= 0
    k_anchor = k[:, anchor.clamp(min=0)].to(q.dtype)  # [B, C, A, H_kv, D]
    q_s_grouped = q_s.reshape(B, C, H_kv, group, D)  # query head h = kv_head * group + g
    scores = torch.einsum("bckgd,bcakd->bckga", q_s_grouped, k_anchor).reshape(B, C, H, -1)
    cols, top_scores, kept = _select_anchors(scores, anchor_valid[None, :, None, :].expand_as(
        scores), topk)  # [B, C, H, k]
    has_anchor = kept.any(dim=-1, keepdim=True)  # [B, C, H, 1]
    # the gate: a softmax over the kept anchors (masked slots get weight 0; no NaN without anchors)
    gate = torch.softmax(top_scores, dim=-1) * kept

    # -- per-query intervals ----------------------------------------------------------------------
    back, fwd = plan.back[pos - plan.first], plan.fwd[pos - plan.first]  # [C]
    w = plan.window
    win_lo = (pos - w + 1).clamp(min=0) if w > 0 else pos + 1  # W = [win_lo, i] (empty if w = 0)
    t = pos[None, :, None, None] - plan.offsets[cols]  # [B, C, H, k] kept anchors
    span_lo = (t - back[None, :, None, None]).clamp(min=0)
    # keys of the span that are not in the window (the union is de-duplicated)
    span_hi = torch.minimum(t + fwd[None, :, None, None], pos[None, :, None, None])
    span_hi = torch.minimum(span_hi, win_lo[None, :, None, None] - 1)

    # -- span keys, gathered per (query, head, slot) ---------------------------------------------
    span_len = int((back + fwd).max().item()) + 1
    idx = span_lo[..., None] + torch.arange(span_len, device=dev)  # [B, C, H, k, J]
    span_valid = (idx <= span_hi[..., None]) & kept[..., None]
    # masked slots read a key <= i, never past the query (a cache may hold garbage there)
    idx = torch.minimum(idx, pos[None, :, None, None, None])
    kv_head = torch.arange(H, device=dev) // group  # [H]
    flat = (idx * H_kv + kv_head[None, None, :, None, None]).reshape(B, -1)  # rows of [T*H_kv, D]
    k_span = k.reshape(B, T * H_kv, D).gather(1, flat[..., None].expand(-1, -1, D))
    v_span = v.reshape(B, T * H_kv, D).gather(1, flat[..., None].expand(-1, -1, D))
    k_span = k_span.reshape(*idx.shape, D).to(q.dtype)
    v_span = v_span.reshape(*idx.shape, D).to(q.dtype)
    span_logits = torch.einsum("bchd,bchkjd->bchkj", q, k_span) * scale
    span_logits = span_logits.masked_fill(~span_valid, neg)

    # -- window keys: one contiguous slab for the whole chunk --------------------------------------
    slab_lo = max(0, i0 - w + 1) if w > 0 else i0
    slab = torch.arange(slab_lo, i0 + C, device=dev)  # [S]
    win_valid = (slab[None, :] >= win_lo[:, None]) & (slab[None, :] <= pos[:, None])  # [C, S]
    k_win = repeat_kv(k[:, slab_lo:i0 + C].to(q.dtype), H)  # [B, S, H, D]
    v_win = repeat_kv(v[:, slab_lo:i0 + C].to(q.dtype), H)
    win_logits = torch.einsum("bchd,bshd->bchs", q, k_win) * scale
    win_logits = win_logits.masked_fill(~win_valid[None, :, None, :], neg)  # [B, C, H, S]

    # -- A_{i,t}: softmax over span(t) u W, then the gated mixture ----------------------------------
    k_slots = cols.shape[-1]
    logits = torch.cat([span_logits, win_logits[:, :, :, None, :].expand(-1, -1, -1, k_slots, -1)],
                       dim=-1)  # [B, C, H, k, J + S]
    probs = torch.softmax(logits, dim=-1)
    p_span, p_win = probs[..., :span_len], probs[..., span_len:]
    per_anchor = (torch.einsum("bchkj,bchkjd->bchkd", p_span, v_span)
                  + torch.einsum("bchks,bshd->bchkd", p_win, v_win))  # A_{i,t}: [B, C, H, k, D]
    mixed = torch.einsum("bchk,bchkd->bchd", gate, per_anchor)
    window_only = torch.einsum("bchs,bshd->bchd", torch.softmax(win_logits, dim=-1), v_win)
    return torch.where(has_anchor, mixed, window_only)


def superlinear_attention_reference(q, q_s, k, v, search_power=0.5, span_power=0.5, topk=2,
                                    backward_factor=2.0, forward_factor=0.0, sw_index=0,
                                    query_chunk: Optional[int] = None):
    """The definition in PyTorch, chunked over queries (see the module docstring for memory).

    Computes in float32 (float64 inputs stay float64) and returns q's dtype.
    """
    op = "superlinear_attention"
    B, T, H, H_kv, D = check_inputs(op, q, q_s, k, v)
    check_knobs(op, search_power, span_power, topk, backward_factor, forward_factor, sw_index)
    chunk = DEFAULT_QUERY_CHUNK if query_chunk is None else query_chunk
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"{op}: query_chunk={query_chunk!r} is invalid: allowed an integer >= 1")
    plan = superlinear_plan(T, search_power, span_power, backward_factor, forward_factor,
                            sw_index, device=q.device)
    dtype = torch.promote_types(q.dtype, torch.float32)
    qc, qsc, kc, vc = (x.to(dtype) for x in (q, q_s, k, v))
    scale = 1.0 / math.sqrt(D)
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, q_s, k, v))
    outs = []
    for i0 in range(0, T, chunk):
        i1 = min(T, i0 + chunk)
        args = (qc[:, i0:i1], qsc[:, i0:i1], kc, vc, i0, plan, topk, scale)
        if needs_grad:  # recompute the chunk in backward instead of keeping its gathers alive
            outs.append(checkpoint(_chunk_forward, *args, use_reentrant=False))
        else:
            outs.append(_chunk_forward(*args))
    return torch.cat(outs, dim=1).to(q.dtype)


# ---------------------------------------------------------------------------------------------
# the reference's rows [start, start + C) against a cache (prefill, decode)
# ---------------------------------------------------------------------------------------------
def reference_rows(q, q_s, k_cache, v_cache, start, knobs, query_chunk):
    """Rows [start, start + C) of the reference forward, the keys read from the caches."""
    C, D = q.shape[1], q.shape[3]
    plan = superlinear_plan_range(start, start + C, **_plan_knobs(knobs), device=q.device)
    dtype = torch.promote_types(q.dtype, torch.float32)
    qc, qsc = q.to(dtype), q_s.to(dtype)
    k, v = k_cache[:, :start + C], v_cache[:, :start + C]  # views; only gathered rows are cast
    scale = 1.0 / math.sqrt(D)
    outs = [_chunk_forward(qc[:, r0:r0 + query_chunk], qsc[:, r0:r0 + query_chunk], k, v,
                           start + r0, plan, knobs["topk"], scale)
            for r0 in range(0, C, query_chunk)]
    return torch.cat(outs, dim=1).to(q.dtype)


def _plan_knobs(knobs: dict) -> dict:
    return {n: x for n, x in knobs.items() if n != "topk"}


# ---------------------------------------------------------------------------------------------
# the O(L^2)-mask form (tests): same definition, written independently
# ---------------------------------------------------------------------------------------------
def superlinear_attention_dense(q, q_s, k, v, search_power=0.5, span_power=0.5, topk=2,
                                backward_factor=2.0, forward_factor=0.0, sw_index=0):
    """Full [T, T] score matrices and masks built position by position from the scalar helpers
    (``superlinear_anchors``, ``ceil_power``, ``ceil_times``). For tests on small T."""
    op = "superlinear_attention_dense"
    B, T, H, H_kv, D = check_inputs(op, q, q_s, k, v)
    check_knobs(op, search_power, span_power, topk, backward_factor, forward_factor, sw_index)
    dtype = torch.promote_types(q.dtype, torch.float32)
    qf, qsf = q.to(dtype), q_s.to(dtype)
    kf, vf = repeat_kv(k, H).to(dtype), repeat_kv(v, H).to(dtype)
    w = superlinear_window(search_power, sw_index)

    candidate = torch.zeros(T, T, dtype=torch.bool)  # [i, t]
    window = torch.zeros(T, T, dtype=torch.bool)  # [i, j]
    back, fwd = torch.zeros(T, dtype=torch.long), torch.zeros(T, dtype=torch.long)
    for i in range(T):
        candidate[i, superlinear_anchors(i, search_power, sw_index)] = True
        if w > 0:
            window[i, max(0, i - w + 1):i + 1] = True
        scale_i = ceil_power(i, span_power)
        back[i], fwd[i] = ceil_times(backward_factor, scale_i), ceil_times(forward_factor, scale_i)
    candidate, window = candidate.to(q.device), window.to(q.device)
    back, fwd = back.to(q.device), fwd.to(q.device)

    search = torch.einsum("bihd,bthd->bhit", qsf, kf)  # [B, H, i, t]
    # ties go to the nearer anchor (larger t): a stable sort over t in decreasing order
    neg = torch.finfo(dtype).min
    flipped = search.masked_fill(~candidate, neg).flip(-1)
    order = torch.sort(flipped.detach(), dim=-1, descending=True, stable=True).indices
    order = order[..., :min(topk, T)]
    t_kept = T - 1 - order  # [B, H, T, k]
    kept = candidate.expand(B, H, T, T).gather(-1, t_kept)
    gate = torch.softmax(search.masked_fill(~candidate, neg).gather(-1, t_kept), dim=-1) * kept

    i = torch.arange(T, device=q.device)[:, None]  # [T, 1]
    j = torch.arange(T, device=q.device)
    lo = (t_kept - back[:, None]).clamp(min=0)[..., None]  # [B, H, T, k, 1]
    hi = torch.minimum(t_kept + fwd[:, None], i)[..., None]
    attend = ((j >= lo) & (j <= hi)) | window[:, None, :]  # [B, H, T, k, T]
    logits = torch.einsum("bihd,bjhd->bhij", qf, kf) / math.sqrt(D)
    per_anchor = torch.softmax(torch.where(attend, logits[:, :, :, None, :], neg), dim=-1)
    mixed = torch.einsum("bhik,bhikj,bjhd->bihd", gate, per_anchor, vf)
    window_only = torch.einsum("bhij,bjhd->bihd",
                               torch.softmax(logits.masked_fill(~window, neg), dim=-1), vf)
    has_anchor = kept.any(-1).transpose(1, 2)[..., None]  # [B, T, H, 1]
    return torch.where(has_anchor, mixed, window_only).to(q.dtype)
