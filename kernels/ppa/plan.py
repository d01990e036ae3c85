"""PPA's offset geometry, shared by the op (``megatron_subq.ops.ppa``) and the kernel
(``function.offset_plan``): the exact rational a power stands for, and the sorted power offsets
``S_p = {j >= 1 : floor(j^p) - floor((j-1)^p) = 1}``. No triton here: the op imports this module
without loading the kernels.
"""

from __future__ import annotations

import numbers
from fractions import Fraction
from functools import lru_cache

import numpy as np

from ..powers import MAX_DENOMINATOR, as_fraction


def ppa_power_fraction(power, what: str = "power") -> Fraction:
    """The exact rational a/b that ``power`` stands for; ValueError naming ``what`` otherwise.

    A ``Fraction`` in [0, 1] is taken as is. A float must be in [0, 1] and equal to the float of
    its nearest fraction with denominator <= 1000 (``powers.as_fraction``): 1/3 -> 1/3,
    0.333 -> 333/1000, 0.875 -> 7/8; 0.1234 is refused rather than silently rounded.
    """
    if isinstance(power, bool) or not isinstance(power, (numbers.Real, Fraction)):
        raise ValueError(f"{what}={power!r} is invalid: allowed a number in [0, 1]")
    if not 0 <= power <= 1:
        raise ValueError(f"{what}={power!r} is invalid: allowed a number in [0, 1]")
    if isinstance(power, (Fraction, numbers.Integral)):
        return Fraction(power)
    frac = as_fraction(float(power))
    if float(frac) != float(power):
        raise ValueError(
            f"{what}={power!r} is invalid: allowed a rational a/b with b <= {MAX_DENOMINATOR} "
            f"(as a float, e.g. 0.5, 1/3, 0.875, or a fractions.Fraction); the nearest is "
            f"{frac} = {float(frac)!r}")
    return frac


@lru_cache(maxsize=64)
def offsets_array(p: Fraction, max_offset: int) -> np.ndarray:
    """Sorted ``S_p ∩ [1, max_offset]`` as int64 (``ops.ppa_offsets`` lists it). ``p``: a
    ``Fraction`` from ``ppa_power_fraction`` (cached per (p, max_offset): do not modify)."""
    if p == 0 or max_offset < 1:
        return np.zeros(0, dtype=np.int64)  # floor(j^0) = 1 for every j >= 0: nothing increments
    # For 0 < p <= 1 the floor grows by at most 1 per step, so S_p holds exactly one offset per
    # value r = 1, 2, ..., R = floor(max_offset^p): the first j with floor(j^p) >= r. With p = a/b,
    # floor(j^p) >= r  <=>  j^a >= r^b  (floor_power's definition), so that j is ceil(r^(b/a)).
    a, b = p.numerator, p.denominator
    R = _largest_r(max_offset, a, b)
    r = np.arange(1, R + 1, dtype=np.int64)
    if a == 1:  # p = 1/n: the offsets are the n-th powers, in exact int64 arithmetic
        return r**b
    # Otherwise ceil(r^(b/a)) from float64, which is exact wherever r^(b/a) is farther from an
    # integer than float error (~1e-15 relative; we allow 1e-12); the few values that are not get
    # settled in integer arithmetic.
    x = r.astype(np.float64) ** (b / a)
    out = np.ceil(x).astype(np.int64)
    near_integer = np.abs(x - np.rint(x)) <= 1e-12 * np.maximum(x, 1.0)
    for idx in np.flatnonzero(near_integer):
        out[idx] = _first_offset_reaching(int(r[idx]), a, b, int(np.rint(x[idx])))
    return out


def _largest_r(m: int, a: int, b: int) -> int:
    """floor(m^(a/b)) exactly: the largest r with r^b <= m^a (as ``powers.floor_power``, but
    starting from a float guess, which keeps large denominators such as 999/1000 fast)."""
    target = m**a
    r = int(m ** (a / b))
    while r > 0 and r**b > target:
        r -= 1
    while (r + 1) ** b <= target:
        r += 1
    return r


def _first_offset_reaching(r: int, a: int, b: int, guess: int) -> int:
    """The smallest j >= 1 with j^a >= r^b (i.e. floor(j^(a/b)) >= r), by exact integer steps."""
    target = r**b
    j = max(1, guess)
    while j > 1 and (j - 1) ** a >= target:
        j -= 1
    while j**a < target:
        j += 1
    return j
