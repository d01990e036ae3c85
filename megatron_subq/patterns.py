"""Per-layer variant patterns: which layers of the stack use the chosen variant.

``layer_pattern`` is either an explicit list of variant names (one per layer, any variants mixed)
or a name from ``NAMED_PATTERNS``. A named pattern is a function ``num_layers -> set of 1-based
layer numbers that use the variant``; all other layers use ``standard``.

Named patterns (deconstructing-attention paper):

* ``uniform`` — every layer uses the variant.
* ``hybrid`` — odd layers (1, 3, 5, ...) use the variant, even layers stay standard (Sec. 4.2).
* Table 11's ablation patterns, which the paper lists by the layers that STAY standard (for 24
  layers). ``TABLE11_STANDARD_LAYERS`` holds them as ``num_layers -> standard set``, generalised
  to any ``n`` as below (reproducing Table 11 exactly at n = 24); the variant takes the rest:

  ========== ============================================ ====================== ==============
  name       standard layers for n layers                 n = 24 (Table 11)      variant share
  ========== ============================================ ====================== ==============
  even       even layers                                  {2, 4, ..., 24}        ceil(n/2)
  odd        odd layers                                   {1, 3, ..., 23}        floor(n/2)
  top        the lower floor(n/2): 1..floor(n/2)          {1..12}                ceil(n/2)
  bottom     the upper floor(n/2): ceil(n/2)+1..n         {13..24}               ceil(n/2)
  middle     floor(n/4) at each end                       {1..6} u {19..24}      n - 2 floor(n/4)
  25%        every fourth layer: 4, 8, ...                {4, 8, ..., 24}        n - floor(n/4)
  first      {1}                                          {1}                    n - 1
  last       {n}                                          {24}                   n - 1
  bilateral  {1, n}                                       {1, 24}                n - 2 (n >= 2)
  ========== ============================================ ====================== ==============

  ``even`` is the same placement as ``hybrid``. The names say where the *variant* goes (``top``:
  the variant in the upper half). For odd n the variant gets the larger half in ``top`` and
  ``bottom`` alike (as in ``even``/``hybrid``). For n < 4 ``25%`` has no standard layer.
  The paper's prose (Sec. 6) says ``bottom`` replaces layers 1-6; its Table 11 keeps 13-24
  standard (variant on 1-12). We follow the table.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Set, Union


def _uniform(n: int) -> Set[int]:
    return set(range(1, n + 1))


def _hybrid(n: int) -> Set[int]:
    # deconstructing-attention paper: odd (1-based) layers take the variant, even stay standard.
    return set(range(1, n + 1, 2))


TABLE11_STANDARD_LAYERS: Dict[str, Callable[[int], Set[int]]] = {
    "even": lambda n: set(range(2, n + 1, 2)),
    "odd": lambda n: set(range(1, n + 1, 2)),
    "top": lambda n: set(range(1, n // 2 + 1)),
    "bottom": lambda n: set(range(n - n // 2 + 1, n + 1)),
    "middle": lambda n: set(range(1, n // 4 + 1)) | set(range(n - n // 4 + 1, n + 1)),
    "25%": lambda n: set(range(4, n + 1, 4)),
    "first": lambda n: {1},
    "last": lambda n: {n},
    "bilateral": lambda n: {1, n},
}
"""Table 11: name -> (num_layers -> the 1-based layers that stay standard)."""


def _complement_of(standard_layers: Callable[[int], Set[int]]) -> Callable[[int], Set[int]]:
    return lambda n: _uniform(n) - standard_layers(n)


NAMED_PATTERNS: Dict[str, Callable[[int], Set[int]]] = {
    "uniform": _uniform,
    "hybrid": _hybrid,
    **{name: _complement_of(std) for name, std in TABLE11_STANDARD_LAYERS.items()},
}
"""name -> (num_layers -> the 1-based layers that use the variant)."""


def variant_layers(pattern: str, num_layers: int) -> Set[int]:
    """The 1-based layers that use the variant under the named ``pattern``."""
    if pattern not in NAMED_PATTERNS:
        raise ValueError(f"layer_pattern={pattern!r} is invalid: allowed one of "
                         f"{sorted(NAMED_PATTERNS)}")
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers={num_layers!r} is invalid: allowed a positive integer")
    return NAMED_PATTERNS[pattern](num_layers)


def resolve_layer_pattern(pattern: Optional[Union[str, Sequence[str]]], variant: str,
                          num_layers: int, slots: str = "num_layers") -> List[str]:
    """The variant name of every layer (a list of length ``num_layers``). ``slots`` names what
    is counted in errors (a hybrid resolves over its attention slots only)."""
    if pattern is None:
        pattern = "uniform"
    if isinstance(pattern, str):
        if pattern not in NAMED_PATTERNS:
            raise ValueError(f"layer_pattern={pattern!r} is invalid: allowed a list of "
                             f"{num_layers} variant names ({slots}) or one of "
                             f"{sorted(NAMED_PATTERNS)}")
        chosen = variant_layers(pattern, num_layers)
        return [variant if i in chosen else "standard" for i in range(1, num_layers + 1)]
    pattern = list(pattern)
    if len(pattern) != num_layers:
        raise ValueError(f"layer_pattern has {len(pattern)} entries; allowed: exactly "
                         f"{slots}={num_layers} variant names")
    for i, name in enumerate(pattern):
        if not isinstance(name, str):
            raise ValueError(f"layer_pattern[{i}]={name!r} is invalid: allowed variant names")
    return pattern


def resolve_layer_variants(pattern: Optional[Union[str, Sequence[str]]], variant: str,
                           num_layers: int, hybrid_pattern: Optional[str] = None
                           ) -> List[Optional[str]]:
    """Every layer's variant: over all ``num_layers`` for a GPT; for a hybrid (its
    ``hybrid_override_pattern`` given) over the ``*`` slots only, None at the other layers."""
    if hybrid_pattern is None:
        return resolve_layer_pattern(pattern, variant, num_layers)
    slots = [i for i, symbol in enumerate(hybrid_pattern) if symbol == "*"]
    names = resolve_layer_pattern(pattern, variant, len(slots),
                                  slots="the '*' slots of hybrid_override_pattern") if slots else []
    out: List[Optional[str]] = [None] * num_layers
    for i, name in zip(slots, names):
        out[i] = name
    return out
