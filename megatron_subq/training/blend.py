"""Megatron's dataset-blend syntax of ``--data-path`` and its per-split siblings, and the blend
files of ``--data-args-path`` / ``--per-split-data-args-path``.

Shared by ``arguments`` (start-up checks) and ``data`` (the dataset builder): below both.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Sequence


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


_SPLIT_KEYS = ("train", "valid", "test")


def _resolve(parser, tokens: Sequence[str], folder: str, where: str) -> List[str]:
    """The blend ``tokens`` with every relative prefix joined to ``folder``; a prefix without
    its ``.bin``/``.idx`` is an error naming ``where``, the listed and the resolved prefix."""
    tokens = list(tokens)
    _, weights = parse_blend(parser, tokens, where)
    out = list(tokens)
    for i in range(1 if weights is not None else 0, len(tokens), 2 if weights is not None else 1):
        token = tokens[i]
        if "://" in token:  # object storage (s3://, msc://): megatron reads it as it is
            continue
        path = token if os.path.isabs(token) else os.path.normpath(os.path.join(folder, token))
        missing = [ext for ext in (".bin", ".idx") if not os.path.isfile(path + ext)]
        if missing:
            parser.error(f"{where}: the prefix {token!r} (relative prefixes are relative to the "
                         f"file's folder: {path}) has no {path}{'/'.join(missing)}; list the "
                         "prefixes of megatron indexed datasets (PREFIX.bin + PREFIX.idx)")
        out[i] = path
    return out


def read_data_args_file(parser, path: str, flag: str = "--data-args-path") -> List[str]:
    """The ``--data-path`` value held by the blend file ``path`` (Megatron-LM's
    ``--data-args-path``): whitespace-separated ``PREFIX ...`` or ``WEIGHT PREFIX ...``; ``#``
    starts a comment. Relative prefixes are resolved against the file's folder, so a blend file
    written beside its datasets works from any working directory. Errors name ``flag``."""
    where = f"{flag} {path}"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        parser.error(f"{where}: cannot read the blend file ({e.strerror or e})")
    tokens = [t for line in text.splitlines() for t in line.split("#", 1)[0].split()]
    if not tokens:
        parser.error(f"{where}: the blend file lists no dataset (expected 'PREFIX ...' or "
                     "'WEIGHT PREFIX ...', as --data-path)")
    return _resolve(parser, tokens, os.path.dirname(os.path.abspath(path)), where)


def read_per_split_file(parser, path: str, flag: str = "--per-split-data-args-path"
                        ) -> Dict[str, Optional[List[str]]]:
    """The per-split blends held by the JSON file ``path``: ``{"train": [...], "valid": [...],
    "test": [...]}``, each a list of ``--data-path`` tokens (or one whitespace-separated string);
    "train" is required, the others may be absent or null. Prefixes resolve as in
    ``read_data_args_file``."""
    where = f"{flag} {path}"
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        parser.error(f"{where}: cannot read the file ({e.strerror or e})")
    except ValueError as e:
        parser.error(f"{where}: not JSON ({e})")
    if not isinstance(data, dict) or set(data) - set(_SPLIT_KEYS) or not data.get("train"):
        parser.error(f"{where}: expected a JSON object with the keys train (required), valid, "
                     f"test, each a list of --data-path tokens; got "
                     f"{sorted(data) if isinstance(data, dict) else type(data).__name__}")
    folder = os.path.dirname(os.path.abspath(path))
    out: Dict[str, Optional[List[str]]] = {}
    for key in _SPLIT_KEYS:
        value = data.get(key)
        if value in (None, [], ""):
            out[key] = None
            continue
        if isinstance(value, str):
            value = value.split()
        if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) for v in value):
            parser.error(f"{where}: {key!r} must be a list of --data-path tokens "
                         "(['PREFIX', ...] or ['WEIGHT', 'PREFIX', ...])")
        out[key] = _resolve(parser, [str(v) for v in value], folder, f"{where} ({key})")
    return out
