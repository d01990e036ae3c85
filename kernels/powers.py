"""Exact integer powers for the power-law variants (PPA offsets, Superlinear anchors and window).

Float ``pow`` is wrong at perfect powers (``1000 ** (1/3) == 9.999999999999998``), so every
``floor(x ** p)`` in this package goes through :func:`floor_power`, which treats ``p`` as the
rational ``a/b`` and returns the largest integer ``r`` with ``r**b <= x**a`` in integer arithmetic.
"""

from __future__ import annotations

from fractions import Fraction
from functools import lru_cache

MAX_DENOMINATOR = 1000


@lru_cache(maxsize=256)  # a handful of knob values, asked for on every decode step
def as_fraction(p: float | Fraction) -> Fraction:
    """The rational a/b a float power stands for (1/3 as a float becomes exactly 1/3)."""
    if isinstance(p, Fraction):
        return p
    return Fraction(p).limit_denominator(MAX_DENOMINATOR)


def integer_root(n: int, b: int) -> int:
    """The largest r >= 0 with r**b <= n (n >= 0, b >= 1)."""
    if n < 0 or b < 1:
        raise ValueError(f"integer_root needs n >= 0 and b >= 1, got n={n}, b={b}")
    if n < 2 or b == 1:
        return n
    if n < 2**52:  # a float guess is within one of the root here
        r = int(round(float(n) ** (1.0 / b)))
    else:  # integer Newton from above: the iterates fall monotonically to floor(n^(1/b))
        r = 1 << -(-n.bit_length() // b)
        while True:
            nxt = ((b - 1) * r + n // r ** (b - 1)) // b
            if nxt >= r:
                break
            r = nxt
    while r**b > n:
        r -= 1
    while (r + 1) ** b <= n:
        r += 1
    return r


@lru_cache(maxsize=1 << 16)
def floor_power(x: int, p: float | Fraction) -> int:
    """floor(x ** p) exactly, for an integer x >= 0 and a rational power p >= 0 (0**0 = 1)."""
    f = as_fraction(p)
    if f < 0:
        raise ValueError(f"floor_power needs p >= 0, got {p}")
    if x < 0:
        raise ValueError(f"floor_power needs x >= 0, got {x}")
    if f == 0:
        return 1
    return integer_root(x**f.numerator, f.denominator)
