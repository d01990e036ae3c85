"""Superlinear's argument checks, shared by the op, its inference entry points and the references:
each refuses bad input with a ValueError/TypeError naming the argument and what is allowed.
"""

from __future__ import annotations

from fractions import Fraction

import torch

from ..dispatch import check_qkv


def check_knobs(op, search_power, span_power, topk, backward_factor, forward_factor,
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


def check_inputs(op, q, q_s, k, v):
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


def check_cache(op, q, q_s, k_cache, v_cache, rows_name):
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


def check_int(op, name, value, lo, hi):
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ValueError(f"{op}: {name}={value!r} is invalid: allowed an integer in [{lo}, {hi}]")
