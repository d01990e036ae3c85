"""Superlinear multi-step attention, N=2 (superlinear-multi-step-attention.txt, variants.md).

Per head, for query position i (0-based), with search power p, span power p_sp, factors b, f and
window length w = floor((sw_index+1)^(1/p)) - 1:

* candidate anchors  t_s = i - floor((s+1)^(1/p)) + 1  for s = 0, 1, ... while t_s >= 0, minus the
  anchors inside the window W = [max(0, i-w+1), i] (W is empty when w = 0);
* search scores      s_{i,t} = Q_s(i) . K(t)   (unscaled; K is the ordinary, RoPE'd key);
* the top-k anchors by score; the gate alpha = softmax over the kept anchors' scores;
* span of anchor t   S_t = [max(0, t - ceil(b*l(i))), min(i, t + ceil(f*l(i)))],  l(i) = ceil(i^p_sp);
* A_{i,t}            = softmax attention of Q(i) (scale 1/sqrt(D)) over S_t u W, de-duplicated;
* output             o_i = sum_t alpha_t A_{i,t};  with no anchor at all, attention over W.

Every power is computed exactly in integer arithmetic (``kernels/powers.py``); the factors b and
f are taken as the rationals they stand for (``as_fraction``), so ceil(b*l) is exact too. The
geometry (window, anchor offsets, span extents: ``SuperlinearPlan``) lives in
``kernels/superlinear/plan.py``, shared with the kernels, and is re-exported here.

Choices where the definition is silent (docs/variants.md):

* Ties in top-k: among equal scores the nearer anchor (smaller s, larger t) wins. Implemented with
  a stable descending sort over the candidates ordered by s.
* Fewer than k candidate anchors: all of them are kept and the gate is a softmax over those.
* The gate is the only path from the loss to Q_s (top-k is discrete); K receives gradients both
  through the attention logits and through the search scores.

Memory: the PyTorch reference works on chunks of ``query_chunk`` queries. For one chunk of C
queries it materialises the search scores (C x #anchors), the gathered span keys/values
(C x k x max span x D) and the window logits (C x (C + w)); with C = O(sqrt(L)) this is O(L*D) per
head and chunk, never the L x L matrix. Under autograd each chunk is checkpointed (recomputed in
backward), so training memory stays at one chunk too. ``superlinear_attention_dense`` is the
O(L^2)-mask form of the same definition, written independently, for tests.

Inference: ``superlinear_prefill`` (a chunk of queries against the cached keys of every earlier
position) and ``superlinear_decode_step`` (one query, O(sqrt(L)) rows of the cache read; see
``superlinear_decode_cost``) give exactly the rows of the full forward; the KV cache is the whole
state because the search key is the ordinary key.
"""

from __future__ import annotations

import bisect
import math
from fractions import Fraction
from typing import List, Optional

import torch
from torch.utils.checkpoint import checkpoint

from ..kernels.powers import floor_power
from ..kernels.superlinear.plan import (SuperlinearPlan, _inverse_power, anchor_offsets,
                                        capacity_bucket, ceil_power, ceil_times,
                                        superlinear_plan, superlinear_plan_range,
                                        superlinear_window)
from .dispatch import check_qkv, choose_impl, repeat_kv

DEFAULT_QUERY_CHUNK = 64


