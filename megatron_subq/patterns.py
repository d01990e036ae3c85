"""Per-layer variant patterns: which layers of the stack use the chosen variant.

``layer_pattern`` is either an explicit list of variant names (one per layer) or a name from
``NAMED_PATTERNS``. A named pattern is a function ``num_layers -> set of 1-based layer numbers
that use the variant``; all other layers use ``standard``.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Set, Union


def _uniform(n: int) -> Set[int]:
    return set(range(1, n + 1))


def _hybrid(n: int) -> Set[int]:
    # deconstructing-attention paper: odd (1-based) layers take the variant, even stay standard.
    return set(range(1, n + 1, 2))


NAMED_PATTERNS: Dict[str, Callable[[int], Set[int]]] = {
    "uniform": _uniform,
    "hybrid": _hybrid,
}


def resolve_layer_pattern(pattern: Optional[Union[str, Sequence[str]]], variant: str,
                          num_layers: int) -> List[str]:
    """The variant name of every layer (a list of length ``num_layers``)."""
    if pattern is None:
        pattern = "uniform"
    if isinstance(pattern, str):
        if pattern not in NAMED_PATTERNS:
            raise ValueError(f"layer_pattern={pattern!r} is invalid: allowed a list of "
                             f"{num_layers} variant names or one of {sorted(NAMED_PATTERNS)}")
        chosen = NAMED_PATTERNS[pattern](num_layers)
        return [variant if i in chosen else "standard" for i in range(1, num_layers + 1)]
    pattern = list(pattern)
    if len(pattern) != num_layers:
        raise ValueError(f"layer_pattern has {len(pattern)} entries; allowed: exactly "
                         f"num_layers={num_layers} variant names")
    for i, name in enumerate(pattern):
        if not isinstance(name, str):
            raise ValueError(f"layer_pattern[{i}]={name!r} is invalid: allowed variant names")
    return pattern
