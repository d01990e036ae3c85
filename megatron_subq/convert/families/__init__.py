"""The families the converter knows: HF architecture name -> ``Family`` (see ``base.py``).

A new family (e.g. the hybrid host's ``nemotron_h``) is one module defining ``FAMILY`` and one
entry in ``FAMILIES`` below.
"""

from __future__ import annotations

from typing import Dict, Optional

from . import llama, mistral, nemotron_h, qwen2, qwen3
from .base import Family, TensorMap

FAMILIES: Dict[str, Family] = {f.name: f for f in (llama.FAMILY, mistral.FAMILY, qwen2.FAMILY,
                                                   qwen3.FAMILY, nemotron_h.FAMILY)}


def supported_architectures() -> list:
    return sorted(a for f in FAMILIES.values() for a in f.architectures)


def family_for_config(cfg: dict, where: str = "config.json") -> Family:
    """The family of an HF config.json (its ``architectures``); ValueError names the field."""
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or len(archs) != 1:
        raise ValueError(f"{where}: architectures={archs!r} is invalid: allowed exactly one of "
                         f"{', '.join(supported_architectures())}")
    for family in FAMILIES.values():
        if archs[0] in family.architectures:
            return family
    raise ValueError(f"{where}: architectures={archs!r} is not supported: allowed "
                     f"{', '.join(supported_architectures())}")


def family_for_args(args) -> Optional[Family]:
    """The family of a checkpoint's arguments when no config.json came with it: NemotronH for a
    hybrid, else the first GPT family whose switches (q/k/v biases, q/k norms) match; Mistral is
    never guessed (it exports as Llama)."""
    return next((f for f in FAMILIES.values() if f.name != "mistral" and f.matches_args(args)),
                None)


__all__ = ["FAMILIES", "Family", "TensorMap", "family_for_args", "family_for_config",
           "supported_architectures"]
