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
from typing import Optional

import torch

from ...kernels.superlinear.plan import (SuperlinearPlan, anchor_offsets, capacity_bucket,
                                         ceil_power, ceil_times, superlinear_plan,
                                         superlinear_plan_range, superlinear_window)
from ..dispatch import choose_impl
from .checks import check_cache, check_inputs, check_int, check_knobs
from .reference import (DEFAULT_QUERY_CHUNK, reference_rows, superlinear_anchors,
                        superlinear_attention_dense, superlinear_attention_reference,
                        superlinear_topk_reference)

__all__ = ["superlinear_anchors", "superlinear_attention", "superlinear_attention_dense",
           "superlinear_attention_reference", "superlinear_decode_cost",
           "superlinear_decode_step", "superlinear_prefill", "superlinear_topk_reference",
           # the geometry, re-exported from kernels/superlinear/plan.py
           "SuperlinearPlan", "anchor_offsets", "capacity_bucket", "ceil_power", "ceil_times",
           "superlinear_plan", "superlinear_plan_range", "superlinear_window"]


# ---------------------------------------------------------------------------------------------
# the op
# ---------------------------------------------------------------------------------------------
def _kernel():
    try:
        from ...kernels.superlinear import superlinear_attention_kernel  # noqa: PLC0415
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
    check_inputs(op, q, q_s, k, v)
    knobs = check_knobs(op, search_power, span_power, topk, backward_factor, forward_factor,
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
def _prefill_kernel():
    try:
        from ...kernels.superlinear import superlinear_prefill_kernel  # noqa: PLC0415
    except ImportError:
        return None
    return superlinear_prefill_kernel


def _decode_kernel():
    try:
        from ...kernels.superlinear import superlinear_decode_kernel  # noqa: PLC0415
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
    B, C, H, H_kv, D, L = check_cache(op, q, q_s, k_cache, v_cache, "[B, C, H, D]")
    if C > L:
        raise ValueError(f"{op}: k_cache holds {L} positions, fewer than the chunk's {C} queries "
                         "(the cache must include this chunk's keys)")
    start = L - C if start is None else start
    check_int(op, "start", start, 0, L - C)
    knobs = check_knobs(op, search_power, span_power, topk, backward_factor, forward_factor,
                        sw_index)
    kernel = _prefill_kernel()
    if choose_impl(op, impl, (q, q_s, k_cache, v_cache), kernel) == "kernel":
        return kernel(q, q_s, k_cache, v_cache, start, **knobs)
    return reference_rows(q, q_s, k_cache, v_cache, start, knobs, DEFAULT_QUERY_CHUNK)


def superlinear_decode_cost(length: int, search_power=0.5, span_power=0.5, topk=2,
                            backward_factor=2.0, forward_factor=0.0, sw_index=0) -> dict:
    """Cache rows one decode step reads per query head, for the query at i = length - 1:
    ``search`` candidate anchor keys (~i^p), at most ``spans`` = min(k, #candidates) spans of
    ceil(b*l) + ceil(f*l) + 1 keys and values (l = ceil(i^p_sp); an upper bound: span keys inside
    the window are not read twice), ``window`` = min(w, i + 1) keys and values. At p = p_sp = 1/2
    the total is ~(1 + k(b + f)) sqrt(i) + w: O(sqrt(L)) with the window as a constant."""
    check_int("superlinear_decode_cost", "length", length, 1, 1 << 62)
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
    B, _, H, H_kv, D, L = check_cache(op, q[:, None], q_s[:, None], k_cache, v_cache,
                                      "[B, H, D]")
    length = L if length is None else length
    check_int(op, "length", length, 1, L)
    knobs = check_knobs(op, search_power, span_power, topk, backward_factor, forward_factor,
                        sw_index)
    kernel = _decode_kernel()
    if choose_impl(op, impl, (q, q_s, k_cache, v_cache), kernel) == "kernel":
        return kernel(q, q_s, k_cache, v_cache, length, **knobs)
    return reference_rows(q[:, None], q_s[:, None], k_cache, v_cache, length - 1, knobs, 1)[:, 0]
