"""Megatron's dataset-blend syntax of ``--data-path`` and its per-split siblings.

Shared by ``arguments`` (start-up checks) and ``data`` (the dataset builder): below both.
"""

from __future__ import annotations

from typing import Sequence


def parse_blend(parser, tokens: Sequence[str], flag: str):
    """Megatron's blend syntax: 'A B' (weights from sizes) or '0.3 A 0.7 B' -> (paths, weights)."""
    tokens = list(tokens)

    def is_number(text):
        try:
            float(text)
            return True
        except ValueError:
            return False

    if len(tokens) > 1 and is_number(tokens[0]):
        if len(tokens) % 2 or not all(is_number(t) for t in tokens[::2]):
            parser.error(f"{flag}: weighted blends alternate weight and path: '0.3 A 0.7 B'")
        weights = [float(t) for t in tokens[::2]]
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            parser.error(f"{flag}: blend weights must be >= 0 and not all 0")
        return tokens[1::2], weights
    if any(is_number(t) for t in tokens):
        parser.error(f"{flag}: give a weight before every path, or none")
    return tokens, None