# ---------------------------------------------------------------------------------------------
# the candidate anchors, literally (the geometry itself: kernels/superlinear/plan.py)
# ---------------------------------------------------------------------------------------------
def superlinear_anchors(position: int, search_power: float = 0.5, sw_index: int = 0) -> List[int]:
    """The candidate anchors of query ``position``, nearest first (s = 0, 1, ...).

    Written literally from the definition: every t_s >= 0, then those inside the window dropped.
    ``superlinear_anchors(30, 0.5, 0) == [30, 27, 22, 15, 6]`` (the paper's Figure 3).
    """
    _check_knobs("superlinear_anchors", search_power, 0.5, 1, 0.0, 0.0, sw_index)
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
# argument checks
# ---------------------------------------------------------------------------------------------
def _check_knobs(op, search_power, span_power, topk, backward_factor, forward_factor,
                 sw_index) -> dict:
    """Validate the knobs (ValueError naming the knob); return them as keyword arguments."""
    def bad(name, value, allowed):
        raise ValueError(f"{op}: {name}={value!r} is invalid: allowed {allowed}")

    def number(x):
        return isinstance(x, (int, float, Fraction)) and not isinstance(x, bool)

    if not (number(search_power) and 0 < search_power <= 1):
        bad("search_power", search_power, "a number in (0, 1]")
    if not (number(span_power) and 0 <= span_power <= 1):
        bad("span_power", span_power, "a number in [0, 1]")
    if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1:
        bad("topk", topk, "an integer >= 1")
    if not (number(backward_factor) and backward_factor >= 0):
        bad("backward_factor", backward_factor, "a number >= 0")
    if not (number(forward_factor) and forward_factor >= 0):
        bad("forward_factor", forward_factor, "a number >= 0")
    if not isinstance(sw_index, int) or isinstance(sw_index, bool) or sw_index < 0:
        bad("sw_index", sw_index, "an integer >= 0")
    return dict(search_power=search_power, span_power=span_power, topk=topk,
                backward_factor=backward_factor, forward_factor=forward_factor, sw_index=sw_index)


def _check_inputs(op, q, q_s, k, v):
    B, T, H, H_kv, D = check_qkv(op, q, k, v)
    if not isinstance(q_s, torch.Tensor):
        raise TypeError(f"{op}: q_s must be a torch.Tensor, got {type(q_s).__name__}")
    if q_s.shape != q.shape:
        raise ValueError(f"{op}: q_s must have the shape of q {tuple(q.shape)} (one search query "
                         f"per query head), got {tuple(q_s.shape)}")
    if q_s.dtype != q.dtype or q_s.device != q.device:
        raise ValueError(f"{op}: q_s must share q's dtype and device, got {q_s.dtype} on "
                         f"{q_s.device} vs {q.dtype} on {q.device}")
    return B, T, H, H_kv, D


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
    B, T, H, H_kv, D = _check_inputs(op, q, q_s, k, v)
    _check_knobs(op, search_power, span_power, topk, backward_factor, forward_factor, sw_index)
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
# the O(L^2)-mask form (tests): same definition, written independently
# ---------------------------------------------------------------------------------------------
def superlinear_attention_dense(q, q_s, k, v, search_power=0.5, span_power=0.5, topk=2,
                                backward_factor=2.0, forward_factor=0.0, sw_index=0):
    """Full [T, T] score matrices and masks built position by position from the scalar helpers
    (``superlinear_anchors``, ``ceil_power``, ``ceil_times``). For tests on small T."""
    op = "superlinear_attention_dense"
    B, T, H, H_kv, D = _check_inputs(op, q, q_s, k, v)
    _check_knobs(op, search_power, span_power, topk, backward_factor, forward_factor, sw_index)
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


# ---------------------------------------------------------------------------------------------
# the op
# ---------------------------------------------------------------------------------------------
def _kernel():
    try:
        from ..kernels.superlinear import superlinear_attention_kernel  # noqa: PLC0415
    except ImportError:
        return None
    return superlinear_attention_kernel


def superlinear_attention(q, q_s, k, v, search_power=0.5, span_power=0.5, topk=2,
                          backward_factor=2.0, forward_factor=0.0, sw_index=0, impl=None):
    """Superlinear attention (N=2). q, q_s: [B, T, H, D]; k, v: [B, T, H_kv, D], H % H_kv == 0.

    Returns [B, T, H, D] in q's dtype. Knobs as ``SubqTransformerConfig.superlinear_*``; the op
    does not insist on random context access (the config does).
    """
    op = "superlinear_attention"
    _check_inputs(op, q, q_s, k, v)
    knobs = _check_knobs(op, search_power, span_power, topk, backward_factor, forward_factor,
                         sw_index)
    kernel = _kernel()
    if choose_impl(op, impl, (q, q_s, k, v), kernel) == "kernel":
        return kernel(q, q_s, k, v, **knobs)
    return superlinear_attention_reference(q, q_s, k, v, **knobs)


