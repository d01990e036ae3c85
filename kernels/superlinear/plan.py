"""Superlinear attention's position geometry, shared by the op (``megatron_subq.ops.superlinear``)
and the kernels (``function.py``, ``decode.py``): the window length, the candidate anchors' stride
pattern, the span extents, as exact integer arithmetic (``..powers``), and the kernels' cached
device copies (``device_plan``). It depends on positions and knobs only, never on content; no
triton here, so the op imports it without the kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Tuple

import torch

from ..powers import as_fraction, floor_power


# ---------------------------------------------------------------------------------------------
# exact integer geometry: window, anchors, span extents
# ---------------------------------------------------------------------------------------------
def _inverse_power(search_power) -> Fraction:
    return 1 / as_fraction(search_power)


@lru_cache(maxsize=64)
def superlinear_window(search_power: float, sw_index: int) -> int:
    """w = floor((sw_index+1)^(1/p)) - 1 (0 for sw_index = 0: no window)."""
    return floor_power(sw_index + 1, _inverse_power(search_power)) - 1


def ceil_power(x: int, power) -> int:
    """ceil(x ** power) exactly, for an integer x >= 0 and a rational power >= 0 (0**0 = 1)."""
    f = as_fraction(power)
    r = floor_power(x, f)
    if f == 0 or r ** f.denominator == x ** f.numerator:
        return r
    return r + 1


def ceil_times(factor, n: int) -> int:
    """ceil(factor * n) exactly, with ``factor`` taken as the rational it stands for."""
    return math.ceil(as_fraction(factor) * n)


@lru_cache(maxsize=64)
def anchor_offsets(T: int, search_power: float, sw_index: int) -> Tuple[int, ...]:
    """The fixed stride pattern: candidate anchors of query i are i - d for d in the result.

    d_s = floor((s+1)^(1/p)) - 1 for s >= sw_index (the anchors s < sw_index are exactly those
    inside the window, because w = d_{sw_index}), up to the largest d_s <= T - 1. Anchor i - d_s is
    a candidate of query i iff d_s <= i.
    """
    inv = _inverse_power(search_power)
    offsets, s = [], sw_index
    while (d := floor_power(s + 1, inv) - 1) <= T - 1:
        offsets.append(d)
        s += 1
    return tuple(offsets)


@lru_cache(maxsize=64)
def _span_scale_table(T: int, span_power: float) -> Tuple[int, ...]:
    """l(i) = ceil(i^p_sp) for i < T, without one big-integer power per position.

    ceil(i^q) = min{r : floor(r^(1/q)) >= i}, so l is a step function whose steps sit at
    c_r = floor(r^(1/q)), r = 0, 1, ...; only O(T^q) exact roots are needed.
    """
    q = as_fraction(span_power)
    if q == 0:
        return (1,) * T  # 0**0 = 1, as floor_power
    steps, r = [], 0
    while not steps or steps[-1] < T - 1:
        steps.append(min(floor_power(r, 1 / q), T))  # capped: only steps below T matter
        r += 1
    table = torch.searchsorted(torch.tensor(steps), torch.arange(T), side="left")
    return tuple(table.tolist())


def to_device(host: torch.Tensor, device) -> torch.Tensor:
    """A CPU tensor on ``device`` without a stream sync. torch's blocking copy of pageable memory
    to a GPU waits for the stream to drain, so a plan built mid-prefill (a new chunk's) stalled
    the host behind the layers already enqueued; a pinned copy, non-blocking, does not (torch's
    caching host allocator keeps the pinned buffer until the copy has run)."""
    if device is None:
        return host
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class SuperlinearPlan:
    """Everything about the sparsity pattern that depends on positions only (not on content)."""

    offsets: torch.Tensor  # [A] int64: candidate anchors of query i are i - offsets (where >= 0)
    back: torch.Tensor  # [T] int64: ceil(b * l(i))
    fwd: torch.Tensor  # [T] int64: ceil(f * l(i))
    window: int  # w
    first: int = 0  # back[j], fwd[j] belong to position first + j (chunked prefill, decode)


def superlinear_plan(T: int, search_power: float = 0.5, span_power: float = 0.5,
                     backward_factor: float = 2.0, forward_factor: float = 0.0, sw_index: int = 0,
                     device=None) -> SuperlinearPlan:
    """Offsets, span extents and window length for sequences of length ``T``."""
    scale = torch.tensor(_span_scale_table(T, span_power), dtype=torch.int64)

    def ceil_factor(factor):  # ceil(factor * l) in integer arithmetic
        f = as_fraction(factor)
        return (scale * f.numerator + f.denominator - 1) // f.denominator

    return SuperlinearPlan(
        offsets=to_device(torch.tensor(anchor_offsets(T, search_power, sw_index),
                                       dtype=torch.int64), device),
        back=to_device(ceil_factor(backward_factor), device),
        fwd=to_device(ceil_factor(forward_factor), device),
        window=superlinear_window(search_power, sw_index),
    )


def _span_scale_range(first: int, stop: int, span_power) -> torch.Tensor:
    """l(i) = ceil(i^p_sp) for first <= i < stop ([stop - first] int64), from the step thresholds
    c_r = floor(r^(1/q)) with l(first) <= r <= l(stop - 1) only: O(stop^q - first^q + 1) exact
    roots, so a decode step (one position) costs one or two roots, not O(stop)."""
    q = as_fraction(span_power)
    if q == 0:
        return torch.ones(stop - first, dtype=torch.int64)
    r0 = ceil_power(first, q)  # l(first)
    steps, r = [], r0
    while not steps or steps[-1] < stop - 1:
        steps.append(min(floor_power(r, 1 / q), stop))  # l(i) = min{r : c_r >= i}
        r += 1
    return r0 + torch.searchsorted(torch.tensor(steps), torch.arange(first, stop), side="left")


def capacity_bucket(length: int) -> int:
    """The next power of two >= length: decode steps share one (cached) offset table per bucket;
    offsets beyond a query's position are masked like any missing candidate."""
    return 1 << max(0, length - 1).bit_length()


def superlinear_plan_range(first: int, stop: int, search_power: float = 0.5,
                           span_power: float = 0.5, backward_factor: float = 2.0,
                           forward_factor: float = 0.0, sw_index: int = 0,
                           device=None) -> SuperlinearPlan:
    """The plan of query positions [first, stop) only (chunked prefill, decode): span extents for
    those positions (``plan.first = first``) and the offset table of the capacity bucket of
    ``stop`` keys (offsets d > i just give no candidate to query i)."""
    scale = _span_scale_range(first, stop, span_power)

    def ceil_factor(factor):
        f = as_fraction(factor)
        return (scale * f.numerator + f.denominator - 1) // f.denominator

    offsets = anchor_offsets(capacity_bucket(stop), search_power, sw_index)
    return SuperlinearPlan(
        offsets=to_device(torch.tensor(offsets, dtype=torch.int64), device),
        back=to_device(ceil_factor(backward_factor), device),
        fwd=to_device(ceil_factor(forward_factor), device),
        window=superlinear_window(search_power, sw_index),
        first=first,
    )


# ---------------------------------------------------------------------------------------------
# plans on the device, cached
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DevicePlan:
    """A plan with the search kernel's int32 offset table (never empty) on its device."""
    plan: SuperlinearPlan
    offsets_i32: torch.Tensor


def _with_offsets(plan: SuperlinearPlan, stop: int, device) -> DevicePlan:
    offsets = plan.offsets.to(torch.int32)
    if offsets.numel() == 0:  # no query has an anchor (the window covers every prefix)
        offsets = torch.full((1,), stop, dtype=torch.int32, device=device)
    return DevicePlan(plan, offsets)


# Plans depend on positions and knobs only, so they are built once per shape and kept on the
# device: building one costs host time that grows with T, and its host-to-device copies
# (pageable memory) can stall the host until the GPU has drained. Nothing writes to them.
@lru_cache(maxsize=16)
def device_plan(T, search_power, span_power, backward_factor, forward_factor, sw_index,
                device) -> DevicePlan:
    """``superlinear_plan`` of T positions on ``device``, cached (training)."""
    return _with_offsets(superlinear_plan(T, search_power, span_power, backward_factor,
                                          forward_factor, sw_index, device=device), T, device)


@lru_cache(maxsize=64)
def device_plan_range(start, stop, search_power, span_power, backward_factor, forward_factor,
                      sw_index, device) -> DevicePlan:
    """``superlinear_plan_range`` of positions [start, stop) on ``device``, cached (prefill)."""
    return _with_offsets(superlinear_plan_range(start, stop, search_power, span_power,
                                                backward_factor, forward_factor, sw_index,
                                                device=device), stop, device)