# ---------------------------------------------------------------------------------------------
# inference: chunked prefill against a cached prefix, and one decode step
# ---------------------------------------------------------------------------------------------
# The KV cache is the state: K is also the search key (K_a = K), so nothing else is cached. Query
# i reads keys <= i only, so a chunk of queries [start, start + C) needs the keys [0, start + C)
# and gives exactly rows [start, start + C) of the full forward.
def _check_cache(op, q, q_s, k_cache, v_cache, rows_name):
    """q, q_s: [B, C, H, D]; caches [B, L, H_kv, D]. Returns (B, C, H, H_kv, D, L)."""
    for name, t in (("q", q), ("q_s", q_s), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{op}: {name} must be a floating-point tensor, got {t.dtype}")
    if q.dim() != 4:
        raise ValueError(f"{op}: q must have shape {rows_name}, got {tuple(q.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4:
            raise ValueError(f"{op}: {name} must have shape [B, L, H_kv, D], got "
                             f"{tuple(t.shape)}")
    B, C, H, D = q.shape
    if q_s.shape != q.shape:
        raise ValueError(f"{op}: q_s must have the shape of q {tuple(q.shape)} (one search query "
                         f"per query head), got {tuple(q_s.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"{op}: k_cache and v_cache must have one shape, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    Bk, L, H_kv, Dk = k_cache.shape
    if Bk != B:
        raise ValueError(f"{op}: k_cache has batch {Bk} but q has batch {B}")
    if Dk != D:
        raise ValueError(f"{op}: k_cache has head dim {Dk} but q has {D}")
    if H % H_kv != 0:
        raise ValueError(f"{op}: the query head count ({H}) must be a multiple of the cache's "
                         f"key/value head count ({H_kv}) for GQA")
    if len({t.device for t in (q, q_s, k_cache, v_cache)}) != 1:
        raise ValueError(f"{op}: q, q_s, k_cache, v_cache must be on one device")
    if len({t.dtype for t in (q, q_s, k_cache, v_cache)}) != 1:
        raise ValueError(f"{op}: q, q_s, k_cache, v_cache must share a dtype, got {q.dtype}, "
                         f"{q_s.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if C < 1:
        raise ValueError(f"{op}: q must hold at least one query, got {tuple(q.shape)}")
    return B, C, H, H_kv, D, L


def _check_int(op, name, value, lo, hi):
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ValueError(f"{op}: {name}={value!r} is invalid: allowed an integer in [{lo}, {hi}]")


def _reference_rows(q, q_s, k_cache, v_cache, start, knobs, query_chunk):
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


def _prefill_kernel():
    try:
        from ..kernels.superlinear import superlinear_prefill_kernel  # noqa: PLC0415
    except ImportError:
        return None
    return superlinear_prefill_kernel


def _decode_kernel():
    try:
        from ..kernels.superlinear import superlinear_decode_kernel  # noqa: PLC0415
    except ImportError:
        return None
    return superlinear_decode_kernel


@torch.no_grad()
def superlinear_prefill(q, q_s, k_cache, v_cache, start: Optional[int] = None,
                        search_power=0.5, span_power=0.5, topk=2, backward_factor=2.0,
                        forward_factor=0.0, sw_index=0, impl=None):
    """One prefill chunk against the cached prefix (forward only, no autograd).

    q, q_s: [B, C, H, D], the queries of positions [start, start + C); k_cache, v_cache:
    [B, L, H_kv, D] with L >= start + C, holding the keys/values of positions [0, start + C)
    (this chunk's included; entries past start + C are never read). ``start`` defaults to
    L - C. Returns [B, C, H, D] in q's dtype: rows [start, start + C) of ``superlinear_attention``
    over the first start + C tokens.
    """
    op = "superlinear_prefill"
    B, C, H, H_kv, D, L = _check_cache(op, q, q_s, k_cache, v_cache, "[B, C, H, D]")
    if C > L:
        raise ValueError(f"{op}: k_cache holds {L} positions, fewer than the chunk's {C} queries "
                         "(the cache must include this chunk's keys)")
    start = L - C if start is None else start
    _check_int(op, "start", start, 0, L - C)
    knobs = _check_knobs(op, search_power, span_power, topk, backward_factor, forward_factor,
                         sw_index)
    kernel = _prefill_kernel()
    if choose_impl(op, impl, (q, q_s, k_cache, v_cache), kernel) == "kernel":
        return kernel(q, q_s, k_cache, v_cache, start, **knobs)
    return _reference_rows(q, q_s, k_cache, v_cache, start, knobs, DEFAULT_QUERY_CHUNK)


def superlinear_decode_cost(length: int, search_power=0.5, span_power=0.5, topk=2,
                            backward_factor=2.0, forward_factor=0.0, sw_index=0) -> dict:
    """Cache rows one decode step reads per query head, for the query at i = length - 1:
    ``search`` candidate anchor keys (~i^p), at most ``spans`` = min(k, #candidates) spans of
    ceil(b*l) + ceil(f*l) + 1 keys and values (l = ceil(i^p_sp); an upper bound: span keys inside
    the window are not read twice), ``window`` = min(w, i + 1) keys and values. At p = p_sp = 1/2
    the total is ~(1 + k(b + f)) sqrt(i) + w: O(sqrt(L)) with the window as a constant."""
    _check_int("superlinear_decode_cost", "length", length, 1, 1 << 62)
    i = length - 1
    offsets = anchor_offsets(capacity_bucket(length), search_power, sw_index)
    candidates = bisect.bisect_right(offsets, i)
    scale = ceil_power(i, span_power)
    span = min(i + 1, ceil_times(backward_factor, scale) + ceil_times(forward_factor, scale) + 1)
    window = min(superlinear_window(search_power, sw_index), i + 1)
    spans = min(topk, candidates) * span
    return dict(search=candidates, spans=spans, window=window,
                total=candidates + spans + window)


@torch.no_grad()
def superlinear_decode_step(q, q_s, k_cache, v_cache, length: Optional[int] = None,
                            search_power=0.5, span_power=0.5, topk=2, backward_factor=2.0,
                            forward_factor=0.0, sw_index=0, impl=None):
    """One decode step: the query of position i = length - 1 over the cache.

    q, q_s: [B, H, D]; k_cache, v_cache: [B, L, H_kv, D] holding positions [0, length) (the
    current token's key/value appended already; ``length`` defaults to L, entries past it are
    never read). Returns [B, H, D] in q's dtype: row i of the full forward.

    Work per (batch, query head) is O(sqrt(i)) at p = p_sp = 1/2: ~i^p search scores, top-k
    spans of <= ceil(b*l) + ceil(f*l) + 1 keys (l = ceil(i^p_sp)) and the w window keys.
    """
    op = "superlinear_decode_step"
    for name, t in (("q", q), ("q_s", q_s)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{op}: {name} must be a tensor of shape [B, H, D] (one token), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t)}")
    B, _, H, H_kv, D, L = _check_cache(op, q[:, None], q_s[:, None], k_cache, v_cache,
                                       "[B, H, D]")
    length = L if length is None else length
    _check_int(op, "length", length, 1, L)
    knobs = _check_knobs(op, search_power, span_power, topk, backward_factor, forward_factor,
                         sw_index)
    kernel = _decode_kernel()
    if choose_impl(op, impl, (q, q_s, k_cache, v_cache), kernel) == "kernel":
        return kernel(q, q_s, k_cache, v_cache, length, **knobs)
    return _reference_rows(q[:, None], q_s[:, None], k_cache, v_cache, length - 1, knobs, 1)[:, 0]
